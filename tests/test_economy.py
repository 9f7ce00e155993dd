"""Responder economy end to end: two `replyd run` processes, three discovery paths, a real `command` responder.

Every parent is found by inbox, search and re-find on both replicas; the
responder is a child program that appends each call to a shared file, so the
calls are counted across processes by the file, and the replies by the sim.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.test_daemon import ROOT, wait_until
from tests.test_replicas import fresh_pg  # noqa: F401  (the PostgreSQL variant uses it)

pytestmark = pytest.mark.slow

BOT = "replybot"
PARENTS = 30

CHILD = """
import json, os, sys
doc = json.load(sys.stdin)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
os.write(fd, (doc["id"] + "\\n").encode())  # one write per call: appends from two processes never interleave
os.close(fd)
print("thanks for asking, @" + doc["author_handle"])
"""


def write_config(path: Path, base_url: str, url: str, child: Path, calls: Path) -> Path:
    """A replica config: shared store, every path on, the command responder."""
    path.write_text(f"""
[store]
url = "{url}"

[log]
format = "json"
level = "debug"  # replyd.pipeline.offered: which path found which parent, per replica

[guard]
send_timeout_s = 3.0

[sweep]
interval_s = 0.5
retry_s = 0.5

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "SIM_TOKEN"
listing_delay_s = 0.5
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.3
search_interval_s = 0.4
search_queries = ["help"]
refind_interval_s = 0.5
refind_lookback_s = 3600
jitter_s = 0.1

[bots.responder]
kind = "command"
command = ["{sys.executable}", "{child}", "{calls}"]
timeout_s = 10
""")
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_replicas_three_paths_one_call_per_parent(db, tmp_path, request):
    """Two replica processes finding every parent three ways: one reply per parent, ≤ 1.05 responder calls each."""
    url = f"sqlite:///{tmp_path / 'r.sqlite3'}" if db == "sqlite" else request.getfixturevalue("fresh_pg")
    Store.open(url).dispose()  # migrate once, before both start
    world = World(SystemClock(), seed=17, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    child, calls = tmp_path / "child.py", tmp_path / "calls.txt"
    child.write_text(CHILD)
    procs = []
    with SimServer(world) as srv:
        cfg = write_config(tmp_path / "replica.toml", srv.base_url, url, child, calls)
        # Posted before the replicas start, so every parent is there for all three paths at once.
        parents = [s.id for s in world.generate(PARENTS, target=BOT, query_word="help", query_fraction=1.0, users=6)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN": bot.token}
        try:
            for rid in ("a", "b"):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                    env={**env, "REPLYD_REPLICA_ID": rid}, cwd=ROOT, stdout=subprocess.DEVNULL,
                    stderr=(tmp_path / f"{rid}.log").open("wb")))
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents), 60), \
                (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(2.0)  # several more rounds of every path on both replicas
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                assert p.wait(20) == 0
    per = world.replies_by(bot.id)
    assert [per.get(p, 0) for p in parents] == [1] * PARENTS
    made = Counter(calls.read_text().split())
    per_parent = sum(made.values()) / PARENTS
    print(f"\nresponder calls per answered parent ({db}, 2 replicas, 3 paths): {per_parent:.3f} "
          f"({sum(made.values())} calls for {PARENTS} parents)")
    assert set(made) == set(parents) and per_parent <= 1.05
    # Every parent was found three ways (the premise of the economy figure), and by both replicas. Not three
    # ways on each replica: inbox and search cursors are shared rows, so the replica that polls first moves
    # them past parents the other then never reads by that path (re-find has no cursor).
    found = {rid: offered_paths(tmp_path / f"{rid}.log") for rid in ("a", "b")}
    union = {p: found["a"].get(p, set()) | found["b"].get(p, set()) for p in parents}
    missing = {p: sorted(paths) for p, paths in union.items() if paths != {"inbox", "search", "refind"}}
    assert not missing, missing
    for rid in ("a", "b"):
        assert set(parents) <= set(found[rid]), (rid, sorted(set(parents) - set(found[rid])))
    s = Store.open(url)
    try:
        rows = s.rows_in(f"mastodon:{srv.base_url}", bot.id, [st.CLOSED], limit=1000)
    finally:
        s.dispose()
    assert sorted(r.parent_id for r in rows) == sorted(parents)
    # Not "both replicas answered some": on a loaded machine one replica can win every claim; that both
    # offered every parent (checked above) is what makes the one-call-per-parent figure mean something.


def offered_paths(log: Path) -> dict[str, set[str]]:
    """Parent id -> the discovery paths that offered it, from a replica's JSON log (replyd.pipeline.offered)."""
    out: dict[str, set[str]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"replyd.pipeline.offered"' not in line:
            continue
        ev = json.loads(line)
        out.setdefault(ev["parent_id"], set()).add(ev["path"])
    return out
