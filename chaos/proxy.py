"""A small TCP proxy between replyd and PostgreSQL that can stop and start the database for one client.

The shared PostgreSQL server must never be stopped, so "the database stopped
and started" is what the proxy does to the connections of the replicas behind
it: ``outage()`` cuts every open connection (both directions closed, so a
query or a COMMIT in flight gets no answer) and refuses new ones until
``restore()``: a new connection is reset at once (the listening socket stays
bound, so no other process can take the port while the "database" is down).

``hold_answer(marker, hold_s)`` holds the database's answer instead: the next
request whose bytes contain ``marker`` reaches the server at once (it commits),
and what the server sends back on that connection is forwarded only ``hold_s``
later, as a slow network, a stalled proxy or a paused client would make it.
``OPEN_COMMIT`` is the marker of the guard's ``composing -> open`` commit.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

# The guard's composing -> open commit: its event kind "opened" as a text parameter of the PostgreSQL Bind
# message (an int32 length, then the bytes), which no query text ("opened_at") carries.
OPEN_COMMIT = struct.pack("!i", 6) + b"opened"


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``(host, port)``; ``outage``/``restore`` cut and refuse."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._listener: socket.socket | None = None
        self._down = False
        self._closed = False
        self.outages = 0
        self.cut_connections = 0
        self.held = 0  # answers held so far
        self.holding_until = 0.0  # monotonic time the last held answer is released
        self._hold: tuple[bytes, float] | None = None  # (marker, seconds) armed by hold_answer
        self._held_until: dict[int, float] = {}  # id(server socket) -> monotonic time its answer may go on

    def start(self) -> TcpProxy:
        """Listen on an ephemeral port."""
        self._listen()
        return self

    def _listen(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        self.port = s.getsockname()[1]
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True, name="chaos-proxy-accept").start()

    def _accept(self, lsock: socket.socket) -> None:
        while True:
            try:
                client, _ = lsock.accept()
            except OSError:
                return
            with self._lock:
                refused = self._down or self._closed
            if refused:
                # RST, not FIN: the client sees the connection reset, as by a server that is not there.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, server: socket.socket) -> None:
        to_server = dst is server
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if to_server:
                    self._arm_if_marked(data, server)
                else:
                    self._wait_if_held(server)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close_pair(src, dst)

    def _close_pair(self, a: socket.socket, b: socket.socket) -> None:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
        with self._lock:
            self._pairs = [p for p in self._pairs if a not in p and b not in p]

    def holds_over(self) -> bool:
        """Whether no answer is still held (an armed hold not yet met counts as over: it may never be met)."""
        return time.monotonic() >= self.holding_until

    def hold_answer(self, marker: bytes, hold_s: float) -> None:
        """Hold the answer to the next request carrying ``marker`` for ``hold_s`` seconds (once)."""
        with self._lock:
            self._hold = (marker, hold_s)

    def _arm_if_marked(self, data: bytes, server: socket.socket) -> None:
        # Armed before the request is forwarded, so the answer cannot overtake it.
        with self._lock:
            if self._hold is not None and self._hold[0] in data:
                self._held_until[id(server)] = time.monotonic() + self._hold[1]
                self.holding_until = max(self.holding_until, self._held_until[id(server)])
                self._hold = None
                self.held += 1

    def _wait_if_held(self, server: socket.socket) -> None:
        with self._lock:
            until = self._held_until.pop(id(server), None)
        if until is not None:
            time.sleep(max(0.0, until - time.monotonic()))

    def outage(self) -> None:
        """The database 'stops': cut every connection and refuse new ones."""
        with self._lock:
            self._down = True
            pairs, self._pairs = self._pairs, []
            self.outages += 1
            self.cut_connections += len(pairs)
        for a, b in pairs:
            self._close_pair(a, b)

    def restore(self) -> None:
        """The database 'starts' again: connections are forwarded again."""
        with self._lock:
            self._down = False

    def close(self) -> None:
        """Stop for good."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
        self.outage()
        self.outages -= 1
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it (Linux)
            except OSError:
                pass
            listener.close()
