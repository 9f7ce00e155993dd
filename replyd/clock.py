"""Clocks: the one place replyd reads the time, so tests can move it by hand."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable


class Clock(Protocol):
    """Source of wall-clock time in epoch seconds."""

    def now(self) -> float:
        """Return the current time in seconds since the epoch."""
        ...


@runtime_checkable
class Steady(Protocol):
    """A clock that also measures intervals no wall-clock step moves (an interval's ends on one clock)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never steps; only differences mean anything."""
        ...


def monotonic_of(clock: object) -> Callable[[], float]:
    """The step-free clock that goes with ``clock``: its own when it has one, else the process's."""
    return clock.monotonic if isinstance(clock, Steady) else time.monotonic


def shared(clock: object) -> bool:
    """Whether every replica reads the same step-free time from ``clock`` (the database's), so that a time
    one replica wrote can be subtracted from another's ``now``."""
    return isinstance(clock, DatabaseClock)


class SystemClock:
    """The real wall clock."""

    def now(self) -> float:
        """Return ``time.time()``."""
        return time.time()

    def monotonic(self) -> float:
        """Return ``time.monotonic()`` (NTP or an operator stepping the wall clock does not move it)."""
        return time.monotonic()


class FakeClock:
    """A clock that only moves when told to; thread-safe."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._t = start
        self._mono = 0.0  # moved by advance only: set() is a wall-clock step
        self._lock = threading.Lock()

    def now(self) -> float:
        """Return the current fake time."""
        with self._lock:
            return self._t

    def monotonic(self) -> float:
        """Return the seconds ``advance`` has moved the clock (a ``set`` step does not count)."""
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` and return the new time."""
        with self._lock:
            self._t += seconds
            self._mono += seconds
            return self._t

    def set(self, t: float) -> None:
        """Jump to ``t`` (backwards too, to test clock jumps), like NTP stepping a wall clock."""
        with self._lock:
            self._t = t


class OffsetClock:
    """Another clock plus a constant offset: a machine whose clock runs ``offset_s`` ahead (negative: behind)."""

    def __init__(self, base: Clock, offset_s: float) -> None:
        self.base = base
        self.offset_s = offset_s

    def now(self) -> float:
        """Return the base clock's time plus the offset."""
        return self.base.now() + self.offset_s


class DatabaseClock:
    """Epoch time taken from the database and carried forward by the local monotonic clock.

    Replicas on several machines compare each other's deadlines and leases:
    with their own wall clocks, a replica whose clock runs 30 s ahead sweeps
    the others' rows 30 s early (docs/RELIABILITY.md, "limits"). Reading the
    database's clock at every decision would cost a round trip on the hot
    path, so ``sync`` reads it once (the midpoint of the round trip is the
    anchor) and ``now`` adds the monotonic time elapsed since: a step of the
    local wall clock (NTP, an operator) changes nothing, and the error
    against the database is half a round trip plus monotonic drift until the
    next ``sync``.
    """

    def __init__(self, read_db_epoch: Callable[[], float], *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._read = read_db_epoch
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._anchor_epoch = 0.0
        self._anchor_mono = 0.0
        self.skew_s = 0.0  # database minus local wall clock at the last sync, for logs and status
        self.sync()

    def sync(self) -> float:
        """Re-anchor on the database's clock; return the correction applied in seconds (errors propagate)."""
        t0 = self._monotonic()
        db = self._read()
        t1 = self._monotonic()
        mid = (t0 + t1) / 2.0
        with self._lock:
            before = self._anchor_epoch + (mid - self._anchor_mono) if self._anchor_epoch else db
            self._anchor_epoch, self._anchor_mono = db, mid
            self.skew_s = db - time.time() + (t1 - mid)
        return db - before

    def monotonic(self) -> float:
        """Return the local monotonic clock this clock is carried forward by."""
        return self._monotonic()

    def now(self) -> float:
        """Return the database's epoch time as of the last sync, plus the monotonic time since."""
        with self._lock:
            return self._anchor_epoch + (self._monotonic() - self._anchor_mono)
