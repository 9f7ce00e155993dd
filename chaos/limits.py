"""The measured limits: runs deliberately outside the configured margin, with and without provider idempotency.

Each scenario is a chaos run (same machinery, real processes) whose plan
breaks one assumption on purpose, once with the platform honouring
``Idempotency-Key`` and once without. Lost responses are switched on in every
scenario, because a lost response is what leaves a row for the sweep to decide.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos.plan import Event, Plan
from chaos.run import Run

SCENARIOS: dict[str, str] = {
    "listing_delay_6x": "platform lists a new reply after 3.0 s; replyd is told 0.5 s",
    "create_delay_beyond_deadline": "creates wait 4.5 s in front of the platform (reads do not); "
                                    "send_timeout 1.5 s + listing delay 0.5 s",
    "replica_clock_ahead_30s": "one of two replicas' clocks is 30 s ahead (sweeps other replicas' rows 30 s early)",
    "platform_clock_back_5s": "the platform's clock steps back 5 s mid-run (only replies created before the step "
                              "are listed late)",
}


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
    if name == "replica_clock_ahead_30s":
        ev = [Event(0.1, "clock", {"replica": 1, "offset": 30.0}),
              Event(10.0, "clock", {"replica": 1, "offset": 0.0, "restore": True})]
        return replace(p, replicas=2, events=ev, families=[*p.families, "clock"])
    if name == "platform_clock_back_5s":
        ev = [Event(1.0, "platform_clock", {"jump": -5.0})]
        return replace(p, events=ev, families=[*p.families, "platform_clock"])
    raise ValueError(name)


def measure(seed: int, repeats: int = 1, workdir: Path | None = None, verbose: bool = False) -> list[dict[str, Any]]:
    """Run every scenario with and without idempotency ``repeats`` times; return one row per (scenario, idem)."""
    rows = []
    i = 1000
    for name, what in SCENARIOS.items():
        for idem in (False, True):
            agg: dict[str, Any] = {"scenario": name, "what": what, "idempotency": idem, "runs": 0, "posts": 0,
                                   "lost_responses": 0, "duplicates": 0, "lost": 0, "gave_up": 0, "open_left": 0}
            for _ in range(repeats):
                plan = plan_for(name, i, seed, idem)
                i += 1
                res = Run(plan, workdir, verbose=verbose).execute()
                agg["runs"] += 1
                agg["posts"] += res.posts
                agg["lost_responses"] += res.fault_counts.get("lost_drop", 0) + res.fault_counts.get("lost_504", 0)
                for k in ("duplicates", "lost", "gave_up", "open_left"):
                    agg[k] += getattr(res, k)
                if res.error:
                    agg["error"] = res.error
            rows.append(agg)
            print(f"limit {name:26s} idem={'on ' if idem else 'off'} posts={agg['posts']:3d} "
                  f"lost_responses={agg['lost_responses']:3d} duplicates={agg['duplicates']:3d} lost={agg['lost']} "
                  f"gave_up={agg['gave_up']} open_left={agg['open_left']}", flush=True)
    return rows
