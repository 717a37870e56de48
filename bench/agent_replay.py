"""Time to first token across the turns of an agent conversation, with the prefix cache on and off.

    .venv/bin/python bench/agent_replay.py --out bench/results/agent_replay_avx2.json [--threads N]

An agent loop resends the whole conversation each turn and asks for a short answer. This replays a
6-turn tool-using conversation (a system prompt with four tool schemas, user turns, the assistant's
tool calls and long tool results) as the server would render it (`encode_chat`): turn t's prompt is
everything up to the t-th point where the assistant must answer. Each turn is generated (greedy,
`whiflash`, 32 tokens) by the engine `whiflash serve` loads (`--weights auto` by default), once
with the prefix cache off and once on; the two passes are interleaved turn by turn, and a fresh
cache is used for the "on" pass, so turn 1 is a miss there too. Reported per turn: prompt tokens,
cached tokens, time to first token on and off and their ratio, and whether the outputs agree (in
bf16/int4 a differently shaped forward may round a near-tie the other way; in float32 they are
the same tokens, see tests/test_prefix_cache.py).
"""
from __future__ import annotations

import argparse
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
from whiflash_core.prefix_cache import PrefixCache  # noqa: E402


def tool(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
        "required": list(params)}}}


TOOLS = [
    tool("search_flights", "Search flights between two airports on a date", origin="IATA code of the origin",
         destination="IATA code of the destination", date="departure date, YYYY-MM-DD"),
    tool("search_hotels", "Search hotels in a city for a stay", city="city name", check_in="YYYY-MM-DD",
         nights="number of nights"),
    tool("get_weather", "Weather forecast for a city", city="city name", date="YYYY-MM-DD"),
    tool("convert_currency", "Convert an amount between currencies", amount="the amount",
         source="ISO code", target="ISO code"),
]
SYSTEM = ("You are a careful travel assistant working for a small agency. Use the tools to look things up "
          "before you answer; never invent prices or times. Keep answers short and give the user the "
          "cheapest reasonable option first, then one alternative.")


def call(i: int, name: str, **args) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def result(i: int, payload) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(payload)}


FLIGHTS = [{"flight": f"AF{1200 + 7 * i}", "departs": f"{6 + i:02d}:{(17 * i) % 60:02d}",
            "arrives": f"{8 + i:02d}:{(17 * i + 25) % 60:02d}", "price_eur": 89 + 23 * i, "stops": i % 2}
           for i in range(8)]
HOTELS = [{"name": f"Hotel {n}", "stars": 3 + i % 2, "price_per_night_eur": 95 + 31 * i,
           "distance_to_center_km": round(0.4 + 0.7 * i, 1), "rating": round(8.9 - 0.3 * i, 1)}
          for i, n in enumerate(["Lumiere", "des Arts", "Bellevue", "du Parc", "Central", "Riviera"])]
WEATHER = {"city": "Rome", "days": [{"date": f"2026-05-{12 + d}", "high_c": 22 + d % 3, "low_c": 13 + d % 2,
                                     "sky": ["sunny", "partly cloudy", "showers"][d % 3]} for d in range(5)]}

# The assistant's side is fixed (a replay): what the engine generates each turn is measured, not kept.
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "I need to get from Paris to Rome on May 12th, in the morning if possible."},
    call(1, "search_flights", origin="CDG", destination="FCO", date="2026-05-12"),
    result(1, {"results": FLIGHTS}),
    {"role": "assistant", "content": "The cheapest morning flight is AF1200 at 06:00, arriving 08:25, for 89 "
                                     "euros. AF1207 at 07:17 costs 112 euros."},
    {"role": "user", "content": "Book nothing yet. What hotels are there near the centre for three nights?"},
    call(2, "search_hotels", city="Rome", check_in="2026-05-12", nights="3"),
    result(2, {"results": HOTELS}),
    {"role": "assistant", "content": "Hotel Lumiere is 0.4 km from the centre at 95 euros a night (rating "
                                     "8.9); Hotel des Arts is 1.1 km away at 126 euros."},
    {"role": "user", "content": "And what will the weather be like while I am there?"},
    call(3, "get_weather", city="Rome", date="2026-05-12"),
    result(3, WEATHER),
    {"role": "assistant", "content": "Mostly mild: highs of 22 to 24 C, lows of 13 to 14 C, sunny at first "
                                     "with showers possible on the 14th."},
    {"role": "user", "content": "My budget is in US dollars. How much is the flight plus three nights at "
                                "Hotel Lumiere?"},
    call(4, "convert_currency", amount="374", source="EUR", target="USD"),
    result(4, {"amount": 374, "source": "EUR", "target": "USD", "rate": 1.087, "converted": 406.54}),
]


def turn_prompts(tokenizer) -> list[list[int]]:
    """The prompt of each turn: the conversation up to each user message or tool result that the
    assistant answers next."""
    ends = [i + 1 for i, m in enumerate(CONVERSATION)
            if m["role"] in ("user", "tool") and (i + 1 == len(CONVERSATION) or CONVERSATION[i + 1]["role"] == "assistant")]
    return [encode_chat(tokenizer, CONVERSATION[:end], TOOLS) for end in ends]


def generate(engine, ids: list[int], max_tokens: int):
    spec = SpeculationConfig(method="whiflash")
    t0 = time.perf_counter()
    gen = engine.start(GenerationRequest(ids, max_tokens, speculation=spec))
    gen.prefill()
    ttft = time.perf_counter() - t0
    while not gen.finished:
        gen.step()
    return gen, ttft, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cache-mb", type=float, default=512)
    args = ap.parse_args()

    engine = load_engine(None, None, args.dtype, threads=args.threads, weights=args.weights)
    prompts = turn_prompts(engine.tokenizer)
    off, on = PrefixCache(0), PrefixCache(int(args.cache_mb * 2**20))
    engine.prefix_cache = off
    generate(engine, prompts[0][:64], 4)   # warm-up: first-call allocations and format dispatch

    turns = []
    for t, ids in enumerate(prompts, 1):
        row = {"turn": t, "prompt_tokens": len(ids)}
        outputs = {}
        for name, cache in (("off", off), ("on", on)):
            engine.prefix_cache = cache
            gen, ttft, total = generate(engine, ids, args.max_tokens)
            outputs[name] = gen.output
            row[f"ttft_{name}_s"] = round(ttft, 4)
            row[f"total_{name}_s"] = round(total, 4)
            if name == "on":
                row["cached_tokens"] = gen.cached_tokens
        row["ttft_ratio_on_off"] = round(row["ttft_on_s"] / row["ttft_off_s"], 4)
        row["same_output"] = outputs["on"] == outputs["off"]
        turns.append(row)
        print(json.dumps(row), flush=True)

    later = turns[1:]
    summary = {
        "turns_2_to_n_ttft_ratio_max": max(r["ttft_ratio_on_off"] for r in later),
        "turns_2_to_n_ttft_ratio_mean": round(sum(r["ttft_ratio_on_off"] for r in later) / len(later), 4),
        "turns_2_to_n_ttft_off_s": round(sum(r["ttft_off_s"] for r in later), 3),
        "turns_2_to_n_ttft_on_s": round(sum(r["ttft_on_s"] for r in later), 3),
        "outputs_agree": sum(r["same_output"] for r in turns),
        "turns": len(turns),
        "cache_bytes": on.stats.stored_bytes,
    }
    print(json.dumps(summary))
    formats = engine.target.formats
    out = {"command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
           "machine": machine_info(args.dtype, torch.get_num_threads()),
           "git": git_info(), "weights": args.weights, "dtype": args.dtype,
           "formats": None if formats is None else formats.__dict__,
           "max_tokens": args.max_tokens, "turns": turns, "summary": summary}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
