#!/usr/bin/env bash
# DFlash alone at each block (`--block-size`: the first slots of the trained block) against plain decode:
# Spec-Bench 3 prompts a category, 128 tokens, one thread, the default format (--weights auto:
# `whiflash bench` alone runs dense), each block in its own run with its own plain baseline.
#   bench/dflash_block_sweep.sh [DRAFTERS_DIR] [TAG] [CPU]
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTERS=${1:-models/smollm2-135m-instruct}
TAG=${2:-shipped}
CPU=${3:-0}
for B in 2 3 4 5 8; do
  taskset -c "$CPU" .venv/bin/whiflash bench --workload ../shared/data/bench/spec_bench.jsonl --limit 3 \
    --max-tokens 128 --threads 1 --weights auto --methods none,dflash --peers "" --block-size "$B" --drafters "$DRAFTERS" \
    --out "bench/results/dflash_block${B}_${TAG}.json"
done
