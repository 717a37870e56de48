"""Load test: N concurrent streaming agent conversations against a running server, for a fixed time.

    .venv/bin/whiflash serve --port 8000 &
    .venv/bin/python bench/load.py --url http://127.0.0.1:8000 --streams 8 --seconds 120 \
        --out bench/results/load_8.json

Each stream runs agent conversations back to back: a system prompt with tool schemas (the same for
every stream, as in a real deployment), a user task, then turns that append the assistant's answer
(its text or tool call) and a tool result or a follow-up question, resending the whole conversation
each time (as agent frameworks do), up to --turns turns; then a new conversation. Every request
streams (`stream: true`, usage included) and is checked for an OpenAI-shaped stream: chunks, one
finish_reason, a usage chunk and `data: [DONE]`.

Reported: requests, errors (429s apart: those are the server's deliberate admission control),
incomplete streams, time to first token p50/p95, tokens/s per stream and in total, the prefix
cache hit rate (prompt tokens answered from cache, from usage and from /metrics), and the server's
resident memory before, right after and --settle-seconds after (`process_resident_memory_bytes`
from /metrics; right after includes the last requests' buffers, settled what the server keeps).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.agent_replay import SYSTEM, TOOLS  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402

CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin", "Athens"]
FOLLOW_UPS = ["Which of those is cheapest?", "Is there anything earlier in the day?",
              "Summarise the options in one sentence.", "What would that cost in US dollars?",
              "And the weather there on that day?"]


@dataclass
class Stats:
    requests: int = 0
    ok: int = 0
    rejected_429: int = 0
    errors: int = 0
    incomplete: int = 0               # 200 streams without a finish_reason, usage or [DONE]
    error_samples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_stream_tokens: dict[int, int] = field(default_factory=dict)


def tool_result(call: dict, rng: random.Random) -> str:
    """A plausible tool result for any of the tools, a few hundred tokens long."""
    name = call.get("function", {}).get("name", "")
    rows = [{"id": f"R{rng.randrange(1000, 9999)}", "time": f"{rng.randrange(6, 22):02d}:{rng.randrange(60):02d}",
             "price_eur": rng.randrange(60, 400), "rating": round(rng.uniform(6, 9.8), 1)} for _ in range(6)]
    return json.dumps({"tool": name, "results": rows})


async def one_request(client: httpx.AsyncClient, messages: list[dict], max_tokens: int, stats: Stats,
                      stream_id: int) -> dict | None:
    """Stream one completion; returns the assistant message to append, or None on failure."""
    body = {"messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    stats.requests += 1
    t0 = time.perf_counter()
    first = None
    text, calls, finish, usage, done = "", {}, None, None, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 429:
                stats.rejected_429 += 1
                await r.aread()
                return None
            if r.status_code != 200:
                stats.errors += 1
                stats.error_samples.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if first is None and (delta.get("content") or delta.get("tool_calls")):
                        first = time.perf_counter() - t0
                    text += delta.get("content") or ""
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                              "function": {"name": "", "arguments": ""}})
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        stats.errors += 1
        stats.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])
        return None
    if finish is None or usage is None or not done:
        stats.incomplete += 1
        return None
    stats.ok += 1
    if first is not None:
        stats.ttft.append(first)
    stats.completion_tokens += usage["completion_tokens"]
    stats.prompt_tokens += usage["prompt_tokens"]
    stats.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    stats.per_stream_tokens[stream_id] = stats.per_stream_tokens.get(stream_id, 0) + usage["completion_tokens"]
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]}
    return {"role": "assistant", "content": text}


async def stream_loop(client: httpx.AsyncClient, stream_id: int, deadline: float, args, stats: Stats) -> None:
    rng = random.Random(stream_id)
    while time.perf_counter() < deadline:
        a, b = rng.sample(CITIES, 2)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Find me a morning flight from {a} to {b} next Friday, "
                                                f"and a hotel near the centre for two nights."}]
        for _ in range(args.turns):
            if time.perf_counter() >= deadline:
                return
            reply = await one_request(client, messages, args.max_tokens, stats, stream_id)
            if reply is None:
                await asyncio.sleep(0.5)   # back off after a 429 or an error, as a client would
                break
            messages.append(reply)
            if reply.get("tool_calls"):
                for call in reply["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(call, rng)})
            else:
                messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))
    return {"rss_bytes": total("process_resident_memory_bytes"), "cpu_seconds": total("process_cpu_seconds_total"),
            "prefix_cache_queries": total("whiflash:prefix_cache_queries_total"),
            "prefix_cache_hits": total("whiflash:prefix_cache_hits_total"),
            "prefix_cache_bytes": total("whiflash:prefix_cache_bytes")}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0], 4)


async def run(args) -> dict:
    before = scrape(args.url)
    stats = Stats()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.request_timeout,
                                 limits=limits) as client:
        t0, client_cpu = time.perf_counter(), time.process_time()
        deadline = t0 + args.seconds
        await asyncio.gather(*(stream_loop(client, i, deadline, args, stats) for i in range(args.streams)))
        wall = time.perf_counter() - t0
        client_cpu = time.process_time() - client_cpu
    after = scrape(args.url)
    # and once the server has been idle a moment (it hands its recycled buffers and freed heap back
    # after app.scheduler.IDLE_TRIM_SECONDS): what stays is growth, not the last requests' buffers
    await asyncio.sleep(args.settle_seconds)
    settled = scrape(args.url)
    per_stream = [n / wall for n in stats.per_stream_tokens.values()]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    result = {
        "streams": args.streams, "seconds": round(wall, 2), "requests": stats.requests, "ok": stats.ok,
        "rejected_429": stats.rejected_429, "errors": stats.errors, "incomplete_streams": stats.incomplete,
        "error_samples": stats.error_samples[:5],
        "ttft_p50_s": percentile(stats.ttft, 50), "ttft_p95_s": percentile(stats.ttft, 95),
        "total_tokens_per_s": round(stats.completion_tokens / wall, 3),
        "per_stream_tokens_per_s_mean": round(statistics.mean(per_stream), 3) if per_stream else 0.0,
        "completion_tokens": stats.completion_tokens, "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "cache_hit_rate_usage": round(stats.cached_tokens / stats.prompt_tokens, 4) if stats.prompt_tokens else 0.0,
        "cache_hit_rate_metrics": round((after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries, 4)
        if queries else 0.0,
        "server_rss_before_mb": round(before["rss_bytes"] / 2**20, 1),
        "server_rss_after_mb": round(after["rss_bytes"] / 2**20, 1),
        "server_rss_growth": round(after["rss_bytes"] / before["rss_bytes"] - 1, 4) if before["rss_bytes"] else None,
        "server_rss_settled_mb": round(settled["rss_bytes"] / 2**20, 1),
        "server_rss_settled_growth": round(settled["rss_bytes"] / before["rss_bytes"] - 1, 4)
        if before["rss_bytes"] else None,
        "prefix_cache_mb_after": round(after["prefix_cache_bytes"] / 2**20, 1),
        # where the CPU went (the server's process, all its threads; this load generator's own)
        "server_cpu_cores": round((after["cpu_seconds"] - before["cpu_seconds"]) / wall, 3),
        "server_cpu_ms_per_token": round(1e3 * (after["cpu_seconds"] - before["cpu_seconds"]) / stats.completion_tokens, 3)
        if stats.completion_tokens else None,
        "client_cpu_cores": round(client_cpu / wall, 3),
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--streams", type=int, nargs="+", default=[8],
                    help="concurrent streams; several values run one after another (e.g. 1 8)")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation before a new one starts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--settle-seconds", type=float, default=3.0,
                    help="after the run, wait this long before the settled RSS reading (the server trims when idle)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    server = httpx.get(args.url + "/v1/models", timeout=30,
                       headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
    runs = []
    for n in args.streams:
        one = argparse.Namespace(**{**vars(args), "streams": n})
        res = asyncio.run(run(one))
        print(json.dumps(res), flush=True)
        runs.append(res)
    if len(runs) > 1 and runs[0]["total_tokens_per_s"]:
        for r in runs[1:]:
            r["total_tokens_per_s_vs_first"] = round(r["total_tokens_per_s"] / runs[0]["total_tokens_per_s"], 3)
    out = {"command": " ".join([os.path.relpath(sys.executable), *sys.argv]), "machine": machine_info("client", 0),
           "git": git_info(), "server_models": server, "turns": args.turns, "max_tokens": args.max_tokens,
           "runs": runs}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
