"""Fuzzing what platforms and API callers hand replyd as text: ids, handles, post text and the free-form ``path``.

Drawn strings are dense in what a terminal or a parser could act on: C0 and C1
controls, ESC / CSI / OSC sequences, NUL, DEL, bidi overrides, line separators,
astral characters, quotes and shell metacharacters. Two properties:

- a ``command`` responder gets the parent byte for byte as JSON on stdin (a real
  child process echoes it back) or a one-line ``ResponderError``, never another
  exception, whatever the parent holds;
- ``replyd log`` and ``replyd explain`` print such a parent's id and path with no
  control character (each shown as a visible escape), and their ``--json`` output
  gives the stored values back exactly.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as hs
import pytest
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

from replyd.cli import app
from replyd.errors import ResponderError
from replyd.guard import Guard
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.responders import ResponderRunner, make_responder
from replyd.store import Store

CHILD = str(Path(__file__).with_name("responder_child.py"))
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
# Whole sequences a terminal acts on, and single characters that are controls somewhere.
SEQUENCES = ["\x1b[2J", "\x1b]0;owned\x07", "\x1b]8;;https://evil.example\x1b\\", "\x9b31m", "\x1bP+q\x1b\\", "\r\n",
             "$(id)", "`id`", "'; DROP TABLE replies; --", '"', "\\", "%s", "{text}", "\udc80"]  # a lone surrogate
CONTROLS = [chr(c) for c in [*range(0x20), 0x7f, *range(0x80, 0xa0)]] + ["\u061c", "\u200e", "\u200f", "\u2028",
                                                                      "\u2029", "\u202e", "\u2066", "\u2069"]
piece = hs.sampled_from(SEQUENCES) | hs.sampled_from(CONTROLS) | hs.text(max_size=4) | hs.sampled_from(["😀", "ü"])
hostile = hs.lists(piece, min_size=1, max_size=6).map("".join)
# What the store's text columns hold: no lone surrogates (not encodable), no NUL (PostgreSQL text refuses it).
stored = hostile.map(lambda s: re.sub("[\x00\ud800-\udfff]", "", s)).filter(lambda s: s.strip() != "")
# What a terminal must never get from a value; the line ends the table and each event line end with are allowed.
TERMINAL_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _parent(pid: str, handle: str, text: str, url: str) -> Parent:
    return Parent(id=pid, author_id="a" + pid[:8], author_handle=handle, text=text, url=url, extra={"k": text})


@FUZZ
@given(pid=hostile, handle=hostile, text=hostile, url=hostile)
def test_command_gets_any_parent_verbatim_on_stdin(pid: str, handle: str, text: str, url: str) -> None:
    """Whatever the ids and text hold, the child reads exactly the parent's snapshot (or the call is a ResponderError)."""
    parent = _parent(pid, handle, text, url)
    runner = ResponderRunner(make_responder("command", {"command": [sys.executable, "-I", CHILD, "echo-stdin"],
                                                        "timeout_s": 20}), timeout_s=30)
    try:
        reply = runner(parent)
    except ResponderError as exc:  # allowed, on one line (e.g. a lone surrogate no UTF-8 can carry)
        assert "\n" not in str(exc)
        return
    finally:
        runner.close()
    assert reply is not None
    assert json.loads(reply) == {"replyd_version": 1, **parent.snapshot()}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One default store (``$XDG_STATE_HOME``, for ``Store.open()`` and the CLI alike) for the module's examples."""
    state = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(state))
        yield state


_examples = itertools.count()


def _cli(state: Path, *args: str) -> str:
    """Run a replyd command in this process; return its stdout (failing on a non-zero exit)."""
    result = CliRunner().invoke(app, list(args), env={"XDG_STATE_HOME": str(state), "COLUMNS": "10000"})
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


@FUZZ
@given(pid=stored, path=stored)
def test_log_and_explain_show_any_id_and_path_escaped(store_dir: Path, pid: str, path: str) -> None:
    """An answered parent with any id and path: log and explain print no control character; --json gives them back."""
    pid += f"#{next(_examples)}"  # one store for every example: each its own parent
    store = Store.open()
    try:
        plat = MemoryPlatform(instance="memory:fuzz")
        Guard(store, plat, plat.whoami()).post(plat.add_parent(pid), "hello", path=path)
    finally:
        store.dispose()
    for args in (["log", "--parent", pid], ["explain", pid]):
        shown = _cli(store_dir, *args)
        assert not TERMINAL_CONTROLS.findall(shown), (args, shown)
    events = json.loads(_cli(store_dir, "log", "--parent", pid, "--json"))
    assert events and {e["parent_id"] for e in events} == {pid} and events[-1]["path"] == path
    [doc] = json.loads(_cli(store_dir, "explain", pid, "--json"))
    assert doc["row"]["parent_id"] == pid and doc["row"]["path"] == path
