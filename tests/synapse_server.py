"""A real Synapse homeserver for the Matrix tests, started once per test session.

``synapse`` (session scope) writes its own ``homeserver.yaml`` (SQLite, one
client listener on a free 127.0.0.1 port, no federation, rate limits raised
far above what the tests send, a fresh signing key and shared secret) into a
temporary directory, starts ``python -m synapse.app.homeserver``, waits for
``/_matrix/client/versions``, registers a bot and three people with the
shared secret, and yields a :class:`Synapse`. Rooms are created by the tests.

:class:`DropProxy` sits between an adapter and the homeserver to lose the
answers of sends that Synapse did carry out, or hide events from ``/messages``.

When ``matrix-synapse`` is not installed or the server does not come up, the
tests are skipped locally with the reason, and FAIL when ``CI=true``.

The fixture is imported by tests/conftest.py, so every module shares the one
server (a session fixture imported into two modules would start two); on xdist workers every test that
uses it is in the ``synapse`` group (``SERVER_GROUPS`` there), which runs on one worker: one server per run.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SERVER_NAME = "replyd.test"
START_TIMEOUT_S = 120.0
BOT = "replybot"
PEOPLE = ("alice", "bob", "carol")
# Far above anything a test sends, so no test meets Synapse's default 0.2 messages/s.
_NO_LIMIT = {"per_second": 10000, "burst_count": 100000}


@dataclass
class User:
    """One account on the homeserver with its access token (from shared-secret registration)."""

    localpart: str
    user_id: str
    token: str = field(repr=False)
    device_id: str = ""
    password: str = field(repr=False, default="")


@dataclass
class Synapse:
    """The running homeserver: URL, accounts, and a raw client-server API client for the people's side."""

    base_url: str
    bot: User
    people: dict[str, User]
    directory: Path
    http: httpx.Client
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    log_path: Path = field(default_factory=Path)
    shared_secret: str = field(repr=False, default="")

    def register(self, localpart: str) -> User:
        """Register one more account (a bot of its own for a test that must see no other room)."""
        return register(self.http, self.base_url, self.shared_secret, localpart)

    # --- raw client-server API (people's actions and test-side reads, never the adapter under test) ---

    def api(self, method: str, path: str, who: User, *, json_body: Any = None,
            params: Any = None) -> dict[str, Any]:
        """One raw request as ``who``; raises on a non-2xx answer; returns the JSON body."""
        resp = self.http.request(method, f"{self.base_url}/_matrix/client/v3{path}", json=json_body, params=params,
                                 headers={"authorization": f"Bearer {who.token}"}, timeout=30)
        if resp.status_code >= 300:
            raise AssertionError(f"{method} {path} as {who.localpart}: HTTP {resp.status_code} {resp.text[:300]}")
        return resp.json()

    def create_room(self, owner: User, *, invite_bot: bool = True, bot_joins: bool = True,
                    others: tuple[User, ...] = ()) -> str:
        """``owner`` creates a private room, invites the bot (and ``others``) who join; returns the room id."""
        invite = ([self.bot.user_id] if invite_bot else []) + [u.user_id for u in others]
        body = self.api("POST", "/createRoom", owner, json_body={"preset": "private_chat", "invite": invite})
        room_id = body["room_id"]
        for u in others + ((self.bot,) if invite_bot and bot_joins else ()):
            self.api("POST", f"/rooms/{quote(room_id, safe='')}/join", u, json_body={})
        return room_id

    def say(self, who: User, room_id: str, body: str, *, mention_bot: bool = True,
            reply_to: str | None = None, thread_root: str | None = None, use_mentions: bool = True) -> str:
        """``who`` sends an ``m.text`` to the room (mentioning the bot); returns the event id."""
        content: dict[str, Any] = {"msgtype": "m.text", "body": body}
        if mention_bot and use_mentions:
            content["m.mentions"] = {"user_ids": [self.bot.user_id]}
        relates: dict[str, Any] = {}
        if thread_root is not None:
            relates = {"rel_type": "m.thread", "event_id": thread_root, "is_falling_back": reply_to is None}
        if reply_to is not None or thread_root is not None:
            relates["m.in_reply_to"] = {"event_id": reply_to or thread_root}
        if relates:
            content["m.relates_to"] = relates
        txn = uuid.uuid4().hex
        path = f"/rooms/{quote(room_id, safe='')}/send/m.room.message/{txn}"
        return self.api("PUT", path, who, json_body=content)["event_id"]

    def messages(self, room_id: str, who: User, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Every ``m.room.message`` in the room as ``who`` reads it, oldest first (the platform-side count)."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        filt = json.dumps({"types": ["m.room.message"]})
        while True:
            params = {"dir": "b", "limit": str(min(limit, 1000)), "filter": filt}
            if token:
                params["from"] = token
            body = self.api("GET", f"/rooms/{quote(room_id, safe='')}/messages", who, params=params)
            out.extend(body.get("chunk", []))
            token = body.get("end")
            if not token or not body.get("chunk"):
                return list(reversed(out))

    def replies_by(self, room_id: str, sender: str, who: User) -> dict[str, list[str]]:
        """``{parent event id: [reply event ids]}`` of ``sender``'s replies in the room, read as ``who``."""
        per: dict[str, list[str]] = {}
        for ev in self.messages(room_id, who):
            relates = (ev.get("content") or {}).get("m.relates_to") or {}
            if ev.get("sender") != sender or relates.get("rel_type") == "m.replace":
                continue  # an edit replaces a reply's text; it is no reply (spec: event replacements)
            parent = relates.get("m.in_reply_to", {}).get("event_id")
            if parent:
                per.setdefault(parent, []).append(ev["event_id"])
        return per

    def edits(self, room_id: str, event_id: str, who: User) -> list[dict[str, Any]]:
        """The replacement events (``m.replace``) of ``event_id`` as ``who`` reads them (``/relations``), oldest first."""
        path = f"/_matrix/client/v1/rooms/{quote(room_id, safe='')}/relations/{quote(event_id, safe='')}/m.replace"
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            params = {"dir": "f", "limit": "100", **({"from": token} if token else {})}
            resp = self.http.get(self.base_url + path, params=params, headers={"authorization": f"Bearer {who.token}"},
                                 timeout=30)
            if resp.status_code >= 300:
                raise AssertionError(f"GET relations as {who.localpart}: HTTP {resp.status_code} {resp.text[:300]}")
            body = resp.json()
            out.extend(body.get("chunk", []))
            token = body.get("next_batch")
            if not token:
                return out

    def reply_text(self, room_id: str, event_id: str, who: User) -> str:
        """The text ``who`` sees for ``event_id``: the body of its most recent valid replacement's ``m.new_content``
        (spec, "Event replacements": same sender and type, ``m.new_content`` present; latest ``origin_server_ts``,
        ties by the largest event id), else the event's own body."""
        original = self.api("GET", f"/rooms/{quote(room_id, safe='')}/event/{quote(event_id, safe='')}", who)
        valid = [e for e in self.edits(room_id, event_id, who)
                 if e.get("sender") == original.get("sender") and e.get("type") == original.get("type")
                 and isinstance((e.get("content") or {}).get("m.new_content"), dict)]
        if not valid:
            return str((original.get("content") or {}).get("body", ""))
        latest = max(valid, key=lambda e: (e.get("origin_server_ts", 0), e.get("event_id", "")))
        return str(latest["content"]["m.new_content"].get("body", ""))

    # --- lifecycle -----------------------------------------------------------------------

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the homeserver process (SIGTERM: graceful; SIGKILL: a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def start(self) -> None:
        """Start (or restart) the homeserver on its config and data; wait until it answers."""
        started = time.monotonic()
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "synapse.app.homeserver", "-c", str(self.directory / "homeserver.yaml")],
            cwd=self.directory, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "SYNAPSE_NO_TLS": "1"},
        )
        log.close()
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"synapse exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if self.http.get(f"{self.base_url}/_matrix/client/versions", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - started
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"synapse did not answer within {START_TIMEOUT_S:.0f}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        """The end of the homeserver's log, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def _body(h: BaseHTTPRequestHandler) -> bytes:
    length = int(h.headers.get("content-length") or 0)
    return h.rfile.read(length) if length else b""


def _hop_headers(h: BaseHTTPRequestHandler) -> dict[str, str]:
    """The request's headers minus those that describe this hop, not the request."""
    return {k: v for k, v in h.headers.items()
            if k.lower() not in ("host", "content-length", "connection", "accept-encoding")}


class _Forward(BaseHTTPRequestHandler):
    """Hands every request to the :class:`DropProxy` that owns the server."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        """Keep the test output quiet."""

    def forward(self) -> None:
        """Let the proxy forward, drop or rewrite this request."""
        self.server.proxy._handle(self)  # type: ignore[attr-defined]

    do_GET = do_POST = do_PUT = forward


class DropProxy:
    """An HTTP proxy to Synapse that can forward the next ``drop_sends`` sends and hang up unanswered."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client = httpx.Client(trust_env=False, timeout=60)
        self.drop_sends = 0
        self.drop_every = 0  # > 0: also lose the answer of every n-th send
        self.dropped = 0
        self.forwarded_sends: list[int] = []  # Synapse's status for each send it got
        self.hide: set[str] = set()  # event ids /messages must not show yet (a lagging listing)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Forward)
        self.server.proxy = self  # type: ignore[attr-defined]
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        """Base URL of the proxy."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        resp = self.client.request(h.command, self.upstream + h.path, headers=_hop_headers(h), content=_body(h))
        is_send = h.command == "PUT" and "/send/m.room.message/" in h.path
        if is_send:
            self.forwarded_sends.append(resp.status_code)
            nth = len(self.forwarded_sends)
            if self.drop_sends > 0 or (self.drop_every and nth % self.drop_every == 0):
                self.drop_sends = max(0, self.drop_sends - 1)
                self.dropped += 1
                h.close_connection = True  # the event exists; its answer is lost
                return
        content = resp.content
        if self.hide and h.command == "GET" and "/messages" in h.path and resp.status_code == 200:
            body = resp.json()
            body["chunk"] = [e for e in body.get("chunk", []) if e.get("event_id") not in self.hide]
            content = json.dumps(body).encode()
        h.send_response(resp.status_code)
        for k, v in resp.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                h.send_header(k, v)
        h.send_header("content-length", str(len(content)))
        h.end_headers()
        h.wfile.write(content)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, port: int, shared_secret: str) -> Path:
    """Write homeserver.yaml, its logging config and a fresh signing key into ``directory``."""
    import yaml
    from signedjson.key import generate_signing_key, write_signing_keys

    with (directory / "signing.key").open("w") as f:
        write_signing_keys(f, [generate_signing_key("a_test")])
    (directory / "log.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(directory / "homeserver.log"),
                              "formatter": "plain"}},
        "root": {"level": "WARNING", "handlers": ["file"]},
        "disable_existing_loggers": False,
    }))
    limits = {
        "rc_message": _NO_LIMIT, "rc_registration": _NO_LIMIT, "rc_admin_redaction": _NO_LIMIT,
        "rc_login": {"address": _NO_LIMIT, "account": _NO_LIMIT, "failed_attempts": _NO_LIMIT},
        "rc_joins": {"local": _NO_LIMIT, "remote": _NO_LIMIT},
        "rc_invites": {"per_room": _NO_LIMIT, "per_user": _NO_LIMIT, "per_issuer": _NO_LIMIT},
        "rc_room_creation": _NO_LIMIT,
    }
    config = {
        "server_name": SERVER_NAME,
        "pid_file": str(directory / "homeserver.pid"),
        "listeners": [{"port": port, "bind_addresses": ["127.0.0.1"], "type": "http", "tls": False,
                       "x_forwarded": False, "resources": [{"names": ["client"], "compress": False}]}],
        "database": {"name": "sqlite3", "args": {"database": str(directory / "homeserver.db")}},
        "log_config": str(directory / "log.yaml"),
        "media_store_path": str(directory / "media"),
        "signing_key_path": str(directory / "signing.key"),
        "registration_shared_secret": shared_secret,
        "macaroon_secret_key": secrets.token_hex(16),
        "form_secret": secrets.token_hex(16),
        "report_stats": False,
        "enable_metrics": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "federation_domain_whitelist": [],
        "presence": {"enabled": False},
        "url_preview_enabled": False,
        "enable_search": True,
        "bcrypt_rounds": 4,  # the default 12 costs ~1 s per registration or login on a loaded machine
        **limits,
    }
    path = directory / "homeserver.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def register(http: httpx.Client, base_url: str, shared_secret: str, localpart: str, *, admin: bool = False) -> User:
    """Register ``localpart`` through the shared-secret admin API (nonce + HMAC-SHA1)."""
    url = f"{base_url}/_synapse/admin/v1/register"
    nonce = http.get(url, timeout=30).json()["nonce"]
    password = secrets.token_hex(12)
    mac = hmac.new(shared_secret.encode(), digestmod=hashlib.sha1)
    mac.update(b"\x00".join([nonce.encode(), localpart.encode(), password.encode(),
                             b"admin" if admin else b"notadmin"]))
    resp = http.post(url, json={"nonce": nonce, "username": localpart, "password": password, "admin": admin,
                                "mac": mac.hexdigest()}, timeout=30)
    if resp.status_code != 200:
        raise RuntimeError(f"registering {localpart}: HTTP {resp.status_code} {resp.text[:300]}")
    body = resp.json()
    return User(localpart, body["user_id"], body["access_token"], body.get("device_id", ""), password)


def _unavailable(why: str) -> None:
    if IN_CI:
        pytest.fail(f"Synapse is required under CI=true but {why}")
    pytest.skip(f"Synapse homeserver not available ({why}); `make install` installs matrix-synapse")


@contextmanager
def start_synapse(directory: Path | None = None) -> Iterator[Synapse]:
    """Start a homeserver in ``directory`` (a new temp dir by default), register the accounts; stop it after.

    Raises ``RuntimeError`` saying why when it cannot start.
    """
    if importlib.util.find_spec("synapse") is None:
        raise RuntimeError("the matrix-synapse package is not installed")
    own_dir = directory is None
    directory = directory or Path(tempfile.mkdtemp(prefix="replyd-synapse-"))
    shared_secret = secrets.token_hex(16)
    port = _free_port()
    write_config(directory, port, shared_secret)
    http = httpx.Client(trust_env=False)
    server = Synapse(base_url=f"http://127.0.0.1:{port}", bot=None, people={}, directory=directory,  # type: ignore[arg-type]
                     http=http, log_path=directory / "stdout.log", shared_secret=shared_secret)
    try:
        server.start()
        server.bot = register(http, server.base_url, shared_secret, BOT)
        server.people = {p: register(http, server.base_url, shared_secret, p) for p in PEOPLE}
        yield server
    finally:
        server.stop()
        http.close()
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def synapse() -> Iterator[Synapse]:
    """A running Synapse with a bot and three people registered; stopped at the end of the session."""
    try:
        cm = start_synapse()
        server = cm.__enter__()
    except RuntimeError as exc:
        _unavailable(str(exc).splitlines()[0][:500])
    print(f"\nsynapse: started in {server.startup_s:.1f}s at {server.base_url} ({server.directory})", file=sys.stderr)
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)
