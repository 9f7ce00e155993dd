"""Clocks: the one place replyd reads the time, so tests can move it by hand."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Source of wall-clock time in epoch seconds."""

    def now(self) -> float:
        """Return the current time in seconds since the epoch."""
        ...


class SystemClock:
    """The real wall clock."""

    def now(self) -> float:
        """Return ``time.time()``."""
        return time.time()


class FakeClock:
    """A clock that only moves when told to; thread-safe."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        """Return the current fake time."""
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` and return the new time."""
        with self._lock:
            self._t += seconds
            return self._t

    def set(self, t: float) -> None:
        """Jump to ``t`` (backwards too, to test clock jumps)."""
        with self._lock:
            self._t = t
