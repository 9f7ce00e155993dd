"""Execute one chaos run: sim + replicas (real processes) + faults, then count on the platform side."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog

from chaos.plan import Event, Plan
from chaos.proxy import OPEN_COMMIT, TcpProxy
from chaos.simhost import JumpClock, SimHost
from replyd.sim.world import World

ROOT = Path(__file__).resolve().parents[1]
BOT = "chaosbot"
UNSETTLED = ("open", "composing", "released", "not_landed")
# Sim faults that refuse a create with a 4xx other than 429 (a refusal replyd must record as rejected).
# None of the plan's families injects one yet; a family that does names its sim fault kind here.
REFUSAL_FAULTS: frozenset[str] = frozenset()
IN_CI_ENV = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_ADMIN_URL = os.environ.get("REPLYD_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/postgres")


def pg_reachable() -> str | None:
    """None if the PostgreSQL admin URL answers, else why not."""
    try:
        eng = sa.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with eng.connect() as c:
            c.exec_driver_sql("SELECT 1")
        eng.dispose()
        return None
    except Exception as exc:  # any failure means unreachable here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@dataclass
class Replica:
    """One replica slot: its current process and its clock offset file."""

    slot: int
    offset_file: Path
    log: Path
    proc: subprocess.Popen | None = None
    generation: int = 0
    restart_at: float | None = None
    started_at: float = 0.0
    killed: set[int] = field(default_factory=set)
    exits: list[int] = field(default_factory=list)


@dataclass
class Result:
    """What one run measured."""

    index: int
    db: str
    replicas: int
    idempotency: bool
    families: list[str]
    posts: int = 0
    replies: int = 0
    duplicates: int = 0
    duplicates_reported: int = 0  # reply ids replyd's duplicate_detected events name as newer
    duplicates_unreported: int = 0  # the sim's duplicates beyond those replyd reported
    lost: int = 0  # unanswered on the sim and not explained (below): must be 0
    unanswered: int = 0  # parents the sim holds no reply of the bot to (the sim alone decides)
    unanswered_gave_up: int = 0  # ... of which replyd says gave_up (explained when alerted)
    unanswered_rejected: int = 0  # ... of which replyd says rejected (explained only by injected refusals)
    unanswered_other: int = 0  # ... of which replyd says anything else: lost
    refusals_injected: int = 0  # creates the sim refused with a 4xx that is not a rate limit
    rejected_unexplained: int = 0  # rejected parents beyond the refusals the plan injected
    gave_up: int = 0
    gave_up_unreported: int = 0
    rejected: int = 0
    open_left: int = 0
    unsettled_left: int = 0
    wrong_close: int = 0
    faults: int = 0
    fault_counts: dict[str, int] = field(default_factory=dict)
    attempts_mean: float = 0.0
    attempts_max: int = 0
    unhandled: int = 0
    bad_exits: list[int] = field(default_factory=list)
    start_failures: int = 0
    start_failure_reasons: dict[str, int] = field(default_factory=dict)
    stopped_while_starting: int = 0
    integrity: str = "ok"
    settle_s: float = 0.0
    elapsed_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the run kept every promise."""
        return (not self.error and self.duplicates == 0 and self.lost == 0 and self.open_left == 0
                and self.wrong_close == 0 and self.gave_up_unreported == 0 and self.rejected_unexplained == 0
                and self.integrity == "ok"
                and not self.bad_exits and self.unhandled == 0)


def config_text(plan: Plan, base_url: str, store_url: str) -> str:
    """The replicas' config file: short intervals, the drawn timings."""
    return f"""
[store]
url = "{store_url}"
auto_migrate = true
db_clock = {str(plan.db_clock).lower()}

[log]
format = "json"
level = "info"

[guard]
max_attempts = {plan.max_attempts}
send_timeout_s = {plan.send_timeout}
compose_lease_s = 2.0
# A run lasts about a minute: the write breaker's probes and the excused retries' back-off on the same scale as
# the sweep's (the defaults, 5 s doubling to 120 s and 5 s to 300 s, outlast a run's 60 s settle window).
retry_backoff_s = 0.5
retry_backoff_max_s = 4.0

[guard.breaker]
probe_s = 1.0
probe_max_s = 4.0

[sweep]
interval_s = 0.4
batch = 50
lease_s = 3.0
retry_s = 0.5
{''.join(f'{k} = {json.dumps(v)}{chr(10)}' for k, v in plan.sweep.items())}
[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "CHAOS_SIM_TOKEN"
listing_delay_s = {plan.ld_conf}
timeout_s = {plan.send_timeout}
idempotency = true

[bots.pollers]
inbox_interval_s = 0.4
search_interval_s = 0.8
search_queries = ["help"]
refind_interval_s = 1.0
refind_lookback_s = 3600
jitter_s = 0.1
"""


class Run:
    """One run of a plan; ``execute`` returns its Result and never raises."""

    def __init__(self, plan: Plan, workdir: Path | None = None, keep: bool = False, verbose: bool = False) -> None:
        self.plan = plan
        self.keep = keep
        self.verbose = verbose
        self.dir = Path(tempfile.mkdtemp(prefix=f"replyd-chaos-{plan.seed}-{plan.index}-", dir=workdir))
        self.res = Result(plan.index, plan.db, plan.replicas, plan.idempotency, plan.families)
        self.faults: Counter[str] = Counter()
        self.replicas: list[Replica] = []
        self.proxies: list[TcpProxy] = []
        self.pg_name: str | None = None
        self.direct_url = ""
        self.sqlite_path: Path | None = None
        self.immutable: list[Path] = []
        self._locker: sqlite3.Connection | None = None
        self.host: SimHost | None = None
        self.t0 = 0.0
        self.token = f"chaos-token-{uuid.uuid4().hex}"

    # -- helpers ---------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"  [{self.plan.index} {self.now():6.2f}s] {msg}", file=sys.stderr, flush=True)

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.replicas if r.proc is not None and r.proc.poll() is None]

    def _on_create_kill(self, pid: int) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.pid == pid:
                r.killed.add(pid)
                r.restart_at = self.now() + self._kill_restart
                self.faults["kill_on_create"] += 1
                self.log(f"killed replica {r.slot} (pid {pid}) after the platform created its post")

    _kill_restart = 0.5

    def start_replica(self, r: Replica) -> None:
        r.generation += 1
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CHAOS_SIM_TOKEN": self.token,
               "REPLYD_REPLICA_ID": f"r{r.slot}g{r.generation}", "PYTHONUNBUFFERED": "1",
               "CHAOS_STALL_FILE": str(self.stall_file(r.slot))}
        env.pop("REPLYD_CONFIG", None)
        cmd = [sys.executable, "-m", "chaos.timeshim", str(r.offset_file), "--",
               "run", "--config", str(self.dir / f"replica{r.slot}.toml"), "--grace-s", "5"]
        r.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=r.log.open("ab"), env=env, cwd=ROOT)
        r.started_at = self.now()
        r.restart_at = None

    def stalls_over(self) -> bool:
        """Whether every stall of the run has ended: no held answer on a proxy, no paused SQLite replica."""
        if not all(p.holds_over() for p in self.proxies):
            return False
        for taken in self.dir.glob("stall*.taken*"):  # paused from the rename for the hold the file names
            try:
                if time.time() < taken.stat().st_mtime + float(taken.read_text().strip() or 0):
                    return False
            except (OSError, ValueError):
                continue
        return True

    def stall_file(self, slot: int) -> Path:
        """The file that arms a pause after replica ``slot``'s next open commit (read by ``chaos.timeshim``)."""
        return self.dir / f"stall{slot}"

    def kill(self, r: Replica, restart_after: float) -> None:
        if r.proc is not None and r.proc.poll() is None:
            r.killed.add(r.proc.pid)
            r.proc.send_signal(signal.SIGKILL)
            self.faults["kill"] += 1
            self.log(f"SIGKILL replica {r.slot} (pid {r.proc.pid})")
        r.restart_at = self.now() + restart_after

    def supervise(self, restart: bool = True) -> None:
        """Restart replicas that died (by our kill or otherwise), like a service manager would."""
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is not None:
                code = r.proc.returncode
                if r.proc.pid not in r.killed:
                    r.exits.append(code)
                    if code == 2:
                        self.res.start_failures += 1  # a ReplydError at start (e.g. the store unreachable)
                        why = [ln for ln in r.log.read_text(errors="replace").splitlines() if ln.startswith("replyd: ")]
                        key = (why[-1] if why else "?")[:90]
                        self.res.start_failure_reasons[key] = self.res.start_failure_reasons.get(key, 0) + 1
                    else:
                        self.res.bad_exits.append(code)
                    self.log(f"replica {r.slot} exited with {code}")
                    if r.restart_at is None:
                        r.restart_at = self.now() + 0.5
                r.proc = None
            if restart and r.proc is None and r.restart_at is not None and self.now() >= r.restart_at:
                self.start_replica(r)

    # -- store -------------------------------------------------------------------------

    def setup_store(self) -> tuple[str, int] | None:
        """Create the run's database; for PostgreSQL return the (host, port) the proxies forward to."""
        if self.plan.db == "sqlite":
            self.sqlite_path = self.dir / "replyd.sqlite3"
            self.direct_url = f"sqlite:///{self.sqlite_path}"
            return None
        # Seed and index say whose database it is; the random tail keeps concurrent runs and campaigns apart.
        self.pg_name = f"replyd_chaos_{self.plan.seed}_{self.plan.index}_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.exec_driver_sql(f'CREATE DATABASE "{self.pg_name}"')
        admin.dispose()
        url = sa.engine.make_url(PG_ADMIN_URL).set(database=self.pg_name)
        self.direct_url = url.render_as_string(hide_password=False)
        return url.host or "127.0.0.1", url.port or 5432

    def drop_store(self) -> None:
        if self.pg_name:
            try:
                admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
                with admin.connect() as c:
                    c.exec_driver_sql(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        f"WHERE datname = '{self.pg_name}' AND pid <> pg_backend_pid()")
                    c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{self.pg_name}"')
                admin.dispose()
            except Exception as exc:  # cleanup must not hide the run's result
                print(f"chaos: could not drop {self.pg_name}: {exc}", file=sys.stderr)

    def query(self, sql: str) -> list[tuple]:
        eng = sa.create_engine(self.direct_url)
        try:
            with eng.connect() as c:
                return [tuple(r) for r in c.execute(sa.text(sql))]
        finally:
            eng.dispose()

    def tables_ready(self) -> bool:
        try:
            self.query("SELECT count(*) FROM replies")
            return True
        except Exception:
            return False

    def sqlite_readonly(self, on: bool) -> None:
        """Make the SQLite database and its WAL immutable (root ignores chmod; chattr +i stops root too).

        The -shm file is left alone: it is mmapped, and an immutable mmap write is a SIGBUS, i.e. a crash
        (covered by the kill faults), not a read-only database.

        Where the file system has no immutable flag (tmpfs) or chattr is missing, the runner holds an
        exclusive lock on the database instead: writers wait (busy timeout) rather than fail.
        """
        assert self.sqlite_path is not None
        if on:
            files = [p for p in (self.sqlite_path, Path(f"{self.sqlite_path}-wal")) if p.exists()]
            if not files:
                return
            try:
                done = subprocess.run(["chattr", "+i", *map(str, files)], capture_output=True).returncode == 0
            except OSError:
                done = False
            if done:
                self.immutable = files
                self.faults["db_readonly"] += 1
                return
            con = sqlite3.connect(self.sqlite_path, timeout=5, isolation_level=None)
            try:
                con.execute("BEGIN EXCLUSIVE")
            except sqlite3.Error:
                con.close()
                return
            self._locker = con
            self.faults["db_locked"] += 1
        else:
            if self.immutable:
                subprocess.run(["chattr", "-i", *map(str, self.immutable)], check=False, capture_output=True)
                self.immutable = []
            if self._locker is not None:
                self._locker.rollback()
                self._locker.close()
                self._locker = None

    # -- faults ------------------------------------------------------------------------

    def fire(self, ev: Event, world: World, host: SimHost, clock: JumpClock, timers: list) -> None:
        a = ev.args
        if ev.kind == "queue_503":
            world.queue_faults(next_creates=["error_503_before"] * a["n"])
        elif ev.kind == "storm_429":
            world.configure(rate_limit_rate=a["rate"])
            timers.append((self.now() + a["duration"], lambda: world.configure(rate_limit_rate=0.0)))
            self.faults["storm_429_windows"] += 1
        elif ev.kind == "latency":
            if a.get("scope") == "create":
                host.create_delay_s = a["latency"]
                timers.append((self.now() + a["duration"], lambda: setattr(host, "create_delay_s", 0.0)))
            else:
                world.configure(latency_s=a["latency"])
                timers.append((self.now() + a["duration"], lambda: world.configure(latency_s=0.0)))
            self.faults["latency_spikes"] += 1
        elif ev.kind == "kill":
            self.kill(self.replicas[a["replica"]], a["restart_after"])
        elif ev.kind == "kill_on_create":
            self._kill_restart = a["restart_after"]
            host.kill_on_create = True
        elif ev.kind == "db_outage":
            if self.plan.db == "postgres":
                targets = self.proxies if a["scope"] == "all" else [self.proxies[a["scope"]]]
                for p in targets:
                    p.outage()
                timers.append((self.now() + a["duration"], lambda: [p.restore() for p in targets]))
                self.faults["db_outages"] += 1
            else:
                self.sqlite_readonly(True)
                timers.append((self.now() + a["duration"], lambda: self.sqlite_readonly(False)))
        elif ev.kind == "clock":
            r = self.replicas[a["replica"]]
            r.offset_file.write_text(str(a["offset"]))
            if not a.get("restore"):
                self.faults["clock_jumps"] += 1
        elif ev.kind == "stall_open":
            if self.plan.db == "postgres":  # the database's answer to that replica's next open commit is held
                self.proxies[a["replica"]].hold_answer(OPEN_COMMIT, a["hold"])
            else:  # SQLite has no wire to hold: the replica's thread pauses right after its open commit
                self.stall_file(a["replica"]).write_text(str(a["hold"]))
            self.faults["stall_open_armed"] += 1
        elif ev.kind == "platform_clock":
            clock.offset += a["jump"]
            self.faults["platform_clock_jumps"] += 1
        self.log(f"fault {ev.kind} {a}")

    # -- the run -------------------------------------------------------------------------

    def execute(self) -> Result:
        start = time.monotonic()
        try:
            self._execute()
        except Exception as exc:  # a broken run is reported, never hidden
            import traceback

            self.res.error = f"{type(exc).__name__}: {exc}"[:500]
            if self.verbose:
                traceback.print_exc()
        finally:
            for r in self.replicas:
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.kill()
                    r.proc.wait(10)
            if self.host is not None:
                self.host.stop()
            for p in self.proxies:
                p.close()
            if self.sqlite_path is not None:
                self.sqlite_readonly(False)
            self.drop_store()
            self.res.elapsed_s = round(time.monotonic() - start, 1)
            if not self.keep and self.res.ok:
                shutil.rmtree(self.dir, ignore_errors=True)
            elif not self.res.ok:
                print(f"chaos: run {self.plan.index} kept in {self.dir}", file=sys.stderr)
        return self.res

    def _execute(self) -> None:
        plan = self.plan
        clock = JumpClock()
        clock.offset = plan.platform_offset_s  # platform_clock_offset: the platform's clock off for the whole run
        if plan.platform_offset_s:
            self.faults["platform_clock_offset"] += 1
        world = World(clock, seed=plan.seed * 1000 + plan.index, listing_delay_s=plan.ld_real,
                      idempotency=plan.idempotency, retry_after_s=1)
        bot = world.add_account(BOT, bot=True, token=self.token)
        host = self.host = SimHost(world, self.pids, self._on_create_kill).start()
        target = self.setup_store()
        for i in range(plan.replicas):
            if target is not None:
                proxy = TcpProxy(*target).start()
                self.proxies.append(proxy)
                url = sa.engine.make_url(self.direct_url).set(host="127.0.0.1", port=proxy.port)
                store_url = url.render_as_string(hide_password=False)
            else:
                store_url = self.direct_url
            cfg = self.dir / f"replica{i}.toml"
            cfg.write_text(config_text(plan, host.base_url, store_url))
            os.chmod(cfg, 0o600)
            r = Replica(i, self.dir / f"clock{i}", self.dir / f"replica{i}.log")
            r.offset_file.write_text("0")
            self.replicas.append(r)
        self.t0 = time.monotonic()
        for r in self.replicas:
            self.start_replica(r)
        # Faults start once the schema exists, so a run measures the daemon, not a failed first start.
        # 60 s: with --jobs, several runs' replicas import and migrate at once on a loaded machine.
        deadline = self.now() + 60
        while not self.tables_ready():
            if self.now() > deadline:
                raise RuntimeError("replicas did not create the schema within 60 s")
            self.supervise()
            time.sleep(0.1)
        world.configure(**plan.rates)
        traffic = world.start_traffic(plan.parents / plan.traffic_s, total=plan.parents, target=BOT,
                                      query_word="help", query_fraction=0.5, users=6)
        base = self.now()
        events = list(plan.events)
        timers: list[tuple[float, Any]] = []
        while events or timers or self.now() - base < plan.chaos_s:
            t = self.now() - base
            while events and events[0].at <= t:
                self.fire(events.pop(0), world, host, clock, timers)
            for due in [x for x in timers if x[0] <= self.now()]:
                timers.remove(due)
                due[1]()
            self.supervise()
            time.sleep(0.02)
        # Faults end; the system must converge on its own.
        traffic.join(30)
        world.configure(**{k: 0.0 for k in plan.rates}, rate_limit_rate=0.0, latency_s=0.0)
        with host.lock:
            host.faults_over, host.kill_on_create = True, False
        host.create_delay_s = 0.0
        for p in self.proxies:
            p.restore()
        if self.sqlite_path is not None:
            self.sqlite_readonly(False)
        for r in self.replicas:
            if r.proc is None and r.restart_at is None:
                r.restart_at = self.now()
        parents = list(traffic.posted)
        settle0 = self.now()
        stable = 0
        clock_steps = [abs(e.args["offset"]) for e in plan.events if e.kind == "clock"]
        while self.now() - settle0 < 60 + max(clock_steps, default=0.0):
            self.supervise()
            per = world.replies_by(bot.id)
            try:
                rows = dict(self.query("SELECT state, count(*) FROM replies GROUP BY state"))
            except Exception:
                rows = {"?": 1}
            # A replica whose open commit is still held (or paused) moves its row when it wakes (a too-late
            # send releases even a row judged meanwhile): the states are not final before every stall ended.
            done = self.stalls_over() and (all(per.get(p) for p in parents) or (
                sum(rows.values()) >= len(parents) and not any(rows.get(s) for s in UNSETTLED)))
            if done and not any(rows.get(s) for s in UNSETTLED) and "?" not in rows:
                stable += 1
                if stable >= 5:
                    break
            else:
                stable = 0
            time.sleep(0.2)
        self.res.settle_s = round(self.now() - settle0, 1)
        self.stop_all()
        self.final_sweep()
        self.collect(world, host, bot.id, parents)

    def stop_all(self) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            if r.proc is None:
                continue
            try:
                code = r.proc.wait(20)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                code = r.proc.wait(10)
                self.res.bad_exits.append(-999)  # did not stop within the grace period
            # 30 s: under --jobs load an import can take several times as long as on an idle machine.
            if code == -signal.SIGTERM and self.now() - r.started_at < 30:
                self.res.stopped_while_starting += 1  # SIGTERM before its handler was installed (still importing)
            elif code != 0 and r.proc.pid not in r.killed:
                self.res.bad_exits.append(code)
            r.proc = None

    def final_sweep(self) -> None:
        """Wait for the last open row's deadline and sweep lease, then one ``replyd sweep`` (a plain process)."""
        try:
            due = self.query("SELECT max(deadline_at), max(lease_until) FROM replies WHERE state = 'open'")[0]
            due = max((x for x in due if x is not None), default=None)
        except Exception:
            due = None
        if due is not None:
            time.sleep(min(60.0, max(0.0, due - time.time() + 0.2)))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CHAOS_SIM_TOKEN": self.token}
        with (self.dir / "final_sweep.log").open("ab") as fh:
            subprocess.run([sys.executable, "-m", "replyd", "sweep", "--config", str(self.dir / "replica0.toml")],
                           stdout=fh, stderr=fh, env=env, cwd=ROOT, timeout=120)

    def collect(self, world: World, host: SimHost, bot_id: str, parents: list[str]) -> None:
        res = self.res
        per = world.replies_by(bot_id)
        report = world.report()
        rows = {p: (s, rid) for p, s, rid in self.query("SELECT parent_id, state, reply_id FROM replies")}
        reported_gave_up: set[str] = set()
        for r in self.replicas:
            text = r.log.read_text(errors="replace") if r.log.exists() else ""
            res.unhandled += text.count("Traceback (most recent call last)")
            for line in text.splitlines():
                if "replyd.sweep.gave_up" in line:
                    try:
                        reported_gave_up.add(json.loads(line).get("parent_id"))
                    except ValueError:
                        pass
        final_log = (self.dir / "final_sweep.log")
        if final_log.exists():
            text = final_log.read_text(errors="replace")
            res.unhandled += text.count("Traceback (most recent call last)")
            for line in text.splitlines():
                if "replyd.sweep.gave_up" in line:
                    try:
                        reported_gave_up.add(json.loads(line).get("parent_id"))
                    except ValueError:
                        pass
        mine = {s.id: s for s in world.statuses.values() if s.account_id == bot_id and s.deleted_at is None}
        res.posts = len(parents)
        res.replies = sum(per.get(p, 0) for p in parents)
        res.duplicates = world.duplicates(bot_id)
        # The sim's own count of refusals (4xx other than 429) it answered to creates: the only thing that
        # excuses a rejected parent. No fault family injects one today, so any rejected parent fails the run.
        refusals = sum(n for k, n in report["faults_injected"].items() if k in REFUSAL_FAULTS)
        account_unanswered(res, parents, per, {p: s for p, (s, _) in rows.items()}, reported_gave_up, refusals)
        for p in parents:
            state, rid = rows.get(p, (None, None))
            if state == "closed" and (rid not in mine or mine[rid].in_reply_to_id != p):
                res.wrong_close += 1
        states = Counter(s for s, _ in rows.values())
        res.open_left = states.get("open", 0)
        res.unsettled_left = sum(states.get(s, 0) for s in UNSETTLED)
        attempts = host.attempts()
        counts = [attempts.get(p, 0) for p in parents]
        res.attempts_mean = round(sum(counts) / max(1, len(counts)), 3)
        res.attempts_max = max(counts, default=0)
        # Stalls that really happened: answers the proxies held, pauses a replica took (its renamed file).
        held = sum(p.held for p in self.proxies) + len(list(self.dir.glob("stall*.taken*")))
        if held:
            self.faults["stall_open_held"] += held
        try:
            details = self.query("SELECT detail FROM events WHERE kind = 'duplicate_detected'")
        except Exception:
            details = []
        res.duplicates_reported = sum(len(json.loads(d or "{}").get("newer", [])) for (d,) in details)
        res.duplicates_unreported = max(0, res.duplicates - res.duplicates_reported)
        for k, n in report["faults_injected"].items():
            self.faults[k] += n
        res.fault_counts = dict(sorted(self.faults.items()))
        res.faults = sum(self.faults.values())
        if self.sqlite_path is not None:
            con = sqlite3.connect(self.sqlite_path)
            try:
                res.integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
            finally:
                con.close()


def account_unanswered(res: Result, parents: list[str], replies: Mapping[str, int], states: Mapping[str, str],
                       alerted: set[str], refusals: int) -> None:
    """Count the unanswered parents by the sim's replies alone, split by what replyd says about each.

    Explained: ``gave_up`` and alerted (``replyd.sweep.gave_up`` logged), or ``rejected`` up to the number
    of refusals the sim injected. Every other unanswered parent is lost.
    """
    unreported = 0
    for p in parents:
        state = states.get(p)
        res.gave_up += state == "gave_up"
        res.gave_up_unreported += state == "gave_up" and p not in alerted
        res.rejected += state == "rejected"
        if replies.get(p):
            continue
        res.unanswered += 1
        if state == "gave_up":
            res.unanswered_gave_up += 1
            unreported += p not in alerted
        elif state == "rejected":
            res.unanswered_rejected += 1
        else:
            res.unanswered_other += 1
    res.refusals_injected = refusals
    res.rejected_unexplained = max(0, res.unanswered_rejected - refusals)
    res.lost = res.unanswered_other + res.rejected_unexplained + unreported


def configure_logging(verbose: bool) -> None:
    """Send the in-process sim's structlog output to stderr (stdout holds the run lines and the totals)."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG if verbose else logging.WARNING))


def run_plan(plan: Plan, workdir: Path | None, keep: bool, verbose: bool) -> Result:
    """Execute one plan and return its Result (module level, so a --jobs pool worker can import it)."""
    return Run(plan, workdir, keep=keep, verbose=verbose).execute()
