"""What the platform fakes in ``replyd.sim`` share: a Starlette app served on a thread, a lost answer.

``AppServer`` serves an app with uvicorn on an ephemeral 127.0.0.1 port from a daemon thread.
``DropResponse`` sends the status line and half a body, then drops the connection: an answer lost
after the request acted.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from replyd.serve import ThreadedServer


class _Dropped(Exception):
    """Raised inside the app so uvicorn closes the connection mid-response."""


class DropResponse(Response):
    """Status line and headers, half a body, then the connection goes away (a response lost after acting)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"id":', "more_body": True})
        raise _Dropped("connection dropped on purpose")


class AppServer:
    """A Starlette (or any ASGI) app under uvicorn on 127.0.0.1, in a daemon thread."""

    def __init__(self, app: Any, *, name: str = "fake", port: int = 0) -> None:
        self.app, self.name, self.port = app, name, port
        self._server: ThreadedServer | None = None

    @property
    def url(self) -> str:
        """Base URL, without trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AppServer:
        """Bind (the port given, else an ephemeral one) and serve until ``stop``."""
        # No uvicorn Date: a fake's bodies carry its own clock's times.
        self._server = ThreadedServer(self.app, name=self.name, grace_s=1, log_level="critical",
                                      date_header=False, port=self.port).start()
        self.port = self._server.port
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._server is not None:
            self._server.stop()
            self._server = None
