"""The group claim (issue 36): guarded posts of a 16-parent page against one claim per commit, side by side.

``PYTHONPATH=. python -m bench.pageclaim --rounds 40``. Per database, four variants post a fresh page of
``--page`` parents each round (the send stubbed): ``Guard.post_page`` (the page's new keys claimed in one
durable commit, each closed on its own), ``Guard.post`` per parent (today's single path), a one-parent
``post_page`` (a page of one: must cost what ``post`` does), and the raw floor of section 1 (one INSERT and
one UPDATE per parent, each its own commit, no Python layers). Every round runs all variants in a freshly
shuffled order, so the machine's noise lands on all alike; each ratio is the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import IDENTITY, REPLY_TEXT, StubPlatform, make_parent, pg_available, pg_databases, sqlite_url, tmpdir
from bench.overhead import _pg_floor, _sqlite_floor
from replyd import log
from replyd.guard import Guard, Status
from replyd.store import Store

_next = iter(range(10_000_000, 100_000_000))


def _page(n: int) -> list:
    """``n`` parents never posted before."""
    return [make_parent(next(_next)) for _ in range(n)]


def _guarded(store: Store, mode: str) -> Callable[[int], None]:
    """Post one fresh page of ``n`` through the guard: as a page, or parent by parent."""
    guard = Guard(store, StubPlatform(), IDENTITY, owner="bench:1:aaaaaa", watch_interval_s=None)

    def run(n: int) -> None:
        parents = _page(n)
        outs = (guard.post_page([(p, REPLY_TEXT) for p in parents]) if mode == "page"
                else [guard.post(p, REPLY_TEXT) for p in parents])
        if any(o.status is not Status.POSTED for o in outs):
            raise RuntimeError(f"{mode}: {outs}")

    return run


def _floor(post: Callable[[int], None]) -> Callable[[int], None]:
    """The raw floor over a page: one claim commit and one close commit per parent."""
    def run(n: int) -> None:
        for _ in range(n):
            post(next(_next))

    return run


def measure(url: str, floor: tuple[Callable[[int], None], Callable[[], None]], page: int, rounds: int,
            seed: int) -> dict[str, float]:
    """Median µs per parent of each variant and the per-round ratios, on one database."""
    store = Store.open(url)
    floor_post, floor_close = floor
    variants: dict[str, tuple[Callable[[int], None], int]] = {
        "page": (_guarded(store, "page"), page),
        "single": (_guarded(store, "single"), page),
        "page_of_1": (_guarded(store, "page"), 1),
        "single_1": (_guarded(store, "single"), 1),
        "floor": (_floor(floor_post), page),
    }
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for r in range(rounds + 3):
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                fn, n = variants[name]
                t0 = time.perf_counter()
                fn(n)
                if r >= 3:  # the first rounds warm caches and connections
                    samples[name].append((time.perf_counter() - t0) / n * 1e6)
    finally:
        floor_close()
        store.dispose()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

    return {**{k: statistics.median(v) for k, v in samples.items()},
            "page/floor": ratio("page", "floor"), "page/single": ratio("page", "single"),
            "single/floor": ratio("single", "floor"), "page_of_1/single_1": ratio("page_of_1", "single_1")}


def main(argv: list[str] | None = None) -> int:
    """Print the section's table (markdown)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    log.configure(level="warning")  # a log line per post would be most of what is measured
    load0 = os.getloadavg()
    rows: list[tuple[str, dict[str, float]]] = []
    with tmpdir("pageclaim") as d:
        url = sqlite_url(d / "r.sqlite3")
        Store.open(url).dispose()  # migrated before the floor's raw connections open it
        rows.append(("SQLite (WAL, FULL claims)", measure(url, _sqlite_floor(Path(d / "r.sqlite3"), "FULL", "NORMAL"),
                                                          a.page, a.rounds, a.seed)))
    if pg_available():
        with pg_databases(1, "page") as (url,):
            rows.append(("PostgreSQL", measure(url, _pg_floor(url, split=True), a.page, a.rounds, a.seed)))
    load1 = os.getloadavg()
    print(f"page of {a.page}, {a.rounds} rounds; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print("| database | page, per parent | single posts, per parent | raw floor, per parent | page / floor | "
          "page / single | single / floor | a page of 1 / one post |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in rows:
        print(f"| {name} | {m['page']:,.0f} µs | {m['single']:,.0f} µs | {m['floor']:,.0f} µs | "
              f"{m['page/floor']:.2f}× | {m['page/single']:.2f}× | {m['single/floor']:.2f}× | "
              f"{m['page_of_1/single_1']:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
