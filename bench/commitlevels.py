"""What a failover-proof claim costs: a guarded post per ``store.claim_commit`` level on a real HA pair.

A primary and a synchronous streaming standby (``chaos.pgcluster``, loopback), one guard over the memory
platform (the send costs nothing, so the figure is the store's). The levels run interleaved in rounds, so
machine noise falls on all of them alike; the figure is the median and p99 of one ``Guard.post`` (claim,
send, close) per level, and its ratio to ``local`` (the primary's disk only, what a failover can lose).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Table

LEVELS = ("local", "on", "remote_write", "remote_apply")


def measure(posts: int = 1000, rounds: int = 10) -> dict[str, Any]:
    """Median/p99 microseconds of a guarded post per level, ``posts`` per level in ``rounds`` interleaved rounds."""
    from chaos.pgcluster import PgPair, unavailable
    from replyd.guard import Guard
    from replyd.platforms.memory import MemoryPlatform
    from replyd.store import Store

    why = unavailable()
    if why:
        return {"error": why}
    base = Path(tempfile.mkdtemp(prefix="replyd-bench-ha-", dir="/tmp"))
    os.chmod(base, 0o755)
    pair = PgPair(base / "pg", sync=True).start()
    try:
        Store.open(pair.url()).dispose()
        guards = {}
        for level in LEVELS:
            store = Store.open(pair.url(), claim_commit=level)
            plat = MemoryPlatform(instance=f"memory:bench-{level}")
            guards[level] = (store, plat, Guard(store, plat, plat.whoami(), watch_interval_s=None))
        times: dict[str, list[float]] = {lv: [] for lv in LEVELS}
        per_round = max(1, posts // rounds)
        for r in range(rounds):
            for level in LEVELS:
                _, plat, guard = guards[level]
                for i in range(per_round):
                    p = plat.add_parent(f"{r}-{i}")
                    t0 = time.perf_counter()
                    guard.post(p, "x")
                    times[level].append(time.perf_counter() - t0)
        for store, _, _ in guards.values():
            store.dispose()
    finally:
        pair.stop()
        shutil.rmtree(base, ignore_errors=True)
    out = {}
    for level, ts in times.items():
        ts.sort()
        out[level] = {"p50_us": statistics.median(ts) * 1e6, "p99_us": ts[int(0.99 * (len(ts) - 1))] * 1e6,
                      "n": len(ts)}
    return {"levels": out, "posts": posts, "rounds": rounds}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The commit-level table."""
    if "error" in res:
        return [Table("8. Claim commit levels: not measured", ["why"], [[res["error"]]])]
    t = Table("8. Claim commit levels on a primary + synchronous standby (loopback)",
              ["store.claim_commit", "posts", "guarded post p50 µs", "p99 µs", "p50 vs local"])
    base = res["levels"]["local"]["p50_us"]
    for level, v in res["levels"].items():
        t.rows.append([f"`{level}`", f"{v['n']:,}", f"{v['p50_us']:.0f}", f"{v['p99_us']:.0f}",
                       f"{v['p50_us'] / base:.2f}×"])
    t.notes.append(
        "One `Guard.post` (claim committed at the level, memory platform send, relaxed close) per parent, the four "
        "levels interleaved in rounds on the same pair (`chaos/pgcluster.py`: `synchronous_standby_names = "
        "'standby'`, the standby streaming over loopback). `local` waits for the primary's disk only (a failover "
        "can lose the claim); `on` and `remote_write` wait for the standby to flush / write it; `remote_apply` for "
        "the standby to apply it (0 duplicates in `docs/RELIABILITY.md`, *PostgreSQL failover*). Across a network "
        f"each synchronous level adds the round trip to the standby to every claim. Command: `{cmd} --only commitlevels`."
    )
    return [t]
