"""The daemon against the simulated platform over real HTTP: paths, restarts, SIGKILL, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.pipeline import Pipeline
from replyd.responders import register_responder
from replyd.sim import SimServer, World
from replyd.store import Store

ROOT = Path(__file__).resolve().parents[1]
BOT = "replybot"
CALLS: list[str] = []


@register_responder("test-counting")
def _counting(settings):
    """A responder that records every call, to count responder calls per parent."""

    def respond(parent):
        CALLS.append(parent.id)
        return f"thanks, {parent.author_handle}"

    return respond


def write_config(path: Path, base_url: str, db: Path, token_env: str = "SIM_TOKEN", responder: str = "template",
                 search: bool = True) -> Path:
    """Write a daemon config for the sim with short intervals."""
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 1.0

[sweep]
interval_s = 0.5
retry_s = 0.5

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "{token_env}"
listing_delay_s = 0.5
timeout_s = 3.0

[bots.pollers]
inbox_interval_s = 0.4
search_interval_s = {0.5 if search else 0}
search_queries = ["help"]
refind_interval_s = 0.7
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "{responder}"
""")
    os.chmod(path, 0o600)
    return path


@pytest.fixture
def sim():
    """A sim in this process (so the test reads its world) with one bot account."""
    world = World(SystemClock(), seed=3, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    with SimServer(world) as srv:
        os.environ["SIM_TOKEN"] = bot.token
        yield srv, world, bot
    os.environ.pop("SIM_TOKEN", None)


def wait_until(cond, timeout_s: float = 30.0, every_s: float = 0.2) -> bool:
    """Poll ``cond`` until true or timeout (waiting on a real daemon, not on replyd logic)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every_s)
    return cond()


def settled(db: Path) -> bool:
    """True when the log has rows and none is open, not_landed, released or composing."""
    s = Store.open(f"sqlite:///{db}")
    try:
        counts = s.counts()
        return bool(counts) and not any(n for (_, state), n in counts.items()
                                        if state in (st.OPEN, st.NOT_LANDED, st.RELEASED, st.COMPOSING))
    finally:
        s.dispose()


def test_three_paths_one_reply_one_responder_call(sim, tmp_path, monkeypatch):
    """A parent found by inbox, search and re-find (each seen offering it) gets one reply and one responder call."""
    srv, world, bot = sim
    parents = [s.id for s in world.generate(6, target=BOT, query_word="help", query_fraction=1.0)]
    CALLS.clear()
    offered: dict[str, set[str]] = {}  # parent id -> the paths that offered it to the pipeline
    real_offer = Pipeline.offer

    def spy(self: Pipeline, parent, path: str):
        """Note which path found the parent, then offer it as the daemon would."""
        offered.setdefault(parent.id, set()).add(path)
        return real_offer(self, parent, path)

    monkeypatch.setattr(Pipeline, "offer", spy)
    cfg = Config.load(write_config(tmp_path / "c.toml", srv.base_url, tmp_path / "r.sqlite3", responder="test-counting"))
    d = Daemon(cfg)
    d.start()
    three = {"inbox", "search", "refind"}
    try:
        assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents))
        # Every path must really find every parent: after the first answer, the others meet an answered key.
        assert wait_until(lambda: all(offered.get(p) == three for p in parents)), {p: offered.get(p) for p in parents}
    finally:
        d.stop(grace_s=5)
    per = world.replies_by(bot.id)
    assert [per.get(p, 0) for p in parents] == [1] * len(parents)
    assert sorted(CALLS) == sorted(parents)  # one responder call per parent, though each was offered three ways
    s = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    rows = s.rows_in(d.bots[0].platform.instance, bot.id, [st.CLOSED])
    s.dispose()
    assert sorted(r.parent_id for r in rows) == sorted(parents) and {r.path for r in rows} <= three


def _start_daemon(cfg: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=env, cwd=ROOT)


@pytest.mark.slow
def test_sigkill_restart_no_duplicates_and_cursor_survives(sim, tmp_path):
    """A daemon SIGKILLed mid-run under lost responses and restarted leaves 0 duplicates and 0 lost."""
    srv, world, bot = sim
    world.configure(lost_drop_rate=0.2, lost_504_rate=0.1, error_500_before_rate=0.1)
    db = tmp_path / "r.sqlite3"
    cfg = write_config(tmp_path / "c.toml", srv.base_url, db)
    traffic = world.start_traffic(10.0, total=40, target=BOT, query_word="help", users=5)
    log = tmp_path / "daemon.log"
    first = _start_daemon(cfg, log)
    try:
        def cursor() -> str | None:
            s = Store.open(f"sqlite:///{db}")
            try:
                return s.get_cursor(f"mastodon:{srv.base_url}", bot.id, "inbox")
            finally:
                s.dispose()

        # Kill mid-run: some answers out, a cursor saved, traffic still arriving.
        assert wait_until(lambda: db.exists() and sum(world.replies_by(bot.id).values()) >= 5 and cursor(), 30), \
            log.read_text()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        cursor_before = cursor()
        traffic.join(30)
        second = _start_daemon(cfg, log)
        try:
            parents = [s.id for s in world.statuses.values() if not s.in_reply_to_id and s.account_id != bot.id]
            assert len(parents) == 40
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents) and settled(db), 60), \
                (world.report()["faults_injected"], log.read_text()[-3000:])
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(20) == 0  # graceful stop exits 0
    finally:
        if first.poll() is None:
            first.kill()
    report = world.report()
    per = world.replies_by(bot.id)
    assert report["duplicates"] == 0, report
    assert all(per.get(p, 0) == 1 for p in parents)
    assert sum(report["faults_injected"].values()) > 0  # the run really met faults
    assert int(cursor()) >= int(cursor_before)  # resumed from the saved position, never reset


def test_sigterm_stops_claiming_and_exits_zero(sim, tmp_path):
    """SIGTERM stops the daemon within the grace period with exit code 0."""
    srv, world, bot = sim
    cfg = write_config(tmp_path / "c.toml", srv.base_url, tmp_path / "r.sqlite3")
    world.generate(3, target=BOT)
    log = tmp_path / "daemon.log"
    p = _start_daemon(cfg, log)
    assert wait_until(lambda: sum(world.replies_by(bot.id).values()) >= 3, 30), log.read_text()[-2000:]
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0
    assert "replyd.daemon.stopped" in log.read_text()
    # Every guard line a poller's post logs says which bot and platform it is about.
    import json

    guard = [json.loads(ln) for ln in log.read_text().splitlines() if '"replyd.guard.' in ln]
    assert guard and all(g.get("bot") == "sim" and g.get("platform") == f"mastodon:{srv.base_url}" for g in guard), guard[:3]


def test_stop_blocks_new_claims(sim, tmp_path):
    """After stop() begins, the guard refuses new claims (nothing is sent while shutting down)."""
    srv, world, bot = sim
    cfg = Config.load(write_config(tmp_path / "c.toml", srv.base_url, tmp_path / "r.sqlite3"))
    d = Daemon(cfg)
    d.start()
    d.stop(grace_s=5)
    world.generate(2, target=BOT)
    time.sleep(0.5)
    out = d.bots[0].guard.post(world.statuses and __import__("replyd.platforms.base", fromlist=["Parent"]).Parent(id="x", author_id="u"), "x")
    assert out.status.value == "not_sent" and "shutting down" in out.detail
    assert sum(world.replies_by(bot.id).values()) == 0
