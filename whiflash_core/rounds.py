"""What one speculation round did (`Round`), and the one accumulator every figure is counted with.

`Generation.step()` returns a `Round`. Everything that reports on speculation derives from the
stream of rounds: a request's stats (`Generation.stats()`) and the stats page's totals
(app/stats.py, fed the `round` events that `Round.event()` writes) through `Tally`; the Prometheus
counters (app/metrics.py) add up the same Round fields. So each figure has one definition:

    acceptance length  = tokens decided by rounds / rounds        (tokens per target forward)
    switch             = a round whose drafter differs from the previous round's (Round.switched)
    per drafter        = rounds, draft tokens proposed, draft tokens accepted
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

TIMED = ("router", "catch_up", "draft", "verify")  # the phases of a round, in order


@dataclass
class RoundTimes:
    """Seconds spent in each phase of a round (or summed over rounds)."""
    router: float = 0.0
    catch_up: float = 0.0
    draft: float = 0.0
    verify: float = 0.0

    def add(self, other: RoundTimes) -> None:
        for name in TIMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in TIMED)

    def as_dict(self) -> dict[str, float]:
        return {name: round(getattr(self, name), 6) for name in TIMED}


@dataclass
class Round:
    """One round: route -> propose -> verify -> commit.

    A round verifies k draft tokens in one target forward; the target keeps the first `accepted`
    (a <= k) and adds one token of its own (the correction, or the bonus when all k were right),
    so it decides a + 1 tokens. `decided` is how many of those the request used: fewer in its last
    round (a stop token ends the request and is counted; tokens past max_tokens are not).
    """
    index: int                        # 1-based round number within the request
    drafter: str | None               # None: plain decoding (method "none")
    draft_len: int = 0                # k: draft tokens verified (after any grammar cut)
    accepted: int = 0                 # a: leading draft tokens the target agreed with
    decided: int = 0                  # tokens this round decided for the request (<= a + 1)
    switched: bool = False            # the drafter differs from the previous round's
    entropy: float | None = None      # the router's input when it chose by entropy, else None
    tokens: list[int] = field(default_factory=list)    # emitted ids (no stop token)
    sources: list[str] = field(default_factory=list)   # per emitted token: the drafter or "target"
    times: RoundTimes = field(default_factory=RoundTimes)
    fallback_from: str | None = None  # the drafter that raised in this round (plain decoding since)

    def event(self) -> dict:
        """The `round` event's fields (app/events.py); `from_event` reads them back."""
        return {"round": self.index, "drafter": self.drafter, "draft_tokens": self.draft_len,
                "accepted": self.accepted, "decided": self.decided, "switched": self.switched,
                "entropy": self.entropy, "seconds": round(self.times.total, 6), "fallback_from": self.fallback_from}

    @classmethod
    def from_event(cls, event: dict) -> Round:
        return cls(index=event["round"], drafter=event.get("drafter"), draft_len=event.get("draft_tokens") or 0,
                   accepted=event.get("accepted") or 0, decided=event.get("decided") or 0,
                   switched=bool(event.get("switched")), entropy=event.get("entropy"),
                   fallback_from=event.get("fallback_from"))


@dataclass
class DrafterCounts:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_length(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted drafts per draft round."""
        return 1 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Tally:
    """Counts over a stream of rounds (one request's, or all requests' on the stats page)."""
    rounds: int = 0
    decided: int = 0
    switches: int = 0
    drafters: dict[str, DrafterCounts] = field(default_factory=dict)
    times: RoundTimes = field(default_factory=RoundTimes)

    @classmethod
    def over(cls, drafters) -> Tally:
        """A tally that lists `drafters` even before (or without) their first round."""
        return cls(drafters={name: DrafterCounts() for name in drafters})

    def add(self, r: Round) -> None:
        self.rounds += 1
        self.decided += r.decided
        self.switches += r.switched
        self.times.add(r.times)
        if r.drafter is not None:
            d = self.drafters.setdefault(r.drafter, DrafterCounts())
            d.rounds += 1
            d.draft_tokens += r.draft_len
            d.accepted_tokens += r.accepted

    @property
    def draft_tokens(self) -> int:
        return sum(d.draft_tokens for d in self.drafters.values())

    @property
    def accepted_tokens(self) -> int:
        return sum(d.accepted_tokens for d in self.drafters.values())

    @property
    def acceptance_length(self) -> float | None:
        """Tokens decided per target forward after prefill (the first token comes from prefill)."""
        return round(self.decided / self.rounds, 4) if self.rounds else None
