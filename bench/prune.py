"""`replyd prune` on a large log: what it removed, what it kept, how long each batch held the store.

    .venv/bin/python -m bench.prune                    # 1,000,000 rows on SQLite and PostgreSQL
    .venv/bin/python -m bench.prune --rows 100000 --only sqlite

The log is written in bulk (no guard): per 20 rows, 14 closed 100 days ago with a parent time, 1 closed
with none, 1 open, 1 not_landed, 1 unconfirmed, 1 gave_up and 1 closed today; two events per row.
The bot's policy.max_age_s is 30 days and the margin a day. After the prune, every row a job may still move
must be there, row by row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from bench.common import Table  # noqa: E402
from replyd.clock import FakeClock  # noqa: E402
from replyd.store import Store  # noqa: E402
from replyd.store.retention import prune  # noqa: E402
from replyd.store.schema import EVENTS, REPLIES  # noqa: E402

DAY_S = 86_400.0
PLATFORM, SENDER = "mastodon:https://bench.example", "109"
# (state, age in days, has a parent time) per slot of 20 rows
MIX = [("closed", 100, True)] * 14 + [("closed", 100, False), ("open", 100, True), ("not_landed", 100, True),
                                      ("unconfirmed", 100, True), ("gave_up", 100, True), ("closed", 0, True)]
PG_ADMIN = os.environ.get("REPLYD_BENCH_PG", "postgresql+psycopg://root@127.0.0.1:5432/postgres")


def _fill(store: Store, n: int, now: float) -> dict[str, int]:
    """Write ``n`` rows and 2n events in bulk; return how many rows of each (state, prunable) there are."""
    kinds: dict[str, int] = {}
    chunk = 10_000
    with store.engine.begin() as c:
        for start in range(0, n, chunk):
            rows, events = [], []
            for i in range(start, min(n, start + chunk)):
                state, age, timed = MIX[i % len(MIX)]
                t = now - age * DAY_S
                snap = {"id": f"p{i}", "author_id": "a", "text": "x" * 200}
                if timed:
                    snap["created_at"] = t - 60
                deadline = None if state in ("closed", "unconfirmed") and age else t + 600
                rows.append({"platform": PLATFORM, "sender_id": SENDER, "parent_id": f"p{i}", "state": state,
                             "attempt": 1, "created_at": t, "updated_at": t, "opened_at": t, "deadline_at": deadline,
                             "reply_id": f"r{i}", "path": "inbox", "snapshot": json.dumps(snap), "excused": 0})
                for kind in ("claimed", "closed" if state == "closed" else "maybe_sent"):
                    events.append({"at": t, "platform": PLATFORM, "sender_id": SENDER, "parent_id": f"p{i}",
                                   "kind": kind, "state": state, "attempt": 1, "detail": "{}"})
                label = f"{state}{'' if timed else ' (no parent time)'}{' today' if not age else ''}"
                kinds[label] = kinds.get(label, 0) + 1
            c.execute(REPLIES.insert(), rows)
            c.execute(EVENTS.insert(), events)
    return kinds


def _states(store: Store) -> dict[str, int]:
    with store.engine.connect() as c:
        return {s: n for s, n in c.execute(sa.select(REPLIES.c.state, sa.func.count()).group_by(REPLIES.c.state))}


def _live(store: Store) -> set[str]:
    """The parent ids of every row a job may still move (or an operator must resolve)."""
    q = sa.select(REPLIES.c.parent_id).where(REPLIES.c.state.in_(["open", "not_landed", "unconfirmed", "gave_up"]))
    with store.engine.connect() as c:
        return {p for (p,) in c.execute(q)}


class _Timed:
    """Wraps the store's prune writes to time each batch (the time a daemon may wait on the write lock)."""

    def __init__(self, store: Store) -> None:
        self.store, self.batches = store, []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)
        if name not in ("delete_done", "prune_events"):
            return fn

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.batches.append(time.perf_counter() - t0)
        return timed


def measure_one(url: str, n: int) -> dict[str, Any]:
    clock = FakeClock()
    store = Store.open(url, clock=clock)
    now = clock.now()
    try:
        t0 = time.perf_counter()
        mix = _fill(store, n, now)
        fill_s = time.perf_counter() - t0
        before, live = _states(store), _live(store)
        timed = _Timed(store)
        t0 = time.perf_counter()
        rep = prune(timed, [(PLATFORM, SENDER, now - 31 * DAY_S)], events_before=now - 90 * DAY_S)
        prune_s = time.perf_counter() - t0
        after, live_after = _states(store), _live(store)
        with store.engine.connect() as c:
            events_left = c.execute(sa.select(sa.func.count()).select_from(EVENTS)).scalar_one()
        return {"rows": n, "mix": mix, "fill_s": fill_s, "before": before, "after": after, "report": rep,
                "prune_s": prune_s, "batches": len(timed.batches), "batch_max_s": max(timed.batches, default=0.0),
                "events_left": events_left, "live_kept": live == live_after, "live": len(live)}
    finally:
        store.dispose()


def measure(n: int, only: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "sqlite" in only:
        with tempfile.TemporaryDirectory(prefix="replyd-prune-") as tmp:
            out["SQLite"] = measure_one(f"sqlite:///{tmp}/prune.sqlite3", n)
    if "postgres" in only:
        name = f"replyd_prune_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            out["PostgreSQL"] = measure_one(PG_ADMIN.rsplit("/", 1)[0] + "/" + name, n)
        finally:
            with admin.connect() as c:
                c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()
    return out


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """One row per store: what the prune removed and kept, and whether every live row is still there."""
    n = next(iter(res.values()))["rows"] if res else 0
    t = Table(f"17. `replyd prune` on a {n:,}-row log: what it removed and kept",
              ["store", "rows", "deleted rows", "kept done rows (no parent time)", "old events deleted (besides deleted rows')", "events left",
               "rows by state after", "live rows kept", "prune s", "batches", "longest batch s"])
    for db, r in res.items():
        rr = r["report"]["rows"][0]
        t.rows.append([db, f"{r['rows']:,}", f"{rr['deleted']:,}", f"{rr['kept_no_platform_time']:,}",
                       f"{r['report']['events']:,}", f"{r['events_left']:,}",
                       ", ".join(f"{k} {v:,}" for k, v in sorted(r["after"].items())),
                       "all " + format(r["live"], ",") if r["live_kept"] else "MISSING", f"{r['prune_s']:.1f}",
                       str(r["batches"]), f"{r['batch_max_s']:.3f}"])
        word = "**met**" if r["live_kept"] else "**MISSED**"
        t.verdicts.append(f"{word}: {db}: every row a job may still move is kept ({r['live']:,} rows)")
    t.notes.append(f"Command: `{cmd}`. Per 20 rows: 14 closed 100 days ago with a parent time, 1 closed with "
                   "none, 1 open, 1 not_landed, 1 unconfirmed, 1 gave_up and 1 closed today; two events per row. "
                   "The bot's `max_age_s` is 30 days, the margin a day, events older than 90 days go. A closed row "
                   "with no parent time is kept: nothing says its parent is too old to be offered again.")
    return [t]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--only", default="sqlite,postgres")
    a = ap.parse_args(argv)
    res = measure(a.rows, a.only.split(","))
    cmd = ".venv/bin/python -m bench.prune" + (f" --rows {a.rows}" if a.rows != 1_000_000 else "") + (
        f" --only {a.only}" if a.only != "sqlite,postgres" else "")
    for t in tables(res, cmd):
        print(t.markdown())
    return 0 if all(r["live_kept"] for r in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
