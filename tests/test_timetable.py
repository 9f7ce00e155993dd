"""The daemon's timetable of polls (``replyd.timetable``): APScheduler's interval rules on one heap, driven by a
fake monotonic clock (``due``), and its thread firing real runs."""

from __future__ import annotations

import random
import threading
import time

import pytest

from replyd.timetable import Timetable


class Mono:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_first_run_at_once_then_every_interval_on_a_fixed_grid() -> None:
    """A job runs when added, then at each slot of its grid: a late look does not move the slots after it."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now)
    tt.add("a", 5.0, phase_s=5.0)
    assert tt.due(now.t) == ["a"]
    assert tt.due(now.t + 4.9) == []
    assert tt.due(now.t + 6.2) == ["a"]  # 1.2 s late
    assert tt.next_in_s(now.t + 6.2) == pytest.approx(3.8)  # the next slot is 1010, not 1011.2: no drift
    assert tt.due(now.t + 10.0) == ["a"]


def test_missed_slots_are_one_run() -> None:
    """A thread held for several intervals runs each job once, then goes on from the next slot (coalesced)."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now)
    tt.add("a", 1.0, phase_s=1.0)
    tt.add("b", 2.0, phase_s=2.0)
    assert sorted(tt.due(now.t)) == ["a", "b"]
    assert sorted(tt.due(now.t + 7.5)) == ["a", "b"]  # 7 missed slots of a, 3 of b: one run each
    assert tt.due(now.t + 7.9) == []
    assert tt.due(now.t + 8.0) == ["a", "b"]


def test_jitter_delays_each_slot_within_its_bound_and_never_drifts() -> None:
    """Each slot is late by uniform(0, jitter_s); the grid under it stays put."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now, rng=random.Random(7))
    tt.add("a", 5.0, jitter_s=1.0, phase_s=5.0)
    assert tt.due(now.t) == ["a"]  # the first run is not jittered: a bot polls as it starts
    lates = []
    for k in range(1, 200):
        at = now.t + tt.next_in_s(now.t)
        lates.append(at - (1000.0 + 5.0 * k))
        now.t = at
        assert tt.due(now.t) == ["a"]
    assert all(0.0 <= x <= 1.0 for x in lates) and max(lates) - min(lates) > 0.5


def test_many_jobs_fire_in_due_order() -> None:
    """Jobs added with their first run spread out come due in that order."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now)
    for i in range(100):
        tt.add(f"j{i}", 5.0, first_in_s=5.0 * (99 - i) / 100, phase_s=5.0)
    got = []
    for step in range(1, 500):  # to 4.99 s: each first slot, none of the second ones
        got += tt.due(now.t + step * 0.01)
    assert got == [f"j{i}" for i in range(99, -1, -1)]


def test_jobs_added_together_run_at_once_then_spread_over_their_interval() -> None:
    """1,000 jobs added at one moment (a daemon's bots starting) all run at once, then no longer in step: their
    next slots cover the interval (none of its tenths holds more than twice its share), each within one interval."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now, rng=random.Random(36))
    for i in range(1000):
        tt.add(f"bot{i}:inbox", 5.0)
    assert len(tt.due(now.t)) == 1000
    tenths = [0] * 10
    for step in range(1, 501):
        got = tt.due(now.t + step * 0.01)
        tenths[(step - 1) // 50] += len(got)
    assert sum(tenths) == 1000 and max(tenths) <= 200, tenths


def test_bad_interval_is_refused() -> None:
    """An interval of 0 or less is a ValueError naming the job."""
    with pytest.raises(ValueError, match="j: every_s"):
        Timetable(lambda j: None).add("j", 0)


def test_the_thread_fires_runs_and_stops() -> None:
    """On the real clock: a job every 20 ms fires several times; a run that raises does not stop the others;
    stop ends the thread."""
    fired: list[str] = []
    lock = threading.Lock()
    enough = threading.Event()

    def fire(job_id: str) -> None:
        with lock:
            fired.append(job_id)
            if fired.count("ok") >= 5:
                enough.set()
        if job_id == "bad":
            raise RuntimeError("boom")

    tt = Timetable(fire)
    tt.start()
    tt.add("ok", 0.02)
    tt.add("bad", 0.02)
    assert enough.wait(5.0), fired
    tt.stop()
    assert fired.count("bad") >= 2  # it kept firing after the first raised
    assert tt._thread is not None and not tt._thread.is_alive()  # stopped: nothing left that could fire


def test_a_removed_job_runs_no_more_and_the_others_keep_their_slots() -> None:
    """A reload removes a bot's polls: its job is never due again; the other jobs' grid does not move."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now)
    tt.add("a:inbox", 1.0, phase_s=1.0)
    tt.add("b:inbox", 1.0, phase_s=1.0)
    assert sorted(tt.due(now.t)) == ["a:inbox", "b:inbox"]
    assert tt.remove("a:inbox") and not tt.remove("a:inbox")
    assert tt.due(now.t + 1.0) == ["b:inbox"] and tt.due(now.t + 2.0) == ["b:inbox"]


def test_the_thread_wakes_on_ticks_and_a_start_poll_is_not_held() -> None:
    """With ticks, the wait ends on the first tick at or after the earliest slot; a run due now waits for none."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now, tick_s=0.25)
    tt.add("a", 5.0, phase_s=5.0)
    assert tt.wake_in_s(now.t) == 0.0  # a bot's first poll as it starts: at once
    assert tt.due(now.t) == ["a"]
    now.t += 0.1
    assert tt.next_in_s(now.t) == pytest.approx(4.9)
    assert tt.wake_in_s(now.t) == pytest.approx(4.9)  # the slot at 1005.0 is on a tick: woken right then
    tt.add("b", 5.0, first_in_s=0.03)  # due at 1000.13: its tick is 1000.25
    assert tt.wake_in_s(now.t) == pytest.approx(0.15)
    assert Timetable(lambda j: None, now=now).wake_in_s(now.t) is None  # nothing booked
    with pytest.raises(ValueError, match="tick_s"):
        Timetable(lambda j: None, tick_s=-1.0)


def test_the_thread_fires_runs_due_between_two_ticks_together() -> None:
    """Runs due at different moments within one tick are fired on that tick, by the real thread."""
    fired: list[tuple[str, float]] = []
    lock = threading.Lock()
    both = threading.Event()
    tick_s = 0.2

    def fire(job_id: str) -> None:
        with lock:
            fired.append((job_id, time.monotonic()))
            if {j for j, _ in fired} >= {"x", "y"} and len(fired) >= 4:
                both.set()

    tt = Timetable(fire, tick_s=tick_s)
    now = time.monotonic()
    tick = (now // tick_s + 1) * tick_s  # both due inside the tick after this one
    tt.add("x", 4.0, first_in_s=tick + 0.03 - now, phase_s=0.31)  # a tick of 0.2 s is a twentieth of 4 s: kept
    tt.add("y", 4.0, first_in_s=tick + 0.10 - now, phase_s=0.17)
    tt.start()
    try:
        assert both.wait(5.0), fired
    finally:
        tt.stop()
    (j1, t1), (j2, t2) = fired[:2]  # due 70 ms apart, fired on one wake of the thread
    assert {j1, j2} == {"x", "y"} and t2 - t1 < 0.03, fired


def test_a_short_interval_gets_a_finer_tick() -> None:
    """A job every 0.4 s is at most 0.02 s late, not a whole 0.25 s tick (a twentieth of the interval)."""
    now = Mono()
    tt = Timetable(lambda j: None, now=now, tick_s=0.25)
    tt.add("slow", 5.0, phase_s=5.0)
    assert tt.due(now.t) == ["slow"]
    tt.add("fast", 0.4, first_in_s=0.013)
    assert tt.wake_in_s(now.t) == pytest.approx(0.02)
