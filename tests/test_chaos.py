"""The short chaos run inside ``make test``: real daemon processes, real HTTP, random faults, platform-side counts.

``python -m chaos --short`` draws a few runs (SQLite and PostgreSQL, one to
three replicas) that together cover every fault family: lost responses (cut
connection, 504 after create), 5xx before create, 429 storms, failed
read-backs, latency spikes, SIGKILL at random moments and right after the
platform created a post, the database cut (PostgreSQL, through a proxy) or made
unwritable (SQLite, ``chattr +i``), replica and platform clock steps. Its last
stdout line is the totals; every promise must hold. The long version is
``make chaos`` (see docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_short_chaos_keeps_every_promise(tmp_path):
    """duplicates 0, lost 0, open rows 0 after the final sweep, no crash, across the short set of runs."""
    args = [sys.executable, "-m", "chaos", "--short", "--seed", os.environ.get("CHAOS_SEED", "1"),
            "--workdir", str(tmp_path), "--json-out", str(tmp_path / "chaos.json")]
    if IN_CI:
        args.append("--require-postgres")
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=280,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = p.stdout.strip().splitlines()
    assert lines, p.stderr[-3000:]
    totals = json.loads(lines[-1])
    print("\n" + "\n".join(lines))
    assert totals["runs"] >= 4 and totals["posts"] > 0 and totals["faults"] > 0, totals
    assert totals["duplicates"] == 0, (totals, p.stdout)
    assert totals["lost"] == 0, (totals, p.stdout)
    assert totals["open_left"] == 0 and totals["unsettled_left"] == 0, totals
    assert totals["wrong_close"] == 0 and totals["gave_up_unreported"] == 0, totals
    assert totals["rejected_unexplained"] == 0, totals  # no plan injects a refusal: nothing may be rejected
    assert totals["unanswered"] == (totals["unanswered_gave_up"] + totals["unanswered_rejected"]
                                    + totals["unanswered_other"]), totals
    assert totals["unhandled"] == 0 and totals["bad_exits"] == 0, (totals, p.stderr[-3000:])
    assert totals["failed_runs"] == 0 and p.returncode == 0, (totals, p.stderr[-3000:])
    kinds = set(totals["faults_by_kind"])
    # The short set really met the faults it claims to cover.
    for k in ("kill", "kill_on_create", "lost_504", "lost_drop", "clock_jumps", "latency_spikes"):
        assert k in kinds, (k, kinds)
    assert kinds & {"db_outages", "db_readonly", "db_locked"}, kinds


def test_unanswered_parents_are_counted_by_the_sim_and_explained_or_lost():
    """Unanswered = no reply on the sim, whatever replyd says; gave_up counts as explained only when alerted,
    rejected only up to the refusals injected; anything else unanswered is lost."""
    from chaos.run import Result, account_unanswered

    parents = ["ok", "closed-but-missing", "gave-up-alerted", "gave-up-silent", "rejected", "open"]
    replies = {"ok": 1}
    states = {"ok": "closed", "closed-but-missing": "closed", "gave-up-alerted": "gave_up",
              "gave-up-silent": "gave_up", "rejected": "rejected", "open": "open"}
    for refusals, lost in ((0, 4), (1, 3)):
        res = Result(0, "sqlite", 1, False, [])
        account_unanswered(res, parents, replies, states, {"gave-up-alerted"}, refusals)
        assert res.unanswered == 5 and res.unanswered_gave_up == 2 and res.unanswered_rejected == 1
        assert res.unanswered_other == 2  # replyd's "closed" does not excuse a parent the sim has no reply to
        assert res.rejected_unexplained == 1 - refusals and res.gave_up_unreported == 1
        assert res.lost == lost and not res.ok


def test_proxy_outage_cuts_and_refuses_then_restores():
    """The database-outage injector really cuts open connections and refuses new ones until restored."""
    import socket
    import threading

    from chaos.proxy import TcpProxy

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def echo() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=c: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")], daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    proxy = TcpProxy("127.0.0.1", srv.getsockname()[1]).start()
    try:
        a = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        a.sendall(b"ping")
        assert a.recv(16) == b"ping"
        proxy.outage()
        assert a.recv(16) == b""  # the open connection is cut
        try:  # refused: reset at once (or, at worst, closed) without reaching the server
            c = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
            c.sendall(b"x")  # an echo would come back if the connection reached the server
            got = c.recv(1)
        except OSError:
            got = b""
        assert got == b""
        proxy.restore()
        b = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        b.sendall(b"pong")
        assert b.recv(16) == b"pong"
        assert proxy.outages == 1 and proxy.cut_connections == 1
    finally:
        proxy.close()
        srv.close()


def test_plans_are_reproducible_and_inside_the_margin():
    """A seed gives the same plans; without idempotency, latency and clock offsets stay within the slack."""
    from chaos.plan import FAMILIES, draw

    seen = set()
    for i in range(60):
        a, b = draw(9, i, short=False, postgres=True), draw(9, i, short=False, postgres=True)
        assert a.to_dict() == b.to_dict()
        assert a.ld_conf > a.ld_real and len(a.families) >= 3
        seen.update(a.families)
        if not a.idempotency:
            lat = [e.args["latency"] for e in a.events if e.kind == "latency"]
            offs = [e.args["offset"] for e in a.events if e.kind == "clock"] + [0.0]
            assert max(lat, default=0.0) + (max(offs) - min(offs)) <= a.slack + 1e-9, a.to_dict()
    assert seen == set(FAMILIES)
    short = [draw(1, i, short=True, postgres=True) for i in range(4)]
    assert set().union(*(p.families for p in short)) == set(FAMILIES)


def test_sqlite_store_writes_again_once_the_file_is_writable(tmp_path):
    """A store whose database was unwritable when it connected writes again once the file is writable."""
    import shutil as _shutil

    from replyd.errors import StoreError
    from replyd.store import Store

    if _shutil.which("chattr") is None or os.geteuid() != 0:
        pytest.skip("needs chattr and root to make the file immutable")
    db = tmp_path / "r.sqlite3"
    url = f"sqlite:///{db}"
    Store.open(url).dispose()
    files = [str(p) for p in (db, Path(f"{db}-wal")) if p.exists()]
    if subprocess.run(["chattr", "+i", *files], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable flag")
    store = Store.open(url, migrate=False)
    try:
        with pytest.raises(StoreError):
            store.set_cursor("p", "s", "inbox", "1")  # fail closed while unwritable
        subprocess.run(["chattr", "-i", *files], check=True)
        store.set_cursor("p", "s", "inbox", "2")  # the database is writable again
        assert store.get_cursor("p", "s", "inbox") == "2"
    finally:
        subprocess.run(["chattr", "-i", *files], capture_output=True)
        store.dispose()


def test_timeshim_stall_pauses_the_thread_after_an_open_commit(tmp_path, monkeypatch):
    """The SQLite stall_open fault: an armed file pauses the first open after it appears, once, before the send."""
    from chaos import timeshim
    from replyd.clock import FakeClock
    from replyd.guard import Guard, Status
    from replyd.platforms.base import Parent
    from replyd.platforms.memory import MemoryPlatform
    from replyd.store import Store

    monkeypatch.setattr(Guard, "_open_composed", Guard._open_composed)  # restored after the test
    stall = tmp_path / "stall0"
    timeshim._stall_opens(str(stall))
    slept: list[float] = []
    monkeypatch.setattr(timeshim.time, "sleep", slept.append)
    clock = FakeClock()
    store = Store.open(f"sqlite:///{tmp_path / 's.sqlite3'}", clock=clock)
    try:
        plat = MemoryPlatform(clock=clock, listing_delay_s=1.0)
        g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=2.0, watch_interval_s=None)
        assert g.post(Parent(id="a", author_id="u"), lambda p: "x").status is Status.POSTED
        assert slept == []  # not armed: no pause
        stall.write_text("4.5")
        assert g.post(Parent(id="b", author_id="u"), lambda p: "x").status is Status.POSTED
        assert slept == [4.5] and not stall.exists() and len(list(tmp_path.glob("stall0.taken.*"))) == 1
        assert g.post(Parent(id="c", author_id="u"), lambda p: "x").status is Status.POSTED
        assert slept == [4.5]  # taken once
    finally:
        store.dispose()


@pytest.mark.parametrize("over", [False, True], ids=["during", "after"])
def test_a_kill_on_create_whose_sender_is_gone_waits_for_the_next_create(over):
    """A create whose sender closed its socket before the answer (its send timed out on a loaded machine) spends
    no armed kill: the next create's sender is the victim; once the run's faults are over nothing re-arms."""
    import asyncio

    from chaos.simhost import SimHost, _Counting
    from replyd.sim import World

    # Not started: the host's middleware alone, in front of an app that answers 200.
    host = SimHost(World(), daemon_pids=lambda: [os.getpid()], on_kill=lambda pid: pytest.fail(f"killed {pid}"))
    host.kill_on_create, host.faults_over = True, over

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def create() -> None:
        sent: list = []
        body = iter([{"type": "http.request", "body": b"in_reply_to_id=p1", "more_body": False}])

        async def receive():
            return next(body)

        async def send(message):
            sent.append(message)

        # Port 1 is nobody's socket: the sender is gone.
        scope = {"type": "http", "method": "POST", "path": "/api/v1/statuses", "client": ("127.0.0.1", 1)}
        await _Counting(app, host)(scope, receive, send)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]

    asyncio.run(create())
    assert host.posts_per_parent["p1"] == 1
    assert host.kill_on_create is (not over)
