"""One write transaction of several steps: the same compare-and-set and events as the store's own, committed together."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from replyd.store.model import OPEN, REPLY_ID_EVENTS, Key, Row
from replyd.clock import Clock
from replyd.store.schema import EVENTS, LISTING_LAG, REPLIES, REPLY_SET
from replyd.transitions import NEW, allowed


class Dialect(Protocol):
    """What a transaction needs of its store: the dialect's statements and the clock (``Store`` has them)."""

    clock: Clock

    def _greatest(self, column: sa.ColumnElement[Any], value: float) -> sa.ColumnElement[Any]: ...

    def _insert(self, table: sa.Table) -> Any: ...

    def _answer_upsert(self) -> Any: ...


def key_where(key: Key) -> sa.ColumnElement[bool]:
    """The SQL condition selecting ``key``'s row."""
    c = REPLIES.c
    return sa.and_(c.platform == key.platform, c.sender_id == key.sender_id, c.parent_id == key.parent_id)


class Tx:
    """The steps of one ``Store.transaction()``: nothing is visible to others until all of them commit."""

    def __init__(self, store: Dialect, conn: Connection) -> None:
        self._store = store
        self._conn = conn

    def get(self, key: Key, *, hold: bool = False) -> Row | None:
        """Return ``key``'s row as this transaction sees it, or None; ``hold``: no other transaction may change
        it until this one ends (PostgreSQL ``FOR SHARE``; SQLite's write transaction already excludes writers)."""
        q = sa.select(REPLIES).where(key_where(key))
        if hold:
            q = q.with_for_update(read=True)
        m = self._conn.execute(q).mappings().first()
        return None if m is None else Row(**dict(m))

    def cas_event(self, key: Key, *, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  event: Mapping[str, Any] | None = None, otherwise: Mapping[str, Any] | None = None,
                  lease_owner: str | None = None, due_by: float | None = None,
                  deadline_at_least: float | None = None) -> bool:
        """``Store.cas_event`` inside this transaction; also ``due_by`` (the row's deadline is at or before it)
        and ``deadline_at_least`` (an open row keeps a later deadline, any other row gets this one)."""
        bad = set(values) - REPLY_SET
        if bad:
            raise ValueError(f"not columns of {REPLIES.name}: {sorted(bad)}")
        allowed(states, values.get("state"))
        c = REPLIES.c
        cond = [key_where(key), c.state.in_(list(states))]
        if attempt is not None:
            cond.append(c.attempt == attempt)
        if lease_owner is not None:
            cond.append(c.lease_owner == lease_owner)
        if due_by is not None:
            cond.append(c.deadline_at <= due_by)
        vals: dict[str, Any] = dict(values)
        if deadline_at_least is not None:
            at = deadline_at_least
            later = self._store._greatest(sa.func.coalesce(c.deadline_at, at), at)
            vals["deadline_at"] = sa.case((c.state == OPEN, later), else_=at)
        ok = self._conn.execute(sa.update(REPLIES).where(*cond).values(**vals)).rowcount == 1
        note = event if ok else otherwise
        if note is not None:
            self.append_event(key, note["kind"], state=note.get("state"), attempt=note.get("attempt"),
                              owner=note.get("owner"), detail=note.get("detail"), at=note.get("at"))
        return ok

    def insert_new(self, key: Key, values: Mapping[str, Any]) -> bool:
        """Insert the key's row unless it exists; True when this call created it."""
        allowed((NEW,), values.get("state"))
        stmt = (self._store._insert(REPLIES)
                .values(platform=key.platform, sender_id=key.sender_id, parent_id=key.parent_id, **values)
                .on_conflict_do_nothing(index_elements=["platform", "sender_id", "parent_id"])
                .returning(REPLIES.c.attempt))
        # RETURNING, not rowcount: psycopg reports -1 for INSERT … ON CONFLICT here.
        return self._conn.execute(stmt).first() is not None

    def append_event(self, key: Key, kind: str, *, state: str | None = None, attempt: int | None = None,
                     owner: str | None = None, detail: Mapping[str, Any] | None = None, at: float | None = None) -> None:
        """Append one event for ``key``."""
        self._conn.execute(sa.insert(EVENTS).values(
            at=self._store.clock.now() if at is None else at, platform=key.platform, sender_id=key.sender_id,
            parent_id=key.parent_id, kind=kind, state=state, attempt=attempt, owner=owner,
            detail=json.dumps(dict(detail or {}), sort_keys=True, default=str)))

    def put_answer(self, key: Key, parts: Sequence[str], *, at: float) -> None:
        """Store the parts of ``key``'s composed answer (a new composition replaces an earlier one)."""
        self._conn.execute(self._store._answer_upsert, {
            "platform": key.platform, "sender_id": key.sender_id, "parent_id": key.parent_id,
            "parts": json.dumps(list(parts)), "created_at": at})

    def has_event(self, key: Key, kind: str, attempt: int) -> bool:
        """True if ``key`` has an event of ``kind`` at ``attempt`` (e.g. the breaker's ``outage_send`` mark)."""
        e = EVENTS.c
        q = (sa.select(e.id).where(e.platform == key.platform, e.sender_id == key.sender_id,
                                   e.parent_id == key.parent_id, e.kind == kind, e.attempt == attempt).limit(1))
        return self._conn.execute(q).first() is not None

    def count_events(self, key: Key, kind: str) -> int:
        """How many events of ``kind`` ``key`` has (e.g. the sweep's ``proven_not_landed`` marks)."""
        e = EVENTS.c
        q = (sa.select(sa.func.count()).select_from(EVENTS)
             .where(e.platform == key.platform, e.sender_id == key.sender_id, e.parent_id == key.parent_id,
                    e.kind == kind))
        return int(self._conn.execute(q).scalar() or 0)

    def reply_id_events(self, key: Key) -> list[tuple[str, int | None, dict[str, Any]]]:
        """Return (kind, attempt, detail) of ``key``'s events that name own reply ids, a send that may have
        landed, or a verification, oldest first."""
        e = EVENTS.c
        q = (sa.select(e.kind, e.attempt, e.detail)
             .where(e.platform == key.platform, e.sender_id == key.sender_id, e.parent_id == key.parent_id,
                    e.kind.in_(REPLY_ID_EVENTS))
             .order_by(e.id))
        return [(k, a, json.loads(d or "{}")) for k, a, d in self._conn.execute(q)]

    def lag_look(self, platform: str, sender_id: str, reply_id: str, *, sent_at: float, age_s: float, listed: bool,
                 now: float) -> bool:
        """Note one read-back's look for an own reply sent at ``sent_at``: unlisted at ``age_s``, or listed.

        Only the first listing completes a sample; later looks change nothing. True when this call completed it.
        """
        c = LISTING_LAG.c
        base = {"platform": platform, "reply_id": reply_id, "sender_id": sender_id, "sent_at": sent_at}
        ins = self._store._insert(LISTING_LAG)
        if listed:
            stmt = ins.values(**base, lower_s=0.0, upper_s=age_s, seen_at=now).on_conflict_do_update(
                index_elements=["platform", "reply_id"], set_={"upper_s": age_s, "seen_at": now},
                where=c.upper_s.is_(None))
        else:
            stmt = ins.values(**base, lower_s=age_s).on_conflict_do_update(
                index_elements=["platform", "reply_id"], set_={"lower_s": self._store._greatest(c.lower_s, age_s)},
                where=c.upper_s.is_(None))
        done = self._conn.execute(stmt.returning(c.upper_s)).first()
        return bool(listed and done is not None)
