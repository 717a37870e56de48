"""The live stats page (/stats), the chat page (/chat) and the provenance event stream behind them.

Two halves:
  * the event stream's access rules and snapshot, against the app around a fake engine served by
    uvicorn in a thread (fast, no model);
  * the pages in a real headless Chromium (Debian's `chromium`, driven by Playwright) against the
    live `whiflash serve` subprocess: token elements must match the request's returned trace.
    Without Chromium these skip; install it with `apt-get install chromium`.

Screenshots go to tests/artifacts/ (git-ignored); the mid-stream one is also copied to
docs/stats-page.png for the README.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from app.main import create_app
from test_gateway_units import StepsEachAlone
from app.settings import Settings
from whiflash_core.buffers import BufferPool
from whiflash_core.rounds import Round, Tally

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "tests" / "artifacts"
MODEL = "SmolLM2-135M-Instruct"
CHROMIUM = os.environ.get("WHIFLASH_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


# --- a fake engine: replays a reply, several tokens per round, with a made-up drafter name --------


class CharTokenizer:
    """Token id = Unicode code point; a toy chat template."""

    chat_template = ""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ReplayGeneration:
    """Each round emits `chunk` tokens: chunk-1 accepted from that round's drafter and one from the
    target. Drafters take turns (eagle3, dflash, then "medusa": a source the pages have no fixed
    colour for), so every round is a switch."""

    DRAFTERS = ["eagle3", "dflash", "medusa"]

    def __init__(self, engine, request):
        self.engine, self.request, self.spec = engine, request, request.speculation
        self.prompt_len = len(request.prompt_ids)
        self.script = [ord(c) for c in engine.reply]
        self.output, self.sources, self.rounds_of = [], [], []
        self.tally = Tally.over(self.DRAFTERS)
        self.rounds = 0
        self.finished, self.finish_reason = False, None
        self.cached_tokens = 0

    def _emit(self, n, drafter=None):
        take = self.script[len(self.output):len(self.output) + n][: self.request.max_new_tokens - len(self.output)]
        self.output += take
        self.rounds_of += [self.rounds] * len(take)
        self.sources += ([drafter] * (len(take) - 1) + ["target"]) if drafter else ["target"] * len(take)
        if len(self.output) >= min(len(self.script), self.request.max_new_tokens):
            self.finished, self.finish_reason = True, "stop"

    def prefill(self):
        self._emit(1)

    def step(self):
        time.sleep(self.engine.delay)
        name = self.DRAFTERS[self.rounds % len(self.DRAFTERS)]
        chunk = self.engine.chunk
        r = Round(self.rounds + 1, name, chunk, chunk - 1, decided=chunk, switched=self.rounds > 0)
        self.rounds += 1
        self.tally.add(r)
        self._emit(chunk, name)
        return r

    def cancel(self):
        if not self.finished:
            self.finished, self.finish_reason = True, "cancelled"

    def stats(self, trace=None):
        out = {"method": self.spec.method, "rounds": self.rounds, "switches": self.tally.switches,
               "acceptance_length": len(self.output) / max(self.rounds, 1),
               "drafters": {k: d.as_dict() for k, d in self.tally.drafters.items()}}
        if self.spec.trace if trace is None else trace:  # as the engine's: each token with its source
            out["tokens"] = [{"id": t, "text": chr(t), "source": s, "round": r}
                             for t, s, r in zip(self.output, self.sources, self.rounds_of)]
        return out

    def timing(self):
        return {"total_s": 0.1}


class FakeEngine(StepsEachAlone):
    model_name = "fake-model"
    max_context = 4096
    eos_ids = [0]
    methods = ["none", "whiflash"]
    buffers = BufferPool()   # the scheduler trims it when idle

    def __init__(self, reply="Hello <b>world</b> & friends", chunk=3, delay=0.0):
        self.reply, self.chunk, self.delay = reply, chunk, delay
        self.tokenizer = CharTokenizer()

    def start(self, request):
        return ReplayGeneration(self, request)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(app, host: str = "127.0.0.1"):
    """The app under a real uvicorn on `host` (TestClient cannot follow an endless SSE stream)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def first_event(url: str, **kw) -> tuple[int, dict | None]:
    """Status of GET url, and its first SSE data event when it streams."""
    with httpx.stream("GET", url, timeout=10, **kw) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                return 200, json.loads(line[6:])
    raise AssertionError("stream ended without an event")


def chat(url: str, key: str = "none", **body) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# --- access and snapshot (fake engine) -------------------------------------------------------------


def test_event_stream_refuses_token_text_without_the_key():
    app = create_app(FakeEngine(), Settings(api_key="secret"))
    with serve(app) as url:
        reply = chat(url, key="secret")
        events = url + "/v1/stats/events"
        for kw in ({}, {"params": {"key": "wrong"}}, {"cookies": {"whiflash_key": "wrong"}},
                   {"headers": {"Authorization": "Bearer wrong"}}):
            status, body = first_event(events, **kw)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", kw
            assert "Hello" not in json.dumps(body)
        assert httpx.get(url + "/v1/stats/snapshot").status_code == 401
        # never in the query string (it would land in access logs), even when right
        status, body = first_event(events, params={"key": "secret"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        # the same key as the API, offered in each way a browser or script can
        for kw in ({"cookies": {"whiflash_key": "secret"}}, {"headers": {"Authorization": "Bearer secret"}}):
            status, snap = first_event(events, **kw)
            assert status == 200 and snap["type"] == "snapshot", kw
            text = "".join(t["text"] for e in snap["events"] if e["type"] == "tokens" and e["id"] == reply["id"]
                           for t in e["tokens"])
            assert text == reply["choices"][0]["message"]["content"]
        # the pages themselves hold no secrets
        assert httpx.get(url + "/stats").status_code == 200
        assert httpx.get(url + "/v1/speculation/methods").status_code == 401
        methods = httpx.get(url + "/v1/speculation/methods", headers={"Authorization": "Bearer secret"}).json()
        assert methods == {"methods": ["none", "whiflash"], "default": "whiflash", "alpha": 1.0}


def test_without_a_key_only_loopback_clients_get_the_stream():
    app = create_app(FakeEngine(), Settings())
    with TestClient(app) as tc:  # TestClient's peer is "testclient", not a loopback address
        r = tc.get("/v1/stats/snapshot")
        assert r.status_code == 403 and r.json()["error"]["code"] == "loopback_only"
        assert tc.get("/v1/stats/events").status_code == 403
    with serve(create_app(FakeEngine(), Settings())) as url:
        assert httpx.get(url + "/v1/stats/snapshot").status_code == 200
        assert httpx.get(url.replace("127.0.0.1", "localhost") + "/v1/stats/snapshot").status_code == 200
        # a loopback peer that calls us by another name is a DNS-rebinding page, not a local user
        r = httpx.get(url + "/v1/stats/snapshot", headers={"Host": "evil.example"})
        assert r.status_code == 403
        # no CORS unless configured: another origin's script cannot read the stream
        r = httpx.get(url + "/v1/stats/snapshot", headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_snapshot_replays_recent_requests_and_aggregates():
    app = create_app(FakeEngine(chunk=4), Settings())
    with serve(app) as url:
        replies = [chat(url, speculation={"method": "whiflash", "alpha": 0.25}) for _ in range(2)]
        snap = httpx.get(url + "/v1/stats/snapshot").json()
    ids = [r["id"] for r in replies]
    by_type = Counter((e["id"], e["type"]) for e in snap["events"])
    for rid in ids:
        assert by_type[(rid, "request_started")] == 1 and by_type[(rid, "request_finished")] == 1
    started = [e for e in snap["events"] if e["type"] == "request_started"]
    assert [(e["method"], e["alpha"]) for e in started] == [("whiflash", 0.25)] * 2
    sources = Counter(t["source"] for e in snap["events"] if e["type"] == "tokens" for t in e["tokens"])
    agg = snap["aggregate"]
    assert agg["tokens_by_source"] == dict(sources) and set(sources) == {"eagle3", "dflash", "medusa", "target"}
    assert agg["requests"] == agg["finished"] == 2 and agg["active"] == 0
    assert {d["acceptance_length"] for d in agg["drafters"].values()} == {4.0}  # 3 accepted + 1 per round
    assert agg["tokens"] == sum(sources.values())
    switches = sum(e["stats"]["switches"] for e in snap["events"] if e["type"] == "request_finished")
    assert agg["switches"] == switches > 0
    assert agg["switches_per_100_tokens"] == round(100 * switches / agg["tokens"], 3)


def test_pages_and_static_files_are_served():
    with TestClient(create_app(FakeEngine(), Settings(api_key="k"))) as tc:
        r = tc.get("/", follow_redirects=False)
        assert r.status_code in (302, 307) and r.headers["location"] == "/chat"
        for path, needle in [("/chat", "chat.js"), ("/stats", "stats.js"), ("/static/common.js", "tokenSpan"),
                             ("/static/stats.js", "EventSource"), ("/static/chat.css", ".composer")]:
            r = tc.get(path)
            assert r.status_code == 200 and needle in r.text, path


# --- the pages in a real browser ------------------------------------------------------------------


# a mark rather than a skip inside the fixture, so that a skipped test does not first start the server
needs_chromium = pytest.mark.skipif(
    not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)),
    reason=f"Chromium not found at {CHROMIUM}: install it with `apt-get install chromium` (Debian/Ubuntu) "
           "or set WHIFLASH_CHROMIUM to its path")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no `playwright install` "
                                   "needed: the system Chromium is used)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=False)
    return path


def owned_by(page) -> dict:
    """Headers that make an API request this browser's own: its viewer cookie, which the pages set.
    The stats page shows a request's text only to the viewer who made it (or the admin)."""
    (cookie,) = [c for c in page.context.cookies() if c["name"] == "whiflash_viewer"]
    return {"Cookie": f"whiflash_viewer={cookie['value']}"}


def page_tokens(page, request_id: str) -> list[dict]:
    return page.eval_on_selector_all(
        f'[data-request-id="{request_id}"] .tokens [data-source]',
        "els => els.map(e => ({source: e.dataset.source, round: Number(e.dataset.round), text: e.textContent}))")


def wait_for_tokens(page, request_id: str, n: int, timeout: float = 60, until_done: bool = False) -> list[dict]:
    """The request's token elements once there are at least n (or, with until_done, once its panel
    says it finished), or whatever is there at the timeout."""
    deadline = time.monotonic() + timeout
    done = f'[data-request-id="{request_id}"] .badge:not(:text("running"))'
    while True:
        tokens = page_tokens(page, request_id)
        if len(tokens) >= n or time.monotonic() > deadline or (until_done and page.locator(done).count()):
            return tokens
        page.wait_for_timeout(200)


@needs_chromium
def test_stats_page_shows_each_token_with_its_source(live_server, page):
    page.goto(live_server.url + "/stats")
    page.wait_for_selector("#status.live", timeout=20_000)
    r = live_server.client(default_headers=owned_by(page)).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=40, temperature=0,
        extra_body={"speculation": {"method": "whiflash", "trace": True}})
    trace = r.model_extra["speculation"]["tokens"]
    page.wait_for_selector(f'[data-request-id="{r.id}"] .badge.done', timeout=30_000)
    shown = wait_for_tokens(page, r.id, len(trace))
    assert Counter(t["source"] for t in shown) == Counter(t["source"] for t in trace)
    assert [(t["source"], t["round"], t["text"]) for t in shown] == \
        [(t["source"], t["round"], t["text"]) for t in trace]
    panel = page.locator(f'[data-request-id="{r.id}"]')
    assert "whiflash" in panel.locator("header").inner_text()
    rounds = r.model_extra["speculation"]["rounds"]
    assert panel.locator(".timeline .bar").count() == rounds  # one router decision per round
    title = panel.locator(".tokens [data-source]").first.get_attribute("title")
    assert title.startswith("round 0") and "target" in title
    assert page.locator("#legend [data-legend=eagle3]").count() == 1
    page.wait_for_selector('#totals :text("(0 active)")', timeout=5_000)  # totals follow request ends
    shot(page, "stats-page.png")


@needs_chromium
def test_stats_page_opened_mid_stream(live_server, page):
    """A page opened while a request streams first replays what already happened (the snapshot)."""
    page.goto(live_server.url + "/chat")  # the browser's viewer cookie, which the request then carries
    client = live_server.client(default_headers=owned_by(page))
    result: dict = {}

    def run():
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
            max_tokens=120, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"speculation": {"method": "whiflash", "trace": True}})
        for chunk in stream:
            result.setdefault("id", chunk.id)
            result["chunks"] = result.get("chunks", 0) + 1
            if (chunk.model_extra or {}).get("speculation"):
                result["speculation"] = chunk.model_extra["speculation"]

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 120
    while result.get("chunks", 0) < 12:  # some tokens out before the page connects
        assert worker.is_alive() and time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.1)
    page.goto(live_server.url + "/stats")
    page.wait_for_selector("#status.live", timeout=20_000)
    rid = result["id"]
    early = wait_for_tokens(page, rid, 10, timeout=10)
    assert len(early) >= 10, "the snapshot did not replay the tokens streamed before the page opened"
    wait_for_tokens(page, rid, len(early) + 15, timeout=60, until_done=True)  # live tokens follow
    running = page.locator(f'[data-request-id="{rid}"] .badge').inner_text() == "running"
    page.wait_for_timeout(1200)  # one more chart sample
    path = shot(page, "stats-page-mid-stream.png")
    # the README's screenshot: written when missing, or refreshed on request, so that a test run
    # does not dirty a committed file
    docs_png = REPO / "docs" / "stats-page.png"
    if running and (not docs_png.exists() or os.environ.get("WHIFLASH_UPDATE_SCREENSHOTS") == "1"):
        docs_png.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, docs_png)
    worker.join(180)
    assert not worker.is_alive() and "speculation" in result
    trace = result["speculation"]["tokens"]
    page.wait_for_selector(f'[data-request-id="{rid}"] .badge.done', timeout=30_000)
    shown = wait_for_tokens(page, rid, len(trace))
    assert Counter(t["source"] for t in shown) == Counter(t["source"] for t in trace)
    assert [t["round"] for t in shown] == [t["round"] for t in trace]


@needs_chromium
def test_chat_page_streams_an_answer_with_its_stats(live_server, page):
    page.goto(live_server.url + "/")
    assert page.url.endswith("/chat")
    page.wait_for_selector("#method option[value=whiflash]", state="attached", timeout=20_000)
    page.select_option("#method", "whiflash")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "What is the capital of France?")
    # record the answer's text as it grows: deltas are shown before the coloured re-render
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg.assistant .answer');
            if (a) window.seen.push([a.textContent.length, a.querySelectorAll('[data-source]').length]);
        }).observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});
    }""")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .meta:not(.hidden)", timeout=120_000)
    answer = page.locator(".msg.assistant .answer")
    tokens = answer.locator("[data-source]")
    assert tokens.count() > 0 and answer.inner_text().strip()
    plain_lengths = {n for n, coloured in page.evaluate("window.seen") if coloured == 0 and n > 0}
    assert plain_lengths, "no streamed text was shown before the final chunk"
    meta = page.locator(".msg.assistant .meta").inner_text()
    assert "whiflash" in meta and "acceptance length" in meta and "tokens/s" in meta
    # the same request through the API (the alpha the page sent: the server's default) gives the
    # same greedy answer and the same sources
    alpha = float(page.input_value("#alpha"))
    r = live_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        temperature=0, extra_body={"speculation": {"method": "whiflash", "alpha": alpha, "trace": True}})
    trace = r.model_extra["speculation"]["tokens"]
    shown = tokens.evaluate_all("els => els.map(e => [e.dataset.source, e.textContent])")
    assert shown == [[t["source"], t["text"]] for t in trace]
    shot(page, "chat-page.png")


@needs_chromium
def test_stats_page_asks_for_the_key(browser, tmp_path):
    """With an API key configured, the page shows a key form; once entered (kept in a cookie, since
    EventSource cannot send headers) the stream connects."""
    app = create_app(FakeEngine(chunk=3), Settings(api_key="s3cret"))
    with serve(app) as url:
        reply = chat(url, key="s3cret")
        context = browser.new_context(viewport={"width": 1280, "height": 700})
        try:
            pg = context.new_page()
            pg.goto(url + "/stats")
            pg.wait_for_selector("#access:not(.hidden) #key-form:not(.hidden)", timeout=15_000)
            assert "API key" in pg.inner_text("#access-message")
            assert pg.locator("[data-request-id]").count() == 0
            pg.fill("#key", "s3cret")
            pg.click("#key-form button")
            pg.wait_for_selector("#status.live", timeout=15_000)
            shown = wait_for_tokens(pg, reply["id"], len(reply["choices"][0]["message"]["content"]), timeout=15)
            assert "".join(t["text"] for t in shown) == reply["choices"][0]["message"]["content"]
            assert pg.locator("[data-request-id] .tokens b").count() == 0  # model text is never parsed as HTML
            # the made-up drafter got a generated colour and a legend entry
            assert pg.locator("#legend [data-legend=medusa]").count() == 1
            colour = pg.eval_on_selector('[data-source="medusa"]', "e => e.style.getPropertyValue('--tok-fg')")
            assert colour.startswith("hsl(")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / "stats-page-with-key.png"))
            # the chat page uses the key saved on the stats page (Authorization header from localStorage)
            pg.goto(url + "/chat")
            pg.wait_for_selector("#method option[value=whiflash]", state="attached", timeout=15_000)
            assert pg.locator("#access.hidden").count() == 1
            pg.fill("#prompt", "hi")
            pg.click("#send")
            pg.wait_for_selector(".msg.assistant .meta:not(.hidden)", timeout=15_000)
            assert pg.inner_text(".msg.assistant .answer") == reply["choices"][0]["message"]["content"]
            pg.evaluate("localStorage.clear()")  # a wrong or missing key shows the key form
            pg.context.clear_cookies()
            pg.reload()
            pg.wait_for_selector("#access:not(.hidden)", timeout=15_000)
            assert "API key" in pg.inner_text("#access-message")
        finally:
            context.close()


def test_feed_never_publishes_user_and_is_refused_when_cors_allows_any_origin():
    app = create_app(FakeEngine(), Settings(api_key="secret"))
    with serve(app) as url:
        chat(url, key="secret", user="alice@example.com")
        status, snap = first_event(url + "/v1/stats/events", headers={"Authorization": "Bearer secret"})
        assert status == 200 and any(e["type"] == "request_started" for e in snap["events"])
        assert "alice@example.com" not in json.dumps(snap)
    app = create_app(FakeEngine(), Settings(api_key="secret", cors_origins=["*"]))
    with serve(app) as url:
        for path in ("/v1/stats/events", "/v1/stats/snapshot"):
            r = httpx.get(url + path, headers={"Authorization": "Bearer secret"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "cors_any_origin", path
        chat(url, key="secret")  # the API itself still works


# --- privacy: each viewer sees its own requests' text, the admin everyone's -----------------------


def viewer_cookie(url: str, page: str = "/chat") -> dict:
    """A browser's viewer identity: the cookie a page sets on its first visit."""
    r = httpx.get(url + page)
    assert r.status_code == 200 and "whiflash_viewer" in r.cookies
    return {"whiflash_viewer": r.cookies["whiflash_viewer"]}


def chat_as(url: str, cookies: dict | None = None, key: str = "none", **body) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "speculation": {"method": "whiflash", "trace": True},
            **body}
    r = httpx.post(url + "/v1/chat/completions", json=body, cookies=cookies,
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def snapshot_as(url: str, **kw) -> dict:
    r = httpx.get(url + "/v1/stats/snapshot", timeout=10, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def events_of(snap: dict, rid: str, kind: str) -> list[dict]:
    return [e for e in snap["events"] if e.get("id") == rid and e["type"] == kind]


def shown_text(snap: dict, rid: str) -> str:
    return "".join(t.get("text", "") for e in events_of(snap, rid, "tokens") for t in e["tokens"])


def assert_counts_without_text(snap: dict, reply: dict, owners_view: dict) -> None:
    """`snap` has the request's counts (tokens by source, rounds, stats) exactly as its owner's view
    has them, and none of its text: no token text, no token ids, no trace."""
    rid, text = reply["id"], reply["choices"][0]["message"]["content"]
    mine = [t["source"] for e in events_of(owners_view, rid, "tokens") for t in e["tokens"]]
    theirs = events_of(snap, rid, "tokens")
    assert [t["source"] for e in theirs for t in e["tokens"]] == mine and mine
    assert all(set(t) == {"source"} for e in theirs for t in e["tokens"])
    (started,) = events_of(snap, rid, "request_started")
    (finished,) = events_of(snap, rid, "request_finished")
    assert started["hidden"] and finished["hidden"] and all(e["hidden"] for e in theirs)
    assert "tokens" not in finished["stats"] and "tokens" in events_of(owners_view, rid, "request_finished")[0]["stats"]
    assert finished["stats"]["rounds"] == reply["speculation"]["rounds"] > 0
    assert len(events_of(snap, rid, "round")) == reply["speculation"]["rounds"]
    assert snap["aggregate"]["tokens_by_source"] == owners_view["aggregate"]["tokens_by_source"]
    assert text not in json.dumps(snap) and "world" not in json.dumps(snap)


def test_feed_gives_a_requests_text_to_its_own_viewer_and_the_admin_only():
    app = create_app(FakeEngine(chunk=3), Settings(admin_key="adm1n-key"))
    with serve(app) as url:
        alice, bob = viewer_cookie(url, "/chat"), viewer_cookie(url, "/stats")
        assert alice != bob
        # bob watches the live stream while alice's request runs (the live path, not only the snapshot)
        live: list[dict] = []
        connected = threading.Event()

        def watch():
            with httpx.stream("GET", url + "/v1/stats/events", cookies=bob, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        live.append(json.loads(line[6:]))
                        connected.set()
                        if live[-1]["type"] == "request_finished":
                            return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert connected.wait(10)
        reply = chat_as(url, alice)
        text = reply["choices"][0]["message"]["content"]
        watcher.join(10)
        assert not watcher.is_alive() and live[-1]["id"] == reply["id"]

        owners_view = snapshot_as(url, cookies=alice)
        assert shown_text(owners_view, reply["id"]) == text
        assert owners_view["viewer"] == {"admin": False, "identified": True}
        for view in (snapshot_as(url, cookies=bob), snapshot_as(url), {**live[0], "events": live[1:],
                                                                     "aggregate": owners_view["aggregate"]}):
            assert_counts_without_text(view, reply, owners_view)
        assert snapshot_as(url)["viewer"] == {"admin": False, "identified": False}
        # a value not made by the server is no identity (a guessable one could be shared by accident)
        assert_counts_without_text(snapshot_as(url, cookies={"whiflash_viewer": "alice"}), reply, owners_view)
        # the admin key, as a header or as the pages' key cookie; never from the query string
        for kw in ({"headers": {"Authorization": "Bearer adm1n-key"}}, {"cookies": {"whiflash_key": "adm1n-key"}}):
            admin_view = snapshot_as(url, **kw)
            assert shown_text(admin_view, reply["id"]) == text and admin_view["viewer"]["admin"], kw
        assert_counts_without_text(snapshot_as(url, params={"key": "adm1n-key"}), reply, owners_view)
        assert_counts_without_text(snapshot_as(url, headers={"Authorization": "Bearer wrong"}), reply, owners_view)
        # nobody's identity leaves the server
        everything = json.dumps([owners_view, admin_view, live])
        assert "owner" not in everything and alice["whiflash_viewer"] not in everything
        # a request with no identity (a script without the cookie) is nobody's: the admin sees it
        anonymous = chat_as(url)
        assert_counts_without_text(snapshot_as(url, cookies=alice), anonymous, snapshot_as(url, **kw))


def test_each_api_key_is_a_tenant_on_the_feed():
    app = create_app(FakeEngine(chunk=3), Settings(api_key="key-one,key-two", admin_key="adm1n-key"))
    with serve(app) as url:
        ones = chat_as(url, key="key-one")
        twos = chat_as(url, key="key-two")
        admins = chat_as(url, key="adm1n-key")  # the admin key is an API key too
        assert httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          headers={"Authorization": "Bearer key-three"}).status_code == 401
        one = snapshot_as(url, headers={"Authorization": "Bearer key-one"})
        two = snapshot_as(url, cookies={"whiflash_key": "key-two"})
        admin = snapshot_as(url, headers={"Authorization": "Bearer adm1n-key"})
        assert shown_text(one, ones["id"]) == ones["choices"][0]["message"]["content"]
        assert shown_text(two, twos["id"]) == twos["choices"][0]["message"]["content"]
        assert_counts_without_text(two, ones, one)
        assert_counts_without_text(one, twos, two)
        assert_counts_without_text(one, admins, admin)
        for reply in (ones, twos, admins):
            assert shown_text(admin, reply["id"]) == reply["choices"][0]["message"]["content"]
        # the viewer cookie means nothing when keys are on: the key is the identity
        cookie = viewer_cookie(url)
        assert httpx.get(url + "/v1/stats/snapshot", cookies=cookie).status_code == 401
        status, _ = first_event(url + "/v1/stats/events", params={"key": "adm1n-key"})
        assert status == 401


def test_pages_give_the_browser_one_http_only_viewer_cookie():
    with serve(create_app(FakeEngine(), Settings())) as url:
        r = httpx.get(url + "/chat")
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("whiflash_viewer=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert "Path=/" in cookie and "Secure" not in cookie  # plain http here; https gets Secure
        value = r.cookies["whiflash_viewer"]
        assert len(value) >= 32 and value != httpx.get(url + "/chat").cookies["whiflash_viewer"]
        assert "set-cookie" not in httpx.get(url + "/stats", cookies={"whiflash_viewer": value}).headers  # kept
        replaced = httpx.get(url + "/stats", cookies={"whiflash_viewer": "bob"})
        assert replaced.cookies["whiflash_viewer"] not in ("bob", value)


def test_admin_key_setting(monkeypatch):
    import argparse

    from app.serve_cli import add_parser, settings_from_args

    assert Settings().admin_key is None
    monkeypatch.setenv("WHIFLASH_ADMIN_KEY", "from-env")
    assert Settings().admin_key == "from-env"
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--admin-key", "from-flag", "--api-key", "a, b"])
    settings = settings_from_args(args)
    assert settings.admin_key == "from-flag" and settings.api_keys == ["a", "b"]


@needs_chromium
def test_a_second_viewer_sees_counts_not_text_and_the_admin_sees_both(browser):
    """Two browsers chat through the chat page (each with its own viewer cookie); on the stats page
    each sees its own answer's text and only the counts of the other's; the admin key shows both."""
    app = create_app(FakeEngine(chunk=3), Settings(admin_key="adm1n-key"))
    with serve(app) as url:
        contexts = {name: browser.new_context(viewport={"width": 1280, "height": 900}) for name in ("a", "b", "admin")}
        try:
            pages = {name: c.new_page() for name, c in contexts.items()}
            answers = {}
            for name in ("a", "b"):
                pg = pages[name]
                pg.goto(url + "/chat")
                pg.wait_for_selector("#method option[value=whiflash]", state="attached", timeout=15_000)
                pg.fill("#prompt", f"hi from {name}")
                pg.click("#send")
                pg.wait_for_selector(".msg.assistant .meta:not(.hidden)", timeout=15_000)
                answers[name] = pg.inner_text(".msg.assistant .answer")
            reply = FakeEngine().reply
            assert answers == {"a": reply, "b": reply}
            snap = snapshot_as(url, headers={"Authorization": "Bearer adm1n-key"})
            started = [e for e in snap["events"] if e["type"] == "request_started"]
            ids = {name: e["id"] for name, e in zip(("a", "b"), started)}
            lengths = {rid: len(shown_text(snap, rid)) for rid in ids.values()}

            for me, other in (("a", "b"), ("b", "a")):
                pg = pages[me]
                pg.goto(url + "/stats")
                pg.wait_for_selector("#status.live", timeout=15_000)
                assert pg.inner_text("#viewer") == "your requests' text"
                assert pg.locator("#privacy:not(.hidden)").count() == 1
                mine = wait_for_tokens(pg, ids[me], lengths[ids[me]], timeout=10)
                assert "".join(t["text"] for t in mine) == reply
                theirs = wait_for_tokens(pg, ids[other], lengths[ids[other]], timeout=10)
                assert len(theirs) == lengths[ids[other]] and all(t["text"] == "" for t in theirs)
                panel = pg.locator(f'[data-request-id="{ids[other]}"]')
                assert "text hidden" in panel.inner_text() and "world" not in panel.inner_text()
                count = panel.locator('.kv div:has(> span:text-is("tokens")) b').inner_text()
                assert count.startswith(f"{lengths[ids[other]]} /")  # its token count is shown
                assert pg.locator(f'[data-request-id="{ids[other]}"] .tok.redacted').count() == lengths[ids[other]]
                pg.wait_for_selector('#totals :text("(0 active)")', timeout=5_000)
                total = pg.locator('#totals div:has(> span:text-is("tokens")) b').inner_text()
                assert total == str(sum(lengths.values()))  # the totals count everyone's tokens
            shot(pages["b"], "stats-page-second-viewer.png")

            pg = pages["admin"]
            pg.goto(url + "/stats")
            pg.wait_for_selector("#status.live", timeout=15_000)
            pg.click("#admin summary")
            pg.fill("#admin-key", "wrong")
            pg.click("#admin-form button")
            pg.wait_for_selector('#privacy-message:text("not the admin key")', timeout=10_000)
            pg.fill("#admin-key", "adm1n-key")
            pg.click("#admin-form button")
            pg.wait_for_selector('#viewer:text("admin")', timeout=10_000)
            assert pg.locator("#privacy.hidden").count() == 1
            for rid in ids.values():
                shown = wait_for_tokens(pg, rid, lengths[rid], timeout=10)
                assert "".join(t["text"] for t in shown) == reply
            assert pg.locator(".tok.redacted").count() == 0
            shot(pg, "stats-page-admin.png")
        finally:
            for c in contexts.values():
                c.close()


def test_another_viewers_request_shows_only_its_public_fields():
    from app.stats import for_viewer
    from app.viewers import Viewer

    owner, other, admin = Viewer("alice"), Viewer("bob"), Viewer(None, admin=True)
    started = {"type": "request_started", "time": 1.0, "id": "r", "owner": "alice", "method": "whiflash",
               "prompt_tokens": 7, "prompt": "a field added later, maybe text"}
    tokens = {"type": "tokens", "time": 2.0, "id": "r", "owner": "alice", "round": 1,
              "tokens": [{"id": 72, "text": "H", "source": "eagle3"}]}
    failed = {"type": "request_finished", "time": 3.0, "id": "r", "owner": "alice", "finish_reason": "error",
              "error": "generation failed: ValueError: 'secret text'"}
    for event in (started, tokens, failed):
        assert for_viewer(event, owner) == for_viewer(event, admin) == {k: v for k, v in event.items() if k != "owner"}
    assert for_viewer(started, other) == {"type": "request_started", "time": 1.0, "id": "r", "hidden": True,
                                          "method": "whiflash", "prompt_tokens": 7}
    assert for_viewer(tokens, other)["tokens"] == [{"source": "eagle3"}]
    assert "secret" not in json.dumps(for_viewer(failed, other)) and for_viewer(failed, other)["error"]
    assert for_viewer(tokens, Viewer(None))["hidden"]  # nobody in particular sees no one's text
    aggregate = {"type": "aggregate", "aggregate": {"tokens": 3}}
    assert for_viewer(aggregate, other) is aggregate


def outward_address() -> str | None:
    """This machine's address on its network (a non-loopback peer for the server), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@needs_chromium
def test_a_remote_admin_enters_the_admin_key_on_a_keyless_server(browser):
    """Without keys the feed is for local viewers; from another address the page asks for the admin
    key, and with it shows every request's text."""
    address = outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to play a remote viewer from")
    app = create_app(FakeEngine(chunk=3), Settings(admin_key="adm1n-key"))
    with serve(app, host=address) as url:
        reply = chat_as(url)
        context = browser.new_context(viewport={"width": 1280, "height": 700})
        try:
            pg = context.new_page()
            pg.goto(url + "/stats")
            pg.wait_for_selector("#access:not(.hidden) #key-form:not(.hidden)", timeout=15_000)
            assert "admin key" in pg.inner_text("#access-message")
            pg.fill("#key", "adm1n-key")
            pg.click("#key-form button")
            pg.wait_for_selector('#viewer:text("admin")', timeout=15_000)
            text = reply["choices"][0]["message"]["content"]
            assert "".join(t["text"] for t in wait_for_tokens(pg, reply["id"], len(text), timeout=10)) == text
        finally:
            context.close()
