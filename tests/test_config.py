"""Config loading: examples are valid, errors name file, key and problem, env overrides apply."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import tomllib
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from replyd.clock import SystemClock
from replyd.config import Config, _env_names
from replyd.platforms.base import make_platform
from replyd.errors import ConfigError
from replyd.store import Store

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_load(path, monkeypatch):
    """Every example in config/ loads once the variables it names are set."""
    text = path.read_text()
    for line in text.splitlines():
        if "_env" in line and "=" in line and not line.lstrip().startswith("#"):
            var = line.split("=", 1)[1].split("#")[0].strip().strip('"')
            # Slack's adapter checks a token's kind by its prefix (xoxb- bot, xapp- app-level).
            prefix = {"SLACK_BOT_TOKEN": "xoxb-", "SLACK_APP_TOKEN": "xapp-"}.get(var, "")
            monkeypatch.setenv(var, prefix + "dummy-secret-value")
    cfg = Config.load(path)
    assert cfg.bots, "an example config should configure at least one bot"
    with httpx.Client() as http:  # adapters validate their settings without a request
        for b in cfg.bots:
            assert make_platform(b.platform, b.settings, http=http, clock=SystemClock()).instance


def test_unknown_key_names_file_and_key(tmp_path):
    """An unknown key is an error naming the file and the dotted key."""
    p = tmp_path / "c.toml"
    p.write_text("[sweep]\ninterval_s = 5\nintervall = 3\n")
    with pytest.raises(ConfigError, match=r"c\.toml: sweep\.intervall: Extra inputs"):
        Config.load(p)


def test_bad_value_names_key(tmp_path):
    """A value out of range names its key and the rule."""
    p = tmp_path / "c.toml"
    p.write_text("[guard]\nmax_attempts = 0\n")
    with pytest.raises(ConfigError, match=r"guard\.max_attempts: Input should be greater than or equal to 1"):
        Config.load(p)


@pytest.mark.parametrize("word", ["yes", "on", "y", "no"])
def test_a_boolean_is_true_or_false_never_yes(tmp_path, word):
    """pydantic's lax mode reads "yes" and "on" as true; a config says true or false, so they are refused."""
    p = tmp_path / "c.toml"
    p.write_text(f'[store]\nauto_migrate = "{word}"\n')
    with pytest.raises(ConfigError, match=rf"store: auto_migrate: '{word}' is not a boolean \(use true or false\)"):
        Config.load(p)


def test_a_boolean_from_the_environment_is_true_false_1_or_0(monkeypatch):
    for text, want in (("false", False), ("TRUE", True), ("0", False), ("1", True)):
        monkeypatch.setenv("REPLYD_STORE__AUTO_MIGRATE", text)
        assert Config.load(None).store.auto_migrate is want


def test_invalid_toml_is_reported(tmp_path):
    """A syntax error names the file and says it is not TOML."""
    p = tmp_path / "c.toml"
    p.write_text("[store\nurl=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(p)


def test_missing_file(tmp_path):
    """A missing file is a ConfigError, not a traceback."""
    with pytest.raises(ConfigError, match="cannot read config file"):
        Config.load(tmp_path / "nope.toml")


def test_env_overrides_file(tmp_path, monkeypatch):
    """REPLYD_* variables override the file's values."""
    p = tmp_path / "c.toml"
    p.write_text("[sweep]\ninterval_s = 5\n")
    monkeypatch.setenv("REPLYD_SWEEP__INTERVAL_S", "7.5")
    monkeypatch.setenv("REPLYD_STORE__URL", "sqlite:////tmp/x.sqlite3")
    cfg = Config.load(p)
    assert cfg.sweep.interval_s == 7.5 and cfg.store.url == "sqlite:////tmp/x.sqlite3"


def test_secret_env_missing_is_named(tmp_path, monkeypatch):
    """A *_env setting whose variable is unset names the bot, key and variable."""
    monkeypatch.delenv("NOPE_TOKEN", raising=False)
    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "mastodon"\n[bots.settings]\ntoken_env = "NOPE_TOKEN"\n')
    with pytest.raises(ConfigError, match=r"bots\.b\.settings\.token_env: environment variable 'NOPE_TOKEN' is not set"):
        Config.load(p)


def test_secret_env_resolved(tmp_path, monkeypatch):
    """A *_env setting gives the adapter the variable's value under the key without _env."""
    monkeypatch.setenv("T_TOKEN", "s3cr3t-value")
    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "mastodon"\n[bots.settings]\ntoken_env = "T_TOKEN"\n')
    token = Config.load(p).bots[0].settings["token"]
    assert isinstance(token, SecretStr) and token.get_secret_value() == "s3cr3t-value"  # hidden in the config's repr


def test_duplicate_bot_names(tmp_path):
    """Two bots with one name are refused."""
    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "memory"\n[[bots]]\nname = "b"\nplatform = "memory"\n')
    with pytest.raises(ConfigError, match="duplicate bot name"):
        Config.load(p)


def test_literal_secret_in_readable_file_warns_and_is_masked(tmp_path, capsys):
    """A token written into a world-readable file triggers a warning and is masked in logs."""
    from replyd import log as rlog

    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "mastodon"\n[bots.settings]\ntoken = "literal-secret-999"\n')
    os.chmod(p, 0o644)
    rlog.configure("json", "info")
    Config.load(p)
    err = capsys.readouterr().err
    assert "replyd.config.readable" in err
    assert rlog.mask("x literal-secret-999 y") == "x *** y"


def test_private_file_with_env_secret_no_warning(tmp_path, capsys, monkeypatch):
    """A 0600 file that names its secret through *_env gives no readability warning."""
    from replyd import log as rlog

    monkeypatch.setenv("T_TOKEN", "abcdefgh")
    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "mastodon"\n[bots.settings]\ntoken_env = "T_TOKEN"\n')
    os.chmod(p, 0o600)
    rlog.configure("json", "info")
    Config.load(p)
    assert "replyd.config.readable" not in capsys.readouterr().err


def test_bad_env_override_names_the_variable(tmp_path, monkeypatch):
    """A bad value from REPLYD_<SECTION>__<KEY> names that variable, not only the file it overrides."""
    p = tmp_path / "c.toml"
    p.write_text("[guard]\nmax_attempts = 2\n")
    monkeypatch.setenv("REPLYD_GUARD__MAX_ATTEMPTS", "lots")
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    msg = str(e.value)
    assert msg.startswith(f"environment variable REPLYD_GUARD__MAX_ATTEMPTS (overrides {p}): guard.max_attempts:")
    monkeypatch.delenv("REPLYD_GUARD__MAX_ATTEMPTS")
    p.write_text("[guard]\nmax_attempts = 99\n")
    with pytest.raises(ConfigError, match=rf"^{p}: guard.max_attempts: "):
        Config.load(p)


def test_policy_section_is_validated(tmp_path):
    """Policy keys are checked: a negative depth or an unknown rule is named with its key."""
    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "memory"\n[bots.policy]\nmax_depth = -1\n')
    with pytest.raises(ConfigError, match=r"bots\.b\.policy\.max_depth"):
        Config.load(p)
    p.write_text('[[bots]]\nname = "b"\nplatform = "memory"\n[bots.policy]\nmax_replies = 3\n')
    with pytest.raises(ConfigError, match=r"bots\.b\.policy\.max_replies: Extra inputs are not permitted \(known: [^)]*max_per_hour"):
        Config.load(p)


@pytest.mark.parametrize("var,hint", [
    ("REPLYD_SWEP__INTERVAL_S", "REPLYD_SWEEP__INTERVAL_S"),
    ("REPLYD_SWEEP_INTERVAL_S", "REPLYD_SWEEP__INTERVAL_S"),
    ("REPLYD_STORE__URI", "REPLYD_STORE__URL"),
    ("REPLYD_REPLICA_IDD", "REPLYD_REPLICA_ID"),
    ("REPLYD_API__TOKEN", "REPLYD_API__TOKEN_ENV"),
])
def test_unknown_replyd_variable_is_an_error_with_a_suggestion(var, hint, monkeypatch):
    """A REPLYD_* variable shaped like a setting but naming none is refused with the closest real one."""
    monkeypatch.setenv(var, "5")
    with pytest.raises(ConfigError, match=rf"environment variable {var} .*did you mean {hint}\?"):
        Config.load(None)


@pytest.mark.parametrize("var", ["REPLYD_API_TOKEN", "REPLYD_TEST_PG", "REPLYD_CONFIG", "REPLYD_STORE__URL"])
def test_other_replyd_variables_pass(var, monkeypatch, tmp_path):
    """Token variables, harness knobs and real settings are not mistaken for typos."""
    monkeypatch.setenv(var, f"sqlite:///{tmp_path / 'x.sqlite3'}")
    assert Config.load(None).source == "defaults"


def test_a_variable_the_config_names_is_never_a_typo(tmp_path, monkeypatch):
    """A REPLYD_* variable a *_env key names (a secret) passes, even when it looks like a near miss of a setting."""
    p = tmp_path / "c.toml"
    p.write_text('[api]\ntoken_env = "REPLYD_REPLICA_IDD"\n')
    monkeypatch.setenv("REPLYD_REPLICA_IDD", "s3cret-value")
    assert Config.load(p).api.token_env == "REPLYD_REPLICA_IDD"
    p.write_text("")
    with pytest.raises(ConfigError, match="REPLYD_REPLICA_IDD"):
        Config.load(p)


# -- one validation: `replyd config check` and `replyd run` agree on every config ------------------------------


class _Contacted(BaseException):
    """Raised by the first request to a platform: the command got past every check that needs no platform."""


BOT = ('[[bots]]\nname = "b"\nplatform = "mastodon"\n[bots.settings]\nbase_url = "http://127.0.0.1:9"\n'
       'token_env = "T_TOK"\n')
GH_BOT = ('[[bots]]\nname = "gh"\nplatform = "github"\n[bots.settings]\ntoken_env = "T_TOK"\nrepos = ["o/r"]\n'
          '[bots.push]\nkind = "github"\nsecret_env = "T_HOOK"\n')
BSKY_BOT = ('[[bots]]\nname = "sky"\nplatform = "bluesky"\n[bots.settings]\nservice = "http://127.0.0.1:9"\n'
            'identifier = "bot.test"\napp_password_env = "T_TOK"\n')
API = '[api]\nenabled = true\nport = 0\n'
LONG_SECRET = "s" * 32


def _demo_header_env() -> dict[str, str]:
    """The variables config/demo.toml's header sets on its `replyd run` line, exactly as documented."""
    line = next(ln for ln in (ROOT / "config" / "demo.toml").read_text().splitlines()
                if "replyd run --config config/demo.toml" in ln)
    return dict(w.split("=", 1) for w in line.lstrip("# ").split() if "=" in w)


def _example_env(path: Path) -> dict[str, str]:
    """A value for every variable an example in config/ names (Slack's token kinds by prefix)."""
    env = {}
    for var in _env_names(tomllib.loads(path.read_text())):
        env[var] = {"SLACK_BOT_TOKEN": "xoxb-", "SLACK_APP_TOKEN": "xapp-"}.get(var, "") + "dummy-secret-value"
    return env


def _corpus(tmp: Path) -> list[tuple[str, str, dict[str, str], str, bool]]:
    """(id, config text, environment, expected verdict, visible only when the store is opened)."""
    afile = tmp / "afile"
    afile.write_text("")
    corrupt = tmp / "corrupt.sqlite3"
    corrupt.write_bytes(b"not a database " * 100)
    ahead = tmp / "ahead.sqlite3"  # migrated by a newer replyd: a revision this one does not know
    s = Store.open(f"sqlite:///{ahead}")
    with s.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'ffff0000'")
    s.dispose()
    empty = tmp / "empty.sqlite3"  # a database with no schema yet: `run` migrates it
    empty.write_bytes(b"")
    tok = {"T_TOK": "t0ken-value"}
    cases = [
        ("baseline", BOT, tok, "starts", False),
        ("secret-unset", BOT, {}, "T_TOK", False),
        ("no-bots", "[sweep]\ninterval_s = 5\n", {}, "no [[bots]]", False),
        ("unknown-platform", '[[bots]]\nname = "b"\nplatform = "myspace"\n', {}, "unknown platform", False),
        ("bad-adapter-setting", BOT.replace("http://127.0.0.1:9", "ftp://x"), tok, "base_url", False),
        ("bad-responder", BOT + '[bots.responder]\nkind = "template"\ntemplat = "x"\n', tok, "templat", False),
        ("store-proc", f'[store]\nurl = "sqlite:////proc/replyd/s.sqlite3"\n{BOT}', tok, "cannot create the store", False),
        ("store-under-a-file", f'[store]\nurl = "sqlite:///{afile}/s.sqlite3"\n{BOT}', tok, "not a directory", False),
        ("store-scheme", f'[store]\nurl = "foo://bar"\n{BOT}', tok, "unsupported store URL scheme", False),
        ("store-corrupt", f'[store]\nurl = "sqlite:///{corrupt}"\n{BOT}', tok, "not a database", True),
        ("store-schema-unknown", f'[store]\nurl = "sqlite:///{ahead}"\n{BOT}', tok, "ffff0000", True),
        ("store-empty-file-migrated", f'[store]\nurl = "sqlite:///{empty}"\n{BOT}', tok, "starts", False),
        ("store-pg-refused", f'[store]\nurl = "postgresql+psycopg://nobody@127.0.0.1:1/x"\n{BOT}', tok,
         "127.0.0.1", True),
        ("store-no-schema-no-migrate", f'[store]\nurl = "sqlite:///{tmp / "new.sqlite3"}"\nauto_migrate = false\n'
                                       f'{BOT}', tok, "db upgrade", True),
        ("webhook", API + GH_BOT, {**tok, "T_HOOK": LONG_SECRET}, "starts", False),
        ("webhook-without-api", GH_BOT, {**tok, "T_HOOK": LONG_SECRET}, "api.enabled", False),
        ("webhook-secret-unset", API + GH_BOT, tok, "T_HOOK", False),
        ("webhook-secret-short", API + GH_BOT, {**tok, "T_HOOK": "short"}, "shorter than 16", False),
        ("webhook-adapter-cannot", API + BSKY_BOT + '[bots.push]\nkind = "github"\nsecret_env = "T_HOOK"\n',
         {**tok, "T_HOOK": LONG_SECRET}, "cannot read webhook", False),
        ("stream-adapter-cannot", GH_BOT.replace('kind = "github"\nsecret_env = "T_HOOK"', 'kind = "slack_socket"'),
         tok, "has no push stream", False),
        ("stream", BOT + '[bots.push]\nkind = "mastodon_stream"\n', tok, "starts", False),
        ("api-public-no-token", API + 'host = "0.0.0.0"\n' + BOT, tok, "needs a bearer token", False),
        ("api-token-unset", API + 'token_env = "T_API"\n' + BOT, tok, "T_API", False),
        ("mcp-token-unset", BOT + '[mcp]\ntoken_env = "T_MCP"\n', tok, "starts", False),
        ("mcp-token-short-public", BOT + '[mcp]\nhost = "0.0.0.0"\ntoken_env = "T_MCP"\n', {**tok, "T_MCP": "short"},
         "mcp.token_env", False),
        ("demo-as-documented", (ROOT / "config" / "demo.toml").read_text(), _demo_header_env(), "starts", False),
    ]
    imm = tmp / "immutable"
    imm.mkdir()
    if subprocess.run(["chattr", "+i", str(imm)], capture_output=True).returncode == 0:
        cases.append(("store-immutable-dir", f'[store]\nurl = "sqlite:///{imm}/s.sqlite3"\n{BOT}', tok,
                      "Operation not permitted", False))
    for p in sorted((ROOT / "config").glob("*.toml")):
        cases.append((f"config/{p.name}", p.read_text(), _example_env(p), "starts", False))
    return cases


def _verdict(args: list[str]) -> str:
    """Run one replyd command in-process, stopped at its first request to a platform: "starts" if it got there
    (or, offline, passed without one), else the one-line error it refused with."""
    from typer.testing import CliRunner

    from replyd.cli import app
    from replyd.errors import ReplydError

    contacted: list[str] = []

    def first_contact(self: httpx.Client, request: httpx.Request, **_kw: object) -> httpx.Response:
        contacted.append(str(request.url))
        if threading.current_thread() is threading.main_thread():
            raise _Contacted(str(request.url))
        # A bot logging in from a thread of its own: stop the daemon as SIGTERM would.
        os.kill(os.getpid(), signal.SIGTERM)
        raise httpx.ConnectError("stopped at the first platform contact", request=request)

    def first_imap_contact(host: str, *_a: object, **_kw: object) -> object:
        # The email adapter's first contact is an IMAP connection, not an HTTP request.
        contacted.append(f"imap://{host}")
        if threading.current_thread() is threading.main_thread():
            raise _Contacted(f"imap://{host}")
        os.kill(os.getpid(), signal.SIGTERM)
        raise OSError("stopped at the first platform contact")

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    guard = threading.Timer(30.0, os.kill, (os.getpid(), signal.SIGTERM))  # a run that never contacts: no hang
    guard.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(httpx.Client, "send", first_contact)
            mp.setattr("replyd.platforms.email.IMAPClient", first_imap_contact)
            try:
                res = CliRunner().invoke(app, args, catch_exceptions=True)
            except _Contacted:  # a BaseException: the runner lets it through
                return "starts"
    finally:
        guard.cancel()
        for s, h in handlers.items():
            signal.signal(s, h)
    exc = res.exception
    if args[:2] == ["config", "check"] and "--online" not in args:
        assert not contacted, f"{args}: the offline check made a request: {contacted}"
    if res.exit_code == 0 and (contacted or args[0] == "config"):
        return "starts"
    if isinstance(exc, ReplydError):
        return " ".join(str(exc).split())
    if isinstance(exc, SystemExit) and res.exit_code == 2 and res.stderr.strip():  # --online prints its failures
        return " ".join(res.stderr.split())
    raise AssertionError(f"{args}: neither refused nor reached a platform: exit {res.exit_code}, {exc!r}, "
                         f"{res.output}")


def test_config_check_and_run_agree_on_every_config(tmp_path, monkeypatch):
    """`config check` gives `run`'s verdict (stopped at its first platform contact) on every example in config/
    and on the bad-config corpus; `--online` also agrees where only opening the store shows the problem."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("REPLYD_API__PORT", "0")
    named = {"T_TOK", "T_HOOK", "T_API", "T_MCP", "SIM_TOKEN", "REPLYD_API_TOKEN", "REPLYD_MCP_TOKEN"}
    for p in (ROOT / "config").glob("*.toml"):
        named |= set(_example_env(p))
    try:
        for case, text, env, expected, opens in _corpus(tmp_path):
            p = tmp_path / f"{case.replace('/', '_')}.toml"
            p.write_text(text)
            os.chmod(p, 0o600)
            with monkeypatch.context() as mp:
                for var in named:
                    mp.delenv(var, raising=False)
                for var, value in env.items():
                    mp.setenv(var, value)
                if "[store]\nurl" not in text or 'url = ""' in text:  # a fresh store per case
                    mp.setenv("REPLYD_STORE__URL", f"sqlite:///{tmp_path / 'stores' / p.stem / 's.sqlite3'}")
                verdicts = {name: _verdict(args) for name, args in (
                    ("check", ["config", "check", str(p)]), ("online", ["config", "check", "--online", str(p)]),
                    ("run", ["run", "--config", str(p)]))}
            run, check, online = verdicts["run"], verdicts["check"], verdicts["online"]
            assert (run == "starts") if expected == "starts" else (expected in run), (case, verdicts)
            assert (online == "starts") == (run == "starts"), (case, verdicts)
            if not opens:
                assert check == run, (case, verdicts)
            else:
                assert check == "starts" and expected in online, (case, verdicts)
    finally:  # an immutable directory outlives its test unless made mutable again
        subprocess.run(["chattr", "-i", str(tmp_path / "immutable")], capture_output=True)


def test_online_check_says_ok_only_after_every_online_check(tmp_path, monkeypatch):
    """`config check --online` on a corrupt store: the store's error and exit 2, never "ok" first."""
    from typer.testing import CliRunner

    from replyd.cli import app

    db = tmp_path / "corrupt.sqlite3"
    db.write_bytes(b"not a database " * 100)
    p = tmp_path / "c.toml"
    p.write_text(f'[store]\nurl = "sqlite:///{db}"\n[[bots]]\nname = "m"\nplatform = "memory"\n')
    res = CliRunner().invoke(app, ["config", "check", "--online", str(p)])
    assert res.exit_code == 2 and "not a database" in res.stderr, res.output
    assert ": ok (" not in res.stdout, res.stdout
    db.unlink()
    res = CliRunner().invoke(app, ["config", "check", "--online", str(p)])
    assert res.exit_code == 0 and res.stdout.rstrip().endswith(f"{p}: ok (1 bot(s))"), res.output


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.toml")), ids=lambda p: p.name)
def test_bot_instance_without_secrets(path, monkeypatch):
    """A bot's platform instance (its keys' first part) comes from its settings alone: with no variable set it
    is the one the adapter has when built with its secrets (`replyd rearm BOT` needs no platform token)."""
    from replyd.cli.common import _instance_of

    for var in _example_env(path):
        monkeypatch.delenv(var, raising=False)
    bare = Config.load(path, secrets=False)
    for var, value in _example_env(path).items():
        monkeypatch.setenv(var, value)
    full = Config.load(path)
    with httpx.Client() as http:
        for b, fb in zip(bare.bots, full.bots, strict=True):
            want = make_platform(fb.platform, {"listing_delay_s": 10.0, **fb.settings}, http=http,
                                 clock=SystemClock()).instance
            assert _instance_of(bare, b.name) == want
