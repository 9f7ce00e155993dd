"""Reload on SIGHUP: a real `replyd run` against the sim adds a bot, refuses broken files, removes a bot."""

from __future__ import annotations

import json
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
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.test_daemon import _head, wait_until

ROOT = Path(__file__).resolve().parents[1]
INBOX_S = 1.0  # every bot's inbox interval: "within one interval" is measured against it


def _bot(name: str, url: str, listing_delay_s: float = 0.3) -> str:
    return f"""
[[bots]]
name = "{name}"
platform = "mastodon"

[bots.settings]
base_url = "{url}"
token_env = "SIM_TOKEN_{name.upper()}"
listing_delay_s = {listing_delay_s}
timeout_s = 5.0

[bots.pollers]
inbox_interval_s = {INBOX_S}
search_interval_s = 0
refind_interval_s = 0
jitter_s = 0

[bots.responder]
kind = "template"
"""


def _write(path: Path, db: Path, url: str, bots: list[str], changed: str = "") -> None:
    """The daemon's config with ``bots`` (``changed``: that bot's listing delay differs)."""
    # A send held 2 s on the platform stays well within its timeout.
    head = _head(db).replace("send_timeout_s = 1.0", "send_timeout_s = 8.0")
    path.write_text(f"""{head}{"".join(_bot(b, url, 0.4 if b == changed else 0.3) for b in bots)}""")
    os.chmod(path, 0o600)


def _events(log: Path, event: str) -> list[dict]:
    return [json.loads(ln) for ln in log.read_text().splitlines() if f'"{event}"' in ln]


class _Reads:
    """Samples one account's inbox reads on the sim every 50 ms: when each new read was first seen."""

    def __init__(self, world: World, account_id: str) -> None:
        self.world, self.account_id = world, account_id
        self.seen: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = -1
        while not self._stop.wait(0.05):
            n = self.world.reads(self.account_id).get("notifications", 0)
            if n != last:
                self.seen.append((time.monotonic(), n))
                last = n

    def max_gap_s(self, start: float, end: float) -> float:
        """The longest time without a new read between ``start`` and ``end``."""
        times = [start, *(t for t, _ in self.seen if start < t < end), end]
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


@pytest.mark.slow
def test_sighup_adds_refuses_and_removes_bots(tmp_path):
    """Add a bot, refuse three broken files, remove a bot with a send in flight: no gap, no duplicate."""
    world = World(SystemClock(), seed=11, listing_delay_s=0.2)
    alpha, beta = world.add_account("alpha", bot=True), world.add_account("beta", bot=True)
    world.add_account("carol")
    db, cfg, log = tmp_path / "r.sqlite3", tmp_path / "replyd.toml", tmp_path / "daemon.log"
    with SimServer(world) as srv:
        url = srv.base_url
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN_ALPHA": alpha.token, "SIM_TOKEN_BETA": beta.token}
        _write(cfg, db, url, ["alpha"])
        p = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                             stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=env, cwd=ROOT)
        reads = _Reads(world, alpha.id)
        try:
            def answered(bot, parents) -> bool:
                got = world.replies_by(bot.id)
                return all(got.get(x.id) for x in parents)

            first = world.post("carol", "hello?", mention=["alpha"])
            assert wait_until(lambda: answered(alpha, [first]), 30), log.read_text()[-3000:]
            waiting = [world.post("carol", f"beta {i}?", mention=["beta"]) for i in range(2)]
            time.sleep(INBOX_S)
            assert not world.replies_by(beta.id)  # not configured yet

            # Add beta: answered within one interval of the SIGHUP; alpha's polls go on without a gap.
            before = world.post("carol", "just before?", mention=["alpha"])
            _write(cfg, db, url, ["alpha", "beta"])
            hup = time.monotonic()
            p.send_signal(signal.SIGHUP)
            after = world.post("carol", "just after?", mention=["alpha"])
            assert wait_until(lambda: answered(beta, waiting), 15, every_s=0.05), log.read_text()[-3000:]
            took_s = time.monotonic() - hup
            assert took_s < INBOX_S + 2.0, took_s  # login, adoption and the first poll, at once
            assert wait_until(lambda: answered(alpha, [before, after]), 10), log.read_text()[-3000:]
            time.sleep(2 * INBOX_S)
            assert reads.max_gap_s(hup - 2 * INBOX_S, time.monotonic()) < 2 * INBOX_S, reads.seen[-12:]
            (done,) = _events(log, "replyd.daemon.reloaded")
            assert done["added"] == ["beta"] and done["removed"] == [] and done["changed"] == [], done

            # Broken files: one line each, nothing stopped, both bots keep answering.
            good = cfg.read_text()
            for broken, words in (("[[bots]\nname = ", "not valid TOML"),
                                  ("\n[daemon]\nbogus_knob = 1\n", "bogus_knob"),
                                  ("\n[daemon]\njob_threads = 3\n", "daemon.job_threads")):
                n = len(_events(log, "replyd.daemon.reload_refused"))
                cfg.write_text(good + broken)
                p.send_signal(signal.SIGHUP)
                assert wait_until(lambda: len(_events(log, "replyd.daemon.reload_refused")) == n + 1, 10)  # noqa: B023 - called at once
                refused = _events(log, "replyd.daemon.reload_refused")[-1]
                assert words in refused["error"], refused
            assert len(_events(log, "replyd.daemon.reloaded")) == 1 and "replyd.bot.stopping" not in log.read_text()
            cfg.write_text(good)
            both = [world.post("carol", "still there?", mention=[b]) for b in ("alpha", "beta")]
            assert wait_until(lambda: answered(alpha, both[:1]) and answered(beta, both[1:]), 10), \
                log.read_text()[-3000:]

            # Remove alpha while its send is held on the platform: the send lands, then alpha's requests stop.
            world.configure(create_hold_s=2.0)
            last = world.post("carol", "last one?", mention=["alpha"])
            assert wait_until(lambda: any(e.get("parent_id") == last.id for e in _events(log, "replyd.guard.claimed")),
                              10, every_s=0.05), log.read_text()[-3000:]
            _write(cfg, db, url, ["beta"])
            p.send_signal(signal.SIGHUP)
            assert wait_until(lambda: _events(log, "replyd.daemon.reloaded")[1:], 10)
            assert _events(log, "replyd.daemon.reloaded")[-1]["removed"] == ["alpha"]
            assert wait_until(lambda: answered(alpha, [last]), 10)  # the row in flight finished
            assert wait_until(lambda: _events(log, "replyd.bot.stopped"), 10)
            order = [e["event"] for e in map(json.loads, log.read_text().splitlines()[-200:])
                     if e["event"] in ("replyd.daemon.reloaded", "replyd.bot.stopped")
                     or e["event"] == "replyd.guard.posted" and e.get("parent_id") == last.id]
            # The send was still held when alpha was removed; alpha closed after it.
            assert order[-3:] == ["replyd.daemon.reloaded", "replyd.guard.posted", "replyd.bot.stopped"], order
            world.configure(create_hold_s=0.0)
            quiet = dict(world.requests)
            time.sleep(3 * INBOX_S)
            alpha_calls = {k: n for k, n in world.requests.items() if k[0] == alpha.id}
            assert alpha_calls == {k: n for k, n in quiet.items() if k[0] == alpha.id}  # no poll since
            late = world.post("carol", "anyone?", mention=["alpha", "beta"])
            assert wait_until(lambda: answered(beta, [late]), 10)
            time.sleep(INBOX_S)
            assert late.id not in world.replies_by(alpha.id)

            # Change beta: it restarts alone and answers on.
            _write(cfg, db, url, ["beta"], changed="beta")
            p.send_signal(signal.SIGHUP)
            assert wait_until(lambda: _events(log, "replyd.daemon.reloaded")[2:], 10)
            assert _events(log, "replyd.daemon.reloaded")[-1]["changed"] == ["beta"]
            again = world.post("carol", "and now?", mention=["beta"])
            assert wait_until(lambda: answered(beta, [again]), 10), log.read_text()[-3000:]
        finally:
            reads.stop()
            p.send_signal(signal.SIGTERM)
            try:
                assert p.wait(20) == 0
            finally:
                if p.poll() is None:
                    p.kill()
        report = world.report()
        assert report["duplicates"] == 0, report
        assert settled_rows(db), "rows left open"


def settled_rows(db: Path) -> bool:
    """No row open or composing."""
    s = Store.open(f"sqlite:///{db}")
    try:
        return not any(n for (_, state), n in s.counts().items() if state in (st.OPEN, st.COMPOSING))
    finally:
        s.dispose()
