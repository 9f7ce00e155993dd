"""The install steps of README and docs/MCP.md, as a new user runs them: a wheel built from the checkout,
installed into a fresh virtual environment outside it, its `replyd` command run from another directory.

This is what "install from a checkout" means until replyd is published: nothing of the checkout (its
tests, its config/ folder) is on the path of the installed command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a wheel, a venv and the demo: minutes when loaded


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "REPLYD_", "VIRTUAL_ENV"))}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_installs_outside_the_checkout_and_runs_the_demo(tmp_path):
    wheels = tmp_path / "wheels"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w",
              str(wheels), str(ROOT)], tmp_path, 600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("replyd-*.whl")
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120).returncode == 0
    # The extra docs/MCP.md names, installed the way it says for a checkout.
    r = _run([str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", "-q", f"{wheel}[mcp]"],
             tmp_path, 900)
    assert r.returncode == 0, r.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    replyd = str(venv / "bin" / "replyd")
    v = _run([replyd, "--version"], elsewhere, 60)
    assert v.returncode == 0 and v.stdout.startswith("replyd "), v.stderr
    where = _run([str(venv / "bin" / "python"), "-c", "import replyd, mcp; print(replyd.__file__)"], elsewhere, 60)
    assert where.returncode == 0 and str(venv) in where.stdout and str(ROOT) not in where.stdout, where
    demo = _run([replyd, "demo", "--quick", "--json"], elsewhere, 600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    scenarios = json.loads(demo.stdout)["scenarios"]
    ok = [s for s in scenarios if s["listing_delay_ok"]]
    assert ok and all(s["replyd"]["duplicates"] == 0 and s["replyd"]["lost"] == 0 for s in ok), scenarios
