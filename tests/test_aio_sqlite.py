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
from replyd.errors import StoreError
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


def _claim_args(g: Any, parent_id: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The args and kwargs the core gives ``Store.claim`` for a new post on ``parent_id``."""
    steps = g.claim_steps(g.key(parent_id), Parent(id=parent_id, author_id="u"), "api", "hi")
    call = next(steps)
    return call.args, call.kwargs


def test_a_group_commit_decides_two_claims_of_one_key_in_order(tmp_path):
    """Four claims in one group, two of them on one key: three rows, the second claim of the key lost."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    plat = MemoryPlatform(listing_delay_s=5.0)
    g = aio.AsyncGuard(store, plat, plat.whoami(), watch_interval_s=None)
    try:
        got = store.claim_group([_claim_args(g, p) for p in ("a", "b", "a", "c")])
    finally:
        g.store_thread.close()
    assert [c.won for c in got] == [True, True, False, True]
    assert got[2].row is not None and got[2].row.parent_id == "a"
    assert sorted(r.parent_id for r in store.rows_in(g.key("a").platform, g.key("a").sender_id, [st.OPEN])) \
        == ["a", "b", "c"]
    assert [e.kind for e in store.history(g.key("a"))] == ["claimed"]


def test_a_group_decides_a_taken_key_on_its_read_without_running_it_again(tmp_path):
    """A claim in a group whose key is already taken (open, not claimable) is answered by the group from its read,
    not handed back to run alone; the new keys beside it are inserted."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    plat = MemoryPlatform(listing_delay_s=5.0)
    g = aio.AsyncGuard(store, plat, plat.whoami(), watch_interval_s=None)
    try:
        assert store.claim(*_claim_args(g, "a")[0], **_claim_args(g, "a")[1]).won
        got = store.claim_group([_claim_args(g, p) for p in ("a", "b", "c")])
    finally:
        g.store_thread.close()
    assert got[0] is not None and not got[0].won and got[0].row is not None and got[0].row.state == st.OPEN
    assert [c is not None and c.won for c in got[1:]] == [True, True]


def test_waiting_claims_commit_together_and_each_parent_gets_one_reply(tmp_path):
    """200 gathered posts on 100 parents: claims waiting together share a commit (fewer commits than claims),
    one reply per parent counted on the platform, every row closed."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    plat = MemoryPlatform(listing_delay_s=5.0)
    commits: list[int] = []
    orig = store._write

    def counted(fairy: Any, relaxed: bool, body: Any) -> Any:
        """Count durable commits (the claims'; the closes are relaxed)."""
        if not relaxed:
            commits.append(1)
        return orig(fairy, relaxed, body)

    store._write = counted  # type: ignore[method-assign]

    async def run() -> tuple[list[Any], int]:
        g = aio.AsyncGuard(store, plat, plat.whoami(), watch_interval_s=None, max_in_flight=64)
        parents = [plat.add_parent(f"p{i}") for i in range(100)]
        outs = await asyncio.gather(*(g.post(p, f"answer {p.id}") for p in parents for _ in range(2)))
        grouped = g.store_thread.grouped
        await g.aclose()
        return outs, grouped

    outs, grouped = asyncio.run(run())
    posted = [o for o in outs if o.status == Status.POSTED]
    assert len(posted) == 100
    assert grouped > 0 and len(commits) < 100
    per_parent: dict[str, int] = {}
    for r in plat.replies():
        per_parent[r["parent_id"]] = per_parent.get(r["parent_id"], 0) + 1
    assert per_parent == {f"p{i}": 1 for i in range(100)}


def test_a_failed_group_commit_falls_back_to_one_claim_each(tmp_path):
    """The group's transaction fails (nothing written): each claim runs alone and every post is answered once."""
    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    plat = MemoryPlatform(listing_delay_s=5.0)

    def broken(calls: Any) -> Any:
        """A group commit that always fails."""
        raise StoreError("disk I/O error (planted)")

    store.claim_group = broken  # type: ignore[method-assign]

    async def run() -> list[Any]:
        g = aio.AsyncGuard(store, plat, plat.whoami(), watch_interval_s=None)
        outs = await asyncio.wait_for(asyncio.gather(*(g.post(plat.add_parent(f"p{i}"), "hi") for i in range(40))), 30)
        await g.aclose()
        return outs

    outs = asyncio.run(run())
    assert [o.status for o in outs] == [Status.POSTED] * 40
    assert len(plat.replies()) == 40
