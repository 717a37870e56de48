"""`POST /v1/chat/completions`: request -> GenerationRequest -> scheduler -> response or SSE stream.

Everything that can fail because of the request (validation, prompt length, grammar compilation,
admission) happens in `prepare()` and `submit()`, before a streaming response sends its 200, so
those failures are real HTTP errors. After that, a failure is an in-stream error event + [DONE].
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from whiflash_core.chat import encode_chat
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.sampling import SamplingParams

from .errors import APIError, bad_request, context_length_exceeded, internal_error, model_not_found
from .grammar_jobs import GrammarJobs
from .limits import certainly_too_long, check_nesting, check_tools, longest_token_chars, text_chars
from .output import TextAccumulator
from .scheduler import Failed, Finished, RequestHandle, Scheduler, TokenBatch
from .schemas import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, Choice, ChunkChoice,
                      CompletionTokensDetails, DeltaMessage, NamedToolChoice, PromptTokensDetails, ResponseFunction,
                      ResponseMessage, ResponseToolCall, Usage)
from .settings import Settings
from .tools import StreamingToolParser, ends_inside_tool_call, new_tool_call_id, parse_tool_calls

log = logging.getLogger(__name__)

SSE_PING_SECONDS = 15  # comment lines (": ping"), which every SSE client ignores
DISCONNECT_POLL_SECONDS = 0.1  # a non-streaming request checks this often whether its client is still there


@dataclass
class Prepared:
    """A validated request, ready to submit."""
    id: str
    created: int
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    stop: list[str]
    parse_tools: bool
    parallel_tool_calls: bool
    info: dict[str, Any]  # request facts for the event feed
    grammar: GrammarJob | None = None  # compiled into generation.constraint before submitting


@dataclass
class GrammarJob:
    """A grammar to compile for a request: the parameter it comes from, and how to compile it."""
    param: str
    compile: Callable[[], Any]


class ChatServing:
    def __init__(self, engine: Engine, scheduler: Scheduler, settings: Settings, model_name: str,
                 model_ids: list[str] | None = None):
        self.engine, self.scheduler, self.settings = engine, scheduler, settings
        self.model_name = model_name
        self.model_ids = set(model_ids or [model_name])  # the served name and its aliases
        self._grammars = None
        self.grammar_jobs = GrammarJobs(settings.grammar_timeout, settings.grammar_queue)

    # -- validation and request building --------------------------------------------------------

    @functools.cached_property
    def token_chars(self) -> int | None:
        """The most characters one token covers (for the early prompt-length check)."""
        return longest_token_chars(self.engine.tokenizer)

    @property
    def grammars(self):
        if self._grammars is None:  # xgrammar's tokenizer tables are built on first use
            from whiflash_core.constraints import GrammarFactory

            self._grammars = GrammarFactory(self.engine.tokenizer, self.engine.target.cfg.vocab_size,
                                            self.engine.eos_ids, self.settings.grammar_cache_bytes)
        return self._grammars

    def default_method(self) -> str:
        if self.settings.speculation_method is not None:
            return self.settings.speculation_method
        # the most capable loaded method: whiflash, else a trained drafter, else prompt lookup
        preference = ("whiflash", "eagle3", "dflash", "ngram", "none")
        return next(m for m in preference if m in self.engine.methods)

    def prepare(self, req: ChatCompletionRequest) -> Prepared:
        """Validate `req` and build the engine request (raises APIError). Runs in a worker thread:
        tokenization and grammar compilation are CPU work."""
        if req.unknown_fields:
            log.debug("ignoring unknown request fields %s", req.unknown_fields)
        # before anything walks the request recursively (templates, tool prompts, grammars)
        fields = req.model_dump(by_alias=True, exclude_none=True)
        check_nesting(fields)
        check_tools(req.tools)
        chars = text_chars(fields["messages"]) + text_chars(fields.get("tools"))
        if certainly_too_long(chars, self.engine.max_context, self.token_chars):
            raise context_length_exceeded(f"at least {-(-chars // self.token_chars)}", self.engine.max_context)
        if req.n not in (None, 1):
            raise bad_request("Only n=1 is supported.", "n", "unsupported_value")
        if req.logprobs:
            raise bad_request("logprobs are not supported.", "logprobs", "unsupported_value")

        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if (choice == "required" or named is not None) and not tools:
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if named is not None and named not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {named!r}, which is not among the tools.", "tool_choice")
        # Absent means the server default: one call per turn unless configured otherwise (llama.cpp's
        # choice; under `required` a small model otherwise keeps appending calls until max_tokens).
        parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None \
            else self.settings.parallel_tool_calls
        # tool_choice "none": the tools are left out of the prompt, so the model answers in text
        prompt_tools = tools if choice != "none" else None

        spec = self._speculation(req)
        grammar = self._constraint(req, tools, choice, named, parallel)  # its bounds, before tokenizing
        ids = self._encode([m.as_dict() for m in req.messages], prompt_tools)
        limit = self.engine.max_context
        if len(ids) + 1 >= limit:
            raise context_length_exceeded(len(ids), limit)
        room = limit - len(ids) - 1
        wanted = req.max_completion_tokens or req.max_tokens or self.settings.default_max_tokens or room
        max_new = min(wanted, room)

        temperature = req.temperature if req.temperature is not None else self.settings.default_temperature
        top_p = req.top_p if req.top_p is not None else self.settings.default_top_p
        seed = None if req.seed is None else req.seed % 2**63
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=req.top_k or 0, seed=seed)

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return Prepared(
            id=request_id, created=int(time.time()),
            generation=GenerationRequest(ids, max_new, sampling, spec), grammar=grammar,
            stream=bool(req.stream),
            include_usage=bool(req.stream and ((req.stream_options and req.stream_options.include_usage)
                                               or self.settings.force_include_usage)),
            stop=list(req.stop or []), parse_tools=choice != "none", parallel_tool_calls=parallel,
            info={"temperature": temperature, "stream": bool(req.stream), "tools": len(tools),
                  # `user` is the client's own identifier of its end user: never published on the feed
                  "tool_choice": choice if isinstance(choice, str) else "named"})

    def _encode(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            return encode_chat(self.engine.tokenizer, messages, tools)
        except Exception as exc:  # e.g. a template's raise_exception(): the request's fault, not ours
            raise bad_request(f"Could not render the chat template: {exc}", "messages") from exc

    def _speculation(self, req: ChatCompletionRequest) -> SpeculationConfig:
        """The server's defaults (settings), overridden by the request's `speculation` fields."""
        p = req.speculation
        method = (p.method if p and p.method else None) or self.default_method()
        if method not in self.engine.methods:
            raise bad_request(f"Speculation method {method!r} is not available: its drafters are not loaded. "
                              f"Available: {self.engine.methods}.", "speculation.method", "method_unavailable")

        given = p.model_dump(exclude_none=True, exclude={"method"}) if p is not None else {}
        return replace(self.settings.speculation(method), **given)

    def _constraint(self, req: ChatCompletionRequest, tools: list[dict], choice, named: str | None,
                    parallel: bool) -> GrammarJob | None:
        """What to compile for the request's tool_choice / response_format (None: nothing). The
        schemas' bounds are checked here; the compilation itself runs later, in `grammar_jobs`."""
        fmt = req.response_format
        wants_json = fmt is not None and fmt.type != "text"
        forced_tools = choice == "required" or named is not None
        if wants_json and forced_tools:
            raise bad_request("response_format cannot be combined with a required or named tool_choice.",
                              "response_format")
        if forced_tools:
            chosen = [t for t in tools if named is None or t["function"]["name"] == named]
            for i, tool in enumerate(chosen):
                self._check_schema(tool["function"].get("parameters") or {}, f"tools[{i}].function.parameters")
            return GrammarJob("tools", lambda: self.grammars.tool_calls(chosen, parallel and named is None))
        if wants_json and fmt.type == "json_object":
            return GrammarJob("response_format", lambda: self.grammars.json_object())
        if wants_json:
            spec = fmt.json_schema
            schema = spec.schema_ if spec is not None else fmt.schema_
            if schema is None:
                raise bad_request("response_format json_schema needs a schema.", "response_format.json_schema")
            self._check_schema(schema, "response_format")
            strict = spec.strict is not False if spec else True
            return GrammarJob("response_format", lambda: self.grammars.json_schema(schema, strict=strict))
        return None

    @staticmethod
    def _check_schema(schema, param: str) -> None:
        from whiflash_core.constraints import SchemaTooComplex, check_schema

        try:
            check_schema(schema)
        except SchemaTooComplex as exc:
            raise bad_request(f"`{param}` is too complex to compile: {exc}.", param, "schema_too_complex") from None

    def _compile(self, job: GrammarJob):
        """Runs in a grammar_jobs thread."""
        try:
            return job.compile()
        except Exception as exc:  # xgrammar rejects the schema
            raise bad_request(f"Could not compile a grammar for the {job.param}: {exc}", job.param,
                              "invalid_schema") from exc

    # -- entry point ----------------------------------------------------------------------------

    async def create(self, req: ChatCompletionRequest, http: Request):
        if req.model is not None and req.model not in self.model_ids:
            raise model_not_found(req.model)
        prepared = await asyncio.to_thread(self.prepare, req)
        prepared.generation.cache_namespace = self._tenant(http)
        if prepared.grammar is not None:  # in its own bounded pool, with a deadline: plain requests never wait
            job = prepared.grammar
            prepared.generation.constraint = await self.grammar_jobs.run(lambda: self._compile(job), job.param)
        handle = self.scheduler.submit(prepared.generation, prepared.id, prepared.info)
        if prepared.stream:
            return EventSourceResponse(self._stream(prepared, handle), sep="\n", ping=SSE_PING_SECONDS)
        try:
            return await self._complete(prepared, handle, http)
        finally:
            handle.cancel("abort")  # no-op when finished; stops the engine if we leave early

    def _tenant(self, http: Request) -> str:
        """The prefix-cache namespace of a request: its API key (hashed), when keys are required, so
        one tenant cannot probe another's prompts through cache timing."""
        if self.settings.api_key is None:
            return ""
        return hashlib.sha256(http.headers.get("authorization", "").encode()).hexdigest()

    # -- non-streaming ----------------------------------------------------------------------------

    async def _complete(self, p: Prepared, handle: RequestHandle, http: Request) -> JSONResponse:
        acc = TextAccumulator(self.engine.tokenizer, p.stop)
        finished: Finished | None = None
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, handle))
        try:
            while finished is None:
                item = await handle.get()
                if isinstance(item, TokenBatch):
                    if not acc.stopped:
                        acc.add(item.token_ids)
                        if acc.stopped:
                            handle.cancel("stop")
                elif isinstance(item, Failed):
                    raise item.error
                else:
                    finished = item
        finally:
            watcher.cancel()
        if handle.cancel_reason == "abort":  # the client left: nobody reads the answer
            raise APIError("client disconnected", 499, "invalid_request_error", None, "client_closed")
        acc.finish()
        text = acc.text
        if p.parse_tools:
            content, calls = parse_tool_calls(text, p.parallel_tool_calls)
        else:
            content, calls = text, []
        reason = self._finish_reason(finished, acc, bool(calls), p.parse_tools)
        message = ResponseMessage(content=content, tool_calls=[
            ResponseToolCall(id=new_tool_call_id(), function=ResponseFunction(name=c.name, arguments=c.arguments))
            for c in calls] or None)
        body = ChatCompletionResponse(
            id=p.id, created=p.created, model=self.model_name,
            choices=[Choice(message=message, finish_reason=reason)],
            usage=self._usage(finished, acc), speculation=self._stats(finished))
        return JSONResponse(body.model_dump(mode="json"))

    @staticmethod
    async def _cancel_on_disconnect(http: Request, handle: RequestHandle) -> None:
        """Polls the connection while the request waits or generates, so a client that leaves is
        noticed within DISCONNECT_POLL_SECONDS whether or not tokens are flowing (a streaming
        response notices through sse-starlette instead)."""
        while not await http.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        handle.cancel("abort")

    @staticmethod
    def _stats(finished: Finished) -> dict:
        """The engine's per-request stats plus its timing (prefill, draft, verify, ... seconds), so
        `whiflash bench --url` can separate decode speed from gateway overhead."""
        return {**finished.stats, "timing": finished.timing}

    @staticmethod
    def _usage(finished: Finished, acc: TextAccumulator) -> Usage:
        completion = acc.num_tokens if acc.stopped else finished.completion_tokens
        drafters = (finished.stats.get("drafters") or {}).values()
        drafted = sum(d.get("draft_tokens", 0) for d in drafters)
        accepted = sum(d.get("accepted_tokens", 0) for d in drafters)
        return Usage(prompt_tokens=finished.prompt_tokens, completion_tokens=completion,
                     total_tokens=finished.prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.cached_tokens),
                     completion_tokens_details=CompletionTokensDetails(
                         accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted))

    @staticmethod
    def _finish_reason(finished: Finished, acc: TextAccumulator, has_calls: bool, parse_tools: bool) -> str:
        if finished.finish_reason == "length" and not acc.stopped and parse_tools and ends_inside_tool_call(acc.text):
            return "length"  # cut off inside a call: report it, don't invent one
        if has_calls:
            return "tool_calls"
        if acc.stopped or finished.finish_reason == "cancelled":
            return "stop"
        return finished.finish_reason

    # -- streaming ------------------------------------------------------------------------------

    def _chunk(self, p: Prepared, delta: DeltaMessage | None, finish_reason: str | None = None,
               usage: Usage | None = None, speculation: dict | None = None) -> str:
        choices = [] if delta is None else [ChunkChoice(delta=delta, finish_reason=finish_reason)]
        chunk = ChatCompletionChunk(id=p.id, created=p.created, model=self.model_name, choices=choices,
                                    usage=usage, speculation=speculation)
        return chunk.model_dump_json()

    async def _stream(self, p: Prepared, handle: RequestHandle) -> AsyncIterator[str]:
        acc = TextAccumulator(self.engine.tokenizer, p.stop)
        tools = StreamingToolParser(p.parallel_tool_calls) if p.parse_tools else None
        sent = 0

        def delta(final: bool) -> DeltaMessage | None:
            nonlocal sent
            text = acc.visible(final)
            if tools is not None:
                content, calls = tools.update(text, final)
            else:
                content, calls = text[sent:], []
                sent = len(text)
            if not content and not calls:
                return None
            return DeltaMessage(content=content or None, tool_calls=calls or None)

        try:
            yield self._chunk(p, DeltaMessage(role="assistant", content=""))
            finished = None
            async for item in handle:
                if isinstance(item, TokenBatch):
                    if acc.stopped:
                        continue
                    acc.add(item.token_ids)
                    if acc.stopped:
                        handle.cancel("stop")
                    d = delta(final=False)
                    if d is not None:
                        yield self._chunk(p, d)
                elif isinstance(item, Failed):
                    yield json.dumps(item.error.body())
                    yield "[DONE]"
                    return
                else:
                    finished = item
            acc.finish()
            d = delta(final=True)
            if d is not None:
                yield self._chunk(p, d)
            reason = self._finish_reason(finished, acc, bool(tools and tools.calls), p.parse_tools)
            stats = self._stats(finished)
            yield self._chunk(p, DeltaMessage(), reason, speculation=None if p.include_usage else stats)
            if p.include_usage:
                yield self._chunk(p, None, usage=self._usage(finished, acc), speculation=stats)
            yield "[DONE]"
        except asyncio.CancelledError:  # client went away (sse-starlette cancels us)
            raise
        except Exception as exc:
            log.exception("stream %s failed", p.id)
            yield json.dumps(internal_error(f"stream failed: {type(exc).__name__}: {exc}").body())
            yield "[DONE]"
        finally:
            handle.cancel("abort")
