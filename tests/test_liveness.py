"""Liveness: a frozen platform turns /readyz, the status page, `replyd status` and /metrics stale, and back."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.liveness import Liveness, ago
from tests.api_harness import ROOT, replyd_cli, write_config
from tests.test_statuspage import ARTIFACTS, browse, chromium

STALE_S = 2.0  # health.stale_min_s, above 3 × every interval below: the bound the test holds the daemon to


def test_liveness_words_and_bound_on_a_fake_clock():
    """A path is stale only past max(factor × interval, minimum) since its last success; failures are counted."""
    clock = FakeClock(1_000.0)
    live = Liveness(clock, stale_after_intervals=3, stale_min_s=10)
    live.track("bot", "inbox", 30)
    live.track("bot", "sweep", 1)
    clock.advance(9)
    assert live.problems() == []
    live.ok("bot", "inbox")
    clock.advance(89)
    for _ in range(7):
        live.failed("bot", "inbox", "inbox: HTTP 503")
    snap = live.snapshot()["bot"]
    assert snap["paths"]["inbox"]["words"] == "inbox: last ok 89 s ago, 7 failures in a row: inbox: HTTP 503"
    assert snap["stale"] == ["sweep"]  # never ran: 98 s since start > max(3 × 1, 10)
    clock.advance(2)
    assert [p.split(": ")[:2] for p in live.problems()] == [["bot bot", "inbox"], ["bot bot", "sweep"]]
    assert "STALE (limit 90 s)" in live.snapshot()["bot"]["paths"]["inbox"]["words"]
    live.ok("bot", "inbox")
    assert live.snapshot()["bot"]["paths"]["inbox"]["failures"] == 0 and live.snapshot()["bot"]["stale"] == ["sweep"]
    assert (ago(59), ago(180), ago(7300), ago(200_000)) == ("59 s", "3 min", "2 h", "2 d")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_sim() -> tuple[subprocess.Popen, str]:
    """The sim in its own process (so SIGSTOP freezes it and not the daemon); return it and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "replyd.sim", "--port", "0", "--listing-delay-s", "0.1",
                             "--account", "replybot:sim-token-live:bot"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    assert line.startswith("SIM_URL="), line
    return proc, line.split("=", 1)[1]


def _ready(url: str) -> tuple[bool, dict]:
    r = httpx.get(url + "/readyz", timeout=5)
    return r.status_code == 200, r.json()


def _wait(cond, timeout_s: float) -> float | None:
    """Poll ``cond`` (a real daemon against a real process) until true; return the seconds it took, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


@pytest.mark.slow
def test_frozen_sim_turns_readiness_status_page_and_cli_stale(tmp_path, monkeypatch):
    """SIGSTOP on the sim: /readyz not ready within the staleness bound, the page and `status --json` show the
    stale path (red, in a Chromium screenshot); after SIGCONT everything is ready and fresh again."""
    chromium()
    sim, sim_url = _start_sim()
    monkeypatch.setenv("SIM_TOKEN", "sim-token-live")
    cfg = write_config(tmp_path / "live.toml", sim_url, tmp_path / "live.sqlite3", token_env=None, pollers=True,
                       port=_free_port(), sweep_s=0.3,
                       extra=f"[health]\nstale_after_intervals = 3\nstale_min_s = {STALE_S}\n")
    d = Daemon(Config.load(cfg))
    try:
        d.start()
        api = d.api.url  # type: ignore[union-attr]
        assert _wait(lambda: _ready(api)[0], 15) is not None, _ready(api)[1]
        sim.send_signal(signal.SIGSTOP)
        try:
            took = _wait(lambda: not _ready(api)[0], STALE_S + 10)
            assert took is not None, "never turned not ready while the platform was frozen"
            # The bound: no success for STALE_S (+ one poll interval and the probe's own cadence).
            assert took <= STALE_S + 2.0, took
            body = _ready(api)[1]
            assert any(re.match(r"bot sim: (inbox|refind): .*STALE", r) for r in body["reasons"]), body
            assert httpx.get(api + "/healthz", timeout=5).status_code == 200  # liveness of the process is not readiness

            cli = replyd_cli("status", "--json", "--config", str(cfg), env={"SIM_TOKEN": ""})
            assert cli.returncode == 0, cli.stderr
            doc = json.loads(cli.stdout)
            live = doc["daemon"]["liveness"]["sim"]
            assert doc["daemon"]["reachable"] and "inbox" in live["stale"], doc
            assert live["paths"]["inbox"]["stale"] and "STALE" in live["paths"]["inbox"]["words"]

            dom = browse(api + "/", tmp_path, "--dump-dom")
            assert dom.returncode == 0, dom.stderr[-2000:]
            assert re.search(r'class="path stale" id="path-sim-inbox" data-stale="true">inbox: [^<]*STALE', dom.stdout)
            assert 'id="card-liveness">paths<b>STALE</b>' in dom.stdout
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "statuspage-stale.png"
            shot.unlink(missing_ok=True)
            r = browse(api + "/", tmp_path, f"--screenshot={shot}")
            assert r.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]
            metrics = httpx.get(api + "/metrics", timeout=5).text
            assert re.search(r'replyd_poll_stale\{path="inbox",platform="sim"\} 1\.0', metrics), metrics[-3000:]
        finally:
            sim.send_signal(signal.SIGCONT)
        assert _wait(lambda: _ready(api)[0], 15) is not None, _ready(api)[1]
        cli = replyd_cli("status", "--json", "--config", str(cfg), env={"SIM_TOKEN": ""})
        assert json.loads(cli.stdout)["daemon"]["liveness"]["sim"]["stale"] == []
        metrics = httpx.get(api + "/metrics", timeout=5).text
        assert re.search(r'replyd_polls_total\{path="inbox",platform="sim",result="ok"\} [1-9]', metrics)
        assert re.search(r'replyd_polls_total\{path="inbox",platform="sim",result="error"\} [1-9]', metrics)
        assert 'replyd_build_info{' in metrics and "process_cpu_seconds_total" in metrics and "python_info{" in metrics
        assert "http://" not in "".join(ln for ln in metrics.splitlines() if not ln.startswith("#"))
    finally:
        d.stop(grace_s=5)
        sim.terminate()
        sim.wait(10)
