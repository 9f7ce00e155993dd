"""A fleet: replicas on one PostgreSQL share the bots, against one replica alone with the same bots.

    PYTHONPATH=. python -m bench.fleet --bots 1000 --replicas 3 [--idle-s 60] [--refind-s 60]

The sim runs in its own process (``bench.manybots``' sim: N bot accounts, a request counter, a burst route).
One config holds N bots (inbox every 5 s, re-find every ``--refind-s``), a PostgreSQL store and
``fleet.enabled = true`` with the default heartbeat and bot lease. First one ``replyd run`` replica serves
every bot: once it holds every bot's lease and has settled, the sim counts its reads (every GET) over the
idle window, and /proc counts the replica's CPU. Then the other replicas start; once the leases are spread
over all of them and have settled, the same window again. The goal: the fleet reads the platform like one
replica (at most 1.1x), and each replica's idle CPU is about a third of the lone one's. Last, one mention
to every bot at once: the time until the last is answered, and duplicates, counted on the sim.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import sqlalchemy as sa

from bench.common import Table, pg_databases, tmpdir, verdict
from bench.manybots import INBOX_S, ROOT, _start_sim, _stop, bot_token, cpu_s, proc_status, write_config

GOALS = {"reads_ratio": 1.1, "cpu_share": 0.4}
FLEET = "enabled = true"  # the default heartbeat (5 s) and bot lease (20 s)


def _reads(http: httpx.Client) -> int:
    """Every GET the sim has served so far."""
    return sum(v for k, v in http.get("/_bench/counts").json().items() if k.startswith("GET "))


def _holders(db: sa.Engine) -> dict[str, int]:
    """Live bot leases per replica, on the database's clock."""
    try:
        with db.connect() as c:
            rows = c.execute(sa.text(
                "SELECT holder, count(*) FROM bot_leases WHERE holder IS NOT NULL"
                " AND until > extract(epoch from clock_timestamp()) GROUP BY holder")).all()
    except sa.exc.ProgrammingError:  # not migrated yet
        return {}
    return {str(h): int(n) for h, n in rows}


def _settle(db: sa.Engine, procs: dict[str, subprocess.Popen[bytes]], n: int, timeout_s: float) -> float:
    """Seconds until every bot is held and every running replica holds some."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for rid, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"replica {rid} exited {p.returncode}")
        held = _holders(db)
        if sum(held.values()) == n and set(held) == set(procs):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"the leases did not settle: {_holders(db)}")


def _idle(http: httpx.Client, procs: dict[str, subprocess.Popen[bytes]], idle_s: float) -> dict[str, Any]:
    """Reads on the sim and each replica's CPU and RSS over one idle window."""
    r0, c0, t0 = _reads(http), {rid: cpu_s(p.pid) for rid, p in procs.items()}, time.monotonic()
    rss = dict.fromkeys(procs, 0)
    while time.monotonic() - t0 < idle_s:
        for rid, p in procs.items():
            rss[rid] = max(rss[rid], proc_status(p.pid)["VmRSS"])
        time.sleep(1.0)
    window = time.monotonic() - t0
    reads = _reads(http) - r0
    cpu = {rid: round(100 * (cpu_s(p.pid) - c0[rid]) / window, 1) for rid, p in procs.items()}
    return {"window_s": round(window, 1), "reads": reads, "reads_per_interval": round(reads * INBOX_S / window),
            "cpu_pct": cpu, "rss_mb": {rid: round(v / 1024) for rid, v in rss.items()}}


def measure(n: int = 1000, replicas: int = 3, *, idle_s: float = 60.0, refind_s: float = 60.0,
            settle_s: float = 20.0, answer_timeout_s: float = 120.0) -> dict[str, Any]:
    """One replica, then ``replicas`` of them, over one store and one sim; then a burst."""
    sim, base_url = _start_sim(n)
    http = httpx.Client(base_url=base_url, timeout=60)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with pg_databases(1, "fleet") as [url], tmpdir("fleet") as tmp:
            db = sa.create_engine(url)
            cfg = write_config(tmp / "fleet.toml", base_url, url, n, None, refind_s=refind_s, fleet=FLEET)
            env = {**os.environ, **{f"MB_TOKEN_{i:04d}": bot_token(i) for i in range(n)}, "PYTHONPATH": str(ROOT)}

            def start(rid: str) -> None:
                log = (tmp / f"{rid}.log").open("ab")
                procs[rid] = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg)],
                                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                              env={**env, "REPLYD_REPLICA_ID": rid})

            try:
                start("r1")
                settled_one_s = _settle(db, procs, n, 300)
                time.sleep(settle_s)
                one = _idle(http, procs, idle_s)
                print(json.dumps({"replicas": 1, **one}), flush=True)
                for i in range(2, replicas + 1):
                    start(f"r{i}")
                settled_many_s = _settle(db, procs, n, 300)
                time.sleep(settle_s)
                many = _idle(http, procs, idle_s)
                many["leases"] = _holders(db)
                print(json.dumps({"replicas": replicas, **many}), flush=True)
                b0 = time.monotonic()
                http.post("/_bench/burst")
                got: dict[str, Any] = {}
                while time.monotonic() - b0 < answer_timeout_s:
                    got = http.get("/_bench/answered").json()
                    if got["answered"] >= n:
                        break
                    time.sleep(0.1)
                time.sleep(3.0)  # a duplicate would land right after the first reply
                got = http.get("/_bench/answered").json()
            finally:
                for p in procs.values():
                    _stop(p)
                db.dispose()
    finally:
        http.close()
        _stop(sim)
    waits = got.get("waits") or []
    return {"bots": n, "replicas": replicas, "refind_s": refind_s, "inbox_s": INBOX_S, "one": one, "many": many,
            "settled_one_s": round(settled_one_s, 1), "settled_many_s": round(settled_many_s, 1),
            "answered": got.get("answered", 0), "duplicates": got.get("duplicates"),
            "answer_s_p50": round(statistics.median(waits), 2) if waits else None,
            "answer_s_max": round(waits[-1], 2) if waits else None,
            "load": " / ".join(f"{x:.2f}" for x in os.getloadavg())}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The fleet table: reads and CPU for one replica and for the fleet, and the burst."""
    one, many, k = res["one"], res["many"], res["replicas"]
    lone_cpu = next(iter(one["cpu_pct"].values()))
    t = Table(f"18. A fleet: {k} replicas share {res['bots']:,} bots on one PostgreSQL",
              ["replicas", "platform reads per 5 s", "idle CPU % of a core, each replica", "RSS MB, each",
               "bots held, each"])
    t.rows.append(["1", f"{one['reads_per_interval']:,}", f"{lone_cpu:.1f}", str(next(iter(one["rss_mb"].values()))),
                   f"{res['bots']:,}"])
    t.rows.append([str(k), f"{many['reads_per_interval']:,}", " / ".join(f"{v:.1f}" for v in many["cpu_pct"].values()),
                   " / ".join(str(v) for v in many["rss_mb"].values()),
                   " / ".join(str(many["leases"].get(r, 0)) for r in many["cpu_pct"])])
    ratio = many["reads"] / one["reads"] * one["window_s"] / many["window_s"] if one["reads"] else float("inf")
    share = max(many["cpu_pct"].values()) / lone_cpu if lone_cpu else float("inf")
    t.verdicts += [
        verdict(ratio <= GOALS["reads_ratio"], f"the fleet reads {ratio:.2f}x what one replica reads (goal ≤ 1.1x)"),
        verdict(share <= GOALS["cpu_share"],
                f"the busiest replica idles at {share:.2f}x the lone one's CPU (goal about a third, ≤ 0.4x)"),
        verdict(res["answered"] == res["bots"] and res["duplicates"] == 0,
                f"burst: {res['answered']:,} of {res['bots']:,} answered, {res['duplicates']} duplicates (sim); "
                f"the last {res['answer_s_max']} s after it, p50 {res['answer_s_p50']} s"),
    ]
    t.notes.append(f"Inbox every {res['inbox_s']:.0f} s, re-find every {res['refind_s']:.0f} s, "
                   f"idle windows of {one['window_s']:.0f} s. Leases settled in {res['settled_one_s']} s "
                   f"(one) and {res['settled_many_s']} s ({k}). Load average after: {res['load']}.")
    t.notes.append(f"Command: `{cmd}`.")
    return [t]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; one JSON line per phase, then the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bots", type=int, default=1000)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=60.0, help="each idle window (one re-find interval)")
    ap.add_argument("--refind-s", type=float, default=60.0)
    ap.add_argument("--settle-s", type=float, default=20.0, help="wait after the leases settle, before a window")
    a = ap.parse_args(argv)
    res = measure(a.bots, a.replicas, idle_s=a.idle_s, refind_s=a.refind_s, settle_s=a.settle_s)
    print(json.dumps(res, default=str))
    for t in tables(res, "PYTHONPATH=. python -m bench.fleet " + " ".join(argv or sys.argv[1:])):
        print(t.text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
