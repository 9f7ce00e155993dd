"""Adapter contract, one level up: the guard and the sweep over each adapter keep one reply per parent.

The same flows the platform files used to repeat (tests/test_discourse.py and
tests/test_github.py ``test_e2e_*`` and ``test_pollers_*``): three discovery
paths, a lost answer closed by the sweep, a 5xx with nothing created, a
reworded retry, a crash between send and close, the daemon's pollers over all
three paths. Replies are counted on the platform.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from replyd import store as st
from replyd.guard import Guard, Status
from replyd.platforms.base import Parent, Platform
from replyd.policy import Policy
from replyd.sweep import Bot, Sweeper
from tests.contract.harnesses import Harness, tag
from tests.fakes_forum import fresh_store
from tests.pollers_harness import pollers_for, run_paths

SEND_TIMEOUT_S = 10.0


@dataclass
class Flow:
    """A harness's adapter with a guard and a sweeper over a fresh SQLite answered-log."""

    harness: Harness
    adapter: Platform
    guard: Guard
    store: st.Store

    def sweeper(self) -> Sweeper:
        """A sweeper for the bot on the harness's clock."""
        return Sweeper(self.store, [Bot(self.adapter, self.guard.identity)], clock=self.harness.clock)

    def sweep(self) -> Any:
        """Move the clock past every send deadline and listing delay, then run one sweep pass."""
        self.harness.clock.advance(SEND_TIMEOUT_S + self.adapter.listing_delay_s + 60)
        return self.sweeper().run_once()

    def row(self, parent: Parent) -> Any:
        """The answered-log row of ``parent``."""
        return self.store.get(self.guard.key(parent.id))


@pytest.fixture
def flow(harness: Harness, store_template: Path, tmp_path: Path) -> Iterator[Flow]:
    """A guard and a sweeper for the harness's bot."""
    adapter = harness.adapter()
    store = fresh_store(store_template, tmp_path, harness.clock)
    guard = Guard(store, adapter, adapter.whoami(), clock=harness.clock, send_timeout_s=SEND_TIMEOUT_S)
    yield Flow(harness, adapter, guard, store)
    store.dispose()


def test_three_paths_find_the_parent_and_it_is_answered_once(flow: Flow) -> None:
    """Inbox, search and re-find all serve the parent's id; the first post answers, the others see it answered."""
    h, a = flow.harness, flow.adapter
    since = h.clock.now() - 60
    word = tag()
    post = h.post(f"{word} how do widgets work?")
    h.settle([post])
    paths = {
        "inbox": h.eventually(lambda: a.inbox(None).parents, lambda ps: post.id in {p.id for p in ps}),
        "search": h.eventually(lambda: a.search(word, None).parents, lambda ps: post.id in {p.id for p in ps}),
        "refind": h.eventually(lambda: a.refind(since), lambda ps: post.id in {p.id for p in ps}),
    }
    found = {name: next(p for p in ps if p.id == post.id) for name, ps in paths.items()}
    outcomes = [flow.guard.post(p, f"answer from {name}", path=name).status for name, p in found.items()]
    assert outcomes == [Status.POSTED, Status.ALREADY_ANSWERED, Status.ALREADY_ANSWERED]
    assert h.reply_count(post.id) == 1


def test_lost_answer_is_closed_by_the_sweep_with_the_landed_reply(flow: Flow) -> None:
    """The reply lands but its answer is lost: the row stays open, the sweep closes it with the landed id; one reply."""
    parent = flow.harness.parent(flow.adapter)
    flow.harness.fail_next_send("lost")
    out = flow.guard.post(parent, "hello")
    landed = flow.harness.reply_ids(parent.id)
    assert len(landed) == 1
    if out.status is Status.UNCERTAIN:
        assert flow.row(parent).state == st.OPEN
        assert flow.harness.eventually(flow.sweep, lambda res: res.closed == 1).closed == 1
    else:  # the adapter probed and learnt the reply (Bluesky: getRecord at the rkey, AlreadyLanded)
        assert flow.harness.probes_unclear_sends and out.status in (Status.POSTED, Status.ALREADY_ANSWERED)
    row = flow.row(parent)
    assert row.state == st.CLOSED and [row.reply_id] == landed
    assert flow.guard.post(parent, "hello again").status is Status.ALREADY_ANSWERED
    assert flow.harness.reply_ids(parent.id) == landed


def test_5xx_with_nothing_created_gets_one_more_attempt(flow: Flow) -> None:
    """A 5xx with nothing created: uncertain, the sweep finds no reply (not_landed), the retry lands once."""
    parent = flow.harness.parent(flow.adapter)
    flow.harness.fail_next_send("error_before")
    assert flow.guard.post(parent, "hi").status is Status.UNCERTAIN
    assert flow.sweep().not_landed == 1
    out = flow.guard.post(parent, "hi")
    assert out.status is Status.POSTED and out.attempt == 2
    assert flow.harness.reply_ids(parent.id) == [out.reply_id]


def test_reworded_retry_is_already_answered(flow: Flow) -> None:
    """A second post with other words hits the same key and returns the first reply; the platform holds one."""
    parent = flow.harness.parent(flow.adapter)
    first = flow.guard.post(parent, "Widgets work by magic.")
    again = flow.guard.post(parent, "Widgets, as it happens, run on magic!")
    assert (first.status, again.status) == (Status.POSTED, Status.ALREADY_ANSWERED)
    assert again.reply_id == first.reply_id
    assert flow.harness.reply_ids(parent.id) == [first.reply_id]


def test_crash_between_send_and_close_is_closed_by_the_sweep(flow: Flow, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies after the send, before the close: the row stays open (in flight) until the sweep closes it."""
    parent = flow.harness.parent(flow.adapter)

    def crash(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("killed before close")

    monkeypatch.setattr(flow.guard, "_close", crash)
    with pytest.raises(SystemExit):
        flow.guard.post(parent, "hello")
    monkeypatch.undo()
    landed = flow.harness.reply_ids(parent.id)
    assert len(landed) == 1 and flow.row(parent).state == st.OPEN
    assert flow.guard.post(parent, "hello").status is Status.IN_FLIGHT
    assert flow.harness.eventually(flow.sweep, lambda res: res.closed == 1).closed == 1
    assert flow.row(parent).reply_id == landed[0]
    assert flow.guard.post(parent, "hello").status is Status.ALREADY_ANSWERED
    assert flow.harness.reply_ids(parent.id) == landed


def test_pollers_over_three_paths_with_lost_answers_one_reply_and_one_call_each(flow: Flow) -> None:
    """The daemon's pollers (inbox, search, re-find, sweeps between) on three mentions, two answers lost: one reply and one responder call each."""
    h, word = flow.harness, tag()
    posts = [h.post(f"{word} question {i}") for i in range(3)]
    h.settle(posts)
    h.fail_next_send("lost")
    h.fail_next_send("lost")
    calls: list[str] = []
    w = {"guard": flow.guard, "clock": h.clock, "store": flow.store, "plat": flow.adapter, "sweeper": flow.sweeper()}
    # Only this test's posts: a real server's bot also has every other test's mentions in its inbox.
    run_paths(pollers_for(w, word, calls, Policy(allow_keywords=(word,))), w)
    assert h.faults_met(), "both lost answers were met"
    assert [h.reply_count(p.id) for p in posts] == [1, 1, 1]
    assert sorted(calls) == sorted(p.id for p in posts)
