"""Several replicas on one PostgreSQL database: three daemon processes, the sim with faults, a SIGKILL.

The platform (the sim, in this process) counts what landed; the answered-log's
``events`` table says which replica decided what. Neither reads the other.
The sim's Idempotency-Key support is switched off, so a duplicate could only
be prevented by replyd's own claim and sweep, not by the platform.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from replyd import migrate
from replyd import store as st
from replyd.clock import SystemClock
from replyd.sim import SimServer, World
from tests.conftest import IN_CI, PG_ADMIN_URL, _pg_reachable
from tests.test_daemon import ROOT, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

BOT = "replybot"
PARENTS = 80
DECISIONS = ("swept_found", "not_landed", "gave_up")  # the sweep's verdicts on one open (row, attempt)
CLOSES = ("closed", "already_landed", "swept_found", "reconciled")  # every way a row reaches closed
SWEEP_INTERVAL_S = 0.5
SEND_TIMEOUT_S = 4.0  # the guard's bound on one send: twice the adapter's per-phase HTTP timeout
LISTING_DELAY_S = 0.5  # configured; the sim lists a reply after 0.2 s


@pytest.fixture
def fresh_pg() -> Iterator[str]:
    """An empty PostgreSQL database (no schema: the replicas migrate it themselves); dropped after."""
    why = _pg_reachable()
    if why:
        if IN_CI:
            pytest.fail(f"PostgreSQL is required under CI=true but unreachable at {PG_ADMIN_URL}: {why}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL} ({why}); set REPLYD_TEST_PG or start it")
    name = f"replyd_replicas_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(
                f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' AND pid <> pg_backend_pid()"
            )
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        admin.dispose()


def write_pg_config(path: Path, base_url: str, url: str) -> Path:
    """Write a replica config: the shared PostgreSQL log, short intervals, every poller on."""
    path.write_text(f"""
[store]
url = "{url}"
auto_migrate = true   # all three start at once on an empty database: the advisory lock serialises them

[log]
format = "json"
level = "info"

[guard]
max_attempts = 5      # error_500_before can hit a parent's retry too; exhausting attempts is not this test's subject
send_timeout_s = {SEND_TIMEOUT_S}
compose_lease_s = 3.0 # a claim orphaned by the SIGKILL mid-compose is claimable again after this

[fleet]
enabled = false       # every replica polls the one bot: the claim alone keeps its answers single

[sweep]
interval_s = {SWEEP_INTERVAL_S}
batch = 5
lease_s = 10.0        # rows leased by the killed replica are swept by the others after this
retry_s = 1.0

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "SIM_TOKEN"
listing_delay_s = {LISTING_DELAY_S}
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.5
search_interval_s = 1.0
search_queries = ["help"]
refind_interval_s = 1.5
refind_lookback_s = 3600
jitter_s = 0.2
""")
    os.chmod(path, 0o600)
    return path


def start_replica(cfg: Path, replica_id: str, token: str, logs: Path) -> subprocess.Popen:
    """Start ``python -m replyd run`` as its own OS process with a fixed replica id and its own JSON log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN": token, "REPLYD_REPLICA_ID": replica_id}
    return subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                            stdout=subprocess.DEVNULL, stderr=(logs / f"{replica_id}.log").open("ab"), env=env, cwd=ROOT)


def sweep_passes(log: Path, event: str = "replyd.sweep.passed") -> list[dict]:
    """The ``replyd.sweep.passed`` records (or another event's) of one replica's JSON log.

    A line can hold more than one record (or a record and a stdlib logging
    line): the daemon's JSON records and other libraries' plain lines reach
    stderr through different locks. Every JSON object on a line is read.
    """
    dec = json.JSONDecoder()
    out = []
    for line in log.read_text().splitlines():
        i = line.find("{")
        while i != -1:
            try:
                rec, end = dec.raw_decode(line, i)
            except ValueError:
                i = line.find("{", i + 1)
                continue
            if isinstance(rec, dict) and rec.get("event") == event:
                out.append(rec)
            i = line.find("{", end)
    return out


def tail(logs: Path, n: int = 1500) -> str:
    """The end of every replica's log, for a failure message."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-n:]}" for p in sorted(logs.glob("*.log")))


def test_three_replicas_sigkill_one_no_duplicates_sweep_shared(fresh_pg, tmp_path):
    """Three replicas on one PostgreSQL log, one SIGKILLed and restarted: each parent answered once, sweep shared."""
    world = World(SystemClock(), seed=11, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    world.configure(lost_drop_rate=0.12, lost_504_rate=0.08, error_500_before_rate=0.10, idempotency=False, latency_s=0.1)
    db = sa.create_engine(fresh_pg)

    def q(sql: str, **params) -> list[tuple]:
        with db.connect() as c:
            return [tuple(r) for r in c.execute(sa.text(sql), params)]

    def tables_exist() -> bool:
        return bool(q("SELECT 1 FROM information_schema.tables WHERE table_name = 'events'"))

    def open_rows_of(owner: str) -> list[tuple[str, int]]:
        if not tables_exist():
            return []
        return q("SELECT parent_id, attempt FROM replies WHERE owner = :o AND state = 'open'", o=owner)

    def unsettled() -> int:
        return q("SELECT count(*) FROM replies WHERE state IN ('open', 'composing', 'not_landed', 'released')")[0][0]

    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen] = {}
    with SimServer(world) as srv:
        cfg = write_pg_config(tmp_path / "replica.toml", srv.base_url, fresh_pg)
        try:
            t0 = time.monotonic()
            for rid in ("r1", "r2", "r3"):
                procs[rid] = start_replica(cfg, rid, bot.token, logs)
                time.sleep(SWEEP_INTERVAL_S / 3)  # replicas never start in lock-step; equal phases share the sweep
            traffic = world.start_traffic(4.0, total=PARENTS, target=BOT, query_word="help", query_fraction=0.5, users=8)

            # SIGKILL r2 mid-run, while it holds an open row (a send in flight: the sim answers after latency_s).
            assert wait_until(lambda: sum(world.replies_by(bot.id).values()) >= 5 and open_rows_of("r2"), 40, every_s=0.02), \
                tail(logs)
            procs["r2"].send_signal(signal.SIGKILL)
            assert procs["r2"].wait(10) == -signal.SIGKILL
            killed_at = time.monotonic() - t0
            orphans = open_rows_of("r2")  # open rows the dead replica left behind: the others must bound them
            assert traffic.running, "traffic ended before the kill: the kill would not be mid-run"
            time.sleep(1.5)
            procs["r2b"] = start_replica(cfg, "r2b", bot.token, logs)  # a restart gets a new owner id, as by default
            traffic.join(40)
            assert len(traffic.posted) == PARENTS

            parents = list(traffic.posted)
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents) and unsettled() == 0, 60), \
                (world.report()["faults_injected"], q("SELECT state, count(*) FROM replies GROUP BY state"),
                 tail(logs))
            time.sleep(2.0)  # more rounds of every path on every replica: a late duplicate would show now
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            codes = {rid: p.wait(20) for rid, p in procs.items()}
        report = world.report()
    elapsed = time.monotonic() - t0

    try:
        per = world.replies_by(bot.id)
        states = dict(q("SELECT state, count(*) FROM replies GROUP BY state"))
        events = q("SELECT parent_id, attempt, kind, owner FROM events")
        ordered = q("SELECT parent_id, attempt, kind, owner, at FROM events ORDER BY id")
        revision = q("SELECT version_num FROM alembic_version")
    finally:
        db.dispose()

    passes = {rid: sweep_passes(logs / f"{rid}.log") for rid in procs}
    leased = {rid: sum(p["leased"] for p in ps) for rid, ps in passes.items()}
    # Every leased row of every logged pass has exactly one count: a verdict, a later look, or "moved" (changed
    # under the lease by another writer before the verdict committed). Verifications inside a sweep's own close
    # are counted by the close.
    unaccounted = {rid: sum(p["leased"] - p["closed"] - p["not_landed"] - p["gave_up"] - p["left_open"] - p["waiting"]
                            - p["reconciled"] - p["moved"] - p["verified"] + p["verified_on_close"] for p in ps)
                   for rid, ps in passes.items()}
    moved = {rid: sweep_passes(logs / f"{rid}.log", "replyd.sweep.row_moved") for rid in procs}
    # What moved a leased row must be another writer's own step (a late close, a re-find's claim, a running
    # send's deadline pushed on), never another replica's sweep: a verdict by a different owner on that (row,
    # attempt) while the lease was held, with no such step to explain it, is a lease broken or expiring during a
    # read-back. (A step's timestamp is taken before its commit: it may precede the lease by a moment.)
    sweep_kinds = (*DECISIONS, "verified", "reconciled", "swept_unknown", "duplicate_detected", "excused",
                   "proven_not_landed", "unconfirmed")
    stolen, why_moved = [], Counter()
    for rid, recs in moved.items():
        for m in recs:
            # (A re-find's claim of a judged row records the next attempt: any later attempt's step counts.)
            near = [(k, a, o, at) for p, a, k, o, at in ordered if p == m["parent_id"] and a >= m["attempt"]
                    and m["leased_at"] - 2.0 <= at <= m["at"] + 0.001]
            steps = [k for k, a, o, at in near if k not in sweep_kinds]
            others = [(k, o) for k, a, o, at in near
                      if k in sweep_kinds and o != rid and a == m["attempt"] and at >= m["leased_at"]]
            why_moved[steps[-1] if steps else "(no event: a deadline pushed on)"] += 1
            if others and not steps:
                stolen.append((rid, m["parent_id"], m["attempt"], m["state"], near))
    decisions = Counter((p, a) for p, a, k, _ in events if k in DECISIONS)
    closes = Counter(p for p, _, k, _ in events if k in CLOSES)
    sweep_by_owner = Counter(o for _, _, k, o in events if k in DECISIONS)
    claims_by_owner = Counter(o for _, _, k, o in events if k == "claimed")
    faults = report["faults_injected"]
    print(f"\nreplicas: {len(parents)} parents in {elapsed:.1f}s, r2 SIGKILLed at {killed_at:.1f}s; "
          f"faults {dict(faults)}; creates {report['creates_attempted']}; duplicates {report['duplicates']}; "
          f"rows {states}; sweep decisions by owner {dict(sweep_by_owner)}; claims by owner {dict(claims_by_owner)}; "
          f"rows leased by owner {leased}, rows moved under a lease {sum(len(m) for m in moved.values())} "
          f"(first change: {dict(why_moved)}); "
          f"open rows left by the killed replica {len(orphans)}; "
          f"exit codes {codes}")

    # The platform's count: every parent answered exactly once, none twice.
    assert report["duplicates"] == 0, report
    assert [per.get(p, 0) for p in parents] == [1] * len(parents)
    assert sum(faults.values()) >= 5 and len(faults) >= 2, faults  # the run really met several kinds of fault
    # The log: one row per parent, all closed, nothing left open; schema migrated once by the racing starts.
    assert states == {st.CLOSED: len(parents)}, states
    assert revision == [(migrate.head(),)]
    assert all(closes[p] == 1 for p in parents), {p: closes[p] for p in parents if closes[p] != 1}
    # The sweep: at most one verdict per (row, attempt), and more than one replica gave verdicts.
    assert max(decisions.values()) == 1, [k for k, n in decisions.items() if n > 1]
    verifications = Counter((p, a) for p, a, k, _ in events if k == "verified")  # every close verified once
    assert max(verifications.values()) == 1, [k for k, n in verifications.items() if n > 1]
    assert sum(1 for _, _, k, _ in events if k == "swept_found") >= 1 and sum(1 for _, _, k, _ in events if k == "not_landed") >= 1
    assert len(sweep_by_owner) >= 2, sweep_by_owner
    # No row was read back by two replicas at once, and every leased row is accounted for.
    assert all(n == 0 for n in unaccounted.values()), unaccounted
    assert not stolen, stolen
    assert sum(leased.values()) >= len(decisions)
    assert len(claims_by_owner) >= 3 and claims_by_owner["r2"] >= 1, claims_by_owner  # pollers on every replica claimed
    # What the SIGKILL cut off: each open row of the dead replica got one verdict from a surviving one.
    assert orphans
    for parent, attempt in orphans:
        verdicts = [o for p, a, k, o in events if p == parent and a == attempt and k in DECISIONS]
        assert len(verdicts) == 1 and verdicts[0] != "r2", (parent, attempt, verdicts)
    assert codes["r2"] == -signal.SIGKILL and all(codes[r] == 0 for r in ("r1", "r3", "r2b")), codes
