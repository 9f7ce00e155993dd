"""The state machine's ways out: every non-terminal row moves on without the path that made it.

Written from reproductions of rows that never moved on (stuck composing, re-find starvation, a sweep racing a send
still in flight, a stale composer, the library's clock). Each test counts replies on the platform (the
sim over HTTP or the scripted memory platform), never in replyd's own log, and runs on SQLite and on
the real PostgreSQL where the store is what is under test.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from replyd import store as st
from replyd.clock import DatabaseClock, FakeClock
from replyd.config import PollerConfig
from replyd.errors import MaybeSent
from replyd.guard import Guard, Status
from replyd.library import open_guard
from replyd.pipeline import Pipeline
from replyd.platforms.base import Parent, make_platform
from replyd.platforms._http import make_client
from replyd.platforms.memory import MemoryPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.sim import SimServer, World
from replyd.store import Store
from replyd.sweep import Bot, Sweeper


class Crash(BaseException):
    """Stands for SIGKILL of the replica at the point it is raised."""


class MentionsOnlyRefind(MemoryPlatform):
    """Re-find re-reads mentions only (as Mastodon, Discourse and Bluesky do): a search hit is not re-found."""

    def refind(self, since):
        """Nothing: the parents of these tests are search hits."""
        return []


# -- 1. composing left for ever -----------------------------------------------------------------


def test_search_hit_whose_composer_died_is_answered_once(store_url) -> None:
    """A replica dies composing a search hit and restarts inside the lease: the row is answered after the lease.

    The restarted replica's search sees the row in flight and saves its cursor past it; nothing but the
    row itself can bring the parent back. Real Mastodon adapter against the sim over HTTP.
    """
    clock = FakeClock()
    world = World(clock=clock)
    world.add_account("bot", bot=True)
    world.add_account("alice")
    bot_id = world.account("bot").id
    parent = world.post("alice", "anyone know about widgets?")  # a search hit, not a mention
    with SimServer(world) as srv, httpx.Client(timeout=5.0) as http:

        def replica(owner: str, responder):
            store = Store.open(store_url, clock=clock)
            plat = make_platform("mastodon", {"base_url": srv.base_url, "token": world.account("bot").token,
                                              "listing_delay_s": 1.0, "timeout_s": 5.0}, http=http, clock=clock)
            ident = plat.whoami()
            g = Guard(store, plat, ident, clock=clock, owner=owner, send_timeout_s=5.0, compose_lease_s=120.0,
                      watch_interval_s=None)
            pol = Pollers(store, plat, Pipeline(g, responder, Policy(), clock),
                          PollerConfig(search_queries=["widgets"]), clock)
            return store, g, pol, Sweeper(store, [Bot(plat, ident)], clock=clock, owner=owner)

        def dies(p: Parent) -> str:
            raise Crash()

        store_a, g_a, pol_a, _ = replica("replica-A", dies)
        with pytest.raises(Crash):
            pol_a.search()
        store_a.dispose()
        clock.advance(5)  # restarted 5 s later, inside the 120 s compose lease
        calls: list[str] = []
        store, g, pol, sw = replica("replica-A-restarted", lambda p: (calls.append(p.id), "answer")[1])
        try:
            pol.search()
            pol.inbox()
            pol.refind()
            sw.run_once()
            assert pol.outcomes == {"in_flight": 1}
            assert store.get_cursor(g.platform.instance, g.identity.sender_id, "search:widgets") == parent.id
            for _ in range(6):  # an hour of normal operation
                clock.advance(600)
                pol.search()
                pol.inbox()
                pol.refind()
                sw.run_once()
            assert world.replies_by(bot_id).get(parent.id, 0) == 1
            assert calls == [parent.id]
            assert store.peek(g.key(parent.id)).state == st.CLOSED
        finally:
            store.dispose()


def test_overdue_rows_are_listed_in_every_waiting_state(store, clock) -> None:
    """``Store.overdue`` lists composing, open, released and not_landed rows past their bound, not others."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, compose_lease_s=60.0,
              watch_interval_s=None)
    with pytest.raises(Crash):  # composing, lease 60 s
        g.post(plat.add_parent("composing"), lambda p: (_ for _ in ()).throw(Crash()))
    plat.script = ["lost"]
    g.post(plat.add_parent("open"), "x")  # open, deadline 15 s
    plat.script = ["not_sent"]
    g.post(plat.add_parent("released"), "x")  # released at once
    g.post(plat.add_parent("closed"), "x")
    assert [r.parent_id for r, _ in store.overdue(clock.now(), grace_s=30.0)] == []
    clock.advance(100)
    listed = {r.parent_id: (r.state, over) for r, over in store.overdue(clock.now(), grace_s=30.0)}
    assert set(listed) == {"composing", "open", "released"}
    assert listed["composing"] == (st.COMPOSING, pytest.approx(40.0))
    assert listed["open"] == (st.OPEN, pytest.approx(85.0))
    assert listed["released"][0] == st.RELEASED


# -- 2. re-find starvation ----------------------------------------------------------------------


def _not_landed(g: Guard, plat: MemoryPlatform, pid: str) -> None:
    """Make ``pid`` an ambiguous send that nothing created (a 502): swept later to not_landed."""
    plat.script = ["error_before"]
    g.post(plat.add_parent(pid), "answer")


def test_refind_reaches_a_fresh_row_behind_rows_the_policy_skips(store_url) -> None:
    """A full page of rows the policy skips for good ends ``skipped``; the fresh not_landed row behind it is answered.

    Before the fix, 500 rows past ``max_age_s`` filled every re-find page for ever.
    """
    clock = FakeClock()
    store = Store.open(store_url, clock=clock)
    try:
        plat = MentionsOnlyRefind(clock=clock, listing_delay_s=5.0)
        ident = plat.whoami()
        g = Guard(store, plat, ident, clock=clock, owner="A", send_timeout_s=5.0, watch_interval_s=None)
        pol = Pollers(store, plat, Pipeline(g, lambda p: "answer", Policy(max_age_s=86_400.0), clock),
                      PollerConfig(refind_batch=50), clock)
        sw = Sweeper(store, [Bot(plat, ident)], clock=clock, owner="S")
        for i in range(50):
            _not_landed(g, plat, f"old-{i}")
        clock.advance(11)
        sw.run_once()
        clock.advance(2 * 86_400)  # a two-day outage: the old parents are now too old
        pol.refind()
        _not_landed(g, plat, "fresh")
        clock.advance(11)
        sw.run_once()
        assert store.peek(g.key("fresh")).state == st.NOT_LANDED
        for _ in range(3):
            clock.advance(600)
            pol.refind()
            sw.run_once()
        assert plat.reply_count("fresh") == 1
        assert store.peek(g.key("fresh")).state == st.CLOSED
        counts = store.counts()
        assert counts.get((plat.instance, st.SKIPPED)) == 50 and not counts.get((plat.instance, st.NOT_LANDED))
        old = store.peek(g.key("old-0"))
        assert old.error == "policy: too_old"
        blocked = g.check("old-0")  # a retired row reports why, not "in flight"
        assert blocked is not None and (blocked.status, blocked.detail) == (Status.SKIPPED, "too_old")
        assert [e.kind for e in store.history(g.key("old-0"))][-1] == "retired"
    finally:
        store.dispose()


def test_refind_pages_rotate_past_rows_that_wait(store, clock) -> None:
    """Rows that cannot move yet (a cap) do not hide the rows behind them: pages rotate across runs."""
    plat = MentionsOnlyRefind(clock=clock, listing_delay_s=5.0)
    ident = plat.whoami()
    g = Guard(store, plat, ident, clock=clock, send_timeout_s=5.0, watch_interval_s=None)
    sw = Sweeper(store, [Bot(plat, ident)], clock=clock)
    for pid in ("a", "b", "c", "d", "e"):
        _not_landed(g, plat, pid)
    clock.advance(11)
    sw.run_once()

    class CapOnAB(Policy):
        """A transient cap on parents a and b (it never lifts in this test)."""

        def limit_reason(self, parent, *args, **kwargs):
            """Skip a and b for a cap, let others through."""
            return "hourly_cap" if parent.id in ("a", "b") else None

    pol = Pollers(store, plat, Pipeline(g, lambda p: "answer", CapOnAB(), clock), PollerConfig(refind_batch=2), clock)
    for _ in range(4):
        clock.advance(600)
        pol.refind()
    assert {pid: plat.reply_count(pid) for pid in "abcde"} == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
    # A transient cap does not retire a row: it keeps waiting.
    assert store.peek(g.key("a")).state == st.NOT_LANDED


# -- 3. the sweep racing a send ------------------------------------------------------------------


class SlowFirstSend(MemoryPlatform):
    """The first send reaches the platform late and its answer is lost later still (threads drive it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.created = threading.Event()
        self.release = threading.Event()
        self.first = True

    def send(self, parent, text, *, provider_key):
        """Block until told, create the reply, block again, then fail ambiguously."""
        if self.first:
            self.first = False
            self.created.wait(10)
            self._create(parent, text, provider_key)
            self.release.wait(10)
            raise MaybeSent("send: ReadTimeout (outcome unknown)")
        return super().send(parent, text, provider_key=provider_key)


def _race(store: Store, clock: FakeClock, *, watch: bool) -> tuple[SlowFirstSend, Guard, Sweeper, Pollers]:
    """Drive a sweep racing a send: the platform acts at t0+35 on a send still running, the sweep looks at t0+40."""
    plat = SlowFirstSend(clock=clock, listing_delay_s=10.0)
    parent = plat.add_parent("p1")
    ident = plat.whoami()
    g_a = Guard(store, plat, ident, clock=clock, owner="A", send_timeout_s=30.0, watch_interval_s=None)
    g_b = Guard(store, plat, ident, clock=clock, owner="B", send_timeout_s=30.0, watch_interval_s=None)
    sweeper = Sweeper(store, [Bot(plat, ident)], clock=clock, owner="S")
    pol_b = Pollers(store, plat, Pipeline(g_b, lambda p: "answer", Policy(), clock), PollerConfig(), clock)
    out: dict[str, object] = {}
    th = threading.Thread(target=lambda: out.setdefault("A", g_a.post(parent, "answer")))
    th.start()
    for _ in range(200):  # until A's send is running (real time: the thread must reach the platform)
        if g_a.sends.overdue(clock.now(), 0.0):
            break
        time.sleep(0.01)
    clock.advance(35)
    plat.created.set()
    if watch:
        assert g_a.watch_sends() == 1  # the send watch ticks while the send runs past half its budget
    clock.advance(5)  # t0+40: the claim's deadline
    swept = sweeper.run_once()
    if watch:
        assert swept.not_landed == 0 and store.peek(g_a.key("p1")).state == st.OPEN
    clock.advance(5)
    plat.release.set()
    th.join(10)
    assert out["A"].status is Status.UNCERTAIN
    return plat, g_a, sweeper, pol_b


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "late-maybe-sent"])
def test_sweep_never_answers_twice_beside_a_running_send(store, clock, watch) -> None:
    """A send still running past its deadline: the watch keeps the sweep off, or its late maybe-sent reopens the row.

    Either way the parent ends with one reply, closed by the sweep from the read-back, and re-find posts nothing.
    """
    plat, g_a, sweeper, pol_b = _race(store, clock, watch=watch)
    row = store.peek(g_a.key("p1"))
    assert row.state == st.OPEN and row.attempt == 1
    clock.advance(600)
    pol_b.refind()
    clock.advance(11)
    sweeper.run_once()
    pol_b.refind()
    assert plat.reply_count("p1") == 1
    assert store.peek(g_a.key("p1")).state == st.CLOSED
    kinds = [(e.kind, e.state) for e in store.history(g_a.key("p1"))]
    assert ("send_overdue", st.OPEN) in kinds if watch else ("maybe_sent", st.OPEN) in kinds


def test_late_success_closes_a_row_that_gave_up(store, clock) -> None:
    """A send that returns its reply id after the sweep gave up on it closes the row (the platform's truth)."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, max_attempts=1, watch_interval_s=None)
    sw = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, max_attempts=1)
    parent = plat.add_parent("p1")
    real_send = plat.send

    def send_judged_meanwhile(parent, text, *, provider_key):
        clock.advance(16)
        sw.run_once()  # the sweep reads back before the reply exists: gave_up (no attempt left)
        return real_send(parent, text, provider_key=provider_key)

    plat.send = send_judged_meanwhile  # type: ignore[method-assign]
    out = g.post(parent, "x")
    row = store.peek(g.key("p1"))
    assert out.status is Status.POSTED and row.state == st.CLOSED and row.reply_id == out.reply_id
    assert [e.kind for e in store.history(g.key("p1"))] == ["claimed", "gave_up", "closed"]


class Trickle:
    """A raw HTTP server that reads one request, trickles interim 102 lines, creates at 2.4 s, answers at 3 s."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.answered = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        c, _ = self.sock.accept()
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += c.recv(65536)
        head, body = buf.split(b"\r\n\r\n", 1)
        n = int([x.split(b":")[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")][0])
        while len(body) < n:
            body += c.recv(65536)
        try:
            for _ in range(3):
                time.sleep(0.8)
                c.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
            time.sleep(0.6)
            status = {"id": "900", "in_reply_to_id": "1", "url": "u", "account": {"id": "7", "acct": "bot"},
                      "created_at": "2026-01-01T00:00:00Z", "content": ""}
            b = json.dumps(status).encode()
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(b) + b)
            self.answered.set()
        except OSError:
            pass  # the client gave up: what the test expects
        finally:
            c.close()


def test_send_ends_within_send_timeout_however_the_server_trickles(store, clock) -> None:
    """With ``send_timeout_s = 1`` a send through replyd's client ends by its deadline, not when the server answers.

    The server keeps each read under the per-phase timeout with 102 lines and answers 200 only at 3 s (e2b);
    the guard's whole-request deadline cuts it: the outcome is uncertain (the sweep decides), not posted.
    """
    srv = Trickle()
    with make_client(1.0, connect_s=1.0) as http:
        plat = make_platform("mastodon", {"base_url": f"http://127.0.0.1:{srv.port}", "token": "t", "timeout_s": 1.0,
                                          "idempotency": False, "listing_delay_s": 5.0}, http=http, clock=clock)
        from replyd.platforms.base import Identity

        g = Guard(store, plat, Identity(sender_id="7", handle="bot"), clock=clock, send_timeout_s=1.0,
                  watch_interval_s=None)
        out = g.post(Parent(id="1", author_id="a"), "hi")
    # Cut at 1 s: the server's 200 (at 3 s) never reached the client, so the outcome is the sweep's to decide.
    assert out.status is Status.UNCERTAIN, out
    assert not srv.answered.is_set()


# -- 4. stale composers and the library's clock ---------------------------------------------------


def _wait_for(cond, what: str) -> None:
    """Wait (real time, for another thread to get there) until ``cond()`` holds."""
    for _ in range(500):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("stale", ["decline", "raise"])
def test_composer_whose_lease_was_taken_cannot_end_the_row(store, clock, stale) -> None:
    """A composer that outlived its lease cannot decline or release the row while the new holder composes (e5)."""
    plat = MemoryPlatform(clock=clock)
    p = plat.add_parent("p1")
    g_a = Guard(store, plat, plat.whoami(), clock=clock, owner="A", compose_lease_s=120, watch_interval_s=None)
    g_b = Guard(store, plat, plat.whoami(), clock=clock, owner="B", compose_lease_s=120, watch_interval_s=None)
    go_a, go_b, out = threading.Event(), threading.Event(), {}

    def slow_a(parent: Parent) -> str | None:
        go_a.wait(10)  # A's responder, slower than its lease, finally declines or fails
        if stale == "raise":
            raise RuntimeError("A's responder failed late")
        return None

    def answer_b(parent: Parent) -> str:
        go_b.wait(10)
        return "B's answer"

    ta = threading.Thread(target=lambda: out.setdefault("A", g_a.post(p, slow_a)))
    ta.start()
    held_by = lambda who: (r := store.peek(g_a.key("p1"))) is not None and (r.lease_owner or "").startswith(who)  # noqa: E731
    _wait_for(lambda: held_by("A/"), "A's claim")
    clock.advance(121)  # A's lease expired; B takes the key
    tb = threading.Thread(target=lambda: out.setdefault("B", g_b.post(p, answer_b)))
    tb.start()
    _wait_for(lambda: held_by("B/"), "B's claim")
    go_a.set()
    ta.join(10)
    row = store.peek(g_a.key("p1"))
    assert row.state == st.COMPOSING and row.lease_owner.startswith("B/")  # B's claim: its own lease
    assert out["A"].status is Status.IN_FLIGHT
    go_b.set()
    tb.join(10)
    assert out["B"].status is Status.POSTED and plat.reply_count("p1") == 1


def test_two_replicas_cannot_both_take_an_expired_lease(store, clock) -> None:
    """Two replicas that read the same expired composing row: one takes it, the other's reclaim fails (one compose)."""
    plat = MemoryPlatform(clock=clock)
    p = plat.add_parent("p1")
    g_a = Guard(store, plat, plat.whoami(), clock=clock, owner="A", compose_lease_s=60, watch_interval_s=None)
    g_b = Guard(store, plat, plat.whoami(), clock=clock, owner="B", compose_lease_s=60, watch_interval_s=None)
    with pytest.raises(Crash):
        g_a.post(p, lambda q: (_ for _ in ()).throw(Crash()))
    clock.advance(61)
    stale = store.peek(g_a.key("p1"))
    calls: list[str] = []
    # B and a restarted A read the same expired row; B's claim lands first.
    assert g_b.post(p, lambda q: (calls.append("B"), None)[1]).status is Status.DECLINED
    vals = {"state": st.COMPOSING, "lease_owner": "A2", "lease_until": clock.now() + 60, "updated_at": clock.now()}
    won = store.cas_event(g_a.key("p1"), states=[stale.state], attempt=stale.attempt, values=vals,
                          lease_owner=st.lease_holder(stale))
    assert not won and calls == ["B"]


@pytest.mark.postgres
def test_library_guard_takes_the_database_clock(pg_url) -> None:
    """``open_guard`` on PostgreSQL decides on the database's clock, as the daemon does (db_clock)."""
    plat = MemoryPlatform()
    with open_guard(pg_url, plat) as session:
        assert isinstance(session.guard.clock, DatabaseClock)
        assert session.store.clock is session.guard.clock
    with open_guard(pg_url, plat, db_clock=False) as session:
        assert not isinstance(session.guard.clock, DatabaseClock)
