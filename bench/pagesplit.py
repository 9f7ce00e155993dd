"""Where a 16-parent page's time goes: each statement of the raw page, the floor and the guarded page.

``PYTHONPATH=. python -m bench.pagesplit --rounds 60``. Per database, the same three variants as section 13,
timed in one process in freshly shuffled rounds: the raw page (``bench.pageclaim``'s replay of the page's own
SQL, no replyd Python) with each of its steps timed on its own, section 1's raw floor (an INSERT and an UPDATE
per parent, a commit each), and ``Guard.post_page`` (the send stubbed). Medians per parent, the first 5 rounds
not counted. What it shows: how much of the floor the page's statements alone take ("SQL / floor"), and how
much is left, under section 13's goal of 0.5× the floor, for replyd's Python ("page − SQL" against "budget").
A diagnosis, not a section of ``docs/BENCHMARKS.md``: it prints, it writes nothing.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import fdatasync_us, pg_available, pg_databases, sqlite_url, tmpdir
from bench.overhead import _pg_floor, _sqlite_floor
from bench.pageclaim import (PAGE_FLOOR_MAX, _floor, _guarded, _history, _pg_raw_page, _sqlite_raw_page,
                             page_args)
from replyd.store import Store

WARM_ROUNDS = 5


class Laps:
    """The time since the last mark, summed per step name for the page being timed."""

    def __init__(self) -> None:
        self.t = 0.0
        self.page: dict[str, float] = {}

    def start(self) -> None:
        """A page starts now."""
        self.page = {}
        self.t = time.perf_counter()

    def __call__(self, step: str) -> None:
        """``step`` ended now."""
        now = time.perf_counter()
        self.page[step] = self.page.get(step, 0.0) + now - self.t
        self.t = now


def split(url: str, raw: Callable[[Callable[[str], None]], tuple[Callable[[int], None], Callable[[], None]]],
          floor: tuple[Callable[[int], None], Callable[[], None]], page: int, rounds: int, seed: int) -> dict:
    """Median µs per parent of each raw-page step, the raw page's SQL, the floor and the guarded page."""
    laps = Laps()
    raw_run, raw_close = raw(laps)
    floor_post, floor_close = floor
    store = Store.open(url)
    guarded, floor_run = _guarded(store, "page"), _floor(floor_post)
    steps: dict[str, list[float]] = {}
    totals: dict[str, list[float]] = {"floor": [], "page": []}
    rng = random.Random(seed)
    try:
        for r in range(rounds + WARM_ROUNDS):
            order = ["raw", "floor", "page"]
            rng.shuffle(order)
            for name in order:
                if name == "raw":
                    laps.start()
                    raw_run(page)
                    if r >= WARM_ROUNDS:
                        for step, s in laps.page.items():
                            steps.setdefault(step, []).append(s / page * 1e6)
                    continue
                t0 = time.perf_counter()
                (floor_run if name == "floor" else guarded)(page)
                if r >= WARM_ROUNDS:
                    totals[name].append((time.perf_counter() - t0) / page * 1e6)
    finally:
        raw_close()
        floor_close()
        store.dispose()
    med = {step: statistics.median(v) for step, v in steps.items()}
    sql = [sum(v[i] for step, v in steps.items() if step != "params") for i in range(rounds)]
    return {"steps": med, "sql": statistics.median(sql), "floor": statistics.median(totals["floor"]),
            "page": statistics.median(totals["page"]),
            "sql/floor": statistics.median(a / b for a, b in zip(sql, totals["floor"], strict=True)),
            "page/floor": statistics.median(a / b for a, b in zip(totals["page"], totals["floor"], strict=True))}


def report(name: str, m: dict) -> str:
    """One database's split as a markdown table and its reading."""
    lines = [f"### {name}", "", "| step | µs per parent |", "|---|---:|"]
    lines += [f"| {step}{' (Python, not SQL)' if step == 'params' else ''} | {us:.1f} |"
              for step, us in m["steps"].items()]
    budget = PAGE_FLOOR_MAX * m["floor"]
    lines += [f"| **the page's SQL** | **{m['sql']:.1f}** |", f"| the floor | {m['floor']:.1f} |",
              f"| `Guard.post_page` | {m['page']:.1f} |", "",
              f"- SQL / floor {m['sql/floor']:.2f}×; page / floor {m['page/floor']:.2f}× (goal ≤ {PAGE_FLOOR_MAX}×).",
              f"- Budget at {PAGE_FLOOR_MAX}× the floor: {budget:.1f} µs per parent; the SQL leaves "
              f"{budget - m['sql']:.1f} µs for replyd's Python, which takes {m['page'] - m['sql']:.1f} "
              "(page − SQL).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the split on SQLite and, when it answers, PostgreSQL."""
    a = page_args(__doc__, argv, 60)
    with tmpdir("pagesplit") as d:
        print(f"page of {a.page}, {a.rounds} rounds; fdatasync {fdatasync_us(d):.0f} µs (8 KiB, median of 200)\n")
        db = Path(d / "r.sqlite3")
        url = sqlite_url(db)
        Store.open(url).dispose()
        _history(url)
        print(report("SQLite (WAL, FULL claims)", split(url, lambda lap: _sqlite_raw_page(db, lap),
                                                        _sqlite_floor(db, "FULL", "NORMAL"), a.page, a.rounds,
                                                        a.seed)))
    if pg_available():
        with pg_databases(1, "split") as (url,):
            _history(url)
            print(report("PostgreSQL", split(url, lambda lap: _pg_raw_page(url, lap), _pg_floor(url, split=True),
                                             a.page, a.rounds, a.seed)))
    else:
        print("PostgreSQL: not reachable on 127.0.0.1:5432, skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
