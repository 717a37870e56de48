"""Verify cost curve and plain-decode speed per weight format, next to transformers, in one run.

    .venv/bin/python bench/verify_curve.py --out bench/results/verify_curve.json [--threads N]

T(k): one target forward over k new tokens on a 300-token KV cache (median of repeats, logits
for all k rows), for float32, bfloat16 and int4 (the GGUF's Q4_1 blocks, bf16 activations).
Plain decode: the engine's `none` method, 128 new tokens, against `transformers` `generate` in
the same dtype. Everything is measured in this one process, interleaved, so ratios hold even on a
noisy shared machine; absolute times drift between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir  # noqa: E402
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.quant import quantize_target_int4  # noqa: E402
from whiflash_core.target import from_hf, load_hf_model  # noqa: E402

KS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
PROMPT = [{"role": "user", "content": "Explain how a hash table works, with an example in Python."}]


def verify_times(model, repeats: int, ctx: int = 300) -> dict[int, float]:
    cache = model.new_cache(ctx + 64)
    g = torch.Generator().manual_seed(0)
    model(torch.randint(0, 49152, (ctx,), generator=g), cache)
    out = {}
    for k in KS:
        ts = []
        for _ in range(repeats + 1):
            tokens = torch.randint(0, 49152, (k,), generator=g)
            t0 = time.perf_counter()
            model(tokens, cache)
            ts.append(time.perf_counter() - t0)
            cache.rollback(ctx)
        out[k] = statistics.median(ts[1:]) * 1000
    return out


def plain_decode_tps(model, tok, n: int = 128) -> float:
    engine = Engine(model, tok, {})
    ids = encode_chat(tok, PROMPT)
    gen = engine.generate(GenerationRequest(ids, n, stop_token_ids=[], speculation=SpeculationConfig(method="none")))
    t = gen.timing()
    return (len(gen.output) - 1) / (t["total_s"] - t["prefill"])


def hf_generate_tps(hf, tok, n: int = 128) -> float:
    ids = torch.tensor([encode_chat(tok, PROMPT)])
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
        total = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1] - 1) / (total - prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/verify_curve.json")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf32, tok = load_hf_model(None)
    hf16 = load_hf_model(None)[0].to(torch.bfloat16)
    models = {"float32": from_hf(hf32, torch.float32), "bfloat16": from_hf(hf32, torch.bfloat16)}
    models["int4"] = from_hf(hf32, torch.bfloat16)
    quantize_target_int4(models["int4"], os.path.join(embedded_model_dir(), EMBEDDED_GGUF))

    curves = {name: verify_times(m, args.repeats) for name, m in models.items()}
    decode = {name: plain_decode_tps(m, tok) for name, m in models.items()}
    decode["hf_generate_float32"] = hf_generate_tps(hf32, tok)
    decode["hf_generate_bfloat16"] = hf_generate_tps(hf16, tok)

    print(f"{'k':>4} " + " ".join(f"{n + ' ms':>14} {'ratio':>6}" for n in curves))
    for k in KS:
        print(f"{k:>4} " + " ".join(f"{c[k]:>14.2f} {c[k] / c[1]:>6.2f}" for c in curves.values()))
    print("plain decode tokens/s:", {k: round(v, 1) for k, v in decode.items()})
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info("float32/bfloat16/int4", torch.get_num_threads()),
        "git_commit": (git_info()["commit"] or "")[:7],
        "context_tokens": 300,
        "verify_ms": curves,
        "verify_ratio": {n: {k: c[k] / c[1] for k in KS} for n, c in curves.items()},
        "plain_decode_tokens_per_s": decode,
        "engine_vs_transformers": {"float32": decode["float32"] / decode["hf_generate_float32"],
                                   "bfloat16": decode["bfloat16"] / decode["hf_generate_bfloat16"],
                                   "int4_vs_hf_bfloat16": decode["int4"] / decode["hf_generate_bfloat16"]},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("engine / transformers:", {k: round(v, 2) for k, v in result["engine_vs_transformers"].items()})



if __name__ == "__main__":
    main()
