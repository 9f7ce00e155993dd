"""The asyncio face against the sync face, side by side in one run (issue 31), the send stubbed (memory platform).

    PYTHONPATH=. python -m bench.aio [--posts 2000] [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

Per database: the median cost per post of ``Guard.post`` and of ``await AsyncGuard.post`` (one of each in
turn, on the same store, so a machine whose load moves during the run loads both faces alike), their ratio,
the same with the stub send a coroutine (``asend``: a bot's own async send, no thread hop for it), and the loop-lag probe (a task sleeping 1 ms and recording its overshoot) through
``--concurrent`` posts gathered at once on the async face, and through the same posts made with the sync
guard called inside the loop (the naive side: its stall measured the same way).

``--lag-parents N`` (issue 31's run): the sim in its own process losing 20 % of create answers, N parents,
``await g.post`` on each plus 3 rival posts per parent from other tasks (4N posts in flight together, started
50 per loop turn), through a bot's own ``httpx.AsyncClient`` (``OwnPlatform``); the probe runs from the first
post to the last outcome; then the daemon's way on (sweep once due, offer again) until every row is closed, and
the replies counted on the sim. Before the run ``gc.freeze()`` moves the start-up heap (the imported modules)
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
        with eng.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        eng.dispose()

    return url, drop


def _lag_stats(lags: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in lags) or [0.0]
    return {"p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2), "max_ms": round(ms[-1], 2), "probes": len(ms)}


async def _probe(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)


class AsyncStubPlatform(MemoryPlatform):
    """The stubbed send as a coroutine (``AsyncSend``): what a bot's own async send costs the face, minus the network."""

    async def asend(self, parent: Any, text: str, *, provider_key: str) -> Any:
        return self.send(parent, text, provider_key=provider_key)


def run(url: str, posts: int, concurrent: int, durability: str = "as_asked") -> dict[str, Any]:
    """One database's figures."""
    store = Store.open(url, durability=durability)
    plat = MemoryPlatform(listing_delay_s=5.0)
    me = plat.whoami()
    sync = Guard(store, plat, me, watch_interval_s=None)
    aplat = AsyncStubPlatform(instance="memory:async-stub", listing_delay_s=5.0)
    per_sync: list[float] = []

    async def on_loop() -> dict[str, Any]:
        g = AsyncGuard(store, plat, me, watch_interval_s=None)
        ga = AsyncGuard(store, aplat, aplat.whoami(), watch_interval_s=None)
        per_async, per_asend = [], []
        for i in range(posts):  # in turn: sync, async (sync send on a thread), async (asend)
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
            sync.post(plat.add_parent(f"n{i}"), "x")  # the sync library called in the loop

        await asyncio.gather(*(naive_post(i) for i in range(concurrent)))
        stop.set()
        await task
        await g.aclose()
        return {"per_async": per_async, "per_asend": per_asend, "lag": _lag_stats(lags), "naive_lag": _lag_stats(naive)}

    got = asyncio.run(on_loop())
    store.dispose()
    s_med, a_med = statistics.median(per_sync), statistics.median(got["per_async"])
    e_med = statistics.median(got["per_asend"])
    return {"durability": durability, "sync_us": round(s_med * 1e6, 1), "async_us": round(a_med * 1e6, 1),
            "ratio": round(a_med / s_med, 3), "async_asend_us": round(e_med * 1e6, 1),
            "ratio_asend": round(e_med / s_med, 3), "loop_lag_async": got["lag"],
            "loop_lag_sync_in_loop": got["naive_lag"]}


def lag_run(url: str, parents: int, platform: str = "own") -> dict[str, Any]:
    """Issue 31's loop-lag run on one database: 4 posts per parent in flight at once, 20 % of answers lost;
    ``platform`` "own" (a bot's own httpx.AsyncClient behind OwnPlatform) or "mastodon" (the adapter's asend)."""
    import gc
    import random

    from replyd import aio
    from replyd.platforms.own import OwnPlatform
    from tests.test_aio import BOT_TOKEN, bot_client, bot_replies, own_calls, parents_on, start_sim

    with start_sim("--lost-drop-rate", "0.2", "--seed", "31") as sim:
        ps = parents_on(sim, parents)

        async def go() -> dict[str, Any]:
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
                    stop = asyncio.Event()
                    probe = asyncio.create_task(_probe(lags, stop))
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
                    "loop_lag": _lag_stats(lags)}

        got = asyncio.run(go())
        counts = bot_replies(sim)
        report = sim.report()
    got["lost_answers"] = report["faults_injected"].get("lost_drop", 0)
    got["parents_not_one_reply"] = sum(1 for p in ps if counts.get(p.id) != 1)
    got["duplicates_on_sim"] = report["duplicates"]
    return got


def main() -> None:
    """Print one JSON line per database."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--posts", type=int, default=2000)
    ap.add_argument("--concurrent", type=int, default=1000)
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--sqlite", default=f"sqlite:////tmp/replyd-bench-aio-{uuid.uuid4().hex[:8]}.sqlite3")
    ap.add_argument("--durability", default="as_asked", choices=["as_asked", "durable", "relaxed"])
    ap.add_argument("--lag-parents", type=int, default=0, help="run issue 31's loop-lag run instead (1000)")
    ap.add_argument("--lag-platform", default="own", choices=["own", "mastodon"])
    a = ap.parse_args()
    # Warnings only, as a quiet bot's production log: an info line per claim and per post is the logger's cost,
    # the same on both faces, and stdout's.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
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
