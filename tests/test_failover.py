"""PostgreSQL high availability: the claim's commit level, the startup check, and real failovers.

The failover tests make a real primary and streaming standby from the machine's PostgreSQL binaries
(``chaos.pgcluster``), run two `replyd run` replicas against them through a multi-host URL and crash the
primary in the middle of the traffic, after cutting the replication link. Replies are counted by the sim.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from chaos.failover import run_config
from chaos.pgcluster import unavailable
from replyd import store as st
from replyd.guard import Guard, Status
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from tests.conftest import IN_CI
from tests.test_store_contract import commit_modes


def test_claim_commit_level_reaches_the_claim_and_the_open_only(pg_url, clock):
    """With ``claim_commit = "remote_write"`` open rows commit at that level; closes and notes stay off."""
    with commit_modes(pg_url) as read_modes:
        store = Store.open(pg_url, clock=clock, claim_commit="remote_write")
        try:
            plat = MemoryPlatform(clock=clock)
            g = Guard(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
            assert g.post(plat.add_parent("text"), "a reply").status is Status.POSTED
            assert g.post(plat.add_parent("composed"), lambda p: "composed").status is Status.POSTED
            modes = read_modes()
        finally:
            store.dispose()
    assert {m for _, s, m in modes if s == st.OPEN} == {"remote_write"}, modes
    assert {m for _, s, m in modes if s == st.CLOSED} == {"off"}, modes


def test_claim_commit_problem_names_the_missing_standby(pg_url):
    """A synchronous level on a server without synchronous_standby_names is reported; local is fine."""
    store = Store.open(pg_url, claim_commit="remote_apply")
    try:
        problem = store.claim_commit_problem()
        assert problem is not None and "synchronous_standby_names" in problem and "remote_apply" in problem
        store.claim_commit = "local"
        assert store.claim_commit_problem() is None
        with pytest.raises(ValueError, match="claim_commit must be one of"):
            store.claim_commit = "sometimes"
    finally:
        store.dispose()


@pytest.fixture
def clusters_possible() -> None:
    """Skip (fail under CI=true) when real clusters cannot be made here."""
    why = unavailable()
    if why:
        if IN_CI:
            pytest.fail(f"CI=true but PostgreSQL clusters cannot be made: {why}")
        pytest.skip(f"PostgreSQL clusters cannot be made here: {why}")


@pytest.mark.slow
def test_failover_async_standby_answers_twice_sync_remote_apply_never(clusters_possible):
    """Same traffic, same failovers: an asynchronous standby loses claims (duplicates); remote_apply loses none.

    The asynchronous run is the control: it shows the harness really loses committed claims, so the
    synchronous run's zero means something.
    """
    # Not pytest's tmp_path (0700 under root's): the postgres user must reach the clusters' directories.
    base = Path(tempfile.mkdtemp(prefix="replyd-failover-test-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        kw = {"parents": 40, "failovers": 2, "lag_s": 1.5, "spacing_s": 5.0}
        sync = run_config("sync", workdir=base / "sync", **kw)
        assert sync["failovers"] == 2
        assert (sync["duplicates"], sync["lost"]) == (0, 0), sync
        control = run_config("async", workdir=base / "async", **kw)
        assert control["failovers"] == 2
        assert control["duplicates"] > 0, control
    finally:
        shutil.rmtree(base, ignore_errors=True)
