"""The sidecar HTTP API: agents in any language post through ``Guard.post``; operators look and steer.

Endpoints (the OpenAPI document at ``/openapi.json`` is the contract):

=======================================================  ==========================================
``POST /v1/replies``                                      resolve the parent, post at most once
``GET  /v1/replies/{platform}/{parent_id}``               a key's row and history
``POST /v1/replies/{platform}/{parent_id}/rearm``         rejected/gave_up/declined -> released
``GET  /v1/status``                                       counts, oldest open rows, recent events
``GET  /healthz`` ``/readyz`` ``/metrics`` ``/``          liveness, readiness, Prometheus, status page
=======================================================  ==========================================

Auth: with a token configured, every route but ``/healthz`` needs
``Authorization: Bearer <token>``; ``/readyz`` and ``/metrics`` can be opened
for probes and scrapers by ``api.open_routes``. Writes always need the token
(no configured token: writes are refused with 403, reads are open, and only a
loopback bind is allowed). A browser may send the token as a Basic password for
reads (the page asks for it), never for writes, so a cached Basic login cannot
be used for cross-site writes; a write must also be ``application/json``.
A non-loopback bind needs a token of at least ``MIN_PUBLIC_TOKEN`` characters.

Host: a request whose ``Host`` names neither an IP address, ``localhost``,
the bind address nor one of ``api.hosts`` is refused with 400 before anything
else, so a web page cannot read the API through DNS rebinding. Every answer
carries a Content-Security-Policy, ``X-Frame-Options: DENY`` and
``X-Content-Type-Options: nosniff``.

Nothing here posts by itself: every reply goes through ``library.submit``,
which resolves the parent through the adapter and calls ``Guard.post``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from replyd import library, metrics, statuspage
from replyd import store as st
from replyd.errors import ConfigError, ContentionError, PlatformError, RateLimited, Rejected, ReplydError, StoreError
from replyd.guard import Guard, Outcome, Status
from replyd.liveness import Liveness
from replyd.platforms._http import is_loopback
from replyd.store import Reply, Store

if TYPE_CHECKING:
    from replyd.hooks import Receiver

log = structlog.get_logger("replyd.api")

NO_NUL = r"^[^\u0000]*$"  # PostgreSQL text cannot hold NUL; refuse it at the door, not as a 503
MAX_PARENT_ID = 1024  # the replies.parent_id column
NOT_SENT_RETRY_S = 5  # Retry-After when the platform refused before acting without saying when


class ReplyIn(BaseModel):
    """The body of ``POST /v1/replies``."""

    model_config = ConfigDict(extra="forbid", strict=True, title="ReplyRequest")

    platform: str = Field(min_length=1, max_length=255, pattern=NO_NUL,
                          description="A configured bot's name, or its platform instance (the first part of the key).")
    parent_id: str = Field(min_length=1, max_length=MAX_PARENT_ID, pattern=NO_NUL,
                           description="The parent's id as the platform serves it, or a URL the adapter resolves.")
    text: str = Field(min_length=1, max_length=10_000, pattern=r"\S",
                      description="The reply. Never part of the key and never compared.")
    path: str = Field("api", min_length=1, max_length=64, pattern=NO_NUL,
                      description="The discovery path recorded on the row (default: api).")


MIN_PUBLIC_TOKEN = 32  # characters: a token guarding a non-loopback bind must not be guessable
WILDCARD_BINDS = ("0.0.0.0", "::", "")
OPENABLE_ROUTES = ("readyz", "metrics")  # what api.open_routes may serve without the token
# The page is self-contained: no script, one inline style (allowed by its hash), never framed.
SECURITY_HEADERS = [
    (b"content-security-policy", statuspage.CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
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


# -- responses -----------------------------------------------------------------------------------

_OUTCOME_CODES = {
    Status.POSTED: 201,
    Status.ALREADY_ANSWERED: 200,
    Status.IN_FLIGHT: 202,
    Status.UNCERTAIN: 202,
    Status.REJECTED: 409,
    Status.GAVE_UP: 409,
    Status.DECLINED: 409,
    Status.SKIPPED: 409,
    Status.DRY_RUN: 202,  # accepted and logged; nothing was sent (dry run)
}


def _error(code: int, error: str, detail: str, *, field: str | None = None,
           headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail, "field": field, **extra}, status_code=code,
                        headers=dict(headers or {}))


def _retry_after(seconds: float | None) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds or NOT_SENT_RETRY_S)))}


def outcome_response(out: Outcome, bot: str) -> JSONResponse:
    """Map a Guard outcome to its HTTP status and body."""
    body = {
        "status": out.status.value,
        "bot": bot,
        "platform": out.key.platform,
        "sender_id": out.key.sender_id,
        "parent_id": out.key.parent_id,
        "state": out.state,
        "attempt": out.attempt,
        "reply_id": out.reply_id,
        "detail": out.detail,
        "retry_after_s": out.retry_after_s,
    }
    if out.status is Status.NOT_SENT:
        # Backing off or rate-limited has a time to wait; anything else is "unavailable, try again".
        code = 429 if out.retry_after_s else 503
        return JSONResponse(body, status_code=code, headers=_retry_after(out.retry_after_s))
    return JSONResponse(body, status_code=_OUTCOME_CODES[out.status])


def row_dict(row: Reply) -> dict[str, Any]:
    """A row as JSON, without the parent snapshot (served separately as ``parent``)."""
    return row.model_dump(exclude={"snapshot"})


def _event_json(ev: Mapping[str, Any]) -> dict[str, Any]:
    return {k: ev.get(k) for k in ("id", "at", "platform", "sender_id", "parent_id", "kind", "state", "attempt",
                                   "owner", "detail", "path")}


# -- the app ---------------------------------------------------------------------------------------


class Api:
    """The ASGI app over one store and the daemon's guards (a live mapping: bots log in after start)."""

    def __init__(
        self,
        store: Store,
        guards: Mapping[str, Guard],
        *,
        expected: Sequence[str] | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        hosts: Sequence[str] = (),
        open_routes: Sequence[str] = (),
        refresh_s: int = 5,
        max_body_bytes: int = 65_536,
        liveness: Liveness | None = None,
        hooks: Receiver | None = None,
    ) -> None:
        self.store = store
        self.liveness = liveness
        self.hooks = hooks
        self.guards = guards
        self.expected = list(expected) if expected is not None else None
        self.token = token or None
        self.hosts = HostCheck(host, hosts)
        unknown = sorted(set(open_routes) - set(OPENABLE_ROUTES))
        if unknown:
            raise ConfigError(f"api.open_routes: {unknown[0]!r} cannot be opened (only {', '.join(OPENABLE_ROUTES)})")
        # /healthz answers anyone (liveness says nothing); these answer without the token when configured so.
        self.open_paths = frozenset({"/healthz", *(f"/{r}" for r in open_routes)})
        self.refresh_s = refresh_s
        self.max_body_bytes = max_body_bytes
        self.registry = metrics.registry(store, liveness)
        self._openapi = openapi_document(auth=self.token is not None, open_routes=open_routes)
        routes = [
            Route("/", self.page, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/v1/status", self.status, methods=["GET"]),
            Route("/v1/replies", self.post_reply, methods=["POST"]),
            Route("/v1/hooks/{bot}", self.hook, methods=["POST"]),
            # The rearm route first: a parent id may contain "/" (Bluesky URIs), so it is a path match.
            Route("/v1/replies/{platform}/{parent_id:path}/rearm", self.rearm, methods=["POST"]),
            Route("/v1/replies/{platform}/{parent_id:path}", self.get_reply, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, middleware=[Middleware(_Gate, api=self)],
                             exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve one ASGI request."""
        await self.app(scope, receive, send)

    # -- the gate: Host, then the token ------------------------------------------------------------

    def admit(self, request: Request) -> Response | None:
        """Return a refusal for a request that may not reach any route, or None when it may."""
        path = request.url.path
        if path == "/healthz":
            return None
        if not self.hosts.allows(request.headers.get("host")):
            log.warning("replyd.api.bad_host", path=path, host=(request.headers.get("host") or "")[:100])
            return _error(400, "bad_host", "the Host header names neither this server's address nor one of "
                          "api.hosts (add the name you use there)", field="Host")
        # A webhook is signed by the platform with the bot's secret (checked by the receiver), not by our token.
        if self.token is None or path in self.open_paths or path.startswith("/v1/hooks/"):
            return None
        return self._auth(request, write=request.method not in ("GET", "HEAD"))

    def _auth(self, request: Request, *, write: bool) -> Response | None:
        """Check the configured token; return a refusal, or None when the request may proceed."""
        assert self.token is not None
        header = request.headers.get("authorization", "")

        def refuse(detail: str) -> Response:
            """A 401 with one challenge per header (browsers read only the first of a combined one)."""
            resp = _error(401, "unauthorized", detail, headers={"WWW-Authenticate": 'Bearer realm="replyd"'})
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
            log.warning("replyd.api.unauthorized", path=request.url.path, method=request.method)
            return refuse("invalid token")
        return None

    def _writes_disabled(self) -> Response | None:
        """A 403 when no token is configured (writes need one), else None."""
        if self.token is not None:
            return None
        return _error(403, "writes_disabled",
                      "writes need an API token and none is configured: set api.token_env to the name of an "
                      "environment variable holding one, export it, and restart")

    # -- helpers ---------------------------------------------------------------------------------

    def _bot(self, ref: str) -> tuple[str, Guard] | Response:
        """Find a bot by name, else by platform instance (unique); a refusal when neither."""
        guard = self.guards.get(ref)
        if guard is not None:
            return ref, guard
        hits = [(n, g) for n, g in list(self.guards.items()) if g.platform.instance == ref]
        if len(hits) == 1:
            return hits[0]
        if hits:
            return _error(409, "ambiguous_platform",
                          f"{len(hits)} bots post on this platform instance: name the bot instead", field="platform")
        known = ", ".join(sorted(self.guards)) or "none logged in yet"
        return _error(404, "unknown_platform", f"no bot or platform instance named {ref!r} (bots: {known})",
                      field="platform")

    async def _body(self, request: Request, limit: int | None = None) -> bytes | Response:
        limit = self.max_body_bytes if limit is None else limit
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return _error(413, "body_too_large", f"body larger than {limit} bytes", field="body")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return _error(413, "body_too_large", f"body larger than {limit} bytes", field="body")
                chunks.append(chunk)
        except ClientDisconnect:
            # The client left mid-body: nothing was claimed or sent, and nobody reads this answer.
            return _error(400, "client_disconnected", "the client closed the connection before the body ended",
                          field="body")
        return b"".join(chunks)

    # -- writes ----------------------------------------------------------------------------------

    async def post_reply(self, request: Request) -> Response:
        """POST /v1/replies: resolve the parent and post through Guard.post, at most once."""
        if (deny := self._writes_disabled()) is not None:
            return deny
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return _error(415, "unsupported_media_type", "send the body as application/json", field="body")
        raw = await self._body(request)
        if isinstance(raw, Response):
            return raw
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, "invalid_json", f"body: not valid JSON ({exc})", field="body")
        except RecursionError:
            return _error(400, "invalid_json", "body: JSON nested too deeply", field="body")
        if not isinstance(data, dict):
            return _error(422, "invalid_body", "body: must be a JSON object with platform, parent_id and text",
                          field="body")
        try:
            req = ReplyIn.model_validate(data)
        except ValidationError as exc:
            errs = exc.errors(include_url=False, include_input=False)
            first = ".".join(str(x) for x in errs[0]["loc"]) or "body"
            detail = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errs)
            return _error(422, "invalid_body", detail, field=first)
        found = self._bot(req.platform)
        if isinstance(found, Response):
            return found
        name, guard = found
        try:
            out = await run_in_threadpool(library.submit, guard, req.parent_id, req.text, path=req.path)
        except RateLimited as exc:
            return _error(429, "platform_rate_limited", f"resolving the parent: {exc.detail}; nothing sent",
                          field="parent_id", headers=_retry_after(exc.retry_after_s))
        except Rejected as exc:
            return _error(404, "unknown_parent", f"the platform refused the parent: {exc.detail}; nothing sent",
                          field="parent_id")
        except PlatformError as exc:
            return _error(502, "resolve_failed", f"could not resolve the parent: {exc.detail or type(exc).__name__}; "
                          "nothing sent", field="parent_id")
        except ContentionError as exc:
            return _error(503, "store_busy", f"{exc}; nothing sent", headers=_retry_after(1))
        except StoreError as exc:
            return _error(503, "store_unavailable", f"{exc}; nothing sent", headers=_retry_after(NOT_SENT_RETRY_S))
        log.info("replyd.api.replied", bot=name, parent_id=out.key.parent_id, status=out.status.value)
        return outcome_response(out, name)

    async def hook(self, request: Request) -> Response:
        """POST /v1/hooks/{bot}: a signed webhook delivery; parents are offered in the background."""
        if self.hooks is None:
            return _error(404, "unknown_hook", "no webhooks are configured (bots.push)", field="bot")
        bot = request.path_params["bot"]
        body = await self._body(request, self.hooks.max_body_bytes)
        if isinstance(body, Response):
            return body
        answer = self.hooks.receive(bot, request.headers, body)
        return JSONResponse(answer.body, status_code=answer.status)

    async def rearm(self, request: Request) -> Response:
        """POST /v1/replies/{platform}/{parent_id}/rearm: an operator sends a terminal key back."""
        if (deny := self._writes_disabled()) is not None:
            return deny
        found = self._bot(request.path_params["platform"])
        if isinstance(found, Response):
            return found
        name, guard = found
        parent_id = request.path_params["parent_id"]
        if not _storable(parent_id):
            return _error(404, "no_row", "no row for this parent", field="parent_id")
        key = guard.key(parent_id)
        try:
            res = await run_in_threadpool(library.rearm, self.store, key, by="api", owner=guard.owner)
        except StoreError as exc:
            return _error(503, "store_unavailable", str(exc), headers=_retry_after(NOT_SENT_RETRY_S))
        except ContentionError as exc:
            return _error(503, "store_busy", str(exc), headers=_retry_after(1))
        if res.row is None:
            return _error(404, "no_row", f"no row for parent {parent_id!r} of bot {name!r} (ids are exact)",
                          field="parent_id")
        if not res.rearmed:
            return _error(409, "not_rearmable",
                          f"the key is {res.previous}; only {', '.join(library.REARMABLE)} can be rearmed",
                          state=res.row.state)
        log.info("replyd.api.rearmed", bot=name, parent_id=parent_id, previous=res.previous)
        return JSONResponse({"rearmed": True, "bot": name, "previous_state": res.previous, "row": row_dict(res.row)})

    # -- reads -----------------------------------------------------------------------------------

    async def get_reply(self, request: Request) -> Response:
        """GET /v1/replies/{platform}/{parent_id}: the key's row and its events in order."""
        found = self._bot(request.path_params["platform"])
        if isinstance(found, Response):
            return found
        name, guard = found
        parent_id = request.path_params["parent_id"]
        if not _storable(parent_id):
            return _error(404, "no_row", "no row for this parent", field="parent_id")
        key = guard.key(parent_id)

        def read() -> tuple[Reply | None, list[st.Event]]:
            """Read the row, and its history when there is one."""
            row = self.store.get(key)
            return row, (self.store.history(key) if row else [])

        try:
            row, history = await run_in_threadpool(read)
        except ReplydError as exc:
            return _error(503, "store_unavailable", str(exc), headers=_retry_after(NOT_SENT_RETRY_S))
        if row is None:
            return _error(404, "no_row", f"no row for parent {parent_id!r} of bot {name!r} (ids are exact)",
                          field="parent_id")
        try:
            parent = json.loads(row.snapshot or "{}")
        except (ValueError, RecursionError):
            parent = {}
        return JSONResponse({
            "bot": name, "platform": key.platform, "sender_id": key.sender_id, "parent_id": key.parent_id,
            "row": row_dict(row), "parent": parent if isinstance(parent, dict) else {},
            "events": [_event_json({**e.model_dump(), "detail": _detail(e.detail), "path": row.path}) for e in history],
        })

    def summary(self) -> dict[str, Any]:
        """Collect what the status page and ``/v1/status`` show (blocking: run in a thread)."""
        now = self.store.clock.now()
        store_info: dict[str, Any] = {"url": self.store.url, "up": True, "error": None}
        counts: list[dict[str, Any]] = []
        oldest: list[dict[str, Any]] = []
        recent: list[dict[str, Any]] = []
        try:
            raw = self.store.counts()
            counts = [{"platform": p, "state": s, "rows": n} for (p, s), n in sorted(raw.items())]
            oldest = [{"platform": r.platform, "sender_id": r.sender_id, "parent_id": r.parent_id,
                       "opened_at": r.opened_at, "age_s": round(max(0.0, now - (r.opened_at or r.created_at)), 1),
                       "attempt": r.attempt} for r in self.store.oldest_open(10)]
            recent = [_event_json(e) for e in library.events(self.store, limit=30)]
        except ReplydError as exc:
            store_info.update(up=False, error=str(exc))
        try:
            live = self.liveness.snapshot(self.store if store_info["up"] else None) if self.liveness else {}
        except ReplydError:
            live = self.liveness.snapshot() if self.liveness else {}
        return {
            "generated_at": now,
            "store": store_info,
            "counts": counts,
            "open_rows": sum(c["rows"] for c in counts if c["state"] == st.OPEN),
            "oldest_open_age_s": oldest[0]["age_s"] if oldest else 0.0,
            "oldest_open": oldest,
            "recent_events": recent,
            "bots": self._bots_state(),
            "liveness": live,
        }

    def _bots_state(self) -> dict[str, dict[str, Any]]:
        guards = dict(self.guards)
        names = self.expected if self.expected is not None else sorted(guards)
        out: dict[str, dict[str, Any]] = {}
        for n in list(names) + [g for g in guards if g not in names]:
            g = guards.get(n)
            out[n] = {"ready": g is not None and g.claiming,
                      "platform": g.platform.instance if g else None,
                      "sender_id": g.identity.sender_id if g else None}
        return out

    async def status(self, request: Request) -> Response:
        """GET /v1/status: counts, open rows, recent events, bots."""
        data = await run_in_threadpool(self.summary)
        return JSONResponse(data, status_code=200 if data["store"]["up"] else 503)

    async def page(self, request: Request) -> Response:
        """GET /: the read-only status page."""
        data = await run_in_threadpool(self.summary)
        return HTMLResponse(statuspage.render(data, refresh_s=self.refresh_s),
                            status_code=200 if data["store"]["up"] else 503)

    async def healthz(self, request: Request) -> Response:
        """GET /healthz: the process serves requests."""
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """GET /readyz: the store answers, every configured bot is logged in (and still claiming) and no path is stale."""

        def check() -> dict[str, Any]:
            """Ask the store one real query and look at every expected bot."""
            store_info: dict[str, Any] = {"up": True, "error": None}
            try:
                self.store.ping()
            except ReplydError as exc:
                store_info = {"up": False, "error": str(exc)}
            bots = {n: b["ready"] for n, b in self._bots_state().items()}
            reasons = [] if store_info["up"] else [f"store: {store_info['error']}"]
            reasons += [f"bot {n}: not logged in" for n, ok in bots.items() if not ok]
            reasons += self.liveness.problems() if self.liveness else []
            return {"ready": not reasons, "reasons": reasons, "store": store_info, "bots": bots}

        data = await run_in_threadpool(check)
        return JSONResponse(data, status_code=200 if data["ready"] else 503)

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: Prometheus text exposition."""
        body = await run_in_threadpool(generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json: this API's contract."""
        return JSONResponse(self._openapi)


def _storable(parent_id: str) -> bool:
    """Whether an id could be stored at all (a NUL or an over-long id has no row by construction)."""
    return "\x00" not in parent_id and len(parent_id) <= MAX_PARENT_ID


def _detail(raw: str) -> Any:
    try:
        return json.loads(raw or "{}")
    except (ValueError, RecursionError):
        return raw


class _Gate:
    """ASGI middleware in front of every route: the Host check and the token, and the security headers."""

    def __init__(self, app: Any, api: Api) -> None:
        self.app = app
        self.api = api

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

        deny = self.api.admit(Request(scope))
        if deny is not None:
            await deny(scope, receive, send_secured)
            return
        await self.app(scope, receive, send_secured)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error(exc.status_code, code, str(exc.detail), headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("replyd.api.failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}"[:300])
    return _error(500, "internal_error", "internal error; see the daemon's log")


# -- the OpenAPI document --------------------------------------------------------------------------


def _nullable(t: str) -> dict[str, Any]:
    return {"type": [t, "null"]}


_ROW = {
    "type": "object",
    "required": ["platform", "sender_id", "parent_id", "state", "attempt", "created_at", "updated_at"],
    "properties": {
        "platform": {"type": "string"}, "sender_id": {"type": "string"}, "parent_id": {"type": "string"},
        "state": {"type": "string", "enum": list(st.STATES)}, "attempt": {"type": "integer"},
        "created_at": {"type": "number"}, "updated_at": {"type": "number"},
        "opened_at": _nullable("number"), "deadline_at": _nullable("number"), "closed_at": _nullable("number"),
        "not_before": _nullable("number"), "reply_id": _nullable("string"), "provider_key": _nullable("string"),
        "text_hash": _nullable("string"), "path": {"type": "string"}, "owner": _nullable("string"),
        "lease_owner": _nullable("string"), "lease_until": _nullable("number"), "error": _nullable("string"),
    },
}
_EVENT = {
    "type": "object",
    "required": ["id", "at", "platform", "sender_id", "parent_id", "kind"],
    "properties": {
        "id": {"type": "integer"}, "at": {"type": "number"}, "platform": {"type": "string"},
        "sender_id": {"type": "string"}, "parent_id": {"type": "string"}, "kind": {"type": "string"},
        "state": _nullable("string"), "attempt": _nullable("integer"), "owner": _nullable("string"),
        "detail": {"description": "What the transition recorded (usually an object)."},
        "path": {**_nullable("string"), "description": "The discovery path stored on the key's row."},
    },
}
_ERROR = {
    "type": "object",
    "required": ["error", "detail", "field"],
    "properties": {
        "error": {"type": "string", "description": "A stable code, e.g. invalid_body, unknown_parent."},
        "detail": {"type": "string", "description": "What went wrong, for people."},
        "field": {**_nullable("string"), "description": "The request field at fault, when one is."},
    },
}
_OUTCOME = {
    "type": "object",
    "required": ["status", "bot", "platform", "sender_id", "parent_id", "state", "attempt", "reply_id", "detail",
                 "retry_after_s"],
    "properties": {
        "status": {"type": "string", "enum": [s.value for s in Status]},
        "bot": {"type": "string"},
        "platform": {"type": "string", "description": "The platform instance (first part of the key)."},
        "sender_id": {"type": "string"},
        "parent_id": {"type": "string", "description": "The parent id as served (after resolving)."},
        "state": _nullable("string"), "attempt": {"type": "integer"}, "reply_id": _nullable("string"),
        "detail": {"type": "string"}, "retry_after_s": _nullable("number"),
    },
}
_STATUS = {
    "type": "object",
    "required": ["generated_at", "store", "counts", "open_rows", "oldest_open_age_s", "oldest_open",
                 "recent_events", "bots"],
    "properties": {
        "generated_at": {"type": "number"},
        "store": {"type": "object", "required": ["url", "up", "error"],
                  "properties": {"url": {"type": "string"}, "up": {"type": "boolean"}, "error": _nullable("string")}},
        "counts": {"type": "array", "items": {"type": "object", "required": ["platform", "state", "rows"],
                   "properties": {"platform": {"type": "string"}, "state": {"type": "string"},
                                  "rows": {"type": "integer"}}}},
        "open_rows": {"type": "integer"},
        "oldest_open_age_s": {"type": "number"},
        "oldest_open": {"type": "array", "items": {"type": "object",
                        "required": ["platform", "sender_id", "parent_id", "opened_at", "age_s", "attempt"],
                        "properties": {"platform": {"type": "string"}, "sender_id": {"type": "string"},
                                       "parent_id": {"type": "string"}, "opened_at": _nullable("number"),
                                       "age_s": {"type": "number"}, "attempt": {"type": "integer"}}}},
        "recent_events": {"type": "array", "items": {"$ref": "#/components/schemas/Event"}},
        "bots": {"type": "object", "additionalProperties": {"$ref": "#/components/schemas/BotState"}},
        "liveness": {"type": "object", "additionalProperties": {"$ref": "#/components/schemas/BotLiveness"}},
    },
}
_PATH_HEALTH = {
    "type": "object",
    "required": ["interval_s", "last_ok", "age_s", "failures", "last_error", "last_error_at", "runs", "stale_after_s",
                 "stale", "words"],
    "properties": {
        "interval_s": {"type": "number"}, "last_ok": _nullable("number"), "age_s": {"type": "number"},
        "failures": {"type": "integer"}, "last_error": _nullable("string"), "last_error_at": _nullable("number"),
        "runs": {"type": "integer"}, "stale_after_s": {"type": "number"}, "stale": {"type": "boolean"},
        "words": {"type": "string", "description": "inbox: last ok 3 min ago, 7 failures in a row: HTTP 503"},
    },
}
_BOT_LIVENESS = {
    "type": "object",
    "required": ["paths", "stale", "oldest_due_open_age_s"],
    "properties": {
        "paths": {"type": "object", "additionalProperties": _PATH_HEALTH,
                  "description": "inbox, search, refind and sweep, as scheduled."},
        "stale": {"type": "array", "items": {"type": "string"}},
        "oldest_due_open_age_s": _nullable("number"),
    },
}
_BOT_STATE = {
    "type": "object",
    "required": ["ready", "platform", "sender_id"],
    "properties": {"ready": {"type": "boolean"}, "platform": _nullable("string"), "sender_id": _nullable("string")},
}


def _json(schema: str, description: str, headers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
    if headers:
        out["headers"] = dict(headers)
    return out


_RETRY = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
_WWW = {"WWW-Authenticate": {"description": "The auth challenge.", "schema": {"type": "string"}}}


def openapi_document(*, auth: bool = True, open_routes: Sequence[str] = ()) -> dict[str, Any]:
    """Return the OpenAPI 3.1 document for an API with a token configured (``auth``) or not."""
    write_sec = [{"bearerAuth": []}]
    # An empty requirement means no auth: every read without a configured token, and the opened probes.
    read_sec = [{"bearerAuth": []}, {"basicAuth": []}] if auth else [{}]

    def probe_sec(route: str) -> list[dict[str, list[str]]]:
        """Security of an openable route."""
        return [{}] if route in open_routes else read_sec
    unauthorized = _json("Error", "Missing or invalid credentials.", _WWW)
    path_params = [
        {"name": "platform", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "A bot's name, or its platform instance when that contains no '/'."},
        {"name": "parent_id", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "The parent id exactly as stored (percent-encode '/')."},
    ]
    request_schema = ReplyIn.model_json_schema()
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "replyd",
            "version": "1",
            "description": "Post replies at most once per parent through replyd's guard; inspect and steer the "
                           "answered-log. Writes always need a bearer token.",
        },
        "paths": {
            "/v1/replies": {"post": {
                "operationId": "postReply",
                "summary": "Resolve the parent through the adapter and post the reply at most once.",
                "security": write_sec,
                "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}},
                "responses": {
                    "200": _json("PostOutcome", "Already answered: reply_id is the existing reply; nothing sent."),
                    "201": _json("PostOutcome", "Posted by this call: reply_id is the new reply."),
                    "202": _json("PostOutcome", "In flight or uncertain: another call holds the key, or this send may "
                                            "have landed; the sweep decides. Do not retry with other text."),
                    "400": _json("Error", "The body is not valid JSON."),
                    "401": unauthorized,
                    "403": _json("Error", "Writes are disabled: no API token is configured."),
                    "404": _json("Error", "Unknown bot/platform, or the platform does not know the parent; "
                                          "nothing sent."),
                    "409": _json("Outcome", "Rejected by the platform, given up, or declined: terminal until an "
                                            "operator rearms the key (or an ambiguous platform instance: Error)."),
                    "413": _json("Error", "The body is too large."),
                    "415": _json("Error", "The body is not application/json."),
                    "422": _json("Error", "The body is not a valid request; field names the first bad field."),
                    "429": _json("Outcome", "Not sent: the platform rate-limits (or the key backs off); retry after "
                                            "Retry-After.", _RETRY),
                    "502": _json("Error", "The parent could not be resolved through the platform; nothing sent."),
                    "503": _json("Outcome", "Not sent: the store is unavailable or busy (Error body), the daemon is "
                                            "shutting down, or the platform refused before acting.", _RETRY),
                },
            }},
            "/v1/replies/{platform}/{parent_id}": {"get": {
                "operationId": "getReply",
                "summary": "A key's row and its whole history.",
                "security": read_sec,
                "parameters": path_params,
                "responses": {
                    "200": _json("ReplyHistory", "The row and its events, oldest first."),
                    "401": unauthorized,
                    "404": _json("Error", "Unknown bot/platform, or no row for this parent."),
                    "409": _json("Error", "The platform instance names several bots: use the bot name."),
                    "503": _json("Error", "The store is unavailable.", _RETRY),
                },
            }},
            "/v1/replies/{platform}/{parent_id}/rearm": {"post": {
                "operationId": "rearmReply",
                "summary": "Operator: move a rejected, gave_up or declined key to released (event rearmed).",
                "security": write_sec,
                "parameters": path_params,
                "responses": {
                    "200": _json("Rearmed", "Rearmed: the next post may claim the key."),
                    "401": unauthorized,
                    "403": _json("Error", "Writes are disabled: no API token is configured."),
                    "404": _json("Error", "Unknown bot/platform, or no row for this parent."),
                    "409": _json("Error", "The key is not in a rearmable state (state says which it is in)."),
                    "503": _json("Error", "The store is unavailable.", _RETRY),
                },
            }},
            "/v1/status": {"get": {
                "operationId": "getStatus",
                "summary": "Row counts, oldest open rows, recent events and bots.",
                "security": read_sec,
                "responses": {
                    "200": _json("StatusSummary", "The summary."),
                    "401": unauthorized,
                    "503": _json("StatusSummary", "The store is unavailable (store.up is false)."),
                },
            }},
            "/healthz": {"get": {
                "operationId": "healthz", "summary": "Liveness.", "security": [{}],
                "responses": {"200": _json("Health", "The process serves requests.")},
            }},
            "/readyz": {"get": {
                "operationId": "readyz", "summary": "Readiness: store reachable, every bot logged in, no path stale.",
                "security": probe_sec("readyz"),
                "responses": {"200": _json("Ready", "Ready."), "401": unauthorized,
                              "503": _json("Ready", "Not ready; the body says why.")},
            }},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics.", "security": probe_sec("metrics"),
                "responses": {"200": {"description": "Prometheus text exposition.",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              "401": unauthorized},
            }},
            "/": {"get": {
                "operationId": "statusPage", "summary": "The read-only status page (refreshes itself).",
                "security": read_sec,
                "responses": {"200": {"description": "HTML.", "content": {"text/html": {"schema": {"type": "string"}}}},
                              "401": unauthorized,
                              "503": {"description": "HTML; the store is unavailable.",
                                      "content": {"text/html": {"schema": {"type": "string"}}}}},
            }},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "This document.", "security": read_sec,
                "responses": {"200": {"description": "OpenAPI 3.1.",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              "401": unauthorized},
            }},
        },
        "components": {
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer",
                               "description": "The token in the environment variable named by api.token_env."},
                "basicAuth": {"type": "http", "scheme": "basic",
                              "description": "Reads only: any user name, the token as password (for browsers)."},
            },
            "schemas": {
                "Error": _ERROR,
                "Outcome": {"oneOf": [{"$ref": "#/components/schemas/PostOutcome"},
                                      {"$ref": "#/components/schemas/Error"}]},
                "PostOutcome": _OUTCOME,
                "Row": _ROW,
                "Event": _EVENT,
                "ReplyHistory": {
                    "type": "object",
                    "required": ["bot", "platform", "sender_id", "parent_id", "row", "parent", "events"],
                    "properties": {
                        "bot": {"type": "string"}, "platform": {"type": "string"}, "sender_id": {"type": "string"},
                        "parent_id": {"type": "string"}, "row": {"$ref": "#/components/schemas/Row"},
                        "parent": {"type": "object", "description": "The parent snapshot stored when claimed."},
                        "events": {"type": "array", "items": {"$ref": "#/components/schemas/Event"}},
                    },
                },
                "Rearmed": {
                    "type": "object",
                    "required": ["rearmed", "bot", "previous_state", "row"],
                    "properties": {"rearmed": {"const": True}, "bot": {"type": "string"},
                                   "previous_state": {"type": "string", "enum": list(library.REARMABLE)},
                                   "row": {"$ref": "#/components/schemas/Row"}},
                },
                "StatusSummary": _STATUS,
                "BotState": _BOT_STATE,
                "BotLiveness": _BOT_LIVENESS,
                "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
                "Ready": {
                    "type": "object",
                    "required": ["ready", "reasons", "store", "bots"],
                    "properties": {
                        "ready": {"type": "boolean"},
                        "reasons": {"type": "array", "items": {"type": "string"}},
                        "store": {"type": "object", "required": ["up", "error"],
                                  "properties": {"up": {"type": "boolean"}, "error": _nullable("string")}},
                        "bots": {"type": "object", "additionalProperties": {"type": "boolean"}},
                    },
                },
            },
        },
    }


# -- the server ------------------------------------------------------------------------------------


class ApiServer:
    """Serves an ASGI app with uvicorn from a background thread; ``url`` is set once it listens."""

    def __init__(self, app: Callable[..., Any], *, host: str = "127.0.0.1", port: int = 0,
                 grace_s: float = 10.0, start_timeout_s: float = 15.0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ApiServer:
        """Bind, start serving, and wait until requests are accepted."""
        family = socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Without it uvicorn's separate header and body writes meet delayed ACKs (~40 ms a request).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host.strip("[]"), self.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"api: cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        self.port = sock.getsockname()[1]
        shown = f"[{self.host.strip('[]')}]" if family == socket.AF_INET6 else self.host
        self.url = f"http://{shown}:{self.port}"
        config = uvicorn.Config(self.app, loop="asyncio", http="h11", ws="none", lifespan="off", log_config=None,
                                log_level="warning", access_log=False, timeout_graceful_shutdown=int(self.grace_s) or 1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="replyd-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"api: the server on {self.url} did not start")
            time.sleep(0.005)
        log.info("replyd.api.started", url=self.url)
        return self

    def stop(self) -> None:
        """Stop accepting, finish running requests within the grace period, and return."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(self.grace_s + 5)
        self._server = self._thread = None
        log.info("replyd.api.stopped", url=self.url)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
