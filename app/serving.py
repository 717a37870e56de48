"""`POST /v1/chat/completions`: request -> GenerationRequest -> scheduler -> response or SSE stream.

Everything that can fail because of the request (validation, prompt length, grammar compilation,
admission) happens in `start()` (`prepare()`, the grammar, `submit()`), before a streaming response
sends its 200, so those failures are real HTTP errors. After that, a failure is an in-stream error
event + [DONE].

The chat route is also the engine path of `/v1/responses` (app/responses.py): `start()` submits a
chat request, and `answers()` (the finished messages) or `deltas()` (the messages as they grow)
follow it; both routes only format what these give. Content and tool calls come from one parser
(app/tools.py), so streamed and non-streamed messages are the same.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from whiflash_core.chat import TOOL_CALL_OPEN, encode_chat, template_supports_tools
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.logits import LogitAdjustments, TokenLogprob
from whiflash_core.sampling import SamplingParams

from .errors import APIError, bad_request, context_length_exceeded, internal_error, model_not_found
from .choices import ChoiceState, cancel_all, collect, merged, submit_all
from .choices import stats as choice_stats, usage as choice_usage
from .grammar_jobs import GrammarJobs
from .limits import MIN_TOP_P, certainly_too_long, check_nesting, check_tools, longest_token_chars, text_chars
from .logprobs import LogprobFormatter
from .output import TextAccumulator
from .scheduler import Failed, Finished, RequestHandle, Scheduler, TokenBatch
from .schemas import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, Choice, ChoiceLogprobs,
                      ChunkChoice, DeltaFunction, DeltaMessage, DeltaToolCall, NamedFunction, NamedToolChoice,
                      ResponseFunction, ResponseMessage, ResponseToolCall, SamplingRequest, Tool, Usage)
from .settings import Settings
from .tools import ParsedToolCall, ToolCallParser, ends_inside_tool_call, parse_tool_calls
from .viewers import request_owner

log = logging.getLogger(__name__)

SSE_PING_SECONDS = 15  # comment lines (": ping"), which every SSE client ignores


@dataclass
class Prepared:
    """A validated request, ready to submit."""
    id: str
    created: int
    generations: list[GenerationRequest]  # one per choice (`n`)
    stream: bool
    include_usage: bool
    stop: list[str]
    parse_tools: bool
    parallel_tool_calls: bool
    logprobs: bool
    info: dict[str, Any]  # request facts for the event feed
    grammar: GrammarJob | None = None  # compiled into each choice's constraint in `start`, in grammar_jobs
    tool_names: set[str] | None = None  # the calls the parser accepts
    legacy_functions: bool = False      # asked with `functions`: answer with the legacy `function_call`

    def accumulator(self, tokenizer) -> TextAccumulator:
        """A choice's text: stop strings apply to its content, never inside a tool call."""
        return TextAccumulator(tokenizer, self.stop, TOOL_CALL_OPEN if self.parse_tools else None)

    def tool_parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.parallel_tool_calls, self.tool_names) if self.parse_tools else None


@dataclass
class Answer:
    """One choice's finished message; the same whether it was streamed or not."""
    content: str | None
    calls: list[ParsedToolCall]
    finish_reason: str
    state: ChoiceState


@dataclass
class ChoiceDelta:
    """What a round added to one choice's message: content, newly complete calls (`first` is the
    index of the first of them among the choice's calls), the logprobs of its tokens."""
    index: int
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)
    first: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str
    state: ChoiceState


def _key(kind: str, *spec) -> str:
    """What a grammar is compiled from, as one string (the same tools or schema, the same key)."""
    return kind + ":" + json.dumps(spec, sort_keys=True, default=str)


@dataclass
class GrammarJob:
    """A grammar to compile for a request: the parameter it comes from, how to compile it, and
    what it is compiled from (`key`: requests with the same key share one compilation's slot)."""
    param: str
    compile: Callable[[], Any]
    key: str = ""


class ChatServing:
    def __init__(self, engine: Engine, scheduler: Scheduler, settings: Settings, model_name: str,
                 model_ids: list[str] | None = None):
        self.engine, self.scheduler, self.settings = engine, scheduler, settings
        self.model_name = model_name
        self.model_ids = set(model_ids or [model_name])  # the served name and its aliases
        self._grammars = None
        self.logprob_format = LogprobFormatter(engine.tokenizer)
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

            self._grammars = GrammarFactory(self.engine.tokenizer, self.engine.vocab_size,
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
        req = self._map_legacy_functions(req)
        # before anything walks the request recursively (templates, tool prompts, grammars)
        fields = req.model_dump(by_alias=True, exclude_none=True)
        check_nesting(fields)
        check_tools(req.tools)
        chars = text_chars(fields["messages"]) + text_chars(fields.get("tools"))
        if certainly_too_long(chars, self.engine.max_context, self.token_chars):
            raise context_length_exceeded(f"at least {-(-chars // self.token_chars)}", self.engine.max_context)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("logprobs must be true when top_logprobs is set.", "top_logprobs")
        if req.modalities is not None and set(req.modalities) != {"text"}:
            raise bad_request("Only text output is supported: `modalities` must be [\"text\"].", "modalities",
                              "unsupported_value")
        if req.audio is not None:
            raise bad_request("Audio output is not supported.", "audio", "unsupported_value")

        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if (choice == "required" or named is not None) and not tools:
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if named is not None and named not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {named!r}, which is not among the tools.", "tool_choice")
        # Absent means the server default, true as in OpenAI; the grammar still allows each tool at
        # most once per turn, so a small model cannot keep appending calls. Legacy `function_call`
        # answers hold one call.
        parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None \
            else self.settings.parallel_tool_calls
        parallel = parallel and not req.functions
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

        adjustments = self.adjustments(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # one generation per choice, each with its own grammar state (compiled in `create`) and seed
        # (seed + i: reproducible, distinct)
        generations = [GenerationRequest(ids, max_new, self.sampling(req, i), spec, adjustments=adjustments,
                                         logprobs=logprobs) for i in range(req.n or 1)]
        temperature = generations[0].sampling.temperature
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return Prepared(
            id=request_id, created=int(time.time()), generations=generations, grammar=grammar,
            stream=bool(req.stream), include_usage=self.include_usage(req),
            stop=list(req.stop or []), parse_tools=choice != "none", parallel_tool_calls=parallel,
            logprobs=logprobs is not None, tool_names={t["function"]["name"] for t in tools},
            legacy_functions=bool(req.functions),
            info={"temperature": temperature, "stream": bool(req.stream), "tools": len(tools),
                  # `user` is the client's own identifier of its end user: never published on the feed
                  "tool_choice": choice if isinstance(choice, str) else "named"})

    @staticmethod
    def _map_legacy_functions(req: ChatCompletionRequest) -> ChatCompletionRequest:
        """The deprecated `functions` / `function_call` fields as tools / tool_choice (as vLLM and
        llama.cpp read them); the answer then comes back in the legacy `function_call` field."""
        if req.functions is None:
            if req.function_call is not None:
                raise bad_request("When using `function_call`, `functions` must be set.", "function_call")
            return req
        if req.tools is not None:
            raise bad_request("Use either `tools` or the deprecated `functions`, not both.", "functions")
        if req.tool_choice is not None:
            raise bad_request("Use either `tool_choice` or the deprecated `function_call`, not both.", "function_call")
        fc = req.function_call
        choice = NamedToolChoice(type="function", function=NamedFunction(name=fc.name)) \
            if isinstance(fc, NamedFunction) else fc
        return req.model_copy(update={"tools": [Tool(type="function", function=f) for f in req.functions],
                                      "tool_choice": choice})

    # -- fields chat and legacy completions share (completions.py reuses these) --------------------

    def sampling(self, req: SamplingRequest, choice: int = 0) -> SamplingParams:
        temperature = req.temperature if req.temperature is not None else self.settings.default_temperature
        top_p = max(req.top_p if req.top_p is not None else self.settings.default_top_p, MIN_TOP_P)
        seed = None if req.seed is None else (req.seed + choice) % 2**63
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=req.top_k or 0, seed=seed)

    def adjustments(self, req: SamplingRequest) -> LogitAdjustments:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        if bias and max(bias) >= (vocab := self.engine.vocab_size):
            raise bad_request(f"logit_bias names a token id outside the vocabulary (0..{vocab - 1}).", "logit_bias")
        return LogitAdjustments(req.presence_penalty or 0.0, req.frequency_penalty or 0.0, bias)

    def include_usage(self, req: SamplingRequest) -> bool:
        return bool(req.stream and ((req.stream_options and req.stream_options.include_usage)
                                    or self.settings.force_include_usage))

    def check_model(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model not in self.model_ids:
            raise model_not_found(req.model)

    def _encode(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            return encode_chat(self.engine.tokenizer, messages, tools)
        except Exception as exc:  # e.g. a template's raise_exception(): the request's fault, not ours
            raise bad_request(f"Could not render the chat template: {exc}", "messages") from exc

    def _speculation(self, req: SamplingRequest) -> SpeculationConfig:
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
        """What to compile for this request, if anything. The schemas' bounds are checked here; the
        compilation itself runs later, in `grammar_jobs`:
        required / named tool_choice   a call is forced (a structured answer can only come in a later turn)
        auto with tools                free text, and a call once the model opens one (lazy grammar);
                                       with response_format: tool calls or the structured answer
        response_format alone          the JSON answer
        tool results, no tools offered free text that does not echo the prompt's tool markup
        """
        schema, strict = self._answer_schema(req.response_format)
        if schema is not None:
            self._check_schema(schema, "response_format")
        if choice == "required" or named is not None:
            chosen = [t for t in tools if named is None or t["function"]["name"] == named]
            self._check_tool_schemas(chosen)
            return GrammarJob("tools", lambda: self.grammars.tool_calls(chosen, parallel and named is None),
                              _key("tool_calls", chosen, parallel and named is None))
        if tools and choice == "auto" and self.settings.lazy_tool_grammar:
            self._check_tool_schemas(tools)
            if schema is not None:
                return GrammarJob("tools", lambda: self.grammars.tool_calls_or_json(tools, parallel, schema),
                                  _key("tool_calls_or_json", tools, parallel, schema))
            return GrammarJob("tools", lambda: self.grammars.lazy_tool_calls(tools, parallel),
                              _key("lazy_tool_calls", tools, parallel))
        if schema is not None:
            return GrammarJob("response_format", lambda: self.grammars.json_schema(schema, strict=strict),
                              _key("json_schema", schema, strict))
        if self.settings.lazy_tool_grammar and self._shows_tool_markup(req):
            return GrammarJob("messages", self.grammars.free_text, _key("free_text"))
        return None

    def _shows_tool_markup(self, req: ChatCompletionRequest) -> bool:
        """Whether the prompt holds Hermes tool calls or results (a small model echoes them)."""
        return not template_supports_tools(self.engine.tokenizer) and any(
            m.role in ("tool", "function") or m.tool_calls or m.function_call for m in req.messages)

    @staticmethod
    def _answer_schema(fmt) -> tuple[dict | bool | None, bool]:
        """(JSON schema, strict) that response_format asks the answer to follow; (None, _) for text."""
        if fmt is None or fmt.type == "text":
            return None, True
        if fmt.type == "json_object":
            return {"type": "object"}, True
        spec = fmt.json_schema
        schema = spec.schema_ if spec is not None else fmt.schema_
        if schema is None:
            raise bad_request("response_format json_schema needs a schema.", "response_format.json_schema")
        return schema, spec.strict is not False if spec else True

    def _check_tool_schemas(self, tools: list[dict]) -> None:
        for i, tool in enumerate(tools):
            self._check_schema(tool["function"].get("parameters") or {}, f"tools[{i}].function.parameters")

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
        prepared, handles = await self.start(req, http)
        if prepared.stream:
            return EventSourceResponse(self._stream(prepared, handles), sep="\n", ping=SSE_PING_SECONDS)
        try:
            return await self._complete(prepared, handles, http)
        finally:
            cancel_all(handles)  # stops the engine if we leave early

    async def start(self, req: ChatCompletionRequest, http: Request) -> tuple[Prepared, list[RequestHandle]]:
        """Validate, compile the grammar and submit every choice (raises APIError before any of it runs)."""
        self.check_model(req)
        prepared = await asyncio.to_thread(self.prepare, req)
        namespace = self.tenant(http)
        for gen in prepared.generations:
            gen.cache_namespace = namespace
            if prepared.grammar is not None:  # in its own bounded pool, with a deadline: plain requests never wait
                job = prepared.grammar
                gen.constraint = await self.grammar_jobs.run(lambda: self._compile(job), job.param, job.key)
        return prepared, submit_all(self.scheduler, prepared.generations, prepared.id, prepared.info,
                                    request_owner(http, self.settings))

    def tenant(self, http: Request) -> str:
        """The prefix-cache namespace of a request: its API key (hashed), when keys are required, so
        one tenant cannot probe another's prompts through cache timing."""
        if self.settings.api_key is None:
            return ""
        return hashlib.sha256(http.headers.get("authorization", "").encode()).hexdigest()

    # -- following the choices -------------------------------------------------------------------

    async def answers(self, p: Prepared, handles: list[RequestHandle], http: Request) -> list[Answer]:
        """Every choice's finished message (non-streaming)."""
        states = await asyncio.gather(*(collect(h, ChoiceState(p.accumulator(self.engine.tokenizer)), http)
                                        for h in handles))
        answers = []
        for state in states:
            text = state.acc.text
            content, calls = parse_tool_calls(text, p.parallel_tool_calls, p.tool_names) if p.parse_tools \
                else (text, [])
            answers.append(Answer(content, calls, self._finish_reason(state.finished, state.acc, bool(calls),
                                                                      p.parse_tools), state))
        return answers

    async def deltas(self, p: Prepared, handles: list[RequestHandle]) -> AsyncIterator[ChoiceDelta | ChoiceDone]:
        """Every choice's message as it grows (streaming): what each round added, then its end. The
        deltas of a choice add up to its `answers()` message. An engine failure raises its APIError."""
        choices = [_StreamedChoice(ChoiceState(p.accumulator(self.engine.tokenizer)), p.tool_parser())
                   for _ in handles]
        async for i, item in merged(handles):
            c = choices[i]
            if isinstance(item, TokenBatch):
                if c.state.acc.stopped:
                    continue
                used = c.state.add(item)
                if c.state.acc.stopped:
                    handles[i].cancel("stop")
                d = c.delta(i, final=False)
                if p.logprobs and used:
                    d.logprobs = used
                if d.content or d.calls or d.logprobs:
                    yield d
            elif isinstance(item, Failed):
                raise item.error
            else:
                c.state.finished = item
                c.state.acc.finish()
                d = c.delta(i, final=True)
                if d.content or d.calls:
                    yield d
                has_calls = bool(c.tools and c.tools.calls)
                yield ChoiceDone(i, self._finish_reason(item, c.state.acc, has_calls, p.parse_tools), c.state)

    @staticmethod
    def _finish_reason(finished: Finished, acc: TextAccumulator, has_calls: bool, parse_tools: bool) -> str:
        if finished.finish_reason == "length" and not acc.stopped and parse_tools and ends_inside_tool_call(acc.text):
            return "length"  # cut off inside a call: report it, don't invent one
        if has_calls:
            return "tool_calls"
        if acc.stopped or finished.finish_reason == "cancelled":
            return "stop"
        return finished.finish_reason

    # -- chat completions: non-streaming ----------------------------------------------------------

    async def _complete(self, p: Prepared, handles: list[RequestHandle], http: Request) -> JSONResponse:
        answers = await self.answers(p, handles, http)
        states = [a.state for a in answers]
        choices = [self._choice(p, i, a) for i, a in enumerate(answers)]
        body = ChatCompletionResponse(
            id=p.id, created=p.created, model=self.model_name, choices=choices,
            usage=choice_usage(states, len(p.generations[0].prompt_ids)), speculation=choice_stats(states))
        return JSONResponse(body.model_dump(mode="json"))

    def _choice(self, p: Prepared, index: int, a: Answer) -> Choice:
        reason = a.finish_reason
        if p.legacy_functions:
            call = a.calls[0] if a.calls else None
            message = ResponseMessage(content=a.content, function_call=call and ResponseFunction(
                name=call.name, arguments=call.arguments))
            reason = "function_call" if reason == "tool_calls" else reason
        else:
            message = ResponseMessage(content=a.content, tool_calls=[
                ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
                for c in a.calls] or None)
        logprobs = self.logprob_format.chat(a.state.logprobs) if p.logprobs else None
        return Choice(index=index, message=message, finish_reason=reason, logprobs=logprobs)

    # -- chat completions: streaming ----------------------------------------------------------------

    def _chunk(self, p: Prepared, delta: DeltaMessage | None, finish_reason: str | None = None,
               usage: Usage | None = None, speculation: dict | None = None, index: int = 0,
               logprobs: ChoiceLogprobs | None = None) -> str:
        choices = [] if delta is None else [ChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                        logprobs=logprobs)]
        chunk = ChatCompletionChunk(id=p.id, created=p.created, model=self.model_name, choices=choices,
                                    usage=usage, speculation=speculation)
        return chunk.model_dump_json()

    @staticmethod
    def _delta_message(p: Prepared, d: ChoiceDelta) -> DeltaMessage:
        """A call is sent whole, in one delta: id, type and name once, and all of its arguments."""
        if p.legacy_functions:
            call = d.calls[0] if d.calls else None
            return DeltaMessage(content=d.content or None,
                                function_call=call and DeltaFunction(name=call.name, arguments=call.arguments))
        return DeltaMessage(content=d.content or None, tool_calls=[
            DeltaToolCall(index=d.first + k, id=c.id, type="function",
                          function=DeltaFunction(name=c.name, arguments=c.arguments))
            for k, c in enumerate(d.calls)] or None)

    async def _stream(self, p: Prepared, handles: list[RequestHandle]) -> AsyncIterator[str]:
        states: list[ChoiceState | None] = [None] * len(handles)
        try:
            for i in range(len(handles)):
                yield self._chunk(p, DeltaMessage(role="assistant", content=""), index=i)
            async for d in self.deltas(p, handles):
                if isinstance(d, ChoiceDelta):
                    logprobs = self.logprob_format.chat(d.logprobs) if d.logprobs else None
                    yield self._chunk(p, self._delta_message(p, d), index=d.index, logprobs=logprobs)
                else:
                    states[d.index] = d.state
                    reason = "function_call" if p.legacy_functions and d.finish_reason == "tool_calls" \
                        else d.finish_reason
                    stats = None if p.include_usage or len(handles) > 1 else choice_stats([d.state])
                    yield self._chunk(p, DeltaMessage(), reason, index=d.index, speculation=stats)
            if p.include_usage:
                yield self._chunk(p, None, usage=choice_usage(states, len(p.generations[0].prompt_ids)),
                                  speculation=choice_stats(states))
            elif len(handles) > 1:  # the per-choice stats, once every choice has finished
                yield self._chunk(p, None, speculation=choice_stats(states))
            yield "[DONE]"
        except asyncio.CancelledError:  # client went away (sse-starlette cancels us)
            raise
        except APIError as exc:  # the engine failed this request
            yield json.dumps(exc.body())
            yield "[DONE]"
        except Exception as exc:
            log.exception("stream %s failed", p.id)
            yield json.dumps(internal_error(f"stream failed: {type(exc).__name__}: {exc}").body())
            yield "[DONE]"
        finally:
            cancel_all(handles)


@dataclass
class _StreamedChoice:
    """One choice of a streamed response: its text and what of it has been sent."""
    state: ChoiceState
    tools: ToolCallParser | None
    sent: int = 0

    def delta(self, index: int, final: bool) -> ChoiceDelta:
        text = self.state.acc.visible(final)
        if self.tools is None:
            content, calls = text[self.sent:], []
            self.sent = len(text)
            return ChoiceDelta(index, content)
        first = len(self.tools.calls)
        content, calls = self.tools.update(text, final)
        return ChoiceDelta(index, content, calls, first)
