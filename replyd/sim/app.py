"""The Starlette app of the simulated platform: a Mastodon REST subset plus ``/_sim`` admin routes.

Response shapes follow the recorded Mastodon responses in
``shared/fixtures/mastodon`` (string ids, ``.000Z`` timestamps, HTML content
with h-card mention links, ``Link`` paging, ISO ``X-RateLimit-Reset``).
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import email.utils
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replyd.sim.render import account_json, iso, notification_json, status_json
from replyd.sim.world import Account, SimError, Status, World, paginate

RATE_WINDOW_S = 300
_INVALID_TOKEN = "The access token is invalid"

_HTML_504 = (
    "<html>\r\n<head><title>504 Gateway Time-out</title></head>\r\n<body>\r\n"
    "<center><h1>504 Gateway Time-out</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)
_HTML_503 = (
    "<html>\r\n<head><title>503 Service Temporarily Unavailable</title></head>\r\n<body>\r\n"
    "<center><h1>503 Service Temporarily Unavailable</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)
_HTML_502 = (
    "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)


# ----- request plumbing ----------------------------------------------------------------------------


class _ApiError(Exception):
    def __init__(self, status: int, error: str, headers: dict[str, str] | None = None) -> None:
        self.status, self.error, self.headers = status, error, headers or {}


def _int(value: str | None) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)  # type: ignore[arg-type]
    except ValueError:
        return None


def _limit(request: Request, default: int, maximum: int) -> int:
    n = _int(request.query_params.get("limit"))
    return default if n is None else max(1, min(n, maximum))


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes", "on")


def _link_header(request: Request, ids: list[str]) -> dict[str, str]:
    """``Link`` with ``rel="next"`` (max_id = oldest) and ``rel="prev"`` (min_id = newest)."""
    if not ids:
        return {}
    url = request.url.remove_query_params(["max_id", "min_id", "since_id"])
    nxt = url.include_query_params(max_id=ids[-1])
    prev = url.include_query_params(min_id=ids[0])
    return {"Link": f'<{nxt}>; rel="next", <{prev}>; rel="prev"'}


async def _params(request: Request) -> dict[str, Any]:
    """Query parameters merged with a form, multipart or JSON body (Rails merges them too)."""
    out: dict[str, Any] = dict(request.query_params)
    raw = await request.body()
    ctype = request.headers.get("content-type", "")
    if not raw:
        return out
    if ctype.startswith("application/json"):
        try:
            data = json.loads(raw)
        except ValueError:
            raise _ApiError(400, "Error while parsing JSON body") from None
        if not isinstance(data, dict):
            raise _ApiError(400, "Error while parsing JSON body")
        out.update(data)
    elif ctype.startswith("multipart/form-data"):
        # python-multipart is not a dependency; the email parser reads form-data fine.
        msg = email.message_from_bytes(
            b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw, policy=email.policy.HTTP
        )
        for part in msg.iter_parts():  # type: ignore[attr-defined]
            name = part.get_param("name", header="content-disposition")
            if name:
                out[name] = (part.get_payload(decode=True) or b"").decode("utf-8", "replace")
    else:
        out.update(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True))
    return out


Handler = Callable[[Request, World, Account], Response]


def _held(world: World, endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Hold a create ``create_hold_s`` before it is done (the client may have given up meanwhile)."""

    async def held(request: Request) -> Response:
        """Wait the knob's hold, then run the create."""
        if world.knobs.create_hold_s > 0:
            await asyncio.sleep(world.knobs.create_hold_s)
        return await endpoint(request)

    return held


def _api(world: World, fn: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler with bearer auth and Mastodon-style JSON errors."""

    async def endpoint(request: Request) -> Response:
        """Authenticate, parse the body, run the handler, map errors."""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        try:
            viewer = world.account_for_token(token) if token else None
            if viewer is None:
                raise _ApiError(
                    401,
                    _INVALID_TOKEN,
                    {
                        "WWW-Authenticate": 'Bearer realm="Doorkeeper", error="invalid_token", '
                        f'error_description="{_INVALID_TOKEN}"'
                    },
                )
            world.count_request(viewer.id, request.method, fn.__name__)
            request.state.params = await _params(request) if request.method in ("POST", "PUT", "PATCH") else {}
            # Sync handlers under the world lock: a response is one consistent snapshot
            # even while traffic threads post.
            with world.lock:
                return fn(request, world, viewer)
        except SimError as e:
            return JSONResponse(e.body, status_code=e.status)
        except _ApiError as e:
            return JSONResponse({"error": e.error}, status_code=e.status, headers=e.headers)

    return endpoint


class _DroppedResponse(Response):
    """A response whose body stops short of its Content-Length: the client sees a broken connection."""

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self._full = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json; charset=utf-8"),
                    (b"content-length", str(len(self._full)).encode()),
                    (b"x-sim-drop", b"1"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self._full[: len(self._full) // 3], "more_body": True})
        # Returning now makes uvicorn close the transport mid-body (server.py mutes its log line).


# ----- Mastodon endpoints --------------------------------------------------------------------------


def verify_credentials(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v1/accounts/verify_credentials."""
    return JSONResponse(account_json(world, viewer, credentials=True))


def instance(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v2/instance: the part of it replyd reads (the post limit)."""
    return JSONResponse({"domain": request.url.hostname or "sim", "title": "replyd sim",
                         "configuration": {"statuses": {"max_characters": world.knobs.max_characters}}})


def notifications(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v1/notifications (only mentions exist here)."""
    qp = request.query_params
    types = qp.getlist("types[]") + qp.getlist("types")
    excluded = qp.getlist("exclude_types[]") + qp.getlist("exclude_types")
    items = world.notifications_for(viewer.id)
    items = [n for n in items if (not types or n.type in types) and n.type not in excluded]
    page = paginate(
        items,
        key=lambda n: int(n.id),
        limit=_limit(request, 40, 80),
        max_id=_int(qp.get("max_id")),
        since_id=_int(qp.get("since_id")),
        min_id=_int(qp.get("min_id")),
    )
    return JSONResponse([notification_json(world, n) for n in page], headers=_link_header(request, [n.id for n in page]))


def _stream_endpoint(world: World) -> Callable[[Request], Awaitable[Response]]:
    """GET /api/v1/streaming/user/notification: server-sent events, one ``notification`` per new mention.

    As Mastodon's streaming server: ``event: notification`` with the notification JSON as ``data``, a
    ``:thump`` comment as heartbeat; only notifications made after the stream opened are sent (what a
    stream misses while it is down, the inbox poll reads). ``World.cut_streams`` ends it.
    """

    async def endpoint(request: Request) -> Response:
        """Authenticate, then stream."""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        viewer = world.account_for_token(token) if token else None
        if viewer is None:
            return JSONResponse({"error": _INVALID_TOKEN}, status_code=401)
        with world.lock:
            if world.clock.now() < world.stream_refused_until:
                return JSONResponse({"error": "streaming is down"}, status_code=503)
            generation = world.stream_generation
            seen = {n.id for n in world.notifications_for(viewer.id)}
            world.streams_served += 1

        async def events() -> AsyncIterator[bytes]:
            idle = 0.0
            yield b":)\n\n"
            while True:
                with world.lock:
                    if world.stream_generation != generation:
                        return
                    new = [n for n in reversed(world.notifications_for(viewer.id)) if n.id not in seen]
                    out = [notification_json(world, n) for n in new]
                    seen.update(n.id for n in new)
                for item in out:
                    yield b"event: notification\ndata: " + json.dumps(item).encode() + b"\n\n"
                    idle = 0.0
                await asyncio.sleep(0.05)
                idle += 0.05
                if idle >= 10.0:
                    idle = 0.0
                    yield b":thump\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-store"})

    return endpoint


def search(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v2/search: substring match on status text, URL resolve when ``resolve`` is set."""
    qp = request.query_params
    q = (qp.get("q") or "").strip()
    kind = qp.get("type")
    limit = _limit(request, 20, 40)
    offset = max(0, _int(qp.get("offset")) or 0)
    statuses: list[Status] = []
    accounts: list[Account] = []
    if q and kind in (None, "", "statuses"):
        hit = world.resolve_url(q, viewer.id) if _truthy(qp.get("resolve")) else None
        if hit is not None:
            statuses = [hit]
        else:
            found = world.search_statuses(q, viewer.id)
            found = paginate(
                found, key=lambda s: int(s.id), limit=len(found),
                max_id=_int(qp.get("max_id")), min_id=_int(qp.get("min_id")),
            )
            statuses = found[offset : offset + limit]
    if q and kind in (None, "", "accounts"):
        needle = q.lstrip("@").lower()
        accounts = [a for a in list(world.accounts.values()) if needle in a.username.lower()][offset : offset + limit]
    return JSONResponse(
        {
            "accounts": [account_json(world, a) for a in accounts],
            "statuses": [status_json(world, s, viewer.id) for s in statuses],
            "hashtags": [],
        }
    )


def get_status(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v1/statuses/:id."""
    st = world.get_status(request.path_params["id"], viewer.id)
    return JSONResponse(status_json(world, st, viewer.id))


def _readback_fault(world: World) -> Response | None:
    if world.next_read_fault() == "error_502":
        world.record_fault("readback_502")
        return HTMLResponse(_HTML_502, status_code=502)
    return None


def context(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v1/statuses/:id/context."""
    if (fault := _readback_fault(world)) is not None:
        return fault
    ancestors, descendants = world.context(request.path_params["id"], viewer.id)
    return JSONResponse(
        {
            "ancestors": [status_json(world, s, viewer.id) for s in ancestors],
            "descendants": [status_json(world, s, viewer.id) for s in descendants],
        }
    )


def account_statuses(request: Request, world: World, viewer: Account) -> Response:
    """GET /api/v1/accounts/:id/statuses."""
    if (fault := _readback_fault(world)) is not None:
        return fault
    qp = request.query_params
    items = world.account_statuses(
        request.path_params["id"], viewer.id, exclude_replies=_truthy(qp.get("exclude_replies"))
    )
    page = paginate(
        items,
        key=lambda s: int(s.id),
        limit=_limit(request, 20, 40),
        max_id=_int(qp.get("max_id")),
        since_id=_int(qp.get("since_id")),
        min_id=_int(qp.get("min_id")),
    )
    return JSONResponse(
        [status_json(world, s, viewer.id) for s in page], headers=_link_header(request, [s.id for s in page])
    )


def create_status(request: Request, world: World, viewer: Account) -> Response:
    """POST /api/v1/statuses with Idempotency-Key and the create faults applied."""
    params = request.state.params
    fault = world.next_create_fault()
    before = _fault_before(world, fault)
    if before is not None:
        return before
    st, _new = world.create_status(viewer, params, request.headers.get("idempotency-key") or None, via_api=True)
    return _answered(world, fault, status_json(world, st, viewer.id))


def _fault_before(world: World, fault: str) -> Response | None:
    """The answer of a write fault that strikes before anything is done (429, 500, 503), else None."""
    if fault == "rate_limit_429":
        world.record_fault(fault)
        retry = world.knobs.retry_after_s
        return JSONResponse(
            {"error": "Too many requests"},
            status_code=429,
            headers={"Retry-After": str(retry), "X-RateLimit-Remaining": "0",
                     "X-RateLimit-Reset": iso(world.clock.now() + retry)},
        )
    if fault == "error_500_before":
        world.record_fault(fault)
        return JSONResponse({"error": "We're sorry, but something went wrong on our end."}, status_code=500)
    if fault == "error_503_before":
        world.record_fault(fault)
        return HTMLResponse(_HTML_503, status_code=503)
    return None


def _answered(world: World, fault: str, body: dict[str, Any]) -> Response:
    """The answer of a write that was done: lost (504, or the connection dropped) when the fault says so."""
    if fault == "lost_504":
        world.record_fault(fault)
        return HTMLResponse(_HTML_504, status_code=504)
    if fault == "lost_drop":
        world.record_fault(fault)
        return _DroppedResponse(json.dumps(body).encode())
    return JSONResponse(body)


def edit_status(request: Request, world: World, viewer: Account) -> Response:
    """PUT /api/v1/statuses/:id (own statuses only), the edit faults applied as a create's are."""
    fault = world.next_edit_fault()
    before = _fault_before(world, fault)
    if before is not None:
        return before
    st = world.edit_status(viewer, request.path_params["id"], request.state.params)
    return _answered(world, fault, status_json(world, st, viewer.id))


def delete_status(request: Request, world: World, viewer: Account) -> Response:
    """DELETE /api/v1/statuses/:id (own statuses only); answers the deleted status with its source text."""
    st = world.delete(viewer, request.path_params["id"])
    body = status_json(world, st, viewer.id)
    body["text"] = st.text
    return JSONResponse(body)


# ----- admin endpoints ---------------------------------------------------------------------------------


def _admin(world: World, fn: Callable[[World, dict[str, Any]], Any]) -> Callable[[Request], Awaitable[Response]]:
    """Wrap an admin handler: JSON in (optional), JSON out, ``ValueError``/``KeyError`` → 400."""

    async def endpoint(request: Request) -> Response:
        """Parse the JSON body, run the admin handler, map errors to 400."""
        raw = await request.body()
        try:
            data = json.loads(raw) if raw else {}
            if not isinstance(data, dict):
                raise ValueError("body must be a JSON object")
            return JSONResponse(fn(world, data))
        except SimError as e:
            return JSONResponse(e.body, status_code=e.status)
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)

    return endpoint


def _admin_account(world: World, d: dict[str, Any]) -> dict[str, Any]:
    acc = world.add_account(d["username"], bot=bool(d.get("bot", False)), token=d.get("token"),
                            display_name=d.get("display_name", ""))
    return {**account_json(world, acc), "token": acc.token}


def _admin_post(world: World, d: dict[str, Any]) -> Any:
    if "generate" in d:
        opts = {k: d[k] for k in ("target", "mention_fraction", "question_fraction", "query_word",
                                  "query_fraction", "users") if k in d}
        return [status_json(world, s) for s in world.generate(int(d["generate"]), **opts)]
    st = world.post(d["account"], d["text"], in_reply_to_id=d.get("in_reply_to_id"),
                    mention=d.get("mention", ()), visibility=d.get("visibility", "public"))
    return status_json(world, st)


def _admin_traffic(world: World, d: dict[str, Any]) -> dict[str, Any]:
    if d.get("stop"):
        world.stop_traffic()
        return {"stopped": True}
    opts = {k: d[k] for k in ("target", "mention_fraction", "question_fraction", "query_word",
                              "query_fraction", "users") if k in d}
    world.start_traffic(float(d["rate_per_s"]), total=d.get("total"), duration_s=d.get("duration_s"), **opts)
    return {"started": True}


def _admin_clock(world: World, d: dict[str, Any]) -> dict[str, Any]:
    if "advance" in d:
        advance = getattr(world.clock, "advance", None)
        if advance is None:
            raise ValueError("the sim runs on the system clock; start it with --fake-clock")
        advance(float(d["advance"]))
    return {"now": world.clock.now()}


def _admin_reset(world: World, d: dict[str, Any]) -> dict[str, Any]:
    world.reset(seed=d.get("seed"), keep_accounts=bool(d.get("keep_accounts", True)))
    return {"reset": True}


# ----- edge middleware ------------------------------------------------------------------------------------


class _Edge:
    """Adds latency, the ``Date`` (on the world's clock) and rate-limit headers to every response, as a proxy in
    front of the API would."""

    def __init__(self, app: ASGIApp, world: World) -> None:
        self.app, self.world = app, world

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        world = self.world
        if world.knobs.latency_s > 0:
            await asyncio.sleep(world.knobs.latency_s)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        client = scope.get("client") or ("?", 0)
        budget = world.knobs.rate_limit_budget
        remaining, reset = world.rate_limit_hit(auth or str(client[0]), budget, RATE_WINDOW_S)

        async def send_with_headers(message: Message) -> None:
            """Add the rate-limit headers a handler did not set itself."""
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                for name, value in (
                    # The platform's own clock (SimServer turns uvicorn's off), as a real server's Date is.
                    (b"date", email.utils.formatdate(int(world.clock.now()), usegmt=True)),
                    (b"x-ratelimit-limit", str(budget)),
                    (b"x-ratelimit-remaining", str(remaining)),
                    (b"x-ratelimit-reset", iso(reset)),
                ):
                    if name not in present:
                        headers.append((name, value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def build_app(world: World) -> ASGIApp:
    """Build the ASGI app serving ``world``: Mastodon routes under /api, admin routes under /_sim."""

    async def get_report(request: Request) -> Response:
        """GET /_sim/report."""
        return JSONResponse(world.report())

    async def get_config(request: Request) -> Response:
        """GET /_sim/config."""
        return JSONResponse(world.configure())

    from replyd.sim.webhooks import Senders  # here, not at the top: it renders deliveries with this module

    senders = Senders(world)

    async def get_webhooks(request: Request) -> Response:
        """GET /_sim/webhooks: the sender's report."""
        return JSONResponse(senders.report())

    routes = [
        Route("/api/v1/accounts/verify_credentials", _api(world, verify_credentials)),
        Route("/api/v1/notifications", _api(world, notifications)),
        Route("/api/v2/instance", _api(world, instance)),
        Route("/api/v1/streaming/user/notification", _stream_endpoint(world)),
        Route("/api/v2/search", _api(world, search)),
        Route("/api/v1/statuses", _held(world, _api(world, create_status)), methods=["POST"]),
        Route("/api/v1/statuses/{id}", _api(world, get_status), methods=["GET"]),
        Route("/api/v1/statuses/{id}", _api(world, delete_status), methods=["DELETE"]),
        Route("/api/v1/statuses/{id}", _api(world, edit_status), methods=["PUT"]),
        Route("/api/v1/statuses/{id}/context", _api(world, context)),
        Route("/api/v1/accounts/{id}/statuses", _api(world, account_statuses)),
        Route("/_sim/accounts", _admin(world, _admin_account), methods=["POST"]),
        Route("/_sim/posts", _admin(world, _admin_post), methods=["POST"]),
        Route("/_sim/config", _admin(world, lambda w, d: w.configure(**d)), methods=["POST"]),
        Route("/_sim/config", get_config, methods=["GET"]),
        Route("/_sim/faults", _admin(world, lambda w, d: w.queue_faults(
            d.get("next_creates", ()), d.get("next_readbacks", ()))), methods=["POST"]),
        Route("/_sim/traffic", _admin(world, _admin_traffic), methods=["POST"]),
        Route("/_sim/clock", _admin(world, _admin_clock), methods=["POST"]),
        Route("/_sim/report", get_report, methods=["GET"]),
        Route("/_sim/reset", _admin(world, _admin_reset), methods=["POST"]),
        Route("/_sim/webhooks", _admin(world, lambda w, d: senders.handle(d)), methods=["POST"]),
        Route("/_sim/webhooks", get_webhooks, methods=["GET"]),
    ]
    return _Edge(Starlette(routes=routes), world)
