"""bench/load.py against the shared live server, briefly: the load test itself must not rot, and a
few concurrent agent conversations must come back complete, with later turns hitting the prefix cache."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.load import run  # noqa: E402


def test_concurrent_agent_conversations_complete_and_reuse_prefixes(live_server):
    args = argparse.Namespace(url=live_server.url, api_key=None, streams=3, seconds=12, turns=3, max_tokens=8,
                              request_timeout=120, settle_seconds=0.5)
    res = asyncio.run(run(args))
    assert res["requests"] >= 3 and res["ok"] == res["requests"], res
    assert res["errors"] == 0 and res["incomplete_streams"] == 0 and res["rejected_429"] == 0, res
    assert res["ttft_p50_s"] is not None and res["total_tokens_per_s"] > 0
    # turn 2 of each conversation resends turn 1: its prompt comes (mostly) from the prefix cache
    assert res["cached_tokens"] > 0 and res["cache_hit_rate_metrics"] > 0, res
    assert res["server_rss_after_mb"] > 0 and res["server_rss_settled_mb"] > 0
    # the server worked (its process CPU from /metrics) and the load generator took some CPU too
    assert 0 < res["server_cpu_cores"] <= os.cpu_count() + 0.5 and res["server_cpu_ms_per_token"] > 0, res
    assert res["client_cpu_cores"] > 0, res
