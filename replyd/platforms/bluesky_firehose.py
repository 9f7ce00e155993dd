"""Bluesky push: the repo firehose (``com.atproto.sync.subscribeRepos``) wakes the bot for a mention or a reply.

The firehose carries every commit of every repo the server hosts (a PDS: its own accounts; a relay: the
network): binary websocket frames, each two DAG-CBOR objects (a header ``{op, t}`` and a body), a
``#commit`` body holding the operations and a CAR file of the changed blocks. It is not addressed to the
bot: every post is decoded and kept only when it mentions the bot's DID (a facet) or replies to one of
the bot's posts (its parent or its root), the two notification reasons the inbox reads.

A kept post is then read from the AppView (``resolve``: ``getPosts``), so the parent is the very one the
notification poll builds (handle, labels, reply refs, the same id: the same key). While the AppView has not
indexed it yet (0.4-1 s on the dev-env network) the read is retried for ``hydrate_timeout_s``; after that
the post is left to the backstop poll. Deeper thread replies, which the AppView also notifies (up to five
ancestors up), are left to the poll too: the firehose alone cannot see a post's grandparents.

The last sequence number seen is the cursor: a reconnect asks the server to replay from it (a PDS keeps
a backfill window), so a short cut loses nothing; a long one is covered by the catch-up poll that every
(re)connect runs (``replyd.streams``). Decoding is ``libipld`` (DAG-CBOR and CAR), the socket is
``websockets``: the ``bluesky`` extra.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from replyd.errors import ConfigError, DefinitelyNotSent, PlatformError, Rejected
from replyd.log import get_logger
from replyd.platforms import unreadable
from replyd.platforms.base import Parent, Platform

log = get_logger("replyd.bluesky")

SUBSCRIBE = "/xrpc/com.atproto.sync.subscribeRepos"
POST_PREFIX = "app.bsky.feed.post/"
MENTION = "app.bsky.richtext.facet#mention"
MAX_FRAME_BYTES = 8 * 1024 * 1024  # a commit is capped at 2 MB of blocks by the PDS; room to spare


def firehose_url(service: str) -> str:
    """The ``ws(s)://`` subscribeRepos URL of a PDS or relay at ``service`` (``http(s)://``, ``ws(s)://``)."""
    parts = urlsplit(service.rstrip("/"))
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ConfigError(f"bluesky setting 'firehose_url': {service!r} is not an http(s):// or ws(s):// URL")
    path = parts.path if parts.path.endswith(SUBSCRIBE) else parts.path + SUBSCRIBE
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def _did_of(uri: Any) -> str | None:
    """The authority (DID) of an ``at://`` URI, or None."""
    if not isinstance(uri, str) or not uri.startswith("at://"):
        return None
    return uri[5:].split("/", 1)[0] or None


def about(record: Any, bot_did: str) -> bool:
    """Whether a post record mentions ``bot_did`` (a mention facet) or replies to one of its posts."""
    if not isinstance(record, dict):
        return False
    for facet in record.get("facets") or ():
        for feature in (facet.get("features") or ()) if isinstance(facet, dict) else ():
            if isinstance(feature, dict) and feature.get("$type") == MENTION and feature.get("did") == bot_did:
                return True
    reply = record.get("reply")
    if isinstance(reply, dict):
        for ref in ("parent", "root"):
            target = reply.get(ref)
            if isinstance(target, dict) and _did_of(target.get("uri")) == bot_did:
                return True
    return False


def commit_posts(body: Any) -> Iterator[tuple[str, Any]]:
    """The ``(at:// uri, record)`` of every post a ``#commit`` body creates (records read from its CAR blocks)."""
    import libipld

    if not isinstance(body, dict) or body.get("tooBig"):
        return  # a too-big commit carries no blocks; the backstop poll reads what was in it
    repo, ops = body.get("repo"), body.get("ops")
    creates = [op for op in ops or () if isinstance(op, dict) and op.get("action") == "create"
               and str(op.get("path", "")).startswith(POST_PREFIX)]
    if not creates or not isinstance(repo, str) or not isinstance(body.get("blocks"), bytes):
        return
    _header, blocks = libipld.decode_car(body["blocks"])
    for op in creates:
        cid = op.get("cid")  # libipld gives a CID link and a CAR block key alike as the CID's bytes
        yield f"at://{repo}/{op['path']}", blocks.get(cid) if isinstance(cid, (bytes, str)) else None


class Firehose:
    """Reads one server's repo firehose and yields the bot's mentions and replies as the poller's parents."""

    def __init__(self, platform: Platform, url: str, *, hydrate_timeout_s: float = 5.0,
                 open_timeout_s: float = 10.0, ping_s: float = 20.0) -> None:
        self.platform = platform
        self.url = firehose_url(url)
        self.hydrate_timeout_s = hydrate_timeout_s
        self.open_timeout_s = open_timeout_s
        # A PDS sends nothing while nothing is committed: a ping every ping_s, unanswered for ping_s, ends the socket.
        self.ping_s = ping_s
        self.cursor: int | None = None  # the last sequence number read: a reconnect replays from here
        self.opened = 0  # connections opened (for tests and logs)
        self.frames = 0

    @property
    def instance(self) -> str:
        """The platform instance (the bot's, for logs)."""
        return self.platform.instance

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """Yield parents as posts about the bot are committed, until the server closes or ``stop`` is set."""
        try:
            import libipld
            from websockets.exceptions import ConnectionClosedOK, WebSocketException
            from websockets.sync.client import connect
        except ImportError as exc:
            raise ConfigError(f"bluesky firehose: {exc.name} is not installed (pip install 'replyd[bluesky]')") from None
        bot_did = self.platform.whoami().sender_id
        url = self.url + (f"?cursor={self.cursor}" if self.cursor is not None else "")
        try:
            with connect(url, open_timeout=self.open_timeout_s, max_size=MAX_FRAME_BYTES, compression=None,
                         proxy=None, ping_interval=self.ping_s, ping_timeout=self.ping_s) as ws:
                self.opened += 1
                log.info("replyd.bluesky.firehose_open", platform=self.instance, cursor=self.cursor)
                while not stop.is_set():
                    try:
                        frame = ws.recv(timeout=1.0)  # a second at most between looks at ``stop``
                    except TimeoutError:
                        continue
                    except ConnectionClosedOK:
                        return
                    if isinstance(frame, str):
                        continue  # the protocol is binary; a text frame is not ours to read
                    yield from self._frame(libipld, frame, bot_did, stop)
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise DefinitelyNotSent(f"firehose: {type(exc).__name__}: {exc}"[:300]) from None

    def _frame(self, libipld: Any, frame: bytes, bot_did: str, stop: threading.Event) -> Iterator[Parent]:
        ok, got = unreadable.read_one(self.instance, "stream", None, lambda _: libipld.decode_dag_cbor_multi(frame))
        if not ok:
            return  # a frame that cannot be decoded: reported, and the stream goes on
        header, body = got
        self.frames += 1
        if not isinstance(header, dict) or not isinstance(body, dict):
            return
        if header.get("op") == -1:  # an error frame: the server closes after it (e.g. FutureCursor)
            raise DefinitelyNotSent(f"firehose: {body.get('error')}: {body.get('message')}"[:300])
        if header.get("t") == "#commit":
            # A commit or a post record that cannot be read is reported; the frame's other posts go on.
            _, posts = unreadable.read_one(self.instance, "stream", body, lambda b: list(commit_posts(b)), id_field="seq")
            for uri, record in posts or ():
                _, wanted = unreadable.read_one(self.instance, "stream", record,  # read_one calls it at once
                                                lambda r: _did_of(uri) != bot_did and about(r, bot_did), ident=uri)  # noqa: B023
                parent = self._hydrate(uri, stop) if wanted else None
                if parent is not None:
                    yield parent
        seq = body.get("seq")
        if isinstance(seq, int):
            self.cursor = seq  # after the frame's parents were handed on: a reconnect replays an unfinished one

    def _hydrate(self, uri: str, stop: threading.Event) -> Parent | None:
        """The AppView's view of ``uri`` as the poller's parent; None when it is not indexed in time."""
        waited_s, pause_s = 0.0, 0.05
        while True:
            try:
                return self.platform.resolve(uri)
            except Rejected:
                pass  # not indexed yet
            except PlatformError as exc:
                log.warning("replyd.bluesky.firehose_unresolved", platform=self.instance, uri=uri,
                            error=str(exc)[:200])
                return None
            if waited_s >= self.hydrate_timeout_s or stop.wait(pause_s):
                log.info("replyd.bluesky.firehose_left_to_poll", platform=self.instance, uri=uri,
                         waited_s=round(waited_s, 2))
                return None
            waited_s += pause_s
            pause_s = min(0.5, pause_s * 2)
