"""Who is asking: the identity behind an API request and behind a viewer of the stats feed.

The stats feed (app/stats.py) carries a request's generated text only to the viewer who made that
request, or to the admin; everyone else sees its counts. Identities:

  keys on (--api-key; several, comma-separated, are separate tenants, as in llama.cpp):
      the key presented. One key is one tenant: whoever holds it sees that key's requests.
  keys off:
      the `whiflash_viewer` cookie, a random HttpOnly token that the chat and stats pages set, and
      that the browser then sends with the pages' own requests.
  the admin (--admin-key): presented like an API key (`Authorization: Bearer`, or the pages'
      `whiflash_key` cookie), sees every request's text; it is accepted as an API key too.

A request with no identity (keys off, no cookie: a script) is nobody's: its text reaches the admin
only. Identities are salted hashes and stay on the server: events carry them as `owner`, and the
feed removes it before anything is sent. Keys are read from headers and cookies, never from the
query string (URLs land in access logs).
"""
from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from fastapi import Request, Response

from .settings import Settings

VIEWER_COOKIE = "whiflash_viewer"
KEY_COOKIE = "whiflash_key"          # set by the pages' key form (EventSource cannot send headers)
VIEWER_COOKIE_DAYS = 365
# what `new_viewer_token` makes; other values are not identities (a short or guessable value chosen
# by hand could be shared by accident)
_VIEWER_TOKEN = re.compile(r"[A-Za-z0-9_-]{32,128}")


@dataclass(frozen=True)
class Viewer:
    id: str | None          # None: nobody in particular (sees no request's text unless admin)
    admin: bool = False

    def may_read(self, owner: str | None) -> bool:
        """Whether this viewer may see the text of a request made by `owner`."""
        return self.admin or (self.id is not None and owner == self.id)


def _identity(kind: str, secret: str) -> str:
    return hashlib.sha256(f"whiflash {kind}\0{secret}".encode()).hexdigest()


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def key_matches(offered: str | None, keys: list[str]) -> bool:
    """Whether `offered` is one of `keys`, each compared in constant time."""
    if not offered:
        return False
    return any(secrets.compare_digest(offered.encode(), k.encode()) for k in keys)


def viewer_cookie(request: Request) -> str | None:
    value = request.cookies.get(VIEWER_COOKIE)
    return value if value and _VIEWER_TOKEN.fullmatch(value) else None


def request_owner(request: Request, settings: Settings) -> str | None:
    """The identity an API request is made under. The API's key check has already run, so with keys
    on the bearer token is a valid key."""
    if settings.api_keys:
        key = bearer_token(request)
        return _identity("key", key) if key else None
    cookie = viewer_cookie(request)
    return _identity("viewer", cookie) if cookie else None


def offered_key(request: Request) -> str | None:
    """The key a stats viewer presents: its Authorization header, else the pages' key cookie."""
    return bearer_token(request) or request.cookies.get(KEY_COOKIE) or None


def is_admin(request: Request, settings: Settings) -> bool:
    return settings.admin_key is not None and key_matches(offered_key(request), [settings.admin_key])


def stats_viewer(request: Request, settings: Settings) -> Viewer:
    """Who reads the feed; who may read it at all is app/stats.py's `stats_access`."""
    if settings.api_keys:
        key = offered_key(request)
        return Viewer(_identity("key", key) if key else None, is_admin(request, settings))
    cookie = viewer_cookie(request)
    return Viewer(_identity("viewer", cookie) if cookie else None, is_admin(request, settings))


def new_viewer_token() -> str:
    return secrets.token_urlsafe(32)


def ensure_viewer_cookie(request: Request, response: Response) -> None:
    """Give a page's browser its viewer identity, once (an existing valid cookie is kept). HttpOnly:
    page scripts never see it; SameSite=Strict: other sites' requests do not carry it."""
    if viewer_cookie(request) is None:
        response.set_cookie(VIEWER_COOKIE, new_viewer_token(), max_age=VIEWER_COOKIE_DAYS * 86400, path="/",
                            httponly=True, samesite="strict", secure=request.url.scheme == "https")
