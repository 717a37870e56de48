"""The greedy verify under a grammar, two ways in one process: the grammar's packed masks read in
place by the C argmax (`sampling.verify_greedy(..., allowed)`, this tree) against the way before it
(each packed row unpacked to a bool [V] row, the logits masked by masked_fill into a copy, argmax).

    .venv/bin/python bench/grammar_ab.py --workload ../shared/data/bench/spec_bench.jsonl --limit 2 \
        --threads 2 --out FILE

Every prompt is asked with the gateway's two tools (tests/test_gateway.py's TOOLS) under
`tool_choice: auto`, i.e. the lazy tool-call grammar an agent request carries every round
(free text until `<tool_call>`), method `whiflash`, greedy, 128 tokens. Arms in the order A B B A
for every second prompt (B A A B for the others), so a drift of the machine's speed falls on both
alike. Reported: tokens per second of the decode loop (prefill excluded) in wall time and in CPU
time of this thread, and how many prompts decoded the same tokens both ways (all of them: the
same forwards, the same choices).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from test_gateway import TOOLS  # noqa: E402

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.constraints import GrammarFactory  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402
from whiflash_core.sampling import verify_greedy  # noqa: E402

BITS = torch.arange(32, dtype=torch.int32)


def unpacked_verify(self, logits, draft, masks):
    """Generation._verify before the packed masks: unpack, masked_fill a copy, argmax."""
    tokens = draft.tokens if draft is not None else torch.zeros(0, dtype=torch.long, device=self.device)
    if masks is not None:
        rows = [((masks[i].unsqueeze(-1) >> BITS) & 1).view(-1)[: logits.shape[-1]].bool()
                for i in range(masks.shape[0])]
        logits = logits[: masks.shape[0]].masked_fill(~torch.stack(rows), float("-inf"))
        tokens = tokens[: masks.shape[0] - 1]
    return verify_greedy(tokens, logits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out")
    args = p.parse_args()
    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights="auto")
    factory = GrammarFactory(engine.tokenizer, engine.target.cfg.vocab_size, engine.eos_ids)
    prompts = load_workload(args.workload, limit=args.limit)
    totals = {arm: {"tokens": 0, "wall_s": 0.0, "cpu_s": 0.0} for arm in ("packed", "unpacked")}

    def run(arm: str, ids: list[int]) -> tuple[list[int], float, float]:
        """One generation: (tokens, decode wall seconds, decode CPU seconds of this thread)."""
        constraint = factory.lazy_tool_calls(TOOLS, parallel=False)
        g = engine.start(GenerationRequest(ids, args.max_tokens, constraint=constraint,
                                           speculation=SpeculationConfig("whiflash")))
        if arm == "unpacked":
            g._verify = types.MethodType(unpacked_verify, g)
        g.prefill()
        wall, cpu = time.perf_counter(), time.thread_time()
        while not g.finished and g.step() is not None:
            pass
        return g.output, time.perf_counter() - wall, time.thread_time() - cpu

    run("packed", encode_chat(engine.tokenizer, prompts[0].messages, TOOLS))   # a process's first runs cold
    same = 0
    for i, prompt in enumerate(prompts):
        ids = encode_chat(engine.tokenizer, prompt.messages, TOOLS)
        order = ("packed", "unpacked", "unpacked", "packed") if i % 2 == 0 else ("unpacked", "packed", "packed", "unpacked")
        outputs = {}
        for arm in order:
            outputs[arm], wall, cpu = run(arm, ids)
            t = totals[arm]
            t["tokens"] += len(outputs[arm])
            t["wall_s"] += wall
            t["cpu_s"] += cpu
        same += outputs["packed"] == outputs["unpacked"]
    summary = {arm: {"tokens": t["tokens"], "tps_wall": round(t["tokens"] / t["wall_s"], 2),
                     "tps_cpu": round(t["tokens"] / t["cpu_s"], 2)} for arm, t in totals.items()}
    summary["packed_over_unpacked"] = {
        "tps_wall": round(totals["unpacked"]["wall_s"] / totals["packed"]["wall_s"], 4),
        "tps_cpu": round(totals["unpacked"]["cpu_s"] / totals["packed"]["cpu_s"], 4)}
    summary["identical_prompts"] = f"{same}/{len(prompts)}"
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "git": git_info(), "machine": machine_info("bfloat16", torch.get_num_threads()),
                       "settings": vars(args), "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
