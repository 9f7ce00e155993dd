"""The asyncio face's window of posts past the claim (``replyd.admission``): it follows the loop's lag.

Held loop: the window shrinks (fewer answers parsed per turn). Idle loop with posts waiting: it grows to the
cap (a platform far away is not throttled). Places are given in order, and a cancelled post never keeps one.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from replyd.admission import Admission


def test_a_late_tick_shrinks_the_window_by_a_quarter_down_to_the_floor():
    """Each tick late by more than ``late_s`` takes a quarter off; never below the floor."""
    a = Admission(64, start=16, floor=2)
    a.observe(0.010)
    assert a.window == 12
    for _ in range(20):
        a.observe(0.010)
    assert a.window == 2


def test_an_on_time_tick_grows_the_window_only_while_posts_wait_for_a_full_one():
    """On time and posts waiting at a full window: one more place; nobody waiting: the window stays."""

    async def run() -> tuple[int, int, int]:
        a = Admission(6, start=2, grow_after=1)
        for _ in range(2):
            await a.enter()
        a.observe(0.0)
        idle = a.window  # nobody waits: no reason to grow
        waiter = asyncio.create_task(a.enter())
        await asyncio.sleep(0)
        a.observe(0.0)
        await asyncio.sleep(0)
        grown, active = a.window, a.active
        for _ in range(10):
            a.observe(0.0)
        await waiter
        a.close()
        return idle, grown, active

    idle, grown, active = asyncio.run(run())
    assert (idle, grown, active) == (2, 3, 3)


def test_the_window_grows_only_after_grow_after_on_time_ticks_in_a_row():
    """With ``grow_after`` 4, three on-time ticks and a late one grow nothing; four in a row add one place."""

    async def run() -> list[int]:
        a = Admission(8, start=4, grow_after=4)
        for _ in range(4):
            await a.enter()
        waiter = asyncio.create_task(a.enter())
        await asyncio.sleep(0)
        seen = []
        for late in (0.0, 0.0, 0.0, 0.010):
            a.observe(late)
        seen.append(a.window)  # 3 then late: a quarter off, no growth
        for _ in range(4):
            a.observe(0.0)
        seen.append(a.window)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        a.close()
        return seen

    assert asyncio.run(run()) == [3, 4]


def test_places_go_in_order_and_a_cancelled_waiter_keeps_none():
    """Waiters are served first come first served; one cancelled while waiting, or after its place was given
    but before it ran, leaves the place to the next."""

    async def run() -> list[str]:
        a = Admission(1, start=1, floor=1)
        got: list[str] = []
        await a.enter()

        async def post(name: str) -> None:
            await a.enter()
            got.append(name)
            a.leave()

        t1, t2, t3 = (asyncio.create_task(post(n)) for n in ("one", "two", "three"))
        await asyncio.sleep(0)
        t2.cancel()  # cancelled while waiting
        await asyncio.sleep(0)
        a.leave()  # the place goes to "one"...
        t1.cancel()  # ...which is cancelled before it runs: "three" must get the place
        await asyncio.wait_for(asyncio.gather(t1, t2, t3, return_exceptions=True), 5)  # a kept place: stuck
        a.close()
        return got + [f"active={a.active}"]

    assert asyncio.run(run()) == ["three", "active=0"]


def test_a_held_loop_shrinks_the_window_and_an_idle_one_grows_it_to_the_cap():
    """On a real loop: callbacks that hold it 10 ms make the ticks late and the window fall; then, the loop
    idle and posts waiting, on-time ticks grow it back to the cap."""

    async def run() -> tuple[int, int]:
        # A loaded CI machine runs ticks a few ms late now and then: 5 ms counts as held, one on-time tick grows.
        a = Admission(32, start=32, late_s=0.005, grow_after=1)
        for _ in range(32):
            await a.enter()
        waiters = [asyncio.create_task(a.enter()) for _ in range(64)]
        for _ in range(5):  # hold the loop, as a turn parsing many answers does
            time.sleep(0.010)
            await asyncio.sleep(0.003)
        held = a.window
        for _ in range(1000):  # idle: the ticks run on time (up to 3 s on a loaded machine)
            await asyncio.sleep(0.003)
            if a.window == a.cap:
                break
        grown = a.window
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        a.close()
        return held, grown

    held, grown = asyncio.run(run())
    assert held <= 16
    assert grown == 32


def test_the_cap_must_be_positive():
    """``max_in_flight`` 0 is a clear error, not a guard that never posts."""
    with pytest.raises(ValueError, match="max_in_flight"):
        Admission(0)
