"""The one threaded uvicorn runner (replyd.serve): it starts, serves over real HTTP, stops, and says why it cannot."""

from __future__ import annotations

import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from replyd.api import ApiServer
from replyd.errors import ConfigError
from replyd.serve import ThreadedServer


async def _hello(request: Request) -> PlainTextResponse:
    """Echo the path, so the test knows this app answered."""
    return PlainTextResponse(f"hello {request.url.path}")


APP = Starlette(routes=[Route("/{rest:path}", _hello)])


def test_serves_until_stopped():
    """start() returns once requests are accepted on an ephemeral port; stop() closes the port and ends the thread."""
    server = ThreadedServer(APP, name="t")
    assert server.start() is server
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}" and server.running
    with httpx.Client(base_url=server.url) as c:
        assert [c.get(f"/x{i}").text for i in range(3)] == ["hello /x0", "hello /x1", "hello /x2"]
    server.stop()
    assert not server.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/after")
    server.stop()  # a second stop is harmless


def test_context_manager_and_restart_on_a_fixed_port():
    """As a context manager it serves inside the block; the port it bound is free again once the block ends."""
    with ThreadedServer(APP, name="t") as first:
        port = first.port
        assert httpx.get(first.url + "/a").text == "hello /a"
    with ThreadedServer(APP, name="t", port=port) as again:
        assert again.port == port and httpx.get(again.url + "/b").text == "hello /b"


def test_bind_failure_is_one_clear_error_naming_the_server_and_address():
    """A port in use is a ConfigError naming the server and the address, raised by start(); no thread is left."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        server = ThreadedServer(APP, name="sim", port=port)
        with pytest.raises(ConfigError) as err:
            server.start()
        assert str(err.value) == f"sim: cannot listen on 127.0.0.1:{port}: Address already in use"
        assert not server.running
        with pytest.raises(ConfigError, match=rf"^api: cannot listen on 127\.0\.0\.1:{port}: "):
            ApiServer(APP, port=port).start()
    finally:
        taken.close()


def test_an_unbindable_address_is_named():
    """An address this machine does not have is refused the same way (the OS's words after the address)."""
    with pytest.raises(ConfigError, match=r"^api: cannot listen on 192\.0\.2\.1:0: "):
        ApiServer(APP, host="192.0.2.1").start()


def test_a_server_that_dies_while_starting_says_why():
    """If uvicorn's thread ends before it serves (here: an app it cannot import), start() raises with the cause."""
    server = ThreadedServer("no_such_module_for_replyd:app", name="t", start_timeout_s=10)
    with pytest.raises(ConfigError, match=r"^t: the server on http://127\.0\.0\.1:\d+ did not start: SystemExit"):
        server.start()
    assert not server.running
