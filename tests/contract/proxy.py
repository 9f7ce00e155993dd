"""A fault-injecting HTTP proxy in front of a fake, the sim or a real server, for the adapter contract suite.

The servers behind it are real HTTP servers (the sim, the stateful forum
fakes, Synapse, the Bluesky dev-env); the proxy only changes what one request
meets, so an adapter is tested against the sockets and exceptions it meets in
production. A :class:`Rule` matches a request (method + a regular expression on
the decoded path and query) and does one of three things:

- ``answer``: reply with a canned status, headers and body, never forwarding
  (a 5xx before the server acted, a 429, a refusal);
- ``lose``: forward the request, let the server act, then hang up without an
  answer (a lost response);
- ``garble``: forward the request, let the server act, then answer its 2xx
  status with this body instead of the server's (an unreadable success);
- otherwise the request is forwarded unchanged.

A rule applies ``times`` times (``None``: until removed). The proxy counts the
requests each rule caught, so a test can check its fault was met.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import httpx

from tests.fixtures_server import Reply

_HOP = frozenset({"host", "content-length", "connection", "accept-encoding", "transfer-encoding"})


@dataclass
class Rule:
    """What the proxy does to requests matching ``method`` and ``pattern`` (searched in the decoded path?query)."""

    method: str
    pattern: str
    answer: Reply | None = None
    lose: bool = False
    garble: bytes | None = None
    times: int | None = 1
    hits: int = 0

    def matches(self, method: str, target: str) -> bool:
        """Whether this rule still applies to ``method target``."""
        if self.times is not None and self.hits >= self.times:
            return False
        return (self.method == "*" or self.method == method) and re.search(self.pattern, target) is not None


class _Handler(BaseHTTPRequestHandler):
    """Hands every request to the :class:`FaultProxy` that owns the server."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        """Keep the test output quiet."""

    def handle_one(self) -> None:
        """Forward, answer or lose this request."""
        self.server.proxy._handle(self)  # type: ignore[attr-defined]

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = handle_one


class FaultProxy:
    """A threaded HTTP proxy to ``upstream`` that applies :class:`Rule` s; ``url`` is what the adapter uses."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client = httpx.Client(trust_env=False, timeout=60)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []  # (method, decoded path?query) of every request seen
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.proxy = self  # type: ignore[attr-defined]
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="contract-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Base URL of the proxy, without trailing slash."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, rule: Rule) -> Rule:
        """Install ``rule`` (rules are tried in the order added) and return it."""
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and forget the recorded requests."""
        with self._lock:
            self.rules.clear()
            self.requests.clear()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def _rule_for(self, method: str, target: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, target))
            for rule in self.rules:
                if rule.matches(method, target):
                    rule.hits += 1
                    return rule
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(length) if length else b""
        rule = self._rule_for(h.command, unquote(h.path))
        if rule is not None and rule.answer is not None:
            answer = rule.answer
            self._reply(h, answer.status, {"content-type": answer.content_type, **answer.headers}, answer.encoded())
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        resp = self.client.request(h.command, self.upstream + h.path, headers=headers, content=body)
        if rule is not None and rule.lose:
            h.close_connection = True  # the server acted; its answer never reaches the client
            return
        passed = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        content = rule.garble if rule is not None and rule.garble is not None else resp.content
        self._reply(h, resp.status_code, passed, content)

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], content: bytes) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("content-length", str(len(content)))
        h.end_headers()
        h.wfile.write(content)
