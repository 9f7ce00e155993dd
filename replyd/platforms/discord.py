"""The Discord adapter: a bot answering mentions, replies to it and DMs, found by the Gateway and by a REST poll.

Settings (``[bots.settings]`` with ``platform = "discord"``):

=======================  ====================================================================
``token``                required; the bot token (``token_env = "DISCORD_BOT_TOKEN"``), sent as
                         ``Authorization: Bot <token>``
``api_url``              the REST root (default ``https://discord.com/api/v10``)
``gateway_url``          the Gateway URL (default: ``GET /gateway/bot``'s ``url``)
``channels``             channel ids (snowflakes) the backstop poll reads; DMs the Gateway
                         delivers need no listing
``message_content``      ask for the privileged ``MESSAGE_CONTENT`` intent (default false: a bot
                         still gets the content of messages that mention it, of DMs and of its
                         own; a reply to the bot that turned its ping off arrives with ``content: ""``)
``inbox_lookback_s``     how far back the first poll of a channel reads (default 86400)
``listing_delay_s``      seconds before a sweep may trust a read-back (default 2)
``nonce_window_s``       what replyd assumes of Discord's undocumented nonce window ("a few minutes";
                         informational: the read-back never relies on it)
``part_marker``          end each part of an answer longer than one message with " (k/n)" (default false)
``timeout_s``, ``page_limit`` (1-100, default 100), ``max_pages`` (default 10)
``instance``             overrides the answered-log instance (default ``discord``)
=======================  ====================================================================

Ids: the sender id is the bot user's id from ``GET /users/@me``; a parent id is
``"<channel id>:<message id>"``, both snowflakes exactly as served (strings, never ints).

Send: ``POST /channels/{channel}/messages`` with ``message_reference`` (the parent, ``fail_if_not_exists:
true``), ``allowed_mentions`` ``{"parse": [], "replied_user": true}`` (only the replied-to author is pinged: no
``@everyone``, ``@here``, role or user ping whatever the text says, unless ``allow_mentions``) and the
guard's provider key as ``nonce`` with ``enforce_nonce: true``.
The key (``provider_key``) is 25 characters, Discord's maximum, derived from (instance, sender, parent): the
same on every attempt, so a retry after a lost answer inside Discord's window ("the past few minutes",
discord-api-docs#6647) gets the earlier message back and no new one. Past the window the read-back closes
the row: the nonce narrows the gap, it is not the guarantee.

Why ``fail_if_not_exists: true``: with ``false`` Discord posts a reply to a deleted parent as a plain
message without ``message_reference``, which the read-back (matching ``message_reference.message_id``) can
never tie to its parent: the row would go ``not_landed`` and a second stray message could follow. With
``true`` a gone parent is one ``50035`` refusal and nothing is posted (``Rejected``).

Long answers (``PostLimit``): a message's ``content`` is at most 2,000 characters, counted by Discord in Unicode
code points (its API counts ``len`` of a Python string: discord-api-docs#1315), which is ``replyd.parts``'s
``"chars"`` unit, so the limit is exactly 2,000. Part k+1 is a reply (``message_reference``) to part k's message,
so each part's row is read back by its own reference, as a reply to a person's message is. Streamed answers
(``EditReply``): ``PATCH /channels/{channel}/messages/{message}`` sets the whole ``content`` again (doing it
twice is harmless); an interaction's answer is its original response, edited by the held token.

Read-back: ``GET /channels/{channel}/messages?after=<snowflake>`` once per channel for all its pending
parents, paged forward from the later of the oldest parent's id and the oldest row's opening (as a
snowflake, on Discord's clock), filtered on ``author.id`` = the bot and ``message_reference.message_id`` =
the parent's message id; never on text. A channel's parents are ``checked`` only when the listing ran out
within ``max_pages``.

Discovery: the Gateway (``stream``): HELLO → IDENTIFY (intents ``GUILD_MESSAGES | DIRECT_MESSAGES``, plus
``MESSAGE_CONTENT`` when set) or RESUME (session id + the last sequence recorded) on a reconnect, heartbeats at
the HELLO's interval (a missing ACK is a zombied connection: closed and resumed), ``RECONNECT`` and
``INVALID_SESSION`` (``d: false``: identify afresh). A RESUME replays what was dispatched after the sequence
(and, as observed, sometimes events already seen): every ``MESSAGE_CREATE`` becomes the same ``Parent`` the
poll builds, so a replay is ``already_answered`` at the guard. The backstop (``inbox``) reads each listed
channel's messages after its cursor. Addressed: a message mentioning the bot, replying to one of its
messages, or in a DM.

A DM at a crash (``ResumableStream``): no poll can list DMs. The daemon's runner records each parent the
stream yields as a ``released`` row before reading on; a frame's seq counts as recorded only then. The
session (id, resume URL, that seq; never the token) is stored in the cursor ``gateway``, so a restarted
process RESUMEs it and Discord replays the rest. The connection closes with 4000, never 1000/1001 (which end
the session). A RESUME refused logs ``replyd.discord.resume_failed`` with the seq after which events are lost.

Interactions (slash commands, ``[bots.push] kind = "discord"``: the HTTP interactions endpoint through
``replyd.hooks``, the Ed25519 check there with the application's public key as ``secret_env``): PING is
answered PONG; a command is answered with the deferred response (type 5) at once, inside Discord's 3 s, and
offered as a parent whose id is the interaction id; the answer edits that deferred response (``PATCH
/webhooks/{app}/{token}/messages/@original``: one message per interaction whatever the retries) and the
read-back reads it back (edited: no LOADING flag). The token is held in memory only (a credential for 15
minutes) and a send that cannot finish inside its 15 minutes is ``Rejected`` (reported, never retried).

Rate limits: every request draws on the global budget and on its route's bucket (``X-RateLimit-Bucket`` as
learned, per channel); a 429 blocks its bucket, or everything with ``X-RateLimit-Global`` /
``"global": true``, for ``Retry-After`` (else the body's ``retry_after``, else ``X-RateLimit-Reset-After``)
seconds; ``X-RateLimit-Remaining: 0`` refuses locally until ``X-RateLimit-Reset``.

Error mapping at this boundary (Discord's JSON error code in brackets; the shared table in ``_http.py``)::

    what happened                                       create message     edit message       reads
    --------------------------------------------------  -----------------  -----------------  -----------------
    connect refused, DNS, connect timeout               DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    read/write timeout, reset, lost response            MaybeSent          MaybeSent          DefinitelyNotSent
    429 (bucket, global or shared)                      RateLimited        RateLimited        RateLimited
    401 (bad token)                                     DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    403 [50013 missing permissions, 50001 missing       Rejected           Rejected           Rejected
      access, 50007 cannot DM the user, 50005 cannot
      edit a message authored by another user]
    400 [50035 invalid form body: too long, unknown     Rejected           Rejected           Rejected
      reply target, empty], other 4xx
    404 [10003 unknown channel, 10008 unknown message:  Rejected           Rejected (the      Rejected
      on a create with enforce_nonce also "a message                       reply is gone)
      with this nonce was made and deleted"]
    500-599                                             MaybeSent          MaybeSent          DefinitelyNotSent
    2xx without an id                                   MaybeSent          done (the body     BadResponse
                                                                           is not needed)
    interaction token not held / past its 15 minutes    DefinitelyNotSent  DefinitelyNotSent
                                                        / Rejected         / Rejected
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import urlencode, urlsplit

import httpx
from pydantic import Field, SecretStr, field_validator

from replyd.clock import Clock
from replyd.errors import BadResponse, DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.parts import Limit
from replyd import net
from replyd.platforms import _http, mentions
from replyd.platforms._http import Found, id_order
from replyd.platforms.base import Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Token, register_platform

DISCORD_EPOCH_MS = 1_420_070_400_000
NONCE_LEN = 25  # Discord's documented maximum for a message nonce
MAX_CONTENT = 2000  # a message's content, in code points (module docstring)
INTENT_GUILD_MESSAGES = 1 << 9
INTENT_DIRECT_MESSAGES = 1 << 12
INTENT_MESSAGE_CONTENT = 1 << 15  # privileged: enable it in the developer portal first
# Message types a person writes: DEFAULT and REPLY (joins, pins, boosts, thread starters are not answered).
_SPOKEN_TYPES = frozenset({0, 19})
_DM_TYPES = frozenset({1, 3})  # DM, GROUP_DM
_SNOWFLAKE = re.compile(r"^[0-9]{1,20}$")
_WORD = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # a rate-limit bucket hash or scope as Discord sends them
_LINK = re.compile(r"/channels/(@me|[0-9]{1,20})/([0-9]{1,20})/([0-9]{1,20})/?$")
# Codes whose 403 is a standing refusal of this target, not a credential problem.
_FORBIDDEN_CODES = frozenset({50001, 50005, 50007, 50013})
# Gateway close codes after which identifying again cannot help (the operator must change something).
_FATAL_CLOSE = {4004: "authentication failed (the bot token)", 4010: "invalid shard", 4011: "sharding required",
                4012: "invalid API version", 4013: "invalid intents",
                4014: "disallowed intents (enable MESSAGE_CONTENT in the developer portal, or message_content = false)"}
_SESSION_GONE = frozenset({4007, 4009})  # invalid seq, session timed out: identify afresh
SESSION_SAVE_S = 1.0  # at most one session save a second between heartbeats (a resume replays the rest)
INTERACTION_TOKEN_LIFE_S = 900.0  # "Interaction tokens are valid for 15 minutes"
FLAG_LOADING = 1 << 7  # a deferred response not yet edited ("thinking…")
_TOKEN = re.compile(r"^[A-Za-z0-9_.-]{20,500}$")


def snowflake_ms(snowflake: str) -> float:
    """The creation time (epoch ms) a snowflake carries."""
    return float((int(snowflake) >> 22) + DISCORD_EPOCH_MS)


def snowflake_at(epoch_s: float) -> str:
    """The smallest snowflake of epoch second ``epoch_s`` (a listing's ``after`` bound)."""
    ms = max(0, int(epoch_s * 1000) - DISCORD_EPOCH_MS)
    return str(ms << 22)


def _message_id(data: dict[str, Any]) -> str | None:
    """The served id (``<channel>:<message>``) of a message object, for the report of one that cannot be read."""
    channel, message = data.get("channel_id"), data.get("id")
    ok = all(isinstance(x, str) and _SNOWFLAKE.match(x) for x in (channel, message))
    return f"{channel}:{message}" if ok else None


def split_id(parent_id: str) -> tuple[str, str]:
    """``"<channel>:<message>"`` → (channel, message); ``Rejected`` when it is not that form."""
    channel, _, message = parent_id.partition(":")
    if not _SNOWFLAKE.match(channel) or not _SNOWFLAKE.match(message):
        raise Rejected(f"discord id {parent_id[:80]!r}: expected '<channel id>:<message id>'")
    return channel, message


def discord_nonce(instance: str, sender_id: str, parent_id: str) -> str:
    """The create's nonce for (instance, sender, parent): 25 hex characters, the same on every attempt."""
    raw = f"replyd\x1f{instance}\x1f{sender_id}\x1f{parent_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:NONCE_LEN]


def _resume_url(url: Any) -> str | None:
    """A resume URL the token may travel to: ``wss://``, or ``ws://`` to loopback only; else None."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or not parts.hostname:
        return None
    return url if parts.scheme == "wss" or (parts.scheme == "ws" and net.is_loopback(parts.hostname)) else None


def _link(guild: str | None, channel: str, message: str) -> str:
    return f"https://discord.com/channels/{guild or '@me'}/{channel}/{message}"


def _ref_id(msg: dict[str, Any], channel: str) -> str | None:
    """The id of the message ``msg`` replies to in the same channel, else None (a forward or a cross-post)."""
    ref = msg.get("message_reference") if isinstance(msg.get("message_reference"), dict) else {}
    mid = ref.get("message_id")
    if not isinstance(mid, str) or not _SNOWFLAKE.match(mid) or ref.get("channel_id", channel) != channel:
        return None
    return mid if ref.get("type", 0) == 0 else None  # type 1 is a forward, not a reply


@register_platform("discord")
class DiscordPlatform(_http.HttpPlatform):
    """A Discord bot user as a replyd platform: mentions, replies and DMs in, replies by message reference out."""

    kind: ClassVar[str] = "discord"
    BUCKET: ClassVar[str] = "global"

    class Settings(_http.HttpSettings):
        """``[bots.settings]`` with ``platform = "discord"`` (the table in the module docstring)."""

        URLS: ClassVar[tuple[str, ...]] = ("api_url", "gateway_url")
        token: Token  # the bot token (never a user token)
        api_url: _http.Url = "https://discord.com/api/v10"
        gateway_url: str | None = None  # wss://…; default from GET /gateway/bot
        channels: list[str] = []  # the backstop poll's channels (snowflakes)
        message_content: bool = False  # ask for the privileged MESSAGE_CONTENT intent
        inbox_lookback_s: float = Field(86_400.0, ge=0)  # how far back a channel's first poll reads
        listing_delay_s: float = Field(2.0, ge=0)  # a created message lists at once
        nonce_window_s: float = Field(120.0, ge=0)  # assumed, undocumented: never relied on
        page_limit: int = Field(100, ge=1, le=100)  # GET …/messages takes at most 100
        max_pages: int = Field(10, ge=1, le=10_000)  # pages per channel walk
        search_queries: list[str] = []  # refused: a bot cannot search Discord
        part_marker: bool = False  # end each part of a long answer with " (k/n)"

        @field_validator("token")
        @classmethod
        def _bot_token(cls, v: SecretStr) -> SecretStr:
            if v.get_secret_value().lower().startswith(("bot ", "bearer ")):
                raise ValueError("give the bare token: replyd adds 'Bot '")  # the value itself is never echoed
            return v

        @field_validator("gateway_url")
        @classmethod
        def _gateway(cls, v: str | None) -> str | None:
            if v is None:
                return v
            parts = urlsplit(v)
            if parts.scheme not in ("wss", "ws") or not parts.hostname:
                raise ValueError("must be a wss:// URL")
            if parts.scheme == "ws" and not net.is_loopback(parts.hostname):
                raise ValueError("ws:// only to loopback: the token would travel in clear text")
            return v

        @field_validator("channels")
        @classmethod
        def _channel_ids(cls, v: list[str]) -> list[str]:
            if any(not isinstance(c, str) or not _SNOWFLAKE.match(c) for c in v):
                raise ValueError("channel ids are snowflakes: strings of digits, e.g. \"1234567890123456789\"")
            return v

        @field_validator("search_queries")
        @classmethod
        def _no_search(cls, v: list[str]) -> list[str]:
            if v:
                raise ValueError("a Discord bot cannot search messages (leave it empty)")
            return v

    s: Settings

    def __init__(self, settings: Settings | None = None, /, *, http: httpx.Client, clock: Clock, **kw: Any) -> None:
        super().__init__(settings, http=http, clock=clock, **kw)
        self.instance = self.s.instance or "discord"
        self._route_bucket: dict[str, str] = {}  # route -> X-RateLimit-Bucket learned
        self._channel_kind: dict[str, tuple[bool, str | None]] = {}  # channel -> (is a DM, guild id)
        self._session: dict[str, Any] = {}  # Gateway: session_id, resume_gateway_url, seq (the last seen)
        self._kept: int | None = None  # the last seq whose events are all recorded: what RESUME sends
        self._slot: tuple[Callable[[], str | None], Callable[[str], None], str] | None = None  # hold_session's
        self._saved: tuple[str, int] | None = None  # (session id, seq) last stored
        self._saved_at = 0.0  # monotonic
        self._every_s = 60.0  # the heartbeat interval HELLO gave
        self._resuming = False  # a RESUME sent and not yet answered RESUMED
        self._loaded_at: float | None = None  # when the stored session was last saved (injected clock)
        self._refused: str | None = None  # a session refused to a RESUME, or taken by another process
        # Interactions: id -> (application id, token, expiry on the injected clock). In memory only: the token
        # lets anyone answer as the app for 15 minutes, so it never rides in the stored parent snapshot.
        self._interactions: dict[str, tuple[str, str, float]] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        """The REST root every path is joined to."""
        return self.s.api_url

    def _auth_headers(self) -> Mapping[str, SecretStr]:
        return {"Authorization": SecretStr(f"Bot {self.s.token.get_secret_value()}")}

    def _secrets(self) -> tuple[str, ...]:
        """The settings' secrets and every interaction token held (they sit in webhook URLs)."""
        with self._lock:
            self._drop_expired()
            held = tuple(t for _app, t, _exp in self._interactions.values())
        return super()._secrets() + held

    def _drop_expired(self) -> None:
        """Forget tokens past their 15 minutes (under ``_lock``): nothing uses them, so nothing logs them. A request
        sent just before the end ends within ``timeout_s``: its error text is still masked."""
        gone = self._clock.now() - self.s.timeout_s - 60.0
        for iid in [i for i, (_app, _t, exp) in self._interactions.items() if exp < gone]:
            del self._interactions[iid]

    # --- transport: buckets, 429s, error bodies -----------------------------------------

    def _bucket(self, route: str, major: str) -> str:
        """The budget a request of ``route`` on top-level resource ``major`` draws on (Discord's hash once known)."""
        with self._lock:
            return f"{self._route_bucket.get(route, route)}:{major}"

    def _api(self, method: str, route: str, path: str, *, what: str, major: str = "", acts: bool = False,
             **kwargs: Any) -> httpx.Response:
        """One REST call under the global and the route's budget; a 2xx response or the mapped error."""
        bucket = self._bucket(route, major)
        resp = self._request(method, path, what=what, bucket=bucket, acts=acts, **kwargs)
        learned = resp.headers.get("x-ratelimit-bucket")
        if learned and _WORD.match(learned):
            with self._lock:
                self._route_bucket[route] = learned
            if f"{learned}:{major}" != bucket:
                self.limits.note(f"{learned}:{major}", resp)
        if not 200 <= resp.status_code < 300:
            self._raise_for_status(resp, what=what, bucket=bucket, acts=acts)
        return resp

    def _wait_s(self, resp: httpx.Response) -> float | None:
        """``Retry-After``, else the body's ``retry_after``, else ``X-RateLimit-Reset-After``."""
        wait = _http.retry_after_s(resp, self._clock.now()) if "retry-after" in resp.headers else None
        if wait is not None:
            return wait
        data = _http.error_json(resp)
        value = data.get("retry_after") if isinstance(data, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 86_400:
            return float(value)
        try:
            after = float(resp.headers.get("x-ratelimit-reset-after", ""))
        except ValueError:
            return None
        return after if 0 <= after < 86_400 else None

    def _error_text(self, resp: httpx.Response) -> str:
        """``<code> <message>`` of Discord's JSON error body (logs only)."""
        data = _http.error_json(resp)
        if not isinstance(data, dict):
            return ""
        code, message = data.get("code"), data.get("message")
        words = " ".join(str(x) for x in (code, message) if isinstance(x, (int, str)) and not isinstance(x, bool))
        return " ".join(words.split())[:200]

    def _raise_for_status(self, resp: httpx.Response, *, what: str, bucket: str = "", acts: bool | None = None) -> None:
        """429 blocks its bucket (or the global one); Discord's 403 codes are standing refusals; else the table."""
        status = resp.status_code
        if status == 429:
            data = _http.error_json(resp)
            is_global = (resp.headers.get("x-ratelimit-global", "").lower() == "true"
                         or (isinstance(data, dict) and data.get("global") is True))
            wait = self._wait_s(resp)
            self.limits.block(self.BUCKET if is_global else (bucket or self.BUCKET), wait if wait is not None else 1.0)
            self.log.warning("replyd.discord.rate_limited", platform=self.instance, what=what,
                             bucket="global" if is_global else bucket, wait_s=wait,
                             scope=resp.headers.get("x-ratelimit-scope", "")[:16] if _WORD.match(
                                 resp.headers.get("x-ratelimit-scope", "")) else None)
            raise RateLimited(self._detail(resp, what), status=429, retry_after_s=wait)
        if status == 403:
            data = _http.error_json(resp)
            if isinstance(data, dict) and data.get("code") in _FORBIDDEN_CODES:
                raise Rejected(self._detail(resp, what), status=status)
        super()._raise_for_status(resp, what=what, bucket=bucket, acts=acts)

    # --- identity and parsing -------------------------------------------------------

    def whoami(self) -> Identity:
        """``GET /users/@me``: the bot user's id (the sender half of the key) and name."""
        resp = self._api("GET", "/users/@me", "/users/@me", what="users/@me")
        body = _http.json_body(resp, "users/@me", dict)
        uid = _http.served_id(body, "id", "users/@me")
        if not _SNOWFLAKE.match(uid):
            raise BadResponse("users/@me: field id is not a snowflake")
        self._me = Identity(sender_id=uid, handle=str(body.get("username") or uid))
        self.log.info("replyd.discord.identified", platform=self.instance, user_id=uid)
        return self._me

    def provider_key(self, sender_id: str, parent_id: str) -> str:
        """``ProviderKeys``: the nonce, 25 characters, the same on every attempt."""
        return discord_nonce(self.instance, sender_id, parent_id)

    def _kind_of(self, channel: str) -> tuple[bool, str | None]:
        """(is a DM, guild id) of ``channel``, asked once per channel."""
        with self._lock:
            known = self._channel_kind.get(channel)
        if known is not None:
            return known
        resp = self._api("GET", "/channels/{id}", f"/channels/{channel}", what="channel", major=channel)
        body = _http.json_body(resp, "channel", dict)
        kind = body.get("type")
        guild = body.get("guild_id") if isinstance(body.get("guild_id"), str) else None
        known = (kind in _DM_TYPES, guild)
        with self._lock:
            self._channel_kind[channel] = known
        return known

    def _parent(self, msg: Any, *, dm: bool | None, guild: str | None = None, mention: bool = True) -> Parent | str:
        """A message as a parent, or why it is none: not a person's words, the bot's own, or not for the bot."""
        if not isinstance(msg, dict):
            return "not a message"
        if msg.get("type", 0) not in _SPOKEN_TYPES:
            return f"message type {str(msg.get('type'))[:10]} is not answered"
        mid, channel = msg.get("id"), msg.get("channel_id")
        author = msg.get("author") if isinstance(msg.get("author"), dict) else {}
        uid = author.get("id")
        if not all(isinstance(x, str) and _SNOWFLAKE.match(x) for x in (mid, channel, uid)):
            return "message without id, channel_id or author.id"
        me = self._identity().sender_id
        if uid == me:
            return "own message"
        if msg.get("webhook_id"):
            return "a webhook's message"
        guild = msg.get("guild_id") if isinstance(msg.get("guild_id"), str) else guild
        is_dm = dm if dm is not None else guild is None
        mentions = msg.get("mentions") if isinstance(msg.get("mentions"), list) else []
        mentioned = any(isinstance(m, dict) and m.get("id") == me for m in mentions)
        ref = msg.get("referenced_message") if isinstance(msg.get("referenced_message"), dict) else {}
        ref_author = ref.get("author") if isinstance(ref.get("author"), dict) else {}
        reply_to_me = ref_author.get("id") == me
        if mention and not (is_dm or mentioned or reply_to_me):
            return "does not address the bot"
        try:
            created = _http.iso_to_epoch(msg["timestamp"]) if isinstance(msg.get("timestamp"), str) else None
        except ValueError:
            created = None
        text = msg.get("content") if isinstance(msg.get("content"), str) else ""
        return Parent(
            id=f"{channel}:{mid}",
            author_id=uid,
            author_handle=str(author.get("username") or uid),
            author_is_bot=bool(author.get("bot")),
            text=text,
            url=_link(guild, channel, mid),
            created_at=created if created is not None else snowflake_ms(mid) / 1000.0,
            thread_depth=1 if ref else 0,
            extra={"channel": channel, "message": mid, "guild": guild, "dm": is_dm, "mentioned": mentioned,
                   "reply_to_me": reply_to_me, "ref": _ref_id(msg, channel)},
        )

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """``Addressing``: a mention, a reply to the bot or a DM, from the message's own fields."""
        x = parent.extra
        return bool(x.get("dm") or x.get("mentioned") or x.get("reply_to_me"))

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """The jump link of one of the bot's replies (``@me`` stands for the guild, which the id does not carry)."""
        try:
            channel, message = split_id(reply_id)
        except Rejected:
            return ""
        guild = self._channel_kind.get(channel, (False, None))[1]
        return _link(guild, channel, message)

    # --- polling --------------------------------------------------------------------

    def _pages_after(self, channel: str, after: str) -> Iterator[tuple[list[dict[str, Any]], bool]]:
        """Yield (messages oldest first, last) of ``channel`` after snowflake ``after``, at most ``max_pages``."""
        for _ in range(self.s.max_pages):
            params = {"after": after, "limit": self.s.page_limit}
            resp = self._api("GET", "/channels/{id}/messages", f"/channels/{channel}/messages?{urlencode(params)}",
                             what="channel messages", major=channel)
            items = []
            for m in _http.json_body(resp, "channel messages", list):
                if isinstance(m, dict) and isinstance(m.get("id"), str) and _SNOWFLAKE.match(m["id"]):
                    items.append(m)
                else:  # no id to page by: reported, and the page goes on
                    self._skipped("channel messages", "a message without a snowflake id", m)
            items.sort(key=lambda m: id_order(m["id"]))  # Discord serves newest first
            last = len(items) < self.s.page_limit
            yield items, last
            if last or not items:
                return
            after = items[-1]["id"]

    def _read_channel(self, channel: str, after: str, *, mention: bool = True) -> tuple[list[Parent], str, bool]:
        """Addressed parents in ``channel`` after ``after``, the newest id seen, whether the walk was complete."""
        dm, guild = self._kind_of(channel)
        found: list[Parent] = []
        newest, complete = after, False
        for items, last in self._pages_after(channel, after):
            complete = last
            for msg in items:
                newest = max(newest, msg["id"], key=id_order)  # past an unreadable one too: it will not read later
                p = self._read("inbox", msg, lambda m: self._parent(m, dm=dm, guild=guild, mention=mention),
                               f"{channel}:{msg['id']}")
                if isinstance(p, Parent):
                    found.append(p)
        if not complete:
            self.log.warning("replyd.discord.gap", platform=self.instance, channel=channel, pages=self.s.max_pages)
        return found, newest, complete

    def inbox(self, cursor: str | None) -> Page:
        """Mentions, replies to the bot and DMs newer than each listed channel's cursor (``{"<channel>": "<id>"}``)."""
        try:
            seen = json.loads(cursor) if cursor else {}
        except ValueError:
            seen = {}
        seen = seen if isinstance(seen, dict) else {}
        now = self.platform_clock.earliest(self._clock.now(), unmeasured_s=0.0)  # snowflakes are Discord's clock
        first = snowflake_at(max(0.0, now - self.s.inbox_lookback_s))
        parents: list[Parent] = []
        for channel in self.s.channels:
            after = seen.get(channel) if isinstance(seen.get(channel), str) and _SNOWFLAKE.match(seen[channel]) else first
            found, newest, _complete = self._read_channel(channel, after)
            parents.extend(found)
            seen[channel] = newest
        parents.sort(key=lambda p: id_order(p.extra["message"]))
        return Page(parents=parents, cursor=json.dumps(seen, sort_keys=True, separators=(",", ":")))

    def search(self, query: str, cursor: str | None) -> Page:
        """A bot cannot search Discord's messages: nothing, ever."""
        return Page(parents=[], cursor=cursor)

    def refind(self, since: float) -> list[Parent]:
        """Every addressed message since epoch ``since`` in the listed channels, with no cursor."""
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        out: list[Parent] = []
        for channel in self.s.channels:
            out.extend(self._read_channel(channel, snowflake_at(max(0.0, since)))[0])
        return sorted(out, key=lambda p: id_order(p.extra["message"]))

    def resolve(self, ref: str) -> Parent:
        """A served id ``<channel>:<message>`` or a jump link (``…/channels/<guild|@me>/<channel>/<message>``)."""
        ref = ref.strip()
        m = _LINK.search(urlsplit(ref).path) if ref.startswith("http") else None
        channel, message = (m.group(2), m.group(3)) if m else split_id(ref)
        dm, guild = self._kind_of(channel)
        resp = self._api("GET", "/channels/{id}/messages/{id}", f"/channels/{channel}/messages/{message}",
                         what="message", major=channel)
        # Named on purpose (CLI, API, MCP): answerable without a mention; the policy still applies.
        p = self._parent(_http.json_body(resp, "message", dict), dm=dm, guild=guild, mention=False)
        if isinstance(p, str):
            raise Rejected(f"resolve: {p}")
        return p

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """``ThreadDepth``: how many messages up the ``message_reference`` chain ``parent`` sits, at most ``limit + 1``.

        One ``GET /channels/{id}/messages/{id}`` per level (Discord serves one level, ``referenced_message``, on
        each message); a reference to another channel, or to a deleted message (10008), ends the walk and
        counts as one ancestor, so the answer is then a lower bound."""
        channel = parent.extra.get("channel")
        ref = parent.extra.get("ref")
        depth = 0
        while isinstance(ref, str) and isinstance(channel, str) and depth <= limit:
            depth += 1
            if depth > limit:
                break
            try:
                resp = self._api("GET", "/channels/{id}/messages/{id}", f"/channels/{channel}/messages/{ref}",
                                 what="thread_depth", major=channel)
            except Rejected:  # the ancestor is gone or not visible: it still counted as one
                break
            ref = _ref_id(_http.json_body(resp, "thread_depth", dict), channel)
        return min(depth, limit + 1)

    # --- the Gateway ------------------------------------------------------------------

    def _gateway_url(self) -> str:
        if self.s.gateway_url:
            return self.s.gateway_url
        resp = self._api("GET", "/gateway/bot", "/gateway/bot", what="gateway/bot")
        url = _http.field(_http.json_body(resp, "gateway/bot", dict), "url", "gateway/bot")
        parts = urlsplit(url)
        if parts.scheme != "wss" and not (parts.scheme == "ws" and net.is_loopback(parts.hostname or "")):
            raise BadResponse("gateway/bot: url is not a wss:// URL")
        return url

    def _intents(self) -> int:
        return INTENT_GUILD_MESSAGES | INTENT_DIRECT_MESSAGES | (INTENT_MESSAGE_CONTENT if self.s.message_content else 0)

    def hold_session(self, load: Callable[[], str | None], save: Callable[[str], None], holder: str) -> None:
        """``ResumableStream``: the Gateway session is stored (id, resume URL, the last seq recorded; never the
        token) and a restarted process resumes it, so Discord replays what it dispatched after that seq."""
        self._slot = (load, save, holder)

    def _stored(self) -> dict[str, Any] | None:
        """The stored session (None: none, unreadable, or no store lent)."""
        if self._slot is None:
            return None
        try:
            data = json.loads(self._slot[0]() or "null")
        except Exception as exc:  # a store that cannot answer: identify, as a first start does
            self.log.warning("replyd.discord.session_unreadable", platform=self.instance,
                             error=f"{type(exc).__name__}: {exc}"[:200])
            return None
        ok = (isinstance(data, dict) and isinstance(data.get("session_id"), str) and isinstance(data.get("seq"), int)
              and _resume_url(data.get("resume_gateway_url")) is not None)
        return data if ok else None

    def _to_resume(self) -> dict[str, Any]:
        """The session this connect resumes: this process's, else the stored one; {} to identify afresh."""
        stored = self._stored()
        mine = self._session.get("session_id")
        if mine and stored and stored["session_id"] == mine and stored.get("holder") != self._holder():
            # Another process resumed this session after a restart: it is that process's now.
            self.log.info("replyd.discord.session_taken", platform=self.instance)
            mine, self._refused = None, mine  # never loaded again here: this process identifies afresh
            self._session, self._kept = {}, None
        if mine:
            return self._session
        if stored and stored["session_id"] != self._refused:
            self._session = {k: stored[k] for k in ("session_id", "resume_gateway_url")} | {"seq": stored["seq"]}
            self._kept = stored["seq"]
            self._loaded_at = stored["at"] if isinstance(stored.get("at"), (int, float)) else None
            self.log.info("replyd.discord.session_loaded", platform=self.instance, seq=stored["seq"])
            self._save_session(take=True)  # this process holds it now (its last holder is gone, or lets go)
        return self._session

    def _holder(self) -> str | None:
        return self._slot[2] if self._slot else None

    def _save_session(self, *, refresh: bool = False, take: bool = False) -> None:
        """Store the session with the last seq whose events are all recorded (throttled; ``refresh``: the
        heartbeat's, which also proves the holder alive). Never over another live holder, unless ``take``."""
        sid, kept = self._session.get("session_id"), self._kept
        if self._slot is None or not sid or kept is None or not self._session.get("resume_gateway_url"):
            return
        now = time.monotonic()
        if not (refresh or take) and ((sid, kept) == self._saved or now - self._saved_at < SESSION_SAVE_S):
            return
        _load, save, holder = self._slot
        stored = None if take else self._stored()
        at = self._clock.now()
        if stored and stored.get("holder") != holder:
            every = stored.get("every_s") if isinstance(stored.get("every_s"), (int, float)) else 60.0
            stale = not isinstance(stored.get("at"), (int, float)) or at - stored["at"] > 3 * every
            if not stale:  # another live process holds the slot (this session, taken; or its own)
                return
        try:
            save(json.dumps({"session_id": sid, "resume_gateway_url": self._session["resume_gateway_url"],
                             "seq": kept, "holder": holder, "at": at, "every_s": self._every_s}))
        except Exception as exc:  # the stored seq stays older: a resume then replays more, never less
            self.log.warning("replyd.discord.session_save_failed", platform=self.instance,
                             error=f"{type(exc).__name__}: {exc}"[:200])
            return
        self._saved, self._saved_at = (sid, kept), now

    def _resume_failed(self, why: str) -> None:
        """A RESUME refused: what Discord dispatched after the last recorded seq is not replayed."""
        age = None if self._loaded_at is None else round(self._clock.now() - self._loaded_at, 1)
        self.log.error("replyd.discord.resume_failed", platform=self.instance, why=why, after_seq=self._kept,
                       stored_age_s=age, missed="messages dispatched after after_seq and before the new session; "
                       "listed guild channels are read again by the poll, DMs are not")
        self._refused = self._session.get("session_id")  # never loaded again: the next connect identifies
        self._session, self._kept, self._loaded_at = {}, None, None

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """The Gateway: identify (or resume the last session), heartbeat, yield each addressed MESSAGE_CREATE.

        Whoever reads this generator must have recorded a parent before it asks for the next one: a frame's
        seq counts as recorded (``_kept``, what RESUME sends and the store keeps) only then."""
        from websockets.exceptions import ConnectionClosed, WebSocketException
        from websockets.sync.client import connect

        self._identity()  # parsing needs the bot's id before the first dispatch
        session = dict(self._to_resume())
        base = session.get("resume_gateway_url") if session.get("session_id") else None
        url = (base or self._gateway_url()).rstrip("/")
        url += ("&" if "?" in url else "?") + "v=10&encoding=json"
        token = self.s.token.get_secret_value()
        resuming = bool(session.get("session_id"))
        try:
            with connect(url, open_timeout=self.s.timeout_s, close_timeout=2, max_size=_http.MAX_RESPONSE_BYTES) as ws:
                try:
                    yield from self._frames(ws, stop, token, resuming)
                finally:
                    # Not 1000/1001, which end the session: it stays resumable a few minutes, after a restart too.
                    ws.close(4000, "resuming later")
                    self._save_session(refresh=True)
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            if code in _SESSION_GONE:
                if self._resuming:
                    self._resume_failed(f"gateway closed {code}")
                self._session, self._kept = {}, None
            if code in _FATAL_CLOSE:
                raise DefinitelyNotSent(f"gateway closed {code}: {_FATAL_CLOSE[code]}") from None
            raise DefinitelyNotSent(f"gateway closed ({code})") from None
        except (WebSocketException, OSError, ValueError) as exc:
            raise DefinitelyNotSent(_http.redact(f"gateway: {type(exc).__name__}: {exc}", self._secrets())) from None

    def _frames(self, ws: Any, stop: threading.Event, token: str, resuming: bool) -> Iterator[Parent]:
        """One connection: HELLO, IDENTIFY or RESUME, heartbeats, the dispatches' parents (each then counted kept)."""
        hello = json.loads(ws.recv(timeout=self.s.timeout_s))
        if not isinstance(hello, dict) or hello.get("op") != 10:
            raise BadResponse("gateway: the first frame is not HELLO")
        interval_s = _http.field(hello, "d.heartbeat_interval", "gateway HELLO", (int, float)) / 1000.0
        if not 0 < interval_s < 3600:
            raise BadResponse("gateway HELLO: heartbeat_interval out of range")
        self._every_s = interval_s
        self._resuming = resuming
        if resuming:
            ws.send(json.dumps({"op": 6, "d": {"token": token, "session_id": self._session["session_id"],
                                               "seq": self._kept}}))
            self.log.info("replyd.discord.resuming", platform=self.instance, seq=self._kept)
        else:
            self._kept = None
            ws.send(json.dumps({"op": 2, "d": {"token": token, "intents": self._intents(),
                                               "properties": {"os": "linux", "browser": "replyd", "device": "replyd"}}}))
        beat_at = time.monotonic() + interval_s * random.random()  # the docs' jitter before the first beat
        acked = True
        while not stop.is_set():
            now = time.monotonic()
            if now >= beat_at:
                if not acked:  # no ACK since the last beat: a zombied connection, resumed anew
                    self.log.warning("replyd.discord.zombie", platform=self.instance)
                    return
                ws.send(json.dumps({"op": 1, "d": self._session.get("seq")}))
                acked, beat_at = False, now + interval_s
                self._save_session(refresh=True)
            try:
                raw = ws.recv(timeout=max(0.05, min(1.0, beat_at - now)))
            except TimeoutError:
                continue
            try:
                frame = json.loads(raw)
            except (ValueError, RecursionError):
                self.log.warning("replyd.discord.gateway_unreadable", platform=self.instance)
                continue
            if not isinstance(frame, dict):
                continue
            op = frame.get("op")
            if op == 11:
                acked = True
            elif op == 1:  # the server asks for a beat now
                ws.send(json.dumps({"op": 1, "d": self._session.get("seq")}))
            elif op == 7:
                self.log.info("replyd.discord.reconnect_asked", platform=self.instance)
                return
            elif op == 9:
                if frame.get("d") is not True:
                    if self._resuming:
                        self._resume_failed("invalid session")
                    self._session, self._kept = {}, None
                self.log.info("replyd.discord.invalid_session", platform=self.instance,
                              resumable=frame.get("d") is True)
                return
            elif op == 0:
                seq = frame.get("s")
                yield from self._dispatch(frame)
                # Every parent of this frame was recorded before the reader came back for more.
                if isinstance(seq, int) and not isinstance(seq, bool) and self._session.get("session_id"):
                    self._kept = max(seq, self._kept or 0)
                    self._save_session()

    def _dispatch(self, frame: dict[str, Any]) -> Iterator[Parent]:
        """One dispatch: the sequence noted, READY's session kept, a MESSAGE_CREATE for the bot yielded."""
        seq = frame.get("s")
        if isinstance(seq, int) and not isinstance(seq, bool):
            self._session["seq"] = max(seq, self._session.get("seq") or 0)
        kind, data = frame.get("t"), frame.get("d")
        if not isinstance(data, dict):
            return
        if kind == "READY":
            sid, resume = data.get("session_id"), data.get("resume_gateway_url")
            self._session = {"session_id": sid if isinstance(sid, str) else None,
                             "resume_gateway_url": _resume_url(resume),
                             "seq": self._session.get("seq")}
            self._saved, self._saved_at, self._resuming = None, 0.0, False  # the new session is saved at once
            self.log.info("replyd.discord.ready", platform=self.instance)
        elif kind == "RESUMED":
            self._resuming = False
            self.log.info("replyd.discord.resumed", platform=self.instance, seq=self._session.get("seq"))
        elif kind == "MESSAGE_CREATE":
            p = self._read("stream", data, self._created_parent, _message_id(data))
            if isinstance(p, Parent):
                yield p

    def _created_parent(self, data: dict[str, Any]) -> Parent | str | None:
        """A MESSAGE_CREATE's parent inside the poll's scope (a guild channel outside ``channels`` is not offered)."""
        channel = data.get("channel_id")
        if self.s.channels and data.get("guild_id") and channel not in self.s.channels:
            return None
        return self._parent(data, dm=None)

    # --- interactions (the HTTP interactions endpoint, through replyd.hooks kind "discord") ----------

    def webhook_challenge(self, payload: Any) -> dict[str, Any] | None:
        """Answer Discord's PING (type 1) with PONG; None for every other interaction."""
        if isinstance(payload, dict) and payload.get("type") == 1:
            return {"type": 1}
        return None

    def webhook_answer(self, payload: Any) -> dict[str, Any] | None:
        """``WebhookAnswer``: every accepted command gets the deferred response (type 5) at once, inside 3 s.

        A second delivery of one interaction gets it too: Discord takes the first answer it receives (a
        redelivery means it has none yet), and the follow-up behind it is the guard's, once."""
        if isinstance(payload, dict) and payload.get("type") == 2:
            return {"type": 5}
        return None

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """An APPLICATION_COMMAND interaction as its parent (id: the interaction id); its token held in memory."""
        if not isinstance(payload, dict) or payload.get("type") != 2:
            kind = payload.get("type") if isinstance(payload, dict) else None
            return f"interaction type {str(kind)[:10]} is not answered"
        iid, app, token = payload.get("id"), payload.get("application_id"), payload.get("token")
        if not (isinstance(iid, str) and _SNOWFLAKE.match(iid) and isinstance(app, str) and _SNOWFLAKE.match(app)
                and isinstance(token, str) and _TOKEN.match(token)):
            raise BadResponse("discord interaction: id, application_id or token missing or malformed")
        member = payload.get("member") if isinstance(payload.get("member"), dict) else {}
        user = member.get("user") if isinstance(member.get("user"), dict) else payload.get("user")
        user = user if isinstance(user, dict) else {}
        uid = user.get("id")
        if not isinstance(uid, str) or not _SNOWFLAKE.match(uid):
            raise BadResponse("discord interaction: no user id (member.user.id or user.id)")
        data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
        words = [f"/{str(data.get('name') or '')[:32]}"]
        for opt in data.get("options") if isinstance(data.get("options"), list) else []:
            if isinstance(opt, dict) and isinstance(opt.get("value"), (str, int, float)):
                words.append(f"{str(opt.get('name'))[:32]}={str(opt['value'])[:1000]}")
        channel = payload.get("channel_id") if isinstance(payload.get("channel_id"), str) else ""
        guild = payload.get("guild_id") if isinstance(payload.get("guild_id"), str) else None
        made = snowflake_ms(iid) / 1000.0
        with self._lock:
            # Expiry on the injected clock from the moment replyd first held the token (never later than Discord's).
            known = self._interactions.get(iid)
            self._interactions[iid] = (app, token, known[2] if known else self._clock.now() + INTERACTION_TOKEN_LIFE_S)
            self._drop_expired()
        return [Parent(id=iid, author_id=uid, author_handle=str(user.get("username") or uid),
                       author_is_bot=bool(user.get("bot")), text=" ".join(words), url="", created_at=made,
                       extra={"interaction": True, "channel": channel, "guild": guild, "dm": guild is None,
                              "mentioned": True, "reply_to_me": False})]

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """An interaction is addressed to the app by construction; a guild channel outside ``channels`` is not."""
        channel = parent.extra.get("channel")
        if self.s.channels and parent.extra.get("guild") and channel not in self.s.channels:
            return "channel_not_listed"
        return None

    def _held(self, iid: str) -> tuple[str, str, float] | None:
        with self._lock:
            return self._interactions.get(iid)

    def _send_interaction(self, parent: Parent, text: str) -> Sent:
        """Edit the deferred response (``PATCH …/messages/@original``) into the answer, inside the token's life."""
        try:
            for attempt in range(3):
                try:
                    resp = self._patch_original(parent, text, doing="sent")
                    break
                except Rejected as exc:
                    # 404: the deferred response is not made yet (its answer may still be on the way to Discord).
                    # An edit that found nothing changed nothing: provably not sent, so it may be tried again.
                    if exc.status != 404:
                        raise
                    if attempt == 2:
                        raise DefinitelyNotSent(f"{exc.detail}: no deferred response to edit (not sent)",
                                                status=404) from None
                    time.sleep(0.3)
            data = _http.json_body(resp, "edit original response", dict)
            mid = _http.served_id(data, "id", "edit original response")
        except BadResponse as exc:
            raise self._send_failed(parent, MaybeSent(f"{exc.detail} (after a 2xx)")) from None
        except PlatformError as exc:
            raise self._send_failed(parent, exc) from None
        channel = data.get("channel_id") if isinstance(data.get("channel_id"), str) else parent.extra.get("channel", "")
        rid = f"{channel}:{mid}"
        self.log.info("replyd.discord.sent", platform=self.instance, parent_id=parent.id, reply_id=rid)
        return Sent(reply_id=rid, url=_link(parent.extra.get("guild"), str(channel), str(mid)))

    def _read_interaction(self, iid: str, found: Found) -> bool:
        """The deferred response: edited (not LOADING) is the landed answer; a token not held checks nothing."""
        held = self._held(iid)
        if held is None or self._clock.now() >= held[2]:
            return False
        app, token, _exp = held
        resp = self._api("GET", "/webhooks/{id}/{token}/messages/@original",
                         f"/webhooks/{app}/{token}/messages/@original", what="original response", major=iid,
                         auth=False)
        data = _http.json_body(resp, "original response", dict)
        flags = data.get("flags") if isinstance(data.get("flags"), int) else 0
        if not flags & FLAG_LOADING:
            mid = _http.served_id(data, "id", "original response")
            rid = f"{data.get('channel_id') or ''}:{mid}"
            found.setdefault(iid, {})[rid] = OwnReply(rid, iid, snowflake_ms(mid) / 1000.0)
        return True

    # --- send, read back, delete ----------------------------------------------------

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Create the reply with the nonce enforced, referencing the parent, pinging nobody but users named
        (an interaction: its deferred response edited into the answer)."""
        if parent.extra.get("interaction") and ":" not in parent.id:
            return self._send_interaction(parent, text)
        channel, message = split_id(parent.id)
        if len(provider_key) > NONCE_LEN:
            raise Rejected(f"discord nonce longer than {NONCE_LEN} characters (not sent)")
        body = {"content": self._outgoing(text), "nonce": provider_key, "enforce_nonce": True,
                "message_reference": {"message_id": message, "channel_id": channel, "fail_if_not_exists": True},
                "allowed_mentions": self._allowed_mentions()}

        def read(data: dict[str, Any]) -> Sent:
            mid = _http.served_id(data, "id", "create message")
            if not _SNOWFLAKE.match(mid):
                raise BadResponse("create message: field id is not a snowflake")
            rid = f"{channel}:{mid}"
            self.log.info("replyd.discord.sent", platform=self.instance, parent_id=parent.id, reply_id=rid)
            return Sent(reply_id=rid, url=_link(parent.extra.get("guild"), channel, mid))

        route = "/channels/{id}/messages"
        try:
            resp = self._api("POST", route, f"/channels/{channel}/messages", what="create message", major=channel,
                             acts=True, json=body)
        except PlatformError as exc:
            raise self._send_failed(parent, exc) from None
        try:
            # No clock sample from the body: with enforce_nonce the answer may be the earlier message, stamped
            # long before this request left (the Date header still samples the clock).
            data = _http.json_body(resp, "create message", dict)
            return read(data)
        except BadResponse as exc:
            raise MaybeSent(f"{exc.detail} (after HTTP {resp.status_code})", status=resp.status_code) from None

    # --- answers in parts and streamed answers (PostLimit, EditReply) ------------------------------

    def post_limit(self, parent: Parent) -> Limit:
        """``PostLimit``: 2,000 code points (``send`` adds nothing to the text)."""
        return Limit(MAX_CONTENT, "chars", self.s.part_marker)

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """``PostLimit``: the next part replies to the previous part's message (``message_reference``), in the same
        channel, so the read-back ties each part to its own row; it addresses nobody (the bot's own message)."""
        channel, message = split_id(previous_reply_id)
        x, me = parent.extra, self._identity()
        return Parent(id=previous_reply_id, author_id=me.sender_id, author_handle=me.handle, author_is_bot=True,
                      thread_depth=parent.thread_depth + 1, url=_link(x.get("guild"), channel, message),
                      extra={"channel": channel, "message": message, "guild": x.get("guild"), "dm": x.get("dm"),
                             "mentioned": False, "reply_to_me": False, "ref": None, "part_of": parent.id})

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """``EditReply``: set the content of the bot's message ``reply_id`` (an interaction's answer: its original
        response, by the token held); the whole content each time, so a repeated edit is harmless."""
        if parent.extra.get("interaction") and ":" not in parent.id:
            self._edited(parent, reply_id, text, lambda: self._patch_original(parent, text, doing="edited"))
            return
        channel, message = split_id(reply_id)
        body = {"content": self._outgoing(text), "allowed_mentions": self._allowed_mentions()}
        self._edited(parent, reply_id, text, lambda: self._api(
            "PATCH", "/channels/{id}/messages/{id} PATCH", f"/channels/{channel}/messages/{message}",
            what="edit message", major=channel, acts=True, json=body))

    def _allowed_mentions(self) -> dict[str, Any]:
        """Whom a reply may ping: the replied-to author only, unless ``allow_mentions`` (then users, roles, all)."""
        if self.s.allow_mentions:
            return {"parse": ["users", "roles", "everyone"], "replied_user": True}
        return {"parse": [], "replied_user": True}

    def _outgoing(self, text: str) -> str:
        """``text`` as sent: ``@everyone`` and ``@here`` defused unless ``allow_mentions``."""
        return text if self.s.allow_mentions else mentions.discord(text)

    def _patch_original(self, parent: Parent, text: str, *, doing: str) -> httpx.Response:
        """``PATCH …/messages/@original`` (the interaction's answer set to ``text``) by the token this process holds,
        inside its 15 minutes; ``doing`` names the act in the refusals ("sent", "edited")."""
        held = self._held(parent.id)
        if held is None:
            raise DefinitelyNotSent("interaction token not held by this process (received elsewhere or before a "
                                    f"restart): not {doing}")
        app, token, expires = held
        if self._clock.now() + self.s.timeout_s >= expires:
            self.log.warning("replyd.discord.interaction_expired", platform=self.instance, parent_id=parent.id)
            raise Rejected(f"interaction token past its 15 minutes (or too close to it): not {doing}")
        return self._api("PATCH", "/webhooks/{id}/{token}/messages/@original",
                         f"/webhooks/{app}/{token}/messages/@original", what="edit original response",
                         major=parent.id, acts=True,
                         json={"content": self._outgoing(text), "allowed_mentions": self._allowed_mentions()},
                         auth=False)

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Own replies to the pending parents: one forward walk per channel from the oldest row's start."""
        by_channel: dict[str, list[str]] = {}
        for p in pending:
            if p.parent.extra.get("interaction") and ":" not in p.parent.id:
                by_channel.setdefault(f"interaction {p.parent.id}", []).append(p.parent.id)
                continue
            try:
                channel, _ = split_id(p.parent.id)
            except Rejected:
                self.log.warning("replyd.discord.read_back_failed", parent_id=p.parent.id[:80], problem="not a discord id")
                continue
            by_channel.setdefault(channel, []).append(p.parent.id)
        opened_at = {p.parent.id: p.opened_at for p in pending}

        def units(opened: dict[str, float], checked: set[str]) -> Iterator[tuple[str, list[str]]]:
            for channel, pids in sorted(by_channel.items()):
                todo = sorted({pid for pid in pids if pid in opened and pid not in checked})
                if todo:
                    yield channel, todo

        def walk(channel: str, pids: list[str], found: Found) -> bool:
            if channel.startswith("interaction "):
                return self._read_interaction(pids[0], found)
            wanted = {split_id(pid)[1]: pid for pid in pids}
            oldest_parent = min(wanted, key=id_order)
            horizon = min(self._horizon(opened_at[pid]) for pid in pids)
            # Both bounds are safe: a reply is made after its parent and after its row opened.
            after = max(str(int(oldest_parent) - 1), snowflake_at(max(0.0, horizon)), key=id_order)
            complete = False
            for items, last in self._pages_after(channel, after):
                for msg in items:
                    pid = self._own_reply_to(msg, sender_id, channel, wanted)
                    if pid is not None:
                        rid = f"{channel}:{msg['id']}"
                        found.setdefault(pid, {})[rid] = OwnReply(rid, pid, snowflake_ms(msg["id"]) / 1000.0)
                complete = last
            return complete

        return self._read_back(pending, feed=None, fallback=walk, units=units,
                               sort_key=lambda rid: id_order(rid.partition(":")[2]), source=("channel", "channel"))

    @staticmethod
    def _own_reply_to(msg: Any, sender_id: str, channel: str, wanted: Mapping[str, str]) -> str | None:
        """The pending parent a message of the bot's answers (its ``message_reference``), else None."""
        author = msg.get("author") if isinstance(msg, dict) and isinstance(msg.get("author"), dict) else {}
        if author.get("id") != sender_id:
            return None
        ref = msg.get("message_reference")
        if not isinstance(ref, dict) or ref.get("type", 0) != 0:  # 0: DEFAULT (a reply), 1: FORWARD
            return None
        if ref.get("channel_id") not in (None, channel):
            return None
        mid = ref.get("message_id")
        return wanted.get(mid) if isinstance(mid, str) else None

    def delete(self, reply_id: str) -> None:
        """Delete one own reply; one already gone (404 unknown message) counts as done."""
        channel, message = split_id(reply_id)
        try:
            self._api("DELETE", "/channels/{id}/messages/{id} DELETE", f"/channels/{channel}/messages/{message}",
                      what="delete", major=channel, acts=True)
        except Rejected as exc:
            if exc.status != 404:
                raise
            self.log.info("replyd.discord.deleted", platform=self.instance, reply_id=reply_id, already_gone=True)
            return
        self.log.info("replyd.discord.deleted", platform=self.instance, reply_id=reply_id, already_gone=False)

    def close(self) -> None:
        """Do nothing: the shared http client belongs to the caller."""


__all__ = ["DiscordPlatform", "discord_nonce", "snowflake_at", "snowflake_ms", "split_id"]
