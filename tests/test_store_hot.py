"""The store's hot path (prebuilt SQL straight through the driver): same guarantees as the SQLAlchemy path.

Durability per transaction, the event in the same transaction as the row, CAS on (key, state, attempt),
errors mapped, and connections the server closed replaced without a pre-ping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from replyd import store as st
from replyd.errors import StoreError
from replyd.guard import Guard, Status
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Key, Store


@pytest.fixture
def plat(clock):
    return MemoryPlatform(clock=clock, listing_delay_s=5.0)


@pytest.fixture
def guard(store, plat, clock):
    return Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)


def _kinds(store: Store, key: Key) -> list[str]:
    return [e.kind for e in store.history(key)]


def test_statements_are_derived_from_the_tables():
    """Every column of the models is in the prebuilt insert and read; an unknown column is refused, not dropped."""
    for dialect in (sa.dialects.sqlite.dialect(), sa.dialects.postgresql.dialect()):
        sql = st._HotSQL(dialect)
        for c in st.REPLIES.columns:
            assert c.name in sql.insert and c.name in sql.peek
        for c in st.EVENTS.columns:
            assert c.primary_key or c.name in sql.event
        with pytest.raises(ValueError, match="not columns"):
            sql.cas(("state", "no_such_column"), 1, True, False, False, False)


def test_claim_writes_every_value_and_its_event(store, clock):
    """A claim stores every column it is given (author_id included) with its claimed event."""
    key = Key("p", "s", "x1")
    new = {"state": st.OPEN, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now(), "author_id": "a1",
           "provider_key": "pk", "snapshot": '{"id": "x1"}', "owner": "me"}
    won, row, values = store.claim(key, new, lambda r: None, {"kind": "claimed", "owner": "me", "detail": {"path": "t"}})
    assert won and row is None and values == new
    got = store.get(key)
    assert (got.author_id, got.provider_key, got.path, got.state, got.owner) == ("a1", "pk", "", st.OPEN, "me")
    ev = store.history(key)
    assert [(e.kind, e.state, e.attempt, e.owner, e.detail) for e in ev] == [("claimed", st.OPEN, 1, "me", '{"path": "t"}')]
    with pytest.raises(ValueError, match="not columns"):
        store.claim(Key("p", "s", "x2"), {**new, "bogus": 1}, lambda r: None, {"kind": "claimed"})


def test_claim_takes_a_claimable_row_and_reports_one_that_is_not(store, clock):
    """An existing row is compared-and-set with reclaim's values, or returned untouched."""
    key = Key("p", "s", "x1")
    base = {"state": st.RELEASED, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now()}
    assert store.claim(key, base, lambda r: None, {"kind": "adopted"}).won
    won, _, values = store.claim(key, {**base, "state": st.OPEN}, lambda r: {"state": st.OPEN, "attempt": r.attempt},
                                 {"kind": "claimed"})
    assert won and values == {"state": st.OPEN, "attempt": 1} and store.get(key).state == st.OPEN
    won, row, values = store.claim(key, base, lambda r: None, {"kind": "claimed"})
    assert not won and values is None and row.state == st.OPEN and row.attempt == 1
    assert _kinds(store, key) == ["adopted", "claimed"]


def test_cas_event_is_a_compare_and_set_with_its_event(store, clock):
    """Wrong attempt or lease owner: no update, only the 'otherwise' event; right ones: update and event."""
    key = Key("p", "s", "x1")
    store.claim(key, {"state": st.OPEN, "attempt": 1, "created_at": 1.0, "updated_at": 1.0, "lease_owner": "me"},
                lambda r: None, {"kind": "claimed"})
    vals = {"state": st.CLOSED, "reply_id": "r1", "updated_at": 2.0}
    ev = {"kind": "closed", "state": st.CLOSED, "attempt": 1, "detail": {"reply_id": "r1"}}
    late = {"kind": "late_landing", "attempt": 2, "detail": {"reply_id": "r1"}}
    assert not store.cas_event(key, states=[st.OPEN], attempt=2, values=vals, event=ev, otherwise=late)
    assert not store.cas_event(key, states=[st.OPEN], attempt=1, values=vals, event=ev, lease_owner="other")
    assert not store.cas_event(key, states=[st.CLOSED], attempt=1, values=vals, event=ev)
    assert store.get(key).state == st.OPEN
    assert store.cas_event(key, states=[st.OPEN, st.NOT_LANDED], attempt=1, values=vals, event=ev, otherwise=late,
                           lease_owner="me", relaxed=True)
    row = store.get(key)
    assert (row.state, row.reply_id) == (st.CLOSED, "r1")
    hist = store.history(key)
    assert [(e.kind, e.state, e.attempt) for e in hist] == [
        ("claimed", st.OPEN, 1), ("late_landing", None, 2), ("closed", st.CLOSED, 1)]


def test_a_failing_event_write_undoes_the_row(store, store_url, guard, plat):
    """Row and event commit together: when the event cannot be written, neither is, and nothing is sent."""
    eng = sa.create_engine(store_url)
    sqlite = store.is_sqlite
    with eng.begin() as c:
        if sqlite:
            c.exec_driver_sql("CREATE TRIGGER t_no_events BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'no events'); END")
        else:
            c.exec_driver_sql("CREATE FUNCTION f_no_events() RETURNS trigger LANGUAGE plpgsql AS "
                              "$$ BEGIN RAISE EXCEPTION 'no events'; END $$")
            c.exec_driver_sql("CREATE TRIGGER t_no_events BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION f_no_events()")
    try:
        with pytest.raises(StoreError, match="no events"):
            guard.post(plat.add_parent("p1"), "x")
        assert store.get(guard.key("p1")) is None and plat.send_calls == 0
    finally:
        with eng.begin() as c:
            c.exec_driver_sql("DROP TRIGGER t_no_events" + ("" if sqlite else " ON events"))
            if not sqlite:
                c.exec_driver_sql("DROP FUNCTION f_no_events()")
        eng.dispose()
    assert guard.post(plat.parents["p1"], "x").status is Status.POSTED
    assert _kinds(store, guard.key("p1")) == ["claimed", "closed"]


def test_sqlite_claim_commits_full_and_close_normal(tmp_path, clock):
    """On SQLite the claim's COMMIT runs with synchronous=FULL, the close's with NORMAL (PRAGMA only on change)."""
    trace: list[str] = []
    store = Store.open(f"sqlite:///{tmp_path / 'd.sqlite3'}", clock=clock)
    store.dispose()  # connections opened from here on are traced
    sa.event.listen(store.engine.pool, "connect", lambda dbc, _r: dbc.set_trace_callback(trace.append))
    plat = MemoryPlatform(clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock)
    for pid in ("p1", "p2"):
        assert g.post(plat.add_parent(pid), "x").status is Status.POSTED
    sync, commits = "FULL", []  # a new connection starts FULL (_sqlite_on_connect)
    last_write = None
    for s in trace:
        u = s.strip().upper()
        if u.startswith("PRAGMA SYNCHRONOUS="):
            sync = u.split("=")[1]
        elif u.startswith(("INSERT INTO REPLIES", "UPDATE REPLIES")):
            last_write = u.split()[0]
        elif u == "COMMIT":
            commits.append((last_write, sync))
    assert commits == [("INSERT", "FULL"), ("UPDATE", "NORMAL")] * 2
    store.dispose()


@pytest.mark.postgres
def test_postgres_relaxed_close_does_not_leak_into_the_session(pg_url, clock):
    """The close's synchronous_commit=off is its own transaction's: the connection's next claim is durable."""
    with sa.create_engine(pg_url).begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors")
    store = Store.open(pg_url, clock=clock)
    plat = MemoryPlatform(clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock)
    assert "synchronous_commit" not in store._sql.claim(False)
    assert g.post(plat.add_parent("p1"), "x").status is Status.POSTED
    with store._driver("checking") as fairy:  # the connection the close just used
        assert store._pg(fairy, "SHOW synchronous_commit", {}) == [("on",)]
    store.dispose()


def _kill_backends(pg_url: str) -> None:
    db = sa.engine.make_url(pg_url).database
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}' "
                          "AND pid <> pg_backend_pid()")
        for _ in range(100):  # until they are gone (their sockets closed)
            n = c.exec_driver_sql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' "
                                  "AND pid <> pg_backend_pid()").scalar()
            if n == 0:
                break
            time.sleep(0.05)
    admin.dispose()
    time.sleep(0.1)


@pytest.mark.postgres
def test_postgres_restart_of_every_connection_is_survived(pg_url, clock):
    """Every connection killed by the server between posts (as by a restart): the next calls just work."""
    with sa.create_engine(pg_url).begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors")
    store = Store.open(pg_url, clock=clock)
    plat = MemoryPlatform(clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock)
    assert g.post(plat.add_parent("p1"), "x").status is Status.POSTED
    store.set_cursor("p", "s", "inbox", "1")
    for i in range(2, 5):
        _kill_backends(pg_url)
        assert g.check("p1").status is Status.ALREADY_ANSWERED
        assert g.post(plat.add_parent(f"p{i}"), "x").status is Status.POSTED
        _kill_backends(pg_url)
        store.set_cursor("p", "s", "inbox", str(i))  # the SQLAlchemy path too
        assert store.get_cursor("p", "s", "inbox") == str(i)
    assert plat.send_calls == 4
    store.dispose()


@pytest.mark.postgres
def test_postgres_message_sent_to_an_idle_connection_does_not_drop_it(pg_url, clock):
    """Data the server sends unasked (here a NOTIFY; with TLS, session records) is read, the connection kept."""
    with sa.create_engine(pg_url).begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors")
    store = Store.open(pg_url, clock=clock)
    plat = MemoryPlatform(clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock)
    with store._driver("listening") as fairy:
        pid = store._pg(fairy, "SELECT pg_backend_pid()", {})[0][0]
        fairy.driver_connection.execute("LISTEN replyd_test_idle")
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql("NOTIFY replyd_test_idle")
    admin.dispose()
    time.sleep(0.2)
    assert g.post(plat.add_parent("p1"), "x").status is Status.POSTED
    with store._driver("checking") as fairy:
        assert store._pg(fairy, "SELECT pg_backend_pid()", {})[0][0] == pid
        fairy.driver_connection.execute("UNLISTEN *")
    store.dispose()


@pytest.mark.postgres
def test_postgres_outage_fails_closed_then_recovers(pg_url, clock):
    """Through a proxy that cuts and refuses connections: StoreError and no send while down, normal after."""
    from chaos.proxy import TcpProxy

    with sa.create_engine(pg_url).begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors")
    u = sa.engine.make_url(pg_url)
    proxy = TcpProxy(u.host or "127.0.0.1", u.port or 5432).start()
    try:
        store = Store.open(u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False), clock=clock)
        plat = MemoryPlatform(clock=clock)
        g = Guard(store, plat, plat.whoami(), clock=clock)
        assert g.post(plat.add_parent("p1"), "x").status is Status.POSTED
        proxy.outage()
        for _ in range(2):
            with pytest.raises(StoreError, match="store unavailable"):
                g.post(plat.add_parent("p2"), "x")
            with pytest.raises(StoreError):
                g.check("p1")
        assert plat.send_calls == 1
        proxy.restore()
        assert g.post(plat.parents["p2"], "x").status is Status.POSTED
        assert g.check("p1").status is Status.ALREADY_ANSWERED
        assert plat.send_calls == 2
        store.dispose()
    finally:
        proxy.close()


def test_sqlite_hot_path_writes_again_once_the_file_is_writable(tmp_path, clock):
    """Opened while the file is unwritable: a post fails closed (nothing sent), then works once writable."""
    if shutil.which("chattr") is None or os.geteuid() != 0:
        pytest.skip("needs chattr and root to make the file immutable")
    db = tmp_path / "r.sqlite3"
    url = f"sqlite:///{db}"
    Store.open(url).dispose()
    files = [str(p) for p in (db, Path(f"{db}-wal")) if p.exists()]
    if subprocess.run(["chattr", "+i", *files], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable flag")
    store = Store.open(url, clock=clock, migrate=False)
    plat = MemoryPlatform(clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock)
    try:
        with pytest.raises(StoreError):
            g.post(plat.add_parent("p1"), "x")
        assert plat.send_calls == 0
        subprocess.run(["chattr", "-i", *files], check=True)
        assert g.post(plat.parents["p1"], "x").status is Status.POSTED
        assert plat.send_calls == 1
    finally:
        subprocess.run(["chattr", "-i", *files], capture_output=True)
        store.dispose()


def test_parent_snapshot_text_is_unchanged():
    """The snapshot column is the text json.dumps(parent.snapshot(), default=str) always gave."""
    import json

    from replyd.guard import snapshot_json

    p = Parent(id="1", author_id="a", text="hé", created_at=1.5,
               extra={"root": {"uri": "at://x", "cid": "c"}, "tags": ("a", "b"), "n": None, "when": object})
    assert snapshot_json(p) == json.dumps(p.snapshot(), default=str)
