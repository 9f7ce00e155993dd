"""`replyd demo --json`: the README's first command, its figures counted by the sim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_json_replyd_zero_duplicates_where_delay_is_right(tmp_path):
    """replyd makes 0 duplicates and loses 0 answers where the delay is right; the naive bot really duplicates."""
    r = subprocess.run([sys.executable, "-m", "replyd", "demo", "--json", "--quick"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path)}, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {s["name"]: s for s in json.loads(r.stdout)["scenarios"]}
    assert len(rows) == 8
    for s in rows.values():
        assert set(s) >= {"name", "listing_delay_ok", "naive", "replyd"}
        assert set(s["replyd"]) >= {"duplicates", "lost", "retries"}
        if s["listing_delay_ok"]:
            assert s["replyd"]["duplicates"] == 0 and s["replyd"]["lost"] == 0, s
    assert rows["three paths find the same parents"]["naive"]["duplicates"] == 2 * rows["three paths find the same parents"]["parents"]
    assert rows["three paths find the same parents"]["replyd"]["responder_calls"] == rows["three paths find the same parents"]["parents"]
    assert rows["crash after send, before close"]["naive"]["duplicates"] > 0
    assert rows["crash before send"]["replyd"]["retries"] > 0
    limit = rows["listing delay > configured, no Idempotency-Key"]
    assert not limit["listing_delay_ok"] and limit["replyd"]["duplicates"] > 0  # the measured limit, shown honestly
    assert rows["listing delay > configured, Idempotency-Key"]["replyd"]["duplicates"] == 0
