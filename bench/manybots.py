"""Many bots in one daemon: idle cost and a burst of one mention per bot, against the sim.

    PYTHONPATH=. python -m bench.manybots --bots 10,100,300,1000 [--refind 1000] [--idle-s 40] [--job-threads 16]
    PYTHONPATH=. python -m bench.manybots --bots "" --refind 1000 --before /tmp/before [--rounds 3]

The second form runs the daemon from the checkout ``--before`` and from this tree in turns, on one sim.

Per bot count N: the sim runs in its own process (``python -m bench.manybots --serve-sim N``: replyd's
simulated platform with N bot accounts and one user, plus a request counter and a burst route); one config
with N bots (one sim account each, inbox every 5 s, search off, re-find off or every ``--refind-s``, SQLite) is run by ``replyd run``
as a subprocess. Once it logged ``replyd.daemon.started`` and settled, the daemon process is watched idle
for ``--idle-s``: RSS and thread count (``/proc/<pid>/status``, the largest seen), CPU as a share of one
core (``/proc/<pid>/stat`` utime + stime over the window), and CPU per empty poll (that CPU, everything the
daemon did while idle, sweeps and re-offers included, divided by the inbox polls the sim served in the
window). Then the sim posts one mention to every bot at once and the bench asks it every 0.1 s which
mentions have a reply by their bot: the time until the last one is answered is counted on the sim. One
JSON line per bot count on stdout, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import httpx

from bench.common import Table, tmpdir, verdict

ROOT = Path(__file__).resolve().parents[1]
USER = "alice"
INBOX_S = 5.0
TICK_S = os.sysconf("SC_CLK_TCK")
GOALS = {"rss_mb": 250.0, "threads": 64, "cpu_pct": 25.0, "answer_s": 10.0, "cpu_ms_per_poll": 1.25}


def bot_name(i: int) -> str:
    """The i-th bot's sim account and config name."""
    return f"bot{i:04d}"


def bot_token(i: int) -> str:
    """The i-th bot's sim token."""
    return f"tok-{bot_name(i)}"


# ----- the sim side (a child process) ------------------------------------------------------------


def serve_sim(n: int) -> int:
    """Serve the sim with ``n`` bot accounts, a request counter and a burst route; print SIM_URL; run until signalled."""
    import threading

    from replyd.clock import SystemClock
    from replyd.sim import SimServer, World
    import replyd.sim.server as sim_server

    world = World(SystemClock(), seed=36, listing_delay_s=0.2)
    bots = [world.add_account(bot_name(i), bot=True, token=bot_token(i)) for i in range(n)]
    world.add_account(USER, token="tok-alice")
    counts: Counter[str] = Counter()
    burst: dict[str, str] = {}  # parent id -> the bot's account id it mentions

    async def reply(send: Any, body: Any) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    def answered() -> dict[str, Any]:
        """Which burst parents have a reply by their bot, and when (the sim's clock)."""
        with world.lock:
            first: dict[str, float] = {}
            replies: Counter[str] = Counter()
            for s in world.statuses.values():
                if s.in_reply_to_id in burst and s.account_id == burst[s.in_reply_to_id]:
                    replies[s.in_reply_to_id] += 1
                    first[s.in_reply_to_id] = min(first.get(s.in_reply_to_id, s.created_at), s.created_at)
            posted = {p: world.statuses[p].created_at for p in burst}
        waits = sorted(first[p] - posted[p] for p in first)
        return {"parents": len(burst), "answered": len(first), "duplicates": sum(v - 1 for v in replies.values()),
                "waits": waits, "burst_at": min(posted.values(), default=0.0)}

    def make(app: Any) -> Any:
        async def counting(scope: Any, receive: Any, send: Any) -> None:
            path = scope.get("path", "")
            if scope.get("type") == "http" and path.startswith("/_bench/"):
                if path == "/_bench/counts":
                    await reply(send, dict(counts))
                elif path == "/_bench/burst":  # one mention to every bot, at once (one lock hold each)
                    for b in bots:
                        burst[world.post(USER, "help?", mention=[b]).id] = b.id
                    await reply(send, {"posted": len(burst)})
                else:
                    await reply(send, answered())
                return
            if scope.get("type") == "http" and not path.startswith("/_sim"):
                counts[f"{scope['method']} {path if '/statuses/' not in path else '/api/v1/statuses/:id'}"] += 1
            await app(scope, receive, send)

        return counting

    original = sim_server.build_app
    sim_server.build_app = lambda w: make(original(w))  # type: ignore[assignment]
    server = SimServer(world).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"SIM_URL={server.base_url}", flush=True)
    stop.wait()
    server.stop()
    return 0


# ----- the daemon side ---------------------------------------------------------------------------


def write_config(path: Path, base_url: str, db: Path | str, n: int, job_threads: int | None, *,
                 inbox_s: float = INBOX_S, jitter_s: float | None = None, sweep_s: float | None = None,
                 level: str = "info", refind_s: float = 0.0, fleet: str = "") -> Path:
    """One daemon config with ``n`` bots, each its own sim account (token in ``MB_TOKEN_<i>``); inbox every
    ``inbox_s``, search off, re-find every ``refind_s`` (0: off); the daemon's defaults unless given (also
    ``tests/test_manybots.py``'s). ``db`` is a SQLite file or a store URL; ``fleet`` a ``[fleet]`` table's body."""
    url = db if isinstance(db, str) else f"sqlite:///{db}"
    out = [f'[store]\nurl = "{url}"\n', f'[log]\nformat = "json"\nlevel = "{level}"\n']
    if fleet:
        out.append(f"[fleet]\n{fleet}\n")
    if job_threads is not None:
        out.append(f"[daemon]\njob_threads = {job_threads}\n")
    if sweep_s is not None:
        out.append(f"[sweep]\ninterval_s = {sweep_s}\n")
    jitter = "" if jitter_s is None else f"jitter_s = {jitter_s}\n"
    for i in range(n):
        out.append(f"""[[bots]]
name = "{bot_name(i)}"
platform = "mastodon"
[bots.settings]
base_url = "{base_url}"
token_env = "MB_TOKEN_{i:04d}"
listing_delay_s = {min(1.0, inbox_s)}
timeout_s = 10.0
[bots.pollers]
inbox_interval_s = {inbox_s}
search_interval_s = 0
refind_interval_s = {refind_s}
{jitter}[bots.responder]
kind = "template"
template = "Thanks @{{author_handle}}."
""")
    path.write_text("\n".join(out))
    os.chmod(path, 0o600)
    return path


def proc_status(pid: int) -> dict[str, int]:
    """RSS (kB) and thread count of ``pid``."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "Threads"):
            out[k] = int(v.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


def _start_sim(n: int) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.manybots", "--serve-sim", str(n)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("SIM_URL="):
            return proc, line.strip().split("=", 1)[1]
    proc.kill()
    raise RuntimeError("the sim did not start")


def _stop(proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_started(log_path: Path, proc: subprocess.Popen[Any], timeout_s: float) -> float:
    """Seconds until the daemon logged ``replyd.daemon.started``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"replyd run exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        if "replyd.daemon.started" in log_path.read_text(errors="replace"):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError("replyd run did not start in time")


def measure_one(n: int, *, idle_s: float, settle_s: float, answer_timeout_s: float,
                job_threads: int | None, refind_s: float = 0.0, root: Path = ROOT) -> dict[str, Any]:
    """Idle cost and burst answer time of one daemon with ``n`` bots, its code from the tree at ``root``."""
    sim, base_url = _start_sim(n)
    http = httpx.Client(base_url=base_url, timeout=60)
    daemon: subprocess.Popen[bytes] | None = None
    try:
        with tmpdir("manybots") as tmp:
            cfg = write_config(tmp / "replyd.toml", base_url, tmp / "replyd.sqlite3", n, job_threads,
                               refind_s=refind_s)
            env = {**os.environ, **{f"MB_TOKEN_{i:04d}": bot_token(i) for i in range(n)},
                   "PYTHONPATH": str(root)}
            log_path = tmp / "replyd.log"
            with log_path.open("wb") as logf:
                daemon = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg)], stdout=logf,
                                          stderr=subprocess.STDOUT, env=env, cwd=root)
                start_s = _wait_started(log_path, daemon, 120 + n * 0.2)
                time.sleep(settle_s)
                pid = daemon.pid
                polls0 = http.get("/_bench/counts").json().get("GET /api/v1/notifications", 0)
                c0, s0, t0 = cpu_s(pid), cpu_s(sim.pid), time.monotonic()
                rss, threads = 0, 0
                while time.monotonic() - t0 < idle_s:
                    st = proc_status(pid)
                    rss, threads = max(rss, st["VmRSS"]), max(threads, st["Threads"])
                    time.sleep(1.0)
                c1, s1, t1 = cpu_s(pid), cpu_s(sim.pid), time.monotonic()
                polls = http.get("/_bench/counts").json().get("GET /api/v1/notifications", 0) - polls0
                log_lines_idle = sum(1 for _ in log_path.open("rb"))
                # The burst: one mention to each bot, posted by the sim in one go.
                b0, cb0 = time.monotonic(), cpu_s(pid)
                http.post("/_bench/burst")
                posted_s = time.monotonic() - b0
                got: dict[str, Any] = {}
                while time.monotonic() - b0 < answer_timeout_s:
                    got = http.get("/_bench/answered").json()
                    st = proc_status(pid)
                    rss, threads = max(rss, st["VmRSS"]), max(threads, st["Threads"])
                    if got["answered"] >= n:
                        break
                    time.sleep(0.1)
                busy = {"rss_mb": rss / 1024, "threads": threads, "cpu_s": cpu_s(pid) - cb0,
                        "wall_s": time.monotonic() - b0}
                time.sleep(2.0)  # a duplicate would land right after the first reply
                got = http.get("/_bench/answered").json()
            _stop(daemon)
            code = daemon.returncode
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
        http.close()
        _stop(sim)
    waits = got.get("waits") or []
    window = t1 - t0
    return {
        "bots": n, "refind_s": refind_s, "job_threads": job_threads, "start_s": round(start_s, 1), "idle_s": round(window, 1),
        "rss_mb": round(busy["rss_mb"], 1), "threads_max": busy["threads"],
        "cpu_pct_idle": round(100 * (c1 - c0) / window, 1),
        "polls": polls, "polls_expected": round(n * window / INBOX_S),
        "cpu_ms_per_poll": round(1000 * (c1 - c0) / polls, 3) if polls else None,
        "sim_cpu_pct": round(100 * (s1 - s0) / window, 1), "log_lines_idle": log_lines_idle,
        "burst_post_s": round(posted_s, 2), "burst_cpu_s": round(busy["cpu_s"], 2),
        "burst_cpu_pct": round(100 * busy["cpu_s"] / busy["wall_s"], 1), "answered": got.get("answered", 0), "duplicates": got.get("duplicates"),
        "answer_s_p50": round(statistics.median(waits), 2) if waits else None,
        "answer_s_max": round(waits[-1], 2) if waits else None,
        "exit_code": code, "load": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def measure(counts: list[int], *, idle_s: float = 40.0, settle_s: float = 12.0, answer_timeout_s: float = 90.0,
            job_threads: int | None = None, refind_counts: Sequence[int] = (), refind_s: float = 60.0) -> dict[str, Any]:
    """One daemon per bot count, one after the other, re-find off; then each of ``refind_counts`` with re-find
    every ``refind_s`` (as the shipped configs run). Each result also printed as one JSON line."""
    rows = []
    runs = [(n, 0.0) for n in counts] + [(n, refind_s) for n in refind_counts]
    for n, every_s in runs:
        # With re-find on, the idle window holds one whole re-find interval: each bot's re-find counts once.
        r = measure_one(n, idle_s=max(idle_s, every_s), settle_s=settle_s, answer_timeout_s=answer_timeout_s,
                        job_threads=job_threads, refind_s=every_s)
        print(json.dumps(r), flush=True)
        rows.append(r)
    return {"rows": rows, "idle_s": idle_s, "inbox_s": INBOX_S}


def compare(n: int, before: Path, *, rounds: int = 3, refind_s: float = 60.0, idle_s: float = 40.0,
            settle_s: float = 12.0, answer_timeout_s: float = 90.0) -> Table:
    """``n`` bots with re-find every ``refind_s``: the code at ``before`` (a checkout) and this tree, taking
    turns for ``rounds`` rounds on one sim build. One run alone varies by a few points of CPU here."""
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
    for _ in range(rounds):
        for label, root in (("before", before), ("now", ROOT)):
            r = measure_one(n, idle_s=max(idle_s, refind_s), settle_s=settle_s, answer_timeout_s=answer_timeout_s,
                            job_threads=None, refind_s=refind_s, root=root)
            print(json.dumps({"side": label, **r}), flush=True)
            runs[label].append(r)
    t = Table(f"{n:,} bots, re-find every {refind_s:.0f} s: the code before against now, {rounds} turns each",
              ["code", "idle CPU % of a core (each turn)", "median", "CPU ms per empty poll (median)",
               "answer max s (each turn)", "duplicates (sim)"])
    med = {k: statistics.median(r["cpu_pct_idle"] for r in v) for k, v in runs.items()}
    for label, rs in runs.items():
        t.rows.append([label, " / ".join(f"{r['cpu_pct_idle']:.1f}" for r in rs), f"{med[label]:.1f}",
                       f"{statistics.median(r['cpu_ms_per_poll'] or 0 for r in rs):.3f}",
                       " / ".join(f"{r['answer_s_max']}" for r in rs), str(sum(r["duplicates"] or 0 for r in rs))])
    t.notes.append(f"Idle CPU now / before: {med['now'] / med['before']:.2f}x (medians).")
    return t


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The many-bots table with its verdicts against the many-bots targets."""
    t = Table("15. Many bots in one daemon: 10 to 1,000 bots on the sim",
              ["bots", "re-find", "RSS MB", "threads (max)", "idle CPU % of a core", "CPU ms per empty poll", "polls (sim)",
               "answered", "duplicates (sim)", "answer p50 s", "answer max s", "load average"])
    for r in res["rows"]:
        refind = f"every {r['refind_s']:.0f} s" if r.get("refind_s") else "off"
        t.rows.append([f"{r['bots']:,}", refind, f"{r['rss_mb']:.0f}", str(r["threads_max"]), f"{r['cpu_pct_idle']:.1f}",
                       "–" if r["cpu_ms_per_poll"] is None else f"{r['cpu_ms_per_poll']:.2f}", f"{r['polls']:,}",
                       f"{r['answered']:,}/{r['bots']:,}", str(r["duplicates"]),
                       "–" if r["answer_s_p50"] is None else f"{r['answer_s_p50']:.1f}",
                       "–" if r["answer_s_max"] is None else f"{r['answer_s_max']:.1f}", r["load"]])
    for big in _biggest(res["rows"]):
        t.verdicts += _verdicts(big)
    t.notes.append(f"Command: `{cmd}`.")
    return [t]


def _biggest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The largest run with re-find off, and the largest with it on (when one ran)."""
    out = []
    for on in (False, True):
        runs = [r for r in rows if bool(r.get("refind_s")) is on]
        if runs:
            out.append(max(runs, key=lambda r: r["bots"]))
    return out


def _verdicts(big: dict[str, Any]) -> list[str]:
    """One run's figures against the many-bots goals."""
    n = f"{big['bots']:,} bots" + (f", re-find every {big['refind_s']:.0f} s" if big.get("refind_s") else "")
    return [
        verdict(big["rss_mb"] <= GOALS["rss_mb"], f"{n}: {big['rss_mb']:.0f} MB RSS (goal ≤ 250 MB)"),
        verdict(big["threads_max"] <= GOALS["threads"], f"{n}: {big['threads_max']} threads (goal ≤ 64)"),
        verdict(big["cpu_pct_idle"] <= GOALS["cpu_pct"], f"{n}: idle CPU {big['cpu_pct_idle']:.1f} % of a core (goal ≤ 25 %)"),
        verdict((big["cpu_ms_per_poll"] or 99) <= GOALS["cpu_ms_per_poll"],
                f"{n}: {big['cpu_ms_per_poll']} ms CPU per empty poll (goal ≤ 1.25 ms)"),
        verdict(big["answered"] == big["bots"] and (big["answer_s_max"] or 99) <= GOALS["answer_s"],
                f"{n}: last mention answered {big['answer_s_max']} s after the burst (goal ≤ 10 s)"),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--serve-sim N``, be its sim)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bots", default="10,100,300,1000", help="comma-separated bot counts")
    ap.add_argument("--idle-s", type=float, default=40.0, help="idle window measured per bot count")
    ap.add_argument("--settle-s", type=float, default=12.0, help="wait after the start before measuring")
    ap.add_argument("--answer-timeout-s", type=float, default=90.0)
    ap.add_argument("--job-threads", type=int, default=None, help="write [daemon] job_threads (default: the daemon's)")
    ap.add_argument("--refind", default="", help="comma-separated bot counts run again with re-find on")
    ap.add_argument("--refind-s", type=float, default=60.0, help="the re-find interval of those runs")
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout of older code: run the first --refind count against it and this tree, in turns")
    ap.add_argument("--rounds", type=int, default=3, help="turns each with --before")
    ap.add_argument("--serve-sim", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_sim is not None:
        return serve_sim(a.serve_sim)
    if a.before is not None:
        n = int(a.refind.split(",")[0]) if a.refind.strip() else 1000
        print(compare(n, a.before.resolve(), rounds=a.rounds, refind_s=a.refind_s, idle_s=a.idle_s,
                      settle_s=a.settle_s, answer_timeout_s=a.answer_timeout_s).markdown())
        return 0
    measure([int(x) for x in a.bots.split(",") if x.strip()], idle_s=a.idle_s, settle_s=a.settle_s,
            answer_timeout_s=a.answer_timeout_s, job_threads=a.job_threads,
            refind_counts=[int(x) for x in a.refind.split(",") if x.strip()], refind_s=a.refind_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
