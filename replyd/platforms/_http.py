"""Shared httpx helpers for platform adapters: error mapping, JSON fields, headers.

Every adapter (Mastodon, Discourse, GitHub, Bluesky ...) talks HTTP through one
shared ``httpx.Client`` (and, for ``asend``, an ``httpx.AsyncClient``) and must map
what it meets into ``replyd.errors`` the same way. The mapping lives here so the
adapters (and the two drivers) cannot drift apart:

=====================================================  ===================  ===================
what happened                                          acting request       read request
                                                       (POST/PUT/PATCH/     (GET/HEAD/OPTIONS)
                                                       DELETE)
=====================================================  ===================  ===================
the request cannot be built (a header value with CR,    NotBuilt             NotBuilt
LF or non-ASCII, a body JSON or a form cannot
encode): it never reached the transport
ConnectError (refused, DNS, TLS), ConnectTimeout,      DefinitelyNotSent    DefinitelyNotSent
PoolTimeout, ProxyError, UnsupportedProtocol,
InvalidURL: no byte reached the server
ReadTimeout, WriteTimeout, ReadError, WriteError,      MaybeSent            DefinitelyNotSent
RemoteProtocolError, any other transport error
HTTP 429                                               RateLimited          RateLimited
HTTP 401, 403 (auth: the server did nothing)           DefinitelyNotSent    DefinitelyNotSent
HTTP 408 (server never got the whole request)          DefinitelyNotSent    DefinitelyNotSent
HTTP 400-499 otherwise (404, 409, 410, 413, 422 ...)   Rejected             Rejected
HTTP 500-599                                           MaybeSent            DefinitelyNotSent
other non-2xx (1xx, 3xx: redirects are not followed)   MaybeSent            BadResponse
2xx body not JSON / wrong type / field missing         BadResponse (the adapter decides
                                                       whether a send's 2xx becomes MaybeSent)
=====================================================  ===================  ===================

A read cannot create anything, so its failures are ``DefinitelyNotSent``: the
caller only needs to know that the read did not happen. Status mapping never
looks at the error text: platforms localise it.

One request, two drivers (sans-I/O). A request is written once as *steps*: a generator
(:func:`request_steps`, and on it ``HttpPlatform._request_steps`` → ``_call_steps`` →
``_created_steps``) that yields a :class:`Fetch` per HTTP exchange and is handed back the
response, or has the transport's exception thrown in where it arose, and maps both by the table
above. A driver only moves bytes: :func:`run_sync` with an ``httpx.Client`` in the calling thread
(the sync face, pollers, sweep, and every ``_request`` / ``_call`` / ``_created``), :func:`run_async`
with an ``httpx.AsyncClient`` on the event loop. An adapter whose send is written as steps
(``_send_steps``, mixing in :class:`StepSend`: Mastodon, Discourse, GitHub, Matrix, WhatsApp) so has
``send`` and ``asend`` from one body, and everything a send is judged by lives once: this table
(``transport_error``, ``raise_for_status``, the adapters' ``_raise_for_status`` / ``_refused`` /
``_limited`` hooks), the body bound (``_Body``, read the same by both drivers), rate-limit buckets,
the platform-clock samples. Why steps: the request template is overridden per adapter at a dozen
hooks, and an async copy of it (or of each adapter's send) would drift from the sync one; greenlets
(the sync code suspended inside its blocking call) would hide where an exchange may wait, where a
``yield`` shows it; and the guard's own decisions are steps already (``replyd.core``), driven the
same way by the two faces. A blocking request made inside steps that ``run_async`` drives raises at
once instead of stalling the loop. The other HTTP adapters keep ``send`` only and the asyncio face
runs it on a worker thread: Slack, Discord and Telegram (sends through their own ``_api`` wrappers
with their own error bodies; convertible the same way), Bluesky (a send of several requests:
``createRecord``, then a ``getRecord`` probe at the rkey when the answer is unclear, behind a session
refresh); email is SMTP. ``asend`` runs on the ``aclient`` the adapter was built with (the caller's),
else on one it makes on the running loop and closes in ``aclose()`` (the async session calls it).

The whole-send deadline (``replyd.deadline``) holds on both drivers. Sync: the client of
:func:`make_client` cuts every socket read and write to the budget left (``_DeadlineBackend``).
Async: ``run_async`` caps each phase's timeout (connect, read, write, pool) at the budget left when
an exchange starts and cuts the whole exchange with ``asyncio.timeout`` at that budget (a cut exchange
is a ``ReadTimeout``: the request may have left, "maybe" for an acting request), a budget gone
before an exchange starts is a ``ConnectTimeout`` (nothing left); so any ``AsyncClient`` honours
it, the user's too. Both drivers stop reading a body that trickles past the deadline.

Secrets: pass them as ``secrets=`` and every detail these helpers build has
them masked. Authorisation goes through :class:`BearerAuth`, whose ``repr``
hides the token, and transport exceptions are re-raised ``from None`` so a
traceback renderer that prints frame locals (structlog's rich tracebacks do by
default) never walks into httpcore frames holding raw header bytes.
"""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import functools
import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from html.parser import HTMLParser
from typing import Annotated, Any, ClassVar, Self, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

import httpcore
import httpx
from pydantic import AfterValidator, Field, SecretStr, ValidationInfo, model_validator

from replyd import deadline, metrics
from replyd.clock import Clock
from replyd.errors import (BadResponse, DefinitelyNotSent, MaybeSent, NotBuilt, PlatformError,
                           RateLimited, Rejected)
from replyd.log import get_logger
from replyd.net import INSECURE_HTTP, is_loopback, require_https  # noqa: F401  (the platforms reach them here too)
from replyd.platforms import mentions
from replyd.platforms.base import Identity, OwnReply, Page, Parent, Pending, PlatformSettings, ReadBack, Sent
from replyd.platforms import unreadable

T = TypeVar("T")

ACTING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

# These fail before any request byte is written, so nothing can have acted.
_NEVER_LEFT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
    httpx.UnsupportedProtocol,
    httpx.InvalidURL,
)

_MAX_SERVER_TEXT = 200
# The largest platform response replyd reads (after decompression). Real pages are tens of KiB;
# anything near this is a broken or hostile server, and reading it whole could exhaust memory.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024


class SecretAuth(httpx.Auth):
    """Sets secret headers on each request: the one way adapters (and responders) carry credentials.

    ``headers`` is a mapping, or a callable returning one (for a token that changes: a login, a session);
    its repr names nothing, so no log, error or traceback shows a value.
    """

    def __init__(self, headers: Mapping[str, SecretStr] | Callable[[], Mapping[str, SecretStr]]) -> None:
        self._headers = headers

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        """Set the headers and send the request once."""
        headers = self._headers() if callable(self._headers) else self._headers
        for name, value in headers.items():
            request.headers[name] = value.get_secret_value()
        yield request

    def __repr__(self) -> str:
        return "SecretAuth(<redacted>)"


def BearerAuth(token: str, scheme: str = "Bearer") -> SecretAuth:  # was a class; callers unchanged
    """``Authorization: <scheme> <token>`` as a :class:`SecretAuth`."""
    return SecretAuth({"Authorization": SecretStr(f"{scheme} {token}")})


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every read and write is cut to what is left of ``replyd.deadline``'s budget."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    @staticmethod
    def _cap(timeout: float | None, exc: type[Exception]) -> float | None:
        left = deadline.remaining()
        if left is None:
            return timeout
        if left <= 0:
            raise exc("the send's whole deadline (guard.send_timeout_s) passed")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Read, waiting no longer than the budget left."""
        return self._inner.read(max_bytes, self._cap(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Write, waiting no longer than the budget left."""
        self._inner.write(buffer, self._cap(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        """Close the socket."""
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        """Upgrade to TLS within the budget left (nothing has been sent yet: a connect timeout)."""
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                     self._cap(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        """Pass through (the TLS object, the peer address ...)."""
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend with every connection's streams bounded by ``replyd.deadline``."""

    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        """Connect within the budget left."""
        return _DeadlineStream(self._inner.connect_tcp(host, port, _DeadlineStream._cap(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        """Connect within the budget left."""
        return _DeadlineStream(self._inner.connect_unix_socket(
            path, _DeadlineStream._cap(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        """Sleep (httpcore's retries on connect)."""
        self._inner.sleep(seconds)


class _Unshown:
    """A container whose repr shows how many items it holds and none of them: an adapter's secrets, kept for
    masking, and its parsed request URLs (a Telegram token is part of its URLs)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {len(self)}>"  # type: ignore[arg-type]


class _Secrets(_Unshown, tuple[str, ...]):
    """Secret values (``_Unshown``)."""


class _URLs(_Unshown, dict[Any, httpx.URL]):
    """Parsed request URLs by (path, params) (``_Unshown``)."""


class _NoCookies(httpx.Cookies):
    """Cookies that keep nothing and parse nothing: replyd authenticates by header, never by cookie.

    A shared client serves every bot, so a cookie one account's platform set would ride along on another
    account's requests to that host; and httpx builds a urllib request per response to parse its cookies,
    which was a tenth of an idle 1,000-bot daemon's CPU (py-spy)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        """Keep no cookie of ``response`` (without building the urllib objects to read them)."""

    def set(self, name: str, value: str, domain: str = "", path: str = "/") -> None:
        """Keep no cookie."""


class _Cookieless:
    """The ``cookies`` of replyd's clients: always the empty jar that keeps nothing (``_NoCookies``)."""

    @property
    def cookies(self) -> httpx.Cookies:
        """An empty jar: nothing is sent, nothing kept."""
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, value: Any) -> None:
        raise ValueError("replyd's HTTP clients keep no cookies (credentials go in headers)")


_NO_COOKIES = _NoCookies()


class _Client(_Cookieless, httpx.Client):
    """``httpx.Client`` keeping no cookies (``_Cookieless``)."""


class _AsyncClient(_Cookieless, httpx.AsyncClient):
    """``httpx.AsyncClient`` keeping no cookies (``_Cookieless``)."""


def make_client(timeout_s: float, *, connect_s: float = 10.0, **kwargs: Any) -> httpx.Client:
    """Return the shared ``httpx.Client`` for adapters: per-phase timeouts, and ``replyd.deadline`` honoured.

    Inside ``deadline.within(...)`` (the guard wraps every send in one) no socket operation of this client
    waits past the deadline, so a send ends by it however the server trickles its answer.
    """
    # The transport is given, so httpx.Client would ignore its limits: they go to the transport.
    transport = httpx.HTTPTransport(**{k: kwargs.pop(k) for k in ("verify", "retries", "limits") if k in kwargs})
    pool = transport._pool  # httpx has no public hook for the network backend; tests/test_state_holes.py guards this
    pool._network_backend = _DeadlineBackend(pool._network_backend)
    return _Client(timeout=httpx.Timeout(timeout_s, connect=connect_s), transport=transport, **kwargs)


def redact(text: str, secrets: Iterable[str]) -> str:
    """Return ``text`` with every non-empty secret replaced by ``<redacted>``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def is_acting(method: str) -> bool:
    """Return whether a request with ``method`` can change state on the server."""
    return method.upper() in ACTING_METHODS


# --- one exchange, two drivers (see the module docstring) -----------------------------------


@dataclass(frozen=True)
class Fetch:
    """One HTTP exchange for a driver to make: ``client.stream(method, url, **kwargs)``, the body read up to
    ``max_bytes`` (decoded) and within the whole-send deadline."""

    method: str
    url: httpx.URL | str
    kwargs: Mapping[str, Any]
    max_bytes: int


# What a request written as steps is: yields ``Fetch``es, takes back responses, returns its value.
HttpSteps = Generator[Fetch, httpx.Response, T]


class _NotBuilt(Exception):
    """Building the request raised ``cause`` (a driver's own wrapper): it was never handed to the transport."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


# What ``client.send`` takes; the rest of a ``Fetch``'s kwargs build the request (``client.build_request``).
_SEND_KWARGS = ("auth", "follow_redirects")
# RFC 9110 field names and values as h11 checks them when it writes the request (CR, LF and NUL never pass).
_FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")


def _build(client: httpx.Client | httpx.AsyncClient, fetch: Fetch) -> tuple[httpx.Request, dict[str, Any]]:
    """The request of ``fetch`` and the arguments of its send, or ``_NotBuilt``: an exception raised here (a
    header value or a body a parent's value made unencodable) comes before any byte is handed to the
    transport. The headers are checked as the HTTP/1.1 writer would, so that a CR or LF it refuses is refused
    here, before a connection is even taken."""
    kwargs = dict(fetch.kwargs)
    send = {k: kwargs.pop(k) for k in _SEND_KWARGS if k in kwargs}
    try:
        request = client.build_request(fetch.method, fetch.url, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the build raised, nothing left
        raise _NotBuilt(exc) from None
    for name, value in request.headers.raw:
        if not (_FIELD_NAME.fullmatch(name) and _FIELD_VALUE.fullmatch(value)):
            # The value is not shown: it may be anything a stranger wrote.
            raise _NotBuilt(ValueError(f"header {name[:40]!r}: not a valid HTTP field (CR, LF, NUL or spacing)"))
    return request, send


class _TooLarge(Exception):
    """A body past ``Fetch.max_bytes``: not read on (the steps say what it means)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def request_steps(method: str, url: httpx.URL | str, *, what: str, acts: bool | None = None, secrets: Iterable[str] = (),
                  max_bytes: int = MAX_RESPONSE_BYTES, **kwargs: Any) -> HttpSteps[httpx.Response]:
    """One request as steps: the response (any status) with its body read; transport errors mapped.

    ``acts`` defaults to ``is_acting(method)``; pass it explicitly for a POST that only reads (a search
    RPC). ``kwargs`` go to ``client.stream``. Status codes are not checked here: call
    :func:`raise_for_status`. A body larger than ``max_bytes`` is not read on: ``BadResponse`` for a read,
    ``MaybeSent`` for a request that may have acted (the sweep decides).
    """
    acting = is_acting(method) if acts is None else acts
    try:
        return (yield Fetch(method, url, kwargs, max_bytes))
    except _NotBuilt as built:
        cause = built.cause
        raise NotBuilt(redact(f"{what}: request not built: {type(cause).__name__}: {str(cause)[:160]} (nothing sent)",
                              secrets)) from None
    except (*_NEVER_LEFT, httpx.HTTPError) as exc:
        raise transport_error(exc, what=what, acting=acting, secrets=secrets) from None
    except _TooLarge as big:
        detail = f"{what}: HTTP {big.status} response larger than {max_bytes} bytes; not read"
        if acting:
            raise MaybeSent(detail + " (outcome unknown)", status=big.status) from None
        raise BadResponse(detail, status=big.status) from None


def request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """:func:`request_steps` (same arguments) driven with ``client`` in the calling thread."""
    return run_sync(client, request_steps(method, url, **kwargs))


def transport_error(exc: Exception, *, what: str, acting: bool, secrets: Iterable[str] = ()) -> PlatformError:
    """The replyd error for an httpx transport failure (module table): could the request have acted?

    Shared by the adapters (through :func:`request`) and by a platform of the user's own calls
    (``replyd.platforms.own``), sync or async client alike: one table answers it for all.
    """
    if isinstance(exc, _NEVER_LEFT):
        return DefinitelyNotSent(redact(f"{what}: {type(exc).__name__}: {exc} (nothing sent)", secrets))
    cls = MaybeSent if acting else DefinitelyNotSent
    tail = "outcome unknown" if acting else "read failed"
    return cls(redact(f"{what}: {type(exc).__name__}: {exc} ({tail})", secrets))


class _Body:
    """A response's body as both drivers read it: bounded by ``max_bytes``, cut at the whole-send deadline."""

    def __init__(self, resp: httpx.Response, max_bytes: int) -> None:
        declared = resp.headers.get("content-length", "")
        self.resp, self.max_bytes, self.chunks = resp, max_bytes, list[bytes]()
        # A declared length past the bound is not read at all.
        self.size = int(declared) if declared.isdigit() and int(declared) > max_bytes else 0

    @property
    def wanted(self) -> bool:
        """Whether reading on is of use (not past the bound)."""
        return self.size <= self.max_bytes

    def take(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False once the body is past the bound (stop reading)."""
        left = deadline.remaining()
        if left is not None and left <= 0:  # a body trickled past the deadline (any client)
            raise httpx.ReadTimeout("the whole deadline passed while reading the body", request=self.resp.request)
        self.size += len(chunk)
        if self.wanted:
            self.chunks.append(chunk)
        return self.wanted

    def response(self) -> httpx.Response:
        """The whole body as a plain response (``_TooLarge`` past the bound)."""
        if not self.wanted:
            raise _TooLarge(self.resp.status_code)
        # What httpx's own ``Response.read()`` does: the decoded body kept on the response. A new response
        # with the headers copied cost a tenth of an empty poll's CPU.
        self.resp._content = b"".join(self.chunks)
        return self.resp


class _Run:
    """One run of a request's steps for a driver: the ``fetch`` to make next (None once done, then ``value``)."""

    def __init__(self, steps: HttpSteps[Any]) -> None:
        self._steps, self.value = steps, None
        self.fetch: Fetch | None = self._next(steps.__next__)

    def _next(self, fn: Callable[..., Fetch], *arg: Any) -> Fetch | None:
        try:
            return fn(*arg)
        except StopIteration as stop:
            self.value = stop.value
            return None

    def ok(self, resp: httpx.Response) -> None:
        """Hand the response back to the steps."""
        self.fetch = self._next(self._steps.send, resp)

    def fail(self, exc: BaseException) -> None:
        """Throw the transport's exception in where it arose: the steps map it."""
        self.fetch = self._next(self._steps.throw, exc)


# Set while ``run_async`` drives steps: a blocking request made then would stall the event loop.
_ON_LOOP: contextvars.ContextVar[bool] = contextvars.ContextVar("replyd_http_on_loop", default=False)


def run_sync(client: httpx.Client, steps: HttpSteps[T]) -> T:
    """Drive ``steps`` with the blocking ``client`` in the calling thread; return their value."""
    if _ON_LOOP.get():
        raise RuntimeError("a blocking HTTP request inside steps driven on the event loop: yield it instead")
    run = _Run(steps)
    while run.fetch is not None:
        try:
            request, send = _build(client, run.fetch)  # built whole before the transport sees it
            resp = client.send(request, stream=True, **send)
            try:
                body = _Body(resp, run.fetch.max_bytes)
                for chunk in resp.iter_bytes() if body.wanted else ():
                    if not body.take(chunk):
                        break
                got = body.response()
            finally:
                resp.close()
        except BaseException as exc:  # thrown in: the steps map it (or let it pass)
            run.fail(exc)
        else:
            run.ok(got)
    return run.value  # type: ignore[return-value]


async def run_async(aclient: httpx.AsyncClient, steps: HttpSteps[T]) -> T:
    """Drive ``steps`` with ``aclient`` on the running loop; return their value. The whole-send deadline
    (``replyd.deadline``) caps each phase's timeout and, over the whole exchange, an ``asyncio.timeout``."""
    token = _ON_LOOP.set(True)
    try:
        run = _Run(steps)
        while run.fetch is not None:
            try:
                got = await _afetch(aclient, run.fetch)
            except BaseException as exc:  # thrown in: the steps map it (or let it pass)
                run.fail(exc)
            else:
                run.ok(got)
        return run.value  # type: ignore[return-value]
    finally:
        _ON_LOOP.reset(token)


async def _afetch(aclient: httpx.AsyncClient, fetch: Fetch) -> httpx.Response:
    """One exchange on ``aclient`` within what is left of the deadline: a cut exchange is a read timeout
    (the request may have left: the table's "maybe"), a deadline gone before it a connect timeout."""
    left = deadline.remaining()
    if left is not None and left <= 0:
        raise httpx.ConnectTimeout("the send's whole deadline (guard.send_timeout_s) passed before it left")
    kwargs = dict(fetch.kwargs)
    if left is not None:
        kwargs["timeout"] = _capped(kwargs.get("timeout"), aclient.timeout, left)
    request, send = _build(aclient, Fetch(fetch.method, fetch.url, kwargs, fetch.max_bytes))  # before the transport
    try:
        async with asyncio.timeout(left):
            resp = await aclient.send(request, stream=True, **send)
            try:
                body = _Body(resp, fetch.max_bytes)
                async for chunk in resp.aiter_bytes() if body.wanted else _nothing():
                    if not body.take(chunk):
                        break
                return body.response()
            finally:
                await resp.aclose()
    except TimeoutError:
        raise httpx.ReadTimeout("the send's whole deadline (guard.send_timeout_s) passed") from None


async def _nothing() -> AsyncIterator[bytes]:
    """No chunks (a body declared past the bound is not read)."""
    return
    yield  # pragma: no cover  (makes this an async generator)


def _capped(timeout: Any, default: httpx.Timeout, left: float) -> httpx.Timeout:
    """A request's ``timeout`` (an ``httpx.Timeout`` or a number; anything else: the client's ``default``) with
    every phase at most ``left``."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = httpx.Timeout(timeout)
    t = timeout if isinstance(timeout, httpx.Timeout) else default
    cap = [left if x is None else min(x, left) for x in (t.connect, t.read, t.write, t.pool)]
    return httpx.Timeout(connect=cap[0], read=cap[1], write=cap[2], pool=cap[3])


def make_async_client(timeout_s: float, *, connect_s: float = 10.0, **kwargs: Any) -> httpx.AsyncClient:
    """The ``httpx.AsyncClient`` for adapters' ``asend``: per-phase timeouts as :func:`make_client`'s; the
    whole-send deadline is the async driver's (``run_async``), so any ``AsyncClient`` honours it.

    Slow (~20 ms: the CA bundle, and the import below): the adapters call it on a thread, not on the loop."""
    try:  # what a client's first request imports (anyio's asyncio backend, ~20 ms): here, not on the loop
        import anyio._backends._asyncio
        import anyio.streams.tls  # noqa: F401
    except ImportError:  # another anyio layout: the first request imports what it needs, as before
        pass
    return _AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect_s), **kwargs)


def error_json(resp: httpx.Response) -> Any:
    """An error body as JSON, or None when it is not JSON (or nests too deeply to parse).

    Only for bodies whose status already says what happened: a body the parser cannot read must not turn a
    refusal into an exception the guard would take for "maybe sent".
    """
    try:
        return json.loads(resp.content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def stream_events(
    client: httpx.Client,
    url: str,
    *,
    what: str,
    stop: threading.Event,
    secrets: Iterable[str] = (),
    read_timeout_s: float = 90.0,
    **kwargs: Any,
) -> Iterator[Any]:
    """Open a server-sent-events stream (GET) and yield its events (``httpx_sse.ServerSentEvent``) until ``stop``.

    A stream is a read: every failure is ``DefinitelyNotSent`` (or ``RateLimited``), mapped like any read;
    a refused stream (non-2xx) is read up to ``MAX_RESPONSE_BYTES`` and raised through ``raise_for_status``.
    ``read_timeout_s`` bounds the silence between two events or heartbeats (servers send one every ~15 s).
    The stream returning normally means the server closed it.
    """
    from httpx_sse import SSEError, connect_sse

    secrets = tuple(secrets)
    timeout = httpx.Timeout(read_timeout_s, connect=min(10.0, read_timeout_s))
    try:
        with connect_sse(client, "GET", url, timeout=timeout, **kwargs) as source:
            resp = source.response
            if not 200 <= resp.status_code < 300 or "text/event-stream" not in resp.headers.get("content-type", ""):
                body = resp.read()[:MAX_RESPONSE_BYTES]
                full = httpx.Response(resp.status_code, headers=resp.headers, content=body, request=resp.request)
                raise_for_status(full, what=what, now=time.time, secrets=secrets)
                raise BadResponse(f"{what}: HTTP {resp.status_code} is not an event stream")
            for event in source.iter_sse():
                if stop.is_set():
                    return
                yield event
    except SSEError as exc:
        raise BadResponse(redact(f"{what}: not an event stream ({exc})", secrets)) from None
    except httpx.HTTPError as exc:
        raise DefinitelyNotSent(redact(f"{what}: {type(exc).__name__}: {exc} (stream ended)", secrets)) from None


def server_error_text(resp: httpx.Response) -> str:
    """Return the server's short error text (JSON ``error``/``message``), for logs only."""
    data = error_json(resp)
    text: Any = ""
    if isinstance(data, dict):
        text = data.get("error") or data.get("message") or data.get("error_description") or ""
        if isinstance(text, dict):
            text = text.get("message", "")
        message = data.get("message")
        # XRPC puts a code in "error" and the useful words in "message": keep both.
        if isinstance(text, str) and isinstance(message, str) and message and message != text:
            text = f"{text}: {message}"
    if not isinstance(text, str):
        return ""
    text = " ".join(text.split())
    return text[:_MAX_SERVER_TEXT]


def raise_for_status(
    resp: httpx.Response,
    *,
    what: str,
    acts: bool | None = None,
    now: Callable[[], float],
    secrets: Iterable[str] = (),
    text: str | None = None,
) -> None:
    """Return if ``resp`` is 2xx, else raise the mapped ``PlatformError`` (see module table).

    ``text`` replaces the server's error text in the detail (a platform with its own error body).
    """
    status = resp.status_code
    if 200 <= status < 300:
        return
    acting = is_acting(resp.request.method) if acts is None else acts
    server_text = server_error_text(resp) if text is None else text
    detail = f"{what}: HTTP {status}" + (f" ({server_text})" if server_text else "")
    detail = redact(detail, secrets)
    if status == 429:
        raise RateLimited(detail, status=status, retry_after_s=retry_after_s(resp, now()))
    if status in (401, 403, 408):
        raise DefinitelyNotSent(detail, status=status)
    if 400 <= status < 500:
        raise Rejected(detail, status=status)
    if status >= 500:
        raise (MaybeSent if acting else DefinitelyNotSent)(detail, status=status)
    raise (MaybeSent if acting else BadResponse)(f"{detail}: unexpected status", status=status)


# --- JSON bodies -----------------------------------------------------------------------

_JSON_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def json_body(resp: httpx.Response, what: str, expect: type | None = None) -> Any:
    """Parse the body as JSON; raise ``BadResponse`` saying what was wrong with it.

    ``expect`` (``dict`` or ``list``) checks the top-level type.
    """
    try:
        data = json.loads(resp.content)
    except RecursionError:
        # Deeply nested JSON (a Bluesky thread of ~1000 parents) is valid but beyond the parser.
        raise BadResponse(f"{what}: JSON nested too deeply to parse", status=resp.status_code) from None
    except (ValueError, UnicodeDecodeError):
        ctype = resp.headers.get("content-type", "").split(";")[0].strip() or "no content-type"
        raise BadResponse(f"{what}: not JSON ({ctype})", status=resp.status_code) from None
    if expect is not None and not isinstance(data, expect):
        raise BadResponse(
            f"{what}: expected {_JSON_TYPE_NAMES.get(expect, expect.__name__)} at top level, "
            f"got {_json_type(data)}",
            status=resp.status_code,
        )
    return data


_MISSING = object()


def field(obj: Any, path: str, what: str, kind: type | tuple[type, ...] = str, *, default: Any = _MISSING) -> Any:
    """Return ``obj[a][b]…`` for the dotted ``path``; raise ``BadResponse`` naming the field.

    A missing (or null) value returns ``default`` when one is given. A present
    value of the wrong type always raises. ``kind=str`` also refuses "".
    """
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or cur.get(part) is None:
            if default is not _MISSING:
                return default
            raise BadResponse(f"{what}: field {path} missing")
        cur = cur[part]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; a JSON true is never a valid number or id here.
    if not isinstance(cur, kinds) or (isinstance(cur, bool) and bool not in kinds):
        raise BadResponse(f"{what}: field {path} is {_json_type(cur)}, not {'/'.join(k.__name__ for k in kinds)}")
    if cur == "" and str in kinds:
        if default is not _MISSING:
            return default
        raise BadResponse(f"{what}: field {path} is empty")
    return cur


# --- time ------------------------------------------------------------------------------


def iso_to_epoch(value: str) -> float:
    """Parse an ISO-8601 timestamp (``Z`` or offset; naive means UTC) to epoch seconds.

    Raises ``ValueError`` on anything else.
    """
    if not isinstance(value, str):
        raise ValueError("not a string")
    text = value.strip()
    if text.endswith(("z", "Z")):
        text = text[:-1] + "+00:00"
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


# A reset time repeats on every response of its window: parsed once per text (a str: hashable).
_iso_to_epoch_cached = functools.lru_cache(maxsize=64)(iso_to_epoch)


def parse_reset(value: str, now: float) -> float | None:
    """Turn a rate-limit reset header into epoch seconds, or ``None`` if unreadable.

    Accepts an ISO-8601 time (Mastodon), epoch seconds (GitHub, Bluesky: any
    number ≥ 1e9) or seconds from now (smaller numbers).
    """
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        try:
            return _iso_to_epoch_cached(text)
        except ValueError:
            return None
    if not math.isfinite(number) or number < 0:
        return None
    return number if number >= 1e9 else now + number


def retry_after_s(resp: httpx.Response, now: float) -> float | None:
    """Seconds to wait after ``resp``: ``Retry-After`` (seconds or HTTP-date), else the reset header.

    Returns ``None`` when the response says nothing usable; never negative.
    """
    raw = resp.headers.get("retry-after")
    if raw is not None:
        raw = raw.strip()
        try:
            seconds = float(raw)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(raw)
            except (TypeError, ValueError):
                when = None
            if when is not None:
                if when.tzinfo is None:
                    when = when.replace(tzinfo=timezone.utc)
                return max(0.0, when.timestamp() - now)
        else:
            if math.isfinite(seconds):
                return max(0.0, seconds)
    for name in ("x-ratelimit-reset", "ratelimit-reset"):
        reset_raw = resp.headers.get(name)
        if reset_raw is not None:
            reset = parse_reset(reset_raw, now)
            if reset is not None:
                return max(0.0, reset - now)
    return None


# --- rate limits -----------------------------------------------------------------------


@dataclass
class _Bucket:
    remaining: int | None = None
    reset_at: float | None = None


class RateLimits:
    """Remembers the last rate-limit headers per bucket; refuses requests while one is spent.

    Platforms keep several budgets (Mastodon: every API call, plus a separate
    one for creating statuses), so callers name the bucket a response reports
    on and the buckets a request draws from. Thread-safe.
    """

    REMAINING_HEADERS = ("x-ratelimit-remaining", "ratelimit-remaining")
    RESET_HEADERS = ("x-ratelimit-reset", "ratelimit-reset")

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def check(self, buckets: Iterable[str], *, what: str) -> None:
        """Raise ``RateLimited`` (nothing sent) if any of ``buckets`` is spent until a future reset."""
        now = self._now()
        wait = 0.0
        spent = ""
        with self._lock:
            for name in buckets:
                b = self._buckets.get(name)
                if b is None or b.remaining is None or b.remaining > 0 or b.reset_at is None:
                    continue
                if b.reset_at > now and b.reset_at - now > wait:
                    wait, spent = b.reset_at - now, name
        if spent:
            raise RateLimited(
                f"{what}: rate limit {spent!r} spent, resets in {wait:.0f}s (not sent)",
                status=None,
                retry_after_s=wait,
            )

    def note(self, bucket: str, resp: httpx.Response) -> None:
        """Record the rate-limit headers of ``resp`` (and a 429's wait) under ``bucket``."""
        now = self._now()
        remaining = _first_int(resp.headers, self.REMAINING_HEADERS)
        reset_at = None
        for name in self.RESET_HEADERS:
            if name in resp.headers:
                reset_at = parse_reset(resp.headers[name], now)
                break
        if resp.status_code == 429:
            wait = retry_after_s(resp, now)
            remaining = 0
            if wait is not None:
                reset_at = now + wait
        if remaining is None and reset_at is None:
            return
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket())
            if remaining is not None:
                b.remaining = remaining
            if reset_at is not None:
                b.reset_at = reset_at

    def block(self, bucket: str, wait_s: float) -> None:
        """Mark ``bucket`` spent for ``wait_s`` seconds from now.

        For refusals whose wait is not in the rate-limit headers ``note`` reads:
        a wait named only in the body (Discourse ``extras.wait_seconds``) or a
        403 the platform documents as a rate limit (GitHub's secondary limits).
        Never shortens a block already in place.
        """
        if not math.isfinite(wait_s) or wait_s <= 0:
            return
        until = self._now() + wait_s
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket())
            if b.remaining == 0 and b.reset_at is not None and b.reset_at > until:
                return
            b.remaining = 0
            b.reset_at = until

    def snapshot(self) -> dict[str, tuple[int | None, float | None]]:
        """Return ``{bucket: (remaining, reset_at)}`` for metrics and tests."""
        with self._lock:
            return {k: (v.remaining, v.reset_at) for k, v in self._buckets.items()}


def _first_int(headers: Mapping[str, str], names: Iterable[str]) -> int | None:
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            return int(float(raw.strip()))
        except ValueError:
            return None
    return None


# --- Link headers ----------------------------------------------------------------------

_LINK_RE = re.compile(r"<([^>]*)>((?:\s*;\s*[^;,]*)*)")
_PARAM_RE = re.compile(r';\s*([^\s=;,]+)\s*(?:=\s*(?:"([^"]*)"|([^\s;,]*)))?')


def parse_link_header(value: str | None) -> dict[str, str]:
    """Parse an RFC 8288 ``Link`` header into ``{rel: url}`` (first link wins per rel)."""
    links: dict[str, str] = {}
    if not value:
        return links
    for match in _LINK_RE.finditer(value):
        url, params = match.group(1).strip(), match.group(2)
        for pmatch in _PARAM_RE.finditer(params):
            if pmatch.group(1).lower() != "rel":
                continue
            rels = pmatch.group(2) if pmatch.group(2) is not None else (pmatch.group(3) or "")
            for rel in rels.split():
                links.setdefault(rel.lower(), url)
    return links


def link_param(resp: httpx.Response, rel: str, name: str) -> str | None:
    """Return query parameter ``name`` of the ``rel`` link of ``resp``, or ``None``.

    Adapters take the page cursor from the link rather than following its URL:
    the link's host may differ from the configured one (proxies, recorded
    fixtures), and the token must only ever go to the configured host.
    """
    url = parse_link_header(resp.headers.get("link")).get(rel)
    if url is None:
        return None
    values = parse_qs(urlsplit(url).query, keep_blank_values=False).get(name)
    return values[0] if values else None


# --- ids and HTML ----------------------------------------------------------------------


@dataclass(frozen=True)
class GapCursor:
    """A newest-first scan that ran out of ``max_pages`` before its old cursor ``since``.

    The next poll resumes at ``page`` (the listing's own page token) until it meets ``since``, then moves on
    to ``newest`` (the cursor the first scan would have returned), so the items in between are offered, older
    ones before newer. ``since`` and ``newest`` are the adapter's own cursors, opaque here.
    """

    PREFIX: ClassVar[str] = "gap\x1f"
    SEP: ClassVar[str] = "\x1f"
    MAX_REFUSED: ClassVar[int] = 3  # resumes the listing refused (a page token can expire) before the gap is given up

    since: str
    newest: str
    page: str
    refused: int = 0

    def encode(self) -> str:
        """The persisted form: never a valid plain cursor of any adapter (they hold no control characters)."""
        return self.PREFIX + self.SEP.join([self.since, self.newest, self.page, str(self.refused)])

    @classmethod
    def decode(cls, cursor: str | None) -> GapCursor | None:
        """The gap ``cursor`` encodes, or None for a plain cursor (or a gap cursor that does not parse)."""
        if not cursor or not cursor.startswith(cls.PREFIX):
            return None
        parts = cursor[len(cls.PREFIX):].split(cls.SEP)
        if len(parts) != 4 or not parts[2] or not parts[3].isdigit():
            return None
        return cls(parts[0], parts[1], parts[2], int(parts[3]))

    def refused_once_more(self, log: Any, what: str, exc: PlatformError) -> str:
        """The cursor after the listing refused ``page``: the same gap counted once more, or (at the limit) the
        newest, leaving the gap to the adapter's re-find backstop."""
        refused = self.refused + 1
        log.warning("replyd.platform.gap_refused", what=what, refused=refused, problem=exc.detail,
                    abandoned=refused >= self.MAX_REFUSED)
        if refused >= self.MAX_REFUSED:
            return self.newest
        return GapCursor(self.since, self.newest, self.page, refused).encode()


def id_order(value: str) -> tuple[int, str]:
    """Sort key for numeric-string ids without converting them: shorter is older."""
    return (len(value), value)


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "br":
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "p":
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def html_to_text(html: str) -> str:
    """Strip tags from server-rendered HTML; ``<br>`` and ``</p>`` become newlines."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts).strip()


# --- ids and fields -------------------------------------------------------------------------


def seg(value: str, what: str) -> str:
    """Quote one path segment; refuse values that would walk the path."""
    if not value or value in (".", ".."):
        raise Rejected(f"{what}: id {value!r} is not usable in a URL path")
    try:
        return quote(value, safe="")
    except UnicodeEncodeError:  # a lone surrogate: no URL can carry it, and nothing was sent
        raise NotBuilt(f"{what}: request not built: an id in its path cannot be encoded (nothing sent)") from None


def iso_field(obj: Any, path: str, what: str) -> float:
    """The ISO-8601 time at ``path`` of ``obj`` in epoch seconds; ``BadResponse`` naming the field."""
    try:
        return iso_to_epoch(field(obj, path, what))
    except ValueError:
        raise BadResponse(f"{what}: field {path} is not an ISO-8601 time") from None


def served_id(obj: Any, path: str, what: str, *, default: Any = _MISSING) -> Any:
    """An id served as a JSON number (or string), as its exact decimal string (``default`` when absent)."""
    value = field(obj, path, what, (int, str), default=default)
    return value if value is default else str(value)


# --- the platform's clock -------------------------------------------------------------------

# Until a sample is taken, a window computed from the platform's time opens this much wider (a day).
UNMEASURED_WIDE_S = 86_400.0
# A measured offset past this (either way) is logged as ``replyd.platform.clock_skew``.
SKEW_WARN_S = 30.0


@dataclass(frozen=True)
class ClockSample:
    """One measurement: the platform's clock minus the local (injected) one, and how far off it can be."""

    offset_s: float  # the centre of the interval that holds the true offset
    error_s: float  # its half-width: half the round trip plus the served time's resolution
    kind: str  # "created" (a reply's created_at) or "date" (the Date header)


@functools.lru_cache(maxsize=64)
def _http_date_s(value: str) -> float | None:
    """An HTTP ``Date`` value as epoch seconds (None: unreadable). Cached: every bot's responses in one second
    carry the same text, and parsing it was a visible share of an empty poll's CPU."""
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


class PlatformClock:
    """The offset of one platform instance's clock from replyd's (``platform time - clock.now()``), measured.

    Samples come from responses: the ``created_at`` of a reply the platform just created (it was stamped
    between the request leaving and the answer arriving), or the ``Date`` header (1 s resolution). The
    estimate (``offset_s``) is the median of the recent samples of the best kind (created over Date); a window
    computed from the platform's time (``earliest``) uses the lowest offset any recent sample allows, so a
    clock that just stepped or a slow response only widens it. With no sample yet, ``earliest`` is a day
    early: the window errs wide. Thread-safe.
    """

    def __init__(self, now: Callable[[], float], *, platform: str, log: Any, warn_s: float = SKEW_WARN_S,
                 window: int = 31, on_change: Callable[[float], None] | None = None) -> None:
        self._now = now
        self.platform = platform
        self._log = log
        self.warn_s = warn_s
        self._samples: dict[str, deque[ClockSample]] = {"created": deque(maxlen=window), "date": deque(maxlen=window)}
        self._lock = threading.Lock()
        self._warned: float | None = None  # the offset last warned about (None: none past the threshold yet)
        self._on_change = on_change

    def note(self, platform_t: float, resolution_s: float, t0: float, t1: float, kind: str) -> None:
        """Add a sample: the platform read ``[platform_t, platform_t + resolution_s)`` between local ``t0`` and ``t1``."""
        if not (math.isfinite(platform_t) and math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
            return
        # The true offset lies in [platform_t - t1, platform_t + resolution_s - t0].
        lo, hi = platform_t - t1, platform_t + resolution_s - t0
        with self._lock:
            self._samples[kind].append(ClockSample((lo + hi) / 2.0, (hi - lo) / 2.0, kind))
        self._check()

    def note_date(self, resp: httpx.Response, t0: float, t1: float) -> None:
        """Sample the ``Date`` header of a response read between ``t0`` and ``t1`` (none, or several: no sample)."""
        values = resp.headers.get_list("date")
        if len(values) != 1:
            return
        when = _http_date_s(values[0])
        if when is not None:
            self.note(when, 1.0, t0, t1, "date")

    def note_created(self, created_at: float, t0: float, t1: float) -> None:
        """Sample a reply's ``created_at`` served in the answer to its create, sent at ``t0``, answered at ``t1``."""
        # A whole second is most likely a time served to the second (GitHub): it can be up to 1 s late.
        resolution = 1.0 if float(created_at).is_integer() else 0.001
        self.note(created_at, resolution, t0, t1, "created")

    def _best(self) -> list[ClockSample]:
        with self._lock:
            return list(self._samples["created"] or self._samples["date"])

    def offset_s(self) -> float | None:
        """The estimated offset (platform minus replyd) in seconds; None before the first sample."""
        samples = sorted(s.offset_s for s in self._best())
        # The lower median: always one sample's value, so a clock that changes moves it in one step, not
        # through averages of the old and the new (each of which would be warned about).
        return samples[(len(samples) - 1) // 2] if samples else None

    def low_s(self) -> float | None:
        """The lowest offset a recent sample allows (windows use it: they can only open wider); None unmeasured."""
        samples = self._best()
        return min((s.offset_s - s.error_s for s in samples), default=None)

    def earliest(self, local_t: float, unmeasured_s: float = UNMEASURED_WIDE_S) -> float:
        """The earliest platform time that local epoch ``local_t`` can be on the platform's clock
        (``unmeasured_s`` earlier while no sample is taken)."""
        low = self.low_s()
        return local_t - unmeasured_s if low is None else local_t + low

    def view(self) -> dict[str, Any]:
        """What ``replyd status`` shows: the offset (None unmeasured), its low bound, the samples behind it."""
        best = self._best()
        offset, low = self.offset_s(), self.low_s()
        return {"offset_s": None if offset is None else round(offset, 3),
                "low_s": None if low is None else round(low, 3),
                "samples": len(best), "source": best[0].kind if best else None}

    def _check(self) -> None:
        """Publish the estimate and warn once per change past the threshold."""
        offset = self.offset_s()
        if offset is None:
            return
        if self._on_change is not None:
            self._on_change(offset)
        last = self._warned
        if abs(offset) < self.warn_s and (last is None or abs(last) < self.warn_s):
            return
        if last is not None and abs(offset - last) < self.warn_s:
            return  # the same skew as the last warning: said once
        self._warned = offset
        self._log.warning("replyd.platform.clock_skew", platform=self.platform, offset_s=round(offset, 3),
                          threshold_s=self.warn_s, samples=len(self._best()),
                          hint="the platform's clock disagrees with replyd's; read-back windows follow the "
                               "platform's" if abs(offset) >= self.warn_s else "back within the threshold")


# --- the shared base of HTTP adapters ---------------------------------------------------------


def _url(value: str) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError("scheme must be http or https")
    if not parts.hostname:
        raise ValueError("no host")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    return value.strip().rstrip("/")


# An http(s) URL without credentials, query or fragment, kept without its trailing slash.
Url = Annotated[str, AfterValidator(_url)]


class HttpSettings(PlatformSettings):
    """Settings every HTTP adapter takes: its URLs (plain http only to loopback unless allowed), a timeout."""

    URLS: ClassVar[tuple[str, ...]] = ("base_url",)  # the fields that carry credentials to a host

    allow_insecure_http: bool = False  # let credentials travel over http:// to a non-loopback host
    timeout_s: float = Field(15.0, gt=0)  # per request
    # Let a reply's broadcast and third-party mentions ping (replyd.platforms.mentions); off: only the author.
    allow_mentions: bool = False

    @model_validator(mode="after")
    def _https(self, info: ValidationInfo) -> Self:
        values = dict(self)
        for key in self.URLS:
            if (url := values[key]) is not None:
                require_https(url, allowed=self.allow_insecure_http, where=f"{info.context['kind']} setting {key!r}")
        return self


class HttpPlatform:
    """The shared base of HTTP adapters: settings, client, clock, rate limits, request template, delete, repr.

    A subclass names its ``Settings`` model and ``root`` (the URL its requests go to), and overrides the
    hooks where its platform differs: ``_auth_headers`` (credentials), ``_buckets`` (which rate-limit
    budgets a request draws on), ``_limited``/``_wait_s``/``_error_text`` (how it says "rate limited",
    "wait" and "why") and ``_raise_for_status`` (error mapping beyond the shared table).
    """

    kind: ClassVar[str]
    Settings: ClassVar[type[HttpSettings]]
    BUCKET: ClassVar[str] = "api"  # the budget a request draws on unless it names another
    HEADERS: ClassVar[Mapping[str, str]] = {}  # sent with every request
    ITEM_ID: ClassVar[str] = "id"  # the field that names a skipped item in logs
    # How far before a row's opening (on the platform's clock, see PlatformClock) a read-back reads: the
    # platform may stamp a reply before its answer arrives, and its clock moves between samples.
    READ_BACK_MARGIN_S: ClassVar[float] = 60.0

    def __init__(self, settings: HttpSettings | None = None, /, *, http: httpx.Client, clock: Clock,
                 aclient: httpx.AsyncClient | None = None, **kw: Any) -> None:
        self.s = settings if settings is not None else self.Settings.load(self.kind, kw)
        self._http = http
        # The async client of ``StepSend.asend``: the caller's (``aclient``), else made on first use.
        self._aclient = aclient
        self._aclient_mine: tuple[asyncio.Future[httpx.AsyncClient], asyncio.AbstractEventLoop] | None = None
        self._clock = clock
        self._timeout = httpx.Timeout(self.s.timeout_s)
        # Read once: every request masks with these, and walking the settings cost ~4 % of an idle daemon's CPU.
        self._settings_secrets = _Secrets(v.get_secret_value() for v in dict(self.s).values()
                                          if isinstance(v, SecretStr))
        self._urls: dict[Any, httpx.URL] = _URLs()  # ``_url``'s parsed URLs
        self._auth = SecretAuth(self._auth_headers)
        self._me: Identity | None = None
        self.limits = RateLimits(clock.now)
        self.log = get_logger(f"replyd.{self.kind}")
        self.listing_delay_s = float(self.s.listing_delay_s)
        self.instance = self.s.instance or f"{self.kind}:{self.root}"
        # Every window sent to or compared with the platform's times is computed on its clock, measured here.
        self.platform_clock = PlatformClock(clock.now, platform=self.instance, log=self.log,
                                            on_change=lambda offset: metrics.platform_clock_offset(self.instance, offset))
        self._setup()

    def _at_names(self, parent: Parent, text: str) -> str:
        """``text`` as sent where a mention is ``@name``: all but the author's defused unless ``allow_mentions``."""
        return text if self.s.allow_mentions else mentions.at_names(text, keep=(parent.author_handle,))

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, http: httpx.Client, clock: Clock,
                      aclient: httpx.AsyncClient | None = None) -> Self:
        """Validate ``settings`` (``ConfigError`` names the key) and build the adapter."""
        return cls(cls.Settings.load(cls.kind, settings), http=http, clock=clock, aclient=aclient)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(instance={self.instance!r})"

    def clock_view(self) -> dict[str, Any]:
        """The platform's clock as measured (``MeasuresClock``): for ``replyd status``."""
        return self.platform_clock.view()

    @property
    def root(self) -> str:
        """The URL every request path is joined to."""
        return str(self.s.base_url)  # type: ignore[attr-defined]

    # --- hooks ---------------------------------------------------------------------------

    def _setup(self) -> None:
        """Build the adapter's own state from ``self.s`` (runs last in ``__init__``)."""

    def _auth_headers(self) -> Mapping[str, SecretStr]:
        """The credential headers of the next request."""
        return {"Authorization": SecretStr(f"Bearer {self.s.token.get_secret_value()}")}  # type: ignore[attr-defined]

    def _secrets(self) -> tuple[str, ...]:
        """Every secret value that must not reach a detail: the settings' ``SecretStr`` fields."""
        return self._settings_secrets

    def _buckets(self, bucket: str) -> tuple[str, ...]:
        """The rate-limit budgets a request named ``bucket`` draws on: its own and the account-wide one."""
        return (bucket,) if bucket == self.BUCKET else (self.BUCKET, bucket)

    def _limited(self, resp: httpx.Response) -> bool:
        """Whether a non-2xx response is a rate limit (HTTP 429; some platforms say so otherwise too)."""
        return resp.status_code == 429

    def _wait_s(self, resp: httpx.Response) -> float | None:
        """Seconds a rate limit asks to wait: ``Retry-After``, else the reset header (or what the body says)."""
        return retry_after_s(resp, self._clock.now())

    def _error_text(self, resp: httpx.Response) -> str:
        """The server's short error text for a detail: logs only, nothing branches on it (platforms localise it)."""
        return server_error_text(resp)

    def _raise_for_status(self, resp: httpx.Response, *, what: str, bucket: str = "", acts: bool | None = None) -> None:
        """Map a non-2xx response into ``replyd.errors``: a rate limit blocks ``bucket``, the rest the shared table."""
        if 200 <= resp.status_code < 300:
            return  # the usual case: no error text to read, no secrets to mask
        if self._limited(resp):
            wait = self._wait_s(resp)
            if wait is not None:
                self.limits.block(bucket or self.BUCKET, wait)
            self.log.warning(f"replyd.{self.kind}.rate_limited", what=what, bucket=bucket, status=resp.status_code,
                             wait_s=wait)
            raise RateLimited(self._detail(resp, what), status=resp.status_code, retry_after_s=wait)
        raise_for_status(resp, what=what, acts=acts, now=self._clock.now, secrets=self._secrets(),
                         text=self._error_text(resp))

    # --- the request template --------------------------------------------------------------

    def _request_steps(self, method: str, path: str, *, what: str, bucket: str | None = None,
                       acts: bool | None = None, auth: httpx.Auth | None | bool = True,
                       **kwargs: Any) -> HttpSteps[httpx.Response]:
        """One request under the rate limits, as steps; returns the response whatever its status."""
        bucket = bucket or self.BUCKET
        self.limits.check(self._buckets(bucket), what=what)
        kwargs["headers"] = {**self.HEADERS, **(kwargs.get("headers") or {})}
        try:
            url = self._url(path, kwargs.pop("params", None))
        except Exception as exc:  # noqa: BLE001 - a path or a query a value made unencodable: nothing left
            raise NotBuilt(redact(f"{what}: request not built: {type(exc).__name__}: {str(exc)[:160]} (nothing sent)",
                                  self._secrets())) from None
        t0 = self._clock.now()
        resp = yield from request_steps(method, url, what=what, acts=acts, secrets=self._secrets(),
                                        auth=self._auth if auth is True else (auth or None), timeout=self._timeout,
                                        **kwargs)
        self.platform_clock.note_date(resp, t0, self._clock.now())
        # A platform that names the budget a response drew on is trusted over our guess.
        self.limits.note(resp.headers.get("x-ratelimit-resource") or bucket, resp)
        return resp

    def _url(self, path: str, params: Any) -> httpx.URL:
        """``root + path`` with ``params`` as a parsed URL, the same as httpx would build, kept for the next
        request: a poll asks for the same URL until something new comes, and parsing it twice per request (the
        URL, then the URL with its query) was a tenth of an empty poll's CPU."""
        try:
            key = (path, params if params is None or isinstance(params, str) else
                   tuple(params.items() if isinstance(params, Mapping) else params))
            got = self._urls.get(key)
        except TypeError:  # an unhashable value (a list in a dict): built every time
            key, got = None, None
        if got is None:
            got = httpx.URL(self.root + path)
            if params:
                got = got.copy_merge_params(params)
            if key is not None:
                if len(self._urls) >= 256:  # a bound, not an LRU: a cursor that moves fills it slowly
                    self._urls.clear()
                self._urls[key] = got
        return got

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``_request_steps`` driven in the calling thread."""
        return self._drive(self._request_steps(method, path, **kwargs))

    def _call_steps(self, method: str, path: str, *, what: str, bucket: str | None = None, acts: bool | None = None,
                    **kwargs: Any) -> HttpSteps[httpx.Response]:
        """One request under the rate limits, as steps; returns a 2xx response or raises the mapped error."""
        resp = yield from self._request_steps(method, path, what=what, bucket=bucket, acts=acts, **kwargs)
        bucket = resp.headers.get("x-ratelimit-resource") or bucket or self.BUCKET
        self._raise_for_status(resp, what=what, bucket=bucket, acts=acts)
        return resp

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``_call_steps`` driven in the calling thread."""
        return self._drive(self._call_steps(method, path, **kwargs))

    def _drive(self, steps: HttpSteps[T]) -> T:
        """Run ``steps`` with the shared blocking client in the calling thread (the sync face, pollers, sweep)."""
        return run_sync(self._http, steps)

    def _detail(self, resp: httpx.Response, what: str) -> str:
        """``<what>: HTTP <status> (<error text>)`` with every secret masked."""
        text = self._error_text(resp)
        return redact(f"{what}: HTTP {resp.status_code}" + (f" ({text})" if text else ""), self._secrets())

    def _delete(self, method: str, path: str, reply_id: str, **kwargs: Any) -> None:
        """Delete one own reply; one that is already gone (404) counts as deleted."""
        try:
            self._call(method, path, what="delete", **kwargs)
        except Rejected as exc:
            if exc.status != 404:
                raise
            self.log.info(f"replyd.{self.kind}.deleted", reply_id=reply_id, already_gone=True)
            return
        self.log.info(f"replyd.{self.kind}.deleted", reply_id=reply_id, already_gone=False)

    def _edit(self, method: str, path: str, parent: Parent, reply_id: str, text: str, *,
              check: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """Replace one own reply's text (``EditReply``) with one acting request, logged by ``_edited``.

        An edit sets the whole text, so its errors keep the send table's meaning: a lost answer is ``MaybeSent``
        (the guard may repeat it), a refusal (gone, not editable, too long) ``Rejected``, read through the
        adapter's ``_refused`` as a send's. ``check`` runs first (a platform that accepts an edit of a gone reply
        reads it: its errors are the edit's).
        """
        def run() -> None:
            if check is not None:
                check()
            try:
                self._call(method, path, what="edit", **kwargs)
            except PlatformError as exc:
                raise self._refused(exc) from None

        self._edited(parent, reply_id, text, run)

    def _identity(self) -> Identity:
        """The bot's identity, asked once (``whoami`` fills the cache)."""
        return self._me if self._me is not None else self.whoami()

    def whoami(self) -> Identity:
        """Return the bot's stable identity (each adapter reads it its own way)."""
        raise NotImplementedError

    def _skipped(self, what: str, problem: BaseException | str, item: Any, ident: str | None = None) -> None:
        """Report an unreadable listing item that a poll skips (``unreadable.report``: the others are still
        offered), named ``ident`` or else by its ``ITEM_ID`` field."""
        unreadable.report(self.instance, what, ident or unreadable.item_id(item, self.ITEM_ID), problem)

    def _created_steps(self, method: str, path: str, parent: Parent, *, what: str,
                       read: Callable[[dict[str, Any]], T], **kwargs: Any) -> HttpSteps[T]:
        """Send a reply (one request, a failure logged), as steps; ``read`` names it from the 2xx body.

        A 2xx body ``read`` cannot read is ``MaybeSent``: the reply very likely exists, we just cannot name it.
        """
        t0 = self._clock.now()
        try:
            resp = yield from self._call_steps(method, path, what=what, **kwargs)
        except PlatformError as exc:
            raise self._send_failed(parent, self._refused(exc)) from None
        t1 = self._clock.now()
        try:
            body = json_body(resp, what, dict)
            created = self._created_at(body)
            if created is not None:
                self.platform_clock.note_created(created, t0, t1)
            return read(body)
        except BadResponse as exc:
            raise MaybeSent(f"{exc.detail} (after HTTP {resp.status_code})", status=resp.status_code) from None

    def _created(self, method: str, path: str, parent: Parent, **kwargs: Any) -> Any:
        """``_created_steps`` driven in the calling thread."""
        return self._drive(self._created_steps(method, path, parent, **kwargs))

    def _created_at(self, body: dict[str, Any]) -> float | None:
        """The platform's creation time in a create's 2xx body (``created_at``), or None: a clock sample."""
        try:
            return iso_to_epoch(body["created_at"]) if isinstance(body.get("created_at"), str) else None
        except ValueError:
            return None

    def _refused(self, exc: PlatformError) -> PlatformError:
        """What a failed send means on this platform (the error as mapped, unless the platform knows better)."""
        return exc

    def _send_failed(self, parent: Parent, exc: PlatformError) -> PlatformError:
        """Log a send that failed (the guard decides what it means) and hand the error back to raise."""
        self.log.info(f"replyd.{self.kind}.send_failed", parent_id=parent.id, error=type(exc).__name__,
                      status=exc.status, detail=exc.detail)
        return exc

    def _edited(self, parent: Parent, reply_id: str, text: str, edit: Callable[[], object]) -> None:
        """Run one edit of an own reply (``EditReply``; ``edit`` makes the request and raises the mapped error):
        logged as ``replyd.<kind>.edited`` or ``replyd.<kind>.edit_failed``, the error handed on for the guard."""
        try:
            edit()
        except PlatformError as exc:
            self.log.info(f"replyd.{self.kind}.edit_failed", platform=self.instance, parent_id=parent.id,
                          reply_id=reply_id, error=type(exc).__name__, status=exc.status, detail=exc.detail)
            raise
        self.log.info(f"replyd.{self.kind}.edited", platform=self.instance, parent_id=parent.id, reply_id=reply_id,
                      chars=len(text))

    def _read(self, what: str, item: Any, read: Callable[[dict[str, Any]], T], ident: str | None = None) -> T | None:
        """``read(item)``; ``None`` (reported by ``_skipped``) when the item is no object or ``read`` raises one
        of ``unreadable.ERRORS``: one item's failure, never the page's."""
        try:
            if not isinstance(item, dict):
                raise BadResponse(f"{what}: item is not an object")
            return read(item)
        except unreadable.ERRORS as exc:
            self._skipped(what, exc, item, ident)
            return None

    def _gap_refused(self, what: str, gap: GapCursor | None, page_no: int, exc: PlatformError) -> Page | None:
        """A gap's resume whose first page the listing refused (a 4xx: its page token expired, an offset past a
        limit): nothing offered and the gap counted once more, so a refused resume cannot stall the path
        forever. None when it is the poll's own failure (the caller raises it, and the cursor stays)."""
        if gap is None or page_no or not isinstance(exc, Rejected):
            return None
        return Page(parents=[], cursor=gap.refused_once_more(self.log, what, exc))

    def _partial(self, what: str, page_no: int, exc: PlatformError) -> None:
        """A listing's page failed: the first one raises ``exc``; after it, what was read is kept (logged)."""
        if page_no == 0:
            raise exc
        self.log.warning(f"replyd.{self.kind}.partial", what=what, pages=page_no, problem=exc.detail)

    def close(self) -> None:
        """Do nothing: the shared http client belongs to the caller."""

    async def _async_client(self) -> httpx.AsyncClient:
        """The async client for this loop: the caller's, else one this adapter made for the running loop (an
        ``AsyncClient``'s connections belong to the loop that opened them: another loop gets its own)."""
        if self._aclient is not None:
            return self._aclient
        loop = asyncio.get_running_loop()
        mine = self._aclient_mine
        if mine is None or mine[1] is not loop:
            # Built once per loop, on a thread: a new client loads the CA bundle into an SSL context, ~20 ms that
            # would stall every task on the loop (found by the loop-lag run's slow-callback log); the first sends
            # of a burst all wait for that one build (one each stalled the loop 100 ms through the thread pool).
            build = asyncio.ensure_future(asyncio.to_thread(make_async_client, self.s.timeout_s))
            mine = self._aclient_mine = (build, loop)
        return await mine[0]

    async def aclose(self) -> None:
        """Close the async client this adapter made (a caller's ``aclient`` stays the caller's)."""
        mine, self._aclient_mine = self._aclient_mine, None
        if mine is not None and mine[1] is asyncio.get_running_loop():
            try:
                client = await mine[0]
            except Exception:  # the build failed: there is no client to close (the send that awaited it said why)
                return
            await client.aclose()

    # --- read-back -------------------------------------------------------------------------

    def _horizon(self, opened_at: float) -> float:
        """The platform time a read-back for a row opened at local epoch ``opened_at`` must reach back to: its
        earliest time on the platform's clock, minus the margin (a day earlier while the clock is unmeasured)."""
        return self.platform_clock.earliest(opened_at) - self.READ_BACK_MARGIN_S

    def _covered(self, opened: Mapping[str, float], covered_after: float | None) -> set[str]:
        """The parents an own-feed listing complete after platform epoch ``covered_after`` settles."""
        if covered_after is None:
            return set()
        return {pid for pid, at in opened.items() if covered_after < self._horizon(at)}

    def _walk_feed(self, pages: Iterator[list[float]], horizon: float, source: str = "feed") -> float | None:
        """Page back through an own feed; return the epoch after which its listing is complete (for ``_covered``).

        ``pages`` notes each page's own replies and yields the page's item times, or ``[END]`` once the
        listing ran out (complete for all time); it just stops where paging cannot go on. Nothing read:
        ``None``. A page that fails ends the walk (logged): what the pages before covered stays.
        """
        covered_after: float | None = None
        page_no = 0
        try:
            for page_no, times in enumerate(pages, start=1):  # noqa: B007 - the except below logs the page it failed on
                if times:
                    covered_after = min(times if covered_after is None else [covered_after, *times])
                    if covered_after < horizon:
                        break
        except PlatformError as exc:
            self.log.warning(f"replyd.{self.kind}.read_back_failed", source=source, page=page_no, problem=exc.detail)
        return covered_after

    def read_parents(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """``ParentReplies``: the adapter's own ``read_back`` with the own-feed pass left out, so every parent
        is read by its per-parent (per-topic, per-issue, per-thread) listing."""
        token = _PER_PARENT.set(True)
        try:
            return self.read_back(pending, sender_id=sender_id)  # type: ignore[attr-defined]
        finally:
            _PER_PARENT.reset(token)

    @staticmethod
    def _per_parent() -> bool:
        """True inside ``read_parents``: an adapter whose fallback units depend on its feed lists every parent."""
        return _PER_PARENT.get()

    def _read_back(
        self,
        pending: Sequence[Pending],
        *,
        feed: Callable[[dict[str, float], Found], set[str]] | None,
        fallback: Callable[[str, list[str], Found], bool],
        units: Callable[[dict[str, float], set[str]], Iterable[tuple[str, list[str]]]] | None = None,
        sort_key: Callable[[str], Any] = id_order,
        source: tuple[str, str] = ("parent", "parent_id"),
    ) -> ReadBack:
        """The read-back skeleton: rows by open time, one own-feed pass, then a fallback per unit.

        ``feed(opened, found)`` reads the own feed once and returns the parents it settled. Each unit
        ``units(opened, checked)`` yields (default: every parent not yet checked) gets
        ``fallback(key, parent ids, found)``, True when it read them in full; a ``RateLimited`` stops the
        fallbacks (every further read would be refused the same way), another error skips the unit.
        Found replies are sorted oldest first, ties by ``sort_key`` of the reply id. ``source`` names the
        fallback and its key in the logs.
        """
        result = ReadBack()
        if not pending:
            return result
        opened: dict[str, float] = {}
        for p in pending:
            opened[p.parent.id] = min(p.opened_at, opened.get(p.parent.id, p.opened_at))
        found: Found = {}
        event = f"replyd.{self.kind}.read_back"
        if feed is not None and not _PER_PARENT.get():
            try:
                result.checked |= feed(opened, found)
            except PlatformError as exc:
                self.log.warning(event + "_failed", source="feed", problem=exc.detail)
        by_feed = len(result.checked)
        for key, pids in (units or _each_parent)(opened, result.checked):
            try:
                complete = fallback(key, pids, found)
            except PlatformError as exc:
                self.log.warning(event + "_failed", source=source[0], problem=exc.detail, **{source[1]: key})
                if isinstance(exc, RateLimited):
                    break
                continue
            if complete:
                result.checked.update(pids)
        for pid, replies in found.items():
            result.found[pid] = sorted(replies.values(), key=lambda r: (r.created_at or 0.0, sort_key(r.reply_id)))
        self.log.info(event, pending=len(opened), checked_by_feed=by_feed, checked=len(result.checked),
                      found=sum(len(v) for v in result.found.values()))
        return result


class StepSend:
    """Mixed into an ``HttpPlatform`` whose send is written once as steps (``_send_steps``, over
    ``_created_steps``): ``send`` drives them with the shared ``httpx.Client`` in the calling thread,
    ``asend`` (``platforms.base.AsyncSend``, awaited by ``replyd.aio``) with an ``httpx.AsyncClient`` on the
    event loop: the same requests, the same error table, bound and whole-send deadline."""

    def _send_steps(self, parent: Parent, text: str, *, provider_key: str) -> HttpSteps[Sent]:
        """The adapter's send as steps: every request it makes through ``yield from`` (never a blocking call)."""
        raise NotImplementedError

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Post ``text`` as a reply to ``parent`` in the calling thread (only the guard's faces call this)."""
        return self._drive(self._send_steps(parent, text, provider_key=provider_key))  # type: ignore[attr-defined]

    async def asend(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """The same send on the event loop, through the adapter's ``httpx.AsyncClient`` (no worker thread)."""
        return await run_async(await self._async_client(),  # type: ignore[attr-defined]
                               self._send_steps(parent, text, provider_key=provider_key))


# Set by ``HttpPlatform.read_parents``: ``_read_back`` skips the own-feed pass.
_PER_PARENT: contextvars.ContextVar[bool] = contextvars.ContextVar("replyd_per_parent", default=False)
# Own replies found so far: parent id -> reply id -> reply.
Found = dict[str, dict[str, OwnReply]]
# What an own-feed page yields once the listing ran out: it is complete for all time.
END = float("-inf")


def _each_parent(opened: Mapping[str, float], checked: set[str]) -> Iterator[tuple[str, list[str]]]:
    return ((pid, [pid]) for pid in opened if pid not in checked)
