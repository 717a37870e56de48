"""Prometheus metrics, named after vLLM's under a `whiflash:` prefix so dashboards carry over.

Speculative decoding counters follow `vllm/v1/spec_decode/metrics.py`, labelled by drafter:
    acceptance rate         = rate(num_accepted_tokens) / rate(num_draft_tokens)
    mean acceptance length  = 1 + num_accepted_tokens / num_drafts
    per-position acceptance = num_accepted_tokens_per_pos{position=k} / num_drafts

Each app gets its own registry, so several apps can live in one process (tests).
"""
from __future__ import annotations

import gc
from collections.abc import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from whiflash_core.rounds import Round

P = "whiflash:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
ROUND_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)   # process_resident_memory_bytes, cpu seconds, open fds (Linux)
        GCCollector(registry=r)        # python_gc_collections_total and objects collected, by generation
        # objects the collector no longer traverses (app.memory.freeze_startup_heap at start-up)
        Gauge(f"{P}gc_frozen_objects", "Objects frozen out of the cyclic GC at start-up",
              registry=r).set_function(gc.get_freeze_count)
        self.model_name = model_name
        m = ["model_name"]
        self.requests = Counter(f"{P}request_success", "Finished requests by finish reason (abort: client left)",
                                m + ["finished_reason"], registry=r)
        self.failed_requests = Counter(f"{P}request_failure", "Requests that ended in an error (timeout, ...)",
                                       m + ["reason"], registry=r)
        self.rejected = Counter(f"{P}request_rejected", "Requests refused before generation (429)",
                                m + ["reason"], registry=r)
        self.prompt_tokens = Counter(f"{P}prompt_tokens", "Prefilled prompt tokens", m, registry=r)
        self.generation_tokens = Counter(f"{P}generation_tokens", "Emitted tokens", m, registry=r)
        self.running = Gauge(f"{P}num_requests_running", "Generations being stepped", m, registry=r)
        self.waiting = Gauge(f"{P}num_requests_waiting", "Requests waiting for a slot", m, registry=r)
        self.ttft = Histogram(f"{P}time_to_first_token_seconds", "Arrival to first token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{P}e2e_request_latency_seconds", "Arrival to finish", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{P}request_queue_time_seconds", "Arrival to prefill", m,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.round_time = Histogram(f"{P}round_time_seconds", "One speculation round (draft + verify)",
                                    m + ["method"], buckets=ROUND_BUCKETS, registry=r)
        d = m + ["drafter"]
        self.num_drafts = Counter(f"{P}spec_decode_num_drafts", "Rounds that verified a draft", d, registry=r)
        self.num_draft_tokens = Counter(f"{P}spec_decode_num_draft_tokens", "Proposed draft tokens", d, registry=r)
        self.num_accepted_tokens = Counter(f"{P}spec_decode_num_accepted_tokens", "Accepted draft tokens", d,
                                           registry=r)
        self.accepted_per_pos = Counter(f"{P}spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft", d + ["position"],
                                        registry=r)
        self.prefix_cache_queries = Counter(f"{P}prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            m, registry=r)
        self.prefix_cache_hits = Counter(f"{P}prefix_cache_hits", "Prompt tokens reused from the prefix cache",
                                         m, registry=r)
        self.prefix_cache_bytes = Gauge(f"{P}prefix_cache_bytes", "Memory held by the prefix cache", m, registry=r)
        self.buffer_pool_free_bytes = Gauge(f"{P}buffer_pool_free_bytes",
                                            "Finished requests' K/V and tap buffers kept for the next requests "
                                            "(handed back to the OS once the server is idle)", m, registry=r)
        self.drafter_failures = Counter(f"{P}spec_decode_drafter_failures",
                                        "Drafters that raised in a round (that request decoded plainly from then on)",
                                        d, registry=r)
        self.router_switches = Counter(f"{P}router_switches", "Rounds whose drafter differs from the round before",
                                       m, registry=r)

    def bind_queue_gauges(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.running.labels(self.model_name).set_function(running)
        self.waiting.labels(self.model_name).set_function(waiting)

    def bind_prefix_cache(self, stored_bytes: Callable[[], float]) -> None:
        self.prefix_cache_bytes.labels(self.model_name).set_function(stored_bytes)

    def bind_buffer_pool(self, free_bytes: Callable[[], float]) -> None:
        self.buffer_pool_free_bytes.labels(self.model_name).set_function(free_bytes)

    # -- recording (called from the engine worker thread; prometheus_client is thread-safe) --------

    def round(self, method: str, r: Round) -> None:
        n = self.model_name
        self.round_time.labels(n, method).observe(r.times.total)
        if r.drafter is not None:
            self.num_drafts.labels(n, r.drafter).inc()
            self.num_draft_tokens.labels(n, r.drafter).inc(r.draft_len)
            self.num_accepted_tokens.labels(n, r.drafter).inc(r.accepted)
            for pos in range(r.accepted):
                self.accepted_per_pos.labels(n, r.drafter, str(pos)).inc()
        if r.switched:
            self.router_switches.labels(n).inc()
        if r.fallback_from is not None:
            self.drafter_failures.labels(n, r.fallback_from).inc()

    def tokens(self, count: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(count)

    def started(self, prompt_tokens: int, queued_s: float) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.queue_time.labels(self.model_name).observe(queued_s)

    def prefix_cache_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        """hit rate = rate(prefix_cache_hits) / rate(prefix_cache_queries), as vLLM's"""
        self.prefix_cache_queries.labels(self.model_name).inc(prompt_tokens)
        self.prefix_cache_hits.labels(self.model_name).inc(cached_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self.requests.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(seconds)

    def failed(self, reason: str) -> None:
        self.failed_requests.labels(self.model_name, reason).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
