"""`POST /v1/completions`: the legacy text completions API (llama-index `OpenAILike`, LangChain's
`OpenAI` class, lm-eval), over the same engine and scheduler as chat.

The prompt is raw text (no chat template): a string, a list of strings, a token-id list or a list
of token-id lists. Each prompt gets `n` choices, indexed prompt by prompt (OpenAI's order). Served:
max_tokens (default 16, as OpenAI's), temperature/top_p/top_k/seed, stop, penalties, logit_bias,
logprobs (0..5: the chosen token plus that many alternatives), stream (+ stream_options), and the
`speculation` extension. `echo: true`, `suffix` and `best_of` other than n are 400s, never ignored.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse

from whiflash_core.engine import GenerationRequest

from .choices import ChoiceState, cancel_all, collect, merged, submit_all
from .choices import stats as choice_stats, usage as choice_usage
from .errors import bad_request, context_length_exceeded, internal_error
from .output import TextAccumulator
from .scheduler import Failed, Finished, RequestHandle, TokenBatch
from .schemas import SamplingRequest, Usage, _OmitNone, _created
from .serving import SSE_PING_SECONDS, ChatServing
from .viewers import request_owner

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for legacy completions
MAX_LOGPROBS = 5          # OpenAI's bound on the legacy `logprobs`


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool | None = Field(False, strict=True)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, strict=True)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(_OmitNone):
    omit_if_none = ("usage", "speculation")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: dict[str, Any] | None = None


@dataclass
class _Prepared:
    id: str
    created: int
    generations: list[GenerationRequest]  # prompt by prompt, n choices each
    prompt_tokens: int                    # every distinct prompt once
    stream: bool
    include_usage: bool
    stop: list[str]
    logprobs: bool


class CompletionServing:
    """Legacy completions; validation of the shared fields, speculation and sampling come from `chat`."""

    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.engine, self.scheduler, self.settings = chat.engine, chat.scheduler, chat.settings

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty.", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                ids = self.engine.tokenizer(p)["input_ids"]
            elif not all(0 <= t < (vocab := self.engine.vocab_size) for t in p):
                raise bad_request(f"prompt token ids must be in 0..{vocab - 1}.", "prompt")
            else:
                ids = list(p)
            if not ids:
                raise bad_request("prompt must not be empty.", "prompt")
            out.append(ids)
        return out

    def prepare(self, req: CompletionRequest) -> _Prepared:
        if req.echo:
            raise bad_request("echo is not supported.", "echo", "unsupported_value")
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix", "unsupported_value")
        n = req.n or 1
        if req.best_of not in (None, n):
            raise bad_request("best_of other than n is not supported.", "best_of", "unsupported_value")
        prompts = self._prompts(req)
        spec = self.chat._speculation(req)
        adjustments = self.chat.adjustments(req)
        limit = self.engine.max_context
        generations = []
        for ids in prompts:
            if len(ids) + 1 >= limit:
                raise context_length_exceeded(len(ids), limit)
            max_new = min(req.max_tokens or DEFAULT_MAX_TOKENS, limit - len(ids) - 1)
            generations += [GenerationRequest(ids, max_new, self.chat.sampling(req, i), spec, adjustments=adjustments,
                                              logprobs=req.logprobs) for i in range(n)]
        return _Prepared(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), generations=generations,
                         prompt_tokens=sum(len(ids) for ids in prompts), stream=bool(req.stream),
                         include_usage=self.chat.include_usage(req), stop=list(req.stop or []),
                         logprobs=req.logprobs is not None)

    async def create(self, req: CompletionRequest, http: Request):
        self.chat.check_model(req)
        p = await asyncio.to_thread(self.prepare, req)
        # `user` is the client's own identifier of its end user: never published on the feed
        info = {"temperature": p.generations[0].sampling.temperature, "stream": p.stream, "endpoint": "completions"}
        namespace = self.chat.tenant(http)
        for gen in p.generations:
            gen.cache_namespace = namespace
        handles = submit_all(self.scheduler, p.generations, p.id, info, request_owner(http, self.settings))
        if p.stream:
            return EventSourceResponse(self._stream(p, handles), sep="\n", ping=SSE_PING_SECONDS)
        try:
            states = await asyncio.gather(*(collect(h, self._state(p), http) for h in handles))
        finally:
            cancel_all(handles)
        choices = [CompletionChoice(index=i, text=s.acc.text, finish_reason=_finish_reason(s.finished, s.acc),
                                    logprobs=self._logprobs(p, s.logprobs))
                   for i, s in enumerate(states)]
        body = CompletionResponse(id=p.id, created=p.created, model=self.chat.model_name, choices=choices,
                                  usage=choice_usage(states, p.prompt_tokens), speculation=choice_stats(states))
        return JSONResponse(body.model_dump(mode="json"))

    def _state(self, p: _Prepared) -> ChoiceState:
        return ChoiceState(TextAccumulator(self.engine.tokenizer, p.stop))

    def _logprobs(self, p: _Prepared, entries, offset: int = 0) -> dict | None:
        return self.chat.logprob_format.legacy(entries, offset) if p.logprobs else None

    def _chunk(self, p: _Prepared, choice: CompletionChoice | None, usage: Usage | None = None,
               speculation: dict | None = None) -> str:
        return CompletionResponse(id=p.id, created=p.created, model=self.chat.model_name,
                                  choices=[choice] if choice else [], usage=usage,
                                  speculation=speculation).model_dump_json()

    async def _stream(self, p: _Prepared, handles: list[RequestHandle]) -> AsyncIterator[str]:
        states = [self._state(p) for _ in handles]
        sent = [0] * len(handles)         # characters of each choice's text already sent
        offsets = [0] * len(handles)      # text_offset of each choice's next token (legacy logprobs)
        try:
            async for i, item in merged(handles):
                s = states[i]
                if isinstance(item, TokenBatch):
                    if s.acc.stopped:
                        continue
                    used = s.add(item)
                    if s.acc.stopped:
                        handles[i].cancel("stop")
                    text = s.acc.visible()
                    logprobs = self._logprobs(p, used, offsets[i]) if used else None
                    if logprobs:
                        offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    if len(text) > sent[i] or logprobs:
                        yield self._chunk(p, CompletionChoice(index=i, text=text[sent[i]:], logprobs=logprobs))
                        sent[i] = len(text)
                elif isinstance(item, Failed):
                    yield json.dumps(item.error.body())
                    yield "[DONE]"
                    return
                else:
                    s.finished = item
                    s.acc.finish()
                    yield self._chunk(p, CompletionChoice(index=i, text=s.acc.text[sent[i]:],
                                                          finish_reason=_finish_reason(item, s.acc)))
            if p.include_usage:
                yield self._chunk(p, None, usage=choice_usage(states, p.prompt_tokens), speculation=choice_stats(states))
            yield "[DONE]"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("stream %s failed", p.id)
            yield json.dumps(internal_error(f"stream failed: {type(exc).__name__}: {exc}").body())
            yield "[DONE]"
        finally:
            cancel_all(handles)


def _finish_reason(finished: Finished, acc: TextAccumulator) -> str:
    if acc.stopped or finished.finish_reason == "cancelled":
        return "stop"
    return finished.finish_reason
