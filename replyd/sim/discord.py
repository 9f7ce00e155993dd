"""A stateful fake of Discord's REST API, as hostile as the published docs allow.

No Discord server exists for tests; this follows the docs (sources and licences: ``fixtures/discord/
SOURCES.md``; every body served is one of those fixtures with the fields that matter replaced).

- ``DiscordWorld``: guild channels and DMs, messages with snowflake ids from the injected clock, and the
  counts tests trust: ``bot_replies(parent_id)`` is the bot's messages whose ``message_reference`` names
  the parent, ``bot_messages_near(parent_id)`` every bot message created because of it (a naive bot that
  drops the reference is counted too). Nonce enforcement per author with a window you set
  (``nonce_window_s``); a nonce whose message was deleted answers ``10008``. Create faults
  (``create_faults``: ``"lost"`` created then the connection drops, ``"error_after"`` created then 500,
  ``"error_before"`` 503 and nothing created, ``"ratelimited"`` a bucket 429, ``"global"`` a global 429,
  ``"hold"`` created and the answer held until ``release_held``), ``create_delay_s`` (slow answers) and ``lose_ratio`` (that share of creates
  lose their answer, seeded). Edits (``PATCH /channels/{c}/messages/{m}``, the Edit Message route): only the
  author's own messages (``50005`` otherwise), ``10008`` for a gone one, ``50035`` past 2,000 characters (code
  points, as Discord counts them); ``edit_faults`` as ``create_faults`` (``"lost"`` edited then the connection
  drops, ``"error_after"`` edited then 500, ``"error_before"`` 503 and nothing edited, ``"ratelimited"``,
  ``"global"``); each message keeps its edit history (``Msg.edits``) and ``text(reply_id)`` is its current
  content: the ground truth of an edit. An edit is heard by the Gateway as ``MESSAGE_UPDATE``.
  ``bucket_limit``: (requests, seconds) per route bucket and channel, enforced with 429s as Discord does.
- ``DiscordRest``: the REST routes replyd uses over HTTP (Starlette on uvicorn).

Shipped in the package so the docs' examples run anywhere (the Gateway and the interactions sender
stay in tests/discord_fake.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from replyd.sim.fakes import AppServer, DropResponse

FIXTURES = Path(__file__).parent / "fixtures" / "discord"
DISCORD_EPOCH_MS = 1_420_070_400_000
BOT_ID, BOT_NAME = "80351110224678912", "replybot"
GUILD = "290926798626357999"
BOT_TOKENS = ("MTAxNjI4.fake-bot-token-a.aaaaaaaaaaaaaaaaaaaaaaaaa", "MTAxNjI4.fake-bot-token-b.bbbbbbbbbbbbbbbbbbbbbbbbb")
MAX_CONTENT = 2000
INTENT_MESSAGE_CONTENT = 1 << 15


def fixture(name: str) -> Any:
    """One of the Discord-shaped JSON bodies in replyd/sim/fixtures/discord."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _err(name: str, status: int, **headers: str) -> JSONResponse:
    return JSONResponse(fixture(name), status_code=status, headers=headers)


def pings(content: str, allowed: Any, replied_author: str | None) -> list[str]:
    """Who a message notifies, as Discord applies ``allowed_mentions`` (absent: every mention in the text).

    ``"everyone"`` for ``@everyone``/``@here``, ``"role:<id>"`` for ``<@&id>``, a user id for ``<@id>`` and for the
    replied-to author when ``replied_user`` is true."""
    allowed = allowed if isinstance(allowed, dict) else {"parse": ["everyone", "users", "roles"]}
    parse = allowed.get("parse") or []
    users = [u for u in re.findall(r"<@!?(\d+)>", content) if "users" in parse or u in (allowed.get("users") or [])]
    roles = [f"role:{r}" for r in re.findall(r"<@&(\d+)>", content)
             if "roles" in parse or r in (allowed.get("roles") or [])]
    out = ["everyone"] if "everyone" in parse and re.search(r"@(everyone|here)\b", content) else []
    if replied_author and allowed.get("replied_user") is True:
        users.append(replied_author)
    return out + roles + list(dict.fromkeys(users))


def _iso(ms: float) -> str:
    """An ISO 8601 timestamp as Discord writes them (microseconds, +00:00)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{int(ms) % 1000:03d}000+00:00"


@dataclass
class Msg:
    """One message as Discord holds it."""

    id: str
    channel_id: str
    author_id: str
    content: str
    reference: str | None = None  # message_reference.message_id
    mentions: list[str] = field(default_factory=list)
    nonce: str | None = None
    token: str = ""  # which bot token made it (the bot's messages only)
    deleted: bool = False
    cause: str | None = None  # the parent a bot message answers, even when it carries no reference (naive bots)
    edits: list[str] = field(default_factory=list)  # every content an edit set, oldest first
    edited_ms: float | None = None  # when the last edit acted (epoch ms)
    pinged: list[str] = field(default_factory=list)  # who the bot's message notified, per allowed_mentions

    def json(self, world: DiscordWorld) -> dict[str, Any]:
        """The message object as REST and the Gateway serve it."""
        out = copy.deepcopy(fixture("message"))
        ch = world.channels[self.channel_id]
        author = world.user(self.author_id)
        if self.author_id == BOT_ID:
            author["bot"] = True
        out.update({"id": self.id, "channel_id": self.channel_id, "content": self.content, "author": author,
                    "type": 19 if self.reference else 0,
                    "timestamp": _iso(world.ms(self.id)),
                    "mentions": [world.user(u) for u in self.mentions]})
        if self.edited_ms is not None:
            out["edited_timestamp"] = _iso(self.edited_ms)
        if ch.guild_id:
            out["guild_id"] = ch.guild_id
        else:
            out.pop("guild_id", None)
        if self.reference:
            out["message_reference"] = {"type": 0, "message_id": self.reference, "channel_id": self.channel_id,
                                        **({"guild_id": ch.guild_id} if ch.guild_id else {})}
            ref = world.find(self.channel_id, self.reference)
            out["referenced_message"] = None if ref is None or ref.deleted else ref.json_flat(world)
        return out

    def json_flat(self, world: DiscordWorld) -> dict[str, Any]:
        """The message without its own referenced message (one level, as Discord nests it)."""
        out = self.json(world)
        out.pop("referenced_message", None)
        return out


@dataclass
class Interaction:
    """One slash-command interaction and what the app answered."""

    id: str
    token: str
    channel_id: str
    user_id: str
    made_at: float
    acks: int = 0  # initial responses accepted (first, type 4/5, inside the ack window)
    late_acks: int = 0  # answers after the first (or late, or not a response)
    ack_s: list[float] = field(default_factory=list)
    original: Msg | None = None
    edits: int = 0
    followups: list[Msg] = field(default_factory=list)


@dataclass
class Channel:
    """A guild text channel (``guild_id`` set) or a DM (None)."""

    id: str
    guild_id: str | None
    messages: list[Msg] = field(default_factory=list)
    forbidden: bool = False  # the bot lacks SEND_MESSAGES here: 403 50013


class DiscordWorld:
    """The guild and DMs, messages, nonces, the platform-side counts and the fault knobs."""

    def __init__(self, *, now: Callable[[], float] = time.time, nonce_window_s: float = 120.0,
                 tokens: tuple[str, ...] = BOT_TOKENS, seed: int = 0) -> None:
        self.now = now
        self.tokens = tokens
        self.nonce_window_s = nonce_window_s
        self.lock = threading.Lock()
        self.channels: dict[str, Channel] = {}
        self.names: dict[str, str] = {BOT_ID: BOT_NAME}
        self.create_faults: list[str] = []
        self.edit_faults: list[str] = []  # as create_faults, popped per edit request
        self.edit_requests = 0
        self.lost_edits = 0  # edits that acted but whose answer never reached the client
        self.read_faults: list[str] = []
        self.lose_ratio = 0.0
        self.create_delay_s = 0.0  # a slow answer: the message is made at once, its answer comes this much later
        self.rng = random.Random(seed)
        self.bucket_limit: tuple[int, float] | None = None
        self._bucket_hits: dict[str, list[float]] = {}
        self.create_requests = 0
        self.nonce_hits = 0  # creates answered with the earlier message
        self.lost_answers = 0
        self.held = threading.Event()
        self.release_held = threading.Event()
        self.held_token = ""
        self.on_message: list[Callable[[Msg], None]] = []  # the Gateway hears every message
        self.on_update: list[Callable[[Msg], None]] = []  # and every edit
        self.interactions: dict[str, Interaction] = {}
        self.token_life_s = 900.0
        self._nonces: dict[tuple[str, str], tuple[str, float]] = {}  # (author, nonce) -> (message id, made at)
        self._last = 0
        self._seq = 0

    # --- ids ------------------------------------------------------------------------

    def snowflake(self) -> str:
        """A fresh snowflake for now (strictly increasing)."""
        ms = int(self.now() * 1000) - DISCORD_EPOCH_MS
        self._seq = (self._seq + 1) % 4096
        value = max(ms << 22 | self._seq, self._last + 1)
        self._last = value
        return str(value)

    @staticmethod
    def ms(snowflake: str) -> float:
        """A snowflake's epoch ms."""
        return float((int(snowflake) >> 22) + DISCORD_EPOCH_MS)

    # --- the people's side ----------------------------------------------------------

    def add_channel(self, *, dm: bool = False, forbidden: bool = False) -> str:
        """A guild text channel (or a DM with the bot); returns its id."""
        with self.lock:
            cid = self.snowflake()
            self.channels[cid] = Channel(cid, None if dm else GUILD, forbidden=forbidden)
            return cid

    def say(self, cid: str, user: str, text: str, *, mention: bool = True, reply_to: str | None = None) -> str:
        """A person posts; the Gateway hears it. Returns the parent id ``<channel>:<message>``."""
        with self.lock:
            self.names.setdefault(user, f"user{user[-4:]}")
            msg = Msg(self.snowflake(), cid, user, (f"<@{BOT_ID}> " if mention else "") + text,
                      reference=reply_to, mentions=[BOT_ID] if mention else [])
            self.channels[cid].messages.append(msg)
        for hear in self.on_message:
            hear(msg)
        return f"{cid}:{msg.id}"

    def amend(self, parent_id: str, text: str) -> None:
        """A person edits their message ``<channel>:<message>``; the Gateway hears MESSAGE_UPDATE."""
        cid, _, mid = parent_id.partition(":")
        with self.lock:
            msg = self.find(cid, mid)
            assert msg is not None
            msg.content = text
            msg.edits.append(text)
            msg.edited_ms = self.now() * 1000
        for hear in self.on_update:
            hear(msg)

    def user(self, uid: str) -> dict[str, Any]:
        """A user object as messages carry it (``avatar`` and ``global_name`` are always there, maybe null)."""
        return {"id": uid, "username": self.names.get(uid, "user"), "discriminator": "0", "global_name": None,
                "avatar": None}

    def find(self, cid: str, mid: str) -> Msg | None:
        """A message by id (deleted ones too)."""
        ch = self.channels.get(cid)
        return next((m for m in ch.messages if m.id == mid), None) if ch else None

    def bot_replies(self, parent_id: str) -> list[Msg]:
        """The bot's live messages replying to the parent: the platform-side count of answers."""
        cid, _, mid = parent_id.partition(":")
        with self.lock:
            return [m for m in self.channels[cid].messages
                    if m.author_id == BOT_ID and not m.deleted and (m.reference == mid or m.cause == parent_id)]

    def text(self, reply_id: str) -> str:
        """The current content of message ``<channel>:<message>`` on the platform (edits applied): ground truth."""
        cid, _, mid = reply_id.partition(":")
        with self.lock:
            msg = self.find(cid, mid)
            if msg is None or msg.deleted:
                raise KeyError(f"no live message {reply_id}")
            return msg.content

    def history(self, reply_id: str) -> list[str]:
        """Every content edits set on message ``<channel>:<message>``, oldest first (not its first content)."""
        cid, _, mid = reply_id.partition(":")
        with self.lock:
            msg = self.find(cid, mid)
            return list(msg.edits) if msg is not None else []

    # --- REST behaviour (called by DiscordRest) -------------------------------------

    def limited(self, bucket: str) -> float | None:
        """Seconds to wait when ``bucket`` is spent (the request counts otherwise), or None."""
        if self.bucket_limit is None:
            return None
        n, per_s = self.bucket_limit
        now = self.now()
        with self.lock:
            hits = [t for t in self._bucket_hits.get(bucket, []) if t > now - per_s]
            if len(hits) >= n:
                self._bucket_hits[bucket] = hits
                return max(0.001, hits[0] + per_s - now)
            hits.append(now)
            self._bucket_hits[bucket] = hits
            return None

    def create(self, cid: str, body: dict[str, Any], token: str) -> tuple[int, Any, Msg | None]:
        """Create a message as the bot: (status, fixture name or message, the message); nonce enforced."""
        content = body.get("content")
        nonce = body.get("nonce")
        ref = body.get("message_reference") if isinstance(body.get("message_reference"), dict) else None
        if not isinstance(content, str) or not content or len(content) > MAX_CONTENT:
            return 400, "error_invalid_form_body", None
        if nonce is not None and (not isinstance(nonce, (str, int)) or len(str(nonce)) > 25):
            return 400, "error_invalid_form_body", None
        with self.lock:
            ch = self.channels.get(cid)
            if ch is None:
                return 404, "error_unknown_channel", None
            if ch.forbidden:
                return 403, "error_missing_permissions", None
            key = (BOT_ID, str(nonce))
            if nonce is not None and body.get("enforce_nonce") is True and key in self._nonces:
                mid, made = self._nonces[key]
                if self.now() - made <= self.nonce_window_s:
                    earlier = self.find(cid, mid)
                    if earlier is None or earlier.deleted:
                        return 404, "error_unknown_message", None
                    self.nonce_hits += 1
                    return 200, earlier, earlier
            reference = None
            if ref is not None:
                target = self.find(cid, str(ref.get("message_id")))
                if target is None or target.deleted:
                    if ref.get("fail_if_not_exists", True) is not False:
                        return 400, "error_reply_unknown", None
                else:
                    reference = target.id
            allowed = body.get("allowed_mentions")
            msg = Msg(self.snowflake(), cid, BOT_ID, content, reference=reference,
                      nonce=None if nonce is None else str(nonce), token=token,
                      cause=body.get("_cause") if isinstance(body.get("_cause"), str) else None)
            if "@everyone" in content and not (isinstance(allowed, dict) and "everyone" not in allowed.get("parse", [])):
                msg.mentions.append("everyone")  # pinged: counted by tests
            replied = self.find(cid, reference) if reference else None
            msg.pinged = pings(content, allowed, replied.author_id if replied else None)
            ch.messages.append(msg)
            if nonce is not None:
                self._nonces[key] = (msg.id, self.now())
        for hear in self.on_message:
            hear(msg)
        return 200, msg, msg


    def edit(self, cid: str, mid: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Edit a message as the bot (Edit Message): (status, fixture name or the edited message)."""
        content = body.get("content")
        if "content" in body and content is not None and (not isinstance(content, str) or len(content) > MAX_CONTENT):
            return 400, "error_invalid_form_body"
        with self.lock:
            if cid not in self.channels:
                return 404, "error_unknown_channel"
            msg = self.find(cid, mid)
            if msg is None or msg.deleted:
                return 404, "error_unknown_message"
            if msg.author_id != BOT_ID:
                return 403, "error_cannot_edit_other"  # only flags may change on another's message
            if isinstance(content, str):
                if not content:
                    return 400, "error_invalid_form_body"  # "Cannot send an empty message": nothing else left
                msg.content = content
                msg.edits.append(content)
                # An edit notifies only mentions it adds; the test reads every ping the texts would make.
                msg.pinged = list(dict.fromkeys(msg.pinged + pings(content, body.get("allowed_mentions"), None)))
                msg.edited_ms = self.now() * 1000
        for hear in self.on_update:
            hear(msg)
        return 200, msg


class DiscordRest:
    """The REST API on a real HTTP server: ``url`` is the ``api_url`` replyd is configured with."""

    def __init__(self, world: DiscordWorld, *, gateway_url: Callable[[], str] = lambda: "") -> None:
        self.world = world
        self.gateway_url = gateway_url
        self.calls: dict[str, int] = {}
        routes = [
            Route("/api/v10/users/@me", self._me),
            Route("/api/v10/oauth2/applications/@me", self._application),
            Route("/api/v10/gateway/bot", self._gateway),
            Route("/api/v10/channels/{cid}", self._channel),
            Route("/api/v10/channels/{cid}/messages", self._messages, methods=["GET", "POST"]),
            Route("/api/v10/channels/{cid}/messages/{mid}", self._message, methods=["GET", "DELETE", "PATCH"]),
            Route("/api/v10/webhooks/{app}/{token}/messages/@original", self._original, methods=["GET", "PATCH"]),
            Route("/api/v10/webhooks/{app}/{token}", self._followup, methods=["POST"]),
        ]
        self._server = AppServer(Starlette(routes=routes), name="discord-fake")

    def __enter__(self) -> DiscordRest:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.world.release_held.set()
        self._server.stop()

    @property
    def url(self) -> str:
        """The REST root (``…/api/v10``)."""
        return f"{self._server.url}/api/v10"

    def _auth(self, request: Request) -> str | None:
        token = request.headers.get("authorization", "")
        return token.removeprefix("Bot ") if token.startswith("Bot ") and token[4:] in self.world.tokens else None

    def _headers(self, bucket: str, route: str) -> dict[str, str]:
        reset = self.world.now() + 1.0
        return {"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "4", "X-RateLimit-Reset": f"{reset:.3f}",
                "X-RateLimit-Reset-After": "1.000", "X-RateLimit-Bucket": uuid.uuid5(uuid.NAMESPACE_URL, route).hex[:16]}

    def _gate(self, request: Request, route: str, major: str) -> Response | None:
        """Auth, injected read faults and the bucket limit; None when the request may go on."""
        self.calls[route] = self.calls.get(route, 0) + 1
        if self._auth(request) is None:
            return JSONResponse({"message": "401: Unauthorized", "code": 0}, status_code=401)
        wait = self.world.limited(f"{request.method} {route}:{major}")
        if wait is not None:
            return _err("rate_limited", 429, **{**self._headers(route, route), "X-RateLimit-Remaining": "0",
                                                   "Retry-After": str(max(1, round(wait))), "X-RateLimit-Scope": "user"})
        return None

    async def _acting(self, request: Request, fault: str | None, route: str) -> dict[str, Any] | Response:
        """An acting request's JSON body, or the answer of a fault refusing it before it acts (a bucket or global
        429, a 503) or of a body that is not JSON."""
        if fault == "ratelimited":
            return _err("rate_limited", 429, **{**self._headers(route, route), "X-RateLimit-Remaining": "0",
                                                   "Retry-After": "65", "X-RateLimit-Scope": "user"})
        if fault == "global":
            return _err("rate_limited_global", 429, **{"Retry-After": "2", "X-RateLimit-Global": "true",
                                                          "X-RateLimit-Scope": "global"})
        if fault == "error_before":
            return JSONResponse({"message": "503: Service Unavailable", "code": 0}, status_code=503)
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"message": "400: Bad Request", "code": 0}, status_code=400)
        return body if isinstance(body, dict) else {}

    def _acted(self, fault: str | None, lost_count: str) -> Response | None:
        """The answer of a fault after the request acted (the connection dropped, counted in the world's
        ``lost_count``; or a 500), else None."""
        if fault == "lost":
            with self.world.lock:
                setattr(self.world, lost_count, getattr(self.world, lost_count) + 1)
            return DropResponse(status_code=200)
        if fault == "error_after":
            return JSONResponse({"message": "500: Internal Server Error", "code": 0}, status_code=500)
        return None

    async def _me(self, request: Request) -> Response:
        if (r := self._gate(request, "me", "")) is not None:
            return r
        body = fixture("user_me")
        body.update({"id": BOT_ID, "username": BOT_NAME})
        return JSONResponse(body)

    async def _application(self, request: Request) -> Response:
        """Get Current Bot Application (discord.py's login asks it): the fields its ``AppInfo`` reads."""
        if (r := self._gate(request, "application", "")) is not None:
            return r
        owner = {"id": "80351110224678913", "username": "owner", "discriminator": "0", "avatar": None}
        return JSONResponse({"id": BOT_ID, "name": BOT_NAME, "icon": None, "description": "", "bot_public": False,
                             "bot_require_code_grant": False, "owner": owner, "team": None, "flags": 0,
                             "verify_key": "00" * 32, "summary": ""})

    async def _gateway(self, request: Request) -> Response:
        if (r := self._gate(request, "gateway", "")) is not None:
            return r
        body = fixture("gateway_bot")
        body["url"] = self.gateway_url()
        return JSONResponse(body)

    async def _channel(self, request: Request) -> Response:
        cid = request.path_params["cid"]
        if (r := self._gate(request, "channel", cid)) is not None:
            return r
        ch = self.world.channels.get(cid)
        if ch is None:
            return _err("error_unknown_channel", 404)
        body = fixture("channel_text" if ch.guild_id else "channel_dm")
        body["id"] = cid
        if ch.guild_id:
            body["guild_id"] = ch.guild_id
        return JSONResponse(body)

    async def _messages(self, request: Request) -> Response:
        cid = request.path_params["cid"]
        route = "messages " + request.method
        if (r := self._gate(request, route, cid)) is not None:
            return r
        w = self.world
        if request.method == "GET":
            with w.lock:
                fault = w.read_faults.pop(0) if w.read_faults else None
            if fault == "5xx":
                return JSONResponse({"message": "500: Internal Server Error", "code": 0}, status_code=500)
            ch = w.channels.get(cid)
            if ch is None:
                return _err("error_unknown_channel", 404)
            q = request.query_params
            limit = max(1, min(100, int(q.get("limit", "50"))))
            with w.lock:
                live = [m for m in ch.messages if not m.deleted]
                if "after" in q:
                    after = int(q["after"])
                    page = sorted((m for m in live if int(m.id) > after), key=lambda m: int(m.id))[:limit]
                else:
                    before = int(q.get("before", str(1 << 63)))
                    page = sorted((m for m in live if int(m.id) < before), key=lambda m: -int(m.id))[:limit]
                out = [m.json(w) for m in sorted(page, key=lambda m: -int(m.id))]  # newest first, always
            # ASCII-escaped JSON (as json.dumps writes it): a test's lone surrogate reaches the client as "\ud800".
            return Response(json.dumps(out), media_type="application/json", headers=self._headers(route, route))
        token = self._auth(request) or ""
        with w.lock:
            w.create_requests += 1
            fault = w.create_faults.pop(0) if w.create_faults else None
            if fault is None and w.lose_ratio and w.rng.random() < w.lose_ratio:
                fault = "lost"
        body = await self._acting(request, fault, route)
        if isinstance(body, Response):
            return body
        status, what, msg = w.create(cid, body, token)
        if status != 200:
            return _err(what, status)
        assert msg is not None
        if w.create_delay_s:
            await asyncio.sleep(w.create_delay_s)
        if (after := self._acted(fault, "lost_answers")) is not None:
            return after
        if fault == "hold":
            w.held_token = token
            w.held.set()
            while not w.release_held.is_set():
                await asyncio.sleep(0.05)
            w.held.clear()
        out = msg.json(w)
        if msg.nonce is not None:
            out["nonce"] = msg.nonce  # the create's answer echoes the nonce; listings do not carry it
        return JSONResponse(out, headers=self._headers(route, route))

    async def _message(self, request: Request) -> Response:
        cid, mid = request.path_params["cid"], request.path_params["mid"]
        route = "message " + request.method
        if (r := self._gate(request, route, cid)) is not None:
            return r
        if request.method == "PATCH":
            return await self._edit(request, route, cid, mid)
        with self.world.lock:
            msg = self.world.find(cid, mid)
            if msg is None or msg.deleted:
                return _err("error_unknown_message" if cid in self.world.channels else "error_unknown_channel", 404)
            if request.method == "DELETE":
                if msg.author_id != BOT_ID:
                    return _err("error_missing_permissions", 403)
                msg.deleted = True
                return Response(status_code=204)
            return JSONResponse(msg.json(self.world))

    async def _edit(self, request: Request, route: str, cid: str, mid: str) -> Response:
        """Edit Message, with the injected faults: a 429, a 503 before acting, or an answer lost after acting."""
        w = self.world
        with w.lock:
            w.edit_requests += 1
            fault = w.edit_faults.pop(0) if w.edit_faults else None
        body = await self._acting(request, fault, route)
        if isinstance(body, Response):
            return body
        status, what = w.edit(cid, mid, body)
        if status != 200:
            return _err(what, status)
        if (after := self._acted(fault, "lost_edits")) is not None:
            return after
        return JSONResponse(what.json(w), headers=self._headers(route, route))

    def _interaction(self, request: Request) -> Interaction | Response:
        w = self.world
        if request.path_params["app"] != BOT_ID:
            return JSONResponse({"message": "Unknown Webhook", "code": 10015}, status_code=404)
        with w.lock:
            it = next((i for i in w.interactions.values() if i.token == request.path_params["token"]), None)
        if it is None or w.now() - it.made_at > w.token_life_s:
            return JSONResponse({"message": "Invalid Webhook Token", "code": 50027}, status_code=401)
        return it

    async def _original(self, request: Request) -> Response:
        self.calls["original " + request.method] = self.calls.get("original " + request.method, 0) + 1
        it = self._interaction(request)
        if isinstance(it, Response):
            return it
        if it.original is None:
            return JSONResponse({"message": "Unknown Message", "code": 10008}, status_code=404)
        if request.method == "PATCH":
            body = json.loads(await request.body())
            with self.world.lock:
                it.original.content = str(body.get("content") or "")
                it.original.pinged = pings(it.original.content, body.get("allowed_mentions"), None)
                it.edits += 1
        out = it.original.json(self.world)
        out["flags"] = 128 if it.edits == 0 else 0  # LOADING until the deferred response is edited
        return JSONResponse(out)

    async def _followup(self, request: Request) -> Response:
        it = self._interaction(request)
        if isinstance(it, Response):
            return it
        body = json.loads(await request.body())
        with self.world.lock:
            msg = Msg(self.world.snowflake(), it.channel_id, BOT_ID, str(body.get("content") or ""))
            self.world.channels[it.channel_id].messages.append(msg)
            it.followups.append(msg)
        return JSONResponse(msg.json(self.world))
