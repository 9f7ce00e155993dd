"""Platform responses have a size limit: huge, lying or compressed-bomb bodies are refused, never read whole."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.errors import BadResponse, MaybeSent
from replyd.platforms import _http
from replyd.platforms.mastodon import MastodonPlatform

LIMIT = 64 * 1024
SENT = {"bytes": 0}


class Hostile(BaseHTTPRequestHandler):
    """Serves bodies far past the limit in the ways a broken or hostile server would."""

    def log_message(self, *a):
        """Keep test output quiet."""

    def _big_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"[" + b'"x",' * 4096
        try:
            for _ in range(2000):  # ~32 MB if the client kept reading
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                SENT["bytes"] += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return

    def do_GET(self):
        """GET /big: chunked, no length; /declared: a huge Content-Length; /bomb: gzip of 20 MB; /ok: small."""
        if self.path.startswith("/big"):
            return self._big_chunked()
        if self.path.startswith("/declared"):
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            return
        if self.path.startswith("/bomb"):
            return self._gzipped(b" " * (20 * 1024 * 1024))
        self._gzipped(json.dumps({"id": "42", "ok": True}).encode())

    def _gzipped(self, raw: bytes) -> None:
        body = gzip.compress(raw)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        """POST anything: a created-looking answer far past the limit."""
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._big_chunked()


@pytest.fixture(scope="module")
def server():
    """A real HTTP server on a free local port."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("path", ["/big", "/declared", "/bomb"])
def test_oversized_read_is_a_bad_response(server, path):
    """A read past the limit is a BadResponse naming the limit; the client stops reading early."""
    SENT["bytes"] = 0
    with httpx.Client(timeout=10.0) as c:
        with pytest.raises(BadResponse, match=rf"inbox: HTTP 200 response larger than {LIMIT} bytes; not read"):
            _http.request(c, "GET", server + path, what="inbox", max_bytes=LIMIT)
    assert SENT["bytes"] < 8 * 1024 * 1024  # far from the 32 MB the server would have sent


def test_oversized_answer_to_a_create_may_have_acted(server):
    """A create whose answer is too big may have landed: MaybeSent, so the row stays open for the sweep."""
    with httpx.Client(timeout=10.0) as c:
        with pytest.raises(MaybeSent, match="outcome unknown"):
            _http.request(c, "POST", server + "/api/v1/statuses", what="send", json={"status": "hi"}, max_bytes=LIMIT)


def test_small_compressed_body_reads_normally(server):
    """Under the limit, a gzip body is decoded once and parses as JSON."""
    with httpx.Client(timeout=10.0) as c:
        resp = _http.request(c, "GET", server + "/ok", what="probe", max_bytes=LIMIT)
    assert resp.status_code == 200 and resp.json() == {"id": "42", "ok": True}
    # As httpx's own read: the header tells the wire's form, the body kept is decoded, and read again as is.
    assert resp.headers["content-encoding"] == "gzip" and resp.read() == resp.content and resp.content[:1] == b"{"


def test_adapter_inbox_survives_a_huge_page(server):
    """The Mastodon adapter's default limit turns a 32 MB notifications page into a named BadResponse."""
    SENT["bytes"] = 0
    with httpx.Client(timeout=20.0) as c:
        plat = MastodonPlatform(base_url=server + "/big", token="t0k3n-secret", http=c, clock=FakeClock())
        with pytest.raises(BadResponse) as e:
            plat.inbox(None)
    assert f"larger than {_http.MAX_RESPONSE_BYTES} bytes" in str(e.value) and "t0k3n-secret" not in str(e.value)
    assert SENT["bytes"] < 2 * _http.MAX_RESPONSE_BYTES


def test_deeply_nested_json_is_a_bad_response():
    """JSON nested past the parser's recursion limit is a named BadResponse, not a RecursionError."""
    body = b'{"a":' * 5000 + b"1" + b"}" * 5000
    resp = httpx.Response(200, content=body, headers={"content-type": "application/json"})
    with pytest.raises(BadResponse, match="thread: JSON nested too deeply to parse"):
        _http.json_body(resp, "thread", dict)
    assert _http.server_error_text(httpx.Response(500, content=body)) == ""
