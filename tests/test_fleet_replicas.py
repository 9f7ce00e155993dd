"""The fleet for real: `replyd run` replicas on one PostgreSQL against the sim, many bots, inbox every 5 s.

Counted on the sim (it never reads replyd's log): platform reads per interval for three replicas against
one alone; a SIGKILLed replica's bots polled again by the others within the bot lease plus one interval,
the burst answered, a replica added mid-burst; no parent answered twice.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from replyd.clock import SystemClock
from replyd.sim import SimServer, World
from tests.test_daemon import ROOT, wait_until
from tests.test_replicas import fresh_pg, tail  # noqa: F401 - fresh_pg is a fixture

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

BOTS = int(os.environ.get("REPLYD_FLEET_BOTS", "60"))
INBOX_S = 5.0
HEARTBEAT_S, LEASE_S = 1.0, 4.0
WINDOW_S = 3 * INBOX_S  # reads are counted over whole intervals


def write_config(path: Path, base_url: str, url: str, bots: int) -> Path:
    head = f"""
[store]
url = "{url}"
auto_migrate = true

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 4.0
compose_lease_s = 30.0  # long: a dead replica's composing rows must come back by its heartbeat, not this

[sweep]
interval_s = 1.0
lease_s = 30.0          # long: likewise for its sweep leases

[fleet]
enabled = true
heartbeat_s = {HEARTBEAT_S}
bot_lease_s = {LEASE_S}

[daemon]
job_threads = 8
"""
    body = "".join(f"""
[[bots]]
name = "b{i:04d}"
platform = "mastodon"
[bots.settings]
base_url = "{base_url}"
token_env = "SIM_TOKEN_{i}"
listing_delay_s = 0.5
timeout_s = 2.0
[bots.pollers]
inbox_interval_s = {INBOX_S}
search_interval_s = 0
refind_interval_s = 0
adopt_at_start = false
jitter_s = 0.5
""" for i in range(bots))
    path.write_text(head + body)
    os.chmod(path, 0o600)
    return path


class Fleet:
    """The replicas of one test, their logs and the database they share."""

    def __init__(self, cfg: Path, tokens: dict[str, str], logs: Path, url: str) -> None:
        self.cfg, self.tokens, self.logs = cfg, tokens, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.db = sa.create_engine(url)

    def start(self, rid: str, *, name: str | None = None) -> None:
        """Start a replica with id ``rid``, kept as ``name`` (default: the id; a second process may share it)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REPLYD_REPLICA_ID": rid, **self.tokens}
        name = name or rid
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "replyd", "run", "--config", str(self.cfg), "--grace-s", "5"],
            stdout=subprocess.DEVNULL, stderr=(self.logs / f"{name}.log").open("ab"), env=env, cwd=ROOT)

    def leases(self) -> dict[str, str | None]:
        """Bot -> holder, for leases live now (by the database's clock)."""
        try:
            with self.db.connect() as c:
                return dict(c.execute(sa.text(
                    "SELECT bot, holder FROM bot_leases WHERE holder IS NOT NULL"
                    " AND until > extract(epoch from clock_timestamp())")).all())
        except sa.exc.ProgrammingError:  # not migrated yet
            return {}

    def settled(self, replicas: set[str]) -> bool:
        """Every bot held, by exactly the given replicas (each holding some)."""
        held = self.leases()
        return len(held) == BOTS and set(held.values()) == replicas

    def unsettled_rows(self) -> int:
        with self.db.connect() as c:
            return c.execute(sa.text("SELECT count(*) FROM replies WHERE state IN "
                                     "('open', 'composing', 'not_landed', 'released')")).scalar_one()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.db.dispose()


def reads_over(world: World, seconds: float) -> int:
    """The sim's GET requests of every account over ``seconds`` from now."""
    before = sum(world.reads().values())
    time.sleep(seconds)
    return sum(world.reads().values()) - before


class Burst:
    """Mentions of random bots from a thread, each parent remembered with the bot it mentions."""

    def __init__(self, world: World, bots: list[str], rate_per_s: float, total: int) -> None:
        self.world, self.bots, self.gap_s, self.total = world, bots, 1.0 / rate_per_s, total
        self.posted: list[tuple[str, str]] = []  # (bot username, parent id)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(7)
        for i in range(self.total):
            bot = rng.choice(self.bots)
            st = self.world.post(f"user{rng.randint(1, 20)}", f"question {i} for @{bot}?", mention=[bot])
            self.posted.append((bot, st.id))
            time.sleep(self.gap_s)

    def start(self) -> Burst:
        self.thread.start()
        return self


def unanswered(world: World, accounts: dict[str, str], posted: list[tuple[str, str]]) -> list[str]:
    return [p for bot, p in posted if world.replies_by(accounts[bot]).get(p, 0) < 1]


def test_fleet_shares_reads_takes_over_a_dead_replica_and_rebalances(fresh_pg, tmp_path):
    world = World(SystemClock(), seed=5, listing_delay_s=0.2)
    names = [f"b{i:04d}" for i in range(BOTS)]
    accounts = {n: world.add_account(n, bot=True) for n in names}
    tokens = {f"SIM_TOKEN_{i}": accounts[n].token for i, n in enumerate(names)}
    ids = {n: a.id for n, a in accounts.items()}
    for u in range(1, 21):
        world.add_account(f"user{u}")
    logs = tmp_path / "logs"
    logs.mkdir()
    figures: dict[str, float] = {}
    with SimServer(world) as srv:
        fleet = Fleet(write_config(tmp_path / "fleet.toml", srv.base_url, fresh_pg, BOTS), tokens, logs, fresh_pg)
        try:
            fleet.start("r1")
            assert wait_until(lambda: fleet.settled({"r1"}), 60, every_s=0.2), tail(logs)
            time.sleep(INBOX_S + 1)  # every bot's first poll and login behind it
            one = reads_over(world, WINDOW_S)

            fleet.start("r2")
            fleet.start("r3")
            assert wait_until(lambda: fleet.settled({"r1", "r2", "r3"}), 60, every_s=0.2), (fleet.leases(), tail(logs))
            time.sleep(INBOX_S + 1)  # the newcomers' logins behind them
            three = reads_over(world, WINDOW_S)
            figures["reads_one"], figures["reads_three"] = one, three
            figures["ratio"] = round(three / one, 3)
            assert three <= 1.1 * one, figures

            # A burst of mentions; r2 SIGKILLed in its middle, r4 added a little later.
            burst = Burst(world, names, rate_per_s=10.0, total=200).start()
            time.sleep(6.0)
            orphans = [b for b, h in fleet.leases().items() if h == "r2"]
            polled = {b: world.reads(ids[b]).get("notifications", 0) for b in orphans}
            fleet.procs["r2"].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            before_kill = list(burst.posted)
            assert fleet.procs["r2"].wait(10) == -signal.SIGKILL
            bound_s = LEASE_S + INBOX_S + HEARTBEAT_S + 1.0  # + a heartbeat to see it, + the poll's jitter

            def polled_again() -> bool:
                return all(world.reads(ids[b]).get("notifications", 0) > polled[b] for b in orphans)

            assert wait_until(polled_again, bound_s + 10, every_s=0.1), (fleet.leases(), tail(logs))
            figures["takeover_s"] = round(time.monotonic() - killed, 2)
            assert figures["takeover_s"] <= bound_s, figures
            assert wait_until(lambda: not unanswered(world, ids, before_kill), bound_s + 10, every_s=0.1), tail(logs)
            figures["answered_before_kill_s"] = round(time.monotonic() - killed, 2)
            assert figures["answered_before_kill_s"] <= bound_s, figures
            fleet.start("r4")
            burst.thread.join(60)
            assert len(burst.posted) == burst.total
            assert wait_until(lambda: fleet.settled({"r1", "r3", "r4"}), 60, every_s=0.2), (fleet.leases(), tail(logs))
            assert wait_until(lambda: not unanswered(world, ids, burst.posted) and fleet.unsettled_rows() == 0,
                              bound_s + 30, every_s=0.2), (len(unanswered(world, ids, burst.posted)), tail(logs))
            figures["all_answered_s"] = round(time.monotonic() - killed, 2)
            time.sleep(INBOX_S)  # more polls everywhere: a late duplicate would show now
        finally:
            fleet.stop()
    report = world.report()
    assert report["duplicates"] == 0, report
    for bot, p in burst.posted:
        assert world.replies_by(ids[bot]).get(p) == 1, (bot, p)
    print("fleet figures:", figures)


def test_a_second_process_with_a_replica_id_in_use_stops_and_the_first_keeps_its_bots(fresh_pg, tmp_path):
    """Two live processes under one replica id would both poll its bots. The later one stops with one line
    (exit 2) and leaves the fleet's row alone; the first keeps every bot and keeps answering."""
    world = World(SystemClock(), seed=9, listing_delay_s=0.2)
    names = [f"b{i:04d}" for i in range(4)]
    accounts = {n: world.add_account(n, bot=True) for n in names}
    tokens = {f"SIM_TOKEN_{i}": accounts[n].token for i, n in enumerate(names)}
    world.add_account("user1")
    logs = tmp_path / "logs"
    logs.mkdir()
    with SimServer(world) as srv:
        fleet = Fleet(write_config(tmp_path / "fleet.toml", srv.base_url, fresh_pg, len(names)), tokens, logs, fresh_pg)
        try:
            fleet.start("r1")
            assert wait_until(lambda: set(fleet.leases().values()) == {"r1"} and len(fleet.leases()) == 4, 60,
                              every_s=0.2), tail(logs)
            fleet.start("r1", name="twin")
            twin = fleet.procs["twin"]
            assert twin.wait(60) == 2, tail(logs)
            said = (logs / "twin.log").read_text()
            assert "replyd run: stopped: replica_id 'r1' is in use by another live process" in said, said[-2000:]
            assert fleet.procs["r1"].poll() is None
            time.sleep(2 * LEASE_S)  # the leases would lapse by now had the twin freed them
            assert fleet.leases() == dict.fromkeys(names, "r1")
            parent = world.post("user1", "still there @b0002?", mention=["b0002"]).id
            assert wait_until(lambda: world.replies_by(accounts["b0002"].id).get(parent) == 1, 30, every_s=0.2), \
                tail(logs)
        finally:
            fleet.stop()
