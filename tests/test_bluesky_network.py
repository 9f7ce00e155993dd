"""Exactly-once replies on the real Bluesky reference network (@atproto/dev-env: PDS, AppView, PLC).

People post through the PDS; the bot finds them through its inbox, search and
re-find; ``Guard.post`` answers; ``Sweeper`` bounds open rows. Replies are
counted by reading the AppView (``getPostThread``), never replyd's own log.
Faults are injected by a small HTTP proxy between the adapter and the PDS
(lost responses, a held request, a listing that lags): the PDS and AppView
themselves are real.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import multiprocessing as mp
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs

from tests.bsky_network import BskyNetwork, _create_account, crash_before_close
from replyd import store as st
from replyd.clock import FakeClock, SystemClock
from replyd.guard import Guard, Status
from replyd.platforms.base import Identity, Pending
from replyd.platforms.bluesky import POST_NSID, BlueskyPlatform, rkey_for
from replyd.store import Store
from replyd.sweep import Bot, Sweeper

pytestmark = pytest.mark.slow
CTX = mp.get_context("spawn")
SEND_TIMEOUT_S = 10.0


# --- a fault-injecting proxy in front of the PDS ------------------------------------------


class PdsProxy:
    """A small HTTP proxy to the PDS that can lose create answers, hold a create, or hide replies.

    - ``drop_creates = n``: forward the next n createRecord calls, then hang up
      without answering (the post landed, the answer was lost);
    - ``drop_record_reads = n``: hang up on the next n getRecord calls unanswered;
    - ``hold()``: keep the next createRecord until ``release()`` (the client
      times out first; the post lands later);
    - ``hide``: reply URIs that getRecord, getAuthorFeed and getPostThread must
      not show yet (a listing delay longer than the configured one).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client = httpx.Client(trust_env=False, timeout=60)
        self.drop_creates = 0
        self.drop_rate = 0.0  # also lose the answer of this fraction of creates (seeded: one run is repeatable)
        self._rng = random.Random(32)
        self.drop_record_reads = 0
        self.hide: set[str] = set()
        self.creates: list[int] = []  # the PDS's status for each forwarded createRecord
        self._hold: threading.Event | None = None
        self.held_done = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            def do_POST(self) -> None:
                proxy._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        """Base URL of the proxy."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def hold(self) -> None:
        """Hold the next createRecord until ``release``."""
        self._hold = threading.Event()
        self.held_done.clear()

    def release(self, timeout: float = 30.0) -> None:
        """Let the held createRecord through and wait until the PDS has answered it."""
        assert self._hold is not None
        self._hold.set()
        assert self.held_done.wait(timeout), "the held create never reached the PDS"

    def close(self) -> None:
        """Stop serving."""
        if self._hold is not None:
            self._hold.set()
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(length) if length else b""
        path = urlsplit(h.path).path
        nsid = path.removeprefix("/xrpc/")
        headers = {k: v for k, v in h.headers.items()
                   if k.lower() not in ("host", "content-length", "connection", "accept-encoding")}
        held = None
        if nsid == "com.atproto.repo.createRecord" and self._hold is not None and not self._hold.is_set():
            held = self._hold
            held.wait(60)
        if nsid == "com.atproto.repo.getRecord" and self.drop_record_reads > 0:
            self.drop_record_reads -= 1
            h.close_connection = True
            return None
        if self.hide and nsid == "com.atproto.repo.getRecord":
            q = parse_qs(urlsplit(h.path).query)
            uri = f"at://{q['repo'][0]}/{q['collection'][0]}/{q['rkey'][0]}"
            if uri in self.hide:
                return self._answer(h, 400, json.dumps({"error": "RecordNotFound",
                                                        "message": f"Could not locate record: {uri}"}).encode())
        resp = self.client.request(h.command, self.upstream + h.path, headers=headers, content=body)
        if nsid == "com.atproto.repo.createRecord":
            self.creates.append(resp.status_code)
            if held is not None:
                self.held_done.set()
                h.close_connection = True  # the client gave up long ago
                return None
            if self.drop_creates > 0 or (self.drop_rate and self._rng.random() < self.drop_rate):
                self.drop_creates = max(0, self.drop_creates - 1)
                h.close_connection = True  # the PDS wrote the post; its answer is lost
                return None
        content = resp.content
        if self.hide and resp.status_code == 200 and nsid in ("app.bsky.feed.getAuthorFeed",
                                                              "app.bsky.feed.getPostThread"):
            content = self._hidden(nsid, json.loads(content))
        return self._answer(h, resp.status_code, content, resp.headers.get("content-type", "application/json"))

    def _hidden(self, nsid: str, data: dict[str, Any]) -> bytes:
        if nsid == "app.bsky.feed.getAuthorFeed":
            data["feed"] = [i for i in data["feed"] if i.get("post", {}).get("uri") not in self.hide]
        else:
            thread = data["thread"]
            kept = [r for r in thread.get("replies", []) if r.get("post", {}).get("uri") not in self.hide]
            if "post" in thread:
                thread["post"]["replyCount"] -= len(thread.get("replies", [])) - len(kept)
            thread["replies"] = kept
        return json.dumps(data).encode()

    @staticmethod
    def _answer(h: BaseHTTPRequestHandler, status: int, content: bytes,
                ctype: str = "application/json; charset=utf-8") -> None:
        h.send_response(status)
        h.send_header("content-type", ctype)
        h.send_header("content-length", str(len(content)))
        h.end_headers()
        h.wfile.write(content)


# --- the bot's side --------------------------------------------------------------------------


@dataclass
class World:
    """One bot on the network: adapter, store (fake clock for the sweep schedule), guard, sweeper."""

    net: BskyNetwork
    http: httpx.Client
    store: Store
    clock: FakeClock
    platform: BlueskyPlatform
    me: Identity
    guard: Guard
    store_url: str

    def settings(self, service: str | None = None, **extra: Any) -> dict[str, Any]:
        """The bot's adapter settings (optionally through a proxy)."""
        return {"service": service or self.net.pds, "identifier": self.net.bot.handle,
                "app_password": self.net.bot_app_password, "appview_did": self.net.appview_did,
                "listing_delay_s": 2.0, **extra}

    def adapter(self, service: str | None = None, **extra: Any) -> BlueskyPlatform:
        """Another adapter for the same bot (same instance key), e.g. through a proxy."""
        return BlueskyPlatform.from_settings(self.settings(service, instance=self.platform.instance, **extra),
                                             http=self.http, clock=SystemClock())

    def guard_for(self, platform: BlueskyPlatform, cls: type[Guard] = Guard) -> Guard:
        """A guard on this store posting through ``platform``."""
        return cls(self.store, platform, self.me, clock=self.clock, send_timeout_s=SEND_TIMEOUT_S)

    def sweep(self, platform: BlueskyPlatform | None = None) -> Any:
        """Move the clock past every deadline and run one sweep pass."""
        self.clock.advance(SEND_TIMEOUT_S + 60)
        sweeper = Sweeper(self.store, [Bot(platform or self.platform, self.me)], clock=self.clock)
        return sweeper.run_once()

    def row(self, parent_id: str) -> st.Reply:
        """The answered-log row of ``parent_id``."""
        row = self.store.get(self.guard.key(parent_id))
        assert row is not None
        return row

    def expected_uri(self, parent_id: str) -> str:
        """Where the bot's reply to ``parent_id`` must be: its deterministic rkey."""
        return f"at://{self.me.sender_id}/{POST_NSID}/{rkey_for(self.me.sender_id, parent_id)}"

    def bot_replies(self, parent_id: str, at_least: int = 1) -> list[dict[str, Any]]:
        """The bot's replies under ``parent_id`` as the AppView shows them (waits for indexing)."""
        self.net.wait_replies_by(parent_id, self.me.sender_id, at_least=at_least)
        time.sleep(0.5)  # and a little longer, so a late second reply would show too
        return self.net.replies_by(parent_id, self.me.sender_id)


@pytest.fixture
def world(bsky_network: BskyNetwork, tmp_path: Any) -> Iterator[World]:
    """A fresh answered-log for the bot on the session's network."""
    net = bsky_network
    with httpx.Client(trust_env=False) as http:
        clock = FakeClock(SystemClock().now())
        url = f"sqlite:///{tmp_path / 'replyd.sqlite3'}"
        store = Store.open(url, clock=clock)
        platform = BlueskyPlatform.from_settings(
            {"service": net.pds, "identifier": net.bot.handle, "app_password": net.bot_app_password,
             "appview_did": net.appview_did, "listing_delay_s": 2.0},
            http=http, clock=SystemClock(),
        )
        me = platform.whoami()
        guard = Guard(store, platform, me, clock=clock, send_timeout_s=SEND_TIMEOUT_S)
        yield World(net, http, store, clock, platform, me, guard, url)
        store.dispose()


@pytest.fixture
def proxy(bsky_network: BskyNetwork) -> Iterator[PdsProxy]:
    """A fault-injecting proxy in front of the PDS."""
    p = PdsProxy(bsky_network.pds)
    yield p
    p.close()


def tag() -> str:
    """A word no other test uses."""
    return f"zq{uuid.uuid4().hex[:10]}"


def eventually(fn: Any, ok: Any, timeout: float = 10.0) -> Any:
    """Call ``fn`` until ``ok(result)`` (the AppView indexes asynchronously); return the last result."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if ok(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def mention(world: World, who: str, text: str) -> dict[str, str]:
    """``who`` mentions the bot; returns the post's uri/cid once the AppView indexed it."""
    post = world.net.post(world.net.people[who], text, mention=world.net.bot)
    world.net.wait_indexed(post["uri"])
    return post


# --- tests ---------------------------------------------------------------------------------


def test_network_and_identity(world: World) -> None:
    """The network started; the bot logs in with its app password and its sender id is its DID."""
    assert world.me.sender_id == world.net.bot.did and world.me.sender_id.startswith("did:plc:")
    assert world.me.handle == "replybot.test"
    assert world.platform.instance == f"bluesky:{world.net.pds}"


def test_three_paths_find_and_each_parent_is_answered_once(world: World) -> None:
    """Inbox, search, re-find and resolve find the posts; every parent gets exactly one reply."""
    net, w = world.net, tag()
    start = time.time() - 5
    asked = mention(world, "alice.test", f"what does {w} do?")
    searched = net.post(net.people["bob.test"], f"does anyone know {w}?")
    bot_post = net.post(net.bot, f"I answer questions about {w}")
    net.wait_indexed(bot_post["uri"])  # people reply to what they have seen (else no reply notification)
    replied = net.post(net.people["carol.test"], f"thanks, {w} again",
                       reply_to=net.reply_refs(bot_post, bot_post))
    for p in (searched, replied):
        net.wait_indexed(p["uri"])

    want = {asked["uri"], replied["uri"]}
    inbox = eventually(lambda: world.platform.inbox(None), lambda pg: want <= {p.id for p in pg.parents})
    found = eventually(lambda: world.platform.search(w, None), lambda pg: len(pg.parents) == 4)
    again = eventually(lambda: world.platform.refind(start), lambda ps: want <= {p.id for p in ps})
    resolved = world.platform.resolve(f"https://bsky.app/profile/bob.test/post/{searched['uri'].rsplit('/', 1)[1]}")
    ours = {asked["uri"], searched["uri"], replied["uri"]}
    assert {asked["uri"], replied["uri"]} <= {p.id for p in inbox.parents}
    # every post with the word, oldest first (the bot's own post too: the policy skips own posts)
    assert [p.id for p in found.parents] == [asked["uri"], searched["uri"], bot_post["uri"], replied["uri"]]
    assert {asked["uri"], replied["uri"]} <= {p.id for p in again}
    assert resolved.id == searched["uri"]
    by_reason = {p.id: p for p in inbox.parents}
    assert by_reason[replied["uri"]].extra["root_uri"] == bot_post["uri"]

    offered = [(p, "inbox") for p in inbox.parents] + [(p, "search") for p in found.parents] \
        + [(p, "refind") for p in again] + [(resolved, "api")]
    posted: dict[str, int] = {}
    for parent, path in offered:
        if parent.id not in ours:
            continue
        out = world.guard.post(parent, f"answer via {path}", path=path)
        assert out.status in (Status.POSTED, Status.ALREADY_ANSWERED), out
        if out.status is Status.POSTED:
            posted[parent.id] = posted.get(parent.id, 0) + 1
            assert out.reply_id == world.expected_uri(parent.id)
    assert posted == dict.fromkeys(ours, 1)
    for pid in ours:
        replies = world.bot_replies(pid)
        assert [r["uri"] for r in replies] == [world.expected_uri(pid)], pid
        assert world.row(pid).state == st.CLOSED
    # the next inbox poll, from the saved cursor, offers none of them again
    assert not ours & {p.id for p in world.platform.inbox(inbox.cursor).parents}


def test_second_post_reports_already_answered(world: World, tmp_path: Any) -> None:
    """A second Guard.post reports already answered; a replica with its own empty log hits AlreadyLanded."""
    parent = world.platform.resolve(mention(world, "bob.test", f"second try {tag()}")["uri"])
    first = world.guard.post(parent, "first answer")
    assert first.status is Status.POSTED
    assert world.row(parent.id).provider_key == rkey_for(world.me.sender_id, parent.id)
    again = world.guard.post(parent, "a reworded answer")
    assert (again.status, again.reply_id) == (Status.ALREADY_ANSWERED, first.reply_id)

    other = Store.open(f"sqlite:///{tmp_path / 'other-machine.sqlite3'}", clock=world.clock)
    try:
        stranger = Guard(other, world.adapter(), world.me, clock=world.clock)
        with capture_logs() as logs:
            out = stranger.post(parent, "a replica that never saw the first answer")
        assert (out.status, out.reply_id) == (Status.ALREADY_ANSWERED, first.reply_id) and not out.sent
        assert other.get(stranger.key(parent.id)).state == st.CLOSED
        assert [e.kind for e in other.history(stranger.key(parent.id))][-1] == "already_landed"
        assert any(e["event"] == "replyd.bluesky.already_landed" and e["status"] == 500 for e in logs)
    finally:
        other.dispose()
    assert len(world.bot_replies(parent.id)) == 1


def test_deep_thread_reply_has_root_and_parent_refs(world: World) -> None:
    """A reply to a post two levels deep has root = the thread root and parent = that post."""
    net = world.net
    root = net.post(net.people["alice.test"], f"thread root {tag()}")
    mid = net.post(net.people["bob.test"], "level one", reply_to=net.reply_refs(root, root))
    deep = net.post(net.people["alice.test"], f"@{net.bot.handle} level two, your take?",
                    reply_to=net.reply_refs(root, mid), mention=net.bot)
    inbox = eventually(lambda: world.platform.inbox(None), lambda pg: deep["uri"] in {p.id for p in pg.parents})
    [parent] = [p for p in inbox.parents if p.id == deep["uri"]]
    assert (parent.extra["root_uri"], parent.extra["root_cid"], parent.extra["cid"]) == (
        root["uri"], root["cid"], deep["cid"])
    out = world.guard.post(parent, "my take")
    assert out.status is Status.POSTED
    rec = net.xrpc("GET", "com.atproto.repo.getRecord", params={
        "repo": world.me.sender_id, "collection": POST_NSID, "rkey": out.reply_id.rsplit("/", 1)[1]}).json()
    assert rec["value"]["reply"] == {"root": {"uri": root["uri"], "cid": root["cid"]},
                                     "parent": {"uri": deep["uri"], "cid": deep["cid"]}}
    [reply] = world.bot_replies(deep["uri"])
    assert reply["uri"] == out.reply_id
    thread = net.thread(root["uri"])
    assert thread["replies"][0]["post"]["uri"] == mid["uri"]
    assert thread["replies"][0]["replies"][0]["replies"][0]["post"]["uri"] == out.reply_id


def test_duplicate_rkey_is_http_500_on_the_pds(world: World) -> None:
    """What the reference PDS really answers to a second create at a taken rkey: HTTP 500."""
    net = world.net
    target = mention(world, "carol.test", f"dup probe {tag()}")
    rkey = rkey_for(net.bot.did, target["uri"] + "#raw")
    body = {"repo": net.bot.did, "collection": POST_NSID, "rkey": rkey,
            "record": {"$type": POST_NSID, "text": "raw", "createdAt": "2026-01-01T00:00:00.000Z",
                       "reply": {"root": target, "parent": target}}}
    first = net.xrpc("POST", "com.atproto.repo.createRecord", who=net.bot, body=body)
    second = net.xrpc("POST", "com.atproto.repo.createRecord", who=net.bot, body=body)
    assert first.status_code == 200 and first.json()["uri"].endswith(rkey)
    assert (second.status_code, second.json()) == (
        500, {"error": "InternalServerError", "message": "Internal Server Error"})
    net.xrpc("POST", "com.atproto.repo.deleteRecord", who=net.bot,
             body={"repo": net.bot.did, "collection": POST_NSID, "rkey": rkey}).raise_for_status()


def test_lost_response_is_closed_by_the_get_record_probe(world: World, proxy: PdsProxy) -> None:
    """The PDS writes the reply but its answer is lost: the getRecord probe finds it and the row closes."""
    parent = world.platform.resolve(mention(world, "alice.test", f"lost answer {tag()}")["uri"])
    guard = world.guard_for(world.adapter(proxy.url))
    proxy.drop_creates = 1
    with capture_logs() as logs:
        out = guard.post(parent, "an answer whose response is lost")
    assert proxy.creates == [200]  # it did land
    row = world.row(parent.id)
    assert (row.state, row.reply_id, out.reply_id) == (st.CLOSED, world.expected_uri(parent.id), row.reply_id)
    assert any(e["event"] == "replyd.bluesky.already_landed" for e in logs)
    assert [r["uri"] for r in world.bot_replies(parent.id)] == [row.reply_id]


def test_lost_response_left_open_then_sweep_closes(world: World, proxy: PdsProxy) -> None:
    """Answer lost and the probe lost too: the row stays open (UNCERTAIN), the sweep closes it by getRecord."""
    parent = world.platform.resolve(mention(world, "alice.test", f"lost twice {tag()}")["uri"])
    lossy = world.adapter(proxy.url)
    guard = world.guard_for(lossy)
    proxy.drop_creates = 1
    proxy.drop_record_reads = 1
    out = guard.post(parent, "an answer whose response is lost")
    assert out.status is Status.UNCERTAIN and world.row(parent.id).state == st.OPEN
    assert proxy.creates == [200]  # it did land
    assert guard.post(parent, "retry?").status is Status.IN_FLIGHT  # an open row blocks a resend
    result = world.sweep(lossy)
    assert result.closed == 1
    row = world.row(parent.id)
    assert (row.state, row.reply_id) == (st.CLOSED, world.expected_uri(parent.id))
    # The sweep's own read-back that found it also verifies the close (one look, no second request).
    assert [e.kind for e in world.store.history(world.guard.key(parent.id))][-3:] == ["maybe_sent", "swept_found",
                                                                                      "verified"]
    assert [r["uri"] for r in world.bot_replies(parent.id)] == [row.reply_id]
    assert proxy.creates == [200]


def test_crash_before_close_then_sweep(world: World) -> None:
    """The process is SIGKILLed between the send and the close: restart blocks, the sweep closes, one reply."""
    parent = world.platform.resolve(mention(world, "bob.test", f"crash {tag()}")["uri"])
    child = CTX.Process(target=crash_before_close,
                        args=(world.settings(instance=world.platform.instance), world.store_url,
                              parent.snapshot(), "answer from a process about to die"))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert world.row(parent.id).state == st.OPEN
    assert world.guard.post(parent, "after restart").status is Status.IN_FLIGHT
    assert world.sweep().closed == 1
    assert world.row(parent.id).reply_id == world.expected_uri(parent.id)
    assert len(world.bot_replies(parent.id)) == 1


def test_crash_and_lagging_listing_retry_is_already_landed(world: World, proxy: PdsProxy) -> None:
    """Crash before close, then a sweep whose listing lags: not_landed, and the retry closes on AlreadyLanded."""
    parent = world.platform.resolve(mention(world, "carol.test", f"lagging listing {tag()}")["uri"])
    child = CTX.Process(target=crash_before_close,
                        args=(world.settings(instance=world.platform.instance), world.store_url,
                              parent.snapshot(), "the first answer"))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    landed = world.expected_uri(parent.id)
    world.net.wait_replies_by(parent.id, world.me.sender_id)
    proxy.hide = {landed}  # the listings the sweep reads do not show it yet
    result = world.sweep(world.adapter(proxy.url))
    assert result.not_landed == 1 and world.row(parent.id).state == st.NOT_LANDED
    out = world.guard.post(parent, "the retry, reworded")
    row = world.row(parent.id)
    assert (row.state, row.attempt, row.reply_id, out.reply_id) == (st.CLOSED, 2, landed, landed)
    assert [e.kind for e in world.store.history(world.guard.key(parent.id))][-1] == "already_landed"
    verify = world.sweep()  # the one verifying read-back after a retry's close: nothing else landed
    assert (verify.verified, verify.duplicates) == (1, 0)
    assert [r["uri"] for r in world.bot_replies(parent.id)] == [landed]


def test_late_landing_after_not_landed(world: World, proxy: PdsProxy) -> None:
    """A create held past the send timeout and the sweep lands late; the retry meets it (one reply)."""
    parent = world.platform.resolve(mention(world, "alice.test", f"late landing {tag()}")["uri"])
    slow = world.adapter(proxy.url, timeout_s=1.0)
    guard = world.guard_for(slow)
    proxy.hold()
    out = guard.post(parent, "held in a queue somewhere")
    assert out.status is Status.UNCERTAIN and "ReadTimeout" in out.detail
    assert world.sweep(slow).not_landed == 1  # truly nothing there yet
    proxy.release()
    assert proxy.creates == [200]  # now it landed
    out2 = guard.post(parent, "the retry")
    row = world.row(parent.id)
    assert (row.state, row.attempt, out2.reply_id) == (st.CLOSED, 2, world.expected_uri(parent.id))
    assert proxy.creates == [200, 500]  # the retry's create was refused at the taken rkey
    verify = world.sweep()
    assert (verify.verified, verify.duplicates) == (1, 0)
    assert len(world.bot_replies(parent.id)) == 1


def _expired_jwt(did: str, aud: str) -> str:
    """An access token signed with the dev-env's published JWT secret, expired an hour ago."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    now = int(time.time())
    head = b64(json.dumps({"typ": "at+jwt", "alg": "HS256"}).encode())
    body = b64(json.dumps({"scope": "com.atproto.appPass", "aud": aud, "sub": did,
                           "iat": now - 7200, "exp": now - 3600}).encode())
    sig = hmac.new(b"jwt-secret", f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


def test_expired_token_is_refreshed_transparently(world: World) -> None:
    """The PDS answers 400 ExpiredToken to an expired access token; the adapter refreshes and carries on."""
    plat = world.platform
    plat.whoami()
    session = plat._session
    assert session is not None
    expired = _expired_jwt(session.did, "did:web:localhost")
    plat._session = dataclasses.replace(session, access=SecretStr(expired))
    with capture_logs() as logs:
        page = plat.inbox(None)
    assert isinstance(page.parents, list)
    renew = [e for e in logs if e["event"] == "replyd.bluesky.session_renew"]
    assert renew and renew[0]["error"] == "ExpiredToken"
    assert plat._session is not None and plat._session.access.get_secret_value() != expired


def test_feed_read_back_finds_other_rkeys_and_delete(world: World) -> None:
    """An own reply at another rkey is found through getAuthorFeed (getRecord misses it); delete removes it."""
    net = world.net
    target = mention(world, "bob.test", f"answered outside replyd {tag()}")
    uris = []
    for text in ("outside one", "outside two"):
        resp = net.xrpc("POST", "com.atproto.repo.createRecord", who=net.bot, body={
            "repo": net.bot.did, "collection": POST_NSID,
            "record": {"$type": POST_NSID, "text": text, "createdAt": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
                       "reply": {"root": target, "parent": target}}})
        resp.raise_for_status()
        uris.append(resp.json()["uri"])
    net.wait_replies_by(target["uri"], net.bot.did, at_least=2)
    parent = world.platform.resolve(target["uri"])
    rb = world.platform.read_back(
        [Pending(parent=parent, opened_at=time.time() - 5, provider_key=rkey_for(net.bot.did, parent.id))],
        sender_id=world.me.sender_id)
    assert parent.id in rb.checked
    assert sorted(r.reply_id for r in rb.found[parent.id]) == sorted(uris)
    world.platform.delete(rb.found[parent.id][-1].reply_id)
    deadline = time.monotonic() + 10
    while len(net.replies_by(target["uri"], net.bot.did)) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(net.replies_by(target["uri"], net.bot.did)) == 1


def test_pollers_find_through_every_path_one_reply_one_call(world: World) -> None:
    """The daemon's per-bot work (Pollers → Pipeline → Guard, then the sweep) on the real network: one reply each."""
    from replyd.config import PollerConfig
    from replyd.pipeline import Pipeline
    from replyd.policy import Policy
    from replyd.pollers import Pollers

    net, w = world.net, tag()
    asked = mention(world, "alice.test", f"is {w} any good?")
    searched = net.post(net.people["bob.test"], f"who can explain {w}?")
    net.wait_indexed(searched["uri"])
    calls: list[str] = []

    def respond(parent: Any) -> str:
        calls.append(parent.id)
        return f"about {w}: yes"

    pollers = Pollers(world.store, world.platform, Pipeline(world.guard, respond, Policy(), world.clock),
                      PollerConfig(search_queries=[w], refind_lookback_s=3600), world.clock)
    for _ in range(3):  # every path, several rounds, as the scheduled jobs would run them
        pollers.inbox()
        pollers.search()
        pollers.refind()
        world.sweep()
    ours = {asked["uri"], searched["uri"]}
    # One responder call per parent, whatever found it (the shared network also holds other tests' mentions).
    assert [calls.count(pid) for pid in sorted(ours)] == [1, 1]
    assert len(calls) == len(set(calls))
    for pid in ours:
        assert [r["uri"] for r in world.bot_replies(pid)] == [world.expected_uri(pid)], pid
        assert world.row(pid).state == st.CLOSED


# --- thread depth -----------------------------------------------------------------------------


def test_thread_depth_counts_parents_on_the_appview(world: World) -> None:
    """root → r1 → r2 → r3 on the real AppView: depths 0..3, one getPostThread each, cut at limit + 1."""
    net = world.net
    root = net.post(net.people["alice.test"], f"depth root {tag()}")
    r1 = net.post(net.people["bob.test"], "depth one", reply_to=net.reply_refs(root, root))
    r2 = net.post(net.people["carol.test"], "depth two", reply_to=net.reply_refs(root, r1))
    r3 = net.post(net.people["alice.test"], "depth three", reply_to=net.reply_refs(root, r2))
    for post in (root, r1, r2, r3):
        net.wait_indexed(post["uri"])
    asked: list[httpx.Request] = []
    with httpx.Client(trust_env=False, event_hooks={"request": [asked.append]}) as http:
        p = BlueskyPlatform.from_settings(world.settings(), http=http, clock=SystemClock())
        parents = [p.resolve(post["uri"]) for post in (root, r1, r2, r3)]
        asked.clear()
        assert [p.thread_depth(q, 10) for q in parents] == [0, 1, 2, 3]
        threads = [r for r in asked if r.url.path.endswith("/app.bsky.feed.getPostThread")]
        assert len(threads) == len(asked) == 3  # none for the root
        assert {(r.url.params["depth"], r.url.params["parentHeight"]) for r in threads} == {("0", "11")}
        asked.clear()
        assert [p.thread_depth(parents[3], limit) for limit in (0, 1, 2, 3)] == [1, 2, 3, 3]
        assert [r.url.params["parentHeight"] for r in asked] == ["2", "3", "4"]  # limit 0: no request


def test_thread_depth_deleted_or_blocked_ancestor_still_counts(world: World) -> None:
    """A deleted ancestor comes back as notFoundPost, a blocking author's as blockedPost: each counts, and the root above."""
    net, w = world.net, tag()
    dave = _create_account(net.http, net.pds, f"{w}.test")
    root = net.post(net.people["alice.test"], f"depth root {w}")
    r1 = net.post(net.people["bob.test"], "to be deleted", reply_to=net.reply_refs(root, root))
    r2 = net.post(dave, "by someone who blocks the bot", reply_to=net.reply_refs(root, r1))
    r3 = net.post(net.people["carol.test"], "depth three", reply_to=net.reply_refs(root, r2))
    r4 = net.post(net.people["alice.test"], "depth four", reply_to=net.reply_refs(root, r3))
    for post in (root, r1, r2, r3, r4):
        net.wait_indexed(post["uri"])
    p = world.platform
    r2_parent, r4_parent = p.resolve(r2["uri"]), p.resolve(r4["uri"])
    assert (p.thread_depth(r2_parent, 10), p.thread_depth(r4_parent, 10)) == (2, 4)

    def bots_view(uri: str) -> dict[str, Any]:
        resp = net.xrpc("GET", "app.bsky.feed.getPostThread", who=net.bot, proxy=True,
                        params={"uri": uri, "depth": 0, "parentHeight": 10})
        resp.raise_for_status()
        return resp.json()["thread"]

    rkey = r1["uri"].rsplit("/", 1)[1]
    net.xrpc("POST", "com.atproto.repo.deleteRecord", who=net.people["bob.test"],
             body={"repo": net.people["bob.test"].did, "collection": POST_NSID, "rkey": rkey}).raise_for_status()
    seen = eventually(lambda: bots_view(r2["uri"]), lambda t: t.get("parent", {}).get("notFound") is True)
    assert seen["parent"]["$type"] == "app.bsky.feed.defs#notFoundPost"
    assert p.thread_depth(r2_parent, 10) == 2  # r1 (gone) and the root above it

    net.xrpc("POST", "com.atproto.repo.createRecord", who=dave, body={
        "repo": dave.did, "collection": "app.bsky.graph.block",
        "record": {"$type": "app.bsky.graph.block", "subject": net.bot.did,
                   "createdAt": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}}).raise_for_status()
    seen = eventually(lambda: bots_view(r4["uri"]), lambda t: t["parent"].get("parent", {}).get("blocked") is True)
    assert seen["parent"]["parent"]["$type"] == "app.bsky.feed.defs#blockedPost"
    assert p.thread_depth(r4_parent, 10) == 3  # r3, r2 (blocked), the root: r1 is not seen, a lower bound
    assert p.thread_depth(r4_parent, 1) == 2
