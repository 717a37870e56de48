"""The prepared GPU check: one command, under 8 minutes on one H200, JSON out.

    python bench/gpu_check.py --device cuda --size 8b --out bench/results/gpu_check_h200.json

It needs only torch, safetensors and this repository's engine core (transformers only for the
small target-loader check; no network, no weights: everything is generated at run time), and
runs at toy size on the CPU in the test suite (tests/test_gpu_check.py), so it cannot rot.
Sections, each written to the JSON as it ends (a timeout keeps what was done):

  device      torch / CUDA versions, the GPU's properties, nvidia-smi and lscpu when present
  identity    every method (none, ngram, eagle3, dflash, whiflash, and an oracle drafter that
              gets long drafts accepted) against a plain greedy loop of 1-token forwards, on a
              small random model on the device, in float32 and float64
  checkpoints the target's drafters at --size shape with random weights, written to disk in the
              published layouts (SafeAILab EAGLE-3, z-lab DFlash: config.json + model.safetensors)
              and loaded back through our loaders; the loaded drafter must reproduce the saved one;
              and a small Llama 3 target through save_pretrained + our loader onto the device
  verify      the bf16 verify curve T(k), k = 1..32: one target forward over k tokens after a
              512-token context (median of repeats)
  throughput  tokens/s of every method against plain decode at fixed acceptance lengths 1, 2, 4, 6,
              driven by an oracle (random weights accept nothing, so acceptance is imposed), with
              each round's phase times measured in a second pass that synchronises the device
  memory      peak device memory

Fixed acceptance on random weights: the throughput target is built so that its greedy choice is
known without running it (`chain_target`): its embedding dominates the residual stream (the layers'
weights are small, their cost is the same) and its LM head maps each token to a fixed successor
pi(token) with a wide margin, so bf16 rounding cannot move the argmax. The oracle drafter then
proposes pi-chains with exactly `accept` correct tokens, and still runs the real drafter first so
that each round pays its real drafting cost.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.config import SpeculationConfig  # noqa: E402
from whiflash_core.drafters.base import Context, Draft, Drafter, DrafterState, DraftSampling  # noqa: E402
from whiflash_core.drafters.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids  # noqa: E402
from whiflash_core.drafters.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from whiflash_core.engine import METHODS, Engine, GenerationRequest  # noqa: E402
from whiflash_core.layers import init_linear_  # noqa: E402
from whiflash_core.sampling import SamplingParams  # noqa: E402
from whiflash_core.target import TargetConfig, TargetModel  # noqa: E402


@dataclass
class Size:
    """Shapes of one --size: the target, its drafters, and how long each measurement runs."""
    target: TargetConfig
    eagle3: Eagle3Config
    dflash: DFlashConfig
    context: int          # cached tokens before the verify curve / the throughput prompt
    new_tokens: int       # tokens per throughput generation
    reps: int             # timed repeats per verify-curve point


def llama_8b_size() -> Size:
    """Llama-3.1-8B's shapes; EAGLE-3 as SafeAILab's EAGLE3-LLaMA3.1-Instruct-8B (one layer, 32k
    draft vocabulary); DFlash with z-lab's layout (5 layers, block 16, shared embedding and head)."""
    t = TargetConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                     num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                     max_position_embeddings=8192, tie_word_embeddings=False, eos_token_ids=[])
    return Size(t, _eagle3_config(t, draft_vocab=32000), _dflash_config(t, layers=5, block=16),
                context=512, new_tokens=128, reps=10)


def toy_size() -> Size:
    """The same structure at sizes a CPU runs in seconds (the test suite's run)."""
    t = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
                     eos_token_ids=[])
    return Size(t, _eagle3_config(t, draft_vocab=256), _dflash_config(t, layers=2, block=8),
                context=64, new_tokens=24, reps=2)


SIZES = {"8b": llama_8b_size, "toy": toy_size}


def _eagle3_config(t: TargetConfig, draft_vocab: int) -> Eagle3Config:
    return Eagle3Config(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_heads=t.num_heads,
                        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
                        draft_vocab_size=draft_vocab, tap_layers=[2, t.num_layers // 2, t.num_layers - 3],
                        rms_norm_eps=t.rms_norm_eps, num_draft_tokens=6)


def _dflash_config(t: TargetConfig, layers: int, block: int) -> DFlashConfig:
    return DFlashConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=layers,
                        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                        vocab_size=t.vocab_size, block_size=block, mask_token_id=t.vocab_size - 1,
                        target_layer_ids=default_target_layer_ids(t.num_layers, layers),
                        num_target_layers=t.num_layers, rms_norm_eps=t.rms_norm_eps)


# --- the device ----------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device (timings on a GPU are otherwise kernel launches, not kernel runs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _command(args: list[str]) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def describe(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": str(device), "cpu": platform.processor() or platform.machine(),
           "cpu_threads": torch.get_num_threads(), "lscpu": _command(["lscpu"])}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                      "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}
        out["nvidia_smi"] = _command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                      "power.limit", "--format=csv"])
    return out


# --- random models ----------------------------------------------------------------------------


def random_target(cfg: TargetConfig, dtype: torch.dtype, device: torch.device, seed: int,
                  std: float = 0.02, embed_std: float = 1.0) -> TargetModel:
    """A TargetModel with random weights, created on `device` in `dtype` directly (an 8B model in
    bf16 is 16 GB: never built on the CPU, never in float32)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = TargetModel(cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        init_linear_(model, std=std)
        torch.nn.init.normal_(model.embed_tokens.weight, std=embed_std)
    return model.eval()


def chain_target(cfg: TargetConfig, dtype: torch.dtype, device: torch.device,
                 seed: int) -> tuple[TargetModel, torch.Tensor]:
    """(target, pi): a random target whose greedy next token after t is pi[t] whatever the context.

    Layers with small weights (std 0.002: each adds ~1 % to the residual stream) leave the final
    hidden state close to the token's own embedding e_t; the LM head's row pi[t] is e_t, so logit
    pi[t] is |e_t|^2 ~ hidden while every other logit is a random inner product ~ sqrt(hidden).
    The compute is that of any model of these shapes."""
    model = random_target(cfg, dtype, device, seed, std=0.002)
    g = torch.Generator().manual_seed(seed)
    pi = torch.randperm(cfg.vocab_size, generator=g).to(device)
    with torch.no_grad():
        head = torch.empty_like(model.lm_head.weight)
        head[pi] = model.embed_tokens.weight
        model.lm_head.weight.copy_(head)
    return model, pi


def random_drafters(target: TargetModel, size: Size, seed: int) -> dict[str, Drafter]:
    """Untrained EAGLE-3 and DFlash drafters of `size`'s shapes, created on the target's device."""
    rows = torch.randperm(size.target.vocab_size, generator=torch.Generator().manual_seed(seed)).to(target.device)
    with torch.device(target.device):
        eagle = Eagle3Drafter.random(size.eagle3, target.embed_tokens, seed=seed, dtype=target.dtype,
                                     vocab_rows=rows[: size.eagle3.draft_vocab_size])
        dflash = DFlashDrafter.random(size.dflash, target.embed_tokens, target.lm_head, seed=seed + 1,
                                      dtype=target.dtype)
    return {"eagle3": eagle, "dflash": dflash}


# --- (a) identity ----------------------------------------------------------------------------


def plain_greedy(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    """The reference: one 1-token forward per token, argmax, no engine."""
    cache = target.new_cache(len(prompt) + n + 1)
    ids = torch.tensor(prompt, device=target.device)
    out = []
    for _ in range(n):
        tok = int(target(ids, cache).logits[-1].argmax())
        out.append(tok)
        ids = torch.tensor([tok], device=target.device)
    return out


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation, corrupting a token now and then (seeded), so that
    drafts are accepted at every length: the engine's bookkeeping of long accepts is exercised."""

    name = "oracle"

    def __init__(self, truth: list[int], prompt_len: int, vocab: int, error_rate: float = 0.2, seed: int = 0):
        self.truth, self.prompt_len, self.vocab, self.error_rate = truth, prompt_len, vocab, error_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.max_draft_tokens = 6

    def new_state(self, capacity):
        return DrafterState()

    def propose(self, state, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        pos = ctx.n + 1 - self.prompt_len  # index in the output of the first draft token
        out = []
        for i in range(num_tokens):
            tok = self.truth[pos + i] if pos + i < len(self.truth) else 0
            if torch.rand(1, generator=self.rng).item() < self.error_rate:
                tok = (tok + 1) % self.vocab
            out.append(tok)
        return Draft(torch.tensor(out, device=ctx.ids.device))


def check_identity(device: torch.device, dtype: torch.dtype, n_tokens: int = 32) -> dict:
    """Every method's greedy output equals `plain_greedy`'s on a small random model (std 0.2, so
    the logits are spread and no tie decides anything)."""
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
                       eos_token_ids=[])
    target = random_target(cfg, dtype, device, seed=0, std=0.2)
    small = Size(cfg, _eagle3_config(cfg, draft_vocab=48), _dflash_config(cfg, layers=2, block=5), 0, 0, 0)
    engine = Engine(target, None, random_drafters(target, small, seed=1))
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, cfg.vocab_size, (12,), generator=g).tolist()
    prompts = [head + head[:6] + torch.randint(0, cfg.vocab_size, (8,), generator=g).tolist() + head[:5],
               torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()]
    results = {}
    for p_index, prompt in enumerate(prompts):
        reference = plain_greedy(target, prompt, n_tokens)
        threshold = _median_entropy(engine, prompt, n_tokens)
        for method in METHODS:
            spec = SpeculationConfig(method=method, entropy_threshold=threshold)
            gen = engine.generate(GenerationRequest(prompt, n_tokens, speculation=spec))
            _record(results, method, gen.output, reference, gen.stats())
        oracle_engine = Engine(target, None, {"eagle3": OracleDrafter(reference, len(prompt), cfg.vocab_size,
                                                                       seed=p_index)})
        gen = oracle_engine.generate(GenerationRequest(prompt, n_tokens, speculation=SpeculationConfig(
            method="eagle3", num_draft_tokens=5)))
        _record(results, "oracle", gen.output, reference, gen.stats())
        # T > 0 on the device: the sampling path runs there (no identity to check, only that it runs)
        for method in METHODS:
            gen = engine.generate(GenerationRequest(prompt, 8, SamplingParams(temperature=0.8, seed=p_index),
                                                    SpeculationConfig(method=method)))
            results[method]["sampled_tokens"] = results[method].get("sampled_tokens", 0) + len(gen.output)
    return results


def _median_entropy(engine: Engine, prompt: list[int], n: int) -> float | None:
    """A router threshold at the median entropy of this prompt's rounds, so whiflash switches."""
    gen = engine.start(GenerationRequest(prompt, n, speculation=SpeculationConfig(method="whiflash")))
    gen.prefill()
    entropies = []
    while not gen.finished:
        r = gen.step()
        if r.entropy is not None:
            entropies.append(r.entropy)
    return float(torch.tensor(entropies).median()) if entropies else None


def _record(results: dict, method: str, output: list[int], reference: list[int], stats: dict) -> None:
    r = results.setdefault(method, {"identical": True, "tokens": 0, "accepted": 0, "rounds": 0})
    same = output == reference
    if not same and r["identical"]:
        r["first_mismatch"] = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b),
                                   min(len(output), len(reference)))
    r["identical"] = r["identical"] and same
    r["tokens"] += len(output)
    r["accepted"] += stats["accepted_tokens"]
    r["rounds"] += stats["rounds"]


# --- (b) checkpoints in the published layouts --------------------------------------------------


def check_checkpoints(target: TargetModel, drafters: dict[str, Drafter], directory: str) -> tuple[dict, dict]:
    """Write the drafters as SafeAILab EAGLE-3 and z-lab DFlash checkpoints, load them back through
    `Eagle3Drafter.load` / `DFlashDrafter.load`, and compare their drafts on one context."""
    report, loaded = {}, {}
    for name, kind, save in (("eagle3", Eagle3Drafter, lambda d, p: d.save(p, layout="safeailab")),
                             ("dflash", DFlashDrafter, lambda d, p: d.save(p))):
        path = os.path.join(directory, name)
        t0 = time.perf_counter()
        save(drafters[name], path)
        t1 = time.perf_counter()
        loaded[name] = kind.load(path, target)
        sync(target.device)
        t2 = time.perf_counter()
        files = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        same = _same_drafts(target, drafters[name], loaded[name])
        report[name] = {"files": files, "config_keys": sorted(config), "save_s": round(t1 - t0, 2),
                        "load_s": round(t2 - t1, 2), "device": str(next(loaded[name].parameters()).device),
                        "params": sum(p.numel() for p in loaded[name].parameters()
                                      if p is not target.embed_tokens.weight),
                        "same_drafts_as_saved": same}
    return report, loaded


def _same_drafts(target: TargetModel, a: Drafter, b: Drafter) -> bool:
    """Both drafters propose the same tokens on one random context (saved in the model's dtype, so
    the round trip is exact)."""
    n = 24
    ids = torch.randint(0, target.cfg.vocab_size - 1, (n + 1,), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([ids, torch.zeros(64, dtype=torch.long)]).to(target.device)
    taps = tuple(sorted(set(a.tap_layers)))
    out = target(ids[:n], target.new_cache(n + 1), taps)
    buf = torch.zeros(n + 64, len(taps), target.cfg.hidden_size, dtype=target.dtype, device=target.device)
    buf[:n] = out.taps
    drafts = [d.propose(d.new_state(n + 64), Context(ids, n, buf, taps), 5, DraftSampling()).tokens.tolist()
              for d in (a, b)]
    return drafts[0] == drafts[1]


def check_target_loader(device: torch.device, directory: str) -> dict:
    """A small random Llama 3 (llama3 RoPE scaling) in Hugging Face's layout, written with
    `save_pretrained` and read back both ways `load_target` reads a --model directory (on a GPU
    `from_safetensors`, on the CPU transformers then `from_hf`), on the device: in float64 our
    (float32) logits must match transformers' own there. (The 8B target is not written: 16 GB of
    random weights to disk and back would take a good part of the time budget.)"""
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return {"skipped": f"transformers not importable: {e}"}
    from whiflash_core.loading import from_hf, from_safetensors

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_parameters={
                             "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    path = os.path.join(directory, "target")
    LlamaForCausalLM(config).save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path).double().eval()
    # the two ways load_target builds a target: off the CPU straight from the files, else via transformers
    loaders = {"from_safetensors": from_safetensors(path, torch.float64, device),
               "from_hf": from_hf(hf, torch.float64).to(device)}
    hf = hf.to(device)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = hf(ids).logits[0].double()
    out = {"files": sorted(os.listdir(path))}
    for name, ours in loaders.items():
        logits = ours(ids[0], ours.new_cache(41)).logits.double()
        out[name] = {"device": str(ours.device), "max_abs_logit_diff": float((logits - ref).abs().max()),
                     "same_argmax": bool((logits.argmax(-1) == ref.argmax(-1)).all())}
    return out


# --- (c) the verify curve ----------------------------------------------------------------------


def verify_curve(target: TargetModel, context: int, reps: int, max_k: int = 32) -> dict[int, float]:
    """Median seconds of one target forward over k tokens after `context` cached ones."""
    device = target.device
    cache = target.new_cache(context + max_k + 1)
    ids = torch.randint(0, target.cfg.vocab_size, (context + max_k,), device=device)
    target(ids[:context], cache)
    curve = {}
    for k in range(1, max_k + 1):
        times = []
        for rep in range(reps + 2):  # two warm-up runs
            sync(device)
            t0 = time.perf_counter()
            target(ids[context:context + k], cache)
            sync(device)
            if rep >= 2:
                times.append(time.perf_counter() - t0)
            cache.rollback(context)
        curve[k] = sorted(times)[len(times) // 2]
    return curve


# --- (d) throughput at fixed acceptance ----------------------------------------------------------


class FixedAcceptance(Drafter):
    """Wraps a real drafter: runs its proposal (so the round pays its drafting cost), then replaces
    the tokens by a pi-chain of which exactly `accept` are the target's choices."""

    def __init__(self, inner: Drafter, chains: torch.Tensor, accept: int, sync_phases: bool = False):
        self.inner, self.chains, self.accept = inner, chains, accept
        self.name, self.tap_layers = inner.name, inner.tap_layers
        self.max_draft_tokens = max(inner.max_draft_tokens, accept + 1)
        self.default_draft_len = inner.default_draft_len
        self.sync_phases = sync_phases
        self.seconds = {"catch_up": 0.0, "draft": 0.0}  # measured only with sync_phases

    def __getattr__(self, attr):  # the router asks the prompt-lookup drafter for its match
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def draft_len(self, spec) -> int:
        return max(self.inner.draft_len(spec), self.accept + 1)

    def new_state(self, capacity):
        return self.inner.new_state(capacity)

    def _timed(self, phase: str, fn, ctx: Context):
        """fn(), timed to its end on the device when sync_phases (else not waited for)."""
        if not self.sync_phases:
            return fn()
        sync(ctx.ids.device)
        t0 = time.perf_counter()
        out = fn()
        sync(ctx.ids.device)
        self.seconds[phase] += time.perf_counter() - t0
        return out

    def catch_up(self, state, ctx):
        self._timed("catch_up", lambda: self.inner.catch_up(state, ctx), ctx)

    def propose(self, state, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        self._timed("draft", lambda: self.inner.propose(state, ctx, num_tokens, sampling), ctx)
        # the pending token's chain, looked up on the device (no host read); wrong from `accept` on
        chain = self.chains[ctx.ids[ctx.n:ctx.n + 1]][0, :num_tokens]  # a 1-element index: no .item()
        wrong = (chain + 1) % self.chains.shape[0]
        return Draft(torch.cat([chain[:self.accept], wrong[self.accept:]]))


def throughput(target: TargetModel, pi: torch.Tensor, drafters: dict[str, Drafter], size: Size,
               lengths=(1, 2, 4, 6), methods=("ngram", "eagle3", "dflash", "whiflash")) -> dict:
    """tokens/s of plain decode and of each method at each fixed acceptance length."""
    from whiflash_core.drafters.ngram import NgramDrafter

    device = target.device
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, size.target.vocab_size, (size.context,), generator=g).tolist()
    all_drafters = {**drafters, "ngram": NgramDrafter()}
    # chains[t, j] = pi^(j+1)(t): the target's next j+1 choices after token t
    longest = max(size.dflash.block_size, size.eagle3.num_draft_tokens, max(lengths)) + 1
    steps = [pi]
    for _ in range(longest - 1):
        steps.append(pi[steps[-1]])
    chains = torch.stack(steps, dim=1)

    def run(engine: Engine, spec: SpeculationConfig) -> tuple[float, object]:
        gen = engine.start(GenerationRequest(prompt, size.new_tokens, speculation=spec))
        gen.prefill()
        sync(device)
        t0 = time.perf_counter()
        while not gen.finished:
            gen.step()
        sync(device)
        return (len(gen.output) - 1) / (time.perf_counter() - t0), gen

    plain_engine = Engine(target, None, {})
    run(plain_engine, SpeculationConfig(method="none"))  # warm-up
    plain_tps, gen = run(plain_engine, SpeculationConfig(method="none"))
    expected, tok = [], prompt[-1]
    for _ in range(len(gen.output)):
        tok = int(pi[tok])
        expected.append(tok)
    # the imposed acceptance holds only if the target really follows pi
    out = {"plain_tokens_per_s": round(plain_tps, 2), "target_follows_pi": gen.output == expected, "methods": {}}
    for method in methods:
        rows = {}
        for length in lengths:
            row = {}
            for sync_phases in (False, True):  # tokens/s unsynchronised; phase times synchronised
                wrapped = {name: FixedAcceptance(d, chains, length - 1, sync_phases)
                           for name, d in all_drafters.items()}
                engine = Engine(target, None, wrapped)
                spec = SpeculationConfig(method=method)
                if not sync_phases:
                    run(engine, spec)  # warm-up (caches, kernels)
                tps, gen = run(engine, spec)
                stats = gen.stats()
                if not sync_phases:
                    row.update(tokens_per_s=round(tps, 2), speedup=round(tps / plain_tps, 3),
                               acceptance_length=round(stats["acceptance_length"], 3), rounds=stats["rounds"],
                               mean_draft_len=round(stats["draft_tokens"] / stats["rounds"], 2),
                               drafter_rounds={n: d["rounds"] for n, d in stats["drafters"].items()})
                else:
                    # per round, each phase waited for: router (with its entropy read), the drafter's
                    # catch-up and drafting, then verify (target forward, the host read, commit)
                    timing, per_round = gen.timing(), 1e3 / stats["rounds"]
                    row["round_ms"] = {
                        "router": round(timing["router"] * per_round, 3),
                        **{phase: round(sum(d.seconds[phase] for d in wrapped.values()) * per_round, 3)
                           for phase in ("catch_up", "draft")},
                        "verify": round(timing["verify"] * per_round, 3)}
            rows[length] = row
            print(f"throughput {method} AL {length}: {row['tokens_per_s']} tokens/s "
                  f"(plain {out['plain_tokens_per_s']})", file=sys.stderr, flush=True)
        out["methods"][method] = rows
    return out


# --- the run ---------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default="8b", choices=sorted(SIZES))
    p.add_argument("--out", required=True, help="JSON results file (rewritten after every section)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="skip the remaining sections once this much time has passed (default 450 s)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    started = time.perf_counter()
    size = SIZES[args.size]()
    results: dict = {"size": args.size, "device": describe(device), "shapes": {
        "target": asdict(size.target), "eagle3": asdict(size.eagle3), "dflash": asdict(size.dflash)}}

    def section(name: str, fn) -> None:
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            results[name] = {"skipped": f"time budget spent ({elapsed:.0f} s)"}
        else:
            t0 = time.perf_counter()
            results[name] = fn()
            results.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 2)
            print(f"{name}: done in {results['section_s'][name]} s", file=sys.stderr, flush=True)
        if device.type == "cuda":
            results["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    print(json.dumps(results["device"], indent=2), file=sys.stderr, flush=True)
    section("identity", lambda: {str(dt).replace("torch.", ""): check_identity(device, dt)
                                 for dt in (torch.float32, torch.float64)})
    # one bf16 target of --size shape serves the checkpoint, verify and throughput sections
    target, pi = chain_target(size.target, torch.bfloat16, device, seed=0)
    drafters = random_drafters(target, size, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        loaded: dict = {}

        def checkpoints():
            report, found = check_checkpoints(target, drafters, tmp)
            loaded.update(found)
            report["target"] = check_target_loader(device, tmp)
            return report
        section("checkpoints", checkpoints)
    drafters = loaded or drafters  # time the drafters as our loaders built them
    section("verify", lambda: {"context": size.context, "seconds": verify_curve(target, size.context, size.reps),
                               "cuda_graphs": "not implemented yet"})
    section("throughput", lambda: throughput(target, pi, drafters, size))
    results["total_s"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    ok = all(r["identical"] for per_dtype in results["identity"].values() if isinstance(per_dtype, dict)
             for r in per_dtype.values() if isinstance(r, dict))
    print(f"identity {'holds' if ok else 'FAILS'}; results in {args.out} ({results['total_s']} s)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
