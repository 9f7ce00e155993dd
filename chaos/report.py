"""``python -m chaos.report RUNS.json [LIMITS.json]``: the fault matrix (markdown) from ``--json-out`` files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from chaos.plan import FAMILIES

# Which measured counters belong to which family.
COUNTERS = {
    "lost_drop": ["lost_drop"],
    "lost_504": ["lost_504"],
    "error_before": ["error_500_before", "error_503_before"],
    "storm_429": ["rate_limit_429"],
    "readback_errors": ["readback_502"],
    "latency": ["latency_spikes"],
    "kill": ["kill"],
    "kill_on_create": ["kill_on_create"],
    "clock": ["clock_jumps"],
    "db_outage": ["db_outages", "db_readonly", "db_locked"],
    "platform_clock": ["platform_clock_jumps"],
}
WHAT = {
    "lost_drop": "lost response: post created, connection cut mid-body",
    "lost_504": "5xx after create: post created, proxy answers 504",
    "error_before": "5xx before create (500 JSON, 503 HTML)",
    "storm_429": "429 storms (windows of 60-100 % refusals, Retry-After)",
    "readback_errors": "read-back errors (502 on own-feed and context listings)",
    "latency": "latency spikes (all requests, or creates only)",
    "kill": "SIGKILL of a replica at a random moment, restart",
    "kill_on_create": "SIGKILL of the sender after the platform created its post, before the answer",
    "clock": "replica wall-clock steps (forward and back)",
    "db_outage": "database stopped/started (PostgreSQL: proxy cuts + refuses) or unwritable (SQLite: chattr +i)",
    "platform_clock": "platform clock steps forward",
}


def matrix(data: dict) -> str:
    """The fault matrix of one chaos --json-out file."""
    runs = data["runs"]
    out = ["| fault family | what | runs | injected | posts in those runs | duplicates | lost |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for fam in FAMILIES:
        mine = [r for r in runs if fam in r["plan"]["families"]]
        injected = sum(r["result"]["fault_counts"].get(c, 0) for r in mine for c in COUNTERS[fam])
        out.append(f"| {fam} | {WHAT[fam]} | {len(mine)} | {injected} | {sum(r['result']['posts'] for r in mine)} | "
                   f"{sum(r['result']['duplicates'] for r in mine)} | {sum(r['result']['lost'] for r in mine)} |")
    topo = {}
    for r in runs:
        k = f"{r['plan']['db']} x{r['plan']['replicas']}, idempotency {'on' if r['plan']['idempotency'] else 'off'}"
        t = topo.setdefault(k, [0, 0, 0, 0, 0, 0])
        res = r["result"]
        t[0] += 1
        t[1] += res["faults"]
        t[2] += res["posts"]
        t[3] += res["duplicates"]
        t[4] += res["lost"]
        t[5] += res["open_left"]
    out += ["", "| store x replicas, provider idempotency | runs | faults | posts | duplicates | lost | open rows left |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for k in sorted(topo):
        t = topo[k]
        out.append(f"| {k} | {t[0]} | {t[1]} | {t[2]} | {t[3]} | {t[4]} | {t[5]} |")
    return "\n".join(out)


def limits(rows: list[dict]) -> str:
    """The limits table of one chaos --limits --json-out file."""
    out = ["| scenario | idempotency | runs | posts | lost responses | duplicates | lost |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['scenario']}: {r['what']} | {'on' if r['idempotency'] else 'off'} | {r['runs']} | {r['posts']} | "
                   f"{r['lost_responses']} | {r['duplicates']} | {r['lost']} |")
    return "\n".join(out)


def main() -> int:
    """Print the matrix (and the limits table when a second file is given)."""
    data = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(data["totals"]))
    print()
    print(matrix(data))
    if len(sys.argv) > 2:
        print()
        print(limits(json.loads(Path(sys.argv[2]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
