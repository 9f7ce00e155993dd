"""One way to serve an ASGI app over real HTTP: uvicorn on a socket bound here, from a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import uvicorn

from replyd.errors import ConfigError
from replyd.log import get_logger

log = get_logger("replyd.serve")


def bind(host: str, port: int, *, what: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) with TCP_NODELAY; ConfigError naming ``what`` if not."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit it: without it uvicorn's separate header and body writes meet the client's
    # delayed ACK and every request after the first on a connection costs ~40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{what}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    """``http://host:port`` of a bound socket (an IPv6 host in brackets)."""
    bare = host.strip("[]")
    shown = f"[{bare}]" if sock.family == socket.AF_INET6 else bare
    return f"http://{shown}:{sock.getsockname()[1]}"


def uvicorn_config(app: Callable[..., Any], *, grace_s: float, log_level: str = "warning",
                   lifespan: str = "off", date_header: bool = True) -> uvicorn.Config:
    """The uvicorn settings every replyd server uses: asyncio, h11, no websockets, replyd's logging, no access log.

    ``date_header=False`` leaves the ``Date`` header to the app (a simulated platform serves its own clock's).
    """
    # h11: the sim's and the fixtures' drop faults rely on h11 closing the transport mid-body.
    return uvicorn.Config(app, loop="asyncio", http="h11", ws="none", lifespan=lifespan, log_config=None,
                          log_level=log_level, access_log=False, date_header=date_header,
                          timeout_graceful_shutdown=max(1, int(grace_s)))


@dataclass(eq=False)
class ThreadedServer:
    """Serves an ASGI app with uvicorn from a daemon thread; ``url`` and ``port`` are set once it listens."""

    app: Callable[..., Any]
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (``port`` holds the bound one after ``start``)
    name: str = "http"  # names the thread, the log events and the errors
    grace_s: float = 10.0
    start_timeout_s: float = 15.0
    log_level: str = "warning"
    date_header: bool = True  # uvicorn's Date (the machine's clock); False: the app serves its own
    url: str = field(default="", init=False)
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _failure: BaseException | None = field(default=None, init=False, repr=False)

    def start(self) -> Self:
        """Bind (ConfigError naming the address if it cannot), start serving, and wait until requests are accepted."""
        if self._server is not None:
            return self
        sock = bind(self.host, self.port, what=self.name)
        self.port = sock.getsockname()[1]
        self.url = url_of(sock, self.host)
        self._server = uvicorn.Server(uvicorn_config(self.app, grace_s=self.grace_s, log_level=self.log_level,
                                                     date_header=self.date_header))
        self._failure = None
        self._thread = threading.Thread(target=self._run, args=(self._server, sock), name=f"replyd-{self.name}",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                why = f": {type(self._failure).__name__}: {self._failure}" if self._failure else ""
                self.stop()
                sock.close()
                raise ConfigError(f"{self.name}: the server on {self.url} did not start{why}")
            time.sleep(0.005)  # polling uvicorn's started flag: it has no event to wait on
        log.info("replyd.serve.started", server=self.name, url=self.url)
        return self

    def _run(self, server: uvicorn.Server, sock: socket.socket) -> None:
        """The thread's body: serve until told to exit; keep what killed it for ``start``'s error."""
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported by start(), the thread has nowhere else to say it
            self._failure = exc
        finally:
            sock.close()

    @property
    def running(self) -> bool:
        """Whether the serving thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop accepting, finish running requests within the grace period, and return."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(self.grace_s + 5)
        self._server = self._thread = None
        log.info("replyd.serve.stopped", server=self.name, url=self.url)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
