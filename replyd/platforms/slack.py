"""The Slack adapter: a bot user answering mentions and DMs in the parent's thread, found by push and by poll.

Settings (``[bots.settings]`` with ``platform = "slack"``):

=======================  ====================================================================
``token``                required; the bot token ``xoxb-…`` (``token_env = "SLACK_BOT_TOKEN"``)
``app_token``            the app-level token ``xapp-…`` Socket Mode connects with
                         (``app_token_env``); needed only with ``[bots.push] kind = "slack_socket"``
``api_url``              the Web API root (default ``https://slack.com/api``)
``channels``             channel ids the backstop poll reads (default: every conversation the
                         bot is a member of, from ``users.conversations``)
``inbox_lookback_s``     how far back the first poll of a channel reads (default 86400)
``thread_window_s``      threads whose parent is this recent have their new replies read (86400)
``rate_per_minute``      ``{method = n}`` overrides of the client-side method-tier budgets below
``listing_delay_s``      seconds before a sweep may trust a read-back (default 2)
``timeout_s``, ``page_limit`` (1-999, default 200), ``max_pages`` (default 10)
``team_id``              the workspace; the answered-log instance is ``slack:<team_id>``
``max_post_chars``       the longest reply sent as one message (default 4000, at most 40000): a longer
                         answer goes out in parts (``replyd.parts``), every part in the parent's thread
``part_marker``          end each part of a long answer with " (k/n)" (default false)
``instance``             overrides the whole instance (default ``slack:<team_id>`` or ``slack``)
=======================  ====================================================================

Ids: the sender id is the bot's user id from ``auth.test``; a parent id is ``"<channel>:<ts>"``
exactly as Slack serves both halves (opaque: never a float). A reply goes into the parent's thread:
``thread_ts`` = the parent's own ``thread_ts`` when it is itself a thread reply, else its ``ts``.
Every reply carries message metadata ``{"event_type": "replyd_reply", "event_payload": {"parent":
<parent id>}}``: the read-back (``conversations.replies`` of each parent's thread with
``include_all_metadata``, filtered on the bot user id, one walk per thread, grouped by channel)
matches replies to parents on it, never on text. ``chat.postMessage`` has no idempotency key.

Long answers (``PostLimit``): Slack truncates ``text`` beyond 40,000 characters (posted anyway, with the
warning ``message_truncated``) and recommends at most 4,000 (past about that it may show one message as
several): api.slack.com/changelog/2018-04-truncating-really-long-messages and chat.postMessage's ``text``
argument. So a reply is at most ``max_post_chars`` (4,000) characters and a longer answer is sent in parts.
Every part goes into the parent's own thread (Slack threads are one level deep), but part k+1's parent id is
part k's reply id (``part_parent``): its metadata names part k, so the read-back (of the same thread) tells
each part's reply from the others', and a part's row is never closed with another part's reply.

Edits (``EditReply``): ``chat.update`` of one of the bot's replies (``channel``, ``ts``, the whole new
``text``), its replyd metadata sent again so the read-back still matches it. Setting the whole text twice
is harmless, so an edit whose answer was lost is simply tried again.

Discovery: the Events API (``parse_webhook`` through ``replyd.hooks``; ``url_verification``
answered by ``webhook_challenge``), Socket Mode (``stream``: ``apps.connections.open`` → WebSocket,
every envelope acknowledged with its ``envelope_id`` before it is offered, ``disconnect`` ends the
connection and the stream runner reconnects), and the backstop poll (``inbox``:
``conversations.history`` of each channel, mentions of the bot in channels and every message in
DMs; thread replies read through ``conversations.replies`` of threads active since the cursor).
A channel mention arrives twice by push (``message`` and ``app_mention``, different ``event_id``):
both are the same parent, so the guard's key makes the second ``already_answered``.

Rate limits: every method draws from a client-side budget of its Slack tier (``_TIERS``, requests
per minute, bursts up to a minute's worth); an HTTP 429 blocks that method for ``Retry-After``
seconds. Both refuse as ``RateLimited`` before anything is sent.

Error mapping at this boundary (Slack answers most refusals HTTP 200 ``{"ok": false, "error"}``)::

    what happened                                        chat.postMessage   chat.update (edit)  reads
    ---------------------------------------------------  -----------------  ------------------  -----------------
    connect refused, DNS, connect timeout                DefinitelyNotSent  DefinitelyNotSent   DefinitelyNotSent
    read/write timeout, reset, lost response             MaybeSent          MaybeSent           DefinitelyNotSent
    HTTP 429 / ``ratelimited``, a spent tier budget      RateLimited (Retry-After)
    ``invalid_auth``, ``not_authed``, ``token_revoked``,  DefinitelyNotSent  DefinitelyNotSent   DefinitelyNotSent
    ``account_inactive``, ``missing_scope`` …
    ``channel_not_found``, ``not_in_channel``,           Rejected           Rejected            Rejected
    ``is_archived``, ``msg_too_long``, other codes
    ``message_not_found``, ``cant_update_message``,      -                  Rejected            -
    ``edit_window_closed``
    ``internal_error``, ``fatal_error``,                 MaybeSent          MaybeSent           DefinitelyNotSent
    ``service_unavailable``, ``request_timeout``, 5xx
    ``ok: true`` without ``ts`` (an edit: with another   MaybeSent          MaybeSent           BadResponse
    ``ts``); a 2xx without ``ok``
    ``ok: true`` with the ``message_truncated`` warning  sent (logged)      edited (logged)     -
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import httpx
from pydantic import Field, SecretStr, field_validator

from replyd.clock import Clock
from replyd.errors import BadResponse, DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.parts import Limit
from replyd import net
from replyd.platforms import _http, mentions
from replyd.platforms._http import Found
from replyd.platforms.base import Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Token, register_platform

METADATA_TYPE = "replyd_reply"
# Requests per minute of each method's tier (Tier 2: 20, Tier 3: 50, Tier 4: 100; chat.postMessage is
# "special": about one message per second per channel). Slack allows short bursts above these.
_TIERS: dict[str, int] = {
    "auth.test": 100,
    "users.conversations": 20,
    "conversations.history": 50,
    "conversations.replies": 50,
    "chat.postMessage": 60,
    "chat.update": 50,  # Tier 3
    "chat.delete": 50,
}
_AUTH_ERRORS = frozenset({
    "invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired", "missing_scope",
    "no_permission", "not_allowed_token_type", "ekm_access_denied", "team_access_not_granted",
    "two_factor_setup_required", "access_denied",
})
_SERVER_ERRORS = frozenset({"internal_error", "fatal_error", "service_unavailable", "request_timeout"})
# Message subtypes that are a person saying something (others: joins, edits, deletions, bot posts).
_SPOKEN = frozenset({None, "file_share", "thread_broadcast"})
_ID = re.compile(r"^[A-Z0-9]{2,40}$")
_CODE = re.compile(r"[a-z0-9_]{1,64}")
_TS = re.compile(r"^\d{1,12}\.\d{1,9}$")
_PERMALINK = re.compile(r"/archives/([A-Z0-9]+)/p(\d{7,})$")
# Slack truncates text beyond this many characters; it recommends at most RECOMMENDED_CHARS (module docstring).
MAX_CHARS = 40_000
RECOMMENDED_CHARS = 4_000


def ts_order(ts: str) -> Decimal:
    """Slack's ``ts`` as an exact number for ordering (a float loses the microseconds)."""
    try:
        return Decimal(ts)
    except (InvalidOperation, TypeError):
        return Decimal(0)


def _item_id(channel: str, msg: Any) -> str | None:
    """The served id a message would have (``<channel>:<ts>``), for the report of one that cannot be read."""
    ts = msg.get("ts") if isinstance(msg, dict) else None
    return f"{channel}:{ts}" if isinstance(ts, str) and _TS.match(ts) else None


def _event_id(payload: Any) -> str | None:
    """The served id of an Events API body's message, for the report of one that cannot be read."""
    event = payload.get("event") if isinstance(payload, dict) else None
    channel = event.get("channel") if isinstance(event, dict) else None
    return _item_id(channel, event) if isinstance(channel, str) else None


def split_id(parent_id: str) -> tuple[str, str]:
    """``"<channel>:<ts>"`` → (channel, ts); ``Rejected`` when it is not that form."""
    channel, _, ts = parent_id.partition(":")
    if not _ID.match(channel) or not _TS.match(ts):
        raise Rejected(f"slack id {parent_id[:80]!r}: expected '<channel id>:<ts>'")
    return channel, ts


def _archive(channel: str, ts: str) -> str:
    return f"https://slack.com/archives/{channel}/p{ts.replace('.', '')}"


class _Budget:
    """Client-side method budgets: a token bucket per method (its tier) on the injected clock."""

    def __init__(self, clock: Clock, per_minute: Mapping[str, int]) -> None:
        self._clock = clock
        self._rate = dict(per_minute)
        self._tokens: dict[str, tuple[float, float]] = {}  # method -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, method: str) -> None:
        """Spend one request of ``method``'s budget, or raise ``RateLimited`` (nothing sent)."""
        rate = self._rate.get(method)
        if rate is None:
            return
        now = self._clock.now()
        with self._lock:
            tokens, at = self._tokens.get(method, (float(rate), now))
            tokens = min(float(rate), tokens + (now - at) * rate / 60.0)
            if tokens < 1.0:
                self._tokens[method] = (tokens, now)
                raise RateLimited(f"{method}: tier budget of {rate}/min spent (not sent)", status=None,
                                  retry_after_s=(1.0 - tokens) * 60.0 / rate)
            self._tokens[method] = (tokens - 1.0, now)


@register_platform("slack")
class SlackPlatform(_http.HttpPlatform):
    """A Slack bot user as a replyd platform: mentions and DMs in, replies in the parent's thread."""

    kind: ClassVar[str] = "slack"

    class Settings(_http.HttpSettings):
        """``[bots.settings]`` with ``platform = "slack"`` (the table in the module docstring)."""

        URLS: ClassVar[tuple[str, ...]] = ("api_url",)
        token: Token  # the bot token, xoxb-…
        app_token: Token | None = None  # the app-level token, xapp-… (Socket Mode only)
        api_url: _http.Url = "https://slack.com/api"
        channels: list[str] = []  # the backstop poll's channels; empty: users.conversations
        inbox_lookback_s: float = Field(86_400.0, ge=0)  # how far back a channel's first poll reads
        # How old a thread's parent may be for the poll to still read the thread's new replies.
        thread_window_s: float = Field(86_400.0, ge=0)
        rate_per_minute: dict[str, int] = {}  # {method: n} over the tier budgets (_TIERS)
        listing_delay_s: float = Field(2.0, ge=0)  # conversations.replies lists a reply once the post returns
        page_limit: int = Field(200, ge=1, le=999)  # conversations.* limit (Slack advises at most 200)
        max_pages: int = Field(10, ge=1, le=10_000)  # pages per listing walk
        team_id: str | None = None  # the instance becomes slack:<team_id>
        # The longest reply sent as one message; longer answers go out in parts (Slack recommends <= 4,000).
        max_post_chars: int = Field(RECOMMENDED_CHARS, ge=20, le=MAX_CHARS)
        part_marker: bool = False  # end each part of a long answer with " (k/n)" (replyd.parts)
        search_queries: list[str] = []  # refused: bots cannot search Slack

        @field_validator("token")
        @classmethod
        def _bot_token(cls, v: SecretStr) -> SecretStr:
            if not v.get_secret_value().startswith("xoxb-"):
                raise ValueError("must be a bot token (xoxb-…)")  # the value itself is never echoed
            return v

        @field_validator("app_token")
        @classmethod
        def _app_token(cls, v: SecretStr | None) -> SecretStr | None:
            if v is not None and not v.get_secret_value().startswith("xapp-"):
                raise ValueError("must be an app-level token (xapp-…)")
            return v

        @field_validator("channels")
        @classmethod
        def _channel_ids(cls, v: list[str]) -> list[str]:
            if any(not _ID.match(c) for c in v):
                raise ValueError("channel ids look like C0123ABCD (capital letters and digits)")
            return v

        @field_validator("rate_per_minute")
        @classmethod
        def _rates(cls, v: dict[str, int]) -> dict[str, int]:
            if any(n < 1 for n in v.values()):
                raise ValueError("every rate must be at least 1 request per minute")
            return v

        @field_validator("search_queries")
        @classmethod
        def _no_search(cls, v: list[str]) -> list[str]:
            if v:
                raise ValueError("Slack's search.messages needs a user token: a bot cannot search (leave it empty)")
            return v

    s: Settings

    def __init__(self, settings: Settings | None = None, /, *, http: httpx.Client, clock: Clock, **kw: Any) -> None:
        super().__init__(settings, http=http, clock=clock, **kw)
        self._budget = _Budget(clock, {**_TIERS, **self.s.rate_per_minute})
        self._team: str | None = self.s.team_id
        self.instance = self.s.instance or (f"slack:{self.s.team_id}" if self.s.team_id else "slack")

    @property
    def root(self) -> str:
        """The Web API root every method name is joined to."""
        return self.s.api_url

    def _buckets(self, bucket: str) -> tuple[str, ...]:
        # Slack's limits are per method (and workspace): a 429 on one method blocks only that method.
        return (bucket,)

    # --- transport ------------------------------------------------------------------

    def _api(self, method: str, *, params: Mapping[str, Any] | None = None, body: Any = None,
             acts: bool = False, token: SecretStr | None = None) -> dict[str, Any]:
        """One Web API call; the ``ok: true`` body, or the mapped error (see the module's table)."""
        self._budget.take(method)
        auth: httpx.Auth | bool = True
        if token is not None:
            auth = _http.SecretAuth({"Authorization": SecretStr(f"Bearer {token.get_secret_value()}")})
        resp = self._request("POST" if body is not None or acts else "GET", f"/{method}", what=method, bucket=method,
                             acts=acts, auth=auth, params=params, json=body)
        data = _http.error_json(resp)
        error = data.get("error") if isinstance(data, dict) and data.get("ok") is False else None
        if resp.status_code == 429 or error == "ratelimited":
            wait = _http.retry_after_s(resp, self._clock.now())
            self.limits.block(method, wait if wait is not None else 60.0)  # no request until then
            raise RateLimited(f"{method}: HTTP {resp.status_code} ratelimited", status=resp.status_code,
                              retry_after_s=wait)
        if not 200 <= resp.status_code < 300:
            self._raise_for_status(resp, what=method, bucket=method, acts=acts)
        if not isinstance(data, dict):
            if acts:
                raise MaybeSent(f"{method}: HTTP {resp.status_code} body is not a JSON object (after a 2xx)",
                                status=resp.status_code)
            raise BadResponse(f"{method}: body is not a JSON object", status=resp.status_code)
        if data.get("ok") is True:
            return data
        if data.get("ok") is not False:  # a 2xx that is neither a success nor a refusal
            if acts:
                raise MaybeSent(f"{method}: HTTP {resp.status_code} without ok (after a 2xx)", status=resp.status_code)
            raise BadResponse(f"{method}: field ok missing", status=resp.status_code)
        # Slack's codes are short snake_case words; anything else (an echoed token, prose) is not repeated.
        code = error if isinstance(error, str) and _CODE.fullmatch(error) else "unexpected_error"
        detail = f"{method}: {code}"
        if code in _AUTH_ERRORS:
            raise DefinitelyNotSent(detail, status=resp.status_code)
        if code in _SERVER_ERRORS:
            raise (MaybeSent if acts else DefinitelyNotSent)(detail, status=resp.status_code)
        raise Rejected(detail, status=resp.status_code)

    def _pages(self, method: str, params: dict[str, Any], key: str) -> Iterator[tuple[list[Any], bool]]:
        """Yield (items, last) per page of a cursor-paged method, at most ``max_pages`` pages."""
        cursor = ""
        for _ in range(self.s.max_pages):
            data = self._api(method, params={**params, "limit": self.s.page_limit,
                                             **({"cursor": cursor} if cursor else {})})
            items = _http.field(data, key, method, list, default=[])
            cursor = _http.field(data, "response_metadata.next_cursor", method, str, default="")
            yield items, not cursor and not data.get("has_more")
            if not cursor:
                return

    # --- identity and parsing -------------------------------------------------------

    def whoami(self) -> Identity:
        """``auth.test``: the bot's user id (the sender half of the key) and name."""
        data = self._api("auth.test", acts=False, body={})
        user_id = _http.field(data, "user_id", "auth.test")
        if self._team is None and isinstance(data.get("team_id"), str):
            self._team = data["team_id"]
        self._me = Identity(sender_id=user_id, handle=str(data.get("user") or user_id))
        self.log.info("replyd.slack.identified", platform=self.instance, user_id=user_id, team_id=self._team)
        return self._me

    def _parent(self, msg: Any, channel: str, *, channel_type: str | None, mention: bool = True) -> Parent | str:
        """A message as a parent, or why it is none: not spoken by a person, the bot's own, or not for the bot."""
        if not isinstance(msg, dict):
            return "not a message"
        if msg.get("subtype") not in _SPOKEN or msg.get("hidden"):
            return f"message subtype {str(msg.get('subtype'))[:40]} is not answered"
        ts, user = msg.get("ts"), msg.get("user")
        if not isinstance(ts, str) or not _TS.match(ts) or not isinstance(user, str) or not user:
            return "message without ts or user"
        me = self._identity().sender_id
        if user == me:
            return "own message"
        text = msg.get("text") if isinstance(msg.get("text"), str) else ""
        is_dm = channel_type == "im" or channel.startswith("D")
        if mention and not is_dm and f"<@{me}>" not in text:
            return "does not mention the bot"
        thread_ts = msg.get("thread_ts") if isinstance(msg.get("thread_ts"), str) else None
        return Parent(
            id=f"{channel}:{ts}",
            author_id=user,
            author_handle=user,
            author_is_bot=bool(msg.get("bot_id")),
            text=text,
            url=_archive(channel, ts),
            created_at=float(ts),
            thread_depth=1 if thread_ts and thread_ts != ts else 0,
            extra={"channel": channel, "ts": ts, "thread_ts": thread_ts, "team": self._team},
        )

    def parse_event(self, payload: Any, *, mention: bool = True) -> list[Parent] | str:
        """An Events API body (``event_callback``) as its parents, or why it has none (``mention``: channel
        messages that do not mention the bot are none; the webhook leaves that to ``webhook_scope``)."""
        if not isinstance(payload, dict) or payload.get("type") != "event_callback":
            return f"{str(payload.get('type') if isinstance(payload, dict) else 'body')[:40]} is not answered"
        event = payload.get("event")
        if not isinstance(event, dict) or event.get("type") not in ("app_mention", "message"):
            kind = event.get("type") if isinstance(event, dict) else None
            return f"event {str(kind)[:40]} is not answered"
        channel = event.get("channel")
        if not isinstance(channel, str) or not _ID.match(channel):
            raise BadResponse("slack event: field event.channel missing or not a channel id")
        found = self._parent(event, channel, channel_type=event.get("channel_type"), mention=mention)
        return [found] if isinstance(found, Parent) else found

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """An Events API delivery as its parents (``event`` is unused: Slack names the event in the body)."""
        return self.parse_event(payload, mention=False)

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """None when the backstop poll would find the message; else why not.

        The poll reads, with the bot token, its own workspace only, the ``channels`` given (else every
        conversation the bot is a member of: the only ones Slack sends the app events of), and takes the
        mentions of the bot there and every message of a DM. An app installed in several workspaces gets
        every workspace's events on one URL and signing secret: another workspace's are ``other_workspace``.
        """
        me = self._identity()
        body = payload if isinstance(payload, dict) else {}
        auths = body.get("authorizations") if isinstance(body.get("authorizations"), list) else []
        named = [body.get("team_id"), *(a.get("team_id") for a in auths if isinstance(a, dict))]
        teams = {t for t in named if isinstance(t, str)}
        if self._team is not None and self._team not in teams:
            return "other_workspace"  # a delivery naming no workspace is not provably this bot's either
        channel = parent.extra.get("channel")
        if self.s.channels and channel not in self.s.channels:
            return "channel_not_listed"
        event_body = body.get("event")
        channel_type = event_body.get("channel_type") if isinstance(event_body, dict) else None
        is_dm = channel_type == "im" or str(channel).startswith("D")
        if not is_dm and f"<@{me.sender_id}>" not in parent.text:
            return "not_addressed"
        return None

    def webhook_challenge(self, payload: Any) -> dict[str, Any] | None:
        """Answer Slack's ``url_verification`` with its challenge; None for every other delivery."""
        if isinstance(payload, dict) and payload.get("type") == "url_verification":
            challenge = payload.get("challenge")
            return {"challenge": challenge[:512] if isinstance(challenge, str) else ""}
        return None

    # --- Socket Mode ----------------------------------------------------------------

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """Socket Mode: open a connection, acknowledge every envelope at once, yield its parents until a disconnect."""
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        if self.s.app_token is None:
            raise DefinitelyNotSent("socket mode: no app_token (app_token_env = the variable holding the xapp- token)")
        data = self._api("apps.connections.open", body={}, token=self.s.app_token)
        url = _http.field(data, "url", "apps.connections.open")
        parts = urlsplit(url)
        if parts.scheme != "wss" and not (parts.scheme == "ws" and net.is_loopback(parts.hostname or "")):
            raise BadResponse("apps.connections.open: url is not a wss:// URL")
        self._identity()  # parse_event needs the bot user id: asked before the first envelope
        try:
            with connect(url, open_timeout=self.s.timeout_s, close_timeout=2,
                         max_size=_http.MAX_RESPONSE_BYTES) as ws:
                while not stop.is_set():
                    try:
                        raw = ws.recv(timeout=1.0)
                    except TimeoutError:
                        continue
                    try:
                        msg = json.loads(raw)
                    except (ValueError, RecursionError):
                        self.log.warning("replyd.slack.socket_unreadable", platform=self.instance)
                        continue
                    if not isinstance(msg, dict):
                        continue
                    envelope = msg.get("envelope_id")
                    if isinstance(envelope, str) and envelope:
                        # Acknowledged before anything else: Slack redelivers an envelope it has no ack for.
                        ws.send(json.dumps({"envelope_id": envelope}))
                    kind = msg.get("type")
                    if kind == "disconnect":
                        self.log.info("replyd.slack.socket_disconnect", platform=self.instance,
                                      reason=str(msg.get("reason"))[:40])
                        return
                    if kind != "events_api":
                        continue
                    yield from self._read("stream", msg, lambda m: self._in_scope(m.get("payload")),
                                          _event_id(msg.get("payload"))) or ()
        except (WebSocketException, OSError) as exc:
            raise DefinitelyNotSent(_http.redact(f"socket mode: {type(exc).__name__}: {exc}", self._secrets())) from None

    def _in_scope(self, payload: Any) -> list[Parent]:
        """The parents of a Socket Mode event inside the scope a webhook's would be (the others logged)."""
        found = self.parse_event(payload)
        kept = []
        for parent in [] if isinstance(found, str) else found:
            # The same scope as a webhook's: another workspace's or an unlisted channel's is not offered.
            reason = self.webhook_scope("", payload, parent)
            if reason is None:
                kept.append(parent)
            else:
                self.log.info("replyd.slack.socket_dropped", platform=self.instance, reason=reason, parent_id=parent.id)
        return kept

    # --- polling --------------------------------------------------------------------

    def _channels(self) -> list[str]:
        if self.s.channels:
            return list(self.s.channels)
        out: list[str] = []
        for items, _last in self._pages("users.conversations",
                                        {"types": "public_channel,private_channel,im,mpim", "exclude_archived": "true"},
                                        "channels"):
            out.extend(c["id"] for c in items if isinstance(c, dict) and isinstance(c.get("id"), str))
        return out

    def _read_channel(self, channel: str, oldest: str, *, threads_since: str | None = None,
                      what: str = "inbox") -> tuple[list[Parent], str]:
        """Parents in ``channel`` after ``oldest`` (thread replies included) and the newest ts seen.

        Thread replies are not in ``conversations.history``: the threads whose parent is after
        ``threads_since`` (default ``oldest``) and whose latest reply is after ``oldest`` are read too,
        so a mention in a thread started before the cursor is still found.
        """
        me = self._identity().sender_id
        found: dict[str, Parent] = {}
        newest = oldest
        threads: list[str] = []
        complete = False
        scan = min(oldest, threads_since or oldest, key=ts_order)

        def take(msg: dict[str, Any]) -> str | None:
            """Note an active thread; the message's ts when it is newer than ``oldest`` (its parent kept)."""
            if not isinstance(msg.get("ts"), str):
                return None
            latest = msg.get("latest_reply")
            if msg.get("reply_count") and isinstance(latest, str) and ts_order(latest) > ts_order(oldest):
                threads.append(msg["ts"])
            if ts_order(msg["ts"]) <= ts_order(oldest):
                return None  # read only to find active threads
            p = self._parent(msg, channel, channel_type=None)
            if isinstance(p, Parent):
                found[p.id] = p
            return msg["ts"]

        for items, last in self._pages("conversations.history", {"channel": channel, "oldest": scan,
                                                                 "inclusive": "false"}, "messages"):
            complete = last
            for msg in items:
                ts = self._read(what, msg, take, _item_id(channel, msg))
                if ts is not None and _TS.match(ts):  # an unreadable ts names no point to read on from
                    newest = max(newest, ts, key=ts_order)
        if not complete:
            # Newest first: more than max_pages pages since the cursor leaves older ones unread (Events API and
            # Socket Mode still deliver them; raise max_pages or poll more often).
            self.log.warning("replyd.slack.gap", platform=self.instance, channel=channel, pages=self.s.max_pages)
        for root in threads:
            for items, _last in self._pages("conversations.replies", {"channel": channel, "ts": root,
                                                                      "oldest": oldest}, "messages"):
                for msg in items:
                    if isinstance(msg, dict) and msg.get("ts") != root and msg.get("user") != me:
                        p = self._read(what, msg, lambda m: self._parent(m, channel, channel_type=None),
                                       _item_id(channel, msg))
                        if isinstance(p, Parent) and ts_order(p.extra["ts"]) > ts_order(oldest):
                            found[p.id] = p
                            newest = max(newest, p.extra["ts"], key=ts_order)
        return list(found.values()), newest

    def inbox(self, cursor: str | None) -> Page:
        """Mentions and DMs newer than each channel's cursor (``{"<channel>": "<newest ts>"}``)."""
        try:
            seen = json.loads(cursor) if cursor else {}
        except ValueError:
            seen = {}
        seen = seen if isinstance(seen, dict) else {}
        now = self.platform_clock.earliest(self._clock.now(), unmeasured_s=0.0)  # Slack's ts are Slack's clock
        first = f"{max(0.0, now - self.s.inbox_lookback_s):.6f}"
        window = f"{max(0.0, now - self.s.thread_window_s):.6f}"
        parents: list[Parent] = []
        for channel in self._channels():
            oldest = seen.get(channel) if isinstance(seen.get(channel), str) else first
            found, newest = self._read_channel(channel, oldest, threads_since=window)
            parents.extend(found)
            seen[channel] = newest
        parents.sort(key=lambda p: (ts_order(p.extra["ts"]), p.id))
        return Page(parents=parents, cursor=json.dumps(seen, sort_keys=True, separators=(",", ":")))

    def search(self, query: str, cursor: str | None) -> Page:
        """Bots cannot search Slack (``search.messages`` needs a user token): nothing, ever."""
        return Page(parents=[], cursor=cursor)

    def refind(self, since: float) -> list[Parent]:
        """Every mention and DM since epoch ``since`` in the bot's channels, with no cursor."""
        # replyd's epoch on the platform's clock, erring early (unmeasured: as it is, a wider window would
        # offer parents older than the configured look-back)
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        out: list[Parent] = []
        for channel in self._channels():
            out.extend(self._read_channel(channel, f"{max(0.0, since):.6f}", what="refind")[0])
        return sorted(out, key=lambda p: (ts_order(p.extra["ts"]), p.id))

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return the parent's ancestors without a request: Slack threads are one level deep, so a message in a
        thread (``thread_ts`` not its own ``ts``) has one, its root, and any other message none."""
        return parent.thread_depth

    def resolve(self, ref: str) -> Parent:
        """A served id ``C…:ts`` or a permalink (``…/archives/C…/p1700000000000100``) as the parent."""
        ref = ref.strip()
        m = _PERMALINK.search(urlsplit(ref).path) if ref.startswith("http") else None
        if m:
            channel, digits = m.group(1), m.group(2)
            ts = f"{digits[:-6]}.{digits[-6:]}"
            thread = parse_qs(urlsplit(ref).query).get("thread_ts", [ts])[0]
        else:
            channel, ts = split_id(ref)
            thread = ts
        data = self._api("conversations.replies", params={"channel": channel, "ts": thread, "oldest": ts,
                                                           "latest": ts, "inclusive": "true", "limit": 2})
        for msg in _http.field(data, "messages", "resolve", list, default=[]):
            if isinstance(msg, dict) and msg.get("ts") == ts:
                # Named on purpose (CLI, API, MCP): answerable without a mention; the policy still applies.
                p = self._parent(msg, channel, channel_type=None, mention=False)
                if isinstance(p, str):
                    raise Rejected(f"resolve: {p}")
                return p
        raise Rejected(f"resolve: no message {ts} in {channel}")

    # --- send, read back, delete ----------------------------------------------------

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """``chat.postMessage`` into the parent's thread, tagged with the parent id (metadata) for the read-back."""
        channel, ts = split_id(parent.id)
        thread_ts = parent.extra.get("thread_ts") if isinstance(parent.extra.get("thread_ts"), str) else None
        body = {"channel": channel, "text": self._outgoing(parent, text), "thread_ts": thread_ts or ts,
                "unfurl_links": False,
                "metadata": {"event_type": METADATA_TYPE, "event_payload": {"parent": parent.id}}}
        try:
            data = self._api("chat.postMessage", body=body, acts=True)
            reply_ts = data.get("ts")
            if not isinstance(reply_ts, str) or not _TS.match(reply_ts):
                raise MaybeSent("chat.postMessage: ok without a ts (after a 2xx)")
        except PlatformError as exc:
            self.log.info("replyd.slack.send_failed", platform=self.instance, parent_id=parent.id,
                     error=type(exc).__name__, status=exc.status, detail=exc.detail)
            raise
        reply_id = f"{channel}:{reply_ts}"
        self._truncated(data, "chat.postMessage", reply_id)
        self.log.info("replyd.slack.sent", platform=self.instance, parent_id=parent.id, reply_id=reply_id)
        return Sent(reply_id=reply_id, url=_archive(channel, reply_ts))

    def _outgoing(self, parent: Parent, text: str) -> str:
        """``text`` as sent: broadcast, user-group and third-party mentions escaped unless ``allow_mentions``."""
        return text if self.s.allow_mentions else mentions.slack(text, keep=(parent.author_id,))

    def _truncated(self, data: dict[str, Any], method: str, reply_id: str) -> None:
        """Log Slack's ``message_truncated`` warning: the message landed, cut at 40,000 characters."""
        meta = data.get("response_metadata")
        warnings = meta.get("warnings") if isinstance(meta, dict) else None
        if isinstance(warnings, list) and "message_truncated" in warnings:
            # Landed all the same (nothing to retry); max_post_chars keeps replies far below this.
            self.log.warning("replyd.slack.truncated", platform=self.instance, method=method, reply_id=reply_id)

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """``EditReply``: ``chat.update`` the bot's reply ``reply_id`` to ``text``, its replyd metadata kept."""
        channel, ts = split_id(reply_id)
        # The metadata sent again (the same parent id): a read-back after the edit still matches the reply.
        body = {"channel": channel, "ts": ts, "text": self._outgoing(parent, text),
                "metadata": {"event_type": METADATA_TYPE, "event_payload": {"parent": parent.id}}}

        def update() -> None:
            data = self._api("chat.update", body=body, acts=True)
            if data.get("ts") not in (None, ts):
                raise MaybeSent("chat.update: ok for another ts (after a 2xx)")
            self._truncated(data, "chat.update", reply_id)

        self._edited(parent, reply_id, text, update)  # logged replyd.slack.edited / edit_failed, as every adapter

    def post_limit(self, parent: Parent) -> Limit:
        """``PostLimit``: ``max_post_chars`` characters (Slack recommends at most 4,000; module docstring)."""
        return Limit(self.s.max_post_chars, "chars", self.s.part_marker)

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """``PostLimit``: the next part goes into the parent's thread, answering the part before it by id.

        Its id is the previous part's reply id, so its metadata (and the read-back of its row) names that part,
        never the parent another part answers; its ``thread_ts`` is the parent's thread, where ``send`` posts.
        """
        channel, ts = split_id(previous_reply_id)
        root = parent.extra.get("thread_ts") if isinstance(parent.extra.get("thread_ts"), str) else None
        me = self._me.sender_id if self._me is not None else ""
        return Parent(id=previous_reply_id, author_id=me, author_handle=me, author_is_bot=True,
                      url=_archive(channel, ts), created_at=float(ts), thread_depth=1,
                      extra={"channel": channel, "ts": ts, "thread_ts": root or split_id(parent.id)[1],
                             "team": self._team})

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """The archive link of one of the bot's replies."""
        try:
            channel, ts = split_id(reply_id)
        except Rejected:
            return ""
        return _archive(channel, ts)

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Own replies to the pending parents: one ``conversations.replies`` walk per thread, grouped by channel.

        A thread's parents are ``checked`` only when its whole listing was read; a failed or
        truncated thread leaves them unchecked (their rows stay open).
        """
        roots: dict[str, str] = {}  # parent id -> "<channel>:<thread root ts>"
        for p in pending:
            try:
                channel, ts = split_id(p.parent.id)
            except Rejected:
                self.log.warning("replyd.slack.read_back_failed", parent_id=p.parent.id[:80], problem="not a slack id")
                continue
            root = p.parent.extra.get("thread_ts") if isinstance(p.parent.extra.get("thread_ts"), str) else ts
            roots[p.parent.id] = f"{channel}:{root}"

        def threads(opened: dict[str, float], checked: set[str]) -> Iterator[tuple[str, list[str]]]:
            by_thread: dict[str, list[str]] = {}
            for pid in opened:
                if pid in roots and pid not in checked:
                    by_thread.setdefault(roots[pid], []).append(pid)
            return iter(sorted(by_thread.items()))  # sorted: one channel's threads one after another

        def walk(thread: str, pids: list[str], found: Found) -> bool:
            channel, _, root = thread.partition(":")
            complete = False
            for items, last in self._pages("conversations.replies", {"channel": channel, "ts": root,
                                                                     "include_all_metadata": "true"}, "messages"):
                for msg in items:
                    pid = self._own_reply_to(msg, sender_id)
                    if pid in pids:
                        rid = f"{channel}:{msg['ts']}"
                        found.setdefault(pid, {})[rid] = OwnReply(rid, pid, float(msg["ts"]))
                complete = last
            return complete

        return self._read_back(pending, feed=None, fallback=walk, units=threads,
                               sort_key=lambda rid: ts_order(rid.partition(":")[2]))

    @staticmethod
    def _own_reply_to(msg: Any, sender_id: str) -> str | None:
        """The parent id a message of the bot's answers (its replyd metadata), else None."""
        if not isinstance(msg, dict) or msg.get("user") != sender_id or not isinstance(msg.get("ts"), str):
            return None
        meta = msg.get("metadata")
        if not isinstance(meta, dict) or meta.get("event_type") != METADATA_TYPE:
            return None
        payload = meta.get("event_payload")
        pid = payload.get("parent") if isinstance(payload, dict) else None
        return pid if isinstance(pid, str) else None

    def delete(self, reply_id: str) -> None:
        """``chat.delete`` one own reply; one already gone counts as done."""
        channel, ts = split_id(reply_id)
        try:
            self._api("chat.delete", body={"channel": channel, "ts": ts}, acts=True)
        except Rejected as exc:
            if not exc.detail.endswith("message_not_found"):
                raise
            self.log.info("replyd.slack.deleted", platform=self.instance, reply_id=reply_id, already_gone=True)
            return
        self.log.info("replyd.slack.deleted", platform=self.instance, reply_id=reply_id, already_gone=False)

    def close(self) -> None:
        """Do nothing: the shared http client belongs to the caller."""


__all__ = ["METADATA_TYPE", "SlackPlatform", "split_id", "ts_order"]
