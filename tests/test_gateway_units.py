"""Gateway pieces without the model: parsers, stop strings, settings, and the app in-process around
a fake engine that replays a fixed reply several tokens per round (as speculative rounds do)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.output import TextAccumulator
from app.settings import Settings
from app.tools import ToolCallParser, parse_tool_calls
from whiflash_core.buffers import BufferPool
from whiflash_core.config import SpeculationConfig
from whiflash_core.rounds import Round, Tally

# --- tool-call parsing under every chunking ------------------------------------------------------

RECORDED = [
    # (model output, expected content, expected [(name, arguments)])
    ('<tool_call>\n{"name": "get_weather", "arguments": {\n   "city": "Paris",\n   "unit": "celsius"\n}}\n</tool_call>',
     None, [("get_weather", '{\n   "city": "Paris",\n   "unit": "celsius"\n}')]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"s": "br}ace \\" {quote", "n": [1, {"x": null}]}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "b"}\n</tool_call>',
     "Let me check.", [("a", '{"s": "br}ace \\" {quote", "n": [1, {"x": null}]}'), ("b", "{}")]),
    ('<tool_call>\n{"name": "c"}\n</tool_call>', None, [("c", "{}")]),
    # cut off by max_tokens inside a second call: the complete one is kept
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "a", "argu',
     None, [("a", '{"x": 1}')]),
]
PLAIN = ["Hello <tool but not a call", "x < y and y > z  \n", "<tool_call>not json</tool_call> trailing"]


def stream_parse(text: str, size: int, parallel: bool = True, names=None):
    """(content, [(name, arguments)]) of `text` streamed `size` characters at a time."""
    parser = ToolCallParser(parallel, names)
    content, calls = "", []
    cuts = list(range(size, len(text), size)) + [len(text)]
    for n, cut in enumerate(cuts):
        piece, new = parser.update(text[:cut], final=n == len(cuts) - 1)
        content += piece
        calls += [(c.name, c.arguments) for c in new]
    return content, calls


def final_parse(text: str, parallel: bool = True, names=None):
    content, calls = parse_tool_calls(text, parallel, names)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text,content,expected", RECORDED)
def test_streamed_tool_calls_match_final_parse_for_every_chunking(text, content, expected):
    assert final_parse(text) == (content, expected)
    for size in range(1, len(text) + 1):
        streamed_content, calls = stream_parse(text, size)
        assert ((streamed_content or None) if calls else streamed_content, calls) == (content, expected), size


@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_streams_unchanged(text):
    assert final_parse(text) == (text, [])
    for size in range(1, len(text) + 1):
        assert stream_parse(text, size) == (text, []), size


# a call cut off by max_tokens, arguments that are not an object, a body that is not a call, a tool
# not offered: never a call, and all of the text as content, streamed or not (issue 17, finding 3)
NOT_CALLS = [
    '<tool_call>\n{"name": "get_weather",',
    'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',
    '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_cut_off_or_invalid_calls_are_content_streamed_or_not(text):
    names = {"get_weather"}
    assert final_parse(text, names=names) == (text, [])
    for size in range(1, len(text) + 1):
        assert stream_parse(text, size, names=names) == (text, []), size


def test_arguments_as_a_json_string_holding_an_object():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>'
    assert final_parse(text) == (None, [("f", '{"city": "Paris"}')])
    assert all(stream_parse(text, size) == ("", [("f", '{"city": "Paris"}')]) for size in (1, 5, len(text)))


def test_after_a_valid_call_an_invalid_one_ends_the_calls():
    text = RECORDED[0][0] + "\n<tool_call>\nnot a call\n</tool_call>\n" + RECORDED[0][0]
    expected = (None, RECORDED[0][2])
    assert final_parse(text) == expected
    assert all(stream_parse(text, size) == ("", expected[1]) for size in (1, 4, 9, len(text)))


def test_parallel_false_keeps_the_first_call():
    text = RECORDED[1][0]
    assert [name for name, _ in final_parse(text, parallel=False)[1]] == ["a"]
    assert [name for name, _ in stream_parse(text, 7, parallel=False)[1]] == ["a"]


# --- stop strings and detokenization -------------------------------------------------------------


class CharTokenizer:
    """Token id = Unicode code point; a toy chat template."""

    chat_template = ""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ByteTokenizer(CharTokenizer):
    """Token id = one UTF-8 byte, so characters can span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_strings_hold_back_and_cut():
    acc = TextAccumulator(CharTokenizer(), ["STOP", "\n\n"])
    acc.add([ord(c) for c in "Hello ST"])
    assert acc.visible() == "Hello " and not acc.stopped
    acc.add([ord(c) for c in "OP and more"])
    assert acc.stopped and acc.text == "Hello " and acc.num_tokens == len("Hello STOP")
    acc = TextAccumulator(CharTokenizer(), ["STOP"])
    acc.add([ord(c) for c in "no stop ST"])
    acc.finish()
    assert acc.visible(final=True) == "no stop ST" and not acc.stopped


def test_incremental_detokenization_waits_for_whole_characters():
    text = "naïve café ☕ done"
    acc = TextAccumulator(ByteTokenizer())
    seen = []
    for b in text.encode():
        acc.add([b])
        seen.append(acc.text)
    acc.finish()
    assert acc.text == text
    assert all("\ufffd" not in s for s in seen)


# --- settings ------------------------------------------------------------------------------------


def test_cli_flags_override_environment(monkeypatch):
    import argparse

    from app.serve_cli import add_parser, settings_from_args

    monkeypatch.setenv("WHIFLASH_PORT", "9000")
    monkeypatch.setenv("WHIFLASH_MAX_QUEUE", "3")
    monkeypatch.setenv("WHIFLASH_CORS_ORIGINS", "http://a.example,http://b.example")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    s = settings_from_args(parser.parse_args(["serve", "--port", "9100", "--api-key", "k"]))
    assert (s.port, s.max_queue, s.api_key) == (9100, 3, "k")
    assert s.cors_origins == ["http://a.example", "http://b.example"]


# --- the app around a fake engine ----------------------------------------------------------------


class ReplayGeneration:
    """Emits `engine.reply` `engine.chunk` tokens per round; enough of Generation for the scheduler."""

    def __init__(self, engine: FakeEngine, request):
        if request.speculation.method not in engine.methods:
            raise ValueError(f"speculation method {request.speculation.method!r} is not available")
        self.engine, self.request, self.spec = engine, request, request.speculation
        self.prompt_len = len(request.prompt_ids)
        self.script = [ord(c) for c in engine.reply]
        self.output, self.sources = [], []
        self.tally = Tally.over(["dflash"])
        self.rounds = 0
        self.finished, self.finish_reason = False, None
        self.cached_tokens = 0

    def _emit(self, n: int) -> None:
        take = self.script[len(self.output):len(self.output) + n][: self.request.max_new_tokens - len(self.output)]
        self.output += take
        self.sources += ["dflash"] * (len(take) - 1) + ["target"]
        if len(self.output) == len(self.script):
            self.finished, self.finish_reason = True, "stop"
        elif len(self.output) >= self.request.max_new_tokens:
            self.finished, self.finish_reason = True, "length"

    def prefill(self):
        self._emit(1)

    def step(self):
        time.sleep(self.engine.delay)
        if self.rounds + 1 == self.engine.fail_at_round:
            raise RuntimeError("boom")
        self.rounds += 1
        chunk = self.engine.chunk
        r = Round(self.rounds, "dflash", chunk, chunk - 1, decided=chunk)
        self.tally.add(r)
        self._emit(chunk)
        return r

    def cancel(self):
        if not self.finished:
            self.finished, self.finish_reason = True, "cancelled"

    def stats(self, trace=None):
        return {"method": self.spec.method, "rounds": self.rounds,
                "drafters": {k: d.as_dict() for k, d in self.tally.drafters.items()}}

    def timing(self):
        return {}


def step_each(gens) -> list:
    """What Engine.step_many returns, for fake engines: a round of each generation, one request's
    exception in its place."""
    results = []
    for gen in gens:
        try:
            results.append(gen.step())
        except Exception as exc:
            results.append(exc)
    return results


class StepsEachAlone:
    """The scheduler's side of the engine for fake engines: each generation steps on its own
    (step_each), and no prefill rides in a shared step (Engine.rides_prefills), so none is passed."""

    def rides_prefills(self):
        return False

    def step_many(self, gens, prefills=()):
        return step_each(gens)


class FakeEngine(StepsEachAlone):
    model_name = "fake-model"
    max_context = 4096
    vocab_size = 0x110000  # CharTokenizer: token id = code point
    eos_ids = [0]
    methods = ["none", "dflash"]
    buffers = BufferPool()   # the scheduler trims it when idle

    def __init__(self, reply: str, chunk: int = 3, delay: float = 0.0, fail_at_round: int | None = None):
        self.reply, self.chunk, self.delay, self.fail_at_round = reply, chunk, delay, fail_at_round
        self.tokenizer = CharTokenizer()

    def start(self, request):
        return ReplayGeneration(self, request)


TOOL_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"unit": "celsius"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HI = [{"role": "user", "content": "hi"}]
MODEL = FakeEngine.model_name  # the served id: any other `model` is a 404


def in_process(engine, **settings):
    # the toy tokenizers have no vocabulary for xgrammar: tools under auto stay free output here, so
    # these tests exercise the parser on whatever the model writes (the grammar: test_tool_auto.py)
    settings.setdefault("lazy_tool_grammar", False)
    app = create_app(engine, Settings(**settings))
    return app, TestClient(app)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 13, 40])
def test_multi_token_rounds_stream_tool_calls_correctly(chunk):
    app, tc = in_process(FakeEngine(TOOL_REPLY, chunk=chunk))
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].message.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
        with client.chat.completions.stream(model=MODEL, messages=HI, tools=TOOLS) as stream:
            final = stream.get_final_completion()
        msg = final.choices[0].message
        assert msg.content == "Let me check." and msg.role == "assistant"
        (streamed,) = msg.tool_calls
        assert streamed.function.name == "get_weather"  # not "get_weatherget_weather"
        assert streamed.function.arguments == call.function.arguments
        assert json.loads(streamed.function.arguments) == {"city": "Paris", "unit": "celsius"}
        assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_stop_string_across_multi_token_rounds(chunk):
    app, tc = in_process(FakeEngine("Hello there STOP and the rest", chunk=chunk))
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=HI, stop=["STOP"])
        assert r.choices[0].message.content == "Hello there " and r.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stop=["STOP"], stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there "


def test_api_key_and_cors():
    app, tc = in_process(FakeEngine("ok"), api_key="secret", cors_origins=["http://ui.example"])
    with tc:
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=tc, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model=MODEL, messages=HI)
        body = info.value.response.json()
        assert info.value.status_code == 401 and body["error"]["code"] == "invalid_api_key"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert tc.post("/v1/chat/completions", json={"messages": HI}).status_code == 401
        assert tc.get("/v1/models").status_code == 401
        assert tc.get("/health").status_code == 200  # probes need no key
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="secret", http_client=tc, max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=HI).choices[0].message.content == "ok"
        pre = tc.options("/v1/chat/completions", headers={"Origin": "http://ui.example",
                                                          "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
        assert pre.headers["access-control-allow-origin"] == "http://ui.example"


def test_unavailable_method_and_context_length():
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HI, extra_body={"speculation": {"method": "eagle3"}})
        assert info.value.response.json()["error"]["param"] == "speculation.method"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 5000}])
        assert info.value.response.json()["error"]["code"] == "context_length_exceeded"
        r = client.chat.completions.create(model=MODEL, messages=HI)
        assert r.model_extra["speculation"]["method"] == "dflash"  # the default: best available


def test_speculation_policy_is_validated_and_reaches_the_engine():
    engine = FakeEngine("ok")
    started = []
    engine.start = lambda request: started.append(request.speculation) or ReplayGeneration(engine, request)
    app, tc = in_process(engine)
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        for bad in ("neural", "", 1):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=MODEL, messages=HI, extra_body={"speculation": {"policy": bad}})
            assert info.value.response.json()["error"]["param"] == "speculation.policy", bad
        for policy in ("entropy", "cost", "learned"):
            client.chat.completions.create(model=MODEL, messages=HI, extra_body={"speculation": {"policy": policy}})
        client.chat.completions.create(model=MODEL, messages=HI)
    assert [s.policy for s in started] == ["entropy", "cost", "learned", SpeculationConfig().policy]


def test_full_server_answers_429_then_recovers():
    app, tc = in_process(FakeEngine("x" * 30, chunk=1, delay=0.03), max_active=1, max_queue=0)
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        first: dict = {}
        worker = threading.Thread(target=lambda: first.setdefault(
            "r", client.chat.completions.create(model=MODEL, messages=HI)))
        worker.start()
        deadline = time.monotonic() + 5
        while app.state.scheduler.num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=HI)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        worker.join(10)
        assert first["r"].choices[0].message.content == "x" * 30
        assert client.chat.completions.create(model=MODEL, messages=HI).choices[0].finish_reason == "stop"


def test_a_full_server_frees_the_place_before_the_client_hears_the_end(monkeypatch):
    """One place (max_active=1, no queue): a client that sends its next request the moment the
    last answer ended gets an answer, not a 429. The worker frees the place (with the metrics,
    `_record_finish`) before it pushes the end; freeing is slowed here so that the other order
    would fail every time, not by chance."""
    app, tc = in_process(FakeEngine("x" * 3, chunk=1), max_active=1, max_queue=0)
    scheduler = app.state.scheduler
    record = scheduler._record_finish

    def slow_record(*args, **kw):
        time.sleep(0.3)
        return record(*args, **kw)

    monkeypatch.setattr(scheduler, "_record_finish", slow_record)
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        for _ in range(3):
            assert client.chat.completions.create(model=MODEL, messages=HI).choices[0].message.content == "xxx"


def test_events_are_published_per_request():
    app = create_app(FakeEngine("hello world", chunk=4), Settings())

    async def main():
        app.state.scheduler.start()
        try:
            sub = app.state.events.subscribe()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
                client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
                await client.chat.completions.create(model=MODEL, messages=HI)
            events = []
            while not events or events[-1]["type"] != "request_finished":
                events.append(await asyncio.wait_for(sub.get(), 5))
            sub.close()
            return events
        finally:
            app.state.scheduler.stop()

    events = asyncio.run(main())
    kinds = [e["type"] for e in events]
    assert kinds[0] == "request_started" and kinds[-1] == "request_finished"
    assert {"round", "tokens"} <= set(kinds)
    assert events[0]["method"] == "dflash" and "alpha" in events[0]
    text = "".join(t["text"] for e in events if e["type"] == "tokens" for t in e["tokens"])
    assert text == "hello world"
    assert events[-1]["stats"]["rounds"] >= 1


def test_failures_mid_generation_are_reported_and_isolated():
    app, tc = in_process(FakeEngine("some text that fails halfway", chunk=2, fail_at_round=3))
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=HI)
        assert info.value.response.headers["x-should-retry"] == "false"
        assert set(info.value.response.json()["error"]) == {"message", "type", "param", "code"}
        # in a stream: the tokens so far, then an error event, then [DONE]
        with tc.stream("POST", "/v1/chat/completions", json={"messages": HI, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert json.loads(events[1])["choices"][0]["delta"]["content"]
        with pytest.raises(openai.APIError):
            list(client.chat.completions.create(model=MODEL, messages=HI, stream=True))
        # the next request is unaffected
        app.state.serving.engine.fail_at_round = None
        r = client.chat.completions.create(model=MODEL, messages=HI)
        assert r.choices[0].message.content == "some text that fails halfway"


def test_request_timeout():
    app, tc = in_process(FakeEngine("x" * 50, chunk=1, delay=0.02), request_timeout=0.2)
    with tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=HI)
        assert info.value.status_code == 504
        assert info.value.response.json()["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("threads, step_threads, default, expected", [
    (None, None, 2, (2, 1)),    # a 2-core machine: rounds on one core, the HTTP side keeps the other
    (None, None, 1, (1, 1)),
    (8, None, 2, (8, 7)),
    (4, 4, 2, (4, 4)),          # asked for: every core for the rounds too
])
def test_engine_threads_leave_a_core_to_the_server_by_default(threads, step_threads, default, expected):
    from app.settings import Settings

    assert Settings(threads=threads, step_threads=step_threads).engine_threads(default) == expected
