"""The Mastodon adapter: mentions, search, replies and read-back over the REST API.

Settings: ``[platforms.<name>]`` with ``kind = "mastodon"``; each key is a field of
``MastodonPlatform.Settings`` below, with its meaning beside it.

Error mapping at this boundary (the shared table is in ``_http.py``)::

    what happened                                   send (POST),       delete             reads (GET)
                                                    edit (PUT)
    ----------------------------------------------  -----------------  -----------------  -----------------
    connect refused, DNS, ConnectTimeout,           DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
      PoolTimeout, TLS handshake
    local rate limit spent (remaining 0, reset      RateLimited        RateLimited        RateLimited
      in the future): refused before sending
    ReadTimeout, WriteTimeout, ReadError,           MaybeSent          MaybeSent          DefinitelyNotSent
      WriteError, RemoteProtocolError, other
    429                                             RateLimited        RateLimited        RateLimited
    401, 403 (auth), 408                            DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    404 (parent, target or edited status gone)      Rejected           treated as done    Rejected
    400, 409, 410, 413, 422, other 4xx              Rejected           Rejected           Rejected
    500, 502, 503, 504 (HTML pages too)             MaybeSent          MaybeSent          DefinitelyNotSent
    2xx with unreadable body / wrong parent         MaybeSent          -                  BadResponse

``retry_after_s`` comes from ``Retry-After`` (seconds or HTTP-date), else from
``X-RateLimit-Reset`` (an ISO time on Mastodon) minus the injected clock's now.
Nothing branches on the ``error`` text: Mastodon localises it.

Ids are the strings Mastodon serves; they are only ever compared as
``(len, str)`` to pick the newest cursor, never converted to int.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit


from pydantic import Field

from replyd.errors import BadResponse, MaybeSent, PlatformError, Rejected
from replyd.parts import Limit
from replyd.platforms.base import Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Token, register_platform
from replyd.platforms import _http, mentions, unreadable
from replyd.platforms._http import id_order

# Widest first: a reply is never more visible than the post it answers.
VISIBILITIES = ("public", "unlisted", "private", "direct")

# Mastodon caps account statuses at 40 per page whatever limit is asked.
DEFAULT_MAX_CHARS = 500  # Mastodon's post limit when the instance does not say its own
READ_BACK_PAGE = 40
# An authenticated /context lists at most this many descendants; a full list may be cut.
CONTEXT_LIMIT = 4096

_STATUSES_PATH = "/api/v1/statuses"


def _at(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _mentions(text: str, acct: str) -> bool:
    """Whether ``text`` already mentions ``@acct`` (not merely a longer handle)."""
    # A trailing "." ends a sentence; ".org" or "-x" would make it another domain.
    pattern = r"(?<![\w@])@" + re.escape(acct) + r"(?![\w@-]|\.[\w-])"
    return re.search(pattern, text, flags=re.IGNORECASE) is not None


@register_platform("mastodon")
class MastodonPlatform(_http.StepSend, _http.HttpPlatform):
    """A Mastodon account as a replyd platform: mentions in, replies out, own posts read back."""

    class Settings(_http.HttpSettings):
        """``kind = "mastodon"``; ``instance`` defaults to ``mastodon:<base_url>``."""

        URLS: ClassVar[tuple[str, ...]] = ("base_url", "streaming_url")
        base_url: _http.Url  # the server root
        streaming_url: _http.Url | None = None  # where the notification stream is served (default: base_url)
        token: Token  # an access token with read + write:statuses
        listing_delay_s: float = Field(10.0, ge=0)
        idempotency: bool = True  # send Idempotency-Key with every reply
        # Default: the parent's. Never wider than the parent's: a direct parent gets a direct reply.
        visibility: Literal["public", "unlisted", "private", "direct"] | None = None
        mention_author: bool = True  # prefix "@acct " unless the text mentions them
        page_limit: int = Field(40, ge=1, le=80)  # items per listing page
        max_pages: int = Field(5, ge=1, le=1000)  # pages per poll / re-find
        # Own-feed pages one read-back may read back to its horizon: a page covers up to 40 of the bot's
        # statuses, so a sweep of many rows costs a few pages instead of one /context read per row.
        readback_max_pages: int = Field(100, ge=1, le=10_000)
        # The post limit a long answer is split by (replyd.parts); None: the instance's own, read at login from
        # /api/v2/instance configuration.statuses.max_characters (500, Mastodon's default, if it says none).
        max_characters: int | None = Field(None, ge=20)
        part_marker: bool = False  # end each part of a long answer with " (k/n)"

    s: Settings
    _max_characters: int | None = None  # read from the instance at login
    _own_id: str = ""  # the bot's account id, from login: a later part's parent is the bot's own status

    def _parent(self, obj: Any, what: str, at: str = "", *, unwrap: bool = False) -> Parent | None:
        """Parse the status at dotted path ``at`` of ``obj``; ``None`` for a reblog unless ``unwrap``."""
        status = _http.field(obj, at, what, dict) if at else obj
        if not isinstance(status, dict):
            raise BadResponse(f"{what}: status is not an object")
        if _http.field(obj, _at(at, "reblog"), what, dict, default=None) is not None:
            if not unwrap:
                return None
            at = _at(at, "reblog")
        sid = _http.field(obj, _at(at, "id"), what)
        author_id = _http.field(obj, _at(at, "account.id"), what)
        acct = _http.field(obj, _at(at, "account.acct"), what)
        created_at = _http.iso_field(obj, _at(at, "created_at"), what)
        content = _http.field(obj, _at(at, "content"), what, default="")
        in_reply_to = _http.field(obj, _at(at, "in_reply_to_id"), what, default=None)
        visibility = _http.field(obj, _at(at, "visibility"), what, default="")
        spoiler = _http.field(obj, _at(at, "spoiler_text"), what, default="")
        language = _http.field(obj, _at(at, "language"), what, default=None)
        url = _http.field(obj, _at(at, "url"), what, default="")
        account = _http.field(obj, _at(at, "account"), what, dict)
        # Who the status addresses, from Mastodon's own fields: mentions[].id (a direct status is visible to
        # exactly those) and in_reply_to_account_id. Malformed values address nobody (never guessed) and do not
        # fail the status: only MCP's addressed scope reads them.
        status_obj = _http.field(obj, at, what, dict) if at else obj
        mentions = status_obj.get("mentions")
        mention_ids = [m["id"] for m in mentions if isinstance(m, dict) and isinstance(m.get("id"), str)] \
            if isinstance(mentions, list) else []
        reply_to_account = status_obj.get("in_reply_to_account_id")
        reply_to_account = reply_to_account if isinstance(reply_to_account, str) else None
        return Parent(
            id=sid,
            author_id=author_id,
            author_handle=acct,
            author_is_bot=account.get("bot") is True,
            text=_http.html_to_text(content),
            url=url,
            created_at=created_at,
            thread_depth=0 if in_reply_to is None else 1,
            extra={
                "acct": acct,
                "visibility": visibility,
                "in_reply_to_id": in_reply_to,
                "in_reply_to_account_id": reply_to_account,
                "mention_ids": mention_ids,
                "spoiler_text": spoiler,
                "language": language,
            },
        )

    def _own_status(self, item: Any, what: str) -> tuple[str, str, str | None, float]:
        """``(id, account id, in_reply_to_id, created_at)`` of a read-back item, or BadResponse."""
        if not isinstance(item, dict):
            raise BadResponse(f"{what}: item is not an object")
        return (
            _http.field(item, "id", what),
            _http.field(item, "account.id", what),
            _http.field(item, "in_reply_to_id", what, default=None),
            _http.iso_field(item, "created_at", what),
        )

    # --- Platform -------------------------------------------------------------------

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """Return the status page of one of the bot's replies (``/@acct/id``), as Mastodon serves it."""
        return f"{self.s.base_url}/@{identity.handle}/{reply_id}" if identity.handle else ""

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """Whether the status mentions the bot's account (a DM is a direct status that does) or replies to it."""
        extra = parent.extra
        return identity.sender_id in (extra.get("mention_ids") or []) or \
            (extra.get("in_reply_to_account_id") or None) == identity.sender_id

    def whoami(self) -> Identity:
        """Return the account's stable id (as served) and its acct."""
        what = "whoami"
        resp = self._call("GET", "/api/v1/accounts/verify_credentials", what=what)
        body = _http.json_body(resp, what, dict)
        identity = Identity(
            sender_id=_http.field(body, "id", what),
            handle=_http.field(body, "acct", what, default=""),
        )
        self._own_id = identity.sender_id
        if self.s.max_characters is None and self._max_characters is None:  # once: the limit does not move
            self._max_characters = self._instance_limit()
        return identity

    def _instance_limit(self) -> int:
        """The instance's post limit (``/api/v2/instance``); Mastodon's default 500 when it does not say."""
        what = "instance"
        try:
            body = _http.json_body(self._call("GET", "/api/v2/instance", what=what), what, dict)
            limit = _http.field(body, "configuration.statuses.max_characters", what, int, default=DEFAULT_MAX_CHARS)
        except PlatformError as exc:  # an older server (no v2) or a fork: the default limit
            self.log.info("replyd.mastodon.instance_unread", problem=exc.detail)
            return DEFAULT_MAX_CHARS
        return limit if isinstance(limit, int) and limit >= 20 else DEFAULT_MAX_CHARS

    def post_limit(self, parent: Parent) -> Limit:
        """``PostLimit``: the instance's characters, less the "@acct " ``send`` puts before each part."""
        size = self.s.max_characters or self._max_characters or DEFAULT_MAX_CHARS
        acct = parent.extra.get("acct") or parent.author_handle
        if self.s.mention_author and acct:
            size -= len(f"@{acct} ")
        return Limit(size, "chars", self.s.part_marker)

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """``PostLimit``: the next part answers the previous one (a thread chain), addressed to the same person."""
        return Parent(id=previous_reply_id, author_id=self._own_id, author_handle=parent.author_handle,
                      extra={"acct": parent.extra.get("acct") or parent.author_handle,
                             "visibility": parent.extra.get("visibility")})

    def inbox(self, cursor: str | None) -> Page:
        """Return mentions newer than ``cursor`` (a notification id), oldest first.

        With a cursor, pages forward with ``min_id`` along the ``prev`` links so
        nothing between polls is skipped; without one, only the newest page.
        """
        what = "inbox"
        base = [("types[]", "mention"), ("limit", str(self.s.page_limit))]
        newest = cursor
        found: dict[str, tuple[str, Parent]] = {}
        min_id = cursor
        pages = self.s.max_pages if cursor is not None else 1
        for page_no in range(pages):
            params = base + ([("min_id", min_id)] if min_id is not None else [])
            try:
                resp = self._call("GET", "/api/v1/notifications", what=what, params=params)
                items = _http.json_body(resp, what, list)
            except PlatformError as exc:
                self._partial(what, page_no, exc)  # the pages read so far are contiguous above the cursor
                break
            for item in items:
                nid = self._take_mention(item, what, found, after=cursor)
                if nid is not None and (newest is None or id_order(nid) > id_order(newest)):
                    newest = nid
            if cursor is None or not items:
                break
            nxt = _http.link_param(resp, "prev", "min_id")
            if nxt is None or (min_id is not None and id_order(nxt) <= id_order(min_id)):
                break
            min_id = nxt
        parents = [p for _, p in sorted(found.values(), key=lambda t: id_order(t[0]))]
        if newest is None:
            # The first look found no notification at all: everything from now on is new. Without this mark
            # the next poll would again read only the newest page and skip the rest of a burst.
            newest = "0"
        return Page(parents=parents, cursor=newest)

    def _take_mention(
        self, item: Any, what: str, found: dict[str, tuple[str, Parent]], *, after: str | None
    ) -> str | None:
        """Add the mention's parent to ``found``; return the notification id (for the cursor)."""
        try:
            if not isinstance(item, dict):
                raise BadResponse(f"{what}: notification is not an object")
            nid = _http.field(item, "id", what)
        except unreadable.ERRORS as exc:
            self._skipped(what, exc, item)
            return None
        if after is not None and id_order(nid) <= id_order(after):
            return None
        # Other types only appear if the server ignored types[]; they still move the cursor.
        if item.get("type") != "mention":
            return nid
        try:
            parent = self._parent(item, what, "status")
        except unreadable.ERRORS as exc:
            self._skipped(what, exc, item)
            return nid
        if parent is not None:
            found.setdefault(parent.id, (nid, parent))
        return nid

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """Yield mentions as the server pushes them (``/api/v1/streaming/user/notification``, server-sent events).

        Only what arrives while the stream is open: the inbox poll (the backstop) reads anything the stream
        missed. Returns when the server closes the stream or ``stop`` is set; raises a ``PlatformError`` when
        it cannot be opened or breaks (a read: nothing was sent).
        """
        what = "stream"
        url = (self.s.streaming_url or self.s.base_url) + "/api/v1/streaming/user/notification"
        for event in _http.stream_events(self._http, url, what=what, stop=stop, secrets=self._secrets(), auth=self._auth):
            if event.event != "notification":
                continue  # heartbeats arrive as comments; other event kinds are not mentions
            try:
                item = json.loads(event.data)
            except (ValueError, RecursionError):
                self._skipped(what, BadResponse(f"{what}: event data is not JSON"), None)
                continue
            found: dict[str, tuple[str, Parent]] = {}
            self._take_mention(item, what, found, after=None)
            for _nid, parent in found.values():
                yield parent

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """Return the parent of a ``mention`` delivery (a notification as the stream sends it), or why none."""
        # Mastodon has no per-account webhooks (its admin webhooks need an admin): this serves the sim's sender,
        # which pushes the stream's notification JSON; a real bot holds the stream (kind mastodon_stream).
        if event != "mention":
            return f"{event or 'an unnamed event'} is not answered"
        if not isinstance(payload, dict) or payload.get("type") != "mention":
            raise BadResponse("webhook: a mention delivery must be a notification object of type mention")
        parent = self._parent(payload, "webhook", "status")
        return [parent] if parent is not None else "a reblog is not answered"

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """Always None: a mention delivery is the account's own notification, the inbox poll's own item."""
        return None

    def search(self, query: str, cursor: str | None) -> Page:
        """Return statuses matching ``query`` newer than ``cursor`` (a status id), oldest first."""
        what = "search"
        # Resuming a gap (the last poll ran out of max_pages before its cursor): read on from its offset. Hits
        # made since push the gap's hits to later offsets, never earlier, so reading on from there skips none.
        gap = _http.GapCursor.decode(cursor)
        base = gap.since if gap is not None else cursor
        newest = base
        found: dict[str, Parent] = {}
        offset = int(gap.page) if gap is not None else 0
        gap_offset: int | None = None  # set when max_pages ends before the cursor
        for page_no in range(self.s.max_pages):
            params = [
                ("q", query),
                ("type", "statuses"),
                ("resolve", "false"),
                ("limit", str(self.s.page_limit)),
            ]
            if base is not None:
                params.append(("min_id", base))
            if offset:
                params.append(("offset", str(offset)))
            try:
                resp = self._call("GET", "/api/v2/search", what=what, params=params)
            except PlatformError as exc:
                refused = self._gap_refused(what, gap, page_no, exc)
                if refused is None:
                    raise
                return refused
            body = _http.json_body(resp, what, dict)
            statuses = _http.field(body, "statuses", what, list)
            for item in statuses:
                try:
                    parent = self._parent(item, what)
                except unreadable.ERRORS as exc:
                    self._skipped(what, exc, item)
                    continue
                if parent is None or (base is not None and id_order(parent.id) <= id_order(base)):
                    continue
                found.setdefault(parent.id, parent)
                if newest is None or id_order(parent.id) > id_order(newest):
                    newest = parent.id
            if len(statuses) < self.s.page_limit:
                break
            offset += len(statuses)
        else:
            gap_offset = offset if base is not None else None
        parents = sorted(found.values(), key=lambda p: id_order(p.id))
        # After a gap, the newest the first scan saw: a newer hit read while resuming is read again next poll.
        newest_cursor = gap.newest if gap is not None else newest
        if gap_offset is None:
            return Page(parents=parents, cursor=newest_cursor)
        self.log.warning("replyd.mastodon.gap", what=what, pages=self.s.max_pages)
        return Page(parents=parents, cursor=_http.GapCursor(base or "", newest_cursor or "", str(gap_offset)).encode())

    def refind(self, since: float) -> list[Parent]:
        """Re-read mentions notified at or after epoch ``since``, paging back (no cursor)."""
        # replyd's epoch on the platform's clock, erring early (unmeasured: as it is, a wider window would
        # offer parents older than the configured look-back)
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        what = "refind"
        base = [("types[]", "mention"), ("limit", str(self.s.page_limit))]
        found: dict[str, tuple[str, Parent]] = {}
        max_id: str | None = None
        for _ in range(self.s.max_pages):
            params = base + ([("max_id", max_id)] if max_id is not None else [])
            resp = self._call("GET", "/api/v1/notifications", what=what, params=params)
            items = _http.json_body(resp, what, list)
            oldest: float | None = None
            for item in items:
                got = self._read(what, item, lambda it: (_http.field(it, "id", what),
                                                         _http.iso_field(it, "created_at", what)))
                if got is None:
                    continue
                nid, created = got
                oldest = created if oldest is None else min(oldest, created)
                if created < since or item.get("type") != "mention":
                    continue
                try:
                    parent = self._parent(item, what, "status")
                except unreadable.ERRORS as exc:
                    self._skipped(what, exc, item)
                    continue
                if parent is not None:
                    found.setdefault(parent.id, (nid, parent))
            if not items or (oldest is not None and oldest < since):
                break
            nxt = _http.link_param(resp, "next", "max_id")
            if nxt is None or (max_id is not None and id_order(nxt) >= id_order(max_id)):
                break
            max_id = nxt
        return [p for _, p in sorted(found.values(), key=lambda t: id_order(t[0]))]

    def resolve(self, ref: str) -> Parent:
        """Turn a served status id or a status URL into the parent with its local served id."""
        what = "resolve"
        ref = ref.strip()
        if "://" not in ref:
            resp = self._call("GET", f"{_STATUSES_PATH}/{_http.seg(ref, what)}", what=what)
            return self._resolved(_http.json_body(resp, what, dict), what)
        if urlsplit(ref).scheme not in ("http", "https"):
            raise Rejected(f"{what}: only http(s) URLs can be resolved")
        params = [("q", ref), ("type", "statuses"), ("resolve", "true"), ("limit", "5")]
        resp = self._call("GET", "/api/v2/search", what=what, params=params)
        statuses = _http.field(_http.json_body(resp, what, dict), "statuses", what, list)
        matching = [s for s in statuses if isinstance(s, dict) and ref in (s.get("url"), s.get("uri"))]
        # A local web URL of a remote post (/@user@host/id) matches neither url nor uri,
        # but URL resolution returns that one status only.
        if not matching and len(statuses) == 1:
            matching = statuses
        if not matching:
            raise Rejected(f"{what}: no status found for the URL")
        return self._resolved(matching[0], what)

    def _resolved(self, status: Any, what: str) -> Parent:
        parent = self._parent(status, what, unwrap=True)
        if parent is None:  # unreachable: unwrap turns a reblog into its original
            raise BadResponse(f"{what}: reblog without original")
        return parent

    def _reply_visibility(self, parent: Parent) -> str | None:
        parent_vis = parent.extra.get("visibility")
        choices = [v for v in (self.s.visibility, parent_vis) if v in VISIBILITIES]
        if not choices:
            return None
        return max(choices, key=VISIBILITIES.index)

    def _addressed(self, parent: Parent, text: str) -> str:
        """``text`` as posted in reply to ``parent``: "@acct " first when ``mention_author`` and not there yet."""
        acct = parent.extra.get("acct") or parent.author_handle
        # A direct status goes to every account it mentions: only the author's mention stays live.
        if not self.s.allow_mentions:
            text = mentions.at_names(text, keep=(acct,))
        if self.s.mention_author and acct and not _mentions(text, acct):
            return f"@{acct} {text}"
        return text

    def _send_steps(self, parent: Parent, text: str, *, provider_key: str) -> _http.HttpSteps[Sent]:
        """Post ``text`` as a reply to ``parent`` (``send`` / ``asend``; only the guard's faces call those)."""
        what = "send"
        text = self._addressed(parent, text)
        form = {"status": text, "in_reply_to_id": parent.id}
        visibility = self._reply_visibility(parent)
        if visibility is not None:
            form["visibility"] = visibility
        headers: dict[str, str] = {}
        if self.s.idempotency and provider_key:
            if not (provider_key.isascii() and provider_key.isprintable()):
                raise Rejected(f"{what}: provider_key is not a valid header value")
            headers["Idempotency-Key"] = provider_key
        reply_id, in_reply_to, url = yield from self._created_steps(
            "POST", _STATUSES_PATH, parent, what=what, bucket="statuses", data=form, headers=headers,
            read=lambda body: (_http.field(body, "id", what), _http.field(body, "in_reply_to_id", what, default=None),
                               _http.field(body, "url", what, default="")))
        if in_reply_to != parent.id:
            # E.g. an Idempotency-Key reused for another parent returns that older status.
            raise MaybeSent(f"{what}: created status {reply_id} answers {in_reply_to!r}, not {parent.id!r}")
        self.log.info("replyd.mastodon.sent", parent_id=parent.id, reply_id=reply_id, visibility=visibility)
        return Sent(reply_id=reply_id, url=url)

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find own replies to the pending parents: one pass over the own feed, then per-parent context.

        A parent is ``checked`` only if the feed listed everything from before it
        was opened (minus a margin) up to now, or its context was read in full.
        """
        return self._read_back(pending, source=("context", "parent_id"),
            feed=lambda opened, found: self._covered(opened, self._scan_own_feed(sender_id, opened, found)),
            fallback=lambda pid, _, found: self._context_replies(pid, sender_id, found),
        )

    def _scan_own_feed(self, sender_id: str, opened: Mapping[str, float], found: _http.Found) -> float | None:
        """Page back through the own statuses; return the epoch after which the listing is complete."""
        return self._walk_feed(self._own_feed(sender_id, opened, found), self._horizon(min(opened.values())))

    def _own_feed(self, sender_id: str, opened: Mapping[str, float], found: _http.Found) -> Iterator[list[float]]:
        what = "read_back feed"
        path = f"/api/v1/accounts/{_http.seg(sender_id, what)}/statuses"
        max_id: str | None = None
        for _ in range(self.s.readback_max_pages):
            params = [("limit", str(READ_BACK_PAGE))] + ([("max_id", max_id)] if max_id else [])
            resp = self._call("GET", path, what=what, params=params)
            # One unreadable item could be the reply we look for: the page is not conclusive.
            page = [self._own_status(item, what) for item in _http.json_body(resp, what, list)]
            for sid, author, in_reply_to, created in page:
                if author == sender_id and in_reply_to in opened:
                    found.setdefault(in_reply_to, {})[sid] = OwnReply(sid, in_reply_to, created)
            yield [created for *_, created in page] or [_http.END]
            nxt = _http.link_param(resp, "next", "max_id")
            if nxt is None:
                yield [_http.END]
            if nxt is None or (max_id is not None and id_order(nxt) >= id_order(max_id)):
                return
            max_id = nxt

    def _context_replies(self, parent_id: str, sender_id: str, found: _http.Found) -> bool:
        """Add the own direct replies among the parent's descendants to ``found``; True if the list was complete."""
        what = "read_back context"
        resp = self._call("GET", f"{_STATUSES_PATH}/{_http.seg(parent_id, what)}/context", what=what)
        descendants = _http.field(_http.json_body(resp, what, dict), "descendants", what, list)
        for item in descendants:
            sid, author, in_reply_to, created = self._own_status(item, what)
            if author == sender_id and in_reply_to == parent_id:
                found.setdefault(parent_id, {})[sid] = OwnReply(sid, parent_id, created)
        return len(descendants) < CONTEXT_LIMIT

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return how many ancestors ``parent`` has in its thread, counting at most ``limit + 1``.

        A top-level status (no ``in_reply_to_id``) is 0, and a reply with ``limit``
        0 is 1, without a request. Otherwise one
        ``GET /api/v1/statuses/{id}/context`` whatever ``limit`` is: its
        ``ancestors`` are the whole chain, oldest first (up to 4096 for a logged-in
        caller); the answer is capped at ``limit + 1`` like every adapter's.
        Mastodon leaves out ancestors it does not show this account
        (deleted, private, or by a muted or blocked author); every break in the
        ``in_reply_to_id`` links counts as one ancestor, so the answer is then a
        lower bound.
        """
        expected = parent.extra.get("in_reply_to_id")
        if parent.thread_depth == 0 and expected is None:
            return 0
        if parent.thread_depth > limit:  # a lower bound already past the limit
            return parent.thread_depth
        what = "thread_depth"
        resp = self._call("GET", f"{_STATUSES_PATH}/{_http.seg(parent.id, what)}/context", what=what)
        ancestors = _http.field(_http.json_body(resp, what, dict), "ancestors", what, list)
        depth = gaps = 0
        for item in reversed(ancestors):  # nearest first
            if not isinstance(item, dict):
                raise BadResponse(f"{what}: ancestor is not an object")
            sid = _http.field(item, "id", what)
            if expected is not None and sid != expected:
                gaps += 1  # at least one status between is not shown to us
            depth += 1
            expected = _http.field(item, "in_reply_to_id", what, default=None)
        if expected is not None:
            gaps += 1  # the oldest listed status answers one we are not shown
        if gaps:
            self.log.info("replyd.mastodon.thread_gaps", parent_id=parent.id, listed=depth, gaps=gaps)
        return min(max(depth + gaps, parent.thread_depth), max(limit, 0) + 1)

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """``EditReply``: ``PUT /api/v1/statuses/:id`` with the text ``send`` would post (its "@acct " kept)."""
        what = "edit"
        text = self._addressed(parent, text)
        body = _http.json_body(self._call("PUT", f"{_STATUSES_PATH}/{_http.seg(reply_id, what)}", what=what,
                                          bucket="statuses", data={"status": text}), what, dict)
        if _http.field(body, "id", what, default=None) != reply_id:
            raise MaybeSent(f"{what}: the answer names status {body.get('id')!r}, not {reply_id!r}")
        self.log.info("replyd.mastodon.edited", parent_id=parent.id, reply_id=reply_id)

    def delete(self, reply_id: str) -> None:
        """Delete one own status; one that is already gone counts as deleted."""
        self._delete("DELETE", f"{_STATUSES_PATH}/{_http.seg(reply_id, 'delete')}", reply_id, bucket="delete")
