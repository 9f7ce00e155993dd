"""A child process SIGKILLed at each point of a post; the sweep leaves exactly one reply."""

from __future__ import annotations


import pytest

from replyd import store as st
from replyd.clock import FakeClock, SystemClock
from replyd.guard import Guard, Status
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests import workers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("where,retries", [("before_send", 1), ("after_send", 0), ("before_close", 0)])
def test_sigkill_then_sweep_leaves_one_reply(store_url, tmp_path, where, retries, face):
    """After a SIGKILL of either face's process and a sweep, each parent has exactly one reply (one retry if
    nothing landed)."""
    journal = str(tmp_path / "journal.jsonl")
    workers.run_until_sigkilled(workers.crash_in, store_url, journal, "p1", where, face)

    clock = FakeClock(SystemClock().now())
    store = Store.open(store_url, clock=clock)
    plat = MemoryPlatform(journal=journal, clock=clock, listing_delay_s=1.0)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=5.0)
    parent = Parent(id="p1", author_id="u")
    assert store.get(guard.key("p1")).state == st.OPEN
    assert guard.post(parent, "x").status is Status.IN_FLIGHT  # open rows block a restart's resend

    clock.advance(10)
    Sweeper(store, [Bot(plat, plat.whoami())], clock=clock).run_once()
    row = store.get(guard.key("p1"))
    out = guard.post(parent, "x")
    if retries:
        assert row.state == st.NOT_LANDED
        assert out.status is Status.POSTED and out.attempt == 2
    else:
        assert row.state == st.CLOSED and row.reply_id == plat.replies()[0]["reply_id"]
        assert out.status is Status.ALREADY_ANSWERED
    assert plat.reply_count("p1") == 1
    store.dispose()
