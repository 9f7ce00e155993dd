"""Real processes: `replyd run` SIGKILLed again and again while its command responder composes.

The parents are search hits only (no mention: the inbox and re-find's notification pass never see them),
the responder is a real child process that takes 1.2 s, and each kill lands while a row is ``composing``;
the daemon restarts at once, inside the compose lease, so its search sees the row in flight and saves its
cursor past it. Only the row itself can bring the parent back. Replies are counted by the sim.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.sim import SimServer, World
from replyd.store import Store

ROOT = Path(__file__).resolve().parents[1]
BOT = "replybot"

RESPONDER = """
import json, sys, time
p = json.load(sys.stdin)
with open(sys.argv[1], "a") as f:
    f.write("start " + p["id"] + "\\n")
time.sleep(1.2)
print("thanks for asking")
"""


def _config(path: Path, base_url: str, db: Path, calls: Path, script: Path, refind_s: float) -> Path:
    """A daemon config: search only (plus re-find), a slow command responder, a short compose lease."""
    argv = ", ".join(f'"{a}"' for a in (sys.executable, str(script), str(calls)))
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 2.0
compose_lease_s = 6.0

[sweep]
interval_s = 0.5
retry_s = 0.5

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "SIM_TOKEN"
listing_delay_s = 0.5
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.4
search_interval_s = 0.3
search_queries = ["widgets"]
refind_interval_s = {refind_s}
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "command"
command = [{argv}]
timeout_s = 5
""")
    os.chmod(path, 0o600)
    return path


def _start(cfg: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "3"],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=env, cwd=ROOT)


def _wait(cond, timeout_s: float) -> bool:
    """Poll ``cond`` until true or timeout (waiting on real processes, not on replyd logic)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.slow
@pytest.mark.parametrize("refind_s", [0.7, 0.0], ids=["refind-on", "refind-off"])
def test_sigkill_during_composition_every_search_hit_answered_once(tmp_path: Path, refind_s: float) -> None:
    """Three SIGKILLs of `replyd run` while it composes search hits: every parent ends with exactly one reply.

    With re-find switched off its re-offer of waiting rows still runs (at the sweep's pace).
    """
    world = World(SystemClock(), seed=5, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    parents = [s.id for s in world.generate(4, target=BOT, mention_fraction=0.0, query_word="widgets")]
    db, calls, log = tmp_path / "r.sqlite3", tmp_path / "calls.txt", tmp_path / "daemon.log"
    script = tmp_path / "responder.py"
    script.write_text(RESPONDER)
    calls.touch()
    with SimServer(world) as srv:
        os.environ["SIM_TOKEN"] = bot.token
        try:
            cfg = _config(tmp_path / "c.toml", srv.base_url, db, calls, script, refind_s)
            kills = 0
            proc = _start(cfg, log)
            try:
                while kills < 3:
                    seen = calls.read_text().count("start ")
                    # Kill while the responder of a new parent is running (the row is composing).
                    if not _wait(lambda: calls.read_text().count("start ") > seen, 30):  # noqa: B023 - _wait calls it at once
                        break
                    time.sleep(0.3)
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                    kills += 1
                    proc = _start(cfg, log)  # restarted at once: well inside the 6 s compose lease
                done = _wait(lambda: all(world.replies_by(bot.id).get(p) for p in parents) and _settled(db), 60)
                assert done, (world.replies_by(bot.id), log.read_text()[-3000:])
                time.sleep(2.0)  # more rounds of every path and the sweep: nothing may answer again
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
        finally:
            os.environ.pop("SIM_TOKEN", None)
    assert kills == 3
    per = world.replies_by(bot.id)
    assert [per.get(p, 0) for p in parents] == [1] * len(parents)
    assert world.report()["duplicates"] == 0
    # Kills really cut compositions short: more responder starts than parents.
    assert calls.read_text().count("start ") > len(parents)


def _settled(db: Path) -> bool:
    """True when every row of the log is terminal (nothing composing, open or waiting)."""
    s = Store.open(f"sqlite:///{db}")
    try:
        counts = s.counts()
        return bool(counts) and all(state in st.TERMINAL for (_, state) in counts)
    finally:
        s.dispose()
