"""A send never leaves past its row's deadline, and a late landing is counted as the duplicate it is.

On the injected clock, SQLite and PostgreSQL: the database's answer to the guard's
``composing -> open`` commit "takes" 20 s (a store whose open write moves the fake clock), while the other
replica's sweep judges the row and re-find sends attempt 2. Replies are counted on the platform (the memory
platform's own list), never from replyd's log.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from replyd import store as st
from replyd.guard import Guard, Status
from replyd.library import begin, finish
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper

SEND_TIMEOUT_S = 10.0
LISTING_DELAY_S = 5.0
STALL_S = 20.0  # the open's answer held past send timeout + listing delay


class StalledStore:
    """One replica's view of the store: the write that opens a row commits, then its answer "takes" ``stall_s``.

    While the answer is held, ``meanwhile`` runs (the other replica's sweep and re-find), as it would on the
    shared store; then the write returns to the guard as if the database had just answered.
    """

    def __init__(self, inner: Store, meanwhile: Any) -> None:
        self._inner = inner
        self.meanwhile = meanwhile
        self.stalls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _stall(self) -> None:
        if self.meanwhile is not None:
            hook, self.meanwhile = self.meanwhile, None
            self.stalls += 1
            hook()

    def claim(self, key, new, reclaim, event, **kw):
        """The claim; held when it commits an open row (a post with its text given)."""
        out = self._inner.claim(key, new, reclaim, event, **kw)
        if out[0] and out[2] is not None and out[2].get("state") == st.OPEN:
            self._stall()
        return out

    def cas_event(self, key, **kw):
        """A compare-and-set; held when it is the composing -> open commit."""
        ok = self._inner.cas_event(key, **kw)
        if ok and (kw.get("event") or {}).get("kind") == "opened":
            self._stall()
        return ok


def replicas(store: Store, clock, plat: MemoryPlatform) -> tuple[Guard, Guard, Sweeper, StalledStore]:
    """Replica A (its store's open answer held), replica B, and B's sweeper, on one store and platform."""
    me = plat.whoami()
    b = Guard(store, plat, me, clock=clock, owner="B", send_timeout_s=SEND_TIMEOUT_S, watch_interval_s=None)
    sweeper = Sweeper(store, [Bot(plat, me, b.lag)], clock=clock, owner="sB", retry_s=5.0)
    held = StalledStore(store, None)
    a = Guard(held, plat, me, clock=clock, owner="A", send_timeout_s=SEND_TIMEOUT_S,  # type: ignore[arg-type]
              watch_interval_s=None)
    return a, b, sweeper, held


@pytest.mark.parametrize("how", ["text", "compose", "finish"])
def test_send_held_past_its_deadline_does_not_leave(store, clock, how) -> None:
    """The open's answer held 20 s while B judges the row and re-find answers: A sends nothing; one reply."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=LISTING_DELAY_S)
    a, b, sweeper, held = replicas(store, clock, plat)
    parent = Parent(id="p-stall", author_id="u")
    b_out: list = []

    def meanwhile() -> None:
        clock.advance(STALL_S)  # the database's answer is held (or the process paused) this long
        res = sweeper.run_once()
        assert res.not_landed == 1, res  # the sweep found nothing of attempt 1: nothing was sent yet
        b_out.append(b.post(parent, "attempt 2"))  # re-find offers the not_landed parent to replica B

    held.meanwhile = meanwhile
    if how == "text":
        out = a.post(parent, "attempt 1")
    elif how == "compose":
        out = a.post(parent, lambda p: "attempt 1")
    else:  # library.finish, the path of the API's and MCP's finish_reply
        lease = begin(a, parent, owner="agent-1")
        out = finish(a, lease, "attempt 1")
    assert held.stalls == 1
    assert b_out and b_out[0].status is Status.POSTED and b_out[0].attempt == 2
    assert out.status is Status.NOT_SENT and "passed between the open and the send" in out.detail, out
    assert plat.reply_count("p-stall") == 1  # counted on the platform
    assert plat.send_calls == 1
    key = b.key("p-stall")
    row = store.get(key)
    assert row.state == st.CLOSED and row.attempt == 2
    notes = [e for e in store.history(key) if e.kind == "too_late"]
    assert len(notes) == 1 and notes[0].attempt == 1 and notes[0].state is None  # the CAS lost: a note only


def test_send_stalled_before_any_judgement_releases_its_row(store, clock) -> None:
    """A stall past the budget with no sweep meanwhile: the row is released (same attempt), then answered once."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=LISTING_DELAY_S)
    a, b, sweeper, held = replicas(store, clock, plat)
    parent = Parent(id="p-alone", author_id="u")
    held.meanwhile = lambda: clock.advance(SEND_TIMEOUT_S)
    out = a.post(parent, lambda p: "attempt 1")
    assert out.status is Status.NOT_SENT and out.state == st.RELEASED and out.attempt == 1, out
    assert plat.send_calls == 0
    again = b.post(parent, "attempt 1 again")
    assert again.status is Status.POSTED and again.attempt == 1  # the attempt never went out: not spent
    assert plat.reply_count("p-alone") == 1


def test_short_stall_sends_with_what_is_left_of_the_budget(store, clock, monkeypatch) -> None:
    """A stall shorter than the budget: the send leaves, under a deadline of only what is left."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=LISTING_DELAY_S)
    a, _, _, held = replicas(store, clock, plat)
    budgets: list[float] = []
    import replyd.guard as guard_mod

    real_within = guard_mod.deadline.within

    def spy(seconds: float):
        budgets.append(seconds)
        return real_within(seconds)

    monkeypatch.setattr(guard_mod.deadline, "within", spy)
    held.meanwhile = lambda: clock.advance(6.0)
    out = a.post(Parent(id="p-short", author_id="u"), lambda p: "a reply")
    assert out.status is Status.POSTED
    assert budgets == [pytest.approx(SEND_TIMEOUT_S - 6.0)]


def test_late_landing_on_a_verified_close_is_a_duplicate(store, clock) -> None:
    """Attempt 1 lands after attempt 2 closed and was verified: the sweep reports it, and deletes it if asked."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=LISTING_DELAY_S)
    me = plat.whoami()
    a = Guard(store, plat, me, clock=clock, owner="A", send_timeout_s=SEND_TIMEOUT_S, watch_interval_s=None)
    b = Guard(store, plat, me, clock=clock, owner="B", send_timeout_s=SEND_TIMEOUT_S, watch_interval_s=None)
    sweeper = Sweeper(store, [Bot(plat, me, b.lag)], clock=clock, owner="s", retry_s=5.0,
                      on_duplicate="delete_newer")
    parent = Parent(id="p-late", author_id="u")
    real_send = plat.send
    late: list = []

    def held_send(p, text, *, provider_key):
        # A's request is held up (past every deadline the watch could push) while B answers and is verified.
        plat.send = real_send  # type: ignore[method-assign]
        clock.advance(SEND_TIMEOUT_S + LISTING_DELAY_S + 1)
        assert sweeper.run_once().not_landed == 1
        assert b.post(p, "attempt 2").status is Status.POSTED
        clock.advance(LISTING_DELAY_S + 1)
        res = sweeper.run_once()
        assert res.verified == 1 and res.duplicates == 0, res
        late.append(real_send(p, text, provider_key=provider_key))  # the platform creates attempt 1 now
        return late[0]

    plat.send = held_send  # type: ignore[method-assign]
    out = a.post(parent, "attempt 1")
    assert out.status is Status.POSTED and out.reply_id == late[0].reply_id
    assert plat.reply_count("p-late") == 2  # the duplicate exists on the platform
    res = sweeper.run_once()
    assert res.duplicates == 1, res
    key = a.key("p-late")
    dup = [e for e in store.history(key) if e.kind == "duplicate_detected"]
    assert len(dup) == 1 and json.loads(dup[0].detail)["newer"] == [late[0].reply_id], dup
    assert plat.reply_count("p-late") == 1  # delete_newer removed attempt 1's late reply
    row = store.get(key)
    assert row.state == st.CLOSED and row.reply_id != late[0].reply_id
    assert sweeper.run_once().duplicates == 0  # reported once


def test_late_landing_closes_a_row_judged_at_a_later_attempt(store, clock) -> None:
    """Attempt 1 lands after attempt 2 was judged not landed: the row closes with it, so no attempt 3 goes out."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=LISTING_DELAY_S)
    me = plat.whoami()
    a = Guard(store, plat, me, clock=clock, owner="A", send_timeout_s=SEND_TIMEOUT_S, watch_interval_s=None,
              max_attempts=3)
    b = Guard(store, plat, me, clock=clock, owner="B", send_timeout_s=SEND_TIMEOUT_S, watch_interval_s=None,
              max_attempts=3)
    sweeper = Sweeper(store, [Bot(plat, me, b.lag)], clock=clock, owner="s", retry_s=5.0, max_attempts=3)
    parent = Parent(id="p-judged", author_id="u")
    real_send = plat.send

    def held_send(p, text, *, provider_key):
        plat.send = real_send  # type: ignore[method-assign]
        clock.advance(SEND_TIMEOUT_S + LISTING_DELAY_S + 1)
        assert sweeper.run_once().not_landed == 1
        plat.script = ["error_before"]  # attempt 2 ends ambiguous, nothing created
        assert b.post(p, "attempt 2").status is Status.UNCERTAIN
        clock.advance(SEND_TIMEOUT_S + LISTING_DELAY_S + 1)
        assert sweeper.run_once().not_landed == 1  # attempt 2 judged; attempt 3 would be allowed
        return real_send(p, text, provider_key=provider_key)

    plat.send = held_send  # type: ignore[method-assign]
    assert a.post(parent, "attempt 1").status is Status.POSTED
    row = store.get(a.key("p-judged"))
    assert row.state == st.CLOSED and row.attempt == 2
    assert b.post(parent, "attempt 3").status is Status.ALREADY_ANSWERED
    assert plat.reply_count("p-judged") == 1


def test_retried_row_is_verified_by_its_parent_not_the_walk(store, clock) -> None:
    """The walk never lists attempt 1's late reply: the retried row's verification reads the parent and counts it."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=LISTING_DELAY_S)
    me = plat.whoami()
    g = Guard(store, plat, me, clock=clock, send_timeout_s=SEND_TIMEOUT_S, watch_interval_s=None)
    sweeper = Sweeper(store, [Bot(plat, me, g.lag)], clock=clock, retry_s=5.0)
    parent = Parent(id="p-walk", author_id="u")
    # Attempt 1 lands unseen by the walk (and its answer is lost: replyd has no id for it).
    plat.script = ["lost"]
    assert g.post(parent, "attempt 1").status is Status.UNCERTAIN
    first = plat.replies()[0]["reply_id"]
    plat.feed_misses.add(first)
    clock.advance(SEND_TIMEOUT_S + LISTING_DELAY_S + 1)
    assert sweeper.run_once().not_landed == 1  # the walk missed it
    assert g.post(parent, "attempt 2").status is Status.POSTED
    assert plat.reply_count("p-walk") == 2
    clock.advance(LISTING_DELAY_S + 1)
    res = sweeper.run_once()
    assert plat.parent_reads >= 1
    assert res.duplicates == 1, res
    dup = [e for e in store.history(g.key("p-walk")) if e.kind == "duplicate_detected"]
    detail = json.loads(dup[0].detail)
    assert first in [detail["kept"], *detail["newer"]]
