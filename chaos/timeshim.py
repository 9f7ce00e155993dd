"""Run ``python -m replyd`` with a wall clock that the chaos runner can jump.

Usage: ``python -m chaos.timeshim OFFSET_FILE -- run --config FILE``. The file
holds a number of seconds; ``time.time()`` (which is all replyd's
``SystemClock`` reads) returns the real time plus that offset, re-read every
20 ms, so the runner jumps a replica's clock forward or back by rewriting the
file. Like libfaketime, but only for ``time.time``: monotonic clocks (httpx
timeouts, APScheduler's intervals, SQLite's busy timeout) keep running, as
they do when NTP steps a real clock.

With ``CHAOS_STALL_FILE`` set, the guard's open commit is wrapped (here, never
in replyd): when that file exists, the first open to return after it appeared
takes it (renames it ``*.taken.<n>``) and its thread sleeps the seconds the
file holds before going on to the send, as a process paused (or a database
answer held) between the open and the send would. That is the chaos
``stall_open`` fault on SQLite, which has no wire a proxy could hold.
"""

from __future__ import annotations

import os
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


def _stall_opens(path: str) -> None:
    """Wrap ``Guard._open_composed`` so that an armed stall file pauses the thread after the open commits."""
    from replyd import guard

    real = guard.Guard._open_composed
    taken = [0]

    def stalled(self, key, row, text):
        out = real(self, key, row, text)
        if isinstance(out, guard.Outcome):
            return out
        taken[0] += 1
        mine = f"{path}.taken.{os.getpid()}.{taken[0]}"
        try:
            os.rename(path, mine)  # atomic: one open takes one armed stall
            os.utime(mine)  # its mtime is now when the pause began (the runner's settle waits it out)
        except OSError:
            return out
        try:
            with open(mine) as fh:
                time.sleep(float(fh.read().strip() or 0))
        except (OSError, ValueError):
            pass
        return out

    guard.Guard._open_composed = stalled  # type: ignore[method-assign]


def main() -> None:
    """Patch time.time, then run replyd's command line with the remaining arguments."""
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: python -m chaos.timeshim OFFSET_FILE -- <replyd arguments>")
    path = sys.argv[1]
    _read(path)
    time.time = lambda: _real_time() + _offset[0]  # type: ignore[assignment]
    time.time_ns = lambda: _real_time_ns() + int(_offset[0] * 1e9)  # type: ignore[assignment]
    threading.Thread(target=_follow, args=(path,), daemon=True, name="timeshim").start()
    if os.environ.get("CHAOS_STALL_FILE"):
        _stall_opens(os.environ["CHAOS_STALL_FILE"])
    sys.argv = ["replyd", *sys.argv[3:]]
    runpy.run_module("replyd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
