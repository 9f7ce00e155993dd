"""The daemon's timetable of polls: every bot's interval paths (inbox, search, re-find) in one heap, one thread.

APScheduler keeps an interval job per bot and path: each run walks its job store, computes the next fire time
with time-zone aware datetimes, dispatches events and takes two locks. Measured alone with 1,000 no-op jobs every
5 s on 16 threads (a steering measurement, not in ``bench/``): 0.25 ms of CPU per run, a quarter of an empty
poll in ``bench/manybots.py``. Here the runs are
a heap of monotonic due times: the thread sleeps until the earliest, hands every due run to ``fire`` (the
daemon's ``_once``: the job pool, or a skip when the last run of that job is still queued or running) and puts
each back at its next slot. APScheduler keeps the daemon's few ticks (sweep, re-offer, clock).

The schedule: each slot delayed by up to ``jitter_s`` (uniform), runs missed while the thread was held
coalesced into one, a late run still run (no misfire grace), as APScheduler's interval jobs; but the slots
stay on a fixed grid (APScheduler adds the next interval to the jittered time, so jitter piles up: with the
default 2 s a 5 s inbox ran every 6 s on average), and the grid after a job's first run starts at a random
phase of its interval, so bots started together do not poll in step.

The thread wakes on a tick of ``tick_s`` (the daemon's: 0.25 s, or a twentieth of the shortest interval
booked if that is less) and fires every run due by then. Polls
spread evenly over the interval woke it once per poll; a lone request then costs more CPU than one among
many (caches gone cold between runs). Measured with ``bench/manybots.py``, 333 bots, re-find every 60 s:
10.1 % of a core without ticks, 7.0 % with 0.25 s ticks; 1,000 bots: 23.3 % and 22.5 %. Each poll is at
most one tick late; the grid under it does not move.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from replyd.log import get_logger

log = get_logger("replyd.timetable")


@dataclass(order=True)
class _Slot:
    """One job's next run: ``at`` (monotonic seconds) is the grid slot plus its jitter."""

    at: float
    seq: int
    job_id: str = field(compare=False)
    base: float = field(compare=False)  # the grid slot, before jitter
    every_s: float = field(compare=False)
    jitter_s: float = field(compare=False)


class Timetable:
    """Interval runs of many jobs from one thread; ``due(now)`` is the whole decision (tests drive it alone)."""

    def __init__(self, fire: Callable[[str], object], *, now: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, tick_s: float = 0.0) -> None:
        if tick_s < 0:
            raise ValueError(f"tick_s must be >= 0, got {tick_s}")
        self._fire = fire
        self._tick_s = tick_s  # lowered by add() to a twentieth of the shortest interval
        self._now = now
        self._rng = rng or random.Random()
        self._heap: list[_Slot] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, job_id: str, every_s: float, *, jitter_s: float = 0.0, first_in_s: float = 0.0,
            phase_s: float | None = None) -> None:
        """Run ``job_id`` every ``every_s`` (each slot up to ``jitter_s`` late): the first run ``first_in_s`` from
        now, the second ``phase_s`` after it (default: a random share of ``every_s``), then on that grid.

        The random phase spreads jobs added together (a daemon's bots, all started at once) over the interval:
        in step, 1,000 bots' polls came due within the jitter every interval, a queue on the pool each time.
        """
        if every_s <= 0:
            raise ValueError(f"{job_id}: every_s must be > 0, got {every_s}")
        self._tick_s = min(self._tick_s, every_s / 20)
        first = self._now() + first_in_s
        phase = self._rng.uniform(0.0, every_s) if phase_s is None else phase_s
        with self._cond:
            # The grid's slot before the second run: the first run is taken at ``first`` whatever the grid says.
            heapq.heappush(self._heap, _Slot(first, next(self._seq), job_id, first + phase - every_s, every_s,
                                             max(0.0, jitter_s)))
            self._cond.notify()

    def remove(self, job_id: str) -> bool:
        """Book no more runs of ``job_id`` (a run already handed to ``fire`` is not recalled); whether it was booked."""
        with self._cond:
            kept = [slot for slot in self._heap if slot.job_id != job_id]
            if len(kept) == len(self._heap):
                return False
            heapq.heapify(kept)
            self._heap = kept
            self._cond.notify()
        return True

    def due(self, now: float) -> list[str]:
        """Take the runs due at ``now`` (one per job however many slots it missed) and book each job's next slot."""
        out: list[str] = []
        with self._cond:
            heap = self._heap
            while heap and heap[0].at <= now:
                slot = heapq.heappop(heap)
                out.append(slot.job_id)
                # The next grid slot after now: slots missed while held are one run (coalesced), never a burst.
                missed = int((now - slot.base) // slot.every_s) + 1
                slot.base += missed * slot.every_s
                slot.at = slot.base + (self._rng.uniform(0.0, slot.jitter_s) if slot.jitter_s else 0.0)
                slot.seq = next(self._seq)
                heapq.heappush(heap, slot)
        return out

    def next_in_s(self, now: float) -> float | None:
        """Seconds until the earliest slot (None: nothing booked)."""
        with self._cond:
            return max(0.0, self._heap[0].at - now) if self._heap else None

    def wake_in_s(self, now: float) -> float | None:
        """Seconds until the thread should wake: the first tick at or after the earliest slot (None: nothing booked)."""
        wait_s = self.next_in_s(now)
        if wait_s is None or wait_s == 0.0 or not self._tick_s:
            return wait_s
        return math.ceil((now + wait_s) / self._tick_s) * self._tick_s - now

    def start(self) -> None:
        """Start the thread that fires due runs (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="replyd-timetable", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Fire nothing more; wait for the thread to end."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                wait_s = self.wake_in_s(self._now())
                if wait_s is None or wait_s > 0:
                    self._cond.wait(wait_s)  # woken early by add() and stop()
                    continue
            for job_id in self.due(self._now()):
                if self._stopped:
                    return
                try:
                    self._fire(job_id)
                except Exception as exc:  # the thread must outlive any one failure
                    log.error("replyd.timetable.fire_failed", job=job_id, error=f"{type(exc).__name__}: {exc}"[:300])
