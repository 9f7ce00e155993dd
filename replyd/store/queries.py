"""The store's reads, leases, cursors and listing-lag records: one SQL text for both backends (SQLAlchemy core)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from replyd.store.model import ANSWERED_EVENTS, CLOSED, COMPOSING, NOT_LANDED, OPEN, PART_PATH, PARTS, RELEASED, SWEPT, Event, Key, Row
from replyd.store.reader import Reader, for_driver
from replyd.store.unit import key_where
from replyd.store.schema import CURSORS, EVENTS, LISTING_DELAY, LISTING_LAG, REPLIES


def _waiting(now: float) -> Any:
    """Rows that wait for a path to offer them again (see ``Reads.reoffer_due``); a released or not_landed row
    once its ``not_before`` has passed (before it, the guard would refuse it: a held or backing-off row)."""
    c = REPLIES.c
    due = sa.and_(c.state.in_([NOT_LANDED, RELEASED]), sa.or_(c.not_before.is_(None), c.not_before <= now))
    return sa.and_(sa.or_(due, c.state == PARTS, sa.and_(c.state == COMPOSING, c.lease_until < now)),
                   c.path != PART_PATH)


# ``_waiting`` as named SQL for ``Reads.reoffer_due``: one bot's page, from the start or after a row.
_WAITING_SQL = (f"path <> '{PART_PATH}' AND ((state IN ('{NOT_LANDED}', '{RELEASED}') "
                "AND (not_before IS NULL OR not_before <= :now)) "
                f"OR state = '{PARTS}' OR (state = '{COMPOSING}' AND lease_until < :now))")
_REOFFER_PAGE = "SELECT * FROM replies WHERE platform = :platform AND sender_id = :sender_id AND {where} " \
                "ORDER BY updated_at, parent_id LIMIT :limit"
REOFFER_DUE = {
    "first": _REOFFER_PAGE.format(where=_WAITING_SQL),
    "after": _REOFFER_PAGE.format(where=_WAITING_SQL + " AND (updated_at > :after_at OR "
                                  "(updated_at = :after_at AND parent_id > :after_id))"),
}


def _opened_since(platform: str, sender_id: str, since: float, author_id: str | None) -> list[Any]:
    """A bot's rows opened (sent or being sent) at or after ``since``, optionally for one author: what caps count.
    A row counts for ``author_id`` when it is the row's author (where the answer went) or its origin (who sent it)."""
    c = REPLIES.c
    cond = [c.platform == platform, c.sender_id == sender_id, c.opened_at >= since, c.state.in_((OPEN, CLOSED))]
    return cond if author_id is None else [*cond, sa.or_(c.author_id == author_id, c.origin_id == author_id)]


_for_driver = functools.lru_cache(maxsize=256)(for_driver)  # the same few texts, rewritten once each


class Reads(Reader):
    """The part of the shared base that needs no backend of its own (mixed into ``Store``).

    The reads for people (``Reader``) run their named SQL through ``_read_sql``, on a read transaction.
    """

    clock: Any

    def _tx(self, *, write: bool = True, relaxed: bool = False,
            doing: str = "writing") -> AbstractContextManager[Connection]:
        """A transaction (``Store._tx``)."""
        raise NotImplementedError

    def _insert(self, table: sa.Table) -> Any:
        """This dialect's INSERT (``Store._insert``)."""
        raise NotImplementedError

    def _lock_due(self, q: sa.Select) -> sa.Select:
        """How the lease select skips rows other replicas hold (``Store._lock_due``)."""
        raise NotImplementedError

    def _read_sql(self, sql: str, params: Mapping[str, Any], doing: str) -> list[dict[str, Any]]:
        """Run one of ``Reader``'s texts in a read transaction; the rows as dicts."""
        with self._tx(write=False, doing=doing) as conn:
            style = "named" if conn.dialect.name == "sqlite" else "pyformat"
            return [dict(m) for m in conn.exec_driver_sql(_for_driver(sql, style), dict(params)).mappings()]

    def count_opened_since(self, platform: str, sender_id: str, since: float, author_id: str | None = None) -> int:
        """Count this bot's rows opened (sent or being sent) at or after ``since``, optionally for one author (as
        the row's author or its origin)."""
        q = sa.select(sa.func.count()).select_from(REPLIES).where(*_opened_since(platform, sender_id, since, author_id))
        with self._tx(write=False, doing="counting recent replies") as conn:
            return int(conn.execute(q).scalar_one())

    def oldest_opened_since(self, platform: str, sender_id: str, since: float,
                            author_id: str | None = None) -> float | None:
        """The earliest ``opened_at`` of the rows ``count_opened_since`` counts, or None (when a cap has room)."""
        q = sa.select(sa.func.min(REPLIES.c.opened_at)).where(*_opened_since(platform, sender_id, since, author_id))
        with self._tx(write=False, doing="reading the oldest recent reply") as conn:
            return conn.execute(q).scalar()

    def last_event(self, key: Key, kinds: Sequence[str] | None = None) -> Event | None:
        """Return the newest event of ``key`` (of one of ``kinds`` when given), or None."""
        q = sa.select(EVENTS).where(
            EVENTS.c.platform == key.platform,
            EVENTS.c.sender_id == key.sender_id,
            EVENTS.c.parent_id == key.parent_id,
        )
        if kinds:
            q = q.where(EVENTS.c.kind.in_(list(kinds)))
        with self._tx(write=False, doing="reading the last event") as conn:
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
        with self._tx(write=False, doing="counting events") as conn:
            return int(conn.execute(q).scalar_one())

    def recent_events(self, limit: int = 50) -> list[Event]:
        """Return the newest events, newest first."""
        q = sa.select(EVENTS).order_by(EVENTS.c.id.desc()).limit(limit)
        with self._tx(write=False, doing="reading events") as conn:
            return [Event(**dict(m)) for m in conn.execute(q).mappings()]

    def reoffer_due(self, platform: str, sender_id: str, *, now: float, after: tuple[float, str] | None,
                    limit: int) -> list[Row]:
        """Return one page of a bot's rows that wait to be offered again, in (updated_at, parent_id) order.

        ``not_landed`` and ``released`` rows past their ``not_before``, ``composing`` rows whose lease has expired
        (their composer died: nothing was sent), and answers in ``parts`` (a post resumes them at their first part
        not closed). A part's own row is never offered: its answer's row is (``replyd.parts.PART_PATH``).
        ``after`` is the last row of the previous page. Re-find walks the whole set page by page across its
        runs, so rows that stay where they are cannot hide the ones behind them.

        Every re-find of every bot runs this, so it is named SQL run as it stands (``REOFFER_DUE``): building
        the statement with SQLAlchemy cost more CPU than the query.
        """
        params: dict[str, Any] = {"platform": platform, "sender_id": sender_id, "now": now, "limit": limit}
        if after is None:
            sql = REOFFER_DUE["first"]
        else:
            sql = REOFFER_DUE["after"]
            params.update(after_at=after[0], after_id=after[1])
        return [Row(**m) for m in self._read_sql(sql, params, "reading rows to offer again")]

    def senders_waiting(self, now: float) -> set[tuple[str, str]]:
        """The (platform, sender id) of every bot with a row ``reoffer_due`` would return: one query for all bots."""
        q = sa.select(REPLIES.c.platform, REPLIES.c.sender_id).where(_waiting(now)).distinct()
        with self._tx(write=False, doing="finding bots with rows to offer again") as conn:
            return {(p, s) for p, s in conn.execute(q)}

    def senders_due(self, now: float) -> set[tuple[str, str]]:
        """The (platform, sender id) of every bot with a row ``lease_due`` would lease: one query for all bots."""
        c = REPLIES.c
        q = (sa.select(c.platform, c.sender_id)
             .where(c.state.in_(SWEPT), c.deadline_at <= now, sa.or_(c.lease_until.is_(None), c.lease_until < now))
             .distinct())
        with self._tx(write=False, doing="finding bots with due rows") as conn:
            return {(p, s) for p, s in conn.execute(q)}

    def rows_in(self, platform: str, sender_id: str, states: Sequence[str], limit: int = 500, *,
                since: float | None = None) -> list[Row]:
        """Return rows of one bot in the given states, changed at or after ``since`` (oldest update first)."""
        q = sa.select(REPLIES).where(
            REPLIES.c.platform == platform,
            REPLIES.c.sender_id == sender_id,
            REPLIES.c.state.in_(list(states)),
        )
        if since is not None:
            q = q.where(REPLIES.c.updated_at >= since)
        q = q.order_by(REPLIES.c.updated_at, REPLIES.c.parent_id).limit(limit)
        with self._tx(write=False, doing="reading rows") as conn:
            return [Row(**dict(m)) for m in conn.execute(q).mappings()]

    # -- sweep leases --------------------------------------------------------------

    def lease_due(self, platform: str, sender_id: str, *, now: float, limit: int, lease_s: float, owner: str) -> list[Row]:
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
        q = self._lock_due(q)
        with self._tx(relaxed=True, doing="leasing due rows") as conn:
            rows = [Row(**dict(m)) for m in conn.execute(q).mappings()]
            leased = []
            for r in rows:
                stmt = (sa.update(REPLIES)
                        .where(key_where(Key(r.platform, r.sender_id, r.parent_id)), REPLIES.c.state == r.state,
                               REPLIES.c.attempt == r.attempt, free)
                        .values(lease_owner=owner, lease_until=now + lease_s))
                if conn.execute(stmt).rowcount == 1:
                    r.lease_owner, r.lease_until = owner, now + lease_s
                    leased.append(r)
            return leased

    def renew_leases(self, keys: Sequence[Key], *, owner: str, now: float, until: float) -> int:
        """Move to ``until`` the sweep leases on ``keys`` that ``owner`` still holds at ``now``; how many it held.

        A row decided since (its lease dropped), or leased by another sweeper after this one's ran out, is left
        as it is: the renewal never takes a lease back, it only keeps a live one alive through a long pass. Nor
        does it shorten one: a renewal whose write was delayed past a later one (a stalled thread) leaves the
        later end, so a live pass's row never looks free to another sweeper.
        """
        # case rather than max()/GREATEST(): one expression both dialects take.
        later = sa.case((REPLIES.c.lease_until > until, REPLIES.c.lease_until), else_=until)
        by_bot: dict[tuple[str, str], list[str]] = {}
        for k in keys:  # one statement per bot (a pass's rows are one bot's)
            by_bot.setdefault((k.platform, k.sender_id), []).append(k.parent_id)
        held = 0
        with self._tx(relaxed=True, doing="renewing sweep leases") as conn:
            for (platform, sender_id), parents in by_bot.items():
                for i in range(0, len(parents), 500):  # SQLite's bound-parameter limit, with room to spare
                    stmt = (sa.update(REPLIES)
                            .where(REPLIES.c.platform == platform, REPLIES.c.sender_id == sender_id,
                                   REPLIES.c.parent_id.in_(parents[i:i + 500]), REPLIES.c.lease_owner == owner,
                                   REPLIES.c.lease_until >= now)
                            .values(lease_until=later))
                    held += conn.execute(stmt).rowcount
        return held

    # -- cursors -------------------------------------------------------------------

    def get_cursor(self, platform: str, sender_id: str, name: str) -> str | None:
        """Return a poller's saved position, or None."""
        q = sa.select(CURSORS.c.value).where(
            CURSORS.c.platform == platform, CURSORS.c.sender_id == sender_id, CURSORS.c.name == name
        )
        with self._tx(write=False, doing="reading a cursor") as conn:
            return conn.execute(q).scalar_one_or_none()

    def set_cursor(self, platform: str, sender_id: str, name: str, value: str) -> None:
        """Save a poller's position (insert or replace)."""
        with self._tx(relaxed=True, doing="saving a cursor") as conn:
            conn.execute(self._cursor_upsert, {"platform": platform, "sender_id": sender_id, "name": name,
                                               "value": value, "updated_at": self.clock.now()})

    @functools.cached_property
    def _cursor_upsert(self) -> Any:
        """``set_cursor``'s upsert, built once with bound parameters (as ``_answer_upsert``): built with its values
        on every call, SQLAlchemy walked a fresh cache key each time (side by side on SQLite, 1,800 saves each:
        190 µs a save built per call, 93 µs prepared)."""
        ins = self._insert(CURSORS)
        stmt = ins.values({c: sa.bindparam(c) for c in ("platform", "sender_id", "name", "value", "updated_at")})
        return stmt.on_conflict_do_update(index_elements=["platform", "sender_id", "name"],
                                          set_={"value": ins.excluded.value, "updated_at": ins.excluded.updated_at})

    # -- listing lag (replyd.lag) ----------------------------------------------------


    def lag_prune(self, platform: str, before: float) -> None:
        """Forget ``platform``'s samples sent before ``before`` (complete or not)."""
        c = LISTING_LAG.c
        with self._tx(relaxed=True, doing="pruning listing lag") as conn:
            conn.execute(sa.delete(LISTING_LAG).where(c.platform == platform, c.sent_at < before))

    def set_listing_delay(self, platform: str, configured_s: float, in_use_s: float) -> None:
        """Record the listing delay ``platform`` uses now (insert or replace)."""
        now = self.clock.now()
        vals = {"configured_s": configured_s, "in_use_s": in_use_s, "updated_at": now}
        stmt = self._insert(LISTING_DELAY).values(platform=platform, **vals)
        stmt = stmt.on_conflict_do_update(index_elements=["platform"], set_=vals)
        with self._tx(relaxed=True, doing="saving the listing delay") as conn:
            conn.execute(stmt)

    # -- reading the log (library, API, liveness) --------------------------------------

    def answers_since(self, since: float, limit: int = 20_000) -> list[tuple[float, float | None]]:
        """Each answer closed at or after ``since`` (``ANSWERED_EVENTS``): (close time, its row's created_at).

        One range of ``ix_events_kind_at``, each event joined to its row by primary key; at most ``limit``.
        """
        e, r = EVENTS, REPLIES
        join = e.outerjoin(r, sa.and_(e.c.platform == r.c.platform, e.c.sender_id == r.c.sender_id,
                                      e.c.parent_id == r.c.parent_id))
        q = (sa.select(e.c.at, r.c.created_at).select_from(join)
             .where(e.c.kind.in_(ANSWERED_EVENTS), e.c.at >= since, e.c.state == CLOSED).limit(limit))
        with self._tx(write=False, doing="reading recent answers") as conn:
            return [(float(at), created) for at, created in conn.execute(q)]

    def decidable(self, states: Sequence[str], limit: int = 20) -> list[Row]:
        """Rows in ``states`` (those an operator decides on), the most recently changed first."""
        q = (sa.select(REPLIES).where(REPLIES.c.state.in_(list(states)), REPLIES.c.path != PART_PATH)
             .order_by(REPLIES.c.updated_at.desc(), REPLIES.c.parent_id).limit(limit))
        with self._tx(write=False, doing="reading rows waiting for a decision") as conn:
            return [Row(**dict(m)) for m in conn.execute(q).mappings()]

    def export_rows(self, table: str, *, since: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield every row of ``replies`` (by creation) or ``events`` (by id) as a dict, changed at or after ``since``."""
        t = {"replies": REPLIES, "events": EVENTS}[table]
        q = sa.select(t)
        if table == "events":
            q = q.order_by(t.c.id)
            if since is not None:
                q = q.where(t.c.at >= since)
        else:
            q = q.order_by(t.c.created_at, t.c.platform, t.c.sender_id, t.c.parent_id)
            if since is not None:
                q = q.where(t.c.updated_at >= since)
        with self._tx(write=False, doing=f"exporting {table}") as conn:
            for m in conn.execute(q).mappings():
                yield dict(m)

    def oldest_due_open(self, platform: str, sender_id: str, now: float) -> float | None:
        """Return the deadline of the bot's oldest open row past its deadline (None when none is due)."""
        r = REPLIES.c
        q = sa.select(sa.func.min(r.deadline_at)).where(
            r.state == OPEN, r.platform == platform, r.sender_id == sender_id, r.deadline_at <= now)
        with self._tx(write=False, doing="reading the oldest due open row") as conn:
            return conn.execute(q).scalar()
