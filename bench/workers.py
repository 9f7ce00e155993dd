"""Functions run in child OS processes by the race benchmark (spawn/forkserver-safe).

The pattern is tests/workers.py's: every process builds its own Store and
Guard over a journal-mode memory platform (so all processes see one platform
and the replies that really exist can be counted), waits at one barrier, and
posts. Each reports its outcomes and wall-clock timestamps.
"""

from __future__ import annotations

import os
import random
import time

from replyd.guard import Guard
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store


def _guard(url: str, journal: str) -> Guard:
    from bench.common import configure_quiet_logs

    configure_quiet_logs()
    store = Store.open(url)
    plat = MemoryPlatform(journal=journal, listing_delay_s=1.0)
    return Guard(store, plat, plat.whoami(), send_timeout_s=5.0)


def race_one(url: str, journal: str, parent_ids: list[str], barrier, results) -> None:
    """For each parent: wait at the barrier with every other process, then post it once."""
    g = _guard(url, journal)
    g.store.get(g.key("warm-up"))  # open the pooled connection before the clock starts
    out = []
    for pid in parent_ids:
        barrier.wait()
        t0 = time.time()
        status = g.post(Parent(id=pid, author_id="u"), f"reply from {os.getpid()}").status.value
        out.append((pid, status, t0, time.time()))
    g.store.dispose()
    results.put(out)


def race_many(url: str, journal: str, n_parents: int, seed: int, barrier, results) -> None:
    """Post every parent in a shuffled order after the barrier; report sends and timestamps."""
    g = _guard(url, journal)
    g.store.get(g.key("warm-up"))
    ids = [f"p{i}" for i in range(n_parents)]
    random.Random(seed).shuffle(ids)
    barrier.wait()
    t0 = time.time()
    sent = sum(1 for pid in ids if g.post(Parent(id=pid, author_id="u"), "x").sent)
    t1 = time.time()
    g.store.dispose()
    results.put((sent, t0, t1))
