"""The answered-log: tables, engines and the compare-and-set primitives the guard uses.

One row per key ``(platform instance, own sender id, parent id as served)`` in
``replies``; every state change appends to ``events`` in the same transaction;
pollers keep their positions in ``cursors``.

SQLite is the embedded default (WAL, ``synchronous=FULL``, busy timeout, every
write transaction ``BEGIN IMMEDIATE`` so a read-then-write never dead-ends on a
stale snapshot). PostgreSQL is for several replicas on several machines.

Durability is chosen per transaction: the claim that opens a row commits with
full durability (it is the only thing that must survive a crash before the
send leaves); closes may commit relaxed, because a lost close leaves the row
open and the sweep closes it from the read-back.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Field, SQLModel

from replyd.clock import Clock, SystemClock
from replyd.errors import ContentionError, SchemaError, StoreError

log = structlog.get_logger("replyd.store")

# States of a row. Terminal ones are only left by an operator's rearm.
COMPOSING = "composing"
OPEN = "open"
CLOSED = "closed"
RELEASED = "released"
REJECTED = "rejected"
NOT_LANDED = "not_landed"
GAVE_UP = "gave_up"
DECLINED = "declined"
STATES = (COMPOSING, OPEN, CLOSED, RELEASED, REJECTED, NOT_LANDED, GAVE_UP, DECLINED)
TERMINAL = (CLOSED, REJECTED, GAVE_UP, DECLINED)

SQLITE_BUSY_TIMEOUT_MS = 30_000


class Reply(SQLModel, table=True):
    """One key of the answered-log and where its answer stands."""

    __tablename__ = "replies"
    __table_args__ = (
        sa.Index("ix_replies_due", "state", "deadline_at"),
        sa.Index("ix_replies_opened", "platform", "sender_id", "opened_at"),
    )

    platform: str = Field(primary_key=True, max_length=255)
    sender_id: str = Field(primary_key=True, max_length=255)
    parent_id: str = Field(primary_key=True, max_length=1024)
    state: str = Field(max_length=16)
    attempt: int = 1
    created_at: float
    updated_at: float
    opened_at: float | None = None
    deadline_at: float | None = None
    closed_at: float | None = None
    not_before: float | None = None
    reply_id: str | None = Field(default=None, max_length=1024)
    provider_key: str | None = Field(default=None, max_length=255)
    text_hash: str | None = Field(default=None, max_length=64)
    path: str = Field(default="", max_length=64)
    snapshot: str = Field(default="{}", sa_type=sa.Text)
    owner: str | None = Field(default=None, max_length=255)
    lease_owner: str | None = Field(default=None, max_length=255)
    lease_until: float | None = None
    error: str | None = Field(default=None, sa_type=sa.Text)
    author_id: str | None = Field(default=None, max_length=255)  # the parent's author, for per-author caps


class Event(SQLModel, table=True):
    """An append-only record of one transition (or skip) of one key."""

    __tablename__ = "events"
    __table_args__ = (sa.Index("ix_events_key", "platform", "sender_id", "parent_id"),)

    id: int | None = Field(default=None, primary_key=True)
    at: float = Field(index=True)
    platform: str = Field(max_length=255)
    sender_id: str = Field(max_length=255)
    parent_id: str = Field(max_length=1024)
    kind: str = Field(max_length=32)
    state: str | None = Field(default=None, max_length=16)
    attempt: int | None = None
    owner: str | None = Field(default=None, max_length=255)
    detail: str = Field(default="{}", sa_type=sa.Text)


class Cursor(SQLModel, table=True):
    """Where one poller of one bot stopped reading."""

    __tablename__ = "cursors"

    platform: str = Field(primary_key=True, max_length=255)
    sender_id: str = Field(primary_key=True, max_length=255)
    name: str = Field(primary_key=True, max_length=255)
    value: str = Field(sa_type=sa.Text)
    updated_at: float


REPLIES = Reply.__table__
EVENTS = Event.__table__
CURSORS = Cursor.__table__


@dataclass(frozen=True)
class Key:
    """The answered-log key: platform instance, own sender id, parent id as served."""

    platform: str
    sender_id: str
    parent_id: str

    def where(self) -> sa.ColumnElement[bool]:
        """Return the SQL condition selecting this key's row."""
        return sa.and_(
            REPLIES.c.platform == self.platform,
            REPLIES.c.sender_id == self.sender_id,
            REPLIES.c.parent_id == self.parent_id,
        )


def default_sqlite_path() -> Path:
    """Return ``$XDG_STATE_HOME/replyd/replyd.sqlite3`` (else under ``~/.local/state``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "replyd" / "replyd.sqlite3"


def default_url() -> str:
    """Return the SQLAlchemy URL of the embedded default store."""
    return f"sqlite:///{default_sqlite_path()}"


def make_owner() -> str:
    """Return an id for this process, used as row owner and lease holder."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced, for logs and errors."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is reported by the caller; never echo it raw
        return "<unparsable database URL>"


def _map_db_error(exc: BaseException, doing: str) -> Exception:
    """Map a DBAPI/SQLAlchemy error to ContentionError or StoreError."""
    text = str(getattr(exc, "orig", exc)).lower()
    if "database is locked" in text or "lock timeout" in text or "could not serialize" in text:
        return ContentionError(f"store busy while {doing}: another writer holds the lock")
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        return SchemaError(f"store schema missing while {doing}: run `replyd db upgrade`")
    detail = str(getattr(exc, "orig", exc)).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return StoreError(f"store unavailable while {doing}: {detail}")


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Take transaction control away from pysqlite so BEGIN IMMEDIATE is ours to emit.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.close()


def _sqlite_on_begin(conn: Connection) -> None:
    opts = conn.get_execution_options()
    # Per-transaction durability: a claim is FULL, a close may be NORMAL.
    conn.exec_driver_sql(f"PRAGMA synchronous={'NORMAL' if opts.get('relaxed') else 'FULL'}")
    conn.exec_driver_sql("BEGIN IMMEDIATE" if opts.get("write") else "BEGIN")


def make_engine(url: str) -> Engine:
    """Create an engine for ``url`` with replyd's connection settings."""
    try:
        parsed = sa.engine.make_url(url)
    except Exception as exc:
        raise StoreError(f"bad store URL {redact_url(url)!r}: {exc}") from None
    if parsed.drivername.startswith("sqlite"):
        db = parsed.database
        if db and db != ":memory:":
            Path(db).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            parsed, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        )
        sa.event.listen(engine, "connect", _sqlite_on_connect)
        sa.event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if not parsed.drivername.startswith("postgresql"):
        raise StoreError(f"unsupported store URL scheme {parsed.drivername!r}: use sqlite:/// or postgresql+psycopg://")
    return sa.create_engine(
        parsed,
        pool_pre_ping=True,
        pool_size=5,
        max_overflow=5,
        connect_args={"connect_timeout": 5, "application_name": "replyd"},
    )


def _row(mapping: Mapping[str, Any] | None) -> Reply | None:
    return None if mapping is None else Reply(**dict(mapping))


class Store:
    """The answered-log over one database; safe to share between threads."""

    def __init__(self, engine: Engine, *, clock: Clock | None = None) -> None:
        self.engine = engine
        self.clock = clock or SystemClock()
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._insert = sqlite_dialect.insert if self.is_sqlite else pg_dialect.insert

    @classmethod
    def open(cls, url: str | None = None, *, clock: Clock | None = None, migrate: bool = True) -> Store:
        """Open the store at ``url`` (default: the embedded SQLite file), migrating if asked."""
        store = cls(make_engine(url or default_url()), clock=clock)
        if migrate:
            store.upgrade()
        else:
            store.require_schema()
        return store

    def dispose(self) -> None:
        """Close all pooled connections."""
        self.engine.dispose()

    @property
    def url(self) -> str:
        """The store URL with any password hidden."""
        return self.engine.url.render_as_string(hide_password=True)

    # -- schema -----------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Apply schema migrations up to ``revision`` (serialised across replicas)."""
        from replyd import migrate

        try:
            migrate.upgrade(self.engine, revision)
        except sa.exc.DBAPIError as exc:
            raise _map_db_error(exc, "migrating the schema") from None

    def require_schema(self) -> None:
        """Raise SchemaError unless the schema is at the newest revision."""
        from replyd import migrate

        try:
            current, head = migrate.revisions(self.engine)
        except sa.exc.DBAPIError as exc:
            raise _map_db_error(exc, "reading the schema revision") from None
        if current != head:
            raise SchemaError(f"store schema is at {current or 'nothing'}, replyd needs {head}: run `replyd db upgrade`")

    # -- transactions ------------------------------------------------------------

    @contextmanager
    def tx(self, *, write: bool = True, relaxed: bool = False, doing: str = "writing") -> Iterator[Connection]:
        """A transaction; ``relaxed`` commits without waiting for the disk (closes only)."""
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(write=write, relaxed=relaxed)
                with conn.begin():
                    if relaxed and not self.is_sqlite:
                        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
                    yield conn
        except sa.exc.DBAPIError as exc:
            if self.is_sqlite and "readonly database" in str(exc.orig).lower():
                # SQLite opens an unwritable file read-only and the pool would keep that connection
                # for ever: drop it, so the first write after the file is writable again succeeds.
                self.engine.dispose()
            raise _map_db_error(exc, doing) from None

    def greatest(self, column: sa.ColumnElement[Any], value: float) -> sa.ColumnElement[Any]:
        """SQL for the larger of a column and a value (SQLite's scalar max, PostgreSQL's GREATEST)."""
        return sa.func.max(column, value) if self.is_sqlite else sa.func.greatest(column, value)

    def db_epoch(self) -> float:
        """Return the database server's clock in epoch seconds (PostgreSQL; SQLite reads this machine's)."""
        sql = ("SELECT CAST((julianday('now') - 2440587.5) * 86400.0 AS REAL)" if self.is_sqlite
               else "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8")
        with self.tx(write=False, doing="reading the database clock") as conn:
            return float(conn.exec_driver_sql(sql).scalar_one())

    # -- rows --------------------------------------------------------------------

    def get(self, key: Key, conn: Connection | None = None) -> Reply | None:
        """Return the row for ``key``, or None."""
        if conn is not None:
            return _row(conn.execute(sa.select(REPLIES).where(key.where())).mappings().first())
        with self.tx(write=False, doing="reading a row") as c:
            return _row(c.execute(sa.select(REPLIES).where(key.where())).mappings().first())

    def insert_new(self, conn: Connection, key: Key, values: Mapping[str, Any]) -> bool:
        """Insert the key's row unless it exists; True when this call created it."""
        stmt = (
            self._insert(REPLIES)
            .values(platform=key.platform, sender_id=key.sender_id, parent_id=key.parent_id, **values)
            .on_conflict_do_nothing(index_elements=["platform", "sender_id", "parent_id"])
            .returning(REPLIES.c.attempt)
        )
        # RETURNING, not rowcount: psycopg reports -1 for INSERT … ON CONFLICT here.
        return conn.execute(stmt).first() is not None

    def cas(
        self,
        conn: Connection,
        key: Key,
        *,
        states: Sequence[str],
        attempt: int | None,
        values: Mapping[str, Any],
        extra_where: sa.ColumnElement[bool] | None = None,
    ) -> bool:
        """Update the row only if its state is in ``states`` and attempt matches; True if it did."""
        cond = [key.where(), REPLIES.c.state.in_(list(states))]
        if attempt is not None:
            cond.append(REPLIES.c.attempt == attempt)
        if extra_where is not None:
            cond.append(extra_where)
        return conn.execute(sa.update(REPLIES).where(*cond).values(**values)).rowcount == 1

    def add_event(
        self,
        conn: Connection,
        key: Key,
        kind: str,
        *,
        state: str | None = None,
        attempt: int | None = None,
        owner: str | None = None,
        detail: Mapping[str, Any] | None = None,
        at: float | None = None,
    ) -> None:
        """Append one event for ``key`` inside the caller's transaction."""
        conn.execute(
            sa.insert(EVENTS).values(
                at=self.clock.now() if at is None else at,
                platform=key.platform,
                sender_id=key.sender_id,
                parent_id=key.parent_id,
                kind=kind,
                state=state,
                attempt=attempt,
                owner=owner,
                detail=json.dumps(dict(detail or {}), sort_keys=True, default=str),
            )
        )

    def record(self, key: Key, kind: str, *, owner: str | None = None, detail: Mapping[str, Any] | None = None) -> None:
        """Append one event in its own relaxed transaction (skips, notes)."""
        with self.tx(relaxed=True, doing="recording an event") as conn:
            row = self.get(key, conn)
            self.add_event(
                conn,
                key,
                kind,
                state=row.state if row else None,
                attempt=row.attempt if row else None,
                owner=owner,
                detail=detail,
            )

    def count_opened_since(self, platform: str, sender_id: str, since: float, author_id: str | None = None) -> int:
        """Count this bot's rows opened (sent or being sent) at or after ``since``, optionally for one author."""
        q = sa.select(sa.func.count()).select_from(REPLIES).where(
            REPLIES.c.platform == platform,
            REPLIES.c.sender_id == sender_id,
            REPLIES.c.opened_at >= since,
            REPLIES.c.state.in_((OPEN, CLOSED)),
        )
        if author_id is not None:
            q = q.where(REPLIES.c.author_id == author_id)
        with self.tx(write=False, doing="counting recent replies") as conn:
            return int(conn.execute(q).scalar_one())

    def last_event(self, key: Key, kinds: Sequence[str] | None = None) -> Event | None:
        """Return the newest event of ``key`` (of one of ``kinds`` when given), or None."""
        q = sa.select(EVENTS).where(
            EVENTS.c.platform == key.platform,
            EVENTS.c.sender_id == key.sender_id,
            EVENTS.c.parent_id == key.parent_id,
        )
        if kinds:
            q = q.where(EVENTS.c.kind.in_(list(kinds)))
        with self.tx(write=False, doing="reading the last event") as conn:
            m = conn.execute(q.order_by(EVENTS.c.id.desc()).limit(1)).mappings().first()
        return Event(**dict(m)) if m else None

    def count_events(self, key: Key, kind: str, *, after_kinds: Sequence[str] = ()) -> int:
        """Count events of ``kind`` for ``key``, only those newer than the last of ``after_kinds``."""
        where = [EVENTS.c.platform == key.platform, EVENTS.c.sender_id == key.sender_id,
                 EVENTS.c.parent_id == key.parent_id]
        q = sa.select(sa.func.count()).select_from(EVENTS).where(*where, EVENTS.c.kind == kind)
        if after_kinds:
            last = sa.select(sa.func.coalesce(sa.func.max(EVENTS.c.id), 0)).where(
                *where, EVENTS.c.kind.in_(list(after_kinds))).scalar_subquery()
            q = q.where(EVENTS.c.id > last)
        with self.tx(write=False, doing="counting events") as conn:
            return int(conn.execute(q).scalar_one())

    def find_events(self, parent_id: str, platform: str | None = None) -> list[Event]:
        """Return every event for ``parent_id`` (any sender), oldest first: skips leave events but no row."""
        q = sa.select(EVENTS).where(EVENTS.c.parent_id == parent_id)
        if platform:
            q = q.where(EVENTS.c.platform == platform)
        with self.tx(write=False, doing="finding events") as conn:
            return [Event(**dict(m)) for m in conn.execute(q.order_by(EVENTS.c.id)).mappings()]

    def history(self, key: Key) -> list[Event]:
        """Return every event of ``key`` in order."""
        q = (
            sa.select(EVENTS)
            .where(
                EVENTS.c.platform == key.platform,
                EVENTS.c.sender_id == key.sender_id,
                EVENTS.c.parent_id == key.parent_id,
            )
            .order_by(EVENTS.c.id)
        )
        with self.tx(write=False, doing="reading history") as conn:
            return [Event(**dict(m)) for m in conn.execute(q).mappings()]

    def find(self, parent_id: str, platform: str | None = None) -> list[Reply]:
        """Return every row whose parent id is exactly ``parent_id`` (any sender)."""
        q = sa.select(REPLIES).where(REPLIES.c.parent_id == parent_id)
        if platform:
            q = q.where(REPLIES.c.platform == platform)
        with self.tx(write=False, doing="finding a parent") as conn:
            return [Reply(**dict(m)) for m in conn.execute(q).mappings()]

    def recent_events(self, limit: int = 50) -> list[Event]:
        """Return the newest events, newest first."""
        q = sa.select(EVENTS).order_by(EVENTS.c.id.desc()).limit(limit)
        with self.tx(write=False, doing="reading events") as conn:
            return [Event(**dict(m)) for m in conn.execute(q).mappings()]

    def counts(self) -> dict[tuple[str, str], int]:
        """Return row counts by (platform, state)."""
        q = sa.select(REPLIES.c.platform, REPLIES.c.state, sa.func.count()).group_by(
            REPLIES.c.platform, REPLIES.c.state
        )
        with self.tx(write=False, doing="counting rows") as conn:
            return {(p, s): n for p, s, n in conn.execute(q)}

    def oldest_open(self, limit: int = 10) -> list[Reply]:
        """Return the oldest open rows."""
        q = sa.select(REPLIES).where(REPLIES.c.state == OPEN).order_by(REPLIES.c.opened_at).limit(limit)
        with self.tx(write=False, doing="reading open rows") as conn:
            return [Reply(**dict(m)) for m in conn.execute(q).mappings()]

    def rows_in(self, platform: str, sender_id: str, states: Sequence[str], limit: int = 500) -> list[Reply]:
        """Return rows of one bot in the given states (oldest update first)."""
        q = (
            sa.select(REPLIES)
            .where(
                REPLIES.c.platform == platform,
                REPLIES.c.sender_id == sender_id,
                REPLIES.c.state.in_(list(states)),
            )
            .order_by(REPLIES.c.updated_at)
            .limit(limit)
        )
        with self.tx(write=False, doing="reading rows") as conn:
            return [Reply(**dict(m)) for m in conn.execute(q).mappings()]

    # -- sweep leases --------------------------------------------------------------

    def lease_due(self, platform: str, sender_id: str, *, now: float, limit: int, lease_s: float, owner: str) -> list[Reply]:
        """Lease up to ``limit`` due rows that no live lease holds.

        Due: open rows past their deadline, and closed rows that still carry a
        deadline (a retry closed them: one verifying read-back looks for an
        earlier attempt's late reply). PostgreSQL skips rows another replica has locked (``FOR UPDATE SKIP
        LOCKED``); SQLite serialises writers, so the same select-then-update
        inside ``BEGIN IMMEDIATE`` is already exclusive.
        """
        free = sa.or_(REPLIES.c.lease_until.is_(None), REPLIES.c.lease_until < now)
        q = (
            sa.select(REPLIES)
            .where(
                REPLIES.c.state.in_([OPEN, CLOSED]),
                REPLIES.c.platform == platform,
                REPLIES.c.sender_id == sender_id,
                REPLIES.c.deadline_at <= now,
                free,
            )
            .order_by(REPLIES.c.deadline_at)
            .limit(limit)
        )
        if not self.is_sqlite:
            q = q.with_for_update(skip_locked=True)
        with self.tx(relaxed=True, doing="leasing due rows") as conn:
            rows = [Reply(**dict(m)) for m in conn.execute(q).mappings()]
            leased = []
            for r in rows:
                key = Key(r.platform, r.sender_id, r.parent_id)
                if self.cas(
                    conn,
                    key,
                    states=[r.state],
                    attempt=r.attempt,
                    values={"lease_owner": owner, "lease_until": now + lease_s},
                    extra_where=free,
                ):
                    r.lease_owner, r.lease_until = owner, now + lease_s
                    leased.append(r)
            return leased

    # -- cursors -------------------------------------------------------------------

    def get_cursor(self, platform: str, sender_id: str, name: str) -> str | None:
        """Return a poller's saved position, or None."""
        q = sa.select(CURSORS.c.value).where(
            CURSORS.c.platform == platform, CURSORS.c.sender_id == sender_id, CURSORS.c.name == name
        )
        with self.tx(write=False, doing="reading a cursor") as conn:
            return conn.execute(q).scalar_one_or_none()

    def set_cursor(self, platform: str, sender_id: str, name: str, value: str) -> None:
        """Save a poller's position (insert or replace)."""
        now = self.clock.now()
        stmt = self._insert(CURSORS).values(platform=platform, sender_id=sender_id, name=name, value=value, updated_at=now)
        stmt = stmt.on_conflict_do_update(
            index_elements=["platform", "sender_id", "name"], set_={"value": value, "updated_at": now}
        )
        with self.tx(relaxed=True, doing="saving a cursor") as conn:
            conn.execute(stmt)
