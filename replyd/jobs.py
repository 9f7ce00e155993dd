"""The daemon's job pool: a fixed set of threads for every bot's runs, the polls that find new parents first.

One pool serves every run of every bot, so threads do not grow with the bots. Its queue has two lanes,
each first in, first out: polls (``urgent``: they find the parents waiting for an answer) and the rest (the
sweep's one-shot passes, re-offers, start attempts, the scheduler's ticks). A free thread takes the next poll
unless the rest's oldest run has waited ``patience_s``: then that one, so upkeep is late under load, never
starved. Why: after a burst of mentions every bot's close is due for its verifying read-back at about the same
time, and one queue put those passes ahead of the polls that find the next mentions (1,000 bots with a sweep
every 2 s: the burst's median answer 4.5 s with one queue, 2.8-3.4 s with two).

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
    """Up to ``threads`` threads (started as runs arrive) taking polls first and the rest by ``patience_s``."""

    def __init__(self, threads: int, *, patience_s: float = 10.0, name: str = "replyd-job",
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if threads < 1:
            raise ValueError("job_threads: must be at least 1")
        self.max_threads = threads
        self.patience_s = patience_s
        self._monotonic = monotonic  # injected: tests age the queue without sleeping
        self._name = name
        self._cond = threading.Condition()
        self._urgent: deque[Callable[[], object]] = deque()
        self._rest: deque[tuple[float, Callable[[], object]]] = deque()  # (queued at, monotonic; run)
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def run_soon(self, fn: Callable[[], object], *, urgent: bool = False) -> None:
        """Queue ``fn()`` on its lane; raise RuntimeError once the pool is shut down."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the job pool is shut down")
            if urgent:
                self._urgent.append(fn)
            else:
                self._rest.append((self._monotonic(), fn))
            if self._idle:
                self._cond.notify()
            elif len(self._threads) < self.max_threads:
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

    def _next(self) -> Callable[[], object] | None:
        """The run a free thread takes (under the lock), or None when the pool is shut down and drained."""
        while True:
            if self._rest and (not self._urgent or self._monotonic() - self._rest[0][0] >= self.patience_s):
                return self._rest.popleft()[1]
            if self._urgent:
                return self._urgent.popleft()
            if self._closed:
                return None
            self._idle += 1
            self._cond.wait()
            self._idle -= 1

    def _work(self) -> None:
        while True:
            with self._cond:
                fn = self._next()
            if fn is None:
                return
            try:
                fn()
            except Exception as exc:  # the daemon's runs report their own; one that does not must not end the thread
                log.error("replyd.jobs.failed", job=getattr(fn, "__name__", "job"), error=f"{type(exc).__name__}: {exc}"[:300])
            del fn  # no reference kept to a finished run while the thread waits

    def shutdown(self, wait: bool = True) -> None:
        """Take no new runs; the queued ones still run. ``wait``: return once every thread has ended."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                t.join()
