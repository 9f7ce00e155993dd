"""Many bots in one daemon: a bounded thread count, one reply per mention, empty polls that touch no store."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.manybots import bot_name, bot_token, write_config
from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.sim import SimServer, World
from tests.test_daemon import wait_until

USER = "alice"


class _World:
    """The sim in this process, its bot accounts, and a running daemon over them."""

    def __init__(self, world: World, srv: SimServer, bots: dict[str, Any], daemon: Daemon, db: Path) -> None:
        self.world, self.srv, self.bots, self.daemon, self.db = world, srv, bots, daemon, db


@pytest.fixture
def many(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[_World]:
    """A sim with ``request.param`` (count, job threads) bots and a daemon over them, stopped afterwards."""
    n, job_threads = request.param
    world = World(SystemClock(), seed=36, listing_delay_s=0.1)
    bots = {bot_name(i): world.add_account(bot_name(i), bot=True, token=bot_token(i)) for i in range(n)}
    world.add_account(USER)
    for i in range(n):
        monkeypatch.setenv(f"MB_TOKEN_{i:04d}", bot_token(i))
    with SimServer(world) as srv:
        db = tmp_path / "r.sqlite3"
        # The benchmark's config, fast: inbox every 0.3 s without jitter, a sweep tick every 0.3 s.
        cfg = write_config(tmp_path / "c.toml", srv.base_url, db, n, job_threads, inbox_s=0.3, jitter_s=0, sweep_s=0.3,
                           level="warning")
        d = Daemon(Config.load(cfg))
        try:
            yield _World(world, srv, bots, d, db)
        finally:
            d.stop(grace_s=5)


class _PeakThreads:
    """Samples the process's thread count every 20 ms; ``peak`` is the largest seen above the count at start."""

    def __init__(self) -> None:
        self.base = threading.active_count() + 1  # + the sampler itself
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="test-thread-sampler", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, threading.active_count() - self.base)

    def stop(self) -> int:
        """Stop sampling; return the peak."""
        self._stop.set()
        self._t.join()
        return self.peak


@pytest.mark.slow
@pytest.mark.parametrize("many", [(50, 6)], indirect=True)
def test_fifty_bots_few_threads_one_reply_per_mention(many: _World) -> None:
    """50 bots on a pool of 6 job threads: the daemon adds at most the pool plus a few threads, and one mention
    to every bot at once is answered exactly once each (counted on the sim)."""
    world, d = many.world, many.daemon
    sampler = _PeakThreads()
    try:
        d.start()
        assert len(d.bots) == 50
        time.sleep(1.5)  # several polls and sweep ticks of every bot, idle
        parents = {name: world.post(USER, "help?", mention=[acc]).id for name, acc in many.bots.items()}
        answered = lambda: all(world.replies_by(acc.id).get(parents[name]) for name, acc in many.bots.items())  # noqa: E731
        assert wait_until(answered, timeout_s=40)
        time.sleep(1.5)  # the sweep verifies every close; a second reply would land now
    finally:
        peak = sampler.stop()
    # The pool, the scheduler, the one send watch, the shared responder loop, the sweep's one lease keeper (while a
    # pass holds rows); the first logins' pool comes and goes.
    assert peak <= 6 + 5, f"{peak} threads above the start for 50 bots"
    per = {name: world.replies_by(acc.id).get(parents[name], 0) for name, acc in many.bots.items()}
    assert set(per.values()) == {1}, Counter(per.values())
    assert world.report()["duplicates"] == 0


class _Counting:
    """A store stand-in for one bot's pollers that counts every call it passes on."""

    def __init__(self, store: Any, calls: Counter[str]) -> None:
        self._store, self._calls = store, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            return attr(*args, **kwargs)

        return call


def _data_version(conn: sqlite3.Connection) -> int:
    """SQLite's data_version on an observer connection: it moves whenever another connection commits a change."""
    return conn.execute("PRAGMA data_version").fetchone()[0]


@pytest.mark.parametrize("many", [(3, 4)], indirect=True)
def test_empty_polls_touch_no_store(many: _World) -> None:
    """Once each bot answered its mention and the sweep verified it, its polls find nothing: no store call from the
    pollers (no cursor read, no write), and the idle daemon (polls and sweep ticks) commits nothing at all."""
    world, d = many.world, many.daemon
    d.start()
    parents = {name: world.post(USER, "help?", mention=[acc]).id for name, acc in many.bots.items()}
    assert wait_until(lambda: all(world.replies_by(acc.id).get(parents[n]) for n, acc in many.bots.items()), 20)
    assert d.store is not None
    # Every close carries a deadline until the sweep verified it: wait until no row carries one (all quiet).
    assert wait_until(lambda: not d.store.senders_due(time.time() + 86_400), 30)
    calls: Counter[str] = Counter()
    for b in d.bots:
        b.pollers.store = _Counting(b.pollers.store, calls)
    observer = sqlite3.connect(many.db)
    try:
        before = _data_version(observer)
        assert d.liveness is not None
        runs = lambda: sum(b["paths"]["inbox"]["runs"] for b in d.liveness.snapshot().values())  # noqa: E731
        runs0 = runs()
        time.sleep(2.0)  # about 6 polls per bot and 6 sweep ticks
        assert runs() - runs0 >= 3 * len(d.bots), "the inbox polls did not run"
        assert _data_version(observer) == before, "an idle daemon committed a change to the store"
    finally:
        observer.close()
    assert calls == Counter(), f"empty polls called the store: {dict(calls)}"


def test_one_shot_runs_of_one_bot_never_overlap() -> None:
    """A bot's sweep (or re-offer) is not submitted again while its last run is queued or running; it is once done."""
    from replyd.jobs import JobPool

    d = Daemon(Config())
    d._jobs = JobPool(2)
    release, ran = threading.Event(), Counter()

    def slow(name: str) -> None:
        ran[name] += 1
        release.wait(10)

    try:
        assert d._once("b1:sweep", slow, "b1")
        assert wait_until(lambda: ran["b1"] == 1, 5, 0.01)
        assert not d._once("b1:sweep", slow, "b1")  # still running: refused (reported as skipped)
        assert d._once("b2:sweep", slow, "b2")  # another bot is not held up by it
        release.set()
        assert wait_until(lambda: d._once("b1:sweep", lambda _n: None, "b1"), 5, 0.01)
        assert ran == Counter(b1=1, b2=1)
    finally:
        release.set()
        d._jobs.shutdown(wait=True)
