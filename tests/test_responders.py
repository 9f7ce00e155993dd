"""The command, webhook and openai responders over real child processes and real local HTTP servers.

Every call goes through ``ResponderRunner``, the way the guard calls a
responder: on the shared responder loop, with a timeout, every failure a
``ResponderError``.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from replyd.errors import ConfigError, ResponderError
from replyd.platforms.base import Parent
from replyd.responders import (
    CommandResponder,
    FunctionResponder,
    ResponderRunner,
    make_responder,
    runner_bound_s,
    webhook_signature,
)
from tests.fixtures_server import (  # noqa: F401  (pytest fixtures by name)
    DroppingServer,
    FixtureServer,
    Reply,
    closed_port_url,
    dropping_server,
    fixture_server,
    fixture_server_session,
    html_error,
)

CHILD = str(Path(__file__).with_name("responder_child.py"))
PY = [sys.executable, "-I", CHILD]
PARENT = Parent(
    id="109876543210",
    author_id="42",
    author_handle="alice@example.social",
    text="Is the ferry running today? ünïcødé ✓",
    url="https://example.social/@alice/109876543210",
    extra={"visibility": "public"},
)
HMAC_SECRET = "whsec-LEAKCHECK-5e1f0a9b7c3d2e8f"
API_KEY = "sk-LEAKCHECK-0123456789abcdef0123"
COMPLETIONS = "/v1/chat/completions"


def run(kind: str, settings: dict[str, Any], parent: Parent = PARENT, *, timeout_s: float = 20.0) -> str | None:
    """Build the responder and call it once through a ResponderRunner (closed afterwards)."""
    runner = ResponderRunner(make_responder(kind, settings), timeout_s=timeout_s, name=kind)
    try:
        return runner(parent)
    finally:
        runner.close()


def fails(kind: str, settings: dict[str, Any], parent: Parent = PARENT, *, timeout_s: float = 20.0) -> str:
    """Call the responder expecting a ResponderError; return its message."""
    with pytest.raises(ResponderError) as ei:
        run(kind, settings, parent, timeout_s=timeout_s)
    assert ei.value.detail == str(ei.value)
    return str(ei.value)


def pid_state(pid: int) -> str | None:
    """The process state letter of ``pid`` (``Z`` for a zombie), or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def test_runner_bound_is_the_responders_own_timeout_plus_a_backstop():
    """The daemon's runner bound: a kind's own timeout_s, else the settings' (default 60 s), plus 5 s."""
    command = {"command": [sys.executable], "timeout_s": 7}
    assert runner_bound_s(make_responder("command", command), command) == 12.0
    assert runner_bound_s(make_responder("webhook", {"url": "https://example.com/h"}), {}) == 35.0
    assert runner_bound_s(make_responder("template", {"timeout_s": 9}), {"timeout_s": 9}) == 14.0
    assert runner_bound_s(FunctionResponder(lambda p: "x"), {}) == 65.0
    with pytest.raises(ConfigError, match="responder.timeout_s"):
        runner_bound_s(FunctionResponder(lambda p: "x"), {"timeout_s": "soon"})


# -- command ---------------------------------------------------------------------------------------


def test_command_reply_reads_the_parent_from_stdin():
    """The child gets the parent as JSON on stdin and its stdout (trailing newline stripped) is the reply."""
    assert run("command", {"command": [*PY, "greet"]}) == f"hi @{PARENT.author_handle}: {PARENT.text}"


def test_command_payload_is_the_parent_snapshot_with_a_version():
    """The stdin document is exactly Parent.snapshot() plus replyd_version = 1."""
    reply = run("command", {"command": [*PY, "echo-stdin"]})
    assert reply is not None
    assert json.loads(reply) == {"replyd_version": 1, **PARENT.snapshot()}


@pytest.mark.parametrize("output", ["", "\\n", "   \\n\\t\\n"])
def test_command_empty_output_declines(output: str):
    """Empty or whitespace-only stdout is a decline (None), not an error."""
    assert run("command", {"command": [*PY, "write", output]}) is None


def test_command_strips_only_trailing_newlines():
    """Inner newlines and leading spaces are kept; trailing CR/LF go."""
    assert run("command", {"command": [*PY, "write", "  line one\\n\\nline two\\r\\n\\n"]}) == "  line one\n\nline two"


def test_command_that_ignores_stdin_gets_a_large_parent():
    """A child that never reads stdin still answers when the parent is larger than the pipe buffer."""
    big = Parent(id="1", author_id="2", text="long post " * 100_000)
    assert run("command", {"command": [*PY, "write", "ok"]}, big) == "ok"


def test_command_invalid_utf8_is_an_error():
    """Bytes that are not UTF-8 are a ResponderError, never a reply with replacement characters."""
    msg = fails("command", {"command": [*PY, "bad-utf8"]})
    assert "not valid UTF-8" in msg and "at byte 3" in msg


def test_command_nonzero_exit_names_code_and_stderr_tail():
    """A non-zero exit raises naming the code and stderr's last line; stdout is discarded; stderr is logged."""
    with capture_logs() as logs:
        msg = fails("command", {"command": [*PY, "fail", "3"]})
    assert "exited with code 3" in msg
    assert msg.endswith("fatal: quota exhausted")
    assert "noise line 0" not in msg and "partial reply" not in msg
    assert len(msg) < 400
    events = [e for e in logs if e["event"] == "replyd.responder.stderr"]
    assert len(events) == 1
    assert (events[0]["exit_code"], events[0]["program"]) == (3, Path(sys.executable).name)
    assert "fatal: quota exhausted" in events[0]["stderr"] and "noise line 49" in events[0]["stderr"]


def test_command_stderr_is_logged_on_success_with_secrets_masked():
    """A successful child's stderr is logged too, with registered secrets masked."""
    from replyd import log as rlog

    secret = "tok-STDERR-LEAK-4b2a9f"
    rlog.add_secret(secret)
    with capture_logs() as logs:
        assert run("command", {"command": [*PY, "stderr-ok", f"debug: using {secret} now"]}) == "ok"
    events = [e for e in logs if e["event"] == "replyd.responder.stderr"]
    assert [e["stderr"].strip() for e in events] == ["debug: using *** now"]
    assert events[0]["exit_code"] == 0


def test_command_timeout_kills_the_child_and_its_helpers(tmp_path: Path):
    """A child past timeout_s is killed with its process group and reaped: no process, no zombie."""
    pidfile = tmp_path / "pids"
    started = time.monotonic()
    msg = fails("command", {"command": [*PY, "sleep", str(pidfile)], "timeout_s": 1.0})
    assert time.monotonic() - started < 5
    assert "timed out after 1 s" in msg
    child, grandchild = (int(p) for p in pidfile.read_text().split())
    assert pid_state(child) is None  # killed and reaped by replyd
    deadline = time.monotonic() + 5  # the orphaned grandchild is reaped by init; it must not be running
    while pid_state(grandchild) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_state(grandchild) in (None, "Z")


def wait_gone(pid: int, timeout_s: float = 5.0) -> str | None:
    """Wait until ``pid`` is gone or a zombie (killed, awaiting init's reaping); return its last state."""
    deadline = time.monotonic() + timeout_s
    while pid_state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.02)
    return pid_state(pid)


@pytest.mark.parametrize("finish", ["holds-stdout", "lets-go"])
def test_command_helper_dies_whatever_the_main_child_did(tmp_path: Path, finish: str):
    """A background helper dies when its main child exits, whether it kept stdout open or not; the reply comes at once."""
    pidfile = tmp_path / "helper"
    # "holds-stdout": the helper keeps stdout open, so EOF comes only when the supervisor kills it after the shell.
    # "lets-go": the helper lets go of stdout, so the reply would come at once and the helper live on.
    redirect = "" if finish == "holds-stdout" else " >/dev/null 2>&1"
    script = f"sleep 31337{redirect} & echo $! > {pidfile}; echo hi"
    settings = {"command": ["/bin/sh", "-c", script], "timeout_s": 5.0}
    started = time.monotonic()
    assert run("command", settings) == "hi"
    assert time.monotonic() - started < 3.0
    helper = int(pidfile.read_text())
    try:
        assert wait_gone(helper) in (None, "Z"), f"helper {helper} outlived the responder"
    finally:
        if pid_state(helper) not in (None, "Z"):
            os.kill(helper, signal.SIGKILL)


def test_runner_cancellation_kills_the_child(tmp_path: Path):
    """When the runner's own timeout cancels the responder, the child is killed and reaped too."""
    pidfile = tmp_path / "pids"
    msg = fails("command", {"command": [*PY, "sleep", str(pidfile)], "timeout_s": 30}, timeout_s=1.0)
    assert "no answer within 1 s" in msg
    child, _ = (int(p) for p in pidfile.read_text().split())
    assert pid_state(child) is None


MARK = "REPLYD_TEST_CALL"  # passed to the child (env_pass): every process of one call carries it in /proc/<pid>/environ


def marked(token: str) -> list[int]:
    """The live (not zombie) processes whose environment holds ``MARK=token``: what is left of one call."""
    needle = f"{MARK}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if needle in environ.split(b"\0") and pid_state(int(name)) not in (None, "Z"):
            found.append(int(name))
    return found


def alive_after(token: str, deadline: float) -> list[int]:
    """Poll until no process of the call is left or ``deadline`` (monotonic) passes; return those left."""
    while (left := marked(token)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


# "auto" leaves the key out (a cgroup where the machine offers one); the other two force a mechanism.
CONTAINMENTS = ["auto", "cgroup", "subreaper"]


def contained(settings: dict[str, Any], containment: str) -> dict[str, Any]:
    """``settings`` with ``containment`` set (left out for auto); skip cgroup where this machine has none."""
    if containment == "auto":
        return settings
    if containment == "cgroup":
        from replyd.responders.command import cgroup_parent

        base, why = cgroup_parent()
        if base is None:
            pytest.skip(f"no writable cgroup v2 here: {why}")
    return {**settings, "containment": containment}


@pytest.fixture
def call_mark(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh marker passed to the command's processes; any of them still alive at the end is killed."""
    token = os.urandom(8).hex()
    monkeypatch.setenv(MARK, token)
    yield token
    for pid in marked(token):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize("escape", ["daemonize", "setsid"])
def test_command_timeout_kills_descendants_in_other_sessions(tmp_path: Path, call_mark: str, escape: str,
                                                             containment: str):
    """A child that double-forks (or setsid-starts) a `sleep 60`: at the 2 s timeout no process of the call lives
    1 s on, and respond() returns within timeout + 1 s."""
    pidfile = tmp_path / "orphan"
    settings = contained({"command": [*PY, escape, str(pidfile), "wait"], "timeout_s": 2.0, "env_pass": [MARK]},
                         containment)
    started = time.monotonic()
    msg = fails("command", settings, timeout_s=30.0)
    took_s = time.monotonic() - started
    assert "timed out after 2 s (killed)" in msg
    assert took_s < 2.0 + 1.0, f"respond() took {took_s:.1f} s"
    orphan = int(pidfile.read_text())
    assert alive_after(call_mark, started + 2.0 + 1.0) == []
    assert pid_state(orphan) in (None, "Z")
    assert call_cgroups() == []


def call_cgroups() -> list[str]:
    """This process's per-call cgroups still on disk (each is removed when its call ends)."""
    from replyd.responders.command import cgroup_parent

    base, _ = cgroup_parent()
    return [] if base is None else sorted(p.name for p in base.glob(f"call-{os.getpid()}-*"))


def test_command_cgroup_kills_what_outlived_a_killed_supervisor(tmp_path: Path, call_mark: str):
    """With a cgroup per call, a command that SIGKILLs its supervisor fails at once and its setsid orphan dies too."""
    settings = contained({"command": [*PY, "kill-parent", str(tmp_path / "orphan")], "timeout_s": 10.0,
                          "env_pass": [MARK]}, "cgroup")
    started = time.monotonic()
    msg = fails("command", settings, timeout_s=30.0)
    assert "was killed before it finished (its supervisor died)" in msg
    assert time.monotonic() - started < 3.0
    assert alive_after(call_mark, time.monotonic() + 1.0) == []
    assert call_cgroups() == []


def test_command_cgroups_of_a_dead_replyd_are_removed(tmp_path: Path, call_mark: str):
    """The empty call groups a SIGKILLed replyd left are removed by the next one's probe; groups in use are not."""
    from replyd.responders.command import cgroup_parent, remove_stale_cgroups

    contained({}, "cgroup")  # skips where there is no writable cgroup v2
    base = cgroup_parent()[0]
    assert base is not None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    # A private parent group: every replyd in other test workers probes ``base`` for dead call groups too, and
    # would remove this test's groups between their mkdir and the test's own probe.
    own = base / f"test-{call_mark}"
    own.mkdir()
    stale = own / f"call-{int(dead.stdout)}-1-test{call_mark[:6]}"
    busy = own / f"call-{int(dead.stdout)}-2-test{call_mark[:6]}"
    stale.mkdir()
    busy.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (busy / "cgroup.procs").write_text(str(sleeper.pid))
        removed = remove_stale_cgroups(own)
        assert stale.name in removed and busy.name not in removed
        assert not stale.exists() and busy.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        deadline = time.monotonic() + 2
        while (busy.exists() or own.exists()) and time.monotonic() < deadline:
            try:
                for group in (stale, busy, own):
                    if group.exists():
                        group.rmdir()
            except OSError:  # the killed sleep still counted for a few ms
                time.sleep(0.01)


DRIVER = """
import sys
from replyd.platforms.base import Parent
from replyd.responders import ResponderRunner, make_responder
runner = ResponderRunner(make_responder("command", {"command": sys.argv[1:], "timeout_s": 60, "env_pass": ["%s"]}),
                         timeout_s=60)
runner(Parent(id="1", author_id="2", text="x"))
""" % MARK


@pytest.mark.parametrize("escape", ["daemonize", "setsid"])
def test_command_processes_die_with_replyd(tmp_path: Path, call_mark: str, escape: str):
    """replyd SIGKILLed while its command runs: the supervisor's parent-death signal kills every process of the call."""
    pidfile = tmp_path / "orphan"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, *PY, escape, str(pidfile), "wait"],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        deadline = time.monotonic() + 20
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pidfile.exists(), "the command never started"
        assert len(marked(call_mark)) >= 3  # supervisor, command, orphan
    finally:
        driver.kill()
        driver.wait()
    assert alive_after(call_mark, time.monotonic() + 1.0) == []


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize("escape", ["daemonize", "setsid"])
def test_command_reply_is_not_held_by_an_orphan_in_another_session(tmp_path: Path, call_mark: str, escape: str,
                                                                   containment: str):
    """The main child prints and exits, its new-session orphan holding stdout: the reply comes at once, the orphan dies."""
    settings = contained({"command": [*PY, escape, str(tmp_path / "orphan"), "exit"], "timeout_s": 10.0,
                          "env_pass": [MARK]}, containment)
    started = time.monotonic()
    assert run("command", settings, timeout_s=30.0) == "ok"
    assert time.monotonic() - started < 3.0
    assert alive_after(call_mark, time.monotonic() + 1.0) == []


def test_command_output_cap_kills_a_flooding_child():
    """More than max_output_bytes on stdout is an error and the (endless) writer is killed."""
    started = time.monotonic()
    msg = fails("command", {"command": [*PY, "flood"], "max_output_bytes": 4096, "timeout_s": 10})
    assert "more than 4096 bytes" in msg
    assert time.monotonic() - started < 5


def test_command_child_does_not_inherit_replyd_environment(monkeypatch: pytest.MonkeyPatch):
    """Only PATH, HOME, LANG, LC_ALL, TZ and env_pass reach the child: a platform token does not."""
    token = "mastodon-token-LEAKCHECK-77aa"
    monkeypatch.setenv("MASTODON_TOKEN", token)
    monkeypatch.setenv("REPLYD_API_TOKEN", token)
    monkeypatch.setenv("BOT_MODE", "friendly")
    monkeypatch.setenv("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    reply = run("command", {"command": [*PY, "env"], "env_pass": ["BOT_MODE", "NOT_SET_ANYWHERE"]})
    assert reply is not None and token not in reply
    env = json.loads(reply)
    assert env["BOT_MODE"] == "friendly" and env["PATH"] == os.environ["PATH"]
    assert "MASTODON_TOKEN" not in env and "REPLYD_API_TOKEN" not in env
    # LC_CTYPE: Python itself may set it in the child when coercing a C locale (PEP 538).
    assert set(env) <= {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "BOT_MODE", "LC_CTYPE"}


def test_shell_metacharacters_in_the_parent_are_data(tmp_path: Path):
    """A parent text full of shell syntax arrives verbatim on stdin and nothing of it is executed."""
    pwned = tmp_path / "pwned"
    text = f"$(touch {pwned}); rm -rf x `touch {pwned}2` | tee {pwned}3 && echo hi > {pwned}4 'quote\" \\n"
    parent = Parent(id="1", author_id="2", author_handle="mallory; id", text=text)
    reply = run("command", {"command": [*PY, "echo-stdin"], "cwd": str(tmp_path)}, parent)
    assert reply is not None and json.loads(reply)["text"] == text
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_command_as_string_is_refused_no_shell():
    """A command written as one string is a ConfigError explaining that no shell is used."""
    with pytest.raises(ConfigError) as ei:
        make_responder("command", {"command": "python3 bot.py | tee log"})
    assert "responder.command" in str(ei.value) and "no shell" in str(ei.value) and "list" in str(ei.value)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({}, "responder.command: required"),
        ({"command": []}, "responder.command: required"),
        ({"command": ["python3", 5]}, "responder.command[1]"),
        ({"command": [""]}, "responder.command[0]"),
        ({"command": ["no-such-program-xyz"]}, "not found on PATH"),
        ({"command": ["./missing.py"]}, "not an executable file"),
        ({"command": [sys.executable], "env_pass": "HOME"}, "responder.env_pass"),
        ({"command": [sys.executable], "env_pass": ["BAD-NAME"]}, "responder.env_pass"),
        ({"command": [sys.executable], "cwd": "/no/such/dir"}, "responder.cwd"),
        ({"command": [sys.executable], "timeout_s": 0}, "responder.timeout_s"),
        ({"command": [sys.executable], "max_output_bytes": 0}, "responder.max_output_bytes"),
        ({"command": [sys.executable], "shell": True}, "unknown setting(s) ['shell']"),
    ],
)
def test_command_settings_are_validated(settings: dict[str, Any], needle: str):
    """Bad command settings are ConfigErrors naming the key."""
    with pytest.raises(ConfigError) as ei:
        make_responder("command", settings)
    assert needle in str(ei.value)


def test_command_defaults():
    """Defaults: timeout 30 s, 64 KiB output cap, nothing passed beyond the base environment."""
    r = make_responder("command", {"command": [sys.executable]})
    assert isinstance(r, CommandResponder)
    assert (r.timeout_s, r.max_output_bytes, r.env_pass, r.cwd) == (30.0, 65536, (), None)


# -- webhook ---------------------------------------------------------------------------------------


def hook(server: FixtureServer, **extra: Any) -> dict[str, Any]:
    """Webhook settings pointing at ``/hook`` on the fixture server."""
    return {"url": f"{server.url}/hook", **extra}


def test_webhook_reply_is_signed_with_hmac(fixture_server: FixtureServer):
    """The body is the parent JSON; the signature is HMAC-SHA256 over "<ts>." + body; "text" is the reply."""
    fixture_server.route("POST", "/hook", Reply(body={"text": "The ferry runs at 9."}))
    assert run("webhook", hook(fixture_server, hmac_secret=HMAC_SECRET, headers={"X-Bot": "ferry"})) == (
        "The ferry runs at 9.")
    [req] = fixture_server.requests_to("POST", "/hook")
    assert json.loads(req.body) == {"replyd_version": 1, **PARENT.snapshot()}
    assert req.headers["content-type"] == "application/json" and req.headers["x-bot"] == "ferry"
    ts = req.headers["x-replyd-timestamp"]
    assert abs(int(ts) - time.time()) < 60
    sig = req.headers["x-replyd-signature"]
    import hashlib
    import hmac as hmac_mod

    expected = "sha256=" + hmac_mod.new(HMAC_SECRET.encode(), f"{ts}.".encode() + req.body, hashlib.sha256).hexdigest()
    assert hmac_mod.compare_digest(sig, expected)
    assert sig == webhook_signature(HMAC_SECRET, ts, req.body)
    assert sig != webhook_signature("another-secret-0000000", ts, req.body)
    assert HMAC_SECRET.encode() not in req.body and HMAC_SECRET not in json.dumps(req.headers)


@pytest.mark.parametrize("creds", [{"hmac_secret": HMAC_SECRET}, {"headers": {"Authorization": "Bearer LEAK-tok-123"}},
                                   {"headers": {"X-Api-Key": "LEAK-key-123"}}])
def test_webhook_credentials_over_plain_http_to_a_public_host_are_refused(creds: dict[str, Any]):
    """A signed webhook, or one with a sensitive header, refuses http:// to a non-loopback host (the openai
    kind's rule): one ConfigError line naming responder.url and allow_insecure_http, no secret in it."""
    for url in ("http://hooks.example.org/h", "http://10.0.0.5:8080/h"):
        with pytest.raises(ConfigError) as err:
            make_responder("webhook", {"url": url, **creds})
        msg = str(err.value)
        assert "responder.url" in msg and "allow_insecure_http" in msg and "\n" not in msg
        assert "LEAK" not in msg and HMAC_SECRET not in msg
    for url in ("https://hooks.example.org/h", "http://127.0.0.1:9/h", "http://localhost:9/h", "http://[::1]:9/h"):
        make_responder("webhook", {"url": url, **creds})
    make_responder("webhook", {"url": "http://hooks.example.org/h", "allow_insecure_http": True, **creds})
    make_responder("webhook", {"url": "http://hooks.example.org/h", "headers": {"X-Bot": "ferry"}})  # no credential


def test_webhook_unsigned_has_no_signature_headers(fixture_server: FixtureServer):
    """Without hmac_secret no signature or timestamp header is sent."""
    fixture_server.route("POST", "/hook", Reply(body={"text": "ok"}))
    assert run("webhook", hook(fixture_server)) == "ok"
    [req] = fixture_server.requests_to("POST", "/hook")
    assert "x-replyd-signature" not in req.headers and "x-replyd-timestamp" not in req.headers


@pytest.mark.parametrize(
    "reply",
    [Reply(status=204), Reply(body={"text": None}), Reply(body={"text": ""}), Reply(body={"text": "  \n"})],
    ids=["204", "null", "empty", "blank"],
)
def test_webhook_declines(fixture_server: FixtureServer, reply: Reply):
    """204, a null text or an empty text declines."""
    fixture_server.route("POST", "/hook", reply)
    assert run("webhook", hook(fixture_server)) is None
    assert len(fixture_server.requests_to("POST", "/hook")) == 1


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (html_error(502), "answered HTTP 502"),
        (Reply(status=500, body={"error": "db down"}), "answered HTTP 500: db down"),
        (Reply(status=404, body={"error": "no route"}), "answered HTTP 404"),
        (Reply(status=302, headers={"location": "https://elsewhere.example/"}), "302 (redirects are not followed)"),
        (Reply(status=201, body={"text": "created"}), "answered HTTP 201"),
        (Reply(body="<html><body>Welcome to nginx</body></html>", content_type="text/html"),
         "body is not JSON (text/html, HTTP 200)"),
        (Reply(body=b"\xff\xfe{", content_type="application/json"), "body is not JSON"),
        (Reply(body=["text"]), "body is not a JSON object (got list)"),
        (Reply(body={"text": 5}), "field 'text' is int, expected str or null"),
        (Reply(body={"reply": "hi"}), "field 'text' is missing"),
    ],
    ids=["html-502", "json-500", "404", "redirect", "201", "html-200", "bytes", "array", "int", "missing"],
)
def test_webhook_bad_answers_are_errors_and_not_retried(fixture_server: FixtureServer, reply: Reply, needle: str):
    """Every answer but 200-with-text and 204 is a ResponderError naming what is wrong; the hook is hit once."""
    fixture_server.route("POST", "/hook", reply)
    msg = fails("webhook", hook(fixture_server))
    assert msg.startswith("webhook: ") and needle in msg
    assert len(fixture_server.requests_to("POST", "/hook")) == 1
    assert "/hook" not in msg  # only the origin is named: a path may hold a token


def test_webhook_response_size_is_capped(fixture_server: FixtureServer):
    """A body over 1 MiB is a ResponderError, not read into memory."""
    fixture_server.route("POST", "/hook", Reply(body=b'{"text": "' + b"x" * (1024 * 1024) + b'"}'))
    assert "larger than 1048576 bytes" in fails("webhook", hook(fixture_server))


class RawServer:
    """A TCP server answering every connection with the same raw bytes, then holding or closing it."""

    def __init__(self, raw: bytes, *, hold_s: float = 0.0) -> None:
        self.raw = raw
        self.hold_s = hold_s
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        """Accept connections until closed; answer each with the raw bytes."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    self._read_request(conn)
                    conn.sendall(self.raw)
                except OSError:
                    continue
                time.sleep(self.hold_s)

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        """Read the whole request (closing with unread bytes would reset the connection)."""
        def more() -> bytes:
            """The next bytes of the request; raise if the client went away."""
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionResetError("client went away")
            return chunk

        data = b""
        while b"\r\n\r\n" not in data:
            data += more()
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                      if k.strip().lower() == b"content-length")
        while len(body) < length:
            body += more()

    def close(self) -> None:
        """Stop accepting."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def test_webhook_body_without_length_is_capped_while_streaming():
    """A body with no Content-Length (read until close) is cut off past 1 MiB."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    srv = RawServer(head + b'{"text": "' + b"y" * (2 * 1024 * 1024) + b'"}')
    try:
        assert "larger than 1048576 bytes" in fails("webhook", {"url": f"{srv.url}/hook"})
    finally:
        srv.close()


def test_webhook_declared_oversize_fails_before_reading():
    """A Content-Length over 1 MiB fails at once, without waiting for the body."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000000\r\n\r\n{"
    srv = RawServer(head, hold_s=5)
    started = time.monotonic()
    try:
        msg = fails("webhook", {"url": f"{srv.url}/hook", "timeout_s": 4})
    finally:
        srv.close()
    assert "larger than 1048576 bytes" in msg and time.monotonic() - started < 2


@pytest.mark.parametrize("kind", ["webhook", "openai"])
@pytest.mark.parametrize("how", ["drop-mid-body", "hang-up"])
def test_lost_response_is_not_retried(kind: str, how: str, fixture_server: FixtureServer,
                                      dropping_server: DroppingServer):
    """A connection lost after the request left (it may have acted) is an error after exactly one request."""
    if how == "drop-mid-body":
        path = "/hook" if kind == "webhook" else COMPLETIONS
        fixture_server.route("POST", path, Reply(fault="drop"))
        base, count = fixture_server.url, lambda: len(fixture_server.requests_to("POST", path))
    else:
        base, count = dropping_server.url, lambda: len(dropping_server.received)
    settings = {"url": f"{base}/hook"} if kind == "webhook" else {"base_url": f"{base}/v1", "model": "m"}
    msg = fails(kind, settings)
    assert "not retried: it may have arrived" in msg
    assert count() == 1


@pytest.fixture
def transport_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count every request httpx's async transport really attempts (one entry per connect attempt)."""
    calls: list[str] = []
    original = httpx.AsyncHTTPTransport.handle_async_request

    async def counting(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        """Record the attempt, then send it for real."""
        calls.append(str(request.url))
        return await original(self, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", counting)
    return calls


@pytest.mark.parametrize("kind", ["webhook", "openai"])
@pytest.mark.parametrize("retries", [0, 2])
def test_refused_connect_is_retried_then_fails(kind: str, retries: int, transport_calls: list[str]):
    """A refused port is tried retries+1 times, then a ResponderError says so."""
    base = closed_port_url()
    settings = ({"url": f"{base}/hook"} if kind == "webhook" else {"base_url": f"{base}/v1", "model": "m"})
    msg = fails(kind, {**settings, "retries": retries})
    assert f"could not connect to {base} after {retries + 1} attempt(s)" in msg
    assert len(transport_calls) == retries + 1


def test_webhook_connect_retry_reaches_a_server_that_came_up(transport_calls: list[str], monkeypatch):
    """After a refused connect, the retry reaches the server once it listens, and its answer is the reply."""
    base = closed_port_url()
    port = int(base.rsplit(":", 1)[1])
    hits: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        """Answers every POST with {"text": "second try"}."""

        def do_POST(self) -> None:
            """Record the body and answer."""
            hits.append(self.rfile.read(int(self.headers["content-length"])))
            body = b'{"text": "second try"}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            """Stay quiet."""

    servers: list[http.server.ThreadingHTTPServer] = []
    counting = httpx.AsyncHTTPTransport.handle_async_request

    async def start_after_first_refusal(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        """Send; on the first refused connect, start listening on the port for the retry."""
        try:
            return await counting(self, request)
        except httpx.ConnectError:
            if not servers:
                srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
                threading.Thread(target=srv.serve_forever, daemon=True).start()
                servers.append(srv)
            raise

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", start_after_first_refusal)
    try:
        assert run("webhook", {"url": f"{base}/hook", "retries": 2}) == "second try"
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
    assert len(transport_calls) == 2 and len(hits) == 1
    assert json.loads(hits[0])["id"] == PARENT.id


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({}, "responder.url"),
        ({"url": "ftp://example.com/hook"}, "responder.url: must be an http:// or https:// URL"),
        ({"url": "https:///nohost"}, "responder.url"),
        ({"url": "http://example.com:99999/"}, "responder.url: the port"),
        ({"url": "https://example.com/h", "hmac_secret": "short"}, "responder.hmac_secret: too short"),
        ({"url": "https://example.com/h", "hmac_secret": 12345678901234567}, "responder.hmac_secret"),
        ({"url": "https://example.com/h", "headers": ["x"]}, "responder.headers"),
        ({"url": "https://example.com/h", "headers": {"X-A": 1}}, "responder.headers"),
        ({"url": "https://example.com/h", "headers": {"X-Replyd-Signature": "x"}}, "set by replyd"),
        ({"url": "https://example.com/h", "headers": {"X-A": "a\r\nX-Injected: 1"}}, "one line"),
        ({"url": "https://example.com/h", "retries": -1}, "responder.retries"),
        ({"url": "https://example.com/h", "retries": True}, "responder.retries"),
        ({"url": "https://example.com/h", "timeout_s": "30"}, "responder.timeout_s"),
        ({"url": "https://example.com/h", "method": "PUT"}, "unknown setting(s) ['method']"),
    ],
)
def test_webhook_settings_are_validated(settings: dict[str, Any], needle: str):
    """Bad webhook settings are ConfigErrors naming the key."""
    with pytest.raises(ConfigError) as ei:
        make_responder("webhook", settings)
    assert needle in str(ei.value)


def test_webhook_secret_env_is_resolved(monkeypatch: pytest.MonkeyPatch, fixture_server: FixtureServer):
    """hmac_secret_env names the variable; the factory resolves it if the loader has not."""
    monkeypatch.setenv("HOOK_SECRET", HMAC_SECRET)
    fixture_server.route("POST", "/hook", Reply(body={"text": "ok"}))
    assert run("webhook", hook(fixture_server, hmac_secret_env="HOOK_SECRET")) == "ok"
    [req] = fixture_server.requests_to("POST", "/hook")
    ts = req.headers["x-replyd-timestamp"]
    assert req.headers["x-replyd-signature"] == webhook_signature(HMAC_SECRET, ts, req.body)


def test_http_client_is_lazy_and_closed():
    """The HTTP client is created on first use only and closed by ResponderRunner.close()."""
    r = make_responder("webhook", {"url": closed_port_url(), "retries": 0})
    assert r._post._client is None  # type: ignore[attr-defined]
    runner = ResponderRunner(r, timeout_s=10)
    with pytest.raises(ResponderError):
        runner(PARENT)
    client = r._post._client  # type: ignore[attr-defined]
    assert client is not None and not client.is_closed
    runner.close()
    assert client.is_closed


# -- openai ----------------------------------------------------------------------------------------


def completion(content: Any, finish_reason: str = "stop") -> dict[str, Any]:
    """A chat completions response with one choice."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25},
    }


def llm(server: FixtureServer, **extra: Any) -> dict[str, Any]:
    """openai settings pointing at the fixture server's /v1."""
    return {"base_url": f"{server.url}/v1/", "model": "gpt-test", "api_key": API_KEY, **extra}


def test_openai_request_shape_and_reply(fixture_server: FixtureServer):
    """POST /v1/chat/completions with model, system+user messages, max_tokens, temperature and the bearer."""
    fixture_server.route("POST", COMPLETIONS, Reply(body=completion("  Yes, every hour from 9.\n")))
    settings = llm(fixture_server, system_prompt="Be brief.", max_tokens=120, temperature=0.2,
                   prompt_template="{author_handle} ({url}) asks: {text}")
    assert run("openai", settings) == "Yes, every hour from 9."
    [req] = fixture_server.requests_to("POST", COMPLETIONS)
    assert req.headers["authorization"] == f"Bearer {API_KEY}"
    assert req.headers["content-type"] == "application/json"
    assert json.loads(req.body) == {
        "model": "gpt-test",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"{PARENT.author_handle} ({PARENT.url}) asks: {PARENT.text}"},
        ],
        "max_tokens": 120,
        "temperature": 0.2,
    }


def test_openai_defaults_and_no_key(fixture_server: FixtureServer):
    """Defaults: 300 max_tokens, no temperature, the default prompt; no key sends no Authorization."""
    fixture_server.route("POST", COMPLETIONS, Reply(body=completion("hello")))
    settings = {"base_url": f"{fixture_server.url}/v1", "model": "llama3"}
    assert run("openai", settings) == "hello"
    [req] = fixture_server.requests_to("POST", COMPLETIONS)
    assert "authorization" not in req.headers
    body = json.loads(req.body)
    assert body["max_tokens"] == 300 and "temperature" not in body
    assert body["messages"][1] == {"role": "user", "content": f"@{PARENT.author_handle} wrote:\n{PARENT.text}"}
    assert body["messages"][0]["role"] == "system" and body["messages"][0]["content"]
    assert make_responder("openai", settings).timeout_s == 60.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("content", "extra"),
    [(None, {}), ("", {}), ("  \n", {}), (" SKIP\n", {"decline_marker": "SKIP"})],
    ids=["null", "empty", "blank", "decline-marker"],
)
def test_openai_declines(fixture_server: FixtureServer, content: Any, extra: dict[str, Any]):
    """Null or empty content, or exactly the decline marker, declines."""
    fixture_server.route("POST", COMPLETIONS, Reply(body=completion(content)))
    assert run("openai", llm(fixture_server, **extra)) is None


def test_openai_decline_marker_only_when_whole_reply(fixture_server: FixtureServer):
    """A reply merely containing the decline marker is still a reply."""
    fixture_server.route("POST", COMPLETIONS, Reply(body=completion("SKIP the 9:00, take the 10:00")))
    assert run("openai", llm(fixture_server, decline_marker="SKIP")) == "SKIP the 9:00, take the 10:00"


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (Reply(status=401, body={"error": {"message": "Invalid key"}}), "unauthorized (HTTP 401; check api_key_env)"),
        (Reply(status=403, body={}), "unauthorized (HTTP 403"),
        (Reply(status=429, body={"error": {"message": "Rate limit reached"}}, headers={"retry-after": "7"}),
         "rate limited (HTTP 429, retry-after 7 s): Rate limit reached"),
        (Reply(status=429, body={}), "rate limited (HTTP 429, no retry-after)"),
        (html_error(503, "Service Unavailable"), "server error (HTTP 503)"),
        (Reply(status=400, body={"error": {"message": "max_tokens is too large"}}),
         "answered HTTP 400: max_tokens is too large"),
        (Reply(body="<html>Gateway</html>", content_type="text/html"), "body is not JSON (text/html"),
        (Reply(body={"object": "chat.completion"}), "field 'choices' is missing"),
        (Reply(body={"error": {"message": "model overloaded"}}), "answered 200 without 'choices': model overloaded"),
        (Reply(body={"choices": []}), "field 'choices' is empty"),
        (Reply(body={"choices": {"0": {}}}), "field 'choices' is dict, expected list"),
        (Reply(body={"choices": ["hi"]}), "field 'choices[0]' is str"),
        (Reply(body={"choices": [{"text": "hi"}]}), "field 'choices[0].message' is missing"),
        (Reply(body={"choices": [{"message": {"role": "assistant"}}]}), "field 'choices[0].message.content' is missing"),
        (Reply(body=completion(5)), "field 'choices[0].message.content' is int"),
        (Reply(body=completion([{"type": "text", "text": "hi"}])), "field 'choices[0].message.content' is list"),
    ],
    ids=["401", "403", "429", "429-bare", "503-html", "400", "html-200", "no-choices", "error-200", "empty",
         "choices-dict", "choice-str", "no-message", "no-content", "content-int", "content-list"],
)
def test_openai_errors_name_the_problem(fixture_server: FixtureServer, reply: Reply, needle: str):
    """Auth, rate limit, server errors and malformed bodies are ResponderErrors naming the problem; hit once."""
    fixture_server.route("POST", COMPLETIONS, reply)
    msg = fails("openai", llm(fixture_server))
    assert msg.startswith("openai: ") and needle in msg
    assert len(fixture_server.requests_to("POST", COMPLETIONS)) == 1


def test_openai_truncated_reply_is_kept_and_logged(fixture_server: FixtureServer):
    """finish_reason=length still answers, with a warning to raise max_tokens."""
    fixture_server.route("POST", COMPLETIONS, Reply(body=completion("The ferry runs at", finish_reason="length")))
    with capture_logs() as logs:
        assert run("openai", llm(fixture_server)) == "The ferry runs at"
    assert [e["model"] for e in logs if e["event"] == "replyd.responder.truncated"] == ["gpt-test"]


def test_openai_api_key_env_is_resolved(monkeypatch: pytest.MonkeyPatch, fixture_server: FixtureServer):
    """api_key_env names the variable holding the key (resolved by the factory if not yet; newline trimmed)."""
    monkeypatch.setenv("LLM_KEY", API_KEY + "\n")
    fixture_server.route("POST", COMPLETIONS, Reply(body=completion("ok")))
    settings = {"base_url": f"{fixture_server.url}/v1", "model": "m", "api_key_env": "LLM_KEY"}
    assert run("openai", settings) == "ok"
    assert fixture_server.requests_to("POST", COMPLETIONS)[0].headers["authorization"] == f"Bearer {API_KEY}"


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"base_url": "http://127.0.0.1:1/v1"}, "responder.model"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": ""}, "responder.model"),
        ({"model": "gpt-4o-mini"}, "responder.api_key_env: required for api.openai.com"),
        ({"base_url": "file:///etc/passwd", "model": "m"}, "responder.base_url"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_tokens": 0}, "responder.max_tokens"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_tokens": 1.5}, "responder.max_tokens"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "temperature": "hot"}, "responder.temperature"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "temperature": 3}, "responder.temperature"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "prompt_template": "{nope}"},
         "responder.prompt_template: unknown field(s) ['nope']"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "prompt_template": "{text"},
         "responder.prompt_template: not a valid format string"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "system_prompt": 3}, "responder.system_prompt"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key_env": "NOT_SET_LLM_KEY_X"},
         "responder.api_key_env: environment variable 'NOT_SET_LLM_KEY_X' is not set"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "strem": True}, "unknown setting(s) ['strem']"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "stream": "yes"}, "responder.stream"),
        ({"base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key": "sk-a b"}, "responder.api_key: contains"),
    ],
)
def test_openai_settings_are_validated(settings: dict[str, Any], needle: str):
    """Bad openai settings are ConfigErrors naming the key."""
    with pytest.raises(ConfigError) as ei:
        make_responder("openai", settings)
    assert needle in str(ei.value)


def _children() -> set[tuple[str, str]]:
    """The (pid, state) of every child process of this test process."""
    me = os.getpid()
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == me:
            found.add((stat.parent.name, fields[0]))
    return found


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    """No test leaves a child process of this test process behind (zombie or running)."""
    # Children started before the test (other test files' multiprocessing helpers) are not its doing.
    before = {pid for pid, _ in _children()}
    yield
    assert sorted(c for c in _children() if c[0] not in before) == []
