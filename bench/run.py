"""replyd's benchmarks: run every section, print the tables, write docs/BENCHMARKS.md.

    .venv/bin/python bench/run.py                  # the full run (answered-log up to 10^6 rows)
    .venv/bin/python bench/run.py --quick          # a smoke run with small sizes (a minute or two)
    .venv/bin/python bench/run.py --rows-max 10000000   # growth up to 10^7 rows (long)
    .venv/bin/python bench/run.py --only overhead,readback

Needs the bench extra (aws-lambda-powertools, boto3, redis, pyinstrument),
PostgreSQL on 127.0.0.1:5432 (user root, trust; ``REPLYD_BENCH_PG`` overrides)
and Redis on 127.0.0.1:6379 plus ``redis-server`` on PATH. Sections whose
server is unreachable are reported as skipped, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Table, configure_quiet_logs, machine  # noqa: E402

SECTIONS = ("overhead", "races", "readback", "growth", "economy", "profile", "commitlevels", "timetoanswer", "slack",
            "aio", "aiolag", "pageclaim", "telegram", "manybots", "clistart", "prune", "fleet", "email")


def _load() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _sizes(rows_max: int, quick: bool) -> list[int]:
    if quick:
        return [10_000, 100_000][: max(1, len(str(rows_max)) - 4)]
    out, n = [], 10_000
    while n <= rows_max:
        out.append(n)
        n *= 10
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not for publishing")
    ap.add_argument("--rows-max", type=int, default=1_000_000, help="largest answered-log for growth (default 10^6)")
    ap.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to write ('-' for none)")
    ap.add_argument("--json", default="", help="also dump the raw results to this file")
    a = ap.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()] or list(SECTIONS)
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; known: {', '.join(SECTIONS)}")

    configure_quiet_logs()
    import warnings

    # Powertools outside Lambda warns on every call that it cannot read the remaining time; that is the setting measured.
    warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    cmd = ".venv/bin/python bench/run.py" + ("" if argv is None and len(sys.argv) == 1 else " " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    q = a.quick
    plan: dict[str, Callable[[], tuple[Any, list[Table]]]] = {}

    def overhead() -> tuple[Any, list[Table]]:
        from bench import overhead as o

        res = o.measure(200 if q else 500, 1 if q else 4, warmup=20 if q else 100, budget_s=None if q else 180)
        scen = o.scenarios(200 if q else 1000)
        return {"loop": _summary(res), "scenarios": scen}, o.tables(res, scen, cmd)

    def races() -> tuple[Any, list[Table]]:
        from bench import races as r

        res = r.measure(repeats=2 if q else 5, many_parents=200 if q else 1000)
        return res, r.tables(res, cmd)

    def readback() -> tuple[Any, list[Table]]:
        from bench import readback as rb

        res = rb.measure(200 if q else 1000)
        return res, rb.tables(res, cmd)

    def growth() -> tuple[Any, list[Table]]:
        from bench import growth as g

        res = g.measure(_sizes(a.rows_max, q), claims=200 if q else 1000, checks=400 if q else 2000,
                        sweeps=2 if q else 5, rss_claims=100 if q else 200)
        return res, g.tables(res, cmd)

    def economy() -> tuple[Any, list[Table]]:
        from bench import economy as e

        res = e.measure(60 if q else 200)
        return res, e.tables(res, cmd)

    def profile() -> tuple[Any, list[Table]]:
        from bench import profile as p

        res = p.measure(300 if q else 1000)
        return res, p.tables(res, cmd)

    def commitlevels() -> tuple[Any, list[Table]]:
        from bench import commitlevels as c

        res = c.measure(200 if q else 1000)
        return res, c.tables(res, cmd)

    def timetoanswer() -> tuple[Any, list[Table]]:
        from bench import timetoanswer as t

        res = t.measure(60 if q else 200)
        return res, t.tables(res, cmd)

    def slack() -> tuple[Any, list[Table]]:
        from bench import slack_duplicates as sd

        res = sd.measure(1 if q else 5)
        return res, sd.tables(res, cmd)

    def aio() -> tuple[Any, list[Table]]:
        """Section 11: the asyncio face against the sync face, send stubbed."""
        from bench import aio as ai

        res = ai.measure(100 if q else 1000, 100 if q else 300)
        return res, ai.tables(res, cmd)

    def aiolag() -> tuple[Any, list[Table]]:
        """Section 12: the loop's lag through 4 posts per parent on the sim."""
        from bench import aio as ai

        res = ai.measure_lag(100 if q else 1000)
        return res, ai.lag_tables(res, cmd)

    def pageclaim() -> tuple[Any, list[Table]]:
        """Section 13: the group claim against one claim per commit."""
        from bench import pageclaim as pc

        res = pc.measure_all(16, 5 if q else 40, 1)
        return res, pc.tables(res, cmd)

    def telegram() -> tuple[Any, list[Table]]:
        """Section 14: Telegram, a naive gateway against replyd."""
        from bench import telegram_naive as tg

        res = tg.measure(30 if q else 60, (1,) if q else (1, 2, 3))
        return res, tg.tables(res, cmd)

    def manybots() -> tuple[Any, list[Table]]:
        """Section 15: many bots in one daemon on the sim."""
        from bench import manybots as m

        res = m.measure([10, 100] if q else [10, 100, 300, 1000], idle_s=20 if q else 40,
                        refind_counts=[100] if q else [1000], refind_s=60.0)
        return res, m.tables(res, cmd)

    def clistart() -> tuple[Any, list[Table]]:
        """Section 16: the CLI's start, each command beside `python -c pass`."""
        from bench import clistart as cs

        res = cs.measure(5 if q else 15)
        return res, cs.tables(res, cmd)

    def fleet() -> tuple[Any, list[Table]]:
        """Section 18: three replicas on one PostgreSQL share 1,000 bots, against one replica alone."""
        from bench import fleet as fl

        res = fl.measure(100 if q else 1000, 3, idle_s=20 if q else 60, refind_s=60.0, settle_s=5 if q else 20)
        return res, fl.tables(res, cmd)

    def email() -> tuple[Any, list[Table]]:
        """Section 19: one email poll's memory with big mails in the inbox (a real Dovecot)."""
        from bench import email_memory as em

        res = em.measure_all([(24, 8.0)] if q else [(24, 8.0), (200, 25.0)])
        return res, em.tables(res, cmd)

    def prune() -> tuple[Any, list[Table]]:
        """Section 17: `replyd prune` on a large log, on both stores."""
        from bench import prune as pr

        res = pr.measure(20_000 if q else 1_000_000, ["sqlite", "postgres"])
        return res, pr.tables(res, cmd)

    plan = {"overhead": overhead, "races": races, "readback": readback, "growth": growth, "economy": economy,
            "profile": profile, "commitlevels": commitlevels, "timetoanswer": timetoanswer, "slack": slack,
            "aio": aio, "aiolag": aiolag, "pageclaim": pageclaim, "telegram": telegram, "manybots": manybots,
            "clistart": clistart, "prune": prune, "fleet": fleet, "email": email}
    started = datetime.now(timezone.utc)
    t_all = time.monotonic()
    info = machine()
    results: dict[str, Any] = {"machine": info, "command": cmd, "started": started.isoformat(timespec="seconds"),
                               "sections": {}}
    tables: dict[str, list[Table]] = {}
    timing: dict[str, tuple[float, str, str]] = {}
    print(f"replyd benchmarks: {cmd}", file=sys.stderr)
    for name in only:
        load0 = _load()
        t0 = time.monotonic()
        print(f"[{time.monotonic() - t_all:6.0f}s] {name} …", file=sys.stderr, flush=True)
        try:
            res, tbs = plan[name]()
        except Exception as exc:  # one broken section must not lose the others
            import traceback

            traceback.print_exc()
            res, tbs = {"error": f"{type(exc).__name__}: {exc}"}, [
                Table(f"{name}: FAILED", ["error"], [[f"{type(exc).__name__}: {str(exc)[:300]}"]])]
        timing[name] = (time.monotonic() - t0, load0, _load())
        results["sections"][name] = res
        tables[name] = tbs
        for t in tbs:
            print("\n" + t.text(), flush=True)
    total = time.monotonic() - t_all
    results["seconds"] = total
    print(f"\ntotal {total:.0f} s", file=sys.stderr)
    if a.out != "-":
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = render(results, tables, timing, cmd, q, info, started, total)
        if a.only and out.exists():  # a subset: its sections replace theirs, the rest of the file stays
            text = splice(out.read_text(), text, started)
        out.write_text(text)
        print(f"wrote {a.out}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def _numbered(text: str) -> dict[str, tuple[int, int]]:
    """Each numbered section (``## 15. …``) of a rendered file: its number and where it starts and ends."""
    heads = [m for m in re.finditer(r"^## .*$", text, re.M)]
    out = {}
    for i, m in enumerate(heads):
        num = re.match(r"## (\d+)\.", m.group(0))
        if num:
            out[num.group(1)] = (m.start(), heads[i + 1].start() if i + 1 < len(heads) else len(text))
    return out


def splice(old: str, new: str, started: datetime) -> str:
    """``old`` with each numbered section ``new`` has put in its place; the header and the rest kept."""
    fresh, kept = _numbered(new), _numbered(old)
    for num, (a, b) in sorted(kept.items(), key=lambda kv: -kv[1][0]):  # from the end: offsets stay valid
        if num in fresh:
            fa, fb = fresh[num]
            section = new[fa:fb].rstrip("\n").replace(
                "`\n", f"` (run alone on {started:%Y-%m-%d}; not in the full run above)\n", 1) + "\n\n"
            old = old[:a] + section + old[b:]
    return old


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """The loop's raw samples are large: keep medians, p99s and pairwise ratios in the JSON."""
    from bench.common import med, pct

    return {"n": res["n"], "rounds": res["rounds"], "seconds": res["seconds"],
            "variants": {k: {"median_us": med(v), "p99_us": pct(v, 99), "count": len(v)} for k, v in res["variants"].items()}}


def _goal_lines(tables: dict[str, list[Table]]) -> list[str]:
    out = []
    for name in SECTIONS:
        for t in tables.get(name, []):
            for v in t.verdicts:
                if v.startswith("**met**") or v.startswith("**MISSED**"):
                    out.append(f"| {t.title.split('.')[0]} | {v.replace('**met**: ', '').replace('**MISSED**: ', '')} | "
                               f"{'met' if v.startswith('**met**') else '**missed**'} |")
    return out


def render(results: dict[str, Any], tables: dict[str, list[Table]], timing: dict[str, tuple[float, str, str]], cmd: str,
           quick: bool, info: dict[str, str], started: datetime, total: float) -> str:
    """The whole docs/BENCHMARKS.md."""
    L: list[str] = []
    L.append("# replyd benchmarks")
    L.append("")
    L.append(f"Generated by `{cmd}` (also `make bench`) on {started.strftime('%Y-%m-%d %H:%M UTC')}, in {total / 60:.1f} "
             "minutes. Everything below is written by `bench/run.py`: tables, verdicts, the profile. "
             "Do not edit by hand; re-run it.")
    if quick:
        L.append("")
        L.append("> **This is a `--quick` smoke run** (small sizes, one round): the figures are not for publishing.")
    L.append("")
    L.append("This machine is shared and noisy. Absolute times are for information only. Every ratio is computed "
             "pair by pair inside one run. The compared variants are interleaved in one loop, so noise lands on both. "
             "Medians and p99 are over all repeated measurements. The load average before and after each section is "
             "recorded below. A reader can judge the noise from it.")
    L.append("")
    L.append("## How to run")
    L.append("")
    L.append("`make bench` runs `.venv/bin/python bench/run.py` after installing the `bench` extra. "
             "The extra holds `aws-lambda-powertools`, `boto3`, `redis` and `pyinstrument`. "
             "Powertools' idempotency package imports `boto3`. "
             "It needs PostgreSQL on 127.0.0.1:5432 (user root, trust). `REPLYD_BENCH_PG` overrides the admin URL. "
             "The bench creates and drops its own databases. "
             "It also needs Redis on 127.0.0.1:6379 and `redis-server` on the PATH. "
             "The bench starts and stops a second one with `appendfsync always`.")
    L.append("")
    L.append("- `--quick` is a smoke run.")
    L.append("- `--rows-max 10000000` adds the 10^7-row log to section 5. "
             "That takes about 14 GB per database and a long load.")
    L.append("- `--only SECTION[,SECTION]` runs a subset.")
    L.append("- `--out -` prints without writing this file.")
    L.append("")
    L.append("## Machine")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    for k, v in info.items():
        L.append(f"| {k} | {v} |")
    L.append("")
    L.append("| section | run time s | load average before | after | run alone with |")
    L.append("|---|---:|---|---|---|")
    for name, (secs, l0, l1) in timing.items():
        L.append(f"| {name} | {secs:.0f} | {l0} | {l1} | `.venv/bin/python bench/run.py{' --quick' if quick else ''} --only {name}` |")
    L.append("")
    goals = _goal_lines(tables)
    if goals:
        L.append("## Goals")
        L.append("")
        L.append("| section | figure | verdict |")
        L.append("|---|---|---|")
        L.extend(goals)
        L.append("")
    for name in SECTIONS:
        for t in tables.get(name, []):
            L.append(f"## {t.title}")
            L.append("")
            L.append(f"Command: `{cmd}`" + ("" if cmd.endswith(f"--only {name}") else
                                           f" (this section alone: `.venv/bin/python bench/run.py{' --quick' if quick else ''} --only {name}`)"))
            L.append("")
            md = t.markdown().split("\n", 2)[2]  # without its own heading
            L.append(md)
    L.extend(_closing(results, tables))
    return "\n".join(L).rstrip() + "\n"


def _reading(prof: dict[str, Any]) -> list[str]:
    """What the profile says, in words, from this run's figures."""
    out: list[str] = []

    def share(p: dict[str, Any], prefix: str) -> float:
        return sum(v for k, v in p["shares"].items() if k.startswith(prefix))

    sq = prof.get("SQLite")
    if sq:
        dbs, sa_s = share(sq, "database"), share(sq, "SQLAlchemy")
        py = share(sq, "replyd") + share(sq, "stdlib") + share(sq, "logging") + share(sq, "metrics") + share(sq, "SQLModel")
        calls = sq["per_post"].get("database calls", 0)
        out.append(
            f"On SQLite the database itself is {dbs * 100:.0f}% of a guarded post, the durable claim's fsync above all. "
            "The hot path runs the store's prebuilt statements straight through sqlite3. "
            "They are written once from the table definitions. "
            "They run on a connection the store keeps checked out between calls. "
            f"SQLAlchemy is down to {sa_s * 100:.0f}%: its pool, when no kept connection is at hand. "
            f"A post makes {calls:.0f} calls into SQLite where the floor makes 2. "
            "The first transaction: the read before the lock, `PRAGMA synchronous` as the durability changes, "
            "`BEGIN IMMEDIATE`, the row, its audit event, `COMMIT`. "
            "The second: `BEGIN IMMEDIATE`, the compare-and-set, its event, `COMMIT`. "
            f"The rest, {py * 100:.0f}%, is the guard's own Python. "
            "That is snapshot and event JSON, the hash, logging, metrics and outcome objects. "
            "The remaining bottleneck against the floor is the audit event in each transaction. "
            "Its row and two indexes are written inside the durable commit. After that comes the Python."
        )
    pg = prof.get("PostgreSQL")
    if pg:
        rt = pg["per_post"].get("round trips", 0)
        dbs, sa_s = share(pg, "database"), share(pg, "SQLAlchemy")
        py_pg = sum(share(pg, k) for k in ("replyd", "stdlib", "logging", "metrics", "SQLModel"))
        out.append("")
        out.append(
            f"On PostgreSQL {dbs * 100:.0f}% of a guarded post is spent in psycopg, most of it waiting on the server. "
            f"A post makes {rt:.0f} round trips; the raw floor makes 2. "
            + ("A pool pre-ping runs per checkout. " if pg["per_post"].get("pre_ping") else
               "There is no pool pre-ping: a dead idle connection is seen on its socket instead. ")
            + "The claim and the close are each ONE autocommit statement. "
            "It is a data-modifying CTE that writes the row and its event together. "
            "The close sets `synchronous_commit` off for its own transaction only. "
            f"SQLAlchemy takes {sa_s * 100:.0f}%, the guard's own Python {py_pg * 100:.0f}%. "
            "The remaining bottleneck is server work the floor does not do. "
            "That is the event row and its two indexes in each transaction, WAL included. "
            "After that comes the Python (snapshot and event JSON, logging, metrics). "
            "Against Powertools, the bottleneck is the two round trips and the synchronous commit themselves. "
            "Section 2 gives the raw floor's own ratio."
        )
    return out


def _closing(results: dict[str, Any], tables: dict[str, list[Table]]) -> list[str]:
    L: list[str] = []
    prof = results["sections"].get("profile")
    L.append("## Closing note: the bottleneck")
    L.append("")
    if not prof or "error" in prof:
        L.append("The profile section did not run.")
        return L
    for db, p in prof.items():
        shares = sorted(p["shares"].items(), key=lambda kv: -kv[1])
        sa_share = sum(v for k, v in p["shares"].items() if k.startswith("SQLAlchemy"))
        top = " ".join(f"{k} {v * 100:.0f}%." for k, v in shares[:3])
        L.append(f"- **{db}**: {top} SQLAlchemy Core as a whole takes {sa_share * 100:.0f}% of a guarded post.")
    L.append("")
    L.extend(_reading(prof))
    L.append("")
    if prof:
        L.append("### Appendix: call tree of a guarded post (pyinstrument)")
        L.append("")
        for db, p in prof.items():
            L.append(f"<details><summary>{db}</summary>")
            L.append("")
            L.append("```")
            L.append(p["tree"])
            L.append("```")
            L.append("")
            L.append("</details>")
            L.append("")
    return L


if __name__ == "__main__":
    raise SystemExit(main())
