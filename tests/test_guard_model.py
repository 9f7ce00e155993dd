"""The guard's state machine against a model, driven by hypothesis (RuleBasedStateMachine).

Two guards (two replicas: different owners) and two sweepers share one
answered-log (SQLite) and one scripted platform (``MemoryPlatform``) whose real
listing delay is the configured one. Hypothesis interleaves posts that meet
every scripted platform outcome, responder outcomes (text, decline, raise, a
compose slower than its lease while the other replica takes the key), a send
that runs past its deadline while the other replica sweeps, an open commit whose answer comes back past the
row's deadline while the other replica sweeps and answers, clock moves, sweeps
and failed read-backs — and process death at every step of a post: before and
after each store write (claim, open, close, release ...), during the compose,
before the request leaves and after the platform acted — also in pages: a page posted through the
group claim (texts, parents to compose, both) and a page a discovery path offers to its pipeline, the replica
dying before/after each write of the page or in a compose. A dead replica restarts
as a new guard (new owner, nothing in memory) and its page is not re-read once a
row exists (the discovery path may have saved its cursor past it): only the
sweep and re-find's re-offer of waiting rows may move the row on.

After every step:

* at most one reply per parent exists on the platform;
* every row's history (its events, in order) follows the allowed transitions
  of replyd/transitions.py (docs/ARCHITECTURE.md, "States"), attempts never go down and never exceed ``max_attempts``, and
  the last event's state is the row's state;
* states that say "nothing landed" (released, not_landed, gave_up, rejected,
  declined) have no reply on the platform, and a closed row names a reply that
  exists under that parent;
* a failed read-back never moves an open row.

Then ``drain`` (also run at teardown) lets the platform accept from now on and
runs only the daemon's own jobs — the sweep and re-find's re-offer (one row a
page, with a policy that rules p1 out for good) — for a bounded number of
rounds; a parent with no row at all is found again (its cursor was never saved).
Every parent must end closed with exactly one reply, or in a reported terminal
state (rejected, declined, gave up, skipped) with none — no answer is lost and
nothing waits for ever.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import hypothesis.strategies as hs
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replyd import store as st
from contextlib import contextmanager

from replyd.clock import FakeClock
from replyd.config import PollerConfig
from replyd.errors import MaybeSent
from replyd.guard import Guard, Status
from tests.aio_harness import BlockingAsyncGuard
from tests.conftest import PG_ADMIN_URL, _pg_reachable
from replyd.pipeline import Pipeline
from replyd.platforms.base import Parent
from replyd.platforms.memory import STEPS, MemoryPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.store import Key, Store
from replyd.sweep import Bot, Sweeper

SEND_STEPS = list(STEPS)


class Crash(BaseException):
    """The replica's process dies here (SIGKILL): nothing after this point runs in it."""


class ModelPlatform(MemoryPlatform):
    """The scripted platform, with the crash steps raising ``Crash`` in the calling replica instead of SIGKILL."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.during_send = None  # called once the request has reached the platform (a slow send)
        # A page's step per parent: the async face sends a page's parents at once, in no set order.
        self.by_parent: dict[str, str] = {}
        self._one = threading.RLock()  # one request at a time: each meets its own step
        self._idle = threading.Condition()
        self.in_flight = 0  # requests under way, on whichever thread (the async face cuts a slow one's wait)

    def wait_idle(self) -> None:
        """Wait until no request is under way (a send cut at its budget on the async face runs on, on its thread)."""
        with self._idle:
            assert self._idle.wait_for(lambda: self.in_flight == 0, timeout=60.0), "a request never returned"

    @contextmanager
    def _request(self):
        with self._idle:
            self.in_flight += 1
        try:
            with self._one:
                yield
        finally:
            with self._idle:
                self.in_flight -= 1
                self._idle.notify_all()

    def edit(self, parent, reply_id, text):
        """Follow the edit script, counted as a request under way."""
        with self._request():
            return super().edit(parent, reply_id, text)

    def send(self, parent, text, *, provider_key):
        """Follow the script (a page's per-parent step first); ``crash_*`` kill the caller before or after the
        platform acted."""
        with self._request():
            if parent.id in self.by_parent:
                self.script.insert(0, self.by_parent.pop(parent.id))
            return self._scripted(parent, text, provider_key)

    def _scripted(self, parent, text, provider_key):
        step = self.script[0] if self.script else "ok"
        if step == "crash_before":
            self.script.pop(0)
            self.send_calls += 1
            raise Crash()
        if step == "crash_after":
            self.script.pop(0)
            self.send_calls += 1
            self._create(parent, text, provider_key)
            raise Crash()
        if step == "slow":
            self.script.pop(0)
            self.send_calls += 1
            hook, self.during_send = self.during_send, None
            if hook is not None:
                hook()  # the request is held up past its deadline; the platform acts only at the end
            self._create(parent, text, provider_key)
            raise MaybeSent("read timeout after the request was sent")
        return super().send(parent, text, provider_key=provider_key)


class DyingStore:
    """One replica's view of the shared store: its ``n``-th write dies before or after it commits."""

    WRITES = ("claim", "cas_event", "record", "claim_new", "claim_page", "close_many")

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.die_at: int | None = None
        self.after = False
        self.writes = 0
        self.on_open = None  # called once after the write that opens a row commits: its answer is held up
        # Set once the replica died: a dead process starts no write (the async face's other tasks of a page
        # would still reach the store thread after the death otherwise).
        self.dead = False

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name in self.WRITES:
            def write(*args, **kwargs):
                self._before()
                out = attr(*args, **kwargs)
                self._after()
                opened = ((name == "claim" and out[0] and (out[2] or {}).get("state") == st.OPEN)
                          or (name == "cas_event" and out and (kwargs.get("event") or {}).get("kind") == "opened"))
                if opened and self.on_open is not None:
                    hook, self.on_open = self.on_open, None
                    hook()
                return out
            return write
        return attr

    def _before(self) -> None:
        if self.dead:
            raise Crash()
        self.writes += 1
        if self.die_at == self.writes and not self.after:
            self.dead = True
            raise Crash()

    def _after(self) -> None:
        if self.die_at == self.writes and self.after:
            self.dead = True
            raise Crash()

    @contextmanager
    def transaction(self, **kwargs):
        """The store's transaction, with death before it begins or after it commits."""
        self._before()
        with self._inner.transaction(**kwargs) as tx:
            yield tx
        self._after()
PARENTS = ["p1", "p2", "p3"]
# A streamed answer: the platform's posts are STREAM_CHARS long, so it is two parts, each posted once
# and grown by edits; a plain reply ("a reply") is one post.
STREAM_CHARS = 24
STREAM_WORDS = ["alpha", " beta", " gamma", " delta", " epsilon", " zeta"]
MAX_ATTEMPTS = 3
SEND_TIMEOUT = 5.0
LISTING_DELAY = 10.0
COMPOSE_LEASE = 20.0
RETRY_S = 7.0

# One step of a row's history: state before -> state after (None: no row yet).
ALLOWED = {
    None: {st.COMPOSING, st.OPEN},
    st.COMPOSING: {st.COMPOSING, st.OPEN, st.RELEASED, st.DECLINED},
    st.OPEN: {st.OPEN, st.CLOSED, st.RELEASED, st.REJECTED, st.NOT_LANDED, st.GAVE_UP},
    st.RELEASED: {st.COMPOSING, st.OPEN},
    st.NOT_LANDED: {st.COMPOSING, st.OPEN, st.CLOSED},
    st.CLOSED: {st.CLOSED},  # duplicate_detected / duplicate_deleted re-state a closed row
    st.REJECTED: set(),
    st.GAVE_UP: set(),
    st.DECLINED: set(),
}
NOTHING_LANDED = (st.RELEASED, st.NOT_LANDED, st.GAVE_UP, st.REJECTED, st.DECLINED, st.SKIPPED)
# Late results and ways out, so every row moves on: a late maybe-sent reopens a judged row at its attempt, a late
# success closes it, a waiting row the policy rules out for good ends skipped, an expired lease is retaken.
ALLOWED[st.NOT_LANDED] = ALLOWED[st.NOT_LANDED] | {st.OPEN, st.SKIPPED}
ALLOWED[st.GAVE_UP] = {st.OPEN, st.CLOSED}
ALLOWED[st.RELEASED] = ALLOWED[st.RELEASED] | {st.SKIPPED}
ALLOWED[st.COMPOSING] = ALLOWED[st.COMPOSING] | {st.SKIPPED}
# Answers in parts: an answer composed (or streamed) longer than a post is stored in parts, and ends in the
# state its parts end in.
ALLOWED[st.COMPOSING] = ALLOWED[st.COMPOSING] | {st.PARTS}
ALLOWED[st.PARTS] = {st.CLOSED, st.REJECTED, st.GAVE_UP, st.SKIPPED}
# The send deadline: a send too late to leave gives a judged row's attempt back (released); a late landing closes
# a row released at a later attempt.
ALLOWED[st.NOT_LANDED] = ALLOWED[st.NOT_LANDED] | {st.RELEASED}
ALLOWED[st.GAVE_UP] = ALLOWED[st.GAVE_UP] | {st.RELEASED}
ALLOWED[st.RELEASED] = ALLOWED[st.RELEASED] | {st.CLOSED}
DENIED = "p1"  # the drain's policy rules this parent out for good (a denied keyword in its text)

_DB: dict[str, Store] = {}
_PG_NAMES: list[str] = []  # the PostgreSQL databases this module created (dropped at its end)


def shared_store(db: str = "sqlite") -> Store:
    """One migrated store per database for all examples; each example uses its own platform instance (key part)."""
    if db not in _DB:
        if db == "sqlite":
            # tmpfs when there is one: every claim commits with synchronous=FULL.
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            path = Path(tempfile.mkdtemp(prefix="replyd-model-", dir=base)) / "model.sqlite3"
            _DB[db] = Store.open(f"sqlite:///{path}")
        else:
            why = _pg_reachable()
            if why:
                pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL} ({why})")
            name = f"replyd_model_{uuid.uuid4().hex[:10]}"
            admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.exec_driver_sql(f'CREATE DATABASE "{name}"')
            admin.dispose()
            _PG_NAMES.append(name)
            _DB[db] = Store.open(sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False))
    return _DB[db]


class GuardModel(RuleBasedStateMachine):
    """Guards + sweepers + platform, checked against the rules above."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.store = shared_store(self.DB)
        self.store.clock = self.clock
        self.plat = ModelPlatform(instance=f"memory:{uuid.uuid4().hex}", listing_delay_s=LISTING_DELAY, clock=self.clock,
                                  post_chars=STREAM_CHARS)
        me = self.plat.whoami()
        self.restarts = 0
        self.guards = [self._guard(i) for i in range(2)]
        self.sweepers = [
            Sweeper(self.store, [Bot(self.plat, me)], clock=self.clock, owner=f"s{i}", lease_s=30.0,
                    retry_s=RETRY_S, max_attempts=MAX_ATTEMPTS)
            for i in range(2)
        ]
        self.parents = {pid: Parent(id=pid, author_id="user-1", author_handle="user",
                                    text="buy spam now" if pid == DENIED else "a question") for pid in PARENTS}
        self.touched: set[str] = set()
        self.streamed: set[str] = set()  # parents a streamed answer was offered for (its parts may have landed)
        self.touched_dead: dict[str, bool] = {}
        # The daemon's re-find over both replicas' log: one waiting row a page, the policy p1 now fails.
        self.refind_policy = Policy(deny_keywords=["spam"])

    FACES: tuple[type, type] = (Guard, Guard)  # the face each replica runs (see VARIANTS)
    DB = "sqlite"  # the shared store's database

    def _guard(self, i: int) -> Guard:
        """A (re)started replica: a new owner and a fresh view of the store; its send watch is ticked by the model."""
        self.restarts += 1
        return self.FACES[i](DyingStore(self.store), self.plat, self.plat.whoami(), clock=self.clock,  # type: ignore[arg-type]
                     owner=f"g{i}-{self.restarts}", max_attempts=MAX_ATTEMPTS, send_timeout_s=SEND_TIMEOUT,
                     compose_lease_s=COMPOSE_LEASE, watch_interval_s=None)

    # -- helpers ------------------------------------------------------------------------

    def key(self, pid: str) -> Key:
        return self.guards[0].key(pid)

    def row(self, pid: str) -> st.Reply | None:
        return self.store.get(self.key(pid))

    def replies(self, pid: str) -> list[dict]:
        return [r for r in self.plat.replies() if r["parent_id"] == pid and r["sender_id"] == self.plat.sender_id]

    def _post(self, g: int, pid: str, step: str, mode: str, die: tuple[str, int] | None = None,
              stall: bool = False) -> None:
        guard, other = self.guards[g], self.guards[1 - g]
        parent = self.parents[pid]
        if self.row(pid) is not None and self.touched_dead.get(pid):
            # A replica died on this parent after its row existed: its path may have moved past it.
            return
        self.plat.script = [step]
        calls = self.plat.send_calls
        store: DyingStore = guard.store  # type: ignore[assignment]
        store.writes, store.die_at, store.after = 0, None, False
        if die is not None and die[0] != "compose":
            store.die_at, store.after = die[1], die[0] == "after"
        if step == "slow":
            self.plat.during_send = lambda: self._meanwhile(guard, 1 - g)
        if stall:
            store.on_open = lambda: self._stalled_open(g, pid)

        def compose(p: Parent) -> Any:
            if die is not None and die[0] == "compose":
                raise Crash()
            if mode == "decline":
                return None
            if mode == "stream":  # two parts of STREAM_CHARS, each posted once and grown by edits
                return iter(STREAM_WORDS)
            if mode == "raise":
                raise RuntimeError("responder down")
            if mode == "stolen":
                # This replica's compose outlives its lease; the other replica takes the key meanwhile.
                self.clock.advance(COMPOSE_LEASE + 1)
                self.plat.script = ["ok"]
                other.post(p, "reply from the other replica")
                self.plat.script = [step]
            return "a reply"

        try:
            if mode == "stream":
                self.streamed.add(pid)
            out = guard.post(parent, "a reply" if mode == "text" else compose)
        except Crash:
            # The process died: a restarted replica has nothing in memory, and the page may be skipped now.
            store.dead = True
            self.guards[g] = self._guard(g)
            self.touched.add(pid)
            self.touched_dead[pid] = True
            self.plat.script = []
            self.plat.during_send = None
            return
        finally:
            store.die_at = None
            store.on_open = None
            self._settle(guard)
        sent = self.plat.send_calls - calls
        self.plat.script = []
        self.plat.during_send = None
        self.touched.add(pid)
        if out.status is Status.POSTED:
            assert out.reply_id in {r["reply_id"] for r in self.replies(pid)}, out
        if mode != "stolen" and sent == 0:
            assert out.status is not Status.POSTED and out.status is not Status.UNCERTAIN, out
        assert sent <= (2 if mode == "stolen" or stall else len(STREAM_WORDS) if mode == "stream" else 1)

    def _settle(self, guard: Guard) -> None:
        """The async face cuts a send at its budget in real time (a loaded machine's slow step) or cancels a dying
        page's other posts, while their requests and store calls run on, on their threads: wait until they
        returned and a late close is written, so all a step started acts within it."""
        self.plat.wait_idle()
        if isinstance(guard, BlockingAsyncGuard):
            guard.settle()

    def _stalled_open(self, g: int, pid: str) -> None:
        """The database's answer to replica ``g``'s open is held past send timeout + listing delay: meanwhile the
        other replica sweeps and its re-find offers the parent again (the platform answers ``ok``)."""
        script, self.plat.script = self.plat.script, ["ok"]
        self.clock.advance(SEND_TIMEOUT + LISTING_DELAY + 1)
        self.sweepers[1 - g].run_once()
        self.guards[1 - g].post(self.parents[pid], "a reply from the other replica")
        self.plat.script = script

    def _meanwhile(self, guard: Guard, s: int) -> None:
        """A send runs past its deadline: its replica's watch ticks while the other replica sweeps."""
        for _ in range(int(4 * (SEND_TIMEOUT + LISTING_DELAY) / SEND_TIMEOUT) + 2):  # past the claim's deadline
            self.clock.advance(SEND_TIMEOUT / 4)  # the watch ticks more often than half the send budget
            guard.watch_sends()
        self.sweepers[s].run_once()

    # -- rules ----------------------------------------------------------------------------

    @rule(g=hs.integers(0, 1), pid=hs.sampled_from(PARENTS), step=hs.sampled_from(SEND_STEPS),
          mode=hs.sampled_from(["text", "compose", "compose", "decline", "raise", "stolen", "stream"]))
    def post(self, g: int, pid: str, step: str, mode: str) -> None:
        """A discovery path offers ``pid`` to replica ``g``; the platform answers ``step``."""
        self._post(g, pid, step, mode)

    @rule(g=hs.integers(0, 1), pid=hs.sampled_from(PARENTS), mode=hs.sampled_from(["text", "compose"]))
    def post_slow(self, g: int, pid: str, mode: str) -> None:
        """Replica ``g``'s send is held up past the row's deadline while the other sweeps; the platform acts last."""
        self._post(g, pid, "slow", mode)

    @rule(g=hs.integers(0, 1), pid=hs.sampled_from(PARENTS), step=hs.sampled_from(["ok", "lost", "not_sent"]),
          mode=hs.sampled_from(["text", "compose"]))
    def post_stalled_open(self, g: int, pid: str, step: str, mode: str) -> None:
        """Replica ``g``'s open commit answers past its deadline while the other replica sweeps and answers."""
        self._post(g, pid, step, mode, stall=True)

    @rule(g=hs.integers(0, 1), pid=hs.sampled_from(PARENTS), step=hs.sampled_from(["ok", "lost", "not_sent"]),
          mode=hs.sampled_from(["text", "compose", "stream"]),
          die=hs.one_of(hs.just(("compose", 0)), hs.tuples(hs.sampled_from(["before", "after"]), hs.integers(1, 6))))
    def post_and_die(self, g: int, pid: str, step: str, mode: str, die: tuple[str, int]) -> None:
        """Replica ``g`` dies during this post: composing, or before/after its n-th store write; it restarts."""
        self._post(g, pid, step, mode, die)

    @rule(g=hs.integers(0, 1), steps=hs.lists(hs.sampled_from(["ok", "ok", "lost", "not_sent"]), min_size=3,
                                              max_size=3),
          mode=hs.sampled_from(["text", "compose", "mixed"]),
          die=hs.one_of(hs.none(), hs.tuples(hs.sampled_from(["before", "after"]), hs.integers(1, 6))))
    def post_page(self, g: int, steps: list[str], mode: str, die: tuple[str, int] | None) -> None:
        """Replica ``g`` posts a page of the parents (the group claim: one claim transaction, the sends, one close
        transaction; parents to compose claimed in it too, each composed under its own lease); the platform answers
        ``steps`` in turn; the replica may die before/after its n-th write."""
        pids = self._page_pids()
        if not pids:
            return
        texts = {"text": ["a reply"] * 3, "compose": [None] * 3, "mixed": ["a reply", None, "a reply"]}[mode]
        items = [(self.parents[p], t if t is not None else (lambda parent: "a reply")) for p, t in zip(pids, texts, strict=False)]
        self._page(g, pids, steps, die, lambda guard: guard.post_page(items))

    @rule(g=hs.integers(0, 1), steps=hs.lists(hs.sampled_from(["ok", "ok", "lost", "not_sent"]), min_size=3,
                                              max_size=3),
          mode=hs.sampled_from(["compose", "compose", "decline", "raise"]),
          die=hs.one_of(hs.none(), hs.tuples(hs.sampled_from(["before", "after"]), hs.integers(1, 8)),
                        hs.tuples(hs.just("compose"), hs.integers(0, 2))))
    def offer_page(self, g: int, steps: list[str], mode: str, die: tuple[str, int] | None) -> None:
        """Replica ``g``'s discovery path offers a page of the parents to its pipeline (the page path: the
        per-parent steps, then one group claim, each row's lease, compose, open, send and close); the platform
        answers ``steps`` in turn; the replica may die before/after its n-th write or in its k-th compose."""
        pids = self._page_pids()
        if not pids:
            return
        composed: list[str] = []

        def compose(parent: Parent) -> str | None:
            if die is not None and die[0] == "compose" and len(composed) == die[1]:
                raise Crash()
            composed.append(parent.id)
            if mode == "raise":
                raise RuntimeError("responder down")
            return None if mode == "decline" else "a reply"

        def offer(guard: Guard) -> list:
            outs = Pipeline(guard, compose, Policy(), self.clock).offer_page([self.parents[p] for p in pids], "inbox")
            assert not [o for o in outs if isinstance(o, Exception)], outs
            assert len(composed) <= len(pids)  # the responder once per parent at most
            return outs

        self._page(g, pids, steps, die if die is None or die[0] != "compose" else None, offer)

    def _page_pids(self) -> list[str]:
        """The parents a page may still offer: not those a dead replica left with a row (its path moved on)."""
        return [p for p in PARENTS if not (self.row(p) is not None and self.touched_dead.get(p))]

    def _page(self, g: int, pids: list[str], steps: list[str], die: tuple[str, int] | None,
              run: Any) -> None:
        """Replica ``g`` runs a page of ``pids`` (``run(guard)`` returns the outcomes), the platform answering
        ``steps``, the replica dying before/after its n-th write (``die``), or wherever ``run`` raises ``Crash``."""
        guard = self.guards[g]
        self.plat.by_parent = dict(zip(pids, steps, strict=False))
        calls = self.plat.send_calls
        store: DyingStore = guard.store  # type: ignore[assignment]
        store.writes, store.die_at, store.after = 0, None, False
        if die is not None:
            store.die_at, store.after = die[1], die[0] == "after"
        try:
            outs = run(guard)
        except Crash:
            store.dead = True
            self.guards[g] = self._guard(g)
            for p in pids:
                self.touched.add(p)
                self.touched_dead[p] = True
            return
        finally:
            store.die_at = None
            self._settle(guard)
            self.plat.by_parent = {}
        self.touched.update(pids)
        for out in outs:
            if out.status is Status.POSTED:
                assert out.reply_id in {r["reply_id"] for r in self.replies(out.key.parent_id)}, out
        assert self.plat.send_calls - calls <= len(pids)

    @rule(seconds=hs.sampled_from([0.5, 3.0, SEND_TIMEOUT + LISTING_DELAY + 0.1, 31.0, 61.0]))
    def advance(self, seconds: float) -> None:
        """Time passes (past deadlines, leases and rate-limit back-offs at the larger values)."""
        self.clock.advance(seconds)

    @rule(s=hs.integers(0, 1))
    def sweep(self, s: int) -> None:
        """One sweep pass by replica ``s``."""
        self.sweepers[s].run_once()

    @rule(s=hs.integers(0, 1))
    def sweep_readback_fails(self, s: int) -> None:
        """A sweep whose read-back fails: open rows must stay open, untouched."""
        before = {pid: self.row(pid) for pid in PARENTS}
        self.clock.advance(SEND_TIMEOUT + LISTING_DELAY + 0.1)
        self.plat.readback_failures = 1
        self.sweepers[s].run_once()
        self.plat.readback_failures = 0
        for pid, r in before.items():
            if r is not None and r.state == st.OPEN:
                now = self.row(pid)
                assert now is not None and now.state == st.OPEN and now.attempt == r.attempt, (pid, r, now)

    @precondition(lambda self: bool(self.touched))
    @rule()
    def drain(self) -> None:
        """From now on the platform accepts: every answerable parent ends answered exactly once."""
        self._drain()

    def _drain(self) -> None:
        pipeline = Pipeline(self.guards[0], lambda p: "a reply", self.refind_policy, self.clock)
        refind = Pollers(self.store, self.plat, pipeline, PollerConfig(refind_batch=1), self.clock)
        for _ in range(3 * MAX_ATTEMPTS + 3 + 2 * len(PARENTS)):
            self.clock.advance(max(SEND_TIMEOUT + LISTING_DELAY, COMPOSE_LEASE, RETRY_S, 30.0) + 1)
            self.sweepers[0].run_once()
            self.plat.script = []
            for pid in sorted(self.touched):
                if self.row(pid) is None:  # never claimed: its cursor was not saved, the path finds it again
                    self.guards[0].post(self.parents[pid], "a reply")
            refind.reoffer()  # only the daemon's jobs move rows on: no discovery path offers them again
            self._settle(self.guards[0])
            rows = [self.row(pid) for pid in self.touched]
            if all(r is not None and r.state in st.TERMINAL for r in rows):
                break
        for pid in self.touched:
            r = self.row(pid)
            assert r is not None and r.state in st.TERMINAL, (pid, r)
            n = len(self.replies(pid))
            if r.state == st.CLOSED:
                assert n == 1, (pid, n)
            elif r.state == st.GAVE_UP:
                assert (r.attempt == MAX_ATTEMPTS or pid in self.streamed) and n <= (pid in self.streamed), (pid, r)
            elif r.state == st.SKIPPED:  # a stream's parts that landed before the policy ruled it out stay
                assert pid == DENIED and n <= (pid in self.streamed), (pid, r)
            else:  # rejected by the platform or declined by the responder: never sent successfully (but a part)
                assert r.state in (st.REJECTED, st.DECLINED) and n <= (pid in self.streamed), (pid, r)
        self.check_histories()

    def teardown(self) -> None:
        if self.touched:
            self._drain()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def at_most_one_reply_per_parent(self) -> None:
        for pid in PARENTS:
            assert len(self.replies(pid)) <= 1, (pid, self.replies(pid))
        # An answer in parts is a chain: no part is answered twice either.
        per: dict[str, int] = {}
        for r in self.plat.replies():
            per[r["parent_id"]] = per.get(r["parent_id"], 0) + 1
        assert all(n <= 1 for n in per.values()), per

    @invariant()
    def check_histories(self) -> None:
        for pid in PARENTS:
            r = self.row(pid)
            events = self.store.history(self.key(pid))
            if r is None:
                assert not events
                continue
            state, attempt = None, 0
            for e in events:
                if e.state is None or e.kind == "skipped":  # notes (late_landing, a policy skip), not transitions
                    continue
                assert e.state in st.STATES
                assert e.state in ALLOWED[state], f"{pid}: {state} -> {e.state} ({e.kind}) not allowed"
                assert e.attempt is not None and attempt <= e.attempt <= MAX_ATTEMPTS, (pid, e)
                if e.attempt > attempt and state is not None:
                    assert state == st.NOT_LANDED and e.kind == "claimed", f"{pid}: attempt rose on {e.kind} from {state}"
                assert e.attempt >= attempt, f"{pid}: attempt went down on {e.kind}"
                state, attempt = e.state, e.attempt
            # On failure: the history, and the row read again (a change between the two reads: a write this step
            # started that went on after it).
            assert state == r.state and attempt == r.attempt, (
                pid, state, attempt, r.state, r.attempt, [(e.kind, e.state, e.attempt, e.owner) for e in events],
                self.row(pid))
            assert 1 <= r.attempt <= MAX_ATTEMPTS
            mine = {x["reply_id"] for x in self.replies(pid)}
            if r.state in NOTHING_LANDED:
                # A stream cut short, failed or held leaves the parts it showed: its next composition edits them.
                shown = self.store.get(self.guards[0].key(f"{pid}#part1"))
                left = {shown.reply_id} if shown is not None and shown.state == st.CLOSED else set()
                assert not (mine - left), (pid, r.state, mine, left)
            if r.state == st.CLOSED:
                assert r.reply_id in mine, (pid, r.reply_id, mine)


# The model on each face (both replicas sync, both async, one of each: the two faces of the one state machine
# racing on one store, every death and stall point included), on SQLite and PostgreSQL. Examples per variant
# from the environment (the sync SQLite model is the cheap one: it runs the most).
VARIANTS = {  # test class name: (the replicas' faces, database, examples variable, default examples)
    "TestGuardModel": ((Guard, Guard), "sqlite", "REPLYD_MODEL_EXAMPLES", 150),
    "TestAsyncFaceModel": ((BlockingAsyncGuard, BlockingAsyncGuard), "sqlite", "REPLYD_MODEL_EXAMPLES_ASYNC", 30),
    "TestMixedFaceModel": ((Guard, BlockingAsyncGuard), "sqlite", "REPLYD_MODEL_EXAMPLES_MIXED", 20),
    "TestGuardModelPostgres": ((Guard, Guard), "postgres", "REPLYD_MODEL_EXAMPLES_PG", 30),
    "TestAsyncFaceModelPostgres": ((BlockingAsyncGuard, BlockingAsyncGuard), "postgres", "REPLYD_MODEL_EXAMPLES_PG", 30),
    "TestMixedFaceModelPostgres": ((Guard, BlockingAsyncGuard), "postgres", "REPLYD_MODEL_EXAMPLES_MIXED", 20),
}


def _variant(name: str, faces: tuple[type, type], db: str, env: str, default: int) -> type:
    """The model's TestCase with ``faces`` on ``db``."""
    model = type(name.removeprefix("Test"), (GuardModel,), {"FACES": faces, "DB": db,
                                                            "__doc__": f"The model, faces {faces}, on {db}."})
    case = model.TestCase
    case.settings = settings(
        max_examples=int(os.environ.get(env, str(default))), stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    if db == "postgres":
        case.pytestmark = [pytest.mark.postgres]
    return case


for _name, _args in VARIANTS.items():
    globals()[_name] = _variant(_name, *_args)


@pytest.fixture(scope="module", autouse=True)
def _dispose_store():
    yield
    for db in list(_DB):
        _DB.pop(db).dispose()
    if _PG_NAMES:
        admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            for name in _PG_NAMES:
                c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
        _PG_NAMES.clear()


def test_slow_ambiguous_send_is_not_swept_before_its_listing_delay(tmp_path) -> None:
    """A send that lasts longer than send_timeout_s and ends ambiguous is read back only a listing delay later.

    The listing delay of an ambiguous send counts from when the send returned (``Guard._note_open`` pushes the
    deadline), not only from the claim: the adapter's own request timeout may exceed ``send_timeout_s``.
    """
    clock = FakeClock()
    store = Store.open(f"sqlite:///{tmp_path / 'slow.sqlite3'}", clock=clock)
    plat = MemoryPlatform(listing_delay_s=LISTING_DELAY, clock=clock, script=["lost"])
    me = plat.whoami()
    guard = Guard(store, plat, me, clock=clock, send_timeout_s=SEND_TIMEOUT, max_attempts=MAX_ATTEMPTS)
    sweeper = Sweeper(store, [Bot(plat, me)], clock=clock, max_attempts=MAX_ATTEMPTS)
    real_send = plat.send

    def slow_send(parent, text, *, provider_key):
        clock.advance(SEND_TIMEOUT + LISTING_DELAY + 1)  # the request is held up; the platform acts at the end
        return real_send(parent, text, provider_key=provider_key)

    plat.send = slow_send  # type: ignore[method-assign]
    parent = Parent(id="slow", author_id="u")
    try:
        assert guard.post(parent, "a reply").status is Status.UNCERTAIN
        sweeper.run_once()  # right after the send: past the claim's deadline, before the reply is listed
        plat.send = real_send  # type: ignore[method-assign]
        guard.post(parent, "a reply")  # a discovery path offers the parent again
        assert plat.reply_count("slow") == 1
    finally:
        store.dispose()
