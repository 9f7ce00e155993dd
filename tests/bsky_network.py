"""The real Bluesky reference network (@atproto/dev-env) for the Bluesky behaviour tests.

``bsky_network`` (session scope) creates a fresh PostgreSQL database, starts
``node tests/bsky/network.mjs`` (PLC, PDS, AppView, Ozone in one process),
waits for its one JSON line, creates the accounts (the bot, with an app
password, and a few people), yields a :class:`BskyNetwork`, and at the end
stops the process (stdin closed + SIGTERM) and drops the database.

When ``tests/bsky/node_modules`` is missing (``make bsky-deps``), or node,
PostgreSQL or Redis is unreachable, the tests are skipped locally with the
reason, and FAIL when ``CI=true``.

``tests/conftest.py`` imports the fixture, so one network serves every module of a session (a module that
imported it again would get a network of its own); on xdist workers every test that uses it is in the ``bsky``
group (``SERVER_GROUPS`` there), which runs on one worker: one network per run.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

BSKY_DIR = Path(__file__).resolve().parent / "bsky"
PG_HOST = os.environ.get("REPLYD_BSKY_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("REPLYD_BSKY_PG_PORT", "5432"))
PG_USER = os.environ.get("REPLYD_BSKY_PG_USER", "root")
REDIS_HOST = os.environ.get("REDIS_HOST", "127.0.0.1:6379")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
START_TIMEOUT_S = 120.0

BOT_HANDLE = "replybot.test"
PEOPLE = ("alice.test", "bob.test", "carol.test")


def _redis_ping(hostport: str) -> str | None:
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port or 6379)), timeout=3) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if reply.startswith(b"+PONG") else f"unexpected reply {reply!r}"


def _pg_admin():
    import psycopg

    return psycopg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres", autocommit=True,
                           connect_timeout=3)


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class Account:
    """One account on the dev-env PDS (the password is the login password, not an app password)."""

    handle: str
    did: str
    password: str
    access: str = field(repr=False, default="")


@dataclass
class BskyNetwork:
    """URLs and accounts of the running network, with a raw XRPC client for the people's side."""

    pds: str
    bsky: str
    plc: str
    appview_did: str
    bot: Account
    bot_app_password: str
    people: dict[str, Account]
    http: httpx.Client
    startup_ms: int = 0

    @property
    def proxy(self) -> str:
        """The ``atproto-proxy`` header value of the dev-env AppView."""
        return f"{self.appview_did}#bsky_appview"

    def xrpc(self, method: str, nsid: str, *, who: Account | None = None, proxy: bool = False,
             params: Any = None, body: Any = None, base: str | None = None) -> httpx.Response:
        """One raw XRPC call (people's actions and test-side reads; never the adapter under test)."""
        headers = {}
        if who is not None:
            headers["authorization"] = f"Bearer {who.access}"
        if proxy:
            headers["atproto-proxy"] = self.proxy
        return self.http.request(method, f"{base or self.pds}/xrpc/{nsid}", headers=headers, params=params,
                                 json=body, timeout=30)

    def post(self, who: Account, text: str, *, reply_to: dict[str, Any] | None = None,
             mention: Account | None = None) -> dict[str, str]:
        """``who`` posts ``text`` (optionally mentioning an account, optionally as a reply); returns uri/cid."""
        record: dict[str, Any] = {"$type": "app.bsky.feed.post", "text": text, "createdAt": _now_iso()}
        if mention is not None:
            tag = f"@{mention.handle}"
            if tag not in text:
                text = f"{tag} {text}"
                record["text"] = text
            start = len(text[: text.index(tag)].encode())
            record["facets"] = [{
                "index": {"byteStart": start, "byteEnd": start + len(tag.encode())},
                "features": [{"$type": "app.bsky.richtext.facet#mention", "did": mention.did}],
            }]
        if reply_to is not None:
            record["reply"] = reply_to
        resp = self.xrpc("POST", "com.atproto.repo.createRecord", who=who,
                         body={"repo": who.did, "collection": "app.bsky.feed.post", "record": record})
        resp.raise_for_status()
        out = resp.json()
        return {"uri": out["uri"], "cid": out["cid"]}

    def reply_refs(self, root: dict[str, str], parent: dict[str, str]) -> dict[str, Any]:
        """A ``reply`` object for a person's reply."""
        return {"root": dict(root), "parent": dict(parent)}

    def thread(self, uri: str, depth: int = 10) -> dict[str, Any]:
        """``getPostThread`` from the AppView, as a person sees it."""
        resp = self.xrpc("GET", "app.bsky.feed.getPostThread", who=self.people["alice.test"], proxy=True,
                         params={"uri": uri, "depth": depth})
        resp.raise_for_status()
        return resp.json()["thread"]

    def replies_by(self, uri: str, did: str) -> list[dict[str, Any]]:
        """Direct replies to ``uri`` authored by ``did``, read from the AppView (getPostThread)."""
        thread = self.thread(uri, depth=1)
        return [r["post"] for r in thread.get("replies", [])
                if "post" in r and r["post"]["author"]["did"] == did
                and r["post"]["record"].get("reply", {}).get("parent", {}).get("uri") == uri]

    def wait_replies_by(self, uri: str, did: str, *, at_least: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Poll the AppView until ``did`` has ``at_least`` replies under ``uri`` (or time runs out)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.replies_by(uri, did)
            if len(got) >= at_least or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def settle(self, seconds: float = 1.0) -> None:
        """Give the AppView's firehose indexer time to catch up (it indexes asynchronously)."""
        time.sleep(seconds)

    def wait_indexed(self, uri: str, timeout: float = 10.0) -> None:
        """Poll the AppView until it serves the post ``uri``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            resp = self.xrpc("GET", "app.bsky.feed.getPosts", who=self.people["alice.test"], proxy=True,
                             params={"uris": uri})
            if resp.status_code == 200 and resp.json().get("posts"):
                return
            time.sleep(0.05)
        raise AssertionError(f"the AppView did not index {uri} within {timeout}s")


class _Process:
    """The node process; its stdout is drained by a thread (the ready line is picked out), stderr goes to a log."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self._ready: queue.Queue[dict[str, Any]] = queue.Queue()
        self.proc = subprocess.Popen(
            ["node", "network.mjs"], cwd=BSKY_DIR, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            start_new_session=True,
        )
        self._drain = threading.Thread(target=self._read_stdout, name="bsky-network-stdout", daemon=True)
        self._drain.start()

    def _read_stdout(self) -> None:
        # Keep reading to the end: a full pipe would block the network's event loop.
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                data = json.loads(line)
            except ValueError:
                data = None
            if isinstance(data, dict) and data.get("ready") is True:
                self._ready.put(data)
            else:
                try:
                    self._log.write(line)
                except ValueError:  # the log was closed at stop
                    return

    def ready_line(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self._ready.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        code = self.proc.poll()
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"network.mjs not ready within {timeout}s (exit code {code}); log tail:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._drain.join(timeout=5)
        self._log.close()


def _create_account(http: httpx.Client, pds: str, handle: str) -> Account:
    password = f"pw-{uuid.uuid4().hex}"
    resp = http.post(f"{pds}/xrpc/com.atproto.server.createAccount", timeout=30,
                     json={"handle": handle, "email": f"{handle}@example.com", "password": password})
    if resp.status_code != 200:
        raise RuntimeError(f"createAccount {handle}: HTTP {resp.status_code} {resp.text[:300]}")
    body = resp.json()
    return Account(handle=handle, did=body["did"], password=password, access=body["accessJwt"])


class NetworkUnavailable(RuntimeError):
    """node_modules, node, PostgreSQL or Redis is missing: the network cannot start here."""


def check_prerequisites() -> None:
    """Raise ``NetworkUnavailable`` saying what is missing."""
    if not (BSKY_DIR / "node_modules" / "@atproto" / "dev-env").is_dir():
        raise NetworkUnavailable(f"{BSKY_DIR}/node_modules is missing: run `make bsky-deps`")
    if shutil.which("node") is None:
        raise NetworkUnavailable("node is not on PATH")
    why = _redis_ping(REDIS_HOST)
    if why:
        raise NetworkUnavailable(f"Redis unreachable at {REDIS_HOST}: {why}")
    try:
        _pg_admin().close()
    except Exception as exc:  # any failure means "not reachable"
        raise NetworkUnavailable(
            f"PostgreSQL unreachable at {PG_USER}@{PG_HOST}:{PG_PORT}: {type(exc).__name__}: {exc}"
        ) from None


@contextmanager
def start_network(log_dir: Path) -> Iterator[BskyNetwork]:
    """Start the network on a fresh database, create the accounts; stop it and drop the database after."""
    check_prerequisites()
    admin = _pg_admin()
    dbname = f"replyd_bsky_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{dbname}"')
    env = {
        **os.environ,
        "DB_POSTGRES_URL": f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{dbname}",
        "DB_POSTGRES_SCHEMA": "replyd",
        "REDIS_HOST": REDIS_HOST,
        "LOG_ENABLED": "false",
    }
    proc = _Process(env, log_dir / "network.log")
    http = httpx.Client(trust_env=False)
    try:
        info = proc.ready_line(START_TIMEOUT_S)
        pds = info["pds"]
        bot = _create_account(http, pds, BOT_HANDLE)
        people = {h: _create_account(http, pds, h) for h in PEOPLE}
        resp = http.post(f"{pds}/xrpc/com.atproto.server.createAppPassword", timeout=30,
                         headers={"authorization": f"Bearer {bot.access}"}, json={"name": "replyd-tests"})
        resp.raise_for_status()
        yield BskyNetwork(
            pds=pds, bsky=info["bsky"], plc=info["plc"], appview_did=info["appview_did"], bot=bot,
            bot_app_password=resp.json()["password"], people=people, http=http,
            startup_ms=int(info.get("startup_ms", 0)),
        )
    finally:
        http.close()
        proc.stop()
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (dbname,),
            )
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
        finally:
            admin.close()


@pytest.fixture(scope="session")
def bsky_network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BskyNetwork]:
    """The dev-env network with a bot (app password) and three people; torn down at session end.

    Skipped locally when it cannot start here; a failure under ``CI=true``.
    """
    try:
        check_prerequisites()
    except NetworkUnavailable as exc:
        if IN_CI:
            pytest.fail(f"the Bluesky dev-env network is required under CI=true: {exc}")
        pytest.skip(f"Bluesky dev-env network unavailable: {exc}")
    with start_network(tmp_path_factory.mktemp("bsky")) as net:
        yield net


def crash_before_close(settings: dict[str, Any], store_url: str, parent: dict[str, Any], text: str) -> None:
    """Child-process worker: post through the guard, SIGKILL itself after the send returned, before the close."""
    from replyd.clock import SystemClock
    from replyd.guard import Guard
    from replyd.platforms.base import Parent
    from replyd.platforms.bluesky import BlueskyPlatform
    from replyd.store import Store

    class CrashingGuard(Guard):
        def _close(self, *args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

    with httpx.Client(trust_env=False) as http:
        platform = BlueskyPlatform.from_settings(settings, http=http, clock=SystemClock())
        store = Store.open(store_url)
        guard = CrashingGuard(store, platform, platform.whoami())
        guard.post(Parent.from_snapshot(parent), text, path="inbox")
