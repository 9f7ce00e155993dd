"""Liveness: a frozen platform turns /readyz, the status page, `replyd status` and /metrics stale, and back."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.liveness import Liveness, ago
from tests.api_harness import ROOT, replyd_cli, write_config
from tests.test_statuspage import ARTIFACTS, browse, chromium

STALE_S = 30.0  # health.stale_min_s: past the first freeze, before the end of the others


def test_liveness_words_and_bound_on_a_fake_clock():
    """A path is stale only past max(factor × interval, minimum) since its last success; failures are counted."""
    clock = FakeClock(1_000.0)
    live = Liveness(clock, stale_after_intervals=3, stale_min_s=10, failures_not_ready=8)  # not failing by count
    live.track("bot", "inbox", 30)
    live.track("bot", "sweep", 1)
    clock.advance(9)
    assert live.problems() == []
    live.ok("bot", "inbox")
    clock.advance(89)
    for _ in range(7):
        live.failed("bot", "inbox", "inbox: HTTP 503")
    snap = live.snapshot()["bot"]
    # Not 8 in a row, but overdue: 89 s without a success > interval + interval (no request timeout known).
    assert snap["paths"]["inbox"]["words"] == "inbox: last ok 89 s ago, 7 failures in a row: HTTP 503 — FAILING"
    assert snap["stale"] == ["sweep"]  # never ran: 98 s since start > max(3 × 1, 10)
    clock.advance(2)
    assert [p.split(": ")[:2] for p in live.problems()] == [["bot bot", "inbox"], ["bot bot", "sweep"]]
    assert "STALE (limit 90 s)" in live.snapshot()["bot"]["paths"]["inbox"]["words"]
    live.ok("bot", "inbox")
    assert live.snapshot()["bot"]["paths"]["inbox"]["failures"] == 0 and live.snapshot()["bot"]["stale"] == ["sweep"]
    assert (ago(59), ago(180), ago(7300), ago(200_000)) == ("59 s", "3 min", "2 h", "2 d")


def test_failing_stuck_start_and_breaker_on_a_fake_clock():
    """Not ready at once on N failures in a row, on a run in flight past interval + timeout, on a bot not started
    and on an open breaker, long before the path is stale; each cleared by its own recovery; generic words hide detail."""
    clock = FakeClock(1_000.0)
    live = Liveness(clock, stale_after_intervals=3, stale_min_s=600, failures_not_ready=2)
    live.expect("a")
    live.expect("b")
    live.started("a")
    live.track("a", "inbox", 5, timeout_s=2)
    live.ok("a", "inbox")
    live.failed("a", "inbox", "inbox: timed out")
    assert live.snapshot()["a"]["failing"] == [] and "bot a" not in " ".join(live.problems())  # one failure: ready
    live.failed("a", "inbox", "inbox: timed out")
    assert live.snapshot()["a"]["failing"] == ["inbox"]
    assert live.problems(detail=False) == ["bot a: inbox failing", "bot b: not started"]
    live.ok("a", "inbox")
    assert live.snapshot()["a"]["failing"] == []
    with live.running("a", "inbox"):  # a frozen platform: the run hangs instead of failing
        clock.advance(7)
        assert live.snapshot()["a"]["failing"] == []  # 7 s = interval + timeout: not yet
        clock.advance(0.5)
        p = live.snapshot()["a"]["paths"]["inbox"]
        assert p["failing"] and p["stuck"] and p["running_s"] == 7.5 and "in flight for 7 s" in p["words"], p
    assert live.snapshot()["a"]["failing"] == []  # the run ended: no longer in flight
    live.starting("b", "cannot log in at mastodon:http://10.0.0.9: connection refused", 4)
    clock.advance(1)
    assert live.retry_in_s("b") == 3 and live.not_running() == {"b"}
    detail = live.problems()
    assert detail == ["bot b: starting (1 attempt failed, next in 3 s): cannot log in at mastodon:http://10.0.0.9: "
                      "connection refused"], detail
    assert "10.0.0.9" not in " ".join(live.problems(detail=False))
    live.started("b")
    live.set_breaker("a", True, "9 of the last 10 sends failed: HTTP 500")
    assert live.problems() == ["bot a: write breaker open: 9 of the last 10 sends failed: HTTP 500"]
    assert live.problems(detail=False) == ["bot a: write breaker open"]
    live.beat("a").breaker(False)
    assert live.problems() == [] and live.not_running() == set()
    live.start_failed("b", "bot b: refused the login (HTTP 401): check SIM_TOKEN")
    assert live.problems() == ["bot b: failed to start: bot b: refused the login (HTTP 401): check SIM_TOKEN"]
    assert live.retry_in_s("b") is None


def test_overdue_counts_from_the_last_success_on_a_fake_clock():
    """A frozen platform's runs each end at the request timeout (one failure, never N) and the next starts an
    interval later: the path is failing once interval + jitter + timeout passed since its last success while a run
    hangs or the last one failed, not an interval + timeout after the run that met the freeze; a run merely late
    to start is not."""
    clock = FakeClock(1_000.0)
    live = Liveness(clock, stale_after_intervals=3, stale_min_s=600, failures_not_ready=5)
    live.track("a", "refind", 1, timeout_s=1.5, jitter_s=0.1)
    live.ok("a", "refind")
    clock.advance(3)  # a busy scheduler: no run started, none failed
    assert live.snapshot()["a"]["failing"] == []
    live.ok("a", "refind")
    clock.advance(1)
    with live.running("a", "refind"):  # the freeze: the run hangs for its timeout
        clock.advance(1.5)
        assert live.snapshot()["a"]["failing"] == []  # 2.5 s since the last success: not yet 2.6
    live.failed("a", "refind", "refind: timed out")
    clock.advance(0.2)
    p = live.snapshot()["a"]["paths"]["refind"]
    assert p["failing"] and p["overdue"] and not p["stuck"] and p["failures"] == 1, p
    with live.running("a", "refind"):
        assert "a run in flight (due every 1 s)" in live.snapshot()["a"]["paths"]["refind"]["words"]
    live.ok("a", "refind")
    assert live.snapshot()["a"]["failing"] == []


STALE_RGB = (0xB3, 0x26, 0x1E)  # statuspage.py's red for a stale path and a bad card


def red_pixels(png: bytes) -> int:
    """Count pixels of the status page's red in a PNG screenshot (8-bit RGB/RGBA, not interlaced; stdlib only)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        body = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, _h, depth, ctype, _c, _f, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, prev, count = zlib.decompress(idat), width * bpp, bytearray(width * bpp), 0
    for y in range(len(raw) // (stride + 1)):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a, b, c = line[i - bpp] if i >= bpp else 0, prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        count += sum(1 for x in range(0, stride, bpp)
                     if all(abs(line[x + k] - STALE_RGB[k]) <= 24 for k in range(3)))
        prev = line
    return count


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


FREEZES_S = (20.0, 45.0, 80.0)  # SIGSTOP lengths: shorter than, about and past the staleness bound
INBOX_S, REFIND_S, TIMEOUT_S = 3.0, 1.0, 1.5  # refind's runs outlast their interval while frozen: skips
# The readiness bound: not ready within one inbox interval of the freeze (the refind path, due every second, is
# overdue 1 s + jitter + min(timeout, interval) after its last success, which came before the freeze).
DOWN_BOUND_S = INBOX_S
UP_BOUND_S = INBOX_S + 1.0  # the next run after SIGCONT succeeds (a hung one answers at once)


@pytest.mark.slow
def test_frozen_sim_turns_readiness_status_page_and_cli_failing_then_stale(tmp_path, monkeypatch, caplog):
    """SIGSTOP on the sim for 20, 45 and 80 s: /readyz not ready within one inbox interval
    and throughout the freeze, long before the staleness bound; the page and `status --json` show the failing path,
    then the stale one (red, in a Chromium screenshot); each skipped run is one `replyd.poll.skipped` event, not
    APScheduler's warning; ready within one inbox interval after SIGCONT."""
    from structlog.testing import capture_logs

    chromium()
    sim, sim_url = _start_sim()
    monkeypatch.setenv("SIM_TOKEN", "sim-token-live")
    cfg = write_config(tmp_path / "live.toml", sim_url, tmp_path / "live.sqlite3", token_env=None, pollers=True,
                       port=_free_port(), sweep_s=0.3,
                       extra=f"[health]\nstale_after_intervals = 3\nstale_min_s = {STALE_S}\nfailures_not_ready = 2\n")
    text = cfg.read_text().replace("timeout_s = 3.0", f"timeout_s = {TIMEOUT_S}")
    text = re.sub(r"inbox_interval_s = [0-9.]+", f"inbox_interval_s = {INBOX_S}", text)
    cfg.write_text(re.sub(r"refind_interval_s = [0-9.]+", f"refind_interval_s = {REFIND_S}", text))
    d = Daemon(Config.load(cfg))
    figures: list[tuple[float, float, float]] = []
    try:
        with capture_logs() as events:
            d.start()
            api = d.api.url  # type: ignore[union-attr]
            for freeze_s in FREEZES_S:
                assert _wait(lambda: _ready(api)[0], 20) is not None, _ready(api)[1]
                time.sleep(2 * INBOX_S)  # settled: every path ran fine since the last freeze
                assert _ready(api)[0], _ready(api)[1]
                sim.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                try:
                    took = _wait(lambda: not _ready(api)[0], DOWN_BOUND_S + 10)
                    assert took is not None, f"never turned not ready during a {freeze_s:.0f} s freeze"
                    assert took <= DOWN_BOUND_S, (freeze_s, took)
                    body = _ready(api)[1]
                    assert any(re.match(r"bot sim: (inbox|refind): .*(FAILING|in flight)", r) for r in body["reasons"]), body
                    if freeze_s == FREEZES_S[0]:
                        _failing_everywhere(api, cfg, tmp_path)
                    shown = False
                    while time.monotonic() - t0 < freeze_s:
                        ok, body = _ready(api)
                        assert not ok, (f"ready again {time.monotonic() - t0:.1f} s into a {freeze_s:.0f} s freeze", body)
                        if freeze_s == FREEZES_S[-1] and not shown and time.monotonic() - t0 > STALE_S + 2 * INBOX_S:
                            stale_red = _stale_everywhere(api, cfg, tmp_path)
                            shown = True
                        time.sleep(0.5)
                    assert shown or freeze_s != FREEZES_S[-1]
                finally:
                    sim.send_signal(signal.SIGCONT)
                t1 = time.monotonic()
                up = _wait(lambda: _ready(api)[0], UP_BOUND_S + 10)
                assert up is not None and up <= UP_BOUND_S, (freeze_s, up, _ready(api)[1])
                figures.append((freeze_s, took, up))
                print(f"freeze {freeze_s:.0f} s: not ready after {took:.1f} s, ready {up:.1f} s after SIGCONT "
                      f"({t1 - t0:.1f} s frozen)")
        fresh = ARTIFACTS / "statuspage-fresh.png"
        fresh.unlink(missing_ok=True)
        assert browse(api + "/", tmp_path, f"--screenshot={fresh}").returncode == 0
        assert red_pixels(fresh.read_bytes()) < stale_red / 10  # nothing red once every path is fresh again
        cli = replyd_cli("status", "--json", "--config", str(cfg), env={"SIM_TOKEN": ""})
        live = json.loads(cli.stdout)["daemon"]["liveness"]["sim"]
        assert live["stale"] == [] and live["failing"] == [], live
        metrics = httpx.get(api + "/metrics", timeout=5).text
        assert re.search(r'replyd_polls_total\{path="inbox",platform="sim",result="ok"\} [1-9]', metrics)
        assert re.search(r'replyd_polls_total\{path="inbox",platform="sim",result="error"\} [1-9]', metrics)
        assert re.search(r'replyd_poll_skipped_total\{path="refind",platform="sim"\} [1-9]', metrics), metrics[-3000:]
        assert 'replyd_build_info{' in metrics and "process_cpu_seconds_total" in metrics and "python_info{" in metrics
        assert "http://" not in "".join(ln for ln in metrics.splitlines() if not ln.startswith("#"))
        skipped = [e for e in events if e["event"] == "replyd.poll.skipped"]
        assert skipped and {(e["bot"], e["path"]) for e in skipped} <= {("sim", "refind"), ("sim", "inbox"),
                                                                        ("sim", "sweep")}, skipped[:3]
        assert all(e["platform"] == f"mastodon:{sim_url}" for e in skipped), skipped[:3]
        assert not [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]
    finally:
        d.stop(grace_s=5)
        sim.terminate()
        sim.wait(10)
    assert [f for f, _, _ in figures] == list(FREEZES_S)


def _failing_everywhere(api: str, cfg, tmp_path) -> None:
    """Not stale yet, but failing: `status --json`, the page (DOM) and /metrics all say so."""
    cli = replyd_cli("status", "--json", "--config", str(cfg), env={"SIM_TOKEN": ""})
    assert cli.returncode == 0, cli.stderr
    live = json.loads(cli.stdout)["daemon"]["liveness"]["sim"]
    assert live["failing"] and live["stale"] == [], live
    dom = browse(api + "/", tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    # Failing; on a loaded machine Chromium may render the page after the path also went stale (the next check).
    assert re.search(r'class="path stale" id="path-sim-(inbox|refind)" data-stale="(false|true)" data-failing="true">',
                     dom.stdout)
    assert re.search(r'id="card-liveness">paths<b>(FAILING|STALE)</b>', dom.stdout)
    metrics = httpx.get(api + "/metrics", timeout=5).text
    assert re.search(r'replyd_poll_failing\{path="(inbox|refind)",platform="sim"\} 1\.0', metrics), metrics[-3000:]
    assert 'replyd_bot_up{platform="sim"} 1.0' in metrics  # the bot runs: its platform is what fails


def _stale_everywhere(api: str, cfg, tmp_path) -> int:
    """Past the staleness bound: /readyz, `status --json`, the page (DOM, screenshot) and /metrics say STALE."""
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
    assert re.search(r'class="path stale" id="path-sim-inbox" data-stale="true"[^>]*>inbox: [^<]*STALE', dom.stdout)
    assert 'id="card-liveness">paths<b>STALE</b>' in dom.stdout
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "statuspage-stale.png"
    shot.unlink(missing_ok=True)
    r = browse(api + "/", tmp_path, f"--screenshot={shot}")
    assert r.returncode == 0, r.stderr[-2000:]
    stale_red = red_pixels(shot.read_bytes())
    assert stale_red > 200, stale_red  # the STALE card and the stale path's line, rendered red
    metrics = httpx.get(api + "/metrics", timeout=5).text
    assert re.search(r'replyd_poll_stale\{path="inbox",platform="sim"\} 1\.0', metrics), metrics[-3000:]
    return stale_red


def test_opened_readyz_hides_detail_without_the_token_and_hooks_wait_for_a_bot_not_started(tmp_path, monkeypatch):
    """With readyz opened, a caller without the token sees ready/not ready and generic reasons only (no database
    address, no platform URL, no error text), one with it the detail; a webhook for a push bot whose platform was
    not reached yet is 503 with Retry-After when signed (the platform redelivers), else the unknown bot's 401."""
    from replyd.errors import StoreError
    from replyd.hooks import sign
    from tests.api_harness import TOKEN, TOKEN_ENV

    port = _free_port()  # nothing listens: the bot's login is refused at the TCP level, so it keeps retrying
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv("SIM_TOKEN", "sim-token-x")
    monkeypatch.setenv("HOOK_SECRET", "hook-secret-0123456789")
    cfg = write_config(tmp_path / "c.toml", f"http://127.0.0.1:{port}", tmp_path / "r.sqlite3",
                       api_extra='open_routes = ["readyz"]', extra="[health]\nstart_retry_s = 20\n")
    cfg.write_text(cfg.read_text() + '\n[bots.push]\nkind = "github"\nsecret_env = "HOOK_SECRET"\n')
    d = Daemon(Config.load(cfg))
    d.start()  # does not raise: the bot's platform is unreachable, not refusing it
    try:
        url = d.api.url  # type: ignore[union-attr]
        secret_db = "postgresql://replyd@10.9.8.7:5432/replyd"

        def ping() -> None:
            """The store's probe failing the way a real outage reads: with the database's address."""
            raise StoreError(f"cannot reach {secret_db}: connection refused")

        monkeypatch.setattr(d.store, "ping", ping)
        anon = httpx.get(url + "/readyz", timeout=5)
        assert anon.status_code == 503
        body = anon.json()
        assert body["reasons"] == ["store: unavailable", "bot sim: not started"], body
        assert body["store"] == {"up": False, "error": "unavailable"} and body["bots"] == {"sim": False}
        assert "10.9.8.7" not in anon.text and str(port) not in anon.text and "refused" not in anon.text.lower()
        authed = httpx.get(url + "/readyz", timeout=5, headers={"Authorization": f"Bearer {TOKEN}"})
        assert authed.status_code == 503
        detail = " ".join(authed.json()["reasons"])
        assert secret_db in authed.json()["store"]["error"] and f"127.0.0.1:{port}" in detail, authed.json()
        assert "bot sim: starting (1 attempt failed, next in " in detail and "refused" in detail.lower(), detail
        wrong = httpx.get(url + "/readyz", timeout=5, headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 503 and "10.9.8.7" not in wrong.text  # a wrong token is no token

        # An unsigned delivery gets what an unknown bot gets: nothing before authentication says which bots exist.
        unsigned = httpx.post(url + "/v1/hooks/sim", content=b"{}", timeout=5, headers={"X-GitHub-Event": "issues"})
        unknown = httpx.post(url + "/v1/hooks/nobody", content=b"{}", timeout=5)
        assert (unsigned.status_code, unsigned.json()) == (401, unknown.json()) and unknown.status_code == 401
        hook = httpx.post(url + "/v1/hooks/sim", content=b"{}", timeout=5, headers={
            "X-GitHub-Event": "issues", "X-Hub-Signature-256": sign("hook-secret-0123456789", b"{}")})
        assert hook.status_code == 503 and hook.json()["error"] == "bot_starting", hook.text
        assert "sim" not in hook.text and 1 <= int(hook.headers["Retry-After"]) <= 21, hook.headers
    finally:
        d.stop(grace_s=2)
