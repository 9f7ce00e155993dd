"""The daemon's job pool (replyd/jobs.py): polls first, upkeep within its patience, a fixed set of threads."""

from __future__ import annotations

import threading
import time

import pytest

from replyd.jobs import JobPool


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _blocked(pool: JobPool) -> threading.Event:
    """Hold the pool's one thread until the returned event is set (the next runs queue behind it)."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    pool.run_soon(hold, urgent=True)
    assert started.wait(10)
    return release


def _recorder(order: list[str], done: threading.Event, last: str):
    """A run factory: each run appends its name; the one named ``last`` sets ``done``."""
    def make(name: str):
        def run() -> None:
            order.append(name)
            if name == last:
                done.set()
        return run
    return make


def _order(queue, last: str) -> list[str]:
    """The order the runs ``queue(pool, ticks, run)`` queued behind a busy thread ran in (``last`` ends it)."""
    ticks = Ticks()
    pool = JobPool(1, patience_s=10.0, monotonic=ticks)
    order: list[str] = []
    done = threading.Event()
    try:
        release = _blocked(pool)
        queue(pool, ticks, _recorder(order, done, last))
        release.set()
        assert done.wait(10)
    finally:
        pool.shutdown()
    return order


def test_polls_run_before_upkeep_queued_earlier() -> None:
    """With the thread busy, upkeep queued first and polls after: the polls run first, then the upkeep in order."""
    def queue(pool: JobPool, ticks: Ticks, run) -> None:
        pool.run_soon(run("sweep-1"))
        pool.run_soon(run("sweep-2"))
        pool.run_soon(run("poll-1"), urgent=True)
        pool.run_soon(run("poll-2"), urgent=True)

    assert _order(queue, "sweep-2") == ["poll-1", "poll-2", "sweep-1", "sweep-2"]


def test_upkeep_past_its_patience_goes_before_polls() -> None:
    """Upkeep that waited ``patience_s`` is taken before the polls queued behind it: late, never starved."""
    def queue(pool: JobPool, ticks: Ticks, run) -> None:
        pool.run_soon(run("sweep-old"))
        ticks.t = 9.0
        pool.run_soon(run("sweep-young"))
        pool.run_soon(run("poll-1"), urgent=True)
        pool.run_soon(run("poll-2"), urgent=True)
        ticks.t = 10.0  # the first sweep has waited its patience, the second 1 s

    assert _order(queue, "sweep-young") == ["sweep-old", "poll-1", "poll-2", "sweep-young"]


def test_threads_start_as_runs_arrive_up_to_the_bound() -> None:
    """Never more than ``threads`` threads, whatever is queued; every queued run runs."""
    pool = JobPool(3)
    gate = threading.Event()
    ran = []
    lock = threading.Lock()

    def run() -> None:
        gate.wait(10)
        with lock:
            ran.append(1)

    try:
        for i in range(20):
            pool.run_soon(run, urgent=i % 2 == 0)
        assert len(pool._threads) == 3
        gate.set()
    finally:
        pool.shutdown(wait=True)
    assert len(ran) == 20


def test_submit_gives_a_future_of_the_result_or_the_exception() -> None:
    """APScheduler's executor submits through ``submit``: the future carries the result, or what was raised."""
    pool = JobPool(2)
    try:
        assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(10) == 5
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(10)
    finally:
        pool.shutdown()


def test_shutdown_runs_what_is_queued_and_refuses_the_rest() -> None:
    """Runs queued before the shutdown still run; a run after it is refused with RuntimeError."""
    pool = JobPool(1)
    order: list[str] = []
    done = threading.Event()
    run = _recorder(order, done, "b")
    release = _blocked(pool)
    pool.run_soon(run("a"))
    pool.run_soon(run("b"), urgent=True)
    t = threading.Thread(target=pool.shutdown, kwargs={"wait": True})
    t.start()
    with pytest.raises(RuntimeError):
        pool.run_soon(run("late"))
    release.set()
    t.join(10)
    assert not t.is_alive() and done.is_set() and order == ["b", "a"]


def test_a_run_that_raises_does_not_end_its_thread() -> None:
    """An exception escaping a run is logged; the thread goes on with the next run."""
    pool = JobPool(1)
    done = threading.Event()
    try:
        pool.run_soon(lambda: 1 / 0)
        pool.run_soon(done.set)
        assert done.wait(10)
        assert len(pool._threads) == 1
    finally:
        pool.shutdown()


def test_a_light_load_stays_on_one_thread() -> None:
    """After a burst started all 16 threads, runs that come one after another run on one hot thread, not
    round all 16 (each hand-over costs the interpreter's lock)."""
    pool = JobPool(16, spread_s=0.01)
    names: set[str] = set()
    lock = threading.Lock()
    try:
        for _ in range(32):
            def slow() -> None:
                with lock:
                    names.add(threading.current_thread().name)
                time.sleep(0.5)

            pool.run_soon(slow, urgent=True)
        end = time.monotonic() + 10
        while len(names) < 16 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(names) == 16
        time.sleep(1.5)  # the burst is done: every thread parked
        names.clear()
        for _ in range(50):
            done = threading.Event()

            def run(done: threading.Event = done) -> None:
                names.add(threading.current_thread().name)
                done.set()

            pool.run_soon(run, urgent=True)
            assert done.wait(10)
            time.sleep(0.002)
    finally:
        pool.shutdown()
    assert len(names) == 1, names


def test_a_run_held_behind_a_stuck_one_is_taken_once_it_waited_the_spread() -> None:
    """One thread is stuck in a run: the runs queued behind it wait about ``spread_s``, then other threads take
    them, one thread each while they keep coming (the watcher wakes the next)."""
    pool = JobPool(4, spread_s=0.2)
    release = _blocked(pool)
    took: list[float] = []
    lock = threading.Lock()
    all_done = threading.Event()
    try:
        t0 = time.monotonic()
        for _ in range(3):
            def run() -> None:
                with lock:
                    took.append(time.monotonic() - t0)
                    if len(took) == 3:
                        all_done.set()

            pool.run_soon(run, urgent=True)
        assert all_done.wait(10), took
    finally:
        release.set()
        pool.shutdown()
    assert 0.15 <= took[0] < 2.0, took  # not at once (a busy thread might take it), never stuck behind the run


def test_a_busy_pool_wakes_every_thread_for_slow_runs() -> None:
    """Slow runs (a slow platform) queue up: all 8 threads end up running, none left parked."""
    pool = JobPool(8, spread_s=0.02)
    names: set[str] = set()
    lock = threading.Lock()
    try:
        for _ in range(40):
            def run() -> None:
                with lock:
                    names.add(threading.current_thread().name)
                time.sleep(0.1)

            pool.run_soon(run, urgent=True)
        time.sleep(1.0)
    finally:
        pool.shutdown()
    assert len(names) == 8, names
