"""`whiflash bench`: tokens/s, acceptance length and losslessness per method and category.

    whiflash bench --workload bench/workload_small.jsonl --out bench/results/small.json --plot small.png
    whiflash bench --workload ... --url http://127.0.0.1:8000        # through the gateway
    whiflash bench --markdown bench/results/small.json                # README table from a results file

Measurement protocol: load once, warm every runner up, then for each prompt run every method
back to back (the order rotates per prompt and repeat), so slow drift of a shared machine hits
all methods alike. Greedy decoding with fixed seeds; every speculative method's output is
compared with `none`'s. In float32/float64 a difference is a bug (exit status 1); in bf16 a
k-token verify forward rounds differently from a 1-token forward, so near-ties can flip and the
agreement rate is reported instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import shlex
import sys

from ..cli_args import add_arguments
from ..config import SpeculationConfig
from ..router import METHODS
from .stats import BASELINE, PromptRecord, collapse_repeats, mismatches, summarize
from .workload import categories_in_order, load_workload

STRICT_DTYPES = ("float32", "fp32", "float64")
INT_LIST = re.compile(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]")


def add_parser(sub) -> None:
    from ..quant import WEIGHT_FORMATS

    p = sub.add_parser("bench", help="benchmark speculation methods (and peers) on a workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", help="JSONL: Spec-Bench records or chat conversations {category, messages, tools?}")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per (prompt, method); medians are kept")
    p.add_argument("--out", default=None, help="results JSON path")
    p.add_argument("--plot", default=None, help="PNG chart path")
    p.add_argument("--peers", nargs="?", const=",".join(PEERS), default=None, metavar="PEERS",
                   help="also run peers: transformers generate (hf_generate), transformers prompt lookup "
                        "(hf_pld) and llama.cpp (llama_cpp, if installed); all of them, or those listed "
                        f"(comma-separated, of {', '.join(PEERS)})")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10)
    p.add_argument("--url", default=None, help="benchmark a running gateway at this base URL instead of in-process")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    add_arguments(p, SpeculationConfig, only=("policy", "alpha", "num_draft_tokens", "block_size"))
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the losslessness check needs it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="Hugging Face model directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--drafters", default=None, help="drafter directory (default: the shipped drafters)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 checkpoint directory")
    p.add_argument("--dflash", default=None, help="DFlash checkpoint directory")
    p.add_argument("--weights", default="dense", choices=WEIGHT_FORMATS,
                   help="target weights: int4 = the GGUF's Q4_1 blocks (LM head int8), int8 = per-row int8 linears (bfloat16 only); peers stay dense")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the target and drafters run (default: cuda when available, else cpu)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--calibrate-router", default=None, metavar="THRESHOLDS",
                   help="comma-separated entropy thresholds: sweep the whiflash router over them and report "
                        "the thresholds maximising acceptance length and tokens/s (what alpha interpolates)")
    p.add_argument("--router-out", default=None,
                   help="with --calibrate-router: write the calibration here (e.g. DRAFTERS_DIR/router.json)")
    p.add_argument("--alpha-sweep", default=None, metavar="ALPHAS",
                   help="comma-separated alphas (e.g. 0,0.25,0.5,0.75,1): run whiflash at each on the workload "
                        "and write acceptance length, tokens/s, mean round time and rounds per drafter per alpha")
    p.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                   help="without --workload: render results JSON FILE as Markdown and exit; "
                        "with --workload: also write the run's Markdown tables to FILE (or stdout)")
    p.set_defaults(func=run)


# -- setup ------------------------------------------------------------------------------------


def drafters_description(args) -> str:
    """'random (untrained)' unless trained checkpoints will be found (mirrors load_engine)."""
    from ..loading import SHIPPED_DRAFTERS

    if args.url:
        return "server's"
    found = [p for p in (args.eagle3, args.dflash) if p]
    directory = args.drafters or (SHIPPED_DRAFTERS if args.model is None else None)
    if directory:
        found += [os.path.join(directory, n) for n in ("eagle3", "dflash")
                  if os.path.exists(os.path.join(directory, n, "config.json"))]
    return "trained: " + ", ".join(os.path.relpath(p) for p in found) if found else "random (untrained)"


def command_line(args) -> str:
    if sys.argv[1:2] == ["bench"]:
        return shlex.join(["whiflash"] + sys.argv[1:])
    parts = ["whiflash", "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command") or value in (None, False):
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


PEERS = ("hf_generate", "hf_pld", "llama_cpp")


def build_inprocess(args, methods, prompts, notes):

    from ..chat import encode_chat
    from ..loading import load_engine
    from ..sampling import SamplingParams
    from .runners import EngineRunner, HFGenerateRunner

    engine = load_engine(args.model, args.drafters, args.dtype, args.eagle3, args.dflash, args.threads,
                         **({"weights": args.weights} if args.weights != "dense" else {}), device=args.device)
    # what --weights auto chose on this machine, for the results file
    args.resolved_formats = None if engine.target.formats is None else dataclasses.asdict(engine.target.formats)
    missing = [m for m in methods if m not in engine.methods]
    if missing:
        raise SystemExit(f"method(s) {missing} need drafters that are not loaded; available: {engine.methods}")
    for p in prompts:
        p.ids = encode_chat(engine.tokenizer, p.messages, p.tools)
    sampling = SamplingParams(args.temperature, seed=args.seed)
    runners = [EngineRunner(engine, m, sampling,
                            SpeculationConfig(method=m, policy=args.policy, alpha=args.alpha,
                                              num_draft_tokens=args.num_draft_tokens, block_size=args.block_size))
               for m in methods]
    if not args.peers:
        return runners

    from transformers.utils import logging as hf_logging

    from ..loading import DTYPES, load_hf_model

    peers = set(args.peers.split(","))
    unknown = peers - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown peer(s) {sorted(unknown)}; known: {', '.join(PEERS)}")
    stop = list(engine.eos_ids)
    if peers & {"hf_generate", "hf_pld"}:
        hf_logging.set_verbosity_error()   # generate() warns about unused sampling fields
        hf_model, _ = load_hf_model(args.model)
        hf_model = hf_model.to(DTYPES[args.dtype])
        if "hf_generate" in peers:
            runners.append(HFGenerateRunner(hf_model, "hf_generate", stop))
        if "hf_pld" in peers:
            runners.append(HFGenerateRunner(hf_model, "hf_pld", stop, prompt_lookup=args.prompt_lookup_tokens))
        notes.append(f"peers: hf_generate = transformers generate (greedy, {args.dtype}); hf_pld = transformers "
                     f"prompt-lookup decoding (prompt_lookup_num_tokens={args.prompt_lookup_tokens}); "
                     "peers are always greedy")
    if "llama_cpp" in peers:
        runners += _llama_cpp_peer(args, stop, notes)
    return runners


def _llama_cpp_peer(args, stop: list[int], notes: list[str]) -> list:
    """[the llama.cpp runner] on the model's GGUF, or [] with a note saying why not."""
    import torch

    from .runners import LlamaCppRunner, llama_cpp_available

    gguf = _gguf_path(args.model)
    if not llama_cpp_available():
        notes.append("llama.cpp peer skipped: llama-cpp-python is not installed (PyPI ships only an sdist; "
                     "it builds in ~4 min with CMAKE_ARGS=-DGGML_NATIVE=ON)")
        return []
    if gguf is None:
        notes.append("llama.cpp peer skipped: it needs a .gguf model")
        return []
    notes.append(f"llama_cpp runs {os.path.basename(gguf)} with its own quantized kernels: token agreement "
                 "with none is not expected")
    return [LlamaCppRunner(gguf, stop, args.threads or torch.get_num_threads())]


def _gguf_path(model: str | None) -> str | None:
    from ..embedded import EMBEDDED_GGUF, embedded_model_dir

    if model is None:
        return os.path.join(embedded_model_dir(), EMBEDDED_GGUF)
    return model if model.endswith(".gguf") else None


def build_http(args, methods):
    import urllib.error
    import urllib.request

    from .runners import HttpRunner, server_model

    try:
        urllib.request.urlopen(args.url.rstrip("/") + "/health", timeout=10).close()
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"whiflash bench: no gateway at {args.url} ({exc})") from exc
    model = args.model or server_model(args.url)
    spec = {"alpha": args.alpha, "policy": args.policy}
    if args.num_draft_tokens:
        spec["num_draft_tokens"] = args.num_draft_tokens
    if args.block_size:
        spec["block_size"] = args.block_size
    return [HttpRunner(args.url, m, model, args.temperature, args.seed, spec) for m in methods]


# -- the run ----------------------------------------------------------------------------------


def measure(runners, prompts, max_tokens: int, repeats: int, warmup: bool) -> list[PromptRecord]:
    from tqdm import tqdm

    if warmup:
        shortest = min(prompts, key=lambda p: len(p.ids) if p.ids else len(json.dumps(p.messages)))
        for runner in tqdm(runners, desc="warm-up", unit="method", file=sys.stderr, leave=False):
            runner.run(shortest, min(8, max_tokens))
    records = []
    bar = tqdm(total=len(prompts) * repeats * len(runners), desc="bench", unit="run", file=sys.stderr)
    for i, prompt in enumerate(prompts):
        raw = {r.name: [] for r in runners}
        for rep in range(repeats):
            k = (i + rep) % len(runners)   # rotate the order: A B C, B C A, ...
            for runner in runners[k:] + runners[:k]:
                bar.set_postfix_str(f"{prompt.category}/{runner.name}", refresh=False)
                raw[runner.name].append(runner.run(prompt, max_tokens))
                bar.update()
        runs = {name: collapse_repeats(rs) for name, rs in raw.items()}
        n_prompt = len(prompt.ids) if prompt.ids else next(
            (r.extra.get("prompt_tokens") for r in runs.values() if r.extra.get("prompt_tokens")), None)
        record = PromptRecord(prompt.id, prompt.category, n_prompt, runs)
        for mm in mismatches([record], [r.name for r in runners if r.name in METHODS]):
            bar.write(f"!! MISMATCH: prompt {mm.prompt} ({mm.category}) {mm.method} differs from none at "
                      f"{mm.unit[:-1]} {mm.first_diff} ({mm.length} vs {mm.baseline_length} {mm.unit})",
                      file=sys.stderr)
        for name, run_ in runs.items():
            if not run_.extra.get("repeats_identical", True):
                bar.write(f"!! NONDETERMINISM: prompt {prompt.id} {name} produced different outputs across repeats",
                          file=sys.stderr)
        records.append(record)
    bar.close()
    return records


def build_results(args, methods, names, prompts, records, notes) -> dict:
    import torch

    from .report import git_info, machine_info

    categories = categories_in_order(prompts)
    summary = summarize(records, names, categories)
    spec_methods = [m for m in methods if m != BASELINE]
    mm = mismatches(records, spec_methods) if BASELINE in names else []
    strict = args.dtype in STRICT_DTYPES and args.temperature <= 0
    units = {rec.agreement(m)[3] for rec in records for m in spec_methods if rec.agreement(m)}
    overall = {s.method: s for s in summary if s.category == "all"}
    checked = [overall[m] for m in spec_methods if m in overall and overall[m].identical_fraction is not None]
    agreement = {
        "unit": "chars" if "chars" in units else "tokens",
        "strict": strict,
        "checked": bool(checked),
        "all_identical": bool(checked) and not mm,
        "identical_fraction": (sum(s.identical_fraction for s in checked) / len(checked)) if checked else None,
        "mean_prefix_fraction": (sum(s.prefix_agreement for s in checked) / len(checked)) if checked else None,
        "per_method": {s.method: {"identical_fraction": s.identical_fraction, "prefix_agreement": s.prefix_agreement}
                       for s in overall.values() if s.method != BASELINE},
        "mismatches": [vars(m) for m in mm],
    }
    if BASELINE not in names:
        notes.append("`none` was not run: no ratios and no losslessness check")
    if args.url and all(r.decode_s is None for rec in records for r in rec.runs.values()):
        notes.append("the server reports no per-request timing (`speculation.timing`): decode tokens/s and "
                     "gateway overhead are unavailable over HTTP; compare end-to-end tokens/s with an "
                     "in-process run of the same workload for the gateway's cost")
    if args.temperature > 0:
        notes.append(f"temperature {args.temperature}: sampled outputs are not expected to match token for token")
    workload = os.path.splitext(os.path.basename(args.workload))[0]
    return {
        "schema": "whiflash-bench/1",
        "command": command_line(args),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine_info(args.dtype, torch.get_num_threads()),
        "config": {
            "workload": args.workload, "workload_name": workload, "categories": categories,
            "prompts": len(prompts), "limit": args.limit, "methods": names, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "temperature": args.temperature, "seed": args.seed, "alpha": args.alpha, "policy": args.policy,
            "num_draft_tokens": args.num_draft_tokens, "block_size": args.block_size, "weights": args.weights,
            "formats": getattr(args, "resolved_formats", None),
            "mode": f"http {args.url}" if args.url else "in-process",
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "drafters": drafters_description(args), "out": args.out,
        },
        "summary": [s.as_dict() for s in summary],
        "agreement": agreement,
        "prompts": [{"id": r.id, "category": r.category, "prompt_tokens": r.prompt_tokens,
                     "runs": {m: run_.as_dict() for m, run_ in r.runs.items()}} for r in records],
        "notes": notes,
    }


def _rounded(obj, digits: int = 6):
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v, digits) for v in obj]
    return obj


def dump_json(results: dict) -> str:
    """Indented JSON, floats to 6 decimals (microseconds), token-id lists on one line each."""
    text = json.dumps(_rounded(results), indent=1)
    return INT_LIST.sub(lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)


def run(args: argparse.Namespace) -> int:
    from .report import plot, render_markdown, render_text

    if args.workload is None:
        if args.markdown and args.markdown != "-":
            with open(args.markdown) as f:
                print(render_markdown(json.load(f)))
            return 0
        raise SystemExit("whiflash bench: give --workload FILE (or --markdown RESULTS.json to render a results file)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    if args.url and args.peers:
        raise SystemExit("--peers runs in-process; benchmark the gateway (--url) and the peers in separate runs")
    if args.repeats < 1 or args.max_tokens < 1:
        raise SystemExit("--repeats and --max-tokens must be >= 1")
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    try:
        prompts = load_workload(args.workload, categories, args.limit)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"whiflash bench: {exc}") from exc

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    notes: list[str] = []
    if args.calibrate_router:
        return calibrate_router(args, prompts)
    if args.alpha_sweep:
        return alpha_sweep(args, prompts)
    runners = build_http(args, methods) if args.url else build_inprocess(args, methods, prompts, notes)
    names = [r.name for r in runners]
    records = measure(runners, prompts, args.max_tokens, args.repeats, warmup=not args.no_warmup)
    results = build_results(args, methods, names, prompts, records, notes)

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(dump_json(results) + "\n")
    if args.plot:
        plot(results, args.plot)
    print(render_text(results))
    if args.markdown == "-":
        print("\n" + render_markdown(results))
    elif args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_markdown(results) + "\n")
    written = [p for p in (args.out, args.plot, None if args.markdown in (None, "-") else args.markdown) if p]
    if written:
        print("wrote " + ", ".join(written))

    agr = results["agreement"]
    if agr["mismatches"]:
        banner = (f"LOSSLESSNESS VIOLATED: {len(agr['mismatches'])} mismatch(es) against none in {args.dtype}"
                  if agr["strict"] else
                  f"warning: {len(agr['mismatches'])} mismatch(es) against none in {args.dtype} "
                  f"(identical {agr['identical_fraction']:.0%}, prefix agreement {agr['mean_prefix_fraction']:.0%})")
        print(banner, file=sys.stderr)
        if agr["strict"]:
            return 1
    return 0


def calibrate_router(args, prompts) -> int:
    """Sweep the entropy threshold for the whiflash method (see calibrate.py)."""
    from ..chat import encode_chat
    from ..loading import load_engine
    from ..sampling import SamplingParams
    from .calibrate import choose, sweep

    thresholds = [float(t) for t in args.calibrate_router.split(",") if t.strip()]
    engine = load_engine(args.model, args.drafters, args.dtype, args.eagle3, args.dflash, args.threads,
                         weights=args.weights, device=args.device)
    if "whiflash" not in engine.methods:
        raise SystemExit("router calibration needs both an EAGLE-3 and a DFlash drafter")
    for p in prompts:
        p.ids = encode_chat(engine.tokenizer, p.messages, p.tools)
    # the router is calibrated on its own choices: no prompt-lookup rounds in between
    base = SpeculationConfig(method="whiflash", num_draft_tokens=args.num_draft_tokens, block_size=args.block_size,
                             prompt_lookup=False)
    results = sweep(engine, prompts, thresholds, args.max_tokens, SamplingParams(0.0, seed=args.seed), base)
    source = (f"whiflash bench --calibrate-router on {os.path.basename(args.workload)} ({len(prompts)} prompts, "
              f"max {args.max_tokens} tokens, {args.dtype}, drafters: {drafters_description(args)}), "
              f"{dt.datetime.now().astimezone().isoformat(timespec='seconds')}")
    calibration = choose(results, source)
    print(f"{'threshold':>9} {'acc. len':>8} {'tok/s':>7} {'round ms':>8} {'eagle3 share':>12}")
    for r in calibration.sweep:
        print(f"{r['threshold']:>9.2f} {r['acceptance_length']:>8.3f} {r['tokens_per_s']:>7.2f} "
              f"{r['round_ms']:>8.2f} {r['eagle3_round_share']:>12.2f}")
    print(f"threshold_al = {calibration.threshold_al}, threshold_tps = {calibration.threshold_tps}")
    round_ms = {p["threshold"]: p["round_ms"] for p in calibration.sweep}
    alpha_path = [{"alpha": alpha, "threshold": t, "round_ms": round_ms[t]}
                  for alpha in (a / 10 for a in range(11)) for t in [calibration.threshold(alpha)]]
    print("alpha -> threshold (measured round ms): " +
          ", ".join(f"{p['alpha']:.1f} -> {p['threshold']:g} ({p['round_ms']:.1f})" for p in alpha_path))
    if args.router_out:
        calibration.save(args.router_out)
        print(f"wrote {args.router_out}")
    if args.out:
        from dataclasses import asdict

        import torch

        from .report import git_info, machine_info

        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"schema": "whiflash-router-calibration/1", "command": command_line(args),
                       "created": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                       "git": git_info(), "machine": machine_info(args.dtype, torch.get_num_threads()),
                       "weights": args.weights, "calibration": asdict(calibration), "alpha_path": alpha_path},
                      f, indent=2)
        print(f"wrote {args.out}")
    return 0


def alpha_sweep(args, prompts) -> int:
    """whiflash at each alpha of --alpha-sweep on the workload, in-process, one table row per alpha.

    Same protocol as the bench: one engine, every prompt run at every alpha back to back with the
    order rotating per prompt, greedy; outputs are checked against the first alpha's (in float32
    every alpha must decode the same tokens)."""
    from ..chat import encode_chat
    from ..loading import load_engine
    from ..sampling import SamplingParams
    from .runners import EngineRunner

    alphas = [float(a) for a in args.alpha_sweep.split(",") if a.strip()]
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise SystemExit("--alpha-sweep: comma-separated alphas in [0, 1]")
    engine = load_engine(args.model, args.drafters, args.dtype, args.eagle3, args.dflash, args.threads,
                         **({"weights": args.weights} if args.weights != "dense" else {}))
    if "whiflash" not in engine.methods:
        raise SystemExit("the alpha sweep needs the whiflash method (an EAGLE-3 and a DFlash drafter)")
    for p in prompts:
        p.ids = encode_chat(engine.tokenizer, p.messages, p.tools)
    sampling = SamplingParams(args.temperature, seed=args.seed)
    runners = [EngineRunner(engine, "whiflash", sampling,
                            SpeculationConfig(method="whiflash", policy=args.policy, alpha=a,
                                              num_draft_tokens=args.num_draft_tokens, block_size=args.block_size))
               for a in alphas]
    if not args.no_warmup:
        for r in runners:
            r.run(prompts[0], min(8, args.max_tokens))
    totals = [{"alpha": a, "rounds": 0, "round_tokens": 0, "decode_tokens": 0, "decode_s": 0.0, "round_s": 0.0,
               "drafter_rounds": {}} for a in alphas]
    differ = 0
    for i, prompt in enumerate(prompts):
        outputs = {}
        for j in [(i + j) % len(alphas) for j in range(len(alphas))]:
            r = runners[j].run(prompt, args.max_tokens)
            t = totals[j]
            outputs[j] = r.tokens
            t["rounds"] += r.rounds
            t["round_tokens"] += r.round_tokens
            t["decode_tokens"] += r.decode_tokens
            t["decode_s"] += r.decode_s
            t["round_s"] += sum(r.times.get(k) or 0.0 for k in ("router", "catch_up", "draft", "verify"))
            for name, n in r.extra["drafter_rounds"].items():
                t["drafter_rounds"][name] = t["drafter_rounds"].get(name, 0) + n
        differ += any(outputs[j] != outputs[0] for j in outputs)
    rows = []
    for t in totals:
        rounds = t["rounds"] or 1
        rows.append({"alpha": t["alpha"], "acceptance_length": t["round_tokens"] / rounds,
                     "tokens_per_s": t["decode_tokens"] / t["decode_s"] if t["decode_s"] else None,
                     "round_ms": 1000.0 * t["round_s"] / rounds, "rounds": t["rounds"],
                     "round_share": {k: v / rounds for k, v in t["drafter_rounds"].items() if v}})
    print(f"{'alpha':>5} {'acc. len':>8} {'tok/s':>7} {'round ms':>8}  rounds by drafter")
    for r in rows:
        share = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["round_share"].items(), key=lambda kv: -kv[1]))
        print(f"{r['alpha']:>5.2f} {r['acceptance_length']:>8.3f} {r['tokens_per_s'] or 0:>7.2f} "
              f"{r['round_ms']:>8.2f}  {share}")
    if differ:
        print(f"{'LOSSLESSNESS VIOLATED' if args.dtype in STRICT_DTYPES else 'note'}: {differ} prompt(s) decoded "
              f"differently at different alphas ({args.dtype})", file=sys.stderr)
    if args.out:
        import torch

        from .report import git_info, machine_info

        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(dump_json({
                "schema": "whiflash-alpha-sweep/1", "command": command_line(args),
                "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "git": git_info(), "machine": machine_info(args.dtype, torch.get_num_threads()),
                "config": {"workload": args.workload, "prompts": len(prompts), "limit": args.limit,
                           "max_tokens": args.max_tokens, "policy": args.policy, "weights": args.weights,
                           "dtype": args.dtype, "drafters": drafters_description(args)},
                "rows": rows, "prompts_differing_across_alphas": differ}) + "\n")
        print(f"wrote {args.out}")
    return 1 if differ and args.dtype in STRICT_DTYPES and args.temperature <= 0 else 0
