"""Hostile input (issue 18), replayed in-process against the app around the fake engine: each case
must get its OpenAI-shaped error (or be made harmless), and the same app must then still answer a
normal request."""
from __future__ import annotations

import torch

from app.settings import Settings
from test_gateway_units import HI, FakeEngine, in_process
from whiflash_core.drafters.base import DraftSampling, pick_tokens
from whiflash_core.sampling import SamplingParams, target_probs


def assert_openai_error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return error


def assert_still_serving(tc) -> None:
    r = tc.post("/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert tc.get("/health").status_code == 200


# --- tiny temperatures are greedy ----------------------------------------------------------------


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.25]])
    for t in (1e-300, 1e-30, 1e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy
        probs = target_probs(logits, params)
        assert not probs.isnan().any()
        assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
        tokens, draft_probs = pick_tokens(logits, DraftSampling(t), None, 3)
        assert tokens.tolist() == [1, 0] and draft_probs is None
    assert not SamplingParams(temperature=0.5).greedy  # ordinary temperatures still sample


class RecordingEngine(FakeEngine):
    def start(self, request):
        self.last = request
        return super().start(request)


def test_tiny_temperature_through_the_api():
    engine = RecordingEngine("ok")
    app, tc = in_process(engine)
    with tc:
        r = tc.post("/v1/chat/completions", json={"messages": HI, "temperature": 1e-300})
        assert r.status_code == 200, r.text
        assert engine.last.sampling.greedy
        assert_still_serving(tc)
