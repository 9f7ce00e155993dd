"""The measured limits: runs deliberately outside the configured margin, with and without provider idempotency.

Each scenario is a chaos run (same machinery, real processes) whose plan
breaks one assumption on purpose, once with the platform honouring
``Idempotency-Key`` and once without. Lost responses are switched on in every
scenario, because a lost response is what leaves a row for the sweep to decide.
Every scenario runs on SQLite except the two ``replica_clock_ahead_30s_pg_*``
variants: the clock scenario again on PostgreSQL, with ``store.db_clock`` off
(each replica's own wall clock, as on SQLite) and on (the database's clock, the
default), skipped when PostgreSQL is unreachable. They reuse the SQLite clock
scenario's run indices, so the three face the same sim seeds (traffic, lost
responses); the indices never depend on what ``only`` selects.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos.plan import Event, Plan
from chaos.run import Run, pg_reachable

SCENARIOS: dict[str, str] = {
    "listing_delay_6x": "platform lists a new reply after 3.0 s; replyd is told 0.5 s",
    "create_delay_beyond_deadline": "creates wait 4.5 s in front of the platform (reads do not); "
                                    "send_timeout 1.5 s + listing delay 0.5 s",
    "replica_clock_ahead_30s": "one of two replicas' clocks is 30 s ahead (sweeps other replicas' rows 30 s early)",
    "platform_clock_back_5s": "the platform's clock steps back 5 s mid-run (only replies created before the step "
                              "are listed late)",
    "replica_clock_ahead_30s_pg_wall": "as replica_clock_ahead_30s, on PostgreSQL with store.db_clock = false "
                                       "(each replica's own wall clock)",
    "replica_clock_ahead_30s_pg_db": "as replica_clock_ahead_30s, on PostgreSQL with store.db_clock = true "
                                     "(the database's clock, the default)",
}
POSTGRES = ("replica_clock_ahead_30s_pg_wall", "replica_clock_ahead_30s_pg_db")


def _base(index: int, seed: int, idempotency: bool) -> Plan:
    return Plan(index=index, seed=seed, db="sqlite", replicas=1, parents=30, traffic_s=8.0, idempotency=idempotency,
                ld_real=0.3, ld_conf=0.5, send_timeout=1.5, max_attempts=3, families=["lost_drop", "lost_504"],
                rates={"lost_drop_rate": 0.2, "lost_504_rate": 0.2}, events=[], chaos_s=10.0)


def plan_for(name: str, index: int, seed: int, idempotency: bool) -> Plan:
    """The plan of one limit scenario."""
    p = _base(index, seed, idempotency)
    if name == "listing_delay_6x":
        return replace(p, ld_real=3.0, families=[*p.families, "listing_delay"])
    if name == "create_delay_beyond_deadline":
        ev = [Event(0.2, "latency", {"duration": 9.5, "latency": 4.5, "scope": "create"})]
        return replace(p, events=ev, families=[*p.families, "latency"])
    if name in ("replica_clock_ahead_30s", *POSTGRES):
        ev = [Event(0.1, "clock", {"replica": 1, "offset": 30.0}),
              Event(10.0, "clock", {"replica": 1, "offset": 0.0, "restore": True})]
        p = replace(p, replicas=2, events=ev, families=[*p.families, "clock"])
        if name in POSTGRES:
            p = replace(p, db="postgres", db_clock=name.endswith("_db"))
        return p
    if name == "platform_clock_back_5s":
        ev = [Event(1.0, "platform_clock", {"jump": -5.0})]
        return replace(p, events=ev, families=[*p.families, "platform_clock"])
    raise ValueError(name)


def measure(seed: int, repeats: int = 1, workdir: Path | None = None, verbose: bool = False,
            only: list[str] | None = None, idempotency: tuple[bool, ...] = (False, True)) -> list[dict[str, Any]]:
    """Run every scenario (or those in ``only``) with and without idempotency (or as ``idempotency`` says)
    ``repeats`` times; return one row per (scenario, idem). Run indices do not depend on the selection."""
    rows = []
    starts: dict[tuple[str, bool], int] = {}
    for name in SCENARIOS:
        for idem in (False, True):
            starts[(name, idem)] = (starts[("replica_clock_ahead_30s", idem)] if name in POSTGRES
                                    else 1000 + repeats * len(starts))
    why_no_pg = pg_reachable() if any(n in POSTGRES for n in (only or SCENARIOS)) else None
    for name, what in SCENARIOS.items():
        for idem in (False, True):
            first = starts[(name, idem)]
            if (only and name not in only) or idem not in idempotency:
                continue
            if name in POSTGRES and why_no_pg:
                print(f"limit {name}: skipped, PostgreSQL unreachable ({why_no_pg})", file=sys.stderr, flush=True)
                continue
            agg: dict[str, Any] = {"scenario": name, "what": what, "idempotency": idem, "runs": 0, "posts": 0,
                                   "lost_responses": 0, "duplicates": 0, "lost": 0, "gave_up": 0, "open_left": 0}
            for index in range(first, first + repeats):
                plan = plan_for(name, index, seed, idem)
                agg["db"], agg["db_clock"] = plan.db, plan.db_clock if plan.db == "postgres" else None
                res = Run(plan, workdir, verbose=verbose).execute()
                agg["runs"] += 1
                agg["posts"] += res.posts
                agg["lost_responses"] += res.fault_counts.get("lost_drop", 0) + res.fault_counts.get("lost_504", 0)
                for k in ("duplicates", "lost", "gave_up", "open_left"):
                    agg[k] += getattr(res, k)
                if res.error:
                    agg["error"] = res.error
            rows.append(agg)
            print(f"limit {name:31s} idem={'on ' if idem else 'off'} posts={agg['posts']:3d} "
                  f"lost_responses={agg['lost_responses']:3d} duplicates={agg['duplicates']:3d} lost={agg['lost']} "
                  f"gave_up={agg['gave_up']} open_left={agg['open_left']}", flush=True)
    return rows
