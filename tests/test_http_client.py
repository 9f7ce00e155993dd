"""replyd's HTTP clients keep no cookies (a platform's Set-Cookie never rides along on the next request), and an
adapter's reused request URLs are exactly the ones asked for."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from replyd.platforms import _http

SEEN: list[str | None] = []
PATHS: list[str] = []


class Setter(BaseHTTPRequestHandler):
    """Sets a session cookie on every answer and records the Cookie header each request carried."""

    def log_message(self, *a: object) -> None:
        """Keep test output quiet."""

    def do_GET(self) -> None:
        """Answer ``{}`` with a cookie a careless client would send back."""
        SEEN.append(self.headers.get("Cookie"))
        PATHS.append(self.path)
        body = b"[]" if self.path.startswith("/api/v1/notifications") else b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Set-Cookie", "session=from-bot-a; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server() -> Iterator[str]:
    """A real local HTTP server that sets cookies."""
    SEEN.clear()
    PATHS.clear()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Setter)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_the_sync_client_sends_back_no_cookie_it_was_given(server: str) -> None:
    """Two requests through ``make_client``: the second carries no Cookie, and the client holds none."""
    with _http.make_client(5.0) as client:
        for _ in range(2):
            _http.request(client, "GET", server + "/x", what="reading")
        assert SEEN == [None, None]
        assert not client.cookies
        with pytest.raises(ValueError, match="keep no cookies"):
            client.cookies = {"a": "b"}


def test_the_async_client_sends_back_no_cookie_it_was_given(server: str) -> None:
    """The same through ``make_async_client`` driven by ``run_async``."""

    async def go() -> None:
        """Two requests on one async client."""
        async with _http.make_async_client(5.0) as client:
            for _ in range(2):
                await _http.run_async(client, _http.request_steps("GET", server + "/x", what="reading"))
            assert not client.cookies

    asyncio.run(go())
    assert SEEN == [None, None]


def test_an_adapters_reused_urls_follow_the_cursor_and_the_params(server: str) -> None:
    """Polls with a cursor that moves and comes back ask for exactly their own query each time (URLs are kept)."""
    from replyd.clock import FakeClock
    from replyd.platforms.mastodon import MastodonPlatform

    with _http.make_client(5.0) as client:
        plat = MastodonPlatform(MastodonPlatform.Settings.load("mastodon", {"base_url": server, "token": "t0ken"}),
                                http=client, clock=FakeClock())
        for cursor in ("100", "100", "205", "100", None):
            plat.inbox(cursor)
    assert PATHS == ["/api/v1/notifications?types%5B%5D=mention&limit=40" + (f"&min_id={c}" if c else "")
                     for c in ("100", "100", "205", "100", None)]


def test_building_an_async_client_imports_what_its_first_request_would() -> None:
    """``make_async_client`` (run on a thread by the adapters) imports anyio's asyncio backend, so a client's first
    request does not import it on the loop (~20 ms there). A fresh interpreter, so nothing is imported yet."""
    import subprocess
    import sys

    code = ("import sys; from replyd.platforms._http import make_async_client; "
            "assert 'anyio._backends._asyncio' not in sys.modules, 'imported before'; make_async_client(5.0); "
            "print('anyio._backends._asyncio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", (out.stdout, out.stderr[-500:])
