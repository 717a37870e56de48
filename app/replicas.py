"""`whiflash serve --replicas N`: the same FastAPI app as N Ray Serve replicas behind one endpoint.

    client --HTTP--> Ray Serve proxy --> Ingress (1 replica, no engine) --handle--> Replica x N
                                          affinity key, merges               create_app(engine): the
                                          /metrics, /health, stats           single server's app

Replica  one engine each (one GPU each with `--device cuda`, else `threads` CPU cores), running
         `create_app(engine, settings)`, the app `whiflash serve` runs, in-process: the ingress
         hands it the HTTP request (method, path, headers, body, client address) and it streams
         back the ASGI response (start, then body chunks) through a Ray Serve streaming call. So
         every route, error and limit behaves exactly as on the single server, the API key and
         its prefix-cache namespace included. Each response start gets an `x-whiflash-replica`
         header with the replica's Serve id.
Ingress  a thin FastAPI app: computes the request's affinity key (app/replica_routing.py: a hash
         of the API key and the conversation's opening: tools, messages up to the first user
         message) and forwards the request through a DeploymentHandle whose request router is
         `AffinityRouter` (Ray Serve's custom request-router hook): the key's replica by
         rendezvous hashing over the replicas' ranks; after HOME_PATIENCE_S without it (full or
         gone), the next one in the key's order. A client that leaves cancels the Serve call, which cancels the
         request on its replica (the replica's app sees the disconnect, as under uvicorn).
         /health, /metrics and the stats endpoints ask every replica and merge their answers.

The key travels as the Serve call's `multiplexed_model_id`: that is the field Serve hands the
router with every request, and with `MultiplexMixin` it also makes the router give a replica it
picked for one key to a waiting request of the same key, never to another key's (plain FIFO
fulfilment could swap two concurrent requests' replicas). A `replica:NAME` id addresses one
replica by name (the fan-out of /metrics and the stats).

Ray is imported here only: the single-process server never imports this module.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from .errors import APIError, error_body, overloaded
from .limits import RequestBodyLimits
from . import replica_routing as routing
from .replica_merge import SSEParser, merge_aggregates, merge_metrics, merge_samples, merge_snapshots, sse, tag
from .replica_routing import REPLICA_HEADER, TARGET, Forwarded, Start, affinity_key, rendezvous_order
from .settings import ReplicaSettings, Settings

log = logging.getLogger(__name__)
serve_log = logging.getLogger("ray.serve")   # inside replicas: Ray Serve's logger, shown by the driver too

APP_NAME = "whiflash"
FAN_OUT_TIMEOUT_S = 5.0       # a replica that does not answer /metrics or /health in time is left out
SSE_PING_S = 15.0
HOME_PATIENCE_S = 1.0         # how long a request waits for its home replica before taking the next one


# --- routing ----------------------------------------------------------------------------------------


def replica_name(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def replica_slot(replica: RunningReplica) -> str:
    """What affinity hashes over: the replica's rank (a replacement takes its predecessor's rank, so a
    conversation's home survives a restart), its id where a replica published none."""
    rank = replica.replica_metadata.get("rank")
    return f"rank-{rank}" if rank is not None else replica_name(replica)


class AffinityRouter(MultiplexMixin, RequestRouter):
    """Ray Serve request router: requests with an affinity key go to the key's replica (rendezvous
    hashing over the replicas' slots), the next in the key's order when it is full (at
    max_ongoing_requests) or gone; `replica:NAME` goes to that replica only; requests without a key
    take the less loaded of two random replicas (Serve's default policy)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if pending_request is not None:
            # when every rank is full, back off before trying again (instead of spinning)
            pending_request.routing_context.should_backoff = True
        if key.startswith(TARGET):
            wanted = key[len(TARGET):]
            return [[r for r in candidate_replicas if replica_name(r) == wanted]]
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_slot = {replica_slot(r): r for r in candidate_replicas}
        ranked = [[by_slot[s]] for s in rendezvous_order(key, list(by_slot))]
        if time.time() - pending_request.created_at < HOME_PATIENCE_S:
            # only the home at first: a queue-length probe that misses its deadline on a busy
            # machine (or a replica that just started) must not cost the conversation its cache
            return ranked[:1]
        return ranked

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # `routing.known` is the ingress's view of the replicas (see app/replica_routing.py)
        routing.known.clear()
        routing.known.update({replica_name(r): replica_slot(r) for r in replicas})

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, Forwarded):
            routing.remember_route(request.id, replica_id.unique_id)


# --- the engine replica -----------------------------------------------------------------------------


@serve.deployment(name="Replica")
class Replica:
    """One engine and the single server's app around it."""

    async def __init__(self, settings: dict):
        from .main import create_app
        from .memory import bound_kernel_caches, freeze_startup_heap, limit_malloc_arenas
        from .serve_cli import load_server_engine

        context = serve.get_replica_context()
        self.name, self.rank = context.replica_id.unique_id, context.rank.rank
        self.settings = s = Settings(**settings)
        limit_malloc_arenas(s.malloc_arena_max)  # as `whiflash serve` does, in this replica's own process
        bound_kernel_caches(s.kernel_cache_entries)
        engine = await asyncio.to_thread(load_server_engine, s)   # as `whiflash serve`
        self.app = create_app(engine, s)
        # the app's lifespan (engine thread, stats hub) as uvicorn would run it, for the replica's life
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        freeze_startup_heap()   # as `whiflash serve` does, in this replica's own process
        serve_log.info("whiflash replica %s (rank %d, pid %d) ready", self.name, self.rank, os.getpid())

    def record_replica_metadata(self) -> dict:
        """Published to the routers once the replica is up (Ray Serve's replica-metadata hook)."""
        return {"rank": self.rank}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        if not self.app.state.scheduler.alive:
            raise RuntimeError(f"engine unavailable: {self.app.state.scheduler.crashed}")

    async def http(self, request: Forwarded):
        """Serve `request` with the app; yields a Start, then the body's chunks. Cancelling the
        call (the client left) is a disconnect for the app, then cancels it."""
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.name.encode())]}
            messages.put_nowait(message)

        task = asyncio.create_task(self.app(request.scope(), receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        completed = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield Start(message["status"], list(message["headers"]))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        completed = True
                        break
            if task.done() and task.exception() is not None:
                raise task.exception()
        finally:
            disconnected.set()   # as uvicorn's receive() reports once the connection is gone
            if not task.done():
                if completed:     # the app may still be winding down after its last byte
                    await asyncio.wait([task], timeout=10)
                task.cancel()     # the call was cancelled (the client left): stop the request now
                await asyncio.gather(task, return_exceptions=True)

    async def __del__(self):
        await self._lifespan.__aexit__(None, None, None)


# --- the ingress ------------------------------------------------------------------------------------


def _json(body: dict, status: int, replica: str) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers={REPLICA_HEADER: replica})


def _unavailable(message: str, replica: str) -> JSONResponse:
    return _json(error_body(message, "server_error", None, "replica_unavailable"), 503, replica)


def _response(start: Start, body) -> Response:
    response = StreamingResponse(body, status_code=start.status)
    response.raw_headers = start.headers   # exactly the replica's, the replica header included
    return response


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    def __init__(self, replicas: DeploymentHandle, settings: dict):
        self.replicas = replicas
        self.settings = Settings(**settings)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    # -- calling replicas ---------------------------------------------------------------------------

    def call(self, request: Forwarded, route: str = ""):
        """The streaming Serve call of `request` on the replica `route` picks (an affinity key,
        `replica:NAME`, or '' for any)."""
        return self.replicas.options(stream=True, multiplexed_model_id=route).http.remote(request)

    async def names(self) -> list[str]:
        """The replicas the router knows; the first call through the handle starts the router."""
        if not routing.known:
            async for _ in self.call(Forwarded("GET", "/health", b"", [], b"", None, None)):
                pass
        return sorted(routing.known)

    async def start_each(self, request: Forwarded) -> dict[str, tuple[Start, object]]:
        """`request` on every replica: each one's Start and the call for the rest; replicas that fail
        or do not answer in time are left out. Routed one after another on purpose: the calls of
        one ingress request share Ray Serve's internal request id, and the router keeps only one
        pending request per id, so a second concurrent one would never be matched to its replica."""
        started = {}
        for name in await self.names():
            gen = self.call(request, TARGET + name)
            try:
                started[name] = (await asyncio.wait_for(gen.__anext__(), FAN_OUT_TIMEOUT_S), gen)
            except Exception as exc:
                serve_log.warning("replica %s did not answer %s: %r", name, request.path, exc)
                gen.cancel()
        return started

    async def ask_each(self, request: Forwarded) -> dict[str, tuple[Start, bytes]]:
        """`request` on every replica, whole answers (start_each)."""
        async def rest(name, start, gen):
            try:
                return name, (start, b"".join([c async for c in gen]))
            except Exception as exc:
                serve_log.warning("replica %s failed answering %s: %r", name, request.path, exc)
                return name, None
        answers = await asyncio.gather(*(rest(n, s, g) for n, (s, g) in (await self.start_each(request)).items()))
        return {name: answer for name, answer in answers if answer is not None}

    async def forward(self, http: Request, body: bytes, route: str) -> Response:
        request = Forwarded.of(http.scope, body)
        gen = self.call(request, route)
        try:
            start = await gen.__anext__()
        except BackPressureError:
            gen.cancel()
            error = overloaded()
            return _json(error.body(), error.status, "none")
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as exc:   # the replica died or was unreachable before it answered
            gen.cancel()
            serve_log.warning("request %s failed on its replica: %r", request.id, exc)
            return _unavailable(f"The replica serving this request failed: {type(exc).__name__}. Please retry.",
                                routing.routed.pop(request.id, "none"))
        routing.routed.pop(request.id, None)
        event_stream = (start.header("content-type") or "").startswith("text/event-stream")

        async def rest():
            try:
                async for chunk in gen:
                    yield chunk
            except Exception as exc:   # the replica died mid-response
                serve_log.warning("request %s lost its replica mid-response: %r", request.id, exc)
                if event_stream:   # as the single server ends a failed stream: an error event, then [DONE]
                    yield sse(error_body(f"The replica serving this stream failed: {type(exc).__name__}.",
                                         "server_error", None, "replica_unavailable"))
                    yield sse("[DONE]")
            finally:
                gen.cancel()   # a no-op when finished; when the client left, stops the replica's work
        return _response(start, rest())

    # -- merged endpoints ---------------------------------------------------------------------------

    async def health(self, http: Request) -> Response:
        answers = await self.ask_each(Forwarded.of(http.scope, b""))
        states = {name: "ok" if start.status == 200 else "unavailable" for name, (start, _) in answers.items()}
        ok = any(state == "ok" for state in states.values())
        slots = {name: routing.known.get(name) for name in answers}   # what affinity hashes over
        return _json({"status": "ok" if ok else "unavailable", "replicas": states, "slots": slots},
                     200 if ok else 503, ",".join(answers) or "none")

    async def metrics(self, http: Request) -> Response:
        answers = await self.ask_each(Forwarded.of(http.scope, b""))
        texts = {name: body.decode() for name, (start, body) in answers.items() if start.status == 200}
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8",
                        headers={REPLICA_HEADER: ",".join(texts) or "none"})

    async def stats_snapshot(self, http: Request) -> Response:
        import json

        answers = await self.ask_each(Forwarded.of(http.scope, b""))
        refused = next(((s, b) for s, b in answers.values() if s.status != 200), None)
        if refused is not None:   # the replicas apply the stats page's access rule (key, loopback)
            return Response(refused[1], status_code=refused[0].status, headers={
                k.decode(): v.decode() for k, v in refused[0].headers if k.lower() != b"content-length"})
        if not answers:
            return _unavailable("No replica answered.", "none")
        merged = merge_snapshots({name: json.loads(body) for name, (_, body) in answers.items()})
        return _json(merged, 200, ",".join(answers))

    async def stats_events(self, http: Request) -> Response:
        """Every replica's stats stream as one: a merged snapshot once each replica has sent its
        own, then their events tagged with `replica`, and a merged aggregate whenever one replica's
        changes (a chart sample only on the ticks of the first live replica, so the chart keeps
        one point per second). A replica that goes away leaves the merge; one that starts later
        joins when the page reconnects."""
        started = await self.start_each(Forwarded.of(http.scope, b""))
        starts = {name: start for name, (start, _) in started.items()}
        gens = {name: gen for name, (_, gen) in started.items()}
        refused = next((name for name, s in starts.items() if s.status != 200), None)
        if refused is not None or not starts:
            for gen in gens.values():
                if refused is None or gen is not gens[refused]:
                    gen.cancel()
            if refused is None:
                return _unavailable("No replica answered.", "none")
            return _response(starts[refused], gens[refused])

        async def merged():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(name, gen):
                parser = SSEParser()
                try:
                    async for chunk in gen:
                        for event in parser.feed(chunk):
                            queue.put_nowait((name, event))
                except Exception:
                    pass
                finally:
                    queue.put_nowait((name, None))

            tasks = [asyncio.create_task(pump(n, g)) for n, g in gens.items()]
            live, snapshots, aggregates, samples = set(gens), {}, {}, {}
            held: list[tuple[str, dict]] = []   # events that arrive before every replica's snapshot
            try:
                while live:
                    try:
                        name, event = await asyncio.wait_for(queue.get(), SSE_PING_S)
                    except asyncio.TimeoutError:
                        yield b": ping\n\n"
                        continue
                    if event is None:
                        live.discard(name)
                        snapshots.pop(name, None), aggregates.pop(name, None), samples.pop(name, None)
                        continue
                    kind = event.get("type")
                    if kind == "snapshot":
                        snapshots[name], aggregates[name] = event, event.get("aggregate") or {}
                        if set(snapshots) >= live:
                            yield sse(merge_snapshots({n: snapshots[n] for n in live}))
                            for n, e in held:
                                yield sse(tag(e, n))
                            held = []
                    elif not set(snapshots) >= live:
                        held.append((name, event))
                    elif kind == "aggregate":
                        aggregates[name] = event.get("aggregate") or {}
                        sample = None
                        if event.get("sample") is not None:
                            samples[name] = event["sample"]
                            if name == min(live):
                                sample = merge_samples(list(samples.values()))
                        yield sse({"type": "aggregate", "aggregate": merge_aggregates(aggregates), "sample": sample})
                    else:
                        yield sse(tag(event, name))
            finally:
                for task in tasks:
                    task.cancel()
                for gen in gens.values():
                    gen.cancel()

        return StreamingResponse(merged(), media_type="text/event-stream", headers={
            "Cache-Control": "no-cache", "X-Accel-Buffering": "no", REPLICA_HEADER: ",".join(gens)})


class NameUnservedResponses:
    """ASGI middleware: a response no replica served (the ingress refused it first) says so."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start" and not any(
                    k.lower() == REPLICA_HEADER.encode() for k, _ in message.get("headers", [])):
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), b"none")]}
            await send(message)
        await self.app(scope, receive, named if scope["type"] == "http" else send)


def build_ingress_app(ingress: Ingress) -> FastAPI:
    settings = ingress.settings
    app = FastAPI(title="WhiFlash Gateway (replicas)", docs_url=None, redoc_url=None, openapi_url=None)
    # the same 413/415 answers as the replicas' own, before the ingress holds a body it must hash
    app.add_middleware(RequestBodyLimits, max_bytes=settings.max_request_bytes)
    app.add_middleware(NameUnservedResponses)   # added last: outermost, so it sees those answers too

    @app.get("/health")
    async def health(request: Request):
        return await ingress.health(request)

    @app.get("/metrics")
    async def metrics(request: Request):
        return await ingress.metrics(request)

    @app.get("/v1/stats/snapshot")
    async def stats_snapshot(request: Request):
        return await ingress.stats_snapshot(request)

    @app.get("/v1/stats/events")
    async def stats_events(request: Request):
        return await ingress.stats_events(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
                   include_in_schema=False)
    async def everything_else(request: Request):
        chunks, size = [], 0
        async for chunk in request.stream():   # bounded for every path (RequestBodyLimits covers /v1 POSTs)
            size += len(chunk)
            if size > settings.max_request_bytes:
                error = APIError(f"Request body too large: at most {settings.max_request_bytes} bytes are "
                                 "accepted.", 413, "invalid_request_error", None, "request_too_large")
                return _json(error.body(), error.status, "none")
            chunks.append(chunk)
        body = b"".join(chunks)
        key = affinity_key(request.url.path, body, request.headers.get("authorization")) \
            if request.method == "POST" else None
        return await ingress.forward(request, body, key or "")

    return app


# --- deployment ---------------------------------------------------------------------------------------


def threads_per_replica(settings: Settings, replicas: int) -> int:
    """The torch threads of each replica: as asked, else the machine's cores shared out."""
    return settings.threads or max(1, (os.cpu_count() or 1) // replicas)


def gpus_per_replica(settings: Settings, rs: ReplicaSettings) -> float:
    if rs.gpus_per_replica is not None:
        return rs.gpus_per_replica
    if settings.device == "cuda":
        return 1
    if settings.device is None:
        import torch

        return 1 if torch.cuda.is_available() else 0
    return 0


def build(settings: Settings, rs: ReplicaSettings):
    """The Serve application: the ingress bound to N engine replicas."""
    threads = threads_per_replica(settings, rs.replicas)
    settings = settings.model_copy(update={"threads": threads})
    admitted = settings.max_active + settings.max_queue
    replica = Replica.options(
        num_replicas=rs.replicas,
        ray_actor_options={"num_cpus": threads, "num_gpus": gpus_per_replica(settings, rs)},
        # what a replica's scheduler admits: beyond it the router tries the key's next replica
        max_ongoing_requests=admitted,
        # with every replica full, this many more wait in the ingress; then 429
        max_queued_requests=settings.max_queue,
        health_check_period_s=rs.health_check_period_s,
        health_check_timeout_s=max(10.0, 3 * rs.health_check_period_s),
        graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter),
    ).bind(settings.model_dump())
    ingress = Ingress.options(
        num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=rs.replicas * admitted + 64,   # it only forwards: never the bottleneck
    )
    return ingress.bind(replica, settings.model_dump())


def build_app(args: dict):
    """Application builder for `serve run app.replicas:build_app KEY=VALUE ...` or a Serve config
    file's `import_path`: the keys are Settings and ReplicaSettings fields (dtype=float32 replicas=2)."""
    return build(Settings(**args), ReplicaSettings(**args))


def serve_replicas(settings: Settings, rs: ReplicaSettings) -> int:
    """`whiflash serve --replicas N`: start (or join) Ray, deploy, serve until SIGINT/SIGTERM."""
    # a self-hosted gateway sends no usage statistics unless its operator asks Ray to
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    threads = threads_per_replica(settings, rs.replicas)
    cpus = os.cpu_count() or 1
    if rs.ray_address is None and rs.replicas * threads > cpus:
        log.warning("%d replicas x %d threads oversubscribe this machine's %d cores", rs.replicas, threads, cpus)
    context = ray.init(address=rs.ray_address, namespace=APP_NAME, include_dashboard=False,
                       # a local cluster gets room for every replica even when that oversubscribes
                       num_cpus=None if rs.ray_address else max(cpus, rs.replicas * threads))
    log.info("ray %s, cluster at %s", ray.__version__, context.address_info.get("gcs_address"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        started = time.perf_counter()
        serve.run(build(settings, rs), name=APP_NAME, route_prefix="/")
        log.info("%d replicas serving on http://%s:%d (ready in %.1f s)", rs.replicas, settings.host,
                 settings.port, time.perf_counter() - started)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
