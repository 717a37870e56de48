#!/usr/bin/env bash
# The start-up heap frozen out of the cyclic GC or not (app.memory.freeze_startup_heap), A B A B:
# a fresh `whiflash serve` per arm, 8 streaming agent conversations for 40 s (bench/load.py), the
# server's GC pauses over that time (bench/gc_freeze_serve.py). Prints one line per arm and its GC.
#   bench/gc_freeze_ab.sh [PORT]
set -uo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8032}; OUT=$(mktemp -d)
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1); flags: $(grep -o -w -E 'avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for arm in off on off on; do
  .venv/bin/python bench/gc_freeze_serve.py $arm --port "$PORT" --threads 2 > "$OUT/server.log" 2>&1 &
  SP=$!
  for _ in $(seq 90); do curl -s "localhost:$PORT/health" > /dev/null && break; sleep 2; done
  kill -USR1 $SP
  .venv/bin/python bench/load.py --url "http://127.0.0.1:$PORT" --streams 8 --seconds 40 --turns 6 --max-tokens 32 \
      --out "$OUT/load.json" > /dev/null 2>&1
  python3 -c "import json; d = json.load(open('$OUT/load.json'))['runs'][0]; print('$arm', {k: d[k] for k in ('requests', 'errors', 'ttft_p50_s', 'ttft_p95_s', 'total_tokens_per_s', 'server_cpu_ms_per_token')})"
  kill -USR2 $SP; sleep 1; grep "GC\[" "$OUT/server.log" | tail -1
  kill $SP; wait $SP 2> /dev/null
done
rm -rf "$OUT"
