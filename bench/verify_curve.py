"""Verify cost curve and plain-decode speed per weight format, next to transformers, in one run.

    .venv/bin/python bench/verify_curve.py --out bench/results/verify_curve.json [--threads N]

T(k): one target forward over k new tokens on a 300-token KV cache (median of repeats, logits
for all k rows), for float32, bfloat16, int8 (per-row int8 linears) and int4 (the GGUF's Q4_1 blocks, LM head
int8), the last two with bf16 activations, all loaded by `load_target` as the server does.
Plain decode: the engine's `none` method, 128 new tokens, against `transformers` `generate` in
the same dtype. Everything is measured in this one process, interleaved, so ratios hold even on a
noisy shared machine; absolute times drift between runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_hf_model, load_target  # noqa: E402

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


def llama_cpp_curve(prompt_ids: list[int], threads: int, repeats: int, ctx: int = 300) -> tuple[dict[int, float], float]:
    """The same measurements for llama.cpp on the GGUF itself (when llama-cpp-python is installed):
    T(k) = `eval` of k tokens after rewinding to the 300-token context, logits for all k rows;
    plain decode = 128 greedy tokens."""
    from llama_cpp import Llama

    from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir

    llm = Llama(model_path=os.path.join(embedded_model_dir(), EMBEDDED_GGUF), n_threads=threads,
                n_threads_batch=threads, n_ctx=1024, n_batch=512, logits_all=True, verbose=False)
    g = torch.Generator().manual_seed(0)
    llm.eval(torch.randint(0, 49152, (ctx,), generator=g).tolist())
    out = {}
    for k in KS:
        ts = []
        for _ in range(repeats + 1):
            llm.n_tokens = ctx  # eval() drops the KV cache past n_tokens first
            tokens = torch.randint(0, 49152, (k,), generator=g).tolist()
            t0 = time.perf_counter()
            llm.eval(tokens)
            ts.append(time.perf_counter() - t0)
        out[k] = statistics.median(ts[1:]) * 1000
    llm.reset()
    stream = llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
    next(stream)  # prefill + first token
    t0 = time.perf_counter()
    for _ in range(127):
        next(stream)
    return out, 127 / (time.perf_counter() - t0)


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


def weight_stream_floor_ms(model, repeats: int) -> dict:
    """What bounds bf16 decode: one GEMV streaming as many bf16 bytes as the model's linear weights
    (one row through one [N, hidden] matrix, the best case for the memory system), and the time
    plain decode needs at least to read them once per token."""
    n_bytes = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    hidden = model.cfg.hidden_size
    w = torch.randn(n_bytes // 2 // hidden, hidden, dtype=torch.bfloat16)
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    ts = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        ts.append(time.perf_counter() - t0)
    ms = statistics.median(ts[2:]) * 1000
    return {"bf16_weight_bytes": n_bytes, "stream_ms": ms, "gb_per_s": n_bytes / ms / 1e6}


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
    models = {"float32": load_target(None, "float32")[0], "bfloat16": load_target(None, "bfloat16")[0],
              "int8": load_target(None, "bfloat16", "int8")[0], "int4": load_target(None, "bfloat16", "int4")[0]}

    floor = weight_stream_floor_ms(models["bfloat16"], 3 * args.repeats)
    print("bf16 weight stream floor:", {k: round(v, 2) for k, v in floor.items()})
    curves = {name: verify_times(m, args.repeats) for name, m in models.items()}
    decode = {name: plain_decode_tps(m, tok) for name, m in models.items()}
    decode["hf_generate_float32"] = hf_generate_tps(hf32, tok)
    decode["hf_generate_bfloat16"] = hf_generate_tps(hf16, tok)
    if importlib.util.find_spec("llama_cpp") is not None:
        curves["llama_cpp"], decode["llama_cpp"] = llama_cpp_curve(encode_chat(tok, PROMPT), torch.get_num_threads(),
                                                                   args.repeats)

    print(f"{'k':>4} " + " ".join(f"{n + ' ms':>14} {'ratio':>6}" for n in curves))
    for k in KS:
        print(f"{k:>4} " + " ".join(f"{c[k]:>14.2f} {c[k] / c[1]:>6.2f}" for c in curves.values()))
    print("plain decode tokens/s:", {k: round(v, 1) for k, v in decode.items()})
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info("float32/bfloat16/int8/int4", torch.get_num_threads()),
        "git_commit": (git_info()["commit"] or "")[:7],
        "context_tokens": 300,
        "verify_ms": curves,
        "verify_ratio": {n: {k: c[k] / c[1] for k in KS} for n, c in curves.items()},
        "plain_decode_tokens_per_s": decode,
        "bf16_weight_stream_floor": floor,
        "engine_vs_transformers": {"float32": decode["float32"] / decode["hf_generate_float32"],
                                   "bfloat16": decode["bfloat16"] / decode["hf_generate_bfloat16"],
                                   "int8_vs_hf_bfloat16": decode["int8"] / decode["hf_generate_bfloat16"],
                                   "int4_vs_hf_bfloat16": decode["int4"] / decode["hf_generate_bfloat16"]},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("engine / transformers:", {k: round(v, 2) for k, v in result["engine_vs_transformers"].items()})



if __name__ == "__main__":
    main()
