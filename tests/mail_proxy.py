"""TCP proxies in front of the test mail servers that inject the faults a network and an MTA can answer.

:class:`SmtpFaultProxy` forwards SMTP line by line and applies, to the next message's ``DATA``, one queued fault:

- ``lost``: the end of the data reaches Postfix, which queues the message and answers ``250``; the proxy swallows
  the ``250`` and cuts both sides (the lost answer);
- ``error_before``: the proxy cuts both sides before the final ``.`` reaches Postfix (nothing is queued, but
  the client cannot know);
- ``garbled``: the ``250`` after the data is replaced by a line with no reply code (the message is queued);
- ``hold``: the message is queued and its ``250`` held back ``hold_s`` seconds (``holding`` is set: a test
  SIGKILLs the sender mid-send);
- ``pass``: nothing (a place-holder, so the faults after it meet later messages);
- ``refused`` / ``rate_limited`` / any ``"<code> <text>"``: the ``DATA`` command is answered by the proxy
  with that reply and never forwarded (nothing is queued).

:class:`CutProxy` forwards bytes both ways; ``cut()`` closes every open connection (an IMAP IDLE cut by the
network) and ``greet`` makes every new connection meet that line and a close instead of the server.
"""

from __future__ import annotations

import socket
import threading
from collections import deque

REPLIES = {"refused": "554 5.7.1 Message rejected by policy", "rate_limited": "451 4.7.1 Try again later"}


class _Listener:
    """A loopback listener on port 0 that hands each accepted client to ``handle`` on a thread of its own."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        except OSError:
            client.close()
            return
        with self.lock:
            self.open |= {client, upstream}
        try:
            self.handle(client, upstream)
        finally:
            self._drop(client, upstream)

    def handle(self, client: socket.socket, upstream: socket.socket) -> None:
        """Relay one connection."""
        raise NotImplementedError

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with self.lock:
                self.open.discard(s)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> int:
        """Close every open connection; return how many sockets were closed."""
        with self.lock:
            socks = list(self.open)
        self._drop(*socks)
        return len(socks)

    def close(self) -> None:
        """Stop listening and cut what is open."""
        self.closed = True
        self.sock.close()
        self.cut()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class CutProxy(_Listener):
    """Bytes both ways; ``cut()`` ends every connection, ``greet`` answers new ones with a line and a close."""

    greet: bytes | None = None

    def handle(self, client: socket.socket, upstream: socket.socket) -> None:
        """Relay until either side closes (or answer ``greet`` and close)."""
        if self.greet is not None:
            try:
                client.sendall(self.greet)
            except OSError:
                pass
            return
        t = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        t.start()
        _pipe(client, upstream)
        t.join(5)


class SmtpFaultProxy(_Listener):
    """SMTP line by line, with one queued fault applied per message (see the module docstring)."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.faults: deque[str] = deque()
        self.met: list[str] = []
        self.holding = threading.Event()  # set while a ``hold`` fault keeps a queued message's 250 back
        self.hold_s = 5.0

    def add(self, fault: str) -> None:
        """Queue ``fault`` for the next message's DATA."""
        self.faults.append(fault)

    def pending(self) -> int:
        """Faults queued and not met yet."""
        return len(self.faults)

    def handle(self, client: socket.socket, upstream: socket.socket) -> None:
        """Relay commands and replies; at DATA, apply the next fault."""
        cin, uin = client.makefile("rb"), upstream.makefile("rb")
        # Replies flow upstream -> client on this thread's partner, except the one after the data.
        state = {"swallow": None}
        done = threading.Event()

        def replies() -> None:
            try:
                while line := uin.readline():
                    fate = state["swallow"]
                    if fate is not None and line[3:4] == b" ":
                        state["swallow"] = None
                        if fate == "lost":
                            self.cut_pair(client, upstream)
                            return
                        if fate == "garbled":
                            line = b"what happened here\r\n"
                        if fate == "hold":  # queued on the server; the sender waits (a test kills it now)
                            self.holding.set()
                            threading.Event().wait(self.hold_s)
                    client.sendall(line)
            except OSError:
                pass
            finally:
                done.set()

        threading.Thread(target=replies, daemon=True).start()
        try:
            while line := cin.readline():
                if line.strip().upper() != b"DATA":
                    upstream.sendall(line)
                    continue
                fault = self.faults.popleft() if self.faults else None
                if fault is not None:
                    self.met.append(fault)
                if fault == "pass":  # a placeholder: this message goes through untouched
                    fault = None
                if fault is not None and fault not in ("lost", "error_before", "garbled", "hold"):
                    client.sendall((REPLIES.get(fault, fault) + "\r\n").encode())
                    continue
                upstream.sendall(line)
                while (data := cin.readline()) and data != b".\r\n":
                    upstream.sendall(data)
                if fault == "error_before" or not data:
                    self.cut_pair(client, upstream)
                    return
                if fault in ("lost", "garbled", "hold"):
                    state["swallow"] = fault
                upstream.sendall(data)
        except OSError:
            pass
        done.wait(5)

    def cut_pair(self, *socks: socket.socket) -> None:
        """Cut one relayed connection on both sides."""
        self._drop(*socks)
