"""Issue 18's hostile inputs replayed against a live `whiflash serve` (the real model): each gets its
OpenAI-shaped refusal or is made harmless, and afterwards the server is healthy, still answers, and
its memory is back where it was. test_hostile_input.py tests the same limits in-process, piece by
piece; this is the whole server, measured from outside.

Memory is the server subprocess's VmRSS (/proc/<pid>/status) and, for peaks, VmHWM after resetting
it (/proc/<pid>/clear_refs). Margins, and why:
  * REFUSED_MARGIN_MB = 20 after each of three rounds of every refused input: a refused request
    holds nothing once answered. What RSS still shows is the one-time growth of the first large
    bodies (+2-11 MB in our runs, flat after that): pages that the request thread's malloc arena
    keeps partly used. With glibc's default of 8 arenas per core each request thread kept its own,
    and RSS crept up in steps (+9 to +28 MB within three rounds); the server now caps them at 2
    (`malloc_arena_max`, app/memory.py). A leak of what one round reads (~13 MB of bodies, several
    times that once parsed) would exceed 20 MB within the three rounds. Without the trim after
    refusals (app/memory.py) RSS stayed +43 MB (glibc's free lists); before the body limit one
    10 MB message kept 2.1 GB.
  * PEAK_MARGIN_MB = 100: while the set runs (three 1.9 MB bodies parsed at once among them) the
    peak was +38-43 MB; before the limits one 10 MB message peaked at +1.3 GB.
  * BUDGET_MARGIN_MB = 96 after rows whose requests are served (grammars compiled, answers
    generated): xgrammar's cache may keep up to its 64 MiB bound, plus the margin above.

The session `live_server` serves the row-by-row replays; the faults that need a server of their own
(one slot, so a queue forms; an engine worker that dies; SIGTERM) use `one_slot_server`.
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
REFUSED_MARGIN_MB = 20
PEAK_MARGIN_MB = 100
BUDGET_MARGIN_MB = 96
HI = [{"role": "user", "content": "Say hi."}]
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's <|endoftext|> and <|im_end|>: the answer runs to max_tokens


# --- measuring the server from outside ---------------------------------------------------------


def status_mb(pid: int, field: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024


def rss_mb(pid: int) -> float:
    return status_mb(pid, "VmRSS")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # "5": reset the peak RSS (VmHWM) to the current RSS


def settled_rss(pid: int, at_most: float, seconds: float = 5.0) -> float:
    """RSS once it is at most `at_most` MB (memory is handed back shortly after a request ends), or
    the lowest seen within `seconds`."""
    lowest, deadline = rss_mb(pid), time.monotonic() + seconds
    while lowest > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
        lowest = min(lowest, rss_mb(pid))
    return lowest


def post(url: str, body=None, *, content=None, headers=None, timeout: float = 60) -> httpx.Response:
    if content is None:
        content = json.dumps(body)
    return httpx.post(url + "/v1/chat/completions", content=content, timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_refused(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error


def answer(url: str, **body) -> dict:
    r = post(url, {"messages": HI, "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_healthy(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert answer(url)["choices"][0]["message"]["content"]


# --- the hostile inputs: each with the refusal it must get ----------------------------------------


def nested(depth: int) -> str:
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def any_of(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth - 1):
        s = {"anyOf": [s, {"type": "integer"}]}
    return s


def structured(schema: dict) -> dict:
    return {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}


def replayed_call(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def chunked(total: int, piece: int = 64 * 1024):
    """A body sent without Content-Length, `total` bytes in pieces."""
    yield b'{"messages": [{"role": "user", "content": "'
    for _ in range(total // piece):
        yield b"x" * piece


ENUM_100K = {"type": "object", "properties": {"a": {"enum": [f"value-{i:06d}" for i in range(100_000)]}}}
NEAR_LIMIT = json.dumps({"messages": [{"role": "user", "content": "x " * 950_000}]})  # 1.9 MB < 2 MiB

# name -> (request keyword arguments for `post`, status, error code)
REFUSED = {
    "10 MB message": (dict(body={"messages": [{"role": "user", "content": "x" * 10_000_000}]}), 413,
                      "request_too_large"),
    "10 MB message, chunked": (dict(content=None), 413, "request_too_large"),  # a fresh generator each time
    "1.9 MB message": (dict(content=NEAR_LIMIT), 400, "context_length_exceeded"),
    "enum of 100k strings (1.3 MB)": (dict(body=structured(ENUM_100K)), 400, "schema_too_complex"),
    "anyOf nested 14 deep": (dict(body=structured(any_of(14))), 400, "schema_too_complex"),
    "5,000 messages": (dict(body={"messages": [{"role": "user", "content": "hello there"}] * 5000}), 400,
                       "context_length_exceeded"),
    "1,000 stop strings": (dict(body={"messages": HI, "stop": [f"s{i}" for i in range(1000)]}), 400, None),
    "16 stop strings of 100 KB": (dict(body={"messages": HI, "stop": ["y" * 100_000] * 16}), 400, None),
    "tool arguments nested 3,000 deep": (dict(body={"messages": replayed_call(nested(3000))}), 400,
                                         "nesting_too_deep"),
    "a body nested 3,000 deep": (dict(content='{"messages": [{"role": "user", "content": ' + "[" * 3000 + "]" * 3000
                                      + "}]}"), 400, "nesting_too_deep"),
    "129 tools": (dict(body={"messages": HI, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                       for i in range(129)]}), 400, "too_many_tools"),
    "image part": (dict(body={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}), 400, None),
    "invalid UTF-8": (dict(content=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400, "invalid_json"),
    "malformed JSON": (dict(content='{"messages": [{"role": "user", "content": "hi"}'), 400, "invalid_json"),
    "text/plain body": (dict(body={"messages": HI}, headers={"content-type": "text/plain"}), 415,
                        "unsupported_media_type"),
}


def send_refused(url: str, name: str) -> float:
    """Send one hostile request; check its refusal; its seconds."""
    kw, status, code = REFUSED[name]
    kw = dict(kw)
    if name == "10 MB message, chunked":
        kw["content"] = chunked(10_000_000)
    t0 = time.monotonic()
    assert_refused(post(url, **kw), status, code)
    return time.monotonic() - t0


def send_all_refused(url: str) -> dict[str, float]:
    seconds = {name: send_refused(url, name) for name in REFUSED}
    # three at once, as in the issue (5.9 GB peak before the limit): sizes beyond and just within it
    with ThreadPoolExecutor(6) as pool:
        for name in ["10 MB message"] * 3 + ["1.9 MB message"] * 3:
            pool.submit(send_refused, url, name)
    return seconds


# --- row 2 and every refusal: memory returns to its level before ---------------------------------


def test_refused_hostile_requests_leave_memory_where_it_was(live_server):
    url, pid = live_server.url, live_server.proc.pid
    answer(url)
    before = settled_rss(pid, at_most=0)  # the lowest RSS over a few idle seconds
    reset_peak(pid)
    seconds = send_all_refused(url)
    peak = status_mb(pid, "VmHWM")
    after = [settled_rss(pid, at_most=before + REFUSED_MARGIN_MB)]
    for _ in range(2):
        send_all_refused(url)
        after.append(settled_rss(pid, at_most=before + REFUSED_MARGIN_MB))
    figures = {"rss_before_mb": round(before, 1), "rss_after_each_round_mb": [round(a, 1) for a in after],
               "peak_during_first_round_mb": round(peak, 1), "seconds": {k: round(v, 3) for k, v in seconds.items()}}
    (REPO / "tests" / "artifacts").mkdir(exist_ok=True)
    (REPO / "tests" / "artifacts" / "hostile_memory.json").write_text(json.dumps(figures, indent=1))
    assert max(seconds.values()) < 5, figures  # refused at once, not after seconds of parsing
    assert max(after) <= before + REFUSED_MARGIN_MB, figures
    assert peak <= before + PEAK_MARGIN_MB, figures
    assert_healthy(url)


def assert_within_budget(pid: int, before: float, margin: float = BUDGET_MARGIN_MB) -> None:
    rss = settled_rss(pid, at_most=before + margin)
    assert rss <= before + margin, f"RSS {rss:.1f} MB, {rss - before:+.1f} MB over {before:.1f} MB"


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (all labels)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


# --- row 1: grammar work bounded -----------------------------------------------------------------


def distinct_enum(i: int) -> dict:
    """A schema at the enum bound (1,000 values), different each time so that nothing is cached:
    ~0.5 s to compile for this tokenizer."""
    return {"type": "object", "properties": {"choice": {"enum": [f"option {i}-{j}" for j in range(1000)]}},
            "required": ["choice"]}


def test_huge_schemas_are_refused_at_once_and_plain_requests_never_wait(live_server):
    url, pid = live_server.url, live_server.proc.pid
    answer(url)
    before = settled_rss(pid, at_most=0, seconds=2)
    plain_seconds = []

    def plain():
        t0 = time.monotonic()
        answer(url)
        plain_seconds.append(time.monotonic() - t0)

    with ThreadPoolExecutor(8) as pool:
        # what used to hold the global grammar lock for minutes, several at once, and grammars at the
        # bounds (compiled, in their own pool), while plain requests and /health go on
        huge = [pool.submit(post, url, structured(ENUM_100K)) for _ in range(3)]
        deep = [pool.submit(post, url, structured(any_of(14))) for _ in range(2)]
        at_bound = [pool.submit(post, url, {**structured(distinct_enum(i)), "max_tokens": 12, "temperature": 0})
                    for i in range(2)]
        for _ in range(3):
            plain()
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        for f in huge + deep:
            error = assert_refused(f.result(), 400, "schema_too_complex")
            assert error["param"] == "response_format"
        for f in at_bound:
            r = f.result()
            assert r.status_code in (200, 429), r.text  # 429: the grammar pool was full (grammar_queue)
            if r.status_code == 200:
                assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{")
    assert max(plain_seconds) < 10, plain_seconds  # before: stuck behind the compilation, for minutes
    assert_healthy(url)
    assert_within_budget(pid, before)


# --- row 3: stop strings bounded, matched in linear time -------------------------------------------


def test_stop_strings_past_the_bounds_are_refused_and_at_the_bounds_cost_nothing(live_server):
    from app.limits import MAX_STOP_CHARS, MAX_STOPS

    url, pid = live_server.url, live_server.proc.pid
    before = settled_rss(pid, at_most=0, seconds=2)
    t0 = time.monotonic()
    error = assert_refused(post(url, {"messages": HI, "stop": ["y" * 100_000] * 16}), 400)
    assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]
    assert time.monotonic() - t0 < 2  # before: ~100 s of event-loop time for this one request
    body = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}], "max_tokens": 24,
            "temperature": 0, "logit_bias": NO_EOS}
    t0 = time.monotonic()
    plain = answer(url, **body)
    plain_s = time.monotonic() - t0
    # the worst stop strings allowed: as many and as long as accepted, each a prefix of the answer
    # extended so that it never matches (the hold-back must keep checking every one of them)
    text = plain["choices"][0]["message"]["content"]
    stops = [(text[:k] + "\x00" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for k in range(1, MAX_STOPS + 1)]
    for stream in (False, True):
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json={**body, "stop": stops, "stream": stream}, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"] if not stream else "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in r.text.splitlines() if line.startswith("data: {") and '"choices":[{' in line)
        assert got == text
        assert time.monotonic() - t0 < 3 * plain_s + 5
    assert_healthy(url)
    assert_within_budget(pid, before)


# --- row 6: the stats feed, per viewer --------------------------------------------------------------


def test_the_live_feed_shows_a_viewer_its_own_text_and_others_only_counts(live_server):
    url = live_server.url
    alice = {"whiflash_viewer": httpx.get(url + "/chat").cookies["whiflash_viewer"]}
    bob = {"whiflash_viewer": httpx.get(url + "/stats").cookies["whiflash_viewer"]}
    r = httpx.post(url + "/v1/chat/completions", cookies=alice, timeout=60, json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0,
        "speculation": {"trace": True}})
    reply = r.json()
    text = reply["choices"][0]["message"]["content"]
    mine, theirs, nobodys = (httpx.get(url + "/v1/stats/snapshot", cookies=c, timeout=10).json()
                             for c in (alice, bob, None))
    for snap, visible in ((mine, True), (theirs, False), (nobodys, False)):
        events = [e for e in snap["events"] if e.get("id") == reply["id"]]
        tokens = [t for e in events if e["type"] == "tokens" for t in e["tokens"]]
        assert [t["source"] for t in tokens] == [t["source"] for t in reply["speculation"]["tokens"]]
        assert ("".join(t.get("text", "") for t in tokens) == text) is visible
        assert all(("text" in t) is visible and ("id" in t) is visible for t in tokens)
        (finished,) = [e for e in events if e["type"] == "request_finished"]
        assert ("tokens" in finished["stats"]) is visible and finished["stats"]["rounds"] == \
            reply["speculation"]["rounds"]
        assert "owner" not in json.dumps(snap)
    assert theirs["aggregate"]["tokens"] == mine["aggregate"]["tokens"]  # the counts are everyone's


# --- row 7: tiny temperatures, deep tool arguments, content types ----------------------------------


def test_tiny_temperature_deep_arguments_and_other_content_types(live_server):
    url, pid = live_server.url, live_server.proc.pid
    before = settled_rss(pid, at_most=0, seconds=2)
    body = {"messages": [{"role": "user", "content": "Name three fruits."}], "max_tokens": 8}
    greedy = answer(url, **body, temperature=0)["choices"][0]["message"]["content"]
    for t in (1e-300, 1e-6):  # before: 1e-300 -> 500 with torch's NaN message
        assert answer(url, **body, temperature=t)["choices"][0]["message"]["content"] == greedy, t
    # found by schemathesis: top_p 5e-324 (0 in float32) -> 500; it keeps the most likely token alone
    assert answer(url, **body, temperature=1.0, top_p=5e-324)["choices"][0]["message"]["content"] == greedy
    r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                                   "temperature": 1e-300}, timeout=60)
    assert r.status_code == 200, r.text
    # before: RecursionError -> 500 (tool-call arguments are JSON text: parsed for the template)
    error = assert_refused(post(url, {"messages": replayed_call(nested(3000))}), 400, "nesting_too_deep")
    assert error["param"] == "messages"
    # before: any Content-Type was read as JSON
    raw = json.dumps({"messages": HI, "max_tokens": 2})
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/completions"):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                             "application/jsonx", ""):
            r = httpx.post(url + path, content=raw, headers={"content-type": content_type}, timeout=10)
            assert_refused(r, 415, "unsupported_media_type")
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert_healthy(url)
    assert_within_budget(pid, before, REFUSED_MARGIN_MB)


# --- row 8: the request bodies in the OpenAPI document ---------------------------------------------


def test_the_openapi_document_describes_every_post_body(live_server):
    doc = httpx.get(live_server.url + "/openapi.json", timeout=10).json()
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert {"/v1/chat/completions", "/v1/completions"} <= set(posts)
    for path, op in posts.items():
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert op["requestBody"]["required"] and schema["properties"], path
    assert {"messages"} <= set(posts["/v1/chat/completions"]["requestBody"]["content"]["application/json"]
                               ["schema"]["required"])


# --- rows 5, 7 (the engine worker) and 1 (SIGTERM): a server of their own ----------------------------


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory):
    """One generation at a time and one waiting (so a queue forms), started through
    tests/fault_injection.py: its engine worker dies once `server.fault_flag` exists. The tests
    below use it in order: disconnects, then the worker's death, then SIGTERM."""
    import sys

    from conftest import start_server

    log_dir = tmp_path_factory.mktemp("one-slot")
    flag = log_dir / "kill-the-worker"
    server = start_server("--dtype", "float32", "--max-active", "1", "--max-queue", "1", log_dir=log_dir,
                          env={"WHIFLASH_TEST_WORKER_FAULT": str(flag)},
                          command=[sys.executable, str(REPO / "tests" / "fault_injection.py")])
    server.fault_flag = flag
    yield server
    server.stop()


LONG = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": 1000, "temperature": 0, "logit_bias": NO_EOS}


def test_clients_that_leave_free_their_slot_and_their_place_in_the_queue(one_slot_server):
    from test_hostile_input import leave_after, wait_until

    url = one_slot_server.url
    running = lambda: metric(url, "whiflash:num_requests_running")  # noqa: E731
    waiting = lambda: metric(url, "whiflash:num_requests_waiting")  # noqa: E731
    tokens_before = metric(url, "whiflash:generation_tokens_total")
    # a non-streaming client that leaves while its tokens flow: noticed within the 0.1 s poll
    leave_after(url, 1.5, LONG)
    assert metric(url, "whiflash:generation_tokens_total") > tokens_before + 5  # it was generating
    assert wait_until(lambda: running() == 0, 5.0) < 1.5  # before: only after 1 s without tokens, i.e. never
    # a queued client that leaves frees its place at once (before: kept it, and others got 429s)
    holder = threading.Thread(target=leave_after, args=(url, 5.0, LONG))
    holder.start()
    wait_until(lambda: running() == 1, 10.0)
    for stream in (False, True):
        leave_after(url, 0.5, {**LONG, "stream": stream})
        wait_until(lambda: waiting() == 0, 1.5)
    status = {}
    queued = threading.Thread(target=lambda: status.setdefault("code", post(url, {**LONG, "max_tokens": 2}).status_code))
    queued.start()
    wait_until(lambda: waiting() == 1, 3.0)  # it waits for the slot instead of getting a 429
    holder.join(30)
    queued.join(60)
    assert status["code"] == 200
    assert_healthy(url)


def test_a_dead_engine_worker_fails_open_requests_with_503_and_health_turns_503(one_slot_server):
    from test_hostile_input import wait_until

    url = one_slot_server.url
    assert_healthy(url)
    seen: list[str] = []
    results: dict = {}

    def stream():
        with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(line[6:])

    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: len(seen) > 3, 60.0)
    queued = threading.Thread(target=lambda: results.setdefault("queued", post(url, LONG)))
    queued.start()
    wait_until(lambda: metric(url, "whiflash:num_requests_waiting") == 1, 5.0)
    one_slot_server.fault_flag.touch()  # the worker raises outside any request's round
    streamer.join(10)
    queued.join(10)
    assert not streamer.is_alive() and not queued.is_alive(), "an open request hung after the worker died"
    assert seen[-1] == "[DONE]" and json.loads(seen[-2])["error"]["code"] == "engine_unavailable"
    assert_refused(results["queued"], 503, "engine_unavailable")
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    for body in ({"messages": HI}, {"messages": HI, "stream": True}):  # before: they waited forever
        assert_refused(post(url, body, timeout=10), 503, "engine_unavailable")
    assert metric(url, 'whiflash:request_failure_total') >= 2


def test_sigterm_ends_the_server_promptly_with_work_in_flight(one_slot_server):
    """Before: a long grammar compilation under the global lock held SIGTERM forever. Now a
    compilation at the bounds is in flight and a stats page is connected, and the server exits within
    uvicorn's graceful window."""
    url, proc = one_slot_server.url, one_slot_server.proc
    feed = httpx.stream("GET", url + "/v1/stats/events", timeout=30)
    feed.__enter__()
    grammar = threading.Thread(target=lambda: post(url, structured(distinct_enum(99)), timeout=30), daemon=True)
    grammar.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(20)
    finally:
        feed.__exit__(None, None, None)
    assert time.monotonic() - t0 < 15 and code is not None
