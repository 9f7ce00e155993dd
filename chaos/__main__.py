"""``python -m chaos --runs N --seed S [--short]``: randomised fault runs of replyd; last line = totals JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import structlog

from chaos.plan import draw
from chaos.run import IN_CI_ENV, Run, pg_reachable


def main(argv: list[str] | None = None) -> int:
    """Run the plans; print one line per run and the totals as the last line; exit 1 if a promise broke."""
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    p.add_argument("--runs", type=int, default=None, help="number of runs (default 20; 4 with --short)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--short", action="store_true", help="small runs for make test (~1-2 minutes)")
    p.add_argument("--only", type=int, action="append", default=None, help="run only this index (repeatable)")
    p.add_argument("--db", choices=("any", "sqlite", "postgres"), default="any")
    p.add_argument("--require-postgres", action="store_true", default=IN_CI_ENV,
                   help="fail when PostgreSQL is unreachable (default under CI=true)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep every run's directory (logs, config, SQLite)")
    p.add_argument("--json-out", type=Path, default=None, help="write every plan and result here")
    p.add_argument("--limits", action="store_true",
                   help="measure the limits instead (listing delay, latency, clocks beyond the margin; idempotency on/off)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    # The in-process sim logs through structlog: keep stdout for the run lines and the totals.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG if a.verbose else logging.WARNING))
    runs = a.runs if a.runs is not None else (4 if a.short else 20)
    if a.limits:
        from chaos.limits import measure

        rows = measure(a.seed, repeats=a.runs or 1, workdir=a.workdir, verbose=a.verbose)
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
    totals = {"runs": 0, "faults": 0, "posts": 0, "duplicates": 0, "lost": 0, "open_left": 0,
              "replies": 0, "gave_up": 0, "gave_up_unreported": 0, "wrong_close": 0, "unsettled_left": 0,
              "unhandled": 0, "bad_exits": 0, "start_failures": 0, "stopped_while_starting": 0, "failed_runs": 0, "attempts_max": 0, "seed": a.seed}
    by_kind: dict[str, int] = {}
    details = []
    t0 = time.monotonic()
    indexes = a.only if a.only else range(runs)
    for i in indexes:
        plan = draw(a.seed, i, short=a.short, postgres=postgres and a.db != "sqlite")
        if a.db == "postgres":
            plan.db = "postgres"
        res = Run(plan, a.workdir, keep=a.keep, verbose=a.verbose).execute()
        details.append({"plan": plan.to_dict(), "result": res.__dict__})
        totals["runs"] += 1
        for k in ("faults", "posts", "duplicates", "lost", "open_left", "replies", "gave_up", "gave_up_unreported",
                  "wrong_close", "unsettled_left", "unhandled", "start_failures", "stopped_while_starting"):
            totals[k] += getattr(res, k)
        totals["bad_exits"] += len(res.bad_exits)
        totals["attempts_max"] = max(totals["attempts_max"], res.attempts_max)
        totals["failed_runs"] += 0 if res.ok else 1
        for k, n in res.fault_counts.items():
            by_kind[k] = by_kind.get(k, 0) + n
        print(f"run {i:3d} {plan.db:8s} x{plan.replicas} idem={'on ' if plan.idempotency else 'off'} "
              f"ld={plan.ld_real}/{plan.ld_conf}s posts={res.posts:3d} faults={res.faults:3d} "
              f"dup={res.duplicates} lost={res.lost} gave_up={res.gave_up} open={res.open_left} "
              f"attempts={res.attempts_mean:.2f}/{res.attempts_max} settle={res.settle_s}s {res.elapsed_s}s "
              f"[{','.join(plan.families)}]{' ERROR ' + res.error if res.error else ''}"
              f"{'' if res.ok else ' FAILED'}", flush=True)
    totals["attempts_mean"] = round(
        sum(d["result"]["attempts_mean"] * d["result"]["posts"] for d in details) / max(1, totals["posts"]), 3)
    totals["faults_by_kind"] = dict(sorted(by_kind.items()))
    totals["elapsed_s"] = round(time.monotonic() - t0, 1)
    if a.json_out:
        a.json_out.write_text(json.dumps({"totals": totals, "runs": details}, indent=1, default=str))
    print(json.dumps(totals, sort_keys=False), flush=True)
    return 0 if totals["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
