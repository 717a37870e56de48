"""What holds in bf16 and int4 on any CPU.

bf16 and int4 forwards round differently with the number of rows (a k-row verify is not a 1-row
decode) and with the CPU's kernels (AVX-512 with native bf16, AVX2 emulating it), so two methods
may part at a near-tie and no test here compares two methods. What does hold everywhere:

- every emitted token is the argmax of the target forward that verified it (greedy losslessness,
  checked by replaying the forwards the engine actually ran);
- the same request twice runs the same forward shapes, so it gives the same tokens: the streamed
  pieces reassemble to the non-streamed answer of the same method, tool calls included.

Cross-method identity is tested in float32 (test_engine_real.py, test_gateway.py's float32 server).
"""
from __future__ import annotations

import json

import pytest
import torch

from whiflash_core.chat import encode_chat
from whiflash_core.engine import METHODS, GenerationRequest, SpeculationConfig
from whiflash_core.loading import load_engine

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(600)]

PROMPTS = [
    [{"role": "user", "content": "Explain what a CPU cache is, in three sentences."}],
    [{"role": "user", "content": "Repeat after me: the quick brown fox jumps over the lazy dog. "
                                 "The quick brown fox jumps over the lazy dog."}],
]
MAX_NEW = 40


class ForwardLog:
    """Records (input tokens, output logits) of every target forward, via a forward hook."""

    def __init__(self, target: torch.nn.Module):
        self.calls: list[tuple[list[int], torch.Tensor]] = []
        self.handle = target.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.calls.append((args[0].tolist(), output.logits.detach().clone()))

    def close(self) -> None:
        self.handle.remove()


def replay_greedy(calls: list[tuple[list[int], torch.Tensor]]) -> list[int]:
    """The tokens a greedy speculative loop must emit, given the forwards it ran: the prefill's
    argmax, then per verify forward over [pending, d1..dk] the drafts that match the argmax of the
    row before them, then the argmax of the first row that does not match (or the bonus row)."""
    (_, prefill_logits), *verifies = calls
    out = [int(prefill_logits[-1].argmax())]
    for tokens, logits in verifies:
        best = logits.argmax(-1).tolist()
        draft = tokens[1:]
        a = 0
        while a < len(draft) and draft[a] == best[a]:
            a += 1
        out += draft[:a] + [best[a]]
    return out


# dense bf16, and what `make run` serves: the formats timed on this CPU (int4 with a float32 prefill
# twin where bf16 is emulated, int4 in bf16 where it is native). `auto` runs on one thread, as
# `whiflash serve` steps requests on a 2-core machine (and default_server below), so the formats and
# round costs it times are the server's, timed once per run. The dense engine's round costs are not
# measured (on an AVX2 CPU, where bf16 is emulated, that took ~100 s): unmeasured, the router prices
# every round alike and drafts all it can, and the check below holds whatever it picks.
@pytest.fixture(scope="module", params=["dense", "auto"])
def engine(request):
    auto, threads = request.param == "auto", torch.get_num_threads()
    try:
        yield load_engine(dtype="bfloat16", weights=request.param, measure_costs=auto, threads=1 if auto else None)
    finally:   # also when loading failed: later modules run on the count they started with
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", METHODS)
def test_every_emitted_token_is_the_argmax_of_its_verify_forward(engine, method):
    forwards = tokens = 0
    for messages in PROMPTS:
        ids = encode_chat(engine.tokenizer, messages)
        log = ForwardLog(engine.target)
        try:
            gen = engine.generate(GenerationRequest(ids, MAX_NEW, speculation=SpeculationConfig(method=method)))
        finally:
            log.close()
        expected = replay_greedy(log.calls)
        n = len(gen.output)
        assert gen.output == expected[:n], method
        if gen.finish_reason == "stop":
            assert expected[n] in engine.eos_ids
        else:
            assert gen.finish_reason == "length" and n == MAX_NEW
        forwards += len(log.calls) - 1
        tokens += len(expected) - 1
    if method != "none":  # the check has teeth: multi-token verify forwards decided tokens
        assert forwards < tokens, (method, forwards, tokens)


def test_replay_catches_a_token_that_is_not_the_argmax():
    """The replay above is a real check: a forced wrong token is caught."""
    logits = torch.zeros(3, 10)
    logits[0, 4] = logits[1, 5] = logits[2, 6] = 1.0
    prefill = torch.zeros(1, 10)
    prefill[0, 7] = 1.0
    calls = [([1, 2], prefill), ([7, 4, 9], logits[:3])]
    assert replay_greedy(calls) == [7, 4, 5]
    assert replay_greedy(calls) != [7, 4, 9]


# --- the `make run` configuration over HTTP --------------------------------------------------------

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_Q = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    from conftest import start_server

    server = start_server(log_dir=tmp_path_factory.mktemp("default-server"))  # --weights auto
    yield server
    server.stop()


def _stream(client, **kw) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += (tc.function and tc.function.name) or ""
            entry["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# A request seen for the first time prefills its whole prompt in one forward; sent again, it reuses
# that K/V from the prefix cache and computes only the rest: in bf16/int4 the two forward shapes
# round differently, so a near-tie may go either way (float32: the same tokens, test_prefix_cache).
# Streamed and non-streamed answers are therefore compared under the same cache state: after one
# warm-up request, both find the same cached prefix.


@pytest.mark.parametrize("method", ["whiflash", "dflash"])
def test_default_server_streams_what_it_answers(default_server, method):
    client = default_server.client()
    kw = dict(model=MODEL, messages=PROMPTS[0], max_tokens=32, temperature=0,
              extra_body={"speculation": {"method": method}})
    client.chat.completions.create(**kw)   # warm the prefix cache (see above)
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    whole = r.choices[0]
    content, calls, finish = _stream(client, **kw)
    assert content == whole.message.content and calls == [] and finish == whole.finish_reason


@pytest.mark.parametrize("method", ["whiflash", "dflash"])
def test_default_server_streams_the_tool_call_it_answers(default_server, method):
    client = default_server.client()
    kw = dict(model=MODEL, messages=WEATHER_Q, max_tokens=48, temperature=0, tools=[WEATHER_TOOL],
              tool_choice="required", extra_body={"speculation": {"method": method, "block_size": 8}})
    client.chat.completions.create(**kw)   # warm the prefix cache (see above)
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    whole = r.choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and whole.finish_reason == "tool_calls"
    assert isinstance(json.loads(call.function.arguments)["city"], str)  # the grammar held
    content, calls, finish = _stream(client, **kw)
    assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]
    assert content == "" and finish == "tool_calls"
