"""The guard's decisions, written once: a sans-I/O core that two faces drive (``replyd.guard``, ``replyd.aio``).

Every rule of the one posting function (claim, compose, open, send budget, close, release, reject, reopen,
late landing, the send watch, the breaker's hooks, compose leases) lives here as a generator. It does no
I/O itself: where it needs the store, the platform's send or the responder, it *yields* an effect
(``Call``, ``Send``, ``Respond``, or ``Step`` for a sub-step a face may intercept) and takes the result back
(or the exception, thrown in at the same point). A face runs the effects its own way:

- ``replyd.guard.Guard`` (sync) calls them in the calling thread, exactly as the guard always did;
- ``replyd.aio.AsyncGuard`` awaits them: store calls on the store's own thread, an async send where the
  adapter offers one (else the sync send on a worker thread), an ``async def`` responder on the loop.

Why generators and not an h11-style explicit state machine: the decisions interleave a dozen I/O calls with
branches on their results (and transactions whose bodies branch on what they read); as generators the code
keeps the order it is reasoned about in (replyd/transitions.py and docs/ARCHITECTURE.md, "States"), sub-steps compose with
``yield from``, and each driver is a dozen lines. A transaction is one effect: the core hands the face a
function of the store that runs whole (and atomically) wherever the face runs store calls.

Order of work for one parent:

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

import contextvars
import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, cast, final

from pydantic_core import PydanticSerializationError, to_json

from replyd import metrics
from replyd import store as st
from replyd.breaker import SEND, Admit, Breaker, Ticket
from replyd.clock import Clock, SystemClock
from replyd.errors import (
    AlreadyLanded,
    ContentionError,
    DefinitelyNotSent,
    LeaseLost,
    NotBuilt,
    PlatformError,
    RateLimited,
    Rejected,
    StoreError,
)
from replyd.lag import ListingLag
from replyd.log import get_logger
from replyd.outcome import Outcome, PartOutcome, Status
from replyd.outcome import classify as _classify
from replyd.parts import MAX_PARTS, PART_PATH, Limit, head, length, part_id, split
from replyd.platforms.base import (EditReply, Identity, Parent, Platform, PostLimit, ProviderKeys, Sent,
                                   default_provider_key)
from replyd.stream import Stream
from replyd.store import Key, Reply, Store

log = get_logger("replyd.guard")  # the events keep their names (replyd.guard.<verb>) on both faces

# A send left with less than this fraction of ``send_timeout_s`` before its row's deadline does not leave: it
# would most likely end timed out after leaving (ambiguous, an attempt spent), where not sending costs nothing.
MIN_SEND_FRACTION = 0.1

# A responder: returns the text (None or "" declines), or an awaitable of it (an ``async def`` responder).
Compose = Callable[[Parent], "str | None | Awaitable[str | None]"]


# -- the effects a face runs for the core ------------------------------------------------------------


@dataclass
class PageCloses:
    """The closes a page's posts leave for one relaxed transaction at the end of the page (the group
    close): only the page's own keys, only a plain reply's close (a part's close orders the next part)."""

    keys: frozenset[Key]
    rows: list[tuple[Key, int, str]] = field(default_factory=list)  # (key, attempt, reply id)


# The states a send's close may close from (see _close_row_steps).
CLOSABLE = (st.OPEN, st.NOT_LANDED, st.GAVE_UP, st.UNCONFIRMED)
CLOSE_LOST = "posted; close not recorded, the sweep will close it"

# Set by a page (``post_page``) around its posts: a context variable, so on the async face only the page's own
# tasks (which copy the context they were made in) defer their closes, never a concurrent post's.
PAGE_CLOSES: contextvars.ContextVar[PageCloses | None] = contextvars.ContextVar("replyd_page_closes", default=None)


@final
@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(*args, **kwargs)``: a store call (or a whole transaction); blocking, so off the loop."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@final
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``text`` to ``parent`` through the adapter, the whole send within ``budget_s`` (replyd.deadline)."""

    parent: Parent
    text: str
    provider_key: str
    budget_s: float
    token: int  # the send's entry in ``GuardCore.sends`` (its key and attempt): a face's late close finds it there


@final
@dataclass(frozen=True, slots=True)
class Respond:
    """Call the responder once for ``parent``; the result is the text (None or "" declines), or with ``stream``
    a ``replyd.stream.Stream`` when the responder streams (without ``stream`` the face drains one to text)."""

    compose: Compose
    parent: Parent
    stream: bool = False


@final
@dataclass(frozen=True, slots=True)
class Pull:
    """The next chunk of a streamed answer (None at its end), within ``timeout_s``; ``close``: stop it instead."""

    stream: Stream
    timeout_s: float
    close: bool = False


@final
@dataclass(frozen=True, slots=True)
class Edit:
    """Replace the text of the bot's reply ``reply_id`` (to ``parent``) through the adapter, within ``budget_s``."""

    parent: Parent
    reply_id: str
    text: str
    budget_s: float


@final
@dataclass(frozen=True, slots=True)
class Step:
    """Run the face's own method ``name`` (a seam crash-injection tests and the chaos shim wrap)."""

    name: str
    args: tuple[Any, ...] = ()


Effect = Call | Send | Respond | Step | Pull | Edit
Steps = Generator[Effect, Any, Any]  # what every decision is: yields effects, returns its result


class Drive:
    """One run of a decision for a face's driver: the ``effect`` to do next, until ``done`` (then ``value``)."""

    __slots__ = ("done", "effect", "steps", "value")

    def __init__(self, steps: Steps) -> None:
        self.steps, self.done, self.value = steps, False, None
        self._step(steps.__next__)

    def _step(self, fn: Callable[..., Any], *arg: Any) -> None:
        try:
            self.effect: Effect | None = fn(*arg)
        except StopIteration as stop:
            self.done, self.value, self.effect = True, stop.value, None

    def ok(self, result: Any) -> None:
        """Hand the effect's result back to the decision."""
        self._step(self.steps.send, result)

    def fail(self, exc: BaseException) -> None:
        """Throw the effect's exception in at the point it arose: the decision says what it means."""
        self._step(self.steps.throw, exc)


def io(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Call:
    """The effect of calling ``fn`` on the store side."""
    return Call(fn, args, kwargs)


@dataclass(frozen=True)
class Lease:
    """A compose lease: ``key``'s ``composing`` claim at ``attempt``, held by ``owner`` until ``until``."""

    key: Key
    owner: str
    attempt: int
    until: float


def text_hash(text: str) -> str:
    """Return the hash stored with an open row (text is never part of the key). A lone surrogate (a
    responder's broken output) hashes too: the send, not the bookkeeping, refuses such a text."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _json_default(obj: Any) -> Any:
    # What asdict() would have made of a dataclass nested in ``extra``; anything else as default=str did.
    return asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else str(obj)


_FIELDS: dict[type, tuple[str, ...]] = {}
_LEASES = itertools.count(1)  # composing claims taken in this process (each its own lease holder)


def _holder(row: Reply | st.Row) -> str:
    """The lease holder a composer's compare-and-set must still find: the one its own claim wrote (a row
    without one matches nothing)."""
    return row.lease_owner or "?"


def snapshot_json(parent: Parent) -> str:
    """The row's ``snapshot`` column: the parent's fields as JSON, read back with ``json.loads`` (the sweep, re-find,
    the API). pydantic-core's encoder writes it (a fifth of ``json.dumps``' time, the largest piece of a page's
    claim in Python: 2.9 against 9.6 µs, timeit); what it cannot write (a lone surrogate, bytes that are not UTF-8)
    goes through ``json.dumps(parent.snapshot(), default=str)``'s settings as before."""
    names = _FIELDS.get(type(parent))
    if names is None:
        names = _FIELDS[type(parent)] = tuple(f.name for f in fields(parent))
    doc = {n: getattr(parent, n) for n in names}  # no asdict deep copy: serialised at once, never kept
    try:
        return to_json(doc, fallback=str).decode()
    except PydanticSerializationError:
        return _snapshot_encode(doc)


_snapshot_encode = json.JSONEncoder(default=_json_default).encode  # json.dumps' settings, made once


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
        self._outliving: set[int] = set()  # sends whose caller stopped waiting while the request still runs

    def started(self, key: Key, attempt: int, at: float) -> int:
        """Note a send about to leave; return its token."""
        token = next(self._seq)
        with self._lock:
            self._running[token] = (key, attempt, at)
        return token

    def finished(self, token: int) -> None:
        """Note that the send with ``token`` returned (or raised) to its caller; one that outlives it stays."""
        with self._lock:
            if token in self._outliving:
                return
            self._running.pop(token, None)
            self._noted.discard(token)

    def outlive(self, token: int) -> None:
        """Keep the send with ``token`` watched after its caller stops waiting: its request still runs (the async
        face cuts a worker thread's send at its budget, but cannot stop the thread) until ``ended``."""
        with self._lock:
            if token in self._running:
                self._outliving.add(token)

    def ended(self, token: int) -> tuple[Key, int] | None:
        """Note that the request of an outliving send returned: it is no longer watched; return its key and
        attempt (None if it was not watched)."""
        with self._lock:
            self._outliving.discard(token)
            self._noted.discard(token)
            entry = self._running.pop(token, None)
        return None if entry is None else (entry[0], entry[1])

    def running(self) -> int:
        """How many sends are watched now (those outliving their caller included)."""
        with self._lock:
            return len(self._running)

    def first_note(self, token: int) -> bool:
        """True the first time it is asked for a running send: its overrun goes in the audit log once."""
        with self._lock:
            if token in self._noted or token not in self._running:
                return False
            self._noted.add(token)
            return True

    def overdue(self, now: float, after_s: float) -> list[tuple[int, Key, int, float]]:
        """Return the sends (token, key, attempt, started) running for at least ``after_s`` at ``now``."""
        if not self._running:  # the usual tick: nothing running, no lock taken
            return []
        with self._lock:
            return [(t, *v) for t, v in self._running.items() if now - v[2] >= after_s]



@functools.lru_cache(maxsize=None)
def _offers_post_limit(cls: type) -> bool:
    """Whether an adapter class offers ``PostLimit`` (answers in parts): once per class, as for provider keys."""
    return issubclass(cls, PostLimit)


def _with_shown(out: Outcome, shown: dict[int, str | None]) -> Outcome:
    """A stream's Outcome, honest about the parts it had shown when it stopped (the next composition edits them)."""
    if not any(shown.values()):
        return out
    parts = tuple(PartOutcome(k, st.CLOSED if rid else None, rid) for k, rid in sorted(shown.items()))
    landed = sum(1 for p in parts if p.landed)
    return dataclasses.replace(out, parts=parts, reply_id=out.reply_id or parts[0].reply_id,
                               detail=f"{landed} part(s) shown before the stream stopped; {out.detail}".rstrip("; "))


@functools.lru_cache(maxsize=None)
def _offers_edits(cls: type) -> bool:
    """Whether adapters of ``cls`` can edit a reply (``EditReply``); once per class, as ``_offers_post_limit``."""
    return issubclass(cls, EditReply)


@functools.lru_cache(maxsize=None)
def _offers_provider_keys(cls: type) -> bool:
    """Whether an adapter class offers ``ProviderKeys``: once per class, because a runtime Protocol check costs
    about 16 µs, a tenth of a SQLite post (measured by ``make bench`` section 1)."""
    return issubclass(cls, ProviderKeys)


# The most parents one page claim takes: the sends of a page leave one after another (on the sync face) from one
# open commit, and each eats the budget of those after it (``_budget_steps``), so a page stays short.
PAGE_MAX = 16


def page_chunks(items: list[Any], size: int) -> list[list[Any]]:
    """``items`` cut into lists of at most ``size``."""
    return [items[i:i + size] for i in range(0, len(items), size)]


class GuardCore:
    """The guard's decisions for one bot on one platform, each parent at most once; faces run their effects."""

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
        stream_edit_interval_s: float = 1.0,
        stream_idle_s: float = 60.0,
    ) -> None:
        self.store = store
        # A streamed answer's reply is edited at most this often (platforms rate-limit edits: Slack's chat.update
        # is Tier 3, Discord 5 per 5 s per channel); a stream silent for ``stream_idle_s`` has failed.
        self.stream_edit_interval_s = stream_edit_interval_s
        self.stream_idle_s = stream_idle_s
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
        # The face's watch starts with the first send; None: the caller ticks ``watch_sends`` itself (tests).
        self._watch_interval_s = None if watch_interval_s is None else min(watch_interval_s, send_timeout_s / 4)

    def key(self, parent_id: str) -> Key:
        """Return the answered-log key for ``parent_id`` exactly as given."""
        return Key(self.platform.instance, self.identity.sender_id, parent_id)

    def provider_key(self, parent_id: str) -> str:
        """Return the idempotency key for this parent: the same on every attempt."""
        if _offers_provider_keys(type(self.platform)):
            return cast(ProviderKeys, self.platform).provider_key(self.identity.sender_id, parent_id)
        return default_provider_key(self.platform.instance, self.identity.sender_id, parent_id)

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

    def _start_watch(self) -> None:
        """Start the face's send watch (a thread, or a task); the core only asks for it."""

    _named_holder = False  # a library lease's holder is named by its caller (begin_reply): that name is the lease

    def _lease_token(self) -> str:
        """The holder a new composing claim writes: this guard and this claim, so a composer that outlived its
        lease finds the key not its own once it was claimed again, even by this guard on another path."""
        return self.owner if self._named_holder else f"{self.owner}/{next(_LEASES)}"

    def _as_holder(self, owner: str) -> Any:
        """The same guard acting as ``owner``, so claims and lease checks name the lease's holder.

        A shallow copy: it shares the store, the adapter and the send watch. Its sends are watched by
        the guard's own watch (started here), so a copy never starts one of its own.
        """
        if self._watch_interval_s is not None:
            self._start_watch()
        holder = copy.copy(self)
        holder.owner = owner
        holder._named_holder = True
        holder._watch_interval_s = None
        return holder

    # -- read-only ---------------------------------------------------------------

    def check_steps(self, parent_id: str) -> Steps:
        """What blocks ``post`` for ``parent_id``, read-only; None if a post would claim it."""
        key = self.key(parent_id)
        row = yield io(self.store.peek, key)
        if row is None or self._claimable(row, self.clock.now()) or row.state == st.PARTS:
            return None  # an answer in parts: a post resumes it at its first part not closed
        return _classify(row, key, self.clock.now())

    def retire_steps(self, parent_id: str, reason: str) -> Steps:
        """End a row that waits to be offered again (released, not_landed, an expired composing lease) as
        ``skipped`` with ``reason``: the policy rules its parent out for good. True if this call moved it."""
        key = self.key(parent_id)
        row = yield io(self.store.peek, key)
        now = self.clock.now()
        # An answer in parts the policy now rules out ends too (its landed parts stay; explain shows them).
        if row is None or not (self._claimable(row, now, backoff=False) or row.state == st.PARTS):
            return False
        values = {"state": st.SKIPPED, "updated_at": now, "error": f"policy: {reason}", "lease_owner": None,
                  "lease_until": None, "not_before": None}
        ok = yield io(
            self.store.cas_event,
            key, states=[row.state], attempt=row.attempt, values=values, lease_owner=st.lease_holder(row),
            event={"kind": "retired", "state": st.SKIPPED, "attempt": row.attempt, "owner": self.owner,
                   "detail": {"reason": reason, "from": row.state}},
            relaxed=True, doing="retiring",
        )
        if ok:
            log.info("replyd.guard.retired", parent_id=parent_id, reason=reason, previous=row.state)
        return ok

    # -- the one posting function ---------------------------------------------------

    def post_steps(self, parent: Parent, text: str | Compose, *, path: str = "api",
                   claimed: st.Row | None = None) -> Steps:
        """Reply to ``parent`` at most once; ``text`` is the reply or a responder to call once. ``claimed``: the
        row a page claim (``claim_page_steps``) already took for it, so this post starts after the claim."""
        key = self.key(parent.id)
        if claimed is None and not self.claiming:
            return Outcome(Status.NOT_SENT, key, detail="shutting down")
        compose = None if isinstance(text, str) else text
        if self.dry_run:
            return (yield from self._shadow_steps(key, parent, text, path))
        ticket = yield from self._admit_steps(key, parent, path, hold=compose is not None and claimed is None)
        if isinstance(ticket, Outcome):
            if claimed is not None:  # the page claimed it before the breaker opened: hand it back, unsent
                yield from self._unclaim_steps(key, claimed, ticket)
            return ticket
        try:
            return (yield from self._post_steps(key, parent, text, compose, path, ticket, claimed))
        finally:
            if self.breaker is not None:
                self.breaker.abandon(ticket)  # a no-op once the send was recorded

    def _post_steps(self, key: Key, parent: Parent, text: str | Compose, compose: Compose | None, path: str,
                    ticket: Ticket, claimed: st.Row | None = None) -> Steps:
        """``post`` once the breaker let the call through: claim (unless the page did), compose, open, send."""
        # A text longer than one post is claimed as an answer to compose (never open whole), then stored in parts.
        long_text = isinstance(text, str) and claimed is None and len(self.split(parent, text)) > 1
        claim = claimed if claimed is not None else (
            yield Step("_claim", (key, parent, path, None if compose or long_text else text)))
        if isinstance(claim, Outcome):
            if claim.state == st.PARTS:  # composed and stored before: resume at its first part not closed
                return (yield from self.parts_steps(key, parent, ticket))
            return claim
        row = claim
        if compose is not None or long_text:
            # A retry (the last attempt proven not landed) sends the answer composed for it, never a new one.
            stored = (yield io(self.store.answer, key)) if compose is not None and row.attempt > 1 else None
            if stored:
                body = "\n\n".join(stored)
            elif compose is not None:
                if claimed is not None and not (yield from self._renew_lease_steps(key, row)):
                    # The page held it for a short while; this compose takes the whole lease, as a claim does.
                    return (yield from self._lost_lease_steps(key))
                written = yield from self._compose_steps(key, parent, row, compose, ticket)
                if isinstance(written, Outcome):
                    return written
                body = written
            else:
                body = cast(str, text)  # no responder: the text itself (too long for one post)
            paused = yield from self._paused_steps(key, row, ticket)
            if paused is not None:
                return paused
            pieces = self.split(parent, body)
            # A stream cut short posted parts already: this composition finishes that answer in parts (editing
            # them), even when it fits one post, never a second reply to the parent.
            if len(pieces) > 1 or (compose is not None and (yield from self._streamed_before_steps(parent))):
                stored = yield from self._store_answer_steps(key, row, pieces)
                if isinstance(stored, Outcome):
                    return stored
                return (yield from self.parts_steps(key, parent, ticket))
            row = yield Step("_open_composed", (key, row, body))
            if isinstance(row, Outcome):
                return row
        else:
            body = cast(str, text)  # no responder: the text itself
        out = yield Step("_send", (key, parent, row, body))
        yield from self._record_steps(ticket, key, row.attempt, out)
        return out

    # -- an answer in several parts (replyd.parts) ---------------------------------------------------

    def split(self, parent: Parent, text: str) -> list[str]:
        """``text`` as the parts a reply to ``parent`` is sent in: one unless the adapter's ``PostLimit`` says
        it is too long for one post."""
        if not _offers_post_limit(type(self.platform)):
            return [text]
        limit = cast(PostLimit, self.platform).post_limit(parent)
        if limit is None:
            return [text]
        try:
            pieces = split(text, limit)
        except ValueError:
            return [text]  # too many parts: sent whole, the platform refuses it (Rejected), as before
        return pieces if len(pieces) > 1 else [text]

    def _store_answer_steps(self, key: Key, row: Reply | st.Row, pieces: list[str]) -> Steps:
        """The composed answer's parts, durable before the first part leaves: our composing claim becomes
        ``parts`` (only while our lease holds) and the parts are stored, in one durable transaction."""
        now = self.clock.now()
        values = {"state": st.PARTS, "updated_at": now, "text_hash": text_hash("\n".join(pieces)),
                  "lease_owner": None, "lease_until": None, "deadline_at": None}

        def store_answer() -> bool:
            with self.store.transaction(doing="storing a composed answer") as tx:
                if not tx.cas_event(key, states=[st.COMPOSING], attempt=row.attempt, values=values,
                                    lease_owner=_holder(row),
                                    event={"kind": "composed", "state": st.PARTS, "attempt": row.attempt,
                                           "owner": self.owner, "detail": {"parts": len(pieces)}}):
                    return False
                tx.put_answer(key, pieces, at=now)
                return True

        if not (yield io(store_answer)):
            return (yield from self._lost_lease_steps(key))
        log.info("replyd.guard.composed", platform=key.platform, parent_id=key.parent_id, parts=len(pieces))
        return None

    def parts_steps(self, key: Key, parent: Parent, ticket: Ticket | None, *, posted: bool = False) -> Steps:
        """Send a stored answer's parts in order, from its first part not closed; close the parent's row when
        every part is closed. Each part is a row of its own (key: ``part_id``), claimed, sent and closed as any
        reply is (the sweep bounds it); part k+1 goes out only once part k is closed (it answers part k).

        A part that is not closed and not ours to claim (in flight, waiting for the sweep, backing off) stops
        the walk: the next offer of the parent resumes it. A part that ended for good (rejected, gave up,
        unconfirmed) ends the parent's row in the same state. The responder is never called here. ``posted``:
        this call's stream posted parts already (the answer is ``posted``, not ``already_answered``).
        """
        pieces = yield io(self.store.answer, key)
        header = yield io(self.store.peek, key)
        if not pieces or header is None or header.state != st.PARTS:
            current = header
            return _classify(current, key, self.clock.now()) if current else Outcome(Status.IN_FLIGHT, key)
        n = len(pieces)
        seen: list[PartOutcome] = []
        target, sent_any, first = parent, posted, None
        for k, piece in enumerate(pieces, 1):
            pkey = self.key(part_id(parent.id, k))
            now = self.clock.now()
            prow = yield io(self.store.peek, pkey)
            if prow is None or prow.state != st.CLOSED:
                if prow is not None and not self._claimable(prow, now):
                    return (yield from self._part_stopped(key, header, pkey, prow, k, n, seen, pieces))
                part_ticket = ticket if ticket is not None and not sent_any else None
                if self.breaker is not None and part_ticket is None and ticket is not None:
                    part_ticket = yield from self._admit_steps(pkey, target, PART_PATH, hold=False)
                    if isinstance(part_ticket, Outcome):
                        return self._parts_outcome(part_ticket.status, key, header, seen, pieces,
                                                   f"part {k} of {n}: {part_ticket.detail}",
                                                   part_ticket.retry_after_s)
                try:
                    claim = yield Step("_claim", (pkey, target, PART_PATH, piece))
                    if isinstance(claim, Outcome):
                        current = yield io(self.store.peek, pkey)
                        if current is None or current.state != st.CLOSED:
                            return (yield from self._part_stopped(key, header, pkey, current, k, n, seen, pieces))
                        prow = current
                    else:
                        out = yield Step("_send", (pkey, target, claim, piece))
                        if part_ticket is not None:
                            yield from self._record_steps(part_ticket, pkey, claim.attempt, out)
                        sent_any = sent_any or out.status is Status.POSTED
                        if out.status not in (Status.POSTED, Status.ALREADY_ANSWERED):
                            if out.state in (st.REJECTED, st.GAVE_UP, st.UNCONFIRMED):  # the answer ends too
                                current = yield io(self.store.peek, pkey)
                                return (yield from self._part_stopped(key, header, pkey, current, k, n, seen,
                                                                      pieces))
                            seen.append(PartOutcome(k, out.state, out.reply_id))
                            return self._parts_outcome(out.status, key, header, seen, pieces,
                                                       f"part {k} of {n}: {out.detail or out.status.value}",
                                                       out.retry_after_s)
                        prow = st.Row.of(pkey, {"state": st.CLOSED, "reply_id": out.reply_id})
                finally:
                    if part_ticket is not None and part_ticket is not ticket and self.breaker is not None:
                        self.breaker.abandon(part_ticket)
            elif prow.text_hash not in (None, text_hash(piece)) and self._edits:
                # Shown by a stream with an earlier text: the part is edited to its final text, never re-posted.
                edited = yield from self._edit_steps(pkey, target, prow.reply_id, piece, record=True)
                sent_any = sent_any or edited == "edited"  # this call finished the answer the platform shows
                if edited == "failed":  # the parent stays in ``parts``: its next offer edits again
                    seen.append(PartOutcome(k, st.CLOSED, prow.reply_id))
                    return self._parts_outcome(Status.IN_FLIGHT, key, header, seen, pieces,
                                               f"part {k} of {n}: its final text is not shown yet (edit failed)")
            seen.append(PartOutcome(k, st.CLOSED, prow.reply_id))
            first = first or prow.reply_id
            if k < n:
                target = cast(PostLimit, self.platform).part_parent(parent, prow.reply_id)
        closed = yield from self._answered_steps(key, header, seen)
        if isinstance(closed, Outcome):
            return closed
        status = Status.POSTED if sent_any else Status.ALREADY_ANSWERED
        return Outcome(status, key, st.CLOSED, header.attempt, first, detail=f"{n} parts", parts=tuple(seen))

    def _parts_outcome(self, status: Status, key: Key, header: Reply | st.Row, seen: list[PartOutcome],
                       pieces: list[str], detail: str, retry_after_s: float | None = None) -> Outcome:
        """A partly sent answer, honestly: the parts seen so far (the rest not claimed yet) and what stopped it."""
        parts = tuple(seen) + tuple(PartOutcome(k) for k in range(len(seen) + 1, len(pieces) + 1))
        landed = sum(1 for p in parts if p.landed)
        first = parts[0].reply_id if parts and parts[0].landed else None
        return Outcome(status, key, st.PARTS, header.attempt, first,
                       detail=f"{landed} of {len(pieces)} parts landed; {detail}", retry_after_s=retry_after_s,
                       parts=parts)

    def _part_stopped(self, key: Key, header: Reply | st.Row, pkey: Key, prow: st.Row | None, k: int, n: int,
                      seen: list[PartOutcome], pieces: list[str]) -> Steps:
        """Part ``k`` is not closed and not ours: in flight (the answer waits), or ended for good (so does it)."""
        now = self.clock.now()
        out = _classify(prow, pkey, now) if prow is not None else Outcome(Status.IN_FLIGHT, pkey)
        seen.append(PartOutcome(k, prow.state if prow is not None else None, out.reply_id))
        if prow is not None and prow.state in (st.REJECTED, st.GAVE_UP, st.UNCONFIRMED):
            # The answer cannot be completed on its own: the parent's row says so (an operator rearms it).
            values = {"state": prow.state, "updated_at": now, "error": f"part {k} of {n}: {prow.error or prow.state}"}
            yield io(self.store.cas_event, key, states=[st.PARTS], attempt=header.attempt, values=values,
                     event={"kind": f"part_{prow.state}", "state": prow.state, "attempt": header.attempt,
                            "owner": self.owner, "detail": {"part": k, "parts": n}},
                     relaxed=True, doing="ending an answer in parts")
            log.error("replyd.guard.part_ended", platform=key.platform, parent_id=key.parent_id, part=k, parts=n,
                      state=prow.state)
        return self._parts_outcome(out.status, key, header, seen, pieces, f"part {k} of {n} {out.status.value}",
                                   out.retry_after_s)

    def _answered_steps(self, key: Key, header: Reply | st.Row, seen: list[PartOutcome]) -> Steps:
        """Every part is closed: close the parent's row with the first part's reply (the parts verify alone)."""
        now = self.clock.now()
        first = seen[0].reply_id
        values = {"state": st.CLOSED, "reply_id": first, "closed_at": now, "updated_at": now, "error": None,
                  "deadline_at": None}
        try:
            yield io(self.store.cas_event, key, states=[st.PARTS], attempt=header.attempt, values=values,
                     event={"kind": "answered", "state": st.CLOSED, "attempt": header.attempt, "owner": self.owner,
                            "detail": {"parts": [p.reply_id for p in seen]}},
                     relaxed=True, doing="closing an answer in parts")
        except StoreError as exc:  # every part is closed; the next offer closes the parent's row
            log.error("replyd.guard.close_failed", parent_id=key.parent_id, error=str(exc))
        log.info("replyd.guard.answered", platform=key.platform, parent_id=key.parent_id, parts=len(seen))
        return None

    # -- the write-path breaker (replyd.breaker) -----------------------------------------------

    def _admit_steps(self, key: Key, parent: Parent, path: str, *, hold: bool) -> Steps:
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
                      "snapshot": snapshot_json(parent), "author_id": parent.author_id[:255],
                      "origin_id": parent.origin_id, "owner": self.owner,
                      "provider_key": self.provider_key(parent.id), "not_before": now + wait_s,
                      "error": "breaker open: sends paused"}
            reason = self.breaker.reason

            def hold_row() -> None:
                with self.store.transaction(relaxed=True, doing="holding a parent while sends are paused") as tx:
                    if tx.insert_new(key, values):
                        tx.append_event(key, "held", state=st.RELEASED, attempt=1, owner=self.owner,
                                        detail={"path": path, "reason": reason})

            try:
                yield io(hold_row)
            except StoreError as exc:  # nothing was claimed or sent: the next discovery offers it again
                log.warning("replyd.guard.hold_failed", parent_id=key.parent_id, error=str(exc))
        return Outcome(Status.NOT_SENT, key, detail="breaker open: sends paused", retry_after_s=wait_s)

    def _paused_steps(self, key: Key, row: Reply | st.Row, ticket: Ticket) -> Steps:
        """The breaker opened while this claim composed: release it before the open commit (no attempt used)."""
        if self.breaker is None or ticket.kind is not Admit.SEND or not self.breaker.is_open:
            return None
        wait_s = self.breaker.retry_in_s()
        error = "breaker open: sends paused"
        detail = {"error": error, "not_before": self.clock.now() + wait_s}
        if not (yield from self._transition_steps(key, [st.COMPOSING], row.attempt, st.RELEASED, "held", detail,
                                                  relaxed=True, lease_owner=_holder(row))):
            return (yield from self._lost_lease_steps(key))
        return Outcome(Status.NOT_SENT, key, st.RELEASED, row.attempt, detail=error, retry_after_s=wait_s)

    def _record_steps(self, ticket: Ticket, key: Key, attempt: int, out: Outcome) -> Steps:
        """Tell the breaker the send's fate; mark the sends an outage swallowed (the sweep excuses them)."""
        if self.breaker is None:
            return
        if out.status is Status.NOT_SENT:
            # A 429, or a request never built (NotBuilt), says nothing about the platform: both set retry_after_s.
            failed: bool | None = None if out.retry_after_s is not None else True
        else:
            failed = out.status is Status.UNCERTAIN
        for ref in self.breaker.record(ticket, (key, attempt), failed):
            k, a = cast("tuple[Key, int]", ref)  # the refs are the (key, attempt) pairs handed to record
            try:
                yield io(self._mark_outage, k, a)
            except StoreError as exc:  # the sweep's own look at the breaker still excuses it in this process
                log.warning("replyd.guard.outage_mark_failed", parent_id=k.parent_id, error=str(exc))

    def _mark_outage(self, key: Key, attempt: int) -> None:
        """Mark ``attempt``'s send as swallowed by an outage, so the sweep's not-landed proof of it is excused.

        The sends that open the breaker fail over several seconds: the sweep may already have judged the first
        ones (counted) before the pattern was seen. Such an attempt is excused here, once, in the same
        transaction; a ``gave_up`` it caused is undone when the attempts left then allow a retry. (One
        transaction: a face runs it whole, as one store call.)
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

    # -- claim, compose, open ------------------------------------------------------------------

    def _claim_values(self, parent: Parent, path: str, text: str | None, now: float, *,
                      lease_s: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A claim's values: (those it writes on any row, a new row's): ``open`` with ``text``, else ``composing``
        with a lease of ``lease_s`` (default ``compose_lease_s``)."""
        if text is not None:
            state, extra = st.OPEN, self._open_values(now, text)
        else:
            until = now + (self.compose_lease_s if lease_s is None else lease_s)
            state, extra = st.COMPOSING, {"lease_owner": self._lease_token(), "lease_until": until}
        common = {
            "state": state,
            "updated_at": now,
            "path": path,
            "snapshot": snapshot_json(parent),
            "author_id": parent.author_id[:255],
            "origin_id": parent.origin_id,  # the sender, when the answer goes elsewhere: the caps count both
            "owner": self.owner,
            **extra,
        }
        return common, {**common, "attempt": 1, "created_at": now, "provider_key": self.provider_key(parent.id)}

    def _reclaim_values(self, row: st.Row, common: dict[str, Any], now: float) -> dict[str, Any] | None:
        """The values a claim compares-and-sets on the row that stands, or None when it is not claimable."""
        if not self._claimable(row, now):
            return None
        attempt = row.attempt + 1 if row.state == st.NOT_LANDED else row.attempt
        return {**common, "attempt": attempt, "error": None, "not_before": None, "reply_id": None}

    def page_hold_s(self) -> float:
        """How long a page claim holds a ``composing`` row it has not reached yet: no longer than an ``open`` row
        of the page waits for the sweep (the send budget and the listing delay), at most a compose lease. Each
        row takes its own full lease (``compose_lease_s``) right before its compose."""
        return min(self.compose_lease_s, self.send_timeout_s + self.lag.delay_s())

    def claim_page_steps(self, items: list[tuple[Parent, str | None]], path: str) -> Steps:
        """The group claim: a page's keys claimed in ONE durable transaction (``Store.claim_page``): a new key
        inserted, a claimable row (released, not landed, an expired lease) compared-and-set on its (state,
        attempt, lease holder) as read; a text as an ``open`` row, an item with a responder (text None) as a
        ``composing`` row held for ``page_hold_s``. Return, per item, the row it claimed, or None where that post
        claims alone (its key's row is not claimable or moved meanwhile, or its text is longer than one post).
        Fewer than two to claim: none is claimed here (a page of one takes the single path).

        A crash after this commit leaves the unsent ``open`` rows to the sweep (one listing delay: not landed,
        offered again), as a crash right after a single claim would, and the ``composing`` rows it had not
        reached claimable again once their hold ends (no attempt used; re-find's re-offer offers them): the
        same delay. Only the row being composed holds its full lease, as after a single claim.
        """
        # A text longer than one post claims alone (as an answer in parts, never one open row).
        take = [i for i, (p, text) in enumerate(items) if text is None or len(self.split(p, text)) == 1]
        rows: list[st.Row | None] = [None] * len(items)
        if (not self.claiming or self.dry_run or len(take) < 2
                or (self.breaker is not None and self.breaker.is_open)):
            return rows  # nothing to share: each post claims alone (or holds, or shadows)
        keys = [self.key(items[i][0].id) for i in take]
        try:
            found = yield io(self.store.rows_of, keys)
            now = self.clock.now()
            hold = self.page_hold_s()
            event = {"kind": "claimed", "owner": self.owner, "detail": {"path": path}}
            batch: list[tuple[int, Key, dict[str, Any], st.Row | None]] = []
            for i, key, row in zip(take, keys, found, strict=True):
                common, new = self._claim_values(items[i][0], path, items[i][1], now, lease_s=hold)
                values = new if row is None else self._reclaim_values(row, common, now)
                if values is not None:
                    batch.append((i, key, values, row))
            if len(batch) < 2:
                return rows
            made = yield io(self.store.claim_page,
                            [(key, values, event, None if row is None else
                              ([row.state], row.attempt, st.lease_holder(row))) for _, key, values, row in batch],
                            doing="claiming a page")
        except StoreError as exc:
            log.error("replyd.guard.store_failed", parent_id=keys[0].parent_id, page=len(keys), error=str(exc))
            raise
        for (i, key, values, row), created in zip(batch, made, strict=True):
            if created:
                log.info("replyd.guard.claimed", parent_id=key.parent_id, state=values["state"],
                         attempt=values["attempt"], path=path, page=len(batch))
                rows[i] = st.Row.of(key, values) if row is None else st.Row(**{**row.model_dump(), **values})
        return rows

    def page_closes(self, keys: Sequence[Key], rows: Sequence[st.Row | None]) -> PageCloses:
        """What a page's posts leave for its one close transaction: the plain replies of the ``open`` rows it
        claimed. A row it claimed ``composing`` closes at once, as alone: a responder's time between the sends
        would hold the page's closes past their rows' deadlines, and the sweep would read back what is known."""
        return PageCloses(frozenset(k for k, row in zip(keys, rows, strict=True)
                                    if row is not None and row.state == st.OPEN))

    def _unclaim_steps(self, key: Key, row: st.Row, refused: Outcome, kind: str = "held") -> Steps:
        """Release a row the page claimed when the breaker refuses its send (or the page stopped before it):
        nothing was sent, no attempt used."""
        detail = {"error": refused.detail, "not_before": self.clock.now() + (refused.retry_after_s or 0.0)}
        holder = _holder(row) if row.state == st.COMPOSING else None
        return (yield from self._transition_steps(key, [row.state], row.attempt, st.RELEASED, kind, detail,
                                                  relaxed=True, lease_owner=holder))

    def unclaim_page_steps(self, left: Sequence[tuple[Key, st.Row | None]], why: BaseException) -> Steps:
        """The page stopped on ``why`` before these posts began: hand the rows it claimed for them back
        (``released``, no attempt used, claimable at once), so the next offer needs no sweep or hold to end. A
        store that refuses leaves the rest as they are: ``open`` for the sweep, ``composing`` until the hold ends."""
        refused = Outcome(Status.NOT_SENT, left[0][0] if left else self.key(""),
                          detail=f"page stopped: {type(why).__name__}"[:300])
        for key, row in left:
            if row is None:
                continue
            try:
                if not (yield from self._unclaim_steps(key, row, refused, "page_stopped")):
                    return None
            except ContentionError as exc:
                log.warning("replyd.guard.contended", parent_id=key.parent_id, error=str(exc)[:300])
                return None
        return None

    def claim_steps(self, key: Key, parent: Parent, path: str, text: str | None) -> Steps:
        """Take the key atomically; return the claimed row, or an Outcome if not ours."""
        now = self.clock.now()
        common, new = self._claim_values(parent, path, text, now)
        # The key's own provider key: a part's (its key derived from the parent's), not its parent's.
        new["provider_key"] = self.provider_key(key.parent_id)
        state = common["state"]

        def reclaim(row: st.Row) -> dict[str, Any] | None:
            # The row exists: ours only if claimable, compared-and-set on the (state, attempt) read here.
            return self._reclaim_values(row, common, now)

        try:
            # One transaction: the row (inserted, or compared-and-set) and its "claimed" event; durable unless composing.
            won, row, values = yield io(self.store.claim, key, new, reclaim,
                                        {"kind": "claimed", "owner": self.owner, "detail": {"path": path}},
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

    def _shadow_steps(self, key: Key, parent: Parent, text: str | Compose, path: str) -> Steps:
        """Dry run: write the reply once, log and record it as ``would_post``; claim and send nothing."""
        now = self.clock.now()
        row = yield io(self.store.get, key)
        if row is not None and not self._claimable(row, now):
            return _classify(row, key, now)
        # One responder call per parent, even though nothing is claimed: later offers see this event.
        if (yield io(self.store.last_event, key, ["would_post"])) is not None:
            return Outcome(Status.DRY_RUN, key, detail="dry run: shown before")
        if isinstance(text, str):
            body: str | None = text
        else:
            try:
                body = yield Respond(text, parent)
            except Exception as exc:
                detail = f"{type(exc).__name__}: {getattr(exc, 'detail', '') or exc}"[:300]
                log.warning("replyd.guard.responder_failed", parent_id=key.parent_id, error=detail, dry_run=True)
                return Outcome(Status.NOT_SENT, key, detail=f"dry run: {detail}")
        if not body or not body.strip():
            yield io(self.store.record, key, "would_decline", owner=self.owner, detail={"path": path})
            return Outcome(Status.DECLINED, key, detail="dry run: the responder declined")
        log.info("replyd.guard.would_post", parent_id=key.parent_id, path=path, text=body[:500])
        yield io(self.store.record, key, "would_post", owner=self.owner,
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

    def _compose_steps(self, key: Key, parent: Parent, row: Reply, compose: Compose,
                       ticket: Ticket | None = None) -> Steps:
        """Call the responder once for a composing claim; release or decline on failure. A streamed answer on a
        platform that edits is shown as it comes and ends here as the whole post's Outcome (``_stream_steps``)."""
        try:
            text = yield Respond(compose, parent, stream=self._edits)
        except Exception as exc:  # a responder failure costs no attempt: the row goes back, with a backoff
            return (yield from self._responder_failed_steps(key, row, exc))
        if isinstance(text, Stream):
            return (yield from self._stream_steps(key, parent, row, text, ticket))
        if not text or not text.strip():
            return (yield from self._declined_steps(key, row))
        return text

    def _responder_failed_steps(self, key: Key, row: Reply | st.Row, exc: BaseException) -> Steps:
        """The responder (or its stream) failed: the row goes back ``released`` with a doubling backoff."""
        detail = (getattr(exc, "detail", "") or f"{type(exc).__name__}: {exc}")[:300]
        wait_s = yield from self._backoff_steps(key)
        nb = self.clock.now() + wait_s
        log.warning("replyd.guard.responder_failed", parent_id=key.parent_id, error=detail, backoff_s=wait_s)
        # Only while our lease holds: a composer that outlived it must not undo the new holder's work.
        if not (yield from self._transition_steps(key, [st.COMPOSING], row.attempt, st.RELEASED,
                                                  "responder_failed",
                                                  {"error": detail, "not_before": nb, "backoff_s": wait_s},
                                                  relaxed=True, lease_owner=_holder(row))):
            return (yield from self._lost_lease_steps(key))
        return Outcome(Status.NOT_SENT, key, st.RELEASED, row.attempt, detail=detail, retry_after_s=wait_s)

    def _declined_steps(self, key: Key, row: Reply | st.Row) -> Steps:
        """The responder wrote nothing: the row ends ``declined`` (only while our lease holds)."""
        if not (yield from self._transition_steps(key, [st.COMPOSING], row.attempt, st.DECLINED, "declined", {},
                                                  relaxed=True, lease_owner=_holder(row))):
            return (yield from self._lost_lease_steps(key))
        return Outcome(Status.DECLINED, key, st.DECLINED, row.attempt)

    # -- a streamed answer (replyd.stream) -------------------------------------------------------------

    @property
    def _edits(self) -> bool:
        """Whether this platform can edit a reply, so a streamed answer is shown as it comes."""
        return _offers_edits(type(self.platform))

    def _stream_steps(self, key: Key, parent: Parent, row: Reply | st.Row, stream: Stream,
                      ticket: Ticket | None) -> Steps:
        """Show a streamed answer as it comes, then store it and finish it as an answer in parts.

        The parent's row stays ``composing`` under our lease (renewed as text comes) until the stream ends; each
        part is posted once, under its own key, when it has text (part k+1 once part k filled and was frozen,
        answering it), and edited at most every ``stream_edit_interval_s`` while it grows. A part already
        closed by an earlier composition of this answer (a stream cut by a crash) is edited, never posted
        again; a part whose send is ambiguous is left alone (no edit, no second send). At the end the parts are
        stored (``parts``, durable) and ``parts_steps`` sends what is missing and edits every closed part whose
        text is not its final text, so the last edit carries the final text.
        """
        limit = self._limit(parent)
        # Room for a "(k/n)" marker: the count is unknown while the answer streams, so the widest is kept.
        size = None if limit is None else limit.size - (len(f" ({50}/{50})") if limit.marker else 0)
        unit = limit.unit if limit is not None else "chars"
        frozen: list[str] = []
        tail = ""
        shown: dict[int, str | None] = {}  # part -> its reply id, or None: not ours to show (ambiguous, foreign)
        targets: list[Parent] = [parent]  # what part k answers: targets[k - 1]
        last_show: float | None = None
        renew_at = self.clock.now() + self.compose_lease_s / 3
        while True:
            try:
                chunk = yield Pull(stream, self.stream_idle_s)
            except Exception as exc:  # the stream failed: as a responder failure; the parts shown stay
                yield Pull(stream, 0.0, close=True)
                failed = yield from self._responder_failed_steps(key, row, exc)
                return _with_shown(failed, shown)
            if chunk is None:
                break
            tail += chunk
            now = self.clock.now()
            if now >= renew_at:
                if not (yield from self._renew_lease_steps(key, row)):
                    yield Pull(stream, 0.0, close=True)
                    return _with_shown((yield from self._lost_lease_steps(key)), shown)
                renew_at = now + self.compose_lease_s / 3
            while size is not None and length(tail.strip(), unit) > size and len(frozen) < MAX_PARTS:
                piece, tail = head(tail, size, unit)
                frozen.append(piece)
                yield from self._show_steps(key, parent, len(frozen), piece, shown, targets, ticket, final=True)
                last_show = None
            if len(frozen) == MAX_PARTS:  # a runaway stream: no more posts than any answer may have
                log.warning("replyd.guard.stream_cut", platform=key.platform, parent_id=key.parent_id,
                            parts=MAX_PARTS)
                yield Pull(stream, 0.0, close=True)
                tail = ""
                break
            if tail.strip() and (last_show is None or now - last_show >= self.stream_edit_interval_s):
                yield from self._show_steps(key, parent, len(frozen) + 1, tail.strip(), shown, targets, ticket,
                                            final=False)
                last_show = now
        pieces = frozen + ([tail.strip()] if tail.strip() else [])
        if not pieces:
            return (yield from self._declined_steps(key, row))
        if limit is not None and limit.marker and len(pieces) > 1:
            pieces = [f"{p} ({k}/{len(pieces)})" for k, p in enumerate(pieces, 1)]
        log.info("replyd.guard.streamed", platform=key.platform, parent_id=key.parent_id, parts=len(pieces),
                 shown=sum(1 for r in shown.values() if r))
        if ticket is not None and not shown:  # a breaker that opened meanwhile holds an answer nothing showed
            paused = yield from self._paused_steps(key, row, ticket)
            if paused is not None:
                return paused
        stored = yield from self._store_answer_steps(key, row, pieces)
        if isinstance(stored, Outcome):
            return stored
        return (yield from self.parts_steps(key, parent, None if shown else ticket,
                                            posted=any(r is not None for r in shown.values())))

    def _streamed_before_steps(self, parent: Parent) -> Steps:
        """Whether an earlier, cut-short stream of the answer to ``parent`` left a part row (only where edits are)."""
        if not self._edits:
            return False
        return (yield io(self.store.peek, self.key(part_id(parent.id, 1)))) is not None

    def _limit(self, parent: Parent) -> Limit | None:
        """The adapter's post limit for a reply to ``parent`` (None: one post of any length)."""
        return cast(PostLimit, self.platform).post_limit(parent) if _offers_post_limit(type(self.platform)) else None

    def _renew_lease_steps(self, key: Key, row: Reply | st.Row) -> Steps:
        """Push our composing lease on (while a stream still comes; as a page's row starts its compose); False if
        it is no longer ours."""
        now = self.clock.now()
        return (yield io(self.store.cas_event, key, states=[st.COMPOSING], attempt=row.attempt,
                         values={"lease_until": now + self.compose_lease_s, "updated_at": now},
                         lease_owner=_holder(row), relaxed=True, doing="renewing a compose lease"))

    def _show_steps(self, key: Key, parent: Parent, k: int, text: str, shown: dict[int, str | None],
                    targets: list[Parent], ticket: Ticket | None, *, final: bool) -> Steps:
        """Show part ``k`` of a streaming answer with ``text``: post it the first time (once, under its key), or
        edit its reply; ``final``: the part is frozen (its text will not change), so its row records it."""
        pkey = self.key(part_id(parent.id, k))
        if k not in shown:
            shown[k] = None  # until proven ours: an ambiguous send, a part in flight elsewhere, no known target
            prow = (yield io(self.store.peek, pkey)) if len(targets) >= k else None
            if prow is not None and prow.state == st.CLOSED:
                shown[k] = prow.reply_id  # posted by an earlier composition (a cut stream): edited below
            elif len(targets) >= k and (prow is None or self._claimable(prow, self.clock.now())):
                claim = yield Step("_claim", (pkey, targets[k - 1], PART_PATH, text))
                if isinstance(claim, Outcome):
                    shown[k] = claim.reply_id if claim.state == st.CLOSED else None
                else:
                    out = yield Step("_send", (pkey, targets[k - 1], claim, text))
                    if ticket is not None and k == 1:
                        yield from self._record_steps(ticket, pkey, claim.attempt, out)
                    if out.status is Status.POSTED:
                        shown[k] = out.reply_id
                        self._next_target(parent, k, shown, targets)
                        return None  # it shows ``text`` already
            if shown[k] is not None:
                self._next_target(parent, k, shown, targets)
        reply_id = shown[k]
        if reply_id is not None:
            yield from self._edit_steps(pkey, targets[k - 1], reply_id, text, record=final)
        return None

    def _next_target(self, parent: Parent, k: int, shown: dict[int, str | None], targets: list[Parent]) -> None:
        """Part ``k`` has its reply: the part after it answers that (a thread chain where the platform has one)."""
        if len(targets) == k and _offers_post_limit(type(self.platform)):
            reply_id = cast(str, shown[k])  # set: both callers saw part k's reply
            targets.append(cast(PostLimit, self.platform).part_parent(targets[0], reply_id))

    def _edit_steps(self, pkey: Key, target: Parent, reply_id: str, text: str, *, record: bool) -> Steps:
        """Edit a part's reply to ``text``: "edited", "refused" (the platform will not: logged and noted on the
        part, which keeps its text), or "failed" (outcome unknown three times). An edit sets the whole text, so
        an unknown outcome is tried again. ``record``: the part's row notes the text's hash, so a resumed
        answer knows whether the platform still shows an older text."""
        for tries in range(3):
            try:
                yield Edit(target, reply_id, text, self.send_timeout_s)
            except Rejected as exc:
                log.error("replyd.guard.edit_refused", platform=pkey.platform, parent_id=pkey.parent_id,
                          reply_id=reply_id, error=str(exc)[:300])
                yield io(self.store.record, pkey, "edit_refused", owner=self.owner,
                         detail={"reply_id": reply_id, "error": str(exc)[:300]})
                return "refused"
            except PlatformError as exc:  # not sent, maybe sent, rate limited: the next edit carries it all
                log.warning("replyd.guard.edit_failed", platform=pkey.platform, parent_id=pkey.parent_id,
                            reply_id=reply_id, error=str(exc)[:300], tries=tries + 1)
                continue
            if record:
                now = self.clock.now()
                yield io(self.store.cas_event, pkey, states=[st.CLOSED], attempt=None,
                         values={"text_hash": text_hash(text), "updated_at": now}, relaxed=True,
                         doing="noting an edited part")
            return "edited"
        return "failed"

    def _lost_lease_steps(self, key: Key) -> Steps:
        """Report what stands after our compose lease was taken over (or the store refused the write)."""
        current = yield io(self.store.peek, key)
        log.warning("replyd.guard.lease_lost", parent_id=key.parent_id, state=current.state if current else None)
        return _classify(current, key, self.clock.now()) if current else Outcome(Status.IN_FLIGHT, key)

    def _backoff_steps(self, key: Key, kind: str = "responder_failed",
                       after_kinds: tuple[str, ...] = ("opened", "rearmed")) -> Steps:
        """How long to wait before offering ``key`` again: the responder's back-off, doubling per ``kind`` event
        since the last of ``after_kinds`` (responder failures in a row; releases of an unbuildable request)."""
        try:
            n = yield io(self.store.count_events, key, kind, after_kinds=after_kinds)
        except StoreError:
            n = 0
        return min(self.responder_backoff_max_s, self.responder_backoff_s * 2.0 ** n)

    def open_steps(self, key: Key, row: Reply | st.Row, text: str) -> Steps:
        """Turn our composing claim into a durable open row, unless the lease was lost."""
        now = self.clock.now()
        values = {**self._open_values(now, text), "state": st.OPEN, "updated_at": now}

        # Durable (the send follows), and only while our composing lease holds: one statement, its answer the
        # commit's (the stall before the send is judged on it, tests/test_stall*.py and chaos's stall_open).
        # The composed text is kept in the same commit, for this key's retry (not landed: the same text, no
        # responder call): only the open row's holder writes it, and no transaction of its own (one fewer per
        # composed post: a relaxed commit on SQLite, a round trip on PostgreSQL).
        ok = yield io(
            self.store.cas_event,
            key, states=[st.COMPOSING], attempt=row.attempt, values=values, lease_owner=_holder(row),
            event={"kind": "opened", "state": st.OPEN, "attempt": row.attempt, "owner": self.owner},
            answer=([text], now), doing="opening",
        )
        if not ok:
            current = yield io(self.store.peek, key)
            return _classify(current, key, now) if current else Outcome(Status.IN_FLIGHT, key)
        return st.Row(**{**row.model_dump(), **values})

    # -- the send ------------------------------------------------------------------------------

    def send_steps(self, key: Key, parent: Parent, row: Reply | st.Row, text: str) -> Steps:
        """Send an open row's text (every path sends from here) and record its fate."""
        attempt = row.attempt
        budget_s = yield from self._budget_steps(key, row)  # every path (post, finish, API, MCP) sends from here
        if isinstance(budget_s, Outcome):
            return budget_s
        if self._watch_interval_s is not None:
            self._start_watch()
        token = self.sends.started(key, attempt, self.clock.now())
        try:
            # The whole send, every request in it, ends by the row's send deadline: the sweep's judgement counts on it.
            sent: Sent = yield Send(parent, text, row.provider_key or self.provider_key(parent.id), budget_s, token)
        except AlreadyLanded as exc:
            if exc.reply_id:
                # This call created nothing: the caller learns the reply was already there.
                return (yield Step("_close", (key, attempt, exc.reply_id, "already_landed", Status.ALREADY_ANSWERED)))
            yield from self._note_open_steps(key, attempt, exc)
            return Outcome(Status.UNCERTAIN, key, st.OPEN, attempt, detail=exc.detail)
        except NotBuilt as exc:
            # The request was never handed to the transport (a value from the parent it cannot carry): a provable
            # not-sent. Released, no attempt used, no breaker count (it says nothing about the platform), and
            # offered again after a back-off (a new composition may build); the row's error says why.
            wait_s = yield from self._backoff_steps(key, "released", ("rearmed",))
            log.warning("replyd.guard.not_built", platform=key.platform, parent_id=key.parent_id, attempt=attempt,
                        error=exc.detail[:300], retry_in_s=wait_s)
            yield from self._transition_steps(key, [st.OPEN], attempt, st.RELEASED, "released",
                                              {"error": str(exc), "not_before": self.clock.now() + wait_s,
                                               "not_built": True}, error=exc)
            return Outcome(Status.NOT_SENT, key, st.RELEASED, attempt, detail=exc.detail, retry_after_s=wait_s)
        except RateLimited as exc:
            now = self.clock.now()
            nb = now + (60.0 if exc.retry_after_s is None else exc.retry_after_s)
            yield from self._transition_steps(key, [st.OPEN], attempt, st.RELEASED, "released",
                                              {"error": str(exc), "not_before": nb}, error=exc)
            return Outcome(Status.NOT_SENT, key, st.RELEASED, attempt, detail=exc.detail, retry_after_s=nb - now)
        except DefinitelyNotSent as exc:
            yield from self._transition_steps(key, [st.OPEN], attempt, st.RELEASED, "released", {"error": str(exc)},
                                              error=exc)
            return Outcome(Status.NOT_SENT, key, st.RELEASED, attempt, detail=exc.detail)
        except Rejected as exc:
            yield from self._transition_steps(key, [st.OPEN], attempt, st.REJECTED, "rejected", {"error": str(exc)},
                                              error=exc)
            return Outcome(Status.REJECTED, key, st.REJECTED, attempt, detail=exc.detail)
        except PlatformError as exc:
            yield from self._note_open_steps(key, attempt, exc)
            return Outcome(Status.UNCERTAIN, key, st.OPEN, attempt, detail=exc.detail)
        except Exception as exc:  # an unmapped error after the request may have left: never release
            yield from self._note_open_steps(key, attempt, exc)
            return Outcome(Status.UNCERTAIN, key, st.OPEN, attempt, detail=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self.sends.finished(token)
        page = PAGE_CLOSES.get()
        if page is not None and key in page.keys:
            # Left for the page's one close transaction (close_page_steps); until then the row is open, and a
            # crash leaves it to the sweep, which reads the reply back and closes it (one sweep delay, no resend).
            self.lag.sent(sent.reply_id)
            page.rows.append((key, attempt, sent.reply_id))
            return Outcome(Status.POSTED, key, st.CLOSED, attempt, sent.reply_id)
        return (yield Step("_close", (key, attempt, sent.reply_id, "closed")))

    # -- a send never leaves past its row's deadline ---------------------------------------

    def _budget_steps(self, key: Key, row: Reply | st.Row) -> Steps:
        """Seconds the send about to leave may take, or the Outcome of one too late to leave (nothing sent).

        The sweep may judge the row from its deadline on (``opened_at + send_timeout_s +`` the listing delay,
        on the clock the sweep reads: the database's on PostgreSQL), so a reply must be created by
        ``opened_at + send_timeout_s`` to be listed when it looks. A stall between the open write and here
        (the database's answer held, a paused process or VM) eats that budget: the request gets what is
        left, and when too little is, it does not leave and the row is released (``_too_late_steps``).
        """
        now = self.clock.now()
        opened_at = row.opened_at if row.opened_at is not None else now
        left_s = min(self.send_timeout_s, opened_at + self.send_timeout_s - now)
        if left_s >= MIN_SEND_FRACTION * self.send_timeout_s:
            return left_s
        return (yield from self._too_late_steps(key, row.attempt, now - opened_at))

    def _too_late_steps(self, key: Key, attempt: int, stalled_s: float) -> Steps:
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

        def release() -> str | None:
            with self.store.transaction(relaxed=True, doing="releasing a send too late to leave") as tx:
                before = tx.get(key)
                state = before.state if before is not None else None
                if tx.cas_event(key, states=[st.OPEN, st.NOT_LANDED, st.GAVE_UP], attempt=attempt, values=values):
                    tx.append_event(key, "too_late", state=st.RELEASED, attempt=attempt, owner=self.owner,
                                    detail={**detail, "from": state})
                    return st.RELEASED
                # the row moved on (a newer attempt, closed): a note for explain, no state
                tx.append_event(key, "too_late", state=None, attempt=attempt, owner=self.owner,
                                detail={**detail, "row_state": state})
                return state

        state: str | None = st.OPEN
        try:
            state = yield io(release)
        except StoreError as exc:
            # The row stays open and the sweep judges it not_landed, which is true: nothing was sent.
            log.error("replyd.guard.release_failed", parent_id=key.parent_id, error=str(exc))
        log.warning("replyd.guard.too_late", platform=key.platform, parent_id=key.parent_id, attempt=attempt,
                    stalled_s=round(stalled_s, 3), send_timeout_s=self.send_timeout_s, state=state)
        return Outcome(Status.NOT_SENT, key, state, attempt, detail=error, retry_after_s=0.0)

    # -- sends that outlive their budget ---------------------------------------------------

    def watch_steps(self) -> Steps:
        """Push the deadline of every row whose send has run past half its budget; return how many moved."""
        now = self.clock.now()
        moved = 0
        for token, key, attempt, started in self.sends.overdue(now, self.send_timeout_s / 2):
            try:
                if (yield io(self._extend, token, key, attempt, started, now)):
                    moved += 1
            except StoreError as exc:
                log.warning("replyd.guard.watch_failed", parent_id=key.parent_id, error=str(exc))
                continue
            log.warning("replyd.guard.send_overdue", parent_id=key.parent_id, attempt=attempt,
                        running_s=round(now - started, 3), send_timeout_s=self.send_timeout_s)
        return moved

    def _extend(self, token: int, key: Key, attempt: int, started: float, now: float) -> bool:
        """One running send's deadline pushed on (one transaction, run whole by the face)."""
        with self.store.transaction(relaxed=True, doing="extending a running send") as tx:
            if not tx.cas_event(key, states=[st.OPEN], attempt=attempt, values={"updated_at": now},
                                deadline_at_least=now + self.send_timeout_s + self.lag.delay_s()):
                return False
            if self.sends.first_note(token):  # one note per send, not per tick
                tx.append_event(key, "send_overdue", state=st.OPEN, attempt=attempt,
                                owner=self.owner, detail={"running_s": round(now - started, 3)})
            return True

    # -- the fate of a send --------------------------------------------------------------------

    def close_steps(self, key: Key, attempt: int, reply_id: str, kind: str, status: Status = Status.POSTED) -> Steps:
        """Close our row with the reply id; a lost close is left to the sweep."""
        if kind == "closed":
            self.lag.sent(reply_id)  # the listing lag is timed from here, on a clock no wall-clock step moves
        return (yield from self._close_row_steps(key, attempt, reply_id, kind, status))

    def _close_values(self, attempt: int, reply_id: str, kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """A close's row values and its event."""
        now = self.clock.now()
        # Every close keeps a deadline: from the configured delay on the sweep measures this reply's listing lag,
        # and once the delay in use has passed it verifies that no other reply (an earlier attempt's) landed.
        values = {"state": st.CLOSED, "reply_id": reply_id, "closed_at": now, "updated_at": now, "error": None,
                  "deadline_at": now + self.lag.configured_s}
        event = {"kind": kind, "state": st.CLOSED, "attempt": attempt, "owner": self.owner,
                 "detail": {"reply_id": reply_id}}
        return values, event

    def _close_row_steps(self, key: Key, attempt: int, reply_id: str, kind: str,
                         status: Status = Status.POSTED) -> Steps:
        values, event = self._close_values(attempt, reply_id, kind)
        try:
            # One relaxed transaction: the compare-and-set and its event; a late_landing note if the row moved on.
            # not_landed or gave_up at our attempt: the sweep looked too early; our reply did land.
            # unconfirmed at our attempt (a platform without read-back): the answer came after the deadline and
            # is the proof nothing else could give, so the row closes rather than wait for an operator.
            ok = yield io(
                self.store.cas_event,
                key, states=CLOSABLE, attempt=attempt, values=values, event=event,
                otherwise={"kind": "late_landing", "attempt": attempt, "owner": self.owner,
                           "detail": {"reply_id": reply_id}},
                relaxed=True, doing="closing",
            )
        except StoreError as exc:
            log.error("replyd.guard.close_failed", parent_id=key.parent_id, reply_id=reply_id, error=str(exc))
            return Outcome(status, key, st.OPEN, attempt, reply_id, detail=CLOSE_LOST)
        if not ok:
            yield from self._late_steps(key, attempt, reply_id)
        log.info("replyd.guard.posted", parent_id=key.parent_id, reply_id=reply_id, attempt=attempt)
        return Outcome(status, key, st.CLOSED, attempt, reply_id)

    def _late_steps(self, key: Key, attempt: int, reply_id: str) -> Steps:
        log.warning("replyd.guard.late_landing", parent_id=key.parent_id, reply_id=reply_id, attempt=attempt)
        try:
            yield io(self._late_landing, key, attempt, reply_id)
        except StoreError as exc:
            log.error("replyd.guard.late_landing_failed", parent_id=key.parent_id, reply_id=reply_id, error=str(exc))

    def close_page_steps(self, page: PageCloses) -> Steps:
        """Close the rows a page's posts left (``PAGE_CLOSES``) in one relaxed transaction; return the outcomes
        that change: a row whose close was not recorded is still open (the sweep closes it)."""
        if not page.rows:
            return {}
        items = []
        for key, attempt, reply_id in page.rows:
            values, event = self._close_values(attempt, reply_id, "closed")
            items.append((key, CLOSABLE, attempt, values, event))
        try:
            oks = yield io(self.store.close_many, items, relaxed=True)
        except (StoreError, ContentionError) as exc:  # a lost close: the rows stay open, the sweep closes them
            log.error("replyd.guard.close_failed", rows=len(items), error=str(exc))
            return {key: Outcome(Status.POSTED, key, st.OPEN, attempt, reply_id, detail=CLOSE_LOST)
                    for key, attempt, reply_id in page.rows}
        for (key, attempt, reply_id), ok in zip(page.rows, oks, strict=True):
            if ok:
                log.info("replyd.guard.posted", parent_id=key.parent_id, reply_id=reply_id, attempt=attempt)
            else:  # the row moved on meanwhile (the sweep): noted and counted as the one-row close does
                yield io(self.store.record, key, "late_landing", owner=self.owner, detail={"reply_id": reply_id})
                yield from self._late_steps(key, attempt, reply_id)
        return {}

    def _late_landing(self, key: Key, attempt: int, reply_id: str) -> None:
        """Our reply landed after the row moved on: make sure it is counted, not just noted (one transaction).

        Closed with another reply: a duplicate, whether or not that close was verified already; the row's
        deadline comes back to now, so the sweep's verification counts it (from the ``late_landing`` event's
        id, whatever its read-back lists), reports ``duplicate_detected`` and deletes it with
        ``on_duplicate = "delete_newer"``. Judged or released at a later attempt (nothing of that attempt
        landed, as far as replyd knows): the parent is answered, so the row closes with our reply
        (``reconciled``) before another attempt can go out.
        """
        now = self.clock.now()
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

    def _transition_steps(
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
    ) -> Steps:
        now = self.clock.now()
        values: dict[str, Any] = {"state": to, "updated_at": now, "lease_owner": None, "lease_until": None}
        if "not_before" in detail:
            values["not_before"] = detail["not_before"]
        if error is not None or "error" in detail:
            values["error"] = detail.get("error") or str(error)
        try:
            ok = yield io(
                self.store.cas_event,
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

    def _note_open_steps(self, key: Key, attempt: int, exc: BaseException) -> Steps:
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

        def reopen() -> str | None:
            with self.store.transaction(relaxed=True, doing="recording an ambiguous send") as tx:
                before = tx.get(key)
                if tx.cas_event(key, states=[st.OPEN, st.NOT_LANDED, st.GAVE_UP], attempt=attempt, values=values,
                                deadline_at_least=look_at):
                    was = before.state if before is not None and before.state != st.OPEN else None
                    note = {"error": detail, **({"reopened_from": was} if was else {})}
                    tx.append_event(key, "maybe_sent", state=st.OPEN, attempt=attempt, owner=self.owner, detail=note)
                    return was
                # the row moved on: a note for explain, no state (it would contradict the row)
                tx.append_event(key, "late_maybe_sent", state=None, attempt=attempt, owner=self.owner,
                                detail={"error": detail, "row_state": before.state if before else None})
                return None

        reopened = None
        try:
            reopened = yield io(reopen)
        except StoreError:
            pass  # the open row itself is durable; this note is only for explain
        log.warning("replyd.guard.maybe_sent", parent_id=key.parent_id, attempt=attempt, error=detail,
                    **({"reopened_from": reopened} if reopened else {}))

    # -- compose leases: begin, compose elsewhere, finish ------------------------------------------------

    def begin_steps(self, parent: Parent, *, owner: str, path: str = "api") -> Steps:
        """Claim ``parent``'s key as ``composing`` for ``owner`` (nothing is sent); else say what blocks it."""
        key = self.key(parent.id)
        if self.dry_run:
            return Outcome(Status.DRY_RUN, key,
                           detail="dry run: no lease is taken; post the text to see what would be sent")
        if not self.claiming:
            return Outcome(Status.NOT_SENT, key, detail="shutting down")
        # The guard's own claim, as the holder: the same compare-and-set every path uses.
        claim = yield Step("_claim", (key, parent, path, None), )
        if isinstance(claim, Outcome):
            metrics.outcome(self.platform.instance, claim.status.value)
            return claim
        return Lease(key, owner, claim.attempt, claim.lease_until)

    def finish_steps(self, lease: Lease, text: str) -> Steps:
        """Post ``text`` under ``lease``: open the composing row while the lease is live and ours, then send.

        Raises ``LeaseLost`` (nothing sent) when the lease ran out or the key is no longer this holder's.
        (Run on the lease holder: ``_as_holder(lease.owner)``.)
        """
        if not text or not text.strip():
            raise ValueError("text: must not be empty")
        now = self.clock.now()
        row = yield io(self.store.peek, lease.key)
        if row is None or row.state != st.COMPOSING or row.lease_owner != lease.owner or row.attempt != lease.attempt:
            raise LeaseLost(f"not held any more: {self.where(lease.key, row, now)}")
        if row.lease_until is not None and row.lease_until < now:
            raise LeaseLost(f"expired {now - row.lease_until:.1f} s ago (compose leases last {self.compose_lease_s:g} s); "
                            "nothing was sent: call begin_reply again")
        parent = Parent.from_snapshot(json.loads(row.snapshot or "{}"))
        pieces = self.split(parent, text)
        if len(pieces) > 1:  # an answer in parts: stored under the lease, then sent part by part
            stored = yield from self._store_answer_steps(lease.key, row, pieces)
            if isinstance(stored, Outcome):
                current = yield io(self.store.peek, lease.key)
                raise LeaseLost(f"lost while storing the answer: {self.where(lease.key, current, now)}")
            out = yield from self.parts_steps(lease.key, parent, None)
            metrics.outcome(self.platform.instance, out.status.value)
            return out
        # Durable open, compared-and-set on (composing, attempt, lease owner): a lease taken over since loses here.
        opened = yield Step("_open_composed", (lease.key, row, text))
        if isinstance(opened, Outcome):
            current = yield io(self.store.peek, lease.key)
            raise LeaseLost(f"lost while opening: {self.where(lease.key, current, now)}")
        out = yield Step("_send", (lease.key, parent, opened, text))
        metrics.outcome(self.platform.instance, out.status.value)
        return out

    def where(self, key: Key, row: st.Row | None, now: float) -> str:
        """Say in words where a key stands now, for a lease refusal."""
        if row is None:
            return "the key has no row; nothing was sent"
        if row.state == st.COMPOSING:
            return "another holder is composing a reply to this parent; nothing was sent"
        out = _classify(row, key, now) if not self._claimable(row, now) else None
        status = out.status.value if out else f"{row.state} and claimable"
        return f"the parent is now {status}" + (f" (reply {row.reply_id})" if row.reply_id else "") + "; nothing was sent"
