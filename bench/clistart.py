"""Section 16: how fast the CLI answers, each command beside `python -c pass` in one interleaved loop.

    .venv/bin/python -m bench.clistart              # 15 rounds, prints the table
    .venv/bin/python -m bench.clistart --rounds 30
    git worktree add ../before <commit> && .venv/bin/python -m bench.clistart --against ../before

Every round runs each command once, in a fresh shuffled order, as a whole process (the interpreter's start
included). The read commands run on a SQLite store of 1,000 answered rows made once before the loop.
Goals: `--version` and `-h` under 0.2 s; `status`, `log`, `explain` and `check` under 0.6 s.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Table  # noqa: E402

FAST_GOAL_S = 0.2
READ_GOAL_S = 0.6
COMMANDS: dict[str, tuple[list[str], float | None]] = {
    "python -c pass": (["-c", "pass"], None),
    "replyd --version": (["-m", "replyd", "--version"], FAST_GOAL_S),
    "replyd -h": (["-m", "replyd", "-h"], FAST_GOAL_S),
    "replyd status": (["-m", "replyd", "status"], READ_GOAL_S),
    "replyd log": (["-m", "replyd", "log"], READ_GOAL_S),
    "replyd explain p-500": (["-m", "replyd", "explain", "p-500"], READ_GOAL_S),
    "replyd check p-500": (["-m", "replyd", "check", "p-500"], READ_GOAL_S),
}


def _seed(state: Path, rows: int) -> None:
    """A default SQLite store under ``state`` with ``rows`` answered parents (the memory platform)."""
    os.environ["XDG_STATE_HOME"] = str(state)
    from replyd.guard import Guard
    from replyd.platforms.memory import MemoryPlatform
    from replyd.store import Store

    store = Store.open()
    plat = MemoryPlatform(instance="memory:bench")
    guard = Guard(store, plat, plat.whoami())
    for i in range(rows):
        guard.post(plat.add_parent(f"p-{i}"), "hello")
    store.dispose()


_SEED = """
import sys
from replyd.guard import Guard
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
store = Store.open()
plat = MemoryPlatform(instance="memory:bench")
guard = Guard(store, plat, plat.whoami())
for i in range(int(sys.argv[1])):
    guard.post(plat.add_parent(f"p-{i}"), "hello")
store.dispose()
"""


def _seed_with(tree: Path, state: Path, rows: int) -> None:
    """Seed a store under ``state`` with the replyd of another checkout ``tree`` (its own schema)."""
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-c", _SEED, str(rows)], env=env, cwd=tree, check=True, capture_output=True)


def measure(rounds: int = 15, rows: int = 1000, against: Path | None = None) -> dict[str, Any]:
    """Seconds per command per round (wall clock of the whole process), commands shuffled in each round.

    ``against``: another checkout (a git worktree of an older commit); each replyd command runs there too, on a
    store it seeded itself, in the same shuffled rounds: the two columns are side by side on one machine state."""
    with tempfile.TemporaryDirectory(prefix="replyd-clistart-") as tmp:
        state = Path(tmp) / "state"
        _seed(state, rows)
        envs = {"": {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT)}}
        variants = {name: (argv, "") for name, (argv, _) in COMMANDS.items()}
        if against is not None:
            other = Path(tmp) / "against"
            _seed_with(against, other, rows)
            envs["against"] = {**os.environ, "XDG_STATE_HOME": str(other), "PYTHONPATH": str(against)}
            variants.update({f"{name} @ {against.name}": (argv, "against")
                             for name, (argv, _) in COMMANDS.items() if name.startswith("replyd")})
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}  # user + system: steadier on a busy machine
        names = list(variants)
        for _ in range(rounds):
            random.shuffle(names)
            for name in names:
                argv, which = variants[name]
                cwd = ROOT if not which else against
                t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
                r = subprocess.run([sys.executable, *argv], env=envs[which], cwd=cwd, capture_output=True)
                times[name].append(time.perf_counter() - t0)
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[name].append(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
                if r.returncode not in (0, 1):
                    raise RuntimeError(f"{name}: exit {r.returncode}: {r.stderr.decode()[-300:]}")
    return {"rounds": rounds, "rows": rows, "times": times, "cpu": cpu, "load": os.getloadavg(),
            "against": str(against) if against else None}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """Median and max per command, and the median against `python -c pass`'s; with ``against``, the CPU ratio."""
    base = statistics.median(res["times"]["python -c pass"])
    against = Path(res["against"]).name if res.get("against") else None
    cols = ["command", "median s", "max s", "median − python s", "median CPU s", "goal s"]
    if against:
        cols.append(f"CPU / {against}'s")
    t = Table(f"16. CLI start: each command beside python -c pass, {res['rounds']} rounds, "
              f"a store of {res['rows']:,} rows", cols)
    for name, (_, goal) in COMMANDS.items():
        for label in [name, *([f"{name} @ {against}"] if against and name.startswith("replyd") else [])]:
            xs, cpu = res["times"][label], statistics.median(res["cpu"][label])
            med = statistics.median(xs)
            row = [f"`{label}`", f"{med:.3f}", f"{max(xs):.3f}", f"{med - base:.3f}", f"{cpu:.3f}",
                   "—" if goal is None or label != name else f"{goal}"]
            if against:
                other = res["cpu"].get(f"{name} @ {against}")
                row.append(f"{cpu / statistics.median(other):.2f}" if other and label == name else "")
            t.rows.append(row)
            if goal is not None and label == name:
                word = "**met**" if med <= goal else "**MISSED**"
                t.verdicts.append(f"{word}: `{name}` median {med:.3f} s (goal ≤ {goal} s)")
    t.notes.append(f"Command: `{cmd}`. Each figure is a whole process: the interpreter's own start is the first row. "
                   f"Load average at the end: {' / '.join(f'{x:.1f}' for x in res['load'])}; on a busy machine the "
                   "CPU column (user + system of the process) is the steadier one.")
    return [t]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--against", type=Path, help="another checkout (e.g. `git worktree add ../old <commit>`) to "
                                                 "run beside this one, in the same rounds")
    a = ap.parse_args(argv)
    res = measure(a.rounds, a.rows, a.against.resolve() if a.against else None)
    cmd = ".venv/bin/python -m bench.clistart" + (f" --rounds {a.rounds}" if a.rounds != 15 else "") + (
        f" --against {a.against}" if a.against else "")
    for t in tables(res, cmd):
        print(t.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
