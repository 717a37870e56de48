"""Memory under the 64-stream agent load, offline: what the process holds besides the prefix cache.

    .venv/bin/python bench/memory_soak.py --streams 64 --requests 300 [--avx2-formats] [--out FILE]

The load of `bench/load.py --streams 64 --max-tokens 8` without HTTP and deterministic: 64 agent
conversations (the load test's system prompt, tools, tool results and follow-ups, up to 6 turns,
then a new conversation) take turns for `--active` (16, the server's max_active) generation slots,
stepped together (Engine.step_many) as the server's worker does; each finished answer is appended
to its conversation (decoded text, or its tool call), re-rendered with the chat template, and
queued as that stream's next request. A fixed number of requests is served, so two versions of
the code see the same load.

Every `--every` requests it prints the process's resident memory (VmRSS), the prefix cache's
bytes, and the difference (what grows besides the cache's budget: per-request buffers, transient
copies, allocator fragmentation); at the end the same after returning free heap to the OS
(malloc_trim, as the server does when idle). `--avx2-formats` imposes the formats `--weights auto`
picks on an AVX2 CPU (int4 decode, float32 prefill twin from 64 rows), so the twin's path runs
here too. Like the server, it fixes glibc's mmap threshold first (`--glibc-default-heap`: not).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import deque


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.agent_replay import SYSTEM, TOOLS  # noqa: E402
from bench.load import CITIES, FOLLOW_UPS, tool_result  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.prefix_cache import PrefixCache  # noqa: E402

AVX2_FORMATS = dict(dtype="bfloat16", weights="int4", prefill_dtype="float32", prefill_from_rows=64)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Stream:
    """One client of the load test: agent conversations back to back, `turns` requests each."""

    def __init__(self, index: int, turns: int):
        self.rng, self.turns, self.index = random.Random(index), turns, index
        self.new_conversation()

    def new_conversation(self) -> None:
        a, b = self.rng.sample(CITIES, 2)
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Find me a morning flight from {a} to {b} next Friday, "
                                                     f"and a hotel near the centre for two nights."}]
        self.turn = 0

    def answered(self, text: str) -> None:
        """The assistant's answer to the last request: append it and what the client sends next."""
        self.turn += 1
        if self.turn >= self.turns:
            self.new_conversation()
            return
        if "<tool_call>" in text:   # as the server would return it: a call, then the client runs the tool
            call = {"id": f"call_{self.index}_{self.turn}", "type": "function",
                    "function": {"name": "search_flights", "arguments": "{}"}}
            self.messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": call["id"], "content": tool_result(call, self.rng)}]
        else:
            self.messages += [{"role": "assistant", "content": text},
                              {"role": "user", "content": self.rng.choice(FOLLOW_UPS)}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--active", type=int, default=16, help="generations stepped at a time (the server's max_active)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefix-cache-mb", type=float, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--avx2-formats", action="store_true")
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--glibc-default-heap", action="store_true",
                    help="leave glibc's mmap threshold alone (the server fixes it at start: "
                         "app.memory.keep_large_buffers_off_the_heap)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from app.memory import keep_large_buffers_off_the_heap
    if not args.glibc_default_heap:
        keep_large_buffers_off_the_heap()   # as the server's scheduler does when it starts
    from whiflash_core import loading
    from whiflash_core.machine import Formats
    if args.avx2_formats:   # what --weights auto picks on an AVX2 CPU, imposed
        loading.formats_from = lambda result: Formats(**AVX2_FORMATS)
        loading.measure = lambda *a, **kw: {}
    engine = loading.load_engine(None, None, "bfloat16", threads=args.threads, weights="auto")
    engine.prefix_cache = PrefixCache(int(args.prefix_cache_mb * 2**20))
    tok = engine.tokenizer
    from app.scheduler import release_free_memory

    streams = [Stream(i, args.turns) for i in range(args.streams)]
    waiting = deque(streams)
    active: list[tuple[Stream, object]] = []
    served, samples, t0 = 0, [], time.perf_counter()
    start_rss = rss_mb()

    def sample() -> None:
        cache_mb = engine.prefix_cache.stats.stored_bytes / 2**20
        row = {"requests": served, "rss_mb": round(rss_mb(), 1), "prefix_cache_mb": round(cache_mb, 1),
               "rss_minus_cache_mb": round(rss_mb() - cache_mb, 1), "seconds": round(time.perf_counter() - t0, 1)}
        samples.append(row)
        print(json.dumps(row), flush=True)

    sample()
    while served < args.requests:
        while waiting and len(active) < args.active:
            stream = waiting.popleft()
            ids = encode_chat(tok, stream.messages, TOOLS)
            gen = engine.start(GenerationRequest(ids, args.max_tokens, speculation=SpeculationConfig("whiflash")))
            gen.prefill()
            active.append((stream, gen))
        engine.step_many([gen for _, gen in active if not gen.finished])
        for stream, gen in [item for item in active if item[1].finished]:
            active.remove((stream, gen))
            stream.answered(tok.decode(gen.output, skip_special_tokens=True))
            waiting.append(stream)
            served += 1
            if served % args.every == 0:
                sample()
    before_trim = rss_mb()
    release_free_memory()
    sample()
    result = {"command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
              "machine": machine_info("bfloat16", args.threads), "git": git_info(),
              "formats": None if engine.target.formats is None else vars(engine.target.formats),
              "args": vars(args), "start_rss_mb": round(start_rss, 1), "end_rss_before_trim_mb": round(before_trim, 1),
              "samples": samples}
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "machine", "command")}))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
