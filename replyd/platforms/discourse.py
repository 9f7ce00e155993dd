"""The Discourse adapter: notifications, search, replies and read-back over the JSON API.

Settings: ``[platforms.<name>]`` with ``kind = "discourse"``; each key is a field of
``DiscoursePlatform.Settings`` below, with its meaning beside it.

Ids: a parent is a post, keyed by its post id as served (a JSON number, kept as
its decimal string). A reply needs the post's *topic* and its *post number*
(its position in the topic, not its id), so both ride in ``Parent.extra``
(``topic_id``, ``post_number``). The sender id is the bot user's numeric id.

Notification types are Discourse's ``Notification.types`` numbers: mentioned 1,
replied 2, quoted 3, private_message 6, posted 9, group_mentioned 15,
watching_first_post 17. Discourse *collapses* replied / posted / private_message
notifications: a new one in a topic deletes the older ones and points at the
first unread post (``post_number``) while ``data.original_post_id`` names the
newest; so for those types every qualifying post in between is offered too.

Read-back is batched from ``/user_actions.json?filter=5,12`` (the bot's replies
and its private-message posts, newest first, offset paging) matched on
``(topic_id, reply_to_post_number)``; a parent the feed does not reach back to
is read from its topic (``/t/{id}.json``, then the post ids after the parent
through ``/t/{id}/posts.json?post_ids[]=``). Discourse's duplicate-text check is
never relied on: staff and admin keys skip it.

Edits (``EditReply``, a streamed answer growing its post): ``PUT
/posts/{id}.json`` with ``{"post": {"raw": …}}``. The site's ``max_post_length``
(default 32,000 characters) bounds the whole new text; the post stays the one
reply the read-back finds (its ``user_actions`` row and ``reply_to_post_number``
are unchanged). Sites limit edits per user and day: that is a 429 like any.

Error mapping at this boundary (the shared table is in ``_http.py``)::

    what happened                                   send (POST)        edit (PUT)         delete             reads (GET)
    ----------------------------------------------  -----------------  -----------------  -----------------  -----------------
    connect refused, DNS, ConnectTimeout,           DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
      PoolTimeout, TLS handshake
    local rate limit spent after a 429              RateLimited        RateLimited        RateLimited        RateLimited
    ReadTimeout, WriteTimeout, ReadError,           MaybeSent          MaybeSent          MaybeSent          DefinitelyNotSent
      WriteError, RemoteProtocolError, other
      (an edit's lost answer: it may have acted;
      repeating it sets the same raw)
    429 (Retry-After, else extras.wait_seconds)     RateLimited        RateLimited        RateLimited        RateLimited
    403, credentials still accepted (topic          Rejected           Rejected           DefinitelyNotSent  DefinitelyNotSent
      closed / archived, no permission; edit:
      not the bot's post, past the edit time
      limit)
    403, credentials refused on a re-check          DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    401, 408                                        DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    404 (topic or post deleted), 410                Rejected           Rejected           treated as done    Rejected
    422 ("Body is too similar", "title has          Rejected           Rejected           Rejected           Rejected
      already been used", too short; edit: "Body
      is limited to 32000 characters"), other 4xx
    500-599 (read-only mode, proxy pages)           MaybeSent          MaybeSent          MaybeSent          DefinitelyNotSent
    200 {"action": "enqueued"} (post held for       Rejected           -                  -                  -
      moderator approval: it may land later, so
      it is never retried)
    2xx with unreadable body                        MaybeSent          done (not read)    -                  BadResponse

A 403 on a send or an edit triggers one cheap GET of the identity endpoint: Discourse
answers a bad or revoked key with the same 403 (``invalid_access``) as a closed
topic, and the two need different handling (retry later vs. give up). The
status decides, never the (localised) error text.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal, Self
from urllib.parse import parse_qs, urlsplit

import httpx
from pydantic import Field, SecretStr, model_validator

from replyd.errors import BadResponse, ConfigError, DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Text, Texts, Token, register_platform,
)
from replyd.platforms import _http, unreadable
from replyd.platforms._http import id_order

# Discourse's Notification.types (app/models/notification.rb); stable across versions.
NOTIFICATION_TYPES: dict[str, int] = {
    "mentioned": 1,
    "replied": 2,
    "quoted": 3,
    "private_message": 6,
    "posted": 9,
    "group_mentioned": 15,
    "watching_first_post": 17,
}
DEFAULT_NOTIFICATION_TYPES = ("mentioned", "replied", "quoted", "private_message")
# PostAlerter::COLLAPSED_NOTIFICATION_TYPES (plus watching_category_or_tag, 36).
COLLAPSED_TYPES = frozenset({2, 6, 9, 36})
# UserAction types: REPLY and NEW_PRIVATE_MESSAGE (a reply in a PM is logged as the latter).
OWN_REPLY_ACTIONS = "5,12"
# /user_actions.json pages are 30 long on every version (the ``limit`` param is newer).
USER_ACTIONS_PAGE = 30
# /t/{id}/posts.json?post_ids[]= is asked in the client's own chunk size.
POST_IDS_CHUNK = 20
# Posts resolved for notifications and search hits, remembered so a re-find over the
# same notifications costs no request per notification (admin keys get 60 a minute).
POST_CACHE_SIZE = 2048

def _number(obj: Any, path: str, what: str, *, default: Any = ...) -> Any:
    """A post or topic number served as a JSON number (topic ids, post numbers)."""
    if default is ...:
        value = _http.field(obj, path, what, int)
    else:
        value = _http.field(obj, path, what, int, default=default)
    return value


def _error_text(resp: httpx.Response) -> str:
    """Discourse's ``{"errors": [...]}`` text (or the generic one), short, for logs only."""
    data = _http.error_json(resp)
    if isinstance(data, dict):
        errors = data.get("errors")
        if isinstance(errors, list):
            text = "; ".join(e for e in errors if isinstance(e, str))
            if text:
                return " ".join(text.split())[:200]
    return _http.server_error_text(resp)


def _wait_seconds(resp: httpx.Response) -> float | None:
    """``extras.wait_seconds`` of a Discourse 429 body."""
    data = _http.error_json(resp)
    extras = data.get("extras") if isinstance(data, dict) else None
    wait = extras.get("wait_seconds") if isinstance(extras, dict) else None
    if isinstance(wait, bool) or not isinstance(wait, (int, float, str)):
        return None
    try:
        value = float(wait)
    except ValueError:
        return None
    return value if value >= 0 and value == value and value != float("inf") else None


@register_platform("discourse")
class DiscoursePlatform(_http.StepSend, _http.HttpPlatform):
    """A Discourse account as a replyd platform: notifications in, replies out, own posts read back."""

    class Settings(_http.HttpSettings):
        """``kind = "discourse"``; ``instance`` defaults to ``discourse:<base_url>``."""

        base_url: _http.Url  # the forum root
        api_key: Token | None = None  # an admin/user API key (header Api-Key), with:
        api_username: Text | None = None  # the account the bot posts as (header Api-Username)
        user_api_key: Token | None = None  # instead of both: a User API key (header User-Api-Key)
        # 30: a POST the client gave up on can still finish inside the server's own request timeout.
        listing_delay_s: float = Field(30.0, ge=0)
        search_queries: Texts = []  # the queries the search poller runs
        # Which notifications are parents (NOTIFICATION_TYPES names).
        notification_types: Annotated[list[Literal[tuple(NOTIFICATION_TYPES)]],  # type: ignore[misc]
                                      Field(min_length=1, strict=False)] = list(DEFAULT_NOTIFICATION_TYPES)
        max_pages: int = Field(5, ge=1, le=1000)  # pages per poll / re-find / read-back

        @model_validator(mode="after")
        def _one_key(self) -> Self:
            if self.user_api_key and (self.api_key or self.api_username):
                raise ConfigError("discourse setting 'user_api_key': give either it or api_key + api_username, not both")
            if not self.user_api_key and not self.api_key:
                raise ConfigError("discourse setting 'api_key': required (with api_username), or give user_api_key")
            if not self.user_api_key and not self.api_username:
                raise ConfigError("discourse setting 'api_username': required with api_key")
            return self

    s: Settings
    HEADERS = {"Accept": "application/json"}

    def _setup(self) -> None:
        self._api_username = None if self.s.user_api_key else self.s.api_username
        self._types = frozenset(NOTIFICATION_TYPES[t] for t in self.s.notification_types)
        self._post_cache: OrderedDict[str, Parent] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.search_queries = tuple(self.s.search_queries)

    def _auth_headers(self) -> dict[str, SecretStr]:
        """``User-Api-Key``, or ``Api-Key`` + ``Api-Username``."""
        if self.s.user_api_key:
            return {"User-Api-Key": self.s.user_api_key}
        return {"Api-Key": self.s.api_key, "Api-Username": SecretStr(self.s.api_username)}  # type: ignore[dict-item,arg-type]

    def _wait_s(self, resp: httpx.Response) -> float | None:
        """``Retry-After``, else the body's ``extras.wait_seconds``."""
        wait = super()._wait_s(resp)
        return _wait_seconds(resp) if wait is None else wait

    def _error_text(self, resp: httpx.Response) -> str:
        """Discourse's ``{"errors": [...]}`` text (or the generic one)."""
        return _error_text(resp)

    # --- parsing --------------------------------------------------------------------

    def _post_parent(self, post: Any, what: str, *, private: bool | None = None) -> Parent:
        """Turn a serialized post (``/posts/{id}.json`` or a topic's post stream) into a parent."""
        if not isinstance(post, dict):
            raise BadResponse(f"{what}: post is not an object")
        pid = _http.served_id(post, "id", what)
        topic_id = _number(post, "topic_id", what)
        post_number = _number(post, "post_number", what)
        author_id = _http.served_id(post, "user_id", what)
        username = _http.field(post, "username", what, default="")
        created = _http.iso_field(post, "created_at", what)
        raw = _http.field(post, "raw", what, default=None)
        cooked = _http.field(post, "cooked", what, default="")
        slug = _http.field(post, "topic_slug", what, default=None)
        post_url = _http.field(post, "post_url", what, default=None)
        reply_to = _number(post, "reply_to_post_number", what, default=None)
        if post_url and post_url.startswith("/"):
            url = self.s.base_url + post_url
        else:
            url = f"{self.s.base_url}/t/{slug or 'topic'}/{topic_id}/{post_number}"
        extra: dict[str, Any] = {
            "topic_id": topic_id,
            "post_number": post_number,
            "reply_to_post_number": reply_to,
            "username": username,
            "topic_slug": slug,
        }
        if private is not None:
            extra["private_message"] = private
        return Parent(
            id=pid,
            author_id=author_id,
            author_handle=username,
            # Discourse's own bots (system, discobot) have negative user ids.
            author_is_bot=author_id.startswith("-"),
            text=raw if raw else _http.html_to_text(cooked),
            url=url,
            created_at=created,
            thread_depth=0 if post_number == 1 else 1,
            extra=extra,
        )

    # --- Platform -------------------------------------------------------------------

    def whoami(self) -> Identity:
        """Return the bot user's numeric id (as a string) and username."""
        what = "whoami"
        if self._api_username is not None:
            resp = self._call("GET", f"/u/{_http.seg(self._api_username, what)}.json", what=what)
            body = _http.json_body(resp, what, dict)
            root = "user"
        else:
            resp = self._call("GET", "/session/current.json", what=what)
            body = _http.json_body(resp, what, dict)
            root = "current_user"
        me = Identity(
            sender_id=_http.served_id(body, f"{root}.id", what),
            handle=_http.field(body, f"{root}.username", what, default=""),
        )
        self._me = me
        return me

    def _username(self) -> str:
        return self._api_username or self._identity().handle

    # inbox / refind --------------------------------------------------------------------

    def _notification_page(self, offset: int, what: str) -> tuple[list[Any], int | None]:
        """One page of ``/notifications.json``: its items and the next offset (None at the end)."""
        params = [("offset", str(offset))] if offset else None
        resp = self._call("GET", "/notifications.json", what=what, params=params)
        body = _http.json_body(resp, what, dict)
        items = _http.field(body, "notifications", what, list)
        total = _http.field(body, "total_rows_notifications", what, int, default=None)
        more = _http.field(body, "load_more_notifications", what, default=None)
        nxt = offset + len(items)
        if more:
            values = parse_qs(urlsplit(more).query).get("offset")
            if values and values[0].isdigit():
                nxt = int(values[0])
        if not items or nxt <= offset or (total is not None and nxt >= total):
            return items, None
        return items, nxt

    def inbox(self, cursor: str | None) -> Page:
        """Return parents from notifications newer than ``cursor`` (a notification id), oldest first.

        Without a cursor only the newest page is read. Notifications are
        resolved to their posts oldest first; if a resolution fails for a
        transient reason the cursor stops before it, so the next poll retries.
        """
        what = "inbox"
        fresh: list[tuple[str, dict[str, Any]]] = []
        offset = 0
        for page_no in range(self.s.max_pages if cursor is not None else 1):
            try:
                items, nxt = self._notification_page(offset, what)
            except PlatformError as exc:
                self._partial(what, page_no, exc)
                return self._notifications_to_page(fresh, cursor, complete=False, what=what)
            new, reached = self._newer(items, cursor, what)
            fresh += new
            if cursor is None or reached or nxt is None:
                break
            offset = nxt
        return self._notifications_to_page(fresh, cursor, complete=True, what=what)

    def _newer(self, items: list[Any], cursor: str | None, what: str) -> tuple[list[tuple[str, Any]], bool]:
        """The items newer than ``cursor`` as (id, item), and whether one at or before it was met."""
        fresh, reached = [], False
        for item in items:
            try:
                iid = _http.served_id(item, "id", what)
            except unreadable.ERRORS as exc:
                self._skipped(what, exc, item)
                continue
            if cursor is not None and id_order(iid) <= id_order(cursor):
                reached = True
            else:
                fresh.append((iid, item))
        return fresh, reached

    def _notifications_to_page(
        self, fresh: list[tuple[str, dict[str, Any]]], cursor: str | None, *, complete: bool, what: str
    ) -> Page:
        """Resolve fresh notifications oldest first; the cursor only moves over resolved ones.

        ``complete`` is False when the listing did not reach back to the old
        cursor: what was read is offered, but the cursor stays so the next poll
        reads the gap again.
        """
        found: dict[str, Parent] = {}
        newest = cursor
        # A notification id served twice (pages that shifted, a mangled copy): each copy is read, in the order
        # served, so a copy that cannot be read never hides the one that can (its parents are kept once).
        for nid, item in sorted(fresh, key=lambda t: id_order(t[0])):
            try:
                parents = self._notification_parents(item, what)
            except (Rejected, *unreadable.ERRORS) as exc:  # gone, forbidden or unreadable: skip for good
                self._skipped(what, exc, item)
                parents = []
            except PlatformError as exc:  # transient: stop here, the next poll retries from here
                self.log.warning("replyd.discourse.inbox_partial", notification_id=nid, problem=exc.detail)
                break
            for p in parents:
                found.setdefault(p.id, p)
            if complete and (newest is None or id_order(nid) > id_order(newest)):
                newest = nid
        return Page(parents=sorted(found.values(), key=lambda p: id_order(p.id)), cursor=newest)

    def _notification_parents(self, item: dict[str, Any], what: str) -> list[Parent]:
        """The posts a notification points at (several for a collapsed one); [] if not wanted."""
        ntype = _http.field(item, "notification_type", what, int)
        if ntype not in self._types:
            return []
        topic_id = _number(item, "topic_id", what, default=None)
        post_number = _number(item, "post_number", what, default=None)
        original = _http.served_id(item, "data.original_post_id", what, default=None)
        private = True if ntype == NOTIFICATION_TYPES["private_message"] else None
        if original is not None:
            newest = self._post_by_id(original, what, private=private, cached=True)
        elif topic_id is not None and post_number is not None:
            newest = self._post_by_number(topic_id, post_number, what, private=private)
        else:
            raise BadResponse(f"{what}: notification names no post")
        parents = [newest]
        first = post_number
        if (
            ntype in COLLAPSED_TYPES
            and topic_id is not None
            and first is not None
            and newest.extra["topic_id"] == topic_id
            and first < newest.extra["post_number"]
        ):
            parents = self._collapsed(topic_id, first, newest, ntype, what, private=private) + parents
        return parents

    def _collapsed(
        self, topic_id: int, first: int, newest: Parent, ntype: int, what: str, *, private: bool | None
    ) -> list[Parent]:
        """Posts from ``first`` up to (not including) ``newest`` that the collapsed notification stood for."""
        me = self._identity()
        out: list[Parent] = []
        after = first - 1
        last = newest.extra["post_number"]
        for _ in range(self.s.max_pages):
            params = [("post_number", str(after)), ("asc", "true")]
            resp = self._call("GET", f"/t/{topic_id}/posts.json", what=what, params=params)
            posts = _http.field(_http.json_body(resp, what, dict), "post_stream.posts", what, list)
            if not posts:
                return out
            for post in posts:
                try:
                    parent = self._post_parent(post, what, private=private)
                except unreadable.ERRORS as exc:
                    self._skipped(what, exc, post)
                    continue
                number = parent.extra["post_number"]
                after = max(after, number)
                if number >= last:
                    return out
                if parent.author_id == me.sender_id:
                    continue
                reply_to_user = post.get("reply_to_user") if isinstance(post, dict) else None
                to_me = isinstance(reply_to_user, dict) and str(reply_to_user.get("username", "")).lower() == me.handle.lower()
                # The first unread post is the one Discourse itself chose for the notification.
                if ntype != NOTIFICATION_TYPES["replied"] or to_me or number == first:
                    out.append(parent)
        self.log.warning("replyd.discourse.collapsed_truncated", topic_id=topic_id, after=after, last=last)
        return out

    def _post_by_id(self, post_id: str, what: str, *, private: bool | None = None, cached: bool = False) -> Parent:
        if cached:
            with self._cache_lock:
                hit = self._post_cache.get(post_id)
                if hit is not None:
                    self._post_cache.move_to_end(post_id)
                    return hit
        resp = self._call("GET", f"/posts/{_http.seg(post_id, what)}.json", what=what)
        parent = self._post_parent(_http.json_body(resp, what, dict), what, private=private)
        with self._cache_lock:
            self._post_cache[post_id] = parent
            self._post_cache.move_to_end(post_id)
            while len(self._post_cache) > POST_CACHE_SIZE:
                self._post_cache.popitem(last=False)
        return parent

    def _post_by_number(self, topic_id: int | str, post_number: int, what: str, *, private: bool | None = None) -> Parent:
        resp = self._call("GET", f"/t/{_http.seg(str(topic_id), what)}/{post_number}.json", what=what)
        posts = _http.field(_http.json_body(resp, what, dict), "post_stream.posts", what, list)
        for post in posts:
            if isinstance(post, dict) and post.get("post_number") == post_number:
                return self._post_parent(post, what, private=private)
        raise Rejected(f"{what}: post {post_number} not in topic {topic_id}")

    def refind(self, since: float) -> list[Parent]:
        """Re-read notifications created at or after epoch ``since`` (offset paging, no cursor)."""
        # replyd's epoch on the platform's clock, erring early (unmeasured: as it is, a wider window would
        # offer parents older than the configured look-back)
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        what = "refind"
        fresh: list[dict[str, Any]] = []
        offset = 0
        for page_no in range(self.s.max_pages):
            try:
                items, nxt = self._notification_page(offset, what)
            except PlatformError as exc:
                self._partial(what, page_no, exc)
                break
            older = False
            for item in items:
                created = self._read(what, item, lambda it: _http.iso_field(it, "created_at", what))
                if created is None:
                    continue
                if created < since:
                    older = True
                    continue
                fresh.append(item)
            if older or nxt is None:
                break
            offset = nxt
        found: dict[str, Parent] = {}
        for item in reversed(fresh):
            try:
                parents = self._notification_parents(item, what)
            except (Rejected, *unreadable.ERRORS) as exc:  # gone, forbidden or unreadable: skip for good
                self._skipped(what, exc, item)
                continue
            except PlatformError as exc:  # a failed read, no cursor here: the next re-find tries again
                self.log.warning("replyd.discourse.refind_partial", problem=exc.detail)
                continue
            for p in parents:
                found.setdefault(p.id, p)
        return sorted(found.values(), key=lambda p: id_order(p.id))

    # search ----------------------------------------------------------------------------

    def search(self, query: str, cursor: str | None) -> Page:
        """Return posts matching ``query`` newer than ``cursor`` (a post id), oldest first.

        ``order:latest`` is added unless the query orders itself. Each new hit is
        read from ``/posts/{id}.json`` (search hits carry no author id).
        """
        what = "search"
        q = query if "order:" in query else f"{query} order:latest"
        # Resuming a gap (the last poll ran out of max_pages before its cursor): read on from its page. Posts
        # made since push the gap's hits to later pages, never earlier, so reading on from there skips none.
        gap = _http.GapCursor.decode(cursor)
        base = gap.since if gap is not None else cursor
        start = int(gap.page) if gap is not None else 1
        hits: dict[str, Any] = {}
        gap_page: int | None = None  # set when max_pages ends before the cursor
        for page in range(start, start + (self.s.max_pages if base is not None else 1)):
            params = [("q", q)] + ([("page", str(page))] if page > 1 else [])
            try:
                resp = self._call("GET", "/search.json", what=what, params=params)
                body = _http.json_body(resp, what, dict)
                posts = _http.field(body, "posts", what, list, default=[])
            except PlatformError as exc:
                refused = self._gap_refused(what, gap, page - start, exc)
                if refused is not None:
                    return refused
                self._partial(what, page - start, exc)
                break
            new, older = self._newer(posts, base, what)
            for pid, post in new:
                hits.setdefault(pid, post)
            more = _http.field(body, "grouped_search_result.more_full_page_results", what, bool, default=None)
            if more is None:
                more = bool(_http.field(body, "grouped_search_result.more_posts", what, bool, default=False))
            if older or not more or not posts:
                break
        else:
            gap_page = (start + self.s.max_pages) if base is not None else None
        found: list[Parent] = []
        newest = base
        complete = True
        for pid in sorted(hits, key=id_order):
            try:
                parent = self._post_by_id(pid, what, cached=True)
            except (Rejected, *unreadable.ERRORS) as exc:
                self._skipped(what, exc, hits[pid])
            except PlatformError as exc:
                self.log.warning("replyd.discourse.search_partial", post_id=pid, problem=exc.detail)
                complete = False
                break
            else:
                found.append(parent)
            newest = pid if newest is None or id_order(pid) > id_order(newest) else newest
        if gap_page is None and gap is None:
            return Page(parents=found, cursor=newest)  # hits past a partial read are newer: read again next poll
        if not complete:
            return Page(parents=found, cursor=cursor)  # a gap half read: all of it again next poll
        newest_cursor = gap.newest if gap is not None else (newest or "")
        if gap_page is None:
            return Page(parents=found, cursor=newest_cursor or None)  # the gap is closed
        self.log.warning("replyd.discourse.gap", what=what, pages=self.s.max_pages)
        return Page(parents=found, cursor=_http.GapCursor(base or "", newest_cursor, str(gap_page)).encode())

    # resolve ---------------------------------------------------------------------------

    # webhooks ---------------------------------------------------------------------------

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """A ``post_created`` delivery's post (not the bot's own) as the parent the pollers build (the post id).

        Discourse sends every post of the forum to a webhook: ``webhook_scope`` keeps the ones that notify the bot.
        """
        what = f"webhook {event or '(no event)'}"
        if not isinstance(payload, dict):
            raise BadResponse(f"{what}: body is not a JSON object")
        if event != "post_created":
            return f"{event or 'an unnamed event'} is not answered"
        parent = self._post_parent(payload.get("post"), what)
        if parent.author_id == self._identity().sender_id:
            return "the bot's own post"
        return [parent]

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """None when the post would notify the bot with one of ``notification_types``; else ``not_addressed``.

        Told from the delivery alone: ``mentioned`` (``@name`` in the raw text), ``replied`` (a reply to one of
        the bot's posts) and ``quoted`` (a ``[quote="name, ...``). A private message, a group mention or a
        watched topic or category needs the forum's state the delivery does not carry: the pollers find those.
        """
        post = payload.get("post") if isinstance(payload, dict) else None
        if not isinstance(post, dict):
            return "not_addressed"
        name = self._identity().handle or self._username()
        if not name:
            return "not_addressed"
        raw = post.get("raw") if isinstance(post.get("raw"), str) else parent.text
        if NOTIFICATION_TYPES["mentioned"] in self._types and re.search(
                rf"(?<![\w@])@{re.escape(name)}(?![\w-])", raw, re.IGNORECASE):
            return None
        reply_to = post.get("reply_to_user")
        if (NOTIFICATION_TYPES["replied"] in self._types and isinstance(reply_to, dict)
                and str(reply_to.get("username") or "").lower() == name.lower()):
            return None
        if NOTIFICATION_TYPES["quoted"] in self._types and re.search(
                rf'\[quote="(?:{re.escape(name)}[,"]|[^"\]]*\busername:{re.escape(name)}\b)', raw, re.IGNORECASE):
            return None
        return "not_addressed"

    def resolve(self, ref: str) -> Parent:
        """Turn a post id, a ``/p/{id}`` link or a ``/t/[slug/]{topic}/{number}`` URL into the parent."""
        what = "resolve"
        ref = ref.strip()
        if ref.isdigit():
            return self._post_by_id(ref, what)
        parts = urlsplit(ref)
        if parts.scheme or parts.netloc:
            if parts.scheme not in ("http", "https"):
                raise Rejected(f"{what}: only http(s) URLs can be resolved")
            base = urlsplit(self.s.base_url)
            if (parts.hostname or "").lower() != (base.hostname or "").lower():
                raise Rejected(f"{what}: URL is not on {base.hostname}")
        path = parts.path
        prefix = urlsplit(self.s.base_url).path.rstrip("/")
        if prefix and path.startswith(prefix + "/"):
            path = path[len(prefix):]
        segs = [s for s in path.split("/") if s]
        if len(segs) == 2 and segs[0] == "p" and segs[1].isdigit():
            return self._post_by_id(segs[1], what)
        if segs and segs[0] == "t":
            nums = segs[1:]
            if nums and not nums[0].isdigit():
                nums = nums[1:]  # the slug
            if 1 <= len(nums) <= 2 and all(n.isdigit() for n in nums):
                number = int(nums[1]) if len(nums) == 2 else 1
                return self._post_by_number(nums[0], number, what)
        raise Rejected(f"{what}: not a Discourse post reference")

    # send ------------------------------------------------------------------------------

    def _send_steps(self, parent: Parent, text: str, *, provider_key: str) -> _http.HttpSteps[Sent]:
        """Post ``text`` as a reply to ``parent`` (``send`` / ``asend``; only the guard's faces call those).

        Discourse honours no idempotency key: ``provider_key`` is not sent.
        """
        what = "send"
        topic_id = parent.extra.get("topic_id")
        post_number = parent.extra.get("post_number")
        if isinstance(topic_id, str) and topic_id.isdigit():
            topic_id = int(topic_id)  # the request body only; the stored parent is untouched
        if (
            isinstance(topic_id, bool)
            or not isinstance(topic_id, int)
            or isinstance(post_number, bool)
            or not isinstance(post_number, int)
            or post_number < 1
        ):
            raise Rejected(f"{what}: parent {parent.id} lacks topic_id / post_number")
        payload = {"topic_id": topic_id, "reply_to_post_number": post_number, "raw": self._at_names(parent, text)}
        body = yield from self._created_steps("POST", "/posts.json", parent, what=what, bucket="post", json=payload, read=lambda b: b)
        if body.get("action") == "enqueued":
            pending = body.get("pending_post")
            pending_id = pending.get("id") if isinstance(pending, dict) else None
            raise Rejected(f"{what}: held for moderator approval (pending post {pending_id}); not retried", status=200)
        try:
            reply_id = _http.served_id(body, "id", what)
            got_topic = _number(body, "topic_id", what, default=None)
            got_reply_to = _number(body, "reply_to_post_number", what, default=None)
            post_url = _http.field(body, "post_url", what, default=None)
        except BadResponse as exc:
            # 2xx: the post very likely exists, we just cannot name it.
            raise MaybeSent(f"{exc.detail} (after a 2xx)") from None
        if got_topic != topic_id or got_reply_to != post_number:
            # The post exists and is ours; the read-back matches on these fields, so say so loudly.
            self.log.warning(
                "replyd.discourse.reply_fields_differ",
                parent_id=parent.id,
                reply_id=reply_id,
                topic_id=got_topic,
                reply_to_post_number=got_reply_to,
            )
        url = self.s.base_url + post_url if isinstance(post_url, str) and post_url.startswith("/") else ""
        self.log.info("replyd.discourse.sent", parent_id=parent.id, reply_id=reply_id)
        return Sent(reply_id=reply_id, url=url)

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """Replace the raw text of own post ``reply_id`` (``EditReply``: ``PUT /posts/{id}.json`` with ``post.raw``).

        Discourse keeps the post's id, number and ``reply_to_post_number`` (so the read-back still finds one
        reply) and makes a revision; the same raw again makes none, so a retried edit is harmless. A 403 is
        told apart as for a send (a refused key retried later, an uneditable post given up).
        """
        self._edit("PUT", f"/posts/{_http.seg(reply_id, 'edit')}.json", parent, reply_id, text, bucket="post",
                   json={"post": {"raw": self._at_names(parent, text)}})

    def _refused(self, exc: PlatformError) -> PlatformError:
        """A 403 to a POST or an edit's PUT: refused credentials (retry later) or a refused target (give up)?"""
        if not isinstance(exc, DefinitelyNotSent) or exc.status != 403:
            return exc
        try:
            self.whoami()
        except PlatformError as probe:
            if probe.status in (401, 403, 404):
                return DefinitelyNotSent(f"{exc.detail}; credentials refused", status=403)
            if isinstance(probe, RateLimited):
                return DefinitelyNotSent(f"{exc.detail}; credentials not re-checked (rate limited)", status=403)
            return Rejected(f"{exc.detail}; credentials not re-checked", status=403)
        return Rejected(exc.detail, status=403)

    # read-back -------------------------------------------------------------------------

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find own replies to the pending parents: the own activity feed, then per-topic reads.

        A parent is ``checked`` only if the feed listed everything from before
        it was opened (minus a margin) up to now, or its topic was read in full
        after the parent.
        """
        where: dict[str, tuple[str, int]] = {}
        for p in pending:
            pid = p.parent.id
            if pid in where:
                continue
            topic_id, number = p.parent.extra.get("topic_id"), p.parent.extra.get("post_number")
            if topic_id is None or not isinstance(number, int) or isinstance(number, bool):
                try:
                    located = self._post_by_id(pid, "read_back locate")
                except PlatformError as exc:
                    self.log.warning("replyd.discourse.read_back_failed", source="locate", parent_id=pid,
                                     problem=exc.detail)
                    continue
                topic_id, number = located.extra["topic_id"], located.extra["post_number"]
            where[pid] = (str(topic_id), number)

        def feed(opened: dict[str, float], found: _http.Found) -> set[str]:
            targets: dict[tuple[str, int], list[str]] = {}
            for pid, loc in where.items():
                targets.setdefault(loc, []).append(pid)
            return self._covered({pid: opened[pid] for pid in where},
                                 self._scan_user_actions(sender_id, targets, opened, found))

        def by_topic(opened: dict[str, float], checked: set[str]) -> Iterable[tuple[str, list[str]]]:
            topics: dict[str, list[str]] = {}
            for pid, (topic_id, _) in where.items():
                if pid not in checked:
                    topics.setdefault(topic_id, []).append(pid)
            return topics.items()

        return self._read_back(pending, source=("topic", "topic_id"), feed=feed, units=by_topic,
                               fallback=lambda topic_id, pids, found: self._scan_topic(topic_id, pids, where,
                                                                                       sender_id, found))

    def _scan_user_actions(
        self, sender_id: str, targets: Mapping[tuple[str, int], list[str]], opened: Mapping[str, float],
        found: _http.Found,
    ) -> float | None:
        """Page back through the own replies; return the epoch after which the listing is complete."""
        if not targets:
            return None
        horizon = self._horizon(min(opened[pid] for pids in targets.values() for pid in pids))
        return self._walk_feed(self._user_actions(sender_id, targets, found), horizon, source="user_actions")

    def _user_actions(
        self, sender_id: str, targets: Mapping[tuple[str, int], list[str]], found: _http.Found
    ) -> Iterator[list[float]]:
        what = "read_back user_actions"
        username = self._username()
        offset = 0
        for _ in range(self.s.max_pages):
            params = [("username", username), ("filter", OWN_REPLY_ACTIONS)] + ([("offset", str(offset))] if offset else [])
            resp = self._call("GET", "/user_actions.json", what=what, params=params)
            items = _http.field(_http.json_body(resp, what, dict), "user_actions", what, list, default=[])
            # One unreadable item could be the reply we look for: the page is not conclusive.
            page = [self._own_action(item, what) for item in items]
            for post_id, actor, topic_id, reply_to, created in page:
                for pid in targets.get((topic_id, reply_to), ()) if actor == sender_id and reply_to is not None else ():
                    found.setdefault(pid, {})[post_id] = OwnReply(post_id, pid, created)
            yield [created for *_, created in page] or [_http.END]
            if len(page) < USER_ACTIONS_PAGE:
                yield [_http.END]
                return
            offset += len(page)

    @staticmethod
    def _own_action(item: Any, what: str) -> tuple[str, str, str, int | None, float]:
        """``(post id, acting user id, topic id, reply_to_post_number, created_at)`` of a user action."""
        if not isinstance(item, dict):
            raise BadResponse(f"{what}: item is not an object")
        actor = _http.served_id(item, "acting_user_id", what, default=None) or _http.served_id(item, "user_id", what)
        return (
            _http.served_id(item, "post_id", what),
            actor,
            _http.served_id(item, "topic_id", what),
            _number(item, "reply_to_post_number", what, default=None),
            _http.iso_field(item, "created_at", what),
        )

    def _scan_topic(
        self,
        topic_id: str,
        pids: list[str],
        where: Mapping[str, tuple[str, int]],
        sender_id: str,
        found: dict[str, dict[str, OwnReply]],
    ) -> bool:
        """Read a topic's posts after the oldest pending parent; True if every such post was read.

        ``/t/{id}.json`` carries the first chunk (20) of posts and the full id
        stream; the ids after the parent that were not loaded are fetched by id.
        Post ids only grow, so a reply's id is above its parent's.
        """
        what = "read_back topic"
        resp = self._call("GET", f"/t/{_http.seg(topic_id, what)}.json", what=what)
        body = _http.json_body(resp, what, dict)
        posts = _http.field(body, "post_stream.posts", what, list)
        stream = _http.field(body, "post_stream.stream", what, list, default=[])
        floor = min(pids, key=id_order)
        by_number: dict[int, list[str]] = {}
        for pid in pids:
            by_number.setdefault(where[pid][1], []).append(pid)

        def take(batch: list[Any]) -> set[str]:
            seen = set()
            for post in batch:
                if not isinstance(post, dict):
                    raise BadResponse(f"{what}: post is not an object")
                post_id = _http.served_id(post, "id", what)
                seen.add(post_id)
                if _http.served_id(post, "user_id", what) != sender_id:
                    continue
                reply_to = _number(post, "reply_to_post_number", what, default=None)
                for pid in by_number.get(reply_to, []) if reply_to is not None else []:
                    found.setdefault(pid, {})[post_id] = OwnReply(post_id, pid, _http.iso_field(post, "created_at", what))
            return seen

        loaded = take(posts)
        wanted = []
        for raw in stream:
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise BadResponse(f"{what}: post_stream.stream holds {type(raw).__name__}")
            sid = str(raw)
            if sid not in loaded and id_order(sid) > id_order(floor):
                wanted.append(sid)
        for start in range(0, len(wanted), POST_IDS_CHUNK):
            chunk = wanted[start : start + POST_IDS_CHUNK]
            params = [("post_ids[]", sid) for sid in chunk]
            resp = self._call("GET", f"/t/{_http.seg(topic_id, what)}/posts.json", what=what, params=params)
            batch = _http.field(_http.json_body(resp, what, dict), "post_stream.posts", what, list)
            got = take(batch)
            if not set(chunk) <= got:
                # A post in the stream we could not read (deleted meanwhile, or hidden): not conclusive.
                missing = sorted(set(chunk) - got, key=id_order)
                self.log.warning("replyd.discourse.read_back_incomplete", topic_id=topic_id, missing=missing[:5])
                return False
        return True

    # thread depth ----------------------------------------------------------------------

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return how many ancestors ``parent`` has in its topic, counting at most ``limit + 1``.

        The topic's first post is depth 0. Any other post answers the first post
        (no ``reply_to_post_number``, or 1): depth 1; or the post it names: one
        more than that post. The parent's own ``reply_to_post_number`` rides in
        ``extra``, so depths 0 and 1 (and anything ``limit`` already cuts) cost no
        request. Above that, ``/posts/{id}/reply-history.json`` returns the posts
        the chain climbs through, up to the site's ``max_reply_history`` (default
        1, so one request per level; fewer where an admin raised it). An ancestor
        that endpoint leaves out is read with ``/posts/by_number/{topic}/{n}.json``;
        one this account may not see (deleted, a whisper) still counts, but ends
        the count: the answer is then a lower bound.
        """
        what = "thread_depth"
        extra = parent.extra
        located = parent
        if not isinstance(extra.get("post_number"), int) or "reply_to_post_number" not in extra:
            located = self._post_by_id(parent.id, what, cached=True)
        number = located.extra["post_number"]
        reply_to = located.extra.get("reply_to_post_number")
        if number == 1:
            return 0
        depth = 1  # the topic's first post
        if depth > limit:
            return depth
        topic_id = located.extra.get("topic_id")
        cur_id, seen = located.id, {number}
        use_history = True
        while isinstance(reply_to, int) and reply_to != 1:
            if reply_to in seen:
                self.log.warning("replyd.discourse.reply_loop", parent_id=parent.id, post_number=reply_to)
                return depth
            seen.add(reply_to)
            depth += 1  # post reply_to, between the first post and this one
            if depth > limit:
                return depth
            chain: dict[int, dict[str, Any]] = {}
            if use_history:
                chain = self._reply_history(cur_id, limit + 2 - depth, what)
            post = chain.get(reply_to)
            if post is None:
                post = self._post_json_by_number(topic_id, reply_to, what)
                if post is None:
                    self.log.info("replyd.discourse.thread_hidden", parent_id=parent.id, post_number=reply_to)
                    return depth
                use_history = bool(chain)  # an empty answer: this site serves no reply history
            while True:  # climb as far as this answer reaches
                cur_id = _http.served_id(post, "id", what)
                reply_to = _number(post, "reply_to_post_number", what, default=None)
                if reply_to is None or reply_to == 1 or reply_to not in chain or reply_to in seen:
                    break
                seen.add(reply_to)
                depth += 1
                if depth > limit:
                    return depth
                post = chain[reply_to]
        return depth

    def _reply_history(self, post_id: str, max_replies: int, what: str) -> dict[int, dict[str, Any]]:
        """The ancestors ``/posts/{id}/reply-history.json`` serves, by post number."""
        params = [("max_replies", str(max(max_replies, 1)))]  # honoured by old servers, ignored by new
        resp = self._call("GET", f"/posts/{_http.seg(post_id, what)}/reply-history.json", what=what, params=params)
        out: dict[int, dict[str, Any]] = {}
        for post in _http.json_body(resp, what, list):
            if not isinstance(post, dict):
                raise BadResponse(f"{what}: post is not an object")
            _http.served_id(post, "id", what)
            _number(post, "reply_to_post_number", what, default=None)
            out[_number(post, "post_number", what)] = post
        return out

    def _post_json_by_number(self, topic_id: Any, number: int, what: str) -> dict[str, Any] | None:
        """One post by its topic and number, or ``None`` if it is gone or hidden from this account."""
        if isinstance(topic_id, bool) or not isinstance(topic_id, (int, str)):
            raise Rejected(f"{what}: parent lacks topic_id")
        path = f"/posts/by_number/{_http.seg(str(topic_id), what)}/{number}.json"
        try:
            resp = self._call("GET", path, what=what)
        except Rejected as exc:
            if exc.status in (404, 410):
                return None
            raise
        post = _http.json_body(resp, what, dict)
        if _number(post, "post_number", what) != number:
            raise BadResponse(f"{what}: by_number {number} served post {post.get('post_number')!r}")
        _http.served_id(post, "id", what)
        _number(post, "reply_to_post_number", what, default=None)
        return post

    # delete ----------------------------------------------------------------------------

    def delete(self, reply_id: str) -> None:
        """Delete one own post; one that is already gone counts as deleted."""
        self._delete("DELETE", f"/posts/{_http.seg(reply_id, 'delete')}.json", reply_id, bucket="post")
