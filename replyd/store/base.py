"""What every backend shares: opening, the schema, transactions, the hot path's connection handling, the reads.

A backend (``sqlite.py``, ``postgres.py``) adds its engine settings and its write path: the claim and the
compare-and-set of the hot path, where the two databases differ most (BEGIN IMMEDIATE vs one CTE statement).

Durability is chosen per transaction: the claim that opens a row commits with full durability (it is the only
thing that must survive a crash before the send leaves); closes may commit relaxed, because a lost close leaves
the row open and the sweep closes it from the read-back. ``durability`` overrides that for every commit.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from replyd.clock import Clock, SystemClock
from replyd.errors import SchemaError, StoreError
from replyd.store.engine import default_url, is_sqlite_url, map_db_error, parse_url, redact_url
from replyd.store.hotsql import HotSQL
from replyd.store.model import (CLAIM_COMMIT_LEVELS, DURABILITIES, SCHEMA_HEAD, Claim, Durability, Expect, Key, Row,
                                lease_holder)
from replyd.store.fleet import FleetLeases
from replyd.store.queries import Reads
from replyd.store.retention import Retention
from replyd.store.schema import ANSWERS, REPLIES, REPLY_COLUMNS, REPLY_DEFAULTS, REPLY_SET
from replyd.store.unit import Tx
from replyd.transitions import NEW, allowed

_detail_encode = json.JSONEncoder(sort_keys=True, default=str).encode  # json.dumps' settings, made once
_quote = json.encoder.encode_basestring_ascii  # how that encoder writes a str (ensure_ascii)


def detail_json(detail: Mapping[str, Any] | None) -> str:
    """An event's detail column: ``json.dumps(detail, sort_keys=True, default=str)``, the same text.

    Most events carry one string (a reply id, a path), two per parent on a page: that shape is quoted
    directly, a third of the encoder's cost."""
    if not detail:
        return "{}"
    if len(detail) == 1:
        ((k, v),) = detail.items()
        if type(k) is str and type(v) is str:
            return "{" + _quote(k) + ": " + _quote(v) + "}"
    return _detail_encode(dict(detail))
_IDLE_MAX = 2  # connections a Store's hot path keeps checked out between calls

T = TypeVar("T")
# A hot-path call written once as the statements it runs: it yields (sql, params) and is sent each one's rows.
# The sync hot path feeds it from a pooled driver connection (``Store._drive``); the async face feeds it from
# psycopg's async connection on the event loop (``replyd.store.aiopg``), so the decisions between statements
# (insert lost → read the row → compare-and-set on it) exist once.
Stmts = Generator[tuple[str, Mapping[str, Any]], list[Any], T]

_STORES: weakref.WeakSet[Store] = weakref.WeakSet()
_BACKENDS: dict[str, type[Store]] = {}  # by Store.backend: each backend module registers its class
_INHERITED: list[Any] = []  # a forked child's copies of its parent's kept connections: never used, never closed


def _after_fork_in_child() -> None:
    # The parent owns those sockets: the child must neither use nor close them (as dispose(close=False)).
    for store in list(_STORES):
        store._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


@runtime_checkable
class ClaimsInGroup(Protocol):
    """A store that commits several waiting ``claim`` calls in one transaction (SQLite: one fsync for all)."""

    def claim_group(self, calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[Claim | None]:
        """Per call (its args and kwargs) its ``Claim``, or None for a call to be run alone."""


class Store(Reads, Retention, FleetLeases):
    """The answered-log over one database; safe to share between threads. ``Store.open`` picks the backend."""

    backend = ""  # "sqlite" / "postgresql", set by each backend
    is_sqlite = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.backend:  # the first class of a backend is the one ``open`` builds (a subclass does not replace it)
            _BACKENDS.setdefault(cls.backend, cls)

    def __init__(self, engine: Engine, *, clock: Clock | None = None, durability: Durability = "as_asked") -> None:
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, not {durability!r}")
        self.engine = engine
        self.clock = clock or SystemClock()
        self.durability = durability
        self._sql = HotSQL(engine.dialect)
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._idle: list[tuple[Any, Any]] = []  # (pool, connection) the hot path keeps checked out; see _driver
        _STORES.add(self)

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def open(cls, url: str | None = None, *, clock: Clock | None = None, migrate: bool | None = True,
             claim_commit: str | None = None, durability: Durability = "as_asked") -> Store:
        """Open the store at ``url`` (default: the embedded SQLite file) on its backend, migrating if asked.

        ``migrate``: True upgrades the schema, False requires it current, None leaves it alone (``replyd db``).
        """
        parsed = parse_url(url or default_url())
        # The backends register themselves (``__init_subclass__``): the package imports both before any use.
        backend = _BACKENDS["sqlite" if is_sqlite_url(parsed) else "postgresql"]
        store = backend(backend.make_engine(parsed), clock=clock, durability=durability)
        store.claim_commit = claim_commit
        try:
            if migrate:
                store.upgrade()
            elif migrate is False:
                store.require_schema()
        except StoreError as exc:  # say which store: several may be configured, and the default is implicit
            store.dispose()
            raise type(exc)(f"store {store.url}: {exc}") from None
        return store

    @classmethod
    def make_engine(cls, url: sa.URL) -> Engine:
        """Create this backend's engine for ``url`` with replyd's connection settings."""
        raise NotImplementedError

    def dispose(self) -> None:
        """Close all pooled connections."""
        self._reset_pool()

    @property
    def url(self) -> str:
        """The store URL with any password (user info or query parameter) hidden."""
        return redact_url(self.engine.url)

    @property
    def claim_commit(self) -> str | None:
        """The ``synchronous_commit`` level of durable writes on PostgreSQL (None: the server's default)."""
        return self._sql.durable

    @claim_commit.setter
    def claim_commit(self, level: str | None) -> None:
        if level is not None and level not in CLAIM_COMMIT_LEVELS:
            raise ValueError(f"claim_commit must be one of {', '.join(CLAIM_COMMIT_LEVELS)}, not {level!r}")
        self._sql = HotSQL(self.engine.dialect, None)  # only PostgreSQL has levels: one machine's disk here

    def claim_commit_problem(self) -> str | None:
        """Why the configured claim commit level cannot hold, on this server now; None when it can (or is local)."""
        return None

    def on_connect(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``callback(driver connection)`` whenever the store opens a new database connection (e.g. to
        re-read a clock); return the function that stops it."""
        def listener(dbapi_conn: Any, _record: Any) -> None:
            callback(dbapi_conn)

        sa.event.listen(self.engine, "connect", listener)
        return lambda: sa.event.remove(self.engine, "connect", listener)

    # -- schema -----------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Apply schema migrations up to ``revision`` (serialised across replicas)."""
        from replyd import migrate

        from alembic.util import CommandError

        try:
            migrate.upgrade(self.engine, revision)
        except sa.exc.DBAPIError as exc:
            raise map_db_error(exc, "migrating the schema") from None
        except CommandError as exc:  # a revision this replyd does not know: a newer one migrated the store
            raise SchemaError(f"cannot migrate the schema: {exc} (a newer replyd may have migrated this store)") from None

    def schema_revision(self) -> tuple[str | None, str]:
        """Return (the database's schema revision, the newest this replyd knows)."""
        from replyd import migrate

        try:
            return migrate.revisions(self.engine)
        except sa.exc.DBAPIError as exc:
            raise map_db_error(exc, "reading the schema revision") from None

    def require_schema(self) -> None:
        """Raise SchemaError unless the schema is at the newest revision."""
        if self._recorded_revision() == SCHEMA_HEAD:  # one plain SELECT: the read commands skip alembic's import
            return
        current, head = self.schema_revision()
        if current != head:
            raise SchemaError(f"store schema is at {current or 'nothing'}, replyd needs {head}: run `replyd db upgrade`")

    def _recorded_revision(self) -> str | None:
        """The revision in alembic's version table, or None (no table, no row, or it cannot be read)."""
        try:
            with self.engine.connect() as conn:
                return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
        except sa.exc.DBAPIError:
            return None

    def ping(self) -> None:
        """Ask the store one real query (a row of ``replies``); StoreError when it cannot answer."""
        with self._tx(write=False, doing="checking readiness") as conn:
            conn.execute(REPLIES.select().limit(1)).first()

    # -- transactions ------------------------------------------------------------

    def commit_relaxed(self, relaxed: bool) -> bool:
        """Whether a commit that asks for ``relaxed`` durability gets it (one place, for every write path)."""
        if self.durability == "as_asked":
            return relaxed
        return self.durability == "relaxed"

    @contextmanager
    def _tx(self, *, write: bool = True, relaxed: bool = False, doing: str = "writing") -> Iterator[Connection]:
        """A transaction on a SQLAlchemy connection (for the package itself: callers use ``transaction()``); errors mapped."""
        relaxed = self.commit_relaxed(relaxed)
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(write=write, relaxed=relaxed)
                with conn.begin():
                    self._begun(conn, write, relaxed)
                    yield conn
        except sa.exc.DBAPIError as exc:
            self._tx_failed(exc)
            raise map_db_error(exc, doing) from None

    @contextmanager
    def transaction(self, *, relaxed: bool = False, doing: str = "writing") -> Iterator[Tx]:
        """A write transaction for several steps that must commit together (the sweep's, a rearm, an adopt)."""
        with self._tx(relaxed=relaxed, doing=doing) as conn:
            yield Tx(self, conn)

    def _begun(self, conn: Connection, write: bool, relaxed: bool) -> None:
        """Backend hook: first statements of a transaction (PostgreSQL's commit level)."""

    def _tx_failed(self, exc: sa.exc.DBAPIError) -> None:
        """Backend hook: a transaction failed with ``exc`` (before it is mapped)."""

    def _greatest(self, column: sa.ColumnElement[Any], value: float) -> sa.ColumnElement[Any]:
        """SQL for the larger of a column and a value."""
        raise NotImplementedError

    def _insert(self, table: sa.Table) -> Any:
        """This dialect's INSERT (with ON CONFLICT)."""
        raise NotImplementedError

    @functools.cached_property
    def _answer_upsert(self) -> Any:
        """``Tx.put_answer``'s upsert, built once with bound parameters: a statement rebuilt with its values on each
        post cost SQLAlchemy a fresh cache key walk every time (a twentieth of a 1,000-bot burst's CPU)."""
        ins = self._insert(ANSWERS)
        a = ANSWERS.c
        stmt = ins.values({c: sa.bindparam(c) for c in ("platform", "sender_id", "parent_id", "parts", "created_at")})
        return stmt.on_conflict_do_update(index_elements=[a.platform, a.sender_id, a.parent_id],
                                          set_={"parts": ins.excluded.parts, "created_at": ins.excluded.created_at})

    def _lock_due(self, q: sa.Select) -> sa.Select:
        """Backend hook: how the lease select skips rows other replicas hold."""
        return q

    # -- the hot path: prebuilt SQL straight through the driver ---------------------------
    #
    # Same guarantees as transaction(): every write and its event commit together, the claim with full
    # durability unless asked otherwise, CAS on (key, state, attempt), errors mapped to StoreError /
    # ContentionError. Reads run without an explicit transaction (one statement, one snapshot).

    @contextmanager
    def _driver(self, doing: str) -> Iterator[Any]:
        """A connection of SQLAlchemy's pool (its connect/checkout handling applies) used at driver level.

        The last ``_IDLE_MAX`` are kept checked out between calls: taking one is a list pop, not a trip through
        the pool (a third of the hot path's Python time). Only a connection whose call ended cleanly, outside
        any transaction, is kept; one of a replaced pool, or one the backend finds dead, is dropped.
        """
        pool = self.engine.pool
        fairy = None
        while self._idle:
            try:
                owner, f = self._idle.pop()
            except IndexError:  # another thread took the last one
                break
            if owner is pool and f.is_valid and self._alive(f):
                fairy = f
                break
            f.invalidate()
            f.close()
        fresh = fairy is None
        if fairy is None:
            try:
                fairy = self.engine.raw_connection()
            except (sa.exc.DBAPIError, sa.exc.DisconnectionError, self._dbapi_error) as exc:
                raise map_db_error(exc, doing) from None
        clean = False
        try:
            if fresh:
                self._fresh(fairy)
            yield fairy
            clean = True
        except self._dbapi_error as exc:
            self._driver_failed(fairy, exc)
            raise map_db_error(exc, doing) from None
        finally:
            if clean and fairy.is_valid and len(self._idle) < _IDLE_MAX and self._keepable(fairy):
                self._idle.append((pool, fairy))
            else:
                self._give_back(fairy)

    def _forget_after_fork(self) -> None:
        """In a forked child: drop (never use, never close) the connections the parent keeps checked out."""
        _INHERITED.extend(self._idle)
        self._idle = []

    def _alive(self, fairy: Any) -> bool:
        """Backend hook: whether a kept connection may be used again (without a round trip)."""
        return True

    def _fresh(self, fairy: Any) -> None:
        """Backend hook: prepare a connection just taken from the pool for the hot path."""

    def _driver_failed(self, fairy: Any, exc: Exception) -> None:
        """Backend hook: the driver raised ``exc`` on ``fairy`` (drop what must not be reused)."""

    def _keepable(self, fairy: Any) -> bool:
        """Backend hook: whether a connection whose call ended cleanly may be kept checked out."""
        return True

    def _give_back(self, fairy: Any) -> None:
        """Return a hot-path connection to the pool as the pool's other users expect it."""
        fairy.close()

    def _reset_pool(self) -> None:
        """Close every pooled connection, the hot path's kept ones too (the next use opens fresh ones)."""
        while self._idle:
            try:
                _, f = self._idle.pop()
            except IndexError:
                break
            self._give_back(f)
        self.engine.dispose()

    def _fetch(self, fairy: Any, sql: str, params: Mapping[str, Any]) -> list[Any]:
        """Run one statement on a hot-path connection and return its rows."""
        raise NotImplementedError

    def _drive(self, fairy: Any, steps: Stmts[T]) -> T:
        """Run ``steps``' statements one by one on a hot-path connection; return what the steps return."""
        try:
            stmt = next(steps)
            while True:
                stmt = steps.send(self._fetch(fairy, *stmt))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _key_params(self, key: Key) -> dict[str, Any]:
        return {"k_platform": key.platform, "k_sender_id": key.sender_id, "k_parent_id": key.parent_id}

    def _event_row(self, key: Key, event: Mapping[str, Any], state: str | None, attempt: int | None) -> tuple[Any, ...]:
        """An event's values in ``EVENT_COLUMNS`` order: how SQLite's positional event statement binds them."""
        at = event.get("at")
        return (self.clock.now() if at is None else at, key.platform, key.sender_id, key.parent_id, event["kind"],
                event.get("state", state), event.get("attempt", attempt), event.get("owner"),
                detail_json(event.get("detail")))

    def _event_params(self, key: Key, event: Mapping[str, Any], state: str | None,
                      attempt: int | None) -> dict[str, Any]:
        return dict(zip(self._sql.event_names["e_"], self._event_row(key, event, state, attempt), strict=True))

    def _cas_params(self, key: Key, states: Sequence[str], attempt: int | None, lease_owner: str | None,
                    names: tuple[str, ...], values: Mapping[str, Any]) -> dict[str, Any]:
        allowed(states, values.get("state"))
        params = self._key_params(key)
        params.update(zip(names, values.values(), strict=True))
        for i, s in enumerate(states):
            params[f"s{i}"] = s
        if attempt is not None:
            params["k_attempt"] = attempt
        if lease_owner is not None:
            params["k_lease_owner"] = lease_owner
        return params

    def _peek_steps(self, key: Key) -> Stmts[Row | None]:
        rows = yield self._sql.peek, self._key_params(key)
        return Row(**dict(zip(REPLY_COLUMNS, rows[0], strict=True))) if rows else None

    def _peek_with(self, fairy: Any, key: Key) -> Row | None:
        return self._drive(fairy, self._peek_steps(key))

    def peek(self, key: Key) -> Row | None:
        """Return ``key``'s row (one statement, no explicit transaction, no lock), or None."""
        with self._driver("reading a row") as fairy:
            return self._peek_with(fairy, key)

    def get(self, key: Key) -> Row | None:
        """Return the row for ``key``, or None (the same read as ``peek``)."""
        return self.peek(key)

    def rows_of(self, keys: Sequence[Key]) -> list[Row | None]:
        """Return, in order, each key's row or None: one statement per bot among ``keys`` (a page has one), no
        explicit transaction, as ``peek``."""
        bots: dict[tuple[str, str], list[str]] = {}
        for k in keys:
            ids = bots.setdefault((k.platform, k.sender_id), [])
            if k.parent_id not in ids:
                ids.append(k.parent_id)
        found: dict[Key, Row] = {}
        with self._driver("reading a page's rows") as fairy:
            for (platform, sender_id), ids in bots.items():
                params = {"k_platform": platform, "k_sender_id": sender_id, **{f"p{i}": v for i, v in enumerate(ids)}}
                for values in self._fetch(fairy, self._sql.rows_of(len(ids)), params):
                    row = Row(**dict(zip(REPLY_COLUMNS, values, strict=True)))
                    found[Key(row.platform, row.sender_id, row.parent_id)] = row
        return [found.get(k) for k in keys]

    def claim(self, key: Key, new: Mapping[str, Any], reclaim: Callable[[Row], Mapping[str, Any] | None],
              event: Mapping[str, Any], *, relaxed: bool = False, doing: str = "claiming") -> Claim:
        """Take ``key``: insert the row ``new`` if the key has none, else compare-and-set the values
        ``reclaim(row)`` returns on that row's (state, attempt, composing lease holder), or leave the row when
        it returns None. ``event`` (kind, owner, detail; state and attempt default to the written row's)
        commits in the same transaction as the row, durably unless ``relaxed``."""
        raise NotImplementedError

    def _claim_params(self, key: Key, new: Mapping[str, Any],
                      event: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The new row's values (every column) and its event's, named as the hot-path statements name them."""
        ins = self._claim_row(key, new)
        return ins, self._event_params(key, event, ins["state"], ins["attempt"])

    @staticmethod
    def _claim_row(key: Key, new: Mapping[str, Any]) -> dict[str, Any]:
        """The new row's values, every column (the defaults where ``new`` is silent); only columns accepted."""
        if not REPLY_SET.issuperset(new):
            raise ValueError(f"not columns of {REPLIES.name}: {sorted(set(new) - REPLY_SET)}")
        allowed((NEW,), new.get("state"))
        return {**REPLY_DEFAULTS, **new, "platform": key.platform, "sender_id": key.sender_id,
                "parent_id": key.parent_id}

    def _reclaim(self, fairy: Any, key: Key, row: Row, reclaim: Callable[[Row], Mapping[str, Any] | None],
                 event: Mapping[str, Any], relaxed: bool) -> Claim:
        """Decide on the row that stands: compare-and-set ``reclaim(row)`` in its own transaction, or leave it."""
        return self._drive(fairy, self._reclaim_steps(fairy, key, row, reclaim, event, relaxed))

    def _reclaim_steps(self, fairy: Any, key: Key, row: Row, reclaim: Callable[[Row], Mapping[str, Any] | None],
                       event: Mapping[str, Any], relaxed: bool) -> Stmts[Claim]:
        vals = reclaim(row)
        if vals is None:
            return Claim(False, row, None)
        # On the row as read, its lease holder included: two replicas that both saw an expired composing
        # lease must not both take it (the second would compose for nothing).
        won = yield from self._cas_steps(fairy, key, [row.state], row.attempt, vals, lease_holder(row),
                                         {**event, "state": vals.get("state"), "attempt": vals.get("attempt")},
                                         None, relaxed)
        return Claim(True, None, vals) if won else Claim(False, (yield from self._peek_steps(key)), None)

    def _cas_steps(self, fairy: Any, key: Key, states: Sequence[str], attempt: int | None,
                   values: Mapping[str, Any], lease_owner: str | None, event: Mapping[str, Any] | None,
                   otherwise: Mapping[str, Any] | None, relaxed: bool,
                   answer: tuple[Sequence[str], float] | None = None) -> Stmts[bool]:
        """The compare-and-set as statements; by default one call of ``_cas_with`` on ``fairy`` (SQLite's
        transaction is not a statement list; only PostgreSQL's hot path is run by the async face)."""
        return self._cas_with(fairy, key, states, attempt, values, lease_owner, event, otherwise, relaxed, answer)
        yield  # never reached: it makes this a generator all the same

    def cas_event(self, key: Key, *, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  event: Mapping[str, Any] | None = None, otherwise: Mapping[str, Any] | None = None,
                  lease_owner: str | None = None, due_by: float | None = None,
                  deadline_at_least: float | None = None, answer: tuple[Sequence[str], float] | None = None,
                  relaxed: bool = False, doing: str = "writing") -> bool:
        """Compare-and-set in its own transaction: update the row only if its state is in ``states`` (and its
        attempt and lease owner match, when given), with ``event`` in the same transaction if it did, else
        the ``otherwise`` note. ``values`` are plain values; ``due_by`` / ``deadline_at_least`` as in
        ``Tx.cas_event``; ``answer`` ``(parts, at)``: the key's composed answer stored (as ``Tx.put_answer``) in
        the same transaction when the row was updated. True if the row was updated."""
        if due_by is not None or deadline_at_least is not None:  # not a hot-path shape: one SQL text for both
            with self.transaction(relaxed=relaxed, doing=doing) as tx:
                ok = tx.cas_event(key, states=states, attempt=attempt, values=values, event=event,
                                  otherwise=otherwise, lease_owner=lease_owner, due_by=due_by,
                                  deadline_at_least=deadline_at_least)
                if ok and answer is not None:
                    tx.put_answer(key, answer[0], at=answer[1])
                return ok
        with self._driver(doing) as fairy:
            return self._cas_with(fairy, key, states, attempt, values, lease_owner, event, otherwise, relaxed, answer)

    def _cas_with(self, fairy: Any, key: Key, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  lease_owner: str | None, event: Mapping[str, Any] | None, otherwise: Mapping[str, Any] | None,
                  relaxed: bool, answer: tuple[Sequence[str], float] | None = None) -> bool:
        raise NotImplementedError

    def _answer_params(self, key: Key, answer: tuple[Sequence[str], float]) -> dict[str, Any]:
        """``HotSQL.answer``'s parameters: ``Tx.put_answer``'s row for ``(parts, at)``."""
        parts, at = answer
        return {"a_platform": key.platform, "a_sender_id": key.sender_id, "a_parent_id": key.parent_id,
                "a_parts": json.dumps(list(parts)), "a_created_at": at}

    def close_many(self, items: Sequence[tuple[Key, Sequence[str], int, Mapping[str, Any], Mapping[str, Any]]], *,
                   relaxed: bool = True, doing: str = "closing a page") -> list[bool]:
        """Compare-and-set several rows, each with its event, in ONE transaction (a page's closes): per item
        ``(key, states, attempt, values, event)``, True where that row was updated. Relaxed unless asked."""
        raise NotImplementedError

    def record(self, key: Key, kind: str, *, owner: str | None = None, detail: Mapping[str, Any] | None = None) -> None:
        """Append one event with the row's current state and attempt, in its own relaxed transaction (notes)."""
        with self.transaction(relaxed=True, doing="recording an event") as tx:
            # Held until the note commits: a rival's transition committing between this read and the insert
            # would leave the note after it in the history (ids are taken at insert), with a state the row left.
            row = tx.get(key, hold=True)
            tx.append_event(key, kind, state=row.state if row else None, attempt=row.attempt if row else None,
                            owner=owner, detail=detail)

    def insert_absent(self, rows: Sequence[tuple[Key, Mapping[str, Any]]], event: Mapping[str, Any], *,
                      doing: str = "recording found parents") -> int:
        """Insert each key's row unless the key already has one (whatever its state), each new row with ``event``
        (kind, owner, detail; state and attempt are the row's), all in ONE durable transaction: when this returns,
        every key has a row another replica's re-find can see. Return how many rows this call created."""
        return sum(self.claim_new([(key, values, event) for key, values in rows], doing=doing))

    def claim_new(self, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any]]], *, relaxed: bool = False,
                  doing: str = "claiming a page") -> list[bool]:
        """The group claim of new keys: insert each ``(key, new, event)`` row unless its key has one, each created
        row with its event, all in ONE transaction (durable unless ``relaxed``); return, in order, whether each was
        created. A key that already has a row is left untouched (its caller claims it alone, with ``claim``'s
        reclaim). ``claim_page`` with no row to compare-and-set."""
        return self.claim_page([(key, new, event, None) for key, new, event in rows], relaxed=relaxed, doing=doing)

    def claim_page(self, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any], Expect | None]], *,
                   relaxed: bool = False, doing: str = "claiming a page") -> list[bool]:
        """The group claim: per ``(key, values, event, expect)``, with ``expect`` None insert the row ``values``
        unless the key has one; else compare-and-set ``values`` on the row that stands, only while it is as
        ``expect = (states, attempt, lease holder)`` says (as ``claim``'s reclaim does). Each row written gets its
        event (state and attempt default to the written values'); all in ONE transaction, durable unless
        ``relaxed``. Return, in order, whether each was written."""
        made: list[bool] = []
        with self.transaction(relaxed=relaxed, doing=doing) as tx:
            for key, values, event, expect in rows:
                ev = {"state": values.get("state"), "attempt": values.get("attempt"), **event}
                if expect is None:
                    done = tx.insert_new(key, values)
                    if done:
                        tx.append_event(key, ev["kind"], state=ev["state"], attempt=ev["attempt"],
                                        owner=ev.get("owner"), detail=ev.get("detail"))
                else:
                    states, attempt, holder = expect
                    done = tx.cas_event(key, states=states, attempt=attempt, values=values, lease_owner=holder,
                                        event=ev)
                made.append(done)
        return made
