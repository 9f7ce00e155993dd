"""The sidecar API over real HTTP: every status of POST /v1/replies, auth, history, rearm, readiness."""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import httpx
import pytest

from replyd import store as st
from replyd.api import Api, ApiServer, check_bind, is_loopback
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.errors import ConfigError, ContentionError
from replyd.store import Store
from replyd.transitions import planting
from tests.api_harness import TOKEN, TOKEN_ENV, Harness, replyd_cli, running, sim_world, write_config


@pytest.fixture
def h(tmp_path, monkeypatch):
    """A sim and a daemon serving the API with a token."""
    with running(tmp_path, monkeypatch) as harness:
        yield harness


def post(h: Harness, parent_id: str, text: str = "thanks!", **kw) -> httpx.Response:
    """POST /v1/replies for the sim bot."""
    with h.client() as c:
        return c.post("/v1/replies", json={"platform": "sim", "parent_id": parent_id, "text": text, **kw})


def test_posted_201_then_already_answered_200(h):
    """The first post answers 201 with the reply id; a reworded retry answers 200 with the same id, nothing sent."""
    pid = h.parent()
    r = post(h, pid)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "posted" and body["reply_id"] and body["parent_id"] == pid
    assert body["bot"] == "sim" and body["platform"] == h.instance and body["sender_id"] == h.bot.id
    creates = h.world.creates_attempted
    again = post(h, pid, "a completely different wording")
    assert again.status_code == 200 and again.json()["status"] == "already_answered"
    assert again.json()["reply_id"] == body["reply_id"]
    assert h.bot_replies(pid) == 1 and h.world.creates_attempted == creates


def test_platform_may_be_the_instance(h):
    """The platform field accepts the platform instance as well as the bot name."""
    pid = h.parent()
    with h.client() as c:
        r = c.post("/v1/replies", json={"platform": h.instance, "parent_id": pid, "text": "hi", "path": "agent-x"})
    assert r.status_code == 201, r.text
    assert Store.open(f"sqlite:///{h.db}").get(st.Key(h.instance, h.bot.id, pid)).path == "agent-x"


def test_lost_response_202_uncertain_then_in_flight(h):
    """A send whose response is lost answers 202 uncertain; a retry answers 202 in flight and sends nothing."""
    pid = h.parent()
    h.world.queue_faults(next_creates=["lost_504"])
    r = post(h, pid)
    assert r.status_code == 202 and r.json()["status"] == "uncertain" and r.json()["state"] == "open"
    again = post(h, pid)
    assert again.status_code == 202 and again.json()["status"] == "in_flight"
    assert h.world.creates_attempted == 1 and h.bot_replies(pid) == 1


def test_rejected_409_is_terminal(h):
    """A reply the platform refuses answers 409 rejected, and a retry is refused without a send."""
    pid = h.parent()
    r = post(h, pid, "x" * 600)  # over the sim's 500-character limit
    assert r.status_code == 409 and r.json()["status"] == "rejected"
    again = post(h, pid, "short now")
    assert again.status_code == 409 and again.json()["status"] == "rejected"
    assert h.world.creates_attempted == 1 and h.bot_replies(pid) == 0


def test_rate_limited_429_with_retry_after(h):
    """A 429 from the platform answers 429 not_sent with Retry-After; nothing landed."""
    pid = h.parent()
    h.world.queue_faults(next_creates=["rate_limit_429"])
    r = post(h, pid)
    assert r.status_code == 429 and r.json()["status"] == "not_sent"
    assert int(r.headers["Retry-After"]) >= 1
    assert h.bot_replies(pid) == 0


def test_shutting_down_503_sends_nothing(h):
    """A guard that stopped claiming answers 503 not_sent with Retry-After; the platform gets no create."""
    pid = h.parent()
    h.daemon.guards["sim"].claiming = False
    r = post(h, pid)
    assert r.status_code == 503 and r.json()["status"] == "not_sent" and "shutting down" in r.json()["detail"]
    assert "Retry-After" in r.headers
    assert h.world.creates_attempted == 0 and h.bot_statuses() == 0


def _busy(*args: object, **kwargs: object) -> None:
    """What the store raises once another writer held the lock past its busy timeout (30 s on SQLite)."""
    raise ContentionError("store busy: held")


def test_broken_store_503_and_nothing_sent(h, monkeypatch):
    """A store error is 503 on every route that reads a row (busy: store_busy, Retry-After 1; unreadable:
    store_unavailable, Retry-After 5), never a 500; with the store unreadable the sim counts zero creates."""
    pid = h.parent()
    store = h.daemon.store
    with monkeypatch.context() as m, h.client() as c:
        m.setattr(store, "get", _busy)  # the read of GET
        m.setattr(store, "transaction", _busy)  # rearm reads and writes in one transaction
        for r in (c.get(f"/v1/replies/sim/{pid}"), c.post(f"/v1/replies/sim/{pid}/rearm")):
            assert r.status_code == 503 and r.json()["error"] == "store_busy", r.text
            assert r.headers["Retry-After"] == "1" and r.json()["detail"].startswith("store busy: held")
    store.dispose()
    h.db.write_bytes(b"not a database " * 1000)
    for suffix in ("-wal", "-shm"):
        Path(f"{h.db}{suffix}").unlink(missing_ok=True)
    r = post(h, pid)
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "store_unavailable" and "nothing sent" in r.json()["detail"]
    assert h.world.creates_attempted == 0 and h.bot_statuses() == 0
    with h.client() as c:
        for r in (c.get(f"/v1/replies/sim/{pid}"), c.post(f"/v1/replies/sim/{pid}/rearm")):
            assert r.status_code == 503 and r.json()["error"] == "store_unavailable", r.text
            assert r.headers["Retry-After"] == "5"
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["store"]["up"] is False
        assert c.get("/v1/status").status_code == 503
        assert "replyd_store_up 0.0" in c.get("/metrics").text
        assert c.get("/healthz").status_code == 200


def test_bad_bodies_400_and_422_name_the_field(h):
    """Malformed JSON is 400; a missing, mistyped or unknown field is 422 naming it; nothing is sent."""
    with h.client() as c:
        bad = c.post("/v1/replies", content=b'{"platform": "sim",', headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["field"] == "body"
        cases = [
            ({"platform": "sim", "parent_id": "1"}, "text"),
            ({"platform": "sim", "parent_id": 1, "text": "x"}, "parent_id"),
            ({"platform": "sim", "parent_id": "1", "text": "   "}, "text"),
            ({"platform": "sim", "parent_id": "1", "text": "x", "colour": "red"}, "colour"),
            ({"platform": "", "parent_id": "1", "text": "x"}, "platform"),
        ]
        for body, field in cases:
            r = c.post("/v1/replies", json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["field"] == field and field in r.json()["detail"]
        arr = c.post("/v1/replies", json=["not", "an", "object"])
        assert arr.status_code == 422 and arr.json()["field"] == "body"
        form = c.post("/v1/replies", content=b"platform=sim", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert form.status_code == 415
        huge = c.post("/v1/replies", content=b'{"text": "' + b"x" * 70_000 + b'"}', headers={"Content-Type": "application/json"})
        assert huge.status_code == 413
    assert h.world.creates_attempted == 0


def test_unknown_platform_and_unknown_parent_404(h):
    """An unknown bot and a parent the platform does not know are 404 naming the field; nothing is sent."""
    r = post(h, h.parent(), platform="nobody")
    assert r.status_code == 404 and r.json()["field"] == "platform"
    r = post(h, "999999")
    assert r.status_code == 404 and r.json()["error"] == "unknown_parent" and r.json()["field"] == "parent_id"
    assert h.world.creates_attempted == 0


def test_resolve_failure_502_sends_nothing(h):
    """When the platform cannot be reached to resolve the parent, 502 says so and no row is claimed."""
    pid = h.parent()
    h.sim.stop()
    r = post(h, pid)
    assert r.status_code == 502 and r.json()["error"] == "resolve_failed" and "nothing sent" in r.json()["detail"]
    assert Store.open(f"sqlite:///{h.db}").get(st.Key(h.instance, h.bot.id, pid)) is None
    assert h.world.creates_attempted == 0


def test_twenty_concurrent_clients_one_send(h):
    """Twenty clients posting one parent at once cause exactly one create on the platform."""
    pid = h.parent()
    codes: list[int] = []
    barrier = threading.Barrier(20)

    def one(i: int) -> None:
        """Wait for all, then post with a text of its own."""
        with h.client() as c:
            barrier.wait()
            codes.append(c.post("/v1/replies", json={"platform": "sim", "parent_id": pid, "text": f"reply {i}"}).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(codes) == 20
    assert codes.count(201) == 1 and set(codes) <= {200, 201, 202}, codes
    assert h.world.creates_attempted == 1 and h.bot_replies(pid) == 1


def test_writes_need_the_token(h):
    """Writes without a token, with a wrong one, or with Basic credentials are 401; nothing is sent."""
    pid = h.parent()
    body = {"platform": "sim", "parent_id": pid, "text": "x"}
    with h.client(token=None) as c:
        r = c.post("/v1/replies", json=body)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
        assert c.post("/v1/replies", json=body, headers={"Authorization": "Bearer wrong-token"}).status_code == 401
        basic = base64.b64encode(f"x:{TOKEN}".encode()).decode()
        assert c.post("/v1/replies", json=body, headers={"Authorization": f"Basic {basic}"}).status_code == 401
        assert c.post(f"/v1/replies/sim/{pid}/rearm").status_code == 401
        # With a token configured, reads need it too, even on a loopback bind.
        assert c.get("/v1/status").status_code == 401
        assert c.get("/v1/status", headers={"Authorization": "Bearer wrong-token"}).status_code == 401
    assert h.world.creates_attempted == 0


def test_writes_refused_403_without_a_configured_token(tmp_path, monkeypatch):
    """With no token configured the API still serves reads, and refuses every write with 403 and a clear message."""
    with running(tmp_path, monkeypatch, token=None) as h:
        r = post(h, h.parent())
        assert r.status_code == 403 and "token_env" in r.json()["detail"]
        with h.client(token=None) as c:
            assert c.post("/v1/rearm", json={"dry_run": True}).status_code == 403
        with h.client(token=None) as c:
            assert c.get("/v1/status").status_code == 200
        assert h.world.creates_attempted == 0


def test_public_bind_without_token_refused_at_start(tmp_path, monkeypatch):
    """A non-loopback bind with no token stops the daemon before it opens anything (library and CLI)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.org")
    with pytest.raises(ConfigError, match="token"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "some-token-of-at-least-32-characters")
    with sim_world(monkeypatch) as (_world, srv, _bot):
        cfg = write_config(tmp_path / "c.toml", srv.base_url, tmp_path / "r.sqlite3", host="0.0.0.0", token_env=None)
        d = Daemon(Config.load(cfg))
        with pytest.raises(ConfigError, match="api.host.*token"):
            d.start()
        assert d.store is None and d.api is None
        r = replyd_cli("run", "--config", str(cfg), env={"SIM_TOKEN": os.environ["SIM_TOKEN"]})
        assert r.returncode == 2 and "api.host" in r.stderr and "token" in r.stderr, r.stderr
        # A named but unset token variable is a config error too.
        cfg2 = write_config(tmp_path / "c2.toml", srv.base_url, tmp_path / "r.sqlite3", host="0.0.0.0")
        with pytest.raises(ConfigError, match=TOKEN_ENV):
            Daemon(Config.load(cfg2)).start()


def test_reads_need_the_token_when_public(tmp_path, monkeypatch):
    """On a public bind, reads need the token (Bearer, or Basic for browsers); only liveness stays open."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    api = Api(store, {}, expected=[], token=TOKEN, host="0.0.0.0")
    with ApiServer(api.app) as srv, httpx.Client(base_url=srv.url) as c:
        for path in ("/v1/status", "/metrics", "/", "/v1/replies/sim/1", "/readyz", "/openapi.json"):
            r = c.get(path)
            assert r.status_code == 401, path
            assert "Basic" in r.headers["WWW-Authenticate"]
        assert c.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        basic = base64.b64encode(f"ops:{TOKEN}".encode()).decode()
        assert c.get("/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        assert c.get("/healthz").status_code == 200
        assert c.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()[
            "paths"]["/v1/status"]["get"]["security"] == [{"bearerAuth": []}, {"basicAuth": []}]
    store.dispose()


@pytest.fixture
def h_patient(tmp_path, monkeypatch):
    """``h`` with a send budget past the adapter's timeout: its sends must land even on a loaded machine."""
    with running(tmp_path, monkeypatch, send_timeout_s=5.0) as harness:
        yield harness


def test_history_and_rearm_via_api(h_patient):
    """GET shows the rejected key's history; rearm releases it once; the next post answers; events record it.
    The second send must land: under load a 1 s budget made it uncertain (202), so this bot waits 5 s."""
    h = h_patient
    pid = h.parent()
    assert post(h, pid, "x" * 600).status_code == 409
    with h.client() as c:
        got = c.get(f"/v1/replies/sim/{pid}")
        assert got.status_code == 200
        doc = got.json()
        assert doc["row"]["state"] == "rejected" and doc["parent"]["id"] == pid
        assert [e["kind"] for e in doc["events"]] == ["claimed", "rejected"]
        assert c.get(f"/v1/replies/sim/{pid}-nope").status_code == 404
        assert c.post(f"/v1/replies/sim/{pid}-nope/rearm").status_code == 404
        r = c.post(f"/v1/replies/sim/{pid}/rearm")
        assert r.status_code == 200, r.text
        assert r.json()["previous_state"] == "rejected" and r.json()["row"]["state"] == "released"
        again = c.post(f"/v1/replies/sim/{pid}/rearm")
        assert again.status_code == 409 and again.json()["state"] == "released"
    ok = post(h, pid, "short enough")
    assert ok.status_code == 201 and h.bot_replies(pid) == 1
    with h.client() as c:
        kinds = [e["kind"] for e in c.get(f"/v1/replies/sim/{pid}").json()["events"]]
    assert kinds == ["claimed", "rejected", "rearmed", "claimed", "closed"]
    with h.client() as c:
        closed = c.post(f"/v1/replies/sim/{pid}/rearm")
    assert closed.status_code == 409 and closed.json()["state"] == "closed"


def test_health_ready_status_and_unknown_routes(h):
    """healthz and readyz answer; readyz lists the bot; unknown routes and methods are JSON 404/405."""
    with h.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["bots"] == {"sim": True}
        assert c.get("/nope").status_code == 404 and c.get("/nope").json()["error"] == "not_found"
        r = c.delete("/v1/replies")
        assert r.status_code == 405 and "POST" in r.headers["Allow"]
        status = c.get("/v1/status").json()
        assert status["bots"]["sim"]["ready"] and status["store"]["up"]
    h.daemon.guards["sim"].claiming = False
    with h.client() as c:
        assert c.get("/readyz").status_code == 503


def test_rearm_many_via_api(h):
    """POST /v1/rearm: a dry run lists the rows of the state changed since T and changes nothing; then each is
    rearmed (event by api) and answered once; a bad state, an unknown bot or no token are refused."""
    import time

    old = h.parent()
    assert post(h, old, "x" * 600).status_code == 409
    time.sleep(0.05)
    since = time.time()
    new = sorted([h.parent(), h.parent()])
    assert all(post(h, p, "x" * 600).status_code == 409 for p in new)
    with h.client() as c:
        assert c.post("/v1/rearm", json={"state": "gave_up"}).json()["matched"] == 0
        dry = c.post("/v1/rearm", json={"state": "rejected", "since": since, "dry_run": True})
        assert dry.status_code == 200, dry.text
        assert sorted(p["parent_id"] for p in dry.json()["parents"]) == new and dry.json()["rearmed"] == 0
        assert {c.get(f"/v1/replies/sim/{p}").json()["row"]["state"] for p in [old, *new]} == {"rejected"}
        r = c.post("/v1/rearm", json={"state": "rejected", "since": since, "bot": "sim", "reason": "outage"})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["matched"] == 2 and got["rearmed"] == 2 and not got["dry_run"]
        assert sorted((p["bot"], p["parent_id"], p["previous_state"], p["state"]) for p in got["parents"]) == [
            ("sim", p, "rejected", "released") for p in new]
        assert c.get(f"/v1/replies/sim/{old}").json()["row"]["state"] == "rejected"
        events = c.get(f"/v1/replies/sim/{new[0]}").json()["events"]
        assert events[-1]["kind"] == "rearmed" and events[-1]["detail"] == {"by": "api", "from": "rejected",
                                                                             "reason": "outage"}
        assert c.post("/v1/rearm", json={"state": "rejected", "since": since}).json()["matched"] == 0
        bad = c.post("/v1/rearm", json={"state": "closed"})
        assert bad.status_code == 422 and bad.json()["field"] == "state", bad.text
        assert c.post("/v1/rearm", json={"bot": "nope"}).status_code == 404
        assert c.post("/v1/rearm", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    with h.client(token=None) as anon:
        assert anon.post("/v1/rearm", json={}).status_code == 401
    assert all(post(h, p, "short").status_code == 201 and h.bot_replies(p) == 1 for p in new)


def test_rearm_many_touches_only_the_named_bot(tmp_path):
    """Two bots with rejected rows: `bot` limits POST /v1/rearm to that bot's key prefix; without it, every bot."""
    from starlette.testclient import TestClient

    from replyd.guard import Guard
    from replyd.platforms.memory import MemoryPlatform

    store = Store.open(f"sqlite:///{tmp_path / 's.sqlite3'}")
    guards = {}
    for name in ("a", "b"):
        plat = MemoryPlatform(instance=f"memory:{name}", script=["rejected"])
        guards[name] = Guard(store, plat, plat.whoami(), watch_interval_s=None)
        assert guards[name].post(plat.add_parent(f"p-{name}"), "hi").status.value == "rejected"
    api = Api(store, guards, token=TOKEN)
    with TestClient(api.app, base_url="http://127.0.0.1") as c:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        one = c.post("/v1/rearm", json={"state": "rejected", "bot": "a"}, headers=auth).json()
        assert [(p["bot"], p["parent_id"], p["rearmed"]) for p in one["parents"]] == [("a", "p-a", True)]
        assert store.find("p-b")[0].state == "rejected"
        rest = c.post("/v1/rearm", json={"state": "rejected"}, headers=auth).json()
        assert [(p["bot"], p["parent_id"]) for p in rest["parents"]] == [("b", "p-b")]
    for g in guards.values():
        g.close()
    store.dispose()


def test_confirm_and_status_of_an_unconfirmed_key_via_api(h):
    """POST .../confirm closes an unconfirmed key (event confirmed, reply id kept); any other state is 409;
    /v1/status, /metrics and the status page count unconfirmed rows (made here as a no-read-back sweep does)."""
    from replyd import store as st

    pid = h.parent()
    assert post(h, pid, "x" * 600).status_code == 409  # a rejected row, then moved as the sweep would move it
    s = h.daemon.store
    key = st.Key(h.instance, h.bot.id, pid)
    with planting(), s.transaction() as tx:  # planted: no event moves a rejected row to unconfirmed
        assert tx.cas_event(key, states=[st.REJECTED], attempt=1, values={"state": st.UNCONFIRMED})
    with h.client() as c:
        assert any(x["state"] == "unconfirmed" and x["rows"] == 1 for x in c.get("/v1/status").json()["counts"])
        assert 'replyd_rows{platform="sim",state="unconfirmed"} 1.0' in c.get("/metrics").text
        assert 'data-unconfirmed="1"' in c.get("/").text
        assert c.post(f"/v1/replies/sim/{pid}/confirm", json={"reply_id": 5}).status_code == 422
        r = c.post(f"/v1/replies/sim/{pid}/confirm", json={"reply_id": "109999", "reason": "seen in the chat"})
        assert r.status_code == 200, r.text
        assert r.json()["row"]["state"] == "closed" and r.json()["row"]["reply_id"] == "109999"
        again = c.post(f"/v1/replies/sim/{pid}/confirm", json={})
        assert again.status_code == 409 and again.json()["state"] == "closed"
        kinds = [e["kind"] for e in c.get(f"/v1/replies/sim/{pid}").json()["events"]]
    assert kinds[-1] == "confirmed" and post(h, pid).status_code == 200  # already answered
