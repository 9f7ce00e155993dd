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
import select
import socket
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

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
SKIPPED = "skipped"  # re-offered, and the policy now rules it out for good (too old, denied ...): reason in error
STATES = (COMPOSING, OPEN, CLOSED, RELEASED, REJECTED, NOT_LANDED, GAVE_UP, DECLINED, SKIPPED)
TERMINAL = (CLOSED, REJECTED, GAVE_UP, DECLINED, SKIPPED)
# Rows that wait for a path to move them on: re-find re-offers them (see ``reoffer_due``).
REOFFERED = (NOT_LANDED, RELEASED, COMPOSING)
# Rows the sweep leases once their deadline has passed (the deadline says what it is for; see Store.lease_due).
SWEPT = (OPEN, CLOSED, NOT_LANDED, GAVE_UP)

# Events whose detail names own reply ids (how a row closed, late answers, duplicates found and deleted), sends
# that may have landed without one (maybe_sent), and verifications done: what the sweep's verification reads.
REPLY_ID_EVENTS = ("closed", "already_landed", "late_landing", "swept_found", "reconciled", "duplicate_detected",
                   "duplicate_deleted", "maybe_sent", "late_maybe_sent", "verified")

# PostgreSQL ``synchronous_commit`` levels a durable write (the claim, the open) may ask for: "local" waits for
# the primary's disk, "on" / "remote_write" / "remote_apply" also for a synchronous standby (when
# ``synchronous_standby_names`` names one), so a claim survives a failover. Closes stay relaxed.
CLAIM_COMMIT_LEVELS = ("local", "on", "remote_write", "remote_apply")

SQLITE_BUSY_TIMEOUT_MS = 30_000
# An event's detail column: json.dumps(detail, sort_keys=True, default=str), one encoder made once.
_detail_json = json.JSONEncoder(sort_keys=True, default=str).encode
_IDLE_MAX = 2  # connections a Store's hot path keeps checked out between calls


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


class ListingLagSample(SQLModel, table=True):
    """How long one own reply took to be listed by the own-feed read-back (see ``replyd.lag``).

    ``lower_s``: its age at the last read-back that did not list it (0 if the first look did), a proven lag;
    ``upper_s``: its age when a read-back first listed it (None while it is still unlisted).
    """

    __tablename__ = "listing_lag"
    __table_args__ = (sa.Index("ix_listing_lag_seen", "platform", "seen_at"),)

    platform: str = Field(primary_key=True, max_length=255)
    reply_id: str = Field(primary_key=True, max_length=1024)
    sender_id: str = Field(max_length=255)
    sent_at: float
    lower_s: float
    upper_s: float | None = None
    seen_at: float | None = None


class ListingDelay(SQLModel, table=True):
    """The listing delay one platform instance uses now: configured, or learned (``replyd.lag``)."""

    __tablename__ = "listing_delay"

    platform: str = Field(primary_key=True, max_length=255)
    configured_s: float
    in_use_s: float
    updated_at: float


REPLIES = Reply.__table__
EVENTS = Event.__table__
CURSORS = Cursor.__table__
LISTING_LAG = ListingLagSample.__table__
LISTING_DELAY = ListingDelay.__table__

# The hot path's prebuilt statements are derived from these, never from hand-typed column lists.
REPLY_COLUMNS = tuple(c.name for c in REPLIES.columns)
EVENT_COLUMNS = tuple(c.name for c in EVENTS.columns if not c.primary_key)
KEY_COLUMNS = tuple(c.name for c in REPLIES.primary_key.columns)
REPLY_DEFAULTS: dict[str, Any] = {
    c.name: c.default.arg if c.default is not None and c.default.is_scalar else None for c in REPLIES.columns
}
_REPLY_SET = frozenset(REPLY_COLUMNS)


class Row(SimpleNamespace):
    """One ``replies`` row as plain attributes (the fields of ``Reply``): the hot path's light row, no ORM state."""

    @classmethod
    def of(cls, key: Key, values: Mapping[str, Any]) -> Row:
        """The row ``values`` describe for ``key``, every column the values leave out at its default."""
        return cls(**{**REPLY_DEFAULTS, **values, "platform": key.platform, "sender_id": key.sender_id,
                      "parent_id": key.parent_id})

    def model_dump(self) -> dict[str, Any]:
        """The row as a dict, like ``Reply.model_dump``."""
        return dict(self.__dict__)


class Claim(NamedTuple):
    """What ``Store.claim`` did: ``won`` with the ``values`` written, else the ``row`` that stands (None if unseen)."""

    won: bool
    row: Row | None
    values: Mapping[str, Any] | None


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


def sqlite_file(url: str) -> Path | None:
    """Return the file a SQLite URL names (None for an in-memory database or a ``file:`` URI)."""
    db = sa.engine.make_url(url).database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db).expanduser()


# Query parameters of a database URL that carry a secret (libpq takes ``?password=``, ``?sslpassword=``).
_SECRET_PARAM_WORDS = ("password", "secret", "token")


def _secret_params(url: sa.URL) -> list[str]:
    return [k for k in url.query if any(w in k.lower() for w in _SECRET_PARAM_WORDS)]


def redact_url(url: str | sa.URL) -> str:
    """Return ``url`` with its password and any secret query parameter replaced by ``***``, for people and logs."""
    try:
        parsed = sa.engine.make_url(url)
        hidden = _secret_params(parsed)
        if hidden:
            parsed = parsed.update_query_dict({k: "***" for k in hidden})
        return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")
    except Exception:  # an unparsable URL is reported by the caller; never echo it raw
        return "<unparsable database URL>"


def _register_url_secrets(url: sa.URL) -> None:
    """Register the URL's password and secret query values with the log masker."""
    from replyd import log as rlog

    values: list[Any] = [url.password] + [url.query[k] for k in _secret_params(url)]
    for v in values:
        for one in (v if isinstance(v, tuple) else (v,)):
            if one:
                rlog.add_secret(str(one))


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


def _map_db_error(exc: BaseException, doing: str) -> Exception:
    """Map a DBAPI/SQLAlchemy error to ContentionError or StoreError."""
    text = str(getattr(exc, "orig", exc)).lower()
    if "database is locked" in text or "lock timeout" in text or "could not serialize" in text:
        return ContentionError(f"store busy while {doing}: another writer holds the lock")
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        return SchemaError(f"store schema missing while {doing}: run `replyd db upgrade`")
    detail = str(getattr(exc, "orig", exc)).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return StoreError(f"store unavailable while {doing}: {detail}")


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
    except Exception as exc:  # no socket any more, or the server closed it  # noqa: BLE001
        return str(exc).strip() or type(exc).__name__
    return "the server keeps sending data while the connection is idle"


def _pg_on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    """Drop a pooled PostgreSQL connection the server has closed (instead of pool_pre_ping's round trip).

    Raising DisconnectionError makes the pool discard it and check out (or open) another.
    """
    why = _pg_idle_dead(dbapi_conn)
    if why:
        raise sa.exc.DisconnectionError(why)


def make_engine(url: str) -> Engine:
    """Create an engine for ``url`` with replyd's connection settings."""
    try:
        parsed = sa.engine.make_url(url)
    except Exception as exc:
        raise StoreError(f"bad store URL {redact_url(url)!r}: {exc}") from None
    _register_url_secrets(parsed)
    if parsed.drivername.startswith("sqlite"):
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:"):
            _owner_only_sqlite(Path(db).expanduser())
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
    engine = sa.create_engine(
        parsed,
        pool_size=5,
        max_overflow=5,
        connect_args={"connect_timeout": 5, "application_name": "replyd"},
    )
    # Not pool_pre_ping (a round trip per checkout): a dead idle connection is seen on its socket instead.
    sa.event.listen(engine.pool, "checkout", _pg_on_checkout)
    return engine


def lease_holder(row: Any) -> str | None:
    """The lease holder a reclaim must still find: a composing row's, none for other states."""
    return row.lease_owner if row.state == COMPOSING and row.lease_owner else None


def _row(mapping: Mapping[str, Any] | None) -> Reply | None:
    return None if mapping is None else Reply(**dict(mapping))


class _HotSQL:
    """The hot path's statements for one dialect, written once from the table definitions and cached by shape.

    They run straight through the driver (sqlite3 / psycopg) with named parameters: no statement is built,
    no compiled-cache key computed and no result object made per call. Column lists come from ``REPLIES`` /
    ``EVENTS``, so a column added to the models is in every statement. On PostgreSQL a write and its
    event are ONE statement (a data-modifying CTE) run in autocommit: one round trip, one transaction;
    a relaxed one sets ``synchronous_commit`` off for its own transaction with ``set_config(…, true)``.
    """

    def __init__(self, dialect: sa.engine.Dialect, durable: str | None = None) -> None:
        self.pg = dialect.name == "postgresql"
        self.durable = durable  # synchronous_commit for the durable writes (claim, open); None: the server's
        q = dialect.identifier_preparer.quote
        self.q = q
        self.R, self.E = q(REPLIES.name), q(EVENTS.name)
        # Strings cast to unbounded TEXT: an explicit CAST to VARCHAR(n) would truncate where the column errors.
        self.cast = {c.name: "TEXT" if isinstance(c.type, sa.String) else c.type.compile(dialect=dialect)
                     for c in EVENTS.columns}
        self.cols = ", ".join(q(c) for c in REPLY_COLUMNS)
        self.key = " AND ".join(f"{q(c)} = {self.p('k_' + c)}" for c in KEY_COLUMNS)
        self.peek = f"SELECT {self.cols} FROM {self.R} WHERE {self.key}"
        self.insert = (f"INSERT INTO {self.R} ({self.cols}) VALUES ({', '.join(self.p(c) for c in REPLY_COLUMNS)}) "
                       f"ON CONFLICT ({', '.join(q(c) for c in KEY_COLUMNS)}) DO NOTHING")
        self.event = (f"INSERT INTO {self.E} ({', '.join(q(c) for c in EVENT_COLUMNS)}) "
                      f"VALUES ({', '.join(self.p('e_' + c) for c in EVENT_COLUMNS)})")
        self.event_names = {"e_": tuple("e_" + c for c in EVENT_COLUMNS)}
        self._claim: dict[bool, str] = {}
        self._cas: dict[tuple[Any, ...], tuple[str, tuple[str, ...]]] = {}

    def p(self, name: str) -> str:
        """A named placeholder in the driver's style."""
        return f"%({name})s" if self.pg else f":{name}"

    def _event_select(self, pre: str) -> str:
        # Typed, so PostgreSQL never has to guess a parameter's type in INSERT … SELECT / UNION ALL.
        return "SELECT " + ", ".join(f"CAST({self.p(pre + c)} AS {self.cast[c]})" for c in EVENT_COLUMNS)

    def _tail(self, relaxed: bool) -> str:
        if relaxed:
            return ", set_config('synchronous_commit', 'off', true)"
        # The level is one of CLAIM_COMMIT_LEVELS (checked by the config), never user text in SQL.
        return f", set_config('synchronous_commit', '{self.durable}', true)" if self.durable else ""

    def claim(self, relaxed: bool) -> str:
        """PostgreSQL: insert the row unless the key has one, with its event, in one statement; return 1 if it did."""
        sql = self._claim.get(relaxed)
        if sql is None:
            ev_cols = ", ".join(self.q(c) for c in EVENT_COLUMNS)
            sql = self._claim[relaxed] = (
                f"WITH w AS ({self.insert} RETURNING 1), "
                f"e AS (INSERT INTO {self.E} ({ev_cols}) {self._event_select('e_')} FROM w RETURNING 1) "
                f"SELECT count(*){self._tail(relaxed)} FROM e"
            )
        return sql

    def event_only(self, relaxed: bool) -> str:
        """PostgreSQL: one event on its own (a note of a write that did not happen), as one statement."""
        return (f"WITH e AS ({self.event} RETURNING 1) SELECT count(*){self._tail(relaxed)} FROM e")

    def cas(self, cols: tuple[str, ...], n_states: int, attempt: bool, lease: bool, event: bool,
            relaxed: bool) -> tuple[str, tuple[str, ...]]:
        """The compare-and-set UPDATE (on PostgreSQL with its event in the same statement) and its value names."""
        shape = (cols, n_states, attempt, lease, event, relaxed)
        hit = self._cas.get(shape)
        if hit is not None:
            return hit
        bad = set(cols) - _REPLY_SET
        if bad:
            raise ValueError(f"not columns of {REPLIES.name}: {sorted(bad)}")
        names = tuple("v_" + c for c in cols)
        where = [self.key, f"{self.q('state')} IN ({', '.join(self.p(f's{i}') for i in range(n_states))})"]
        if attempt:
            where.append(f"{self.q('attempt')} = {self.p('k_attempt')}")
        if lease:
            where.append(f"{self.q('lease_owner')} = {self.p('k_lease_owner')}")
        sets = ", ".join(f"{self.q(c)} = {self.p(n)}" for c, n in zip(cols, names, strict=True))
        sql = f"UPDATE {self.R} SET {sets} WHERE {' AND '.join(where)}"
        if self.pg:
            ev = (f", e AS (INSERT INTO {self.E} ({', '.join(self.q(c) for c in EVENT_COLUMNS)}) "
                  f"{self._event_select('e_')} FROM w RETURNING 1)") if event else ""
            sql = f"WITH w AS ({sql} RETURNING 1){ev} SELECT count(*){self._tail(relaxed)} FROM w"
        self._cas[shape] = (sql, names)
        return sql, names


_STORES: weakref.WeakSet[Store] = weakref.WeakSet()
_INHERITED: list[Any] = []  # a forked child's copies of its parent's kept connections: never used, never closed


def _after_fork_in_child() -> None:
    # The parent owns those sockets: the child must neither use nor close them (as dispose(close=False)).
    for store in list(_STORES):
        _INHERITED.extend(store._idle)
        store._idle = []


os.register_at_fork(after_in_child=_after_fork_in_child)


class Store:
    """The answered-log over one database; safe to share between threads."""

    def __init__(self, engine: Engine, *, clock: Clock | None = None) -> None:
        self.engine = engine
        self.clock = clock or SystemClock()
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._insert = sqlite_dialect.insert if self.is_sqlite else pg_dialect.insert
        self._sql = _HotSQL(engine.dialect)
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._idle: list[tuple[Any, Any]] = []  # (pool, connection) the hot path keeps checked out; see _driver
        _STORES.add(self)

    @property
    def claim_commit(self) -> str | None:
        """The ``synchronous_commit`` level of durable writes on PostgreSQL (None: the server's default)."""
        return self._sql.durable

    @claim_commit.setter
    def claim_commit(self, level: str | None) -> None:
        if level is not None and level not in CLAIM_COMMIT_LEVELS:
            raise ValueError(f"claim_commit must be one of {', '.join(CLAIM_COMMIT_LEVELS)}, not {level!r}")
        self._sql = _HotSQL(self.engine.dialect, None if self.is_sqlite else level)

    def sync_standbys(self) -> tuple[str, int | None]:
        """PostgreSQL: ``synchronous_standby_names`` and how many synchronous standbys are connected now
        (None when this role may not see ``pg_stat_replication``)."""
        with self.tx(write=False, doing="reading the replication settings") as conn:
            names = conn.exec_driver_sql("SHOW synchronous_standby_names").scalar_one() or ""
            rows = conn.exec_driver_sql("SELECT sync_state FROM pg_stat_replication").scalars().all()
        if rows and all(r is None for r in rows):
            return names, None  # not allowed to see the columns
        return names, sum(1 for r in rows if r in ("sync", "quorum"))

    def claim_commit_problem(self) -> str | None:
        """Why the configured claim commit level cannot hold, on this server now; None when it can (or is local)."""
        if self.is_sqlite or self.claim_commit in (None, "local"):
            return None
        names, connected = self.sync_standbys()
        if not names.strip():
            return (f"store.claim_commit = {self.claim_commit!r} but the server has no synchronous_standby_names: "
                    "claims commit on the primary only and a failover can lose them")
        if connected == 0:
            return (f"store.claim_commit = {self.claim_commit!r} and synchronous_standby_names = {names!r}, but no "
                    "synchronous standby is connected: every claim waits until one is")
        return None

    @classmethod
    def open(cls, url: str | None = None, *, clock: Clock | None = None, migrate: bool = True,
             claim_commit: str | None = None) -> Store:
        """Open the store at ``url`` (default: the embedded SQLite file), migrating if asked."""
        store = cls(make_engine(url or default_url()), clock=clock)
        store.claim_commit = claim_commit
        try:
            if migrate:
                store.upgrade()
            else:
                store.require_schema()
        except StoreError as exc:  # say which store: several may be configured, and the default is implicit
            store.dispose()
            raise type(exc)(f"store {store.url}: {exc}") from None
        return store

    def dispose(self) -> None:
        """Close all pooled connections."""
        self._reset_pool()

    @property
    def url(self) -> str:
        """The store URL with any password (user info or query parameter) hidden."""
        return redact_url(self.engine.url)

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
        relaxed = self.commit_relaxed(relaxed)
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(write=write, relaxed=relaxed)
                with conn.begin():
                    if relaxed and not self.is_sqlite:
                        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
                    elif write and self._sql.durable and not self.is_sqlite:
                        conn.exec_driver_sql(f"SET LOCAL synchronous_commit = {self._sql.durable}")
                    yield conn
        except sa.exc.DBAPIError as exc:
            if self.is_sqlite and "readonly database" in str(exc.orig).lower():
                # SQLite opens an unwritable file read-only and the pool would keep that connection
                # for ever: drop it, so the first write after the file is writable again succeeds.
                self._reset_pool()
            raise _map_db_error(exc, doing) from None

    def commit_relaxed(self, relaxed: bool) -> bool:
        """Whether a commit that asks for ``relaxed`` durability gets it (one place, for ``tx`` and the hot path).

        A subclass may pin it (the benchmarks' all-durable and all-relaxed variants do).
        """
        return relaxed

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
        row = self.peek(key)
        return None if row is None else Reply(**row.__dict__)

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

    # -- the hot path: prebuilt SQL straight through the driver ---------------------------
    #
    # Same guarantees as tx() + insert_new/cas/add_event: every write and its event commit together, the
    # claim with full durability unless asked otherwise, CAS on (key, state, attempt), errors mapped to
    # StoreError / ContentionError. Reads run without an explicit transaction (one statement, one snapshot).

    @contextmanager
    def _driver(self, doing: str) -> Iterator[Any]:
        """A connection of SQLAlchemy's pool (its connect/checkout handling applies) used at driver level.

        The last ``_IDLE_MAX`` are kept checked out between calls: taking one is a list pop, not a trip through
        the pool (a third of the hot path's Python time). Only a connection whose call ended cleanly, outside
        any transaction, is kept; one of a replaced pool, or (PostgreSQL) whose server closed it, is dropped.
        A PostgreSQL connection is in autocommit while the hot path has it (one statement, one transaction)
        and back in transaction mode before the pool gets it again.
        """
        pool = self.engine.pool
        fairy = None
        while self._idle:
            try:
                owner, f = self._idle.pop()
            except IndexError:  # another thread took the last one
                break
            if owner is pool and f.is_valid and (self.is_sqlite or _pg_idle_dead(f.driver_connection) is None):
                fairy = f
                break
            f.invalidate()
            f.close()
        fresh = fairy is None
        if fairy is None:
            try:
                fairy = self.engine.raw_connection()
            except (sa.exc.DBAPIError, sa.exc.DisconnectionError, self._dbapi_error) as exc:
                raise _map_db_error(exc, doing) from None
        clean = False
        try:
            if fresh and not self.is_sqlite:
                fairy.driver_connection.autocommit = True
            yield fairy
            clean = True
        except self._dbapi_error as exc:
            if self.is_sqlite:
                if "readonly database" in str(exc).lower():
                    # As in tx(): never keep a connection SQLite opened read-only.
                    fairy.invalidate(exc)
                    self._reset_pool()
            elif self.engine.dialect.is_disconnect(exc, fairy.driver_connection, None):
                fairy.invalidate(exc)
            raise _map_db_error(exc, doing) from None
        finally:
            if (clean and fairy.is_valid and len(self._idle) < _IDLE_MAX
                    and not (self.is_sqlite and fairy.driver_connection.in_transaction)):
                self._idle.append((pool, fairy))
            else:
                self._give_back(fairy)

    def _give_back(self, fairy: Any) -> None:
        """Return a hot-path connection to the pool as the pool's other users expect it (transactions on)."""
        if not self.is_sqlite and fairy.is_valid:
            try:
                fairy.driver_connection.autocommit = False
            except Exception:  # a broken connection refuses: never pool it again  # noqa: BLE001
                fairy.invalidate()
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

    def _pg(self, fairy: Any, sql: str, params: Mapping[str, Any]) -> list[Any]:
        """Run one statement on a hot-path connection (autocommit: its own transaction, one round trip)."""
        cur = fairy.driver_connection.cursor()
        cur.execute(sql, params)
        return cur.fetchall()

    def _sqlite_write(self, fairy: Any, relaxed: bool, body: Callable[[Any], Any]) -> Any:
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

    def _key_params(self, key: Key) -> dict[str, Any]:
        return {"k_platform": key.platform, "k_sender_id": key.sender_id, "k_parent_id": key.parent_id}

    def _event_params(self, pre: str, key: Key, event: Mapping[str, Any], state: str | None,
                      attempt: int | None) -> dict[str, Any]:
        at = event.get("at")
        return dict(zip(self._sql.event_names[pre], (
            self.clock.now() if at is None else at, key.platform, key.sender_id, key.parent_id, event["kind"],
            event.get("state", state), event.get("attempt", attempt), event.get("owner"),
            _detail_json(dict(event.get("detail") or {})),
        ), strict=True))

    def _peek_with(self, fairy: Any, key: Key) -> Row | None:
        if self.is_sqlite:
            rows = fairy.driver_connection.execute(self._sql.peek, self._key_params(key)).fetchall()
        else:
            rows = self._pg(fairy, self._sql.peek, self._key_params(key))
        return Row(**dict(zip(REPLY_COLUMNS, rows[0], strict=True))) if rows else None

    def peek(self, key: Key) -> Row | None:
        """Return ``key``'s row as a light ``Row`` (one statement, no explicit transaction, no lock), or None."""
        with self._driver("reading a row") as fairy:
            return self._peek_with(fairy, key)

    def claim(
        self,
        key: Key,
        new: Mapping[str, Any],
        reclaim: Callable[[Row], Mapping[str, Any] | None],
        event: Mapping[str, Any],
        *,
        relaxed: bool = False,
        doing: str = "claiming",
    ) -> Claim:
        """Take ``key``: insert the row ``new`` if the key has none, else compare-and-set the values
        ``reclaim(row)`` returns on that row's (state, attempt), or leave the row when it returns None.

        ``event`` (kind, owner, detail; state and attempt default to the written row's) commits in the same
        transaction as the row, durably unless ``relaxed``. SQLite reads the row before ``BEGIN IMMEDIATE``,
        so a taken key costs no write lock; PostgreSQL tries the insert (with its event, one statement) first
        and reads the row only when the insert lost (callers ``check`` first, so new keys are the common case).
        """
        bad = set(new) - _REPLY_SET
        if bad:
            raise ValueError(f"not columns of {REPLIES.name}: {sorted(bad)}")
        ins = {**REPLY_DEFAULTS, **new, "platform": key.platform, "sender_id": key.sender_id,
               "parent_id": key.parent_id}
        ev = self._event_params("e_", key, event, ins["state"], ins["attempt"])
        with self._driver(doing) as fairy:
            if self.is_sqlite:
                row = self._peek_with(fairy, key)
                if row is None:
                    def insert(dbc: Any) -> Claim:
                        if dbc.execute(self._sql.insert, ins).rowcount == 1:
                            dbc.execute(self._sql.event, ev)
                            return Claim(True, None, new)
                        # Inserted by someone since the read: decide on it under the lock, in this transaction.
                        got = self._peek_with(fairy, key)
                        vals = None if got is None else reclaim(got)
                        if vals is None:
                            return Claim(False, got, None)
                        assert got is not None
                        if self._cas_sqlite(dbc, key, [got.state], got.attempt, vals, lease_holder(got),
                                            {**event, "state": vals.get("state"), "attempt": vals.get("attempt")},
                                            None):
                            return Claim(True, None, vals)
                        return Claim(False, got, None)

                    return self._sqlite_write(fairy, relaxed, insert)
            else:
                if self._pg(fairy, self._sql.claim(self.commit_relaxed(relaxed)), {**ins, **ev})[0][0] == 1:
                    return Claim(True, None, new)
                row = self._peek_with(fairy, key)  # the row that made the insert lose
                if row is None:  # deleted since (an operator): report it in flight, as before
                    return Claim(False, None, None)
            vals = reclaim(row)
            if vals is None:
                return Claim(False, row, None)
            # On the row as read, its lease holder included: two replicas that both saw an expired composing
            # lease must not both take it (the second would compose for nothing).
            won = self._cas_with(fairy, key, [row.state], row.attempt, vals, lease_holder(row),
                                 {**event, "state": vals.get("state"), "attempt": vals.get("attempt")}, None,
                                 relaxed)
            return Claim(True, None, vals) if won else Claim(False, self._peek_with(fairy, key), None)

    def cas_event(
        self,
        key: Key,
        *,
        states: Sequence[str],
        attempt: int | None,
        values: Mapping[str, Any],
        event: Mapping[str, Any] | None = None,
        otherwise: Mapping[str, Any] | None = None,
        lease_owner: str | None = None,
        relaxed: bool = False,
        doing: str = "writing",
    ) -> bool:
        """``cas`` in its own transaction, with ``event`` in the same transaction if it updated the row.

        ``otherwise`` is the event to record when it did not (nothing changed: on PostgreSQL it is written by
        a statement of its own right after). ``values`` are plain values (no SQL expressions); ``lease_owner``
        adds ``lease_owner = …`` to the condition. Events give kind, state, attempt, owner, detail. True if
        the row was updated.
        """
        with self._driver(doing) as fairy:
            return self._cas_with(fairy, key, states, attempt, values, lease_owner, event, otherwise, relaxed)

    def _cas_with(self, fairy: Any, key: Key, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  lease_owner: str | None, event: Mapping[str, Any] | None, otherwise: Mapping[str, Any] | None,
                  relaxed: bool) -> bool:
        if self.is_sqlite:
            return self._sqlite_write(fairy, relaxed, lambda dbc: self._cas_sqlite(
                dbc, key, states, attempt, values, lease_owner, event, otherwise))
        relaxed = self.commit_relaxed(relaxed)
        sql, names = self._sql.cas(tuple(values), len(states), attempt is not None, lease_owner is not None,
                                   event is not None, relaxed)
        params = self._cas_params(key, states, attempt, lease_owner, names, values)
        if event is not None:
            params.update(self._event_params("e_", key, event, None, None))
        ok = self._pg(fairy, sql, params)[0][0] == 1
        if not ok and otherwise is not None:
            # Nothing was changed, so there is nothing to be atomic with: the note is a statement of its own.
            self._pg(fairy, self._sql.event_only(relaxed), self._event_params("e_", key, otherwise, None, None))
        return ok

    def _cas_params(self, key: Key, states: Sequence[str], attempt: int | None, lease_owner: str | None,
                    names: tuple[str, ...], values: Mapping[str, Any]) -> dict[str, Any]:
        params = self._key_params(key)
        params.update(zip(names, values.values(), strict=True))
        for i, s in enumerate(states):
            params[f"s{i}"] = s
        if attempt is not None:
            params["k_attempt"] = attempt
        if lease_owner is not None:
            params["k_lease_owner"] = lease_owner
        return params

    def _cas_sqlite(self, dbc: Any, key: Key, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                    lease_owner: str | None, event: Mapping[str, Any] | None,
                    otherwise: Mapping[str, Any] | None) -> bool:
        sql, names = self._sql.cas(tuple(values), len(states), attempt is not None, lease_owner is not None,
                                   False, False)
        ok = dbc.execute(sql, self._cas_params(key, states, attempt, lease_owner, names, values)).rowcount == 1
        ev = event if ok else otherwise
        if ev is not None:
            dbc.execute(self._sql.event, self._event_params("e_", key, ev, None, None))
        return ok

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

    def reoffer_due(self, platform: str, sender_id: str, *, now: float, after: tuple[float, str] | None,
                    limit: int) -> list[Reply]:
        """Return one page of a bot's rows that wait to be offered again, in (updated_at, parent_id) order.

        ``not_landed`` and ``released`` rows, and ``composing`` rows whose lease has expired (their composer
        died: nothing was sent). ``after`` is the last row of the previous page; re-find walks the whole set
        page by page across its runs, so rows that stay where they are cannot hide the ones behind them.
        """
        c = REPLIES.c
        q = sa.select(REPLIES).where(
            c.platform == platform, c.sender_id == sender_id,
            sa.or_(c.state.in_([NOT_LANDED, RELEASED]), sa.and_(c.state == COMPOSING, c.lease_until < now)),
        )
        if after is not None:
            q = q.where(sa.tuple_(c.updated_at, c.parent_id) > sa.tuple_(sa.literal(after[0]), sa.literal(after[1])))
        q = q.order_by(c.updated_at, c.parent_id).limit(limit)
        with self.tx(write=False, doing="reading rows to offer again") as conn:
            return [Reply(**dict(m)) for m in conn.execute(q).mappings()]

    def overdue(self, now: float, grace_s: float, limit: int = 50) -> list[tuple[Reply, float]]:
        """Return non-terminal rows past their bound by more than ``grace_s``, most overdue first, with seconds over.

        The bound: a composing row's lease, an open row's sweep deadline, a released row's back-off (or its
        last change), a not_landed row's last change. Each has a job that moves it on within ``grace_s``
        (sweep, re-find); a row listed here is one they did not move.
        """
        c = REPLIES.c
        bound = sa.case(
            (c.state == COMPOSING, sa.func.coalesce(c.lease_until, c.updated_at)),
            (c.state == OPEN, sa.func.coalesce(c.deadline_at, c.updated_at)),
            (c.state == RELEASED, sa.func.coalesce(c.not_before, c.updated_at)),
            else_=c.updated_at,
        )
        q = (sa.select(REPLIES, bound.label("bound_at"))
             .where(c.state.in_([COMPOSING, OPEN, RELEASED, NOT_LANDED]), bound < now - grace_s)
             .order_by(bound).limit(limit))
        with self.tx(write=False, doing="reading overdue rows") as conn:
            out = []
            for m in conn.execute(q).mappings():
                d = dict(m)
                at = d.pop("bound_at")
                out.append((Reply(**d), now - at))
            return out

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

        Due: open rows past their deadline, closed rows that still carry a
        deadline (every close is verified once, and its reply's listing lag measured), and
        ``not_landed`` / ``gave_up`` rows that carry one (a later look may reconcile them). PostgreSQL skips rows another replica has locked (``FOR UPDATE SKIP
        LOCKED``); SQLite serialises writers, so the same select-then-update
        inside ``BEGIN IMMEDIATE`` is already exclusive.
        """
        free = sa.or_(REPLIES.c.lease_until.is_(None), REPLIES.c.lease_until < now)
        q = (
            sa.select(REPLIES)
            .where(
                REPLIES.c.state.in_(SWEPT),
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

    # -- listing lag (replyd.lag) ----------------------------------------------------

    def lag_look(self, conn: Connection, platform: str, sender_id: str, reply_id: str, *, sent_at: float,
                 age_s: float, listed: bool, now: float) -> bool:
        """Note one read-back's look for an own reply sent at ``sent_at``: unlisted at ``age_s``, or listed.

        Only the first listing completes a sample; later looks change nothing. True when this call completed it.
        """
        c = LISTING_LAG.c
        base = {"platform": platform, "reply_id": reply_id, "sender_id": sender_id, "sent_at": sent_at}
        if listed:
            ins = self._insert(LISTING_LAG).values(**base, lower_s=0.0, upper_s=age_s, seen_at=now)
            stmt = ins.on_conflict_do_update(index_elements=["platform", "reply_id"],
                                             set_={"upper_s": age_s, "seen_at": now}, where=c.upper_s.is_(None))
        else:
            ins = self._insert(LISTING_LAG).values(**base, lower_s=age_s)
            stmt = ins.on_conflict_do_update(index_elements=["platform", "reply_id"],
                                             set_={"lower_s": self.greatest(c.lower_s, age_s)},
                                             where=c.upper_s.is_(None))
        done = conn.execute(stmt.returning(c.upper_s)).first()
        return bool(listed and done is not None)

    def lag_samples(self, platform: str, limit: int) -> list[tuple[float, float]]:
        """Return the newest ``limit`` complete samples of ``platform`` as (lower_s, upper_s), newest first."""
        c = LISTING_LAG.c
        q = (sa.select(c.lower_s, c.upper_s).where(c.platform == platform, c.upper_s.is_not(None))
             .order_by(c.seen_at.desc()).limit(limit))
        with self.tx(write=False, doing="reading listing lag") as conn:
            return [(float(lo), float(hi)) for lo, hi in conn.execute(q)]

    def lag_prune(self, platform: str, before: float) -> None:
        """Forget ``platform``'s samples sent before ``before`` (complete or not)."""
        c = LISTING_LAG.c
        with self.tx(relaxed=True, doing="pruning listing lag") as conn:
            conn.execute(sa.delete(LISTING_LAG).where(c.platform == platform, c.sent_at < before))

    def set_listing_delay(self, platform: str, configured_s: float, in_use_s: float) -> None:
        """Record the listing delay ``platform`` uses now (insert or replace)."""
        now = self.clock.now()
        vals = {"configured_s": configured_s, "in_use_s": in_use_s, "updated_at": now}
        stmt = self._insert(LISTING_DELAY).values(platform=platform, **vals)
        stmt = stmt.on_conflict_do_update(index_elements=["platform"], set_=vals)
        with self.tx(relaxed=True, doing="saving the listing delay") as conn:
            conn.execute(stmt)

    def listing_delays(self) -> dict[str, ListingDelay]:
        """Return the recorded listing delay of every platform instance."""
        with self.tx(write=False, doing="reading listing delays") as conn:
            return {m["platform"]: ListingDelay(**dict(m)) for m in conn.execute(sa.select(LISTING_DELAY)).mappings()}

    def lag_platforms(self) -> list[str]:
        """Return the platform instances with lag samples."""
        with self.tx(write=False, doing="reading listing lag") as conn:
            return [p for (p,) in conn.execute(sa.select(LISTING_LAG.c.platform).distinct())]

    def reply_id_events(self, conn: Connection, key: Key) -> list[tuple[str, int | None, dict[str, Any]]]:
        """Return (kind, attempt, detail) of ``key``'s events that name own reply ids, a send that may have
        landed, or a verification, oldest first."""
        q = (sa.select(EVENTS.c.kind, EVENTS.c.attempt, EVENTS.c.detail)
             .where(EVENTS.c.platform == key.platform, EVENTS.c.sender_id == key.sender_id,
                    EVENTS.c.parent_id == key.parent_id, EVENTS.c.kind.in_(REPLY_ID_EVENTS))
             .order_by(EVENTS.c.id))
        return [(k, a, json.loads(d or "{}")) for k, a, d in conn.execute(q)]
