"""Every close verified from the union of reply ids replyd knows, and later looks that reconcile judged rows.

All on the injected clock (no sleeps); duplicates are counted on the platform (the memory platform's replies),
never from replyd's log.
"""

from __future__ import annotations

import pytest

from replyd import store as st
from replyd.config import GuardConfig, SweepConfig
from replyd.guard import Guard, Status
from replyd.lag import ListingLag
from replyd.platforms.memory import MemoryPlatform
from replyd.sweep import Bot, Sweeper, SweepResult


class HidingPlatform(MemoryPlatform):
    """A memory platform whose read-back never lists the ids in ``hidden``, and may run a hook before reading."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.hidden: set[str] = set()
        self.before_read = None

    def read_back(self, pending, *, sender_id):
        """The memory read-back, minus hidden replies; the hook (once) runs first, as a racing process would."""
        hook, self.before_read = self.before_read, None
        if hook is not None:
            hook()
        rb = super().read_back(pending, sender_id=sender_id)
        for pid in list(rb.found):
            rb.found[pid] = [m for m in rb.found[pid] if m.reply_id not in self.hidden]
            if not rb.found[pid]:
                del rb.found[pid]
        return rb


CFG = SweepConfig(listing_delay_min_samples=5, listing_lag_refresh_s=1.0, listing_delay_max_s=60.0,
                  reconcile_after=[10.0, 100.0])


@pytest.fixture
def plat(clock):
    """A platform configured for a 2 s listing delay."""
    return HidingPlatform(clock=clock, listing_delay_s=2.0)


@pytest.fixture
def guard(store, plat, clock):
    """A guard with a 1 s send budget, its listing delay on the sweep's settings (as the daemon shares one)."""
    lag = ListingLag(store, plat.instance, plat.listing_delay_s, CFG, clock=clock)
    return Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=1.0, lag=lag, watch_interval_s=None)


def sweeper(store, plat, guard, clock, **kw) -> Sweeper:
    """A sweeper sharing the guard's listing delay."""
    return Sweeper(store, [Bot(plat, plat.whoami(), guard.lag)], clock=clock, retry_s=5.0, config=CFG, **kw)


def sweep_for(sw: Sweeper, clock, seconds: float, step: float = 0.5) -> SweepResult:
    """Advance the clock ``seconds`` in steps, sweeping after each; return the summed counts."""
    total = SweepResult()
    for _ in range(int(seconds / step)):
        clock.advance(step)
        total.add(sw.run_once())
    return total


def kinds(store, guard, pid):
    return [e.kind for e in store.history(guard.key(pid))]


def test_retry_closed_by_the_sweep_is_verified(store, plat, guard, clock):
    """Both attempts' responses lost, real delay 3x the configured: the sweep closes the retry with the first
    reply, and a later look still finds the second one (the issue's 21 undetected duplicates)."""
    plat.real_listing_delay_s = 6.0
    plat.script = ["lost", "lost"]
    sw = sweeper(store, plat, guard, clock)
    guard.post(plat.add_parent("p1"), "x")
    assert sweep_for(sw, clock, 3.5).not_landed == 1  # looked at 3 s: nothing listed yet
    assert guard.post(plat.parents["p1"], "x").status is Status.UNCERTAIN  # the retry lands, its response lost
    r = sweep_for(sw, clock, 30)
    assert r.closed == 1 and r.verified == 1
    assert plat.reply_count("p1") == 2
    assert r.duplicates == plat.reply_count("p1") - 1
    assert "duplicate_detected" in kinds(store, guard, "p1")


def test_union_counts_a_late_answer_the_listing_never_shows(store, plat, guard, clock):
    """A reply known only from a late_landing event counts, though no read-back lists it."""
    plat.script = ["error_before"]
    sw = sweeper(store, plat, guard, clock)
    parent = plat.add_parent("p1")
    guard.post(parent, "x")
    assert sweep_for(sw, clock, 3.5).not_landed == 1
    assert guard.post(parent, "x").status is Status.POSTED  # attempt 2
    # Attempt 1's send answers late after all: its reply exists, and the feed does not list it.
    late = plat._create(parent, "x", "k")
    plat.hidden.add(late)
    guard._close(guard.key("p1"), 1, late, "closed")
    assert "late_landing" in kinds(store, guard, "p1")
    r = sweep_for(sw, clock, 10)
    assert r.verified == 1 and r.duplicates == plat.reply_count("p1") - 1 == 1
    ev = [e for e in store.history(guard.key("p1")) if e.kind == "duplicate_detected"]
    assert len(ev) == 1 and late in ev[0].detail


def test_union_counts_the_rows_own_reply_when_unlisted(store, plat, guard, clock):
    """A read-back that lists one reply while the row closed with another is a duplicate (never 'own_replies: 1')."""
    plat.script = ["lost"]
    sw = sweeper(store, plat, guard, clock)
    parent = plat.add_parent("p1")
    guard.post(parent, "x")
    first = plat.replies()[0]["reply_id"]
    plat.hidden.add(first)  # the first reply lists too late for the open row's look
    assert sweep_for(sw, clock, 3.5).not_landed == 1
    out = guard.post(parent, "x")
    assert out.status is Status.POSTED
    plat.hidden = {out.reply_id}  # now the first lists and the retry's never does
    r = sweep_for(sw, clock, 70)
    assert r.verified == 1 and r.duplicates == plat.reply_count("p1") - 1 == 1


def test_delete_newer_acts_on_a_union_duplicate(store, plat, guard, clock):
    """With delete_newer, a duplicate found through the events is deleted on the platform."""
    plat.script = ["error_before"]
    sw = sweeper(store, plat, guard, clock, on_duplicate="delete_newer")
    parent = plat.add_parent("p1")
    guard.post(parent, "x")
    sweep_for(sw, clock, 3.5)
    kept = guard.post(parent, "x").reply_id
    late = plat._create(parent, "x", "k")
    plat.hidden.add(late)
    guard._close(guard.key("p1"), 1, late, "closed")
    assert sweep_for(sw, clock, 10).duplicates == 1
    assert [r["reply_id"] for r in plat.replies()] == [kept]
    assert "duplicate_deleted" in kinds(store, guard, "p1")
    assert store.get(guard.key("p1")).reply_id == kept


def test_gave_up_row_reconciled_when_its_reply_lists_late(store, plat, guard, clock):
    """A row given up because the listing was 15x slower is closed as reconciled by a later look, reply id kept
    (proven retries not excused: with them the second miss is retried, up to guard.max_proven_retries)."""
    plat.real_listing_delay_s = 30.0
    plat.script = ["lost", "lost"]
    sw = sweeper(store, plat, guard, clock, guard_config=GuardConfig(max_proven_retries=0))
    parent = plat.add_parent("p1")
    guard.post(parent, "x")
    sweep_for(sw, clock, 3.5)
    guard.post(parent, "x")
    assert sweep_for(sw, clock, 4).gave_up == 1
    assert store.get(guard.key("p1")).state == st.GAVE_UP
    r = sweep_for(sw, clock, 20)  # the look at 10x the delay (about 20 s after) finds nothing yet
    assert r.reconciled == 0 and store.get(guard.key("p1")).state == st.GAVE_UP
    r = sweep_for(sw, clock, 200)  # the look at 100x finds both
    row = store.get(guard.key("p1"))
    assert r.reconciled == 1 and row.state == st.CLOSED
    assert row.reply_id == plat.replies()[0]["reply_id"]
    ev = [e for e in store.history(guard.key("p1")) if e.kind == "reconciled"]
    assert len(ev) == 1 and row.reply_id in ev[0].detail and "gave_up" in ev[0].detail
    assert r.duplicates == plat.reply_count("p1") - 1 == 1  # and the second attempt's reply is a duplicate
    assert guard.post(parent, "x").status is Status.ALREADY_ANSWERED
    assert sweep_for(sw, clock, 300).leased == 0  # no more looks: verified once


def test_reconcile_loses_to_a_refind_claim(store, plat, guard, clock):
    """A not_landed row re-claimed while the reconciling look reads: no 'reconciled', the new attempt stands,
    and its verification counts the late first reply as a duplicate."""
    plat.real_listing_delay_s = 15.0
    plat.script = ["lost"]
    sw = sweeper(store, plat, guard, clock)
    parent = plat.add_parent("p1")
    guard.post(parent, "x")
    assert sweep_for(sw, clock, 3.5).not_landed == 1
    claimed = []
    plat.before_read = lambda: claimed.append(guard.post(parent, "x"))  # re-find, during the sweep's read
    r = sweep_for(sw, clock, 25)
    assert claimed and claimed[0].status is Status.POSTED and claimed[0].attempt == 2
    assert r.reconciled == 0 and "reconciled" not in kinds(store, guard, "p1")
    row = store.get(guard.key("p1"))
    assert row.state == st.CLOSED and row.attempt == 2
    r.add(sweep_for(sw, clock, 60))
    assert r.duplicates == plat.reply_count("p1") - 1 == 1
