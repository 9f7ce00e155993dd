"""Races between real OS processes on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import collections
import multiprocessing as mp
import queue
import time

import pytest

from replyd.platforms.memory import MemoryPlatform
from tests import workers

pytestmark = pytest.mark.slow
CTX = mp.get_context("spawn")


def _run(target, args_for, n: int, timeout_s: float = 240.0) -> list:
    """Start n processes that meet at one barrier; return what each reported."""
    barrier = CTX.Barrier(n, timeout=timeout_s)
    results = CTX.Queue()
    procs = [CTX.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    out = []
    try:
        while len(out) < n:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"worker processes failed with exit codes {dead}"
            assert time.monotonic() < deadline, f"only {len(out)} of {n} workers reported in {timeout_s}s"
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                pass
    finally:
        for p in procs:
            p.join(max(5.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * n
    return out


def test_forty_processes_one_parent_one_send(store_url, tmp_path):
    """40 processes released together on one parent make exactly one send."""
    journal = str(tmp_path / "journal.jsonl")
    statuses = _run(workers.race_one, lambda i: (store_url, journal, "parent-1"), 40)
    counts = collections.Counter(statuses)
    assert counts["posted"] == 1, counts
    assert counts["posted"] + counts["already_answered"] + counts["in_flight"] == 40, counts
    assert MemoryPlatform(journal=journal).reply_count("parent-1") == 1


def test_eight_processes_two_hundred_parents(store_url, tmp_path):
    """8 processes each posting the same 200 parents in different orders make 200 sends."""
    journal = str(tmp_path / "journal.jsonl")
    sent = _run(workers.race_many, lambda i: (store_url, journal, 200, i), 8)
    assert sum(sent) == 200
    replies = MemoryPlatform(journal=journal).replies()
    per_parent = collections.Counter(r["parent_id"] for r in replies)
    assert len(per_parent) == 200 and set(per_parent.values()) == {1}
