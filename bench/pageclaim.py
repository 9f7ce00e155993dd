"""The group claim: guarded posts of a 16-parent page against one claim per commit, side by side.

``PYTHONPATH=. python -m bench.pageclaim --rounds 40``. Per database, four variants post a fresh page of
``--page`` parents each round (the send stubbed): ``Guard.post_page`` (the page's new keys claimed in one
durable commit, each closed on its own), ``Guard.post`` per parent (today's single path), a one-parent
``post_page`` against ``post`` (pages of one: must cost what ``post`` does; the two alternate post by post),
and the raw floor of section 1 (one INSERT and
one UPDATE per parent, each its own commit, no Python layers), and a peer: AWS Lambda Powertools'
``idempotent_function`` on Redis with ``appendfsync always`` per parent (it has no page). Every round runs all variants in a freshly
shuffled order, so the machine's noise lands on all alike; each ratio is the median of per-round ratios.
Section ``pageclaim`` of ``bench/run.py`` (``measure_all``/``tables``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (FIRST_PARENT, IDENTITY, INSTANCE, REPLY_TEXT, SENDER_ID, StubPlatform, Table, fdatasync_us,
                          fmt_ratio, fmt_us, make_parent, pg_available, pg_databases, snapshot_json, sqlite_url, tmpdir,
                          verdict)
from bench.common import REDIS_PORT, pg_analyze, psycopg_dsn, redis_always, redis_version
from bench.overhead import (_CLOSE_COLS, _hot, _parent, _pg_floor, _powertools, _same_sql_params, _sqlite_conn,
                            _sqlite_floor, powertools_missing)
from replyd import log
from replyd.core import text_hash
from replyd.guard import Guard, Status
from replyd.store import Store

_next = iter(range(10_000_000, 100_000_000))


def _page(n: int) -> list:
    """``n`` parents never posted before."""
    return [make_parent(next(_next)) for _ in range(n)]


HISTORY = 10_000  # answered parents already in the bot's table before the first round


def _history(url: str, n: int = HISTORY) -> None:
    """``n`` answered parents (a closed row and its two events each) of the bench's bot, older than every parent the
    rounds post, then ANALYZE on PostgreSQL: a live bot's table, whose statistics stay true as the rounds add to it.
    On a fresh table PostgreSQL's statistics (taken when it had a few hundred rows) go stale as the rounds grow it
    tenfold, and the page's cached close plan (a read of all the bot's rows, right for a few hundred) is kept."""
    import sqlalchemy as sa

    now = time.time()
    p = make_parent(0)
    first = "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < :n) "
    key = ":platform, :sender, CAST(:base + i * 7 AS TEXT)"
    engine = sa.create_engine(url)
    try:
        with engine.begin() as c:
            c.execute(sa.text(
                first + "INSERT INTO replies (platform, sender_id, parent_id, state, attempt, created_at, updated_at, "
                "opened_at, closed_at, reply_id, provider_key, text_hash, path, snapshot, owner, author_id, excused) "
                f"SELECT {key}, 'closed', 1, :now, :now, :now, :now, CAST(:base + 1 + i * 7 AS TEXT), "
                "'history-' || CAST(i AS TEXT), :hash, 'api', :snapshot, 'bench:0:history', :author, 0 FROM g"),
                {"n": n, "platform": INSTANCE, "sender": SENDER_ID, "base": FIRST_PARENT, "now": now - 86_400,
                 "hash": text_hash(REPLY_TEXT), "snapshot": snapshot_json(p), "author": p.author_id})
            c.execute(sa.text(
                first + "INSERT INTO events (at, platform, sender_id, parent_id, kind, state, attempt, owner, detail) "
                f"SELECT :now, {key}, k.kind, k.state, 1, 'bench:0:history', '{{}}' FROM g, "
                "(SELECT 'claimed' AS kind, 'open' AS state UNION ALL SELECT 'closed', 'closed') AS k"),
                {"n": n, "platform": INSTANCE, "sender": SENDER_ID, "base": FIRST_PARENT, "now": now - 86_400})
        if engine.dialect.name == "postgresql":
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()


def _guarded(store: Store, mode: str) -> Callable[[int], None]:
    """Post one fresh page of ``n`` through the guard: as a page, or parent by parent."""
    guard = Guard(store, StubPlatform(), IDENTITY, owner="bench:1:aaaaaa", watch_interval_s=None)

    def run(n: int) -> None:
        """Post ``n`` new parents, all of which must end posted."""
        parents = _page(n)
        if mode == "page":
            outs = guard.post_page([(p, REPLY_TEXT) for p in parents])
        elif mode == "ones":  # a page of one per parent: what a poll that finds one parent does
            outs = [o for p in parents for o in guard.post_page([(p, REPLY_TEXT)])]
        else:
            outs = [guard.post(p, REPLY_TEXT) for p in parents]
        if any(o.status is not Status.POSTED for o in outs):
            raise RuntimeError(f"{mode}: {outs}")

    return run


def _no_lap(_step: str) -> None:
    """A raw page's step recorder when nothing times the steps."""


def _floor(post: Callable[[int], None]) -> Callable[[int], None]:
    """The raw floor over a page: one claim commit and one close commit per parent."""
    def run(n: int) -> None:
        """``n`` raw claim + close pairs."""
        for _ in range(n):
            post(next(_next))

    return run


def _sqlite_raw_page(path: Path, lap: Callable[[str], None] = _no_lap
                     ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """Raw sqlite3 issuing a page's statements as ``Guard.post_page`` does, replyd's own SQL text bound by position,
    without its Python layers: the rows read, then the rows and their events (one multi-row INSERT each) in one FULL
    commit, then every close (``executemany``) and their events in one NORMAL commit. What a page costs the
    database alone. ``lap(step)`` is called as each step ends (``bench.pagesplit`` times them)."""
    h = _hot("sqlite")
    cas = h.cas(_CLOSE_COLS, 2, True, False, False, False)[0]
    c = _sqlite_conn(path, "FULL")
    row_of, event_of = h.positional(h.insert)[1], h.positional(h.event)[1]
    cas_q, cas_of = h.positional(cas)

    def run(n: int) -> None:
        """Claim, then close, ``n`` new parents as one page."""
        now = time.time()
        params = [_same_sql_params(h, _parent(i), i, now) for i in (next(_next) for _ in range(n))]
        rows = [v for _k, row, *_r in params for v in row_of(row)]
        claimed = [v for _k, _row, ev, *_r in params for v in event_of(ev)]
        closes = [cas_of(close) for *_r, close, _closed in params]
        closed = [v for *_r, ev in params for v in event_of(ev)]
        lap("params")
        c.execute(h.rows_of(n), {"k_platform": params[0][0]["k_platform"], "k_sender_id": params[0][0]["k_sender_id"],
                               **{f"p{j}": k["k_parent_id"] for j, (k, *_r) in enumerate(params)}}).fetchall()
        lap("read")
        c.execute("PRAGMA synchronous=FULL")
        c.execute("BEGIN IMMEDIATE")
        c.execute(h.values_rows(h.insert, n), rows)
        lap("claim rows")
        c.execute(h.values_rows(h.event, n), claimed)
        lap("claim events")
        c.execute("COMMIT")
        lap("claim commit (FULL)")
        c.execute("PRAGMA synchronous=NORMAL")
        c.execute("BEGIN IMMEDIATE")
        c.executemany(cas_q, closes)
        lap("closes")
        c.execute(h.values_rows(h.event, n), closed)
        lap("close events")
        c.execute("COMMIT")
        lap("close commit (NORMAL)")

    return run, c.close


def _pg_raw_page(url: str, lap: Callable[[str], None] = _no_lap
                 ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """Raw psycopg issuing a page's statements as ``Guard.post_page`` does on PostgreSQL, replyd's own SQL text and
    parameter names (the rows as binary ``unnest`` arrays), without its Python layers: the rows read, the rows and
    their events as ONE durable autocommit statement (``HotSQL.claim_set``), every close and its event as ONE
    relaxed one (``HotSQL.close_set``). What a page costs the database and the driver alone. ``lap(step)`` is
    called as each step ends (``bench.pagesplit`` times them)."""
    import psycopg

    from replyd.store.schema import EVENT_COLUMNS, REPLY_COLUMNS

    h = _hot("postgresql")
    claim_sql = h.claim_set(False)
    close_sql, names = h.close_set(_CLOSE_COLS, 2, True)
    c = psycopg.connect(psycopg_dsn(url), autocommit=True)

    def run(n: int) -> None:
        """Claim, then close, ``n`` new parents as one page."""
        now = time.time()
        params = [_same_sql_params(h, _parent(i), i, now) for i in (next(_next) for _ in range(n))]
        k0 = params[0][0]
        claim = {"a_" + col: [row[col] for _k, row, *_r in params] for col in REPLY_COLUMNS}
        claim.update({"b_" + col: [ev["e_" + col] for _k, _row, ev, *_r in params] for col in EVENT_COLUMNS})
        close = {"k_platform": k0["k_platform"], "k_sender_id": k0["k_sender_id"], "s0": params[0][3]["s0"],
                 "s1": params[0][3]["s1"], "a_parent_id": [k["k_parent_id"] for k, *_r in params],
                 "a_attempt": [cl["k_attempt"] for *_r, cl, _ev in params]}
        close.update({"a_" + name: [cl[name] for *_r, cl, _ev in params] for name in names})
        close.update({"b_" + col: [ev["e_" + col] for *_r, ev in params] for col in EVENT_COLUMNS})
        lap("params")
        c.execute(h.rows_of(n), {"k_platform": k0["k_platform"], "k_sender_id": k0["k_sender_id"],
                                 **{f"p{j}": k["k_parent_id"] for j, (k, *_r) in enumerate(params)}}).fetchall()
        lap("read")
        if len(c.execute(claim_sql, claim).fetchall()) != n:
            raise RuntimeError("raw page: a new key was not inserted")
        lap("claim (rows and events, durable)")
        if len(c.execute(close_sql, close).fetchall()) != n:
            raise RuntimeError("raw page: a close did not take")
        lap("close (rows and events, relaxed)")

    return run, c.close


def measure(url: str, floor: tuple[Callable[[int], None], Callable[[], None]], page: int, rounds: int,
            seed: int, peer: Callable[[int], None] | None = None,
            raw_page: tuple[Callable[[int], None], Callable[[], None]] | None = None,
            warmed: Callable[[], None] | None = None) -> dict[str, float]:
    """Median µs per parent of each variant and the per-round ratios, on one database (``peer``: Powertools;
    ``raw_page``: the page's statements without replyd's Python; ``warmed``: run once after the warm-up rounds)."""
    store = Store.open(url)
    floor_post, floor_close = floor
    variants: dict[str, tuple[Callable[[int], None], int]] = {
        "page": (_guarded(store, "page"), page),
        "single": (_guarded(store, "single"), page),
        "floor": (_floor(floor_post), page),
    }
    if raw_page is not None:
        variants["raw_page"] = (raw_page[0], page)
    # A page of one against one post: the same call underneath (``post_page`` with one item takes ``post``), so
    # the ratio is 1 plus the page's wrapper, far under one fsync's noise (two runs of ``page`` posts each, one
    # after the other, measured 1.07x against themselves). So the two alternate post by post, the first of each
    # pair drawn at random, and a round's sample is the ratio of their sums.
    ones, single_1 = _guarded(store, "ones"), _guarded(store, "single")
    pair_order = random.Random(seed + 1)
    if peer is not None:  # measured in the same shuffled rounds, so its ratio is side by side
        variants["powertools"] = (_floor(peer), page)
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {k: [] for k in [*variants, "page_of_1", "single_1"]}
    pair_ratios: list[float] = []
    try:
        for r in range(rounds + 3):
            if r == 3 and warmed is not None:
                warmed()
            order = [*variants, "pairs"]
            rng.shuffle(order)
            for name in order:
                if name == "pairs":
                    spent = {ones: 0.0, single_1: 0.0}
                    for _ in range(page):
                        for fn in sorted(spent, key=lambda _f: pair_order.random()):
                            t0 = time.perf_counter()
                            fn(1)
                            spent[fn] += time.perf_counter() - t0
                    if r >= 3:
                        samples["page_of_1"].append(spent[ones] / page * 1e6)
                        samples["single_1"].append(spent[single_1] / page * 1e6)
                        pair_ratios.append(spent[ones] / spent[single_1])
                    continue
                fn, n = variants[name]
                t0 = time.perf_counter()
                fn(n)
                if r >= 3:  # the first rounds warm caches and connections
                    samples[name].append((time.perf_counter() - t0) / n * 1e6)
    finally:
        floor_close()
        if raw_page is not None:
            raw_page[1]()
        store.dispose()

    def ratio(a: str, b: str) -> float:
        """The median of ``a``'s per-round cost over ``b``'s."""
        return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

    out = {**{k: statistics.median(v) for k, v in samples.items()},
           "page/floor": ratio("page", "floor"), "page/single": ratio("page", "single"),
           "single/floor": ratio("single", "floor"), "page_of_1/single_1": statistics.median(pair_ratios)}
    if peer is not None:
        out["page/powertools"] = ratio("page", "powertools")
    if raw_page is not None:
        out["raw_page/floor"] = ratio("raw_page", "floor")
        out["page/raw_page"] = ratio("page", "raw_page")
    return out


# The group claim's targets (docs/BENCHMARKS.md section 13).
PAGE_FLOOR_MAX = 0.5
PAGE_OF_1_MAX = 1.05
PAGE_POWERTOOLS_MAX = 0.8


def measure_all(page: int = 16, rounds: int = 40, seed: int = 1) -> dict[str, Any]:
    """``measure`` on SQLite and on PostgreSQL (when it answers): one row per database, the load around them."""
    load0 = os.getloadavg()
    rows: list[dict[str, Any]] = []
    peer_missing = powertools_missing() or (None if redis_version(REDIS_PORT) else "Redis unreachable on :6379")
    with contextlib.ExitStack() as stack:
        peer = None
        if peer_missing is None:
            try:
                port = stack.enter_context(redis_always())
            except RuntimeError as e:  # no redis-server binary to start the fsync-always one
                peer_missing = str(e)
            else:
                call, close = _powertools(port, f"replyd-pageclaim-{os.getpid()}")
                stack.callback(close)
                peer = call
        with tmpdir("pageclaim") as d:
            sync0 = fdatasync_us(d)
            url = sqlite_url(d / "r.sqlite3")
            Store.open(url).dispose()  # migrated before the floor's raw connections open it
            _history(url)
            rows.append({"database": "SQLite (WAL, FULL claims)",
                         **measure(url, _sqlite_floor(Path(d / "r.sqlite3"), "FULL", "NORMAL"), page, rounds, seed,
                                   peer, _sqlite_raw_page(Path(d / "r.sqlite3")))})
        if pg_available():
            with pg_databases(1, "page") as (url,):
                _history(url)
                rows.append({"database": "PostgreSQL",
                             **measure(url, _pg_floor(url, split=True), page, rounds, seed, peer,
                                       _pg_raw_page(url), warmed=lambda: pg_analyze(url))})
        with tmpdir("pageclaim") as d:
            sync1 = fdatasync_us(d)
    return {"page": page, "rounds": rounds, "seed": seed, "load": [load0[0], os.getloadavg()[0]], "rows": rows,
            "powertools_missing": peer_missing, "fdatasync_us": [sync0, sync1], "history": HISTORY}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """Section 13: a page's guarded posts against single posts and the raw floor, per parent."""
    t = Table(f"13. The group claim: a {res['page']}-parent page against one claim per commit, {res['rounds']} rounds",
              ["database", "page, per parent", "single posts, per parent", "raw floor, per parent",
               "Powertools (Redis appendfsync always), per parent", "page / floor", "page / Powertools",
               "page / single", "single / floor", "a page of 1 / one post",
               "raw page (its statements, no Python), per parent", "raw page / floor",
               "page / raw page"])
    for m in res["rows"]:
        pt, raw = "powertools" in m, "raw_page" in m
        t.rows.append([m["database"], f"{fmt_us(m['page'])} µs", f"{fmt_us(m['single'])} µs",
                       f"{fmt_us(m['floor'])} µs", f"{fmt_us(m['powertools'])} µs" if pt else "—",
                       fmt_ratio(m["page/floor"]), fmt_ratio(m["page/powertools"]) if pt else "—",
                       fmt_ratio(m["page/single"]), fmt_ratio(m["single/floor"]), fmt_ratio(m["page_of_1/single_1"]),
                       f"{fmt_us(m['raw_page'])} µs" if raw else "—", fmt_ratio(m["raw_page/floor"]) if raw else "—",
                       fmt_ratio(m["page/raw_page"]) if raw else "—"])
    for m in res["rows"]:
        db = m["database"].split(" (")[0]
        t.verdicts.append(verdict(m["page/floor"] <= PAGE_FLOOR_MAX,
                                  f"{db}: a page's post {m['page/floor']:.2f}× the one-claim-per-commit floor "
                                  f"(goal ≤ {PAGE_FLOOR_MAX}×)"))
        if "page/powertools" in m:
            t.verdicts.append(verdict(m["page/powertools"] <= PAGE_POWERTOOLS_MAX,
                                      f"{db}: a page's post {m['page/powertools']:.2f}× Powertools on Redis with "
                                      f"appendfsync always (goal ≤ {PAGE_POWERTOOLS_MAX}×)"))
        t.verdicts.append(verdict(m["page_of_1/single_1"] <= PAGE_OF_1_MAX,
                                  f"{db}: a page of 1 {m['page_of_1/single_1']:.2f}× one post "
                                  f"(goal ≤ {PAGE_OF_1_MAX}×)"))
    t.notes.append(
        f"Every round posts a fresh page of {res['page']} parents (the send stubbed) four ways, in a freshly shuffled "
        "order, so the machine's noise lands on all alike: `Guard.post_page` (the page's new keys claimed as `open` "
        "rows in one durable commit, each sent, the plain replies' closes in one relaxed commit at the end of the "
        "page), `Guard.post` per parent (the single path), a page of one against one `post`, and section 1's raw "
        "floor (an INSERT and an UPDATE per parent, each its own commit, no Python layers). Ratios are medians of "
        "per-round ratios; the first 3 rounds warm caches and connections and are not counted. Before the first "
        f"round the bot's table holds {res.get('history', 0):,} answered parents (a closed row and its two events "
        "each), as a live bot's does, and PostgreSQL's database is ANALYZEd, then again after the warm-up rounds, "
        "as autovacuum does a live table. On a fresh table's statistics the planner read a key through an index "
        "that shares only (platform, sender) with it, and every statement by key (a page's read and closes, the "
        "floor's UPDATE) walked all of the bot's rows, more each round (the floor measured 690-850 µs per parent "
        "against about 400 after); and statistics taken on a few hundred rows kept the page's close on a cached "
        "plan that reads all the bot's rows while the rounds grew the table tenfold.")
    t.notes.append(
        f"\"A page of 1\": {res['page']} pages of one parent per round (`post_page` with one item takes `post` "
        f"itself) against {res['page']} `post` calls, alternating post by post (which of a pair goes first drawn "
        "at random), a round's ratio that of the two sums: run one block after the other, the same call measured "
        "1.07x against itself, one fsync's noise, more than the 1.05x it is judged by. PostgreSQL's page is ONE statement for its claims and one "
        "for its closes (the rows as binary `unnest` arrays). Alone: `PYTHONPATH=. python -m bench.pageclaim "
        "--rounds N`.")
    if "fdatasync_us" in res:
        s0, s1 = res["fdatasync_us"]
        t.notes.append(
            f"The disk: one 8 KiB write's `fdatasync` took {s0:.0f} µs before the section and {s1:.0f} µs after "
            "(median of 200, in the bench's temporary directory). "
            "The floor pays one per parent, the page one per page, so the ratios move with it: on a disk whose "
            "fdatasync is cheap the floor is mostly statements and CPU, which a page shares only in part (its audit "
            "events are more statements than the floor's), and \"raw page / floor\" rises towards 0.5×.")
    if any("raw_page" in m for m in res["rows"]):
        t.notes.append(
            "\"Raw page\": the statements `Guard.post_page` issues for a page, replyd's own SQL text, with none of "
            "replyd's Python (the parameters built as the floor's are). SQLite, from raw `sqlite3`: the rows read, "
            "the rows and their events (one multi-row INSERT each) in one FULL commit, every close (`executemany`) and "
            "their events in one NORMAL commit. PostgreSQL, from raw psycopg: the rows read, the rows and their "
            "events as ONE durable autocommit statement, every close and its event as ONE relaxed one (binary "
            "`unnest` arrays). In the same shuffled rounds. It is what the page costs the database and its driver "
            "alone, so \"raw page / floor\" is the least \"page / floor\" can be with the audit events kept, and "
            "\"page / raw page\" is replyd's Python on top. Where fsync is cheap the floor is mostly statements, and "
            "the raw page's share of it rises.")
        t.notes.append(
            "Where a page's time goes, statement by statement, against the floor and the budget 0.5× the floor "
            "leaves replyd's Python: `PYTHONPATH=. python -m bench.pagesplit` (prints; writes nothing here).")
    if res.get("powertools_missing"):
        t.notes.append(f"No Powertools column: {res['powertools_missing']} (the bench extra installs "
                       "aws-lambda-powertools and redis; `redis-server` must be on PATH).")
    else:
        t.notes.append(
            "Powertools: section 2's `idempotent_function` on `RedisCachePersistenceLayer`, against a second "
            "`redis-server --appendonly yes --appendfsync always` started by the bench, one call per parent (it has "
            "no group form), in the same shuffled rounds. Both its writes (in progress, completed) are fsynced; "
            "replyd's page fsyncs one claim commit per page and closes in one relaxed commit.")
    return [t]


def page_args(doc: str, argv: list[str] | None, rounds: int) -> argparse.Namespace:
    """``--page``, ``--rounds``, ``--seed`` of a page bench (this one, ``bench.pagesplit``); logs quieted."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    log.configure(level="warning")  # a log line per post would be most of what is measured
    return a


def main(argv: list[str] | None = None) -> int:
    """Print the section's table (markdown)."""
    a = page_args(__doc__, argv, 40)
    res = measure_all(a.page, a.rounds, a.seed)
    print(f"page of {a.page}, {a.rounds} rounds; load average {res['load'][0]:.2f} before, {res['load'][1]:.2f} after; "
          f"fdatasync {res['fdatasync_us'][0]:.0f} µs before, {res['fdatasync_us'][1]:.0f} µs after")
    for t in tables(res, "PYTHONPATH=. python -m bench.pageclaim"):
        print(t.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
