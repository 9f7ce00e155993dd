"""How many posts the asyncio face lets past their claim at once: a window that follows the loop's own lag.

A fixed bound is wrong one way or the other. Against a platform a few milliseconds away the loop itself is the
bottleneck: every answer it parses is loop time, and 16 answers ready in one turn held it 8-20 ms (the lag
probe's p99 in docs/BENCHMARKS.md, the asyncio face). Against a real platform 100-500 ms away the loop is idle
and a small bound only caps the throughput. So the window moves: a timer ticks every ``tick_s`` while posts are
in flight; a tick that runs more than ``late_s`` late (the loop was held) shrinks the window by a quarter, one
on time ``grow_after`` times in a row while posts wait for a place grows it by one, between ``floor`` and
``cap`` (``max_in_flight``): TCP's congestion window with the loop's lateness as the signal. The defaults
(late past 1.5 ms, four on-time ticks to grow) were chosen on the 4,000-post run of docs/BENCHMARKS.md: a
looser window (2.5 ms, grow every tick) let bursts through and the probe's p99 stayed at 7-8 ms.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Admission:
    """The places past the claim: ``await enter()`` before a post claims, ``leave()`` when it ended."""

    def __init__(self, cap: int, *, start: int = 8, floor: int = 2, tick_s: float = 0.002, late_s: float = 0.0015,
                 on_time_s: float = 0.001, grow_after: int = 4) -> None:
        if cap < 1:
            raise ValueError("max_in_flight: must be at least 1")
        self.cap = cap
        self.floor = min(floor, cap)
        self.window = max(self.floor, min(start, cap))
        self.active = 0
        self.tick_s, self.late_s, self.on_time_s = tick_s, late_s, on_time_s
        self.grow_after = grow_after  # on-time ticks in a row (while posts wait) before one more place
        self._on_time = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._due: float | None = None  # the pending tick's due time (None: not ticking)
        self._timer: asyncio.TimerHandle | None = None

    async def enter(self) -> None:
        """Take a place, waiting in order while the window is full."""
        if self.active < self.window and not self._waiters:
            self.active += 1
            self._start_ticking()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._start_ticking()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.leave()  # granted, then cancelled before it ran: the place goes to the next one
            else:
                fut.cancel()  # passed over when its turn comes
            raise

    def leave(self) -> None:
        """Give a place back; the next waiter takes it if the window allows."""
        self.active -= 1
        self._grant()

    def observe(self, late_s: float) -> None:
        """One tick's lateness: shrink the window if the loop was held, grow it if on time and posts wait."""
        if late_s > self.late_s:
            self.window = max(self.floor, (self.window * 3) // 4)
            self._on_time = 0
        elif late_s < self.on_time_s and self._waiters and self.active >= self.window:
            self._on_time += 1
            if self._on_time >= self.grow_after:
                self._on_time = 0
                self.window = min(self.cap, self.window + 1)
                self._grant()
        else:
            self._on_time = 0

    def _grant(self) -> None:
        while self._waiters and self.active < self.window:
            fut = self._waiters.popleft()
            if fut.done():  # its post was cancelled while it waited
                continue
            self.active += 1
            fut.set_result(None)

    def _start_ticking(self) -> None:
        if self._due is None:
            loop = asyncio.get_running_loop()
            self._due = loop.time() + self.tick_s
            self._timer = loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._due is not None
        self.observe(loop.time() - self._due)
        if self.active or self._waiters:
            self._due = loop.time() + self.tick_s
            self._timer = loop.call_at(self._due, self._tick, loop)
        else:  # nothing in flight: no timer on an idle loop
            self._due = self._timer = None

    def close(self) -> None:
        """Stop the ticks (the guard is closing)."""
        if self._timer is not None:
            self._timer.cancel()
        self._due = self._timer = None
