"""The asyncio face against the sync face, side by side in one run, the send stubbed (memory platform).

    PYTHONPATH=. python -m bench.aio [--posts 2000] [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

Sections ``aio`` (``measure``/``tables``) and ``aiolag`` (``measure_lag``/``lag_tables``) of ``bench/run.py``.

Per database: the median cost per post of ``Guard.post`` and of ``await AsyncGuard.post`` (one of each in
turn, on the same store, so a machine whose load moves during the run loads both faces alike), their ratio,
the same with the stub send a coroutine (``asend``: a bot's own async send, no thread hop for it), and the loop-lag probe (a task sleeping 1 ms and recording its overshoot) through
``--concurrent`` posts gathered at once on the async face, and through the same posts made with the sync
guard called inside the loop (the naive side: its stall measured the same way).

``--lag-parents N`` (the loop-lag run): the sim in its own process losing 20 % of create answers, N parents,
``await g.post`` on each plus 3 rival posts per parent from other tasks (4N posts in flight together, started
50 per loop turn), through a bot's own ``httpx.AsyncClient`` (``OwnPlatform``); the probe runs from the first
post to the last outcome; then the daemon's way on (sweep once due, offer again) until every row is closed, and
the replies counted on the sim. ``--lag-url URL``: one run on that store only (section 12 runs each so, in a
fresh interpreter: ``_lag_alone``). Before the run ``gc.freeze()`` moves the start-up heap (the imported modules)
out of the collector's way, as docs/LIBRARY.md advises: without it one full collection stalled the loop 78-93
ms here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa
import structlog

from bench.common import Table, fmt_ratio, fmt_us, pg_available, pg_databases, sqlite_url, tmpdir, verdict
from replyd.aio import AsyncGuard
from replyd.guard import Guard
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store


def _fresh_pg(admin_url: str) -> tuple[str, Any]:
    """A new PostgreSQL database for this run; returns its URL and a function that drops it."""
    name = f"replyd_bench_aio_{uuid.uuid4().hex[:8]}"
    eng = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin_url.rsplit("/", 1)[0] + f"/{name}"

    def drop() -> None:
        """Drop the run's database, its connections with it."""
        with eng.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        eng.dispose()

    return url, drop


def _lag_stats(lags: list[float]) -> dict[str, float]:
    """p99 and max of the probe's overshoots, in ms."""
    ms = sorted(x * 1000 for x in lags) or [0.0]
    return {"p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2), "max_ms": round(ms[-1], 2), "probes": len(ms)}


async def _probe(lags: list[float], stop: asyncio.Event, spans: list[tuple[float, float]] | None = None) -> None:
    """Sleep 1 ms over and over until ``stop``, recording each overshoot: how long the loop was held (and, in
    ``spans``, each probe's start and end, to set beside the collector's pauses)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        t1 = time.perf_counter()
        lags.append(t1 - t0 - 0.001)
        if spans is not None:
            spans.append((t0, t1))


class GcPauses:
    """The garbage collector's pauses, timed through ``gc.callbacks``: which of the loop's stalls were the
    interpreter's full collections rather than anything the face did."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # start, end, generation
        self._t0 = 0.0

    def __enter__(self) -> GcPauses:
        import gc

        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((self._t0, time.perf_counter(), info["generation"]))

    def split(self, lags: list[float], spans: list[tuple[float, float]]) -> dict[str, float]:
        """How many full (gen-2) collections ran and the longest pause of any generation; and the probe's max lag
        with the collector's time inside each probe taken out (what the loop was held by everything else)."""
        import bisect

        full = [(a, b) for a, b, g in self.pauses if g == 2]
        starts = [a for a, _b, _g in self.pauses]
        clean = []
        for lag, (t0, t1) in zip(lags, spans, strict=True):
            i = max(bisect.bisect_left(starts, t0) - 1, 0)  # pauses are in time order: only those near the probe
            in_gc = 0.0
            for a, b, _g in self.pauses[i:]:
                if a >= t1:
                    break
                in_gc += max(0.0, min(b, t1) - max(a, t0))
            clean.append(lag - in_gc)
        return {"gc_full_n": len(full),
                "gc_max_ms": round(max((b - a for a, b, _g in self.pauses), default=0.0) * 1000, 2),
                "max_ms_outside_gc": round(max(clean, default=0.0) * 1000, 2)}


class AsyncStubPlatform(MemoryPlatform):
    """The stubbed send as a coroutine (``AsyncSend``): what a bot's own async send costs the face, minus the network."""

    async def asend(self, parent: Any, text: str, *, provider_key: str) -> Any:
        """The memory platform's send, awaited on the loop."""
        return self.send(parent, text, provider_key=provider_key)


def _nothing() -> None:
    """An empty store call: what one round trip to the store's thread costs by itself."""


def run(url: str, posts: int, concurrent: int, durability: str = "as_asked") -> dict[str, Any]:
    """One database's figures."""
    store = Store.open(url, durability=durability)
    plat = MemoryPlatform(listing_delay_s=5.0)
    me = plat.whoami()
    sync = Guard(store, plat, me, watch_interval_s=None)
    aplat = AsyncStubPlatform(instance="memory:async-stub", listing_delay_s=5.0)
    per_sync: list[float] = []

    async def on_loop() -> dict[str, Any]:
        """The posts in turn on each face, then the two loop-lag runs; the async side's figures."""
        g = AsyncGuard(store, plat, me, watch_interval_s=None)
        ga = AsyncGuard(store, aplat, aplat.whoami(), watch_interval_s=None)
        per_async, per_asend, per_hop = [], [], []
        for i in range(posts):  # in turn: sync, async (sync send on a thread), async (asend), a bare round trip
            p = plat.add_parent(f"s{i}")
            t0 = time.perf_counter()
            sync.post(p, "x")
            per_sync.append(time.perf_counter() - t0)
            p = plat.add_parent(f"a{i}")
            t0 = time.perf_counter()
            await g.post(p, "x")
            per_async.append(time.perf_counter() - t0)
            p = aplat.add_parent(f"e{i}")
            t0 = time.perf_counter()
            await ga.post(p, "x")
            per_asend.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await ga.store_thread.run(_nothing)
            per_hop.append(time.perf_counter() - t0)
        await ga.aclose()
        lags: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(_probe(lags, stop))
        await asyncio.gather(*(g.post(plat.add_parent(f"c{i}"), "x") for i in range(concurrent)))
        stop.set()
        await task
        naive: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(_probe(naive, stop))

        async def naive_post(i: int) -> None:
            """One sync post made inside a coroutine: what a bot that ignores the async face does."""
            sync.post(plat.add_parent(f"n{i}"), "x")  # the sync library called in the loop

        await asyncio.gather(*(naive_post(i) for i in range(concurrent)))
        stop.set()
        await task
        await g.aclose()
        return {"per_async": per_async, "per_asend": per_asend, "per_hop": per_hop, "lag": _lag_stats(lags),
                "naive_lag": _lag_stats(naive)}

    got = asyncio.run(on_loop())
    store.dispose()
    s_med, a_med = statistics.median(per_sync), statistics.median(got["per_async"])
    e_med = statistics.median(got["per_asend"])
    return {"durability": durability, "sync_us": round(s_med * 1e6, 1), "async_us": round(a_med * 1e6, 1),
            "ratio": round(a_med / s_med, 3), "async_asend_us": round(e_med * 1e6, 1),
            "ratio_asend": round(e_med / s_med, 3), "hop_us": round(statistics.median(got["per_hop"]) * 1e6, 1),
            "loop_lag_async": got["lag"],
            "loop_lag_sync_in_loop": got["naive_lag"]}


def lag_run(url: str, parents: int, platform: str = "own") -> dict[str, Any]:
    """The loop-lag run on one database: 4 posts per parent in flight at once, 20 % of answers lost;
    ``platform`` "own" (a bot's own httpx.AsyncClient behind OwnPlatform) or "mastodon" (the adapter's asend)."""
    import gc
    import random

    from replyd import aio
    from replyd.platforms.own import OwnPlatform
    from tests.test_aio import BOT_TOKEN, bot_client, bot_replies, own_calls, parents_on, start_sim

    with start_sim("--lost-drop-rate", "0.2", "--seed", "31") as sim:
        ps = parents_on(sim, parents)

        async def go() -> dict[str, Any]:
            """The probed burst, then sweeps and offers until every row is closed."""
            async with bot_client() as client:
                plat: Any = OwnPlatform(instance=f"mastodon:{sim.base_url}", listing_delay_s=0.5,
                                        **own_calls(sim.base_url, client))
                settings = None
                if platform == "mastodon":
                    plat, settings = "mastodon", {"base_url": sim.base_url, "token": BOT_TOKEN,
                                                  "listing_delay_s": 0.5, "timeout_s": 10.0}
                async with aio.open_guard(url, plat, settings, send_timeout_s=10.0) as g:
                    gc.collect()
                    gc.freeze()
                    lags: list[float] = []
                    spans: list[tuple[float, float]] = []
                    stop = asyncio.Event()
                    gcp = GcPauses().__enter__()
                    probe = asyncio.create_task(_probe(lags, stop, spans))
                    calls = [(p, f"answer to {p.id}") for p in ps] + [(p, "rival") for p in ps for _ in range(3)]
                    random.Random(31).shuffle(calls)
                    t0 = time.perf_counter()
                    tasks = []
                    for i, (p, text) in enumerate(calls):
                        tasks.append(asyncio.create_task(g.post(p, text)))
                        if i % 50 == 49:
                            await asyncio.sleep(0)  # a burst arrives over loop turns, not in one callback
                    outs = await asyncio.gather(*tasks)
                    posts_s = time.perf_counter() - t0
                    stop.set()
                    await probe
                    gcp.__exit__()
                    states: dict[str, int] = {}
                    for _ in range(6):  # the daemon's way on, outside the probed run
                        await asyncio.sleep(10.0 + 0.7)
                        await g.sweep()
                        states = {}
                        for p in ps:
                            row = await g.guard.store_thread.run(g.store.get, g.guard.key(p.id))
                            states[row.state] = states.get(row.state, 0) + 1
                        if states.get("closed") == len(ps):
                            break
                        await asyncio.gather(*(g.post(p, f"answer to {p.id}", path="refind") for p in ps))
            gc.unfreeze()
            by: dict[str, int] = {}
            for o in outs:
                by[o.status.value] = by.get(o.status.value, 0) + 1
            return {"posts": len(calls), "posts_s": round(posts_s, 2), "outcomes": by, "states": states,
                    "loop_lag": {**_lag_stats(lags), **gcp.split(lags, spans)}}

        got = asyncio.run(go())
        counts = bot_replies(sim)
        report = sim.report()
    got["lost_answers"] = report["faults_injected"].get("lost_drop", 0)
    got["parents_not_one_reply"] = sum(1 for p in ps if counts.get(p.id) != 1)
    got["duplicates_on_sim"] = report["duplicates"]
    return got


# The asyncio face's targets (docs/BENCHMARKS.md sections 11 and 12).
RATIO_MAX = 1.2
LAG_P99_MS, LAG_MAX_MS = 5.0, 20.0
DBS = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}


def measure(posts: int = 1000, concurrent: int = 300,
            durabilities: tuple[str, ...] = ("as_asked", "relaxed")) -> dict[str, Any]:
    """``run`` on SQLite and on PostgreSQL (when it answers) for each durability; one row per pair."""
    rows: list[dict[str, Any]] = []
    with tmpdir("aio") as d:
        for dur in durabilities:
            rows.append({"db": "sqlite", **run(sqlite_url(d / f"{dur}.sqlite3"), posts, concurrent, dur)})
            if pg_available():
                with pg_databases(1, "aio") as [url]:
                    rows.append({"db": "postgresql", **run(url, posts, concurrent, dur)})
    return {"posts": posts, "concurrent": concurrent, "rows": rows}


def _lag_cell(lag: dict[str, float]) -> str:
    """p99 / max of a probe, for a table cell."""
    return f"{lag['p99_ms']:.1f} / {lag['max_ms']:.1f} ms"


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """Section 11: the faces' cost per post side by side, the loop's lag and the naive stall."""
    t = Table(f"11. The asyncio face against the sync face, send stubbed: {res['posts']:,} posts each, "
              f"{res['concurrent']:,} gathered for the loop lag",
              ["database", "durability", "sync per post", "async, stub send on a thread", "ratio",
               "async, stub `asend`", "ratio", "one store-thread round trip, empty", "loop lag, async face (p99 / max)",
               "sync guard in the loop: longest stall"])
    for r in res["rows"]:
        naive = r["loop_lag_sync_in_loop"]
        t.rows.append([DBS[r["db"]], r["durability"].replace("_", " "), f"{fmt_us(r['sync_us'])} µs",
                       f"{fmt_us(r['async_us'])} µs", fmt_ratio(r["ratio"]), f"{fmt_us(r['async_asend_us'])} µs",
                       fmt_ratio(r["ratio_asend"]), f"{fmt_us(r['hop_us'])} µs", _lag_cell(r["loop_lag_async"]),
                       f"{naive['max_ms']:,.0f} ms ({naive['probes']:,} probe{'s' if naive['probes'] != 1 else ''})"])
    for r in res["rows"]:
        if r["durability"] == "as_asked":  # the target is the default durability's
            t.verdicts.append(verdict(r["ratio_asend"] <= RATIO_MAX,
                                      f"{DBS[r['db']]}: async face (`asend`) / sync face {r['ratio_asend']:.2f}× "
                                      f"(goal ≤ {RATIO_MAX}×)"))
    t.notes.append(
        "The same store, the send stubbed (memory platform). Every post is made three ways in turn — `Guard.post`, "
        "`await AsyncGuard.post` with the stub's sync send (run on a worker thread, as a sync adapter's is), and "
        "`await AsyncGuard.post` on a platform whose stub send is a coroutine (`asend`: a bot's own async send, no "
        "thread hop for it) — so a load that moves during the run weighs on every face alike; medians per post. "
        "\"as asked\": the claim commits durably (SQLite `FULL`), the close relaxed; \"relaxed\": no fsync at all.")
    t.notes.append(
        f"Loop lag: a probe task sleeps 1 ms over and over and records its overshoot, through {res['concurrent']:,} "
        "posts gathered at once on the async face, and through the same posts made by the sync guard called inside "
        "the loop (the naive side): that holds the loop for the whole run, so its probes are few and its stall is "
        "about the run's length.")
    t.notes.append(
        "Reading: the ratio is what the face adds to a post's store work and send. The durable claim never runs on "
        "the loop (an fsync there would stall every task): on SQLite it is a round trip to the store's own thread "
        "and the relaxed close is written on the loop when it needs no wait; on PostgreSQL the claim and the close "
        "go through psycopg's async connection on the loop. A sync adapter's send adds a worker-thread round trip, "
        "which `asend` avoids; hence the verdict on the `asend` ratio, the thread column beside it for comparison. "
        "On SQLite the `asend` post is the sync post's work plus one round trip to the store's thread (the durable "
        "claim); the round-trip column times that trip with an empty call, in the same rounds: two thread wake-ups "
        "the face cannot do without unless the fsync ran on the loop. "
        "Alone: `PYTHONPATH=. python -m bench.aio --posts N --concurrent N [--durability relaxed]` (JSON lines).")
    return [t]


def measure_lag(parents: int = 1000, platforms: tuple[str, ...] = ("own", "mastodon")) -> dict[str, Any]:
    """``lag_run`` on SQLite and on PostgreSQL (when it answers) for each platform; one row per pair."""
    rows: list[dict[str, Any]] = []
    with tmpdir("aiolag") as d:
        for plat in platforms:
            rows.append({"db": "sqlite", "platform": plat, "load": os.getloadavg()[0],
                         **_lag_alone(sqlite_url(d / f"{plat}.sqlite3"), parents, plat)})
            if pg_available():
                with pg_databases(1, "aiolag") as [url]:
                    rows.append({"db": "postgresql", "platform": plat, "load": os.getloadavg()[0],
                                 **_lag_alone(url, parents, plat)})
    return {"parents": parents, "rows": rows}


def _lag_alone(url: str, parents: int, platform: str) -> dict[str, Any]:
    """``lag_run`` in a fresh interpreter, as a bot's own process: a collection's pause walks the process's heap,
    so a run made after the other sections (a million-row growth run among them) would time their leftovers."""
    import subprocess
    import sys

    from bench.common import ROOT

    done = subprocess.run([sys.executable, "-m", "bench.aio", "--lag-parents", str(parents), "--lag-platform",
                           platform, "--lag-url", url], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"db"')]
    if done.returncode or not lines:
        raise RuntimeError(f"lag run on {platform} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    got: dict[str, Any] = json.loads(lines[-1])
    for k in ("db", "load", "platform"):
        got.pop(k, None)
    return got


def lag_tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """Section 12: the loop's lag through 4 posts per parent in flight, replies counted on the sim."""
    n = res["parents"]
    t = Table(f"12. The loop's lag through {4 * n:,} concurrent posts on {n:,} parents, 20 % of answers lost, "
              "counted on the sim",
              ["database", "platform", "posts", "posting, s", "outcomes", "answers lost (sim)", "rows closed",
               "parents without exactly one reply", "duplicates (sim)", "loop lag p99", "loop lag max",
               "max with the collector's pauses taken out", "full collections; longest pause", "probes", "load (1 min) at start"])
    for r in res["rows"]:
        outs = ", ".join(f"{k} {v:,}" for k, v in sorted(r["outcomes"].items()))
        t.rows.append([DBS[r["db"]], r["platform"], f"{r['posts']:,}", f"{r['posts_s']:.1f}", outs,
                       f"{r['lost_answers']:,}", f"{r['states'].get('closed', 0):,} / {n:,}",
                       str(r["parents_not_one_reply"]), str(r["duplicates_on_sim"]),
                       f"{r['loop_lag']['p99_ms']:.1f} ms", f"{r['loop_lag']['max_ms']:.1f} ms",
                       f"{r['loop_lag'].get('max_ms_outside_gc', float('nan')):.1f} ms",
                       f"{r['loop_lag'].get('gc_full_n', 0)}; {r['loop_lag'].get('gc_max_ms', 0.0):.1f} ms",
                       f"{r['loop_lag']['probes']:,}", f"{r['load']:.1f}"])
    for r in res["rows"]:
        lag = r["loop_lag"]
        t.verdicts.append(verdict(lag["p99_ms"] <= LAG_P99_MS and lag["max_ms"] <= LAG_MAX_MS,
                                  f"{DBS[r['db']]}, {r['platform']}: loop lag p99 {lag['p99_ms']:.1f} ms, max "
                                  f"{lag['max_ms']:.1f} ms (goal ≤ {LAG_P99_MS:.0f} and ≤ {LAG_MAX_MS:.0f} ms)"))
    bad = [f"{DBS[r['db']]}, {r['platform']}" for r in res["rows"]
           if r["parents_not_one_reply"] or r["duplicates_on_sim"]]
    t.verdicts.append(verdict(not bad, "one reply per parent on the sim, every run" + (
        f" (not: {'; '.join(bad)})" if bad else "")))
    t.notes.append(
        "The sim runs in its own process (its CPU is not the loop's) and drops 20 % of create answers after "
        f"creating the reply. {n:,} parents; `await g.post` on each plus 3 rival posts per parent from other tasks "
        f"({4 * n:,} posts in flight together, started 50 per loop turn, in a shuffled order). Platform \"own\": a "
        "bot's own `httpx.AsyncClient` behind `OwnPlatform`; \"mastodon\": the Mastodon adapter's `asend`. The probe "
        "(a task sleeping 1 ms, its overshoot recorded) runs from the first post to the last outcome. Then the "
        "daemon's way on, outside the probed run: sweep once every open row is due, offer the parents again, until "
        "every row is closed; replies are counted on the sim. Each run in a fresh interpreter, as a bot's own process "
        "(a collection walks the process's heap: in the benchmark's own process it would also walk what the "
        "sections before it left). Before the run `gc.freeze()` moves the start-up heap "
        "out of the collector's way, as docs/LIBRARY.md advises: without it one full collection can stall the loop "
        "for tens of ms. `AsyncGuard`'s window (following the loop's lag, capped by `max_in_flight`) bounds the posts past their claim: without it every parent "
        "is claimed at once and posts give up, their budgets spent waiting for the store and its pool.")
    t.notes.append(
        "\"Max with the collector's pauses taken out\": each probe's overshoot less the time garbage collections ran "
        "inside its sleep (`gc.callbacks` time every collection), the largest; \"full collections; longest pause\": "
        "how many generation-2 collections ran during the probed run, and the longest pause of any generation. A "
        "collection walks every live object of the "
        "generation (a full one: the thousands of posts in flight included) with the loop stopped: it is the interpreter's pause, "
        "not a call of the face, and the verdict above counts it all the same.")
    t.notes.append("Alone: `PYTHONPATH=. python -m bench.aio --lag-parents N --lag-platform own|mastodon` (JSON lines).")
    return [t]


def main() -> None:
    """Print one JSON line per database."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--posts", type=int, default=2000)
    ap.add_argument("--concurrent", type=int, default=1000)
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--sqlite", default=f"sqlite:////tmp/replyd-bench-aio-{uuid.uuid4().hex[:8]}.sqlite3")
    ap.add_argument("--durability", default="as_asked", choices=["as_asked", "durable", "relaxed"])
    ap.add_argument("--lag-parents", type=int, default=0, help="run the loop-lag run instead (1000)")
    ap.add_argument("--lag-platform", default="own", choices=["own", "mastodon"])
    ap.add_argument("--lag-url", default="", help="with --lag-parents: one run on this store URL only")
    a = ap.parse_args()
    # Warnings only, as a quiet bot's production log: an info line per claim and per post is the logger's cost,
    # the same on both faces, and stdout's.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if a.lag_parents and a.lag_url:
        print(json.dumps({"db": a.lag_url.split(":", 1)[0].split("+", 1)[0], "load": os.getloadavg(),
                          "platform": a.lag_platform, **lag_run(a.lag_url, a.lag_parents, a.lag_platform)}))
        return
    if a.lag_parents:
        print(json.dumps({"db": "sqlite", "load": os.getloadavg(), "platform": a.lag_platform,
                          **lag_run(a.sqlite, a.lag_parents, a.lag_platform)}))
        url, drop = _fresh_pg(a.pg)
        try:
            print(json.dumps({"db": "postgresql", "load": os.getloadavg(), "platform": a.lag_platform,
                              **lag_run(url, a.lag_parents, a.lag_platform)}))
        finally:
            drop()
        return
    print(json.dumps({"db": "sqlite", **run(a.sqlite, a.posts, a.concurrent, a.durability)}))
    url, drop = _fresh_pg(a.pg)
    try:
        print(json.dumps({"db": "postgresql", **run(url, a.posts, a.concurrent, a.durability)}))
    finally:
        drop()


if __name__ == "__main__":
    main()
