"""The hot path's SQL: written once per dialect from the table definitions, run straight through the driver."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from replyd.store.schema import ANSWERS, EVENT_COLUMNS, EVENTS, KEY_COLUMNS, REPLIES, REPLY_COLUMNS, REPLY_SET

ANSWER_COLUMNS = tuple(c.name for c in ANSWERS.columns)


def _cast(t: sa.types.TypeEngine[Any], dialect: sa.engine.Dialect) -> str:
    """The SQL type a parameter of column type ``t`` is cast to: TEXT for any string (never truncated)."""
    return "TEXT" if isinstance(getattr(t, "impl", t), sa.String) else t.compile(dialect=dialect)


def _value_names(cols: tuple[str, ...]) -> tuple[str, ...]:
    """The parameter names of a compare-and-set's new values; a name that is no column is refused."""
    bad = set(cols) - REPLY_SET
    if bad:
        raise ValueError(f"not columns of {REPLIES.name}: {sorted(bad)}")
    return tuple("v_" + c for c in cols)


class HotSQL:
    """The hot path's statements for one dialect, written once from the table definitions and cached by shape.

    They run straight through the driver (sqlite3 / psycopg) with named parameters (SQLite's writes bound by
    position, ``positional``): no statement is built, no compiled-cache key computed and no result object
    made per call. Column lists come from ``REPLIES`` / ``EVENTS``, so a column added to the models is in
    every statement. On PostgreSQL a write and its event are ONE statement (a data-modifying CTE) run in
    autocommit: one round trip, one transaction; a relaxed one sets ``synchronous_commit`` off for its own
    transaction with ``set_config(…, true)``.
    """

    def __init__(self, dialect: sa.engine.Dialect, durable: str | None = None) -> None:
        self.pg = dialect.name == "postgresql"
        self.durable = durable  # synchronous_commit for the durable writes (claim, open); None: the server's
        q = dialect.identifier_preparer.quote
        self.q = q
        self.R, self.E = q(REPLIES.name), q(EVENTS.name)
        # Strings cast to unbounded TEXT: an explicit CAST to VARCHAR(n) would truncate where the column errors.
        # (sqlmodel's AutoString is a TypeDecorator over String: its ``impl`` is what says "a string".)
        self.cast = {c.name: _cast(c.type, dialect) for c in EVENTS.columns}
        self.cols = ", ".join(q(c) for c in REPLY_COLUMNS)
        self.key = " AND ".join(f"{q(c)} = {self.p('k_' + c)}" for c in KEY_COLUMNS)
        self.peek = f"SELECT {self.cols} FROM {self.R} WHERE {self.key}"
        self.insert = (f"INSERT INTO {self.R} ({self.cols}) VALUES ({', '.join(self.p(c) for c in REPLY_COLUMNS)}) "
                       f"ON CONFLICT ({', '.join(q(c) for c in KEY_COLUMNS)}) DO NOTHING")
        self.event = (f"INSERT INTO {self.E} ({', '.join(q(c) for c in EVENT_COLUMNS)}) "
                      f"VALUES ({', '.join(self.p('e_' + c) for c in EVENT_COLUMNS)})")
        self.event_names = {"e_": tuple("e_" + c for c in EVENT_COLUMNS)}
        # A composed answer kept with the write that opens its row (``Store.cas_event(answer=…)``): a new
        # composition replaces an earlier one, as ``Tx.put_answer``.
        acast = {c.name: _cast(c.type, dialect) for c in ANSWERS.columns}
        akey = ", ".join(q(c) for c in KEY_COLUMNS)
        aset = ", ".join(f"{q(c)} = excluded.{q(c)}" for c in ANSWER_COLUMNS if c not in KEY_COLUMNS)
        acols = ", ".join(q(c) for c in ANSWER_COLUMNS)
        self.answer = (f"INSERT INTO {q(ANSWERS.name)} ({acols}) "
                       f"VALUES ({', '.join(self.p('a_' + c) for c in ANSWER_COLUMNS)}) "
                       f"ON CONFLICT ({akey}) DO UPDATE SET {aset}")
        typed = ", ".join(f"CAST({self.p('a_' + c)} AS {acast[c]})" for c in ANSWER_COLUMNS)
        self._answer_after_w = (f", a AS (INSERT INTO {q(ANSWERS.name)} ({acols}) SELECT {typed} FROM w "
                                f"ON CONFLICT ({akey}) DO UPDATE SET {aset} RETURNING 1)")
        self.rcast = {c.name: _cast(c.type, dialect) for c in REPLIES.columns}
        self._claim: dict[bool, str] = {}
        self._claim_set: dict[bool, str] = {}
        self._close_set: dict[tuple[Any, ...], tuple[str, tuple[str, ...]]] = {}
        self._rows_of: dict[int, str] = {}
        self._cas: dict[tuple[Any, ...], tuple[str, tuple[str, ...]]] = {}
        self._positional: dict[str, tuple[str, Any]] = {}
        self._values_rows: dict[tuple[str, int], str] = {}

    def p(self, name: str) -> str:
        """A named placeholder in the driver's style."""
        return f"%({name})s" if self.pg else f":{name}"

    def positional(self, sql: str) -> tuple[str, Callable[[Mapping[str, Any]], tuple[Any, ...]]]:
        """SQLite: ``sql`` (one of these statements, ``:name`` placeholders) with ``?`` placeholders, and the
        getter that turns its named parameters into that order's tuple (a name used twice is taken twice).

        sqlite3 binds a dict by asking SQLite each placeholder's name and looking it up, per row: a 22-column
        row cost 3.9 µs that way against 1.7 µs by position (``executemany`` of 16 rows, steering measurement).
        The writes of a 16-parent page bound by position: 0.95x its time, side by side in one process."""
        hit = self._positional.get(sql)
        if hit is None:
            names = tuple(re.findall(r":(\w+)", sql))
            get = itemgetter(*names) if len(names) > 1 else (lambda d: tuple(d[n] for n in names))
            hit = self._positional[sql] = (re.sub(r":\w+", "?", sql), get)
        return hit

    def values_rows(self, sql: str, n: int) -> str:
        """SQLite: ``positional(sql)`` of an ``INSERT … VALUES (…)`` with its VALUES row written ``n`` times: ONE
        statement for ``n`` rows, bound with the ``n`` rows' tuples (``positional``'s getter) laid end to end.

        ``executemany`` resets and steps the statement once per row: 16 event rows cost 3.7 µs each that way
        against 2.2 µs as one statement (steering measurement, raw sqlite3)."""
        hit = self._values_rows.get((sql, n))
        if hit is None:
            q = self.positional(sql)[0]
            head, _values, rest = q.partition(" VALUES (")
            row, _close, tail = rest.partition(")")  # the row is placeholders only; the tail its ON CONFLICT
            hit = self._values_rows[(sql, n)] = f"{head} VALUES {', '.join([f'({row})'] * n)}{tail}"
        return hit

    def _event_select(self, pre: str) -> str:
        # Typed, so PostgreSQL never has to guess a parameter's type in INSERT … SELECT / UNION ALL.
        return "SELECT " + ", ".join(f"CAST({self.p(pre + c)} AS {self.cast[c]})" for c in EVENT_COLUMNS)

    def _tail(self, relaxed: bool) -> str:
        if relaxed:
            return ", set_config('synchronous_commit', 'off', true)"
        # The level is one of CLAIM_COMMIT_LEVELS (checked by the config), never user text in SQL.
        return f", set_config('synchronous_commit', '{self.durable}', true)" if self.durable else ""

    def rows_of(self, n: int) -> str:
        """The rows of ``n`` parent ids of one bot (``k_platform``, ``k_sender_id``; ``p0`` … ``p{n-1}``)."""
        sql = self._rows_of.get(n)
        if sql is None:
            ids = ", ".join(self.p(f"p{i}") for i in range(n))
            sql = self._rows_of[n] = (f"SELECT {self.cols} FROM {self.R} WHERE {self.q('platform')} = "
                                      f"{self.p('k_platform')} AND {self.q('sender_id')} = {self.p('k_sender_id')} "
                                      f"AND {self.q('parent_id')} IN ({ids})")
        return sql

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

    def _unnest(self, pre: str, cols: tuple[str, ...], cast: dict[str, str], alias: str) -> str:
        """One row per array index: ``cols`` from the array parameters ``{pre}{col}`` (typed: never guessed)."""
        # Binary parameters (``%(name)b``): psycopg's text format escapes every array element with a regex, most
        # of a 16-row page's client cost.
        arrays = ", ".join(f"CAST(%({pre}{c})b AS {cast[c]}[])" for c in cols)
        return f"SELECT * FROM unnest({arrays}) AS {alias}({', '.join(self.q(c) for c in cols)})"

    def _events_of(self, relaxed: bool) -> str:
        """The tail of a set statement: its events (``b_`` arrays) for the keys ``w`` wrote, and what it wrote."""
        ev_cols = ", ".join(self.q(c) for c in EVENT_COLUMNS)
        key = ", ".join(self.q(c) for c in KEY_COLUMNS)
        return (f", ev AS ({self._unnest('b_', EVENT_COLUMNS, self.cast, 'ev')}), "
                f"e AS (INSERT INTO {self.E} ({ev_cols}) SELECT {ev_cols} FROM ev JOIN w USING ({key}) RETURNING 1) "
                f"SELECT w.{self.q('parent_id')}, (SELECT count(*) FROM e){self._tail(relaxed)} FROM w")

    def claim_set(self, relaxed: bool) -> str:
        """PostgreSQL: insert many new rows (``a_`` arrays, distinct keys) with their events in ONE statement; it
        returns the parent ids it inserted (a key that has a row is left as it is)."""
        sql = self._claim_set.get(relaxed)
        if sql is None:
            key = ", ".join(self.q(c) for c in KEY_COLUMNS)
            sql = self._claim_set[relaxed] = (
                f"WITH v AS ({self._unnest('a_', REPLY_COLUMNS, self.rcast, 'v')}), "
                f"w AS (INSERT INTO {self.R} ({self.cols}) SELECT {self.cols} FROM v "
                f"ON CONFLICT ({key}) DO NOTHING RETURNING {key})" + self._events_of(relaxed))
        return sql

    def close_set(self, cols: tuple[str, ...], n_states: int, relaxed: bool) -> tuple[str, tuple[str, ...]]:
        """PostgreSQL: compare-and-set many rows of one bot (``a_parent_id``, ``a_attempt``, one array per value
        column, the shared ``s{i}`` states) with their events in ONE statement; it returns the parent ids set."""
        shape = (cols, n_states, relaxed)
        hit = self._close_set.get(shape)
        if hit is not None:
            return hit
        names = _value_names(cols)
        q, R = self.q, self.R
        vcols = ("parent_id", "attempt", *names)
        vcast = {"parent_id": "TEXT", "attempt": self.rcast["attempt"],
                 **{n: self.rcast[c] for c, n in zip(cols, names, strict=True)}}
        sets = ", ".join(f"{q(c)} = v.{q(n)}" for c, n in zip(cols, names, strict=True))
        states = ", ".join(self.p(f"s{i}") for i in range(n_states))
        # ``state || ''``: not indexable, so no plan reaches the rows through ``ix_replies_due``. With the states as
        # known values and a live table's statistics (few open rows) that custom plan looks cheaper than the by-key
        # generic one, so PostgreSQL planned the statement again on every page (0.3 ms, a third of the close's
        # server time); now the cached generic plan is used. It is by key on a table of a few thousand rows and
        # more; on statistics of a smaller one it reads the bot's rows and hash-joins the page (about 1 ms at
        # 1,440 rows), until autovacuum's next ANALYZE (10 % more rows) plans it again.
        sql = (f"WITH v AS ({self._unnest('a_', vcols, vcast, 'v')}), "
               f"w AS (UPDATE {R} SET {sets} FROM v WHERE {R}.{q('platform')} = {self.p('k_platform')} "
               f"AND {R}.{q('sender_id')} = {self.p('k_sender_id')} AND {R}.{q('parent_id')} = v.{q('parent_id')} "
               f"AND ({R}.{q('state')} || '') IN ({states}) AND {R}.{q('attempt')} = v.{q('attempt')} "
               f"RETURNING {', '.join(f'{R}.{q(c)}' for c in KEY_COLUMNS)})" + self._events_of(relaxed))
        self._close_set[shape] = (sql, names)
        return sql, names

    def event_only(self, relaxed: bool) -> str:
        """PostgreSQL: one event on its own (a note of a write that did not happen), as one statement."""
        return (f"WITH e AS ({self.event} RETURNING 1) SELECT count(*){self._tail(relaxed)} FROM e")

    def cas(self, cols: tuple[str, ...], n_states: int, attempt: bool, lease: bool, event: bool,
            relaxed: bool, answer: bool = False) -> tuple[str, tuple[str, ...]]:
        """The compare-and-set UPDATE (on PostgreSQL with its event, and ``answer``'s upsert when the row was
        set, in the same statement) and its value names."""
        shape = (cols, n_states, attempt, lease, event, relaxed, answer)
        hit = self._cas.get(shape)
        if hit is not None:
            return hit
        names = _value_names(cols)
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
            ans = self._answer_after_w if answer else ""
            sql = f"WITH w AS ({sql} RETURNING 1){ev}{ans} SELECT count(*){self._tail(relaxed)} FROM w"
        self._cas[shape] = (sql, names)
        return sql, names


def hot_sql(backend: str, durable: str | None = None) -> HotSQL:
    """The hot-path statements of ``backend`` ("sqlite" or "postgresql"), e.g. for a benchmark's raw replay."""
    return HotSQL((sqlite if backend == "sqlite" else postgresql).dialect(), durable)
