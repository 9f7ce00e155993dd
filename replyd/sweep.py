"""The sweep: every open row gets a bound, every close one verifying look, every judged row later looks.

After a row's deadline (send timeout + the listing delay in use, ``replyd.lag``) the sweep
leases it, reads back the bot's own replies through the adapter (batched: one
own-feed read covers many rows) and decides by the row's state:

open
    found -> closed with the (oldest) own reply id; checked, none -> ``not_landed`` (one more attempt
    allowed) or ``gave_up``, but only once the delay in use *now* has passed since the send (it may have
    grown since the deadline was set: then only the deadline moves); not checked -> still open, swept again
    after a back-off. Closed rows are decided first, so their looks count for the open rows of the pass.
closed (every close keeps a deadline)
    from the configured delay on, the reply the row closed with is looked for until a read-back lists it:
    its age then is a listing-lag sample (``replyd.lag``). Once the delay in use has passed since the close,
    one verification counts duplicates from the union of the reply ids replyd knows (the row's, earlier
    attempts' and late answers' from the events) and those read back: every one beyond the first is a
    ``duplicate_detected`` event and metric (and, with ``on_duplicate = "delete_newer"``, deleted).
not_landed / gave_up
    looked at again at ``reconcile_after`` multiples of the delay in use: an own reply found then closes
    the row as ``reconciled`` (reply id kept, verified like any close).

Every transition is a compare-and-set on (key, state, attempt) under the sweep's lease; its event is
written only when it succeeded. A failed read-back is never "not found".
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from replyd import metrics
from replyd import store as st
from replyd.breaker import Breaker
from replyd.clock import Clock, SystemClock
from replyd.config import GuardConfig, SweepConfig
from replyd.lag import ListingLag
from replyd.log import get_logger
from replyd.platforms.base import Identity, OwnReply, Parent, ParentReplies, Pending, Platform, ReadBack, reads_back
from replyd.store import Key, Reply, Store, Tx

log = get_logger("replyd.sweep")

UNACCOUNTED_LOOKS = 10.0  # a close with an attempt's reply unaccounted for is looked at until this x the delay


@dataclass
class SweepResult:
    """Counts from one sweep pass."""

    by_platform: Counter[str] = field(default_factory=Counter)  # rows leased per platform instance
    leased: int = 0
    closed: int = 0
    not_landed: int = 0
    gave_up: int = 0
    left_open: int = 0
    duplicates: int = 0
    readback_errors: int = 0
    verified: int = 0
    reconciled: int = 0
    waiting: int = 0  # looked at, given a later look (a close not yet verified, a judged row with no reply yet)
    verified_on_close: int = 0  # of ``verified``: closed by this pass's read-back, which was late enough to verify
    unconfirmed: int = 0  # open rows of a ``NoReadBack`` platform moved to ``unconfirmed`` (never retried on their own)
    # Leased rows that changed under the lease before the verdict committed (a late close, a re-find's claim of a
    # judged row, a running send's deadline pushed on): the other writer's change stands, this pass decides nothing.
    moved: int = 0

    def add(self, other: SweepResult) -> None:
        """Accumulate another pass's counts."""
        for name in ("leased", "closed", "not_landed", "gave_up", "left_open", "duplicates", "readback_errors", "verified",
                     "reconciled", "waiting", "verified_on_close", "unconfirmed", "moved"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.by_platform.update(other.by_platform)


@dataclass
class _Hold:
    """One pass's leased keys, renewed until the pass ends."""

    store: Store
    keys: list[Key]
    owner: str
    lease_s: float
    clock: Clock
    renew_at: float  # on the keeper's monotonic clock: when it renews next


class LeaseKeeper:
    """Keeps running sweep passes' leases alive: one thread for every sweeper of a process, only while a pass holds
    rows (it ends when none does).

    ``sweep.lease_s`` bounds how long a replica that dies mid-pass keeps its leased rows from the others, so it
    is short; a pass that runs longer (a slow read-back, a long page of rows) renews its leases every third of
    it instead. A renewal only keeps a live lease alive: a row decided meanwhile, or leased by another sweeper
    after this one's ran out (a renewal that failed for a whole lease), is left as it is; every verdict is a
    compare-and-set under the lease all the same.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic  # injected: tests make a renewal due without waiting for it
        self._cond = threading.Condition()
        self._holds: dict[int, _Hold] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.renewed = 0  # renewals that kept at least one lease (for tests)

    @contextmanager
    def holding(self, store: Store, keys: list[Key], *, owner: str, lease_s: float, clock: Clock) -> Iterator[None]:
        """Renew ``owner``'s leases on ``keys`` every third of ``lease_s`` until the block ends."""
        hold = _Hold(store, keys, owner, lease_s, clock, renew_at=self._monotonic() + lease_s / 3)
        with self._cond:
            hid = next(self._ids)
            self._holds[hid] = hold
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="replyd-sweep-leases", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                del self._holds[hid]
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._holds:
                    self._thread = None  # under the lock: the next hold starts a new thread
                    return
                wait_s = min(h.renew_at for h in self._holds.values()) - self._monotonic()
                if wait_s > 0:
                    self._cond.wait(None if wait_s == float("inf") else wait_s)
                    continue
            self.renew_due()

    def renew_due(self) -> None:
        """Renew every hold whose renewal is due (the keeper's thread does this; a test may call it)."""
        with self._cond:
            mono = self._monotonic()
            due = [h for h in self._holds.values() if h.renew_at <= mono]
        for h in due:  # outside the lock: a pass that ends meanwhile is not kept waiting on the store
            self._renew(h, mono)

    def _renew(self, h: _Hold, due_at: float) -> None:
        # The next renewal counts from when this one was found due, not from when its write returned: a slow
        # store does not stretch the period, and two callers (the thread, a test) never push each other's next
        # renewal past the time they found due.
        now = h.clock.now()
        try:
            held = h.store.renew_leases(h.keys, owner=h.owner, now=now, until=now + h.lease_s)
        except Exception as exc:  # the store is down: try again soon, the lease may still be saved
            log.warning("replyd.sweep.renew_failed", platform=h.keys[0].platform, owner=h.owner, rows=len(h.keys),
                        error=str(exc)[:300])
            with self._cond:
                h.renew_at = self._monotonic() + h.lease_s / 10  # a pause after the failure, not a busy retry
            return
        # Nothing held any more (every row decided): nothing to renew until the pass ends. Both under the lock
        # ``renew_due`` reads them under: a caller that finds this renewal done finds it counted.
        with self._cond:
            h.renew_at = due_at + (h.lease_s / 3 if held else float("inf"))
            if held:
                self.renewed += 1


KEEPER = LeaseKeeper()  # the process's one keeper; a Sweeper may be given its own


@dataclass
class Bot:
    """One swept account: an adapter and the identity it posts as."""

    platform: Platform
    identity: Identity
    lag: ListingLag | None = None  # the listing delay in use; the Sweeper makes one when not given
    breaker: Breaker | None = None  # the bot's write-path breaker in this process: a send it saw open is excused
    name: str = ""  # the bot's config name, for alert lines


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
        lease_s: float = 30.0,
        retry_s: float = 60.0,
        max_attempts: int = 2,
        on_duplicate: str = "report",
        config: SweepConfig | None = None,
        guard_config: GuardConfig | None = None,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        if on_duplicate not in ("report", "delete_newer"):
            raise ValueError(f"on_duplicate must be 'report' or 'delete_newer', not {on_duplicate!r}")
        self.store = store
        self.bots = bots
        self.clock = clock or store.clock or SystemClock()
        self.owner = owner or st.make_owner()
        self.batch = batch
        self.lease_s = lease_s
        self.keeper = keeper or KEEPER  # renews this sweeper's leases while a pass runs
        self.retry_s = retry_s
        self.max_attempts = max_attempts
        self.on_duplicate = on_duplicate
        self.cfg = config or SweepConfig()
        self.guard_cfg = guard_config or GuardConfig()  # the retry horizon and back-off of excused attempts
        for bot in bots:
            if bot.lag is None:
                bot.lag = ListingLag(store, bot.platform.instance, bot.platform.listing_delay_s, self.cfg,
                                     clock=self.clock)

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
        # Held while the pass runs: a replica that dies here leaves its rows to the others after one short lease.
        with self.keeper.holding(self.store, [Key(r.platform, r.sender_id, r.parent_id) for r in rows],
                                 owner=self.owner, lease_s=self.lease_s, clock=self.clock):
            return self._judge(bot, rows, now, res)

    def _judge(self, bot: Bot, rows: list[Reply], now: float, res: SweepResult) -> SweepResult:
        """Read back and decide the rows this pass leased."""
        if not reads_back(bot.platform):
            return self._no_read_back(bot, rows, now, res)
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
        # Read once per pass, outside the rows' transactions (a refresh reads and writes the store).
        delay_s = bot.lag.refresh_if_due() if bot.lag is not None else bot.platform.listing_delay_s
        verify_s = bot.lag.verify_delay_s() if bot.lag is not None else delay_s
        looked: set[str] = set()  # parents whose own replies were read this pass (the second read)
        # What each row's send answered (its snapshot): its key's parent, or for a part of an answer in several
        # parts (replyd.parts) the part before it. The read-back is asked about that, its answer keyed by row.
        targets = {r.parent_id: p.parent.id for r, p in zip(rows, pending, strict=True)}
        if not res.readback_errors:  # a platform failing its listings gets no second round of reads this pass
            rb, looked = self._parent_look(bot, rows, pending, rb, now, verify_s, targets)
        rb, looked = _by_row(rb, looked, targets)
        # Closed rows first: their looks may prove a longer lag (the warm-up) before an open row is judged.
        for r in sorted(rows, key=lambda r: r.state != st.CLOSED):
            self._decide(bot, r, rb, now, delay_s, verify_s, res, proven=r.parent_id in looked)
        res.by_platform[bot.platform.instance] += len(rows)
        metrics.sweep_pass(bot.platform.instance, res)
        log.info("replyd.sweep.passed", platform=bot.platform.instance, leased=res.leased, closed=res.closed,
                 not_landed=res.not_landed, gave_up=res.gave_up, left_open=res.left_open, duplicates=res.duplicates,
                 verified=res.verified, reconciled=res.reconciled, waiting=res.waiting,
                 verified_on_close=res.verified_on_close, moved=res.moved, leased_at=now)
        return res

    def _no_read_back(self, bot: Bot, rows: list[Reply], now: float, res: SweepResult) -> SweepResult:
        """A ``NoReadBack`` platform: nothing can be read back, so nothing is judged "not found" and retried.

        An open row past its deadline (its send's fate unknown: a lost response, a 5xx, a crash mid-send) moves to
        ``unconfirmed`` for an operator; any other leased row (a close, which cannot be verified) loses its
        deadline. The compare-and-set keeps a row whose send still runs (``Guard.watch_sends`` moves its deadline).
        """
        for r in rows:
            key = Key(r.platform, r.sender_id, r.parent_id)
            with self.store.transaction(relaxed=True, doing="sweeping") as tx:
                if r.state != st.OPEN:
                    if tx.cas_event(key, states=[r.state], attempt=r.attempt, lease_owner=self.owner,
                                    values={"deadline_at": None, "lease_owner": None, "lease_until": None}):
                        res.waiting += 1  # nothing to look at again: its deadline is dropped
                    else:
                        self._moved(bot, r, now, res)
                    continue
                why = "the send may have landed and this platform cannot list the bot's replies"
                values = {"state": st.UNCONFIRMED, "updated_at": now, "deadline_at": None, "lease_owner": None,
                          "lease_until": None, "error": why}
                if not tx.cas_event(key, states=[st.OPEN], attempt=r.attempt, values=values, lease_owner=self.owner,
                                    due_by=now):
                    self._moved(bot, r, now, res)
                    continue
                maybe = tx.has_event(key, "maybe_sent", r.attempt)
                tx.append_event(key, st.UNCONFIRMED, state=st.UNCONFIRMED, attempt=r.attempt, owner=self.owner,
                                detail={"maybe_sent": maybe})
            res.unconfirmed += 1
            log.error("replyd.reply.unconfirmed", bot=bot.name, platform=bot.platform.instance, parent_id=r.parent_id,
                      attempt=r.attempt, maybe_sent=maybe,
                      resolve="replyd rearm (send again) or replyd confirm (mark answered)")
        res.by_platform[bot.platform.instance] += len(rows)
        metrics.sweep_pass(bot.platform.instance, res)
        log.info("replyd.sweep.passed", platform=bot.platform.instance, leased=res.leased, unconfirmed=res.unconfirmed,
                 waiting=res.waiting, moved=res.moved, leased_at=now)
        return res

    def _parent_look(self, bot: Bot, rows: list[Reply], pending: list[Pending], rb: ReadBack, now: float,
                     verify_s: float, targets: dict[str, str]) -> tuple[ReadBack, set[str]]:
        """Rows that needed a retry: read each one's parent by itself (``ParentReplies``), not through the walk.

        A retry exists because a read-back missed the first attempt's reply (or it landed late); the batched
        walk that missed it may miss it again, and then the verification would see one reply and be satisfied.
        So a retried row, once it is due to be verified (closed for the delay in use) or judged (open), is
        decided on the union of both reads, and is checked only when its parent's own listing was read.
        Also returns the parents so read (two reads that agree: a not-landed proof strong enough to excuse).
        """
        if not isinstance(bot.platform, ParentReplies):
            return rb, set()
        due = {targets[r.parent_id] for r in rows if r.attempt > 1 and (
            r.state == st.OPEN or (r.state == st.CLOSED and now >= (r.closed_at or now) + verify_s))}
        if not due:
            return rb, set()
        try:
            second = bot.platform.read_parents([p for p in pending if p.parent.id in due],
                                               sender_id=bot.identity.sender_id)
        except Exception as exc:  # not looked: these rows wait for the next pass, never "not found"
            metrics.platform_error(bot.platform.instance, "read_back", exc)
            log.warning("replyd.sweep.parent_look_failed", platform=bot.platform.instance, rows=len(due),
                        error=str(exc)[:300])
            second = ReadBack()
        found = dict(rb.found)
        for pid in due:
            merged: dict[str, OwnReply] = {m.reply_id: m for m in [*rb.found.get(pid, []), *second.found.get(pid, [])]}
            if merged:
                found[pid] = sorted(merged.values(), key=lambda m: m.created_at or 0.0)
            else:
                found.pop(pid, None)
        return ReadBack(found=found, checked=(rb.checked - due) | (second.checked & due)), second.checked & due

    def _duplicates(self, tx: Tx, key: Key, r: Reply, kept: str, newer: list[str], res: SweepResult) -> list[str]:
        """Record own replies beyond the first to one parent; return the ids to delete (if configured)."""
        if not newer:
            return []
        tx.append_event(key, "duplicate_detected", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                        detail={"kept": kept, "newer": newer, "action": self.on_duplicate})
        res.duplicates += len(newer)
        log.error("replyd.sweep.duplicate_detected", platform=key.platform, parent_id=r.parent_id, kept=kept,
                  newer=newer)
        return newer if self.on_duplicate == "delete_newer" else []

    def _verify(self, tx: Tx, bot: Bot, key: Key, r: Reply, mine: list, rb: ReadBack, now: float,
                delay_s: float, res: SweepResult, basis: float | None = None) -> list[str]:
        """A closed row: measure its reply's listing lag, then (once, after the delay in use) count duplicates.

        ``basis``: when the last send that can have made an unseen reply started (default: the close).
        """
        assert bot.lag is not None
        checked = r.parent_id in rb.checked
        if not checked and not mine:
            values = {"deadline_at": now + self.retry_s, "lease_owner": None, "lease_until": None}
            if tx.cas_event(key, states=[st.CLOSED], attempt=r.attempt, values=values, lease_owner=self.owner):
                res.left_open += 1
            else:
                self._moved(bot, r, now, res)
            return []
        events = tx.reply_id_events(key)
        listed = [m.reply_id for m in mine]
        own, closed_at = r.reply_id, r.closed_at if r.closed_at is not None else now
        own_listed = own in listed
        # A lag sample needs the send time: only a reply the guard closed the row with from the send's response.
        if own and any(k == "closed" and d.get("reply_id") == own for k, _, d in events):
            bot.lag.look(tx, r.sender_id, own, sent_at=closed_at, now=now, listed=own_listed)
        known = _known_ids(events, own)
        deleted = {d.get("reply_id") for k, _, d in events if k == "duplicate_deleted"}
        every = [i for i in dict.fromkeys([*listed, *known]) if i and i not in deleted]
        # Attempts whose send may have made a reply: fewer replies seen than that, one may still be unlisted.
        sent = {a for k, a, _ in events if k in ("closed", "late_landing", "maybe_sent", "late_maybe_sent")}
        unaccounted = len(every) + len(deleted) < len(sent)
        due = (closed_at if basis is None else basis) + delay_s
        give_up_at = closed_at + self.cfg.listing_delay_max_s
        waiting_own = bool(own) and not own_listed and now < give_up_at
        if now < due or waiting_own:
            # Not yet: at the delay in use, and meanwhile every step until our own reply is listed (its lag).
            nxt = (min(due, now + bot.lag.step_s()) if now < due else now + bot.lag.step_s()) if waiting_own else due
            values = {"deadline_at": nxt, "lease_owner": None, "lease_until": None}
            if tx.cas_event(key, states=[st.CLOSED], attempt=r.attempt, values=values, lease_owner=self.owner):
                res.waiting += 1
            else:
                self._moved(bot, r, now, res)
            return []
        reported = {i for k, _, d in events if k == "duplicate_detected" for i in [d.get("kept"), *d.get("newer", [])]}
        kept = listed[0] if listed else own
        newer = [i for i in every if i != kept and i not in reported]
        # While an attempt's reply is unaccounted for, look again at doubling ages, up to ten times the delay
        # (a reply that lists later than that is the reconciling looks' case; the feed read stays short).
        horizon = closed_at + min(self.cfg.listing_delay_max_s, UNACCOUNTED_LOOKS * max(delay_s, bot.lag.step_s()))
        nxt = (min(horizon, closed_at + 2 * max(now - closed_at, bot.lag.step_s()))
               if unaccounted and now < horizon else None)
        values = {"deadline_at": nxt, "lease_owner": None, "lease_until": None}
        if newer and self.on_duplicate == "delete_newer" and kept and kept != own:
            values["reply_id"] = kept  # the newer ones are about to be deleted
        if not tx.cas_event(key, states=[st.CLOSED], attempt=r.attempt, values=values, lease_owner=self.owner):
            self._moved(bot, r, now, res)
            return []
        if not any(k == "verified" and a == r.attempt for k, a, _ in events):
            tx.append_event(key, "verified", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                            detail={"own_replies": len(listed), "known": len(every)})
            res.verified += 1
        else:
            res.waiting += 1  # a later look for an unaccounted attempt's reply
        return self._duplicates(tx, key, r, kept or "", newer, res)

    def _not_landed(self, tx: Tx, bot: Bot, key: Key, r: Reply, now: float,
                    proven: bool = False) -> tuple[str, dict, dict]:
        """The verdict on an open row whose send is proven not landed: (state, row values, event detail).

        A send an outage swallowed (marked ``outage_send`` by a guard's breaker, or made while this process's
        breaker was open) is excused: it spends no attempt; the parent is retried after a back-off (doubling
        per excused attempt) until ``retry_horizon_s`` after its first claim. So is a retry's send ``proven``
        not landed by two reads (the walk and the parent's own replies, after the delay in use), up to
        ``guard.max_proven_retries`` per parent: the weather below the breaker's threshold (one 500 here and
        there) spends no attempt either. Other sends count against ``max_attempts`` as before: the first
        attempt's proof is the walk's alone, and a platform whose parent listing lags past the delay makes
        every proof wrong, so past the bound its sends count again (at most that many duplicates per parent,
        each one counted by the verification's union of known reply ids).
        """
        sent_at = r.opened_at or r.created_at
        excused = r.excused or 0
        swallowed = tx.has_event(key, "outage_send", r.attempt) or (
            bot.breaker is not None and bot.breaker.open_during(sent_at, now))
        why = "outage"
        if (not swallowed and proven and self.guard_cfg.max_proven_retries > 0
                and not tx.has_event(key, "excused", r.attempt)
                and tx.count_events(key, "proven_not_landed") < self.guard_cfg.max_proven_retries):
            swallowed, why = True, "proven"
            tx.append_event(key, "proven_not_landed", state=None, attempt=r.attempt, owner=self.owner)
        # Once per attempt (a late "maybe sent" can reopen the row at the same attempt for a second verdict).
        if swallowed and not tx.has_event(key, "excused", r.attempt):
            excused += 1
            tx.append_event(key, "excused", state=st.OPEN, attempt=r.attempt, owner=self.owner,
                            detail={"counted": r.attempt - excused, "why": why})
        counted = r.attempt - excused
        horizon_at = r.created_at + self.guard_cfg.retry_horizon_s
        note = {"counted": counted, "excused": excused}
        # The horizon bounds only the retries an outage excused; counted attempts keep their own bound.
        past_horizon = bool(excused) and now >= horizon_at
        if counted >= self.max_attempts or past_horizon:
            return st.GAVE_UP, {"excused": excused}, {**note, **({"horizon": True} if past_horizon else {})}
        retry: dict = {"excused": excused, "not_before": None}
        if excused:
            g = self.guard_cfg
            wait_s = min(g.retry_backoff_max_s, g.retry_backoff_s * 2.0 ** (excused - 1), horizon_at - now)
            retry["not_before"] = now + wait_s
            note["retry_after_s"] = round(wait_s, 3)
        return st.NOT_LANDED, retry, note

    def _moved(self, bot: Bot, r: Reply, leased_at: float, res: SweepResult) -> None:
        """A leased row changed under the lease before its verdict: count it and name it (the other change stands)."""
        res.moved += 1
        log.info("replyd.sweep.row_moved", bot=bot.name, platform=bot.platform.instance, parent_id=r.parent_id,
                 attempt=r.attempt, state=r.state, leased_at=leased_at, at=self.clock.now())

    @staticmethod
    def _judge_at(bot: Bot, r: Reply, delay_s: float) -> float:
        """The earliest an open row may be judged not found: the delay in use now after its send last moved."""
        now_s = max(delay_s, bot.lag.delay_s()) if bot.lag is not None else delay_s
        return max(r.opened_at or r.created_at, r.updated_at or 0.0) + now_s

    def _next_look(self, judged_at: float, now: float, delay_s: float) -> float | None:
        """When a ``not_landed`` / ``gave_up`` row judged at ``judged_at`` is looked at next (None: never)."""
        for m in self.cfg.reconcile_after:
            at = judged_at + min(m * delay_s, self.cfg.reconcile_max_s)
            if at > now:
                return at
        return None

    def _reconcile(self, tx: Tx, bot: Bot, key: Key, r: Reply, mine: list, rb: ReadBack, now: float,
                   delay_s: float, res: SweepResult) -> list[str]:
        """A judged row's later look: an own reply found now closes it as ``reconciled``."""
        if mine:
            first = mine[0].reply_id
            values = {"state": st.CLOSED, "reply_id": first, "closed_at": now, "updated_at": now, "error": None,
                      "deadline_at": now + delay_s, "lease_owner": None, "lease_until": None}
            # Re-find may have claimed a not_landed row meanwhile: then the state or attempt differs, nothing moves.
            if not tx.cas_event(key, states=[r.state], attempt=r.attempt, values=values, lease_owner=self.owner):
                self._moved(bot, r, now, res)
                return []
            tx.append_event(key, "reconciled", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                            detail={"reply_id": first, "from": r.state, "judged_s": round(now - r.updated_at, 3)})
            res.reconciled += 1
            log.warning("replyd.sweep.reconciled", platform=key.platform, parent_id=r.parent_id, reply_id=first,
                        previous=r.state)
            return self._duplicates(tx, key, r, first, [m.reply_id for m in mine[1:]], res)
        nxt = self._next_look(r.updated_at, now, delay_s) if r.parent_id in rb.checked else now + self.retry_s
        values = {"deadline_at": nxt, "lease_owner": None, "lease_until": None}
        if tx.cas_event(key, states=[r.state], attempt=r.attempt, values=values, lease_owner=self.owner):
            res.waiting += 1
        else:
            self._moved(bot, r, now, res)
        return []

    def _decide(self, bot: Bot, r: Reply, rb: ReadBack, now: float, delay_s: float, verify_s: float,
                res: SweepResult, *, proven: bool = False) -> None:
        key = Key(r.platform, r.sender_id, r.parent_id)
        mine = rb.found.get(r.parent_id) or []
        delete: list[str] = []
        with self.store.transaction(relaxed=True, doing="sweeping") as tx:
            if r.state == st.CLOSED:
                delete = self._verify(tx, bot, key, r, mine, rb, now, verify_s, res)
            elif r.state in (st.NOT_LANDED, st.GAVE_UP):
                delete = self._reconcile(tx, bot, key, r, mine, rb, now, delay_s, res)
            elif mine:
                first = mine[0]
                # Closed under our lease, which the verification below releases: this read-back came after the
                # delay in use since the attempt opened, so it verifies the close at once unless a reply is
                # unaccounted for (the same batched read, no second look).
                values = {"state": st.CLOSED, "reply_id": first.reply_id, "closed_at": now, "updated_at": now,
                          "deadline_at": now + verify_s}
                if tx.cas_event(key, states=[st.OPEN], attempt=r.attempt, values=values, lease_owner=self.owner):
                    tx.append_event(key, "swept_found", state=st.CLOSED, attempt=r.attempt, owner=self.owner,
                                    detail={"reply_id": first.reply_id})
                    res.closed += 1
                    closed = r.model_copy(update={k: v for k, v in values.items() if k != "deadline_at"})
                    waiting, verified, moved = res.waiting, res.verified, res.moved
                    delete = self._verify(tx, bot, key, closed, mine, rb, now, verify_s, res,
                                          basis=r.opened_at or r.created_at)
                    res.waiting, res.moved = waiting, moved  # counted as closed (this transaction holds the row)
                    res.verified_on_close += res.verified - verified
                else:
                    self._moved(bot, r, now, res)
            elif r.parent_id in rb.checked and now < (judge_at := self._judge_at(bot, r, delay_s)):
                # The delay in use grew since this row's deadline was set: not found yet proves nothing.
                values = {"deadline_at": judge_at, "lease_owner": None, "lease_until": None}
                if tx.cas_event(key, states=[st.OPEN], attempt=r.attempt, values=values, lease_owner=self.owner):
                    res.waiting += 1
                else:
                    self._moved(bot, r, now, res)
            elif r.parent_id in rb.checked:
                to, retry, note = self._not_landed(tx, bot, key, r, now, proven=proven)
                values = {"state": to, "updated_at": now, "lease_owner": None, "lease_until": None,
                          "error": "no own reply found after the listing delay",
                          "deadline_at": self._next_look(now, now, delay_s), **retry}
                # Still past its deadline: a send still running (Guard.watch_sends) pushes it on meanwhile,
                # and a row whose send may still land must not be judged.
                if tx.cas_event(key, states=[st.OPEN], attempt=r.attempt, values=values, lease_owner=self.owner,
                                due_by=now):
                    tx.append_event(key, to, state=to, attempt=r.attempt, owner=self.owner, detail=note)
                    if to == st.GAVE_UP:
                        res.gave_up += 1
                        log.error("replyd.sweep.gave_up", parent_id=r.parent_id, attempt=r.attempt)
                    else:
                        res.not_landed += 1
                else:
                    self._moved(bot, r, now, res)
            else:
                # Not looked at conclusively: keep it open and look again later.
                values = {"deadline_at": now + self.retry_s, "lease_owner": None, "lease_until": None, "updated_at": now}
                if tx.cas_event(key, states=[st.OPEN], attempt=r.attempt, values=values, lease_owner=self.owner):
                    tx.append_event(key, "swept_unknown", state=st.OPEN, attempt=r.attempt, owner=self.owner)
                    res.left_open += 1
                else:
                    self._moved(bot, r, now, res)
        for extra in delete:
            try:
                bot.platform.delete(extra)
                self.store.record(key, "duplicate_deleted", owner=self.owner, detail={"reply_id": extra})
            except Exception as exc:
                log.error("replyd.sweep.delete_failed", parent_id=r.parent_id, reply_id=extra, error=str(exc)[:300])


def _by_row(rb: ReadBack, looked: set[str], targets: dict[str, str]) -> tuple[ReadBack, set[str]]:
    """The read-back's answer (keyed by what each row's send answered) keyed by each row's own parent id."""
    if all(k == t for k, t in targets.items()):
        return rb, looked
    found = {pid: rb.found[t] for pid, t in targets.items() if t in rb.found}
    return (ReadBack(found=found, checked={pid for pid, t in targets.items() if t in rb.checked}),
            {pid for pid, t in targets.items() if t in looked})


def _known_ids(events: list[tuple[str, int | None, dict]], own: str | None) -> list[str]:
    """Own reply ids the events name as really made (closes, late answers), the row's own first."""
    ids = [own] if own else []
    for kind, _, detail in events:
        if kind in ("closed", "already_landed", "late_landing", "swept_found", "reconciled") and detail.get("reply_id"):
            ids.append(detail["reply_id"])
    return list(dict.fromkeys(ids))
