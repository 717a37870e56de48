#!/usr/bin/env bash
# The Q4_1 kernel alone, this tree against another kernel source, built for one class, in turns:
#   [COPIES=256] bench/q4_1_kernel_ab.sh OTHER_Q4_1_C [haswell|native] [ROUNDS]
# e.g. git show HEAD~1:whiflash_core/kernels/q4_1.c > /tmp/base_q4_1.c first. One thread, core 0;
# the embedded model's shapes N x K (gate/up halves, down). Prints each build's best per shape
# and rows, and whether the outputs' hashes agree (meaningful only where both builds take the
# same layout: the bench fills the packed bytes at random). COPIES > 1: weights from memory
# (q4_1_kernel_bench.c), as in a forward; default 1, from this core's L2.
set -euo pipefail
cd "$(dirname "$0")/.."
OTHER=$1; ARCH=${2:-haswell}; ROUNDS=${3:-4}; COPIES=${COPIES:-1}
OUT=$(mktemp -d)
cc -O3 -march="$ARCH" -fopenmp -I. bench/q4_1_kernel_bench.c -o "$OUT/this" -lm
cc -O3 -march="$ARCH" -fopenmp -DKERNEL="\"$(realpath "$OTHER")\"" bench/q4_1_kernel_bench.c -o "$OUT/other" -lm
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1); flags: $(grep -o -w -E 'avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "build: -march=$ARCH, OMP_NUM_THREADS=1, taskset -c 0, $ROUNDS rounds in turns, $COPIES copies of the weights"
for _ in $(seq "$ROUNDS"); do
  for b in other this; do
    for shape in "1536 576" "576 1536"; do
      OMP_NUM_THREADS=1 taskset -c 0 "$OUT/$b" $shape 50 "$COPIES" | sed "s/^/$b /"
    done
  done
done > "$OUT/runs.txt"
python3 - "$OUT/runs.txt" <<'PY'
import re, sys
best, hashes = {}, {}
for line in open(sys.argv[1]):
    b, shape, rows, us, h = re.match(r"(\S+) (N=\d+ K=\d+) rows=(\d+): ([\d.]+) us .* hash (\S+)", line).groups()
    key = (shape, int(rows))
    best[b, key] = min(best.get((b, key), 1e9), float(us))
    hashes.setdefault(key, set()).add(h)
for key in sorted({k for _, k in best}):
    o, t = best["other", key], best["this", key]
    print(f"{key[0]} rows={key[1]}: other {o:.1f} us, this {t:.1f} us ({o / t:.2f}x), "
          f"outputs {'identical' if len(hashes[key]) == 1 else 'DIFFER'}")
PY
rm -rf "$OUT"
