"""The replyd command line on a live log (subprocesses, the default SQLite path under XDG_STATE_HOME)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from replyd import migrate
from replyd.guard import Guard
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store, default_sqlite_path

ROOT = Path(__file__).resolve().parents[1]


def replyd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `python -m replyd ARGS` and capture its output."""
    return subprocess.run([sys.executable, "-m", "replyd", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **env}, cwd=ROOT, timeout=60)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An XDG state dir of our own, so the default store is a fresh file."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return {"XDG_STATE_HOME": str(tmp_path / "state")}


@pytest.fixture
def answered(env):
    """A default store where parent '0042' is answered and 'p-open' is in flight."""
    store = Store.open()
    plat = MemoryPlatform(instance="memory:cli")
    g = Guard(store, plat, plat.whoami())
    g.post(plat.add_parent("0042"), "hello")
    plat.script = ["lost"]
    g.post(plat.add_parent("p-open"), "hello")
    yield store, g
    store.dispose()


def test_default_store_path_is_under_xdg_state(env):
    """The embedded default lives at $XDG_STATE_HOME/replyd/replyd.sqlite3."""
    assert default_sqlite_path() == Path(env["XDG_STATE_HOME"]) / "replyd" / "replyd.sqlite3"


def test_check_answered_prints_already_answered_and_sends_nothing(answered, env):
    """The card's verify step: an answered parent prints 'already answered', exit 0, log unchanged."""
    store, g = answered
    before = len(store.history(g.key("0042")))
    r = replyd("check", "0042", env=env)
    assert r.returncode == 0, r.stderr
    assert "already answered" in r.stdout and "nothing sent" in r.stdout
    assert len(store.history(g.key("0042"))) == before


def test_check_is_exact_about_ids(answered, env):
    """'42' is not '0042': ids are opaque, so check finds no row and exits 1."""
    r = replyd("check", "42", env=env)
    assert r.returncode == 1 and "not answered" in r.stdout


def test_check_in_flight(answered, env):
    """An open row reports in flight, exit 1."""
    r = replyd("check", "p-open", env=env)
    assert r.returncode == 1 and "in flight" in r.stdout


def test_status_json_counts(answered, env):
    """status --json reports rows by state and the oldest open row."""
    r = replyd("status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    counts = {(c["platform"], c["state"]): c["rows"] for c in data["counts"]}
    assert counts == {("memory:cli", "closed"): 1, ("memory:cli", "open"): 1}
    assert [o["parent_id"] for o in data["oldest_open"]] == ["p-open"]


def test_explain_shows_timeline(answered, env):
    """explain --json shows the row and its events in order."""
    r = replyd("explain", "p-open", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)[0]
    assert doc["row"]["state"] == "open"
    assert [e["kind"] for e in doc["events"]] == ["claimed", "maybe_sent"]


def test_explain_of_a_one_post_answer_shows_no_parts(env):
    """A composed one-post answer reads as one story: no "0 of 1 parts landed" table after "closed, reply ..."."""
    store = Store.open()
    plat = MemoryPlatform(instance="memory:cli")
    Guard(store, plat, plat.whoami()).post(plat.add_parent("0042"), lambda _p: "hello")  # composed: text stored
    store.dispose()
    r = replyd("explain", "0042", env=env)
    assert r.returncode == 0, r.stderr
    assert "closed attempt 1 reply" in r.stdout
    assert "parts landed" not in r.stdout and "not claimed" not in r.stdout
    doc = json.loads(replyd("explain", "0042", "--json", env=env).stdout)[0]
    assert doc["row"]["state"] == "closed" and "parts" not in doc


# Ids from a platform and the API's free-form path, made of what a terminal would act on: OSC (set the title),
# CSI (clear the screen), a one-byte C1 CSI, BEL, a newline that would fake a row, a bidi override.
EVIL_ID = "9\x1b]0;owned\x07\x1b[2J\x9b31m\nfake row\u202edi"
EVIL_PATH = "api\x1b[31m\x85"
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]")  # any control but the line ends rich writes


@pytest.fixture
def evil(env):
    """A default store holding an answered and an in-flight parent whose ids and path carry terminal controls."""
    store = Store.open()
    plat = MemoryPlatform(instance="memory:cli")
    g = Guard(store, plat, plat.whoami())
    g.post(plat.add_parent(EVIL_ID), "hello", path=EVIL_PATH)
    plat.script = ["lost"]
    g.post(plat.add_parent(EVIL_ID + "-open"), "hello", path=EVIL_PATH)
    yield store
    store.dispose()


SHOWN_ID = "9\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\x0afake row\\u202edi"  # the newline too: the id keeps its line
SHOWN_PATH = "api\\x1b[31m\\x85"


@pytest.mark.parametrize(("args", "expected"), [
    (["log"], [SHOWN_ID, SHOWN_PATH]),
    (["explain", EVIL_ID], [SHOWN_ID, SHOWN_PATH]),  # the path as the row's "found by"
    (["explain", EVIL_ID + "-open"], [SHOWN_ID]),
    (["status"], [SHOWN_ID]),  # the in-flight one among the oldest open rows
    (["check", EVIL_ID], ["already answered"]),
    (["check", EVIL_ID + "x"], ["no row for '9\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\nfake row\\u202edix'"]),  # a repr
    (["explain", "\x1b[2Jnothing"], ["\\x1b[2Jnothing"]),
], ids=repr)
def test_read_commands_escape_terminal_controls(evil, env, args, expected):
    """Control characters from ids and paths reach the terminal as visible escapes, never as controls."""
    r = replyd(*args, env=env)
    assert r.returncode in (0, 1), r.stderr
    shown = r.stdout + r.stderr
    assert not CONTROL.findall(shown)
    assert all(text in shown for text in expected), shown


def test_log_follow_escapes_terminal_controls(evil, env):
    """log --follow writes each event on one line with its controls escaped."""
    proc = subprocess.Popen([sys.executable, "-m", "replyd", "log", "--follow"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]  # claimed, closed (the answered one), then claimed
    finally:
        proc.kill()
        proc.wait()
    assert all(line.endswith("\n") and not CONTROL.findall(line) for line in lines), lines
    assert SHOWN_ID in lines[0] and SHOWN_PATH in lines[0]


def test_db_upgrade_and_current(env, tmp_path):
    """db upgrade creates the schema at a given URL; db current reports the revision."""
    url = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    e = {**env, "REPLYD_STORE__URL": url}
    assert replyd("db", "upgrade", env=e).returncode == 0
    r = replyd("db", "current", env=e)
    assert r.returncode == 0 and f"revision {migrate.head()} (newest: {migrate.head()})" in r.stdout


def test_bad_config_exits_2_with_clear_message(env, tmp_path):
    """A bad config exits 2 with the file and key named, no traceback."""
    p = tmp_path / "bad.toml"
    p.write_text("[sweep]\ninterval_s = -1\n")
    r = replyd("status", "--config", str(p), env=env)
    assert r.returncode == 2
    assert "bad.toml" in r.stderr and "sweep.interval_s" in r.stderr and "Traceback" not in r.stderr


def test_secret_never_printed(env, tmp_path):
    """A secret read from the environment does not appear in a config error's output."""
    p = tmp_path / "c.toml"
    p.write_text('[[bots]]\nname = "b"\nplatform = "mastodon"\n[bots.settings]\ntoken_env = "TOK"\nbase_url = "ftp://x"\n')
    r = replyd("config", "check", str(p), env={**env, "TOK": "very-secret-token-123"})
    assert r.returncode == 2 and "bots.b" in r.stderr and "base_url" in r.stderr
    assert "very-secret-token-123" not in r.stdout + r.stderr


def test_status_lists_rows_waiting_past_their_bound(env):
    """status --json lists a composing row whose composer died two hours ago (its lease long expired)."""
    import time as _time

    from replyd.clock import FakeClock

    store = Store.open()
    plat = MemoryPlatform(instance="memory:cli")
    g = Guard(store, plat, plat.whoami(), clock=FakeClock(_time.time() - 7200), compose_lease_s=120.0,
              watch_interval_s=None)

    class Died(BaseException):
        """The process died while its responder ran."""

    with pytest.raises(Died):
        g.post(plat.add_parent("p-stuck"), lambda p: (_ for _ in ()).throw(Died()))
    g.post(plat.add_parent("p-done"), "hello")
    store.dispose()
    r = replyd("status", "--json", "--overdue-after-s", "60", env=env)
    assert r.returncode == 0, r.stderr
    over = json.loads(r.stdout)["overdue"]
    assert [(o["parent_id"], o["state"]) for o in over] == [("p-stuck", "composing")]
    assert over[0]["over_s"] > 7000
    text = replyd("status", "--overdue-after-s", "60", env=env).stdout
    assert "p-stuck" in text and "past their bound" in text


def test_status_json_shows_listing_delay_and_observed_lag(env):
    """status --json: per platform instance, the configured delay, the delay in use and the observed lag."""
    from replyd.clock import FakeClock
    from replyd.config import SweepConfig
    from replyd.lag import ListingLag
    from replyd.sweep import Bot, Sweeper

    clock = FakeClock()
    store = Store.open(clock=clock)
    plat = MemoryPlatform(instance="memory:cli", listing_delay_s=1.0, clock=clock)
    plat.real_listing_delay_s = 3.0
    cfg = SweepConfig(listing_delay_min_samples=5, listing_lag_refresh_s=0.5)
    lag = ListingLag(store, plat.instance, 1.0, cfg, clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=1.0, watch_interval_s=None, lag=lag)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=clock, config=cfg)
    for i in range(6):
        g.post(plat.add_parent(f"p{i}"), "hello")
    for _ in range(20):
        clock.advance(0.5)
        sw.run_once()
    g.lag.refresh()
    store.dispose()
    r = replyd("status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    [row] = json.loads(r.stdout)["listing"]
    assert row["platform"] == "memory:cli" and row["configured_s"] == 1.0 and row["samples"] == 6
    assert 2.0 <= row["observed_p99_s"] < 3.0 <= row["in_use_s"]
