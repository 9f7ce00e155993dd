"""replyd's HTTP clients keep no cookies: a platform's Set-Cookie never rides along on the next request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from replyd.platforms import _http

SEEN: list[str | None] = []


class Setter(BaseHTTPRequestHandler):
    """Sets a session cookie on every answer and records the Cookie header each request carried."""

    def log_message(self, *a: object) -> None:
        """Keep test output quiet."""

    def do_GET(self) -> None:
        """Answer ``{}`` with a cookie a careless client would send back."""
        SEEN.append(self.headers.get("Cookie"))
        body = b"{}"
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
