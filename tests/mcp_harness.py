"""Shared setup for the MCP tests: a sim, a config, and ``replyd mcp`` subprocesses driven by the SDK's client."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from replyd.sim import SimServer, World
from replyd.sim.world import Account
from tests.api_harness import BOT, ROOT, sim_world, wait_visible, write_config

MCP_TOKEN = "mcp-test-token-7f3a2b9c"
MCP_TOKEN_ENV = "REPLYD_TEST_MCP_TOKEN"
OTHER = "otherbot"  # the second bot's account on the sim (configured as bot "other")
OTHER_TOKEN = "mcp-test-token-b-91c0d4e2"  # a second MCP bearer token ([[mcp.tokens]] in scope tests)
OTHER_TOKEN_ENV = "REPLYD_TEST_MCP_TOKEN_B"
T = TypeVar("T")


@dataclass
class McpEnv:
    """A running sim, a config for ``replyd mcp`` on it, and the environment its processes get."""

    world: World
    sim: SimServer
    bot: Account
    config: Path
    db: Path
    env: dict[str, str]
    servers: list[McpHttp] = field(default_factory=list)
    other: Account | None = None  # the second bot's account, when the config has one

    @property
    def instance(self) -> str:
        """The bot's platform instance (first part of the key)."""
        return f"mastodon:{self.sim.base_url}"

    def parent(self, text: str = "hello bot, a question?", author: str = "alice") -> str:
        """Post a parent mentioning the bot; return its id once the sim lists it."""
        if self.world.find_account(author) is None:
            self.world.add_account(author)
        status = self.world.post(author, text, mention=[BOT])
        wait_visible(self.world, status)
        return status.id

    def replies(self, parent_id: str) -> int:
        """How many replies by the bot the sim holds under ``parent_id`` (the ground truth)."""
        return self.world.replies_by(self.bot.id).get(parent_id, 0)

    def other_replies(self) -> int:
        """How many replies the second bot's account holds on the sim, under any parent."""
        assert self.other is not None
        return sum(self.world.replies_by(self.other.id).values())

    def post(self, author: str, text: str, *, mention: tuple[str, ...] = (), **kw: Any) -> str:
        """Post as ``author`` (created on first use) mentioning ``mention``; return the id once the sim lists it."""
        if self.world.find_account(author) is None:
            self.world.add_account(author)
        status = self.world.post(author, text, mention=list(mention), **kw)
        wait_visible(self.world, status)
        return status.id

    def stdio(self, **env: str) -> Client:
        """An SDK client that starts ``replyd mcp`` over stdio as its own subprocess."""
        params = StdioServerParameters(command=sys.executable, args=["-m", "replyd", "mcp", "--config", str(self.config)],
                                       env={**self.env, **env}, cwd=str(ROOT))
        return Client(params, read_timeout_seconds=60)

    @contextmanager
    def http_server(self, **env: str) -> Iterator[McpHttp]:
        """Start ``replyd mcp --transport http`` on an ephemeral port; stop it afterwards."""
        srv = McpHttp([sys.executable, "-m", "replyd", "mcp", "--transport", "http", "--port", "0",
                       "--config", str(self.config)], {**self.env, **env})
        try:
            yield srv.start()
        finally:
            srv.stop()


@asynccontextmanager
async def http_client(url: str, token: str | None = MCP_TOKEN, mode: str = "auto") -> AsyncIterator[Client]:
    """An SDK client session over streamable HTTP with the bearer token (none when ``token`` is None); ``mode``
    "legacy" forces the initialize handshake (a transport session, ``mcp-session-id``), "auto" lets it negotiate."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0)) as http:
        async with Client(streamable_http_client(url, http_client=http), read_timeout_seconds=60,
                          mode=mode) as client:
            yield client


class McpHttp:
    """One ``replyd mcp`` HTTP server process; ``url`` is read from its "listening on" line."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.env = env
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self.stderr: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self, timeout_s: float = 60.0) -> McpHttp:
        """Start the process and wait for its URL."""
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._drain, daemon=True).start()
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"replyd mcp did not listen within {timeout_s} s: {self.stderr}") from None
            if line is None:
                raise AssertionError(f"replyd mcp exited ({self.proc.wait()}): {''.join(self.stderr)}")
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
                return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def kill(self) -> None:
        """SIGKILL the server: every session and lease it held dies with it, mid-call."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 10 s); the server's log goes to stderr, which pytest shows on failure."""
        if self.proc is None:
            return
        sys.stderr.write(f"--- replyd mcp {self.url or '(not listening)'} stderr ---\n{''.join(self.stderr)}")
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def mcp_env(tmp_path: Path, monkeypatch: Any, *, second_bot: bool = False, mcp_extra: str = "",
            **knobs: Any) -> Iterator[McpEnv]:
    """A sim and a config whose ``[mcp]`` section names the test token; the env carries every secret it needs.

    ``second_bot`` adds bot "other" (the sim account ``OTHER``); ``mcp_extra`` is TOML appended to ``[mcp]``
    (keys first, then any ``[[mcp.tokens]]``), with ``OTHER_TOKEN`` in ``$OTHER_TOKEN_ENV``.
    """
    with sim_world(monkeypatch, **knobs) as (world, srv, bot):
        db = tmp_path / "replyd.sqlite3"
        cfg = write_config(tmp_path / "replyd.toml", srv.base_url, db, api=False, token_env=None,
                           send_timeout_s=10.0)
        other = world.add_account(OTHER, bot=True) if second_bot else None
        with cfg.open("a") as fh:
            if other is not None:
                fh.write(f"""
[[bots]]
name = "other"
platform = "mastodon"

[bots.settings]
base_url = "{srv.base_url}"
token_env = "OTHER_SIM_TOKEN"
listing_delay_s = 0.2
timeout_s = 3.0

[bots.pollers]
inbox_interval_s = 0
search_interval_s = 0
refind_interval_s = 0
""")
            fh.write(f'\n[mcp]\ntoken_env = "{MCP_TOKEN_ENV}"\nport = 0\n{mcp_extra}\n')
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN": bot.token, MCP_TOKEN_ENV: MCP_TOKEN,
               OTHER_TOKEN_ENV: OTHER_TOKEN, **({"OTHER_SIM_TOKEN": other.token} if other else {})}
        yield McpEnv(world, srv, bot, cfg, db, env, other=other)


async def race(makers: list[Callable[[], AbstractAsyncContextManager[Client] | Client]], call: Callable[[Client], Awaitable[T]],
               timeout_s: float = 180.0) -> list[T]:
    """Connect every session first, then let all of them ``call`` at once; return the results."""
    results: list[T] = []
    connected = 0
    go = anyio.Event()

    async def one(i: int, make: Callable[[], AbstractAsyncContextManager[Client] | Client]) -> None:
        nonlocal connected
        try:
            async with make() as client:
                connected += 1
                if connected == len(makers):
                    go.set()
                await go.wait()
                results.append(await call(client))
        except Exception as exc:
            exc.add_note(f"session {i} of {len(makers)} ({'connected' if go.is_set() else 'connecting'})")
            raise

    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            for i, make in enumerate(makers):
                tg.start_soon(one, i, make)
    return results


async def tool(client: Client, name: str, **args: Any) -> dict[str, Any]:
    """Call a tool that must succeed; return its structured result."""
    r = await client.call_tool(name, args)
    assert not r.is_error, r.content[0].text
    assert r.structured_content is not None
    return r.structured_content


async def tool_error(client: Client, name: str, **args: Any) -> str:
    """Call a tool that must fail; return its one error line."""
    r = await client.call_tool(name, args)
    assert r.is_error, r.structured_content
    text = r.content[0].text
    assert "\n" not in text and "Traceback" not in text, text
    return text
