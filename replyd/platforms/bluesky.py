"""The Bluesky adapter: mentions, search, replies and read-back over XRPC (no atproto SDK).

Settings: ``[bots.settings]`` with ``platform = "bluesky"``; each key is a field of
``BlueskyPlatform.Settings`` below, with its meaning beside it.

Ids. The sender id is the account's DID (from ``createSession``). A parent id
is the post's ``at://did:…/app.bsky.feed.post/<rkey>`` URI exactly as the
AppView serves it; its CID and thread root go into ``Parent.extra`` (``cid``,
``root_uri``, ``root_cid``), so a reply deep in a thread gets root = the thread
root from the parent's ``record.reply.root`` and parent = the post itself.

Cursors (inbox and search). Bluesky pages only backwards (newest first, a
``cursor`` for older items), so the persisted cursor is the newest
``indexedAt`` seen, followed by the URIs seen at exactly that instant
(``"<indexedAt>|<uri>|<uri>"``) so a tie is neither skipped nor re-offered.
A poll pages back until it meets an item at or before that point. The bot's
``seenAt`` (``updateSeen``) is deliberately not used: it is shared with every
app the account is logged into and would make replyd's progress depend on a
human opening the app. Without a cursor only the newest page is read.

Record key (``provider_key``). Every reply is created with
``com.atproto.repo.createRecord`` at a deterministic rkey: a TID whose 10-bit
clock id and a 48-bit microsecond offset come from SHA-256 of
``(sender DID, parent URI)``; the timestamp is 2000-01-01T00:00:00Z plus that
offset (so it always lies in 2000-01-01 … 2008-11-30). Why this is accepted:
the PDS checks an ``app.bsky.feed.post`` rkey only for record-key syntax, the
lexicon's ``tid`` format (13 chars of ``234567abcdefghijklmnopqrstuvwxyz``,
first char in ``234567abcdefghij``) and a slur list; it never checks the time
(verified against @atproto/pds 0.4.217: ``2222222222222`` and ``7zzzzzzzzzzzz``
are both accepted and indexed). A past time is chosen because it can never be
"in the future" whatever the clock skew (atproto consumers are told to
distrust future *revs*, and some may apply that to rkeys), and the AppView
sorts posts by ``createdAt``/``indexedAt``, not by rkey. The few TIDs the
PDS's slur filter would refuse are skipped deterministically.

A second create at the same rkey fails; the reference PDS answers HTTP 500
``{"error":"InternalServerError","message":"Internal Server Error"}`` (the
MST's "There is already a value at key" is not passed on). So every
ambiguous or refused create is followed by a ``getRecord`` at the rkey: a
record there that replies to this parent is ``AlreadyLanded`` with its URI.

Error mapping at this boundary (the shared table is in ``_http.py``)::

    what happened                                   send (createRecord)             reads
    ----------------------------------------------  ------------------------------  -----------------
    connect refused, DNS, ConnectTimeout, pool      DefinitelyNotSent               DefinitelyNotSent
    local rate limit spent (ratelimit-remaining 0)  RateLimited                     RateLimited
    429 (ratelimit-reset: epoch seconds)            RateLimited                     RateLimited
    400 ExpiredToken / InvalidToken, 401            refresh (or new session), retry once;
                                                    still failing: DefinitelyNotSent
    403, 408                                        DefinitelyNotSent               DefinitelyNotSent
    ReadTimeout, reset, RemoteProtocolError, 5xx    getRecord at the rkey: our      DefinitelyNotSent
      (500 is what a taken rkey answers)            reply there -> AlreadyLanded;
                                                    else MaybeSent
    400 InvalidRequest (record/rkey validation),    getRecord at the rkey: our      Rejected
      other 4xx                                     reply there -> AlreadyLanded;
                                                    else Rejected
    the rkey holds a record answering another       Rejected                        -
      parent (a hash collision)
    2xx with an unreadable body                     getRecord -> AlreadyLanded,     BadResponse
                                                    else MaybeSent

Session calls (createSession, refreshSession) never post: their failures are
``DefinitelyNotSent`` (or ``RateLimited``). Nothing branches on error text.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar
from urllib.parse import unquote, urlsplit

import httpx
import structlog

from pydantic import AfterValidator, Field, SecretStr, StringConstraints

from replyd.errors import (AlreadyLanded, BadResponse, ConfigError, DefinitelyNotSent, MaybeSent, PlatformError,
                           RateLimited, Rejected)
from replyd.parts import Limit
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Text, Texts, Token, register_platform,
)
from replyd.platforms import _http

POST_NSID = "app.bsky.feed.post"
DEFAULT_APPVIEW = "did:web:api.bsky.app#bsky_appview"
DEFAULT_LISTING_DELAY_S = 5.0
MAX_GRAPHEMES = 300  # app.bsky.feed.post text maxGraphemes: a longer answer is sent in parts
# getAuthorFeed serves at most 100 items per page.
FEED_PAGE = 100
INBOX_REASONS = ("mention", "reply")
MENTION_FACET = "app.bsky.richtext.facet#mention"
# Ancestors asked per getPostThread (the lexicon allows 1000). Each one nests the JSON a level
# deeper, and Python's json module gives up (RecursionError) near 1000 levels.
THREAD_DEPTH_PAGE = 250

# --- TIDs ------------------------------------------------------------------------------

B32_SORTABLE = "234567abcdefghijklmnopqrstuvwxyz"
TID_RE = re.compile(r"^[234567abcdefghij][234567abcdefghijklmnopqrstuvwxyz]{12}$")
# 2000-01-01T00:00:00Z in microseconds: every derived rkey lies in [2000-01-01, 2008-11-30).
TID_BASE_US = 946_684_800_000_000
TID_SPAN_BITS = 48

# The PDS refuses rkeys matching its explicit-slur list (@atproto/pds
# src/handle/explicit-slurs.ts). Over the TID alphabet only these shapes can
# match: the one unanchored pattern, and two anchored ones whose repeatable
# letters could fill all 13 characters.
_RKEY_REFUSED = (
    re.compile(r"n[ilo4a3][gq]{2}(?:l[e3]t|[e3]r)"),
    re.compile(r"^k[iyl]k[e3](?:ry|rie)?s*$"),
    re.compile(r"^tra+n{1,2}(?:ie|y|[e3]r)s?$"),
)


def tid_encode(timestamp_us: int, clock_id: int) -> str:
    """Encode a TID: top bit 0, 53-bit microseconds since the epoch, 10-bit clock id."""
    if not 0 <= timestamp_us < 1 << 53:
        raise ValueError("TID timestamp out of range")
    if not 0 <= clock_id < 1 << 10:
        raise ValueError("TID clock id out of range")
    value = (timestamp_us << 10) | clock_id
    chars = []
    for _ in range(13):
        chars.append(B32_SORTABLE[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def tid_decode(tid: str) -> tuple[int, int]:
    """Return ``(timestamp_us, clock_id)`` of a valid TID; ``ValueError`` otherwise."""
    if not is_tid(tid):
        raise ValueError(f"not a TID: {tid!r}")
    value = 0
    for ch in tid:
        value = (value << 5) | B32_SORTABLE.index(ch)
    return value >> 10, value & 0x3FF


def is_tid(value: object) -> bool:
    """Whether ``value`` is a syntactically valid TID (what @atproto/syntax isValidTid checks)."""
    return isinstance(value, str) and TID_RE.match(value) is not None


def rkey_for(sender_did: str, parent_uri: str) -> str:
    """The deterministic TID record key of the bot's reply to ``parent_uri``."""
    for salt in range(64):
        raw = f"replyd-bluesky-rkey\x1f{sender_did}\x1f{parent_uri}"
        if salt:
            raw += f"\x1f{salt}"
        n = int.from_bytes(hashlib.sha256(raw.encode()).digest()[:8], "big")
        offset = n >> (64 - TID_SPAN_BITS)
        tid = tid_encode(TID_BASE_US + offset, n & 0x3FF)
        if not any(p.search(tid) for p in _RKEY_REFUSED):
            return tid
    raise AssertionError("unreachable: 64 refused TIDs in a row")  # pragma: no cover


# --- at:// URIs ------------------------------------------------------------------------

_AT_URI_RE = re.compile(r"^at://([^/?#]+)/([^/?#]+)/([^/?#]+)$")


@dataclass(frozen=True)
class AtUri:
    """``at://<authority>/<collection>/<rkey>`` (only record URIs)."""

    authority: str
    collection: str
    rkey: str

    @classmethod
    def parse(cls, uri: str) -> AtUri:
        """Parse a record URI; ``ValueError`` if it is not one."""
        m = _AT_URI_RE.match(uri) if isinstance(uri, str) else None
        if m is None:
            raise ValueError(f"not an at:// record URI: {uri!r}")
        return cls(*m.groups())

    def __str__(self) -> str:
        return f"at://{self.authority}/{self.collection}/{self.rkey}"


def _web_url(actor: str, uri: str) -> str:
    try:
        rkey = AtUri.parse(uri).rkey
    except ValueError:
        return ""
    return f"https://bsky.app/profile/{actor}/post/{rkey}"


def _iso_now(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(value: Any) -> float | None:
    try:
        t = _http.iso_to_epoch(value)
    except (ValueError, TypeError, OverflowError):
        return None
    return t if math.isfinite(t) else None


@dataclass(frozen=True)
class _Session:
    did: str
    handle: str
    access: SecretStr
    refresh: SecretStr


@dataclass(frozen=True)
class _Cursor:
    """Where a backwards-paging listing stopped: the newest indexedAt and the URIs at it."""

    at: float
    raw: str
    uris: frozenset[str]

    def covers(self, t: float, uri: str) -> bool:
        """Whether an item at ``t`` with ``uri`` was already seen."""
        return t < self.at or (t == self.at and uri in self.uris)

    def encode(self) -> str:
        return "|".join([self.raw, *sorted(self.uris)])

    @classmethod
    def decode(cls, cursor: str | None) -> _Cursor | None:
        if not cursor:
            return None
        raw, *uris = cursor.split("|")
        t = _epoch(raw)
        if t is None:
            structlog.get_logger("replyd.bluesky").warning("replyd.bluesky.bad_cursor", problem="cursor is not an ISO time; starting over")
            return None
        return cls(t, raw, frozenset(uris))


def _since(cursor: str | None) -> _Cursor | None:
    """Where a scan from ``cursor`` stops: the cursor itself, or the start of the gap it is resuming."""
    gap = _http.GapCursor.decode(cursor)
    return _Cursor.decode(gap.since if gap is not None else cursor)


def _firehose(value: str | None) -> str | None:
    """A ``firehose_url`` checked now: a bad URL is a config error, not a stream that never opens."""
    from replyd.platforms.bluesky_firehose import firehose_url

    if value is not None:
        try:
            firehose_url(value)
        except ConfigError:
            raise ValueError(f"{value!r} is not an http(s):// or ws(s):// URL") from None
    return value


def _identifier(value: str) -> str:
    value = value.removeprefix("@")
    if any(c.isspace() for c in value):
        raise ValueError("must not contain whitespace")
    return value


@register_platform("bluesky")
class BlueskyPlatform(_http.HttpPlatform):
    """A Bluesky account as a replyd platform: notifications in, replies out, own posts read back."""

    class Settings(_http.HttpSettings):
        """``platform = "bluesky"``; ``instance`` defaults to ``bluesky:<service>``."""

        URLS: ClassVar[tuple[str, ...]] = ("service",)
        service: _http.Url  # the PDS (or entryway)
        identifier: Annotated[Text, AfterValidator(_identifier)]  # the bot's handle or DID
        app_password: Token  # an app password (app_password_env = "VAR")
        # The AppView the PDS proxies app.bsky.* reads to (atproto-proxy); "#bsky_appview" is appended when
        # no "#" is given; "" sends no header and lets the PDS pick.
        appview_did: Annotated[str, StringConstraints(pattern=r"^(did:[a-z]+:[^\s#]+(#[^\s#]+)?)?$")] = DEFAULT_APPVIEW
        listing_delay_s: float = Field(DEFAULT_LISTING_DELAY_S, ge=0)
        search_queries: Texts = []  # the queries the search poller runs
        langs: Texts = []  # BCP-47 language tags put on every reply
        page_limit: int = Field(50, ge=1, le=100)  # items per listing page
        max_pages: int = Field(5, ge=1, le=1000)  # pages per poll / re-find / read-back
        # push.kind = "bluesky_firehose": the PDS's (or a relay's) subscribeRepos; default: the service.
        firehose_url: Annotated[str | None, AfterValidator(_firehose)] = None
        part_marker: bool = False  # end each part of a long answer with " (k/n)" (replyd.parts)

    s: Settings
    ITEM_ID = "uri"

    def _setup(self) -> None:
        self._identifier = self.s.identifier
        appview = self.s.appview_did
        self._proxy = appview + "#bsky_appview" if appview and "#" not in appview else appview
        self.search_queries = list(self.s.search_queries)
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self.firehose_url = self.s.firehose_url or self.s.service
        self._firehose: Any = None  # one per adapter: it keeps the stream's cursor

    @property
    def root(self) -> str:
        """The PDS (``service``)."""
        return self.s.service

    def _secrets(self) -> tuple[str, ...]:
        s = self._session
        return super()._secrets() + ((s.access.get_secret_value(), s.refresh.get_secret_value()) if s else ())

    def _raw(
        self,
        method: str,
        nsid: str,
        *,
        what: str,
        token: SecretStr | None,
        proxy: bool = False,
        acts: bool | None = None,
        params: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | None = None,
    ) -> httpx.Response:
        """One XRPC request under the rate limits; returns the response whatever its status."""
        auth = _http.SecretAuth({"authorization": SecretStr(f"Bearer {token.get_secret_value()}")}) if token else None
        return self._request(method, f"/xrpc/{nsid}", what=what, bucket=nsid, acts=acts, auth=auth, params=params,
                             json=body, headers={"atproto-proxy": self._proxy} if proxy and self._proxy else None)

    def _xrpc(
        self,
        method: str,
        nsid: str,
        *,
        what: str,
        proxy: bool = False,
        acts: bool | None = None,
        params: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | None = None,
    ) -> httpx.Response:
        """One authenticated call; renews the session once on an auth failure; 2xx or the mapped error."""
        session = self._ensure_session(what)
        resp = self._raw(method, nsid, what=what, token=session.access, proxy=proxy, acts=acts,
                         params=params, body=body)
        if _auth_failure(resp):
            # The PDS checks the token before the handler runs: nothing acted, a retry is safe.
            self.log.info("replyd.bluesky.session_renew", what=what, error=self._server_says(resp, resp.status_code))
            session = self._renew(session, what)
            resp = self._raw(method, nsid, what=what, token=session.access, proxy=proxy, acts=acts,
                             params=params, body=body)
            if _auth_failure(resp):
                raise DefinitelyNotSent(
                    f"{what}: HTTP {resp.status_code} ({self._server_says(resp, 'auth')}) after renewing the session",
                    status=resp.status_code,
                )
        self._raise_for_status(resp, what=what, bucket=nsid, acts=acts)
        return resp

    def _server_says(self, resp: httpx.Response, default: object) -> str:
        """The XRPC error of ``resp`` (or ``default``), redacted: a server may quote what it was sent (a token,
        the app password) back in its error text."""
        return _http.redact(str(_xrpc_error(resp) or default), self._secrets())

    # --- session ----------------------------------------------------------------------

    def _ensure_session(self, what: str) -> _Session:
        with self._lock:
            if self._session is None:
                self._session = self._create_session(what)
            return self._session

    def _renew(self, stale: _Session, what: str) -> _Session:
        """Refresh the session (or log in again if the refresh token is refused)."""
        with self._lock:
            if self._session is not None and self._session is not stale:
                return self._session  # another thread renewed it meanwhile
            resp = self._raw("POST", "com.atproto.server.refreshSession", what=f"{what}: refreshSession",
                             token=stale.refresh, acts=False)
            if _auth_failure(resp):
                self.log.info("replyd.bluesky.session_relogin", what=what, error=self._server_says(resp, resp.status_code))
                self._session = self._create_session(what)
            else:
                self._raise_for_status(resp, what=f"{what}: refreshSession", bucket="com.atproto.server.refreshSession",
                                       acts=False)
                self._session = self._parse_session(resp, f"{what}: refreshSession", stale.did)
            return self._session

    def _create_session(self, what: str) -> _Session:
        w = f"{what}: createSession"
        resp = self._raw("POST", "com.atproto.server.createSession", what=w, token=None, acts=False,
                         body={"identifier": self._identifier, "password": self.s.app_password.get_secret_value()})
        if _auth_failure(resp):
            raise DefinitelyNotSent(f"{w}: HTTP {resp.status_code} ({self._server_says(resp, 'refused')})",
                                    status=resp.status_code)
        self._raise_for_status(resp, what=w, bucket="com.atproto.server.createSession", acts=False)
        session = self._parse_session(resp, w, None)
        self.log.info("replyd.bluesky.session", did=session.did, handle=session.handle)
        return session

    def _parse_session(self, resp: httpx.Response, what: str, expect_did: str | None) -> _Session:
        try:
            body = _http.json_body(resp, what, dict)
            did = _http.field(body, "did", what)
            session = _Session(
                did=did,
                handle=_http.field(body, "handle", what, default=""),
                access=SecretStr(_http.field(body, "accessJwt", what)),
                refresh=SecretStr(_http.field(body, "refreshJwt", what)),
            )
        except BadResponse as exc:
            raise DefinitelyNotSent(f"{exc.detail} (no session, nothing sent)", status=resp.status_code) from None
        for name, token in (("accessJwt", session.access), ("refreshJwt", session.refresh)):
            # Sent back as an Authorization header: anything but printable ASCII could never be, and httpx
            # would raise UnicodeEncodeError on the next request instead of a ReplydError.
            value = token.get_secret_value()
            if not value or not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
                raise DefinitelyNotSent(f"{what}: field {name} is not a usable token (no session, nothing sent)",
                                        status=resp.status_code)
        if not did.startswith("did:") or (expect_did is not None and did != expect_did):
            raise DefinitelyNotSent(f"{what}: session is for an unexpected DID", status=resp.status_code)
        return session

    def _own_did(self, what: str) -> str:
        return self._ensure_session(what).did

    # --- parsing --------------------------------------------------------------------

    def _post_parent(self, post: Any, what: str) -> Parent:
        """Parse a post view (or a notification, which has the same fields) into a Parent."""
        if not isinstance(post, dict):
            raise BadResponse(f"{what}: post is not an object")
        uri = _http.field(post, "uri", what)
        try:
            at = AtUri.parse(uri)
        except ValueError:
            raise BadResponse(f"{what}: field uri is not an at:// record URI") from None
        if at.collection != POST_NSID:
            raise BadResponse(f"{what}: {uri} is not an {POST_NSID}")
        cid = _http.field(post, "cid", what)
        did = _http.field(post, "author.did", what)
        handle = _http.field(post, "author.handle", what, default="")
        record = _http.field(post, "record", what, dict)
        rtype = _http.field(record, "$type", what, default=POST_NSID)
        if rtype != POST_NSID:
            raise BadResponse(f"{what}: record of {uri} is a {rtype}, not a post")
        text = _http.field(record, "text", what, default="")
        created = _epoch(record.get("createdAt"))
        if created is None:
            created = _epoch(post.get("indexedAt"))
        reply = _http.field(record, "reply", what, dict, default=None)
        if reply is not None:
            root_uri = _http.field(record, "reply.root.uri", what)
            root_cid = _http.field(record, "reply.root.cid", what)
            in_reply_to = _http.field(record, "reply.parent.uri", what)
        else:
            root_uri, root_cid, in_reply_to = uri, cid, None
        labels = post["author"].get("labels")
        is_bot = isinstance(labels, list) and any(isinstance(lb, dict) and lb.get("val") == "bot" for lb in labels)
        # Who the post addresses (MCP's addressed scope): the DIDs of its mention facets; a reply's parent and
        # root name their authors in their URIs. Malformed facets address nobody and do not fail the post.
        facets = record.get("facets")
        mention_dids = [f["did"] for facet in (facets if isinstance(facets, list) else []) if isinstance(facet, dict)
                        for f in (facet.get("features") if isinstance(facet.get("features"), list) else [])
                        if isinstance(f, dict) and f.get("$type") == MENTION_FACET and isinstance(f.get("did"), str)]
        return Parent(
            id=uri,
            author_id=did,
            author_handle=handle,
            author_is_bot=is_bot,
            text=text,
            url=_web_url(handle or did, uri),
            created_at=created,
            thread_depth=0 if reply is None else 1,
            extra={"cid": cid, "root_uri": root_uri, "root_cid": root_cid, "in_reply_to": in_reply_to,
                   "mention_dids": mention_dids},
        )

    # --- Platform: identity and discovery ---------------------------------------------

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """Return the bsky.app page of one of the bot's replies (``reply_id`` is its at:// URI)."""
        return _web_url(identity.handle or identity.sender_id, reply_id)

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """Whether the post mentions the bot (a mention facet with its DID) or replies to a post or thread of its
        (its DID in ``reply.parent`` / ``reply.root``). A reply deeper in a thread the bot only took part in is
        notified by Bluesky but says nothing of the bot itself: not addressed here."""
        extra = parent.extra
        if identity.sender_id in (extra.get("mention_dids") or []):
            return True
        refs = (extra.get("in_reply_to"), extra.get("root_uri")) if extra.get("in_reply_to") else ()
        for uri in refs:
            try:
                if uri and AtUri.parse(uri).authority == identity.sender_id:
                    return True
            except ValueError:
                continue
        return False

    def whoami(self) -> Identity:
        """Return the account's DID (the sender id) and handle, checking the session."""
        what = "whoami"
        resp = self._xrpc("GET", "com.atproto.server.getSession", what=what)
        body = _http.json_body(resp, what, dict)
        return Identity(sender_id=_http.field(body, "did", what), handle=_http.field(body, "handle", what, default=""))

    def provider_key(self, sender_id: str, parent_id: str) -> str:
        """The record key of the reply to ``parent_id``: a deterministic, valid TID (see module doc)."""
        return rkey_for(sender_id, parent_id)

    def inbox(self, cursor: str | None) -> Page:
        """Return mention and reply notifications newer than ``cursor``, oldest first."""
        what = "inbox"

        def fetch(page_cursor: str | None) -> Any:
            return self._notifications(what, page_cursor)

        return self._scan_newer(what, fetch, "notifications", cursor, self._notification_parent)

    def _notifications(self, what: str, page_cursor: str | None) -> Any:
        params = [("limit", str(self.s.page_limit))] + [("reasons", r) for r in INBOX_REASONS]
        if page_cursor:
            params.append(("cursor", page_cursor))
        resp = self._xrpc("GET", "app.bsky.notification.listNotifications", what=what, proxy=True, params=params)
        return _http.json_body(resp, what, dict)

    def _notification_parent(self, item: Any, what: str) -> Parent | None:
        # Other reasons only appear if the server ignored ``reasons``; they still move the cursor.
        if item.get("reason") not in INBOX_REASONS:
            return None
        return self._post_parent(item, what)

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """Yield mentions and replies to the bot as the firehose carries them (``push.kind = "bluesky_firehose"``)."""
        from replyd.platforms.bluesky_firehose import Firehose

        if self._firehose is None:
            self._firehose = Firehose(self, self.firehose_url)
        return self._firehose.stream(stop)

    def search(self, query: str, cursor: str | None) -> Page:
        """Return posts matching ``query`` indexed after ``cursor``, oldest first."""
        what = "search"
        since = _since(cursor)

        def fetch(page_cursor: str | None) -> Any:
            params = [("q", query), ("sort", "latest"), ("limit", str(min(self.s.page_limit, 100)))]
            if since is not None:
                params.append(("since", since.raw))
            if page_cursor:
                params.append(("cursor", page_cursor))
            resp = self._xrpc("GET", "app.bsky.feed.searchPosts", what=what, proxy=True, params=params)
            return _http.json_body(resp, what, dict)

        return self._scan_newer(what, fetch, "posts", cursor, lambda item, w: self._post_parent(item, w))

    def _scan_newer(
        self,
        what: str,
        fetch: Callable[[str | None], Any],
        items_key: str,
        cursor: str | None,
        parse: Callable[[Any, str], Parent | None],
    ) -> Page:
        """Page back from the newest item until one at or before ``cursor``; new parents oldest first.

        When ``max_pages`` ends before the cursor, the returned cursor is a gap (``_http.GapCursor``): the next
        poll pages on from where this one stopped, so the items in between are offered too, before newer ones.
        """
        gap = _http.GapCursor.decode(cursor)
        since = _since(cursor)
        newest = _Cursor.decode(gap.newest) if gap is not None else since
        found: dict[str, tuple[float, Parent]] = {}
        page_cursor: str | None = gap.page if gap is not None else None
        pages = self.s.max_pages if since is not None else 1
        for page_no in range(pages):
            try:
                body = fetch(page_cursor)
                items = _http.field(body, items_key, what, list)
            except PlatformError as exc:
                refused = self._gap_refused(what, gap, page_no, exc)
                if refused is not None:
                    return refused
                self._partial(what, page_no, exc)
                # Pages so far do not reach the cursor: offer what was read, keep the old cursor.
                return Page(parents=_oldest_first(found), cursor=cursor)
            reached = False
            for item in items:
                got = self._read(what, item, lambda it: (_http.field(it, "uri", what), _indexed(it, what)))
                if got is None:
                    continue
                uri, (t, t_raw) = got
                if since is not None and since.covers(t, uri):
                    reached = True
                    continue
                if newest is None or t > newest.at:
                    newest = _Cursor(t, t_raw, frozenset({uri}))
                elif t == newest.at:
                    newest = _Cursor(newest.at, newest.raw, newest.uris | {uri})
                parent = self._read(what, item, lambda it: parse(it, what))
                if parent is not None:
                    prev = found.get(parent.id)
                    if prev is None or t < prev[0]:
                        found[parent.id] = (t, parent)
            nxt = body.get("cursor")
            if since is None or reached or not items or not isinstance(nxt, str) or not nxt or nxt == page_cursor:
                break
            page_cursor = nxt
        else:
            if since is not None and newest is not None and page_cursor:
                # The budget ended before the cursor: the next poll resumes at the next page.
                self.log.warning("replyd.bluesky.gap", what=what, pages=pages)
                return Page(parents=_oldest_first(found),
                            cursor=_http.GapCursor(since.encode(), newest.encode(), page_cursor).encode())
        return Page(parents=_oldest_first(found), cursor=newest.encode() if newest else cursor)

    def refind(self, since: float) -> list[Parent]:
        """Re-read mention and reply notifications indexed at or after epoch ``since`` (no cursor)."""
        # replyd's epoch on the platform's clock, erring early (unmeasured: as it is, a wider window would
        # offer parents older than the configured look-back)
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        what = "refind"
        found: dict[str, tuple[float, Parent]] = {}
        page_cursor: str | None = None
        for _ in range(self.s.max_pages):
            body = self._notifications(what, page_cursor)
            items = _http.field(body, "notifications", what, list)
            oldest: float | None = None
            for item in items:
                indexed = self._read(what, item, lambda it: _indexed(it, what))
                if indexed is None:
                    continue
                t = indexed[0]
                oldest = t if oldest is None else min(oldest, t)
                parent = self._read(what, item, lambda it: self._notification_parent(it, what)) if t >= since else None
                if parent is not None and parent.id not in found:
                    found[parent.id] = (t, parent)
            nxt = body.get("cursor")
            if not items or (oldest is not None and oldest < since) or not isinstance(nxt, str) or not nxt:
                break
            if nxt == page_cursor:
                break
            page_cursor = nxt
        return _oldest_first(found)

    def resolve(self, ref: str) -> Parent:
        """Turn an ``at://`` URI or a ``https://bsky.app/profile/<actor>/post/<rkey>`` URL into the served parent."""
        what = "resolve"
        ref = ref.strip()
        if ref.startswith("at://"):
            try:
                at = AtUri.parse(ref)
            except ValueError:
                raise Rejected(f"{what}: not an at:// record URI") from None
        elif urlsplit(ref).scheme in ("http", "https"):
            parts = [unquote(p) for p in urlsplit(ref).path.split("/") if p]
            if len(parts) != 4 or parts[0] != "profile" or parts[2] != "post" or not parts[1] or not parts[3]:
                raise Rejected(f"{what}: not a post URL (/profile/<handle>/post/<rkey>)")
            at = AtUri(parts[1].removeprefix("@"), POST_NSID, parts[3])
        else:
            raise Rejected(f"{what}: expected an at:// URI or a post URL")
        if at.collection != POST_NSID:
            raise Rejected(f"{what}: {at.collection} records cannot be answered")
        did = at.authority if at.authority.startswith("did:") else self._resolve_handle(at.authority, what)
        uri = str(AtUri(did, POST_NSID, at.rkey))
        resp = self._xrpc("GET", "app.bsky.feed.getPosts", what=what, proxy=True, params=[("uris", uri)])
        posts = _http.field(_http.json_body(resp, what, dict), "posts", what, list)
        matching = [p for p in posts if isinstance(p, dict) and p.get("uri") == uri]
        if not matching:
            raise Rejected(f"{what}: no post found at {uri}")
        return self._post_parent(matching[0], what)

    def _resolve_handle(self, handle: str, what: str) -> str:
        resp = self._xrpc("GET", "com.atproto.identity.resolveHandle", what=what,
                          params=[("handle", handle.lower())])
        did = _http.field(_http.json_body(resp, what, dict), "did", what)
        if not did.startswith("did:"):
            raise BadResponse(f"{what}: resolveHandle returned no DID")
        return did

    # --- Platform: sending -------------------------------------------------------------

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Post ``text`` as a reply to ``parent`` at rkey ``provider_key`` (only ``replyd.guard`` calls this)."""
        what = "send"
        did = self._own_did(what)
        rkey = provider_key if is_tid(provider_key) else rkey_for(did, parent.id)
        if rkey != provider_key:
            self.log.warning("replyd.bluesky.provider_key_not_tid", parent_id=parent.id, rkey=rkey)
        refs = self._reply_refs(parent, what)
        record: dict[str, Any] = {
            "$type": POST_NSID,
            "text": text,
            "createdAt": _iso_now(self._clock.now()),
            "reply": refs,
        }
        if self.s.langs:
            record["langs"] = list(self.s.langs)
        body = {"repo": did, "collection": POST_NSID, "rkey": rkey, "record": record}
        try:
            resp = self._xrpc("POST", "com.atproto.repo.createRecord", what=what, body=body)
        except PlatformError as exc:
            # A taken rkey answers 500 here (other PDSes may say 400/409): look before deciding.
            landed = self._probe(did, rkey, parent.id, what, exc) if isinstance(exc, (MaybeSent, Rejected)) else None
            if landed is not None:
                self.log.info("replyd.bluesky.already_landed", parent_id=parent.id, reply_id=landed, status=exc.status)
                raise AlreadyLanded(f"{what}: our reply is already at rkey {rkey} ({exc.detail})",
                                    status=exc.status, reply_id=landed) from None
            self._send_failed(parent, exc)
            raise
        expected = str(AtUri(did, POST_NSID, rkey))
        try:
            uri = _http.field(_http.json_body(resp, what, dict), "uri", what)
        except BadResponse as exc:
            uri = None
            problem = exc.detail
        else:
            problem = f"{what}: created {uri}, expected {expected}"
        if uri != expected:
            err = MaybeSent(f"{problem} (after HTTP {resp.status_code})", status=resp.status_code)
            landed = self._probe(did, rkey, parent.id, what, err)
            if landed is not None:
                raise AlreadyLanded(f"{what}: our reply is at rkey {rkey}", status=resp.status_code, reply_id=landed)
            raise err
        self.log.info("replyd.bluesky.sent", parent_id=parent.id, reply_id=uri)
        return Sent(reply_id=uri, url=_web_url(self._session.handle if self._session else did, uri))

    def post_limit(self, parent: Parent) -> Limit:
        """``PostLimit``: a post's text is at most 300 graphemes (app.bsky.feed.post's maxGraphemes)."""
        return Limit(MAX_GRAPHEMES, "graphemes", self.s.part_marker)

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """``PostLimit``: the next part answers the previous one in the same thread (its refs read at send)."""
        return Parent(id=previous_reply_id, author_id=self._session.did if self._session else "")

    def _own_refs(self, uri: str, what: str) -> tuple[str, str, str] | None:
        """(cid, root uri, root cid) of one of the bot's own posts, read from its PDS (read-your-writes: a part
        just sent is there before the AppView indexed it); None when ``uri`` is not an own post."""
        try:
            at = AtUri.parse(uri)
        except ValueError:
            return None
        if self._session is None or at.authority != self._session.did or at.collection != POST_NSID:
            return None
        try:
            rec = self._get_record(at.authority, at.rkey, f"{what}: getRecord")
        except PlatformError as exc:  # nothing was sent yet
            raise DefinitelyNotSent(f"{what}: could not read the parent's refs: {exc.detail}") from None
        if rec is None or not isinstance(rec.get("cid"), str):
            raise DefinitelyNotSent(f"{what}: own post {uri} not found on the PDS")
        root = (rec["value"].get("reply") or {}).get("root") or {}
        if isinstance(root.get("uri"), str) and isinstance(root.get("cid"), str):
            return rec["cid"], root["uri"], root["cid"]
        return rec["cid"], uri, rec["cid"]

    def _reply_refs(self, parent: Parent, what: str) -> dict[str, Any]:
        """``reply.root`` and ``reply.parent`` strong refs; fetch the parent if its snapshot lacks them."""
        extra = parent.extra or {}
        cid, root_uri, root_cid = extra.get("cid"), extra.get("root_uri"), extra.get("root_cid")
        own = None if isinstance(cid, str) and cid else self._own_refs(parent.id, what)
        if own is not None:  # a part of a long answer answering the part before it
            cid, root_uri, root_cid = own
        if not (isinstance(cid, str) and cid and isinstance(root_uri, str) and root_uri
                and isinstance(root_cid, str) and root_cid):
            try:
                fresh = self.resolve(parent.id)
            except (DefinitelyNotSent, Rejected):
                raise
            except PlatformError as exc:  # nothing was sent yet
                raise DefinitelyNotSent(f"{what}: could not read the parent's refs: {exc.detail}") from None
            if fresh.id != parent.id:
                raise Rejected(f"{what}: parent id {parent.id!r} is not in served form ({fresh.id!r})")
            cid, root_uri, root_cid = fresh.extra["cid"], fresh.extra["root_uri"], fresh.extra["root_cid"]
        return {"root": {"uri": root_uri, "cid": root_cid}, "parent": {"uri": parent.id, "cid": cid}}

    def _get_record(self, repo: str, rkey: str, what: str) -> dict[str, Any] | None:
        """``getRecord`` of one own post: the body, or ``None`` if the PDS has no record at ``rkey``."""
        params = [("repo", repo), ("collection", POST_NSID), ("rkey", rkey)]
        try:
            resp = self._xrpc("GET", "com.atproto.repo.getRecord", what=what, params=params)
        except Rejected as exc:
            if exc.status == 400 and "RecordNotFound" in (exc.detail or ""):
                return None
            raise
        body = _http.json_body(resp, what, dict)
        _http.field(body, "uri", what)
        _http.field(body, "value", what, dict)
        return body

    def _probe(self, did: str, rkey: str, parent_id: str, what: str, cause: PlatformError) -> str | None:
        """After an ambiguous or refused create: the URI of our reply at ``rkey``, or ``None``.

        A record at ``rkey`` answering another parent means the key is taken for
        good (a hash collision): that is ``Rejected``, never a close.
        """
        try:
            rec = self._get_record(did, rkey, f"{what}: getRecord")
        except PlatformError as exc:
            self.log.warning("replyd.bluesky.probe_failed", rkey=rkey, problem=exc.detail)
            return None
        if rec is None:
            return None
        answers = _reply_parent_uri(rec.get("value"))
        if answers != parent_id:
            raise Rejected(
                f"{what}: rkey {rkey} already holds {rec['uri']}, which answers {answers!r}, not this parent "
                f"({cause.detail})",
                status=cause.status,
            )
        return rec["uri"]

    # --- Platform: read-back ---------------------------------------------------------------

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find own replies: ``getRecord`` at each row's rkey, then one own-feed pass, then threads.

        ``getRecord`` reads the PDS (read-your-writes): found or ``RecordNotFound``
        is conclusive at once, without waiting for the AppView. The own feed
        (``getAuthorFeed``) is read when any row is not found that way, to spot
        an own reply with another rkey; it makes a row ``checked`` only if it
        listed everything back to the row's opening minus a margin. A row
        neither way settled gets a per-parent ``getPostThread``.
        """
        rkeys: dict[str, set[str]] = {}
        for p in pending:
            key = p.provider_key if is_tid(p.provider_key) else rkey_for(sender_id, p.parent.id)
            rkeys.setdefault(p.parent.id, set()).add(key)

        def feed(opened: dict[str, float], found: _http.Found) -> set[str]:
            settled = self._check_records(sender_id, rkeys, found)
            if all(pid in found for pid in opened):
                return settled
            try:
                return settled | self._covered(opened, self._scan_own_feed(sender_id, opened, found))
            except PlatformError as exc:
                self.log.warning("replyd.bluesky.read_back_failed", source="feed", problem=exc.detail)
                return settled

        result = self._read_back(pending, source=("thread", "parent_id"), feed=feed,
                                 fallback=lambda pid, _, found: self._thread_replies(pid, sender_id, found))
        result.checked.update(result.found)  # an own reply found settles its row
        return result

    def _check_records(
        self, sender_id: str, rkeys: Mapping[str, set[str]], found: dict[str, dict[str, OwnReply]]
    ) -> set[str]:
        """The fast path: ``getRecord`` at every rkey; return the parents settled this way."""
        what = "read_back record"
        settled: set[str] = set()
        for pid, keys in rkeys.items():
            ok = True
            for rkey in sorted(keys):
                try:
                    rec = self._get_record(sender_id, rkey, what)
                except RateLimited as exc:
                    self.log.warning("replyd.bluesky.read_back_failed", source="record", problem=exc.detail)
                    return settled  # every further read would be refused the same way
                except PlatformError as exc:
                    self.log.warning("replyd.bluesky.read_back_failed", source="record", parent_id=pid, problem=exc.detail)
                    ok = False
                    continue
                if rec is None:
                    continue
                answers = _reply_parent_uri(rec.get("value"))
                if answers != pid:
                    self.log.error("replyd.bluesky.rkey_collision", parent_id=pid, rkey=rkey, holder=rec["uri"],
                              answers=answers)
                    ok = False
                    continue
                created = _epoch(rec["value"].get("createdAt"))
                found.setdefault(pid, {})[rec["uri"]] = OwnReply(rec["uri"], pid, created)
            if ok:
                settled.add(pid)
        return settled

    def _scan_own_feed(self, sender_id: str, opened: Mapping[str, float], found: _http.Found) -> float | None:
        """Page back through the own posts; return the epoch after which the listing is complete."""
        return self._walk_feed(self._own_feed(sender_id, opened, found), self._horizon(min(opened.values())))

    def _own_feed(self, sender_id: str, opened: Mapping[str, float], found: _http.Found) -> Iterator[list[float]]:
        what = "read_back feed"
        cursor: str | None = None
        for _ in range(self.s.max_pages):
            params = [("actor", sender_id), ("filter", "posts_with_replies"), ("limit", str(FEED_PAGE))]
            resp = self._xrpc("GET", "app.bsky.feed.getAuthorFeed", what=what, proxy=True,
                              params=params + ([("cursor", cursor)] if cursor else []))
            body = _http.json_body(resp, what, dict)
            feed = _http.field(body, "feed", what, list)
            # One unreadable item could be the reply we look for: the page is not conclusive.
            rows = [self._own_feed_item(item, what) for item in feed]
            for uri, author, in_reply_to, created, _ in rows:
                if author == sender_id and in_reply_to in opened:
                    found.setdefault(in_reply_to, {}).setdefault(uri, OwnReply(uri, in_reply_to, created))
            yield [sort_t for *_, sort_t in rows if sort_t is not None] if feed else [_http.END]
            nxt = body.get("cursor")
            if not isinstance(nxt, str) or not nxt:
                yield [_http.END]
            if not isinstance(nxt, str) or not nxt or nxt == cursor:
                return
            cursor = nxt

    @staticmethod
    def _own_feed_item(item: Any, what: str) -> tuple[str, str, str | None, float | None, float | None]:
        """``(uri, author DID, reply.parent.uri, createdAt, feed sort time)`` of a feed item."""
        if not isinstance(item, dict):
            raise BadResponse(f"{what}: feed item is not an object")
        uri = _http.field(item, "post.uri", what)
        author = _http.field(item, "post.author.did", what)
        record = _http.field(item, "post.record", what, dict)
        in_reply_to = _http.field(record, "reply.parent.uri", what, default=None)
        created = _epoch(record.get("createdAt"))
        indexed = _epoch(_http.field(item, "post.indexedAt", what))
        reason = _http.field(item, "reason", what, dict, default=None)
        if reason is not None:
            # A repost is listed at the repost's time, a pin out of order: neither dates the listing.
            sort_t = _epoch(reason.get("indexedAt")) if "Repost" in str(reason.get("$type", "")) else None
        elif indexed is None:
            raise BadResponse(f"{what}: field post.indexedAt is not an ISO-8601 time")
        else:
            sort_t = indexed if created is None else min(created, indexed)
        return uri, author, in_reply_to, created, sort_t

    def _thread_replies(self, parent_id: str, sender_id: str, found: _http.Found) -> bool:
        """Add the own direct replies in the parent's thread to ``found``; True if the listing was complete."""
        what = "read_back thread"
        params = [("uri", parent_id), ("depth", "1"), ("parentHeight", "0")]
        resp = self._xrpc("GET", "app.bsky.feed.getPostThread", what=what, proxy=True, params=params)
        thread = _http.field(_http.json_body(resp, what, dict), "thread", what, dict)
        if "post" not in thread:
            raise BadResponse(f"{what}: thread is a {thread.get('$type', 'non-post')}")
        reply_count = _http.field(thread, "post.replyCount", what, int, default=0)
        replies = _http.field(thread, "replies", what, list, default=[])
        for r in replies:
            if not isinstance(r, dict) or "post" not in r:
                continue  # blocked or not-found placeholders still count towards completeness
            uri = _http.field(r, "post.uri", what)
            author = _http.field(r, "post.author.did", what)
            record = _http.field(r, "post.record", what, dict)
            if author == sender_id and _reply_parent_uri(record) == parent_id:
                found.setdefault(parent_id, {})[uri] = OwnReply(uri, parent_id, _epoch(record.get("createdAt")))
        return len(replies) >= reply_count

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return how many ancestors ``parent`` has in its thread, counting at most ``limit + 1``.

        A top-level post is 0, and a reply with ``limit`` 0 is 1, without a
        request. Otherwise one ``getPostThread`` (``depth=0``,
        ``parentHeight=limit+1``) per 250 ancestors (``THREAD_DEPTH_PAGE``). The
        ``parent`` links are counted. A ``notFoundPost`` or ``blockedPost`` (a
        deleted post, a block) counts as an ancestor and ends the chain, as does
        a reply whose parent the AppView leaves out (outside the thread's root,
        or hidden by a threadgate); if that unseen post is not the thread root
        (``record.reply.root``), the root above it counts too. The answer is
        then a lower bound.
        """
        if parent.thread_depth == 0 and not parent.extra.get("in_reply_to"):
            return 0
        if parent.thread_depth > limit:  # a lower bound already past the limit
            return parent.thread_depth
        what = "thread_depth"
        want = max(limit, 0) + 1
        depth = 0
        uri = parent.id
        root: str | None = None
        while True:
            height = min(want - depth, THREAD_DEPTH_PAGE)
            params = [("uri", uri), ("depth", "0"), ("parentHeight", str(height))]
            resp = self._xrpc("GET", "app.bsky.feed.getPostThread", what=what, proxy=True, params=params)
            # A server that ignored parentHeight may nest too deep to parse: json_body says so (BadResponse).
            body = _http.json_body(resp, what, dict)
            node = _http.field(body, "thread", what, dict)
            if "post" not in node:
                raise BadResponse(f"{what}: thread is a {node.get('$type', 'non-post')}")
            if root is None:
                root = _reply_root_uri(_http.field(node, "post.record", what, dict))
            steps = 0
            while steps < height:
                up = _http.field(node, "parent", what, dict, default=None)
                if up is None:
                    break
                steps += 1
                if "post" not in up:  # notFoundPost / blockedPost: nothing above it can be seen
                    unseen = up.get("uri")
                    return min(want, depth + steps + (1 if root is not None and unseen != root else 0))
                node = up
            depth += steps
            if depth >= want:
                return depth
            unseen = _reply_parent_uri(_http.field(node, "post.record", what, dict))
            if unseen is None:
                return depth  # reached the thread root
            if steps < height:
                # A reply whose parent the AppView left out: count that parent, see no further.
                self.log.info("replyd.bluesky.thread_cut", parent_id=parent.id, at=_http.field(node, "post.uri", what))
                return min(want, depth + 1 + (1 if root is not None and unseen != root else 0))
            uri = _http.field(node, "post.uri", what)  # parentHeight capped below what is wanted

    def delete(self, reply_id: str) -> None:
        """Delete one own post; one that is already gone counts as deleted."""
        what = "delete"
        try:
            at = AtUri.parse(reply_id)
        except ValueError:
            raise Rejected(f"{what}: {reply_id!r} is not an at:// record URI") from None
        did = self._own_did(what)
        if at.authority != did or at.collection != POST_NSID:
            raise Rejected(f"{what}: {reply_id} is not one of this account's posts")
        self._xrpc("POST", "com.atproto.repo.deleteRecord", what=what,
                   body={"repo": did, "collection": POST_NSID, "rkey": at.rkey})
        self.log.info("replyd.bluesky.deleted", reply_id=reply_id)

# --- helpers ------------------------------------------------------------------------------


def _oldest_first(found: Mapping[str, tuple[float, Parent]]) -> list[Parent]:
    return [p for _, p in sorted(found.values(), key=lambda tp: (tp[0], tp[1].id))]


def _indexed(item: dict[str, Any], what: str) -> tuple[float, str]:
    """An item's ``indexedAt`` as (epoch, the raw text a cursor keeps)."""
    raw = _http.field(item, "indexedAt", what)
    t = _epoch(raw)
    if t is None:
        raise BadResponse(f"{what}: field indexedAt is not an ISO-8601 time")
    return t, raw


def _reply_parent_uri(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    reply = record.get("reply")
    parent = reply.get("parent") if isinstance(reply, dict) else None
    uri = parent.get("uri") if isinstance(parent, dict) else None
    return uri if isinstance(uri, str) else None


def _reply_root_uri(record: Any) -> str | None:
    reply = record.get("reply") if isinstance(record, dict) else None
    root = reply.get("root") if isinstance(reply, dict) else None
    uri = root.get("uri") if isinstance(root, dict) else None
    return uri if isinstance(uri, str) else None


def _xrpc_error(resp: httpx.Response) -> str:
    """The XRPC ``error`` name of a response body (``ExpiredToken``…), or ``""``."""
    data = _http.error_json(resp)
    name = data.get("error") if isinstance(data, dict) else None
    return name if isinstance(name, str) else ""


def _auth_failure(resp: httpx.Response) -> bool:
    """Whether the PDS refused the token (it answers 400 ExpiredToken/InvalidToken, or 401)."""
    if resp.status_code == 401:
        return True
    return resp.status_code == 400 and _xrpc_error(resp) in ("ExpiredToken", "InvalidToken")
