#!/bin/bash
# The agent-serving measurements (bench/results/{agent_replay,specbench_cost,load_*}_avx2.json):
# run from a quiet machine; each step writes its results file.
set -x
cd "$(dirname "$0")/.."
date
.venv/bin/python bench/agent_replay.py --out bench/results/agent_replay_avx2.json --threads 2 > /tmp/agent_serving_replay.log 2>&1
date
.venv/bin/whiflash bench --workload ../shared/data/bench/spec_bench.jsonl --limit 1 --max-tokens 128 --threads 2 --weights auto --methods none,eagle3,dflash,ngram,whiflash --out bench/results/specbench_cost_avx2.json --markdown bench/results/specbench_cost_avx2.md > /tmp/agent_serving_sb.log 2>&1
date
serve() {  # serve() PORT ARGS...: start and wait for /health
  port=$1; shift
  .venv/bin/whiflash serve --port $port --threads 2 "$@" > /tmp/agent_serving_serve_$port.log 2>&1 &
  echo $! > /tmp/agent_serving_serve_$port.pid
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && return 0; sleep 1; done
  return 1
}
serve 8011
.venv/bin/python bench/load.py --url http://127.0.0.1:8011 --streams 1 8 --seconds 60 --turns 6 --max-tokens 32 --out bench/results/load_shared_avx2.json > /tmp/agent_serving_load1.log 2>&1
.venv/bin/python bench/load.py --url http://127.0.0.1:8011 --streams 64 --seconds 120 --turns 6 --max-tokens 8 --out bench/results/load_64_avx2.json > /tmp/agent_serving_load64.log 2>&1
kill $(cat /tmp/agent_serving_serve_8011.pid); sleep 3
serve 8012 --no-shared-forwards
.venv/bin/python bench/load.py --url http://127.0.0.1:8012 --streams 1 8 --seconds 60 --turns 6 --max-tokens 32 --out bench/results/load_unshared_avx2.json > /tmp/agent_serving_load2.log 2>&1
kill $(cat /tmp/agent_serving_serve_8012.pid)
date
