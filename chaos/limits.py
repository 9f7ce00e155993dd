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

import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos.plan import Event, Plan
from chaos.run import BOT, Run, pg_reachable
from chaos.simhost import SimHost
from replyd.sim.world import World

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


# -- the learned listing delay (issue 14) ------------------------------------------------------------------------

LEARNED_CONF_S = 1.0  # the configured listing_delay_s
LEARNED_SEND_TIMEOUT_S = 0.5  # with the configured delay, the margin a lost response's row is judged after
LEARNED: dict[str, tuple[float, bool]] = {  # name -> (real delay as a multiple of the configured one, learned on)
    "listing_delay_2x_learned_off": (2.0, False),
    "listing_delay_2x_learned_on": (2.0, True),
    "listing_delay_4x_learned_off": (4.0, False),
    "listing_delay_4x_learned_on": (4.0, True),
}
WARM_UP_PARENTS = 20  # the target: no duplicate among the parents after these


def learned_plan(name: str, index: int, seed: int, parents: int = 100, traffic_s: float = 40.0) -> Plan:
    """One learned-delay row's plan: no provider idempotency, parents over ``traffic_s``, 20 % of responses lost,
    replyd's default two attempts (so a row whose both responses are lost can end gave_up while answered)."""
    factor, auto = LEARNED[name]
    # Defaults but for the reconciling looks' cap: 10x / 100x a learned 8 s would outlast the run.
    sweep = {"listing_delay_auto": auto, "reconcile_max_s": 30.0}
    return Plan(index=index, seed=seed, db="sqlite", replicas=1, parents=parents, traffic_s=traffic_s,
                idempotency=False, ld_real=factor * LEARNED_CONF_S, ld_conf=LEARNED_CONF_S,
                send_timeout=LEARNED_SEND_TIMEOUT_S, max_attempts=2, families=["lost_drop", "lost_504", "listing_delay"],
                rates={"lost_drop_rate": 0.1, "lost_504_rate": 0.1}, events=[], chaos_s=traffic_s, sweep=sweep)


class LearnedRun(Run):
    """A chaos run that also reads what replyd saw: duplicates detected, reconciled rows, the delay it used."""

    settle_verify_s = 60.0  # after the parents are answered, how long closes may take to be verified

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.extra: dict[str, Any] = {}

    def _pending(self) -> tuple[int, int]:
        """(closes not yet verified, gave_up / not_landed rows the sim shows answered)."""
        assert self.host is not None
        answered = set(self.host.world.replies_by(self._bot_id()))
        unverified = self.query("SELECT count(*) FROM replies WHERE state = 'closed' AND deadline_at IS NOT NULL")
        judged = [p for (p,) in self.query("SELECT parent_id FROM replies WHERE state IN ('gave_up', 'not_landed')")]
        return unverified[0][0], sum(1 for p in judged if p in answered)

    def _bot_id(self) -> str:
        assert self.host is not None
        acc = self.host.world.find_account(BOT)
        return acc.id

    def stop_all(self) -> None:
        """Before stopping: give every close its verifying look and every judged row its reconciling looks."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.settle_verify_s and self.replicas and self.replicas[0].proc is not None:
            try:
                if self._pending() == (0, 0):
                    break
            except Exception:  # a locked database: look again
                pass
            self.supervise()
            time.sleep(0.25)
        self.extra["verify_wait_s"] = round(time.monotonic() - t0, 1)
        super().stop_all()

    def collect(self, world: World, host: SimHost, bot_id: str, parents: list[str]) -> None:
        """The chaos counts, plus the duplicates replyd detected and the sim's view of judged rows."""
        super().collect(world, host, bot_id, parents)
        per = world.replies_by(bot_id)
        detected = 0
        for (detail,) in self.query("SELECT detail FROM events WHERE kind = 'duplicate_detected'"):
            detected += len(json.loads(detail or "{}").get("newer", []))
        states = dict(self.query("SELECT parent_id, state FROM replies"))
        kinds = dict(self.query("SELECT kind, count(*) FROM events GROUP BY kind"))
        delays = self.query("SELECT configured_s, in_use_s FROM listing_delay")
        lags = [lo for (lo,) in self.query("SELECT lower_s FROM listing_lag WHERE upper_s IS NOT NULL")]
        self.extra.update({
            "detected": detected,
            "answered": sum(1 for p in parents if per.get(p)),
            "gave_up_answered": sum(1 for p in parents if states.get(p) == "gave_up" and per.get(p)),
            "duplicates_after_warm_up": sum(max(0, per.get(p, 0) - 1) for p in parents[WARM_UP_PARENTS:]),
            "duplicate_parents": [i + 1 for i, p in enumerate(parents) if per.get(p, 0) > 1],
            "reconciled": kinds.get("reconciled", 0),
            "not_landed_events": kinds.get("not_landed", 0),
            "delay_in_use_s": round(delays[0][1], 2) if delays else None,
            "lag_samples": len(lags),
            "lag_proven_max_s": round(max(lags), 2) if lags else None,
        })


def measure_learned(seed: int, repeats: int = 1, workdir: Path | None = None, verbose: bool = False,
                    only: list[str] | None = None, parents: int = 100,
                    traffic_s: float = 40.0) -> list[dict[str, Any]]:
    """Run the learned-delay rows (``only``: a subset) ``repeats`` times each; one aggregated row per name."""
    rows = []
    for n, (name, (factor, auto)) in enumerate(LEARNED.items()):
        if only and name not in only:
            continue
        agg: dict[str, Any] = {"scenario": name, "real_over_configured": factor, "learned": auto, "runs": 0,
                               "parents": 0, "lost_responses": 0, "duplicates_made": 0, "detected": 0,
                               "answered": 0, "gave_up_answered": 0, "duplicates_after_warm_up": 0,
                               "duplicate_parents": [], "reconciled": 0, "lost": 0, "open_left": 0,
                               "delay_in_use_s": [], "errors": []}
        for index in range(2000 + n * repeats, 2000 + (n + 1) * repeats):
            plan = learned_plan(name, index, seed, parents, traffic_s)
            run = LearnedRun(plan, workdir, verbose=verbose)
            res = run.execute()
            if res.error:
                agg["errors"].append(res.error)
            agg["runs"] += 1
            agg["parents"] += res.posts
            agg["lost_responses"] += res.fault_counts.get("lost_drop", 0) + res.fault_counts.get("lost_504", 0)
            agg["duplicates_made"] += res.duplicates
            agg["lost"] += res.lost
            agg["open_left"] += res.open_left
            for k in ("detected", "answered", "gave_up_answered", "duplicates_after_warm_up", "reconciled"):
                agg[k] += run.extra.get(k, 0)
            agg["duplicate_parents"].append(run.extra.get("duplicate_parents"))
            agg["delay_in_use_s"].append(run.extra.get("delay_in_use_s"))
            shutil.rmtree(run.dir, ignore_errors=True)  # a run with duplicates is kept by Run; these are expected
        rows.append(agg)
        print(f"learned {name:29s} parents={agg['parents']:3d} lost_responses={agg['lost_responses']:3d} "
              f"made={agg['duplicates_made']:3d} detected={agg['detected']:3d} answered={agg['answered']:3d} "
              f"gave_up_answered={agg['gave_up_answered']} after_{WARM_UP_PARENTS}={agg['duplicates_after_warm_up']} "
              f"reconciled={agg['reconciled']} in_use={agg['delay_in_use_s']} dup_at={agg['duplicate_parents']}"
              f"{' ERRORS ' + '; '.join(agg['errors']) if agg['errors'] else ''}", flush=True)
    return rows


def learned_table(rows: list[dict[str, Any]]) -> str:
    """The docs/CAMPAIGNS.md table of the learned-delay rows."""
    out = ["| real delay | learned delay | parents | lost responses | duplicates made (sim) | detected by replyd "
           f"| duplicates after parent {WARM_UP_PARENTS} | parents answered (sim) | gave_up but answered (sim) "
           "| delay in use at the end |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        used = ", ".join(f"{d:g} s" for d in r["delay_in_use_s"] if d is not None) or "—"
        out.append(f"| {r['real_over_configured']:g}× ({r['real_over_configured'] * LEARNED_CONF_S:g} s) "
                   f"| {'on' if r['learned'] else 'off'} | {r['parents']} | {r['lost_responses']} "
                   f"| {r['duplicates_made']} | {r['detected']} | {r['duplicates_after_warm_up']} "
                   f"| {r['answered']} | {r['gave_up_answered']} | {used} |")
    return "\n".join(out)
