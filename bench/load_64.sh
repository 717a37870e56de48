#!/bin/bash
# The 64-stream memory check of issue 16, one server per configuration, in one sitting: start
# `whiflash serve` with the given arguments, warm it with 8 streams for 20 s (the prefix cache and
# kernel caches fill, so "before" is a working server's level, not a fresh one's), then 64 streaming
# agent conversations for 120 s (bench/load.py: errors, incomplete streams, 429s, RSS before / at the
# end / settled). Several LABEL=ARGS pairs run one after the other and land in one file.
#
#   bench/load_64.sh OUT.json LABEL='SERVER ARGS' [LABEL='SERVER ARGS' ...]
#   bench/load_64.sh bench/results/load_64_kernel_caches_xeon.json bounded='' default='--kernel-cache-entries 1024'
set -euo pipefail
OUT=$1; shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
PORT=${PORT:-8052}
# shellcheck source=bench/server.sh
. "$ROOT/bench/server.sh"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

for pair in "$@"; do
  label=${pair%%=*}; server_args=${pair#*=}
  # shellcheck disable=SC2086  # the server arguments are words
  start_server "$ROOT" "$WORK/$label.server.log" -- $server_args
  "$PY" "$ROOT/bench/load.py" --url "http://127.0.0.1:$PORT" --streams 8 --seconds 20 --turns 6 --max-tokens 8 \
     --out "$WORK/$label.warm.json" > /dev/null 2>&1
  "$PY" "$ROOT/bench/load.py" --url "http://127.0.0.1:$PORT" --streams 64 --seconds 120 --turns 6 --max-tokens 8 \
     --out "$WORK/$label.json" > "$WORK/$label.log" 2>&1
  stop_server
done

"$PY" - "$OUT" "$WORK" "$@" <<'PYEOF'
import json, os, sys
out, work, pairs = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {}
for name in sorted(os.listdir(work)):
    if name.endswith(".json") and not name.endswith(".warm.json"):
        runs[name[:-5]] = json.load(open(os.path.join(work, name)))
keys = ("requests", "ok", "rejected_429", "errors", "incomplete_streams", "ttft_p50_s", "total_tokens_per_s",
        "server_rss_before_mb", "server_rss_after_mb", "server_rss_settled_mb", "server_rss_growth",
        "server_rss_settled_growth", "prefix_cache_mb_after", "cache_hit_rate_usage")
table = {label: {k: d["runs"][0].get(k) for k in keys} for label, d in runs.items()}
first = next(iter(runs.values()))
command = " ".join(["bench/load_64.sh", out] + [f"'{p}'" for p in pairs])
json.dump({"command": command, "git": first["git"],
           "machine": first["machine"], "runs": table}, open(out, "w"), indent=1)
print(json.dumps(table, indent=1))
PYEOF
