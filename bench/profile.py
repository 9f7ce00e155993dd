"""The guard's hot path under pyinstrument: where a guarded post's time goes.

Profiles ``Guard.post`` (claim + close, send stubbed) on SQLite and on
PostgreSQL as shipped, and attributes every sample's self time to a category
by the file of the frame that was running.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from bench.common import IDENTITY, REPLY_TEXT, StubPlatform, Table, make_parent, pg_available, pg_databases, sqlite_url, tmpdir
from replyd.guard import Guard
from replyd.store import Store

# (category, test on (file path, function name)); first match wins.
_DRIVER_FUNCS = {"do_execute", "do_executemany", "do_commit", "do_rollback", "do_ping", "do_begin", "_exec_command",
                 "wait", "execute", "commit", "rollback", "fetchone", "_fetch_gen", "_execute_gen", "_commit_gen",
                 "_rollback_gen", "wait_c", "wait_conn", "_wait_conn", "_start_query", "_maybe_prepare_gen"}
CATEGORIES = [
    ("database + driver (sqlite3 / psycopg, incl. fsync)",
     lambda f, fn: ("/psycopg/" in f) or ("sqlalchemy/engine/default.py" in f and fn in _DRIVER_FUNCS)
     or ("<built-in>" in f and fn.split(".")[0] in ("Connection", "Cursor", "PGconn", "PGresult"))),
    ("SQLAlchemy: building statements + compiled-cache keys", lambda f, fn: "sqlalchemy/sql/" in f),
    ("SQLAlchemy: execution, pool, events, results", lambda f, fn: "sqlalchemy/" in f and "/orm/" not in f),
    ("SQLModel / pydantic / ORM row objects", lambda f, fn: "sqlmodel/" in f or "pydantic" in f or "sqlalchemy/orm/" in f),
    ("metrics (replyd/metrics.py, prometheus_client)", lambda f, fn: "replyd/metrics.py" in f or "prometheus_client" in f),
    ("logging (structlog)", lambda f, fn: "structlog" in f),
    ("replyd guard + store code", lambda f, fn: "/replyd/" in f),
    ("stdlib (json, dataclasses, hashlib, contextlib…)", lambda f, fn: True),
]


def _category(path: str, fn: str) -> str:
    for name, test in CATEGORIES:
        if test(path, fn):
            return name
    return CATEGORIES[-1][0]


def _self_times(frame: Any, acc: Counter[str], hot: Counter[str]) -> None:
    child_total = sum(c.time for c in frame.children)
    own = max(0.0, frame.time - child_total)
    path = frame.file_path or ""
    fn = frame.function or ""
    if frame.is_synthetic:
        # pyinstrument's "[self]"/"[await]" leaves: charge them to the parent's file.
        parent = frame.parent
        path = (parent.file_path or "") if parent is not None else ""
        fn = (parent.function or "") if parent is not None else ""
    if own > 0:
        acc[_category(path, fn)] += own
        hot[f"{fn} ({frame.file_path_short or path})"] += own
    for c in frame.children:
        _self_times(c, acc, hot)


def _profile(store: Store, n: int) -> dict[str, Any]:
    from pyinstrument import Profiler

    guard = Guard(store, StubPlatform(), IDENTITY)
    for i in range(100):
        guard.post(make_parent(50_000_000 + i), REPLY_TEXT)
    prof = Profiler(interval=0.0005)
    t0 = time.perf_counter()
    prof.start()
    for i in range(n):
        guard.post(make_parent(i), REPLY_TEXT)
    prof.stop()
    wall = time.perf_counter() - t0
    session = prof.last_session
    root = session.root_frame()
    acc: Counter[str] = Counter()
    hot: Counter[str] = Counter()
    if root is not None:
        _self_times(root, acc, hot)
    total = sum(acc.values()) or 1.0
    tree = prof.output_text(unicode=False, color=False, show_all=False, short_mode=False)
    return {"n": n, "us_per_post": wall / n * 1e6, "shares": {k: v / total for k, v in acc.items()},
            "hot": [(k, v / total) for k, v in hot.most_common(12)], "tree": _trim(tree),
            "per_post": _count_statements(store, guard, 200)}


def _count_statements(store: Store, guard: Guard, n: int) -> dict[str, float]:
    """Calls into SQLite / round trips to PostgreSQL per guarded post, counted at the driver, outside the profiler.

    The hot path runs prebuilt SQL straight through the driver, so SQLAlchemy's execute events would not see it:
    SQLite counts every statement its trace callback reports (PRAGMA, BEGIN, COMMIT included), PostgreSQL every
    statement psycopg sends and waits for: ``Cursor.execute`` plus its own commands (BEGIN, COMMIT, ROLLBACK).
    """
    cnt: Counter[str] = Counter()
    if store.is_sqlite:
        conns: list[Any] = []

        def trace(sql: str) -> None:
            cnt["statements"] += 1
            if sql.strip().upper() == "COMMIT":
                cnt["commits"] += 1

        def on_connect(dbapi_conn: Any) -> None:
            dbapi_conn.set_trace_callback(trace)
            conns.append(dbapi_conn)

        store.dispose()  # the connections from here on are traced
        stop_tracing = store.on_connect(on_connect)
        try:
            for i in range(20):  # open the connections, then count
                guard.post(make_parent(59_000_000 + i), REPLY_TEXT)
            cnt.clear()
            for i in range(n):
                guard.post(make_parent(60_000_000 + i), REPLY_TEXT)
        finally:
            stop_tracing()
            for c in conns:
                c.set_trace_callback(None)
    else:
        import psycopg
        from psycopg._connection_base import BaseConnection

        orig_exec, orig_cmd = psycopg.Cursor.execute, BaseConnection._exec_command

        def execute(self: Any, *a: Any, **k: Any) -> Any:
            cnt["round trips"] += 1
            return orig_exec(self, *a, **k)

        def command(self: Any, *a: Any, **k: Any) -> Any:
            cnt["round trips"] += 1
            return orig_cmd(self, *a, **k)

        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        BaseConnection._exec_command = command  # type: ignore[method-assign]
        try:
            for i in range(n):
                guard.post(make_parent(60_000_000 + i), REPLY_TEXT)
        finally:
            psycopg.Cursor.execute = orig_exec  # type: ignore[method-assign]
            BaseConnection._exec_command = orig_cmd  # type: ignore[method-assign]
    per = {k: v / n for k, v in cnt.items()}
    if store.is_sqlite:
        # Every statement (PRAGMA, BEGIN and COMMIT included) is one call into SQLite; nothing crosses a socket.
        per["database calls"] = per.get("statements", 0)
    else:
        per["statements"] = per.get("round trips", 0)
    return per


def _trim(tree: str, max_lines: int = 70) -> str:
    lines = [ln for ln in tree.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "Guard.post" in ln or "wrapper" in ln), 0)
    return "\n".join(lines[max(0, start - 1): start - 1 + max_lines])


def measure(n: int = 1500) -> dict[str, Any]:
    """Profile SQLite and PostgreSQL posts."""
    out: dict[str, Any] = {}
    with tmpdir("profile") as d:
        s = Store.open(sqlite_url(d / "p.sqlite3"))
        out["SQLite"] = _profile(s, n)
        s.dispose()
    if pg_available():
        with pg_databases(1, "prof") as urls:
            s = Store.open(urls[0])
            out["PostgreSQL"] = _profile(s, n)
            s.dispose()
    return out


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """Share of a guarded post's time by category, per database."""
    dbs = [db for db in ("SQLite", "PostgreSQL") if db in res]
    t = Table("7. Profile of the guard's hot path (pyinstrument)", ["where the time goes"] + [f"{db} share" for db in dbs])
    names = [c[0] for c in CATEGORIES]
    for name in names:
        if all(res[db]["shares"].get(name, 0) < 0.005 for db in dbs):
            continue
        t.rows.append([name] + [f"{res[db]['shares'].get(name, 0) * 100:.0f}%" for db in dbs])
    t.rows.append(["µs per post under the profiler"] + [f"{res[db]['us_per_post']:,.0f}" for db in dbs])
    if "SQLite" in dbs:
        sp = res["SQLite"]["per_post"]
        t.rows.append(["SQLite calls per post, PRAGMA/BEGIN/COMMIT included (the floor: 2)"] + [
            f"{sp.get('database calls', 0):.1f} (incl. {sp.get('commits', 0):.0f} commits)" if db == "SQLite" else "–"
            for db in dbs])
    if "PostgreSQL" in dbs:
        pp = res["PostgreSQL"]["per_post"]
        t.rows.append(["PostgreSQL round trips per post (the floor: 2)"] + [
            f"{pp.get('round trips', 0):.1f}"
            if db == "PostgreSQL" else "–" for db in dbs])
    for db in dbs:
        hot = "; ".join(f"`{k}` {v * 100:.0f}%" for k, v in res[db]["hot"][:8])
        t.notes.append(f"{db}, hottest frames by self time: {hot}.")
    t.notes.append(
        f"{res[dbs[0]]['n']:,} guarded posts of new parents (send stubbed), sampled every 0.5 ms; every sample's self time "
        "is charged to the category of the file it was running in. The sqlite3 module's C calls show as their own "
        "frames (`Connection.execute`, which runs `COMMIT` too) and psycopg's time is spent waiting on the socket "
        "(`psycopg/connection.py:wait`): both count as \"database + driver\", which includes the fsync of a durable "
        "commit. The call tree is in the appendix."
    )
    return [t]
