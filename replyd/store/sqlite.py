"""The SQLite backend: the embedded default (one machine).

WAL, ``synchronous=FULL``, a busy timeout, and every write transaction ``BEGIN IMMEDIATE``, so a read-then-write
never dead-ends on a stale snapshot. The claim reads the row before ``BEGIN IMMEDIATE``, so a taken key costs no
write lock; durability is switched per commit (FULL / NORMAL) with a PRAGMA only when it changes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine

from replyd.errors import StoreError
from replyd.log import get_logger
from replyd.store.base import _INHERITED, Store
from replyd.store.engine import map_db_error
from replyd.store.model import Claim, Expect, Key, Row, lease_holder

log = get_logger("replyd.store")

SQLITE_BUSY_TIMEOUT_MS = 30_000


def _owner_only_sqlite(db: Path) -> None:
    """Make a SQLite store owner-only: a new directory 0700, the database 0600 (created here, so SQLite
    gives its WAL and SHM files the same mode), and existing files this user owns tightened to 0600."""
    try:
        db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(db, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass  # opened as it is (it may be read-only: SQLite then fails closed on the first write)
    except OSError as exc:
        raise StoreError(f"cannot create the store {db}: {exc.strerror}") from None
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        try:
            st_ = path.stat()
            if st_.st_uid == os.geteuid() and st_.st_mode & 0o077:
                path.chmod(0o600)
                log.warning("replyd.store.permissions_tightened", path=str(path), was=oct(st_.st_mode & 0o777))
        except FileNotFoundError:
            continue
        except OSError as exc:  # not ours to change (a read-only mount): say so, do not stop
            log.warning("replyd.store.permissions_unchanged", path=str(path), error=exc.strerror)



def _sqlite_on_connect(dbapi_conn: Any, record: Any) -> None:
    # Take transaction control away from pysqlite so BEGIN IMMEDIATE is ours to emit.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.close()
    record.info["synchronous"] = "FULL"  # what this connection commits with now; see _sqlite_durability


def _sqlite_durability(dbapi_conn: Any, info: dict[str, Any], relaxed: bool) -> None:
    """Make the connection's next commit FULL (or NORMAL when ``relaxed``); no PRAGMA when it already is."""
    want = "NORMAL" if relaxed else "FULL"
    if info.get("synchronous") != want:
        info.pop("synchronous", None)  # unknown until the PRAGMA has run
        dbapi_conn.execute(f"PRAGMA synchronous={want}")
        info["synchronous"] = want


def _sqlite_on_begin(conn: Connection) -> None:
    opts = conn.get_execution_options()
    # Per-transaction durability: a claim is FULL, a close may be NORMAL (no PRAGMA when already so).
    want = "NORMAL" if opts.get("relaxed") else "FULL"
    if conn.info.get("synchronous") != want:
        conn.info.pop("synchronous", None)
        conn.exec_driver_sql(f"PRAGMA synchronous={want}")
        conn.info["synchronous"] = want
    conn.exec_driver_sql("BEGIN IMMEDIATE" if opts.get("write") else "BEGIN")



class SQLiteStore(Store):
    """The answered-log in one SQLite file (or in memory)."""

    backend = "sqlite"
    is_sqlite = True

    def __init__(self, engine: Engine, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self._now = threading.local()  # write_now's connection, one per calling thread (an event loop's)
        self._now_all: list[Any] = []  # every one of them, for dispose

    def _reset_pool(self) -> None:
        while self._now_all:
            fairy = self._now_all.pop()
            try:
                fairy.close()
            except Exception:  # a connection another thread holds or already closed: nothing to release
                pass
        self._now = threading.local()
        super()._reset_pool()

    def _forget_after_fork(self) -> None:
        super()._forget_after_fork()
        _INHERITED.extend(self._now_all)
        self._now_all, self._now = [], threading.local()

    @classmethod
    def make_engine(cls, url: sa.URL) -> Engine:
        """A SQLite engine: the file owner-only, WAL, FULL commits, BEGIN IMMEDIATE for writes."""
        db = url.database
        if db and db != ":memory:" and not db.startswith("file:"):
            _owner_only_sqlite(Path(db).expanduser())
        engine = sa.create_engine(
            url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        )
        sa.event.listen(engine, "connect", _sqlite_on_connect)
        sa.event.listen(engine, "begin", _sqlite_on_begin)
        return engine

    def db_epoch(self) -> float:
        """Return this machine's clock in epoch seconds, read through SQLite (one machine: no other clock)."""
        with self._tx(write=False, doing="reading the database clock") as conn:
            return float(conn.exec_driver_sql(
                "SELECT CAST((julianday('now') - 2440587.5) * 86400.0 AS REAL)").scalar_one())

    def _greatest(self, column: sa.ColumnElement[Any], value: float) -> sa.ColumnElement[Any]:
        return sa.func.max(column, value)  # SQLite's scalar max of two arguments

    def _insert(self, table: sa.Table) -> Any:
        return sqlite_dialect.insert(table)

    def _tx_failed(self, exc: sa.exc.DBAPIError) -> None:
        if "readonly database" in str(exc.orig).lower():
            # SQLite opens an unwritable file read-only and the pool would keep that connection
            # for ever: drop it, so the first write after the file is writable again succeeds.
            self._reset_pool()

    # -- the hot path ---------------------------------------------------------------

    def _driver_failed(self, fairy: Any, exc: Exception) -> None:
        if "readonly database" in str(exc).lower():
            # As in _tx(): never keep a connection SQLite opened read-only.
            fairy.invalidate(exc)
            self._reset_pool()

    def _keepable(self, fairy: Any) -> bool:
        return not fairy.driver_connection.in_transaction

    def _fetch(self, fairy: Any, sql: str, params: Mapping[str, Any]) -> list[Any]:
        return fairy.driver_connection.execute(sql, params).fetchall()

    def _write(self, fairy: Any, relaxed: bool, body: Callable[[Any], Any]) -> Any:
        """``body(conn)`` inside BEGIN IMMEDIATE … COMMIT, committed FULL (NORMAL when ``relaxed``)."""
        dbc = fairy.driver_connection
        _sqlite_durability(dbc, fairy.info, self.commit_relaxed(relaxed))
        dbc.execute("BEGIN IMMEDIATE")
        try:
            out = body(dbc)
            dbc.execute("COMMIT")
        except BaseException:
            if dbc.in_transaction:
                try:
                    dbc.execute("ROLLBACK")
                except self._dbapi_error:
                    fairy.invalidate()
            raise
        return out

    def claim(self, key: Key, new: Mapping[str, Any], reclaim: Callable[[Row], Mapping[str, Any] | None],
              event: Mapping[str, Any], *, relaxed: bool = False, doing: str = "claiming") -> Claim:
        """``Store.claim``: read the row first (no write lock when the key is taken), then insert or
        compare-and-set under ``BEGIN IMMEDIATE``, deciding again on a row inserted since the read."""
        ins, ev = self._claim_params(key, new, event)
        with self._driver(doing) as fairy:
            row = self._peek_with(fairy, key)
            if row is None:
                return self._write(fairy, relaxed, lambda dbc: self._insert_claim(dbc, fairy, key, ins, ev, new,
                                                                                reclaim, event))
            return self._reclaim(fairy, key, row, reclaim, event, relaxed)

    def _insert_claim(self, dbc: Any, fairy: Any, key: Key, ins: Mapping[str, Any], ev: Mapping[str, Any],
                      new: Mapping[str, Any], reclaim: Callable[[Row], Mapping[str, Any] | None],
                      event: Mapping[str, Any]) -> Claim:
        """Inside the caller's write transaction: insert the new row and its event, or decide on the row that
        was inserted since the read (under the lock)."""
        if self._exec(dbc, self._sql.insert, ins).rowcount == 1:
            self._exec(dbc, self._sql.event, ev)
            return Claim(True, None, new)
        got = self._peek_with(fairy, key)
        vals = None if got is None else reclaim(got)
        if vals is None:
            return Claim(False, got, None)
        assert got is not None
        if self._cas_in(dbc, key, [got.state], got.attempt, vals, lease_holder(got),
                        {**event, "state": vals.get("state"), "attempt": vals.get("attempt")}, None):
            return Claim(True, None, vals)
        return Claim(False, got, None)

    def claim_group(self, calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[Claim | None]:
        """``ClaimsInGroup``: the ``claim`` calls (their args and kwargs) whose keys have no row yet, inserted
        under one ``BEGIN IMMEDIATE`` … ``COMMIT`` (one fsync for all, FULL unless every one is relaxed); per
        call its ``Claim``, or None for a call to be run alone (its key has a claimable row: that takes its own
        compare-and-set; or its values are bad). A key whose row is not claimable is decided on the read.

        Each claim commits durably before any of them is answered, so the group is as safe as one claim per
        commit; two calls on one key are decided in order inside the transaction, as two commits would be.
        A transaction that fails raises, nothing written: the caller runs the calls one by one.
        """
        out: list[Claim | None] = [None] * len(calls)
        fresh: list[tuple[int, Key, dict[str, Any], dict[str, Any], Mapping[str, Any], Any, Mapping[str, Any]]] = []
        relaxed = True
        with self._driver("claiming") as fairy:
            for i, (args, kwargs) in enumerate(calls):
                key, new, reclaim, event = args
                try:
                    ins, ev = self._claim_params(key, new, event)
                except ValueError:
                    continue  # run alone: its own call raises the error to its own caller
                row = self._peek_with(fairy, key)
                if row is None:
                    fresh.append((i, key, ins, ev, new, reclaim, event))
                    relaxed = relaxed and bool(kwargs.get("relaxed", False))
                elif reclaim(row) is None:  # taken and not claimable: decided on the read, as ``claim`` decides it
                    out[i] = Claim(False, row, None)
            if len(fresh) > 1:
                got = self._write(fairy, relaxed, lambda dbc: [self._insert_claim(dbc, fairy, *f[1:]) for f in fresh])
                for f, claim in zip(fresh, got, strict=True):
                    out[f[0]] = claim
        return out

    def write_now(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
        """Run a relaxed compare-and-set (a close) at once on the calling thread when it can go without waiting:
        ``(True, result)``; ``(False, None)`` when it would have to wait, or is not such a call (run it elsewhere).

        For the async face, whose loop must not wait: a relaxed commit in WAL mode writes the WAL to the page
        cache and does not fsync, this thread's connection never waits for a lock (``busy_timeout = 0``: a
        writer holding it gives "database is locked" at once and the call goes to the store thread, nothing
        written) and never checkpoints (``wal_autocheckpoint = 0``: the store thread's commits do). It saves
        the close its trip to the store thread and back, most of what the async face cost over the sync one.
        """
        if fn != self.cas_event or not kwargs.get("relaxed") or not self.commit_relaxed(True):
            return False, None
        if kwargs.get("due_by") is not None or kwargs.get("deadline_at_least") is not None:
            return False, None
        fairy = self._now_connection()
        kw = dict(kwargs)
        doing = kw.pop("doing", "writing")
        try:
            return True, self._cas_with(fairy, args[0], kw["states"], kw["attempt"], kw["values"],
                                        kw.get("lease_owner"), kw.get("event"), kw.get("otherwise"), True)
        except self._dbapi_error as exc:
            text = str(exc).lower()
            if "locked" in text or "busy" in text:
                return False, None  # rolled back by _write: nothing written, the store thread waits its turn
            self._now.conn = None
            if fairy in self._now_all:
                self._now_all.remove(fairy)
            fairy.invalidate(exc)
            self._driver_failed(fairy, exc)
            raise map_db_error(exc, doing) from None

    def _now_connection(self) -> Any:
        """This thread's connection for ``write_now``: out of the pool for good, never waiting, never checkpointing."""
        fairy = getattr(self._now, "conn", None)  # a threading.local: one per loop thread
        if fairy is None or not fairy.is_valid:
            try:
                fairy = self.engine.raw_connection()
            except (sa.exc.DBAPIError, self._dbapi_error) as exc:
                raise map_db_error(exc, "opening a connection") from None
            fairy.driver_connection.execute("PRAGMA busy_timeout=0")
            fairy.driver_connection.execute("PRAGMA wal_autocheckpoint=0")
            self._now.conn = fairy
            self._now_all.append(fairy)
        return fairy

    def claim_page(self, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any], Expect | None]], *,
                   relaxed: bool = False, doing: str = "claiming a page") -> list[bool]:
        """``Store.claim_page``: every insert or compare-and-set and its event under one ``BEGIN IMMEDIATE`` …
        ``COMMIT`` (one fsync)."""

        def write_all(dbc: Any) -> list[bool]:
            if len(rows) > 1 and all(expect is None for *_kve, expect in rows):
                got = self._insert_all(dbc, rows)
                if got is not None:
                    return got
            made = []
            for key, values, event, expect in rows:
                ev = _claim_event(values, event)
                if expect is None:
                    ins, evp = self._claim_params(key, values, ev)
                    done = self._exec(dbc, self._sql.insert, ins).rowcount == 1
                    if done:
                        self._exec(dbc, self._sql.event, evp)
                else:
                    states, attempt, holder = expect
                    done = self._cas_in(dbc, key, states, attempt, values, holder, ev, None)
                made.append(done)
            return made

        with self._driver(doing) as fairy:
            return self._write(fairy, relaxed, write_all)

    def close_many(self, items: Sequence[tuple[Key, Sequence[str], int, Mapping[str, Any], Mapping[str, Any]]], *,
                   relaxed: bool = True, doing: str = "closing a page") -> list[bool]:
        """``Store.close_many``: every compare-and-set and its event under one ``BEGIN IMMEDIATE`` … ``COMMIT``."""
        if not items:
            return []

        def write_all(dbc: Any) -> list[bool]:
            got = self._cas_all(dbc, items) if len(items) > 1 else None
            if got is not None:
                return got
            return [self._cas_in(dbc, key, states, attempt, values, None, event, None)
                    for key, states, attempt, values, event in items]

        with self._driver(doing) as fairy:
            return self._write(fairy, relaxed, write_all)

    # A page's rows written by one ``executemany`` per statement, not two ``execute`` calls per row: a sixth of a
    # 16-parent page's time on SQLite. Only when every row goes the same way (each key new; each compare-and-set
    # of one shape holding): a savepoint takes back a batch in which some row did not, and the rows go one by one.

    def _insert_all(self, dbc: Any, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any], Any]]
                    ) -> list[bool] | None:
        """Every row of a page of new keys inserted, then their events; None (nothing kept) if any key stood."""
        return self._all_or_none(
            dbc, self._sql.insert, [self._claim_row(key, values) for key, values, _e, _x in rows],
            [self._event_row(key, _claim_event(values, event), None, None) for key, values, event, _x in rows],
            one_statement=True)

    def _cas_all(self, dbc: Any, items: Sequence[tuple[Key, Sequence[str], int, Mapping[str, Any],
                                                       Mapping[str, Any]]]) -> list[bool] | None:
        """Every close of a page set, then their events, if all are of one shape and all hold; else None."""
        _k, states0, _a, values0, _e = items[0]
        shape = (tuple(values0), len(states0))
        if any((tuple(v), len(s)) != shape or a is None for _k, s, a, v, _e in items):
            return None
        sql, names = self._sql.cas(shape[0], shape[1], True, False, False, False)
        return self._all_or_none(
            dbc, sql, [self._cas_params(key, states, attempt, None, names, values)
                       for key, states, attempt, values, _e in items],
            [self._event_row(key, event, None, None) for key, _s, _a, _v, event in items])

    def _exec(self, dbc: Any, sql: str, params: Mapping[str, Any]) -> Any:
        """One hot-path write with its parameters bound by position (``HotSQL.positional``)."""
        q, get = self._sql.positional(sql)
        return dbc.execute(q, get(params))

    def _all_or_none(self, dbc: Any, sql: str, rows: list[dict[str, Any]], events: list[tuple[Any, ...]], *,
                     one_statement: bool = False) -> list[bool] | None:
        """``sql`` over ``rows`` and the events after it (each ``_event_row``) when every row took; else nothing
        kept and None. ``one_statement`` (an INSERT): the rows as one multi-row statement
        (``HotSQL.values_rows``), as the events always are; an UPDATE runs once per row."""
        dbc.execute("SAVEPOINT replyd_page")
        q, get = self._sql.positional(sql)
        done = (dbc.execute(self._sql.values_rows(sql, len(rows)), list(chain.from_iterable(map(get, rows))))
                if one_statement else dbc.executemany(q, map(get, rows)))
        if done.rowcount != len(rows):  # an INSERT … DO NOTHING counts only the rows it inserted
            dbc.execute("ROLLBACK TO replyd_page")
            dbc.execute("RELEASE replyd_page")
            return None
        dbc.execute(self._sql.values_rows(self._sql.event, len(events)), list(chain.from_iterable(events)))
        dbc.execute("RELEASE replyd_page")
        return [True] * len(rows)

    def _cas_with(self, fairy: Any, key: Key, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  lease_owner: str | None, event: Mapping[str, Any] | None, otherwise: Mapping[str, Any] | None,
                  relaxed: bool, answer: tuple[Sequence[str], float] | None = None) -> bool:
        return self._write(fairy, relaxed, lambda dbc: self._cas_in(
            dbc, key, states, attempt, values, lease_owner, event, otherwise, answer))

    def _cas_in(self, dbc: Any, key: Key, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                lease_owner: str | None, event: Mapping[str, Any] | None,
                otherwise: Mapping[str, Any] | None, answer: tuple[Sequence[str], float] | None = None) -> bool:
        """The compare-and-set and its event (or the ``otherwise`` note), and ``answer`` when it set the row,
        inside the caller's transaction."""
        sql, names = self._sql.cas(tuple(values), len(states), attempt is not None, lease_owner is not None,
                                   False, False)
        ok = self._exec(dbc, sql, self._cas_params(key, states, attempt, lease_owner, names, values)).rowcount == 1
        ev = event if ok else otherwise
        if ev is not None:
            self._exec(dbc, self._sql.event, self._event_params(key, ev, None, None))
        if ok and answer is not None:
            self._exec(dbc, self._sql.answer, self._answer_params(key, answer))
        return ok


def _claim_event(values: Mapping[str, Any], event: Mapping[str, Any]) -> dict[str, Any]:
    """A page claim's event: the state and attempt the row takes, unless the event names its own."""
    return {"state": values.get("state"), "attempt": values.get("attempt"), **event}
