#!/bin/bash
# The agent-serving measurements (issue 16) for one CPU class:
#
#   bench/agent_serving.sh native     # bench/results/{agent_replay,load_*}_native.json
#   bench/agent_serving.sh avx2       # the AVX2 kernels forced (or an AVX2-only CPU: its own kernels)
#
# Run from a quiet machine; each step writes its results file. Spec-Bench and the agentic workload
# for the same class come from bench/cpu_classes.sh.
set -x
cd "$(dirname "$0")/.."
class=${1:?usage: bench/agent_serving.sh native|avx2}
case "$class" in
  native) ;;
  avx2) export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ;;
  *) echo "unknown class $class" >&2; exit 2 ;;
esac
out=bench/results
date
.venv/bin/python bench/agent_replay.py --out $out/agent_replay_$class.json --threads 2 > /tmp/agent_serving_replay.log 2>&1
date
serve() {  # serve() PORT ARGS...: start and wait for /health
  port=$1; shift
  .venv/bin/whiflash serve --port $port --threads 2 "$@" > /tmp/agent_serving_serve_$port.log 2>&1 &
  echo $! > /tmp/agent_serving_serve_$port.pid
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && return 0; sleep 1; done
  return 1
}
serve 8011
.venv/bin/python bench/load.py --url http://127.0.0.1:8011 --streams 1 8 --seconds 60 --turns 6 --max-tokens 32 --out $out/load_shared_$class.json > /tmp/agent_serving_load1.log 2>&1
.venv/bin/python bench/load.py --url http://127.0.0.1:8011 --streams 64 --seconds 120 --turns 6 --max-tokens 8 --out $out/load_64_$class.json > /tmp/agent_serving_load64.log 2>&1
kill $(cat /tmp/agent_serving_serve_8011.pid); sleep 3
serve 8012 --no-shared-forwards
.venv/bin/python bench/load.py --url http://127.0.0.1:8012 --streams 1 8 --seconds 60 --turns 6 --max-tokens 32 --out $out/load_unshared_$class.json > /tmp/agent_serving_load2.log 2>&1
kill $(cat /tmp/agent_serving_serve_8012.pid)
date
