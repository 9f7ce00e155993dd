"""``deadline.within``: a budget nests (the inner one only shortens it) and ends with its block, however it ends."""

from __future__ import annotations

import time

import pytest

from replyd import deadline


def test_a_nested_budget_only_shortens_and_each_block_restores_the_one_around_it():
    """The inner budget is the earlier of the two deadlines; leaving a block (normally or by an exception)
    gives back the budget around it, and none is left after the outermost."""
    assert deadline.remaining() is None
    with deadline.within(10.0) as outer:
        assert outer == pytest.approx(time.monotonic() + 10.0, abs=0.5)
        with deadline.within(100.0) as longer:
            assert longer == outer  # a longer inner budget cannot extend the outer one
        with pytest.raises(RuntimeError), deadline.within(1.0) as shorter:
            assert shorter < outer and deadline.remaining() == pytest.approx(1.0, abs=0.5)
            raise RuntimeError("the send failed")
        assert deadline.remaining() == pytest.approx(10.0, abs=0.5)
    assert deadline.remaining() is None


def test_a_thread_cut_while_it_runs_is_handed_to_the_outliving_block_with_the_budget_it_ran_under():
    """``deadline.to_thread`` cut (cancelled) while its thread runs puts the thread's future in the enclosing
    ``outliving`` block's list, and the future ends with the thread's own result; the thread saw the budget; a
    call that ends in time leaves nothing; a block is gone once left."""
    import asyncio
    import threading

    release = threading.Event()
    seen: list[float | None] = []

    def blocked() -> str:
        seen.append(deadline.remaining())
        release.wait(10.0)
        return "landed late"

    async def main() -> tuple[int, int, str]:
        with deadline.within(5.0), deadline.outliving() as quick:
            assert await deadline.to_thread(lambda: "in time") == "in time"
        with deadline.within(5.0), deadline.outliving() as left:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await deadline.to_thread(blocked)
        assert deadline._LEFT.get() is None
        n_left = len(left)
        release.set()
        return len(quick), n_left, await left[0]

    assert asyncio.run(main()) == (0, 1, "landed late")
    assert seen and seen[0] is not None and 0 < seen[0] <= 5.0
