"""Shared setup for the API, library, status page and operator CLI tests: a sim, a daemon with its API."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.sim import SimServer, World
from replyd.sim.world import Account

ROOT = Path(__file__).resolve().parents[1]
BOT = "replybot"
TOKEN = "api-test-token-5d1c9e"
TOKEN_ENV = "REPLYD_TEST_API_TOKEN"


def write_config(
    path: Path,
    sim_url: str,
    db: Path,
    *,
    api: bool = True,
    host: str = "127.0.0.1",
    token_env: str | None = TOKEN_ENV,
    pollers: bool = False,
    port: int = 0,
    sweep_s: float = 3600,
    extra: str = "",
    api_extra: str = "",
    send_timeout_s: float = 1.0,
) -> Path:
    """Write a daemon config for the sim: API on an ephemeral port (or ``port``), pollers off unless asked, a
    manual sweep (or one every ``sweep_s``), any ``extra`` TOML sections and ``api_extra`` [api] keys.

    ``send_timeout_s`` is short by default so stall tests end fast; a race under load wants it above the
    adapter's ``timeout_s`` (a winner stalled past it releases its claim and nobody posts)."""
    every = 0.3 if pollers else 0
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "warning"

[guard]
send_timeout_s = {send_timeout_s}

[sweep]
interval_s = {sweep_s}
retry_s = 0.5
{extra}
[api]
enabled = {"true" if api else "false"}
host = "{host}"
port = {port}
token_env = "{token_env or ''}"
refresh_s = 5
{api_extra}

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{sim_url}"
token_env = "SIM_TOKEN"
listing_delay_s = 0.2
timeout_s = 3.0
# Above the sim's 500: a long text is one post the sim refuses (these tests' way to a rejected row), not parts.
max_characters = 100000

[bots.pollers]
inbox_interval_s = {every}
search_interval_s = 0
refind_interval_s = {every}
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "template"
""")
    os.chmod(path, 0o600)
    return path


@dataclass
class Harness:
    """A running sim, a daemon serving the API, and what tests need to drive them."""

    world: World
    sim: SimServer
    bot: Account
    daemon: Daemon
    url: str
    config: Path
    db: Path

    @property
    def instance(self) -> str:
        """The bot's platform instance (first part of the key)."""
        return f"mastodon:{self.sim.base_url}"

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        """An HTTP client for the API, with the bearer token unless ``token`` is None."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def parent(self, text: str = "hello bot, a question?") -> str:
        """Post a parent mentioning the bot as a simulated user; return its id."""
        if self.world.find_account("alice") is None:
            self.world.add_account("alice")
        status = self.world.post("alice", text, mention=[BOT])
        wait_visible(self.world, status)
        return status.id

    def bot_replies(self, parent_id: str) -> int:
        """How many replies by the bot exist on the sim under ``parent_id``."""
        return self.world.replies_by(self.bot.id).get(parent_id, 0)

    def bot_statuses(self) -> int:
        """How many statuses the bot has on the sim (the ground truth for "nothing sent")."""
        return self.world.statuses_count(self.bot.id)


def wait_visible(world: World, status, timeout_s: float = 10.0) -> None:
    """Wait out the sim's listing delay, so the parent resolves by id (the delay is real time)."""
    end = time.monotonic() + timeout_s
    while not world.can_see(status, None) and time.monotonic() < end:
        time.sleep(0.02)


@contextmanager
def sim_world(monkeypatch, **knobs) -> Iterator[tuple[World, SimServer, Account]]:
    """A sim served from this process with the bot account; SIM_TOKEN set for the daemon."""
    world = World(SystemClock(), seed=11, **{"listing_delay_s": 0.1, **knobs})
    bot = world.add_account(BOT, bot=True)
    with SimServer(world) as srv:
        monkeypatch.setenv("SIM_TOKEN", bot.token)
        yield world, srv, bot


@contextmanager
def running(tmp_path: Path, monkeypatch, *, token: str | None = TOKEN, host: str = "127.0.0.1",
            pollers: bool = False, api_extra: str = "", send_timeout_s: float = 1.0, **knobs) -> Iterator[Harness]:
    """Start the sim and a daemon with the API on an ephemeral port; stop both afterwards.
    ``send_timeout_s`` as ``write_config``'s: a test whose sends must land under load sets it above 3 s."""
    if token:
        monkeypatch.setenv(TOKEN_ENV, token)
    else:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
    with sim_world(monkeypatch, **knobs) as (world, srv, bot):
        db = tmp_path / "replyd.sqlite3"
        cfg_path = write_config(tmp_path / "replyd.toml", srv.base_url, db, host=host,
                                token_env=TOKEN_ENV if token else None, pollers=pollers, api_extra=api_extra,
                                send_timeout_s=send_timeout_s)
        d = Daemon(Config.load(cfg_path))
        d.start()
        try:
            assert d.api is not None
            yield Harness(world, srv, bot, d, d.api.url, cfg_path, db)
        finally:
            d.stop(grace_s=5)


def replyd_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m replyd ARGS`` in a subprocess and capture its output."""
    return subprocess.run([sys.executable, "-m", "replyd", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})},
                          timeout=timeout)
