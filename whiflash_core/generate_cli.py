"""`whiflash generate`: scripted runs, one JSON line per (prompt, method) on stdout.

The model is loaded once per invocation. Each input line is {"messages": [...]} (the chat template
is applied, tools too) or {"prompt": "..."} (raw text).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .cli_args import add_arguments
from .engine import METHODS, GenerationRequest, SpeculationConfig
from .sampling import SamplingParams


def add_parser(sub) -> None:
    from .quant import WEIGHT_FORMATS

    p = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    p.add_argument("--prompts", required=True, help="JSONL: {'messages': [...]} or {'prompt': '...'} per line")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    add_arguments(p, SpeculationConfig, only=("alpha", "num_draft_tokens", "block_size"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    p.add_argument("--model", default=None, help="Hugging Face model directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--drafters", default=None, help="drafter directory (default: the shipped drafters)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 checkpoint directory (SafeAILab or speculators)")
    p.add_argument("--dflash", default=None, help="DFlash checkpoint directory (z-lab format)")
    p.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="int4: the GGUF's Q4_1 blocks through the CPU int4 matmul, LM head int8; int8: every linear per-row int8 (bfloat16 only)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the target and drafters run (default: cuda when available, else cpu)")
    p.add_argument("--trace", action="store_true", help="include per-token sources")
    p.set_defaults(func=run)


def read_prompts(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            item = json.loads(line)
            if "messages" not in item and "prompt" not in item:
                raise SystemExit(f"{path}:{i + 1}: each line needs 'messages' or 'prompt'")
            out.append(item)
    return out


def prompt_ids(engine, item: dict) -> list[int]:
    from .chat import encode_chat

    if "messages" in item:
        return encode_chat(engine.tokenizer, item["messages"], item.get("tools"))
    return engine.tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]


def run(args: argparse.Namespace) -> int:
    from .loading import load_engine

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    items = read_prompts(args.prompts)
    engine = load_engine(args.model, args.drafters, args.dtype, args.eagle3, args.dflash, args.threads,
                         args.weights, args.device)
    missing = [m for m in methods if m not in engine.methods]
    if missing:
        raise SystemExit(f"method(s) {missing} need drafters that are not loaded; available: {engine.methods}")
    for index, item in enumerate(items):
        ids = prompt_ids(engine, item)
        for method in methods:
            request = GenerationRequest(
                ids, args.max_tokens,
                SamplingParams(args.temperature, args.top_p, args.top_k, args.seed),
                SpeculationConfig(method=method, alpha=args.alpha, num_draft_tokens=args.num_draft_tokens,
                                  block_size=args.block_size, trace=args.trace))
            t0 = time.perf_counter()
            gen = engine.generate(request)
            seconds = time.perf_counter() - t0
            line = {"index": index, "method": method, "text": engine.tokenizer.decode(gen.output),
                    "token_ids": gen.output, "finish_reason": gen.finish_reason,
                    "speculation": gen.stats(args.trace), "seconds": round(seconds, 4)}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
    return 0
