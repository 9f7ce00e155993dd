"""PostgreSQL failover under two `replyd run` replicas: duplicates counted by the sim, per commit level.

    python -m chaos.failover [--parents 200] [--failovers 5] [--configs async,sync] [--json]

For each configuration a real primary and streaming standby are made (``chaos.pgcluster``), two
``replyd run`` processes share them through a multi-host URL (``target_session_attrs=read-write``), and
the simulated Mastodon (Idempotency-Key off, so the store is the only guard) posts parents over time.
Each failover first cuts the replication link for ``--lag-s`` (a partition, or a standby that fell behind:
the primary goes on committing what only it knows), then crashes the primary (``pg_ctl stop -m
immediate``), promotes the standby and rebuilds the old primary as the new standby.

* ``async``: the default claim commit, the standby asynchronous. Claims and cursors the primary committed
  during the cut are gone after the failover; the replicas find those parents again and answer again.
* ``sync``: ``synchronous_standby_names`` names the standby and ``store.claim_commit = "remote_apply"``. A
  claim does not return until the standby has it, so during the cut claims wait, nothing is sent, and the
  failover loses no claim.

The figures are the sim's: duplicates (more than one reply by the bot to a parent), lost (a parent with
none at the end). The claim latency of each ``synchronous_commit`` level is measured on the same pair.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos.pgcluster import PgPair, unavailable
from replyd import log
from replyd import store as st
from replyd.clock import SystemClock
from replyd.guard import Guard
from replyd.platforms.memory import MemoryPlatform
from replyd.sim import SimServer, World
from replyd.store import Store

ROOT = Path(__file__).resolve().parents[1]
BOT = "replybot"


def _config(path: Path, base_url: str, store_url: str, claim_commit: str | None) -> Path:
    level = f'claim_commit = "{claim_commit}"' if claim_commit else ""
    path.write_text(f"""
[store]
url = "{store_url}"
{level}

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 2.0

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
idempotency = false

[bots.pollers]
inbox_interval_s = 0.3
refind_interval_s = 1.0
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "template"
""")
    os.chmod(path, 0o600)
    return path


def _replica(cfg: Path, log: Path, n: int, token: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN": token, "REPLYD_REPLICA_ID": f"replica-{n}"}
    return subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=env, cwd=ROOT)


def _settled(url: str) -> bool:
    """True when every row is terminal (the store answers: a failover may still be under way)."""
    try:
        s = Store.open(url, migrate=False)
    except Exception:
        return False
    try:
        counts = s.counts()
        return bool(counts) and all(state in st.TERMINAL for (_, state) in counts)
    except Exception:
        return False
    finally:
        s.dispose()


def claim_latency_us(url: str, levels: tuple[str, ...], n: int = 200) -> dict[str, float]:
    """Median microseconds of one guarded post (claim + close) per ``synchronous_commit`` level of the claim."""
    out: dict[str, float] = {}
    for level in levels:
        store = Store.open(url, claim_commit=level)
        plat = MemoryPlatform(instance=f"memory:bench-{level}")
        guard = Guard(store, plat, plat.whoami(), watch_interval_s=None)
        times = []
        for i in range(n):
            p = plat.add_parent(f"{level}-{i}")
            t0 = time.perf_counter()
            guard.post(p, "x")
            times.append(time.perf_counter() - t0)
        store.dispose()
        out[level] = round(statistics.median(times) * 1e6, 1)
    return out


def run_config(name: str, *, parents: int, failovers: int, lag_s: float, workdir: Path,
               seed: int = 7, spacing_s: float = 6.0) -> dict[str, Any]:
    """One configuration: a fresh pair, two replicas, traffic, ``failovers`` failovers; the sim's figures."""
    sync = name == "sync"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o755)  # the postgres user walks into its data directories below
    pair = PgPair(workdir / "pg", sync=sync).start()
    world = World(SystemClock(), seed=seed, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    log = workdir / f"{name}.log"
    procs: list[subprocess.Popen] = []
    t_start = time.monotonic()
    try:
        Store.open(pair.url()).dispose()  # migrate once, before the replicas race to
        latency = claim_latency_us(pair.url(), ("local", "remote_write", "remote_apply") if sync else ("local",))
        with SimServer(world) as srv:
            cfg = _config(workdir / f"{name}.toml", srv.base_url, pair.url(), "remote_apply" if sync else None)
            procs = [_replica(cfg, log, n, bot.token) for n in (1, 2)]
            end = time.monotonic() + 60
            while time.monotonic() < end and log.read_text().count("replyd.daemon.started") < 2:
                time.sleep(0.2)
            # Parents keep arriving through every cut: the failovers fall in the middle of the traffic.
            rate = parents / ((failovers + 1) * spacing_s)
            traffic = world.start_traffic(rate, total=parents, target=BOT, users=25)
            for _ in range(failovers):
                time.sleep(spacing_s)
                pair.cut_replication()
                time.sleep(lag_s)
                pair.failover()
            traffic.join(parents / rate + 60)
            ids = [s.id for s in world.statuses.values() if not s.in_reply_to_id and s.account_id != bot.id]
            end = time.monotonic() + 120
            while time.monotonic() < end:
                if all(world.replies_by(bot.id).get(p) for p in ids) and _settled(pair.url()):
                    break
                time.sleep(0.5)
            time.sleep(3.0)  # more rounds of every path: nothing may answer again
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        failed_over = pair.failovers
        pair.stop()
    per = world.replies_by(bot.id)
    report = world.report()
    return {
        "config": name,
        "claim_commit": "remote_apply" if sync else "(server default)",
        "standby": "synchronous" if sync else "asynchronous",
        "parents": len(ids),
        "failovers": failed_over,
        "duplicates": report["duplicates"],
        "lost": sum(1 for p in ids if not per.get(p)),
        "answered": sum(1 for p in ids if per.get(p)),
        "claim_latency_us": latency,
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The RELIABILITY.md table."""
    head = ("| standby | claim commit | parents | failovers | duplicates (sim) | lost (sim) | "
            "median guarded post, µs, per level |\n|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['standby']} | `{r['claim_commit']}` | {r['parents']} | {r['failovers']} | {r['duplicates']} | "
        f"{r['lost']} | {', '.join(f'{k} {v}' for k, v in r['claim_latency_us'].items())} |\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print the table (or JSON)."""
    ap = argparse.ArgumentParser(prog="python -m chaos.failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parents", type=int, default=200)
    ap.add_argument("--failovers", type=int, default=5)
    ap.add_argument("--lag-s", type=float, default=1.5, help="how long the replication link is cut before each crash")
    ap.add_argument("--configs", default="async,sync")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    log.configure("console", "warning", sys.stderr)  # the harness's own guard (latency) logs only trouble
    why = unavailable()
    if why:
        print(f"chaos.failover: cannot make PostgreSQL clusters here: {why}", file=sys.stderr)
        return 2
    base = args.workdir or Path(tempfile.mkdtemp(prefix="replyd-failover-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)  # the postgres user walks into the clusters' directories below
    rows = [run_config(c, parents=args.parents, failovers=args.failovers, lag_s=args.lag_s, workdir=base / c)
            for c in args.configs.split(",")]
    print(json.dumps(rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
