"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Clients (openai-python, LiteLLM, agent frameworks) read `error.code` / `error.param` and match
messages by substring (e.g. "maximum context length"), so every failure path, including
FastAPI's own validation and routing errors, goes through `error_body`.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def context_length_exceeded(prompt_tokens: int | str, max_context: int) -> APIError:
    # The wording matters: LiteLLM, crewAI and OpenHands detect overflow by substring.
    return APIError(
        f"This model's maximum context length is {max_context} tokens. However, your messages "
        f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
        400, "invalid_request_error", "messages", "context_length_exceeded")


def model_not_found(model: str) -> APIError:
    # OpenAI's wording and code; vLLM answers an unknown `model` with a 404 too
    return APIError(f"The model `{model}` does not exist or you do not have access to it.", 404,
                    "invalid_request_error", "model", "model_not_found")


def overloaded(retry_after: int = 1) -> APIError:
    return APIError("The server is at capacity; please retry shortly.", 429, "rate_limit_error", None,
                    "rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def engine_unavailable() -> APIError:
    # the engine worker is gone: nothing will be generated until the server is restarted
    return APIError("The inference engine is unavailable; the server needs a restart.", 503, "server_error",
                    None, "engine_unavailable")


def internal_error(message: str = "internal error") -> APIError:
    # Deterministic for the request: tell openai-python not to retry it twice more.
    return APIError(message, 500, "server_error", None, "internal_error", headers={"x-should-retry": "false"})


_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "json-or-python"}


def _is_union_tag(part: str) -> bool:
    """Pydantic names the branch of a union in `loc` ('str', 'list[ContentPart]', 'NamedToolChoice',
    'function-after[...]'); our field names are lower-case identifiers."""
    return part in _SCALAR_TAGS or "[" in part or part[:1].isupper()


def _loc_to_param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_union_tag(str(p)):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None,
                           "invalid_json")
    # Union validation reports one error per branch; the first names the field well enough.
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    if param:
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error(s))"
    return bad_request(msg, param, "invalid_value" if param else "invalid_request")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}
        return JSONResponse(error_body(str(exc.detail), kind.get(exc.status_code, "invalid_request_error")),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception):
        log.exception("unhandled error")
        return internal_error(f"internal error: {type(exc).__name__}").response()
