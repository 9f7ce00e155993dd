"""The store contract suite: every test runs on SQLite and on the real PostgreSQL (the ``store`` fixture), and
on both faces of the guard: the store as the sync face calls it, and as the async face does (every call on its
store threads, awaited from a loop: ``tests/aio_harness.StoreOnFace``), guards built by the face under test.

What a backend must do, through the public contract only: claim (atomic, durable), compare-and-set with its
event, transactions, events and reads, sweep leases, cursors, overdue and re-offer pages, listing-lag samples and
listing delays; concurrency with real OS processes. Backend-specific connection handling is in test_store_hot.py.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from replyd import store as st
from replyd.clock import FakeClock
from replyd.errors import SchemaError, StoreError
from replyd.guard import Status
from replyd.platforms.memory import MemoryPlatform
from replyd.store import AnsweredLog, Key, PostgresStore, SQLiteStore, Store
from replyd.transitions import planting
from tests.aio_harness import BlockingAsyncGuard, StoreOnFace, face, raw, store_on  # noqa: F401  (face: both faces)

P, S = "memory:contract", "bot-1"


@pytest.fixture
def store(store: Store, face: type) -> Iterator[Store]:
    """The conftest's store as ``face`` reaches it: as is (sync), or through the async face's store threads."""
    with store_on(face, store) as faced:
        yield faced


def key(pid: str) -> Key:
    """The key of parent ``pid`` of the suite's one bot."""
    return Key(P, S, pid)


def seed(store: Store, pid: str, **values) -> Key:
    """Insert a row for ``pid`` with ``values`` (no event), as an earlier writer left it."""
    now = store.clock.now()
    k = key(pid)
    with planting(), store.transaction() as tx:  # as an earlier writer left it: any state
        assert tx.insert_new(k, {"state": st.OPEN, "attempt": 1, "created_at": now, "updated_at": now, **values})
    return k


def kinds(store: Store, k: Key) -> list[str]:
    """The kinds of ``k``'s events, oldest first."""
    return [e.kind for e in store.history(k)]


def open_row(clock: FakeClock, owner: str = "me", **more) -> dict:
    """The values of a freshly claimed open row."""
    return {"state": st.OPEN, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now(), "owner": owner,
            **more}


# -- the backend and the contract -----------------------------------------------------------------


def test_open_picks_the_backend_the_url_names(store, store_url):
    """Store.open returns SQLiteStore for sqlite:// and PostgresStore for postgresql://, both meeting the contract."""
    assert isinstance(store, AnsweredLog)
    assert type(raw(store)) is (SQLiteStore if store_url.startswith("sqlite") else PostgresStore)
    assert store.is_sqlite == store_url.startswith("sqlite")
    current, head = store.schema_revision()
    assert current == head
    store.ping()
    with pytest.raises(ValueError, match="claim_commit must be one of"):
        store.claim_commit = "sometimes"


def test_no_sqlalchemy_outside_the_store_package():
    """Only replyd/store/ (and the migrations it runs) import SQLAlchemy or SQLModel: callers see records only."""
    root = Path(__file__).resolve().parents[1] / "replyd"
    allowed = (root / "store", root / "migrations", root / "migrate.py")
    leaks = []
    for path in root.rglob("*.py"):
        if any(path == a or a in path.parents for a in allowed):
            continue
        if re.search(r"^\s*(import|from)\s+(sqlalchemy|sqlmodel)\b", path.read_text(), re.M):
            leaks.append(str(path.relative_to(root)))
    assert leaks == []


def test_missing_schema_is_a_schema_error(tmp_path):
    """A store never migrated refuses to open without migrating, naming the fix; the URL's password is hidden."""
    with pytest.raises(SchemaError, match="replyd db upgrade"):
        Store.open(f"sqlite:///{tmp_path / 'empty.sqlite3'}", migrate=False)
    with pytest.raises(StoreError, match="unsupported store URL scheme"):
        Store.open("mysql://u:hunter2@h/db")
    assert "hunter2" not in st.redact_url("postgresql://u:hunter2@h/db?sslpassword=x2")


# -- claim ------------------------------------------------------------------------------------------


def test_claim_writes_every_value_and_its_event(store, clock):
    """A claim stores every column it is given with its claimed event; an unknown column is refused, not dropped."""
    k = key("x1")
    new = open_row(clock, author_id="a1", provider_key="pk", snapshot='{"id": "x1"}')
    won, row, values = store.claim(k, new, lambda r: None, {"kind": "claimed", "owner": "me", "detail": {"path": "t"}})
    assert won and row is None and values == new
    got = store.get(k)
    assert isinstance(got, st.Row)
    assert (got.author_id, got.provider_key, got.path, got.state, got.owner) == ("a1", "pk", "", st.OPEN, "me")
    ev = store.history(k)
    assert [(e.kind, e.state, e.attempt, e.owner, e.detail) for e in ev] == [("claimed", st.OPEN, 1, "me", '{"path": "t"}')]
    with pytest.raises(ValueError, match="not columns"):
        store.claim(key("x2"), {**new, "bogus": 1}, lambda r: None, {"kind": "claimed"})
    assert store.get(key("x2")) is None


def test_claim_takes_a_claimable_row_and_reports_one_that_is_not(store, clock):
    """An existing row is compared-and-set with reclaim's values, or returned untouched."""
    k = key("x1")
    base = {"state": st.RELEASED, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now()}
    assert store.claim(k, base, lambda r: None, {"kind": "adopted"}).won
    won, _, values = store.claim(k, {**base, "state": st.OPEN}, lambda r: {"state": st.OPEN, "attempt": r.attempt},
                                 {"kind": "claimed"})
    assert won and values == {"state": st.OPEN, "attempt": 1} and store.get(k).state == st.OPEN
    won, row, values = store.claim(k, base, lambda r: None, {"kind": "claimed"})
    assert not won and values is None and row.state == st.OPEN and row.attempt == 1
    assert kinds(store, k) == ["adopted", "claimed"]


def test_claim_is_atomic_when_a_rival_commits_between_read_and_write(store_url, clock, monkeypatch):
    """B reads the key as free, then A claims and commits it, then B writes: one winner, its row, one claimed event."""
    a, b = Store.open(store_url, clock=clock), Store.open(store_url, clock=clock)
    k = key("contested")
    won: dict[str, bool] = {}
    real_peek = b._peek_with  # the row read a claim decides on; the rival commits right after it

    def read_then_rival_commits(fairy, kk):
        row = real_peek(fairy, kk)
        if "A" not in won:
            won["A"] = a.claim(k, open_row(clock, "A"), lambda r: None, {"kind": "claimed", "owner": "A"}).won
        return row

    monkeypatch.setattr(b, "_peek_with", read_then_rival_commits)
    try:
        won["B"] = b.claim(k, open_row(clock, "B"), lambda r: None, {"kind": "claimed", "owner": "B"}).won
        if "A" not in won:  # B never read before writing (PostgreSQL inserts first): A comes second
            won["A"] = a.claim(k, open_row(clock, "A"), lambda r: None, {"kind": "claimed", "owner": "A"}).won
        winners = [who for who, w in won.items() if w]
        assert len(winners) == 1, won
        row = a.get(k)
        assert row is not None and row.owner == winners[0] and row.state == st.OPEN
        assert [e.owner for e in a.history(k) if e.kind == "claimed"] == winners
    finally:
        a.dispose()
        b.dispose()


def test_reclaim_of_an_expired_composing_lease_checks_its_holder(store_url, clock, monkeypatch):
    """Two replicas saw the same expired composing lease: the one that reclaims second, on the stale row, loses."""
    a, b = Store.open(store_url, clock=clock), Store.open(store_url, clock=clock)

    def take(me: str) -> Callable[[st.Row], dict]:
        return lambda r: {"state": st.COMPOSING, "attempt": r.attempt, "lease_owner": me,
                          "lease_until": clock.now() + 60}

    try:
        k = seed(a, "c1", state=st.COMPOSING, lease_owner="dead", lease_until=clock.now() - 1)
        stale = a.get(k)
        assert a.claim(k, open_row(clock), take("r1"), {"kind": "claimed", "owner": "r1"}).won
        def stale_read(kk: Key):  # b decides on the row as it read it before (no statement run)
            return stale
            yield  # a statement generator all the same

        monkeypatch.setattr(b, "_peek_steps", stale_read)
        assert not b.claim(k, open_row(clock), take("r2"), {"kind": "claimed", "owner": "r2"}).won
        assert a.get(k).lease_owner == "r1"
        assert [e.owner for e in a.history(k) if e.kind == "claimed"] == ["r1"]
    finally:
        a.dispose()
        b.dispose()


@contextmanager
def events_refused(store: Store, store_url: str, parent_id: str | None = None) -> Iterator[None]:
    """A trigger makes every event insert fail ("no events"), or only those of ``parent_id``; dropped after."""
    eng = sa.create_engine(store_url)
    only = f"'{parent_id}'" if parent_id else None
    with eng.begin() as c:
        if store.is_sqlite:
            when = f" WHEN NEW.parent_id = {only}" if only else ""
            c.exec_driver_sql(f"CREATE TRIGGER t_no_events BEFORE INSERT ON events{when} "
                              "BEGIN SELECT RAISE(ABORT, 'no events'); END")
        else:
            cond = f"NEW.parent_id = {only}" if only else "true"
            c.exec_driver_sql("CREATE FUNCTION f_no_events() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                              f"IF {cond} THEN RAISE EXCEPTION 'no events'; END IF; RETURN NEW; END $$")
            c.exec_driver_sql("CREATE TRIGGER t_no_events BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION f_no_events()")
    try:
        yield
    finally:
        with eng.begin() as c:
            c.exec_driver_sql("DROP TRIGGER t_no_events" + ("" if store.is_sqlite else " ON events"))
            if not store.is_sqlite:
                c.exec_driver_sql("DROP FUNCTION f_no_events()")
        eng.dispose()


def test_a_failing_event_write_undoes_the_row(store, store_url, clock, face):
    """Row and event commit together: when the event cannot be written, neither is, and nothing is sent."""
    plat = MemoryPlatform(clock=clock)
    guard = face(raw(store), plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    with events_refused(store, store_url):
        with pytest.raises(StoreError, match="no events"):
            guard.post(plat.add_parent("p1"), "x")
        assert store.get(guard.key("p1")) is None and plat.send_calls == 0
        k = seed(store, "t1")
        with pytest.raises(StoreError, match="no events"):
            store.cas_event(k, states=[st.OPEN], attempt=1, values={"state": st.CLOSED}, event={"kind": "closed"})
        assert store.get(k).state == st.OPEN
    assert guard.post(plat.parents["p1"], "x").status is Status.POSTED
    assert kinds(store, guard.key("p1")) == ["claimed", "closed"]
    guard.close()


# -- compare-and-set, transactions, notes -----------------------------------------------------------


def test_cas_event_is_a_compare_and_set_with_its_event(store, clock):
    """Wrong state, attempt or lease owner: no update, only the 'otherwise' event; right ones: update and event."""
    k = key("x1")
    store.claim(k, open_row(clock, lease_owner="me"), lambda r: None, {"kind": "claimed"})
    vals = {"state": st.CLOSED, "reply_id": "r1", "updated_at": 2.0}
    ev = {"kind": "closed", "state": st.CLOSED, "attempt": 1, "detail": {"reply_id": "r1"}}
    late = {"kind": "late_landing", "attempt": 2, "detail": {"reply_id": "r1"}}
    assert not store.cas_event(k, states=[st.OPEN], attempt=2, values=vals, event=ev, otherwise=late)
    assert not store.cas_event(k, states=[st.OPEN], attempt=1, values=vals, event=ev, lease_owner="other")
    assert not store.cas_event(k, states=[st.CLOSED], attempt=1, values=vals, event=ev)
    assert store.get(k).state == st.OPEN
    assert store.cas_event(k, states=[st.OPEN, st.NOT_LANDED], attempt=1, values=vals, event=ev, otherwise=late,
                           lease_owner="me", relaxed=True)
    row = store.get(k)
    assert (row.state, row.reply_id) == (st.CLOSED, "r1")
    assert [(e.kind, e.state, e.attempt) for e in store.history(k)] == [
        ("claimed", st.OPEN, 1), ("late_landing", None, 2), ("closed", st.CLOSED, 1)]
    with pytest.raises(ValueError, match="not columns"):
        store.cas_event(k, states=[st.CLOSED], attempt=1, values={"nope": 1})


@pytest.mark.parametrize("inside", [False, True], ids=["own", "transaction"])
def test_cas_lease_due_by_and_deadline_at_least(store, clock, inside):
    """The lease owner must match; ``due_by`` needs the deadline passed; ``deadline_at_least`` keeps an open row's
    later deadline and sets any other row's (on the store's own transaction and inside a shared one alike)."""
    def cas(k: Key, **kw) -> bool:
        if not inside:
            return store.cas_event(k, attempt=1, **kw)
        with store.transaction() as tx:
            return tx.cas_event(k, attempt=1, **kw)

    k = seed(store, "d1", deadline_at=100.0, lease_owner="sweep-1")
    assert not cas(k, states=[st.OPEN], values={"state": st.NOT_LANDED}, lease_owner="sweep-2", due_by=100.0)
    assert not cas(k, states=[st.OPEN], values={"state": st.NOT_LANDED}, lease_owner="sweep-1", due_by=99.0)
    assert not cas(k, states=[st.CLOSED], values={"updated_at": 1.0}, deadline_at_least=10.0)
    assert store.get(k).state == st.OPEN
    assert cas(k, states=[st.OPEN], values={"updated_at": 1.0}, lease_owner="sweep-1", due_by=100.0)
    assert cas(k, states=[st.OPEN], values={"updated_at": 2.0}, deadline_at_least=50.0)
    assert store.get(k).deadline_at == 100.0  # open: the later deadline stays
    assert cas(k, states=[st.OPEN], values={"updated_at": 3.0}, deadline_at_least=150.0)
    assert store.get(k).deadline_at == 150.0
    j = seed(store, "d2", state=st.NOT_LANDED, deadline_at=900.0)
    assert cas(j, states=[st.NOT_LANDED], values={"state": st.OPEN}, deadline_at_least=60.0)
    assert (store.get(j).state, store.get(j).deadline_at) == (st.OPEN, 60.0)  # judged: its next look, not the old one


def test_a_transaction_commits_all_its_steps_or_none(store, clock):
    """Steps of one transaction are seen together after it commits, and none of them when it raises."""
    k = seed(store, "t1")
    with pytest.raises(RuntimeError), store.transaction() as tx:
        assert tx.cas_event(k, states=[st.OPEN], attempt=1, values={"state": st.CLOSED})
        tx.append_event(k, "closed", state=st.CLOSED, attempt=1)
        assert tx.get(k).state == st.CLOSED  # the transaction sees its own write
        raise RuntimeError("dies before commit")
    assert store.get(k).state == st.OPEN and kinds(store, k) == []
    with store.transaction() as tx:
        assert tx.cas_event(k, states=[st.OPEN], attempt=1, values={"state": st.CLOSED},
                            event={"kind": "closed", "state": st.CLOSED, "attempt": 1, "detail": {"reply_id": "r"}})
        assert not tx.insert_new(k, {"state": st.OPEN, "attempt": 1, "created_at": 0.0, "updated_at": 0.0})
        tx.append_event(k, "verified", state=st.CLOSED, attempt=1, detail={"n": 1})
        tx.append_event(k, "skipped_note")
        assert [kd for kd, _, _ in tx.reply_id_events(k)] == ["closed", "verified"]
    assert store.get(k).state == st.CLOSED and kinds(store, k) == ["closed", "verified", "skipped_note"]


def test_a_composed_answer_is_stored_with_its_row_and_replaced_by_a_new_one(store, clock):
    """put_answer stores an answer's parts (in order, any text) in the transaction of its row's move to ``parts``:
    none of it when that transaction fails; answer() reads them back; a new composition replaces them."""
    k = seed(store, "ans", state=st.COMPOSING)
    assert store.answer(k) is None
    with pytest.raises(RuntimeError), store.transaction() as tx:
        assert tx.cas_event(k, states=[st.COMPOSING], attempt=1, values={"state": st.PARTS})
        tx.put_answer(k, ["one", "two"], at=clock.now())
        raise RuntimeError("dies before commit")
    assert store.answer(k) is None and store.get(k).state == st.COMPOSING
    parts = ["first part, with 'quotes' and \"doubles\"", "second: é👍🏽\nnewline", "x" * 5000]
    with store.transaction() as tx:
        assert tx.cas_event(k, states=[st.COMPOSING], attempt=1, values={"state": st.PARTS})
        tx.put_answer(k, parts, at=clock.now())
    assert store.answer(k) == parts and store.get(k).state == st.PARTS
    assert store.answer(key("other")) is None  # keyed exactly
    with store.transaction() as tx:
        tx.put_answer(k, ["again"], at=clock.now())
    assert store.answer(k) == ["again"]


@pytest.mark.parametrize("shape", ["hot", "due_by"])
def test_cas_event_keeps_an_answer_only_with_the_write_it_rides_on(store, clock, shape):
    """``cas_event(answer=(parts, at))``: stored in the compare-and-set's transaction when the row was set (it
    replaces an earlier answer), and not at all when the compare-and-set lost; on the hot statement and on the
    transaction a ``due_by`` takes alike."""
    extra = {} if shape == "hot" else {"due_by": clock.now() + 1.0}
    k = seed(store, "keep", state=st.COMPOSING, lease_owner="me", deadline_at=clock.now())
    opened = {"kind": "opened", "state": st.OPEN, "attempt": 1}
    assert not store.cas_event(k, states=[st.COMPOSING], attempt=1, values={"state": st.OPEN}, event=opened,
                               lease_owner="someone else", answer=(["lost"], clock.now()), **extra)
    assert store.answer(k) is None and store.get(k).state == st.COMPOSING
    assert store.cas_event(k, states=[st.COMPOSING], attempt=1, values={"state": st.OPEN}, event=opened,
                           lease_owner="me", answer=(["kept, with 'quotes' é👍🏽"], clock.now()), **extra)
    assert store.answer(k) == ["kept, with 'quotes' é👍🏽"] and store.get(k).state == st.OPEN
    assert kinds(store, k) == ["opened"]
    assert not store.cas_event(k, states=[st.COMPOSING], attempt=1, values={"state": st.OPEN},
                               answer=(["late"], clock.now()), **extra)
    assert store.answer(k) == ["kept, with 'quotes' é👍🏽"]  # a lost compare-and-set replaces nothing
    assert store.cas_event(k, states=[st.OPEN], attempt=1, values={"updated_at": 5.0},
                           answer=(["one", "two"], clock.now()), **extra)
    assert store.answer(k) == ["one", "two"]


def test_reoffer_due_offers_an_answer_in_parts_never_a_part_row(store, clock):
    """A parent's row in ``parts`` waits to be offered again; a part's own row (path ``part``) never is."""
    seed(store, "whole", state=st.PARTS, updated_at=1.0)
    seed(store, "whole#part2", state=st.NOT_LANDED, updated_at=2.0, path=st.PART_PATH)
    assert [r.parent_id for r in store.reoffer_due(P, S, now=10.0, after=None, limit=10)] == ["whole"]
    seed(store, "older", state=st.PARTS, updated_at=0.5)
    assert [r.parent_id for r in store.in_parts(10)] == ["older", "whole"]
    assert [r.parent_id for r in store.in_parts(1)] == ["older"]


def test_insert_absent_adds_only_missing_keys_with_their_event(store, clock):
    """insert_absent creates the rows of keys without one (one event each), leaves an existing row and its events
    alone, and a key re-offered from the new row's snapshot is claimable as released (nothing spent)."""
    done = seed(store, "ia-closed", state=st.CLOSED, reply_id="r1")
    vals = {"state": st.RELEASED, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now(),
            "path": "webhook", "snapshot": '{"id": "x"}'}
    event = {"kind": "received", "owner": "me", "detail": {"delivery": "d1"}}
    assert store.insert_absent([(key("ia-1"), vals), (done, vals), (key("ia-2"), vals)], event) == 2
    assert store.get(done).state == st.CLOSED and kinds(store, done) == []
    for pid in ("ia-1", "ia-2"):
        row, [ev] = store.get(key(pid)), store.history(key(pid))
        assert (row.state, row.attempt, row.path, row.snapshot) == (st.RELEASED, 1, "webhook", '{"id": "x"}')
        assert (ev.kind, ev.state, ev.attempt, ev.owner, json.loads(ev.detail)) == (
            "received", st.RELEASED, 1, "me", {"delivery": "d1"})
    assert store.insert_absent([(key("ia-1"), {**vals, "path": "again"})], event) == 0
    assert store.get(key("ia-1")).path == "webhook" and len(store.history(key("ia-1"))) == 1
    assert [r.parent_id for r in store.reoffer_due(P, S, now=clock.now(), after=None, limit=10)] == ["ia-1", "ia-2"]


def test_claim_new_takes_a_page_of_new_keys_in_one_transaction(store, clock):
    """claim_new inserts every missing key's row with its own event, leaves existing rows alone, answers in order."""
    done = seed(store, "cn-done", state=st.CLOSED, reply_id="r1")
    page = [(key(f"cn-{i}"), open_row(clock, provider_key=f"pk{i}"), {"kind": "claimed", "owner": "me",
                                                                         "detail": {"path": "inbox"}})
            for i in range(5)]
    page.insert(2, (done, open_row(clock), {"kind": "claimed", "owner": "me"}))
    assert store.claim_new(page) == [True, True, False, True, True, True]
    assert store.get(done).state == st.CLOSED and kinds(store, done) == []
    for i in range(5):
        row, [ev] = store.get(key(f"cn-{i}")), store.history(key(f"cn-{i}"))
        assert (row.state, row.attempt, row.provider_key, row.owner) == (st.OPEN, 1, f"pk{i}", "me")
        assert (ev.kind, ev.state, ev.attempt, json.loads(ev.detail)) == ("claimed", st.OPEN, 1, {"path": "inbox"})
    assert store.claim_new(page[:2]) == [False, False] and store.claim_new([]) == []


def test_claim_new_is_all_or_nothing(store, store_url, clock):
    """A page whose last event cannot be written leaves none of its rows: the page commits as one."""
    with events_refused(store, store_url, parent_id="cx-3"):
        with pytest.raises(StoreError, match="no events"):
            store.claim_new([(key(f"cx-{i}"), open_row(clock), {"kind": "claimed", "owner": "me"}) for i in range(4)])
        assert [store.get(key(f"cx-{i}")) for i in range(4)] == [None] * 4
    assert store.claim_new([(key("cx-0"), open_row(clock), {"kind": "claimed", "owner": "me"})]) == [True]


def test_claim_page_inserts_new_keys_and_compares_and_sets_the_rows_that_stand(store, clock):
    """claim_page, in one transaction: a new key inserted, a row as expected (state, attempt, lease holder)
    compared-and-set with its event (state and attempt the written values'), a row that moved on or another
    holder's left alone with no event; answers in order."""
    now = clock.now()
    freed = seed(store, "cp-freed", state=st.RELEASED, attempt=1)
    judged = seed(store, "cp-judged", state=st.NOT_LANDED, attempt=1)
    lapsed = seed(store, "cp-lapsed", state=st.COMPOSING, attempt=1, lease_owner="gone", lease_until=now - 1)
    taken = seed(store, "cp-taken", state=st.COMPOSING, attempt=1, lease_owner="other", lease_until=now - 1)
    moved = seed(store, "cp-moved", state=st.CLOSED, attempt=1, reply_id="r1")
    ev = {"kind": "claimed", "owner": "me", "detail": {"path": "refind"}}
    held = {"state": st.COMPOSING, "updated_at": now, "owner": "me", "lease_owner": "me", "lease_until": now + 5}
    page = [
        (key("cp-new"), {**open_row(clock), "provider_key": "pk"}, ev, None),
        (freed, {**held, "attempt": 1}, ev, ([st.RELEASED], 1, None)),
        (judged, {**held, "attempt": 2}, ev, ([st.NOT_LANDED], 1, None)),
        (lapsed, {**held, "attempt": 1}, ev, ([st.COMPOSING], 1, "gone")),
        (taken, {**held, "attempt": 1}, ev, ([st.COMPOSING], 1, "gone")),  # another holder took it meanwhile
        (moved, {**held, "attempt": 1}, ev, ([st.RELEASED], 1, None)),  # closed since it was read
    ]
    assert store.claim_page(page) == [True, True, True, True, False, False]
    assert (store.get(key("cp-new")).state, store.get(key("cp-new")).provider_key) == (st.OPEN, "pk")
    for k, attempt in ((freed, 1), (judged, 2), (lapsed, 1)):
        row, [e] = store.get(k), store.history(k)
        assert (row.state, row.attempt, row.lease_owner, row.lease_until) == (st.COMPOSING, attempt, "me", now + 5)
        assert (e.kind, e.state, e.attempt, e.owner, json.loads(e.detail)) == (
            "claimed", st.COMPOSING, attempt, "me", {"path": "refind"})
    assert store.get(taken).lease_owner == "other" and kinds(store, taken) == []
    assert store.get(moved).state == st.CLOSED and kinds(store, moved) == []
    assert store.claim_page([]) == []


def test_claim_page_of_new_keys_inserts_the_free_ones_with_their_events(store, clock):
    """A page of new keys (PostgreSQL: one set statement): each free key inserted with its one event; a key that
    has a row meanwhile answers False and keeps its row and history; answers in order."""
    stood = seed(store, "cn-stood", state=st.CLOSED, attempt=1, reply_id="r-stood")
    ev = {"kind": "claimed", "owner": "me", "detail": {"path": "inbox"}}
    pids = ["cn-0", "cn-1", "cn-stood", "cn-2", "cn-3"]
    page = [(key(p), {**open_row(clock), "provider_key": f"pk-{p}"}, ev, None) for p in pids]
    assert store.claim_page(page) == [True, True, False, True, True]
    for p in ("cn-0", "cn-1", "cn-2", "cn-3"):
        row, [e] = store.get(key(p)), store.history(key(p))
        assert (row.state, row.provider_key, row.owner) == (st.OPEN, f"pk-{p}", "me")
        assert (e.kind, e.state, e.attempt, e.owner, json.loads(e.detail)) == (
            "claimed", st.OPEN, 1, "me", {"path": "inbox"})
    assert store.get(stood).reply_id == "r-stood" and kinds(store, stood) == []


def test_a_page_never_truncates_a_value_longer_than_its_column(store, clock):
    """A parent id or owner longer than its column is stored whole or refused (StoreError), never cut: a cut
    parent id would be another key."""
    long_pid, long_owner = "cl-" + "x" * 1500, "o" * 300
    ev = {"kind": "claimed", "owner": long_owner}
    page = [(key(long_pid), open_row(clock, owner=long_owner), ev, None),
            (key("cl-short"), open_row(clock), ev, None)]
    try:
        store.claim_page(page)
    except StoreError:
        assert store.get(key(long_pid)) is None and store.get(key("cl-short")) is None
        return
    assert store.get(key(long_pid)).owner == long_owner and store.history(key(long_pid))[0].owner == long_owner


ODD_TEXTS = ["quote ' double \" backslash \\ tab\t newline\n", "é👍🏽 中文 \u202e rtl", "null", "", "[1, 2]",
             "x" * 5000]
ODD_FLOATS = [1733370000.1234567, 0.1 + 0.2, 1e-300, 5e-324, 2.0 ** 53 + 2, 1.7976931348623157e308]


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")], ids=["plain", "nan", "inf"])
def test_a_page_writes_every_value_as_given(store, clock, poison):
    """A page claimed and closed (PostgreSQL: one statement each, the rows as arrays) stores each text and float
    exactly as given, None as NULL, with its event's; NaN and infinity do not stop it."""
    pids = [f"odd-{i}" for i in range(len(ODD_TEXTS))]
    page = []
    for i, p in enumerate(pids):
        values = {**open_row(clock, owner=ODD_TEXTS[i][:255]), "created_at": ODD_FLOATS[i], "provider_key": None,
                  "snapshot": ODD_TEXTS[i], "text_hash": ODD_TEXTS[-1 - i][:64], "error": ODD_TEXTS[i],
                  "not_before": poison if i == 2 else None}
        page.append((key(p), values, {"kind": "claimed", "owner": ODD_TEXTS[i][:255],
                                      "detail": {"text": ODD_TEXTS[i]}}, None))
    assert store.claim_page(page) == [True] * len(pids)
    for i, p in enumerate(pids):
        row, [e] = store.get(key(p)), store.history(key(p))
        assert (row.snapshot, row.text_hash, row.error, row.owner, row.provider_key) == (
            ODD_TEXTS[i], ODD_TEXTS[-1 - i][:64], ODD_TEXTS[i], ODD_TEXTS[i][:255], None)
        assert repr(row.created_at) == repr(ODD_FLOATS[i])  # the same double
        assert (e.owner, json.loads(e.detail)) == (ODD_TEXTS[i][:255], {"text": ODD_TEXTS[i]})
    nb = store.get(key(pids[2])).not_before
    if poison is None or poison == poison:  # NaN is the backend's to keep (SQLite stores it as NULL)
        assert nb == poison
    items = []
    for i, p in enumerate(pids):
        values = {"state": st.CLOSED, "reply_id": ODD_TEXTS[i][:1024], "closed_at": ODD_FLOATS[-1 - i],
                  "updated_at": ODD_FLOATS[i], "error": None, "deadline_at": poison if i == 0 else ODD_FLOATS[i]}
        items.append((key(p), (st.OPEN,), 1, values, {"kind": "closed", "state": st.CLOSED, "attempt": 1,
                                                       "detail": {"reply_id": ODD_TEXTS[i]}}))
    assert store.close_many(items) == [True] * len(pids)
    for i, p in enumerate(pids):
        row = store.get(key(p))
        assert (row.state, row.reply_id, row.error) == (st.CLOSED, ODD_TEXTS[i][:1024], None)
        assert repr(row.closed_at) == repr(ODD_FLOATS[-1 - i])
        assert json.loads(store.history(key(p))[-1].detail) == {"reply_id": ODD_TEXTS[i]}


def test_claim_page_is_all_or_nothing(store, store_url, clock):
    """A page claim whose last event cannot be written leaves every row as it was, new and reclaimed alike."""
    now = clock.now()
    freed = seed(store, "cq-0", state=st.RELEASED, attempt=1)
    held = {"state": st.COMPOSING, "attempt": 1, "updated_at": now, "lease_owner": "me", "lease_until": now + 5}
    with events_refused(store, store_url, parent_id="cq-2"):
        with pytest.raises(StoreError, match="no events"):
            store.claim_page([(freed, held, {"kind": "claimed", "owner": "me"}, ([st.RELEASED], 1, None))]
                             + [(key(f"cq-{i}"), open_row(clock), {"kind": "claimed", "owner": "me"}, None)
                                for i in (1, 2)])
        assert store.get(freed).state == st.RELEASED and [store.get(key(f"cq-{i}")) for i in (1, 2)] == [None] * 2
    assert kinds(store, freed) == []


def test_rows_of_reads_a_page_in_order(store, clock):
    """rows_of answers each key's row or None, in the order asked, repeated keys included."""
    a, b = seed(store, "ro-a", state=st.CLOSED, reply_id="ra"), seed(store, "ro-b", state=st.RELEASED)
    got = store.rows_of([b, key("ro-none"), a, b, Key("other-platform", S, "ro-a")])
    assert [r and (r.parent_id, r.state) for r in got] == [("ro-b", st.RELEASED), None, ("ro-a", st.CLOSED),
                                                           ("ro-b", st.RELEASED), None]
    assert store.rows_of([]) == []


def _close_item(pid: str, clock, attempt: int = 1) -> tuple:
    now = clock.now()
    values = {"state": st.CLOSED, "reply_id": f"r-{pid}", "closed_at": now, "updated_at": now, "error": None,
              "deadline_at": now + 60}
    return (key(pid), (st.OPEN, st.NOT_LANDED), attempt, values,
            {"kind": "closed", "state": st.CLOSED, "attempt": attempt, "owner": "me", "detail": {"reply_id": f"r-{pid}"}})


def test_close_many_closes_a_page_with_its_events_and_skips_moved_rows(store, clock):
    """close_many compare-and-sets each row with its event in order; a row that moved on (closed by the sweep,
    another attempt) is left as it is, with no event, and answers False."""
    for i in range(4):
        seed(store, f"cm-{i}", state=st.OPEN, attempt=1)
    seed(store, "cm-moved", state=st.CLOSED, attempt=1, reply_id="r-sweep")
    seed(store, "cm-later", state=st.OPEN, attempt=2)
    items = [_close_item(f"cm-{i}", clock) for i in range(4)]
    items.insert(1, _close_item("cm-moved", clock))
    items.append(_close_item("cm-later", clock, attempt=1))
    assert store.close_many(items) == [True, False, True, True, True, False]
    for i in range(4):
        row = store.get(key(f"cm-{i}"))
        assert (row.state, row.reply_id) == (st.CLOSED, f"r-cm-{i}")
        assert [(e.kind, e.state) for e in store.history(key(f"cm-{i}"))] == [("closed", st.CLOSED)]
    assert store.get(key("cm-moved")).reply_id == "r-sweep" and kinds(store, key("cm-moved")) == []
    assert store.get(key("cm-later")).state == st.OPEN and kinds(store, key("cm-later")) == []
    assert store.close_many([]) == []


def test_close_many_is_all_or_nothing(store, store_url, clock):
    """A page of closes whose last event cannot be written closes none of its rows: the closes commit as one."""
    for i in range(3):
        seed(store, f"cz-{i}", state=st.OPEN, attempt=1)
    with events_refused(store, store_url, parent_id="cz-2"):
        with pytest.raises(StoreError, match="no events"):
            store.close_many([_close_item(f"cz-{i}", clock) for i in range(3)])
        assert [store.get(key(f"cz-{i}")).state for i in range(3)] == [st.OPEN] * 3


def test_a_note_never_follows_a_transition_with_the_state_the_row_left(store, store_url, clock):
    """A note written while a rival's transition of the row is uncommitted waits for it and carries the new state:
    the history's last state is the row's (the model test found a ``late_landing`` note ending a ``composing``
    row's history with ``released``)."""
    k = seed(store, "nr", state=st.RELEASED, attempt=1)
    eng = sa.create_engine(store_url, isolation_level="AUTOCOMMIT")
    rival = eng.connect()
    rival.exec_driver_sql("BEGIN IMMEDIATE" if store.is_sqlite else "BEGIN")
    rival.exec_driver_sql("UPDATE replies SET state = 'composing' WHERE parent_id = 'nr'")
    rival.exec_driver_sql(
        "INSERT INTO events (at, platform, sender_id, parent_id, kind, state, attempt, owner, detail) "
        f"VALUES (1.0, '{k.platform}', '{k.sender_id}', 'nr', 'claimed', 'composing', 1, 'rival', '{{}}')")
    done = threading.Event()
    t = threading.Thread(target=lambda: (store.record(k, "late_landing", owner="me"), done.set()))
    t.start()
    done.wait(0.5)  # an unheld note ends at once (before the rival commits); a held one waits for the commit
    rival.exec_driver_sql("COMMIT")
    t.join(30)
    rival.close()
    eng.dispose()
    assert done.is_set()
    *_, last = [e for e in store.history(k) if e.state is not None]
    assert (last.state, store.get(k).state) == (st.COMPOSING, st.COMPOSING), \
        [(e.kind, e.state) for e in store.history(k)]


def test_record_notes_the_rows_state_and_attempt(store, clock):
    """A note carries the row's current state and attempt (none for a key without a row)."""
    k = seed(store, "n1", state=st.CLOSED, attempt=2)
    store.record(k, "duplicate_deleted", owner="sw", detail={"reply_id": "r9"})
    store.record(key("none"), "skipped", detail={"why": "policy"})
    e = store.last_event(k)
    assert (e.kind, e.state, e.attempt, e.owner, json.loads(e.detail)) == (
        "duplicate_deleted", st.CLOSED, 2, "sw", {"reply_id": "r9"})
    assert [(e.state, e.attempt) for e in store.find_events("none")] == [(None, None)]


# -- events and reads -------------------------------------------------------------------------------


def test_event_reads(store, clock):
    """history, last_event, count_events (after a kind), find_events, recent_events, events_with_path agree."""
    k = seed(store, "e1", path="inbox")
    other = Key("memory:other", S, "e1")
    for kind in ("claimed", "maybe_sent", "released", "maybe_sent", "closed"):
        clock.advance(1)
        store.record(k, kind)
    store.record(other, "skipped")
    assert kinds(store, k) == ["claimed", "maybe_sent", "released", "maybe_sent", "closed"]
    assert store.last_event(k).kind == "closed" and store.last_event(k, ["released"]).kind == "released"
    assert store.last_event(key("nothing")) is None
    assert store.count_events(k, "maybe_sent") == 2
    assert store.count_events(k, "maybe_sent", after_kinds=["released"]) == 1
    assert [e.platform for e in store.find_events("e1")] == [P] * 5 + ["memory:other"]
    assert len(store.find_events("e1", platform="memory:other")) == 1
    assert [e.kind for e in store.recent_events(2)] == ["skipped", "closed"]
    rows = store.events_with_path(limit=10)
    assert rows[0]["kind"] == "skipped" and rows[0]["path"] is None and rows[1]["path"] == "inbox"
    assert [r["kind"] for r in store.events_with_path(kind="maybe_sent")] == ["maybe_sent"] * 2
    assert len(store.events_with_path(path="inbox")) == 5
    assert len(store.events_with_path(platform="other")) == 1
    assert len(store.events_with_path(parent_id="e1", since=clock.now() - 1.5)) == 3  # two of e1's, the other's
    assert store.events_with_path(platform="%") == []  # a LIKE wildcard is matched literally


def test_row_reads(store, clock):
    """find, counts, path_counts, rows_in, oldest_open, count_opened_since, oldest_due_open, export_rows."""
    seed(store, "a", path="inbox", opened_at=10.0, deadline_at=50.0, author_id="u1", updated_at=1.0)
    clock.advance(5)
    seed(store, "b", path="inbox", opened_at=20.0, deadline_at=40.0, author_id="u2", updated_at=2.0)
    seed(store, "c", path="search", state=st.CLOSED, opened_at=30.0, author_id="u1", updated_at=3.0)
    seed(store, "d", state=st.RELEASED, updated_at=4.0)
    with store.transaction() as tx:
        tx.insert_new(Key("memory:x", S, "a"), {"state": st.OPEN, "attempt": 1, "created_at": 0.0, "updated_at": 0.0,
                                                "opened_at": 50.0})
    assert {r.platform for r in store.find("a")} == {P, "memory:x"} and len(store.find("a", platform=P)) == 1
    assert store.counts()[(P, st.OPEN)] == 2 and store.counts()[(P, st.CLOSED)] == 1
    by_path = {path: (n, last) for p, s, path, n, last in store.path_counts() if p == P}
    assert by_path["inbox"] == (2, clock.now()) and by_path["search"][0] == 1
    assert [r.parent_id for r in store.rows_in(P, S, [st.OPEN, st.RELEASED])] == ["a", "b", "d"]
    assert [r.parent_id for r in store.rows_in(P, S, [st.OPEN, st.RELEASED], since=2.0)] == ["b", "d"]
    assert [r.parent_id for r in store.oldest_open(2)][:1] == ["a"]
    assert store.count_opened_since(P, S, 15.0) == 2  # b open, c closed; a opened before
    assert store.count_opened_since(P, S, 0.0, author_id="u1") == 2
    assert store.oldest_due_open(P, S, now=45.0) == 40.0 and store.oldest_due_open(P, S, now=39.0) is None
    rows = list(store.export_rows("replies"))
    assert [r["parent_id"] for r in rows][:1] == ["a"] and set(rows[0]) == set(st.EXPORT_TABLES["replies"])
    assert len(list(store.export_rows("replies", since=2.0))) == 3
    store.record(key("a"), "claimed")
    ev = list(store.export_rows("events"))
    assert [e["kind"] for e in ev] == ["claimed"] and set(ev[0]) == set(st.EXPORT_TABLES["events"])


def test_a_row_counts_for_its_author_and_for_its_origin(store, clock):
    """The per-author counts (caps, the loop breaker) find a row by its author_id (where the answer went) or by its
    origin_id (the sender, set when that is someone else); the bot's own count still counts each row once."""
    seed(store, "a", opened_at=10.0, author_id="r1@x.example", origin_id="s@x.example")
    seed(store, "b", opened_at=20.0, author_id="r2@x.example", origin_id="s@x.example")
    seed(store, "c", opened_at=30.0, author_id="s@x.example")
    seed(store, "d", state=st.RELEASED, author_id="r3@x.example", origin_id="s@x.example")  # not sent: not counted
    assert store.count_opened_since(P, S, 0.0, author_id="s@x.example") == 3
    assert store.count_opened_since(P, S, 15.0, author_id="s@x.example") == 2
    assert store.count_opened_since(P, S, 0.0, author_id="r1@x.example") == 1
    assert store.count_opened_since(P, S, 0.0, author_id="r3@x.example") == 0
    assert store.count_opened_since(P, S, 0.0) == 3
    assert store.oldest_opened_since(P, S, 0.0, author_id="s@x.example") == 10.0
    assert store.oldest_opened_since(P, S, 15.0, author_id="r2@x.example") == 20.0
    assert store.get(key("a")).origin_id == "s@x.example" and store.get(key("c")).origin_id is None


def test_overdue_lists_rows_past_their_bound(store, clock):
    """Each waiting state's bound (lease, deadline, back-off, last change), most overdue first, terminal ones never."""
    seed(store, "comp", state=st.COMPOSING, lease_until=100.0, updated_at=0.0)
    seed(store, "open", deadline_at=200.0, updated_at=0.0)
    seed(store, "rel", state=st.RELEASED, not_before=None, updated_at=50.0)
    seed(store, "nl", state=st.NOT_LANDED, updated_at=300.0)
    seed(store, "done", state=st.CLOSED, updated_at=0.0)
    got = [(r.parent_id, over) for r, over in store.overdue(now=400.0, grace_s=10.0)]
    assert got == [("rel", 350.0), ("comp", 300.0), ("open", 200.0), ("nl", 100.0)]
    assert [r.parent_id for r, _ in store.overdue(now=400.0, grace_s=150.0, limit=2)] == ["rel", "comp"]


def test_reoffer_due_pages_through_waiting_rows(store, clock):
    """not_landed, released and lease-expired composing rows, page by page in (updated_at, parent_id) order."""
    for i, state in enumerate([st.NOT_LANDED, st.RELEASED, st.COMPOSING, st.NOT_LANDED, st.OPEN]):
        seed(store, f"r{i}", state=state, updated_at=float(i // 2), lease_until=5.0 if state == st.COMPOSING else None)
    seed(store, "live", state=st.COMPOSING, updated_at=0.0, lease_until=50.0)
    first = store.reoffer_due(P, S, now=10.0, after=None, limit=2)
    assert [r.parent_id for r in first] == ["r0", "r1"]
    last = first[-1]
    rest = store.reoffer_due(P, S, now=10.0, after=(last.updated_at, last.parent_id), limit=10)
    assert [r.parent_id for r in rest] == ["r2", "r3"]
    assert [r.parent_id for r in store.reoffer_due(P, S, now=1.0, after=None, limit=10)] == ["r0", "r1", "r3"]


# -- sweep leases -------------------------------------------------------------------------------------


def test_lease_due_takes_due_rows_no_live_lease_holds(store, clock):
    """Due rows of the swept states are leased once; a live lease is respected, an expired one taken over."""
    seed(store, "o1", deadline_at=10.0)
    seed(store, "c1", state=st.CLOSED, deadline_at=5.0)
    seed(store, "later", deadline_at=500.0)
    seed(store, "rel", state=st.RELEASED, deadline_at=1.0)
    seed(store, "held", deadline_at=1.0, lease_owner="other", lease_until=200.0)
    got = store.lease_due(P, S, now=100.0, limit=10, lease_s=30.0, owner="s1")
    assert [r.parent_id for r in got] == ["c1", "o1"]
    assert all((r.lease_owner, r.lease_until) == ("s1", 130.0) for r in got)
    assert store.get(key("o1")).lease_owner == "s1"
    assert store.lease_due(P, S, now=100.0, limit=10, lease_s=30.0, owner="s2") == []
    assert [r.parent_id for r in store.lease_due(P, S, now=250.0, limit=1, lease_s=30.0, owner="s2")] == ["held"]


def test_renew_leases_keeps_only_live_leases_of_their_owner(store, clock):
    """A renewal moves the owner's live leases on; a lease that ran out, another owner's, or a decided row's is left."""
    seed(store, "a", deadline_at=1.0)
    seed(store, "b", deadline_at=1.0)
    seed(store, "theirs", deadline_at=1.0, lease_owner="s2", lease_until=200.0)
    assert len(store.lease_due(P, S, now=100.0, limit=10, lease_s=30.0, owner="s1")) == 2
    with store.transaction() as tx:  # "b" decided: its lease dropped
        assert tx.cas_event(key("b"), states=[st.OPEN], attempt=1, lease_owner="s1",
                            values={"deadline_at": None, "lease_owner": None, "lease_until": None})
    keys = [key(f"absent-{i}") for i in range(1200)] + [key("b"), key("theirs"), key("a")]  # past one statement's
    assert store.renew_leases(keys, owner="s1", now=120.0, until=150.0) == 1
    assert (store.get(key("a")).lease_owner, store.get(key("a")).lease_until) == ("s1", 150.0)
    assert (store.get(key("b")).lease_owner, store.get(key("b")).lease_until) == (None, None)
    assert (store.get(key("theirs")).lease_owner, store.get(key("theirs")).lease_until) == ("s2", 200.0)
    assert store.lease_due(P, S, now=140.0, limit=10, lease_s=30.0, owner="s3") == []  # "a" still held (past 130)
    # Ran out before the renewal came: not taken back, whoever leases it next has it.
    assert store.renew_leases([key("a")], owner="s1", now=151.0, until=181.0) == 0
    assert [r.parent_id for r in store.lease_due(P, S, now=151.0, limit=10, lease_s=30.0, owner="s3")] == ["a"]


def test_a_delayed_renewal_never_shortens_a_lease(store, clock):
    """A renewal whose write lands after a later one (a stalled keeper thread) still counts the lease held but
    leaves the later end: the row never looks free to another sweeper while its pass runs."""
    seed(store, "a", deadline_at=1.0)
    assert len(store.lease_due(P, S, now=100.0, limit=10, lease_s=30.0, owner="s1")) == 1
    assert store.renew_leases([key("a")], owner="s1", now=120.0, until=150.0) == 1  # the later renewal, first
    assert store.renew_leases([key("a")], owner="s1", now=110.0, until=140.0) == 1  # the stalled one, after it
    assert store.get(key("a")).lease_until == 150.0
    assert store.lease_due(P, S, now=145.0, limit=10, lease_s=30.0, owner="s2") == []


def test_senders_due_and_waiting_name_every_bot_with_rows_due(store, clock):
    """One query for all bots: the (platform, sender) of every bot whose lease_due / reoffer_due would return rows."""
    seed(store, "o1", deadline_at=10.0)
    with planting(), store.transaction() as tx:
        for sender, values in (("later", {"deadline_at": 500.0}),
                               ("held", {"deadline_at": 1.0, "lease_owner": "other", "lease_until": 200.0}),
                               ("nl", {"state": st.NOT_LANDED}),
                               ("comp", {"state": st.COMPOSING, "lease_until": 50.0})):
            assert tx.insert_new(Key(P, sender, "p"), {"state": st.OPEN, "attempt": 1, "created_at": 0.0,
                                                       "updated_at": 0.0, **values})
    assert store.senders_due(100.0) == {(P, S)}
    assert store.senders_due(600.0) == {(P, S), (P, "later"), (P, "held")}
    assert store.senders_waiting(10.0) == {(P, "nl")}
    assert store.senders_waiting(100.0) == {(P, "nl"), (P, "comp")}
    assert [r.parent_id for r in store.reoffer_due(P, "comp", now=100.0, after=None, limit=10)] == ["p"]
    assert [r.parent_id for r in store.lease_due(P, S, now=100.0, limit=10, lease_s=30.0, owner="s1")] == ["o1"]
    assert store.senders_due(100.0) == set()  # leased now: another pass would find nothing


# -- cursors, listing lag, listing delays -------------------------------------------------------------


def test_cursors_are_saved_and_replaced(store, clock):
    """A poller's position is per (platform, bot, name), replaced in place."""
    assert store.get_cursor(P, S, "inbox") is None
    store.set_cursor(P, S, "inbox", "10")
    store.set_cursor(P, S, "inbox", "11")
    store.set_cursor(P, S, "search", "a")
    assert (store.get_cursor(P, S, "inbox"), store.get_cursor(P, S, "search"), store.get_cursor(P, "x", "inbox")) == (
        "11", "a", None)


def test_lag_samples(store, clock):
    """Unlisted looks raise the proven lower bound; the first listing completes a sample, later ones change nothing."""
    with store.transaction() as tx:
        assert not tx.lag_look(P, S, "r1", sent_at=100.0, age_s=2.0, listed=False, now=102.0)
        assert not tx.lag_look(P, S, "r1", sent_at=100.0, age_s=1.0, listed=False, now=101.0)
        assert not tx.lag_look(P, S, "r1", sent_at=100.0, age_s=3.0, listed=False, now=103.0)
        assert tx.lag_look(P, S, "r1", sent_at=100.0, age_s=5.0, listed=True, now=105.0)
        assert not tx.lag_look(P, S, "r1", sent_at=100.0, age_s=9.0, listed=True, now=109.0)
        assert tx.lag_look(P, S, "r2", sent_at=200.0, age_s=0.5, listed=True, now=200.5)
        tx.lag_look("memory:other", S, "r3", sent_at=50.0, age_s=1.0, listed=False, now=51.0)
    assert store.lag_samples(P, 10) == [(0.0, 0.5), (3.0, 5.0)]  # newest first
    assert store.lag_samples(P, 1) == [(0.0, 0.5)]
    assert store.lag_samples("memory:other", 10) == []  # not complete
    assert sorted(store.lag_platforms()) == sorted([P, "memory:other"])
    store.lag_prune(P, before=150.0)
    assert store.lag_samples(P, 10) == [(0.0, 0.5)]


def test_listing_delays_are_recorded_per_platform(store, clock):
    """The delay in use per platform instance, replaced in place, stamped with the store's clock."""
    store.set_listing_delay(P, 5.0, 5.0)
    clock.advance(10)
    store.set_listing_delay(P, 5.0, 12.5)
    store.set_listing_delay("memory:x", 3.0, 3.0)
    d = store.listing_delays()
    assert set(d) == {P, "memory:x"}
    assert (d[P].configured_s, d[P].in_use_s, d[P].updated_at) == (5.0, 12.5, clock.now())


# -- durability ---------------------------------------------------------------------------------------


def _sqlite_commits(store: Store, posts: int, face: type, *, page: bool = False) -> list[tuple[str | None, str]]:
    """``face``'s guard posts on ``store`` (one by one, or as one page); (the write, the synchronous level) of every
    COMMIT SQLite ran."""
    trace: list[tuple[int, str]] = []
    store.dispose()  # connections opened from here on are traced
    # Per connection: the async face writes closes on its loop's own connection, claims on the store thread's.
    store.on_connect(lambda dbc: dbc.set_trace_callback(lambda sql, c=id(dbc): trace.append((c, sql))))  # noqa: B008 - each connection's id, bound when it opens
    plat = MemoryPlatform(clock=store.clock)
    g = face(store, plat, plat.whoami(), clock=store.clock, watch_interval_s=None)
    parents = [plat.add_parent(f"p{i}") for i in range(posts)]
    outs = g.post_page([(p, "x") for p in parents]) if page else [g.post(p, "x") for p in parents]
    assert all(o.status is Status.POSTED for o in outs), outs
    g.close()
    sync: dict[int, str] = {}  # a new connection starts FULL
    commits: list[tuple[str | None, str]] = []
    last_write: dict[int, str] = {}
    for conn, s in trace:
        u = s.strip().upper()
        if u.startswith("PRAGMA SYNCHRONOUS="):
            sync[conn] = u.split("=")[1]
        elif u.startswith(("INSERT INTO REPLIES", "UPDATE REPLIES")):
            last_write[conn] = u.split()[0]
        elif u == "COMMIT":
            commits.append((last_write.get(conn), sync.get(conn, "FULL")))
    return commits


@pytest.mark.parametrize("durability,claim,close", [("as_asked", "FULL", "NORMAL"), ("durable", "FULL", "FULL"),
                                                    ("relaxed", "NORMAL", "NORMAL")])
def test_sqlite_durability(tmp_path, clock, durability, claim, close, face):
    """SQLite: the claim commits FULL and the close NORMAL, unless the store's durability option pins both."""
    store = Store.open(f"sqlite:///{tmp_path / 'd.sqlite3'}", clock=clock, durability=durability)
    try:
        assert _sqlite_commits(store, 2, face) == [("INSERT", claim), ("UPDATE", close)] * 2
    finally:
        store.dispose()


def test_sqlite_page_claim_is_one_full_commit(tmp_path, clock, face):
    """SQLite: a page of 6 posts commits its claims once (FULL) and its closes once (NORMAL), on each face."""
    store = Store.open(f"sqlite:///{tmp_path / 'd.sqlite3'}", clock=clock)
    try:
        assert _sqlite_commits(store, 6, face, page=True) == [("INSERT", "FULL"), ("UPDATE", "NORMAL")]
    finally:
        store.dispose()


EVENT_NOTES = """
CREATE TABLE event_notes ({columns});
CREATE FUNCTION note_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO event_notes VALUES ({values});
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER note_event AFTER INSERT ON events
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION note_event();
"""


@contextmanager
def event_notes(pg_url: str, columns: str, values: str) -> Iterator[Callable[[], list[tuple[Any, ...]]]]:
    """Every event inserted meanwhile noted as ``values`` (SQL over ``NEW`` and the transaction, evaluated as it
    commits) in a table of ``columns``; yields a reader of the notes. The table and trigger are dropped after."""
    eng = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.exec_driver_sql(EVENT_NOTES.format(columns=columns, values=values))

    def notes() -> list[tuple[Any, ...]]:
        with eng.connect() as c:
            return [tuple(r) for r in c.exec_driver_sql("SELECT * FROM event_notes")]

    try:
        yield notes
    finally:
        with eng.connect() as c:
            c.exec_driver_sql("DROP TRIGGER IF EXISTS note_event ON events; DROP FUNCTION IF EXISTS note_event(); "
                              "DROP TABLE IF EXISTS event_notes")
        eng.dispose()


@contextmanager
def commit_modes(pg_url: str) -> Iterator[Callable[[], list[tuple[Any, ...]]]]:
    """An emptied log whose events record (kind, state, their transaction's synchronous_commit); yields a reader."""
    eng = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, answers")
    eng.dispose()
    with event_notes(pg_url, "kind TEXT, state TEXT, mode TEXT",
                     "NEW.kind, NEW.state, current_setting('synchronous_commit')") as notes:
        yield notes


@pytest.mark.postgres
@pytest.mark.parametrize("durability", ["as_asked", "durable", "relaxed"])
def test_postgres_durability(pg_url, clock, durability, face):
    """PostgreSQL: every open row commits synchronously and closes/notes with synchronous_commit off, as asked;
    a relaxed close never leaks into the next claim on the same connection; the option pins every commit."""
    with commit_modes(pg_url) as read_modes:
        eng = sa.create_engine(pg_url)
        with eng.connect() as c:
            default = c.exec_driver_sql("SHOW synchronous_commit").scalar()
        eng.dispose()
        assert default != "off", "the server itself commits asynchronously: this test cannot tell"
        store = Store.open(pg_url, clock=clock, durability=durability)
        try:
            plat = MemoryPlatform(clock=clock)
            g = face(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
            for pid in ("text", "again"):  # the second claim runs on the connection the first close used
                assert g.post(plat.add_parent(pid), "a reply").status is Status.POSTED
            assert g.post(plat.add_parent("composed"), lambda p: "composed reply").status is Status.POSTED
            page = g.post_page([(plat.add_parent(f"page{i}"), "a reply") for i in range(3)])  # one page claim
            assert [o.status for o in page] == [Status.POSTED] * 3
            store.record(Key("p", "s", "probe"), "probe", owner="t")
            g.close()
            modes = read_modes()
            opened = [m for _, s, m in modes if s == st.OPEN]
            relaxed = [m for k, _, m in modes if k in ("closed", "probe")]
            assert len(opened) >= 6 and len(relaxed) == 7, modes
            want_open = "off" if durability == "relaxed" else default
            want_relaxed = default if durability == "durable" else "off"
            assert set(opened) == {want_open}, f"open rows committed {opened}, want {want_open}: {modes}"
            assert set(relaxed) == {want_relaxed}, f"closes committed {relaxed}, want {want_relaxed}: {modes}"
        finally:
            store.dispose()


@pytest.mark.postgres
def test_postgres_page_claim_of_composers_is_synchronous(pg_url, clock, face):
    """PostgreSQL: a page claim of parents to compose (a new key and a released row among them) commits
    synchronously, though a single composing claim is relaxed; each row's lease and close stay relaxed."""
    with commit_modes(pg_url) as read_modes:
        store = Store.open(pg_url, clock=clock)
        try:
            plat = MemoryPlatform(clock=clock)
            g = face(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
            parents = [plat.add_parent(f"cp{i}") for i in range(3)]
            seed_values = {"state": st.RELEASED, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now()}
            with store.transaction() as tx:
                tx.insert_new(g.key("cp1"), seed_values)
            outs = g.post_page([(p, lambda parent: f"composed for {parent.id}") for p in parents])
            assert [o.status for o in outs] == [Status.POSTED] * 3
            g.close()
            modes = read_modes()
            claimed = [m for k, s, m in modes if k == "claimed"]
            assert len(claimed) == 3 and "off" not in claimed, modes
            assert {m for k, _, m in modes if k == "closed"} == {"off"}, modes
        finally:
            store.dispose()


# -- concurrency with real OS processes ---------------------------------------------------------------

KEYS = 40
RACERS = 4


def _racer(url: str, me: str, seed_: int, barrier, out, on_async_face: bool) -> None:
    """One replica process: claim every key (in its own order) and lease due rows; report what it won."""
    opened = Store.open(url, migrate=False)
    store = StoreOnFace(opened) if on_async_face else opened
    order = [f"k{i}" for i in range(KEYS)]
    random.Random(seed_).shuffle(order)

    def reclaim(r: st.Row) -> dict | None:
        return {"state": st.OPEN, "attempt": r.attempt + 1, "owner": me} if r.state == st.RELEASED else None

    try:
        barrier.wait(30)
        won = [pid for pid in order if store.claim(
            key(pid), {"state": st.OPEN, "attempt": 1, "created_at": 1.0, "updated_at": 1.0, "owner": me},
            reclaim, {"kind": "claimed", "owner": me}).won]
        barrier.wait(30)
        leased = []
        for _ in range(KEYS):  # small pages, so the replicas' leases interleave
            got = store.lease_due("memory:lease", S, now=100.0, limit=3, lease_s=60.0, owner=me)
            if not got:
                break
            leased += [r.parent_id for r in got]
        out.put((me, won, leased))
    finally:
        if on_async_face:
            store.close()
        opened.dispose()


def test_replica_processes_claim_and_lease_each_key_once(store, store_url, face):
    """Real OS processes claim the same keys (new and released ones) and lease the same due rows: one winner each."""
    for i in range(0, KEYS, 2):  # half the keys exist, released: reclaim races the compare-and-set
        seed(store, f"k{i}", state=st.RELEASED)
    for i in range(KEYS):
        with store.transaction() as tx:
            tx.insert_new(Key("memory:lease", S, f"l{i}"), {"state": st.OPEN, "attempt": 1, "created_at": 0.0,
                                                             "updated_at": 0.0, "deadline_at": 1.0})
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(store_url, f"r{n}", n, barrier, out, face is BlockingAsyncGuard)) for n in range(RACERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    won = [pid for _, w, _ in results for pid in w]
    assert sorted(won) == sorted(f"k{i}" for i in range(KEYS)), "a key claimed twice or not at all"
    for me, w, _ in results:
        for pid in w:
            row = store.get(key(pid))
            assert row.owner == me and row.state == st.OPEN
            assert [e.owner for e in store.history(key(pid)) if e.kind == "claimed"] == [me]
    leased = [pid for _, _, lz in results for pid in lz]
    assert sorted(leased) == sorted(f"l{i}" for i in range(KEYS)), "a row leased twice or not at all"
