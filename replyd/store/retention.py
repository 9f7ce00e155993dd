"""Pruning the answered-log: what ``replyd prune`` may delete, in short batches, and what it never deletes.

The log grows with every parent and every event. Two things may go:

- events older than a window, of keys whose story is over (their row is done, or they never had one);
- done rows of a bot whose parents are too old to be answered again (``policy.max_age_s`` plus a margin).

A row is "done" when it is ``skipped``, ``declined`` or ``rejected``, or ``closed`` with its verifying look
behind it (``deadline_at`` is null), and no sweeper holds it. Everything else stays: rows a path or the sweep may still
move (``composing``, ``open``, ``released``, ``not_landed``, ``parts``), ``gave_up`` rows that get later looks,
and ``unconfirmed`` rows an operator must resolve. A row is deleted only when its snapshot carries the parent's
platform time and that time is older than the cutoff: the policy then skips the parent as ``too_old`` if a
path finds it again. Cursors and the listing-lag records are never pruned here.

Each batch (1,000 keys) is one short transaction, so a daemon sharing the store waits milliseconds, never seconds.
Every delete repeats the conditions its select used: a row that moved on in between stays.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from replyd.store.model import CLOSED, DECLINED, REJECTED, SKIPPED, Key
from replyd.store.schema import ANSWERS, EVENTS, REPLIES

# Row states whose story is over: closed once its verifying look is done; the others at once (no sweep looks).
DONE = (CLOSED, SKIPPED, DECLINED, REJECTED)
UNSWEPT_DONE = (SKIPPED, DECLINED, REJECTED)


def _finished(c: Any) -> Any:
    """A row whose story is over: done, and (for a state the sweep looks at) no look pending."""
    return sa.or_(sa.and_(c.state == CLOSED, c.deadline_at.is_(None)), c.state.in_(UNSWEPT_DONE))


def _done(before: float) -> Any:
    """Rows that are done and untouched since ``before``."""
    c = REPLIES.c
    return sa.and_(_finished(c), c.lease_owner.is_(None), c.updated_at < before, c.created_at < before)


def _chunks(ids: Sequence[str], size: int = 200) -> list[Sequence[str]]:
    """``ids`` in slices of ``size``."""
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def parent_time(snapshot: str | None) -> float | None:
    """The parent's platform time from a row's snapshot (None when the snapshot has none)."""
    try:
        t = json.loads(snapshot or "{}").get("created_at")
    except (ValueError, AttributeError):
        return None
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


class Retention:
    """The prune half of the store (mixed into ``Store``)."""

    def _tx(self, *, write: bool = True, relaxed: bool = False,
            doing: str = "writing") -> AbstractContextManager[Connection]:
        """A transaction (``Store._tx``)."""
        raise NotImplementedError

    def refresh_statistics(self) -> None:
        """Let the database re-read the log's statistics before a prune (``ANALYZE``; SQLite's planner needs none).

        After a bulk import the planner may think the log is a few rows: each batch's delete then read every event
        of the bot (measured on a loaded machine: 27,000 of 700,000 rows pruned in 40 minutes, the rest in a minute
        once analysed). ``ANALYZE`` reads a sample and takes about a second on 2,000,000 events."""
        if getattr(self, "backend", "") != "postgresql":
            return
        with self._tx(doing="refreshing the planner's statistics") as conn:
            conn.exec_driver_sql("ANALYZE replies")
            conn.exec_driver_sql("ANALYZE events")

    def _old_events(self, before: float) -> Any:
        """Events older than ``before`` whose key has no row, or a done row."""
        e, r = EVENTS.c, REPLIES.c
        live = sa.select(sa.literal(1)).where(r.platform == e.platform, r.sender_id == e.sender_id,
                                              r.parent_id == e.parent_id,
                                              sa.not_(_finished(r)))
        return sa.and_(e.at < before, ~sa.exists(live))

    def count_old_events(self, before: float) -> int:
        """How many events ``prune_events`` would delete."""
        q = sa.select(sa.func.count()).select_from(EVENTS).where(self._old_events(before))
        with self._tx(write=False, doing="counting old events") as conn:
            return int(conn.execute(q).scalar_one())

    def prune_events(self, before: float, *, batch: int = 1000) -> int:
        """Delete one batch of old events of finished keys; return how many went (0: nothing is left)."""
        ids = sa.select(EVENTS.c.id).where(self._old_events(before)).order_by(EVENTS.c.id).limit(batch)
        with self._tx(relaxed=True, doing="pruning events") as conn:
            return int(conn.execute(sa.delete(EVENTS).where(EVENTS.c.id.in_(ids.scalar_subquery()))).rowcount or 0)

    def done_rows(self, platform: str, sender_id: str, *, before: float, after: str | None,
                  limit: int) -> list[tuple[str, str]]:
        """(parent id, snapshot) of this bot's done rows untouched since ``before``, by parent id after ``after``."""
        c = REPLIES.c
        q = sa.select(c.parent_id, c.snapshot).where(c.platform == platform, c.sender_id == sender_id, _done(before))
        if after is not None:
            q = q.where(c.parent_id > after)
        with self._tx(write=False, doing="listing old rows") as conn:
            return [(p, s) for p, s in conn.execute(q.order_by(c.parent_id).limit(limit))]

    def delete_done(self, keys: Sequence[Key], *, before: float) -> int:
        """Delete these done rows (each still done and untouched since ``before``) with their events and answers."""
        if not keys:
            return 0
        platform, sender = keys[0].platform, keys[0].sender_id
        assert all(k.platform == platform and k.sender_id == sender for k in keys), "one bot per batch"
        ids = [k.parent_id for k in keys]
        c = REPLIES.c
        gone: list[str] = []
        with self._tx(relaxed=True, doing="pruning rows") as conn:
            # Short IN lists: a long one makes PostgreSQL scan the whole table instead of using the key's index.
            for chunk in _chunks(ids):
                gone += [p for (p,) in conn.execute(
                    sa.delete(REPLIES).where(c.platform == platform, c.sender_id == sender, c.parent_id.in_(chunk),
                                             _done(before)).returning(c.parent_id))]
            for chunk in _chunks(gone):
                for table in (EVENTS, ANSWERS):
                    t = table.c
                    conn.execute(sa.delete(table).where(t.platform == platform, t.sender_id == sender,
                                                        t.parent_id.in_(chunk)))
            return len(gone)


def prune(store: Any, bots: Sequence[tuple[str, str, float]], *, events_before: float | None, dry_run: bool = False,
          batch: int = 1000) -> dict[str, Any]:
    """Prune ``store``: each bot's done rows older than its cutoff, then old events; what went and what stayed.

    ``bots``: (platform, sender id, cutoff) for each bot whose parents older than the cutoff are never answered
    (its ``policy.max_age_s`` plus a margin before now). ``events_before``: None keeps every event.
    ``dry_run`` counts and deletes nothing.
    """
    report: dict[str, Any] = {"dry_run": dry_run, "rows": [], "events": 0}
    store.refresh_statistics()
    for platform, sender, before in bots:
        deleted = kept = 0
        after: str | None = None
        while True:
            page = store.done_rows(platform, sender, before=before, after=after, limit=batch)
            if not page:
                break
            after = page[-1][0]
            old = [Key(platform, sender, p) for p, snap in page if (t := parent_time(snap)) is not None and t < before]
            kept += len(page) - len(old)
            deleted += len(old) if dry_run else store.delete_done(old, before=before)
        report["rows"].append({"platform": platform, "sender_id": sender, "before": before, "deleted": deleted,
                               "kept_no_platform_time": kept})
    if events_before is not None:
        if dry_run:
            report["events"] = store.count_old_events(events_before)
        else:
            while n := store.prune_events(events_before, batch=batch):
                report["events"] += n
    return report
