"""The CLI as a well-made tool, run as subprocesses: absent stores, versions, one-line errors, tokens, times, follow."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version
from pathlib import Path

import pytest

from replyd.cli import parse_time
from replyd.errors import ConfigError
from replyd.guard import Guard
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from tests.api_harness import ROOT

READ_COMMANDS = [("status",), ("status", "--json"), ("log",), ("log", "--json"), ("explain", "p1"), ("check", "p1"),
                 ("export",), ("db", "current")]
CLASS_NAMES = re.compile(r"\b(ConfigError|StoreError|SchemaError|PlatformError|DefinitelyNotSent|MaybeSent|Rejected|"
                         r"Traceback|PermissionError|OSError|NotADirectoryError)\b")


def run(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m replyd ARGS`` with exactly ``env`` over a clean base (no inherited REPLYD_* or tokens)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("REPLYD_", "SIM_TOKEN", "XDG_"))}
    return subprocess.run([sys.executable, "-m", "replyd", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**base, "PYTHONPATH": str(ROOT), **env}, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """Assert exit 2 and exactly one plain stderr line starting ``replyd:``, no class names; return it."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("replyd: "), (r.returncode, r.stderr)
    assert not CLASS_NAMES.search(lines[0]), lines[0]
    return lines[0]


def files_under(path: Path) -> list[Path]:
    """Every file and directory under ``path`` (empty when it does not exist)."""
    return sorted(path.rglob("*")) if path.exists() else []


@pytest.fixture
def bot_config(tmp_path) -> Path:
    """A config with one Mastodon bot whose token variable is NOT set, and no store URL (the XDG default)."""
    p = tmp_path / "bot.toml"
    p.write_text('[[bots]]\nname = "sim"\nplatform = "mastodon"\n[bots.settings]\nbase_url = "http://127.0.0.1:9"\n'
                 'token_env = "SIM_TOKEN_UNSET"\n')
    return p


def test_version_and_short_help():
    """`replyd --version` prints the installed version; `-h` is help, on the app and on a command."""
    r = run("--version", env={})
    assert r.returncode == 0 and r.stdout.strip() == f"replyd {version('replyd')}" and r.stderr == ""
    for args in (("-h",), ("status", "-h"), ("db", "-h")):
        h = run(*args, env={})
        assert h.returncode == 0 and h.stdout.startswith("Usage: ") and "-h, --help" in h.stdout, args
    assert "Exit codes: 0" in run("-h", env={}).stdout


# What a command that reads nothing must never load: the store, the log, any adapter, the API.
HEAVY = ("sqlalchemy", "sqlmodel", "alembic", "structlog", "httpx", "prometheus_client",
         "replyd.platforms", "replyd.api", "replyd.guard", "replyd.daemon")


# Runs one CLI command in a fresh interpreter, then prints every module it loaded (a lazy one not yet used
# counts as not loaded) on stderr.
_PROBE = ("import sys, importlib.util\n"
          "sys.argv = ['replyd', *sys.argv[1:]]\n"
          "from replyd.cli import main\n"
          "try:\n    main()\nexcept SystemExit:\n    pass\n"
          "lazy = importlib.util._LazyModule\n"
          "loaded = sorted(m for m, mod in list(sys.modules.items()) if mod is not None and type(mod) is not lazy)\n"
          "sys.stderr.write('\\n'.join(loaded))\n")


def _loaded(args: tuple[str, ...], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, timeout=60)
    return r, r.stderr.split()


@pytest.mark.parametrize("args", [("--version",), ("-h",), ("status", "-h")])
def test_version_and_help_import_no_store_adapter_or_api(args):
    """`replyd --version` and `-h` start at once: they load none of the heavy modules. Timing lives in
    bench/clistart.py; this test holds the cause."""
    r, loaded = _loaded(args, {})
    assert r.returncode == 0, r.stderr[-2000:]
    heavy = sorted(m for m in loaded if m.startswith(HEAVY))
    assert not heavy, f"replyd {' '.join(args)} loaded {heavy[:10]}"


# What a read command on a current store must never load: migrations, the guard, adapters, the API.
READ_HEAVY = ("alembic", "replyd.guard", "replyd.core", "replyd.library", "replyd.daemon", "replyd.platforms.mastodon",
              "replyd.api", "httpx")


@pytest.mark.parametrize("args", [("log",), ("check", "0042"), ("explain", "0042"), ("status",)])
def test_read_commands_import_neither_alembic_nor_the_guard(args, store_env):
    """The read commands answer from the store alone: a current schema is one SELECT, not alembic's import, and
    no guard or adapter is loaded. Timing lives in bench/clistart.py; this test holds the cause."""
    r, loaded = _loaded(args, store_env)
    assert r.stdout.strip() and "Traceback" not in r.stderr, (r.stdout, r.stderr[-2000:])
    heavy = sorted(m for m in loaded if m.startswith(READ_HEAVY))
    assert not heavy, f"replyd {' '.join(args)} loaded {heavy[:10]}"


def test_schema_head_is_alembics_head():
    """``SCHEMA_HEAD`` (what read commands compare the store with) is the newest migration."""
    from replyd import migrate
    from replyd.store.model import SCHEMA_HEAD

    assert SCHEMA_HEAD == migrate.head()


def test_read_commands_on_an_absent_store_create_nothing_and_name_it(tmp_path, bot_config):
    """status, log, explain, check, export, db current: exit 2, no file or directory created, the path named;
    no platform token needed to get that far."""
    state = tmp_path / "state"
    want = state / "replyd" / "replyd.sqlite3"
    for cmd in READ_COMMANDS:
        r = run(*cmd, "--config", str(bot_config), env={"XDG_STATE_HOME": str(state)})
        line = one_line_error(r)
        assert f"no store at {want}" in line and "--store" in line, (cmd, line)
        assert files_under(state) == [], (cmd, files_under(state))
    other = tmp_path / "elsewhere.sqlite3"
    r = run("status", "--store", str(other), env={"XDG_STATE_HOME": str(state)})
    assert f"no store at {other}" in one_line_error(r) and not other.exists()
    r = run("log", env={"XDG_STATE_HOME": str(state), "REPLYD_STORE__URL": f"sqlite:///{other}"})
    assert f"no store at {other}" in one_line_error(r) and not other.exists()


@pytest.fixture
def store_env(tmp_path):
    """A real store with an answered parent '0042' and an events history, at the XDG default of ``tmp_path``."""
    state = tmp_path / "state"
    os.environ["XDG_STATE_HOME"] = str(state)
    try:
        s = Store.open()
        plat = MemoryPlatform(instance="memory:cli")
        g = Guard(s, plat, plat.whoami())
        g.post(plat.add_parent("0042"), "hello")
        s.dispose()
    finally:
        del os.environ["XDG_STATE_HOME"]
    return {"XDG_STATE_HOME": str(state)}


def test_read_commands_need_no_token_and_status_json_stderr_is_empty(store_env, bot_config):
    """On a healthy store every read command works with the bot's token variable unset; `status --json` writes
    JSON on stdout and nothing at all on stderr (no migration lines, no warnings)."""
    r = run("status", "--json", "--config", str(bot_config), env=store_env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"] == [{"platform": "memory:cli", "state": "closed", "rows": 1}]
    assert doc["daemon"]["reachable"] is False  # no [api]: said, not guessed
    for cmd, code in ((("check", "0042", "--json"), 0), (("explain", "0042", "--json"), 0), (("log", "--json"), 0),
                      (("export",), 0), (("check", "nope"), 1)):
        r = run(*cmd, "--config", str(bot_config), env=store_env)
        assert r.returncode == code and "SIM_TOKEN_UNSET" not in r.stderr, (cmd, r.stderr)
    assert json.loads(run("check", "0042", "--json", env=store_env).stdout)["answered"] is True


def test_unwritable_state_directory_is_one_line_exit_2(tmp_path):
    """A store directory that cannot be created (its parent is a file: fails even as root) is one storage line."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    r = run("db", "upgrade", env={"XDG_STATE_HOME": str(blocker / "state")})
    line = one_line_error(r)
    assert f"cannot create the store {blocker / 'state' / 'replyd' / 'replyd.sqlite3'}" in line, line


def test_unknown_variable_and_key_say_did_you_mean(tmp_path, store_env):
    """A misspelt REPLYD_* override or config key is an error with a suggestion, not silently ignored."""
    r = run("status", env={**store_env, "REPLYD_SWEP__INTERVAL_S": "5"})
    assert "REPLYD_SWEP__INTERVAL_S" in (line := one_line_error(r)) and "did you mean REPLYD_SWEEP__INTERVAL_S" in line
    p = tmp_path / "typo.toml"
    p.write_text('[sweep]\nintervall_s = 5\n[[bots]]\nname = "helper"\nplatform = "mastodon"\n'
                 '[bots.pollers]\ninbox_intervl_s = 3\n')
    line = one_line_error(run("status", "--config", str(p), env=store_env))
    assert "sweep.intervall_s" in line and "did you mean interval_s" in line
    assert "bots.helper.pollers.inbox_intervl_s" in line and "did you mean inbox_interval_s" in line


def test_since_takes_iso_durations_and_epochs_and_export_writes_iso(store_env):
    """--since reads ISO 8601 and durations; exports show ISO 8601 times, not epoch floats."""
    now = 1_780_000_000.0
    assert parse_time("2h", now) == now - 7200 and parse_time("1h30m", now) == now - 5400
    assert parse_time("2026-12-01", now) == 1_796_083_200.0
    assert parse_time("2026-12-01T08:00:00+02:00", now) == 1_796_083_200.0 + 6 * 3600
    assert parse_time("1796083200", now) == 1_796_083_200.0
    with pytest.raises(ConfigError, match="--since: 'yesterday' is not a time"):
        parse_time("yesterday", now)
    rows = list(csv.DictReader(io.StringIO(run("export", "--since", "1h", env=store_env).stdout)))
    assert len(rows) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", rows[0]["created_at"])
    assert json.loads(run("export", "--format", "json", "--since", "2999-01-01", env=store_env).stdout) == []
    events = json.loads(run("export", "--table", "events", "--format", "json", "--since", "2026-01-01",
                            env=store_env).stdout)
    assert [e["kind"] for e in events] == ["claimed", "closed"] and events[0]["at"].endswith("+00:00")
    assert "is not a time" in one_line_error(run("log", "--since", "yesterday", env=store_env))


def test_log_follow_prints_new_events_as_they_come(store_env):
    """`log --follow --json` prints the existing events, then a new one within a look or two; Ctrl-C exits 0."""
    proc = subprocess.Popen([sys.executable, "-m", "replyd", "log", "--follow", "--json", "--every", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **store_env})
    try:
        first = [json.loads(proc.stdout.readline()) for _ in range(2)]  # type: ignore[union-attr]
        assert [e["kind"] for e in first] == ["claimed", "closed"]
        os.environ["XDG_STATE_HOME"] = store_env["XDG_STATE_HOME"]
        try:
            s = Store.open()
            plat = MemoryPlatform(instance="memory:cli")
            Guard(s, plat, plat.whoami()).post(plat.add_parent("0043"), "hello again")
            s.dispose()
        finally:
            del os.environ["XDG_STATE_HOME"]
        later = [json.loads(proc.stdout.readline()) for _ in range(2)]  # type: ignore[union-attr]
        assert [(e["parent_id"], e["kind"]) for e in later] == [("0043", "claimed"), ("0043", "closed")]
        time.sleep(1.0)  # five more looks of the real process: none may print an event again
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    assert proc.stdout.read() == "" and proc.stderr.read() == ""  # type: ignore[union-attr]


class _Refusing(BaseHTTPRequestHandler):
    """A platform that refuses every token, counting the identity requests it received."""

    status = 401
    seen: list[str] = []

    def do_GET(self) -> None:  # http.server's naming
        """Answer 401/403 with a Mastodon-style error body."""
        type(self).seen.append(self.path)
        body = b'{"error":"The access token is invalid"}'
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.mark.parametrize("status", [401, 403])
def test_refused_token_is_one_line_naming_bot_and_variable_and_never_retried(tmp_path, status):
    """`replyd run` with a token the platform refuses: one line naming the bot and the variable, exit 2, promptly
    after the first identity request (no wait for a retry), which the platform saw exactly once."""
    _Refusing.status, _Refusing.seen = status, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cfg = tmp_path / "refused.toml"
    cfg.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "r.sqlite3"}"\n[[bots]]\nname = "helper"\n'
                   f'platform = "mastodon"\n[bots.settings]\nbase_url = "http://127.0.0.1:{srv.server_port}"\n'
                   'token_env = "HELPER_TOKEN"\n')
    try:
        proc = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "HELPER_TOKEN": "wrong-token-5e1a"})
        while not _Refusing.seen and proc.poll() is None:
            time.sleep(0.01)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        r = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
        line = one_line_error(r)
        assert "bot helper" in line and "HELPER_TOKEN" in line and f"HTTP {status}" in line, line
        assert "wrong-token-5e1a" not in stderr
        # One request (below) shows it did not retry; the time only bounds a hang (a loaded machine starts a
        # Python process in seconds).
        assert took < 15.0, took
        assert _Refusing.seen == ["/api/v1/accounts/verify_credentials"]
        online = run("config", "check", "--online", str(cfg), env={"HELPER_TOKEN": "wrong-token-5e1a"})
        assert online.returncode == 2 and "bot helper" in online.stderr and "HELPER_TOKEN" in online.stderr
        assert "ok, schema current" in online.stdout  # `run` created and migrated the store before logging in
    finally:
        srv.shutdown()


def test_brackets_survive_and_online_check_reaches_the_store(tmp_path):
    """Error text keeps its brackets (no markup); `config check` is offline-ok but `--online` fails, naming the
    store, when the PostgreSQL it names refuses connections."""
    line = one_line_error(run("run", env={"XDG_STATE_HOME": str(tmp_path / "state")}))
    assert "no [[bots]] configured" in line, line
    p = tmp_path / "pg.toml"
    p.write_text('[store]\nurl = "postgresql+psycopg://nobody@127.0.0.1:1/replyd"\n[[bots]]\nname = "m"\nplatform = "memory"\n')
    assert run("config", "check", str(p), env={}).returncode == 0
    r = run("config", "check", "--online", str(p), env={})
    assert r.returncode == 2 and "store postgresql+psycopg://nobody@127.0.0.1:1/replyd" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and not CLASS_NAMES.search(r.stderr)


def test_log_of_an_unknown_kind_is_an_error_naming_the_kinds(store_env):
    """`log --kind bogus` is a mistake, not "no events": exit 2, one line naming the kinds this store holds."""
    r = run("log", "--kind", "bogus", env=store_env)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    line = r.stderr.strip()
    assert "\n" not in line and "'bogus'" in line and "claimed" in line and "closed" in line, line
    ok = run("log", "--kind", "closed", "--json", env=store_env)  # a kind the store holds still answers
    assert ok.returncode == 0 and [e["kind"] for e in json.loads(ok.stdout)] == ["closed"]


@pytest.mark.parametrize("token", ["", "wrong-token-5e1a"])
def test_status_names_the_api_token_variable_when_the_daemon_refuses(tmp_path, store_env, token):
    """The daemon answers 401: status says which variable to set (or that its token is refused), never the value
    and never "not reachable"; without --config it says a config is needed, not that [api] is off."""
    _Refusing.status, _Refusing.seen = 401, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cfg = tmp_path / "api.toml"
    cfg.write_text(f'[api]\nenabled = true\nhost = "127.0.0.1"\nport = {srv.server_port}\ntoken_env = "OPS_API_TOKEN"\n')
    try:
        r = run("status", "--config", str(cfg), env={**store_env, **({"OPS_API_TOKEN": token} if token else {})})
    finally:
        srv.shutdown()
    assert r.returncode == 0, r.stderr
    daemon_line = next(line for line in r.stdout.splitlines() if line.startswith("daemon:"))
    assert "OPS_API_TOKEN" in daemon_line and "401" in daemon_line, daemon_line
    assert ("set OPS_API_TOKEN" in daemon_line) == (not token), daemon_line
    assert "not reachable" not in daemon_line and (not token or token not in r.stdout + r.stderr)
    bare = run("status", env=store_env)
    assert "no config given" in bare.stdout and "does not enable [api]" not in bare.stdout, bare.stdout
