"""The Ray-free parts of `whiflash serve --replicas`: the affinity key, the replica order for a key,
and the merging of the replicas' metrics and stats (app/replica_routing.py, app/replica_merge.py).
The deployment itself is tested live in test_replicas.py."""
from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from app.metrics import Metrics
from app.replica_merge import SSEParser, merge_aggregates, merge_metrics, merge_snapshots, sse
from app.replica_routing import Forwarded, affinity_key, rendezvous_order

SYSTEM = {"role": "system", "content": "You are a careful agent."}
ASK = {"role": "user", "content": "What's the weather in Paris?"}


def chat(*messages, **fields) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages), **fields}).encode()


def test_a_conversations_turns_share_its_key():
    first = affinity_key("/v1/chat/completions", chat(SYSTEM, ASK), "Bearer k")
    later = affinity_key("/v1/chat/completions", chat(
        SYSTEM, ASK, {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": "And tomorrow?"}, max_tokens=5, stream=True), "Bearer k")
    assert first is not None and first == later
    # also without /v1 (clients whose base URL lacks it)
    assert affinity_key("/chat/completions", chat(SYSTEM, ASK), "Bearer k") == first


def test_other_openings_and_tenants_get_other_keys():
    base = affinity_key("/v1/chat/completions", chat(SYSTEM, ASK), "Bearer k")
    assert affinity_key("/v1/chat/completions", chat(SYSTEM, ASK), "Bearer other") != base
    assert affinity_key("/v1/chat/completions", chat({"role": "system", "content": "Else."}, ASK), "Bearer k") != base
    assert affinity_key("/v1/chat/completions", chat(SYSTEM, {"role": "user", "content": "Hi"}), "Bearer k") != base
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert affinity_key("/v1/chat/completions", chat(SYSTEM, ASK, tools=tools), "Bearer k") != base


def test_legacy_completions_key_on_the_prompts_opening():
    opening = "x" * 600
    a = affinity_key("/v1/completions", json.dumps({"prompt": opening + " one"}).encode(), None)
    b = affinity_key("/v1/completions", json.dumps({"prompt": [opening + " two", "z"]}).encode(), None)
    assert a is not None and a == b
    assert affinity_key("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode(), None) is not None


def test_bad_bodies_have_no_key():
    for body in (b"not json", b"[1, 2]", b'{"messages": "x"}', b'{"messages": []}', b"\xff\xfe"):
        assert affinity_key("/v1/chat/completions", body, None) is None
    assert affinity_key("/v1/models", chat(SYSTEM, ASK), None) is None


def test_rendezvous_moves_only_the_keys_of_a_member_that_leaves():
    members = ["rank-0", "rank-1", "rank-2"]
    keys = [f"k{i}" for i in range(300)]
    home = {k: rendezvous_order(k, members)[0] for k in keys}
    assert set(home.values()) == set(members)              # every member is somebody's home
    assert all(rendezvous_order(k, list(reversed(members)))[0] == home[k] for k in keys)   # order-free
    without = {k: rendezvous_order(k, ["rank-0", "rank-2"])[0] for k in keys}
    assert all(without[k] == home[k] for k in keys if home[k] != "rank-1")
    assert all(without[k] == rendezvous_order(k, members)[1] for k in keys if home[k] == "rank-1")


def test_forwarded_keeps_the_client_and_headers():
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"a=1",
             "headers": [(b"authorization", b"Bearer k"), (b"host", b"localhost:8000")],
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}
    s = Forwarded.of(scope, b"{}").scope()
    assert (s["method"], s["path"], s["query_string"], s["client"]) == ("POST", "/v1/chat/completions", b"a=1",
                                                                        ("127.0.0.1", 5555))
    assert (b"authorization", b"Bearer k") in s["headers"]   # the replica derives the tenant's cache namespace


def test_metrics_add_up_over_replicas():
    a, b = Metrics("m"), Metrics("m")
    a.finished("stop", 0.2)
    b.finished("stop", 0.3)
    b.finished("length", 30.0)
    a.tokens(5)
    b.tokens(7)
    a.prefix_cache_lookup(100, 64)
    text = merge_metrics({"r1": a.render().decode(), "r2": b.render().decode()})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    m = (("model_name", "m"),)
    assert samples[("whiflash:replicas", ())] == 2
    assert samples[("whiflash:generation_tokens_total", m)] == 12
    assert samples[("whiflash:request_success_total", (("finished_reason", "stop"), *m))] == 2
    assert samples[("whiflash:e2e_request_latency_seconds_count", m)] == 3
    assert samples[("whiflash:e2e_request_latency_seconds_bucket", (("le", "+Inf"), *m))] == 3
    assert samples[("whiflash:prefix_cache_hits_total", m)] == 64
    # per process: one series per replica
    assert {dict(k[1]).get("replica") for k in samples if k[0] == "process_resident_memory_bytes"} == {"r1", "r2"}


def test_stats_aggregates_and_snapshots_merge():
    one = {"since": 10.0, "requests": 2, "finished": 2, "active": 0, "tokens": 30, "rounds": 10, "switches": 3,
           "tokens_by_source": {"target": 20, "eagle3": 10}, "acceptance_length": 3.0,
           "switches_per_100_tokens": 10.0,
           "drafters": {"eagle3": {"rounds": 10, "draft_tokens": 30, "accepted_tokens": 20, "acceptance_length": 3.0}}}
    two = {"since": 5.0, "requests": 1, "finished": 0, "active": 1, "tokens": 10, "rounds": 10, "switches": 0,
           "tokens_by_source": {"target": 10}, "acceptance_length": 1.0, "switches_per_100_tokens": 0.0,
           "drafters": {}}
    merged = merge_aggregates({"r1": one, "r2": two})
    assert (merged["since"], merged["requests"], merged["active"], merged["tokens"]) == (5.0, 3, 1, 40)
    assert merged["tokens_by_source"] == {"target": 30, "eagle3": 10}
    assert merged["acceptance_length"] == 2.0          # (30 + 10) decided / 20 rounds
    assert merged["switches_per_100_tokens"] == 7.5
    assert merged["drafters"]["eagle3"]["accepted_tokens"] == 20
    assert merged["replicas"] == {"r1": one, "r2": two}

    snap = merge_snapshots({
        "r1": {"type": "snapshot", "time": 3, "aggregate": one, "samples": [{"time": 1, "tokens_per_s": 2.0,
                                                                              "acceptance_length": 2.0}],
               "events": [{"type": "request_started", "id": "a", "time": 2}]},
        "r2": {"type": "snapshot", "time": 4, "aggregate": two, "samples": [],
               "events": [{"type": "request_started", "id": "b", "time": 1}]}})
    assert [(e["id"], e["replica"]) for e in snap["events"]] == [("b", "r2"), ("a", "r1")]
    assert snap["aggregate"]["requests"] == 3 and snap["samples"][0]["tokens_per_s"] == 2.0
    assert "viewer" not in snap
    viewer = {"admin": False, "identified": True}  # who the stats page is: the same on every replica
    assert merge_snapshots({"r1": {"type": "snapshot", "viewer": viewer},
                            "r2": {"type": "snapshot", "viewer": viewer}})["viewer"] == viewer


def test_sse_parser_reads_what_the_server_frames():
    parser = SSEParser()
    framed = sse({"type": "round", "n": 1}) + b": ping\r\n\r\n" + sse({"type": "tokens"})
    events = parser.feed(framed[:7]) + parser.feed(framed[7:])
    assert events == [{"type": "round", "n": 1}, {"type": "tokens"}]


def test_one_replica_is_the_single_process_server(monkeypatch):
    import argparse

    from app.serve_cli import add_parser, replica_settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    monkeypatch.delenv("WHIFLASH_REPLICAS", raising=False)
    assert replica_settings_from_args(parser.parse_args(["serve"])) is None
    assert replica_settings_from_args(parser.parse_args(["serve", "--replicas", "1"])) is None
    monkeypatch.setenv("WHIFLASH_REPLICAS", "1")
    assert replica_settings_from_args(parser.parse_args(["serve"])) is None
