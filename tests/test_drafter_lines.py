"""The drafters' catch-up and draft lines (costs.drafter_lines): timed once per machine, target and
drafters, read back by later starts, timed again where a start runs them clearly faster."""
from __future__ import annotations

import json

import pytest
import torch

from tiny import tiny_dflash, tiny_engine, tiny_target
from whiflash_core import costs, machine
from whiflash_core.costs import BACKLOGS, SPOT_DRAFTS, drafter_fingerprint, drafter_lines


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(machine, "_busy_seconds", lambda cpus: None)   # no other work on our CPUs
    return tmp_path


def fake_timing(monkeypatch, seconds: dict[str, float]):
    """_time_drafters answering from `seconds` (draft time per token, per drafter; catch-up a tenth
    of it per position), recording which timings were asked for: "full" or "spot"."""
    calls = []

    def time_drafters(engine, reps, backlogs=BACKLOGS, ks=None):
        calls.append("full" if backlogs else "spot")
        points = {}
        for name, d in engine.drafters.items():
            s = seconds[name]
            most = min(d.max_draft_tokens, costs.MAX_TIMED_DRAFT)
            draft_ks = range(1, most + 1) if ks is None else [k for k in ks if k <= most]
            points[name] = {"catch_up": {b: 0.1 * s * b for b in backlogs},
                            "draft": {k: 1e-4 + s * k for k in draft_ks}}
        return points
    monkeypatch.setattr(costs, "_time_drafters", time_drafters)
    return calls


def coefficients(lines):
    return {name: (c.coefficients(), d.coefficients()) for name, (c, d) in lines.items()}


def test_the_lines_are_timed_once_and_read_back_the_same(cache, monkeypatch):
    eng = tiny_engine(torch.float32)
    seconds = {"eagle3": 2e-4, "dflash": 5e-4, "ngram": 1e-6}
    calls = fake_timing(monkeypatch, seconds)
    first = coefficients(drafter_lines(eng))
    assert calls == ["full"] and set(first) == {"eagle3", "dflash", "ngram"}
    (saved,) = cache.glob("drafters-*.json")
    assert set(json.loads(saved.read_text())["drafters"]) == set(first)
    again = coefficients(drafter_lines(eng))
    assert calls == ["full", "spot"]   # a later start checks a few draft lengths, then reads the cache
    assert again == first              # bit for bit: every start prices the same rounds alike
    # the lines are least squares through the points: a = 1e-4, b = the per-token time
    a, b = first["eagle3"][1]
    assert a == pytest.approx(1e-4) and b == pytest.approx(2e-4)
    assert costs.measure(eng).draft["eagle3"].coefficients() == first["eagle3"][1]
    # with the cache off the lines are timed again
    drafter_lines(eng, use_cache=False)
    assert calls[-1] == "full"


def test_a_cached_line_slower_than_this_start_runs_is_timed_again(cache, monkeypatch):
    eng = tiny_engine(torch.float32)
    seconds = {"eagle3": 4e-4, "dflash": 5e-4, "ngram": 1e-6}
    calls = fake_timing(monkeypatch, seconds)
    slow = coefficients(drafter_lines(eng))
    seconds["eagle3"] = 2e-4      # this start drafts twice as fast: the cached line was timed beside other work
    seconds["dflash"] = 6e-4      # ... and DFlash slower: each point keeps its best time
    fast = coefficients(drafter_lines(eng))
    assert calls == ["full", "spot", "full"] and fast != slow
    assert fast["eagle3"][1][1] == pytest.approx(2e-4) and fast["dflash"] == slow["dflash"]
    seconds["dflash"] = 5e-4
    seconds["eagle3"] = 3e-4      # a busier start runs slower: interference only adds time, the cache stays
    assert coefficients(drafter_lines(eng)) == fast and calls[-1] == "spot"
    seconds["eagle3"] = 2.2e-4    # within the slack
    assert coefficients(drafter_lines(eng)) == fast and calls[-1] == "spot"


def test_another_drafter_shape_is_timed_apart_and_another_checkpoint_is_not(cache, monkeypatch):
    target = tiny_target(torch.float32)
    a, same_shape, other = tiny_dflash(target), tiny_dflash(target, seed=5), tiny_dflash(target, block=8)
    with torch.no_grad():
        for p in same_shape.parameters():
            p.add_(1.0)
    assert drafter_fingerprint(a) == drafter_fingerprint(same_shape)
    assert drafter_fingerprint(a) != drafter_fingerprint(other)
    eng = tiny_engine(torch.float32)
    calls = fake_timing(monkeypatch, {"eagle3": 2e-4, "dflash": 5e-4, "ngram": 1e-6})
    drafter_lines(eng)
    eng.drafters["dflash"] = other
    drafter_lines(eng)
    assert calls == ["full", "full"] and len(list(cache.glob("drafters-*.json"))) == 2


def test_the_timing_runs_every_drafter_at_every_backlog_and_draft_length():
    """_time_drafters on real (tiny) drafters, not mocked: every point there, each a real time."""
    eng = tiny_engine(torch.float32)
    points = costs._time_drafters(eng, reps=2)
    for name, d in eng.drafters.items():
        most = min(d.max_draft_tokens, costs.MAX_TIMED_DRAFT)
        assert set(points[name]["catch_up"]) == set(BACKLOGS)
        assert set(points[name]["draft"]) == set(range(1, most + 1))
        assert all(0 < t < 1 for p in points[name].values() for t in p.values())
    spot = costs._time_drafters(eng, reps=2, backlogs=(), ks=SPOT_DRAFTS)
    assert all(p["catch_up"] == {} and set(p["draft"]) <= set(SPOT_DRAFTS) and p["draft"] for p in spot.values())
