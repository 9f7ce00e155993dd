"""Run ``python -m replyd`` with a wall clock that the chaos runner can jump.

Usage: ``python -m chaos.timeshim OFFSET_FILE -- run --config FILE``. The file
holds a number of seconds; ``time.time()`` (which is all replyd's
``SystemClock`` reads) returns the real time plus that offset, re-read every
20 ms, so the runner jumps a replica's clock forward or back by rewriting the
file. Like libfaketime, but only for ``time.time``: monotonic clocks (httpx
timeouts, APScheduler's intervals, SQLite's busy timeout) keep running, as
they do when NTP steps a real clock.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time

_real_time = time.time
_real_time_ns = time.time_ns
_offset = [0.0]


def _read(path: str) -> None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
        if text:
            _offset[0] = float(text)
    except (OSError, ValueError):
        pass


def _follow(path: str) -> None:
    while True:
        _read(path)
        time.sleep(0.02)


def main() -> None:
    """Patch time.time, then run replyd's command line with the remaining arguments."""
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: python -m chaos.timeshim OFFSET_FILE -- <replyd arguments>")
    path = sys.argv[1]
    _read(path)
    time.time = lambda: _real_time() + _offset[0]  # type: ignore[assignment]
    time.time_ns = lambda: _real_time_ns() + int(_offset[0] * 1e9)  # type: ignore[assignment]
    threading.Thread(target=_follow, args=(path,), daemon=True, name="timeshim").start()
    sys.argv = ["replyd", *sys.argv[3:]]
    runpy.run_module("replyd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
