"""The listing delay estimator (replyd.lag) on the injected clock: samples, percentile, cap, persistence."""

from __future__ import annotations

import pytest
import structlog.testing

from replyd.clock import FakeClock
from replyd.config import SweepConfig
from replyd.guard import Guard, Status
from replyd.lag import ListingLag, effective_delay, percentile
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper


def cfg(**kw) -> SweepConfig:
    """Sweep settings with a small warm-up for short tests."""
    return SweepConfig(**{"listing_delay_min_samples": 5, "listing_lag_refresh_s": 1.0, **kw})


def test_percentile_is_nearest_rank():
    """Nearest rank over the sorted values; empty is 0."""
    assert percentile([], 99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 1) == 5.0


def test_effective_delay_rules():
    """Warm-up: factor x the longest proven lag; then max(configured, factor x percentile); capped, never below configured."""
    c = cfg(listing_delay_factor=2.0, listing_delay_max_s=20.0)
    assert effective_delay(3.0, [], c) == 3.0  # nothing proven yet: the configured delay
    assert effective_delay(3.0, [6.0] * 4, c) == 12.0  # warm-up: 4 < 5 samples, the longest proven lag
    assert effective_delay(3.0, [1.0], c, proven=[4.0]) == 8.0  # a reply still unlisted at 4 s counts
    assert effective_delay(3.0, [1.0, 1.0], c) == 3.0  # proven lags below the configured delay change nothing
    assert effective_delay(3.0, [1.0] * 199 + [9.0], c, proven=[30.0]) == 3.0  # after: the percentile, not the max
    assert effective_delay(3.0, [6.0] * 5, c) == 12.0
    assert effective_delay(3.0, [0.0] * 50, c) == 3.0  # a fast platform never lowers the configured delay
    assert effective_delay(3.0, [60.0] * 50, c) == 20.0  # capped
    assert effective_delay(30.0, [60.0] * 50, c) == 30.0  # the cap never goes below the configured value
    assert effective_delay(3.0, [6.0] * 50, cfg(listing_delay_auto=False)) == 3.0  # today's behaviour


def _run(store, clock, real_s: float, configured_s: float, n: int, c: SweepConfig):
    """Post ``n`` parents one at a time through the guard and sweep every half second; return platform, guard, lag."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=configured_s)
    plat.real_listing_delay_s = real_s
    lag = ListingLag(store, plat.instance, configured_s, c, clock=clock, bot="b1")
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=1.0, lag=lag, watch_interval_s=None)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=clock, retry_s=5.0, config=c)
    for i in range(n):
        assert guard.post(plat.add_parent(f"p{i}"), "x").status is Status.POSTED
        for _ in range(4):
            clock.advance(0.5)
            sw.run_once()
    for _ in range(200):
        clock.advance(0.5)
        sw.run_once()
    lag.refresh()
    return plat, guard, lag


def test_learns_a_delay_above_the_real_lag(store, clock):
    """Configured 1 s, real 3 s: the delay in use rises above 3 s once enough sends were measured, no higher than factor x real."""
    c = cfg()
    plat, guard, lag = _run(store, clock, 3.0, 1.0, 12, c)
    assert lag.summary.samples == 12
    assert 2.0 <= lag.summary.p99_s < 3.0  # a proven lag: the last look that did not list it
    assert 3.0 <= lag.delay_s() <= 6.0
    # Persisted and shared: a new estimator (a restart, another replica) starts from the store.
    again = ListingLag(store, plat.instance, 1.0, c, clock=clock)
    assert again.delay_s() == 1.0  # no I/O until refreshed
    assert again.refresh_if_due() == lag.delay_s()
    row = next(r for r in store.listing() if r["platform"] == plat.instance)
    assert row["in_use_s"] == lag.delay_s() and row["configured_s"] == 1.0 and row["samples"] == 12


def test_fast_platform_keeps_configured_delay(store, clock):
    """Real lag below the configured delay: every first look lists the reply, the delay in use stays configured.

    Guards against an estimate fed by its own looks (upper bounds), which would grow to the cap.
    """
    plat, guard, lag = _run(store, clock, 0.5, 2.0, 12, cfg())
    assert lag.summary.samples == 12 and lag.summary.p99_s == 0.0
    assert lag.delay_s() == 2.0


def test_auto_off_measures_but_keeps_configured(store, clock):
    """listing_delay_auto = false: lag is still observed and shown, the configured delay stays in use."""
    plat, guard, lag = _run(store, clock, 3.0, 1.0, 8, cfg(listing_delay_auto=False))
    assert lag.summary.samples == 8 and lag.summary.p99_s >= 2.0
    assert lag.delay_s() == 1.0


def test_change_logged_once_and_short_configuration_warned(store, clock):
    """Each change is logged once with old and new value (a chain from the configured delay); the warning names the bot and the key."""
    with structlog.testing.capture_logs() as logs:
        _run(store, clock, 3.0, 1.0, 12, cfg())
    changed = [(e["old_s"], e["new_s"]) for e in logs if e["event"] == "replyd.lag.delay_changed"]
    assert changed and changed[0][0] == 1.0 and changed[-1][1] >= 3.0
    assert all(a[1] == b[0] for a, b in zip(changed, changed[1:], strict=False))  # no change logged twice, none skipped
    assert len(changed) <= 8  # the warm-up's steps, not one line per look
    short = [e for e in logs if e["event"] == "replyd.lag.configured_short"]
    assert len(short) == 1 and short[0]["key"] == "bots.b1.settings.listing_delay_s" and short[0]["bot"] == "b1"


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_store_failure_keeps_last_delay(store, clock, monkeypatch):
    """A refresh that cannot read the store keeps the delay in use (never falls back silently to 0)."""
    lag = ListingLag(store, "memory:test", 4.0, cfg(), clock=clock)
    assert lag.refresh_if_due() == 4.0
    from replyd.errors import StoreError

    def broken(*a, **k):
        raise StoreError("store unavailable while reading listing lag: down")

    monkeypatch.setattr(Store, "lag_samples", broken)
    clock.advance(5)
    assert lag.refresh_if_due() == 4.0


def test_lag_is_exported_as_a_histogram(store, clock):
    """Every measured reply is one observation of replyd_listing_lag_seconds for its platform instance."""
    from prometheus_client import generate_latest

    from replyd import metrics

    before = metrics.LISTING_LAG.labels("memory:test")._sum.get()
    _run(store, clock, 3.0, 1.0, 3, cfg())
    text = generate_latest(metrics.registry()).decode()
    assert 'replyd_listing_lag_seconds_bucket{le="5.0",platform="memory:test"}' in text
    assert metrics.LISTING_LAG.labels("memory:test")._sum.get() - before >= 3 * 3.0  # three replies, each >= 3 s


@pytest.mark.parametrize("auto", [True, False])
def test_warm_up_keeps_a_lost_response_from_being_judged_too_early(store, clock, auto):
    """Before any sample completes, a reply seen unlisted raises the delay at once and an open row waits for it.

    Configured 1 s, real 4 s: p0's reply (response received) is still unlisted at its looks, so p1 (response
    lost, opened just after) is not judged not_landed at its 1.5 s deadline but found once listed. With the
    learned delay off, today's behaviour: judged too early.
    """
    c = cfg(listing_delay_auto=auto)
    plat = MemoryPlatform(clock=clock, listing_delay_s=1.0)
    plat.real_listing_delay_s = 4.0
    lag = ListingLag(store, plat.instance, 1.0, c, clock=clock, bot="b1")
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=0.5, lag=lag, watch_interval_s=None)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=clock, retry_s=5.0, config=c)
    assert guard.post(plat.add_parent("p0"), "x").status is Status.POSTED
    clock.advance(0.2)
    plat.script = ["lost"]
    assert guard.post(plat.add_parent("p1"), "x").status is Status.UNCERTAIN
    for _ in range(40):
        clock.advance(0.25)
        sw.run_once()
    kinds = [e.kind for e in store.history(guard.key("p1"))]
    if auto:
        assert "not_landed" not in kinds and "swept_found" in kinds, kinds
        assert lag.delay_s() >= 6.0  # 2 x the proven lag of p0 (unlisted at 3.5 s or later)
    else:
        assert "not_landed" in kinds and lag.delay_s() == 1.0


def test_a_look_in_the_same_pass_counts_before_an_open_row_is_judged(store, clock):
    """When a close's first look and an open row's deadline fall in one pass, the look (closed rows) goes first.

    p1 (response lost) opens at 0 with its deadline at 1.5 s; p0 closes at 0.5 s, first looked at 1.5 s: that
    look proves 1 s of lag, so p1 is not judged in the same pass.
    """
    c = cfg()
    plat = MemoryPlatform(clock=clock, listing_delay_s=1.0)
    plat.real_listing_delay_s = 4.0
    lag = ListingLag(store, plat.instance, 1.0, c, clock=clock, bot="b1")
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=0.5, lag=lag, watch_interval_s=None)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=clock, retry_s=5.0, config=c)
    plat.script = ["lost"]
    assert guard.post(plat.add_parent("p1"), "x").status is Status.UNCERTAIN
    clock.advance(0.5)
    assert guard.post(plat.add_parent("p0"), "x").status is Status.POSTED
    assert store.get(guard.key("p1")).deadline_at == store.get(guard.key("p0")).deadline_at  # one pass
    clock.advance(1.0)
    r = sw.run_once()
    assert r.leased == 2 and r.not_landed == 0 and lag.delay_s() == 2.0


def _stepped(store, replica: FakeClock, platform_clock: FakeClock, real_s: float):
    """A bot on ``replica``'s wall clock against a platform on its own clock (real lag ``real_s``, configured 1 s)."""
    plat = MemoryPlatform(clock=platform_clock, listing_delay_s=1.0)
    plat.real_listing_delay_s = real_s
    lag = ListingLag(store, plat.instance, 1.0, cfg(), clock=replica, bot="b1")
    guard = Guard(store, plat, plat.whoami(), clock=replica, send_timeout_s=0.5, lag=lag, watch_interval_s=None)
    return plat, lag, guard


def _tick(clocks, sweepers, seconds: float, every: float = 0.25) -> None:
    """Advance every clock together (real time passing) and run each sweeper at every step."""
    for _ in range(int(seconds / every)):
        for c in clocks:
            c.advance(every)
        for sw in sweepers:
            sw.run_once()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("step_s", [30.0, -30.0])
def test_a_wall_clock_step_between_send_and_look_proves_no_lag(store, clock, step_s):
    """The sender's wall clock steps 30 s (NTP, an operator) after a send: its looks time the lag on the monotonic
    clock, so the proven lag stays the platform's 3 s and the delay in use 2 x that, not 2 x 33 s; stepped back,
    the first reply's look comes 31 s later and is timed 31 s old, not 0."""
    platform_clock = FakeClock(clock.now())
    plat, lag, guard = _stepped(store, clock, platform_clock, 3.0)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=clock, retry_s=5.0, config=cfg())
    for i in range(6):
        assert guard.post(plat.add_parent(f"p{i}"), "x").status is Status.POSTED
        if i == 0:
            clock.set(clock.now() + step_s)  # the step: wall time only, the platform and monotonic go on
        _tick([clock, platform_clock], [sw], 1.0)
    _tick([clock, platform_clock], [sw], 60.0)
    lag.refresh()
    assert lag.summary.samples == 6
    assert 2.0 <= lag.summary.p99_s < 3.0, lag.summary
    assert 3.0 <= lag.delay_s() <= 6.0
    listed_at = max(upper for _, upper in store.lag_samples(plat.instance, 100))
    assert (listed_at >= 30.0) == (step_s < 0), listed_at  # the wall clock would read 0 s (or 33 s) for it


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_another_replicas_stepped_send_time_is_no_sample(store, clock):
    """Replica A's wall clock is 30 s behind B's: B's looks at A's replies (sent_at 30 s in B's past) prove
    nothing, A's own looks still measure the platform's 3 s; no replica's delay in use goes near 60 s."""
    platform_clock = FakeClock(clock.now())
    clock_b = FakeClock(clock.now())
    clock.set(clock.now() - 30.0)  # replica A, stepped back before it sends
    plat, lag_a, guard_a = _stepped(store, clock, platform_clock, 3.0)
    lag_b = ListingLag(store, plat.instance, 1.0, cfg(), clock=clock_b, bot="b1")
    sweepers = [Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=c, retry_s=5.0, config=cfg(), owner=o)
                for lag, c, o in ((lag_b, clock_b, "b"), (lag_a, clock, "a"))]  # B first: it sees them due first
    for i in range(6):
        assert guard_a.post(plat.add_parent(f"p{i}"), "x").status is Status.POSTED
        _tick([clock, clock_b, platform_clock], sweepers, 1.0)
    _tick([clock, clock_b, platform_clock], sweepers, 60.0)
    for lag in (lag_a, lag_b):
        lag.refresh()
        assert lag.summary.p99_s < 3.0 and lag.delay_s() <= 6.0, (lag.summary, lag.delay_s())


def test_only_the_database_clock_is_shared_between_replicas():
    """A wall clock (system or fake) can step, so another process's time on it is no end of an interval."""
    from replyd.clock import DatabaseClock, SystemClock, shared

    assert not shared(SystemClock()) and not shared(FakeClock())
    assert shared(DatabaseClock(lambda: 1_800_000_000.0))


def test_the_send_log_forgets_a_reply_once_no_look_can_want_it(store, clock):
    """This process's send log keeps a reply's monotonic send time while a look may still come (up to
    listing_delay_max_s), and drops it once twice that has passed, pruned by a later send."""
    lag = ListingLag(store, "memory:sendlog", 1.0, cfg(listing_delay_max_s=10.0), clock=clock)
    lag.sent("r1")
    clock.advance(9.0)
    lag.sent("r2")
    assert lag.age_s("r1", 0.0, clock.now()) == pytest.approx(9.0)  # still looked at: kept
    clock.advance(25.0)  # r1 is 34 s old, past 2 x 10 s; the next send prunes
    lag.sent("r3")
    assert "r1" not in lag._sent and "r3" in lag._sent
