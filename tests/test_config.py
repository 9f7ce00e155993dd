"""Config loading: examples are valid, errors name file, key and problem, env overrides apply."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from replyd.clock import SystemClock
from replyd.config import Config
from replyd.platforms.base import make_platform
from replyd.errors import ConfigError

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
