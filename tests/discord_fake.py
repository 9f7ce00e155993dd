"""A stateful fake of Discord: the REST API and the Gateway, as hostile as the published docs allow.

No Discord server exists for tests; this follows the docs (sources and licences: ``tests/fixtures/discord/
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
- ``Gateway``: a real WebSocket server: HELLO, heartbeat ACKs, IDENTIFY (intents checked: MESSAGE_CONTENT
  refused with 4014 unless ``content_allowed``), READY with a session id and ``resume_gateway_url``,
  RESUME replaying every dispatch after the client's ``seq`` (and ``replay_seen`` already-seen ones before
  it, as observed in the field), RESUMED; ``force_reconnect()`` closes every connection with 4000 (the
  client resumes), ``invalidate()`` sends INVALID_SESSION, ``stop_acks`` stops heartbeat ACKs.
- ``InteractionSender``: slash-command interactions POSTed to the app's interactions endpoint, signed with
  Ed25519 (``X-Signature-Ed25519`` over ``X-Signature-Timestamp`` + body) by the fake app's key, each
  delivered ``deliveries`` times (to the URLs in turn); an answer counts as the initial response only when
  it is type 4/5 within ``ack_timeout_s`` (3 s) and the first for its id (later ones are ``late_acks``:
  "already acknowledged"). A type 5 makes the deferred original message (flag LOADING) that
  ``PATCH /webhooks/{app}/{token}/messages/@original`` fills; ``POST /webhooks/{app}/{token}`` makes a
  follow-up message. Tokens die ``token_life_s`` (900 s) after the interaction (401 50027).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
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

from tests.fakes_forum import AppServer
from tests.fixtures_server import DropResponse

FIXTURES = Path(__file__).parent / "fixtures" / "discord"
DISCORD_EPOCH_MS = 1_420_070_400_000
BOT_ID, BOT_NAME = "80351110224678912", "replybot"
GUILD = "290926798626357999"
BOT_TOKENS = ("MTAxNjI4.fake-bot-token-a.aaaaaaaaaaaaaaaaaaaaaaaaa", "MTAxNjI4.fake-bot-token-b.bbbbbbbbbbbbbbbbbbbbbbbbb")
MAX_CONTENT = 2000
INTENT_MESSAGE_CONTENT = 1 << 15


def fixture(name: str) -> Any:
    """One of the Discord-shaped JSON bodies in tests/fixtures/discord."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _err(name: str, status: int, **headers: str) -> JSONResponse:
    return JSONResponse(fixture(name), status_code=status, headers=headers)


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

    def json(self, world: DiscordWorld) -> dict[str, Any]:
        """The message object as REST and the Gateway serve it."""
        out = copy.deepcopy(fixture("message"))
        ch = world.channels[self.channel_id]
        author = {"id": self.author_id, "username": world.names.get(self.author_id, "user"), "discriminator": "0"}
        if self.author_id == BOT_ID:
            author["bot"] = True
        out.update({"id": self.id, "channel_id": self.channel_id, "content": self.content, "author": author,
                    "type": 19 if self.reference else 0,
                    "timestamp": _iso(world.ms(self.id)),
                    "mentions": [{"id": u, "username": world.names.get(u, "user"), "discriminator": "0"}
                                 for u in self.mentions]})
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
            Route("/api/v10/gateway/bot", self._gateway),
            Route("/api/v10/channels/{cid}", self._channel),
            Route("/api/v10/channels/{cid}/messages", self._messages, methods=["GET", "POST"]),
            Route("/api/v10/channels/{cid}/messages/{mid}", self._message, methods=["GET", "DELETE", "PATCH"]),
            Route("/api/v10/webhooks/{app}/{token}/messages/@original", self._original, methods=["GET", "PATCH"]),
            Route("/api/v10/webhooks/{app}/{token}", self._followup, methods=["POST"]),
        ]
        self._server = AppServer(Starlette(routes=routes))

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
            return JSONResponse(out, headers=self._headers(route, route))
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


class InteractionSender:
    """Discord's side of the interactions endpoint: signed deliveries (each ``deliveries`` times), acks judged."""

    def __init__(self, world: DiscordWorld, urls: list[str], *, deliveries: int = 2, ack_timeout_s: float = 3.0,
                 key: Any = None) -> None:
        import httpx
        from nacl.signing import SigningKey

        self.world, self.urls, self.deliveries, self.ack_timeout_s = world, urls, deliveries, ack_timeout_s
        self.key = key or SigningKey.generate()
        self.statuses: list[int | None] = []
        self._http = httpx.Client(timeout=ack_timeout_s + 2)

    @property
    def public_key(self) -> str:
        """The app's public key (hex), as the developer portal shows it."""
        return bytes(self.key.verify_key).hex()

    def payload(self, cid: str, user: str, question: str) -> dict[str, Any]:
        """A CHAT_INPUT command interaction in ``cid`` by ``user``, registered in the world."""
        w = self.world
        with w.lock:
            iid = w.snowflake()
            token = "aW50ZXJhY3Rpb246" + uuid.uuid4().hex + uuid.uuid4().hex
            w.interactions[iid] = Interaction(iid, token, cid, user, w.now())
            guild = w.channels[cid].guild_id
        who = {"id": user, "username": f"user{user[-4:]}", "discriminator": "0"}
        body: dict[str, Any] = {"id": iid, "application_id": BOT_ID, "type": 2, "token": token, "version": 1,
                                "channel_id": cid, "locale": "en-US", "app_permissions": "442368",
                                "data": {"id": "771825006014889984", "name": "ask", "type": 1,
                                         "options": [{"name": "question", "type": 3, "value": question}]}}
        if guild:
            body.update({"guild_id": guild, "member": {"user": who, "roles": [], "permissions": "2147483647"}})
        else:
            body["user"] = who
        return body

    def deliver(self, body: dict[str, Any], url: str, *, key: Any = None, stamp: int | None = None) -> Any:
        """POST one signed delivery; judge its answer as Discord would. Returns the response (or None)."""
        raw = json.dumps(body).encode()
        ts = str(stamp if stamp is not None else int(time.time()))
        sig = (key or self.key).sign(ts.encode() + raw).signature.hex()
        t0 = time.monotonic()
        try:
            resp = self._http.post(url, content=raw, headers={"Content-Type": "application/json",
                                                              "X-Signature-Ed25519": sig, "X-Signature-Timestamp": ts})
        except Exception:
            self.statuses.append(None)
            return None
        took = time.monotonic() - t0
        self.statuses.append(resp.status_code)
        it = self.world.interactions.get(str(body.get("id")))
        try:
            kind = resp.json().get("type") if resp.status_code == 200 else None
        except ValueError:
            kind = None
        if it is not None:
            with self.world.lock:
                if kind in (4, 5) and took <= self.ack_timeout_s and it.acks == 0:
                    it.acks += 1
                    it.ack_s.append(took)
                    it.original = Msg(self.world.snowflake(), it.channel_id, BOT_ID, "")
                    self.world.channels[it.channel_id].messages.append(it.original)
                else:
                    it.late_acks += 1
        return resp

    def fire(self, cid: str, user: str, question: str) -> str:
        """One interaction delivered ``deliveries`` times, to the URLs in turn, at once; returns its id."""
        body = self.payload(cid, user, question)
        threads = [threading.Thread(target=self.deliver, args=(body, self.urls[i % len(self.urls)]), daemon=True)
                   for i in range(self.deliveries)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.ack_timeout_s + 3)
        return str(body["id"])

    def close(self) -> None:
        """Close the client."""
        self._http.close()


@dataclass
class _Session:
    id: str
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (seq, frame)
    seq: int = 0
    content: bool = False


class Gateway:
    """The Gateway on a real WebSocket: sessions buffered for RESUME, replays, forced reconnects."""

    def __init__(self, world: DiscordWorld, *, heartbeat_ms: int = 1000, content_allowed: bool = False,
                 replay_seen: int = 0) -> None:
        from websockets.sync.server import serve

        self.world = world
        self.heartbeat_ms = heartbeat_ms
        self.content_allowed = content_allowed
        self.replay_seen = replay_seen  # on RESUME, also replay this many dispatches the client had seen
        self.stop_acks = False
        self.sessions: dict[str, _Session] = {}
        self.identifies = 0
        self.resumes: list[tuple[str, Any]] = []  # (session id, seq the client sent)
        self.dispatched: list[tuple[str, str]] = []  # (session id, message id) of every MESSAGE_CREATE sent
        self._lock = threading.Lock()
        self._live: dict[Any, _Session] = {}
        self._server = serve(self._handler, "127.0.0.1", 0)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="discord-gateway")
        self._thread.start()
        world.on_message.append(self._heard)
        world.on_update.append(lambda msg: self._heard(msg, "MESSAGE_UPDATE"))

    def url(self) -> str:
        """What ``GET /gateway/bot`` hands out."""
        return f"ws://127.0.0.1:{self.port}"

    def _heard(self, msg: Msg, kind: str = "MESSAGE_CREATE") -> None:
        with self._lock:
            sessions = list(self.sessions.values())
            live = dict(self._live)
        for s in sessions:
            data = msg.json(self.world)
            if not s.content and msg.author_id != BOT_ID and BOT_ID not in msg.mentions \
                    and self.world.channels[msg.channel_id].guild_id is not None:
                data["content"] = ""  # the MESSAGE_CONTENT rule
            with self._lock:
                s.seq += 1
                frame = {"op": 0, "s": s.seq, "t": kind, "d": data}
                s.events.append((s.seq, frame))
            for ws, held in live.items():
                if held is s:
                    self._send(ws, s, frame)

    def _send(self, ws: Any, s: _Session, frame: dict[str, Any]) -> None:
        try:
            ws.send(json.dumps(frame))
            if frame.get("t") == "MESSAGE_CREATE":
                with self._lock:
                    self.dispatched.append((s.id, frame["d"]["id"]))
        except Exception:  # a closing connection: the session keeps the event for a RESUME
            pass

    def _handler(self, ws: Any) -> None:
        hello = fixture("gateway_hello")
        hello["d"]["heartbeat_interval"] = self.heartbeat_ms
        ws.send(json.dumps(hello))
        session: _Session | None = None
        try:
            for raw in ws:
                try:
                    frame = json.loads(raw)
                except ValueError:
                    ws.close(4002, "decode error")
                    return
                op, d = frame.get("op"), frame.get("d")
                if op == 1:
                    if not self.stop_acks:
                        ws.send(json.dumps({"op": 11}))
                elif op == 2 and isinstance(d, dict):
                    if d.get("token") not in self.world.tokens:
                        ws.close(4004, "Authentication failed.")
                        return
                    intents = d.get("intents")
                    if not isinstance(intents, int):
                        ws.close(4013, "Invalid intent(s).")
                        return
                    if intents & INTENT_MESSAGE_CONTENT and not self.content_allowed:
                        ws.close(4014, "Disallowed intent(s).")
                        return
                    session = _Session(uuid.uuid4().hex, content=bool(intents & INTENT_MESSAGE_CONTENT))
                    ready = fixture("gateway_ready")
                    ready["d"].update({"session_id": session.id, "resume_gateway_url": self.url()})
                    ready["d"]["user"].update({"id": BOT_ID, "username": BOT_NAME})
                    with self._lock:
                        self.identifies += 1
                        session.seq = 1
                        ready["s"] = 1
                        session.events.append((1, ready))
                        self.sessions[session.id] = session
                        self._live[ws] = session
                    ws.send(json.dumps(ready))
                elif op == 6 and isinstance(d, dict):
                    with self._lock:
                        self.resumes.append((str(d.get("session_id")), d.get("seq")))
                        session = self.sessions.get(str(d.get("session_id")))
                    if session is None or d.get("token") not in self.world.tokens:
                        ws.send(json.dumps(fixture("gateway_invalid_session")))
                        continue
                    seq = d.get("seq") if isinstance(d.get("seq"), int) else 0
                    with self._lock:
                        again = [f for s, f in session.events if s > seq - self.replay_seen]
                        self._live[ws] = session
                    for f in again:
                        self._send(ws, session, f)
                    with self._lock:
                        session.seq += 1
                        resumed = {"op": 0, "s": session.seq, "t": "RESUMED", "d": {}}
                        session.events.append((session.seq, resumed))
                    ws.send(json.dumps(resumed))
        except Exception:
            pass
        finally:
            with self._lock:
                self._live.pop(ws, None)

    def force_reconnect(self, code: int = 4000) -> None:
        """Close every connection (4000: reconnect and resume; 4009: session timed out)."""
        with self._lock:
            live = list(self._live)
            if code in (4007, 4009):
                for s in list(self._live.values()):
                    self.sessions.pop(s.id, None)
        for ws in live:
            try:
                ws.close(code, "forced")
            except Exception:
                pass

    def invalidate(self, resumable: bool = False) -> None:
        """Send INVALID_SESSION to every connection (``d: false`` ends their sessions)."""
        with self._lock:
            live = dict(self._live)
            if not resumable:
                for s in live.values():
                    self.sessions.pop(s.id, None)
        for ws in live:
            try:
                ws.send(json.dumps({**fixture("gateway_invalid_session"), "d": resumable}))
            except Exception:
                pass

    @property
    def connections(self) -> int:
        """Connections holding a session now."""
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._thread.join(2)
