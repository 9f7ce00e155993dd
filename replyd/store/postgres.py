"""The PostgreSQL backend: several replicas on several machines.

The hot path's write and its event are ONE statement (a data-modifying CTE) in autocommit: one round trip, one
transaction. The claim tries the insert first and reads the row only when it lost (callers ``check`` first, so
new keys are the common case). Durable writes may ask a ``synchronous_commit`` level (``claim_commit``) so a
claim survives a failover; relaxed ones set it off for their own transaction only.
"""

from __future__ import annotations

import select
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.engine import Connection, Engine

from replyd.errors import StoreError
from replyd.store.base import Stmts, Store
from replyd.store.hotsql import HotSQL
from replyd.store.model import Claim, Expect, Key, Row
from replyd.store.schema import EVENT_COLUMNS, REPLY_COLUMNS
from replyd.transitions import allowed


def _pg_idle_dead(dbapi_conn: Any) -> str | None:
    """Why an idle PostgreSQL connection is unusable (None if it is alive), without a round trip.

    An idle connection normally has nothing to read: one poll(2) says so, no network traffic. When the socket
    is readable, libpq reads what is there: a server that closed the connection (restart,
    ``pg_terminate_backend``, a cut proxy) shows as end of file or a bad status; a notice or a TLS record
    the server sent unasked is simply consumed and the connection kept.
    """
    if dbapi_conn.closed or getattr(dbapi_conn, "broken", False):
        return "connection closed"
    pgconn = getattr(dbapi_conn, "pgconn", None)
    try:
        fd = dbapi_conn.fileno()
        for _ in range(4):
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLPRI)
            if not poller.poll(0):
                return None
            if pgconn is None:
                return "the server sent data while the connection was idle"
            pgconn.consume_input()  # raises at end of file
            if pgconn.status != 0:  # CONNECTION_OK
                return "the connection is lost"
    except Exception as exc:  # no socket any more, or the server closed it
        return str(exc).strip() or type(exc).__name__
    return "the server keeps sending data while the connection is idle"


def _pg_on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    """Drop a pooled PostgreSQL connection the server has closed (instead of pool_pre_ping's round trip).

    Raising DisconnectionError makes the pool discard it and check out (or open) another.
    """
    why = _pg_idle_dead(dbapi_conn)
    if why:
        raise sa.exc.DisconnectionError(why)


class PostgresStore(Store):
    """The answered-log on a PostgreSQL server."""

    backend = "postgresql"
    is_sqlite = False

    @classmethod
    def make_engine(cls, url: sa.URL) -> Engine:
        """A psycopg engine whose pool drops connections the server closed, seen on their socket."""
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")
        if not url.drivername.startswith("postgresql"):
            raise StoreError(f"unsupported store URL scheme {url.drivername!r}: use sqlite:/// or postgresql+psycopg://")
        engine = sa.create_engine(url, pool_size=5, max_overflow=5,
                                  connect_args={"connect_timeout": 5, "application_name": "replyd"})
        # Not pool_pre_ping (a round trip per checkout): a dead idle connection is seen on its socket instead.
        sa.event.listen(engine.pool, "checkout", _pg_on_checkout)
        return engine

    @property
    def claim_commit(self) -> str | None:
        """The ``synchronous_commit`` level of durable writes (None: the server's default)."""
        return self._sql.durable

    @claim_commit.setter
    def claim_commit(self, level: str | None) -> None:
        Store.claim_commit.fset(self, level)  # type: ignore[attr-defined]  # the same check
        self._sql = HotSQL(self.engine.dialect, level)

    def sync_standbys(self) -> tuple[str, int | None]:
        """``synchronous_standby_names`` and how many synchronous standbys are connected now
        (None when this role may not see ``pg_stat_replication``)."""
        with self._tx(write=False, doing="reading the replication settings") as conn:
            names = conn.exec_driver_sql("SHOW synchronous_standby_names").scalar_one() or ""
            rows = conn.exec_driver_sql("SELECT sync_state FROM pg_stat_replication").scalars().all()
        if rows and all(r is None for r in rows):
            return names, None  # not allowed to see the columns
        return names, sum(1 for r in rows if r in ("sync", "quorum"))

    def claim_commit_problem(self) -> str | None:
        """Why the configured claim commit level cannot hold, on this server now; None when it can (or is local)."""
        if self.claim_commit in (None, "local"):
            return None
        names, connected = self.sync_standbys()
        if not names.strip():
            return (f"store.claim_commit = {self.claim_commit!r} but the server has no synchronous_standby_names: "
                    "claims commit on the primary only and a failover can lose them")
        if connected == 0:
            return (f"store.claim_commit = {self.claim_commit!r} and synchronous_standby_names = {names!r}, but no "
                    "synchronous standby is connected: every claim waits until one is")
        return None

    def db_epoch(self) -> float:
        """Return the database server's clock in epoch seconds."""
        with self._tx(write=False, doing="reading the database clock") as conn:
            return float(conn.exec_driver_sql("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").scalar_one())

    def _begun(self, conn: Connection, write: bool, relaxed: bool) -> None:
        if relaxed:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        elif write and self._sql.durable:
            conn.exec_driver_sql(f"SET LOCAL synchronous_commit = {self._sql.durable}")

    def _greatest(self, column: sa.ColumnElement[Any], value: float) -> sa.ColumnElement[Any]:
        return sa.func.greatest(column, value)

    def _insert(self, table: sa.Table) -> Any:
        return pg_dialect.insert(table)

    def _lock_rows(self, q: sa.Select) -> sa.Select:
        """``q`` locking its rows until the transaction ends: two replicas' heartbeats settle leases in turn."""
        return q.with_for_update()

    def _lock_due(self, q: sa.Select) -> sa.Select:
        # Replicas sweeping at once each take rows the others have not locked.
        return q.with_for_update(skip_locked=True)

    # -- the hot path: autocommit while the hot path has a connection ------------------

    def _alive(self, fairy: Any) -> bool:
        return _pg_idle_dead(fairy.driver_connection) is None

    def _fresh(self, fairy: Any) -> None:
        fairy.driver_connection.autocommit = True

    def _driver_failed(self, fairy: Any, exc: Exception) -> None:
        if self.engine.dialect.is_disconnect(exc, fairy.driver_connection, None):
            fairy.invalidate(exc)

    def _give_back(self, fairy: Any) -> None:
        """Back to the pool in transaction mode, as the pool's other users expect it."""
        if fairy.is_valid:
            try:
                fairy.driver_connection.autocommit = False
            except Exception:  # a broken connection refuses: never pool it again
                fairy.invalidate()
        fairy.close()

    def _fetch(self, fairy: Any, sql: str, params: Mapping[str, Any]) -> list[Any]:
        """Run one statement (autocommit: its own transaction, one round trip)."""
        cur = fairy.driver_connection.cursor()
        cur.execute(sql, params)
        return cur.fetchall()

    def claim(self, key: Key, new: Mapping[str, Any], reclaim: Callable[[Row], Mapping[str, Any] | None],
              event: Mapping[str, Any], *, relaxed: bool = False, doing: str = "claiming") -> Claim:
        """``Store.claim``: the insert and its event as one statement; the row is read only when it lost."""
        with self._driver(doing) as fairy:
            return self._drive(fairy, self._claim_steps(key, new, reclaim, event, relaxed=relaxed))

    def _claim_steps(self, key: Key, new: Mapping[str, Any], reclaim: Callable[[Row], Mapping[str, Any] | None],
                     event: Mapping[str, Any], *, relaxed: bool = False, doing: str = "claiming") -> Stmts[Claim]:
        ins, ev = self._claim_params(key, new, event)
        if (yield self._sql.claim(self.commit_relaxed(relaxed)), {**ins, **ev})[0][0] == 1:
            return Claim(True, None, new)
        row = yield from self._peek_steps(key)  # the row that made the insert lose
        if row is None:  # deleted since (an operator): report it in flight, as before
            return Claim(False, None, None)
        return (yield from self._reclaim_steps(None, key, row, reclaim, event, relaxed))

    def hot_steps(self, fn: Callable[..., Any], args: Sequence[Any],
                  kwargs: Mapping[str, Any]) -> tuple[Stmts[Any], str] | None:
        """The statements of a hot-path call (``claim``, ``cas_event``, ``peek``/``get``) with what it is
        doing, for a driver that runs them itself; None for any other call (it takes the sync path)."""
        if fn == self.claim:
            kw = dict(kwargs)
            doing = kw.pop("doing", "claiming")
            return self._claim_steps(*args, **kw), doing
        if fn == self.cas_event and kwargs.get("due_by") is None and kwargs.get("deadline_at_least") is None:
            kw = dict(kwargs)
            doing = kw.pop("doing", "writing")
            kw.pop("due_by", None)
            kw.pop("deadline_at_least", None)
            return self._cas_event_steps(*args, **kw), doing
        if fn == self.peek or fn == self.get:
            return self._peek_steps(*args, **kwargs), "reading a row"
        return None

    def _cas_event_steps(self, key: Key, *, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                         event: Mapping[str, Any] | None = None, otherwise: Mapping[str, Any] | None = None,
                         lease_owner: str | None = None, answer: tuple[Sequence[str], float] | None = None,
                         relaxed: bool = False) -> Stmts[bool]:
        return self._cas_steps(None, key, states, attempt, values, lease_owner, event, otherwise, relaxed, answer)

    def claim_page(self, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any], Expect | None]], *,
                   relaxed: bool = False, doing: str = "claiming a page") -> list[bool]:
        """``Store.claim_page``: the claim statement once per new row and the compare-and-set statements (one
        shape at a time), pipelined (psycopg's ``executemany``) inside one transaction block: one commit, one WAL
        flush, for the whole page."""
        if not rows:
            return []
        relaxed = self.commit_relaxed(relaxed)
        news: list[tuple[int, dict[str, Any]]] = []
        cas: list[tuple[int, Key, Sequence[str], int, str | None, Mapping[str, Any], Mapping[str, Any]]] = []
        for i, (key, values, event, expect) in enumerate(rows):
            if expect is None:
                ins, ev = self._claim_params(key, values, event)
                news.append((i, {**ins, **ev}))
            else:
                ev = {"state": values.get("state"), "attempt": values.get("attempt"), **event}
                cas.append((i, key, expect[0], expect[1], expect[2], values, ev))
        made = [False] * len(rows)
        distinct = len({(p["platform"], p["sender_id"], p["parent_id"]) for _, p in news}) == len(news)
        one_set = len(news) > 1 and distinct  # a repeated key takes the pipelined path: each decided in order
        with self._driver(doing) as fairy:
            conn = fairy.driver_connection
            if one_set and not cas:  # one statement is its own transaction (autocommit): no BEGIN/COMMIT trips
                with conn.cursor() as cur:
                    self._claim_set(cur, news, relaxed, made)
                return made
            with conn.transaction(), conn.cursor() as cur:
                if one_set:
                    self._claim_set(cur, news, relaxed, made)
                elif news:
                    self._pipelined(cur, self._sql.claim(relaxed), news, made)
                self._cas_pipelined(cur, cas, relaxed, made)
        return made

    def _claim_set(self, cur: Any, news: list[tuple[int, dict[str, Any]]], relaxed: bool, made: list[bool]) -> None:
        """The new rows of a page (distinct keys) inserted with their events by ONE statement: the server parses,
        plans and runs one statement, not one per row (most of a page's cost on PostgreSQL)."""
        params: dict[str, Any] = {"a_" + c: [p[c] for _, p in news] for c in REPLY_COLUMNS}
        params.update({"b_" + c: [p["e_" + c] for _, p in news] for c in EVENT_COLUMNS})
        cur.execute(self._sql.claim_set(relaxed), params)
        won = {r[0] for r in cur.fetchall()}
        for i, p in news:
            made[i] = p["parent_id"] in won

    def close_many(self, items: Sequence[tuple[Key, Sequence[str], int, Mapping[str, Any], Mapping[str, Any]]], *,
                   relaxed: bool = True, doing: str = "closing a page") -> list[bool]:
        """``Store.close_many``: the compare-and-set statements pipelined (psycopg's ``executemany``) inside one
        transaction block: one round trip and one commit for a page whose closes share one shape (they do)."""
        if not items:
            return []
        relaxed = self.commit_relaxed(relaxed)
        made = [False] * len(items)
        shapes = {(k.platform, k.sender_id, tuple(states), tuple(values)) for k, states, _, values, _ in items}
        one_shape = len(shapes) == 1
        with self._driver(doing) as fairy:
            conn = fairy.driver_connection
            if len(items) > 1 and one_shape and len({k.parent_id for k, *_ in items}) == len(items):
                with conn.cursor() as cur:  # one statement is its own transaction (autocommit)
                    self._close_set(cur, items, relaxed, made)
                return made
            with conn.transaction(), conn.cursor() as cur:
                self._cas_pipelined(cur, [(i, key, states, attempt, None, values, event)
                                          for i, (key, states, attempt, values, event) in enumerate(items)],
                                    relaxed, made)
        return made

    def _close_set(self, cur: Any, items: Sequence[tuple[Key, Sequence[str], int, Mapping[str, Any],
                                                         Mapping[str, Any]]], relaxed: bool, made: list[bool]) -> None:
        """A page's closes (one bot, one shape, distinct parents) set with their events by ONE statement."""
        key0, states, _, values0, _ = items[0]
        allowed(states, values0.get("state"))  # one shape: every item writes the same state
        sql, names = self._sql.close_set(tuple(values0), len(states), relaxed)
        params: dict[str, Any] = {"k_platform": key0.platform, "k_sender_id": key0.sender_id,
                                  "a_parent_id": [k.parent_id for k, *_ in items],
                                  "a_attempt": [attempt for _, _, attempt, _, _ in items]}
        params.update({f"s{i}": s for i, s in enumerate(states)})
        for c, n in zip(values0, names, strict=True):
            params["a_" + n] = [v[c] for _, _, _, v, _ in items]
        evs = [self._event_params(k, e, None, None) for k, _, _, _, e in items]
        params.update({"b_" + c: [ev["e_" + c] for ev in evs] for c in EVENT_COLUMNS})
        cur.execute(sql, params)
        done = {r[0] for r in cur.fetchall()}
        for i, (k, *_) in enumerate(items):
            made[i] = k.parent_id in done

    @staticmethod
    def _pipelined(cur: Any, sql: str, params: list[tuple[int, dict[str, Any]]], made: list[bool]) -> None:
        """Run ``sql`` once per ``(index, params)`` in one pipelined ``executemany``; ``made[index]``: it wrote."""
        cur.executemany(sql, [p for _, p in params], returning=True)
        for i, _ in params:
            made[i] = cur.fetchone()[0] == 1
            cur.nextset()

    def _cas_pipelined(self, cur: Any, items: Sequence[tuple[int, Key, Sequence[str], int, str | None,
                                                             Mapping[str, Any], Mapping[str, Any]]],
                       relaxed: bool, made: list[bool]) -> None:
        """Compare-and-set each ``(index, key, states, attempt, lease holder, values, event)`` with its event: one
        pipelined ``executemany`` per statement shape, inside the caller's transaction block."""
        shapes: dict[tuple[Any, ...], tuple[str, list[tuple[int, dict[str, Any]]]]] = {}
        for i, key, states, attempt, holder, values, event in items:
            shape = (tuple(values), len(states), holder is not None)
            sql, names = self._sql.cas(tuple(values), len(states), True, holder is not None, True, relaxed)
            params = self._cas_params(key, states, attempt, holder, names, values)
            params.update(self._event_params(key, event, None, None))
            shapes.setdefault(shape, (sql, []))[1].append((i, params))
        for sql, params in shapes.values():
            self._pipelined(cur, sql, params, made)

    def _cas_with(self, fairy: Any, key: Key, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  lease_owner: str | None, event: Mapping[str, Any] | None, otherwise: Mapping[str, Any] | None,
                  relaxed: bool, answer: tuple[Sequence[str], float] | None = None) -> bool:
        return self._drive(fairy, self._cas_steps(fairy, key, states, attempt, values, lease_owner, event,
                                                  otherwise, relaxed, answer))

    def _cas_steps(self, fairy: Any, key: Key, states: Sequence[str], attempt: int | None,
                   values: Mapping[str, Any], lease_owner: str | None, event: Mapping[str, Any] | None,
                   otherwise: Mapping[str, Any] | None, relaxed: bool,
                   answer: tuple[Sequence[str], float] | None = None) -> Stmts[bool]:
        relaxed = self.commit_relaxed(relaxed)
        sql, names = self._sql.cas(tuple(values), len(states), attempt is not None, lease_owner is not None,
                                   event is not None, relaxed, answer is not None)
        params = self._cas_params(key, states, attempt, lease_owner, names, values)
        if event is not None:
            params.update(self._event_params(key, event, None, None))
        if answer is not None:  # stored by the same statement, only if it set the row
            params.update(self._answer_params(key, answer))
        ok = (yield sql, params)[0][0] == 1
        if not ok and otherwise is not None:
            # Nothing was changed, so there is nothing to be atomic with: the note is a statement of its own.
            yield self._sql.event_only(relaxed), self._event_params(key, otherwise, None, None)
        return ok
