"""Measure the CPU at hand and pick the target's formats per phase (`--weights auto`).

Which format is fastest depends on the machine, not on ours: on a CPU with native bf16 (AVX-512
bf16, AMX) a bf16 GEMM is quick, while on an AVX2 CPU bf16 is emulated and a float32 prefill runs
several times faster than a bf16 one (bench/results/prefill_probe_avx2.json: 5.6x for a 1,024-token
prompt); PyTorch's int4/int8 weight-only kernels decode fastest with bf16 activations and crawl
with float32 ones (3-6x slower, same AVX2 machine). So the engine times the candidates here, on
the shapes of the model it is about to load, and picks per phase:

- decode / verify (1-8 rows): the (activation dtype, weight format) with the cheapest
  T(1) + T(4), a plain step plus the 4-row verify of a k=3 EAGLE-3 round. The activation dtype
  matters even where the weight kernels run in bf16 (quant.KERNEL_DTYPE): float32 activations
  keep the norms, rotary, attention and residual adds native where bf16 is emulated;
- the LM head of a light format: weight-only int8 or the dynamic int8 GEMM (quant.HEAD_KINDS),
  timed on its own;
- prefill (many rows): bf16 or float32 dense, whichever runs a 128-row chunk faster; where that is
  another dtype than decode's, the target gets a float32 twin for long inputs
  (`TargetModel.set_prefill_twin`), from the smallest measured row count where the twin wins.

Timing runs on random weights of the real shapes, FORMATS_CONTEXT positions cached (an agent
conversation's length): a model with no layers (embedding, norm, head)
and one with n = min(L, 8) layers give the whole model's cost as T0 + (L / n) * (Tn - T0) without
building all of it. Each figure is the best of a few runs (interference only adds time), a table
whose times fall as rows grow is timed again and cached only where the next attempt reproduces it
(out_of_order, reproduced: then it is the CPU's own shape, not interference), and timings taken
while other processes kept busy the CPUs this one's threads need are timed again at the first
start that finds the machine quiet (`contended`). It takes
seconds to a minute, once: it is cached per CPU model, ISA flags, thread count, torch
version and model shape (in ~/.cache/whiflash, or $WHIFLASH_CACHE_DIR). `whiflash info` prints it.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from .cache import cache_root

DECODE_ROWS = (1, 4, 8)
VERIFY_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # the router's verify-cost table (costs.py)
# the shared-forward table (Engine.step_many: several requests' verify rows in one forward): total
# rows, as requests of SHARED_SEGMENT_ROWS rows each (1 + a draft of 3), each over its own cache
SHARED_ROWS = (2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64)
SHARED_SEGMENT_ROWS = 4
PREFILL_ROWS = (8, 16, 24, 32, 64, 128)
LIGHT_PREFILL_ROWS = PREFILL_ROWS[:4]  # light formats lose to dense GEMMs well before 64 rows...
# ...except q4_1, whose forwards past the layer stack's rows run as chunks through it
# (TargetModel._forward_in_chunks): timed at every prefill row count, it may keep the prefill of an
# agent turn's new tokens (tens of rows) where a dense GEMM would cost more
CHUNKED_FORMATS = ("q4_1",)
WARMUP_FORWARDS = 20  # untimed one-row forwards before the verify table (a cold process runs slow)
# a row count of the verify tables is timed `reps` times, or fewer (two at least) once its runs add
# up to this: a float32 verify at 1 thread runs 50-360 ms a forward, and five of each of the 23
# row counts took ~30 s an attempt; a Q4_1 one (3-20 ms) still gets all five
TIMING_BUDGET_S = 0.3
CONTEXT = 256  # cached positions the verify-cost table's forwards attend to (verify_table)
# A verify's attention reads every cached position's K/V, so its time grows with the context: rounds
# at 2k positions of an agent conversation ran 3.5-4.7x the verify table's times at CONTEXT (rounds
# under 1k 2.0-2.3x, beside a training job). context_table times the growth per cached position
# between CONTEXT and LONG_CONTEXT for these row counts; a shared step is priced with it (costs.py).
LONG_CONTEXT = 1280
CONTEXT_ROWS = (1, 2, 4, 8, 16)
# cached positions the format timings attend to: an agent conversation's length (system prompt, tool
# schemas, earlier turns), where reading the KV cache is a good part of a decode step. Timed at 256
# positions, float32 activations (so a float32 KV cache: twice the bytes) won natively, and then
# decoded the 580-2,500-token agentic workload slower than bf16 (plain 51.2 vs 53.6 tok/s, one run
# each; that run's files were replaced by the committed rerun at 1,024)
FORMATS_CONTEXT = 1024
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile",
             "fma", "f16c", "asimd", "sve", "bf16")
CACHE_VERSION = 11
VERIFY_CACHE_VERSION = 6
# A forward's time only grows with its rows, so a table where fewer rows cost clearly more than
# more rows was timed while other work ran (seen: a verify table cached beside a training job read
# T(1) = 25.0 ms > T(4) = 17.2 ms; quiet, 2.94 and 5.43 ms). Such a table is timed again, up to
# MEASURE_ATTEMPTS times in all. One still out of order after all of them is taken as each row
# count's best over the attempts (interference only adds time), read from below, and cached: it
# was once not cached, and on a VM whose attempts differ by 20-40 % (a float32 verify at 1 thread,
# T(1) 73, 73 and 51 ms, T(12) > T(16) in each: the GEMM library's shape, see REPEAT_SLACK) every
# start then spent three 30-s attempts on a table it threw away. The slack is relative plus
# absolute: a tiny model's forwards differ by noise alone.
ORDER_SLACK = (1.15, 1e-3)
MEASURE_ATTEMPTS = 3
# ... and no attempt starts once the attempts so far took MEASURE_BUDGET_S: a float32 verify table at
# one thread (AMD EPYC Zen 3) took 11-13 s an attempt, out of order in each (T(3) > T(4), T(9) > T(12),
# never twice the same way), so every cold start spent ~38 s on three of them for the envelope that
# the first one gives within its noise; a Q4_1 table (~2-3 s an attempt) still gets all of them.
MEASURE_BUDGET_S = 10.0
# ... unless the CPU itself runs fewer rows slower: on an AMX Xeon (2 cores, 1 thread) a float32 verify
# read T(12) = 139 ms, T(16) = 114 ms in every attempt (the GEMM library changes kernels at 16 rows),
# and being never cached every server start spent three 21-s attempts on it. Interference does not
# repeat itself: two attempts in a row out of order and within REPEAT_SLACK of each other at every
# row count are the machine's own shape, used as timed (the better of the two) and cached.
REPEAT_SLACK = (1.10, 1e-3)
# A busy machine can also slow every row count alike, which no ordering shows: at 2 threads on a
# 2-core AMD EPYC beside a one-core training job (this repo's own background work) the format table
# read bf16/q4_1 T(1) = 23.3 ms, T(128) = 602 ms and bf16/dense T(128) = 667 ms, quiet 6.8, 137 and
# 188 ms, every table in order, and would have been cached for good. So each attempt also reads how
# much CPU other processes took on the CPUs this process may run on (/proc/stat, Linux); beyond the
# CPUs its threads leave free, plus this slack in cores, the attempt counts as contended, and its
# tables are cached marked so: a machine that stays busy starts at once with them, and the first
# start that finds it quiet times them again.
OTHERS_SLACK = 0.25
# A table timed while other work ran can also pass all of that: the work came and went within the
# attempt (too little on average to count as contended) or never showed in /proc/stat (a
# hypervisor's other guests on a VM without steal accounting). Once cached it priced every round of
# every later start: a 2-thread Q4_1 verify table on an AMD EPYC Zen 3 read T(4) = 11.2 ms where
# the same machine ran it in 7.4 ms, and routed 47 % of Spec-Bench's rounds to plain decode (7 %
# once timed again, bench/results/router_ab_retimed_zen3.json). So a start that finds a cached
# verify table times these row counts again (a few forwards, after a short warm-up) and times the
# whole table again where the cache reads any of them over SPOT_SLACK times slower than now.
# Interference only adds time: a start that runs them slower (a busy machine now) keeps the cache.
SPOT_ROWS = (1, 4)
SPOT_SLACK = (1.15, 2e-4)
SPOT_REPS = 5
SPOT_WARMUP_S = 0.1   # warm-up forwards (one row) for at most this long, at least two


@dataclass(frozen=True)
class Formats:
    """What the target runs: `dtype` activations with `weights` for decode and verify, and long
    inputs (>= prefill_from_rows) in `prefill_dtype` with dense weights."""
    dtype: str = "bfloat16"
    weights: str = "dense"
    prefill_dtype: str = "bfloat16"
    prefill_from_rows: int = 24
    head: str = "int8"  # the LM head's kind with light weights (quant.HEAD_KINDS)


# --------------------------------------------------------------------------- the machine

def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`; empty where /proc/cpuinfo is missing)."""
    m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", _cpuinfo(), re.M)
    return set(m.group(1).split()) if m else set()


def cpu_info() -> dict:
    """CPU model, the ISA flags that decide kernels, threads and torch version."""
    m = re.search(r"^model name\s*:\s*(.+)$", _cpuinfo(), re.M)
    model = m.group(1).strip() if m else (platform.processor() or platform.machine())
    flags = cpu_flags()
    forced = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
              if k in os.environ}
    return {"cpu": model, "machine": platform.machine(), "isa": sorted(f for f in ISA_FLAGS if f in flags),
            "kernels": torch.backends.cpu.get_cpu_capability(), "forced": forced,
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _cache_path(key: dict, kind: str = "formats") -> str:
    root = cache_root()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, f"{kind}-{digest}.json")


def _write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- timing

def out_of_order(table: dict[int, float], slack: tuple[float, float] = ORDER_SLACK) -> bool:
    """True where some row count costs more than slack beyond a larger one's time."""
    later = float("inf")
    for r in sorted(table, reverse=True):
        if table[r] > slack[0] * later + slack[1]:
            return True
        later = min(later, table[r])
    return False


def envelope(table: dict[int, float]) -> dict[int, float]:
    """T(r) = min over r' >= r of T(r'): the table in order, read from below (interference only adds time)."""
    out, later = {}, float("inf")
    for r in sorted(table, reverse=True):
        later = out[r] = min(later, table[r])
    return dict(sorted(out.items()))


def reproduced(a: dict[int, float], b: dict[int, float], slack: tuple[float, float] = REPEAT_SLACK) -> bool:
    """Two timings of one table that agree at every row count (within slack)."""
    return a.keys() == b.keys() and all(max(a[r], b[r]) <= slack[0] * min(a[r], b[r]) + slack[1] for r in a)


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds the given CPUs have spent busy since boot (every /proc/stat state but idle and
    iowait; steal included: a hypervisor's other guests are other work too). None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    ticks = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            t = [int(x) for x in fields[1:9]]   # user nice system idle iowait irq softirq steal
            ticks += sum(t) - t[3] - t[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def _our_cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def others_load(time_once):
    """(time_once(), the cores other processes kept busy meanwhile on this process's CPUs, None
    where that cannot be read)."""
    cpus = _our_cpus()
    busy, own, wall = _busy_seconds(cpus), time.process_time(), time.perf_counter()
    result = time_once()
    after = _busy_seconds(cpus)
    if busy is None or after is None:
        return result, None
    own, wall = time.process_time() - own, time.perf_counter() - wall
    return result, max(after - busy - own, 0.0) / max(wall, 1e-9)


def contended(others: float | None) -> bool:
    """Did other work (`others_load` cores) take CPU that this process's threads needed?"""
    spare = max(len(_our_cpus()) - torch.get_num_threads(), 0)
    return others is not None and others > spare + OTHERS_SLACK


def quiet_now(seconds: float = 0.25) -> bool:
    """No other work competing for this process's CPUs over a short look (`contended`)."""
    return not contended(others_load(lambda: time.sleep(seconds))[1])


def _timed_in_order(time_once, what: str) -> tuple[dict, float | None]:
    """time_once() -> {name: {rows: seconds}}, timed until no table is out of order (MEASURE_ATTEMPTS
    times at most), and not again once other work competed for the CPUs (`contended`: that work is
    rarely gone a minute later). Returns (tables, the other work's cores if it competed else None),
    for the caller to cache with `_marks`: tables out of order the same way in two attempts in a row
    are the CPU's own shape (`reproduced`) and come as timed, the better of the two; tables still
    out of order after every attempt (MEASURE_ATTEMPTS, or fewer once they took MEASURE_BUDGET_S)
    come as the lower envelope of each row count's best over the attempts; contended ones come as
    timed, read from below, and are cached marked so (a later start that finds the machine quiet
    times them again, a busy one starts at once with them: `_cached`)."""
    previous, best, started = None, None, time.perf_counter()
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        tables, others = others_load(time_once)
        if contended(others):
            print(f"whiflash: the {what} timings ran beside other work ({others:.1f} cores of it on this "
                  "process's CPUs); cached as such, timed again at the next start that finds the machine "
                  "quiet", file=sys.stderr, flush=True)
            return {name: envelope(t) for name, t in tables.items()}, others
        if not any(map(out_of_order, tables.values())):
            return tables, None
        if previous is not None and previous.keys() == tables.keys() and all(
                reproduced(previous[name], t) for name, t in tables.items()):
            return _lower(previous, tables), None
        previous = tables
        best = tables if best is None else _lower(best, tables)
        if time.perf_counter() - started >= MEASURE_BUDGET_S:
            break
    print(f"whiflash: the {what} timings stayed out of order in {attempt} attempt(s), each differently; "
          "using the lower envelope of their best times (cached)", file=sys.stderr, flush=True)
    return {name: envelope(t) for name, t in best.items()}, None


def _lower(a: dict, b: dict) -> dict:
    """Two timings of the same tables, each row count at the lower (interference only adds time)."""
    return {name: {r: min(v, a[name][r]) for r, v in t.items()} for name, t in b.items()}


def _cached(path: str, use_cache: bool) -> dict | None:
    """The cached timing file at path, unless use_cache is off or it was timed beside other work
    and the machine is quiet now (time it again, then)."""
    if not (use_cache and os.path.exists(path)):
        return None
    with open(path) as f:
        saved = json.load(f)
    if saved.get("contended") is not None and quiet_now():
        return None
    return saved


def _trusted(saved: dict, tables) -> bool:
    """A cached file's tables are used where in order, or out of order the way two attempts in a
    row timed them (marked "reproduced" when cached); anything else was cached by an older build
    beside other work, and is timed again."""
    return bool(saved.get("reproduced")) or not any(map(out_of_order, tables))


def _marks(tables, others: float | None) -> dict:
    """What a timing file records beside its tables: the other work's cores if it competed, that
    its tables are out of order as reproduced (`_timed_in_order`)."""
    if others is not None:
        return {"contended": round(others, 2)}
    return {"reproduced": True} if any(map(out_of_order, tables)) else {}


def _random_dense(cfg, layers: int) -> torch.nn.Module:
    """A float32 model of cfg's shapes with `layers` decoder layers and random weights (std 0.02)."""
    from .target import TargetModel

    torch.manual_seed(0)
    model = TargetModel(dataclasses.replace(cfg, num_layers=layers)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def _random_model(cfg, layers: int, dtype: torch.dtype, weights: str, head: str = "int8",
                  bases: dict | None = None):
    """A model of cfg's shapes, `layers` layers, random weights in the given format. `bases` keeps
    the dense float32 models it copies from between calls: building and filling one took ~1.5 s
    of a ~2 s call (AMD EPYC, one thread), and the format table builds 22 of them."""
    from .quant import Int4Linear, Q41Linear, quantize_head, quantize_int8

    bases = {} if bases is None else bases
    if layers not in bases:
        bases[layers] = _random_dense(cfg, layers)
    model = copy.deepcopy(bases[layers]).to(dtype)
    if weights in ("int4", "q4_1"):  # random Q4_1 blocks: only the kernel's speed matters here
        linear = Q41Linear if weights == "q4_1" else Int4Linear
        rng = np.random.default_rng(0)
        for name, mod in list(model.named_modules()):
            if isinstance(mod, torch.nn.Linear) and mod.bias is None and name != "lm_head":
                n, k = mod.weight.shape
                q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
                d = np.full((n, k // 32), 0.01, np.float32)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, linear(q, d, -8 * d))
        if weights == "q4_1":  # as quant.apply_weight_format: the rest of the layer in C too
            from . import decode_ops
            decode_ops.use_for(model)
    elif weights == "int8":
        quantize_int8(model, names=[n for n, m in model.named_modules()
                                    if isinstance(m, torch.nn.Linear) and n != "lm_head"])
    if weights != "dense":
        quantize_head(model, head)
    return model


def _cache_at(model, length: int, capacity: int):
    """A new cache of `model` holding `length` positions of random K/V. A timing needs the context's
    length, not its contents (attention reads every cached position whatever it holds), and a
    prefill to fill it cost more than the timings after it: 8.5 s of bf16 GEMMs for 1,024
    positions where bf16 is emulated (AMD EPYC Zen 3, one thread), against ~1.5 s of timing."""
    cache = model.new_cache(capacity)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(cache.k[:, :, :length].shape, generator=gen) for _ in range(2))
    cache.load_prefix(k, v, length)
    return cache


def head_kinds() -> tuple[str, ...]:
    """The LM-head kinds this machine can run (quant.HEAD_KINDS): dynint8 needs a PyTorch build with
    a dynamic int8 GEMM, q4_1 the kernel built here."""
    from . import q4_1_kernel
    from .quant import dynamic_int8_available

    return (("int8", "int4") + (("dynint8",) if dynamic_int8_available() else ())
            + (("q4_1",) if q4_1_kernel.available() else ()))


class _Timer:
    """One model of a candidate with FORMATS_CONTEXT positions cached, timed for r new rows at a time."""

    def __init__(self, model):
        self.model = model
        n = FORMATS_CONTEXT
        self.ids = torch.randint(0, model.cfg.vocab_size, (n + max(PREFILL_ROWS),),
                                 generator=torch.Generator().manual_seed(0))
        self.cache = _cache_at(model, n, n + max(PREFILL_ROWS))

    def once(self, r: int) -> float:
        n = FORMATS_CONTEXT
        t0 = time.perf_counter()
        self.model(self.ids[n:n + r], self.cache, logits_from=r - 1)
        elapsed = time.perf_counter() - t0
        self.cache.rollback(n)
        return elapsed


def time_formats(cfg, candidates: list[tuple[str, str]], reps: int = 5,
                 heads: tuple[str, ...] = ()) -> dict[str, dict[int, float]]:
    """{"dtype/weights": {rows: estimated seconds of a whole-model forward}} = T0 + (L / n) (Tn - T0),
    plus, for each light candidate's dtype and each LM-head kind in `heads`, "head:dtype/kind":
    {rows: T0 with that head} (the model without layers: embedding, norm, head).

    Every figure is the best of `reps` runs (interference only adds time), and the runs go round
    robin over all candidates and row counts, so a burst of other work on the machine slows one
    run of each rather than every run of one candidate.
    """
    n = min(cfg.num_layers, 8)
    rows_of = {c: DECODE_ROWS + (PREFILL_ROWS if c[1] == "dense" or c[1] in CHUNKED_FORMATS else LIGHT_PREFILL_ROWS)
               for c in candidates}
    heads_of = {(dtype, head): (dtype, f"head-{head}") for dtype in sorted({c[0] for c in candidates if c[1] != "dense"})
                for head in heads}
    rows_of.update({c: DECODE_ROWS for c in heads_of.values()})

    def model_of(c: tuple[str, str], layers: int) -> tuple[str, str, int, str | None]:
        """(dtype, weights, layers, head) of the model that times candidate c at `layers` layers.
        Without layers a light format is its LM head alone (q4_1 also runs the norm natively): the
        0-layer models of int4, int8 and the int8 head's entry are one model, built and timed once."""
        dtype, weights = c
        if weights.startswith("head-"):
            return dtype, "light", 0, weights[5:]
        if layers == 0 and weights not in ("dense", *CHUNKED_FORMATS):
            weights = "light"
        return dtype, weights, layers, None if weights == "dense" else "int8"

    uses = [(c, layers) for c in candidates for layers in (0, n)] + [(c, 0) for c in heads_of.values()]
    rows_for: dict[tuple, set[int]] = {}
    for c, layers in uses:
        rows_for.setdefault(model_of(c, layers), set()).update(rows_of[c])
    bases: dict = {}
    timers = {m: _Timer(_random_model(cfg, m[2], getattr(torch, m[0]), "int8" if m[1] == "light" else m[1],
                                      m[3] or "int8", bases))
              for m in rows_for}
    best: dict[tuple, float] = {}
    for rep in range(reps):
        for m, timer in timers.items():
            for r in sorted(rows_for[m]):
                if r > 8 and rep >= max(1, reps // 2):  # big row counts: less relative noise
                    continue
                best[(m, r)] = min(best.get((m, r), float("inf")), timer.once(r))

    def t(c, layers, r):
        return best[(model_of(c, layers), r)]

    table = {f"{c[0]}/{c[1]}": {r: t(c, 0, r) + cfg.num_layers / n * max(t(c, n, r) - t(c, 0, r), 0.0)
                                for r in sorted(set(rows_of[c]))} for c in candidates}
    for (dtype, head), c in heads_of.items():
        table[f"head:{dtype}/{head}"] = {r: t(c, 0, r) for r in rows_of[c]}
    return table


# --------------------------------------------------------------------------- the choice

def choose(table: dict[str, dict[int, float]], candidates: list[tuple[str, str]]) -> Formats:
    """Pick formats from a timing table {"dtype/weights": {rows: seconds}} (see module doc);
    `candidates` (dtype, weights) in order of preference."""
    def heads(dtype: str) -> dict[str, dict[int, float]]:
        return {k.split("/", 1)[1]: t for k, t in table.items() if k.startswith(f"head:{dtype}/")}

    def best_head(dtype: str) -> str:
        h = heads(dtype)
        return min(h, key=lambda kind: h[kind][1] + h[kind][4]) if h else "int8"

    def decode_time(c: tuple[str, str], r: int) -> float:
        """T(r) of candidate c with its best LM head (the table's light rows ran the int8 head)."""
        t = table[f"{c[0]}/{c[1]}"][r]
        h = heads(c[0])
        if c[1] != "dense" and h:
            t += h[best_head(c[0])][r] - h["int8"][r]
        return t

    def round_cost(c: tuple[str, str]) -> float:
        return decode_time(c, 1) + decode_time(c, 4)

    # the first candidate within 5 % of the fastest: candidates come lightest first, and a lighter
    # format also leaves memory bandwidth to the drafters
    best = min(round_cost(c) for c in candidates)
    dtype, weights = next(c for c in candidates if round_cost(c) <= 1.05 * best)
    dense = {d: table[f"{d}/dense"] for d in ("bfloat16", "float32") if f"{d}/dense" in table}
    prefill_dtype = min(dense, key=lambda d: dense[d][max(PREFILL_ROWS)])
    decode = table[f"{dtype}/{weights}"]
    # from how many rows the prefill path beats the decode format: the first row count measured for
    # both where it wins, else the first one past the decode format's measured range
    both = [r for r in PREFILL_ROWS if r in dense[prefill_dtype] and r in decode]
    wins = [r for r in both if dense[prefill_dtype][r] < decode[r]]
    beyond = [r for r in PREFILL_ROWS if r > max(both, default=0)]
    from_rows = min(wins) if wins else min(beyond, default=max(PREFILL_ROWS))
    if prefill_dtype == dtype and weights == "dense":
        from_rows = 10**9  # one path for every row count
    return Formats(dtype, weights, prefill_dtype, from_rows, best_head(dtype) if weights != "dense" else "int8")


def measure(cfg, light_formats: tuple[str, ...] = ("int8",), use_cache: bool = True, verbose: bool = False) -> dict:
    """Time the candidates for this machine and model shape; returns {"machine", "table", "formats"}.

    `light_formats` are the weight formats the model can load besides dense (int4 needs the GGUF's
    Q4_1 blocks). Cached on disk per machine and shape.
    """
    info = cpu_info()
    shape = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                           "num_heads", "num_kv_heads", "head_dim")}
    key = {"v": CACHE_VERSION, "machine": info, "shape": shape, "light": sorted(light_formats)}
    path = _cache_path(key)
    saved = _cached(path, use_cache)
    if saved is not None and _trusted(saved, ({int(r): t for r, t in v.items()} for v in saved["table"].values())):
        return saved
    started = time.perf_counter()
    candidates = ([(d, w) for d in ("bfloat16", "float32") for w in light_formats]
                  + [("bfloat16", "dense"), ("float32", "dense")])
    table, others = _timed_in_order(lambda: time_formats(cfg, candidates, heads=head_kinds()), "format")
    if verbose:
        for name, t in table.items():
            print(f"  {name}: " + " ".join(f"T({r})={1e3 * v:.1f}ms" for r, v in t.items()), file=sys.stderr,
                  flush=True)   # stderr: `whiflash info --json` prints only the JSON to stdout
    formats = choose(table, candidates)
    result = {"machine": info, "shape": shape, "context": FORMATS_CONTEXT,
              "seconds": round(time.perf_counter() - started, 2),
              "table": {k: {str(r): round(t, 6) for r, t in v.items()} for k, v in table.items()},
              "formats": dataclasses.asdict(formats)}
    result.update(_marks(table.values(), others))
    _write_json(path, result)
    return result


def verify_table(target, taps: tuple[int, ...] = (), use_cache: bool = True, reps: int = 5) -> dict[int, float]:
    """{rows: seconds} of a verify forward of the loaded target: `rows` new tokens after CONTEXT
    cached ones, logits for every row and the drafters' `taps`, as the engine runs it (VERIFY_ROWS);
    the router's verify-cost table (costs.py). Timed on the target itself, so in its loaded format
    (weights, activations, any prefill twin); best of `reps` (of fewer for slow forwards:
    TIMING_BUDGET_S). Cached per machine, model shape and format, like `measure`."""
    return verify_tables(target, taps, use_cache, reps)[0]


def _target_key(target, taps: tuple[int, ...]) -> dict:
    """What a timing of the loaded target depends on (its cache key): this machine, the device, the
    model's shape, dtype and formats, its linears' kinds, the tapped layers, the kernels' tiles."""
    from . import tiles   # imported here: tiles -> q4_1_kernel -> native -> this module

    cfg = target.cfg
    shape = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                           "num_heads", "num_kv_heads", "head_dim")}
    fmt = dataclasses.asdict(target.formats) if getattr(target, "formats", None) is not None else None
    linears = sorted({type(m).__name__ for m in target.modules() if "Linear" in type(m).__name__})
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    return {"v": VERIFY_CACHE_VERSION, "machine": cpu_info(), "device": device, "shape": shape,
            "dtype": str(target.dtype), "formats": fmt, "linears": linears, "taps": list(taps),
            "tiles": dataclasses.asdict(tiles.current())}


def verify_tables(target, taps: tuple[int, ...] = (), use_cache: bool = True,
                  reps: int = 5) -> tuple[dict[int, float], dict[int, float]]:
    """(verify_table, shared table): the second is {total rows: seconds} of a shared forward
    (`TargetModel.forward_many`) over requests of SHARED_SEGMENT_ROWS rows (the last one the rest),
    each after CONTEXT cached positions of its own: what one step of several requests costs, whose
    price per row differs from one request's (attention per request, and where the rows outgrow
    the layer stack the module forward). Timed and cached together."""
    key = _target_key(target, taps)
    shape, fmt = key["shape"], key["formats"]
    path = _cache_path(key, "verify")
    saved = _cached(path, use_cache)
    if saved is not None:
        tables = ({int(r): t for r, t in saved["table"].items()}, {int(r): t for r, t in saved["shared"].items()})
        if _trusted(saved, tables) and not _stale(tables[0], _spot_verify(target, taps, SPOT_ROWS)):
            return tables
    tables, others = _timed_in_order(
        lambda: dict(zip(("table", "shared"), _time_verify(target, taps, reps))), "verify")
    # to the microsecond, as cached: the start that times the tables prices rounds as the later
    # starts that read them back
    best, shared = ({r: round(t, 6) for r, t in tables[name].items()} for name in ("table", "shared"))
    _write_json(path, {"machine": key["machine"], "shape": shape, "formats": fmt, "context": CONTEXT,
                       "table": {str(r): t for r, t in best.items()},
                       "shared": {str(r): t for r, t in shared.items()},
                       **_marks((best, shared), others)})
    return best, shared


def _time_verify(target, taps: tuple[int, ...], reps: int) -> tuple[dict[int, float], dict[int, float]]:
    """One timing of verify_tables' two tables (uncached)."""
    longest = max(max(VERIFY_ROWS), SHARED_SEGMENT_ROWS)
    ids, sync = _timing_inputs(target, CONTEXT + longest, seed=0)
    segments = max(SHARED_ROWS) // SHARED_SEGMENT_ROWS + 1
    caches = [_cache_at(target, CONTEXT, CONTEXT + longest) for _ in range(segments)]
    best: dict[int, float] = {}
    shared: dict[int, float] = {}
    with torch.inference_mode():
        # Warm up, then one row count at a time, as a decode loop runs them. A fresh process's
        # first ~10 forwards run slow (one row: 5.7 ms first, 3.1 ms after a dozen), and with the
        # counts interleaved (and the shared forwards between) each call was cold again: the table
        # read T(1) 5.4 ms, T(4) 5.4 ms, against 3.2 ms a plain step and 5.7 ms a 4-row EAGLE-3
        # verify in the Spec-Bench loop, so T(4) looked free and EAGLE-3 rounds were priced under
        # their cost.
        _warm_up(target, taps, ids, caches[0], sync)
        for r in VERIFY_ROWS:
            best[r] = _best_seconds(lambda: target(ids[CONTEXT:CONTEXT + r], caches[0], taps), caches[:1], CONTEXT,
                                    reps, sync, TIMING_BUDGET_S)
        for r in SHARED_ROWS:   # likewise one total at a time
            sizes = [SHARED_SEGMENT_ROWS] * (r // SHARED_SEGMENT_ROWS) + ([r % SHARED_SEGMENT_ROWS] if r % SHARED_SEGMENT_ROWS else [])
            rows = [ids[CONTEXT:CONTEXT + n] for n in sizes]
            shared[r] = _best_seconds(lambda: target.forward_many(rows, caches[:len(rows)], taps), caches[:len(rows)],
                                      CONTEXT, reps, sync, TIMING_BUDGET_S)
    return best, shared


def _spot_verify(target, taps: tuple[int, ...], rows: tuple[int, ...]) -> dict[int, float]:
    """{rows: seconds} of verify forwards timed now as `_time_verify` times them, for a few row
    counts (SPOT_REPS each, after at most SPOT_WARMUP_S of warm-up): what a cached verify table is
    checked against (`_stale`)."""
    longest = max(rows)
    ids, sync = _timing_inputs(target, CONTEXT + longest, seed=0)
    cache = _cache_at(target, CONTEXT, CONTEXT + longest)
    with torch.inference_mode():
        _warm_up(target, taps, ids, cache, sync, SPOT_WARMUP_S)
        return {r: _best_seconds(lambda: target(ids[CONTEXT:CONTEXT + r], cache, taps), [cache], CONTEXT, SPOT_REPS,
                                 sync, TIMING_BUDGET_S) for r in rows}


def _stale(table: dict[int, float], now: dict[int, float], slack: tuple[float, float] = SPOT_SLACK) -> bool:
    """Does the cached `table` read some row count of `now` (timed this start) more than `slack`
    slower? Then it was timed beside other work (see SPOT_ROWS), or by kernels a later build made
    faster under the same cache key, and is timed again."""
    slow = {r: t for r, t in now.items() if r in table and table[r] > slack[0] * t + slack[1]}
    if slow:
        print("whiflash: the cached verify table reads " + ", ".join(
            f"T({r}) = {table[r] * 1e3:.2f} ms" for r in slow) + " where this start ran " + ", ".join(
            f"{t * 1e3:.2f} ms" for t in slow.values()) + ": timed beside other work (or by slower kernels); "
            "timing it again",
            file=sys.stderr, flush=True)
    return bool(slow)


def _timing_inputs(target, length: int, seed: int) -> tuple[torch.Tensor, object]:
    """(ids, sync) for a timing of the loaded target: `length` random token ids on its device (a
    timing needs shapes, not text) and the call that waits for the work, not its launch."""
    ids = torch.randint(0, target.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    return ids.to(target.device), sync


def _warm_up(target, taps: tuple[int, ...], ids: torch.Tensor, cache, sync, budget: float | None = None) -> None:
    """Untimed one-row forwards after CONTEXT cached positions of `cache` before a timing (a fresh
    process's first ones run slow): WARMUP_FORWARDS, or fewer (two at least) once they took `budget`."""
    _best_seconds(lambda: target(ids[CONTEXT:CONTEXT + 1], cache, taps), [cache], CONTEXT, WARMUP_FORWARDS, sync,
                  budget)


def _best_seconds(forward, caches, length: int, reps: int, sync, budget: float | None = None) -> float:
    """The best of `reps` timings of forward() (synced), each followed by rolling `caches` back to
    `length` cached positions (so every run starts from the same context); with a `budget`, the
    best of fewer (at least two) once the timed runs add up to it."""
    best, spent = float("inf"), 0.0
    for i in range(reps):
        t0 = time.perf_counter()
        forward()
        sync()
        seconds = time.perf_counter() - t0
        best, spent = min(best, seconds), spent + seconds
        for cache in caches:
            cache.rollback(length)
        if budget is not None and i >= 1 and spent >= budget:
            break
    return best


def context_table(target, taps: tuple[int, ...] = (), use_cache: bool = True, reps: int = 5) -> dict[int, float]:
    """{rows: seconds per cached position} of a verify forward of the loaded target: how much longer
    a forward of `rows` new tokens runs for each position in the cache before them (the attention
    reading their K/V), from the forward's time after CONTEXT and after LONG_CONTEXT cached
    positions (CONTEXT_ROWS; best of `reps` each). Cached like verify_tables."""
    key = {**_target_key(target, taps), "contexts": [CONTEXT, LONG_CONTEXT]}
    shape, fmt = key["shape"], key["formats"]
    path = _cache_path(key, "context")
    saved = _cached(path, use_cache)
    if saved is not None:
        table = {int(r): t for r, t in saved["per_position"].items()}
        if _trusted(saved, (table,)):
            return table
    tables, others = _timed_in_order(lambda: {"per_position": _time_context(target, taps, reps)}, "context")
    table = tables["per_position"]
    _write_json(path, {"machine": key["machine"], "shape": shape, "formats": fmt,
                       "contexts": [CONTEXT, LONG_CONTEXT],
                       "per_position": {str(r): t for r, t in table.items()}, **_marks((table,), others)})
    return table


def _time_context(target, taps: tuple[int, ...], reps: int) -> dict[int, float]:
    """One timing of context_table's table (uncached): each row count after CONTEXT and after
    LONG_CONTEXT cached positions, one row count at a time (as a decode loop runs them)."""
    longest = max(CONTEXT_ROWS)
    ids, sync = _timing_inputs(target, LONG_CONTEXT + longest, seed=1)
    caches = {context: _cache_at(target, context, context + longest) for context in (CONTEXT, LONG_CONTEXT)}
    per_position: dict[int, float] = {}
    with torch.inference_mode():
        _warm_up(target, taps, ids, caches[CONTEXT], sync)
        for r in CONTEXT_ROWS:
            best = {c: _best_seconds(lambda: target(ids[c:c + r], cache, taps), [cache], c, reps, sync,
                                     TIMING_BUDGET_S)
                    for c, cache in caches.items()}
            per_position[r] = max(best[LONG_CONTEXT] - best[CONTEXT], 0.0) / (LONG_CONTEXT - CONTEXT)
    return per_position


def light_formats(gguf: str | None) -> tuple[str, ...]:
    """The weight formats a model can load besides dense: int4 and q4_1 need a GGUF's Q4_1 blocks,
    q4_1 also the kernel built on this machine (q4_1_kernel)."""
    from . import q4_1_kernel

    if not gguf:
        return ("int8",)
    return (("q4_1",) if q4_1_kernel.available() else ()) + ("int4", "int8")


def formats_from(result: dict) -> Formats:
    return Formats(**result["formats"])
