"""The Matrix adapter: mentions from ``/sync``, replies by transaction id, own events read back per room.

Settings (``[bots.settings]`` with ``platform = "matrix"``):

===================  ========================================================
``base_url``         required; the homeserver's client-server API root
``token``            an access token (``token_env = "MATRIX_TOKEN"``), or:
``user`` +           log in with a password (``password_env``) on the fixed
``password``         ``device_id``, so transaction ids stay in one scope
``device_id``        the device a password login uses (default ``replyd``)
``listing_delay_s``  seconds before a sweep may trust a read-back (default 2)
``timeout_s``        per-request timeout (default 15)
``page_limit``       events per page, 1-1000 (default 100)
``max_pages``        pages per poll, re-find and read-back room (default 10)
``msgtype``          ``m.text`` (default) or ``m.notice``
``join_invites``     join rooms the bot is invited to (default false: rooms
                     are joined only by this policy, never silently)
``instance``         first part of the answered-log key (default
                     ``matrix:<base_url>``)
===================  ========================================================

Ids: the sender id is the bot's user id (``/account/whoami``); a parent id is
the event id exactly as served, its room id rides in ``Parent.extra["room_id"]``
(and a thread root in ``extra["thread_root"]``). A reply id is the reply's
event id; ``delete`` and ``reply_url`` need its room, which ``send`` and
``read_back`` remember.

Provider idempotency: every reply is ``PUT /rooms/{room}/send/m.room.message/{txnId}``
with ``txnId`` = the guard's ``provider_key`` for (bot, parent): the same on
every attempt. Synapse answers a repeated transaction id of the same device
with the first event's id (measured limits in docs/PLATFORMS.md).

Error mapping at this boundary (``_http.py`` holds the shared table; Matrix adds
the ``errcode`` of the JSON body)::

    what happened                                  send (PUT)         reads (GET, /search POST)
    ---------------------------------------------  -----------------  -------------------------
    connect refused, DNS, connect timeout          DefinitelyNotSent  DefinitelyNotSent
    read/write timeout, reset, lost response       MaybeSent          DefinitelyNotSent
    429 M_LIMIT_EXCEEDED                           RateLimited (retry_after_ms, else Retry-After)
    401 M_UNKNOWN_TOKEN, M_MISSING_TOKEN           DefinitelyNotSent (a password login logs in
                                                   again and retries once)
    403 M_FORBIDDEN (not joined, no power, banned) DefinitelyNotSent  DefinitelyNotSent
    404 M_NOT_FOUND, 400 M_TOO_LARGE, other 4xx    Rejected           Rejected
    5xx                                            MaybeSent          DefinitelyNotSent
    2xx without ``event_id``                       MaybeSent          BadResponse

The ``error`` text is never branched on; only ``errcode``.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import quote, unquote, urlsplit

import httpx
import structlog

from replyd.clock import Clock
from replyd.errors import BadResponse, ConfigError, DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.platforms.base import Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, register_platform
from replyd.platforms import _http

log = structlog.get_logger("replyd.matrix")

API = "/_matrix/client/v3"
MSGTYPES = ("m.text", "m.notice")
# Clock skew between our opened_at and the homeserver's origin_server_ts.
READ_BACK_MARGIN_S = 60.0
# How many reply-event -> room entries ``delete`` can look up (filled by send and read_back).
_ROOM_MEMORY = 10_000

_KNOWN_SETTINGS = frozenset({
    "kind", "allow_insecure_http", "base_url", "token", "user", "password", "device_id", "listing_delay_s",
    "timeout_s", "page_limit", "max_pages", "msgtype", "join_invites", "instance", "search_queries",
})
_MATRIX_TO = re.compile(r"^https://matrix\.to/#/([^/?]+)(?:/([^/?]+))?")


def _seg(value: str, what: str) -> str:
    """Quote one path segment; refuse values that would walk the path."""
    if not value or value in (".", ".."):
        raise Rejected(f"{what}: id {value!r} is not usable in a URL path")
    return quote(value, safe="")


def _event_filter(**extra: Any) -> str:
    """A RoomEventFilter (JSON) for ``m.room.message`` events, plus ``extra`` keys."""
    return json.dumps({"types": ["m.room.message"], **extra}, separators=(",", ":"))


def _relation(content: Any) -> tuple[str | None, str | None]:
    """A message content's (``m.in_reply_to`` event id, thread root event id); None where absent or not a string."""
    rel = content.get("m.relates_to") if isinstance(content, dict) else None
    if not isinstance(rel, dict):
        return None, None
    irt = rel.get("m.in_reply_to")
    reply_to = irt.get("event_id") if isinstance(irt, dict) else None
    root = rel.get("event_id") if rel.get("rel_type") == "m.thread" else None
    return (reply_to if isinstance(reply_to, str) else None), (root if isinstance(root, str) else None)


@register_platform("matrix")
class MatrixPlatform:
    """A Matrix account as a replyd platform: mentions in, replies by transaction id, own events read back."""

    kind: ClassVar[str] = "matrix"

    def __init__(
        self,
        *,
        base_url: str,
        http: httpx.Client,
        clock: Clock,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        device_id: str = "replyd",
        listing_delay_s: float = 2.0,
        timeout_s: float = 15.0,
        page_limit: int = 100,
        max_pages: int = 10,
        msgtype: str = "m.text",
        join_invites: bool = False,
        instance: str | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._token = token or ""
        self._user = user
        self._password = password
        self._device_id = device_id
        self._http = http
        self._clock = clock
        self._timeout = httpx.Timeout(timeout_s)
        self._page_limit = page_limit
        self._max_pages = max_pages
        self._msgtype = msgtype
        self._join_invites = join_invites
        self._user_id: str | None = None
        self._rooms: OrderedDict[str, str] = OrderedDict()  # reply event id -> room id, for delete
        self.listing_delay_s = float(listing_delay_s)
        self.instance = instance or f"matrix:{self._base_url}"

    def __repr__(self) -> str:
        return f"MatrixPlatform(instance={self.instance!r})"

    # --- configuration -------------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, http: httpx.Client, clock: Clock) -> MatrixPlatform:
        """Validate ``settings`` (``ConfigError`` names the key) and build the adapter."""
        unknown = sorted(str(k) for k in settings if k not in _KNOWN_SETTINGS)
        if unknown:
            raise ConfigError(f"matrix setting {unknown[0]!r}: unknown key "
                              f"(known: {', '.join(sorted(_KNOWN_SETTINGS - {'kind'}))})")
        token = _http.setting_secret(settings, "matrix", "token")
        password = _http.setting_secret(settings, "matrix", "password")
        user = settings.get("user")
        if user is not None and (not isinstance(user, str) or not re.fullmatch(r"@?[^\s:@]+(:\S+)?", user.strip())):
            raise ConfigError("matrix setting 'user': must be a user id (@name:server) or a localpart")
        if token is None and (password is None or user is None):
            raise ConfigError("matrix setting 'token': required (token_env), or 'user' with 'password' (password_env)")
        device_id = settings.get("device_id", "replyd")
        if not isinstance(device_id, str) or not re.fullmatch(r"[A-Za-z0-9._=-]{1,64}", device_id):
            raise ConfigError("matrix setting 'device_id': 1-64 characters of A-Z a-z 0-9 . _ = -")
        msgtype = settings.get("msgtype", "m.text")
        if msgtype not in MSGTYPES:
            raise ConfigError(f"matrix setting 'msgtype': {msgtype!r} is not one of {', '.join(MSGTYPES)}")
        _http.setting_queries(settings, "matrix")
        return cls(
            base_url=_http.setting_url(settings, "matrix", "base_url"),
            http=http,
            clock=clock,
            token=token,
            user=user.strip() if isinstance(user, str) else None,
            password=password,
            device_id=device_id,
            listing_delay_s=_http.setting_number(settings, "matrix", "listing_delay_s", 2.0, minimum=0.0),
            timeout_s=_http.setting_number(settings, "matrix", "timeout_s", 15.0, minimum=0.0, exclusive=True),
            page_limit=_http.setting_int(settings, "matrix", "page_limit", 100, 1, 1000),
            max_pages=_http.setting_int(settings, "matrix", "max_pages", 10, 1, 10_000),
            msgtype=msgtype,
            join_invites=_http.setting_flag(settings, "matrix", "join_invites", False),
            instance=_http.setting_instance(settings, "matrix"),
        )

    # --- transport ------------------------------------------------------------------

    def _secrets(self) -> tuple[str, ...]:
        return (self._token, self._password or "")

    def _call(self, method: str, path: str, *, what: str, params: Any = None, body: Any = None,
              acts: bool | None = None, auth: bool = True) -> Any:
        """One request; returns the 2xx JSON object or raises the mapped error (re-logging in once on 401)."""
        if auth and not self._token:
            self._login()
        resp = self._send(method, path, what=what, params=params, body=body, acts=acts, auth=auth)
        if resp.status_code == 401 and auth and self._password is not None:
            log.info("replyd.matrix.relogin", what=what, errcode=self._errcode(resp))
            self._login()
            resp = self._send(method, path, what=what, params=params, body=body, acts=acts, auth=auth)
        self._raise_for_status(resp, what=what, acts=acts)
        return _http.json_body(resp, what, dict)

    def _send(self, method: str, path: str, *, what: str, params: Any, body: Any, acts: bool | None,
              auth: bool) -> httpx.Response:
        return _http.request(
            self._http, method, self._base_url + API + path, what=what, acts=acts, secrets=self._secrets(),
            auth=_http.BearerAuth(self._token) if auth else None, timeout=self._timeout, params=params,
            json=body,
        )

    @staticmethod
    def _errcode(resp: httpx.Response) -> str:
        data = _http.error_json(resp)
        code = data.get("errcode") if isinstance(data, dict) else None
        return code if isinstance(code, str) else ""

    def _raise_for_status(self, resp: httpx.Response, *, what: str, acts: bool | None) -> None:
        """The shared mapping, with Matrix's ``retry_after_ms`` and errcode in the detail."""
        if 200 <= resp.status_code < 300:
            return
        errcode = self._errcode(resp)
        data = _http.error_json(resp)
        if resp.status_code == 429 or errcode == "M_LIMIT_EXCEEDED":
            wait_ms = data.get("retry_after_ms") if isinstance(data, dict) else None
            wait = (wait_ms / 1000.0 if isinstance(wait_ms, (int, float)) and not isinstance(wait_ms, bool)
                    and math.isfinite(wait_ms) and wait_ms >= 0
                    else _http.retry_after_s(resp, self._clock.now()))
            log.warning("replyd.matrix.rate_limited", what=what, retry_after_s=wait)
            raise RateLimited(f"{what}: HTTP {resp.status_code} M_LIMIT_EXCEEDED", status=resp.status_code,
                              retry_after_s=wait)
        try:
            _http.raise_for_status(resp, what=what, acts=acts, now=self._clock.now, secrets=self._secrets())
        except PlatformError as exc:
            if errcode:
                exc.detail = f"{exc.detail} [{errcode}]"
                exc.args = (exc.detail,)
            raise

    def _login(self) -> None:
        """Log in with the password on the fixed device (the same transaction-id scope every time)."""
        if self._password is None or self._user is None:
            raise DefinitelyNotSent("login: no token and no password configured")
        what = "login"
        body = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": self._user},
                "password": self._password, "device_id": self._device_id,
                "initial_device_display_name": "replyd"}
        data = self._call("POST", "/login", what=what, body=body, acts=False, auth=False)
        self._token = _http.field(data, "access_token", what)
        self._user_id = _http.field(data, "user_id", what)
        log.info("replyd.matrix.logged_in", user_id=self._user_id, device_id=self._device_id)

    # --- parsing --------------------------------------------------------------------

    def _parent(self, ev: Any, room_id: str, what: str) -> Parent | None:
        """A ``m.room.message`` event as a parent; ``None`` for other events, edits and redacted ones."""
        if not isinstance(ev, dict) or ev.get("type") != "m.room.message":
            return None
        content = ev.get("content")
        if not isinstance(content, dict) or not isinstance(content.get("body"), str):
            return None  # redacted: nothing left to answer
        relates = content.get("m.relates_to") if isinstance(content.get("m.relates_to"), dict) else {}
        if relates.get("rel_type") == "m.replace":
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

    def _skipped(self, what: str, exc: BadResponse, ev: Any) -> None:
        eid = ev.get("event_id") if isinstance(ev, dict) else None
        log.warning("replyd.matrix.skipped", what=what, problem=exc.detail, event_id=eid if isinstance(eid, str) else None)

    def _mentions_in(self, events: Any, room_id: str, what: str) -> list[Parent]:
        out = []
        for ev in events if isinstance(events, list) else []:
            try:
                parent = self._parent(ev, room_id, what)
            except BadResponse as exc:
                self._skipped(what, exc, ev)
                continue
            if parent is not None and self._mentions_me(parent, ev):
                out.append(parent)
        return out

    def _me(self) -> str:
        if self._user_id is None:
            self.whoami()
        assert self._user_id is not None
        return self._user_id

    # --- Platform -------------------------------------------------------------------

    def whoami(self) -> Identity:
        """Return the bot's user id (``/account/whoami``)."""
        what = "whoami"
        data = self._call("GET", "/account/whoami", what=what)
        self._user_id = _http.field(data, "user_id", what)
        return Identity(sender_id=self._user_id, handle=self._user_id)

    def inbox(self, cursor: str | None) -> Page:
        """Return the events mentioning the bot since ``cursor`` (a ``/sync`` ``next_batch``), oldest first.

        A room whose timeline came back ``limited`` (more events than one sync
        returns) is paged back with ``/messages`` from its ``prev_batch`` to the
        old cursor; if ``max_pages`` runs out first, ``replyd.matrix.gap`` is
        logged and re-find covers the rest.
        """
        what = "inbox"
        me = self._me()
        params = {"timeout": "0", "filter": json.dumps({
            "presence": {"types": []}, "account_data": {"types": []},
            "room": {"timeline": {"types": ["m.room.message"], "limit": self._page_limit},
                     "state": {"types": []}, "ephemeral": {"types": []}, "account_data": {"types": []}}},
            separators=(",", ":"))}
        if cursor:
            params["since"] = cursor
        data = self._call("GET", "/sync", what=what, params=params)
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
        if self._join_invites:
            for room_id in _http.field(rooms, "invite", what, dict, default={}) or {}:
                self._join(room_id)
        parents = sorted(found.values(), key=lambda p: (p.created_at or 0.0, p.id))
        log.debug("replyd.matrix.inbox", bot=me, found=len(parents))
        return Page(parents=parents, cursor=next_batch)

    def _fill_gap(self, room_id: str, prev_batch: str, since: str) -> list[Parent]:
        """Page back from ``prev_batch`` to the old sync token ``since`` in one room."""
        what = "inbox gap"
        out: list[Parent] = []
        token: str | None = prev_batch
        for _ in range(self._max_pages):
            params = {"dir": "b", "from": token, "to": since, "limit": str(self._page_limit),
                      "filter": _event_filter()}
            data = self._call("GET", f"/rooms/{_seg(room_id, what)}/messages", what=what, params=params)
            chunk = _http.field(data, "chunk", what, list, default=[])
            out.extend(self._mentions_in(chunk, room_id, what))
            token = data.get("end") if isinstance(data.get("end"), str) else None
            if not chunk or token is None:
                return out
        log.warning("replyd.matrix.gap", room_id=room_id, pages=self._max_pages)
        return out

    def _join(self, room_id: str) -> None:
        """Accept one invite (``join_invites = true``); a failure is logged, the next sync retries."""
        what = "join"
        try:
            self._call("POST", f"/rooms/{_seg(room_id, what)}/join", what=what, body={})
            log.info("replyd.matrix.joined", room_id=room_id)
        except PlatformError as exc:
            log.warning("replyd.matrix.join_failed", room_id=room_id, problem=exc.detail)

    def search(self, query: str, cursor: str | None) -> Page:
        """Return messages matching ``query`` (server-side ``/search``) newer than ``cursor``.

        The cursor is the newest ``origin_server_ts`` seen (ms) and the event ids
        at exactly that instant (``"<ts>|<id>|…"``), so nothing sharing the
        instant is skipped or offered twice.
        """
        what = "search"
        me = self._me()
        since_ts, seen = -1, set[str]()
        if cursor:
            head, *ids = cursor.split("|")
            since_ts, seen = (int(head), set(ids)) if head.isdigit() else (-1, set())
        body = {"search_categories": {"room_events": {
            "search_term": query, "keys": ["content.body"], "order_by": "recent",
            "filter": {"types": ["m.room.message"], "limit": self._page_limit}}}}
        found: dict[str, Parent] = {}
        next_batch: str | None = None
        for _ in range(self._max_pages):
            params = {"next_batch": next_batch} if next_batch else None
            data = self._call("POST", "/search", what=what, body=body, params=params, acts=False)
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
                except BadResponse as exc:
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
        newest = max((round((p.created_at or 0) * 1000) for p in found.values()), default=since_ts)
        if newest < 0:
            return Page(parents=[], cursor=cursor)
        at_newest = sorted(p.id for p in found.values() if round((p.created_at or 0) * 1000) == newest)
        if newest == since_ts:
            at_newest = sorted(seen | set(at_newest))
        parents = sorted(found.values(), key=lambda p: (p.created_at or 0.0, p.id))
        return Page(parents=parents, cursor="|".join([str(newest), *at_newest]))

    def refind(self, since: float) -> list[Parent]:
        """Re-read every joined room's ``/messages`` back to epoch ``since``; the events mentioning the bot."""
        what = "refind"
        self._me()
        rooms = _http.field(self._call("GET", "/joined_rooms", what=what), "joined_rooms", what, list)
        found: dict[str, Parent] = {}
        for room_id in rooms:
            if not isinstance(room_id, str):
                continue
            for chunk in self._pages_back(room_id, since, what=what, filt=_event_filter()):
                for p in self._mentions_in(chunk, room_id, what):
                    found.setdefault(p.id, p)
        return sorted(found.values(), key=lambda p: (p.created_at or 0.0, p.id))

    def _pages_back(self, room_id: str, since: float, *, what: str, filt: str, complete: list[bool] | None = None):  # noqa: ANN202
        """Yield ``/messages`` chunks newest first until one reaches before epoch ``since`` or the room begins.

        ``complete`` (if given) gets ``True`` appended when the listing really reached back that far.
        """
        token: str | None = None
        for _ in range(self._max_pages):
            params = {"dir": "b", "limit": str(self._page_limit), "filter": filt}
            if token:
                params["from"] = token
            data = self._call("GET", f"/rooms/{_seg(room_id, what)}/messages", what=what, params=params)
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
            room = _http.field(self._call("GET", f"/directory/room/{_seg(room, what)}", what=what), "room_id", what)
        ev = self._call("GET", f"/rooms/{_seg(room, what)}/event/{_seg(event, what)}", what=what)
        parent = self._parent(ev, room, what)
        if parent is None:
            raise Rejected(f"{what}: the event is not a message that can be answered")
        return parent

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Reply to ``parent`` in its room (in its thread if it has one); ``txnId`` = ``provider_key``."""
        what = "send"
        room_id = parent.extra.get("room_id")
        if not isinstance(room_id, str) or not room_id:
            raise Rejected(f"{what}: parent {parent.id!r} carries no room id")
        if not provider_key or not re.fullmatch(r"[A-Za-z0-9._~-]{1,255}", provider_key):
            raise Rejected(f"{what}: provider_key is not a usable transaction id")
        relates: dict[str, Any] = {"m.in_reply_to": {"event_id": parent.id}}
        thread_root = parent.extra.get("thread_root")
        if isinstance(thread_root, str) and thread_root:
            relates.update({"rel_type": "m.thread", "event_id": thread_root, "is_falling_back": False})
        content = {"msgtype": self._msgtype, "body": text, "m.relates_to": relates,
                   "m.mentions": {"user_ids": [parent.author_id]}}
        path = f"/rooms/{_seg(room_id, what)}/send/m.room.message/{_seg(provider_key, what)}"
        try:
            try:
                reply_id = _http.field(self._call("PUT", path, what=what, body=content), "event_id", what)
            except BadResponse as exc:
                # Only a 2xx body is parsed: the event very likely exists, we just cannot name it.
                raise MaybeSent(f"{exc.detail} (after a 2xx)", status=exc.status) from None
        except PlatformError as exc:
            log.info("replyd.matrix.send_failed", parent_id=parent.id, error=type(exc).__name__, status=exc.status,
                     detail=exc.detail)
            raise
        self._remember(reply_id, room_id)
        log.info("replyd.matrix.sent", parent_id=parent.id, reply_id=reply_id, room_id=room_id)
        return Sent(reply_id=reply_id, url=f"https://matrix.to/#/{room_id}/{reply_id}")

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
        result = ReadBack()
        by_room: dict[str, dict[str, float]] = {}
        for p in pending:
            room_id = p.parent.extra.get("room_id")
            if not isinstance(room_id, str) or not room_id:
                log.warning("replyd.matrix.read_back_failed", parent_id=p.parent.id, problem="no room id")
                continue
            opened = by_room.setdefault(room_id, {})
            opened[p.parent.id] = min(p.opened_at, opened.get(p.parent.id, p.opened_at))
        what = "read_back"
        for room_id, opened in by_room.items():
            horizon = min(opened.values()) - READ_BACK_MARGIN_S
            complete: list[bool] = []
            found: dict[str, dict[str, OwnReply]] = {}
            try:
                for chunk in self._pages_back(room_id, horizon, what=what, complete=complete,
                                              filt=_event_filter(senders=[sender_id])):
                    for ev in chunk:
                        if not isinstance(ev, dict) or ev.get("sender") != sender_id:
                            continue
                        pid, _root = _relation(ev.get("content"))
                        if pid in opened and isinstance(ev.get("event_id"), str):
                            ts = ev.get("origin_server_ts")
                            created = ts / 1000.0 if isinstance(ts, (int, float)) else None
                            found.setdefault(pid, {})[ev["event_id"]] = OwnReply(ev["event_id"], pid, created)
                            self._remember(ev["event_id"], room_id)
            except PlatformError as exc:
                log.warning("replyd.matrix.read_back_failed", room_id=room_id, problem=exc.detail)
                continue
            if complete:
                result.checked.update(opened)
            for pid, replies in found.items():
                result.found[pid] = sorted(replies.values(), key=lambda r: (r.created_at or 0.0, r.reply_id))
        log.info("replyd.matrix.read_back", rooms=len(by_room), checked=len(result.checked),
                 found=sum(len(v) for v in result.found.values()))
        return result

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
            ev = self._call("GET", f"/rooms/{_seg(room_id, what)}/event/{_seg(nxt, what)}", what=what)
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
        path = f"/rooms/{_seg(room_id, what)}/redact/{_seg(reply_id, what)}/{_seg(txn, what)}"
        try:
            self._call("PUT", path, what=what, body={"reason": "duplicate reply"})
        except Rejected as exc:
            if exc.status != 404:
                raise
            log.info("replyd.matrix.deleted", reply_id=reply_id, already_gone=True)
            return
        log.info("replyd.matrix.deleted", reply_id=reply_id, already_gone=False)

    def close(self) -> None:
        """Do nothing: the shared http client belongs to the caller."""
