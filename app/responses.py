"""`POST /v1/responses`: the OpenAI Responses API over the chat path.

A Responses request is rewritten as the chat request it means (`to_chat`: instructions and input
items as messages, flat function tools as chat tools, `text.format` as `response_format`,
`max_output_tokens` as `max_tokens`), and then runs exactly as chat does: `ChatServing.start()`
validates, renders the prompt, compiles the grammar and submits; `answers()` / `deltas()` give the
message, which is only formatted here, as output items (a `message` with its `output_text`, then
one `function_call` per call) or as the stream of events the openai client accumulates:

    response.created, response.in_progress,
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta,
                  response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut the answer off;
    response.failed if the engine fails)

Served: input as a string or items (`message`, `function_call`, `function_call_output`; `reasoning`
items are skipped), `instructions`, function tools, `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema), `max_output_tokens`, `temperature`, `top_p`,
`include: ["message.output_text.logprobs"]` with `top_logprobs`, `stream`, `metadata` (echoed), and
the chat extensions `seed`, `top_k`, `speculation`. Nothing is stored: `store` is accepted (OpenAI's
default is true) and changes nothing, so `previous_response_id` and `conversation` are 400s (send
the whole conversation as input, as the Agents SDK does by default). Also 400s: `background`,
`prompt`, `truncation: "auto"`, `reasoning` with an effort or summary, `context_management`, other
`include` values, non-function tools, non-text content parts. Accepted and without effect here:
`user`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention` (the prefix cache is
automatic), `service_tier`, `stream_options`, `max_tool_calls` (built-in tools only),
`text.verbosity` (a hint to OpenAI's models).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from whiflash_core.logits import TokenLogprob

from .choices import ChoiceState, cancel_all
from .choices import stats as choice_stats, usage as choice_usage
from .errors import APIError, bad_request, internal_error, validation_error
from .responses_schemas import (FunctionCallItem, FunctionCallOutputItem, IncompleteDetails, InputTokensDetails,
                                MessageItem, OutputFunctionCall, OutputMessage, OutputText, Response, ResponseError,
                                ResponsesRequest, ResponseUsage, parts_text)
from .scheduler import RequestHandle
from .schemas import ChatCompletionRequest
from .serving import SSE_PING_SECONDS, ChatServing, ChoiceDelta, Prepared
from .tools import ParsedToolCall

log = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


# --- the request as a chat request -----------------------------------------------------------------


def _refuse_unserved(req: ResponsesRequest) -> None:
    """400s for the fields that would change the answer but are not served (see the module doc)."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server stores no responses (`store` has "
                          "no effect). Send the whole conversation as `input`.", "previous_response_id",
                          "unsupported_parameter")
    if req.conversation is not None:
        raise bad_request("conversation is not supported: this server stores no conversations. Send the whole "
                          "conversation as `input`.", "conversation", "unsupported_parameter")
    if req.background:
        raise bad_request("background responses are not supported.", "background", "unsupported_parameter")
    if req.prompt is not None:
        raise bad_request("Stored prompt templates are not supported; send `instructions` and `input`.", "prompt",
                          "unsupported_parameter")
    if req.truncation == "auto":
        raise bad_request("truncation \"auto\" is not supported: an input longer than the context is a 400.",
                          "truncation", "unsupported_value")
    if req.reasoning is not None and (req.reasoning.effort not in (None, "none") or req.reasoning.summary
                                      or req.reasoning.generate_summary):
        raise bad_request("reasoning is not supported: this model does not reason.", "reasoning",
                          "unsupported_parameter")
    if req.context_management:
        raise bad_request("context_management is not supported.", "context_management", "unsupported_parameter")
    for i, value in enumerate(req.include or []):
        if value != LOGPROBS_INCLUDE:
            raise bad_request(f"include value {value!r} is not supported (only {LOGPROBS_INCLUDE!r}).",
                              f"include[{i}]", "unsupported_value")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Instructions and input items as chat messages. Consecutive calls (and the assistant text
    right before them) make one assistant message with tool_calls, as a chat client sends them."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": parts_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output)})
        # reasoning items: skipped (another model's reasoning; this one does not reason)
    return messages


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format json_schema needs a schema.", "text.format.schema")
    spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `req` means (raises APIError for what is not served)."""
    _refuse_unserved(req)
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    if req.top_logprobs and not logprobs:
        raise bad_request(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}].", "top_logprobs")
    chat = {
        "model": req.model, "messages": _messages(req), "stream": req.stream,
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in req.tools] if req.tools is not None else None,
        "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "logprobs": logprobs or None, "top_logprobs": req.top_logprobs if logprobs else None,
        "seed": req.seed, "top_k": req.top_k, "user": req.user,
        "speculation": req.speculation.model_dump(exclude_none=True) if req.speculation else None,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:  # e.g. an input with no messages at all
        raise _responses_error(validation_error(exc)) from None


# chat's names for the request's fields -> the Responses API's
_PARAMS = [(re.compile(r"^messages(\[\d+\])?"), "input"), (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
           (re.compile(r"^max_tokens"), "max_output_tokens"), (re.compile(r"^logprobs"), "include"),
           (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1")]


def _responses_error(exc: APIError) -> APIError:
    """An error of the chat path, naming the Responses request's field."""
    if exc.param:
        for pattern, name in _PARAMS:
            param, n = pattern.subn(name, exc.param, count=1)
            if n:
                exc.message = exc.message.replace(exc.param, param)
                exc.param = param
                break
    return exc


# --- serving ----------------------------------------------------------------------------------------


class ResponsesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat

    async def create(self, req: ResponsesRequest, http: Request):
        if req.model_extra:
            log.debug("ignoring unknown request fields %s", sorted(req.model_extra))
        try:
            p, handles = await self.chat.start(to_chat(req), http)
        except APIError as exc:
            raise _responses_error(exc) from None
        shape = _Shape(req, p, self.chat)
        if p.stream:
            return EventSourceResponse(self._stream(shape, p, handles), sep="\n", ping=SSE_PING_SECONDS)
        try:
            (answer,) = await self.chat.answers(p, handles, http)
        finally:
            cancel_all(handles)
        output: list = []
        if answer.content or not answer.calls:
            # a message before tool calls ended when they began: complete, and without logprobs;
            # one that ends the output has every token's logprobs (when asked for) and the response's status
            if answer.calls:
                output.append(shape.message(answer.content, [], "completed"))
            else:
                output.append(shape.message(answer.content, shape.logprobs(answer.state.logprobs),
                                            _status(answer.finish_reason)))
        output += [shape.call(c) for c in answer.calls]
        return JSONResponse(shape.final(answer.finish_reason, output, answer.state).model_dump(mode="json"))

    async def _stream(self, shape: _Shape, p: Prepared, handles: list[RequestHandle]) -> AsyncIterator[dict]:
        """The events of one response; the items they add up to are the non-streamed response's."""
        seq = itertools.count()

        def event(kind: str, **data) -> dict:
            return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": next(seq), **data})}

        started = shape.response("in_progress").model_dump(mode="json")
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        output: list = []  # the finished items
        message = _OpenMessage(shape)
        try:
            async for d in self.chat.deltas(p, handles):
                if isinstance(d, ChoiceDelta):
                    message.pending += d.logprobs  # sent with the next text (a call's tokens have no text here)
                    if d.content:
                        for e in message.add(event, output, d.content):
                            yield e
                    for call in d.calls:
                        if message.is_open:  # calls come after the text: the message is complete
                            for e in message.close(event, output, [], "completed"):
                                yield e
                        for e in self._call_events(event, shape, call, output):
                            yield e
                    continue
                # the choice is done: a message ends the output unless calls did (an empty one if neither)
                if not output or message.is_open:
                    for e in message.close(event, output, shape.logprobs(d.state.logprobs), _status(d.finish_reason)):
                        yield e
                final = shape.final(d.finish_reason, output, d.state)
                done = "response.incomplete" if final.status == "incomplete" else "response.completed"
                yield event(done, response=final.model_dump(mode="json"))
        except asyncio.CancelledError:  # the client went away
            raise
        except Exception as exc:
            if not isinstance(exc, APIError):
                log.exception("stream %s failed", shape.id)
                exc = internal_error(f"stream failed: {type(exc).__name__}: {exc}")
            failed = shape.response("failed", error=ResponseError(code="server_error", message=exc.message))
            yield event("response.failed", response=failed.model_dump(mode="json"))
        finally:
            cancel_all(handles)

    @staticmethod
    def _call_events(event, shape: _Shape, call: ParsedToolCall, output: list) -> list[dict]:
        """A call, whole: it is only sent once complete (app/tools.py)."""
        index, item = len(output), shape.call(call)
        output.append(item)
        opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
        return [event("response.output_item.added", output_index=index, item=opened.model_dump(mode="json")),
                event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                      delta=call.arguments),
                event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                      name=call.name, arguments=call.arguments),
                event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))]


class _OpenMessage:
    """The message item being streamed: opened by its first text, closed by a call or the end."""

    def __init__(self, shape: _Shape):
        self.shape = shape
        self.id = f"msg_{uuid.uuid4().hex}"
        self.is_open = False
        self.text: list[str] = []
        self.pending: list[TokenLogprob] = []  # logprobs not sent yet

    def _open(self, event, index: int) -> list[dict]:
        self.is_open = True
        item = OutputMessage(id=self.id, status="in_progress", content=[])
        return [event("response.output_item.added", output_index=index, item=item.model_dump(mode="json")),
                event("response.content_part.added", item_id=self.id, output_index=index, content_index=0,
                      part=OutputText(text="").model_dump(mode="json"))]

    def add(self, event, output: list, text: str) -> list[dict]:
        events = [] if self.is_open else self._open(event, len(output))
        self.text.append(text)
        logprobs, self.pending = self.shape.logprobs(self.pending), []
        return events + [event("response.output_text.delta", item_id=self.id, output_index=len(output),
                               content_index=0, delta=text, logprobs=logprobs)]

    def close(self, event, output: list, logprobs: list[dict], status: str) -> list[dict]:
        index = len(output)
        events = [] if self.is_open else self._open(event, index)
        item = self.shape.message("".join(self.text), logprobs, status, self.id)
        output.append(item)
        self.is_open = False
        part = item.content[0].model_dump(mode="json")
        return events + [
            event("response.output_text.done", item_id=self.id, output_index=index, content_index=0,
                  text=part["text"], logprobs=logprobs),
            event("response.content_part.done", item_id=self.id, output_index=index, content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))]


class _Shape:
    """The Responses objects of one request: its items, and the response around them."""

    def __init__(self, req: ResponsesRequest, p: Prepared, chat: ChatServing):
        self.req, self.p, self.model = req, p, chat.model_name
        self.logprob_format = chat.logprob_format
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())

    def logprobs(self, entries: list[TokenLogprob]) -> list[dict]:
        if not (self.p.logprobs and entries):
            return []
        return [e.model_dump(exclude_none=True) for e in self.logprob_format.chat(entries).content]

    @staticmethod
    def message(text: str, logprobs: list[dict], status: str, id: str | None = None) -> OutputMessage:
        return OutputMessage(id=id or f"msg_{uuid.uuid4().hex}", status=status,
                             content=[OutputText(text=text, logprobs=logprobs)])

    @staticmethod
    def call(call: ParsedToolCall) -> OutputFunctionCall:
        return OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.name,
                                  arguments=call.arguments, status="completed")

    def response(self, status: str, **fields) -> Response:
        req, sampling = self.req, self.p.generations[0].sampling
        fmt = req.text.format if req.text else None
        choice = req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(req.tool_choice, str) \
            else req.tool_choice or "auto"
        return Response(
            id=self.id, created_at=self.created, status=status, model=self.model, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            parallel_tool_calls=self.p.parallel_tool_calls, temperature=sampling.temperature, top_p=sampling.top_p,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            tool_choice=choice, tools=[t.model_dump(exclude_none=True) for t in req.tools or []], user=req.user,
            **fields)

    def final(self, finish: str, output: list, state: ChoiceState) -> Response:
        usage = choice_usage([state], len(self.p.generations[0].prompt_ids))
        status = _status(finish)
        return self.response(
            status, output=output, completed_at=int(time.time()) if status == "completed" else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            usage=ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens)),
            speculation=choice_stats([state]))


def _status(finish: str) -> str:
    """A response cut off by max_output_tokens is incomplete (OpenAI's status and reason)."""
    return "incomplete" if finish == "length" else "completed"
