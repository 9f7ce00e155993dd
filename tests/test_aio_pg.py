"""The async face on PostgreSQL: claims, closes and reads through psycopg's async connection, on the loop.

A table lock held by another session makes every claim wait at the server; the loop must keep running (the
probe) and no hot-path call may take the store thread. Errors map into the store's tree as the sync path's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

from replyd import aio
from replyd.errors import StoreError
from replyd.guard import Status
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.store.aiopg import conninfo
from tests.conftest import _truncate
from tests.aio_harness import probed

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_store(pg_url):
    """A clean PostgreSQL store for one test."""
    _truncate(pg_url)
    store = Store.open(pg_url)
    yield store
    store.dispose()


def test_claims_waiting_on_a_locked_table_leave_the_loop_free(pg_store):
    """Another session locks the answered-log for 1.5 s: 8 posts wait at the server while the loop probe runs
    (worst overshoot well under the lock), every post then lands once, and the store thread ran no claim/close."""
    plat = MemoryPlatform(listing_delay_s=5.0)
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with psycopg.connect(conninfo(pg_store.engine.url)) as conn:
            conn.execute("LOCK TABLE replies IN ACCESS EXCLUSIVE MODE")
            locked.set()
            release.wait(10)
            time.sleep(1.5)
        # the transaction ends with the block: the lock is released

    holder = threading.Thread(target=hold_lock)
    holder.start()
    locked.wait(10)

    async def posts(g: aio.AsyncGuard) -> list:
        return await asyncio.gather(*(g.post(plat.add_parent(f"p{i}"), "hi") for i in range(8)))

    t0 = time.perf_counter()
    outs, lags, ran_on_thread = probed(pg_store, plat, posts, start=release.set)
    waited_s = time.perf_counter() - t0
    holder.join()
    assert waited_s >= 1.2, f"the posts did not wait for the lock ({waited_s:.2f} s): the test proves nothing"
    assert [o.status for o in outs] == [Status.POSTED] * 8, outs
    assert plat.send_calls == 8
    assert max(lags) < 0.5, f"the loop stalled {max(lags) * 1000:.0f} ms while claims waited on the lock"
    hot = {"claim", "cas_event", "peek", "get"}
    assert hot.isdisjoint(ran_on_thread), f"hot-path calls took the store thread: {ran_on_thread}"


def test_an_unreachable_server_is_a_store_error_on_the_async_path(pg_store):
    """The async connection to a server that refuses maps to StoreError (one line), never a raw psycopg error."""
    plat = MemoryPlatform(listing_delay_s=5.0)

    async def run() -> BaseException:
        g = aio.AsyncGuard(pg_store, plat, plat.whoami(), watch_interval_s=None)
        assert g.hot_path is not None
        g.hot_path._conninfo = "postgresql://nobody@127.0.0.1:1/none"  # a port nothing listens on
        try:
            await g.post(plat.add_parent("p1"), "hi")
        except BaseException as exc:
            return exc
        finally:
            await g.aclose()
        raise AssertionError("the post went through without a store")

    exc = asyncio.run(run())
    assert isinstance(exc, StoreError), repr(exc)
    assert "\n" not in str(exc) and "store unavailable" in str(exc), str(exc)
    assert plat.send_calls == 0  # nothing is sent without a claim
