"""The one posting function: every reply replyd sends leaves through ``Guard.post``.

Order of work for one parent (docs/ARCHITECTURE.md, "States of a row"):

1. pre-check and claim in one write transaction: insert the key's row if absent
   (``ON CONFLICT DO NOTHING``), or compare-and-set a claimable row (released,
   an expired ``composing`` lease, or ``not_landed`` with an attempt left);
2. with a responder, the claim is ``composing`` (cheap, never sent) and the text
   is written next; ``open`` is committed durably right before the send;
3. send through the adapter; close with the reply id read back from the
   response, release only when the adapter proves nothing was sent, reject on a
   refusal, and leave the row open for the sweep on anything ambiguous.

If the log cannot be written nothing is sent (fail closed) and the caller gets
``StoreError``, distinct from ``ContentionError``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import structlog

from replyd import deadline, metrics
from replyd import store as st
from replyd.breaker import SEND, Admit, Breaker, Ticket
from replyd.clock import Clock, SystemClock
from replyd.errors import (
    AlreadyLanded,
    ContentionError,
    DefinitelyNotSent,
    PlatformError,
    RateLimited,
    Rejected,
    StoreError,
)
from replyd.lag import ListingLag
from replyd.platforms.base import Identity, Parent, Platform, ProviderKeys, default_provider_key
from replyd.store import Key, Reply, Store

log = structlog.get_logger("replyd.guard")

# A send left with less than this fraction of ``send_timeout_s`` before its row's deadline does not leave: it
# would most likely end timed out after leaving (ambiguous, an attempt spent), where not sending costs nothing.
MIN_SEND_FRACTION = 0.1

Compose = Callable[[Parent], "str | None"]


class Status(enum.StrEnum):
    """What happened to one call of ``Guard.post``, as a value the caller acts on."""

    POSTED = "posted"  # this call sent the reply; reply_id set
    ALREADY_ANSWERED = "already_answered"  # a reply exists; reply_id set
    IN_FLIGHT = "in_flight"  # someone holds the key, or it awaits the sweep
    NOT_SENT = "not_sent"  # provably not sent; retry later (retry_after_s)
    UNCERTAIN = "uncertain"  # this call's send may have landed; the sweep decides
    REJECTED = "rejected"  # the platform refused; terminal until rearmed
    GAVE_UP = "gave_up"  # attempts exhausted; terminal until rearmed
    UNCONFIRMED = "unconfirmed"  # a send may have landed where nothing can read it back; an operator resolves it
    DECLINED = "declined"  # the responder chose not to answer
    DRY_RUN = "dry_run"  # shadow mode: the reply was logged, nothing was sent or claimed
    SKIPPED = "skipped"  # the policy said not to answer (detail: the reason); nothing was claimed


@dataclass(frozen=True)
class Outcome:
    """The result of one ``Guard.post`` or ``Guard.check`` call."""

    status: Status
    key: Key
    state: str | None = None
    attempt: int = 0
    reply_id: str | None = None
    detail: str = ""
    retry_after_s: float | None = None

    @property
    def sent(self) -> bool:
        """True when this call made the platform create a reply."""
        return self.status is Status.POSTED


def text_hash(text: str) -> str:
    """Return the hash stored with an open row (text is never part of the key)."""
    return hashlib.sha256(text.encode()).hexdigest()


def _json_default(obj: Any) -> Any:
    # What asdict() would have made of a dataclass nested in ``extra``; anything else as default=str did.
    return asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else str(obj)


_FIELDS: dict[type, tuple[str, ...]] = {}


def snapshot_json(parent: Parent) -> str:
    """The row's ``snapshot`` column: ``json.dumps(parent.snapshot(), default=str)``, the same text without
    ``asdict``'s deep copy of the parent (it is serialised at once, never kept or changed)."""
    names = _FIELDS.get(type(parent))
    if names is None:
        names = _FIELDS[type(parent)] = tuple(f.name for f in fields(parent))
    return _snapshot_encode({n: getattr(parent, n) for n in names})


_snapshot_encode = json.JSONEncoder(default=_json_default).encode  # json.dumps' settings, made once


def _classify(row: Reply | st.Row, key: Key, now: float) -> Outcome:
    """Describe an existing row the caller may not claim."""
    s = row.state
    if s == st.CLOSED:
        return Outcome(Status.ALREADY_ANSWERED, key, s, row.attempt, row.reply_id)
    if s == st.REJECTED:
        return Outcome(Status.REJECTED, key, s, row.attempt, detail=row.error or "")
    if s == st.GAVE_UP:
        return Outcome(Status.GAVE_UP, key, s, row.attempt, detail=row.error or "")
    if s == st.UNCONFIRMED:
        return Outcome(Status.UNCONFIRMED, key, s, row.attempt, row.reply_id, detail=row.error or "")
    if s == st.DECLINED:
        return Outcome(Status.DECLINED, key, s, row.attempt)
    if s == st.SKIPPED:  # retired by re-find: the policy rules the parent out (the reason is in error)
        return Outcome(Status.SKIPPED, key, s, row.attempt, detail=(row.error or "").removeprefix("policy: "))
    if s in (st.RELEASED, st.NOT_LANDED) and row.not_before and row.not_before > now:
        return Outcome(Status.NOT_SENT, key, s, row.attempt, detail="backing off", retry_after_s=row.not_before - now)
    return Outcome(Status.IN_FLIGHT, key, s, row.attempt)


class SendWatch:
    """The sends running in this process, so one that outlives its budget keeps its row away from the sweep.

    The whole-request deadline (``replyd.deadline``) bounds sends made through replyd's HTTP client, but an
    adapter may block elsewhere (DNS, a custom transport, a paused process). While a send runs, the row must
    not be judged: the sweep would mark it ``not_landed`` and a retry could land beside it. So a live send
    that has run past half its budget pushes its row's deadline on, again at every tick, until it returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._running: dict[int, tuple[Key, int, float]] = {}
        self._noted: set[int] = set()  # tokens whose overrun is already in the audit log

    def started(self, key: Key, attempt: int, at: float) -> int:
        """Note a send about to leave; return its token."""
        token = next(self._seq)
        with self._lock:
            self._running[token] = (key, attempt, at)
        return token

    def finished(self, token: int) -> None:
        """Note that the send with ``token`` returned (or raised)."""
        with self._lock:
            self._running.pop(token, None)
            self._noted.discard(token)

    def first_note(self, token: int) -> bool:
        """True the first time it is asked for a running send: its overrun goes in the audit log once."""
        with self._lock:
            if token in self._noted or token not in self._running:
                return False
            self._noted.add(token)
            return True

    def overdue(self, now: float, after_s: float) -> list[tuple[int, Key, int, float]]:
        """Return the sends (token, key, attempt, started) running for at least ``after_s`` at ``now``."""
        with self._lock:
            return [(t, *v) for t, v in self._running.items() if now - v[2] >= after_s]



@functools.lru_cache(maxsize=None)
def _offers_provider_keys(cls: type) -> bool:
    """Whether an adapter class offers ``ProviderKeys``: once per class, because a runtime Protocol check costs
    about 16 µs, a tenth of a SQLite post (measured by ``make bench`` section 1)."""
    return issubclass(cls, ProviderKeys)

class Guard:
    """Posts replies for one bot on one platform, each parent at most once."""

    def __init__(
        self,
        store: Store,
        platform: Platform,
        identity: Identity,
        *,
        clock: Clock | None = None,
        owner: str | None = None,
        max_attempts: int = 2,
        send_timeout_s: float = 30.0,
        compose_lease_s: float = 120.0,
        dry_run: bool = False,
        responder_backoff_s: float = 30.0,
        responder_backoff_max_s: float = 3600.0,
        watch_interval_s: float | None = 1.0,
        lag: ListingLag | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        self.store = store
        self.breaker = breaker  # the bot's write-path breaker (replyd.breaker); None: never paused
        self.platform = platform
        self.identity = identity
        self.clock = clock or store.clock or SystemClock()
        self.owner = owner or st.make_owner()
        self.max_attempts = max_attempts
        self.send_timeout_s = send_timeout_s
        self.compose_lease_s = compose_lease_s
        self.dry_run = dry_run
        self.responder_backoff_s = responder_backoff_s
        self.responder_backoff_max_s = responder_backoff_max_s
        self.claiming = True  # the daemon clears this on shutdown: no new claims
        # The listing delay in use (configured, or learned from the observed lag): the daemon shares the sweep's.
        self.lag = lag or ListingLag(store, platform.instance, platform.listing_delay_s, clock=self.clock)
        self.sends = SendWatch()
        # The watch thread starts with the first send; None: the caller ticks ``watch_sends`` itself (tests).
        self._watch_interval_s = None if watch_interval_s is None else min(watch_interval_s, send_timeout_s / 4)
        self._watcher: threading.Thread | None = None
        self._watch_lock = threading.Lock()
        self._stop_watch = threading.Event()

    def key(self, parent_id: str) -> Key:
        """Return the answered-log key for ``parent_id`` exactly as given."""
        return Key(self.platform.instance, self.identity.sender_id, parent_id)

    def provider_key(self, parent_id: str) -> str:
        """Return the idempotency key for this parent: the same on every attempt."""
        if _offers_provider_keys(type(self.platform)):
            return self.platform.provider_key(self.identity.sender_id, parent_id)  # type: ignore[attr-defined]
        return default_provider_key(self.platform.instance, self.identity.sender_id, parent_id)

    # -- read-only ---------------------------------------------------------------

    def check(self, parent_id: str) -> Outcome | None:
        """Return what blocks ``post`` for ``parent_id``, read-only; None if a post would claim it."""
        key = self.key(parent_id)
        row = self.store.peek(key)
        if row is None or self._claimable(row, self.clock.now()):
            return None
        return _classify(row, key, self.clock.now())

    def retire(self, parent_id: str, reason: str) -> bool:
        """End a row that waits to be offered again (released, not_landed, an expired composing lease) as
        ``skipped`` with ``reason``: the policy rules its parent out for good. True if this call moved it."""
        key = self.key(parent_id)
        row = self.store.peek(key)
        now = self.clock.now()
        if row is None or not self._claimable(row, now, backoff=False):
            return False
        values = {"state": st.SKIPPED, "updated_at": now, "error": f"policy: {reason}", "lease_owner": None,
                  "lease_until": None, "not_before": None}
        ok = self.store.cas_event(
            key, states=[row.state], attempt=row.attempt, values=values, lease_owner=st.lease_holder(row),
            event={"kind": "retired", "state": st.SKIPPED, "attempt": row.attempt, "owner": self.owner,
                   "detail": {"reason": reason, "from": row.state}},
            relaxed=True, doing="retiring",
        )
        if ok:
            log.info("replyd.guard.retired", parent_id=parent_id, reason=reason, previous=row.state)
        return ok

    # -- the one posting function ---------------------------------------------------

    @metrics.observe_post
    def post(self, parent: Parent, text: str | Compose, *, path: str = "api") -> Outcome:
        """Reply to ``parent`` at most once; ``text`` is the reply or a responder to call once."""
        key = self.key(parent.id)
        if not self.claiming:
            return Outcome(Status.NOT_SENT, key, detail="shutting down")
        compose = None if isinstance(text, str) else text
        if self.dry_run:
            return self._shadow(key, parent, text, path)
        ticket = self._breaker_admit(key, parent, path, hold=compose is not None)
        if isinstance(ticket, Outcome):
            return ticket
        try:
            return self._post(key, parent, text, compose, path, ticket)
        finally:
            if self.breaker is not None:
                self.breaker.abandon(ticket)  # a no-op once the send was recorded

    def _post(self, key: Key, parent: Parent, text: str | Compose, compose: Compose | None, path: str,
              ticket: Ticket) -> Outcome:
        """``post`` once the breaker let the call through: claim, compose, open, send."""
        claim = self._claim(key, parent, path, None if compose else text)
        if isinstance(claim, Outcome):
            return claim
        row = claim
        if compose is not None:
            written = self._compose(key, parent, row, compose)
            if isinstance(written, Outcome):
                return written
            body = written
            paused = self._breaker_paused(key, row, ticket)
            if paused is not None:
                return paused
            row = self._open_composed(key, row, body)
            if isinstance(row, Outcome):
                return row
        else:
            body = text  # type: ignore[assignment]
        out = self._send(key, parent, row, body)
        self._breaker_record(ticket, key, row.attempt, out)
        return out

    def _claimable(self, row: Reply | st.Row, now: float, *, backoff: bool = True) -> bool:
        if row.state == st.RELEASED:
            return not backoff or not row.not_before or row.not_before <= now
        if row.state == st.COMPOSING:
            return row.lease_until is not None and row.lease_until < now
        if row.state == st.NOT_LANDED:
            # Attempts an outage swallowed (excused) do not count; their retry waits out its back-off.
            counted = row.attempt - (row.excused or 0)
            return counted < self.max_attempts and (not backoff or not row.not_before or row.not_before <= now)
        return False

    # -- the write-path breaker (replyd.breaker) -----------------------------------------------

    def _breaker_admit(self, key: Key, parent: Parent, path: str, *, hold: bool) -> Ticket | Outcome:
        """Ask the bot's breaker before any claim; refused: an Outcome, and (``hold``) a new parent is kept
        as a ``released`` row, no attempt used, so a discovery path whose cursor moves on does not lose it."""
        if self.breaker is None:
            return SEND
        ticket = self.breaker.admit()
        if ticket.kind is not Admit.REFUSED:
            return ticket
        wait_s = self.breaker.retry_in_s()
        if hold:
            now = self.clock.now()
            values = {"state": st.RELEASED, "attempt": 1, "created_at": now, "updated_at": now, "path": path,
                      "snapshot": snapshot_json(parent), "author_id": parent.author_id[:255], "owner": self.owner,
                      "provider_key": self.provider_key(parent.id), "not_before": now + wait_s,
                      "error": "breaker open: sends paused"}
            try:
                with self.store.transaction(relaxed=True, doing="holding a parent while sends are paused") as tx:
                    if tx.insert_new(key, values):
                        tx.append_event(key, "held", state=st.RELEASED, attempt=1, owner=self.owner,
                                        detail={"path": path, "reason": self.breaker.reason})
            except StoreError as exc:  # nothing was claimed or sent: the next discovery offers it again
                log.warning("replyd.guard.hold_failed", parent_id=key.parent_id, error=str(exc))
        return Outcome(Status.NOT_SENT, key, detail="breaker open: sends paused", retry_after_s=wait_s)

    def _breaker_paused(self, key: Key, row: Reply | st.Row, ticket: Ticket) -> Outcome | None:
        """The breaker opened while this claim composed: release it before the open commit (no attempt used)."""
        if self.breaker is None or ticket.kind is not Admit.SEND or not self.breaker.is_open:
            return None
        wait_s = self.breaker.retry_in_s()
        detail = {"error": "breaker open: sends paused", "not_before": self.clock.now() + wait_s}
        if not self._transition(key, [st.COMPOSING], row.attempt, st.RELEASED, "held", detail, relaxed=True,
                                lease_owner=self.owner):
            return self._lost_lease(key)
        return Outcome(Status.NOT_SENT, key, st.RELEASED, row.attempt, detail=detail["error"], retry_after_s=wait_s)

    def _breaker_record(self, ticket: Ticket, key: Key, attempt: int, out: Outcome) -> None:
        """Tell the breaker the send's fate; mark the sends an outage swallowed (the sweep excuses them)."""
        if self.breaker is None:
            return
        if out.status is Status.NOT_SENT:
            failed: bool | None = None if out.retry_after_s is not None else True  # a 429 says nothing
        else:
            failed = out.status is Status.UNCERTAIN
        for k, a in self.breaker.record(ticket, (key, attempt), failed):  # type: ignore[misc]
            try:
                self._mark_outage(k, a)
            except StoreError as exc:  # the sweep's own look at the breaker still excuses it in this process
                log.warning("replyd.guard.outage_mark_failed", parent_id=k.parent_id, error=str(exc))

    def _mark_outage(self, key: Key, attempt: int) -> None:
        """Mark ``attempt``'s send as swallowed by an outage, so the sweep's not-landed proof of it is excused.

        The sends that open the breaker fail over several seconds: the sweep may already have judged the first
        ones (counted) before the pattern was seen. Such an attempt is excused here, once, in the same
        transaction; a ``gave_up`` it caused is undone when the attempts left then allow a retry.
        """
        assert self.breaker is not None
        with self.store.transaction(relaxed=True, doing="marking a send the outage swallowed") as tx:
            tx.append_event(key, "outage_send", state=None, attempt=attempt, owner=self.owner,
                            detail={"reason": self.breaker.reason})
            row = tx.get(key)
            judged = tx.has_event(key, st.NOT_LANDED, attempt) or tx.has_event(key, st.GAVE_UP, attempt)
            if row is None or not judged or tx.has_event(key, "excused", attempt):
                return
            excused = (row.excused or 0) + 1
            values: dict[str, Any] = {"excused": excused}
            if row.state == st.GAVE_UP and row.attempt == attempt and row.attempt - excused < self.max_attempts:
                values.update(state=st.NOT_LANDED, updated_at=self.clock.now(), not_before=None)
            tx.cas_event(key, states=[row.state], attempt=row.attempt, values=values,
                         event={"kind": "excused", "state": values.get("state", row.state), "attempt": attempt,
                                "owner": self.owner, "detail": {"counted": attempt - excused, "late": True}})

    def _claim(self, key: Key, parent: Parent, path: str, text: str | None) -> st.Row | Outcome:
        """Take the key atomically; return the claimed row, or an Outcome if not ours."""
        now = self.clock.now()
        if text is not None:
            state, extra = st.OPEN, self._open_values(now, text)
        else:
            state, extra = st.COMPOSING, {"lease_owner": self.owner, "lease_until": now + self.compose_lease_s}
        common = {
            "state": state,
            "updated_at": now,
            "path": path,
            "snapshot": snapshot_json(parent),
            "author_id": parent.author_id[:255],
            "owner": self.owner,
            **extra,
        }
        new = {**common, "attempt": 1, "created_at": now, "provider_key": self.provider_key(parent.id)}

        def reclaim(row: st.Row) -> dict[str, Any] | None:
            # The row exists: ours only if claimable, compared-and-set on the (state, attempt) read here.
            if not self._claimable(row, now):
                return None
            attempt = row.attempt + 1 if row.state == st.NOT_LANDED else row.attempt
            return {**common, "attempt": attempt, "error": None, "not_before": None, "reply_id": None}

        try:
            # One transaction: the row (inserted, or compared-and-set) and its "claimed" event; durable unless composing.
            won, row, values = self.store.claim(key, new, reclaim, {"kind": "claimed", "owner": self.owner,
                                                                    "detail": {"path": path}},
                                                relaxed=state == st.COMPOSING, doing="claiming")
        except ContentionError:
            log.warning("replyd.guard.contended", parent_id=key.parent_id)
            raise
        except StoreError as exc:
            log.error("replyd.guard.store_failed", parent_id=key.parent_id, error=str(exc))
            raise
        if not won or values is None:
            # Not ours (or lost the race): whatever stands must be reported, including a finished answer.
            return _classify(row, key, now) if row else Outcome(Status.IN_FLIGHT, key)
        log.info("replyd.guard.claimed", parent_id=key.parent_id, state=state, attempt=values["attempt"], path=path)
        return st.Row.of(key, values)

    def _shadow(self, key: Key, parent: Parent, text: str | Compose, path: str) -> Outcome:
        """Dry run: write the reply once, log and record it as ``would_post``; claim and send nothing."""
        now = self.clock.now()
        row = self.store.get(key)
        if row is not None and not self._claimable(row, now):
            return _classify(row, key, now)
        # One responder call per parent, even though nothing is claimed: later offers see this event.
        if self.store.last_event(key, ["would_post"]) is not None:
            return Outcome(Status.DRY_RUN, key, detail="dry run: shown before")
        if isinstance(text, str):
            body: str | None = text
        else:
            try:
                body = metrics.timed_responder(text, parent, self.platform.instance)
            except Exception as exc:
                detail = f"{type(exc).__name__}: {getattr(exc, 'detail', '') or exc}"[:300]
                log.warning("replyd.guard.responder_failed", parent_id=key.parent_id, error=detail, dry_run=True)
                return Outcome(Status.NOT_SENT, key, detail=f"dry run: {detail}")
        if not body or not body.strip():
            self.store.record(key, "would_decline", owner=self.owner, detail={"path": path})
            return Outcome(Status.DECLINED, key, detail="dry run: the responder declined")
        log.info("replyd.guard.would_post", parent_id=key.parent_id, path=path, text=body[:500])
        self.store.record(key, "would_post", owner=self.owner,
                          detail={"path": path, "text": body[:2000], "text_hash": text_hash(body)})
        return Outcome(Status.DRY_RUN, key, detail="dry run: would post")

    def _open_values(self, now: float, text: str) -> dict[str, Any]:
        return {
            "opened_at": now,
            "deadline_at": now + self.send_timeout_s + self.lag.delay_s(),
            "text_hash": text_hash(text),
            "lease_owner": None,
            "lease_until": None,
        }

    def _compose(self, key: Key, parent: Parent, row: Reply, compose: Compose) -> str | Outcome:
        """Call the responder once for a composing claim; release or decline on failure."""
        try:
            text = metrics.timed_responder(compose, parent, self.platform.instance)
        except Exception as exc:  # a responder failure costs no attempt: the row goes back, with a backoff
            detail = (getattr(exc, "detail", "") or f"{type(exc).__name__}: {exc}")[:300]
            wait_s = self._responder_backoff(key)
            nb = self.clock.now() + wait_s
            log.warning("replyd.guard.responder_failed", parent_id=key.parent_id, error=detail, backoff_s=wait_s)
            # Only while our lease holds: a composer that outlived it must not undo the new holder's work.
            if not self._transition(key, [st.COMPOSING], row.attempt, st.RELEASED, "responder_failed",
                                    {"error": detail, "not_before": nb, "backoff_s": wait_s}, relaxed=True,
                                    lease_owner=self.owner):
                return self._lost_lease(key)
            return Outcome(Status.NOT_SENT, key, st.RELEASED, row.attempt, detail=detail, retry_after_s=wait_s)
        if not text or not text.strip():
            if not self._transition(key, [st.COMPOSING], row.attempt, st.DECLINED, "declined", {}, relaxed=True,
                                    lease_owner=self.owner):
                return self._lost_lease(key)
            return Outcome(Status.DECLINED, key, st.DECLINED, row.attempt)
        return text

    def _lost_lease(self, key: Key) -> Outcome:
        """Report what stands after our compose lease was taken over (or the store refused the write)."""
        current = self.store.peek(key)
        log.warning("replyd.guard.lease_lost", parent_id=key.parent_id, state=current.state if current else None)
        return _classify(current, key, self.clock.now()) if current else Outcome(Status.IN_FLIGHT, key)

    def _responder_backoff(self, key: Key) -> float:
        """Return how long to wait before calling the responder again: doubling per failure in a row."""
        try:
            failures = self.store.count_events(key, "responder_failed", after_kinds=("opened", "rearmed"))
        except StoreError:
            failures = 0
        return min(self.responder_backoff_max_s, self.responder_backoff_s * 2.0 ** failures)

    def _open_composed(self, key: Key, row: Reply | st.Row, text: str) -> st.Row | Outcome:
        """Turn our composing claim into a durable open row, unless the lease was lost."""
        now = self.clock.now()
        values = {**self._open_values(now, text), "state": st.OPEN, "updated_at": now}
        # Durable (the send follows), and only while our composing lease holds.
        ok = self.store.cas_event(
            key, states=[st.COMPOSING], attempt=row.attempt, values=values, lease_owner=self.owner,
            event={"kind": "opened", "state": st.OPEN, "attempt": row.attempt, "owner": self.owner}, doing="opening",
        )
        if not ok:
            current = self.store.peek(key)
            return _classify(current, key, now) if current else Outcome(Status.IN_FLIGHT, key)
        return st.Row(**{**row.model_dump(), **values})

    def _send(self, key: Key, parent: Parent, row: Reply | st.Row, text: str) -> Outcome:
        attempt = row.attempt
        budget_s = self._send_budget(key, row)  # every path (post, library.finish, API, MCP) sends from here
        if isinstance(budget_s, Outcome):
            return budget_s
        if self._watcher is None and self._watch_interval_s is not None:
            self._start_watch()
        token = self.sends.started(key, attempt, self.clock.now())
        try:
            # The whole send, every request in it, ends by the row's send deadline: the sweep's judgement counts on it.
            with metrics.watching_send(self.platform.instance), deadline.within(budget_s):
                sent = self.platform.send(parent, text, provider_key=row.provider_key or self.provider_key(parent.id))
        except AlreadyLanded as exc:
            if exc.reply_id:
                # This call created nothing: the caller learns the reply was already there.
                return self._close(key, attempt, exc.reply_id, "already_landed", Status.ALREADY_ANSWERED)
            self._note_open(key, attempt, exc)
            return Outcome(Status.UNCERTAIN, key, st.OPEN, attempt, detail=exc.detail)
        except RateLimited as exc:
            now = self.clock.now()
            nb = now + (60.0 if exc.retry_after_s is None else exc.retry_after_s)
            self._transition(key, [st.OPEN], attempt, st.RELEASED, "released", {"error": str(exc), "not_before": nb}, error=exc)
            return Outcome(Status.NOT_SENT, key, st.RELEASED, attempt, detail=exc.detail, retry_after_s=nb - now)
        except DefinitelyNotSent as exc:
            self._transition(key, [st.OPEN], attempt, st.RELEASED, "released", {"error": str(exc)}, error=exc)
            return Outcome(Status.NOT_SENT, key, st.RELEASED, attempt, detail=exc.detail)
        except Rejected as exc:
            self._transition(key, [st.OPEN], attempt, st.REJECTED, "rejected", {"error": str(exc)}, error=exc)
            return Outcome(Status.REJECTED, key, st.REJECTED, attempt, detail=exc.detail)
        except PlatformError as exc:
            self._note_open(key, attempt, exc)
            return Outcome(Status.UNCERTAIN, key, st.OPEN, attempt, detail=exc.detail)
        except Exception as exc:  # an unmapped error after the request may have left: never release
            self._note_open(key, attempt, exc)
            return Outcome(Status.UNCERTAIN, key, st.OPEN, attempt, detail=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self.sends.finished(token)
        return self._close(key, attempt, sent.reply_id, "closed")

    # -- a send never leaves past its row's deadline ---------------------------------------

    def _send_budget(self, key: Key, row: Reply | st.Row) -> float | Outcome:
        """Seconds the send about to leave may take, or the Outcome of one too late to leave (nothing sent).

        The sweep may judge the row from its deadline on (``opened_at + send_timeout_s +`` the listing delay,
        on the clock the sweep reads: the database's on PostgreSQL), so a reply must be created by
        ``opened_at + send_timeout_s`` to be listed when it looks. A stall between the open write and here
        (the database's answer held, a paused process or VM) eats that budget: the request gets what is
        left, and when too little is, it does not leave and the row is released (``_release_too_late``).
        """
        now = self.clock.now()
        opened_at = row.opened_at if row.opened_at is not None else now
        left_s = min(self.send_timeout_s, opened_at + self.send_timeout_s - now)
        if left_s >= MIN_SEND_FRACTION * self.send_timeout_s:
            return left_s
        return self._release_too_late(key, row.attempt, now - opened_at)

    def _release_too_late(self, key: Key, attempt: int, stalled_s: float) -> Outcome:
        """Release a row whose send found itself past its deadline, by compare-and-set: nothing was sent.

        The sweep may have judged it meanwhile (``not_landed``, or ``gave_up`` on the last attempt: true, but
        this attempt never went out, so it is given back), and a re-find may have claimed the next attempt:
        then the row has moved on, the compare-and-set loses and only a note is written.
        """
        metrics.too_late(self.platform.instance)
        now = self.clock.now()
        detail = {"stalled_s": round(stalled_s, 3), "send_timeout_s": self.send_timeout_s}
        error = f"not sent: {stalled_s:.1f} s passed between the open and the send (budget {self.send_timeout_s:g} s)"
        values = {"state": st.RELEASED, "updated_at": now, "error": error, "not_before": None,
                  "lease_owner": None, "lease_until": None}
        state: str | None = st.OPEN
        try:
            with self.store.transaction(relaxed=True, doing="releasing a send too late to leave") as tx:
                before = tx.get(key)
                state = before.state if before is not None else None
                if tx.cas_event(key, states=[st.OPEN, st.NOT_LANDED, st.GAVE_UP], attempt=attempt, values=values):
                    tx.append_event(key, "too_late", state=st.RELEASED, attempt=attempt, owner=self.owner,
                                    detail={**detail, "from": state})
                    state = st.RELEASED
                else:  # the row moved on (a newer attempt, closed): a note for explain, no state
                    tx.append_event(key, "too_late", state=None, attempt=attempt, owner=self.owner,
                                    detail={**detail, "row_state": state})
        except StoreError as exc:
            # The row stays open and the sweep judges it not_landed, which is true: nothing was sent.
            log.error("replyd.guard.release_failed", parent_id=key.parent_id, error=str(exc))
        log.warning("replyd.guard.too_late", platform=key.platform, parent_id=key.parent_id, attempt=attempt,
                    stalled_s=round(stalled_s, 3), send_timeout_s=self.send_timeout_s, state=state)
        return Outcome(Status.NOT_SENT, key, state, attempt, detail=error, retry_after_s=0.0)

    # -- sends that outlive their budget ---------------------------------------------------

    def watch_sends(self) -> int:
        """Push the deadline of every row whose send has run past half its budget; return how many moved."""
        now = self.clock.now()
        moved = 0
        for token, key, attempt, started in self.sends.overdue(now, self.send_timeout_s / 2):
            values = {"updated_at": now}
            try:
                with self.store.transaction(relaxed=True, doing="extending a running send") as tx:
                    if tx.cas_event(key, states=[st.OPEN], attempt=attempt, values=values,
                                    deadline_at_least=now + self.send_timeout_s + self.lag.delay_s()):
                        moved += 1
                        if self.sends.first_note(token):  # one note per send, not per tick
                            tx.append_event(key, "send_overdue", state=st.OPEN, attempt=attempt,
                                            owner=self.owner, detail={"running_s": round(now - started, 3)})
            except StoreError as exc:
                log.warning("replyd.guard.watch_failed", parent_id=key.parent_id, error=str(exc))
                continue
            log.warning("replyd.guard.send_overdue", parent_id=key.parent_id, attempt=attempt,
                        running_s=round(now - started, 3), send_timeout_s=self.send_timeout_s)
        return moved

    def _start_watch(self) -> None:
        with self._watch_lock:
            if self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._watch_loop, name="replyd-send-watch", daemon=True)
            self._watcher.start()

    def _watch_loop(self) -> None:
        assert self._watch_interval_s is not None
        while not self._stop_watch.wait(self._watch_interval_s):
            try:
                self.watch_sends()
            except Exception as exc:  # the watch must outlive any one failure
                log.error("replyd.guard.watch_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def close(self) -> None:
        """Stop the send watch thread (the guard can still post; the thread restarts on the next send)."""
        self._stop_watch.set()
        t, self._watcher = self._watcher, None
        if t is not None:
            t.join(timeout=5.0)
        self._stop_watch = threading.Event()

    def _close(self, key: Key, attempt: int, reply_id: str, kind: str, status: Status = Status.POSTED) -> Outcome:
        """Close our row with the reply id; a lost close is left to the sweep."""
        now = self.clock.now()
        if kind == "closed":
            self.lag.sent(reply_id)  # the listing lag is timed from here, on a clock no wall-clock step moves
        # Every close keeps a deadline: from the configured delay on the sweep measures this reply's listing lag,
        # and once the delay in use has passed it verifies that no other reply (an earlier attempt's) landed.
        verify_at = now + self.lag.configured_s
        values = {"state": st.CLOSED, "reply_id": reply_id, "closed_at": now, "updated_at": now, "error": None,
                  "deadline_at": verify_at}
        detail = {"reply_id": reply_id}
        try:
            # One relaxed transaction: the compare-and-set and its event; a late_landing note if the row moved on.
            # not_landed or gave_up at our attempt: the sweep looked too early; our reply did land.
            ok = self.store.cas_event(
                key, states=[st.OPEN, st.NOT_LANDED, st.GAVE_UP], attempt=attempt, values=values,
                event={"kind": kind, "state": st.CLOSED, "attempt": attempt, "owner": self.owner, "detail": detail},
                otherwise={"kind": "late_landing", "attempt": attempt, "owner": self.owner, "detail": detail},
                relaxed=True, doing="closing",
            )
        except StoreError as exc:
            log.error("replyd.guard.close_failed", parent_id=key.parent_id, reply_id=reply_id, error=str(exc))
            return Outcome(status, key, st.OPEN, attempt, reply_id, detail="posted; close not recorded, the sweep will close it")
        if not ok:
            log.warning("replyd.guard.late_landing", parent_id=key.parent_id, reply_id=reply_id, attempt=attempt)
            self._late_landing(key, attempt, reply_id)
        log.info("replyd.guard.posted", parent_id=key.parent_id, reply_id=reply_id, attempt=attempt)
        return Outcome(status, key, st.CLOSED, attempt, reply_id)

    def _late_landing(self, key: Key, attempt: int, reply_id: str) -> None:
        """Our reply landed after the row moved on: make sure it is counted, not just noted.

        Closed with another reply: a duplicate, whether or not that close was verified already; the row's
        deadline comes back to now, so the sweep's verification counts it (from the ``late_landing`` event's
        id, whatever its read-back lists), reports ``duplicate_detected`` and deletes it with
        ``on_duplicate = "delete_newer"``. Judged or released at a later attempt (nothing of that attempt
        landed, as far as replyd knows): the parent is answered, so the row closes with our reply
        (``reconciled``) before another attempt can go out.
        """
        now = self.clock.now()
        try:
            with self.store.transaction(relaxed=True, doing="recording a late landing") as tx:
                row = tx.get(key)
                if row is None or row.reply_id == reply_id:
                    return
                if row.state == st.CLOSED:
                    tx.cas_event(key, states=[st.CLOSED], attempt=row.attempt, values={"deadline_at": now})
                    log.error("replyd.guard.duplicate_landed", platform=key.platform, parent_id=key.parent_id,
                              reply_id=reply_id, kept=row.reply_id, attempt=attempt)
                elif row.state in (st.NOT_LANDED, st.GAVE_UP, st.RELEASED) and row.attempt > attempt:
                    values = {"state": st.CLOSED, "reply_id": reply_id, "closed_at": now, "updated_at": now,
                              "error": None, "not_before": None, "deadline_at": now + self.lag.configured_s}
                    if tx.cas_event(key, states=[row.state], attempt=row.attempt, values=values):
                        tx.append_event(key, "reconciled", state=st.CLOSED, attempt=row.attempt, owner=self.owner,
                                        detail={"reply_id": reply_id, "from": row.state, "late_attempt": attempt})
        except StoreError as exc:
            log.error("replyd.guard.late_landing_failed", parent_id=key.parent_id, reply_id=reply_id, error=str(exc))

    def _transition(
        self,
        key: Key,
        states: list[str],
        attempt: int,
        to: str,
        kind: str,
        detail: dict[str, Any],
        *,
        error: BaseException | None = None,
        relaxed: bool = False,
        lease_owner: str | None = None,
    ) -> bool:
        now = self.clock.now()
        values: dict[str, Any] = {"state": to, "updated_at": now, "lease_owner": None, "lease_until": None}
        if "not_before" in detail:
            values["not_before"] = detail["not_before"]
        if error is not None or "error" in detail:
            values["error"] = detail.get("error") or str(error)
        try:
            ok = self.store.cas_event(
                key, states=states, attempt=attempt, values=values,
                event={"kind": kind, "state": to, "attempt": attempt, "owner": self.owner, "detail": detail},
                lease_owner=lease_owner, relaxed=relaxed, doing=kind,
            )
        except StoreError as exc:
            # The row stays as it was (open rows are swept); never guess a state.
            log.error("replyd.guard.transition_failed", parent_id=key.parent_id, to=to, error=str(exc))
            return False
        log.info(f"replyd.guard.{kind}", parent_id=key.parent_id, attempt=attempt, ok=ok, **{k: v for k, v in detail.items() if k == "error"})
        return ok

    def _note_open(self, key: Key, attempt: int, exc: BaseException) -> None:
        """Record an ambiguous send: the row is (back) open for the sweep, one listing delay from now.

        The sweep may have judged the row while this send still ran (``not_landed``, or ``gave_up`` on the last
        attempt): the send may have landed after that read-back, so the row goes back to ``open`` at the same
        attempt. If the row moved on (a newer attempt, closed), only a note is written.
        """
        detail = (getattr(exc, "detail", "") or f"{type(exc).__name__}: {exc}")[:300]
        now = self.clock.now()
        # The send has returned: whatever it did is done, so one listing delay from now is enough to look.
        # An open row keeps a later deadline (a running send's); a judged one's is its next reconciling look.
        look_at = now + self.lag.delay_s()
        values = {"state": st.OPEN, "error": detail, "updated_at": now}
        reopened = None
        try:
            with self.store.transaction(relaxed=True, doing="recording an ambiguous send") as tx:
                before = tx.get(key)
                if tx.cas_event(key, states=[st.OPEN, st.NOT_LANDED, st.GAVE_UP], attempt=attempt, values=values,
                                deadline_at_least=look_at):
                    reopened = before.state if before is not None and before.state != st.OPEN else None
                    note = {"error": detail, **({"reopened_from": reopened} if reopened else {})}
                    tx.append_event(key, "maybe_sent", state=st.OPEN, attempt=attempt, owner=self.owner, detail=note)
                else:  # the row moved on: a note for explain, no state (it would contradict the row)
                    tx.append_event(key, "late_maybe_sent", state=None, attempt=attempt, owner=self.owner,
                                    detail={"error": detail, "row_state": before.state if before else None})
        except StoreError:
            pass  # the open row itself is durable; this note is only for explain
        log.warning("replyd.guard.maybe_sent", parent_id=key.parent_id, attempt=attempt, error=detail,
                    **({"reopened_from": reopened} if reopened else {}))
