"""Section 6: responder economy — every parent found by all three paths, two replicas, one sim.

Two replicas (two Store objects on the same SQLite file, each with its own
HTTP client, Mastodon adapter, Guard, Pipeline, Pollers and Sweeper) poll the
sim in two threads while it posts new parents that mention the bot AND
contain the search word, so inbox, search and re-find all find each one. The
responder counts its calls (and takes 20 ms, a stand-in for a model call);
the sim counts every request and every reply.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import httpx

from bench.common import Table, sqlite_url, tmpdir, verdict
from bench.simcount import counting_sim
from replyd.clock import SystemClock
from replyd.config import PollerConfig
from replyd.guard import Guard
from replyd.pipeline import Pipeline
from replyd.platforms.mastodon import MastodonPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.responders import FunctionResponder
from replyd.sim import World
from replyd.store import Store
from replyd.sweep import Bot, Sweeper

QUERY = "help"


def measure(n: int = 200, *, rate_per_s: float = 25.0, poll_s: float = 0.5, responder_s: float = 0.02,
            timeout_s: float = 120.0) -> dict[str, Any]:
    """Run two replicas until the sim shows every parent answered (or ``timeout_s``)."""
    clock = SystemClock()
    world = World(clock, seed=3)
    bot = world.add_account("econbot", bot=True)
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    async def respond(parent):
        with lock:
            calls[parent.id] += 1
        await asyncio.sleep(responder_s)  # a stand-in for a model call, on the shared responder loop
        return f"thanks for asking, @{parent.author_handle}"

    # The daemon's path: an async Responder run by the pipeline's ResponderRunner.
    responder = FunctionResponder(respond)

    out: dict[str, Any] = {"n": n, "rate_per_s": rate_per_s, "poll_s": poll_s, "responder_s": responder_s}
    with counting_sim(world) as (srv, counts), tmpdir("economy") as d:
        url = sqlite_url(d / "econ.sqlite3")
        Store.open(url).dispose()
        stop = threading.Event()
        replicas = []
        for i in range(2):
            store = Store.open(url, clock=clock)
            http = httpx.Client(timeout=30.0)
            plat = MastodonPlatform(base_url=srv.base_url, token=bot.token, http=http, clock=clock,
                                    listing_delay_s=1.0, timeout_s=30.0)
            ident = plat.whoami()
            guard = Guard(store, plat, ident, clock=clock, owner=f"replica-{i}", send_timeout_s=5.0)
            pipe = Pipeline(guard, responder, Policy(), clock)
            pollers = Pollers(store, plat, pipe, PollerConfig(search_queries=[QUERY], refind_lookback_s=3600), clock)
            sweeper = Sweeper(store, [Bot(plat, ident)], clock=clock, owner=f"replica-{i}")
            replicas.append((store, http, pollers, sweeper))
        errors: list[str] = []

        def loop(i: int) -> None:
            _store, _http, pollers, sweeper = replicas[i]
            while not stop.is_set():
                try:
                    pollers.inbox()
                    pollers.search()
                    pollers.refind()
                    sweeper.run_once()
                except Exception as exc:  # report, keep going
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                stop.wait(poll_s)

        counts.clear()
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(2)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        traffic = world.start_traffic(rate_per_s, total=n, target=bot.username, mention_fraction=1.0,
                                      query_word=QUERY, query_fraction=1.0, users=8)
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if traffic.running:
                continue
            per = world.replies_by(bot.id)
            if len([p for p in traffic.posted if per.get(p)]) >= n:
                break
        elapsed = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(30)
        per = world.replies_by(bot.id)
        parents = traffic.posted
        answered = [p for p in parents if per.get(p)]
        # Which path claimed each answered parent (from replyd's log; the counts above are the sim's).
        paths: Counter[str] = Counter()
        found_by: dict[str, set[str]] = {}
        for store, *_ in replicas[:1]:
            for _p, _s, path, k, _last in store.path_counts():
                paths[path] += k
            for e in store.events_with_path(kind="claimed", limit=10**9):
                found_by.setdefault(e["parent_id"], set()).add(e["detail"])
        outcomes: Counter[str] = Counter()
        for _store, _http, pollers, _sw in replicas:
            outcomes.update(pollers.outcomes)
        for store, http, *_ in replicas:
            store.dispose()
            http.close()
    out.update(
        parents=len(parents), answered=len(answered), replies=sum(per.get(p, 0) for p in parents),
        duplicates=sum(max(0, per.get(p, 0) - 1) for p in parents), responder_calls=sum(calls.values()),
        responder_calls_max=max(calls.values(), default=0), requests=sum(counts.values()), by_endpoint=dict(counts),
        seconds=elapsed, claimed_by_path=dict(paths), outcomes=dict(outcomes), errors=errors[:5],
    )
    return out


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The responder-economy table."""
    t = Table("6. Responder economy: three paths, two replicas, one sim",
              ["parents", "answered", "duplicates", "responder calls", "calls per answered parent",
               "platform requests", "requests per answered parent", "of which POST /statuses", "run s"])
    a = max(1, res["answered"])
    posts = res["by_endpoint"].get("POST /api/v1/statuses", 0)
    t.rows.append([f"{res['parents']:,}", f"{res['answered']:,}", str(res["duplicates"]), f"{res['responder_calls']:,}",
                   f"{res['responder_calls'] / a:.3f}", f"{res['requests']:,}", f"{res['requests'] / a:.2f}",
                   f"{posts / a:.3f} per parent", f"{res['seconds']:.1f}"])
    per_call = res["responder_calls"] / a
    t.verdicts.append(verdict(per_call <= 1.05 and res["answered"] == res["parents"],
                              f"responder calls per answered parent = {per_call:.3f} (goal ≤ 1.05); "
                              f"{res['answered']}/{res['parents']} answered, {res['duplicates']} duplicates"))
    eps = ", ".join(f"{k} {v / a:.2f}" for k, v in sorted(res["by_endpoint"].items(), key=lambda kv: -kv[1]))
    t.notes.append(f"Requests per answered parent by endpoint: {eps}.")
    t.notes.append(
        f"The sim posts {res['parents']} parents at {res['rate_per_s']:g}/s, each mentioning the bot and containing the "
        f"search word, so the inbox (mentions), search and re-find (mentions in a lookback window) paths all find every "
        f"one. Two replicas — two `Store` objects on one SQLite file, each with its own httpx client, Mastodon adapter, "
        f"Guard, Pipeline, Pollers and Sweeper — run inbox → search → re-find → sweep every {res['poll_s']:g} s in two "
        f"threads until the sim shows every parent answered. The responder takes {res['responder_s'] * 1000:.0f} ms. "
        f"Rows claimed by path (replyd's log): {', '.join(f'{k} {v}' for k, v in sorted(res['claimed_by_path'].items()))}; "
        f"outcomes the pollers saw: {', '.join(f'{k} {v}' for k, v in sorted(res['outcomes'].items()))}. "
        "Platform requests per answered parent depend on the poll interval against the arrival rate: the polls cost "
        "requests whether or not anything new arrived; sends are the only writes."
    )
    if res["errors"]:
        t.notes.append("Errors seen by the replica loops: " + "; ".join(res["errors"]))
    return [t]
