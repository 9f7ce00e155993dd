"""A real local HTTP server for adapter tests: recorded bodies and injected faults over uvicorn.

Adapters are tested against real sockets, not transport mocks, so the
exceptions they map are the ones httpx raises in production. Import the
fixtures into a test module::

    from tests.fixtures_server import fixture_server, fixture_server_session, http_client  # noqa: F401

``fixture_server.route(method, path, *replies)`` answers the replies in order
(the last one repeats); a reply may be a callable taking the recorded request.
Unrouted requests get a 404 ``{"error": "no route"}`` and are still recorded.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from replyd.serve import ThreadedServer
from replyd.sim.fakes import DropResponse


_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "fixtures",  # the team checkout layout
    Path("/work/shared/fixtures"),  # this machine, whatever directory CI clones into
)


def fixtures_root() -> Path:
    """Where the recorded fixtures live: ``$REPLYD_FIXTURES``, else the first known place that exists."""
    env = os.environ.get("REPLYD_FIXTURES")
    if env:
        return Path(env)
    return next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])


def fixtures_dir(platform: str) -> Path:
    """Return the recorded fixtures of ``platform``; skip if absent (fail under CI=true)."""
    path = fixtures_root() / platform
    if not path.is_dir():
        why = f"recorded {platform} fixtures not found at {path} (set REPLYD_FIXTURES to their parent)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def load_fixture(platform: str, name: str) -> bytes:
    """Return a recorded body byte for byte."""
    path = fixtures_dir(platform) / name
    if not path.is_file():
        pytest.skip(f"recorded fixture {path} is missing")
    return path.read_bytes()


def http_date(t: float) -> str:
    """Epoch ``t`` as an HTTP ``Date`` header value (whole seconds, as servers send it)."""
    return email.utils.formatdate(int(t), usegmt=True)


@dataclass
class Reply:
    """One canned answer: status, body (bytes/str raw, anything else JSON-encoded), headers, faults.

    ``delay_s`` sleeps before answering (timeouts); ``fault="drop"`` sends the
    status line and headers, then closes the connection mid-body.
    """

    status: int = 200
    body: Any = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json; charset=utf-8"
    delay_s: float = 0.0
    fault: str | None = None

    def encoded(self) -> bytes:
        """Return the body as bytes."""
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str):
            return self.body.encode()
        return json.dumps(self.body).encode()


def html_error(status: int, title: str = "Bad Gateway") -> Reply:
    """A proxy-style HTML error page, as nginx serves in front of a sick app server."""
    page = f"<html><head><title>{status} {title}</title></head><body><h1>{title}</h1></body></html>"
    return Reply(status=status, body=page, content_type="text/html")


@dataclass
class Recorded:
    """A request as the server saw it."""

    method: str
    path: str
    query: list[tuple[str, str]]
    headers: dict[str, str]
    body: bytes

    def param(self, name: str) -> str | None:
        """Return the first query parameter ``name``."""
        return next((v for k, v in self.query if k == name), None)

    def form(self) -> dict[str, str]:
        """Return the urlencoded form body (or the JSON object body) as a dict."""
        ctype = self.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            return json.loads(self.body)
        return dict(parse_qsl(self.body.decode(), keep_blank_values=True))


Handler = Reply | Callable[[Recorded], Reply]


class FixtureServer:
    """Starlette app under uvicorn on an ephemeral 127.0.0.1 port, in a daemon thread."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], list[Handler]] = {}
        self._lock = threading.Lock()
        self.requests: list[Recorded] = []
        self.port = 0
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        self._app = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=methods)])
        self._server: ThreadedServer | None = None

    @property
    def url(self) -> str:
        """Base URL, without trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Bind an ephemeral port and serve until ``stop``."""
        # No uvicorn Date: a recorded body's times are not this machine's clock, and a Date header that
        # disagrees with them would be measured as the platform's clock skew (a test that wants one routes it).
        self._server = ThreadedServer(self._app, name="fixture-server", grace_s=1, log_level="critical",
                                      date_header=False).start()
        self.port = self._server.port

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._server is not None:
            self._server.stop()

    def reset(self) -> None:
        """Forget routes and recorded requests."""
        with self._lock:
            self._routes.clear()
            self.requests.clear()

    def route(self, method: str, path: str, *replies: Handler) -> None:
        """Answer ``method path`` with ``replies`` in order; the last one repeats."""
        if not replies:
            raise ValueError("route needs at least one reply")
        with self._lock:
            self._routes[(method.upper(), path)] = list(replies)

    def requests_to(self, method: str, path: str) -> list[Recorded]:
        """Recorded requests for ``method path``, in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.method == method.upper() and r.path == path]

    def _next(self, rec: Recorded) -> Reply:
        with self._lock:
            queue = self._routes.get((rec.method, rec.path))
            if not queue:
                return Reply(status=404, body={"error": "no route"})
            handler = queue.pop(0) if len(queue) > 1 else queue[0]
        return handler(rec) if callable(handler) else handler

    async def _endpoint(self, request: Request) -> Response:
        rec = Recorded(
            method=request.method,
            path=request.url.path,
            query=list(request.query_params.multi_items()),
            headers={k.lower(): v for k, v in request.headers.items()},
            body=await request.body(),
        )
        with self._lock:
            self.requests.append(rec)
        reply = self._next(rec)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.fault == "drop":
            return DropResponse(status_code=reply.status)
        headers = {"content-type": reply.content_type, **reply.headers}
        return Response(content=reply.encoded(), status_code=reply.status, headers=headers)


class DroppingServer:
    """A raw TCP server that reads a whole HTTP request and closes without answering."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self.port = self._sock.getsockname()[1]
        self.received: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, name="dropping-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Base URL, without trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value.strip())
                    while len(rest) < length:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        rest += chunk
                    self.received.append(head + b"\r\n\r\n" + rest)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop accepting (shutdown wakes the blocked accept; close alone does not)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connections are refused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def fixture_server_session() -> Iterator[FixtureServer]:
    """One uvicorn server for the whole session."""
    server = FixtureServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fixture_server(fixture_server_session: FixtureServer) -> Iterator[FixtureServer]:
    """The session server with routes and recorded requests cleared for this test."""
    fixture_server_session.reset()
    yield fixture_server_session
    fixture_server_session.reset()


@pytest.fixture
def dropping_server() -> Iterator[DroppingServer]:
    """A server that swallows each request and hangs up without a response."""
    server = DroppingServer()
    yield server
    server.close()


@pytest.fixture
def http_client() -> Iterator[httpx.Client]:
    """A shared httpx client that ignores proxy settings from the environment."""
    with httpx.Client(trust_env=False) as client:
        yield client
