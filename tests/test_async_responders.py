"""Async responders everywhere: an ``async def`` responder (or one returning an awaitable) in the sync guard,
called from plain code and from inside a running event loop, and in the daemon's pipeline."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from replyd import store as st
from replyd.guard import Guard, Status
from replyd.pipeline import Pipeline
from replyd.platforms.memory import MemoryPlatform
from replyd.policy import Policy
from tests.aio_harness import face  # noqa: F401  (both faces)


@pytest.fixture
def plat(clock):
    """A scripted in-memory platform."""
    return MemoryPlatform(clock=clock, listing_delay_s=5.0)


@pytest.fixture
def guard(store, plat, clock, face):
    """The guard over the parametrised store, on each face (the async face behind the sync API)."""
    g = face(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, watch_interval_s=None)
    yield g
    g.close()


async def composed(parent) -> str:
    """An ``async def`` responder that really suspends before it answers."""
    await asyncio.sleep(0.01)
    return f"hello {parent.id}"


def awaitable_returning(parent):
    """A plain function that returns an awaitable (a coroutine of another function)."""
    return composed(parent)


def _no_unawaited(fn):
    """Run ``fn`` and fail on a "coroutine was never awaited" warning (the bug's symptom)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
        gc.collect()
    never = [w for w in caught if "never awaited" in str(w.message)]
    assert not never, never
    return out


@pytest.mark.parametrize("responder", [composed, awaitable_returning], ids=["async_def", "returns_awaitable"])
def test_sync_guard_awaits_an_async_responder(guard, plat, store, responder):
    """The sync guard posts what an async responder returns: one reply with its text, the row closed."""
    out = _no_unawaited(lambda: guard.post(plat.add_parent("p1"), responder))
    assert out.status is Status.POSTED, out
    assert [r["text"] for r in plat.replies()] == ["hello p1"]
    assert store.get(guard.key("p1")).state == st.CLOSED


def test_sync_guard_inside_a_running_loop_awaits_an_async_responder(guard, plat):
    """Called from a coroutine (a bot's own loop), the sync guard still awaits the responder (on its loop)."""

    async def bot() -> Status:
        return guard.post(plat.add_parent("p1"), composed).status

    assert _no_unawaited(lambda: asyncio.run(bot())) is Status.POSTED
    assert plat.reply_count("p1") == 1


def test_pipeline_awaits_an_async_function_responder(guard, plat, clock):
    """The daemon's pipeline, given a plain ``async def`` function as its responder, posts its text once."""
    pipe = Pipeline(guard, composed, Policy(), clock)
    out = _no_unawaited(lambda: pipe.offer(plat.add_parent("p1"), "inbox"))
    assert out.status is Status.POSTED, out
    assert pipe.offer(plat.parents["p1"], "search").status is Status.ALREADY_ANSWERED
    assert [r["text"] for r in plat.replies()] == ["hello p1"]


def test_dry_run_awaits_an_async_responder(store, plat, clock):
    """Shadow mode shows what an async responder would post (nothing sent)."""
    g = Guard(store, plat, plat.whoami(), clock=clock, dry_run=True, watch_interval_s=None)
    out = _no_unawaited(lambda: g.post(plat.add_parent("p1"), composed))
    assert out.status is Status.DRY_RUN and out.detail == "dry run: would post"
    assert plat.send_calls == 0
