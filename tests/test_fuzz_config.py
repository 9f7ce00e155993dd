"""Config errors name the file, the key and the problem — for any document, not only the ones we thought of.

Hypothesis writes TOML documents from replyd's own sections and keys plus
unknown ones, with values of every TOML type; ``Config.load`` must return a
config or raise ``ConfigError`` whose message starts with the file's path
(never another exception). The explicit cases cover what tests/test_config.py
does not: a wrong type deep in a bot, a bot without a name, a directory, a
non-UTF-8 file, a bad environment override, a non-string ``*_env``, and the
CLI's ``config check`` naming file, bot and adapter key without a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as hs
import pytest
from hypothesis import HealthCheck, given, settings

from replyd.config import Config
from replyd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

SECTIONS = {
    "store": ["url", "auto_migrate"],
    "log": ["format", "level"],
    "guard": ["max_attempts", "send_timeout_s", "compose_lease_s", "dry_run"],
    "sweep": ["interval_s", "batch", "lease_s", "retry_s", "on_duplicate", "listing_delay_auto", "listing_delay_max_s",
              "reconcile_after"],
}
BOT_KEYS = ["name", "platform", "settings", "pollers", "policy", "responder"]
POLLER_KEYS = ["inbox_interval_s", "search_interval_s", "search_queries", "refind_interval_s", "refind_lookback_s", "jitter_s"]

scalar = (hs.integers(-10**6, 10**6) | hs.floats(allow_nan=True, allow_infinity=True) | hs.booleans()
          | hs.text(max_size=12) | hs.sampled_from(["json", "debug", "report", "memory", "mastodon", "", "sqlite:///x"])
          | hs.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(2100, 1, 1)))
value = hs.recursive(scalar, lambda c: hs.lists(c, max_size=3), max_leaves=4)
key = hs.sampled_from([k for ks in SECTIONS.values() for k in ks] + POLLER_KEYS + ["bogus", "x y", "token_env"])


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, dt.datetime):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)  # a TOML basic string is a JSON string


def toml_key(k: str) -> str:
    return k if k.replace("_", "").isalnum() else json.dumps(k)


@hs.composite
def documents(draw: hs.DrawFn) -> str:
    lines = []
    for section, keys in SECTIONS.items():
        if draw(hs.booleans()):
            lines.append(f"[{section}]")
            for _ in range(draw(hs.integers(0, 3))):
                k = draw(hs.sampled_from(keys) | key)
                lines.append(f"{toml_key(k)} = {toml_value(draw(value))}")
    for i in range(draw(hs.integers(0, 2))):
        lines.append("[[bots]]")
        if draw(hs.integers(0, 4)):
            lines.append(f"name = {toml_value(draw(hs.sampled_from(['b' + str(i), 'b0', 'a b', '']) | hs.text(max_size=5)))}")
        lines.append(f"platform = {toml_value(draw(hs.sampled_from(['memory', 'mastodon', 'nope'])))}")
        for sub, keys in (("settings", ["token_env", "base_url", "listing_delay_s", "bogus"]), ("pollers", POLLER_KEYS),
                          ("policy", ["skip_bots", "max_age_s", "bogus"]), ("responder", ["kind", "template", "api_key"])):
            if draw(hs.booleans()):
                lines.append(f"[bots.{sub}]")
                for _ in range(draw(hs.integers(0, 3))):
                    k = draw(hs.sampled_from(keys))
                    lines.append(f"{toml_key(k)} = {toml_value(draw(value))}")
    return "\n".join(lines) + "\n"


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=documents())
def test_any_document_loads_or_names_the_file(doc: str, tmp_path_factory, monkeypatch) -> None:
    """A config or a ConfigError that starts with the file's path; nothing else."""
    monkeypatch.setenv("T_SECRET", "value-of-secret-1")
    p = tmp_path_factory.mktemp("cfg") / "fuzz.toml"
    p.write_text(doc.replace('"token_env"', "token_env"))
    try:
        Config.load(p)
    except ConfigError as exc:
        assert str(exc).startswith(str(p)), str(exc)
        assert "value-of-secret-1" not in str(exc)


@pytest.mark.parametrize("text,pattern", [
    ('[[bots]]\nname = "b"\nplatform = "memory"\n[bots.pollers]\ninbox_interval_s = "often"\n',
     r"fuzz\.toml: bots\.b\.pollers\.inbox_interval_s: Input should be a valid number"),
    ('[[bots]]\nplatform = "memory"\n', r"fuzz\.toml: bots\.0\.name: Field required"),
    ('[[bots]]\nname = "a b"\nplatform = "memory"\n', r"fuzz\.toml: bots\.0\.name: .*letters, digits"),
    ("bots = 3\n", r"fuzz\.toml: bots: Input should be a valid list"),
    ('[log]\nlevel = "loud"\n', r"fuzz\.toml: log\.level: Input should be"),
    ('[sweep]\non_duplicate = "shout"\n', r"fuzz\.toml: sweep\.on_duplicate: Input should be"),
    ("[guard]\nmax_attempts = 99\n", r"fuzz\.toml: guard\.max_attempts: Input should be less than or equal to 5"),
])
def test_error_names_file_key_problem(text: str, pattern: str, tmp_path) -> None:
    """Errors deeper than the ones tests/test_config.py covers still name file, dotted key and rule."""
    p = tmp_path / "fuzz.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        Config.load(p)


def test_directory_and_non_utf8(tmp_path) -> None:
    """A directory and a non-UTF-8 file are ConfigErrors naming the path."""
    d = tmp_path / "dir.toml"
    d.mkdir()
    with pytest.raises(ConfigError, match=r"dir\.toml: cannot read config file"):
        Config.load(d)
    b = tmp_path / "bin.toml"
    b.write_bytes(b"\xff\xfe[store]\n")
    with pytest.raises(ConfigError, match=r"bin\.toml: not valid TOML"):
        Config.load(b)


def test_bad_environment_override_is_a_config_error(tmp_path, monkeypatch) -> None:
    """REPLYD_SWEEP__INTERVAL_S=abc names the key."""
    p = tmp_path / "fuzz.toml"
    p.write_text("")
    monkeypatch.setenv("REPLYD_SWEEP__INTERVAL_S", "abc")
    with pytest.raises(ConfigError, match=r"sweep\.interval_s: Input should be a valid number"):
        Config.load(p)


def test_non_json_section_override_is_a_config_error(tmp_path, monkeypatch) -> None:
    """REPLYD_GUARD='{not json' must be a ConfigError naming REPLYD_GUARD, not a SettingsError."""
    p = tmp_path / "fuzz.toml"
    p.write_text("")
    monkeypatch.setenv("REPLYD_GUARD", "{not json")
    with pytest.raises(ConfigError, match="REPLYD_GUARD"):
        Config.load(p)


def test_non_string_env_reference_is_named(tmp_path) -> None:
    """token_env = 5 is an error naming the key."""
    p = tmp_path / "fuzz.toml"
    p.write_text('[[bots]]\nname = "a"\nplatform = "memory"\n[bots.settings]\ntoken_env = 5\n')
    with pytest.raises(ConfigError, match=r"bots\.a\.settings\.token_env"):
        Config.load(p)


def test_cli_config_check_names_file_bot_and_adapter_key(tmp_path) -> None:
    """`replyd config check` on a bad adapter setting: exit 2, file + bot + key named, no traceback."""
    p = tmp_path / "bad.toml"
    p.write_text('[[bots]]\nname = "masto"\nplatform = "mastodon"\n[bots.settings]\nbase_url = "ftp://x"\n'
                 'token_env = "T_TOK"\n')
    os.chmod(p, 0o600)
    r = subprocess.run([sys.executable, "-m", "replyd", "config", "check", str(p)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "T_TOK": "abcdefgh"}, timeout=60)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert "Traceback" not in out
    assert "bad.toml" in out and "masto" in out and "base_url" in out and "http" in out, out
