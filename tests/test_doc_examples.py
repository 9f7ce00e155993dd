"""The docs harness (tools/doc_examples.py): a good example passes, a planted broken one fails it.

The harness runs README.md's and docs/*.md's examples in CI (`.ci/run`, `make examples`). Here it runs on
copies of one example from docs/LIBRARY.md, written to a temporary doc."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tools" / "doc_examples.py"


def _once_example() -> str:
    """docs/LIBRARY.md's `@once` example as the doc has it: the marker, the block, "prints" and its output."""
    doc = (ROOT / "docs" / "LIBRARY.md").read_text()
    found = re.search(r"<!-- runnable -->\n```python\n(?:(?!```).)*?from replyd\.once import once.*?```\n\nprints\n\n"
                      r"```\n.*?```\n", doc, re.S)
    assert found, "docs/LIBRARY.md lost its @once example"
    return found.group(0)


def _harness(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    doc = tmp_path / "doc.md"
    doc.write_text(f"# A copy\n\n{text}")
    return subprocess.run([sys.executable, str(HARNESS), str(doc)], capture_output=True, text=True, timeout=180)


def test_a_good_example_passes(tmp_path):
    """The example as the doc writes it: one "ok" line, exit 0."""
    r = _harness(tmp_path, _once_example())
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"doc\.md:4 ok \d+\.\ds", r.stdout), r.stdout
    assert "1 runnable, 0 failed" in r.stdout


def test_a_planted_wrong_output_fails(tmp_path):
    """One line changed (another parent, so a second "posted"): the output differs from "prints"; exit 1."""
    good = _once_example()
    bad = good.replace('reply("42:1001", "Thanks again!")', 'reply("42:1003", "Thanks again!")')
    assert bad != good
    r = _harness(tmp_path, bad)
    assert r.returncode == 1, r.stdout
    assert "doc.md:4 FAILED" in r.stdout and "output differs" in r.stdout
    assert "-already_answered" in r.stdout and "+posted" in r.stdout


def test_an_example_leaning_on_the_test_suite_fails(tmp_path):
    """`from tests...` works inside the checkout (an editable install puts it on sys.path), never in the harness."""
    bad = _once_example().replace("from replyd.once import once\n",
                                  "from replyd.once import once\nfrom tests.telegram_fake import TOKEN\n")
    r = _harness(tmp_path, bad)
    assert r.returncode == 1, r.stdout
    assert "ModuleNotFoundError: No module named 'tests'" in r.stdout


def test_a_fragment_that_does_not_compile_fails_even_unmarked(tmp_path):
    """A block without the marker is not run, but it must still be Python: top-level `async with` is not."""
    fragment = "```python\nasync with open_guard(url, platform) as g:\n    await g.post(parent, 'Hi')\n```\n"
    r = _harness(tmp_path, fragment)
    assert r.returncode == 1, r.stdout
    assert "doc.md:3 FAILED compile" in r.stdout and "0 runnable, 1 failed" in r.stdout
