"""The API's gate over real HTTP: Host check (DNS rebinding), the token on every route, bodies, headers."""

from __future__ import annotations

import base64
import hashlib
import re
from urllib.parse import urlsplit

import httpx
import pytest

from replyd.api import Api, ApiServer, check_bind
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.errors import ConfigError
from replyd.store import Store
from tests.api_harness import TOKEN, TOKEN_ENV, Harness, running, sim_world, write_config

READS = ("/", "/v1/status", "/metrics", "/readyz", "/openapi.json", "/v1/replies/sim/1")
LONG_TOKEN = "t" * 32


@pytest.fixture
def h(tmp_path, monkeypatch):
    """A sim and a daemon serving the API with a token on a loopback bind."""
    with running(tmp_path, monkeypatch) as harness:
        yield harness


def port(h: Harness) -> int:
    """The API's port."""
    return urlsplit(h.url).port or 0


def test_foreign_host_refused_on_every_route(h):
    """A Host naming another server (a DNS-rebinding page) is 400 on every route, token or not; nothing is sent."""
    evil = {"Host": f"evil.example:{port(h)}"}
    for token in (None, TOKEN):
        with h.client(token=token) as c:
            for path in READS:
                r = c.get(path, headers=evil)
                assert r.status_code == 400 and r.json()["error"] == "bad_host", (path, token, r.status_code)
            r = c.post("/v1/replies", headers=evil, json={"platform": "sim", "parent_id": h.parent(), "text": "x"})
            assert r.status_code == 400 and r.json()["error"] == "bad_host"
    assert h.world.creates_attempted == 0
    with h.client() as c:
        for host in (f"127.0.0.1:{port(h)}", f"localhost:{port(h)}", f"LocalHost.:{port(h)}", f"[::1]:{port(h)}"):
            assert c.get("/v1/status", headers={"Host": host}).status_code == 200, host
        # Liveness answers whatever the Host: it says nothing a page could use.
        assert c.get("/healthz", headers=evil).status_code == 200


def test_configured_host_names_are_served(tmp_path):
    """A name listed in hosts is served; an unlisted name is not; IP literals are (rebinding needs a name)."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    api = Api(store, {}, expected=[], token=TOKEN, hosts=["replyd.internal"])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ApiServer(api.app) as srv, httpx.Client(base_url=srv.url, headers=auth) as c:
        assert c.get("/v1/status", headers={"Host": "replyd.internal:8080"}).status_code == 200
        assert c.get("/v1/status", headers={"Host": "replyd.internal.evil.example"}).status_code == 400
        assert c.get("/v1/status", headers={"Host": "10.1.2.3:8787"}).status_code == 200
        assert c.get("/v1/status", headers={"Host": "bad host:x"}).status_code == 400
    store.dispose()


def test_wrong_tokens_write_one_warning_a_minute_with_the_count_held_back(tmp_path):
    """Anyone can send a wrong token: each request is refused, but the log gets one line a minute, the next one
    carrying how many were held back. Over HTTP, the API's gates (the routes' and the opened probes') share it.
    A wrong Host header is held back the same way."""
    from starlette.requests import Request
    from structlog.testing import capture_logs

    from replyd.api.gate import Gate, HostCheck, log
    from replyd.clock import FakeClock
    from replyd.quiet import Quiet

    clock = FakeClock()
    gate = Gate(None, token=LONG_TOKEN, hosts=HostCheck("127.0.0.1"), open_paths=frozenset(),
                quiet=Quiet(log, clock.now))

    def ask(token: str) -> int:
        headers = [(b"host", b"127.0.0.1:8787"), (b"authorization", f"Bearer {token}".encode())]
        refusal = gate.admit(Request({"type": "http", "method": "GET", "path": "/v1/status", "query_string": b"",
                                      "headers": headers}))
        return 200 if refusal is None else refusal.status_code

    def warnings(logs: list[dict]) -> list[tuple[str, int | None]]:
        return [(e["event"], e.get("suppressed")) for e in logs if e["log_level"] == "warning"]

    with capture_logs() as logs:
        answers = [ask("wrong") for _ in range(50)]
        clock.advance(61)
        answers += [ask("wrong"), ask(LONG_TOKEN)]
    assert answers == [401] * 51 + [200]
    assert warnings(logs) == [("replyd.api.unauthorized", None), ("replyd.api.unauthorized", 49)]

    def from_host(host: bytes) -> int:
        refusal = gate.admit(Request({"type": "http", "method": "GET", "path": "/v1/status", "query_string": b"",
                                      "headers": [(b"host", host)]}))
        return 200 if refusal is None else refusal.status_code

    with capture_logs() as logs:  # a wrong Host header is anyone's to send too
        answers = [from_host(b"evil.example") for _ in range(30)]
        clock.advance(61)
        answers.append(from_host(b"evil.example"))
    assert answers == [400] * 31
    assert warnings(logs) == [("replyd.api.bad_host", None), ("replyd.api.bad_host", 29)]

    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    api = Api(store, {}, expected=[], token=TOKEN, open_routes=["readyz"])
    wrong = {"Authorization": "Bearer wrong"}
    with capture_logs() as logs, ApiServer(api.app) as srv, httpx.Client(base_url=srv.url, headers=wrong) as c:
        assert [c.get(path).status_code for path in ("/v1/status", "/readyz") * 10] == [401, 200] * 10
    assert warnings(logs) == [("replyd.api.unauthorized", None)]
    store.dispose()


def test_token_needed_on_every_route_but_healthz(h):
    """On a loopback bind with a token, every route but /healthz answers 401 without it and 200 with it."""
    with h.client(token=None) as c:
        for path in READS[:-1]:
            r = c.get(path)
            assert r.status_code == 401, (path, r.status_code)
            assert "Bearer" in r.headers["WWW-Authenticate"]
        assert c.get(READS[-1]).status_code == 401
        assert c.get("/nope").status_code == 401  # unknown routes too: the gate comes first
        assert c.get("/healthz").status_code == 200
        basic = base64.b64encode(f"ops:{TOKEN}".encode()).decode()
        assert c.get("/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
    with h.client() as c:
        for path in READS[:-1]:
            assert c.get(path).status_code == 200, path
        assert c.get(READS[-1]).status_code == 404  # past the gate: no such row
        assert c.get("/openapi.json").json()["paths"]["/v1/status"]["get"]["security"] == [
            {"bearerAuth": []}, {"basicAuth": []}]


def test_an_opened_metrics_scraped_without_the_token_reads_the_store_once_per_window(tmp_path, monkeypatch):
    """Anyone may scrape an opened /metrics as often as they like: the row gauges come from one read every few
    seconds (counted on the store), while a scrape with the token reads the store each time."""
    with running(tmp_path, monkeypatch, api_extra='open_routes = ["metrics"]') as h:
        store, reads = h.daemon.store, []
        counts = store.counts
        monkeypatch.setattr(store, "counts", lambda *a, **kw: reads.append(1) or counts(*a, **kw))
        with h.client(token=None) as anon, h.client() as authed:
            pages = [anon.get("/metrics") for _ in range(20)]
            anonymous = len(reads)
            assert all(r.status_code == 200 and "replyd_store_up 1.0" in r.text for r in pages)
            for _ in range(3):
                assert "replyd_store_up 1.0" in authed.get("/metrics").text
        assert anonymous == 1 and len(reads) == 4


def test_the_store_gauges_read_once_per_window_and_again_after_it(store, clock):
    """StoreCollector's kept rows: one read per window however many scrapes, a new read once it passed."""
    from prometheus_client import generate_latest

    from replyd import metrics

    reads: list[int] = []
    counts = store.counts
    store.counts = lambda *a, **kw: reads.append(1) or counts(*a, **kw)
    reg = metrics.registry(store, store_cache_s=5.0)
    for _ in range(5):
        generate_latest(reg)
    clock.advance(4.9)
    generate_latest(reg)
    assert len(reads) == 1
    clock.advance(0.2)
    generate_latest(reg)
    assert len(reads) == 2


def test_open_routes_serve_probes_without_the_token(tmp_path, monkeypatch):
    """api.open_routes opens /readyz and /metrics (and nothing else); an unknown route name is a config error."""
    with running(tmp_path, monkeypatch, api_extra='open_routes = ["readyz", "metrics"]') as h:
        with h.client(token=None) as c:
            assert c.get("/readyz").status_code == 200 and c.get("/metrics").status_code == 200
            for path in ("/", "/v1/status", "/openapi.json"):
                assert c.get(path).status_code == 401, path
        with h.client() as c:
            sec = c.get("/openapi.json").json()["paths"]
        assert sec["/readyz"]["get"]["security"] == [{}] and sec["/metrics"]["get"]["security"] == [{}]
        assert sec["/v1/status"]["get"]["security"] == [{"bearerAuth": []}, {"basicAuth": []}]
    cfg = write_config(tmp_path / "bad.toml", "http://127.0.0.1:9", tmp_path / "b.sqlite3",
                       api_extra='open_routes = ["status"]')
    with pytest.raises(ConfigError, match="api.open_routes"):
        Config.load(cfg)


def test_public_bind_needs_a_32_character_token(tmp_path, monkeypatch):
    """A non-loopback bind refuses a token shorter than 32 characters before anything opens; loopback does not."""
    for short in ("x", "x" * 31):
        with pytest.raises(ConfigError, match="at least 32"):
            check_bind("0.0.0.0", short)
    check_bind("0.0.0.0", LONG_TOKEN)
    check_bind("127.0.0.1", "x")
    monkeypatch.setenv(TOKEN_ENV, "only-22-characters-xyz")
    with sim_world(monkeypatch) as (_world, srv, _bot):
        cfg = write_config(tmp_path / "c.toml", srv.base_url, tmp_path / "r.sqlite3", host="0.0.0.0")
        d = Daemon(Config.load(cfg))
        with pytest.raises(ConfigError, match="at least 32"):
            d.start()
        assert d.store is None and d.api is None


def test_deeply_nested_bodies_are_400(h):
    """A body nested past the parser's depth, at the top or inside a field, is 400 invalid_json; nothing is sent."""
    pid = h.parent()
    deep_array = b"[" * 30_000 + b"]" * 30_000
    deep_field = (b'{"platform": "sim", "parent_id": "' + pid.encode() + b'", "text": '
                  + b'{"a":' * 5_000 + b"1" + b"}" * 5_000 + b"}")
    with h.client() as c:
        for body in (deep_array, deep_field):
            r = c.post("/v1/replies", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"] == "invalid_json" and r.json()["field"] == "body"
    assert h.world.creates_attempted == 0


def test_every_answer_carries_the_security_headers(h):
    """The page (and every other answer, refusals included) has a CSP, X-Frame-Options DENY and nosniff."""
    with h.client() as c:
        page = c.get("/")
        answers = [page, c.get("/v1/status"), c.get("/healthz"), c.get("/nope"),
                   c.get("/", headers={"Authorization": "Bearer wrong"}),
                   c.get("/", headers={"Host": "evil.example"})]
    for r in answers:
        assert r.headers["X-Frame-Options"] == "DENY", r.request.url
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    # The CSP allows exactly the page's own inline style (by hash) and no script.
    style = re.search(r"<style>(.*?)</style>", page.text, re.S)
    assert style is not None
    digest = base64.b64encode(hashlib.sha256(style.group(1).encode()).digest()).decode()
    csp = page.headers["Content-Security-Policy"]
    assert f"style-src 'sha256-{digest}'" in csp and "script-src" not in csp and "unsafe-inline" not in csp
