"""The database clock: replicas whose wall clocks disagree still agree on deadlines (PostgreSQL)."""

from __future__ import annotations

import time
import uuid

import pytest

from replyd.clock import DatabaseClock, SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.guard import Guard, Status
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from replyd.transitions import planting


class Ticks:
    """A hand-moved monotonic clock."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        """Return the current tick."""
        return self.t


def test_anchor_carries_forward_on_the_monotonic_clock(monkeypatch):
    """now() is the database's time at sync plus monotonic time since; a wall-clock step changes nothing."""
    ticks = Ticks()
    db = {"t": 5_000.0}

    def read() -> float:
        ticks.t += 0.2  # a 0.2 s round trip: the anchor is its midpoint
        return db["t"]

    c = DatabaseClock(read, monotonic=ticks)
    assert c.now() == pytest.approx(5_000.0 + 0.1)
    ticks.t += 10
    monkeypatch.setattr(time, "time", lambda: 9e9)  # NTP or an operator steps the wall clock
    assert c.now() == pytest.approx(5_010.1)
    db["t"] = 5_010.5  # the server's clock moved 0.2 s more than ours: the next sync corrects it
    assert c.sync() == pytest.approx(5_010.5 - (5_010.1 + 0.1))
    assert c.now() == pytest.approx(5_010.5 + 0.1)


@pytest.mark.postgres
def test_database_epoch_is_the_servers_clock(pg_url):
    """Store.db_epoch reads PostgreSQL's clock; on this machine it agrees with time.time() within a second."""
    s = Store.open(pg_url)
    try:
        assert abs(s.db_epoch() - time.time()) < 1.0
        assert abs(DatabaseClock(s.db_epoch).now() - time.time()) < 1.0
    finally:
        s.dispose()


class Ahead:
    """A wall clock running ``ahead_s`` seconds fast, like a replica whose NTP is off."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead_s = ahead_s

    def now(self) -> float:
        """Return the skewed wall-clock time."""
        return time.time() + self.ahead_s


@pytest.mark.postgres
def test_a_fast_replica_sweeps_early_only_on_its_own_clock(pg_url):
    """A row opened by replica A is not due yet: replica B 30 s fast sweeps it early, unless B uses the database clock."""
    store_a = Store.open(pg_url)
    plat = MemoryPlatform(instance=f"memory:skew-{uuid.uuid4().hex[:8]}", listing_delay_s=5.0)  # rows of its own
    guard = Guard(store_a, plat, plat.whoami(), clock=DatabaseClock(store_a.db_epoch), send_timeout_s=5.0)
    out = guard.post(plat.add_parent("p-skew"), "hello")
    assert out.status is Status.POSTED
    with planting(), store_a.transaction() as tx:  # planted as if the response was lost: open, due in 10 s
        assert tx.cas_event(guard.key("p-skew"), states=["closed"], attempt=1,
                           values={"state": "open", "reply_id": None, "deadline_at": store_a.db_epoch() + 10.0})
    fast = Sweeper(Store.open(pg_url, clock=Ahead(30.0)), [Bot(plat, plat.whoami())], clock=Ahead(30.0), owner="b")
    synced_store = Store.open(pg_url)
    synced = Sweeper(synced_store, [Bot(plat, plat.whoami())], clock=DatabaseClock(synced_store.db_epoch), owner="b2")
    try:
        assert synced.run_once().leased == 0  # the database says: not due for another 10 s
        assert fast.run_once().leased == 1  # its own clock says: 20 s overdue
    finally:
        for s in (store_a, fast.store, synced_store):
            s.dispose()


@pytest.mark.postgres
def test_daemon_on_postgres_takes_the_database_clock(pg_url, monkeypatch):
    """The daemon on PostgreSQL uses the database's time even when this machine's wall clock is an hour off."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)
    monkeypatch.setenv("REPLYD_STORE__URL", pg_url)
    d = Daemon(Config.load(None), clock=None)
    d.start()
    try:
        assert isinstance(d.clock, DatabaseClock) and d.store.clock is d.clock
        assert abs(d.clock.now() - real()) < 1.0 and d.clock.skew_s == pytest.approx(-3600.0, abs=1.0)
    finally:
        d.stop(grace_s=2)
    monkeypatch.setenv("REPLYD_STORE__DB_CLOCK", "false")
    d2 = Daemon(Config.load(None))
    d2.start()
    try:
        assert isinstance(d2.clock, SystemClock)
    finally:
        d2.stop(grace_s=2)


@pytest.mark.postgres
def test_daemon_re_anchors_the_database_clock_after_a_reconnect(pg_url, monkeypatch):
    """A new server connection (after a failover it is a new primary) re-anchors the clock at the next sweep tick."""
    monkeypatch.setenv("REPLYD_STORE__URL", pg_url)
    d = Daemon(Config.load(None))
    d.start()
    try:
        assert isinstance(d.clock, DatabaseClock)
        syncs = []
        real_sync = d.clock.sync
        monkeypatch.setattr(d.clock, "sync", lambda: (syncs.append(1), real_sync())[1])
        d.sweep_once()
        assert syncs == []  # no reconnect yet: the scheduled re-sync is enough
        d.store.dispose()  # every pooled connection gone, as after the primary died
        d.store.dispose()
        d.store.counts()  # the next query connects anew
        d.sweep_once()
        assert syncs == [1]
        d.sweep_once()
        assert syncs == [1]  # once per reconnect, not every tick
    finally:
        d.stop(grace_s=2)
