"""The Ray Serve ingress (app/replicas.py) merges the replicas' /metrics, stats snapshots and stats
events into one with these (no Ray here, so the default test suite checks them).
 counters, histograms and gauges of the `whiflash:` families add up over replicas (the
`_created` timestamps take the earliest); process_* families (memory, CPU, start time, fds) are
per process, so they keep one series per replica under a `replica` label. Stats aggregates add up
their counts; acceptance lengths are recomputed from the sums (decided = acceptance length x
rounds, exact up to the 4 decimals each replica rounds to).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

# --- /metrics -------------------------------------------------------------------------------------


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def merge_metrics(texts: dict[str, str]) -> str:
    """One Prometheus exposition from each replica's (replica name -> text): whiflash:* series
    summed, process_* series labelled by replica, plus whiflash:replicas (replicas that answered)."""
    families: dict[str, tuple[str, str]] = {}              # name -> (type, help), first seen order
    sums: dict[str, dict[tuple, float]] = defaultdict(dict)  # family -> (sample name, labels) -> value
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            per_replica = not family.name.startswith("whiflash:")
            earliest = family.name.endswith("_created")
            for s in family.samples:
                labels = {**s.labels, "replica": replica} if per_replica else s.labels
                key = (s.name, tuple(sorted(labels.items())))
                old = sums[family.name].get(key)
                if old is None:
                    sums[family.name][key] = s.value
                else:
                    sums[family.name][key] = min(old, s.value) if earliest else old + s.value
    lines = ["# HELP whiflash:replicas Replicas whose metrics are merged here",
             "# TYPE whiflash:replicas gauge", f"whiflash:replicas {float(len(texts))!r}"]
    for name, (kind, doc) in families.items():
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample, labels), value in sums[name].items():
            lines.append(f"{sample}{_labels(dict(labels))} {_value(value)}")
    return "\n".join(lines) + "\n"


# --- stats page -----------------------------------------------------------------------------------


def _weighted_al(parts: list[tuple[float | None, int]]) -> float | None:
    rounds = sum(r for _, r in parts)
    decided = sum((al or 0.0) * r for al, r in parts)
    return round(decided / rounds, 4) if rounds else None


def merge_aggregates(aggregates: dict[str, dict]) -> dict:
    """app/stats.py's `Aggregates.as_dict()` of each replica, added up (same keys), plus
    `replicas`: each replica's own aggregate."""
    aggs = [a for a in aggregates.values() if a]
    total: dict = {"since": min((a["since"] for a in aggs), default=None)}
    for field in ("requests", "finished", "active", "tokens", "rounds", "switches"):
        total[field] = sum(a.get(field) or 0 for a in aggs)
    by_source: dict[str, int] = defaultdict(int)
    for a in aggs:
        for source, n in (a.get("tokens_by_source") or {}).items():
            by_source[source] += n
    total["tokens_by_source"] = dict(by_source)
    total["acceptance_length"] = _weighted_al([(a.get("acceptance_length"), a.get("rounds") or 0) for a in aggs])
    total["switches_per_100_tokens"] = (round(100 * total["switches"] / total["tokens"], 3)
                                        if total["tokens"] else None)
    drafters: dict[str, dict] = {}
    for name in dict.fromkeys(n for a in aggs for n in (a.get("drafters") or {})):
        parts = [a["drafters"][name] for a in aggs if name in (a.get("drafters") or {})]
        merged = {k: sum(p.get(k) or 0 for p in parts) for k in parts[0] if k != "acceptance_length"}
        merged["acceptance_length"] = _weighted_al([(p.get("acceptance_length"), p.get("rounds") or 0)
                                                    for p in parts])
        drafters[name] = merged
    total["drafters"] = drafters
    total["replicas"] = dict(aggregates)
    return total


def merge_samples(samples: list[dict | None]) -> dict | None:
    """Chart samples taken by the replicas at about the same time: tokens/s add up, acceptance
    length is their mean (the samples carry no round counts to weigh it by)."""
    present = [s for s in samples if s]
    if not present:
        return None
    lengths = [s["acceptance_length"] for s in present if s.get("acceptance_length") is not None]
    return {"time": max(s["time"] for s in present),
            "tokens_per_s": round(sum(s.get("tokens_per_s") or 0 for s in present), 3),
            "acceptance_length": round(sum(lengths) / len(lengths), 4) if lengths else None}


def tag(event: dict, replica: str) -> dict:
    """A replica's event as the merged stream sends it: with the replica that produced it."""
    return {**event, "replica": replica}


def merge_snapshots(snapshots: dict[str, dict]) -> dict:
    """One stats snapshot from each replica's: their events (tagged, in time order), the merged
    aggregate and chart samples (aligned from the newest)."""
    events = sorted((tag(e, name) for name, snap in snapshots.items() for e in snap.get("events", [])),
                    key=lambda e: e.get("time", 0))
    sample_lists = [list(reversed(s.get("samples") or [])) for s in snapshots.values()]
    depth = max((len(s) for s in sample_lists), default=0)
    samples = [merge_samples([s[i] if i < len(s) else None for s in sample_lists]) for i in range(depth)]
    # every replica saw the same request headers, so each names the same viewer (app/viewers.py)
    viewer = next((s["viewer"] for s in snapshots.values() if "viewer" in s), None)
    return {"type": "snapshot", "time": max((s.get("time", 0) for s in snapshots.values()), default=0),
            "events": events, "aggregate": merge_aggregates({n: s.get("aggregate") or {} for n, s in snapshots.items()}),
            "samples": [s for s in reversed(samples) if s is not None],
            **({"viewer": viewer} if viewer is not None else {})}


class SSEParser:
    """Incremental parser of a server-sent-event byte stream into the JSON of its `data:` lines
    (comments such as `: ping` and other fields are skipped)."""

    def __init__(self):
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        events = []
        while b"\n\n" in self._buffer:
            block, self._buffer = self._buffer.split(b"\n\n", 1)
            data = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                try:
                    events.append(json.loads(b"\n".join(data)))
                except ValueError:
                    pass
        return events


def sse(event: dict | str) -> bytes:
    """One SSE event, framed as sse-starlette frames the single server's (`sep="\\n"`)."""
    data = event if isinstance(event, str) else json.dumps(event, default=str, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
