"""Warnings anyone on the network can cause (a forged webhook, a wrong API token): one per event and window.

A stranger who sends many refused requests must not fill the log: the first refusal of an event writes its
warning, the next ones in the window are only counted, and the first warning after the window carries
``suppressed``, how many were held back since the last one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from replyd.log import Logger


class Quiet:
    """At most one warning per event per ``window_s`` on ``log``, the rest counted (thread-safe)."""

    def __init__(self, log: Logger, now: Callable[[], float] = time.monotonic, window_s: float = 60.0) -> None:
        self._log, self._now, self._window_s = log, now, window_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, event: str, **kw: Any) -> None:
        """Write ``event`` unless it was written less than a window ago; then count it for the next one."""
        now = self._now()
        with self._lock:
            last = self._last.get(event)
            if last is not None and 0 <= now - last < self._window_s:
                self._held[event] = self._held.get(event, 0) + 1
                return
            self._last[event] = now
            held = self._held.pop(event, 0)
        self._log.warning(event, **kw, **({"suppressed": held} if held else {}))
