"""The daemon's job pool: a fixed set of threads for every bot's runs, the polls that find new parents first.

One pool serves every run of every bot, so threads do not grow with the bots. Its queue has two lanes,
each first in, first out: polls (``urgent``: they find the parents waiting for an answer) and the rest (the
sweep's one-shot passes, re-offers, start attempts, the scheduler's ticks). A free thread takes the next poll
unless the rest's oldest run has waited ``patience_s``: then that one, so upkeep is late under load, never
starved. Why: after a burst of mentions every bot's close is due for its verifying read-back at about the same
time, and one queue put those passes ahead of the polls that find the next mentions (1,000 bots with a sweep
every 2 s: the burst's median answer 4.5 s with one queue, 2.8-3.4 s with two).

Threads are woken sparingly. A run queued while another runs waits up to ``spread_s`` for a busy thread to
take it; only then is another thread woken. Idle threads park on a stack: the last to park is woken first.
So a light load stays on one or two hot threads. A condition's order handed each run to the next of 16
threads, and every run queued behind a busy one woke another. Each woken thread is one more contender for
the interpreter's lock. A slow platform still gets every thread: queued runs age past ``spread_s`` and wake them.

Not ``concurrent.futures.ThreadPoolExecutor``: it has one queue, and a run there costs a work item and a future
nobody reads (1,000 idle bots side by side: 0.79-0.81x the CPU per empty poll with this pool). ``submit`` (a future) is kept for APScheduler's executor; the daemon's own runs use ``run_soon``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from replyd.log import get_logger

log = get_logger("replyd.jobs")


class JobPool:
    """Up to ``threads`` threads (started as runs arrive) taking polls first and the rest by ``patience_s``;
    a run queued while a thread runs waits up to ``spread_s`` for it before another thread is woken."""

    def __init__(self, threads: int, *, patience_s: float = 10.0, spread_s: float = 0.05, name: str = "replyd-job",
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if threads < 1:
            raise ValueError("job_threads: must be at least 1")
        self.max_threads = threads
        self.patience_s = patience_s
        self.spread_s = spread_s
        self._monotonic = monotonic  # injected: tests age the queue without sleeping
        self._name = name
        self._lock = threading.Lock()
        self._urgent: deque[tuple[float, Callable[[], object]]] = deque()  # (queued at, time.monotonic; run)
        self._rest: deque[tuple[float, float, Callable[[], object]]] = deque()  # (queued at, ``monotonic``; the same; run)
        self._threads: list[threading.Thread] = []
        self._running = 0  # threads inside a run
        self._parked: list[threading.Event] = []  # idle threads, each on its own event; the last parked on top
        self._watcher: threading.Event | None = None  # the one idle thread that wakes for runs held too long
        self._watch_timed = False  # whether the watcher waits with a timeout (a run may be held) or for good
        self._closed = False

    def run_soon(self, fn: Callable[[], object], *, urgent: bool = False) -> None:
        """Queue ``fn()`` on its lane; raise RuntimeError once the pool is shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the job pool is shut down")
            now = time.monotonic()
            if urgent:
                self._urgent.append((now, fn))
            else:
                self._rest.append((self._monotonic(), now, fn))
            if self._running == 0 or self.spread_s <= 0:
                self._wake()  # nobody busy to take it
            elif self._watcher is None:  # one thread must watch: a busy one may hold this run past spread_s
                self._hand_watch()
            elif not self._watch_timed:
                self._watcher.set()  # it parks again with a timeout

    def _wake(self) -> None:
        """Wake the idle thread that parked last (the watcher when no other is parked), or start one (under the lock)."""
        if self._parked:
            self._parked.pop().set()
        elif self._watcher is not None:
            self._watcher.set()
            self._watcher = None
        else:
            self._start()

    def _hand_watch(self) -> None:
        """Wake a parked thread, or start one, to be the watcher (under the lock): it parks again as the watcher.
        The coldest parked thread: the hot one on top stays for the next run."""
        if self._parked:
            self._parked.pop(0).set()
        else:
            self._start()

    def _start(self) -> None:
        if len(self._threads) < self.max_threads:
            t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """``fn(*args, **kwargs)`` on the rest's lane, its result in a future (APScheduler's executor asks one)."""
        fut: Future[Any] = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # the future carries it, as ThreadPoolExecutor's would
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self.run_soon(run)
        return fut

    def _held_s(self) -> float | None:
        """How long the oldest queued run has waited (None: nothing queued)."""
        oldest = min([q[0][0] for q in (self._urgent,) if q] + [q[0][1] for q in (self._rest,) if q], default=None)
        return None if oldest is None else time.monotonic() - oldest

    def _next(self, fresh: bool) -> Callable[[], object] | None:
        """The run a thread takes now (under the lock), or None. A thread just done with a run (``fresh``)
        takes any; a woken one only while nobody runs, or once the oldest has waited ``spread_s``."""
        if not fresh and self._running and not self._closed:
            held = self._held_s()
            if held is None or held < self.spread_s:
                return None
        if self._rest and (not self._urgent or self._monotonic() - self._rest[0][0] >= self.patience_s):
            return self._rest.popleft()[2]
        if self._urgent:
            return self._urgent.popleft()[1]
        return None

    def _park(self, wake: threading.Event) -> float | None:
        """Park this thread (under the lock): as the watcher if there is none; the wait it takes (None: for good)."""
        if self._watcher is None:
            self._watcher = wake
            held = self._held_s()
            self._watch_timed = bool(self._running)
            if not self._watch_timed:
                return None
            return max(0.001, self.spread_s - (held or 0.0))
        self._parked.append(wake)
        return None

    def _work(self) -> None:
        wake = threading.Event()
        fresh = False  # a thread starts as woken: it defers to a busy one like any woken thread
        while True:
            with self._lock:
                if self._watcher is wake:
                    self._watcher = None  # timed out: decide again
                fn = self._next(fresh)
                if fn is None:
                    if self._closed and not (self._urgent or self._rest):
                        return  # shut down and drained
                    wait_s = self._park(wake)
                else:
                    self._running += 1
                    if self._watcher is None and (self._urgent or self._rest):
                        self._hand_watch()  # runs still queued: someone must time them
            if fn is None:
                wake.wait(wait_s)  # set by run_soon or shutdown (off the stack), or the watcher's timeout
                wake.clear()
                fresh = False
                continue
            try:
                fn()
            except Exception as exc:  # the daemon's runs report their own; one that does not must not end the thread
                log.error("replyd.jobs.failed", job=getattr(fn, "__name__", "job"), error=f"{type(exc).__name__}: {exc}"[:300])
            finally:
                with self._lock:
                    self._running -= 1
            del fn  # no reference kept to a finished run while the thread waits
            fresh = True

    def shutdown(self, wait: bool = True) -> None:
        """Take no new runs; the queued ones still run. ``wait``: return once every thread has ended."""
        with self._lock:
            self._closed = True
            for wake in [*self._parked, *([self._watcher] if self._watcher else [])]:
                wake.set()
            self._parked.clear()
            self._watcher = None
            threads = list(self._threads)
        if wait:
            for t in threads:
                t.join()
