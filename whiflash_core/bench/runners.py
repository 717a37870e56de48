"""One runner per measured method. Each turns a prompt into a `RunResult`.

- `EngineRunner`    the WhiFlash engine in-process (none / eagle3 / dflash / whiflash)
- `HttpRunner`      the same methods through a running gateway (`/v1/chat/completions`)
- `HFGenerateRunner` peers: transformers `generate` (greedy) and prompt-lookup decoding
- `LlamaCppRunner`  peer: llama.cpp on the same GGUF through llama-cpp-python (optional)

All runners are greedy at temperature 0 and time the request from its start to its last token;
decode time starts when the first token exists, so prefill is excluded from decode tokens/s.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Protocol

import torch

from .stats import RunResult
from .workload import BenchPrompt


class Runner(Protocol):
    name: str

    def run(self, prompt: BenchPrompt, max_tokens: int) -> RunResult: ...


def cut_at_stop(tokens: list[int], stop_ids: set[int], max_tokens: int) -> tuple[list[int], str]:
    """Tokens up to (excluding) the first stop token, at most max_tokens, and the finish reason."""
    for i, tok in enumerate(tokens[:max_tokens]):
        if tok in stop_ids:
            return tokens[:i], "stop"
    return tokens[:max_tokens], "length"


# -- the engine -------------------------------------------------------------------------------


def drafter_rounds(stats: dict) -> dict[str, int]:
    """Rounds per drafter from a request's stats, with "plain" for rounds that drafted nothing
    (the router found no draft worth its cost, or method none)."""
    out = {name: d["rounds"] for name, d in stats["drafters"].items()}
    out["plain"] = stats["rounds"] - sum(out.values())
    return out


class EngineRunner:
    def __init__(self, engine, method: str, sampling, speculation):
        self.engine, self.name = engine, method
        self.sampling, self.speculation = sampling, speculation

    def run(self, prompt: BenchPrompt, max_tokens: int) -> RunResult:
        from ..engine import GenerationRequest

        request = GenerationRequest(prompt.ids, max_tokens, self.sampling, self.speculation)
        t0 = time.perf_counter()
        gen = self.engine.start(request)
        gen.prefill()
        t1 = time.perf_counter()
        while not gen.finished:
            gen.step()
        t2 = time.perf_counter()
        stats, timing = gen.stats(trace=False), gen.timing()
        return RunResult(
            method=self.name, n_tokens=len(gen.output), e2e_s=t2 - t0, decode_s=t2 - t1,
            tokens=list(gen.output), rounds=stats["rounds"],
            times={k: timing[k] for k in ("draft", "verify", "catch_up", "router", "prefill")},
            switches=stats["switches"], finish_reason=gen.finish_reason,
            extra={"draft_tokens": stats["draft_tokens"], "accepted_tokens": stats["accepted_tokens"],
                   "drafter_rounds": drafter_rounds(stats)},
        )


# -- the gateway over HTTP --------------------------------------------------------------------


def _post_json(url: str, body: dict, timeout: float) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def server_model(base_url: str, timeout: float = 10.0) -> str | None:
    """The first model id the server lists, or None."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
            data = json.loads(resp.read()).get("data") or []
        return data[0]["id"] if data else None
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return None


def message_text(message: dict) -> str:
    """Content plus tool calls, so tool-call answers are compared too."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        text += f"\n<tool_call>{fn.get('name')}:{fn.get('arguments')}</tool_call>"
    return text


class HttpRunner:
    """Non-streaming chat completions with `"speculation": {"method": m, "trace": true}`.

    Read from the response: `choices[0].message`, `usage.completion_tokens`, and the gateway's
    `speculation` object (the engine's `Generation.stats()`: rounds, switches, and with trace the
    per-token ids). Server-side timing is used when present, as `speculation.timing` or a top-level
    `timing` (the engine's `Generation.timing()`: total_s, prefill, draft, ...); then decode time is
    server-measured and the gateway overhead is client wall time minus the server's total_s.
    """

    def __init__(self, base_url: str, method: str, model: str | None, temperature: float = 0.0,
                 seed: int | None = 0, speculation: dict | None = None, timeout: float = 600.0):
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.name, self.model, self.temperature, self.seed = method, model, temperature, seed
        self.speculation = {"method": method, **(speculation or {})}
        self.timeout = timeout
        self.trace = True   # dropped if the server rejects the field

    def body(self, prompt: BenchPrompt, max_tokens: int) -> dict:
        spec = dict(self.speculation, **({"trace": True} if self.trace else {}))
        body = {"messages": prompt.messages, "max_tokens": max_tokens,
                "temperature": self.temperature, "stream": False, "speculation": spec}
        if self.model:  # absent: the served model (a made-up name would be a 404)
            body["model"] = self.model
        if self.seed is not None:
            body["seed"] = self.seed
        if prompt.tools:
            body["tools"] = prompt.tools
        return body

    def run(self, prompt: BenchPrompt, max_tokens: int) -> RunResult:
        t0 = time.perf_counter()
        try:
            resp = _post_json(self.url, self.body(prompt, max_tokens), self.timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or not self.trace:
                raise RuntimeError(f"{self.url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
            self.trace = False   # a strict server may not know `trace`; retry without it
            t0 = time.perf_counter()
            resp = _post_json(self.url, self.body(prompt, max_tokens), self.timeout)
        wall = time.perf_counter() - t0
        return self.parse(resp, wall)

    def parse(self, resp: dict, wall: float) -> RunResult:
        choice = (resp.get("choices") or [{}])[0]
        spec = resp.get("speculation") or {}
        timing = spec.get("timing") or resp.get("timing") or {}
        tokens = [t["id"] for t in spec["tokens"]] if spec.get("tokens") else None
        usage = resp.get("usage") or {}
        n = usage.get("completion_tokens")
        n = n if n is not None else (len(tokens) if tokens is not None else 0)
        decode_s = None
        if timing.get("total_s") is not None and timing.get("prefill") is not None:
            decode_s = max(0.0, timing["total_s"] - timing["prefill"])
        extra = {"prompt_tokens": usage.get("prompt_tokens")}
        if timing.get("total_s") is not None:
            extra["gateway_overhead_s"] = wall - timing["total_s"]
        return RunResult(
            method=self.name, n_tokens=n, e2e_s=wall, decode_s=decode_s, tokens=tokens,
            text=message_text(choice.get("message") or {}), rounds=spec.get("rounds"),
            times={k: timing[k] for k in ("draft", "verify", "catch_up", "router", "prefill") if k in timing},
            switches=spec.get("switches", 0) or 0, finish_reason=choice.get("finish_reason"), extra=extra,
        )


# -- peers: transformers ----------------------------------------------------------------------


class _FirstTokenClock:
    """A generate() streamer that only notes when the first new token exists. generate() puts
    the prompt first, then new tokens as they are produced."""

    def __init__(self):
        self.puts, self.first_token_time = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerateRunner:
    """transformers `generate`, greedy, in the benchmark's dtype. With `prompt_lookup` set, it is
    prompt-lookup decoding (n-gram drafts copied from the prompt, verified by the model)."""

    def __init__(self, model, name: str, stop_ids: list[int], prompt_lookup: int | None = None):
        self.model, self.name, self.stop_ids = model, name, list(stop_ids)
        self.prompt_lookup = prompt_lookup
        self.forwards, self.counting = 0, False
        # target forwards -> acceptance length; several runners may share the model, so each
        # counts only during its own run
        model.register_forward_hook(self._count)

    def _count(self, *_):
        if self.counting:
            self.forwards += 1

    def run(self, prompt: BenchPrompt, max_tokens: int) -> RunResult:
        input_ids = torch.tensor([prompt.ids])
        kwargs = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=self.stop_ids,
                      pad_token_id=self.stop_ids[0] if self.stop_ids else None)
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        clock = _FirstTokenClock()
        self.forwards, self.counting = 0, True
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=clock,
                                          **kwargs)
        finally:
            self.counting = False
        t2 = time.perf_counter()
        tokens, reason = cut_at_stop(out[0, input_ids.shape[1]:].tolist(), set(self.stop_ids), max_tokens)
        decode_s = t2 - clock.first_token_time if clock.first_token_time is not None else None
        return RunResult(method=self.name, n_tokens=len(tokens), e2e_s=t2 - t0, decode_s=decode_s,
                         tokens=tokens, rounds=max(0, self.forwards - 1), finish_reason=reason)


# -- peer: llama.cpp --------------------------------------------------------------------------


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppRunner:
    """llama.cpp on the GGUF itself (its own quantized kernels), greedy via top_k=1, temp=0.
    Token agreement with `none` is reported but not expected: llama.cpp quantizes activations
    for its quantized dot products, so its trajectory differs after a few words."""

    name = "llama_cpp"

    def __init__(self, gguf_path: str, stop_ids: list[int], threads: int | None, n_ctx: int = 4096):
        from llama_cpp import Llama

        n = threads or torch.get_num_threads()
        self.llm = Llama(model_path=gguf_path, n_threads=n, n_threads_batch=n, n_ctx=n_ctx, n_batch=512,
                         verbose=False)
        self.stop_ids = set(stop_ids) | {self.llm.token_eos()}

    def run(self, prompt: BenchPrompt, max_tokens: int) -> RunResult:
        tokens: list[int] = []
        first = None
        reason = "length"
        t0 = time.perf_counter()
        self.llm.reset()
        for tok in self.llm.generate(prompt.ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            if tok in self.stop_ids:
                reason = "stop"
                break
            tokens.append(int(tok))
            if len(tokens) >= max_tokens:
                break
        t2 = time.perf_counter()
        return RunResult(method=self.name, n_tokens=len(tokens), e2e_s=t2 - t0,
                         decode_s=(t2 - first) if first is not None else None, tokens=tokens,
                         rounds=max(0, len(tokens) - (reason != "stop")), finish_reason=reason)
