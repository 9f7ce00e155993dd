"""The status page's action forms: their CSRF tokens, the Origin check and the signed result line.

A browser sends a cached Basic login with any request to the page's origin, even one a foreign site
starts. SameSite does not apply: it governs cookies, and Basic credentials are not cookies. So a form
POST must carry a token only a page we served could hold. Each form's token is an HMAC, keyed by a key
derived from the API token, over the action, the bot, the parent id and the issue time. It expires
after ``FORM_MAX_AGE_S``. The Origin header, which browsers send on every POST, must name this host.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from replyd.api.gate import PAGE_ACTIONS, host_name

__all__ = ["ACTIONS", "FORM_MAX_AGE_S", "PAGE_ACTIONS", "form_token", "form_token_ok", "origin_problem", "result_ok",
           "result_sig"]
ACTIONS = ("rearm", "confirm")
FORM_MAX_AGE_S = 3600  # a form older than this is refused: reload the page
RESULT_SHOWN_S = 120  # how long the page repeats an action's result line after the redirect
MAX_FORM_BYTES = 8192


def _key(token: str) -> bytes:
    """The forms' HMAC key: derived from the API token, so the token itself never signs anything shown."""
    return hmac.new(token.encode(), b"replyd.page.form.v1", hashlib.sha256).digest()


def _mac(token: str, *parts: str) -> str:
    msg = "\x1f".join(parts).encode("utf-8", "surrogateescape")
    return hmac.new(_key(token), msg, hashlib.sha256).hexdigest()


def form_token(token: str, action: str, bot: str, parent_id: str, now: float) -> str:
    """The CSRF token of one form: ``<issued>.<hmac>``, good for this action on this row only."""
    issued = str(int(now))
    return f"{issued}.{_mac(token, 'form', issued, action, bot, parent_id)}"


def form_token_ok(token: str, given: str, action: str, bot: str, parent_id: str, now: float) -> bool:
    """Whether ``given`` is a token we issued for this form within ``FORM_MAX_AGE_S``."""
    issued, _, mac = given.partition(".")
    if not issued.isdigit() or len(issued) > 12 or not mac:
        return False
    if not -60 <= now - int(issued) <= FORM_MAX_AGE_S:
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, "form", issued, action, bot, parent_id).encode())


def result_sig(token: str, at: int, text: str) -> str:
    """The signature of a result line the redirect carries, so a crafted link cannot show a false one."""
    return _mac(token, "result", str(at), text)


def result_ok(token: str, text: str, at: str, sig: str, now: float) -> bool:
    """Whether a result line is one we signed, and recent enough to show."""
    if not at.isdigit() or len(at) > 12 or not -60 <= now - int(at) <= RESULT_SHOWN_S:
        return False
    return hmac.compare_digest(sig.encode("utf-8", "surrogateescape"), result_sig(token, int(at), text).encode())


def origin_problem(origin: str | None, host: str | None, *, basic: bool) -> str | None:
    """Why the Origin header refuses this POST (None: it passes).

    A browser sends Origin on every POST; a Basic login comes only from a browser, so there it is required.
    It must name the Host the request was sent to (the gate already checked that Host).
    """
    if origin is None:
        return "no Origin header: a browser's form always sends one" if basic else None
    if origin == "null":
        return "Origin is null (a sandboxed or redirected form): post from the status page"
    try:
        parts = urlsplit(origin)
        o_host, o_port = parts.hostname, parts.port
    except ValueError:
        return "malformed Origin header"
    want = urlsplit("//" + (host or ""))
    try:
        h_port = want.port
    except ValueError:
        return "malformed Host header"
    default = {"http": 80, "https": 443}.get(parts.scheme)
    if (o_host or "").rstrip(".") != (host_name(host or "") or "") or (o_port or default) != (h_port or default):
        return "Origin names another site: post from the status page"
    return None
