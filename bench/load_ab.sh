#!/bin/bash
# The agent load test (bench/load.py, 1 then 8 streams) against servers of two versions of this
# repository, interleaved on one machine in one sitting: REF (a git revision, checked out in a
# temporary worktree) and the working tree, the latter also with the settings of EXTRA_ARM (default
# WHIFLASH_TILES=0: the AMX tiles off, whiflash_core/tiles.py; empty: no third arm). Servers of one
# machine drift by 10-20 % over an hour (other tenants), so only figures of one sitting are compared.
#
#   bench/load_ab.sh OUT.json REF [ROUNDS] [SECONDS]
#   EXTRA_ARM=WHIFLASH_STEP_THREADS=2 bench/load_ab.sh OUT.json HEAD 2 25   # a setting, same code
#   bench/load_ab.sh bench/results/load_ab_tiles_xeon.json fc0e04f 2 25
set -euo pipefail
OUT=$1; REF=$2; ROUNDS=${3:-2}; SECONDS_PER_RUN=${4:-25}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
WORK=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$WORK/ref" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git -C "$ROOT" worktree add --detach "$WORK/ref" "$REF" >/dev/null 2>&1
PORT=${PORT:-8051}
EXTRA_ARM=${EXTRA_ARM-WHIFLASH_TILES=0}
# shellcheck source=bench/server.sh
. "$ROOT/bench/server.sh"

one() {   # LABEL CODE_DIR [ENV=VALUE ...]
  local label=$1 dir=$2; shift 2
  start_server "$dir" "$WORK/$label.server.log" "$@"
  "$PY" "$ROOT/bench/load.py" --url "http://127.0.0.1:$PORT" --streams 1 8 --seconds "$SECONDS_PER_RUN" \
     --turns 6 --max-tokens 32 --out "$WORK/$label.json" > "$WORK/$label.log" 2>&1
  stop_server
}

for round in $(seq "$ROUNDS"); do
  one "ref_$round" "$WORK/ref"
  one "new_$round" "$ROOT"
  # shellcheck disable=SC2086   # EXTRA_ARM is a list of VAR=VALUE words
  if [ -n "$EXTRA_ARM" ]; then one "new_extra_$round" "$ROOT" $EXTRA_ARM; fi
done

"$PY" - "$OUT" "$REF" "$WORK" "$*" "$EXTRA_ARM" <<'EOF'
import json, os, statistics, sys
out, ref, work, args, extra = sys.argv[1:6]
runs = {}
for name in sorted(os.listdir(work)):
    if name.endswith(".json"):
        runs[name[:-5]] = json.load(open(os.path.join(work, name)))
keys = ("requests", "total_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "server_cpu_cores", "server_cpu_ms_per_token",
        "client_cpu_cores", "errors")
table = {label: [{k: r.get(k) for k in ("streams",) + keys} for r in d["runs"]] for label, d in runs.items()}
summary = {}
for kind in ("ref", "new", "new_extra"):
    mine = [v for k, v in table.items() if k.rsplit("_", 1)[0] == kind]
    if not mine:   # no extra arm
        continue
    for i, streams in enumerate((1, 8)):
        summary[f"{kind}_{streams}_streams_tokens_per_s_mean"] = round(statistics.mean(r[i]["total_tokens_per_s"] for r in mine), 1)
        summary[f"{kind}_{streams}_streams_requests_mean"] = round(statistics.mean(r[i]["requests"] for r in mine), 1)
        summary[f"{kind}_{streams}_streams_ttft_p50_ms_mean"] = round(1e3 * statistics.mean(r[i]["ttft_p50_s"] for r in mine), 1)
first = next(iter(runs.values()))
json.dump({"command": "bench/load_ab.sh " + args, "ref": ref, "extra_arm": extra, "git": first["git"], "machine": first["machine"],
           "summary": summary, "runs": table}, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
