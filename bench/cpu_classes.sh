#!/bin/bash
# Issue 20's measurements for one CPU class, against llama.cpp on the same GGUF, in one quiet run:
#
#   bench/cpu_classes.sh native                 # the CPU's own kernels (AVX-512 / AMX here)
#   LLAMA_CPP_AVX2=DIR bench/cpu_classes.sh avx2 # PyTorch, oneDNN and MKL held to AVX2, and a
#                                                # llama.cpp built without AVX-512 (see below)
#
# On an AVX-512 machine "avx2" approximates the AVX2 class (most laptops, AMD Zen 3): torch's
# ATen_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2, and a llama.cpp
# peer built with only AVX2 (its system_info is recorded in every results file):
#
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
#     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
#     .venv/bin/pip install --no-deps --target DIR llama-cpp-python==0.3.36
#
# The native peer: llama.cpp's GGML_NATIVE build turns on its AMX int8 backend, which crashed
# (SIGSEGV in the first decode) on our Sapphire Rapids VMs, so the native run takes an AVX-512
# build without AMX, in LLAMA_CPP_NATIVE=DIR (unset: the llama-cpp-python installed in .venv):
#
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
#     -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
#     -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
#     .venv/bin/pip install --no-deps --target DIR llama-cpp-python==0.3.36
#
# (llama-cpp-python's one pure-Python dependency, diskcache, must be in .venv: --no-deps skips it;
# `.venv/bin/pip install -e '.[bench]'` installs both into .venv itself.)
#
# Each step writes bench/results/<step>_<class>.json. Run on a quiet machine (no training, no
# tests): contention on 2 cores slows OpenMP work many times over, llama.cpp's spinning threads most.
set -euo pipefail
cd "$(dirname "$0")/.."
class=${1:?usage: bench/cpu_classes.sh native|avx2}
threads=${THREADS:-2}
case "$class" in
  native) env=(${LLAMA_CPP_NATIVE:+PYTHONPATH="$LLAMA_CPP_NATIVE"}) ;;
  avx2)
    : "${LLAMA_CPP_AVX2:?set LLAMA_CPP_AVX2 to a llama-cpp-python built without AVX-512 (see the header)}"
    env=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH="$LLAMA_CPP_AVX2") ;;
  *) echo "unknown class $class" >&2; exit 2 ;;
esac
run() { echo "+ $*" >&2; env "${env[@]}" "$@"; }
out=bench/results
lscpu | sed -n 's/^Model name: *//p;s/^Flags: *//p' > "$out/lscpu_${class}.txt"
export WHIFLASH_CACHE_DIR=${WHIFLASH_CACHE_DIR:-$(mktemp -d)}  # time the formats afresh, for this class
date
run .venv/bin/whiflash info --threads "$threads" --remeasure --json > "$out/machine_table_${class}.json"
run .venv/bin/whiflash info --threads "$threads"
date
run .venv/bin/python bench/prefill_probe.py --threads "$threads" --configs int4,auto --out "$out/prefill_probe_${class}.json"
date
methods=none,eagle3,dflash,ngram,whiflash
run .venv/bin/whiflash bench --workload ../shared/data/bench/spec_bench.jsonl --limit 1 --max-tokens 128 \
  --threads "$threads" --weights auto --methods "$methods" --peers llama_cpp \
  --out "$out/specbench_${class}.json" --markdown "$out/specbench_${class}.md"
date
run .venv/bin/whiflash bench --workload ../shared/data/bench/spec_bench.jsonl --limit 1 --max-tokens 128 \
  --threads "$threads" --weights auto --methods whiflash --alpha-sweep 0,0.25,0.5,0.75,1 \
  --out "$out/alpha_sweep_spec_${class}.json"
date
run .venv/bin/whiflash bench --workload bench/workload_agentic.jsonl --max-tokens 128 \
  --threads "$threads" --weights auto --methods "$methods" --peers llama_cpp \
  --out "$out/agentic_${class}.json" --markdown "$out/agentic_${class}.md"
date
