"""Fuzzing the sidecar API with what a hostile caller sends as ids and the free-form ``path``.

A running daemon serves the API over real HTTP against the sim. Drawn strings are
dense in terminal controls, escape sequences, bidi overrides and digits of other
scripts (``"\\xb2"``). Properties:

- ``POST /v1/replies`` with any ``path`` on a real parent answers 2xx (posted once) or
  a 4xx naming the field, never a 5xx; what it stored, ``replyd log`` and
  ``replyd explain`` print with no control character;
- ``GET /v1/replies/{platform}/{parent_id}`` and ``POST /v1/replies`` with any parent id
  answer a JSON error whose detail is one printable line, never a 500.
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote

import hypothesis.strategies as hs
import httpx
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

from replyd.cli import app
from tests.api_harness import running
from tests.test_fuzz_responders import TERMINAL_CONTROLS, hostile

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
DIGITS = hs.sampled_from(["\xb2", "\u0663", "\uff11", "\u00bd", "1\x1b[31m", "12\u202e3"])  # not ASCII digits
# HTTP carries UTF-8: no lone surrogates (the guard-level fuzz has them); NUL stays, the API must refuse it.
wire = hostile.map(lambda s: re.sub("[\ud800-\udfff]", "", s)).filter(bool)
ids = wire | DIGITS | hs.lists(DIGITS, min_size=1, max_size=3).map("".join)
PRINTABLE_LINE = re.compile(r"^[^\x00-\x1f\x7f-\x9f]*$")


def _cli(config: str, *args: str) -> str:
    """Run a read command on the daemon's store; return stdout (failing on a non-zero exit)."""
    result = CliRunner().invoke(app, [*args, "--config", config], env={"COLUMNS": "10000"})
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def _one_line_error(r: httpx.Response) -> None:
    """A refusal: JSON with an error word and a detail on one printable line, and never a 500."""
    assert r.status_code != 500 and r.status_code >= 400, r.text
    body = r.json()
    assert isinstance(body.get("error"), str) and PRINTABLE_LINE.match(body.get("detail", "")), body


def test_api_stores_any_path_and_refuses_any_id_in_one_line(tmp_path, monkeypatch) -> None:
    """Hostile paths post once and print escaped; hostile parent ids are one-line refusals, never a 500."""
    with running(tmp_path, monkeypatch) as h, h.client() as c:

        @FUZZ
        @given(path=wire)
        def posts_with_any_path(path: str) -> None:
            pid = h.parent()
            r = c.post("/v1/replies", json={"platform": h.instance, "parent_id": pid, "text": "hi", "path": path})
            if r.status_code >= 400:  # e.g. NUL, or longer than 64: refused naming the field
                _one_line_error(r)
                assert h.bot_replies(pid) == 0
                return
            assert r.json()["status"] == "posted" and h.bot_replies(pid) == 1, r.text
            for args in (["log", "--parent", pid], ["explain", pid]):
                shown = _cli(str(h.config), *args)
                assert not TERMINAL_CONTROLS.findall(shown), (args, shown)
            [doc] = json.loads(_cli(str(h.config), "explain", pid, "--json"))
            assert doc["row"]["path"] == path  # stored exactly; only the terminal output escapes

        @FUZZ
        @given(pid=ids)
        def refuses_any_id(pid: str) -> None:
            before = h.bot_statuses()
            got = c.get(f"/v1/replies/{quote(h.instance, safe='')}/{quote(pid, safe='')}")
            if got.status_code != 200:
                _one_line_error(got)
            r = c.post("/v1/replies", json={"platform": h.instance, "parent_id": pid, "text": "hi"})
            _one_line_error(r)  # no such status on the sim: nothing to answer
            assert h.bot_statuses() == before

        posts_with_any_path()
        refuses_any_id()


@FUZZ
@given(path=wire)
def test_the_daemons_console_log_escapes_any_value(path: str) -> None:
    """On a terminal the daemon's own log lines carry ids and paths escaped; the JSON log keeps them exactly."""
    import io

    import structlog

    from replyd import log as rlog

    try:
        for fmt in ("console", "json"):
            buf = io.StringIO()
            rlog.configure(fmt, "info", stream=buf)
            structlog.get_logger().info("replyd.guard.claimed", path=path, parent_id=path)
            line = buf.getvalue()
            if fmt == "console":
                # The renderer's own colour codes are ESC [ ... m; nothing else from the value may reach the terminal.
                assert not TERMINAL_CONTROLS.findall(re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip("\n")), line
            else:
                assert json.loads(line)["path"] == path
    finally:
        rlog.configure("json", "info")
