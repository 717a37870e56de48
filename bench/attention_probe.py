"""The C attention (kernels/decode_ops.c attend_rows_bf16) of this tree against another commit's, in one run.

    .venv/bin/python bench/attention_probe.py --base HEAD~1 --threads 1 --out bench/results/attention_probe_native.json

Both sources are built for this machine (the base one under another name, so neither build
evicts the other from the kernel cache) and called with the same arguments, interleaved: t new
rows of SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head size 64) after `start`
cached positions, the cache one layer's [kv heads, capacity, hd] in bf16 (it stays in L2 between
calls: this is the kernel's compute, not the memory traffic of 30 layers' caches). Reported per
(start, t): the median microseconds of each, and base / this.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import native  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.layers import Rotary  # noqa: E402

SOURCE = Path(__file__).resolve().parent.parent / "whiflash_core" / "kernels" / "decode_ops.c"
NH, NKV, HD = 9, 3, 64


def build_base(ref: str, workdir: str):
    text = subprocess.run(["git", "show", f"{ref}:whiflash_core/kernels/decode_ops.c"], capture_output=True,
                          text=True, check=True, cwd=SOURCE.parent).stdout
    path = Path(workdir) / "decode_ops_base.c"
    path.write_text(text)
    return native.build(path)


def call(lib, qkv, cos, sin, k, v, start: int, out) -> None:
    status = lib.attend_rows_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  k.shape[1], start, qkv.shape[0], NH, NKV, HD, out.data_ptr())
    assert status == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="the commit whose decode_ops.c is compared")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--starts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rotary = Rotary.default(HD, 10000.0, 8192)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_base(args.base, tmp), "this": native.build(SOURCE)}
        if None in libs.values():
            raise SystemExit("the C kernels cannot be built on this machine")
        for lib in libs.values():   # decode_ops._library's signature
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.attend_rows_bf16.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, p]
            lib.attend_rows_bf16.restype = ctypes.c_int
        results = []
        for start in args.starts:
            for t in args.rows:
                torch.manual_seed(start + t)
                cos, sin = rotary.tables(slice(start, start + t), torch.bfloat16)
                qkv = (torch.randn(t, (NH + 2 * NKV) * HD) * 2).bfloat16()
                k, v = torch.randn(NKV, start + t, HD).bfloat16(), torch.randn(NKV, start + t, HD).bfloat16()
                out = torch.empty(t, NH * HD, dtype=torch.bfloat16)
                times: dict[str, list[float]] = {name: [] for name in libs}
                for _ in range(args.reps):
                    for name, lib in libs.items():
                        t0 = time.perf_counter()
                        call(lib, qkv, cos, sin, k, v, start, out)
                        times[name].append(time.perf_counter() - t0)
                row = {"start": start, "rows": t,
                       **{f"{name}_us": round(1e6 * statistics.median(ts), 2) for name, ts in times.items()}}
                row["base_over_this"] = round(row["base_us"] / row["this_us"], 3)
                print(json.dumps(row), flush=True)
                results.append(row)
    report = {"command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]), "base": args.base,
              "git": git_info(), "machine": machine_info("bfloat16", args.threads), "shape": {"nh": NH, "nkv": NKV, "hd": HD},
              "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
