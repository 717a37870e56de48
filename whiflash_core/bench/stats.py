"""The numbers: one run's result, repeats collapsed per prompt, and per-category summaries.

Conventions (shared by every table, chart and JSON file):

- decode tokens/s  = (tokens - 1) / (time after the first token): the first token comes from the
  prefill forward, so decode speed excludes it and the prefill time.
- end-to-end tokens/s = tokens / (request start .. last token), prefill included.
- A category's tokens/s is total tokens over total time (long answers weigh more), as in Spec-Bench.
- acceptance length = tokens produced by speculation rounds / target forwards in those rounds
  (the prefill forward and its token are excluded; a stop token a round produced counts), so
  plain decoding is exactly 1.0. The engine's own `stats()` leaves the stop token out.
- Ratios compare with the `none` method of the same run and category.
- Agreement with `none`: a prompt is identical when the token sequences are equal; the prefix
  fraction is the common prefix length over the longer sequence.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

BASELINE = "none"
ALL = "all"
ROUND_PARTS = ("draft", "verify", "catch_up", "router")


@dataclass
class RunResult:
    method: str
    n_tokens: int                       # emitted tokens, stop token excluded
    e2e_s: float                        # request start .. last token
    decode_s: float | None              # first token .. last token (None: not measurable)
    tokens: list[int] | None = None     # emitted token ids (None: not available, e.g. over HTTP without trace)
    text: str | None = None
    rounds: int | None = None           # target forwards after prefill (None: unknown)
    times: dict = field(default_factory=dict)   # seconds: draft, verify, catch_up, router, prefill
    switches: int = 0
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)   # runner-specific numbers (e.g. gateway overhead)

    @property
    def decode_tokens(self) -> int:
        return max(0, self.n_tokens - 1)

    @property
    def round_tokens(self) -> int:
        """Tokens the speculation rounds produced: the decode tokens plus a stop token a round
        emitted (the output excludes it), so plain decoding is exactly 1 token per forward."""
        stopped = self.finish_reason == "stop" and bool(self.rounds)
        return self.decode_tokens + int(stopped)

    def as_dict(self, with_tokens: bool = True) -> dict:
        out = asdict(self)
        if not with_tokens:
            out.pop("tokens")
        return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def collapse_repeats(runs: list[RunResult]) -> RunResult:
    """One result per (prompt, method): median times over repeats, output of the first repeat.
    `extra["repeats_identical"]` says whether every repeat produced the same output."""
    first = runs[0]
    if len(runs) == 1:
        return first

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    keys = {k for r in runs for k in r.times}
    same = all((r.tokens, r.text) == (first.tokens, first.text) for r in runs[1:])
    return RunResult(
        method=first.method, n_tokens=first.n_tokens,
        e2e_s=med([r.e2e_s for r in runs]), decode_s=med([r.decode_s for r in runs]),
        tokens=first.tokens, text=first.text, rounds=first.rounds,
        times={k: med([r.times.get(k) for r in runs]) for k in sorted(keys)},
        switches=first.switches, finish_reason=first.finish_reason,
        extra={**{k: med([r.extra.get(k) for r in runs]) if _is_number(v) else v for k, v in first.extra.items()},
               "repeats": len(runs), "repeats_identical": same},
    )


def matching_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(run: RunResult, ref: RunResult) -> tuple[bool, float, int | None, str]:
    """(identical, prefix fraction, first differing index or None, unit) of `run` against `ref`.
    Compares token ids when both have them, otherwise characters of the text."""
    if run.tokens is not None and ref.tokens is not None:
        a, b, unit = run.tokens, ref.tokens, "tokens"
    else:
        a, b, unit = run.text or "", ref.text or "", "chars"
    n = matching_prefix(a, b)
    longest = max(len(a), len(b))
    identical = len(a) == len(b) == n
    return identical, (1.0 if longest == 0 else n / longest), (None if identical else n), unit


@dataclass
class PromptRecord:
    id: str
    category: str
    prompt_tokens: int | None
    runs: dict[str, RunResult]          # method -> collapsed result

    def agreement(self, method: str, baseline: str = BASELINE):
        if baseline not in self.runs or method not in self.runs:
            return None
        return agreement(self.runs[method], self.runs[baseline])


@dataclass
class Summary:
    category: str
    method: str
    prompts: int
    tokens: int
    e2e_s: float
    decode_s: float | None
    decode_tps: float | None
    e2e_tps: float
    ratio_decode: float | None = None   # decode_tps / none's decode_tps
    ratio_e2e: float | None = None
    acceptance_length: float | None = None
    ms_per_round: dict = field(default_factory=dict)
    round_share: dict = field(default_factory=dict)   # drafter (or "plain") -> share of the rounds
    switches_per_prompt: float | None = None
    identical_fraction: float | None = None   # vs none
    prefix_agreement: float | None = None     # mean matching-prefix fraction vs none
    gateway_overhead_ms: float | None = None  # HTTP only: client wall time - server time, per request

    def as_dict(self) -> dict:
        return asdict(self)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_group(category: str, method: str, records: list[PromptRecord],
                    baseline: str = BASELINE) -> Summary | None:
    runs = [r.runs[method] for r in records if method in r.runs]
    if not runs:
        return None
    tokens = sum(r.n_tokens for r in runs)
    e2e = sum(r.e2e_s for r in runs)
    decode_known = all(r.decode_s is not None for r in runs)
    decode_s = sum(r.decode_s for r in runs) if decode_known else None
    decode_tokens = sum(r.decode_tokens for r in runs)
    s = Summary(category, method, len(runs), tokens, e2e, decode_s,
                decode_tokens / decode_s if decode_s else None, tokens / e2e if e2e else 0.0)
    if all(r.rounds is not None for r in runs):
        rounds = sum(r.rounds for r in runs)
        s.acceptance_length = sum(r.round_tokens for r in runs) / rounds if rounds else None
        if rounds and any(r.times for r in runs):
            s.ms_per_round = {k: 1000.0 * sum(r.times.get(k) or 0.0 for r in runs) / rounds for k in ROUND_PARTS}
        counts: dict[str, int] = {}
        for r in runs:
            for name, n in (r.extra.get("drafter_rounds") or {}).items():
                counts[name] = counts.get(name, 0) + n
        if rounds and counts:
            s.round_share = {name: n / rounds for name, n in counts.items() if n}
    s.switches_per_prompt = sum(r.switches for r in runs) / len(runs)
    overheads = [r.extra.get("gateway_overhead_s") for r in runs]
    if overheads and all(o is not None for o in overheads):
        s.gateway_overhead_ms = 1000.0 * sum(overheads) / len(overheads)
    if method != baseline:
        agreements = [r.agreement(method, baseline) for r in records if method in r.runs]
        agreements = [a for a in agreements if a is not None]
        if agreements:
            s.identical_fraction = sum(a[0] for a in agreements) / len(agreements)
            s.prefix_agreement = sum(a[1] for a in agreements) / len(agreements)
    return s


def summarize(records: list[PromptRecord], methods: list[str], categories: list[str],
              baseline: str = BASELINE) -> list[Summary]:
    """Per (category, method) summaries, then the `all` rows; ratios against `baseline`."""
    out: list[Summary] = []
    groups = [(c, [r for r in records if r.category == c]) for c in categories] + [(ALL, records)]
    for category, group in groups:
        rows = [summarize_group(category, m, group, baseline) for m in methods]
        rows = [r for r in rows if r is not None]
        base = next((r for r in rows if r.method == baseline), None)
        for r in rows:
            if base is not None:
                r.ratio_decode = _ratio(r.decode_tps, base.decode_tps)
                r.ratio_e2e = _ratio(r.e2e_tps, base.e2e_tps)
        out.extend(rows)
    return out


@dataclass
class Mismatch:
    prompt: str
    category: str
    method: str
    first_diff: int
    length: int
    baseline_length: int
    unit: str


def mismatches(records: list[PromptRecord], methods: list[str], baseline: str = BASELINE) -> list[Mismatch]:
    out = []
    for rec in records:
        for m in methods:
            if m == baseline:
                continue
            a = rec.agreement(m, baseline)
            if a is None or a[0]:
                continue
            run, ref = rec.runs[m], rec.runs[baseline]
            size = (lambda r: len(r.tokens)) if a[3] == "tokens" else (lambda r: len(r.text or ""))
            out.append(Mismatch(rec.id, rec.category, m, a[2], size(run), size(ref), a[3]))
    return out
