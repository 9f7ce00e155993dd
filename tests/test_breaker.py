"""The write-path breaker on the injected clock, alone and under the guard and the sweep (SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest

from replyd import metrics
from replyd import store as st
from replyd.breaker import Admit, Breaker
from replyd.clock import FakeClock
from replyd.config import BreakerConfig, GuardConfig
from replyd.guard import Guard, Status
from replyd.platforms.memory import MemoryPlatform
from replyd.sweep import Bot, Sweeper

CFG = BreakerConfig(window=5, min_failures=3, failure_ratio=0.6, probe_s=2.0, probe_max_s=8.0)


class Listener:
    """Records every ``set_breaker`` call, as the readiness record would receive it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, str]] = []

    def set_breaker(self, bot: str, open: bool, reason: str) -> None:
        """Note the call."""
        self.calls.append((bot, open, reason))


def gauge(platform: str) -> float:
    """The ``replyd_breaker_open`` value of ``platform``."""
    return metrics.BREAKER_OPEN.labels(metrics.platform_label(platform))._value.get()


def make(clock: FakeClock, listener: Listener | None = None) -> Breaker:
    return Breaker(CFG, clock, bot="b1", platform="memory:brk", listener=listener)


def test_opens_when_most_recent_sends_fail_and_hands_back_their_refs():
    """Two failures of five stay closed; the third opens it and returns the three failed sends to mark."""
    clock, lst = FakeClock(), Listener()
    b = make(clock, lst)
    assert b.record(b.admit(), "ok1", False) == [] and b.record(b.admit(), "f1", True) == []
    assert b.record(b.admit(), "ok2", False) == [] and b.record(b.admit(), "f2", True) == []
    assert not b.is_open and b.admit().kind is Admit.SEND
    assert b.record(b.admit(), "f3", True) == ["f1", "f2", "f3"]
    assert b.is_open and b.admit().kind is Admit.REFUSED
    assert lst.calls == [("b1", True, "3 of the last 5 sends failed")] and gauge("memory:brk") == 1


def test_a_minority_of_failures_never_opens():
    """Failures below the ratio (2 in 5, then 3 in 6 → window of 5 holds 2-3 of 5 mixed) keep sending."""
    b = make(FakeClock())
    for i in range(20):  # every other send fails: 50 % < 60 %
        b.record(b.admit(), i, i % 2 == 0)
    assert not b.is_open


def test_rate_limits_say_nothing():
    """A 429 verdict (None) neither fills the window nor opens it."""
    b = make(FakeClock())
    for i in range(10):
        b.record(b.admit(), i, None)
    assert not b.is_open


def test_probe_interval_doubles_up_to_the_cap_and_one_probe_at_a_time():
    """Open: refused until probe_s; then one probe; a failed probe doubles the wait (2, 4, 8, 8 s)."""
    clock = FakeClock()
    b = make(clock)
    for i in range(3):
        b.record(b.admit(), i, True)
    waits = []
    for _ in range(4):
        start = clock.now()
        while (t := b.admit()).kind is not Admit.PROBE:
            assert t.kind is Admit.REFUSED
            clock.advance(0.5)
        waits.append(clock.now() - start)
        assert b.admit().kind is Admit.REFUSED  # the probe is out: nobody else sends
        assert b.record(t, "probe", True) == ["probe"]  # a failed probe is an outage send too
    assert waits == [2.0, 4.0, 8.0, 8.0] and b.is_open


def test_a_landed_probe_closes_and_a_later_open_starts_at_probe_s():
    """The probe lands: closed, every call sends, listener and gauge told; a new outage waits probe_s again."""
    clock, lst = FakeClock(), Listener()
    b = make(clock, lst)
    for i in range(3):
        b.record(b.admit(), i, True)
    clock.advance(2.0)
    b.record(b.admit(), "p", True)  # interval now 4 s
    clock.advance(4.0)
    t = b.admit()
    assert t.kind is Admit.PROBE and b.record(t, "p2", False) == []
    assert not b.is_open and b.admit().kind is Admit.SEND and gauge("memory:brk") == 0
    assert [c[1] for c in lst.calls] == [True, False]
    for i in range(3):
        b.record(b.admit(), i, True)
    assert b.retry_in_s() == pytest.approx(2.0)


def test_an_abandoned_probe_lets_the_next_call_probe_and_a_stale_abandon_changes_nothing():
    """A probe whose key was not claimable is handed back; abandoning an old ticket later ends no other probe."""
    clock = FakeClock()
    b = make(clock)
    for i in range(3):
        b.record(b.admit(), i, True)
    clock.advance(2.0)
    first = b.admit()
    b.abandon(first)
    second = b.admit()
    assert first.kind is second.kind is Admit.PROBE
    b.abandon(first)  # late: must not free the slot second holds
    assert b.admit().kind is Admit.REFUSED


def test_open_during_covers_every_spell():
    """open_during answers for the spells it was open, not for the time between."""
    clock = FakeClock()
    b = make(clock)
    t0 = clock.now()
    for i in range(3):
        b.record(b.admit(), i, True)
    clock.advance(2.0)
    b.record(b.admit(), "p", False)
    clock.advance(10.0)
    assert b.open_during(t0 - 5, t0 - 1) is False
    assert b.open_during(t0 + 1, t0 + 1.5) is True
    assert b.open_during(t0 + 3, t0 + 10) is False


# -- under the guard and the sweep ------------------------------------------------------------------


@pytest.fixture
def plat(clock):
    """A scripted in-memory platform with a 5 s listing delay."""
    return MemoryPlatform(clock=clock, listing_delay_s=5.0)


def rig(store, plat, clock, **guard_kw):
    """A guard with a breaker and a sweeper that sees it, like the daemon builds them."""
    gcfg = GuardConfig(retry_backoff_s=4.0, retry_backoff_max_s=16.0, **guard_kw)
    brk = Breaker(CFG, clock, bot="b1", platform=plat.instance)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, max_attempts=gcfg.max_attempts,
              watch_interval_s=None, breaker=brk)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), breaker=brk)], clock=clock, retry_s=30.0,
                 max_attempts=gcfg.max_attempts, guard_config=gcfg)
    return g, sw, brk


def compose(_parent):
    """A responder that always answers."""
    return "thanks"


def test_an_outage_spends_no_attempt_and_every_parent_is_answered_once(store, plat, clock):
    """Sends fail 100 %: three open the breaker, new parents are held, probes double; when a probe lands
    every parent is answered once, none gave up, and each row's counted attempts are exactly its one landing."""
    g, sw, brk = rig(store, plat, clock)
    plat.script = ["error_before"] * 6  # the outage: 3 sends that trip it, then 3 failed probes
    parents = [plat.add_parent(f"p{i}") for i in range(8)]
    for p in parents[:3]:
        assert g.post(p, compose, path="inbox").status is Status.UNCERTAIN
    assert brk.is_open
    for p in parents[3:]:  # held as released rows, nothing sent, no responder call needed
        out = g.post(p, compose, path="inbox")
        assert out.status is Status.NOT_SENT and "breaker" in out.detail
        assert store.get(g.key(p.id)).state == st.RELEASED
    assert plat.send_calls == 3
    for _ in range(60):  # the daemon's jobs, by hand: sweep, then re-offer every waiting row
        clock.advance(1.0)
        sw.run_once()
        for p in parents:
            g.post(p, compose, path="refind")
    assert not brk.is_open
    for _ in range(40):
        clock.advance(1.0)
        sw.run_once()
        for p in parents:
            g.post(p, compose, path="refind")
    assert [plat.reply_count(p.id) for p in parents] == [1] * 8
    assert plat.send_calls == 3 + 3 + 8  # the sends that tripped it, three failed probes, one landing each
    for p in parents:
        row = store.get(g.key(p.id))
        kinds = [e.kind for e in store.history(g.key(p.id))]
        assert row.state == st.CLOSED and "gave_up" not in kinds, (p.id, kinds)
        assert row.attempt - row.excused == 1, (p.id, row.attempt, row.excused, kinds)  # only the landing counts


def test_attempts_outside_an_outage_still_count(store, plat, clock):
    """One lost send among landing ones opens nothing: with proven retries not excused (max_proven_retries 0), its
    parent spends attempts and gives up at max_attempts."""
    g, sw, brk = rig(store, plat, clock, max_proven_retries=0)
    lone = plat.add_parent("lone")
    plat.script = ["error_before"]
    assert g.post(lone, compose).status is Status.UNCERTAIN
    for i in range(4):
        assert g.post(plat.add_parent(f"ok{i}"), compose).status is Status.POSTED
    plat.script = ["error_before"]
    for _ in range(40):
        clock.advance(1.0)
        sw.run_once()
        g.post(lone, compose)
    assert not brk.is_open
    row = store.get(g.key("lone"))
    assert row.state == st.GAVE_UP and row.attempt == 2 and row.excused == 0


def test_retries_proven_not_landed_by_two_reads_are_excused_up_to_the_bound(store, plat, clock):
    """Weather outside an outage: the first attempt's walk-only proof counts; each retry proven not landed by the
    walk and the parent's own replies is excused (back-off, no attempt) up to guard.max_proven_retries, after which
    proofs count again and max_attempts gives up."""
    g, sw, brk = rig(store, plat, clock, max_proven_retries=2)
    lone = plat.add_parent("lone")
    for i in range(4):
        assert g.post(plat.add_parent(f"ok{i}"), compose).status is Status.POSTED
    plat.script = ["error_before"]
    assert g.post(lone, compose).status is Status.UNCERTAIN
    for i in range(120):  # landing sends between the lone parent's failures: the breaker stays closed
        clock.advance(1.0)
        sw.run_once()
        assert g.post(plat.add_parent(f"w{i}"), compose).status is Status.POSTED
        plat.script = ["error_before"]
        g.post(lone, compose)
        plat.script = []
    assert not brk.is_open
    row = store.get(g.key("lone"))
    events = [(e.kind, e.attempt) for e in store.history(g.key("lone"))]
    assert ("excused", 2) in events and ("excused", 3) in events and ("excused", 1) not in events, events
    assert ("proven_not_landed", 4) not in events and ("excused", 4) not in events, events
    assert row.state == st.GAVE_UP and row.attempt == 4 and row.excused == 2, (row, events)
    assert plat.reply_count("lone") == 0 and plat.send_calls == 4 + 4 + 120


def test_excused_retries_back_off_and_end_at_the_horizon(store, plat, clock):
    """An excused not_landed waits its back-off; past guard.retry_horizon_s the next proof gives up."""
    g, sw, brk = rig(store, plat, clock, retry_horizon_s=100.0, max_proven_retries=0)
    plat.script = ["error_before"] * 3
    ps = [plat.add_parent(f"h{i}") for i in range(3)]
    for p in ps:
        g.post(p, compose)
    assert brk.is_open
    clock.advance(16.0)  # past the deadline (10 s send + 5 s delay)
    sw.run_once()
    row = store.get(g.key("h0"))
    assert row.state == st.NOT_LANDED and row.excused == 1 and row.not_before == pytest.approx(clock.now() + 4.0)
    brk.record(brk.admit(), "elsewhere", False)  # the platform is back (another parent's probe landed)
    assert g.post(ps[0], compose).status is Status.NOT_SENT  # backing off
    assert plat.send_calls == 3
    clock.advance(4.0)
    plat.script = ["error_before"]
    assert g.post(ps[0], compose).status is Status.UNCERTAIN  # attempt 2 fails outside an outage: it counts
    clock.advance(100.0)  # and the horizon has passed
    sw.run_once()
    row = store.get(g.key("h0"))
    assert row.state == st.GAVE_UP and row.attempt == 2 and row.excused == 1
    # h1's excused retry, proven not landed while the breaker is open again, after the horizon: given up too.
    for i in range(3):
        brk.record(brk.admit(), f"x{i}", True)
    clock.advance(brk.retry_in_s())
    plat.script = ["error_before"]
    assert g.post(ps[1], compose).status is Status.UNCERTAIN  # the probe
    clock.advance(16.0)
    sw.run_once()
    last = store.history(g.key("h1"))[-1]
    assert store.get(g.key("h1")).state == st.GAVE_UP and '"horizon": true' in last.detail


def test_the_breaker_opening_while_composing_releases_before_the_open_commit(store, plat, clock):
    """A claim admitted while closed whose compose outlasts the breaker's opening is released, not sent."""
    g, _, brk = rig(store, plat, clock)

    def trip_then_answer(_parent):
        for i in range(3):
            brk.record(brk.admit(), f"other{i}", True)
        return "thanks"

    out = g.post(plat.add_parent("c1"), trip_then_answer)
    assert out.status is Status.NOT_SENT and plat.send_calls == 0
    row = store.get(g.key("c1"))
    assert row.state == st.RELEASED and row.attempt == 1 and row.opened_at is None


def test_a_send_judged_before_the_outage_was_seen_is_excused_when_the_breaker_opens(store, plat, clock):
    """The first failed send is proven not landed (and, with max_attempts 1, given up) before two more open
    the breaker: opening excuses it late, back to not_landed, and the parent is answered after the outage."""
    g, sw, brk = rig(store, plat, clock, max_attempts=1)
    plat.script = ["error_before"] * 3
    first = plat.add_parent("early")
    assert g.post(first, compose).status is Status.UNCERTAIN
    clock.advance(16.0)
    sw.run_once()
    assert store.get(g.key("early")).state == st.GAVE_UP  # counted: nothing showed an outage yet
    for i in range(2):
        g.post(plat.add_parent(f"late{i}"), compose)
    assert brk.is_open
    row = store.get(g.key("early"))
    assert row.state == st.NOT_LANDED and row.excused == 1 and row.attempt - row.excused == 0
    clock.advance(brk.retry_in_s())
    assert g.post(first, compose).status is Status.POSTED  # the probe lands: closed, answered once
    assert not brk.is_open and plat.reply_count("early") == 1
    row = store.get(g.key("early"))
    assert row.state == st.CLOSED and row.attempt - row.excused == 1
