"""Routing for the Ray Serve replicas (app/replicas.py), without Ray: the affinity key of a request,
the replica order for a key, the request a replica is handed, and the routing state the ingress
shares with its request router.

Affinity: an agent loop resends the same opening (tools, system prompt, first user message) on
every turn, and the prefix cache of the replica that served the first turn holds its K/V. The key
is a hash of exactly that opening plus the Authorization header, so one conversation's turns go to
one replica while different tenants with the same system prompt spread over the replicas (the
prefix cache is partitioned by API key anyway, so they could never share entries).

Why a module of its own: Ray Serve ships a custom request router to the process that routes (here
the ingress) by pickling the router's module *by value*, so state kept in app/replicas.py would be
a copy inside the router. This module is imported by reference, so the router and the ingress see
the same `known` and `routed`, and `Forwarded` is the same class on both sides.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

REPLICA_HEADER = "x-whiflash-replica"
COMPLETIONS_LEAD_CHARS = 512  # legacy completions: the part of the prompt an agent resends unchanged
TARGET = "replica:"           # a routing key that names one replica (the ingress's fan-out)

# Filled by the request router, read by the ingress (same process): the replicas routed to
# (name -> slot), and which replica each forwarded request went to, so that an error before the
# replica answered can still name it (bounded).
known: dict[str, str] = {}
routed: OrderedDict[str, str] = OrderedDict()
ROUTED_MAX = 10_000


def remember_route(request_id: str, replica: str) -> None:
    routed[request_id] = replica
    while len(routed) > ROUTED_MAX:
        routed.popitem(last=False)


# --- affinity -------------------------------------------------------------------------------------


def affinity_key(path: str, body: bytes, authorization: str | None) -> str | None:
    """The routing key of a generation request: a hash of the tenant and the conversation's opening
    (tools, the messages up to and including the first user message; for legacy completions the
    first 512 characters of the first prompt). None when the body has none of these (a bad request:
    any replica answers it with the same 4xx)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        lead = []
        for message in messages:
            lead.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        opening = [data.get("tools"), lead]
    elif path.endswith("/completions"):
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch of prompts: the first one's replica serves the batch
        if isinstance(prompt, str):
            opening = prompt[:COMPLETIONS_LEAD_CHARS]
        elif isinstance(prompt, list):
            opening = prompt[:COMPLETIONS_LEAD_CHARS // 4]   # token ids: about 4 characters each
        else:
            return None
    else:
        return None
    material = json.dumps([authorization or "", opening], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def rendezvous_order(key: str, members: list[str]) -> list[str]:
    """`members` by preference for `key` (highest random weight hashing): the first is the key's
    home; when it is gone, only its keys move (each to its own second choice), and they come back
    when a member of the same name returns."""
    def weight(member: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{key}/{member}".encode(), digest_size=8).digest(), "big")
    return sorted(members, key=weight, reverse=True)



# --- what travels between the ingress and a replica ----------------------------------------------


@dataclass
class Forwarded:
    """An HTTP request as the ingress received it, for a replica's app to serve."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    server: tuple[str, int] | None
    scheme: str = "http"
    http_version: str = "1.1"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def of(cls, scope: dict, body: bytes) -> Forwarded:
        """From the ingress's ASGI scope: the client address and headers as received, so the
        replica's access rules (API key, the stats page's loopback rule) see the real client."""
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), list(scope["headers"]), body,
                   tuple(scope["client"]) if scope.get("client") else None,
                   tuple(scope["server"]) if scope.get("server") else None, scope.get("scheme", "http"),
                   scope.get("http_version", "1.1"))

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": self.http_version,
                "method": self.method, "scheme": self.scheme, "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": self.headers,
                "client": self.client, "server": self.server}


@dataclass
class Start:
    """The first item of a replica's answer: status and headers."""
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: str) -> str | None:
        return next((v.decode() for k, v in self.headers if k.decode().lower() == name), None)
