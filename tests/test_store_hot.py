"""Each backend's own connection handling on the hot path (prebuilt SQL straight through the driver).

Connections the server closed replaced without a pre-ping, outages failing closed, a read-only SQLite file
recovered, statements derived from the tables. What both backends promise is in test_store_contract.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st_

from replyd.errors import StoreError
from replyd.guard import Guard, Status
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store, hot_sql
from replyd.store.schema import EVENTS, REPLIES


def test_statements_are_derived_from_the_tables():
    """Every column of the models is in the prebuilt insert and read; an unknown column is refused, not dropped."""
    for backend in ("sqlite", "postgresql"):
        sql = hot_sql(backend)
        for c in REPLIES.columns:
            assert c.name in sql.insert and c.name in sql.peek
        for c in EVENTS.columns:
            assert c.primary_key or c.name in sql.event
        with pytest.raises(ValueError, match="not columns"):
            sql.cas(("state", "no_such_column"), 1, True, False, False, False)


def test_sqlite_positional_statements_bind_what_the_named_ones_bind():
    """SQLite's writes bound by position store exactly what the named form stores: every placeholder in the
    statement's own order, a name used twice taken twice, a one-name statement as a one-tuple."""
    import sqlite3

    sql = hot_sql("sqlite")
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (a, b, c, d)")
    named = "INSERT INTO t (a, b, c, d) VALUES (:x_2, :x_10, :x_1, :x_2)"  # not sorted; x_2 twice
    params = {"x_1": "one", "x_2": 2.5, "x_10": None, "unused": "left out"}
    db.execute(named, params)
    q, get = sql.positional(named)
    assert "?" in q and ":" not in q
    db.execute(q, get(params))
    first, second = db.execute("SELECT a, b, c, d FROM t ORDER BY rowid").fetchall()
    assert first == second == (2.5, None, "one", 2.5)
    one, get_one = sql.positional("DELETE FROM t WHERE c = :only")
    assert get_one({"only": "one"}) == ("one",)
    assert db.execute(one, get_one({"only": "one"})).rowcount == 2
    # The statements the hot path runs: every name their parameters carry, in order.
    q_event, get_event = sql.positional(sql.event)
    names = sql.event_names["e_"]
    assert q_event.count("?") == len(names)
    assert get_event({n: i for i, n in enumerate(names)}) == tuple(range(len(names)))


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
        pid = store._fetch(fairy, "SELECT pg_backend_pid()", {})[0][0]
        fairy.driver_connection.execute("LISTEN replyd_test_idle")
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql("NOTIFY replyd_test_idle")
    admin.dispose()
    time.sleep(0.2)
    assert g.post(plat.add_parent("p1"), "x").status is Status.POSTED
    with store._driver("checking") as fairy:
        assert store._fetch(fairy, "SELECT pg_backend_pid()", {})[0][0] == pid
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


def test_parent_snapshot_reads_back_as_json_dumps_gave_it():
    """The snapshot column reads back (json.loads) as json.dumps(parent.snapshot(), default=str) did; what
    pydantic-core cannot write (a lone surrogate, bytes not UTF-8) still gets json.dumps' very text."""
    import json

    from replyd.guard import snapshot_json

    p = Parent(id="1", author_id="a", text="hé", created_at=1.5,
               extra={"root": {"uri": "at://x", "cid": "c"}, "tags": ("a", "b"), "n": None, "when": object,
                      "big": 2**70, "inf": float("inf"), "ids": {"1": [1.25, True]}})
    assert json.loads(snapshot_json(p)) == json.loads(json.dumps(p.snapshot(), default=str))
    for odd in ("\ud800 lone", b"\xff not utf-8"):
        q = Parent(id="2", author_id="a", text="t", extra={"odd": odd})
        assert snapshot_json(q) == json.dumps(q.snapshot(), default=str)


@settings(max_examples=400, deadline=None)
@given(st_.dictionaries(st_.text(max_size=12), st_.one_of(st_.text(), st_.integers(), st_.floats(), st_.none(),
                                                            st_.booleans(), st_.lists(st_.text(max_size=3))),
                        max_size=3))
def test_event_detail_text_is_what_json_dumps_gives(detail):
    """An event's detail column is the text json.dumps(detail, sort_keys=True, default=str) gives, whatever the
    shape (the one-string shortcut included: odd characters, surrogates, empty strings)."""
    import json

    from replyd.store.base import detail_json

    assert detail_json(detail) == json.dumps(detail, sort_keys=True, default=str)
    assert detail_json(None) == "{}"


def test_a_page_statement_of_n_rows_is_the_row_repeated(tmp_path):
    """``HotSQL.values_rows``: the positional INSERT with its VALUES row n times, its ON CONFLICT kept; three
    events through it land once each, in order."""
    import sqlite3

    h = hot_sql("sqlite")
    one = h.positional(h.insert)[0]
    three = h.values_rows(h.insert, 3)
    row = one.partition(" VALUES ")[2].partition(" ON CONFLICT")[0]
    assert three == one.replace(f"VALUES {row}", f"VALUES {row}, {row}, {row}")
    assert three.endswith(one[one.index(" ON CONFLICT"):])
    db = tmp_path / "r.sqlite3"
    Store.open(f"sqlite:///{db}").dispose()
    get = h.positional(h.event)[1]
    events = [dict(zip(h.event_names["e_"], (float(i), "p", "s", f"id{i}", "claimed", "open", 1, "o", "{}"),
                       strict=True)) for i in range(3)]
    with sqlite3.connect(db) as c:
        c.execute(h.values_rows(h.event, 3), [v for e in events for v in get(e)])
        assert c.execute("SELECT parent_id, at FROM events ORDER BY id").fetchall() == [
            ("id0", 0.0), ("id1", 1.0), ("id2", 2.0)]
