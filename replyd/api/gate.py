"""The API's gate: which Host names it answers, the bearer token, the bind rule and the security headers."""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from replyd import statuspage
from replyd.api.answers import error
from replyd.net import MIN_PUBLIC_TOKEN, is_loopback
from replyd.errors import ConfigError
from replyd.log import get_logger
from replyd.quiet import Quiet

log = get_logger("replyd.api")

WILDCARD_BINDS = ("0.0.0.0", "::", "")
OPENABLE_ROUTES = ("readyz", "metrics")  # what api.open_routes may serve without the token
# The status page's forms post here with the browser's Basic login; the handler checks a CSRF token and Origin.
PAGE_ACTIONS = "/page/actions"
# The page is self-contained: no script, one inline style (allowed by its hash), never framed.
# Referrer: none to other sites. "no-referrer" would also make a browser send "Origin: null" with the
# page's own form posts, and the form handler needs a real Origin to refuse cross-site ones.
SECURITY_HEADERS = [
    (b"content-security-policy", statuspage.CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


def check_bind(host: str, token: str | None) -> None:
    """Refuse (ConfigError) to listen on a non-loopback address without a long enough token."""
    if is_loopback(host):
        return
    if not token:
        raise ConfigError(
            f"api.host: {host!r} is not a loopback address, so the API needs a bearer token: "
            "set api.token_env to the name of an environment variable holding one (or bind 127.0.0.1)"
        )
    if len(token) < MIN_PUBLIC_TOKEN:
        raise ConfigError(
            f"api.token_env: the token is {len(token)} characters; a non-loopback bind ({host!r}) needs at least "
            f"{MIN_PUBLIC_TOKEN} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )


def open_paths(open_routes: Sequence[str]) -> frozenset[str]:
    """The paths served without the token: ``/healthz`` always, the opened probes; ConfigError for any other."""
    unknown = sorted(set(open_routes) - set(OPENABLE_ROUTES))
    if unknown:
        raise ConfigError(f"api.open_routes: {unknown[0]!r} cannot be opened (only {', '.join(OPENABLE_ROUTES)})")
    # /healthz answers anyone (liveness says nothing); these answer without the token when configured so.
    return frozenset({"/healthz", *(f"/{r}" for r in open_routes)})


def host_name(header: str) -> str | None:
    """The host name of a ``Host`` header (lower case, no port, no brackets, no final dot); None if malformed."""
    try:
        name = urlsplit("//" + header.strip()).hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


class HostCheck:
    """Which ``Host`` names the API answers: IP addresses, localhost, the bind address and the configured names.

    DNS rebinding needs a name the attacker controls that resolves to this machine; an IP literal or
    ``localhost`` cannot be one, any other name must be listed.
    """

    def __init__(self, bind: str, names: Sequence[str] = ()) -> None:
        self.names = {n.strip().lower().rstrip(".") for n in (*names, "localhost") if n.strip()}
        if bind.strip("[]") not in WILDCARD_BINDS:
            self.names.add(bind.strip("[]").lower().rstrip("."))

    def allows(self, header: str | None) -> bool:
        """Whether a request with this ``Host`` header may be served."""
        name = host_name(header or "")
        if not name:
            return False
        if name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


class Gate:
    """ASGI middleware in front of every route: the Host check and the token, and the security headers."""

    def __init__(self, app: Any, *, token: str | None, hosts: HostCheck, open_paths: frozenset[str],
                 quiet: Quiet | None = None) -> None:
        self.app = app
        self.token = token
        self.hosts = hosts
        self.open_paths = open_paths
        # A wrong token is anyone's to send: one warning a minute, the next one counting those held back.
        self.quiet = quiet if quiet is not None else Quiet(log)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Refuse or pass one request; add the security headers to whatever answers it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Any) -> None:
            """Add the security headers to the response start."""
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        deny = self.admit(Request(scope))
        if deny is not None:
            await deny(scope, receive, send_secured)
            return
        await self.app(scope, receive, send_secured)

    def admit(self, request: Request) -> Response | None:
        """Return a refusal for a request that may not reach any route, or None when it may."""
        path = request.url.path
        if path == "/healthz":
            return None
        if not self.hosts.allows(request.headers.get("host")):
            self.quiet.warning("replyd.api.bad_host", path=path, host=(request.headers.get("host") or "")[:100])
            return error(400, "bad_host", "the Host header names neither this server's address nor one of "
                         "api.hosts (add the name you use there)", field="Host")
        # A webhook is signed by the platform with the bot's secret (checked by the receiver), not by our token.
        if self.token is None or path in self.open_paths or path.startswith("/v1/hooks/"):
            return None
        # A write never takes Basic, but for the page's forms (their handler checks a CSRF token and Origin).
        return self._auth(request, write=request.method not in ("GET", "HEAD") and path != PAGE_ACTIONS)

    def _auth(self, request: Request, *, write: bool) -> Response | None:
        """Check the configured token; return a refusal, or None when the request may proceed."""
        assert self.token is not None
        header = request.headers.get("authorization", "")

        def refuse(detail: str) -> Response:
            """A 401 with one challenge per header (browsers read only the first of a combined one)."""
            resp = error(401, "unauthorized", detail, headers={"WWW-Authenticate": 'Bearer realm="replyd"'})
            if not write:
                resp.headers.append("WWW-Authenticate", 'Basic realm="replyd", charset="UTF-8"')
            return resp

        if not header:
            return refuse("missing credentials: send Authorization: Bearer <token>")
        scheme, _, cred = header.strip().partition(" ")
        scheme, cred = scheme.lower(), cred.strip()
        if scheme == "bearer":
            given = cred
        elif scheme == "basic" and not write:
            try:
                given = base64.b64decode(cred, validate=True).decode("utf-8").partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return refuse("malformed Basic credentials")
        else:
            return refuse("unsupported authorization scheme: use Bearer")
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.token.encode()):
            self.quiet.warning("replyd.api.unauthorized", path=request.url.path, method=request.method)
            return refuse("invalid token")
        return None
