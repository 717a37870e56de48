"""Hostile input (issue 18), replayed in-process against the app around the fake engine: each case
must get its OpenAI-shaped error (or be made harmless), and the same app must then still answer a
normal request."""
from __future__ import annotations

import json
import time

import torch

from app.main import create_app
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


def test_tiny_top_p_keeps_the_most_likely_token_not_nan():
    from app.limits import MIN_TOP_P

    # found by schemathesis: top_p 5e-324 is 0 in float32, so every token was dropped -> NaN -> 500
    engine = RecordingEngine("ok")
    app, tc = in_process(engine)
    with tc:
        for top_p in (5e-324, 1e-300):
            r = tc.post("/v1/chat/completions", json={"messages": HI, "temperature": 1.0, "top_p": top_p})
            assert r.status_code == 200, r.text
            assert engine.last.sampling.top_p == MIN_TOP_P
        assert tc.post("/v1/completions", json={"prompt": "hi", "top_p": 5e-324}).status_code == 200
        assert_still_serving(tc)
    # raising a tiny top_p to MIN_TOP_P changes no distribution: the most likely token alone remains
    logits = torch.randn(4, 50_000)
    for top_p in (MIN_TOP_P, 1e-9):
        probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert probs.tolist() == target_probs(logits, SamplingParams(temperature=0.0)).tolist()


# --- nesting depth -------------------------------------------------------------------------------


def nested(depth: int) -> str:
    """JSON text of `depth` objects inside one another."""
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def schema(depth: int) -> dict:
    """A JSON schema whose text nests `depth` levels."""
    s: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):
        s = {"type": "object", "properties": {"x": s}}
    return s


def tools_with(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def replay_call(arguments) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def test_deep_nesting_is_a_400_naming_the_limit():
    from app.limits import MAX_JSON_DEPTH

    deep = MAX_JSON_DEPTH + 40  # past our limit, within pydantic's parser (200)
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        bodies = {
            "messages": {"messages": replay_call(nested(3000))},  # arguments as JSON text
            "tools": {"messages": HI, "tools": tools_with(schema(deep))},
            "response_format": {"messages": HI, "response_format": {
                "type": "json_schema", "json_schema": {"name": "r", "schema": schema(deep)}}},
        }
        for param, body in bodies.items():
            error = assert_openai_error(tc.post("/v1/chat/completions", json=body), 400, "nesting_too_deep")
            assert error["param"] == param and str(MAX_JSON_DEPTH) in error["message"]
        # arguments as an object, and a body too deep for the JSON parser itself
        body = {"messages": replay_call(json.loads(nested(deep)))}
        assert_openai_error(tc.post("/v1/chat/completions", json=body), 400, "nesting_too_deep")
        for raw in ('{"messages": [{"role": "user", "content": ' + "[" * 3000 + "]" * 3000 + "}]}",
                    '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                    '"function": {"name": "f", "parameters": ' + nested(3000) + "}}]}"):
            r = tc.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert str(MAX_JSON_DEPTH) in assert_openai_error(r, 400, "nesting_too_deep")["message"]
        # ordinary depths still pass
        ok = tc.post("/v1/chat/completions", json={"messages": replay_call(nested(10)), "tools": tools_with(schema(20))})
        assert ok.status_code == 200, ok.text
        assert_still_serving(tc)


def test_deeply_nested_tool_call_in_model_output_is_text_not_500():
    reply = '<tool_call>\n{"name": "f", "arguments": ' + nested(3000) + "}\n</tool_call>"
    engine = FakeEngine(reply, chunk=500)
    engine.max_context = 2 * len(reply)
    app, tc = in_process(engine)
    with tc:
        r = tc.post("/v1/chat/completions", json={"messages": HI, "tools": tools_with({"type": "object"})})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] == reply and not message.get("tool_calls")
        engine.reply = "ok"
        assert_still_serving(tc)


# --- content type --------------------------------------------------------------------------------


def test_only_json_bodies_are_accepted():
    app, tc = in_process(FakeEngine("ok"))
    body = json.dumps({"messages": HI})
    with tc:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                             "application/jsonx", ""):
            for path in ("/v1/chat/completions", "/chat/completions"):
                r = tc.post(path, content=body, headers={"content-type": content_type})
                assert_openai_error(r, 415, "unsupported_media_type")
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON", None):
            headers = {"content-type": content_type} if content_type is not None else {}
            r = tc.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 200, (content_type, r.text)
        assert_still_serving(tc)


# --- body size -----------------------------------------------------------------------------------


def test_request_body_size_limit():
    app, tc = in_process(FakeEngine("ok"), max_request_bytes=1000)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    with tc:
        # Content-Length says too much: refused before reading
        error = assert_openai_error(tc.post("/v1/chat/completions", content=big,
                                            headers={"content-type": "application/json"}), 413, "request_too_large")
        assert "1000" in error["message"]
        # chunked (no Content-Length): counted while it arrives
        chunks = (big[i:i + 100] for i in range(0, len(big), 100))
        r = tc.post("/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "request_too_large")
        # just under the limit is parsed as usual
        small = json.dumps({"messages": [{"role": "user", "content": "x" * 900}]})
        assert len(small) <= 1000
        assert tc.post("/v1/chat/completions", content=small,
                       headers={"content-type": "application/json"}).status_code == 200
        assert_still_serving(tc)


def test_default_limit_is_2_mib_and_configurable(monkeypatch):
    import argparse

    from app.serve_cli import add_parser, settings_from_args

    assert Settings().max_request_bytes == 2 * 1024 * 1024
    monkeypatch.setenv("WHIFLASH_MAX_REQUEST_BYTES", "5000")
    assert Settings().max_request_bytes == 5000
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(["serve", "--max-request-bytes", "7000"])).max_request_bytes == 7000
    monkeypatch.delenv("WHIFLASH_MAX_REQUEST_BYTES")
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        huge = {"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
        assert_openai_error(tc.post("/v1/chat/completions", json=huge), 413, "request_too_large")
        fits = {"messages": [{"role": "user", "content": "x" * (1024 * 1024)}]}  # read, then too long a prompt
        assert_openai_error(tc.post("/v1/chat/completions", json=fits), 400, "context_length_exceeded")
        assert_still_serving(tc)


def test_chunked_body_is_cut_off_at_the_limit_before_the_app_runs():
    import asyncio

    from app.limits import RequestBodyLimits

    called, sent, received = [], [], []

    async def app(scope, receive, send):
        called.append(True)

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}  # endless

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(RequestBodyLimits(app, max_bytes=1000)(scope, receive, send))
    assert not called and len(received) == 11  # stopped at the first chunk past the limit
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


# --- linear-time streaming -----------------------------------------------------------------------


def brute_force_stop(text: str, stops: list[str]) -> tuple[str, bool, int]:
    """(text cut at the earliest stop string, stopped, held-back length): the definition."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], True, 0
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text, False, hold


def test_stop_matching_equals_the_definition_under_any_chunking():
    import random

    from app.output import TextAccumulator
    from test_gateway_units import CharTokenizer

    rng = random.Random(18)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        acc = TextAccumulator(CharTokenizer(), stops)
        pos = 0
        while pos < len(text) and not acc.stopped:
            n = rng.randint(1, 5)
            acc.add([ord(c) for c in text[pos:pos + n]])
            pos += n
            if not acc.stopped:
                cut, _, hold = brute_force_stop(acc.text, stops)
                assert acc.visible() == acc.text[: len(acc.text) - hold], (stops, text)
        acc.finish()
        # token by token, the cut is at the earliest stop completed by the first token completing any
        expected, stopped, _ = brute_force_stop(text[:acc.num_tokens], stops)
        assert (acc.text, acc.stopped) == (expected, stopped), (stops, text)


def test_stop_hold_back_is_linear_in_the_output():
    import time

    from app.limits import MAX_STOP_CHARS, MAX_STOPS
    from app.output import TextAccumulator
    from test_gateway_units import CharTokenizer

    # the worst case of a suffix-by-suffix check: every prefix length has to be tried
    stops = [("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + chr(ord("c") + i) for i in range(MAX_STOPS)]
    acc = TextAccumulator(CharTokenizer(), stops)
    t0 = time.process_time()
    for _ in range(5000):
        acc.add([ord("a")])
        assert acc.visible() == acc.text[:-1]  # "a" may begin every stop string
    assert time.process_time() - t0 < 2.0  # was minutes: each round re-checked every prefix


def test_streamed_tool_call_parsing_is_linear_in_the_output():
    import time

    from app.tools import ToolCallParser, parse_tool_calls

    args = json.dumps({"items": [{"k": i, "s": "x}" * 3} for i in range(1200)]})  # ~30 KB
    text = '<tool_call>\n{"name": "f", "arguments": ' + args + "}\n</tool_call>"
    parser = ToolCallParser()
    streamed = []
    t0 = time.process_time()
    for cut in range(3, len(text) + 3, 3):
        _, calls = parser.update(text[:cut], final=cut >= len(text))
        streamed += [c.arguments for c in calls]
    assert time.process_time() - t0 < 2.0  # was 11.6 s: every round re-scanned the whole call
    assert streamed == [args] == [parse_tool_calls(text)[1][0].arguments]


class CountingTokenizer:
    """A character tokenizer that knows its vocabulary and counts how often it is asked to encode."""

    def __new__(cls):
        from test_gateway_units import CharTokenizer

        class Tok(CharTokenizer):
            calls = 0

            def get_vocab(self):
                return {chr(i): i for i in range(32, 127)}

            def __call__(self, text, add_special_tokens=False):
                Tok.calls += 1
                return super().__call__(text, add_special_tokens)
        return Tok()


def test_stop_strings_tools_and_prompt_length_are_bounded():
    from app.limits import MAX_STOP_CHARS, MAX_STOPS, MAX_TOOLS

    engine = FakeEngine("ok")
    engine.tokenizer = CountingTokenizer()
    engine.max_context = 20_000  # room for the prompt of 128 tools
    app, tc = in_process(engine)
    post = lambda **body: tc.post("/v1/chat/completions", json={"messages": HI, **body})
    with tc:
        error = assert_openai_error(post(stop=["x" * (MAX_STOP_CHARS + 1)]), 400)
        assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]
        error = assert_openai_error(post(stop=[f"s{i}" for i in range(MAX_STOPS + 1)]), 400)
        assert error["param"] == "stop" and str(MAX_STOPS) in error["message"]
        assert post(stop=["x" * MAX_STOP_CHARS] * MAX_STOPS).status_code == 200
        many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
        error = assert_openai_error(post(tools=many), 400, "too_many_tools")
        assert error["param"] == "tools" and str(MAX_TOOLS) in error["message"]
        assert post(tools=many[:MAX_TOOLS]).status_code == 200
        # longer than the context in characters: refused without tokenizing it
        before = engine.tokenizer.calls
        huge = [{"role": "user", "content": "x" * (engine.max_context + 1)}]
        error = assert_openai_error(tc.post("/v1/chat/completions", json={"messages": huge}), 400,
                                    "context_length_exceeded")
        assert "maximum context length is 20000 tokens" in error["message"]
        assert engine.tokenizer.calls == before
        # a prompt that might fit is tokenized and checked exactly
        fits = [{"role": "user", "content": "x" * (engine.max_context - 100)}]
        assert tc.post("/v1/chat/completions", json={"messages": fits}).status_code == 200
        assert engine.tokenizer.calls > before
        assert_still_serving(tc)


# --- cancellation: a real server, real disconnects -----------------------------------------------


class served:
    """The app under uvicorn on a free port, in a thread (real sockets, so clients can really leave)."""

    def __init__(self, app):
        import uvicorn

        from conftest import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))

    def __enter__(self) -> str:
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)


def wait_until(condition, seconds: float) -> float:
    """Seconds until `condition()` held (fails after `seconds`)."""
    import time

    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < seconds, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - t0


def leave_after(url: str, seconds: float, body: dict) -> None:
    """A client that sends `body` and hangs up after `seconds` without reading an answer."""
    import httpx

    try:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=seconds)
    except httpx.TimeoutException:
        return
    raise AssertionError("the request finished before its client left")


def test_non_streaming_client_that_leaves_is_noticed_while_tokens_flow():
    import httpx

    # a token every 10 ms for 30 s: the old 1 s "no tokens" check never fired
    engine = FakeEngine("x" * 3000, chunk=1, delay=0.01)
    app = create_app(engine, Settings())
    scheduler = app.state.scheduler
    with served(app) as url:
        leave_after(url, 0.5, {"messages": HI})
        noticed = wait_until(lambda: scheduler.num_running == 0, 5.0)
        assert noticed < 1.0
        metrics = httpx.get(url + "/metrics").text
        assert 'whiflash:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in metrics
        engine.reply, engine.delay = "ok", 0.0
        assert httpx.post(url + "/v1/chat/completions", json={"messages": HI}).json()["choices"][0]["message"][
            "content"] == "ok"


def test_queued_request_whose_client_left_frees_its_place_at_once():
    import threading

    import httpx

    engine = FakeEngine("x" * 3000, chunk=1, delay=0.01)
    app = create_app(engine, Settings(max_active=1, max_queue=1))
    scheduler = app.state.scheduler
    with served(app) as url:
        running = threading.Thread(target=leave_after, args=(url, 4.0, {"messages": HI}))
        running.start()
        wait_until(lambda: scheduler.num_running == 1, 5.0)
        for stream in (False, True):  # queued behind it, then gone
            leave_after(url, 0.3, {"messages": HI, "stream": stream})
            wait_until(lambda: scheduler.num_waiting == 0, 1.0)
            assert scheduler.num_running == 1
        # its place is free: another request queues instead of getting a 429
        status = {}
        waiter = threading.Thread(target=lambda: status.setdefault("code", httpx.post(
            url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=30).status_code))
        waiter.start()
        wait_until(lambda: scheduler.num_waiting == 1, 2.0)
        running.join()
        waiter.join(30)
        assert status["code"] == 200


# --- fault isolation -----------------------------------------------------------------------------


def test_dead_engine_worker_fails_open_requests_with_503_and_turns_unhealthy():
    import threading

    engine = FakeEngine("x" * 400, chunk=1, delay=0.01)
    app, tc = in_process(engine, max_active=1)
    scheduler = app.state.scheduler
    with tc:
        answers = {}

        def ask(name):
            answers[name] = tc.post("/v1/chat/completions", json={"messages": HI})

        threads = [threading.Thread(target=ask, args=(n,)) for n in ("running", "queued")]
        for t in threads:
            t.start()
            time.sleep(0.1)
        wait_until(lambda: scheduler.num_running == 1 and scheduler.num_waiting == 1, 5.0)

        def broken(slot):  # a fault in the worker's own code, outside any one request's round
            raise RuntimeError("worker bug")

        scheduler._deliver = broken
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "an open request hung after the worker died"
        for name in ("running", "queued"):
            assert_openai_error(answers[name], 503, "engine_unavailable")
        assert tc.get("/health").status_code == 503
        assert_openai_error(tc.post("/v1/chat/completions", json={"messages": HI}), 503, "engine_unavailable")
        assert 'reason="engine_failure"' in tc.get("/metrics").text


def test_a_drafter_that_raises_falls_back_to_plain_decoding_for_that_request():
    import asyncio

    import pytest

    from app.metrics import Metrics
    from app.scheduler import Finished, Scheduler, TokenBatch
    from tiny import tiny_dflash, tiny_eagle, tiny_target
    from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig

    target = tiny_target()
    eagle = tiny_eagle(target)
    engine = Engine(target, None, {"eagle3": eagle, "dflash": tiny_dflash(target)})
    prompt = [5, 9, 17, 3, 22, 41, 8]
    plain = engine.generate(GenerationRequest(prompt, 40, speculation=SpeculationConfig(method="none"))).output

    calls = {"n": 0}
    propose = eagle.propose

    def flaky(*args, **kw):  # fails on its third proposal, on this instance only
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("drafter bug")
        return propose(*args, **kw)

    eagle.propose = flaky
    metrics = Metrics("tiny")

    async def serve(requests):
        scheduler = Scheduler(engine, metrics)
        scheduler.start()
        try:
            outputs = []
            for i, spec in enumerate(requests):
                handle = scheduler.submit(GenerationRequest(prompt, 40, speculation=spec), f"r{i}")
                tokens, finished = [], None
                async for item in handle:
                    if isinstance(item, TokenBatch):
                        tokens += item.token_ids
                    else:
                        finished = item
                assert isinstance(finished, Finished), finished
                outputs.append((tokens, finished.stats))
            return outputs
        finally:
            scheduler.stop()

    (failed, failed_stats), (after, after_stats) = asyncio.run(serve(
        [SpeculationConfig(method="eagle3"), SpeculationConfig(method="eagle3")]))
    assert calls["n"] > 3  # the second request drafted with EAGLE-3 again
    assert failed == plain and after == plain  # lossless either way
    assert failed_stats["fallback_from"] == "eagle3" and failed_stats["drafters"]["eagle3"]["rounds"] == 2
    assert "fallback_from" not in after_stats and after_stats["drafters"]["eagle3"]["rounds"] > 2
    text = metrics.render().decode()
    assert 'whiflash:spec_decode_drafter_failures_total{drafter="eagle3",model_name="tiny"} 1.0' in text
    # the target failing is not a drafter failing: it stays the request's error (no fallback)
    gen = engine.start(GenerationRequest(prompt, 5, speculation=SpeculationConfig(method="eagle3")))
    gen.prefill()

    def broken_target(*args, **kw):
        raise RuntimeError("target bug")

    engine.target.forward = broken_target
    with pytest.raises(RuntimeError, match="target bug"):
        gen.step()
    assert gen.fallback_from is None


# --- grammar work bounded ------------------------------------------------------------------------


def test_schemas_past_the_bounds_get_a_400_naming_the_bound():
    from whiflash_core.constraints import MAX_ENUM_VALUES, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH

    def any_of(depth: int) -> dict:
        s: dict = {"type": "string"}
        for _ in range(depth - 1):
            s = {"anyOf": [s, {"type": "integer"}]}
        return s

    too_much = {
        str(MAX_ENUM_VALUES): {"type": "object", "properties": {
            "a": {"enum": [f"v{i}" for i in range(MAX_ENUM_VALUES // 2)]},
            "b": {"type": "array", "items": {"enum": [f"w{i}" for i in range(MAX_ENUM_VALUES // 2 + 1)]}}}},
        str(MAX_SCHEMA_DEPTH): any_of(MAX_SCHEMA_DEPTH + 1),
        str(MAX_SCHEMA_BYTES): {"type": "string", "description": "x" * MAX_SCHEMA_BYTES},
    }
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        for limit, schema in too_much.items():
            r = tc.post("/v1/chat/completions", json={"messages": HI, "response_format": {
                "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
            error = assert_openai_error(r, 400, "schema_too_complex")
            assert error["param"] == "response_format" and limit in error["message"], error
            r = tc.post("/v1/chat/completions", json={"messages": HI, "tools": tools_with(schema),
                                                      "tool_choice": "required"})
            error = assert_openai_error(r, 400, "schema_too_complex")
            assert error["param"] == "tools[0].function.parameters" and limit in error["message"], error
        assert_still_serving(tc)
    from whiflash_core.constraints import check_schema
    check_schema(any_of(MAX_SCHEMA_DEPTH))  # at the bounds is fine
    check_schema({"enum": list(range(MAX_ENUM_VALUES))})


class SlowGrammars:
    """Stands in for xgrammar on a schema that takes `seconds` to compile (the fake engine has no
    real tokenizer to build a grammar for)."""

    def __init__(self, seconds: float):
        self.seconds, self.compiled = seconds, 0

    def json_schema(self, schema, strict=True):
        time.sleep(self.seconds)
        self.compiled += 1
        return None


def test_slow_grammar_meets_its_deadline_and_plain_requests_never_wait_behind_it():
    import threading

    app, tc = in_process(FakeEngine("ok"), grammar_timeout=0.5, grammar_queue=2)
    serving = app.state.serving
    serving._grammars = slow = SlowGrammars(2.0)

    def body(n: int) -> dict:   # a schema of its own per n
        return {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
            "type": "object", "properties": {f"p{n}": {"type": "string"}}}}}}

    with tc:
        answers = []
        # two distinct grammars fill the pool; a third request for the first one's grammar shares
        # its slot (agent streams resend the same tools), so all three are admitted
        grammar_requests = [threading.Thread(target=lambda n=n: answers.append(tc.post("/v1/chat/completions",
                                                                                       json=body(n))))
                            for n in (0, 1, 0)]
        for t in grammar_requests:
            t.start()
        wait_until(lambda: serving.grammar_jobs.pending == 2, 2.0)
        # the pool is full: another grammar is refused at once, plain requests are served at once
        assert_openai_error(tc.post("/v1/chat/completions", json=body(2)), 429, "grammar_queue_full")
        for _ in range(5):
            t0 = time.monotonic()
            assert_still_serving(tc)
            assert time.monotonic() - t0 < 0.4
        for t in grammar_requests:
            t.join(5)
        assert len(answers) == 3
        for r in answers:  # each waited its 0.5 s, then a 400 naming the limit
            error = assert_openai_error(r, 400, "grammar_timeout")
            assert "0.5 s" in error["message"] and error["param"] == "response_format"
        # the compilations go on in the background and free their places when done
        wait_until(lambda: serving.grammar_jobs.pending == 0, 8.0)
        slow.seconds = 0.0
        assert tc.post("/v1/chat/completions", json=body(2)).status_code == 200


def test_grammar_cache_is_bounded():
    from transformers import AutoTokenizer

    from app.settings import Settings as S
    from whiflash_core.constraints import GRAMMAR_CACHE_BYTES, GrammarFactory
    from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir

    assert S().grammar_cache_bytes == GRAMMAR_CACHE_BYTES > 0  # the server's default is a bound
    tok = AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)
    limit = 2 * 1024 * 1024  # a few grammars of this tokenizer (each ~0.5 MB); 30 would be ~16 MB
    grammars = GrammarFactory(tok, len(tok), [tok.eos_token_id], cache_limit_bytes=limit)
    assert grammars.compiler.cache_limit_bytes == limit
    for i in range(30):  # distinct schemas, each cached
        grammars.json_schema({"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(8)}})
        assert grammars.compiler.get_cache_size_bytes() <= limit


# --- the request body in the OpenAPI document ----------------------------------------------------


def test_openapi_document_describes_the_chat_request_body():
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        doc = tc.get("/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert body["required"] and "messages" in schema["required"]
    assert {"messages", "temperature", "tools", "stop", "speculation"} <= set(schema["properties"])
    # every $ref resolves inside the document (what a fuzzer such as schemathesis needs)
    refs, stack = [], [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            refs += [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    assert any(r.endswith("/ChatMessage") for r in refs)
    for ref in refs:
        target = doc
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]


# --- memory handed back after refusals ---------------------------------------------------------


def test_refused_requests_trim_the_heap_once_per_burst(monkeypatch):
    import app.memory as memory

    trims = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(memory, "TRIM_DELAY_SECONDS", 0.2)
    # the 5 s cap for floods has its own test: a burst slowed past it (a loaded 2-core CI run of
    # the whole suite) would trim twice here
    monkeypatch.setattr(memory, "TRIM_MAX_WAIT_SECONDS", 60.0)
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        for _ in range(20):  # a burst of refusals, from the limits and from the app
            assert tc.post("/v1/chat/completions", content="x", headers={"content-type": "text/plain"}).status_code == 415
            assert tc.post("/v1/chat/completions", json={"messages": "nope"}).status_code == 400
        wait_until(lambda: trims, 2.0)
        time.sleep(0.4)
        assert len(trims) == 1  # one trim for the whole burst, not one per request
        for _ in range(5):  # served requests leave trimming to the scheduler's idle trim
            assert_still_serving(tc)
        time.sleep(0.4)
        assert len(trims) == 1


def test_a_flood_of_refusals_that_never_pauses_still_trims(monkeypatch):
    import app.memory as memory

    trims = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(memory, "TRIM_DELAY_SECONDS", 0.2)
    monkeypatch.setattr(memory, "TRIM_MAX_WAIT_SECONDS", 0.5)
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # refusals back to back: never a 0.2 s pause
            assert tc.post("/v1/chat/completions", json={"messages": "nope"}).status_code == 400
        flood_over = time.monotonic()
        assert trims and trims[0] < flood_over  # the max wait, not the pause, set off the first trim
        assert len(trims) <= 4  # about one per max wait, not one per refusal
        assert_still_serving(tc)


def test_malloc_arenas_are_capped_unless_the_environment_says(monkeypatch):
    import argparse

    import app.memory as memory
    from app.serve_cli import add_parser, settings_from_args

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))

        def malloc_trim(self, pad):
            calls.append(("trim", pad))

    monkeypatch.setattr(memory, "_libc", lambda: Libc())
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert Settings().malloc_arena_max == 2
    memory.limit_malloc_arenas(Settings().malloc_arena_max)
    assert calls == [(memory.M_ARENA_MAX, 2)]
    memory.limit_malloc_arenas(0)  # 0: glibc's default
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # glibc read it at start: left alone
    memory.limit_malloc_arenas(2)
    assert calls == [(memory.M_ARENA_MAX, 2)]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(["serve", "--malloc-arena-max", "0"])).malloc_arena_max == 0
