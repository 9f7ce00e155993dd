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


# An allow-listed node id (tests/ci_allowed_skips.toml) rebuilt under a temporary root, in an xdist group: its
# skip must stay allowed although loadgroup runs it as "...[memory]@g"; the other group's skip must still fail;
# the six tests of group "g" write down their worker, which must be one (as one Synapse serves its group).
GROUPED = '''
import os
import pytest

@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("adapter_name", ["memory"])
def test_delete_meeting_not_found_is_done(adapter_name):
    """Allow-listed by its node id."""
    pytest.skip("memory delete has no transport")

@pytest.mark.xdist_group("h")
def test_not_listed():
    """Not allow-listed."""
    pytest.skip("no such tool here")

@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("i", range(6))
def test_in_group(i):
    """Records the worker it ran on."""
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
'''


def run_pytest(tmp_path: Path, ci: bool, *args: str, module: str = "test_skipping.py",
               source: str = SKIPPING, **extra_env: str) -> subprocess.CompletedProcess:
    """Run pytest with this suite's conftest on a module that skips; CI set or not."""
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | extra_env
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), *args, str(path)], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=540)  # a hang guard inside the test timeout


def test_skips_fail_under_ci_and_stay_skips_otherwise(tmp_path):
    """The same module: two skips under CI=true fail (a marker's skip as a setup error), naming the allow-list;
    an xfail is untouched; without CI, two skips."""
    ci = run_pytest(tmp_path, ci=True)
    assert ci.returncode == 1 and "1 failed" in ci.stdout and "1 error" in ci.stdout, ci.stdout[-2000:]
    assert "1 xfailed" in ci.stdout and "skipped" not in ci.stdout.splitlines()[-1]
    assert "ci_allowed_skips.toml" in ci.stdout and "no such tool here" in ci.stdout
    local = run_pytest(tmp_path, ci=False)
    assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout[-2000:]


@pytest.mark.slow  # two xdist workers that each import the suite's conftest: ~45 s idle, minutes under load
@pytest.mark.timeout(600)
def test_skip_check_holds_on_xdist_workers_with_groups(tmp_path):
    """`make test`'s -n/--dist loadgroup: a group runs on one worker, the check runs on the workers, an
    allow-listed skip in an xdist group (node id suffixed "@g") stays a skip, an unlisted one still fails."""
    workers = tmp_path / "workers.txt"
    ci = run_pytest(tmp_path, True, "-n", "2", "--dist", "loadgroup", module="tests/contract/test_delete.py",
                    source=GROUPED, WORKERS_FILE=str(workers))
    last = ci.stdout.splitlines()[-1]
    assert ci.returncode == 1 and "1 failed" in last and "6 passed" in last and "1 skipped" in last, ci.stdout[-2000:]
    ran_on = workers.read_text().split()
    assert len(ran_on) == 6 and len(set(ran_on)) == 1, f"group g ran on {ran_on}: --dist loadgroup did not group"
    assert "test_not_listed" in ci.stdout and "ci_allowed_skips.toml" in ci.stdout
    assert skip_allowed("tests/contract/test_delete.py::test_delete_meeting_not_found_is_done[memory]@bsky",
                        load_allowed_skips())
    assert not skip_allowed("tests/contract/test_delete.py::test_delete_meeting_not_found_is_done[x@y]",
                            {"tests/contract/test_delete.py::test_delete_meeting_not_found_is_done[x": "a"})


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
