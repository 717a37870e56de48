"""The live stats page and the chat page: static files plus the provenance event stream behind them.

    GET /                        redirects to /chat
    GET /chat                    chat page (streams /v1/chat/completions with trace on)
    GET /stats                   live stats page
    GET /static/...              the pages' CSS and JavaScript
    GET /v1/stats/events         SSE: one `snapshot`, then every engine event as it happens
    GET /v1/stats/snapshot       the same snapshot as plain JSON (scripts, tests)
    GET /v1/speculation/methods  what the chat page may offer: loaded methods, defaults

`StatsHub` is the one subscriber of the app's EventBus. It keeps the events of the active and the
most recent requests, plus aggregates since start, and fans every event out to the connected
pages. A page connecting mid-stream first gets a snapshot (the retained events, replayed by the
page through the same code path as live ones), then the live events; both are handed out on the
event loop without an `await` in between, so nothing is lost or shown twice.

The stream's events (JSON in `data:` lines, each with a "type"):
    snapshot   {events: [...retained EventBus events, oldest first], aggregate, samples: [...]}
    aggregate  {aggregate, sample}   every second (sample: tokens/s and acceptance length over the
               last 3 s), and with sample null whenever a request starts or finishes
    request_started, round, tokens, request_finished: the EventBus events as published (app/events.py)

Privacy: each viewer gets a request's generated text (token text and ids, the final trace) only
for its own requests, or for all of them with the admin key; of everyone else's it gets the
counts: tokens by source, rounds, acceptance, timing. Who is who is app/viewers.py (the API key
when keys are on, else the pages' `whiflash_viewer` cookie). Events carry their request's `owner`
from the scheduler to here; `for_viewer` removes it and the text before an event leaves, so
neither the text of others' requests nor anyone's identity is sent.

Access: with keys configured the feed needs one of them (or the admin key); EventSource cannot set
headers, so a key is also accepted as the `whiflash_key` cookie the pages set once the user enters
it (never as `?key=`: URLs end up in access logs). With no key configured, only loopback clients
that address the server by a loopback name are served (the Host check stops a DNS-rebinding page
from reading it), or a viewer presenting the admin key. Cross-origin access follows the app's CORS
settings (off by default), and the stream is refused altogether while CORS allows any origin. The
client's `user` field is never published.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse

from whiflash_core.rounds import Round, Tally

from .errors import APIError
from .events import EventBus, Subscription
from .settings import Settings
from .viewers import Viewer, ensure_viewer_cookie, is_admin, key_matches, offered_key, stats_viewer

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
KEEP_FINISHED = 20          # finished requests kept for the snapshot
SAMPLE_SECONDS = 1.0        # chart sample period
SAMPLE_WINDOW = 3.0         # tokens/s and acceptance length are averaged over this many seconds
KEEP_SAMPLES = 300          # five minutes of chart
CLIENT_QUEUE = 5_000        # events buffered per page before it is resynchronised with a snapshot
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


# --- recording ------------------------------------------------------------------------------------


class Aggregates:
    """Totals since start, updated from events (not from final stats) so they move while requests run.
    Round figures come from one `Tally` over every request's rounds (the engine's definitions)."""

    def __init__(self):
        self.started = time.time()
        self.requests = 0
        self.finished = 0
        self._active: set[str] = set()          # started, not yet finished
        self.tokens = 0
        self.tokens_by_source: dict[str, int] = {}
        self.tally = Tally()
        self._recent: deque[tuple[float, int, int, int]] = deque()  # (time, tokens, rounds, decided)

    def apply(self, event: dict) -> None:
        kind, rid, now = event["type"], event.get("id"), event["time"]
        if kind == "request_started":
            self.requests += 1
            self._active.add(rid)
        elif kind == "round":
            r = Round.from_event(event)
            self.tally.add(r)
            self._recent.append((now, 0, 1, r.decided))
        elif kind == "tokens":
            tokens = event.get("tokens") or []
            self.tokens += len(tokens)
            for t in tokens:
                self.tokens_by_source[t["source"]] = self.tokens_by_source.get(t["source"], 0) + 1
            self._recent.append((now, len(tokens), 0, 0))
        elif kind == "request_finished" and rid in self._active:
            # (a request that timed out in the queue finishes without having started: not counted)
            self._active.discard(rid)
            self.finished += 1

    def sample(self, now: float) -> dict:
        """Throughput and acceptance length over the last SAMPLE_WINDOW seconds."""
        while self._recent and self._recent[0][0] < now - SAMPLE_WINDOW:
            self._recent.popleft()
        window = min(SAMPLE_WINDOW, max(now - self.started, 1e-6))
        recent = Tally(rounds=sum(r[2] for r in self._recent), decided=sum(r[3] for r in self._recent))
        return {"time": now, "tokens_per_s": round(sum(r[1] for r in self._recent) / window, 3),
                "acceptance_length": recent.acceptance_length}

    def as_dict(self) -> dict:
        t = self.tally
        return {"since": self.started, "requests": self.requests, "finished": self.finished,
                "active": len(self._active), "tokens": self.tokens,
                "tokens_by_source": dict(self.tokens_by_source), "rounds": t.rounds,
                "acceptance_length": t.acceptance_length, "switches": t.switches,
                "switches_per_100_tokens": round(100 * t.switches / self.tokens, 3) if self.tokens else None,
                "drafters": {name: {**d.as_dict(), "acceptance_length": round(d.acceptance_length, 4)}
                             for name, d in t.drafters.items() if d.rounds}}


# --- what one viewer may see ---------------------------------------------------------------------


# What another viewer's request shows, field by field (a whitelist, so that a field added to an
# event later stays on the server until it is known to carry no text). Rounds are numbers and
# drafter names only; tokens keep their sources (per-source totals still add up), not their text
# or ids; the final stats lose the trace.
PUBLIC_FIELDS = {
    "request_started": {"prompt_tokens", "max_tokens", "method", "alpha", "policy", "temperature", "stream",
                        "tools", "tool_choice", "endpoint"},
    "round": {"round", "drafter", "draft_tokens", "accepted", "decided", "switched", "entropy", "seconds",
              "fallback_from"},
    "tokens": {"round"},
    "request_finished": {"finish_reason", "timing"},
}


def for_viewer(event: dict, viewer: Viewer) -> dict:
    """`event` as `viewer` may see it: never its owner; of another viewer's request only its public
    fields, marked `hidden`. Events of no request (aggregates) are the same for everyone."""
    if "owner" not in event:
        return event
    if viewer.may_read(event["owner"]):
        return {k: v for k, v in event.items() if k != "owner"}
    kind = event["type"]
    shown = {"type": kind, "time": event["time"], "id": event["id"], "hidden": True,
             **{k: v for k, v in event.items() if k in PUBLIC_FIELDS.get(kind, ())}}
    if kind == "tokens":
        shown["tokens"] = [{"source": t["source"]} for t in event.get("tokens") or []]
    elif kind == "request_finished":
        if isinstance(event.get("stats"), dict):
            shown["stats"] = {k: v for k, v in event["stats"].items() if k != "tokens"}  # the trace is text
        if event.get("error"):
            shown["error"] = "failed (the details are the requester's)"  # a message may quote the request
    return shown


class _Client:
    def __init__(self, viewer: Viewer):
        self.viewer = viewer
        self.queue: asyncio.Queue[dict | None] = asyncio.Queue()   # None: end of stream


class StatsHub:
    """Records the event feed and fans it out to the stats pages. Lives on the app's event loop."""

    def __init__(self, events: EventBus, keep_finished: int = KEEP_FINISHED):
        self.events = events
        self.keep_finished = keep_finished
        self.requests: OrderedDict[str, list[dict]] = OrderedDict()   # id -> its events, oldest first
        self.finished: deque[str] = deque()
        self.aggregates = Aggregates()
        self.samples: deque[dict] = deque(maxlen=KEEP_SAMPLES)
        self._clients: set[_Client] = set()
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task] = []

    # lifecycle: called from the app's lifespan, on its loop

    def start(self) -> None:
        if self._sub is None:
            self._sub = self.events.subscribe()
            self._tasks = [asyncio.create_task(self._pump(), name="stats-pump"),
                           asyncio.create_task(self._tick(), name="stats-tick")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sub is not None:
            self._sub.close()
            self._sub = None

    async def _pump(self) -> None:
        async for event in self._sub:
            try:
                self.record(event)
            except Exception:  # a malformed event must not stop the feed
                log.exception("stats: could not record %r", event.get("type"))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_SECONDS)
            sample = self.aggregates.sample(time.time())
            self.samples.append(sample)
            self._broadcast({"type": "aggregate", "aggregate": self.aggregates.as_dict(), "sample": sample})

    # recording

    def record(self, event: dict) -> None:
        rid = event.get("id")
        if rid is not None:
            if event["type"] == "request_started" or rid in self.requests:
                self.requests.setdefault(rid, []).append(event)
            if event["type"] == "request_finished" and rid in self.requests:
                self.finished.append(rid)
                while len(self.finished) > self.keep_finished:
                    self.requests.pop(self.finished.popleft(), None)
        self.aggregates.apply(event)
        self._broadcast(event)
        if event["type"] in ("request_started", "request_finished"):
            # request counts change now; don't leave the page's totals a tick behind
            self._broadcast({"type": "aggregate", "aggregate": self.aggregates.as_dict(), "sample": None})

    def snapshot(self, viewer: Viewer) -> dict:
        """The retained events as `viewer` may see them, the aggregates, and who the viewer is (so the
        page can say why some text is hidden)."""
        return {"type": "snapshot", "time": time.time(),
                "events": [for_viewer(e, viewer) for events in self.requests.values() for e in events],
                "aggregate": self.aggregates.as_dict(), "samples": list(self.samples),
                "viewer": {"admin": viewer.admin, "identified": viewer.id is not None}}

    # fan-out

    def connect(self, viewer: Viewer) -> _Client:
        """A new page: its queue starts with the snapshot, then receives every later event."""
        client = _Client(viewer)
        client.queue.put_nowait(self.snapshot(viewer))
        self._clients.add(client)
        return client

    def disconnect(self, client: _Client) -> None:
        self._clients.discard(client)

    def _broadcast(self, event: dict) -> None:
        for client in self._clients:
            if client.queue.qsize() >= CLIENT_QUEUE:
                # too slow to keep up: drop its backlog and start it over from a fresh snapshot
                while not client.queue.empty():
                    client.queue.get_nowait()
                client.queue.put_nowait(self.snapshot(client.viewer))
            else:
                client.queue.put_nowait(for_viewer(event, client.viewer))

    async def stream(self, viewer: Viewer, shutdown: anyio.Event | None = None):
        """`viewer`'s SSE events. Connecting here (not in the endpoint) ties the client's lifetime
        to the generator's: sse-starlette closes it when the page goes away. When the server shuts
        down (`shutdown` set by sse-starlette) the stream ends cleanly instead of being cancelled."""
        client = self.connect(viewer)

        async def end_on_shutdown():
            await shutdown.wait()
            client.queue.put_nowait(None)

        watcher = asyncio.create_task(end_on_shutdown()) if shutdown is not None else None
        try:
            while True:
                event = await client.queue.get()
                if event is None:
                    return
                yield {"data": json.dumps(event, default=str, separators=(",", ":"))}
        finally:
            if watcher is not None:
                watcher.cancel()
            self.disconnect(client)


# --- access -----------------------------------------------------------------------------------------


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(request: Request) -> str:
    host = request.headers.get("host", "")
    if host.startswith("["):  # [::1]:8000
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def stats_access(settings: Settings):
    """Dependency: may this client read the stats feed at all, and as which viewer (app/viewers.py)?"""
    keys = settings.api_keys + ([settings.admin_key] if settings.admin_key else [])

    async def check(request: Request) -> Viewer:
        if "*" in settings.cors_origins:
            # any web page could then read the feed from a visitor's browser (with its cookie)
            raise APIError("The stats stream is disabled while CORS allows any origin ('*').", 403,
                           "permission_error", None, "cors_any_origin")
        if settings.api_keys:
            # not from the query string: a `?key=` URL lands in access logs, proxies and browser history
            if key_matches(offered_key(request), keys):
                return stats_viewer(request, settings)
            raise APIError("Incorrect API key provided.", 401, "invalid_request_error", None, "invalid_api_key")
        client = request.client.host if request.client else None
        if is_admin(request, settings) or (_is_loopback(client) and _host_name(request).lower() in LOOPBACK_HOSTS):
            return stats_viewer(request, settings)
        raise APIError("The stats stream is served to loopback clients only when the server has no API key.",
                       403, "permission_error", None, "loopback_only")
    return check


# --- routes -------------------------------------------------------------------------------------------


def _page(name: str, request: Request) -> Response:
    # no-cache: the pages are tiny and change with the server; a stale copy would confuse
    page = FileResponse(STATIC_DIR / name, media_type="text/html", headers={"Cache-Control": "no-cache"})
    ensure_viewer_cookie(request, page)  # the browser's identity on the stats feed when keys are off
    return page


def install(app: FastAPI, hub: StatsHub, settings: Settings, api_auth, methods, default_method) -> None:
    """Add the pages and the stats routes. `api_auth` is the API's own key check (a dependency)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    pages = APIRouter(include_in_schema=False)

    @pages.get("/")
    async def root():
        return RedirectResponse("/chat")

    @pages.get("/chat")
    async def chat_page(request: Request):
        return _page("chat.html", request)

    @pages.get("/stats")
    async def stats_page(request: Request):
        return _page("stats.html", request)

    guarded = APIRouter()
    access = stats_access(settings)

    @guarded.get("/v1/stats/events")
    async def stats_events(viewer: Viewer = Depends(access)):
        shutdown = anyio.Event()
        return EventSourceResponse(hub.stream(viewer, shutdown), sep="\n", ping=15, shutdown_event=shutdown,
                                   shutdown_grace_period=1.0,
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @guarded.get("/v1/stats/snapshot")
    async def stats_snapshot(viewer: Viewer = Depends(access)):
        return JSONResponse(json.loads(json.dumps(hub.snapshot(viewer), default=str)))

    api = APIRouter(dependencies=[Depends(api_auth)])

    @api.get("/v1/speculation/methods")
    async def speculation_methods() -> dict[str, Any]:
        return {"methods": list(methods), "default": default_method(), "alpha": settings.speculation_alpha}

    app.include_router(pages)
    app.include_router(guarded)
    app.include_router(api)
