"""Time to first token and decode speed per target format, in one run (`--weights auto` vs fixed).

    .venv/bin/python bench/prefill_probe.py --out bench/results/prefill_probe.json [--threads N]

For each configuration (loaded by `load_engine` as the server does): the prefill of an agent-like
conversation cut to 256 / 1024 / 2048 tokens (time to first token, best of 2), then 64 greedy
tokens after the 1024-token prompt with plain decode and with `whiflash`. Configurations are
interleaved per measurement, so ratios hold on a noisy machine. llama.cpp (llama-cpp-python, an
optional extra) is measured on the same GGUF when installed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

LENGTHS = (256, 1024, 2048)
DECODE_TOKENS = 64
TOOL = {"type": "function", "function": {
    "name": "search_flights", "description": "Search flights between two cities on a date",
    "parameters": {"type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                                                    "date": {"type": "string"}}, "required": ["origin", "destination"]}}}


def agent_prompt(tokenizer, n: int) -> list[int]:
    """A multi-turn tool conversation grown until it has at least n tokens, cut to n."""
    messages = [{"role": "system", "content": "You are a travel agent. Use the tools to answer."}]
    turn = 0
    while True:
        messages += [
            {"role": "user", "content": f"Find me a flight from city {turn} to city {turn + 1} next week, "
                                        "preferably in the morning, and tell me the cheapest option."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{turn}", "type": "function",
             "function": {"name": "search_flights",
                          "arguments": json.dumps({"origin": f"city {turn}", "destination": f"city {turn + 1}"})}}]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": json.dumps(
                {"results": [{"flight": f"XY{100 + i}", "departs": f"0{6 + i}:15", "price_eur": 80 + 17 * i}
                             for i in range(5)]})},
            {"role": "assistant", "content": f"The cheapest morning flight from city {turn} is XY100 at 06:15 "
                                             "for 80 euros."}]
        ids = encode_chat(tokenizer, messages, [TOOL])
        if len(ids) >= n:
            return ids[-n:]
        turn += 1


def time_prefill(engine, ids: list[int]) -> float:
    best = float("inf")
    for _ in range(2):
        gen = engine.start(GenerationRequest(ids, 1, speculation=SpeculationConfig(method="none")))
        t0 = time.perf_counter()
        gen.prefill()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_rate(engine, ids: list[int], method: str) -> float:
    gen = engine.start(GenerationRequest(ids, DECODE_TOKENS, stop_token_ids=[],
                                         speculation=SpeculationConfig(method=method)))
    gen.prefill()
    t0 = time.perf_counter()
    while not gen.finished:
        gen.step()
    return (len(gen.output) - 1) / (time.perf_counter() - t0)


def llama_cpp_rates(prompts: dict[int, list[int]], threads: int) -> dict | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir

    llm = llama_cpp.Llama(os.path.join(embedded_model_dir(), EMBEDDED_GGUF), n_ctx=4096, n_threads=threads,
                          n_batch=512, verbose=False)
    out = {"prefill_s": {}}
    for n, ids in prompts.items():
        best = float("inf")
        for _ in range(2):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            best = min(best, time.perf_counter() - t0)
        out["prefill_s"][n] = best
    # greedy decode after the 1024-token prompt, timed from the first token (as bench's llama_cpp runner)
    n, first = 0, None
    for _ in llm.generate(prompts[1024], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter()
        n += 1
        if n > DECODE_TOKENS:
            break
    out["decode_tokens_per_s"] = DECODE_TOKENS / (time.perf_counter() - first)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="int4,auto", help="comma-separated --weights values (bfloat16 activations)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    configs = [c.strip() for c in args.configs.split(",")]
    engines = {c: load_engine(dtype="bfloat16", weights=c) for c in configs}
    tok = next(iter(engines.values())).tokenizer
    prompts = {n: agent_prompt(tok, n) for n in LENGTHS}
    prefill = {c: {} for c in configs}
    for n, ids in prompts.items():
        for c, engine in engines.items():
            prefill[c][n] = time_prefill(engine, ids)
            print(f"prefill {n:5d} tokens  {c:>6}: {prefill[c][n]:.2f} s ({n / prefill[c][n]:.0f} tok/s)", flush=True)
    decode = {c: {} for c in configs}
    for method in ("none", "whiflash"):
        for c, engine in engines.items():
            decode[c][method] = decode_rate(engine, prompts[1024], method)
            print(f"decode {method:>8} {c:>6}: {decode[c][method]:.1f} tok/s", flush=True)
    result = {
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_info("bfloat16", args.threads), "git": git_info(),
        "formats": {c: (None if e.target.formats is None else e.target.formats.__dict__) for c, e in engines.items()},
        "prefill_s": prefill, "prefill_tokens_per_s": {c: {n: n / t for n, t in v.items()} for c, v in prefill.items()},
        "decode_tokens_per_s": decode, "llama_cpp": llama_cpp_rates(prompts, args.threads),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "llama_cpp")}, indent=1))


if __name__ == "__main__":
    main()
