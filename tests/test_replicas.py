"""`whiflash serve --replicas 2` end to end on the CPU: one Ray cluster, two float32 replicas of the
embedded model, one endpoint.

- both replicas serve, and conversation affinity holds: each conversation's turns land on one
  replica (the one its opening hashes to) and its second turn reports cached prompt tokens;
- streaming through Ray Serve gives the single server's chunks, ending in [DONE];
- every response, errors included, names its replica in `x-whiflash-replica`;
- a client that leaves a stream frees its request on the replica;
- /metrics and the stats snapshot add up both replicas;
- a replica killed (SIGKILL) mid-stream fails only its own requests (its streams end with an error
  event, then [DONE]; a request not streamed gets a 503 naming it), the other replica's streams
  complete, and Ray Serve replaces it; the time until the replacement serves is measured, and the
  conversation returns to it (it takes the dead replica's rank).

The measured numbers are printed at the end of the module (`pytest -s tests/test_replicas.py`).
The cluster is the CLI's own local one (`ray.init()` in `whiflash serve`); it goes down with the
server, and `ray stop` runs after it in case a killed server left processes behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from app.replica_routing import affinity_key, rendezvous_order
from conftest import LIVE_SERVER_ARGS, start_server

pytest.importorskip("ray.serve", reason="the replicas extra is not installed: pip install -e '.[replicas]'")

pytestmark = [pytest.mark.timeout(300), pytest.mark.extended]   # ~90-130 s: make test-extended, .ci/run

HEADER = "x-whiflash-replica"
SLOTS = ["rank-0", "rank-1"]
RECOVERY_LIMIT_S = 180
RESULTS: dict = {}


def _ray_stop() -> None:
    ray = Path(sys.executable).parent / "ray"
    if ray.exists():
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = time.perf_counter()
    server = start_server("--replicas", "2", *LIVE_SERVER_ARGS, log_dir=tmp_path_factory.mktemp("replicas"),
                          env={"RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"})
    RESULTS["cluster_start_s"] = round(time.perf_counter() - started, 1)
    RESULTS["module_started"] = started
    try:
        wait_for_replicas(server, 2)
        yield server
    finally:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(90)   # serve.shutdown() stops the replicas gracefully, then ray.shutdown()
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
        _ray_stop()
        RESULTS["module_wall_s"] = round(time.perf_counter() - started, 1)
        print("\nreplicas test:", json.dumps({k: v for k, v in RESULTS.items() if k != "module_started"}))


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def wait_for_replicas(server, n: int, without: str | None = None, limit: float = RECOVERY_LIMIT_S) -> dict:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            replicas = health(server)["replicas"]
            if (len(replicas) == n and all(s == "ok" for s in replicas.values())
                    and (without is None or without not in replicas)):
                return replicas
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{n} healthy replicas not seen within {limit} s:\n{server.log_tail()}")


def replica_pids(server) -> dict[str, int]:
    """Each replica's process, from the line it logs when ready (shown by the Ray driver)."""
    return {name: int(pid) for name, pid in
            re.findall(r"whiflash replica (\w+) \(rank \d+, pid (\d+)\) ready", server.log_tail(10**7))}


def opening(i: int) -> list[dict]:
    # long enough (> 32 tokens, one prefix-cache block) for the next turn to hit the cache
    return [{"role": "system", "content": f"You are assistant number {i} of a careful team. You answer in one short "
                                          "sentence, always, and you never add greetings or other chatter."},
            {"role": "user", "content": "Name a planet of the solar system."}]


def home_of(messages: list[dict]) -> str:
    """The rank the router sends a conversation to (what the test client sends: no Authorization)."""
    key = affinity_key("/v1/chat/completions", json.dumps({"messages": messages}).encode(), None)
    return rendezvous_order(key, SLOTS)[0]


def counting(i: int) -> list[dict]:
    """A conversation whose answer is long (to be mid-stream when its replica is killed)."""
    return [opening(i)[0], {"role": "user", "content": "Count from 1 to 300, separated by commas."}]


def conversations(per_slot: int, messages=opening) -> dict[str, list[int]]:
    """Conversation numbers, `per_slot` homed on each rank."""
    found: dict[str, list[int]] = {s: [] for s in SLOTS}
    i = 0
    while any(len(v) < per_slot for v in found.values()):
        slot = home_of(messages(i))
        if len(found[slot]) < per_slot:
            found[slot].append(i)
        i += 1
    return found


def chat(server, messages, **fields) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)


def test_both_replicas_serve_and_conversations_keep_their_replica(cluster):
    assert sorted(health(cluster)["slots"].values()) == SLOTS
    homes = conversations(per_slot=2)
    served: dict[int, list[str]] = {}
    cached: dict[int, int] = {}
    for slot, numbers in homes.items():
        for i in numbers:
            first = chat(cluster, opening(i))
            assert first.status_code == 200, first.text
            answer = first.json()["choices"][0]["message"]["content"]
            second = chat(cluster, [*opening(i), {"role": "assistant", "content": answer},
                                    {"role": "user", "content": "And another one?"}])
            assert second.status_code == 200, second.text
            served[i] = [first.headers[HEADER], second.headers[HEADER]]
            cached[i] = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # affinity: both turns on one replica, and the second reuses the first's prefix from its cache
    assert all(a == b for a, b in served.values()), served
    assert all(n >= 32 for n in cached.values()), cached
    # the conversations of one rank share a replica; the two ranks are the two replicas
    by_slot = {slot: {served[i][0] for i in numbers} for slot, numbers in homes.items()}
    assert all(len(names) == 1 for names in by_slot.values()), by_slot
    assert by_slot["rank-0"] != by_slot["rank-1"], by_slot
    per_replica = Counter(name for pair in served.values() for name in pair)
    RESULTS["requests_per_replica"] = dict(per_replica)
    RESULTS["affinity_hits"] = f"{sum(a == b and cached[i] >= 32 for i, (a, b) in served.items())}/{len(served)}"
    RESULTS["cached_tokens_turn2"] = sorted(cached.values())


def sse_lines(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def streamed(url: str, messages, **fields) -> tuple[str | None, list[str]]:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True, **fields}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return r.headers.get(HEADER), sse_lines(r)


def test_streams_match_the_single_server(cluster, live_server):
    # plain decoding: one token per round, so the chunking does not depend on each process's
    # start-up timing of the router's costs (in float32 every method gives the same tokens)
    fields = {"stream_options": {"include_usage": True}, "speculation": {"method": "none"}}
    replica, through_ray = streamed(cluster.url, opening(1000), **fields)
    _, single = streamed(live_server.url, opening(1000), **fields)
    assert replica in health(cluster)["replicas"]
    assert through_ray[-1] == single[-1] == "[DONE]"
    chunks = [json.loads(x) for x in through_ray[:-1]]
    reference = [json.loads(x) for x in single[:-1]]
    # the same chunks: deltas, finish reason, usage (ids and timings differ per request)
    assert [c["choices"] for c in chunks] == [c["choices"] for c in reference]
    assert chunks[-1]["usage"]["completion_tokens"] == reference[-1]["usage"]["completion_tokens"]


def test_every_response_names_its_replica(cluster):
    names = set(health(cluster)["replicas"])
    bad = httpx.post(cluster.base_url + "/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"}, timeout=30)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    assert bad.headers[HEADER] in names
    unknown = chat(cluster, opening(0), model="no-such-model")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert unknown.headers[HEADER] in names
    models = httpx.get(cluster.base_url + "/models", timeout=30)
    assert models.status_code == 200 and models.headers[HEADER] in names
    # refused by the ingress before any replica saw it: says so
    huge = httpx.post(cluster.base_url + "/chat/completions", content=b"x" * (3 * 2**20),
                      headers={"content-type": "application/json"}, timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    assert huge.headers[HEADER] == "none"
    assert set(httpx.get(cluster.url + "/health", timeout=30).headers[HEADER].split(",")) == names


def metric_values(server) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def aborted(server) -> float:
    return sum(v for k, v in metric_values(server).items()
               if k.startswith("whiflash:request_success_total") and 'finished_reason="abort"' in k)


def test_a_client_that_leaves_frees_its_request_on_the_replica(cluster):
    before = aborted(cluster)
    body = {"messages": opening(2000), "max_tokens": 400, "stream": True, "speculation": {"method": "none"}}
    with httpx.stream("POST", cluster.base_url + "/chat/completions", json=body, timeout=120) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break   # leave mid-stream
    left = time.perf_counter()
    while aborted(cluster) == before:
        assert time.perf_counter() - left < 30, "the replica kept generating for a client that left"
        time.sleep(0.2)
    RESULTS["disconnect_freed_s"] = round(time.perf_counter() - left, 2)


def test_metrics_and_stats_add_up_both_replicas(cluster):
    values = metric_values(cluster)
    assert values["whiflash:replicas"] == 2
    finished = sum(v for k, v in values.items() if k.startswith("whiflash:request_success_total"))
    assert finished >= 9   # 8 conversation turns and a stream (the refused requests never started)
    assert values['whiflash:prefix_cache_hits_total{model_name="SmolLM2-135M-Instruct"}'] >= 4 * 32
    assert len([k for k in values if k.startswith("process_resident_memory_bytes{")]) == 2
    snapshot = httpx.get(cluster.url + "/v1/stats/snapshot", timeout=30).json()
    aggregate = snapshot["aggregate"]
    assert set(aggregate["replicas"]) == set(health(cluster)["replicas"])
    assert aggregate["requests"] == sum(a["requests"] for a in aggregate["replicas"].values()) >= 9
    assert {e["replica"] for e in snapshot["events"]} == set(aggregate["replicas"])


def test_a_killed_replica_fails_only_its_own_streams_and_is_replaced(cluster):
    homes = conversations(per_slot=3, messages=counting)
    waiting = homes["rank-1"].pop()   # a request that is not streamed, on the replica to be killed
    homes["rank-0"].pop()
    body = {"max_tokens": 120, "temperature": 0, "stream": True, "speculation": {"method": "none"}}
    results: dict[int, dict] = {}
    answer: dict = {}

    def ask() -> None:
        r = httpx.post(cluster.base_url + "/chat/completions", timeout=120,
                       json={**body, "stream": False, "messages": counting(waiting)})
        answer.update(status=r.status_code, replica=r.headers.get(HEADER), body=r.json())

    def stream(i: int) -> None:
        with httpx.stream("POST", cluster.base_url + "/chat/completions", json={**body, "messages": counting(i)},
                          timeout=120) as r:
            results[i] = {"replica": r.headers.get(HEADER), "lines": []}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    results[i]["lines"].append(line[6:])

    numbers = [i for group in homes.values() for i in group]
    threads = [threading.Thread(target=stream, args=(i,)) for i in numbers] + [threading.Thread(target=ask)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not (len(results) == len(numbers) and all(len(r["lines"]) >= 3 for r in results.values())):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.1)
    victim = results[homes["rank-1"][0]]["replica"]
    assert health(cluster)["slots"][victim] == "rank-1"
    killed_at = time.perf_counter()
    os.kill(replica_pids(cluster)[victim], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream did not end"

    for i, r in results.items():
        assert r["lines"][-1] == "[DONE]", (i, r["lines"][-3:])
        last = json.loads(r["lines"][-2])
        if r["replica"] == victim:   # its own streams: the single server's in-stream error shape
            assert last["error"]["code"] == "replica_unavailable", last
        else:                       # the other replica's streams are unaffected
            assert "error" not in last and last["choices"][0]["finish_reason"] in ("length", "stop"), last
    assert sum(r["replica"] == victim for r in results.values()) == 2
    # the request that was not streamed: a 503 naming the replica it was on
    assert (answer["status"], answer["replica"], answer["body"]["error"]["code"]) == \
        (503, victim, "replica_unavailable"), answer

    # Ray Serve replaces the dead replica; the conversation's home is its rank, so it moves back
    replicas = wait_for_replicas(cluster, 2, without=victim)
    RESULTS["recovery_healthy_s"] = round(time.perf_counter() - killed_at, 1)
    newcomer = (set(replicas) - {r["replica"] for r in results.values()}).pop()
    again = chat(cluster, counting(homes["rank-1"][0]))
    assert again.status_code == 200 and again.headers[HEADER] == newcomer, health(cluster)
    RESULTS["recovery_serving_s"] = round(time.perf_counter() - killed_at, 1)
    RESULTS["killed_streams_failed"] = sum(r["replica"] == victim for r in results.values())
    RESULTS["other_streams_completed"] = sum(r["replica"] != victim for r in results.values())
