"""The async face on SQLite: a close (relaxed, no fsync) is written on the loop only when it need not wait.

With nobody else writing, closes skip the store thread. With another writer holding the lock, the close must
not wait on the loop: it goes to the store thread (which waits its turn), the loop keeps running, the post ends
``posted`` and the row closed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

from replyd import aio
from replyd import store as st
from replyd.guard import Status
from replyd.platforms.base import Parent, Sent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from tests.aio_harness import CountingThread, probed


class LockingSend(MemoryPlatform):
    """A send (``asend``) after which another connection holds the database's write lock for ``hold_s``."""

    def __init__(self, db: str, hold_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.db, self.hold_s = db, hold_s
        self.holders: list[threading.Thread] = []

    async def asend(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Send, then have another writer take the lock before the guard closes the row."""
        sent = self.send(parent, text, provider_key=provider_key)
        locked = threading.Event()

        def hold() -> None:
            conn = sqlite3.connect(self.db, timeout=10)
            conn.execute("BEGIN IMMEDIATE")
            locked.set()
            time.sleep(self.hold_s)
            conn.rollback()
            conn.close()

        t = threading.Thread(target=hold)
        t.start()
        self.holders.append(t)
        await asyncio.to_thread(locked.wait, 10)
        return sent


def test_closes_skip_the_store_thread_when_nobody_else_writes(tmp_path):
    """20 posts, no other writer: every close was written on the loop (the store thread ran claims only)."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    plat = MemoryPlatform(listing_delay_s=5.0)

    async def run() -> tuple[list[Any], list[str]]:
        thread = CountingThread(store)
        g = aio.AsyncGuard(store, plat, plat.whoami(), watch_interval_s=None, store_thread=thread)
        outs = [await g.post(plat.add_parent(f"p{i}"), "hi") for i in range(20)]
        await g.aclose()
        return outs, thread.names

    outs, ran_on_thread = asyncio.run(run())
    assert [o.status for o in outs] == [Status.POSTED] * 20
    assert all(store.get(o.key).state == st.CLOSED for o in outs)
    assert "cas_event" not in ran_on_thread, ran_on_thread
    assert ran_on_thread.count("claim") == 20
    store.dispose()


def test_a_close_meeting_another_writer_never_waits_on_the_loop(tmp_path):
    """Another connection holds the write lock for 1 s right after each of 3 sends: the closes go to the store
    thread, the loop probe never stalls near the hold, and every row ends closed with its reply."""
    db = tmp_path / "r.sqlite3"
    store = Store.open(f"sqlite:///{db}")
    plat = LockingSend(str(db), 1.0, instance="memory:locking", listing_delay_s=5.0)

    async def posts(g: aio.AsyncGuard) -> list[Any]:
        return [await g.post(plat.add_parent(f"p{i}"), "hi") for i in range(3)]

    t0 = time.perf_counter()
    outs, lags, ran_on_thread = probed(store, plat, posts)
    took_s = time.perf_counter() - t0
    for t in plat.holders:
        t.join()
    assert took_s >= 2.5, f"the closes did not wait for the other writer ({took_s:.2f} s): the test proves nothing"
    assert [o.status for o in outs] == [Status.POSTED] * 3, outs
    assert [store.get(o.key).reply_id for o in outs] == [o.reply_id for o in outs]
    assert max(lags) < 0.5, f"the loop stalled {max(lags) * 1000:.0f} ms while a close waited for the lock"
    assert ran_on_thread.count("cas_event") == 3, ran_on_thread  # each close fell back to the thread
    store.dispose()
