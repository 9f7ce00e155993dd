"""`replyd run` (a real process) against platforms whose clocks run 5 minutes behind or ahead of replyd's.

A Mastodon-shaped server (the sim) and a GitHub-shaped one (``tests.fakes_forum.FakeGitHub``) serve their
``created_at``, ``Date`` and (GitHub) ``since`` filter on their own clock, 300 s off the machine's; parents
arrive in bursts of 80, so more than a page (40) of own replies lands between a send and its sweep; 30 % of
create responses are lost and no idempotency key helps. Duplicates are counted on the server. On SQLite and
PostgreSQL: none, and the daemon shows the skew it measured (``/metrics``, ``replyd status``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from replyd import store as st
from replyd.clock import OffsetClock, SystemClock
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.fakes_forum import FakeGitHub, FakeHost
from tests.test_daemon import wait_until

ROOT = Path(__file__).resolve().parents[1]
# Parents per burst: the sweep of a lost create comes after the whole burst is answered (the Mastodon bot's
# listing delay is longer than a burst takes), so the first 40 of each burst sit on page 2 or later by then.
BURSTS, BURST = 2, 80
SKEWS_S = (-300.0, 300.0)
LOST = 0.3


def free_port() -> int:
    """An ephemeral port nothing listens on (for the daemon's API)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(path: Path, store_url: str, port: int, bot: str) -> Path:
    """A daemon config: fast sweeps and retries, the API on ``port`` for /metrics and status; ``bot`` is the
    ``[[bots]]`` table."""
    path.write_text(f"""
[store]
url = "{store_url}"

[log]
format = "json"

[api]
enabled = true
port = {port}

[guard]
send_timeout_s = 1.0

[sweep]
interval_s = 0.25
retry_s = 0.5
listing_delay_auto = false

{bot}
""")
    os.chmod(path, 0o600)
    return path


def open_rows(store_url: str) -> int:
    """Rows not settled yet (open, not_landed, composing, released)."""
    s = Store.open(store_url)
    try:
        c = Counter({state: n for (_, state), n in s.counts().items()})
    finally:
        s.dispose()
    return c[st.OPEN] + c[st.NOT_LANDED] + c[st.COMPOSING] + c[st.RELEASED]


def detected(store_url: str) -> int:
    """Duplicates replyd recorded (the ``newer`` ids of its duplicate_detected events)."""
    s = Store.open(store_url)
    try:
        rows = s.events_with_path(kind="duplicate_detected", limit=1_000_000)
        return sum(len(json.loads(e["detail"])["newer"]) for e in rows)
    finally:
        s.dispose()


def measured(port: int) -> float:
    """The offset the daemon exports as ``replyd_platform_clock_offset_seconds``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    [value] = re.findall(r"^replyd_platform_clock_offset_seconds\{[^}]*\} (\S+)$", text, re.M)
    return float(value)


def status_json(cfg: Path, env: dict[str, str]) -> dict:
    """``replyd status --json`` as an operator runs it."""
    out = subprocess.run([sys.executable, "-m", "replyd", "status", "--config", str(cfg), "--json"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def daemon(cfg: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `replyd run`."""
    return subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=env, cwd=ROOT)


def wait_ready(log: Path) -> None:
    """Until the daemon's bot is ready and its first inbox poll (the newest page only) has set a cursor."""
    assert wait_until(lambda: log.exists() and "replyd.bot.ready" in log.read_text(), 60, 0.2), log.read_text()[-2000:]
    time.sleep(1.5)  # a few inbox polls: the next ones page forward from the cursor, so a burst is read whole


def stop(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM and a clean exit."""
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0


def skew_warned(log: Path) -> list[dict]:
    """The daemon's replyd.platform.clock_skew events."""
    out = []
    for line in log.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "replyd.platform.clock_skew":
            out.append(ev)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("skew_s", SKEWS_S)
def test_mastodon_clock_off_by_5_minutes_no_duplicate(skew_s: float, store_url: str, tmp_path: Path) -> None:
    """The sim's clock 5 min off, bursts of 80, 30 % lost creates, no Idempotency-Key: 0 duplicates on the sim."""
    world = World(OffsetClock(SystemClock(), skew_s), seed=11, listing_delay_s=0.5, idempotency=False,
                  lost_drop_rate=0.2, lost_504_rate=0.1)
    bot = world.add_account("skewbot", bot=True)
    port = free_port()
    log = tmp_path / "daemon.log"
    with SimServer(world) as srv:
        cfg = config(tmp_path / "c.toml", store_url, port, f"""
[[bots]]
name = "skew"
platform = "mastodon"

[bots.settings]
base_url = "{srv.base_url}"
token_env = "SKEW_SIM_TOKEN"
listing_delay_s = 3.0
idempotency = false
timeout_s = 1.0

[bots.pollers]
inbox_interval_s = 0.3
search_interval_s = 0
refind_interval_s = 2
refind_lookback_s = 3600
jitter_s = 0
""")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SKEW_SIM_TOKEN": bot.token}
        p = daemon(cfg, env, log)
        try:
            wait_ready(log)
            parents: list[str] = []
            for _ in range(BURSTS):
                parents += [s.id for s in world.generate(BURST, target="skewbot", users=10)]
                assert wait_until(lambda: all(world.replies_by(bot.id).get(q) for q in parents), 150, 0.5), \
                    log.read_text()[-3000:]  # noqa: B023 - called at once
            assert wait_until(lambda: open_rows(store_url) == 0, 90, 0.5), log.read_text()[-3000:]
            time.sleep(3.0)  # a late retry would land by now (listing delay, send timeout, retry_s)
            offset = measured(port)
            shown = status_json(cfg, env)["daemon"]["liveness"]["skew"]["platform_clock"]
            text = subprocess.run([sys.executable, "-m", "replyd", "status", "--config", str(cfg)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=60).stdout
        finally:
            stop(p)
    [said] = re.findall(r"skew platform clock: ([+-][0-9.]+) s from replyd's", text) or [text]
    assert float(said) == pytest.approx(skew_s, abs=1.0)  # the words an operator reads
    per = world.replies_by(bot.id)
    made = world.duplicates(bot.id)
    lost = sum(world.report()["faults_injected"].values())
    print(f"mastodon skew {skew_s:+.0f} s ({store_url.split(':')[0]}): {len(parents)} parents, "
          f"{lost} create responses lost, duplicates on the sim {made}, detected {detected(store_url)}, "
          f"measured offset {offset:+.2f} s, status {shown}")
    assert lost > 0.15 * len(parents)  # responses really were lost
    assert made == 0, {q: n for q, n in per.items() if n > 1}
    assert all(per.get(q) == 1 for q in parents)
    assert offset == pytest.approx(skew_s, abs=1.0)
    assert shown["offset_s"] == pytest.approx(skew_s, abs=1.0) and shown["source"] == "created"
    warned = skew_warned(log)
    assert warned and abs(warned[0]["offset_s"] - skew_s) < 2.0, warned


@pytest.fixture(scope="module")
def gh_host():
    """One fake-GitHub server for the module (it serves its own Date)."""
    with FakeHost() as h:
        yield h


@pytest.mark.slow
@pytest.mark.parametrize("skew_s", SKEWS_S)
def test_github_clock_off_by_5_minutes_no_duplicate(skew_s: float, store_url: str, tmp_path: Path,
                                                    gh_host: FakeHost) -> None:
    """GitHub's clock (created_at, Date, the since filter) 5 min off, bursts of 80 issues, 30 % lost creates
    (GitHub has no idempotency key): 0 duplicate comments on the fake."""
    gh = FakeGitHub(OffsetClock(SystemClock(), skew_s))  # type: ignore[arg-type]
    gh.add_repo("acme/widgets")
    gh.listing_delay_s = 0.5
    gh.lost_rate = LOST
    gh_host.fake = gh
    people = [gh.add_user(f"user{i}") for i in range(10)]
    port = free_port()
    log = tmp_path / "daemon.log"
    cfg = config(tmp_path / "c.toml", store_url, port, f"""
[[bots]]
name = "skew"
platform = "github"

[bots.settings]
api_url = "{gh_host.url}"
token_env = "SKEW_GH_TOKEN"
notifications = false
repos = ["acme/widgets"]
listing_delay_s = 1.0
timeout_s = 2.0
writes_per_minute = 100000
writes_per_hour = 1000000

[bots.pollers]
inbox_interval_s = 0.3
search_interval_s = 0
refind_interval_s = 2
refind_lookback_s = 3600
jitter_s = 0
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SKEW_GH_TOKEN": FakeGitHub.TOKEN}
    p = daemon(cfg, env, log)
    issues = []
    try:
        wait_ready(log)
        for b in range(BURSTS):
            issues += [gh.open_issue(people[i % 10], "acme/widgets", f"burst {b} issue {i}", "it broke")
                       for i in range(BURST)]
            assert wait_until(lambda: all(gh.replies(i) for i in issues), 120, 0.5), log.read_text()[-3000:]  # noqa: B023 - called at once
        assert wait_until(lambda: open_rows(store_url) == 0, 120, 0.5), log.read_text()[-3000:]
        time.sleep(3.0)  # a late retry would land by now
        offset = measured(port)
        shown = status_json(cfg, env)["daemon"]["liveness"]["skew"]["platform_clock"]
    finally:
        stop(p)
        gh_host.fake = None
    counts = [len(gh.replies(i)) for i in issues]
    made = sum(n - 1 for n in counts if n > 1)
    print(f"github skew {skew_s:+.0f} s ({store_url.split(':')[0]}): {len(issues)} issues, {gh.create_requests} "
          f"creates, {gh.lost_responses} responses lost, duplicates on the fake {made}, detected {detected(store_url)}, measured offset {offset:+.2f} s, "
          f"status {shown}")
    assert gh.lost_responses > 0.15 * len(issues)  # responses really were lost
    assert made == 0, [(i.number, n) for i, n in zip(issues, counts, strict=True) if n > 1]
    assert counts == [1] * len(issues)
    assert offset == pytest.approx(skew_s, abs=1.5)
    assert shown["offset_s"] == pytest.approx(skew_s, abs=1.5) and shown["source"] == "created"
    warned = skew_warned(log)
    assert warned and abs(warned[0]["offset_s"] - skew_s) < 2.0, warned
