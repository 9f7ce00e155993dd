"""Shared helpers of the benchmarks: statistics, the machine, databases, Redis, a stub platform.

Nothing here is imported by replyd itself. Every section module returns plain
data (a dict with a ``tables`` list) that ``bench/run.py`` renders.
"""

from __future__ import annotations

import os
import platform as pyplatform
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from replyd.platforms.base import Identity, Parent, Sent
from replyd.store import Store

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("REPLYD_BENCH_PG", "postgresql+psycopg://root@127.0.0.1:5432/postgres")
REDIS_HOST = "127.0.0.1"
REDIS_PORT = int(os.environ.get("REPLYD_BENCH_REDIS_PORT", "6379"))

# What a bulk-loaded or benchmarked key looks like on a real Mastodon instance.
INSTANCE = "mastodon:https://mastodon.example"
SENDER_ID = "109876543210987654"
IDENTITY = Identity(SENDER_ID, "replybot")
FIRST_PARENT = 113_000_000_000_000_000


# ----- statistics ------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def med(values: Sequence[float]) -> float:
    """Median; NaN for no values."""
    return statistics.median(values) if values else float("nan")


def fmt_us(v: float) -> str:
    """Microseconds for a table cell."""
    if v != v:
        return "–"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def fmt_ratio(v: float) -> str:
    """A ratio for a table cell."""
    return "–" if v != v else f"{v:.2f}×"


def fmt_s(v: float) -> str:
    """Seconds for a table cell."""
    if v != v:
        return "–"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def fmt_bytes(n: float) -> str:
    """A size for a table cell."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Table:
    """One Markdown table with the command that produced it and notes under it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        """Render as Markdown."""
        out = [f"### {self.title}", ""]
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|")
        for r in self.rows:
            out.append("| " + " | ".join(r) + " |")
        out.append("")
        for v in self.verdicts:
            out.append(f"- {v}")
        if self.verdicts:
            out.append("")
        for n in self.notes:
            out.append(n)
            out.append("")
        return "\n".join(out)

    def text(self) -> str:
        """Render for a terminal."""
        widths = [len(c) for c in self.columns]
        for r in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, r, strict=False)]
        line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(self.columns, widths, strict=False)))
        out = [self.title, line, "-" * len(line)]
        for r in self.rows:
            out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))))
        out.extend(f"  * {v}" for v in self.verdicts)
        return "\n".join(out)


def verdict(ok: bool, what: str) -> str:
    """A goal line: met or missed."""
    return f"{'**met**' if ok else '**MISSED**'}: {what}"


# ----- the machine ------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """Cores, CPU, memory, Python, SQLite, PostgreSQL and Redis versions, kernel, filesystem."""
    info: dict[str, str] = {}
    info["cores"] = str(os.cpu_count())
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = pyplatform.processor() or "?"
    info["cpu"] = model
    try:
        mem_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal")))
        info["memory"] = f"{mem_kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        info["memory"] = "?"
    info["os"] = f"{pyplatform.system()} {pyplatform.release()}"
    info["python"] = sys.version.split()[0]
    info["sqlite"] = sqlite3.sqlite_version
    try:
        import sqlalchemy

        info["sqlalchemy"] = sqlalchemy.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import psycopg

        info["psycopg"] = psycopg.__version__
    except ImportError:  # pragma: no cover
        pass
    info["postgresql"] = pg_version() or "unreachable"
    info["redis"] = redis_version(REDIS_PORT) or "unreachable"
    try:
        from importlib.metadata import version

        info["aws-lambda-powertools"] = version("aws-lambda-powertools")
    except Exception:  # not installed
        info["aws-lambda-powertools"] = "not installed"
    try:
        out = subprocess.run(["df", "-T", tempfile.gettempdir()], capture_output=True, text=True, timeout=5).stdout
        fields = out.splitlines()[1].split()
        info["tmp filesystem"] = f"{fields[1]} on {fields[0]}"
    except Exception:  # df missing
        pass
    return info


def pg_version() -> str | None:
    """PostgreSQL server version, or None if it does not answer."""
    try:
        eng = sa.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with eng.connect() as c:
            v = c.exec_driver_sql("SHOW server_version").scalar()
        eng.dispose()
        return str(v)
    except Exception:
        return None


def redis_version(port: int) -> str | None:
    """Redis server version on ``port``, or None."""
    try:
        import redis

        r = redis.Redis(host=REDIS_HOST, port=port, socket_connect_timeout=2)
        v = r.info("server").get("redis_version")
        r.close()
        return str(v)
    except Exception:
        return None


# ----- databases ----------------------------------------------------------------------------------


def pg_available() -> bool:
    """Whether the PostgreSQL server answers."""
    return pg_version() is not None


def psycopg_dsn(url: str) -> str:
    """A libpq connection string for a SQLAlchemy URL."""
    u = sa.engine.make_url(url)
    parts = [f"host={u.host or '127.0.0.1'}", f"port={u.port or 5432}", f"dbname={u.database}", f"user={u.username or 'root'}"]
    if u.password:
        parts.append(f"password={u.password}")
    return " ".join(parts)


def pg_analyze(url: str) -> None:
    """ANALYZE the database a warm-up filled, as autovacuum does a live table. On a fresh table's statistics (no
    rows) the planner reads a key through ``ix_replies_opened``, which shares only (platform, sender) with it:
    every statement by key (a read, a close, the floor's UPDATE) then walks every row of the bot, and more each
    round (measured: the floor's post 690-850 µs before, about 400 µs after)."""
    import psycopg

    with psycopg.connect(psycopg_dsn(url), autocommit=True) as c:
        c.execute("ANALYZE")


@contextmanager
def pg_databases(n: int, tag: str) -> Iterator[list[str]]:
    """``n`` fresh migrated PostgreSQL databases (URLs), dropped afterwards."""
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    names = [f"replyd_bench_{tag}_{i}_{uuid.uuid4().hex[:6]}" for i in range(n)]
    urls = []
    try:
        with admin.connect() as c:
            for name in names:
                c.exec_driver_sql(f'CREATE DATABASE "{name}"')
        for name in names:
            url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
            Store.open(url).dispose()
            urls.append(url)
        yield urls
    finally:
        with admin.connect() as c:
            for name in names:
                c.exec_driver_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
                )
                c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        admin.dispose()


@contextmanager
def tmpdir(prefix: str) -> Iterator[Path]:
    """A temporary directory removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=f"replyd-bench-{prefix}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fdatasync_us(directory: Path, n: int = 200) -> float:
    """Median µs of one 8 KiB write + ``fdatasync`` in ``directory`` (as ``pg_test_fsync`` measures): what a durable
    commit waits for on this disk. A ratio to a floor made of commits moves with it: where it is cheap, the floor
    is mostly statements and CPU, and batching commits saves little."""
    path = directory / f".fdatasync-probe-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    block = os.urandom(8192)
    times = []
    try:
        for _ in range(n):
            os.pwrite(fd, block, 0)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return statistics.median(times)


def sqlite_url(path: Path) -> str:
    """SQLAlchemy URL of a SQLite file."""
    return f"sqlite:///{path}"


def sqlite_size(path: Path) -> int:
    """Bytes on disk of a SQLite database with its WAL and shared-memory files."""
    total = 0
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{path}{suffix}")
        if p.exists():
            total += p.stat().st_blocks * 512
    return total


# ----- Redis with appendfsync always --------------------------------------------------------------


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_always() -> Iterator[int]:
    """A second redis-server with ``appendonly yes`` and ``appendfsync always``; yields its port, then stops it."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found")
    port = free_port()
    with tmpdir("redis") as d:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes", "--appendfsync", "always",
             "--save", "", "--dir", str(d), "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while redis_version(port) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("second redis-server did not start")
                time.sleep(0.05)
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# ----- the stubbed platform --------------------------------------------------------------------------


class StubPlatform:
    """The smallest Platform the guard can post through: ``send`` returns ``Sent(id)`` at once."""

    kind = "stub"

    def __init__(self, instance: str = INSTANCE, listing_delay_s: float = 10.0) -> None:
        self.instance = instance
        self.listing_delay_s = listing_delay_s
        self.n = 0

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Return a new reply id immediately."""
        self.n += 1
        return Sent(str(FIRST_PARENT + 10_000_000 + self.n))

    def close(self) -> None:
        """Nothing to release."""


def make_parent(i: int, *, base: int = FIRST_PARENT) -> Parent:
    """A parent shaped like one the Mastodon adapter builds (its snapshot is what replyd stores)."""
    pid = str(base + i * 7)
    return Parent(
        id=pid,
        author_id=str(110_000_000_000_000_000 + i % 5000),
        author_handle=f"user{i % 5000}",
        text="thinking about coffee, the weather and the release, what do you think?",
        url=f"https://mastodon.example/@user{i % 5000}/{pid}",
        created_at=1_764_000_000.0 + i,
        extra={"acct": f"user{i % 5000}", "visibility": "public", "in_reply_to_id": None,
               "spoiler_text": "", "language": "en"},
    )


REPLY_TEXT = "@user thanks for your post! (answered once by replyd)"


def snapshot_json(p: Parent) -> str:
    """The snapshot column replyd writes for ``p``, computed as replyd computes it (the floors pay the same)."""
    from replyd.guard import snapshot_json as replyd_snapshot_json

    return replyd_snapshot_json(p)


def shuffled(items: Sequence[Any], rng: random.Random) -> list[Any]:
    """A shuffled copy."""
    out = list(items)
    rng.shuffle(out)
    return out


def configure_quiet_logs() -> None:
    """replyd's structlog at level error, to stderr (info lines are filtered before rendering, as in a quiet daemon)."""
    from replyd import log as rlog

    rlog.configure("json", "error", stream=sys.stderr)
