"""Bluesky push: the PDS's repo firehose on the real reference network (@atproto/dev-env) feeds the pipeline.

A post about the bot, committed on the PDS, arrives as a binary subscribeRepos frame, is decoded (DAG-CBOR,
CAR) and read back from the AppView as the notification poll's own parent. Replies are counted on the
network (the AppView's thread), never from replyd's log. The firehose is cut by a TCP proxy in front of it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import libipld
import pytest
from websockets.sync.server import serve

from replyd import store as st
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.errors import ConfigError, DefinitelyNotSent, Rejected
from replyd.platforms.base import Identity, Parent
from replyd.platforms.bluesky_firehose import Firehose, about, firehose_url
from replyd.store import Store
from tests.test_bluesky_network import World, eventually, mention, tag, world  # noqa: F401
from tests.test_daemon import wait_until

BOT = "did:plc:bot"


def test_about_reads_mention_facets_and_replies_to_the_bot() -> None:
    """A mention facet naming the bot's DID, or a reply whose parent or root is the bot's post, is about the bot;
    text that merely says the handle, another DID's facet or a reply elsewhere is not."""
    facet = {"features": [{"$type": "app.bsky.richtext.facet#mention", "did": BOT}]}
    assert about({"text": "@replybot.test hi", "facets": [facet]}, BOT)
    assert not about({"text": "@replybot.test hi"}, BOT)
    assert not about({"facets": [{"features": [{"$type": "app.bsky.richtext.facet#mention", "did": "did:plc:x"}]}]},
                     BOT)
    ref = {"uri": f"at://{BOT}/app.bsky.feed.post/3k", "cid": "bafy"}
    other = {"uri": "at://did:plc:x/app.bsky.feed.post/3k", "cid": "bafy"}
    assert about({"reply": {"root": other, "parent": ref}}, BOT)
    assert about({"reply": {"root": ref, "parent": other}}, BOT)
    assert not about({"reply": {"root": other, "parent": other}}, BOT)
    assert not about(None, BOT) and not about({"facets": ["x"], "reply": "y"}, BOT)


def test_firehose_url_is_the_servers_subscribe_repos() -> None:
    """http(s) becomes ws(s) with the subscribeRepos path; anything else is a config error naming the setting."""
    assert firehose_url("https://pds.example") == "wss://pds.example/xrpc/com.atproto.sync.subscribeRepos"
    assert firehose_url("ws://127.0.0.1:2583/") == "ws://127.0.0.1:2583/xrpc/com.atproto.sync.subscribeRepos"
    with pytest.raises(Exception, match="firehose_url"):
        firehose_url("ftp://pds.example")


def test_a_stream_kind_of_another_platform_is_a_config_error(tmp_path) -> None:
    """push.kind bluesky_firehose on a Mastodon bot is refused at load, naming the kind and both platforms."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[bots]]\nname = "m"\nplatform = "mastodon"\n[bots.push]\nkind = "bluesky_firehose"\n')
    with pytest.raises(ConfigError, match="bluesky_firehose.*'bluesky', not 'mastodon'"):
        Config.load(cfg, secrets=False)


# -- recorded frames on a local websocket ----------------------------------------------------------

FRAMES = Path(__file__).parent / "fixtures" / "bluesky_firehose"


class StubBluesky:
    """The adapter's side the firehose uses: whoami, resolve (the AppView read-back) and instance."""

    instance = "bluesky:stub"

    def __init__(self, bot_did: str, indexed_after: int = 0) -> None:
        self.bot_did = bot_did
        self.indexed_after = indexed_after  # resolve answers Rejected (not indexed yet) this many times first
        self.resolved: list[str] = []

    def whoami(self) -> Identity:
        """The bot's DID."""
        return Identity(sender_id=self.bot_did, handle="replybot.test")

    def resolve(self, uri: str) -> Parent:
        """The post as the AppView would serve it, once it is 'indexed'."""
        self.resolved.append(uri)
        if len(self.resolved) <= self.indexed_after:
            raise Rejected(f"resolve: no post found at {uri}")
        return Parent(id=uri, author_id=uri.split("/")[2], author_handle="alice.test")


@contextmanager
def ws_server(messages: list[bytes | str]) -> Iterator[tuple[str, list[str]]]:
    """A local websocket server that sends ``messages`` to each client and closes; yields its URL and the paths
    clients asked for (with their cursor)."""
    paths: list[str] = []

    def handler(conn) -> None:
        paths.append(conn.request.path)
        for m in messages:
            conn.send(m)

    with serve(handler, "127.0.0.1", 0, compression=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.socket.getsockname()[1]}", paths
        server.shutdown()


def test_recorded_frames_yield_the_mention_skip_the_rest_and_keep_the_cursor() -> None:
    """Frames recorded from dev-env: the mention of the bot is yielded (read back after one 'not indexed yet'),
    the unrelated post, a text frame and garbage bytes are not; the cursor is the last seq, sent on reconnect."""
    meta = json.loads((FRAMES / "frames.json").read_text())
    mention_frame, unrelated = (FRAMES / "mention.bin").read_bytes(), (FRAMES / "unrelated.bin").read_bytes()
    stub = StubBluesky(meta["bot_did"], indexed_after=1)
    with ws_server(["a text frame", b"\xff\x00garbage", unrelated, mention_frame]) as (url, paths):
        firehose = Firehose(stub, url)  # type: ignore[arg-type]
        got = list(firehose.stream(threading.Event()))  # the server closes after the last frame: the stream ends
        seq = libipld.decode_dag_cbor_multi(mention_frame)[1]["seq"]
        assert [p.id for p in got] == [meta["mention_uri"]] and stub.resolved == [meta["mention_uri"]] * 2
        assert firehose.cursor == seq and firehose.frames == 2  # the garbage and the text frame are not frames
        list(firehose.stream(threading.Event()))
    assert paths == ["/xrpc/com.atproto.sync.subscribeRepos", f"/xrpc/com.atproto.sync.subscribeRepos?cursor={seq}"]


def test_a_post_not_indexed_in_time_is_left_to_the_poll_and_an_error_frame_ends_the_stream() -> None:
    """With no time to wait, a mention the AppView has not indexed yields nothing; an error frame (op -1) is a
    DefinitelyNotSent naming the server's error."""
    meta = json.loads((FRAMES / "frames.json").read_text())
    stub = StubBluesky(meta["bot_did"], indexed_after=99)
    error = libipld.encode_dag_cbor({"op": -1}) + libipld.encode_dag_cbor(
        {"error": "FutureCursor", "message": "Cursor in the future."})
    with ws_server([(FRAMES / "mention.bin").read_bytes(), error]) as (url, _paths):
        firehose = Firehose(stub, url, hydrate_timeout_s=0)  # type: ignore[arg-type]
        got: list[Parent] = []
        with pytest.raises(DefinitelyNotSent, match="FutureCursor: Cursor in the future"):
            for parent in firehose.stream(threading.Event()):
                got.append(parent)
    assert got == [] and stub.resolved == [meta["mention_uri"]]


# -- the real network ----------------------------------------------------------------------------


def test_firehose_yields_the_notification_polls_parent(world: World) -> None:
    """A mention and a reply to the bot's post arrive on the firehose as the inbox poll's own parents (equal, so
    one key); a post about something else does not arrive."""
    net, w = world.net, tag()
    got: list[Any] = []
    stop = threading.Event()
    firehose = Firehose(world.platform, net.pds)

    def read() -> None:
        for parent in firehose.stream(stop):
            got.append(parent)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: firehose.opened == 1, 10)  # open before the posts: no cursor, only what is new
        bot_post = net.post(net.bot, f"I answer questions about {w}")
        net.wait_indexed(bot_post["uri"])
        asked = mention(world, "alice.test", f"what does {w} do?")
        net.post(net.people["bob.test"], f"unrelated {w}")
        replied = net.post(net.people["carol.test"], f"thanks, {w}", reply_to=net.reply_refs(bot_post, bot_post))
        assert wait_until(lambda: {p.id for p in got} >= {asked["uri"], replied["uri"]}, 15)
    finally:
        stop.set()
        reader.join(5)
    inbox = eventually(lambda: world.platform.inbox(None),
                       lambda pg: {asked["uri"], replied["uri"]} <= {p.id for p in pg.parents})
    polled = {p.id: p for p in inbox.parents}
    # This test's posts only (all carry its tag): the dev-env is shared, and another test's mention of the bot
    # committed as the firehose opened may come first; the unrelated post carries the tag and must not arrive.
    mine = [p for p in got if w in p.text]
    assert [p.id for p in mine] == [asked["uri"], replied["uri"]]
    assert all(p == polled[p.id] for p in mine)
    assert firehose.cursor is not None and firehose.frames >= 4


class Cut:
    """A TCP proxy in front of the PDS that can cut every connection and refuse new ones for a while."""

    def __init__(self, target: str) -> None:
        host, port = target.split("//", 1)[1].split(":")
        self.target = (host, int(port.rstrip("/")))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.refuse_until = 0.0
        self.conns: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self.refuse_until:
                client.close()
                continue
            self.accepted += 1
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self, refuse_s: float) -> None:
        """Close every open connection and refuse new ones for ``refuse_s`` seconds."""
        self.refuse_until = time.monotonic() + refuse_s
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns = []

    def close(self) -> None:
        """Stop listening."""
        self.cut(0)
        self.listener.close()


def _config(tmp_path: Path, world: World, firehose: str, *, backstop_s: float) -> Path:
    net = world.net
    cfg = tmp_path / "bsky.toml"
    cfg.write_text(f"""
[store]
url = "sqlite:///{tmp_path / 'r.sqlite3'}"

[guard]
send_timeout_s = 5.0

[[bots]]
name = "bsky"
platform = "bluesky"

[bots.settings]
service = "{net.pds}"
allow_insecure_http = true
identifier = "{net.bot.handle}"
app_password_env = "BSKY_TEST_APP_PASSWORD"
appview_did = "{net.appview_did}"
firehose_url = "{firehose}"
listing_delay_s = 2.0

[bots.pollers]
refind_interval_s = 0
jitter_s = 0

[bots.push]
kind = "bluesky_firehose"
backstop_interval_s = {backstop_s}

[bots.responder]
kind = "template"
""")
    os.chmod(cfg, 0o600)
    return cfg


def _paths(tmp_path: Path, world: World) -> dict[str, str]:
    s = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    try:
        return {r.parent_id: r.path for r in s.rows_in(world.platform.instance, world.me.sender_id, [st.CLOSED],
                                                        limit=1000)}
    finally:
        s.dispose()


@pytest.mark.slow
def test_daemon_answers_from_the_firehose_and_the_backstop_covers_a_cut(world: World, tmp_path, monkeypatch) -> None:
    """replyd's daemon with the firehose: a mention is answered once through it (path stream); with the firehose
    cut and refused for 30 s, a mention is answered once by the notification poll; after the reconnect (cursor
    replay) nothing is answered twice. Replies are counted on the AppView."""
    monkeypatch.setenv("BSKY_TEST_APP_PASSWORD", world.net.bot_app_password)
    cut = Cut(world.net.pds)
    d = Daemon(Config.load(_config(tmp_path, world, cut.url, backstop_s=2.0)))
    d.start()
    try:
        assert wait_until(lambda: cut.accepted >= 1, 20)
        time.sleep(1.0)
        first = mention(world, "alice.test", f"first {tag()}?")
        assert world.bot_replies(first["uri"]) and _paths(tmp_path, world).get(first["uri"]) in ("stream", "inbox")
        cut.cut(refuse_s=30.0)
        gap = mention(world, "bob.test", f"in the gap {tag()}?")
        # Answered while the firehose is still refused: by the notification poll (the 2 s backstop, or the
        # catch-up poll that each reconnect attempt runs), never by the firehose.
        assert wait_until(lambda: bool(world.net.replies_by(gap["uri"], world.me.sender_id)), 15)
        accepted = cut.accepted
        assert wait_until(lambda: cut.accepted > accepted, 90)  # the firehose reconnected, replaying from its cursor
        later = mention(world, "carol.test", f"later {tag()}?")
        assert wait_until(lambda: bool(world.net.replies_by(later["uri"], world.me.sender_id)), 20)
        time.sleep(2.5)  # one more backstop poll and any replay have run: nothing may answer again
    finally:
        d.stop(grace_s=3)
        cut.close()
    for post in (first, gap, later):
        assert len(world.net.replies_by(post["uri"], world.me.sender_id)) == 1, post
    paths = _paths(tmp_path, world)
    assert paths[gap["uri"]] == "inbox"
    assert "stream" in {paths[first["uri"]], paths[later["uri"]]}
