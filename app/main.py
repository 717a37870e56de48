"""The FastAPI app: OpenAI-compatible routes around one Engine.

    POST /v1/chat/completions   (also /chat/completions, for clients whose base URL lacks /v1)
    POST /v1/completions        legacy text completions (also /completions): app/completions.py
    POST /v1/responses          the Responses API over the chat path (also /responses): app/responses.py
    GET  /v1/models, /v1/models/{id}   the served model id, then its aliases (settings.model_aliases)
    GET  /health                unauthenticated, cheap
    GET  /metrics               Prometheus text, unauthenticated
    GET  /, /chat, /stats       browser pages, and the stats event stream (see app/stats.py)

`create_app(engine, settings)` builds everything per app (scheduler thread, metrics registry,
event bus), so tests can run several apps in one process.
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from whiflash_core.engine import Engine
from whiflash_core.prefix_cache import PrefixCache

from .errors import APIError, install_error_handlers, model_not_found, validation_error
from .events import EventBus
from .limits import RequestBodyLimits, is_too_deep, nesting_too_deep
from .memory import ReleaseMemoryAfterRefusals
from .metrics import Metrics
from .scheduler import Scheduler
from .completions import CompletionRequest, CompletionServing
from .responses import ResponsesServing
from .responses_schemas import ResponsesRequest
from .schemas import ChatCompletionRequest, ModelCard, ModelList
from .serving import ChatServing
from .settings import Settings
from .stats import StatsHub, install as install_stats
from .viewers import bearer_token, key_matches


def _auth_dependency(settings: Settings):
    """The API's key check: with keys configured, `Authorization: Bearer` must name one of them (the
    admin key counts as one)."""
    keys = settings.api_keys + ([settings.admin_key] if settings.admin_key else [])

    async def check(request: Request) -> None:
        if settings.api_keys and not key_matches(bearer_token(request), keys):
            raise APIError("Incorrect API key provided.", 401, "invalid_request_error", None, "invalid_api_key")
    return check


def create_app(engine: Engine, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    model_name = settings.served_model_name or engine.model_name
    engine.prefix_cache = PrefixCache(int(settings.prefix_cache_mb * 2**20))
    metrics = Metrics(model_name)
    metrics.bind_prefix_cache(lambda: engine.prefix_cache.stats.stored_bytes)
    metrics.bind_buffer_pool(lambda: engine.buffers.free_bytes)
    events = EventBus()
    scheduler = Scheduler(engine, metrics, events, max_active=settings.max_active, max_queue=settings.max_queue,
                          request_timeout=settings.request_timeout, shared_forwards=settings.shared_forwards)
    # the ids a request's `model` may name (absent also means the served model); others are 404s
    model_ids = list(dict.fromkeys([model_name, *settings.model_aliases]))
    serving = ChatServing(engine, scheduler, settings, model_name, model_ids)
    completions = CompletionServing(serving)
    responses = ResponsesServing(serving)
    stats = StatsHub(events)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        stats.start()
        try:
            yield
        finally:
            await stats.stop()
            scheduler.stop()
            serving.grammar_jobs.shutdown()

    app = FastAPI(title="WhiFlash Gateway", version="0.1.0", lifespan=lifespan)
    # handles for later features (e.g. a /stats page subscribing to `events`)
    app.state.engine, app.state.settings, app.state.scheduler = engine, settings, scheduler
    app.state.events, app.state.metrics, app.state.serving = events, metrics, serving
    app.state.stats = stats
    install_error_handlers(app)
    # added before CORS, so CORS wraps it and browsers can read its 413/415 answers
    app.add_middleware(RequestBodyLimits, max_bytes=settings.max_request_bytes)
    app.add_middleware(ReleaseMemoryAfterRefusals)  # around the limits' refusals too
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in settings.cors_origins)

    api = APIRouter(dependencies=[Depends(_auth_dependency(settings))])

    # bodies are parsed by hand (below), so FastAPI does not know their schemas: declared here, with
    # their $defs moved into the document's components, so the OpenAPI document (and schemathesis) has them
    body_defs: dict = {}

    def body(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        body_defs.update(schema.pop("$defs", {}))
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    async def parse(request: Request, model: type[BaseModel]):
        # parsed here rather than by FastAPI so that every failure (malformed JSON included) becomes
        # an OpenAI-shaped 400; RequestBodyLimits has already checked the content type and size
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise (nesting_too_deep(None) if is_too_deep(exc) else validation_error(exc)) from None

    @api.post("/v1/chat/completions", openapi_extra=body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await serving.create(await parse(request, ChatCompletionRequest), request)

    @api.post("/v1/completions", openapi_extra=body(CompletionRequest))
    async def text_completions(request: Request):
        return await completions.create(await parse(request, CompletionRequest), request)

    @api.post("/v1/responses", openapi_extra=body(ResponsesRequest))
    async def create_response(request: Request):
        return await responses.create(await parse(request, ResponsesRequest), request)

    @api.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        raise APIError(f"No response with id {response_id!r}: this server stores no responses.", 404,
                       "invalid_request_error", "response_id", "not_found")

    api.add_api_route("/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
    api.add_api_route("/completions", text_completions, methods=["POST"], include_in_schema=False)
    api.add_api_route("/responses", create_response, methods=["POST"], include_in_schema=False)

    def card(model_id: str) -> ModelCard:
        return ModelCard(id=model_id, root=model_name, max_model_len=engine.max_context,
                         speculation_methods=engine.methods)

    @api.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(i) for i in model_ids])

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id not in model_ids:
            raise model_not_found(model_id)
        return card(model_id)

    @app.get("/health")
    async def health():
        alive = scheduler.alive
        return JSONResponse({"status": "ok" if alive else "unavailable"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    app.include_router(api)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(body_defs)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    install_stats(app, stats, settings, _auth_dependency(settings), engine.methods, serving.default_method)
    return app
