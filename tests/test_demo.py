"""`replyd demo --json`: the README's first command, its figures counted by the sim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_json_replyd_zero_duplicates_where_delay_is_right(tmp_path):
    """replyd makes 0 duplicates and loses 0 answers where the delay is right; the naive bot really duplicates."""
    r = subprocess.run([sys.executable, "-m", "replyd", "demo", "--json", "--quick"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path)}, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {s["name"]: s for s in json.loads(r.stdout)["scenarios"]}
    assert len(rows) == 9
    for s in rows.values():
        assert set(s) >= {"name", "listing_delay_ok", "naive", "replyd"}
        assert set(s["replyd"]) >= {"duplicates", "lost", "retries"}
        if s["listing_delay_ok"]:
            assert s["replyd"]["duplicates"] == 0 and s["replyd"]["lost"] == 0, s
    assert rows["three paths find the same parents"]["naive"]["duplicates"] == 2 * rows["three paths find the same parents"]["parents"]
    assert rows["three paths find the same parents"]["replyd"]["responder_calls"] == rows["three paths find the same parents"]["parents"]
    assert rows["crash after send, before close"]["naive"]["duplicates"] > 0
    assert rows["crash before send"]["replyd"]["retries"] > 0
    limit = rows["listing delay > configured, no Idempotency-Key"]
    assert not limit["listing_delay_ok"] and limit["replyd"]["duplicates"] > 0  # the measured limit, shown honestly
    assert rows["listing delay > configured, Idempotency-Key"]["replyd"]["duplicates"] == 0
    assert not limit["learned_delay"] and limit["replyd"]["delay_in_use_s"] == limit["replyd"]["configured_delay_s"]
    # The same limit with the learned delay on (half the responses arrive): the lag is learned, no duplicate.
    learned = rows["listing delay > configured, no key, learned"]
    assert learned["learned_delay"] and not learned["listing_delay_ok"]
    assert learned["replyd"]["delay_in_use_s"] >= 3.0 > learned["replyd"]["configured_delay_s"]
    assert learned["replyd"]["duplicates"] == 0 and learned["replyd"]["lost"] == 0
    push = {r["name"]: r for r in json.loads(r.stdout)["push"]}
    assert [push[name]["duplicates"] + push[name]["lost"] for name in push if name.startswith("replyd")] == [0, 0]
    assert push["naive: answers each delivery"]["duplicates"] > 0


def test_piped_demo_prints_a_line_per_scenario_as_it_finishes(monkeypatch, capsys):
    """Off a terminal the demo prints each scenario's line when that scenario finishes, before the next starts."""
    from replyd import demo

    seen_before_next: list[bool] = []

    def fake_run_all(n, progress=None, done=None):
        """Finish each scenario in turn, checking the previous one's line is already out."""
        rows = []
        for i, sc in enumerate(demo.SCENARIOS):
            if i:
                seen_before_next.append(demo.SCENARIOS[i - 1].name in capsys.readouterr().out)
            rows.append({"name": sc.name, "listing_delay_ok": sc.listing_delay_ok, "parents": n,
                         "naive": {"duplicates": i, "lost": 0, "replies": n},
                         "replyd": {"duplicates": 0, "lost": 0, "retries": 0, "replies": n, "responder_calls": n,
                                    "seconds": 0.1}})
            if done:
                done(rows[-1])
        return rows

    monkeypatch.setattr(demo, "run_all", fake_run_all)
    monkeypatch.setattr(demo.demo_push, "run_push", lambda n, done=None: [])  # its own test below
    # main() configures logging for the whole process (errors only): keep later tests' log capture intact.
    monkeypatch.setattr(demo.rlog, "configure", lambda *a, **k: None)
    assert demo.main(quick=True) == 0
    assert seen_before_next == [True] * (len(demo.SCENARIOS) - 1)
    tail = capsys.readouterr().out
    assert f"[{len(demo.SCENARIOS)}/{len(demo.SCENARIOS)}] {demo.SCENARIOS[-1].name}: naive dup" in tail


def _documented_commands() -> tuple[str, str, str]:
    """The sim command, the replyd command and the seeding curl from config/demo.toml's header, as written."""
    lines, cmds = [], []
    for line in (ROOT / "config" / "demo.toml").read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   "):
            lines.append(line[4:].strip())
    joined = " ".join(lines).replace("\\ ", "")
    for start in ("python -m replyd.sim", "SIM_TOKEN=", "curl "):
        i = joined.index(start)
        ends = [joined.find(nxt, i + 1) for nxt in ("python -m replyd.sim", "SIM_TOKEN=", "curl ") if joined.find(nxt, i + 1) > i]
        cmds.append(joined[i: min(ends) if ends else None].strip().rstrip("&").strip())
    return cmds[0], cmds[1], cmds[2]


@pytest.mark.slow
def test_demo_toml_documented_commands_work(tmp_path):
    """config/demo.toml's own commands (sim, daemon, seeding) work as written: the daemon logs in, serves a ready
    API with the documented token variable, and answers the seeded question once (ports moved to free ones)."""
    import shlex
    import signal
    import socket
    import time

    import httpx

    sim_cmd, run_cmd, curl_cmd = _documented_commands()
    free = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free.append(s.getsockname()[1])
    sim_port, api_port = free
    cfg = tmp_path / "demo.toml"
    cfg.write_text((ROOT / "config" / "demo.toml").read_text().replace("127.0.0.1:8790", f"127.0.0.1:{sim_port}")
                   .replace("port = 8787", f"port = {api_port}"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state")}
    sim_args = shlex.split(sim_cmd.replace("--port 8790", f"--port {sim_port}"))
    assert sim_args[:3] == ["python", "-m", "replyd.sim"]
    sim = subprocess.Popen([sys.executable, *sim_args[1:]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, env=env, cwd=ROOT)
    words = shlex.split(run_cmd)
    assigns = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    argv = [w for w in words if "=" not in w or w.startswith("-")]
    assert argv[:2] == ["replyd", "run"]
    daemon = None
    try:
        assert sim.stdout.readline().startswith("SIM_URL=")  # type: ignore[union-attr]
        assert argv[2:] == ["--config", "config/demo.toml"]
        daemon = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**env, **assigns}, cwd=ROOT)
        api = f"http://127.0.0.1:{api_port}"
        auth = {"Authorization": f"Bearer {assigns['REPLYD_API_TOKEN']}"}  # the documented token guards the API
        end = time.monotonic() + 60
        ready = False
        while time.monotonic() < end and daemon.poll() is None and not ready:
            try:
                ready = httpx.get(api + "/readyz", timeout=2, headers=auth).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.3)
        assert ready, daemon.stderr.read() if daemon.poll() is not None else "not ready in 60 s"  # type: ignore[union-attr]
        # The header's `replyd status --config …`: no platform token, the API token from the environment.
        st = subprocess.run([sys.executable, "-m", "replyd", "status", "--json", "--config", str(cfg)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60,
                            env={**env, "REPLYD_API_TOKEN": assigns["REPLYD_API_TOKEN"]})
        assert st.returncode == 0 and st.stderr == "", st.stderr
        daemon_view = json.loads(st.stdout)["daemon"]
        assert daemon_view["reachable"] and set(daemon_view["liveness"]["sim"]["paths"]) >= {"inbox", "sweep"}
        curl = shlex.split(curl_cmd)
        body = json.loads(curl[curl.index("-d") + 1])
        parent = httpx.post(f"http://127.0.0.1:{sim_port}/_sim/posts", json=body, timeout=5).json()["id"]
        sim_url = f"http://127.0.0.1:{sim_port}"
        end = time.monotonic() + 60
        while time.monotonic() < end and not httpx.get(sim_url + "/_sim/report", timeout=5).json()["parents"].get(parent):
            time.sleep(0.5)
        report = httpx.get(sim_url + "/_sim/report", timeout=5).json()
        assert sum(report["parents"].get(parent, {}).values()) == 1 and report["duplicates"] == 0, report
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(30) == 0
        sim.terminate()
        sim.wait(10)


def test_push_rows_naive_bots_duplicate_or_lose_and_replyd_does_neither(tmp_path) -> None:
    """The sim's webhooks (each sent twice, some dropped): answering each delivery duplicates, a seen-set of
    Discourse event ids still duplicates (a retry has a new id), both lose the dropped; replyd does neither."""
    from replyd import demo_push
    from replyd.clock import SystemClock
    from replyd.sim import SimServer, World

    world = World(SystemClock(), seed=7)
    world.add_account(demo_push.BOT, bot=True)
    rows = {r.name: r for r in demo_push.ROWS}
    with SimServer(world) as srv:
        got = {name: demo_push.run_row(world, srv.base_url, rows[name], 8, tmp_path) for name in (
            "naive: answers each delivery", "naive: seen-set of X-Discourse-Event-Id",
            "replyd: webhooks + backstop poll")}
    each, seen, rep = got.values()
    assert each["deliveries_dropped"] > 0 and each["copies_sent"] == 2 * (8 - each["deliveries_dropped"])
    assert each["duplicates"] == 8 - each["deliveries_dropped"] and each["lost"] == each["deliveries_dropped"]
    assert seen["duplicates"] > 0 and seen["lost"] == seen["deliveries_dropped"]
    assert rep["duplicates"] == 0 and rep["lost"] == 0 and rep["deliveries_dropped"] > 0
