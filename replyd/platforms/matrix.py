"""The Matrix adapter: mentions from ``/sync``, replies by transaction id, own events read back per room.

Settings: ``[bots.settings]`` with ``platform = "matrix"``; each key is a field of
``MatrixPlatform.Settings`` below, with its meaning beside it.

Ids: the sender id is the bot's user id (``/account/whoami``); a parent id is
the event id exactly as served, its room id rides in ``Parent.extra["room_id"]``
(and a thread root in ``extra["thread_root"]``). A reply id is the reply's
event id; ``delete`` and ``reply_url`` need its room, which ``send`` and
``read_back`` remember.

Provider idempotency: every reply is ``PUT /rooms/{room}/send/m.room.message/{txnId}``
with ``txnId`` = the guard's ``provider_key`` for (bot, parent): the same on
every attempt. Synapse answers a repeated transaction id of the same device
with the first event's id (measured limits in docs/PLATFORMS.md).

Edits (``EditReply``, a streamed answer growing its reply): a replacement event
(``rel_type = m.replace``, ``m.new_content``), sent by transaction id too (see
``edit``). Edits are never replies or parents: the inbox, search, re-find and
the read-back skip every ``m.replace`` event, so a reply edited n times is still
one reply and the sweep counts no duplicate (with ``delete_newer`` it would
otherwise redact an edit, or the reply itself).

Error mapping at this boundary (``_http.py`` holds the shared table; Matrix adds
the ``errcode`` of the JSON body)::

    what happened                                  send, edit (PUT)   reads (GET, /search POST)
    ---------------------------------------------  -----------------  -------------------------
    connect refused, DNS, connect timeout          DefinitelyNotSent  DefinitelyNotSent
    read/write timeout, reset, lost response       MaybeSent          DefinitelyNotSent
      (a retried edit is the same transaction)
    429 M_LIMIT_EXCEEDED                           RateLimited (retry_after_ms, else Retry-After)
    401 M_UNKNOWN_TOKEN, M_MISSING_TOKEN           DefinitelyNotSent (a password login logs in
                                                   again and retries once)
    403 M_FORBIDDEN (not joined, no power, banned) DefinitelyNotSent  DefinitelyNotSent
    404 M_NOT_FOUND, 413/400 M_TOO_LARGE (an       Rejected           Rejected
      edit carries its text twice: the event's
      65,536 bytes hold about half as much),
      other 4xx; edit: the reply read first is
      redacted, another sender's or an edit
    5xx                                            MaybeSent          DefinitelyNotSent
    2xx without ``event_id``                       send: MaybeSent;   BadResponse
                                                   edit: done

The ``error`` text is never branched on; only ``errcode``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal, Self
from urllib.parse import unquote

import httpx
from pydantic import AfterValidator, Field, SecretStr, StringConstraints, model_validator

from replyd.errors import ConfigError, DefinitelyNotSent, PlatformError, Rejected
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Text, Texts, Token, register_platform,
)
from replyd.platforms import _http, mentions, unreadable

API = "/_matrix/client/v3"
# How many reply-event -> room entries ``delete`` can look up (filled by send and read_back).
_ROOM_MEMORY = 10_000

_MATRIX_TO = re.compile(r"^https://matrix\.to/#/([^/?]+)(?:/([^/?]+))?")


def _errcode(resp: httpx.Response) -> str:
    data = _http.error_json(resp)
    code = data.get("errcode") if isinstance(data, dict) else None
    return code if isinstance(code, str) else ""


def _event_filter(**extra: Any) -> str:
    """A RoomEventFilter (JSON) for ``m.room.message`` events, plus ``extra`` keys."""
    return json.dumps({"types": ["m.room.message"], **extra}, separators=(",", ":"))


def _is_edit(content: Any) -> bool:
    """Whether a message content replaces an earlier event (``rel_type = m.replace``): an edit, never a new message."""
    rel = content.get("m.relates_to") if isinstance(content, dict) else None
    return isinstance(rel, dict) and rel.get("rel_type") == "m.replace"


def edit_txn_id(reply_id: str, text: str) -> str:
    """The transaction id of the edit setting ``reply_id``'s text to ``text``: the same on every retry of that edit."""
    digest = hashlib.sha256(f"{reply_id}\x1f{hashlib.sha256(text.encode()).hexdigest()}".encode()).hexdigest()
    return f"replyd-edit-{digest[:40]}"


def _relation(content: Any) -> tuple[str | None, str | None]:
    """A message content's (``m.in_reply_to`` event id, thread root event id); None where absent or not a string."""
    rel = content.get("m.relates_to") if isinstance(content, dict) else None
    if not isinstance(rel, dict):
        return None, None
    irt = rel.get("m.in_reply_to")
    reply_to = irt.get("event_id") if isinstance(irt, dict) else None
    root = rel.get("event_id") if rel.get("rel_type") == "m.thread" else None
    return (reply_to if isinstance(reply_to, str) else None), (root if isinstance(root, str) else None)


def _user(value: str) -> str:
    if not re.fullmatch(r"@?[^\s:@]+(:\S+)?", value):
        raise ValueError("must be a user id (@name:server) or a localpart")
    return value


@register_platform("matrix")
class MatrixPlatform(_http.StepSend, _http.HttpPlatform):
    """A Matrix account as a replyd platform: mentions in, replies by transaction id, own events read back."""

    class Settings(_http.HttpSettings):
        """``platform = "matrix"``; ``instance`` defaults to ``matrix:<base_url>``."""

        base_url: _http.Url  # the homeserver (its client-server API root)
        token: Token | None = None  # an access token (token_env), or:
        user: Annotated[Text, AfterValidator(_user)] | None = None  # log in as user with password (password_env)
        password: Token | None = None  # on the fixed device_id, so transaction ids stay in one scope
        device_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._=-]{1,64}$")] = "replyd"
        listing_delay_s: float = Field(2.0, ge=0)
        page_limit: int = Field(100, ge=1, le=1000)  # events per page
        max_pages: int = Field(10, ge=1, le=10_000)  # pages per poll, re-find and read-back room
        msgtype: Literal["m.text", "m.notice"] = "m.text"
        join_invites: bool = False  # join rooms the bot is invited to (else only by policy, never silently)
        search_queries: Texts = []

        @model_validator(mode="after")
        def _credentials(self) -> Self:
            if self.token is None and (self.password is None or self.user is None):
                raise ConfigError("matrix setting 'token': required (token_env), or 'user' with 'password' (password_env)")
            return self

    s: Settings
    ITEM_ID = "event_id"

    def _setup(self) -> None:
        self._token = self.s.token.get_secret_value() if self.s.token else ""  # a password login replaces it
        self._user_id: str | None = None
        self._rooms: OrderedDict[str, str] = OrderedDict()  # reply event id -> room id, for delete

    @property
    def root(self) -> str:
        """The client-server API root under ``base_url``."""
        return self.s.base_url + API

    def _auth_headers(self) -> dict[str, SecretStr]:
        return {"Authorization": SecretStr(f"Bearer {self._token}")}

    def _secrets(self) -> tuple[str, ...]:
        return (*super()._secrets(), self._token)

    def _call_steps(self, method: str, path: str, *, what: str, bucket: str | None = None, acts: bool | None = None,
                    auth: bool = True, **kwargs: Any) -> _http.HttpSteps[httpx.Response]:
        """One request as steps; a 2xx response or the mapped error (logging in first, and again once on a 401)."""
        if auth and not self._token:
            yield from self._login_steps()
        resp = yield from self._request_steps(method, path, what=what, acts=acts, auth=auth, **kwargs)
        if resp.status_code == 401 and auth and self.s.password is not None:
            self.log.info("replyd.matrix.relogin", what=what, errcode=_errcode(resp))
            yield from self._login_steps()
            resp = yield from self._request_steps(method, path, what=what, acts=acts, auth=auth, **kwargs)
        self._raise_for_status(resp, what=what, acts=acts)
        return resp

    def _api(self, method: str, path: str, *, what: str, params: Any = None, body: Any = None,
             acts: bool | None = None, auth: bool = True) -> Any:
        """One request; returns the 2xx JSON object or raises the mapped error."""
        resp = self._call(method, path, what=what, params=params, json=body, acts=acts, auth=auth)
        return _http.json_body(resp, what, dict)

    def _limited(self, resp: httpx.Response) -> bool:
        """429, or Matrix's ``M_LIMIT_EXCEEDED`` whatever the status."""
        return resp.status_code == 429 or _errcode(resp) == "M_LIMIT_EXCEEDED"

    def _wait_s(self, resp: httpx.Response) -> float | None:
        """The body's ``retry_after_ms``, else ``Retry-After``."""
        data = _http.error_json(resp)
        wait_ms = data.get("retry_after_ms") if isinstance(data, dict) else None
        usable = isinstance(wait_ms, (int, float)) and not isinstance(wait_ms, bool) and math.isfinite(wait_ms)
        return wait_ms / 1000.0 if usable and wait_ms >= 0 else super()._wait_s(resp)

    def _error_text(self, resp: httpx.Response) -> str:
        """The server's text and the ``errcode`` (the only part anything may branch on)."""
        code = _errcode(resp)
        return " ".join(t for t in (super()._error_text(resp), f"[{code}]" if code else "") if t)

    def _login(self) -> None:
        """``_login_steps`` driven in the calling thread."""
        self._drive(self._login_steps())

    def _login_steps(self) -> _http.HttpSteps[None]:
        """Log in with the password on the fixed device (the same transaction-id scope every time)."""
        if self.s.password is None or self.s.user is None:
            raise DefinitelyNotSent("login: no token and no password configured")
        what = "login"
        body = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": self.s.user},
                "password": self.s.password.get_secret_value(), "device_id": self.s.device_id,
                "initial_device_display_name": "replyd"}
        resp = yield from self._call_steps("POST", "/login", what=what, json=body, acts=False, auth=False)
        data = _http.json_body(resp, what, dict)
        self._token = _http.field(data, "access_token", what)
        self._user_id = _http.field(data, "user_id", what)
        self.log.info("replyd.matrix.logged_in", user_id=self._user_id, device_id=self.s.device_id)

    # --- parsing --------------------------------------------------------------------

    def _parent(self, ev: Any, room_id: str, what: str) -> Parent | None:
        """A ``m.room.message`` event as a parent; ``None`` for other events, edits and redacted ones."""
        if not isinstance(ev, dict) or ev.get("type") != "m.room.message":
            return None
        content = ev.get("content")
        if not isinstance(content, dict) or not isinstance(content.get("body"), str):
            return None  # redacted: nothing left to answer
        if _is_edit(content):
            return None  # an edit of an earlier message, not a new one
        event_id = _http.field(ev, "event_id", what)
        sender = _http.field(ev, "sender", what)
        ts = _http.field(ev, "origin_server_ts", what, (int, float))
        in_reply_to, thread_root = _relation(content)
        return Parent(
            id=event_id,
            author_id=sender,
            author_handle=sender,
            author_is_bot=content.get("msgtype") == "m.notice",  # bots speak in notices by convention
            text=content["body"],
            url=f"https://matrix.to/#/{room_id}/{event_id}",
            created_at=ts / 1000.0,
            thread_depth=1 if (in_reply_to or thread_root) else 0,
            extra={"room_id": room_id, "thread_root": thread_root, "in_reply_to": in_reply_to},
        )

    def _mentions_me(self, parent: Parent, ev: dict[str, Any]) -> bool:
        """Whether the event names the bot: ``m.mentions.user_ids``, else its user id in the body."""
        me = self._user_id or ""
        if not me or parent.author_id == me:
            return False
        mentions = ev.get("content", {}).get("m.mentions")
        if isinstance(mentions, dict) and isinstance(mentions.get("user_ids"), list):
            if me in mentions["user_ids"]:
                return True
        return me.lower() in parent.text.lower()

    def _mentions_in(self, events: Any, room_id: str, what: str) -> list[Parent]:
        out = []
        for ev in events if isinstance(events, list) else []:
            try:
                parent = self._parent(ev, room_id, what)
                if parent is not None and self._mentions_me(parent, ev):
                    out.append(parent)
            except unreadable.ERRORS as exc:
                self._skipped(what, exc, ev)
        return out

    def _my_id(self) -> str:
        if self._user_id is None:
            self.whoami()
        assert self._user_id is not None
        return self._user_id

    # --- Platform -------------------------------------------------------------------

    def whoami(self) -> Identity:
        """Return the bot's user id (``/account/whoami``)."""
        what = "whoami"
        data = self._api("GET", "/account/whoami", what=what)
        self._user_id = _http.field(data, "user_id", what)
        return Identity(sender_id=self._user_id, handle=self._user_id)

    def inbox(self, cursor: str | None) -> Page:
        """Return the events mentioning the bot since ``cursor`` (a ``/sync`` ``next_batch``), oldest first.

        A room whose timeline came back ``limited`` (more events than one sync
        returns) is paged back with ``/messages`` from its ``prev_batch`` to the
        old cursor; if ``max_pages`` runs out first, ``replyd.matrix.gap`` is
        logged and re-find covers the rest. Synapse caches a ``/sync`` answer
        for two minutes (``sync_response_cache_duration``): the same cursor may
        get the same page again, and later events come on the page after it,
        so nothing is lost, only late.
        """
        what = "inbox"
        me = self._my_id()
        params = {"timeout": "0", "filter": json.dumps({
            "presence": {"types": []}, "account_data": {"types": []},
            "room": {"timeline": {"types": ["m.room.message"], "limit": self.s.page_limit},
                     "state": {"types": []}, "ephemeral": {"types": []}, "account_data": {"types": []}}},
            separators=(",", ":"))}
        if cursor:
            params["since"] = cursor
        data = self._api("GET", "/sync", what=what, params=params)
        next_batch = _http.field(data, "next_batch", what)
        rooms = _http.field(data, "rooms", what, dict, default={})
        found: dict[str, Parent] = {}
        for room_id, room in (_http.field(rooms, "join", what, dict, default={}) or {}).items():
            timeline = room.get("timeline") if isinstance(room, dict) else None
            if not isinstance(timeline, dict):
                continue
            for p in self._mentions_in(timeline.get("events"), room_id, what):
                found.setdefault(p.id, p)
            if timeline.get("limited") and cursor and isinstance(timeline.get("prev_batch"), str):
                for p in self._fill_gap(room_id, timeline["prev_batch"], cursor):
                    found.setdefault(p.id, p)
        if self.s.join_invites:
            for room_id in _http.field(rooms, "invite", what, dict, default={}) or {}:
                self._join(room_id)
        parents = sorted(found.values(), key=lambda p: (p.created_at or 0.0, p.id))
        self.log.debug("replyd.matrix.inbox", bot=me, found=len(parents))
        return Page(parents=parents, cursor=next_batch)

    def _fill_gap(self, room_id: str, prev_batch: str, since: str) -> list[Parent]:
        """Page back from ``prev_batch`` to the old sync token ``since`` in one room."""
        what = "inbox gap"
        out: list[Parent] = []
        token: str | None = prev_batch
        for _ in range(self.s.max_pages):
            params = {"dir": "b", "from": token, "to": since, "limit": str(self.s.page_limit),
                      "filter": _event_filter()}
            data = self._api("GET", f"/rooms/{_http.seg(room_id, what)}/messages", what=what, params=params)
            chunk = _http.field(data, "chunk", what, list, default=[])
            out.extend(self._mentions_in(chunk, room_id, what))
            token = data.get("end") if isinstance(data.get("end"), str) else None
            if not chunk or token is None:
                return out
        self.log.warning("replyd.matrix.gap", room_id=room_id, pages=self.s.max_pages)
        return out

    def _join(self, room_id: str) -> None:
        """Accept one invite (``join_invites = true``); a failure is logged, the next sync retries."""
        what = "join"
        try:
            self._api("POST", f"/rooms/{_http.seg(room_id, what)}/join", what=what, body={})
            self.log.info("replyd.matrix.joined", room_id=room_id)
        except PlatformError as exc:
            self.log.warning("replyd.matrix.join_failed", room_id=room_id, problem=exc.detail)

    def search(self, query: str, cursor: str | None) -> Page:
        """Return messages matching ``query`` (server-side ``/search``) newer than ``cursor``.

        The cursor is the newest ``origin_server_ts`` seen (ms) and the event ids
        at exactly that instant (``"<ts>|<id>|…"``), so nothing sharing the
        instant is skipped or offered twice.
        """
        what = "search"
        me = self._my_id()
        # Resuming a gap (the last poll ran out of max_pages before its cursor): page on from its next_batch.
        gap = _http.GapCursor.decode(cursor)
        base = gap.since if gap is not None else cursor
        since_ts, seen = -1, set[str]()
        if base:
            head, *ids = base.split("|")
            since_ts, seen = (int(head), set(ids)) if head.isdigit() else (-1, set())
        body = {"search_categories": {"room_events": {
            "search_term": query, "keys": ["content.body"], "order_by": "recent",
            "filter": {"types": ["m.room.message"], "limit": self.s.page_limit}}}}
        found: dict[str, Parent] = {}
        next_batch: str | None = gap.page if gap is not None else None
        gap_page: str | None = None  # set when max_pages ends before the cursor
        for page_no in range(self.s.max_pages):
            params = {"next_batch": next_batch} if next_batch else None
            try:
                data = self._api("POST", "/search", what=what, body=body, params=params, acts=False)
            except PlatformError as exc:
                refused = self._gap_refused(what, gap, page_no, exc)
                if refused is None:
                    raise
                return refused
            events = _http.field(data, "search_categories.room_events", what, dict, default={})
            results = events.get("results") if isinstance(events.get("results"), list) else []
            older = False
            for r in results:
                ev = r.get("result") if isinstance(r, dict) else None
                room_id = ev.get("room_id") if isinstance(ev, dict) else None
                if not isinstance(room_id, str) or not room_id:
                    continue  # a hit the bot could not answer: the send needs the room
                try:
                    parent = self._parent(ev, room_id, what)
                except unreadable.ERRORS as exc:
                    self._skipped(what, exc, ev)
                    continue
                if parent is None or parent.author_id == me:
                    continue
                ts = round((parent.created_at or 0) * 1000)
                if ts < since_ts or (ts == since_ts and parent.id in seen):
                    older = True
                    continue
                found.setdefault(parent.id, parent)
            next_batch = events.get("next_batch") if isinstance(events.get("next_batch"), str) else None
            if older or not results or next_batch is None:
                break
        else:
            gap_page = next_batch if since_ts >= 0 else None  # a first poll (no cursor) has no gap to close
        parents = sorted(found.values(), key=lambda p: (p.created_at or 0.0, p.id))
        if gap is not None:
            newest_cursor = gap.newest  # what the scan that left the gap saw first
        else:
            newest = max((round((p.created_at or 0) * 1000) for p in found.values()), default=since_ts)
            if newest < 0:
                return Page(parents=[], cursor=cursor)
            at_newest = sorted(p.id for p in found.values() if round((p.created_at or 0) * 1000) == newest)
            if newest == since_ts:
                at_newest = sorted(seen | set(at_newest))
            newest_cursor = "|".join([str(newest), *at_newest])
        if gap_page is not None and base:
            # max_pages ended before the cursor: the next poll resumes at next_batch instead of skipping.
            self.log.warning("replyd.matrix.gap", what=what, pages=self.s.max_pages)
            return Page(parents=parents, cursor=_http.GapCursor(base, newest_cursor, gap_page).encode())
        return Page(parents=parents, cursor=newest_cursor)

    def refind(self, since: float) -> list[Parent]:
        """Re-read every joined room's ``/messages`` back to epoch ``since``; the events mentioning the bot."""
        # replyd's epoch on the platform's clock, erring early (unmeasured: as it is, a wider window would
        # offer parents older than the configured look-back)
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        what = "refind"
        self._my_id()
        rooms = _http.field(self._api("GET", "/joined_rooms", what=what), "joined_rooms", what, list)
        found: dict[str, Parent] = {}
        for room_id in rooms:
            if not isinstance(room_id, str):
                continue
            for chunk in self._pages_back(room_id, since, what=what, filt=_event_filter()):
                for p in self._mentions_in(chunk, room_id, what):
                    found.setdefault(p.id, p)
        return sorted(found.values(), key=lambda p: (p.created_at or 0.0, p.id))

    def _pages_back(self, room_id: str, since: float, *, what: str, filt: str, complete: list[bool] | None = None):
        """Yield ``/messages`` chunks newest first until one reaches before epoch ``since`` or the room begins.

        ``complete`` (if given) gets ``True`` appended when the listing really reached back that far.
        """
        token: str | None = None
        for _ in range(self.s.max_pages):
            params = {"dir": "b", "limit": str(self.s.page_limit), "filter": filt}
            if token:
                params["from"] = token
            data = self._api("GET", f"/rooms/{_http.seg(room_id, what)}/messages", what=what, params=params)
            chunk = _http.field(data, "chunk", what, list, default=[])
            yield chunk
            token = data.get("end") if isinstance(data.get("end"), str) else None
            stamps = [ev.get("origin_server_ts") for ev in chunk if isinstance(ev, dict)]
            oldest = min((t for t in stamps if isinstance(t, (int, float))), default=None)
            if not chunk or token is None or (oldest is not None and oldest / 1000.0 < since):
                if complete is not None:
                    complete.append(True)
                return

    def resolve(self, ref: str) -> Parent:
        """Turn a ``matrix.to`` link or ``!room/$event`` into the parent (the event as served)."""
        what = "resolve"
        ref = ref.strip()
        room, event = "", ""
        m = _MATRIX_TO.match(ref)
        if m:
            room, event = unquote(m.group(1)), unquote(m.group(2) or "")
        elif "/" in ref and ref.startswith(("!", "#")):
            room, _, event = ref.partition("/")
        if not room or not event.startswith("$"):
            raise Rejected(f"{what}: expected a matrix.to link or '!room:server/$event' to an event")
        if room.startswith("#"):
            room = _http.field(self._api("GET", f"/directory/room/{_http.seg(room, what)}", what=what), "room_id", what)
        ev = self._api("GET", f"/rooms/{_http.seg(room, what)}/event/{_http.seg(event, what)}", what=what)
        parent = self._parent(ev, room, what)
        if parent is None:
            raise Rejected(f"{what}: the event is not a message that can be answered")
        return parent

    def _send_steps(self, parent: Parent, text: str, *, provider_key: str) -> _http.HttpSteps[Sent]:
        """Reply to ``parent`` in its room (in its thread if it has one); ``txnId`` = ``provider_key`` (``send`` /
        ``asend``; only the guard's faces call those)."""
        what = "send"
        room_id = self._room_of(parent, what)
        if not provider_key or not re.fullmatch(r"[A-Za-z0-9._~-]{1,255}", provider_key):
            raise Rejected(f"{what}: provider_key is not a usable transaction id")
        relates: dict[str, Any] = {"m.in_reply_to": {"event_id": parent.id}}
        thread_root = parent.extra.get("thread_root")
        if isinstance(thread_root, str) and thread_root:
            relates.update({"rel_type": "m.thread", "event_id": thread_root, "is_falling_back": False})
        content = {**self._message(parent, text), "m.relates_to": relates}
        path = f"/rooms/{_http.seg(room_id, what)}/send/m.room.message/{_http.seg(provider_key, what)}"
        reply_id = yield from self._created_steps("PUT", path, parent, what=what, json=content,
                                                  read=lambda body: _http.field(body, "event_id", what))
        self._remember(reply_id, room_id)
        self.log.info("replyd.matrix.sent", parent_id=parent.id, reply_id=reply_id, room_id=room_id)
        return Sent(reply_id=reply_id, url=f"https://matrix.to/#/{room_id}/{reply_id}")

    @staticmethod
    def _room_of(parent: Parent, what: str) -> str:
        """The parent's room id from ``extra``; ``Rejected`` when it carries none."""
        room_id = parent.extra.get("room_id")
        if not isinstance(room_id, str) or not room_id:
            raise Rejected(f"{what}: parent {parent.id!r} carries no room id")
        return room_id

    def _message(self, parent: Parent, text: str) -> dict[str, Any]:
        """A reply's content without its relation: what ``send`` posts and an edit's ``m.new_content`` repeats."""
        # m.mentions names the author only; "@room" in the body is defused for clients that read the body.
        body = text if self.s.allow_mentions else mentions.matrix(text)
        return {"msgtype": self.s.msgtype, "body": body, "m.mentions": {"user_ids": [parent.author_id]}}

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """Replace the text of own reply ``reply_id`` (``EditReply``): a replacement event (spec: event replacements).

        The replacement is an ``m.room.message`` whose ``m.new_content`` is the reply's whole new content (its
        mentions kept; no ``m.relates_to``: the reply's ``m.in_reply_to`` / thread relation stays the
        original's), with a ``"* "`` fallback body and an empty top-level ``m.mentions`` (no one notified again
        per edit), related by ``m.replace`` only. The reply is read first (``_editable``): Synapse accepts an edit
        of a redacted or foreign event, which no client shows. Its ``txnId`` is ``edit_txn_id(reply_id, text)``: a retry
        after a lost answer is the same transaction and Synapse answers it with the first edit event, not a
        second one. (Setting a text the reply had before, after another edit, inside Synapse's transaction
        window, would be answered with that older edit event: a streamed answer only grows, so it never does.)
        """
        what = "edit"
        room_id = self._room_of(parent, what)
        content = {"msgtype": self.s.msgtype, "body": f"* {text}", "m.new_content": self._message(parent, text),
                   "m.mentions": {}, "m.relates_to": {"rel_type": "m.replace", "event_id": reply_id}}
        path = f"/rooms/{_http.seg(room_id, what)}/send/m.room.message/{_http.seg(edit_txn_id(reply_id, text), what)}"
        self._edit("PUT", path, parent, reply_id, text, check=lambda: self._editable(room_id, reply_id),
                   json=content)
        self._remember(reply_id, room_id)

    def _editable(self, room_id: str, reply_id: str) -> None:
        """Read the reply first: Synapse takes an edit of anything, but a replacement of a redacted event, of
        another sender's or of an edit is ignored by every client (spec: validity), so it is ``Rejected`` here."""
        what = "edit"
        ev = self._api("GET", f"/rooms/{_http.seg(room_id, what)}/event/{_http.seg(reply_id, what)}", what=what)
        unsigned = ev.get("unsigned") if isinstance(ev.get("unsigned"), dict) else {}
        content = ev.get("content")
        if "redacted_because" in unsigned or not isinstance(content, dict) or "body" not in content:
            raise Rejected(f"{what}: reply {reply_id} is redacted")
        if ev.get("sender") != self._my_id() or ev.get("type") != "m.room.message" or _is_edit(content):
            raise Rejected(f"{what}: {reply_id} is not one of the bot's messages (a replacement would be ignored)")

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """The ``matrix.to`` link of one of the bot's replies; "" when its room is not known to this process."""
        room_id = self._rooms.get(reply_id)
        return f"https://matrix.to/#/{room_id}/{reply_id}" if room_id else ""

    def _remember(self, event_id: str, room_id: str) -> None:
        self._rooms[event_id] = room_id
        self._rooms.move_to_end(event_id)
        while len(self._rooms) > _ROOM_MEMORY:
            self._rooms.popitem(last=False)

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find own replies to the pending parents: one ``/messages`` walk per room, filtered on the bot.

        A room's parents are ``checked`` only when its listing reached back to
        the oldest open time (minus a margin) or the room's start; a failed page
        leaves them unchecked.
        """
        rooms: dict[str, list[str]] = {}
        for p in pending:
            room_id = p.parent.extra.get("room_id")
            if not isinstance(room_id, str) or not room_id:
                self.log.warning("replyd.matrix.read_back_failed", parent_id=p.parent.id, problem="no room id")
                continue
            if p.parent.id not in rooms.setdefault(room_id, []):
                rooms[room_id].append(p.parent.id)
        opened_at: dict[str, float] = {}

        def units(opened: dict[str, float], checked: set[str]) -> Iterable[tuple[str, list[str]]]:
            opened_at.update(opened)
            return rooms.items()

        def room(room_id: str, pids: list[str], found: _http.Found) -> bool:
            horizon = self._horizon(min(opened_at[pid] for pid in pids))
            complete: list[bool] = []
            for chunk in self._pages_back(room_id, horizon, what="read_back", complete=complete,
                                          filt=_event_filter(senders=[sender_id])):
                for ev in chunk:
                    if not isinstance(ev, dict) or ev.get("sender") != sender_id:
                        continue
                    if _is_edit(ev.get("content")):
                        continue  # an edit of a reply is no reply, whatever else it carries (m.in_reply_to)
                    pid, _root = _relation(ev.get("content"))
                    if pid in pids and isinstance(ev.get("event_id"), str):
                        ts = ev.get("origin_server_ts")
                        created = ts / 1000.0 if isinstance(ts, (int, float)) else None
                        found.setdefault(pid, {})[ev["event_id"]] = OwnReply(ev["event_id"], pid, created)
                        self._remember(ev["event_id"], room_id)
            return bool(complete)

        return self._read_back(pending, source=("room", "room_id"), feed=None, units=units, fallback=room)

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Count ``m.in_reply_to`` ancestors of ``parent``, at most ``limit + 1`` (one event read each)."""
        what = "thread_depth"
        room_id = parent.extra.get("room_id")
        nxt = parent.extra.get("in_reply_to") or parent.extra.get("thread_root")
        depth = 0
        while isinstance(nxt, str) and nxt and depth <= limit and isinstance(room_id, str):
            depth += 1
            if depth > limit:
                break
            ev = self._api("GET", f"/rooms/{_http.seg(room_id, what)}/event/{_http.seg(nxt, what)}", what=what)
            reply_to, root = _relation(ev.get("content") if isinstance(ev, dict) else None)
            nxt = reply_to or root
        return min(depth, max(limit, 0) + 1)

    def delete(self, reply_id: str) -> None:
        """Redact one own reply (its room known from ``send`` or ``read_back``); one already gone counts as done."""
        what = "delete"
        room_id = self._rooms.get(reply_id)
        if room_id is None:
            raise Rejected(f"{what}: the room of {reply_id!r} is unknown (not sent or read back by this process)")
        txn = "replyd-redact-" + re.sub(r"[^A-Za-z0-9._~-]", "_", reply_id)[:200]
        path = f"/rooms/{_http.seg(room_id, what)}/redact/{_http.seg(reply_id, what)}/{_http.seg(txn, what)}"
        self._delete("PUT", path, reply_id, json={"reason": "duplicate reply"})
