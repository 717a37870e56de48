"""One request, several choices (`n`, or a list of prompts): each choice is its own generation in the
scheduler; this module submits them together, follows them together, and adds up their usage.
Chat completions (serving.py) and legacy completions (completions.py) share it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from whiflash_core.engine import GenerationRequest
from whiflash_core.logits import TokenLogprob

from .errors import APIError
from .output import TextAccumulator
from .scheduler import Failed, Finished, RequestHandle, Scheduler, TokenBatch
from .schemas import CompletionTokensDetails, PromptTokensDetails, Usage


def submit_all(scheduler: Scheduler, generations: list[GenerationRequest], request_id: str,
               info: dict, owner: str | None = None) -> list[RequestHandle]:
    """Submit every choice, or none: when the queue fills part way (429), the submitted ones are cancelled.
    `owner`: who made the request (app/viewers.py), for the stats feed."""
    handles: list[RequestHandle] = []
    try:
        for i, gen in enumerate(generations):
            rid = request_id if len(generations) == 1 else f"{request_id}-{i}"
            handles.append(scheduler.submit(gen, rid, info, owner))
    except APIError:
        cancel_all(handles)
        raise
    return handles


def cancel_all(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.cancel("abort")  # no-op once finished


@dataclass
class ChoiceState:
    """What one choice produced so far: its text (cut at a stop string) and its tokens' logprobs."""
    acc: TextAccumulator
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, batch: TokenBatch) -> list[TokenLogprob]:
        """Take a round's tokens; returns the logprobs of those the text used (none past a stop string)."""
        if self.acc.stopped:
            return []
        before = self.acc.num_tokens
        self.acc.add(batch.token_ids)
        used = (batch.logprobs or [])[: self.acc.num_tokens - before]
        self.logprobs += used
        return used


DISCONNECT_POLL_SECONDS = 0.1  # a non-streaming request checks this often whether its client is still there


async def collect(handle: RequestHandle, state: ChoiceState, http: Request) -> ChoiceState:
    """Follow one choice to its end (non-streaming). A watcher polls the connection meanwhile, so a
    client that leaves is noticed within DISCONNECT_POLL_SECONDS whether or not tokens are flowing
    (a queued request then leaves the queue at once): the choice is cancelled and this raises a 499."""
    watcher = asyncio.create_task(_cancel_on_disconnect(http, handle))
    try:
        while state.finished is None:
            item = await handle.get()
            if isinstance(item, TokenBatch):
                state.add(item)
                if state.acc.stopped:
                    handle.cancel("stop")
            elif isinstance(item, Failed):
                raise item.error
            else:
                state.finished = item
    finally:
        watcher.cancel()
    if handle.cancel_reason == "abort":  # the client left: nobody reads the answer
        raise APIError("client disconnected", 499, "invalid_request_error", None, "client_closed")
    state.acc.finish()
    return state


async def _cancel_on_disconnect(http: Request, handle: RequestHandle) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    handle.cancel("abort")


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, item) from every handle as items arrive; ends when each has finished or failed."""
    if len(handles) == 1:  # the common case, without tasks
        async for item in handles[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        async for item in handle:
            await queue.put((i, item))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        done = 0
        while done < len(handles):
            i, item = await queue.get()
            if isinstance(item, (Finished, Failed)):
                done += 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def usage(states: list[ChoiceState], prompt_tokens: int) -> Usage:
    """The request's usage over its choices: the prompt once per distinct prompt (`prompt_tokens`),
    every choice's completion tokens (cut at a stop string), and the draft tokens accepted/rejected."""
    completion = accepted = drafted = 0
    for s in states:
        completion += s.acc.num_tokens if s.acc.stopped else s.finished.completion_tokens
        for d in (s.finished.stats.get("drafters") or {}).values():
            drafted += d.get("draft_tokens", 0)
            accepted += d.get("accepted_tokens", 0)
    # the prompt's reuse from the prefix cache, as the first choice found it (later choices of the same
    # prompt find the first one's prefill in the cache)
    cached = min(states[0].finished.cached_tokens, prompt_tokens) if states else 0
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 completion_tokens_details=CompletionTokensDetails(
                     accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted))


def stats(states: list[ChoiceState]) -> dict:
    """The engine's per-request stats plus timing (prefill, draft, verify, ... seconds), so
    `whiflash bench --url` can separate decode speed from gateway overhead; with several choices,
    one such object per choice under `choices`."""
    per = [{**s.finished.stats, "timing": s.finished.timing} for s in states]
    return per[0] if len(per) == 1 else {"choices": per}
