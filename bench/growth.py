"""Section 5: cost growth with the answered-log's size.

For each size the log is bulk-loaded with closed rows (and their two events)
straight through the driver (executemany on SQLite, COPY on PostgreSQL). Then
a FRESH process — the daemon's stand-in, whose peak RSS is reported — opens the
store through replyd and measures: the claim and the close of new parents (a
guarded post, send stubbed), the read-only pre-check ``Guard.check`` on random
answered parents, and a sweep of 100 due open rows hidden among them.

Run directly: ``python -m bench.growth --child ...`` is the measuring process.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    FIRST_PARENT,
    INSTANCE,
    ROOT,
    SENDER_ID,
    Table,
    fmt_bytes,
    fmt_s,
    fmt_us,
    make_parent,
    pg_available,
    pg_databases,
    psycopg_dsn,
    snapshot_json,
    sqlite_size,
    sqlite_url,
    tmpdir,
    verdict,
)

DUE = 100
DUE_BUDGET_S = 0.3  # the due rows' send budget: they are due once it has passed
CHUNK = 20_000


def _rows(n: int, now: float) -> Any:
    """Closed rows of the log, oldest first; parent ids as Mastodon serves them."""
    snap_tpl = snapshot_json(make_parent(0))
    for i in range(n):
        pid = str(FIRST_PARENT + i * 7)
        t = now - 86_400 * 30 + i * 0.01
        # deadline_at NULL: what a first attempt's close leaves (only a retry's close keeps one for the sweep to verify).
        yield (INSTANCE, SENDER_ID, pid, "closed", 1, t, t + 1, t, None, t + 1, None, str(FIRST_PARENT + 10**12 + i * 7),
               f"{pid[:20]}{i:020d}"[:40], "ab" * 32, "inbox", snap_tpl.replace(str(FIRST_PARENT), pid, 1),
               "host:1:abcdef", None, None, None)


_COLS = ("platform", "sender_id", "parent_id", "state", "attempt", "created_at", "updated_at", "opened_at", "deadline_at",
         "closed_at", "not_before", "reply_id", "provider_key", "text_hash", "path", "snapshot", "owner", "lease_owner",
         "lease_until", "error")
_ECOLS = ("at", "platform", "sender_id", "parent_id", "kind", "state", "attempt", "owner", "detail")


def _events(n: int, now: float) -> Any:
    for i in range(n):
        pid = str(FIRST_PARENT + i * 7)
        t = now - 86_400 * 30 + i * 0.01
        yield (t, INSTANCE, SENDER_ID, pid, "claimed", "open", 1, "host:1:abcdef", '{"path": "inbox"}')
        yield (t + 1, INSTANCE, SENDER_ID, pid, "closed", "closed", 1, "host:1:abcdef",
               f'{{"reply_id": "{FIRST_PARENT + 10**12 + i * 7}"}}')


def _chunks(it: Any, size: int) -> Any:
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def load_sqlite(path: Path, n: int) -> float:
    """Create the schema through replyd, then bulk-insert ``n`` closed rows and 2n events; return seconds."""
    import sqlite3

    from replyd.store import Store

    Store.open(sqlite_url(path)).dispose()
    t0 = time.monotonic()
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=OFF")  # loading only; replyd's own connections set FULL/NORMAL
    c.execute("PRAGMA cache_size=-200000")
    now = time.time()
    ins = f"INSERT INTO replies ({', '.join(_COLS)}) VALUES ({', '.join('?' * len(_COLS))})"
    eins = f"INSERT INTO events ({', '.join(_ECOLS)}) VALUES ({', '.join('?' * len(_ECOLS))})"
    for chunk in _chunks(_rows(n, now), CHUNK):
        c.execute("BEGIN")
        c.executemany(ins, chunk)
        c.execute("COMMIT")
    for chunk in _chunks(_events(n, now), CHUNK * 2):
        c.execute("BEGIN")
        c.executemany(eins, chunk)
        c.execute("COMMIT")
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.execute("ANALYZE")
    c.close()
    return time.monotonic() - t0


def load_pg(url: str, n: int) -> float:
    """Bulk-load with COPY (indexes dropped and rebuilt); return seconds."""
    import psycopg

    t0 = time.monotonic()
    now = time.time()
    with psycopg.connect(psycopg_dsn(url), autocommit=True) as c:
        c.execute("DROP INDEX IF EXISTS ix_replies_due")
        c.execute("DROP INDEX IF EXISTS ix_events_key")
        c.execute("DROP INDEX IF EXISTS ix_events_at")
        c.execute("ALTER TABLE replies DROP CONSTRAINT IF EXISTS replies_pkey")
        with c.cursor() as cur:
            with cur.copy(f"COPY replies ({', '.join(_COLS)}) FROM STDIN") as cp:
                for row in _rows(n, now):
                    cp.write_row(row)
            with cur.copy(f"COPY events ({', '.join(_ECOLS)}) FROM STDIN") as cp:
                for row in _events(n, now):
                    cp.write_row(row)
        c.execute("ALTER TABLE replies ADD PRIMARY KEY (platform, sender_id, parent_id)")
        c.execute("CREATE INDEX ix_replies_due ON replies (state, deadline_at)")
        c.execute("CREATE INDEX ix_events_key ON events (platform, sender_id, parent_id)")
        c.execute("CREATE INDEX ix_events_at ON events (at)")
        c.execute("VACUUM ANALYZE replies")
        c.execute("VACUUM ANALYZE events")
    return time.monotonic() - t0


def pg_size(url: str) -> int:
    """Bytes of the replies and events tables with their indexes."""
    import psycopg

    with psycopg.connect(psycopg_dsn(url), autocommit=True) as c:
        return int(c.execute("SELECT pg_total_relation_size('replies') + pg_total_relation_size('events')").fetchone()[0])


def _vm_hwm_kb() -> int | None:
    """This process's peak resident set (VmHWM) in KiB, from /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


# ----- the measuring child -----------------------------------------------------------------------


def child(url: str, n: int, claims: int, checks: int) -> dict[str, Any]:
    """Measure claim/close, check and a 100-row sweep on a store of ``n`` rows; report peak RSS."""
    from bench.common import IDENTITY, REPLY_TEXT, StubPlatform, configure_quiet_logs, med, pct
    from replyd.guard import Guard, Status
    from replyd.platforms.memory import MemoryPlatform
    from replyd.store import Store
    from replyd.sweep import Bot, Sweeper

    configure_quiet_logs()
    store = Store.open(url)
    stub = StubPlatform(listing_delay_s=10.0)
    guard = Guard(store, stub, IDENTITY)
    marks: dict[str, float] = {}
    orig_send = stub.send

    def send(parent, text, *, provider_key):
        marks["sent"] = time.perf_counter()
        return orig_send(parent, text, provider_key=provider_key)

    stub.send = send  # type: ignore[method-assign]
    rng = random.Random(5)
    base = FIRST_PARENT + n * 7 + 1_000_003
    claim_us, close_us, check_us = [], [], []
    for j in range(50):  # warm-up
        guard.post(make_parent(j, base=base + 10**9), REPLY_TEXT)
        guard.check(str(FIRST_PARENT + rng.randrange(n) * 7))
    for j in range(claims):
        p = make_parent(j, base=base)
        t0 = time.perf_counter()
        out = guard.post(p, REPLY_TEXT)
        t1 = time.perf_counter()
        if out.status is not Status.POSTED:
            raise RuntimeError(f"growth post: {out}")
        claim_us.append((marks["sent"] - t0) * 1e6)
        close_us.append((t1 - marks["sent"]) * 1e6)
    for _ in range(checks):
        pid = str(FIRST_PARENT + rng.randrange(n) * 7)
        t0 = time.perf_counter()
        out = guard.check(pid)
        check_us.append((time.perf_counter() - t0) * 1e6)
        if out is None or out.status is not Status.ALREADY_ANSWERED:
            raise RuntimeError(f"growth check {pid}: {out}")
    # 100 due open rows among the n closed ones, opened the real way through a memory platform.
    mem = MemoryPlatform(instance=INSTANCE, sender_id=SENDER_ID, listing_delay_s=0.0, script=["lost"] * DUE)
    # A short send budget, not none: a send with no budget left is never made (the stall guard), nothing opens.
    g2 = Guard(store, mem, IDENTITY, send_timeout_s=DUE_BUDGET_S)
    for j in range(DUE):
        g2.post(mem.add_parent(str(base + 2 * 10**9 + j)), REPLY_TEXT)
    time.sleep(DUE_BUDGET_S)  # every open row past its deadline (the listing delay is 0): due
    t0 = time.perf_counter()
    r = Sweeper(store, [Bot(mem, IDENTITY)]).run_once()
    sweep_s = time.perf_counter() - t0
    if r.closed != DUE:
        raise RuntimeError(f"growth sweep closed {r.closed} of {DUE}")
    store.dispose()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over execve from the forking parent.
    rss_kb = _vm_hwm_kb() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"claim_p50": med(claim_us), "claim_p99": pct(claim_us, 99), "close_p50": med(close_us),
            "close_p99": pct(close_us, 99), "check_p50": med(check_us), "check_p99": pct(check_us, 99),
            "sweep_s": sweep_s, "sweep_closed": r.closed, "rss_mb": rss_kb / 1024}


def _run_child(url: str, n: int, claims: int, checks: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.growth", "--child", url, str(n), str(claims), str(checks)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"growth child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleaved(urls: dict[int, str], *, claims: int, checks: int, sweeps: int, seed: int = 9) -> dict[str, Any]:
    """Time claim/close, check and the 100-row sweep on every size in ONE loop, sizes shuffled per iteration."""
    from bench.common import IDENTITY, REPLY_TEXT, StubPlatform, med, pct
    from replyd.guard import Guard, Status
    from replyd.platforms.memory import MemoryPlatform
    from replyd.store import Store
    from replyd.sweep import Bot, Sweeper

    sizes = sorted(urls)
    rng = random.Random(seed)
    stores = {n: Store.open(urls[n]) for n in sizes}
    marks: dict[str, float] = {}
    guards = {}
    for n in sizes:
        stub = StubPlatform(listing_delay_s=10.0)
        orig = stub.send

        def send(parent, text, *, provider_key, _orig=orig):
            marks["sent"] = time.perf_counter()
            return _orig(parent, text, provider_key=provider_key)

        stub.send = send  # type: ignore[method-assign]
        guards[n] = Guard(stores[n], stub, IDENTITY)
    claim: dict[int, list[float]] = {n: [] for n in sizes}
    close: dict[int, list[float]] = {n: [] for n in sizes}
    check: dict[int, list[float]] = {n: [] for n in sizes}
    sweep: dict[int, list[float]] = {n: [] for n in sizes}
    base = {n: FIRST_PARENT + n * 7 + 3_000_003 for n in sizes}
    for j in range(50):  # warm-up
        for n in sizes:
            guards[n].post(make_parent(j, base=base[n] + 10**9), REPLY_TEXT)
            guards[n].check(str(FIRST_PARENT + rng.randrange(n) * 7))
    for j in range(claims):
        for n in sorted(sizes, key=lambda _n: rng.random()):
            t0 = time.perf_counter()
            out = guards[n].post(make_parent(j, base=base[n]), REPLY_TEXT)
            t1 = time.perf_counter()
            if out.status is not Status.POSTED:
                raise RuntimeError(f"growth post: {out}")
            claim[n].append((marks["sent"] - t0) * 1e6)
            close[n].append((t1 - marks["sent"]) * 1e6)
    for _ in range(checks):
        for n in sorted(sizes, key=lambda _n: rng.random()):
            pid = str(FIRST_PARENT + rng.randrange(n) * 7)
            t0 = time.perf_counter()
            out = guards[n].check(pid)
            check[n].append((time.perf_counter() - t0) * 1e6)
            if out is None or out.status is not Status.ALREADY_ANSWERED:
                raise RuntimeError(f"growth check {pid}: {out}")
    for k in range(sweeps):
        for n in sorted(sizes, key=lambda _n: rng.random()):
            # 100 due open rows among the n closed ones, opened the real way (memory platform, lost responses).
            mem = MemoryPlatform(instance=INSTANCE, sender_id=SENDER_ID, listing_delay_s=0.0, script=["lost"] * DUE)
            g2 = Guard(stores[n], mem, IDENTITY, send_timeout_s=DUE_BUDGET_S)  # see child()
            for j in range(DUE):
                g2.post(mem.add_parent(str(base[n] + 2 * 10**9 + k * 1000 + j)), REPLY_TEXT)
            time.sleep(DUE_BUDGET_S)
            t0 = time.perf_counter()
            r = Sweeper(stores[n], [Bot(mem, IDENTITY)]).run_once()
            sweep[n].append(time.perf_counter() - t0)
            if r.closed != DUE:
                raise RuntimeError(f"growth sweep closed {r.closed} of {DUE}")
    for s_ in stores.values():
        s_.dispose()
    small = sizes[0]

    def ratio(d: dict[int, list[float]], n: int) -> float:
        return med([a / b for a, b in zip(d[n], d[small], strict=True)])

    return {n: {"claim_p50": med(claim[n]), "claim_p99": pct(claim[n], 99), "close_p50": med(close[n]),
                "close_p99": pct(close[n], 99), "check_p50": med(check[n]), "check_p99": pct(check[n], 99),
                "sweep_s": med(sweep[n]), "sweep_max_s": max(sweep[n]),
                "claim_ratio": ratio(claim, n), "check_ratio": ratio(check, n), "sweep_ratio": ratio(sweep, n)}
            for n in sizes}


def measure(sizes: list[int], *, claims: int = 1000, checks: int = 2000, sweeps: int = 5, rss_claims: int = 200,
            pg: bool = True) -> dict[str, Any]:
    """Load every size on SQLite and (when reachable) PostgreSQL, measure peak RSS per size, then time them interleaved."""
    from contextlib import ExitStack

    out: dict[str, Any] = {"sizes": sizes, "claims": claims, "checks": checks, "sweeps": sweeps, "rss_claims": rss_claims,
                           "rows": []}
    kinds = ["SQLite"] + (["PostgreSQL"] if pg and pg_available() else [])
    for kind in kinds:
        with ExitStack() as stack:
            urls: dict[int, str] = {}
            loads: dict[int, float] = {}
            sizes_on_disk: dict[int, int] = {}
            if kind == "SQLite":
                d = stack.enter_context(tmpdir("growth"))
                for n in sizes:
                    path = d / f"log-{n}.sqlite3"
                    loads[n] = load_sqlite(path, n)
                    urls[n] = sqlite_url(path)
            else:
                pg_urls = stack.enter_context(pg_databases(len(sizes), "growth"))
                for n, url in zip(sizes, pg_urls, strict=True):
                    loads[n] = load_pg(url, n)
                    urls[n] = url
            rss = {n: _run_child(urls[n], n, rss_claims, rss_claims * 2) for n in sizes}
            timed = interleaved(urls, claims=claims, checks=checks, sweeps=sweeps)
            for n in sizes:
                sizes_on_disk[n] = sqlite_size(Path(urls[n][len("sqlite:///"):])) if kind == "SQLite" else pg_size(urls[n])
                out["rows"].append({"db": kind, "n": n, "load_s": loads[n], "size": sizes_on_disk[n],
                                    "rss_mb": rss[n]["rss_mb"], **timed[n]})
    return out


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The growth table."""
    t = Table("5. Growth of the answered-log",
              ["database", "rows", "claim p50 µs", "claim p99 µs", "claim ratio", "close p50 µs", "check p50 µs",
               "check p99 µs", "check ratio", f"sweep {DUE} due rows s (median)", "sweep ratio", "size on disk",
               "peak RSS MiB", "bulk load s"])
    for r in res["rows"]:
        t.rows.append([r["db"], f"{r['n']:,}", fmt_us(r["claim_p50"]), fmt_us(r["claim_p99"]), f"{r['claim_ratio']:.2f}×",
                       fmt_us(r["close_p50"]), fmt_us(r["check_p50"]), fmt_us(r["check_p99"]), f"{r['check_ratio']:.2f}×",
                       fmt_s(r["sweep_s"]), f"{r['sweep_ratio']:.2f}×", fmt_bytes(r["size"]), f"{r['rss_mb']:.0f}",
                       f"{r['load_s']:.1f}"])
    for db in ("SQLite", "PostgreSQL"):
        rows = [r for r in res["rows"] if r["db"] == db]
        if len(rows) < 2:
            continue
        first, last = rows[0], rows[-1]
        span = f"{first['n']:,} → {last['n']:,} rows"
        c = max(r["claim_ratio"] for r in rows)
        k = max(r["check_ratio"] for r in rows)
        s = max(r["sweep_ratio"] for r in rows)
        rss = max(r["rss_mb"] for r in rows)
        t.verdicts.append(verdict(c <= 1.5, f"{db} claim p50, {span}: at most {c:.2f}× the smallest log's (goal ≤ 1.5×)"))
        t.verdicts.append(verdict(k <= 1.5, f"{db} check p50, {span}: at most {k:.2f}× (goal ≤ 1.5×)"))
        if k > 1.5:
            worst = max(rows, key=lambda r: r["check_ratio"])
            cache = ("SQLite's page cache of 2 MiB per connection" if db == "SQLite"
                     else "PostgreSQL's shared buffers")
            t.verdicts.append(
                f"{db} check, where the growth is: {fmt_us(first['check_p50'])} µs at {first['n']:,} rows, "
                f"{fmt_us(worst['check_p50'])} µs at {worst['n']:,} ({fmt_bytes(worst['size'])}) — one primary-key "
                f"`SELECT` outside any transaction; the extra {worst['check_p50'] - first['check_p50']:.0f} µs are the "
                f"B-tree's deeper levels and the page reads once the log outgrows {cache} (O(log n), no scan). The "
                "ratio misses because the small-log check itself now costs that little")
        t.verdicts.append(verdict(s <= 1.5, f"{db} sweep of {DUE} due rows, {span}: at most {s:.2f}× (goal: independent "
                                  "of size; ≤ 1.5× taken as flat)"))
        t.verdicts.append(verdict(rss <= 100, f"{db} peak RSS of a process using the log: at most {rss:.0f} MiB (goal ≤ 100 MB)"))
    t.notes.append(
        "Each size is bulk-loaded with closed rows shaped like the Mastodon adapter's (18-digit parent ids, a ~400-byte "
        "snapshot) plus their two events (`claimed`, `closed`), straight through the driver (SQLite executemany with "
        "`synchronous=OFF` for the load only; PostgreSQL COPY with the indexes rebuilt after). All sizes of one database "
        "are then timed in ONE loop through replyd, the sizes in a shuffled order each iteration: "
        f"{res['claims']:,} guarded posts of new parents per size (claim = from the call to the stubbed send, close = "
        f"from the send's return to the outcome), {res['checks']:,} `Guard.check` calls on random answered parents, and "
        f"{res['sweeps']} rounds of one `Sweeper.run_once()` over {DUE} due open rows (opened through the memory "
        "platform's `lost` step) among the n closed ones. A ratio is the median over iterations of (this size / the "
        "smallest size) of the same iteration. Peak RSS: a separate fresh process per size opens the log through "
        f"replyd, makes {res['rss_claims']} posts, {res['rss_claims'] * 2} checks and one 100-row sweep, and reports its "
        "`VmHWM`. Size on disk: SQLite file + WAL; PostgreSQL `pg_total_relation_size` of both tables."
    )
    return [t]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=4, metavar=("URL", "N", "CLAIMS", "CHECKS"))
    a = ap.parse_args()
    if a.child:
        url, n, claims, checks = a.child
        print(json.dumps(child(url, int(n), int(claims), int(checks))))
