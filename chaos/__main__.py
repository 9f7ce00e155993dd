"""``python -m chaos --runs N --seed S [--jobs J] [--short]``: randomised fault runs of replyd; last line = totals JSON."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from chaos.plan import Plan, draw
from chaos.run import IN_CI_ENV, Result, configure_logging, pg_reachable, run_plan

SUMMED = ("faults", "posts", "duplicates", "duplicates_reported", "duplicates_unreported", "lost", "open_left", "replies", "gave_up", "gave_up_unreported",
          "unanswered", "unanswered_gave_up", "unanswered_rejected", "unanswered_other", "refusals_injected",
          "rejected", "rejected_unexplained", "wrong_close", "unsettled_left", "unhandled", "start_failures",
          "stopped_while_starting")


def run_line(plan: Plan, res: Result) -> str:
    """The one stdout line of a finished run."""
    return (f"run {plan.index:3d} {plan.db:8s} x{plan.replicas} idem={'on ' if plan.idempotency else 'off'} "
            f"ld={plan.ld_real}/{plan.ld_conf}s posts={res.posts:3d} faults={res.faults:3d} "
            f"dup={res.duplicates} lost={res.lost} unanswered={res.unanswered}"
            f"(gave_up={res.unanswered_gave_up},rejected={res.unanswered_rejected},other={res.unanswered_other}) "
            f"open={res.open_left} "
            f"attempts={res.attempts_mean:.2f}/{res.attempts_max} settle={res.settle_s}s {res.elapsed_s}s "
            f"[{','.join(plan.families)}]{' ERROR ' + res.error if res.error else ''}"
            f"{'' if res.ok else ' FAILED'}")


class Tally:
    """The totals over finished runs, in any order of completion; details are kept sorted by run index."""

    def __init__(self, seed: int) -> None:
        self.totals: dict[str, Any] = {"runs": 0, **{k: 0 for k in SUMMED}, "bad_exits": 0, "failed_runs": 0,
                                       "attempts_max": 0, "seed": seed}
        self.by_kind: dict[str, int] = {}
        self.details: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def add(self, plan: Plan, res: Result) -> None:
        """Count one finished run."""
        self.details.append({"plan": plan.to_dict(), "result": res.__dict__})
        self.details.sort(key=lambda d: d["plan"]["index"])
        t = self.totals
        t["runs"] += 1
        for k in SUMMED:
            t[k] += getattr(res, k)
        t["bad_exits"] += len(res.bad_exits)
        t["attempts_max"] = max(t["attempts_max"], res.attempts_max)
        t["failed_runs"] += 0 if res.ok else 1
        for k, n in res.fault_counts.items():
            self.by_kind[k] = self.by_kind.get(k, 0) + n

    def final(self) -> dict[str, Any]:
        """The totals JSON object as of now (the derived fields computed over the runs finished so far)."""
        t = dict(self.totals)
        t["attempts_mean"] = round(sum(d["result"]["attempts_mean"] * d["result"]["posts"] for d in self.details)
                                   / max(1, t["posts"]), 3)
        t["faults_by_kind"] = dict(sorted(self.by_kind.items()))
        t["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        return t

    def write(self, path: Path, complete: bool, about: dict[str, Any] | None = None) -> None:
        """Write totals and every finished run to ``path`` atomically, so a stopped campaign loses nothing."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**(about or {}), "totals": self.final(), "complete": complete,
                                   "runs": self.details}, indent=1, default=str))
        os.replace(tmp, path)


def git_commit() -> str:
    """The commit this campaign ran on (``+dirty`` with uncommitted changes), or ``unknown``."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "chaos"


def main(argv: list[str] | None = None) -> int:
    """Run the plans; print one line per run and the totals as the last line; exit 1 if a promise broke."""
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    p.add_argument("--runs", type=int, default=None, help="number of runs (default 20; 4 with --short)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1,
                   help="runs executed at once, each in its own process (own ports, directory, database, proxies)")
    p.add_argument("--short", action="store_true", help="small runs for make test (~1-2 minutes)")
    p.add_argument("--only", type=int, action="append", default=None, help="run only this index (repeatable)")
    p.add_argument("--db", choices=("any", "sqlite", "postgres"), default="any")
    p.add_argument("--require-postgres", action="store_true", default=IN_CI_ENV,
                   help="fail when PostgreSQL is unreachable (default under CI=true)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep every run's directory (logs, config, SQLite)")
    p.add_argument("--json-out", type=Path, default=None,
                   help="write every plan and result here (rewritten after each finished run); a campaign "
                        "(not --short, not --only) writes docs/chaos/results-seed<S>-runs<N>.json by default")
    p.add_argument("--no-results", action="store_true", help="write no results file")
    p.add_argument("--limits", action="store_true",
                   help="measure the limits instead (listing delay, latency, clocks beyond the margin; idempotency on/off)")
    p.add_argument("--limit-scenario", action="append", default=None, metavar="NAME",
                   help="with --limits: only this scenario (repeatable; names in chaos/limits.py SCENARIOS)")
    p.add_argument("--limit-idempotency", choices=("on", "off", "both"), default="both",
                   help="with --limits: only runs with provider idempotency on, off, or both (default)")
    p.add_argument("--learned", action="store_true",
                   help="with --limits: the learned listing delay rows instead (no idempotency, real delay 2x and 4x "
                        "the configured one, learned delay off and on); prints the docs/CAMPAIGNS.md table")
    p.add_argument("--learned-parents", type=int, default=100, help="with --learned: parents per run (default 100)")
    p.add_argument("--learned-traffic-s", type=float, default=40.0,
                   help="with --learned: seconds the parents arrive over (default 40)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    if a.workdir is not None:
        # Every run makes its own directory below it; a missing one would fail all runs at once.
        a.workdir.mkdir(parents=True, exist_ok=True)
    configure_logging(a.verbose)
    runs = a.runs if a.runs is not None else (4 if a.short else 20)
    if a.limits and a.learned:
        from chaos.limits import LEARNED, learned_table, measure_learned

        unknown = sorted(set(a.limit_scenario or ()) - set(LEARNED))
        if unknown:
            p.error(f"unknown --limit-scenario {', '.join(unknown)} (known: {', '.join(LEARNED)})")
        rows = measure_learned(a.seed, repeats=a.runs or 1, workdir=a.workdir, verbose=a.verbose,
                               only=a.limit_scenario, parents=a.learned_parents, traffic_s=a.learned_traffic_s)
        if a.json_out:
            a.json_out.write_text(json.dumps(rows, indent=1))
        print(learned_table(rows), flush=True)
        print(json.dumps({"learned": rows}), flush=True)
        return 0
    if a.limits:
        from chaos.limits import SCENARIOS, measure

        unknown = sorted(set(a.limit_scenario or ()) - set(SCENARIOS))
        if unknown:
            p.error(f"unknown --limit-scenario {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
        idem = {"on": (True,), "off": (False,), "both": (False, True)}[a.limit_idempotency]
        rows = measure(a.seed, repeats=a.runs or 1, workdir=a.workdir, verbose=a.verbose, only=a.limit_scenario,
                       idempotency=idem)
        if a.json_out:
            a.json_out.write_text(json.dumps(rows, indent=1))
        print(json.dumps({"limits": rows}), flush=True)
        return 0
    why = pg_reachable() if a.db != "sqlite" else "not asked for"
    if why and a.db != "sqlite":
        if a.require_postgres or a.db == "postgres":
            print(f"chaos: PostgreSQL is required but unreachable: {why}", file=sys.stderr)
            return 2
        print(f"chaos: PostgreSQL unreachable ({why}); SQLite runs only", file=sys.stderr)
    postgres = why is None
    plans = []
    for i in (a.only if a.only else range(runs)):
        plan = draw(a.seed, i, short=a.short, postgres=postgres and a.db != "sqlite")
        if a.db == "postgres":
            plan.db = "postgres"
        plans.append(plan)
    tally = Tally(a.seed)
    results = a.json_out
    if results is None and not (a.short or a.only or a.no_results):
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        results = RESULTS_DIR / f"results-seed{a.seed}-runs{runs}.json"
    about = {"seed": a.seed, "runs_asked": runs, "jobs": a.jobs, "db": a.db, "commit": git_commit(),
             "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "command": "python -m chaos " + " ".join(sys.argv[1:] if argv is None else argv)}

    def finished(plan: Plan, res: Result) -> None:
        tally.add(plan, res)
        print(run_line(plan, res), flush=True)
        if results:
            tally.write(results, complete=False, about=about)

    if a.jobs == 1:
        for plan in plans:
            finished(plan, run_plan(plan, a.workdir, a.keep, a.verbose))
    else:
        # spawn, not fork: the parent may hold threads, and a worker must start from a clean interpreter.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(a.jobs, mp_context=ctx, initializer=configure_logging, initargs=(a.verbose,)) as pool:
            pending: dict[Future, Plan] = {pool.submit(run_plan, plan, a.workdir, a.keep, a.verbose): plan
                                           for plan in plans}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    plan = pending.pop(fut)
                    try:
                        res = fut.result()
                    except Exception as exc:  # a dead worker is a broken run, reported like any other
                        res = Result(plan.index, plan.db, plan.replicas, plan.idempotency, plan.families,
                                     error=f"worker: {type(exc).__name__}: {exc}"[:500])
                    finished(plan, res)
    totals = tally.final()
    if results:
        tally.write(results, complete=True, about=about)
        print(f"chaos: results written to {results}", file=sys.stderr, flush=True)
    print(json.dumps(totals, sort_keys=False), flush=True)
    return 0 if totals["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
