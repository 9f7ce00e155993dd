"""Section 3: races between real OS processes on SQLite and PostgreSQL.

40 processes released by one barrier on the same parent (sends must be 1),
repeated on fresh parents; and 8 processes each posting the same 1,000 parents
in different orders (sends must be 1,000). Sends are counted on the platform
(the journal file every process appends to), not in the log.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import queue
import time
from typing import Any

from bench.common import Table, fmt_s, med, pg_available, pg_databases, sqlite_url, tmpdir, verdict
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store


def _ctx() -> Any:
    # A fork server that has imported replyd once forks the racers quickly (no 1 s import per process),
    # and forks from a process without threads.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["bench.workers"])
    return ctx


def _run(ctx: Any, target: Any, args_for: Any, n: int, timeout_s: float = 300.0) -> list[Any]:
    barrier = ctx.Barrier(n, timeout=timeout_s)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    out: list[Any] = []
    try:
        while len(out) < n:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"race workers failed with exit codes {dead}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(out)} of {n} race workers reported in {timeout_s}s")
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                pass
    finally:
        for p in procs:
            p.join(max(5.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    return out


def _one_db(ctx: Any, url: str, d: Any, repeats: int, many_parents: int, many_procs: int, label: str) -> dict[str, Any]:
    from bench import workers

    res: dict[str, Any] = {"db": label}
    journal = str(d / f"{label}-one.jsonl")
    pids = [f"race-{k}" for k in range(repeats)]
    t0 = time.monotonic()
    reports = _run(ctx, workers.race_one, lambda i: (url, journal, pids), 40)
    res["one_total_s"] = time.monotonic() - t0
    walls, counts = [], collections.Counter()
    for pid in pids:
        rows = [r for rep in reports for r in rep if r[0] == pid]
        walls.append(max(r[3] for r in rows) - min(r[2] for r in rows))
        counts.update(r[1] for r in rows)
    plat = MemoryPlatform(journal=journal)
    sends = [plat.reply_count(pid) for pid in pids]
    res.update(one_walls=walls, one_sends=sends, one_outcomes=dict(counts), one_repeats=repeats)

    journal = str(d / f"{label}-many.jsonl")
    t0 = time.monotonic()
    reports = _run(ctx, workers.race_many, lambda i: (url, journal, many_parents, i), many_procs)
    res["many_total_s"] = time.monotonic() - t0
    sent = sum(r[0] for r in reports)
    wall = max(r[2] for r in reports) - min(r[1] for r in reports)
    replies = MemoryPlatform(journal=journal).replies()
    per_parent = collections.Counter(r["parent_id"] for r in replies)
    res.update(many_sent_reported=sent, many_replies=len(replies), many_parents_answered=len(per_parent),
               many_max_per_parent=max(per_parent.values()) if per_parent else 0, many_wall=wall,
               many_procs=many_procs, many_parents=many_parents)
    return res


def measure(*, repeats: int = 5, many_parents: int = 1000, many_procs: int = 8) -> dict[str, Any]:
    """Run both races on SQLite and (when reachable) PostgreSQL."""
    ctx = _ctx()
    out: dict[str, Any] = {"dbs": []}
    with tmpdir("races") as d:
        url = sqlite_url(d / "races.sqlite3")
        Store.open(url).dispose()
        out["dbs"].append(_one_db(ctx, url, d, repeats, many_parents, many_procs, "SQLite"))
        if pg_available():
            with pg_databases(1, "race") as urls:
                out["dbs"].append(_one_db(ctx, urls[0], d, repeats, many_parents, many_procs, "PostgreSQL"))
    return out


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The race table."""
    t = Table("3. Races between OS processes",
              ["database", "race", "sends on the platform", "wall time median s", "max s", "throughput"])
    ok_all = True
    for r in res["dbs"]:
        one_ok = all(s == 1 for s in r["one_sends"])
        ok_all &= one_ok
        t.rows.append([r["db"], f"40 processes, one parent (×{r['one_repeats']} parents)",
                       f"{'1 each' if one_ok else r['one_sends']}", fmt_s(med(r["one_walls"])), fmt_s(max(r["one_walls"])),
                       f"outcomes: {', '.join(f'{v} {k}' for k, v in sorted(r['one_outcomes'].items()))}"])
        many_ok = r["many_replies"] == r["many_parents"] == r["many_parents_answered"] and r["many_max_per_parent"] == 1
        ok_all &= many_ok
        tp = r["many_parents"] / r["many_wall"] if r["many_wall"] else float("nan")
        calls = r["many_parents"] * r["many_procs"] / r["many_wall"] if r["many_wall"] else float("nan")
        t.rows.append([r["db"], f"{r['many_procs']} processes × {r['many_parents']:,} parents",
                       f"{r['many_replies']:,}" + ("" if many_ok else " (WRONG)"), fmt_s(r["many_wall"]), "",
                       f"{tp:,.0f} answered parents/s; {calls:,.0f} guard calls/s"])
    t.verdicts.append(verdict(ok_all, "every race made exactly one send per parent"))
    t.notes.append(
        "Real OS processes (a fork server that preloaded replyd forks them), each with its own Store and Guard over "
        "the memory platform in journal mode; one barrier releases them. Wall time of the 40-process race: from the "
        "first process leaving the barrier to the last one getting its outcome, per parent; the 8 × 1,000 race: from "
        "the first start to the last finish. Sends are counted in the platform's journal, not in replyd's log."
    )
    return [t]
