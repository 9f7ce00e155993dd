"""The short chaos run inside ``make test``: real daemon processes, real HTTP, random faults, platform-side counts.

``python -m chaos --short`` draws a few runs (SQLite and PostgreSQL, one to
three replicas) that together cover every fault family: lost responses (cut
connection, 504 after create), 5xx before create, 429 storms, failed
read-backs, latency spikes, SIGKILL at random moments and right after the
platform created a post, the database cut (PostgreSQL, through a proxy) or made
unwritable (SQLite, ``chattr +i``), replica and platform clock steps. Its last
stdout line is the totals; every promise must hold. The long version is
``make chaos`` (see docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_short_chaos_keeps_every_promise(tmp_path):
    """duplicates 0, lost 0, open rows 0 after the final sweep, no crash, across the short set of runs."""
    args = [sys.executable, "-m", "chaos", "--short", "--seed", os.environ.get("CHAOS_SEED", "1"),
            "--workdir", str(tmp_path), "--json-out", str(tmp_path / "chaos.json")]
    if IN_CI:
        args.append("--require-postgres")
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=280,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = p.stdout.strip().splitlines()
    assert lines, p.stderr[-3000:]
    totals = json.loads(lines[-1])
    print("\n" + "\n".join(lines))
    assert totals["runs"] >= 4 and totals["posts"] > 0 and totals["faults"] > 0, totals
    assert totals["duplicates"] == 0, (totals, p.stdout)
    assert totals["lost"] == 0, (totals, p.stdout)
    assert totals["open_left"] == 0 and totals["unsettled_left"] == 0, totals
    assert totals["wrong_close"] == 0 and totals["gave_up_unreported"] == 0, totals
    assert totals["unhandled"] == 0 and totals["bad_exits"] == 0, (totals, p.stderr[-3000:])
    assert totals["failed_runs"] == 0 and p.returncode == 0, (totals, p.stderr[-3000:])
    kinds = set(totals["faults_by_kind"])
    # The short set really met the faults it claims to cover.
    for k in ("kill", "kill_on_create", "lost_504", "lost_drop", "clock_jumps", "latency_spikes"):
        assert k in kinds, (k, kinds)
    assert "db_outages" in kinds or "db_readonly" in kinds, kinds
