"""The sweep: every open row gets a bound.

After a row's deadline (send timeout + the platform's listing delay) the sweep
leases it, reads back the bot's own replies through the adapter (batched: one
own-feed read covers many rows) and decides:

- found           -> closed with the (oldest) own reply id;
- more than one   -> closed, plus a ``duplicate_detected`` event (and, with
                     ``on_duplicate = "delete_newer"``, the newer ones deleted);
- checked, none   -> ``not_landed`` (one more attempt allowed) or ``gave_up``;
- not checked     -> still open; swept again after a back-off.

A row closed by a retry (attempt 2) keeps a deadline: once the listing delay
has passed, one verifying read-back counts a late-landing first reply as a
duplicate (the measured limit when the real delay exceeds the configured one).

A failed read-back is never "not found".
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import sqlalchemy as sa
import structlog

from replyd import metrics
from replyd import store as st
from replyd.clock import Clock, SystemClock
from replyd.platform import Identity, Parent, Pending, Platform, ReadBack
from replyd.store import Key, Reply, Store

log = structlog.get_logger("replyd.sweep")


@dataclass
class SweepResult:
    """Counts from one sweep pass."""

    leased: int = 0
    closed: int = 0
    not_landed: int = 0
    gave_up: int = 0
    left_open: int = 0
    duplicates: int = 0
    readback_errors: int = 0
    verified: int = 0
    by_platform: Counter[str] = field(default_factory=Counter)

    def add(self, other: SweepResult) -> None:
        """Accumulate another pass's counts."""
        for name in ("leased", "closed", "not_landed", "gave_up", "left_open", "duplicates", "readback_errors", "verified"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.by_platform.update(other.by_platform)


@dataclass
class Bot:
    """One swept account: an adapter and the identity it posts as."""

    platform: Platform
    identity: Identity


class Sweeper:
    """Bounds open rows of one or more bots by reading back their own replies."""

    def __init__(
        self,
        store: Store,
        bots: list[Bot],
        *,
        clock: Clock | None = None,
        owner: str | None = None,
        batch: int = 1000,
        lease_s: float = 120.0,
        retry_s: float = 60.0,
        max_attempts: int = 2,
        on_duplicate: str = "report",
    ) -> None:
        if on_duplicate not in ("report", "delete_newer"):
            raise ValueError(f"on_duplicate must be 'report' or 'delete_newer', not {on_duplicate!r}")
        self.store = store
        self.bots = bots
        self.clock = clock or store.clock or SystemClock()
        self.owner = owner or st.make_owner()
        self.batch = batch
        self.lease_s = lease_s
        self.retry_s = retry_s
        self.max_attempts = max_attempts
        self.on_duplicate = on_duplicate

    def run_once(self) -> SweepResult:
        """Sweep every bot's due rows until none is left (or only failing ones)."""
        total = SweepResult()
        for bot in self.bots:
            while True:
                r = self._pass(bot)
                total.add(r)
                # A short batch means the due set is drained; a failing read-back must not spin.
                if r.leased < self.batch or r.readback_errors or r.left_open:
                    break
        return total

    def _pass(self, bot: Bot) -> SweepResult:
        res = SweepResult()
        now = self.clock.now()
        rows = self.store.lease_due(
            bot.platform.instance, bot.identity.sender_id, now=now, limit=self.batch, lease_s=self.lease_s, owner=self.owner
        )
        res.leased = len(rows)
        if not rows:
            return res
        pending = [
            Pending(parent=Parent.from_snapshot(json.loads(r.snapshot or "{}") or {"id": r.parent_id, "author_id": ""}),
                    # The first claim, not this attempt's open: an earlier attempt may have landed late.
                    opened_at=min(r.created_at, r.opened_at or r.created_at), provider_key=r.provider_key)
            for r in rows
        ]
        try:
            rb = bot.platform.read_back(pending, sender_id=bot.identity.sender_id)
        except Exception as exc:  # any failure is "not looked", never "not found"
            metrics.platform_error(bot.platform.instance, "read_back", exc)
            log.warning("replyd.sweep.readback_failed", platform=bot.platform.instance, rows=len(rows), error=str(exc)[:300])
            res.readback_errors = 1
            rb = ReadBack()
        for r in rows:
            self._decide(bot, r, rb, now, res)
        res.by_platform[bot.platform.instance] += len(rows)
        metrics.sweep_pass(bot.platform.instance, res)
        log.info("replyd.sweep.passed", platform=bot.platform.instance, leased=res.leased, closed=res.closed,
                 not_landed=res.not_landed, gave_up=res.gave_up, left_open=res.left_open, duplicates=res.duplicates,
                 verified=res.verified)
        return res

    def _duplicates(self, conn, key: Key, r: Reply, mine: list, res: SweepResult) -> None:  # noqa: ANN001
        """Record more than one own reply to one parent (the caller deletes newer ones if configured)."""
        extra = [m.reply_id for m in mine[1:]]
        self.store.add_event(conn, key, "duplicate_detected", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                             detail={"kept": mine[0].reply_id, "newer": extra, "action": self.on_duplicate})
        res.duplicates += len(extra)
        log.error("replyd.sweep.duplicate_detected", parent_id=r.parent_id, kept=mine[0].reply_id, newer=extra)

    def _verify(self, conn, key: Key, r: Reply, mine: list, rb: ReadBack, now: float, res: SweepResult) -> None:  # noqa: ANN001
        """One read-back after a retry's close: count a late first reply as a duplicate, then stop looking."""
        lease = st.REPLIES.c.lease_owner == self.owner
        if r.parent_id not in rb.checked and not mine:
            values = {"deadline_at": now + self.retry_s, "lease_owner": None, "lease_until": None}
            self.store.cas(conn, key, states=[st.CLOSED], attempt=r.attempt, values=values, extra_where=lease)
            res.left_open += 1
            return
        values = {"deadline_at": None, "lease_owner": None, "lease_until": None}
        if len(mine) > 1 and self.on_duplicate == "delete_newer":
            values["reply_id"] = mine[0].reply_id  # the newer ones are about to be deleted
        if self.store.cas(conn, key, states=[st.CLOSED], attempt=r.attempt, values=values, extra_where=lease):
            self.store.add_event(conn, key, "verified", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                                 detail={"own_replies": len(mine)})
            res.verified += 1
            if len(mine) > 1:
                self._duplicates(conn, key, r, mine, res)

    def _decide(self, bot: Bot, r: Reply, rb: ReadBack, now: float, res: SweepResult) -> None:
        key = Key(r.platform, r.sender_id, r.parent_id)
        mine = rb.found.get(r.parent_id) or []
        lease = st.REPLIES.c.lease_owner == self.owner
        with self.store.tx(relaxed=True, doing="sweeping") as conn:
            if r.state == st.CLOSED:
                self._verify(conn, key, r, mine, rb, now, res)
            elif mine:
                first = mine[0]
                values = {"state": st.CLOSED, "reply_id": first.reply_id, "closed_at": now, "updated_at": now,
                          "deadline_at": None, "lease_owner": None, "lease_until": None}
                if self.store.cas(conn, key, states=[st.OPEN], attempt=r.attempt, values=values, extra_where=lease):
                    self.store.add_event(conn, key, "swept_found", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                                         detail={"reply_id": first.reply_id})
                    res.closed += 1
                if len(mine) > 1:
                    self._duplicates(conn, key, r, mine, res)
            elif r.parent_id in rb.checked:
                to = st.NOT_LANDED if r.attempt < self.max_attempts else st.GAVE_UP
                values = {"state": to, "updated_at": now, "lease_owner": None, "lease_until": None,
                          "error": "no own reply found after the listing delay"}
                # Still past its deadline: a send still running (Guard.watch_sends) pushes it on meanwhile,
                # and a row whose send may still land must not be judged.
                still_due = sa.and_(lease, st.REPLIES.c.deadline_at <= now)
                if self.store.cas(conn, key, states=[st.OPEN], attempt=r.attempt, values=values, extra_where=still_due):
                    self.store.add_event(conn, key, to, state=to, attempt=r.attempt, owner=self.owner)
                    if to == st.GAVE_UP:
                        res.gave_up += 1
                        log.error("replyd.sweep.gave_up", parent_id=r.parent_id, attempt=r.attempt)
                    else:
                        res.not_landed += 1
            else:
                # Not looked at conclusively: keep it open and look again later.
                values = {"deadline_at": now + self.retry_s, "lease_owner": None, "lease_until": None, "updated_at": now}
                if self.store.cas(conn, key, states=[st.OPEN], attempt=r.attempt, values=values, extra_where=lease):
                    self.store.add_event(conn, key, "swept_unknown", state=st.OPEN, attempt=r.attempt, owner=self.owner)
                res.left_open += 1
        if len(mine) > 1 and self.on_duplicate == "delete_newer":
            for extra in mine[1:]:
                try:
                    bot.platform.delete(extra.reply_id)
                    self.store.record(key, "duplicate_deleted", owner=self.owner, detail={"reply_id": extra.reply_id})
                except Exception as exc:
                    log.error("replyd.sweep.delete_failed", parent_id=r.parent_id, reply_id=extra.reply_id, error=str(exc)[:300])
