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
