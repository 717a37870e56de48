"""`whiflash info`: this CPU, the target formats timed on it, and the choice `--weights auto` makes.

The first call times the candidates (a few seconds) and caches them; `--remeasure` times again.
"""
from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="show the CPU and the target formats measured on it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (part of the cache key)")
    p.add_argument("--remeasure", action="store_true", help="ignore the cached table")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    from .loading import model_location
    from .machine import light_formats, measure
    from .target import TargetConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    path, gguf = model_location(args.model)
    cfg = TargetConfig.from_hf(AutoConfig.from_pretrained(path, **({"gguf_file": gguf} if gguf else {})))
    result = measure(cfg, light_formats(gguf), use_cache=not args.remeasure, verbose=True)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    m = result["machine"]
    print(f"CPU: {m['cpu']} ({m['machine']}), ISA: {' '.join(m['isa']) or '-'}, torch kernels: {m['kernels']}"
          + (f" (forced: {m['forced']})" if m["forced"] else ""))
    print(f"threads: {m['threads']}, torch {m['torch']}; measured in {result['seconds']} s (cached)")
    rows = sorted({int(r) for t in result["table"].values() for r in t})
    print(f"{'format':<22}" + "".join(f"{f'T({r}) ms':>11}" for r in rows))
    for name, t in result["table"].items():  # head:... rows: the model without layers, with that LM head
        print(f"{name:<22}" + "".join(f"{1e3 * t[str(r)]:>11.1f}" if str(r) in t else f"{'-':>11}" for r in rows))
    f = result["formats"]
    prefill = ("the same weights" if f["prefill_from_rows"] >= 10**9
               else f"{f['prefill_dtype']} dense from {f['prefill_from_rows']} rows")
    head = f", LM head {f['head']}" if f["weights"] != "dense" else ""
    print(f"choice (--weights auto): decode/verify {f['dtype']} activations with {f['weights']} weights{head}; "
          f"prefill {prefill}")
    if f["weights"] == "q4_1":
        from . import tiles
        settings, timings = tiles.choose(cfg, use_cache=not args.remeasure)
        if not timings:
            print("AMX tiles: not on this machine (or WHIFLASH_TILES=0)")
        else:
            linear = " ".join(f"{r}:{'/'.join(f'{t:.3f}' for t in p)}" for r, p in timings["linear_gate_up_ms"].items())
            print(f"AMX tiles: Q4_1 matmuls with integer tiles from {settings.linear_from_rows or 'no'} rows, with bf16 "
                  f"tiles from {settings.bf16_from_rows or 'no'} rows (gate_up ms plain/integer/bf16 by rows: "
                  f"{linear}); attention {'on' if settings.attention else 'off'} "
                  f"(ms plain/tiles: {'/'.join(f'{t:.3f}' for t in timings['attention_ms']) or '-'})")
    return 0
