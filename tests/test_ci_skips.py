"""Under CI=true a skip fails the run unless tests/ci_allowed_skips.toml lists it with a reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ALLOWED_SKIPS_FILE, load_allowed_skips, skip_allowed

ROOT = Path(__file__).resolve().parents[1]
SKIPPING = '''
import pytest

def test_skips_at_run_time():
    """Skips when it runs."""
    pytest.skip("no such tool here")

@pytest.mark.skipif(True, reason="never on this machine")
def test_skipped_by_marker():
    """Skipped by a marker."""

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    """An expected failure is not a skip."""
    assert False
'''


def run_pytest(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    """Run pytest with this suite's conftest on a module that skips; CI set or not."""
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_skipping.py")], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_skips_fail_under_ci_and_stay_skips_otherwise(tmp_path):
    """The same module: two skips under CI=true fail (a marker's skip as a setup error), naming the allow-list;
    an xfail is untouched; without CI, two skips."""
    ci = run_pytest(tmp_path, ci=True)
    assert ci.returncode == 1 and "1 failed" in ci.stdout and "1 error" in ci.stdout, ci.stdout[-2000:]
    assert "1 xfailed" in ci.stdout and "skipped" not in ci.stdout.splitlines()[-1]
    assert "ci_allowed_skips.toml" in ci.stdout and "no such tool here" in ci.stdout
    local = run_pytest(tmp_path, ci=False)
    assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout[-2000:]


def test_allow_list_entries_need_a_reason(tmp_path):
    """Each entry names a test (node id or pattern) and a reason; the committed file parses."""
    load_allowed_skips(ALLOWED_SKIPS_FILE)
    good = tmp_path / "ok.toml"
    good.write_text('[[allow]]\ntest = "tests/test_x.py::test_y[*"\nreason = "no GPU on CI"\n')
    allowed = load_allowed_skips(good)
    assert skip_allowed("tests/test_x.py::test_y[sqlite]", allowed)
    assert not skip_allowed("tests/test_x.py::test_z", allowed)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[allow]]\ntest = "tests/test_x.py::test_y"\nreason = " "\n')
    with pytest.raises(ValueError, match="reason"):
        load_allowed_skips(bad)
