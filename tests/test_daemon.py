"""The daemon against the simulated platform over real HTTP: paths, restarts, SIGKILL, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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


def _head(db: Path) -> str:
    """The store, log, guard and sweep sections every daemon config here shares: short intervals."""
    return f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 1.0
# A SIGKILL between a row's compose lease and its open leaves it composing for the whole lease: 120 s by default,
# as long as the restart tests wait for every parent (CI failed once so under load).
compose_lease_s = 10.0

[sweep]
interval_s = 0.5
retry_s = 0.5
"""


def write_config(path: Path, base_url: str, db: Path, token_env: str = "SIM_TOKEN", responder: str = "template",
                 search: bool = True) -> Path:
    """Write a daemon config for the sim with short intervals."""
    path.write_text(f"""{_head(db)}
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
    real_offer = Pipeline.offer_page

    def spy(self: Pipeline, parents, path: str):
        """Note which path found each parent of a page, then offer the page as the daemon would."""
        for parent in parents:
            offered.setdefault(parent.id, set()).add(path)
        return real_offer(self, parents, path)

    monkeypatch.setattr(Pipeline, "offer_page", spy)
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
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents) and settled(db), 120), \
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


def test_sigterm_with_a_job_stuck_past_the_grace_exits_at_once(sim, tmp_path):
    """A compose still running after the grace (a 60 s responder) does not hold the process: it exits, says so."""
    srv, world, bot = sim
    cfg = write_config(tmp_path / "c.toml", srv.base_url, tmp_path / "r.sqlite3", responder="command")
    cfg.write_text(cfg.read_text().replace('kind = "command"', 'kind = "command"\ncommand = ["sleep", "60"]\n'
                                                                 'timeout_s = 60'))
    world.generate(1, target=BOT)
    log = tmp_path / "daemon.log"
    p = _start_daemon(cfg, log)
    try:
        assert wait_until(lambda: _composing(tmp_path / "r.sqlite3"), 60), \
            log.read_text()[-2000:]
        p.send_signal(signal.SIGTERM)
        # Grace 5 s: without the forced exit the interpreter joins the stuck job's thread for the rest of 60 s.
        assert p.wait(40) == 0, log.read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log.read_text()
    assert "replyd.daemon.grace_expired" in text and "replyd.daemon.exit_forced" in text, text[-2000:]
    assert world.replies_by(bot.id) == {} or sum(world.replies_by(bot.id).values()) == 0


def _composing(db: Path) -> bool:
    """Whether the store has a row being composed (a responder running)."""
    if not db.exists():
        return False
    s = Store.open(f"sqlite:///{db}")
    try:
        return any(n for (_, state), n in s.counts().items() if state == st.COMPOSING)
    except Exception:  # the daemon is still creating the schema
        return False
    finally:
        s.dispose()


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


def _free_port() -> int:
    """A port nothing listens on (bound and released): connecting to it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_bot_config(path: Path, db: Path, url_a: str, url_b: str, api_port: int) -> Path:
    """Two bots, ``a`` and ``b``, on two sims; the API on ``api_port``; a start retried after 1, 2, 4, 4… s."""
    bots = "".join(f"""
[[bots]]
name = "{name}"
platform = "mastodon"

[bots.settings]
base_url = "{url}"
token_env = "SIM_TOKEN_{name.upper()}"
listing_delay_s = 0.3
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.5
search_interval_s = 0
refind_interval_s = 2.0
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "template"
""" for name, url in (("a", url_a), ("b", url_b)))
    path.write_text(f"""{_head(db)}
[health]
start_retry_s = 1.0
start_retry_max_s = 4.0

[api]
enabled = true
port = {api_port}
{bots}""")
    os.chmod(path, 0o600)
    return path


@pytest.mark.slow
def test_one_platform_down_at_start_stops_no_other_bot(tmp_path):
    """Two bots, b's platform refusing connections for 60 s: `replyd run` keeps running, a answers from the first
    seconds, /readyz and /metrics say b is starting and why; once a sim listens on b's port, b answers its backlog.
    Replies are counted on the sims."""
    import httpx

    world_a = World(SystemClock(), seed=5, listing_delay_s=0.2)
    bot_a = world_a.add_account(BOT, bot=True)
    world_b = World(SystemClock(), seed=6, listing_delay_s=0.2)
    bot_b = world_b.add_account(BOT, bot=True)
    backlog_b = [s.id for s in world_b.generate(5, target=BOT)]  # waiting on b's platform while it is down
    port_b, api_port = _free_port(), _free_port()
    with SimServer(world_a) as sim_a:
        cfg = _two_bot_config(tmp_path / "two.toml", tmp_path / "two.sqlite3", sim_a.base_url,
                              f"http://127.0.0.1:{port_b}", api_port)
        first_a = [s.id for s in world_a.generate(5, target=BOT)]
        log = tmp_path / "daemon.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN_A": bot_a.token, "SIM_TOKEN_B": bot_b.token}
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                             stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=env, cwd=ROOT)
        api = f"http://127.0.0.1:{api_port}"
        try:
            assert wait_until(lambda: p.poll() is not None or all(world_a.replies_by(bot_a.id).get(x) for x in first_a),
                              30), log.read_text()[-3000:]
            assert p.poll() is None, f"replyd run exited {p.returncode}: {log.read_text()[-3000:]}"
            took_a = time.monotonic() - t0
            ready = httpx.get(api + "/readyz", timeout=5)
            body = ready.json()
            assert ready.status_code == 503 and body["bots"] == {"a": True, "b": False}, body
            assert [r for r in body["reasons"] if r.startswith("bot b: starting (")], body
            assert any("refused" in r.lower() or "connect" in r.lower() for r in body["reasons"]), body
            assert not [r for r in body["reasons"] if r.startswith("bot a")], body  # a is ready; only b is not
            metrics = httpx.get(api + "/metrics", timeout=5).text
            assert 'replyd_bot_up{platform="a"} 1.0' in metrics and 'replyd_bot_up{platform="b"} 0.0' in metrics
            live = httpx.get(api + "/v1/status", timeout=5).json()["liveness"]
            assert live["b"]["start"]["state"] == "starting" and live["b"]["start"]["attempts"] >= 1, live["b"]
            page = httpx.get(api + "/", timeout=5).text
            assert 'data-start="starting"' in page, page[-2000:]
            # New mentions of a keep being answered while b's platform stays down.
            later_a = [s.id for s in world_a.generate(3, target=BOT)]
            assert wait_until(lambda: all(world_a.replies_by(bot_a.id).get(x) for x in later_a), 20)
            assert sum(world_b.replies_by(bot_b.id).values()) == 0
            down_s = 60.0 - (time.monotonic() - t0)
            assert down_s > 0, f"a took {took_a:.0f} s: too slow to show b's outage"
            time.sleep(down_s)  # b's platform is down for 60 s from the daemon's start
            assert p.poll() is None, log.read_text()[-3000:]
            with SimServer(world_b, port=port_b):
                up = time.monotonic()
                assert wait_until(lambda: all(world_b.replies_by(bot_b.id).get(x) for x in backlog_b), 30), \
                    log.read_text()[-3000:]
                took_b = time.monotonic() - up
                assert took_b <= 4.0 + 5.0, took_b  # the retry cap, then the first polls
                assert wait_until(lambda: httpx.get(api + "/readyz", timeout=5).status_code == 200, 15), \
                    httpx.get(api + "/readyz", timeout=5).json()
                p.send_signal(signal.SIGTERM)
                assert p.wait(20) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    print(f"a answered its first 5 in {took_a:.1f} s; b answered its backlog {took_b:.1f} s after its platform came up")
    assert [world_a.replies_by(bot_a.id).get(x, 0) for x in first_a + later_a] == [1] * 8
    assert [world_b.replies_by(bot_b.id).get(x, 0) for x in backlog_b] == [1] * 5
    events = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
    retrying = [e for e in events if e.get("event") == "replyd.bot.start_retrying"]
    assert retrying and all(e["bot"] == "b" for e in retrying)
    waits = [e["retry_in_s"] for e in retrying]
    assert waits[:3] == [1.0, 2.0, 4.0] and max(waits) == 4.0, waits  # doubling, capped
    assert any(e.get("event") == "replyd.bot.started" and e["bot"] == "b" for e in events)


def test_refused_login_at_start_is_one_line_exit_2(tmp_path):
    """A refused login (HTTP 401) of one bot stops `replyd run` at start with one line naming bot and variable,
    though the other bot's platform is fine."""
    world = World(SystemClock(), seed=7)
    bot = world.add_account(BOT, bot=True)
    with SimServer(world) as sim_a:
        cfg = _two_bot_config(tmp_path / "two.toml", tmp_path / "two.sqlite3", sim_a.base_url, sim_a.base_url,
                              _free_port())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN_A": bot.token, "SIM_TOKEN_B": "not-the-token"}
        r = subprocess.run([sys.executable, "-m", "replyd", "run", "--config", str(cfg)], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "bot b" in last and "refused the login (HTTP 401)" in last and "SIM_TOKEN_B" in last, last
    assert "not-the-token" not in r.stderr
