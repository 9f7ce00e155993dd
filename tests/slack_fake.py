"""A stateful fake of Slack: the Web API, the Events API sender and the Socket Mode server, redelivering as Slack does.

Shapes follow Slack's published examples (``tests/fixtures/slack``, sources in its SOURCES.md): each
body the fake serves or sends is a fixture with the fields that matter replaced.

- ``SlackWorld``: the workspace in memory (channels, members, messages with ``ts`` as strings, threads,
  message metadata) and the counts the tests trust: ``bot_replies(parent_id)`` counts the bot's
  messages in the parent's thread, on the platform side. Fault knobs for ``chat.postMessage``
  (``post_faults``: ``"lost"`` created then the connection drops, ``"error_after"`` created then HTTP
  500, ``"error_before"`` 503 and nothing created, ``"ratelimited"`` 429 + Retry-After, ``"hold"``
  created and the answer held until ``release_held``) and for reads (``read_faults[method]``).
  ``chat.update`` has its own knobs (``update_faults``: ``"lost"`` edited then the connection drops,
  ``"error_after"`` edited then HTTP 500, ``"error_before"`` 503 and nothing edited, ``"ratelimited"`` 429 +
  Retry-After; ``edit_window_s``: the workspace's edit window) and keeps every message's edit history: the
  ground truth a test reads is ``text_of(reply_id)`` (the current text) and ``history_of(reply_id)`` (every
  text it had, the first post's first).
  Text beyond ``MAX_TEXT`` (40,000 characters) is posted truncated with the ``message_truncated`` warning, as
  Slack documents (``too_long = "refuse"``: the documented ``msg_too_long`` instead; SOURCES.md).
  Several bot tokens may belong to the one bot user (``tokens``): which one sent is recorded.
- ``SlackWebApi``: the Web API over HTTP (Starlette on uvicorn): ``auth.test``, ``users.conversations``,
  ``conversations.history`` / ``replies``, ``chat.postMessage`` / ``update`` / ``delete``,
  ``apps.connections.open``.
- ``EventsSender``: posts each event as the Events API does, signed (v0 HMAC-SHA256), and retries an
  unacknowledged one (no 2xx within ``ack_timeout_s``) at once, after 1 and after 5 minutes of Slack time
  (``minute_s`` real seconds a minute), with ``X-Slack-Retry-Num`` / ``X-Slack-Retry-Reason``;
  ``retry_all`` sends every retry whatever the ack (an ack lost on the way back).
- ``SocketServer``: Socket Mode over a real WebSocket: ``hello``, one envelope per event, acks by
  ``envelope_id``; unacknowledged envelopes are sent again on the next connection (``retry_attempt``
  + 1); ``lose_acks`` drops the acks of a connection; ``disconnect()`` asks every client to reconnect.

A channel mention is pushed twice as Slack does (``message`` and ``app_mention``, each with its own
``event_id``), and ``extra_event_ids`` sends the same message under more fresh ids
(node-slack-sdk#2141).
"""

from __future__ import annotations

import asyncio
import copy
import heapq
import itertools
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from replyd.hooks import slack_sign
from tests.fakes_forum import AppServer
from tests.fixtures_server import DropResponse

FIXTURES = Path(__file__).parent / "fixtures" / "slack"
TEAM, BOT_USER, BOT_ID, APP_ID = "T0FAKE001", "U0BOT0001", "B0BOT0001", "A0APP0001"
BOT_TOKENS = ("xoxb-1111-fake-bot-token-a", "xoxb-2222-fake-bot-token-b")
APP_TOKEN = "xapp-1-A0APP0001-fake-app-token"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
# Slack truncates ``text`` beyond 40,000 characters (api.slack.com/changelog/2018-04-truncating-really-long-messages).
MAX_TEXT = 40_000


def fixture(name: str) -> Any:
    """One of the Slack-shaped JSON bodies in tests/fixtures/slack."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


@dataclass
class Msg:
    """One message as Slack holds it."""

    ts: str
    user: str
    text: str
    thread_ts: str | None = None
    bot_id: str | None = None
    metadata: dict[str, Any] | None = None
    token: str = ""  # which bot token posted it (the bot's messages only)
    client_msg_id: str = field(default_factory=lambda: str(uuid.uuid4()))  # set by a person's client
    history: list[str] = field(default_factory=list)  # every text it had before the current one, oldest first
    edited_ts: str | None = None  # when it was last edited (served as ``edited``)

    def json(self, *, metadata: bool) -> dict[str, Any]:
        """The message as conversations.history / replies serve it."""
        out = copy.deepcopy(fixture("message"))
        out.update({"ts": self.ts, "user": self.user, "text": self.text})
        out["client_msg_id"] = self.client_msg_id
        if self.bot_id:  # a bot's message carries no client_msg_id (only people's clients set one)
            out.pop("client_msg_id", None)
        if self.thread_ts:
            out["thread_ts"] = self.thread_ts
        if self.bot_id:
            out.update({"bot_id": self.bot_id, "app_id": APP_ID})
        if metadata and self.metadata:
            out["metadata"] = self.metadata
        if self.edited_ts:
            out["edited"] = {"user": self.user, "ts": self.edited_ts}
        return out


@dataclass
class Channel:
    """A conversation: a public channel (``C…``) or a DM (``D…``)."""

    id: str
    members: set[str]
    messages: list[Msg] = field(default_factory=list)

    @property
    def is_im(self) -> bool:
        """Whether this is a direct message."""
        return self.id.startswith("D")


class SlackWorld:
    """The workspace: channels, messages, the platform-side counts and the fault knobs."""

    def __init__(self, *, now: Callable[[], float] = time.time, tokens: tuple[str, ...] = BOT_TOKENS) -> None:
        self.now = now
        self.tokens = tokens
        self.lock = threading.Lock()
        self.channels: dict[str, Channel] = {}
        self.post_faults: list[str] = []
        self.update_faults: list[str] = []
        self.update_requests = 0
        self.edit_window_s: float | None = None  # None: edits allowed at any age (a workspace's default)
        self.update_per_minute = 50  # chat.update is Tier 3: 50+ a minute; past it a 429 (None: no limit)
        self._update_times: list[float] = []
        self.too_long = "truncate"  # text beyond MAX_TEXT: "truncate" (documented) or "refuse" (msg_too_long)
        self.read_faults: dict[str, list[str]] = {}
        self.post_requests = 0
        self.post_tokens: Counter[str] = Counter()
        self.held = threading.Event()  # set while a "hold" answer is being held
        self.release_held = threading.Event()
        self.held_token = ""
        self.on_user_message: list[Callable[[Channel, Msg, list[dict[str, Any]]], None]] = []  # the push senders
        self._last_ts = Decimal(0)
        self._ids = itertools.count(1)

    def _ts(self) -> str:
        ts = max(Decimal(f"{self.now():.6f}"), self._last_ts + Decimal("0.000001"))
        self._last_ts = ts
        return f"{ts:.6f}"

    def add_channel(self, cid: str, *members: str) -> Channel:
        """A channel (``C…``) or DM (``D…``) with ``members`` (the bot is in it when listed)."""
        with self.lock:
            self.channels[cid] = Channel(cid, set(members))
            return self.channels[cid]

    def say(self, cid: str, user: str, text: str, *, thread_ts: str | None = None, push: bool = True) -> str:
        """A person posts ``text``; the push senders hear of it. Returns the parent id ``C…:ts``."""
        with self.lock:
            ch = self.channels[cid]
            msg = Msg(self._ts(), user, text, thread_ts=thread_ts)
            ch.messages.append(msg)
        if push:
            bodies = self.events_for(ch, msg)  # one event id per event, the same on every path
            for hear in self.on_user_message:
                hear(ch, msg, bodies)
        return f"{cid}:{msg.ts}"

    def bot_replies(self, parent_id: str) -> list[Msg]:
        """The bot's messages in the parent's thread tagged for it: the platform-side count of answers."""
        cid, _, ts = parent_id.partition(":")
        with self.lock:
            ch = self.channels[cid]
            root = next((m.thread_ts or m.ts for m in ch.messages if m.ts == ts), ts)
            return [m for m in ch.messages if m.bot_id and (m.thread_ts or m.ts) == root
                    and (m.metadata or {}).get("event_payload", {}).get("parent") in (parent_id, None)]

    def message(self, reply_id: str) -> Msg:
        """The message ``<channel>:<ts>`` as the workspace holds it now (KeyError when there is none)."""
        cid, _, ts = reply_id.partition(":")
        with self.lock:
            return next(m for m in self.channels[cid].messages if m.ts == ts)

    def text_of(self, reply_id: str) -> str:
        """The current text of message ``reply_id``: the ground truth an edit is judged on."""
        return self.message(reply_id).text

    def history_of(self, reply_id: str) -> list[str]:
        """Every text message ``reply_id`` has had, the posted one first and the current one last."""
        msg = self.message(reply_id)
        return [*msg.history, msg.text]

    def thread_replies(self, parent_id: str, *, by: str = BOT_USER) -> list[Msg]:
        """Every message by ``by`` in the parent's thread, tagged or not (naive bots tag nothing)."""
        cid, _, ts = parent_id.partition(":")
        with self.lock:
            return [m for m in self.channels[cid].messages if m.user == by and m.thread_ts == ts]

    # --- Web API methods (called with the lock free) --------------------------------

    def event_body(self, ch: Channel, msg: Msg, kind: str) -> dict[str, Any]:
        """The Events API ``event_callback`` body for ``msg`` as a ``message`` or ``app_mention`` event."""
        body = copy.deepcopy(fixture("event_app_mention" if kind == "app_mention" else "event_message_im"))
        body.update({"team_id": TEAM, "api_app_id": APP_ID, "event_id": f"Ev{next(self._ids):08d}FAKE",
                     "event_time": int(float(msg.ts))})
        body["authorizations"][0].update({"team_id": TEAM, "user_id": BOT_USER})
        ev = body["event"]
        ev.update({"user": msg.user, "text": msg.text, "ts": msg.ts, "event_ts": msg.ts, "channel": ch.id,
                   "team": TEAM, "client_msg_id": msg.client_msg_id})
        if kind == "message":
            ev["channel_type"] = "im" if ch.is_im else "channel"
        if msg.thread_ts:
            ev["thread_ts"] = msg.thread_ts
        return body

    def events_for(self, ch: Channel, msg: Msg) -> list[dict[str, Any]]:
        """What Slack pushes for one message: ``message``, plus ``app_mention`` when the bot is named."""
        if BOT_USER not in ch.members or msg.user == BOT_USER:
            return []
        out = [self.event_body(ch, msg, "message")]
        if not ch.is_im and f"<@{BOT_USER}>" in msg.text:
            out.append(self.event_body(ch, msg, "app_mention"))
        return out


def _ok(**kw: Any) -> Response:
    # ASCII-escaped JSON (as json.dumps writes it): a test's lone surrogate reaches the client as "\ud800".
    return Response(json.dumps({"ok": True, **kw}), media_type="application/json")


def _err(code: str, status: int = 200, **headers: str) -> JSONResponse:
    return JSONResponse({"ok": False, "error": code}, status_code=status, headers=headers)


def _truncated(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the warning Slack adds when it posted a text truncated to 40,000 characters."""
    body["response_metadata"] = {"messages": ["[WARN] Your message was truncated but still posted. The `text` "
                                              "field accepts up to 40,000 characters."],
                                 "warnings": ["message_truncated"]}
    return body


class SlackWebApi:
    """The Web API on a real HTTP server: ``url`` is the ``api_url`` replyd is configured with."""

    def __init__(self, world: SlackWorld, *, socket_url: Callable[[], str] = lambda: "") -> None:
        self.world = world
        self.socket_url = socket_url
        self.calls: Counter[str] = Counter()
        self._server = AppServer(Starlette(routes=[Route("/api/{method}", self._endpoint, methods=["GET", "POST"])]))

    def __enter__(self) -> SlackWebApi:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.world.release_held.set()
        self._server.stop()

    @property
    def url(self) -> str:
        """The Web API root (``…/api``)."""
        return f"{self._server.url}/api"

    async def _endpoint(self, request: Request) -> Response:
        method = request.path_params["method"]
        self.calls[method] += 1
        args: dict[str, Any] = dict(request.query_params)
        if request.method == "POST":
            raw = await request.body()
            if raw and request.headers.get("content-type", "").startswith("application/json"):
                args.update(json.loads(raw))
        token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if method == "apps.connections.open":
            return _ok(url=self.socket_url()) if token == APP_TOKEN else _err("invalid_auth")
        if token not in self.world.tokens:
            return _err("invalid_auth" if token else "not_authed")
        fault = self._read_fault(method)
        if fault == "ratelimited":
            return _err("ratelimited", 429, **{"Retry-After": "30"})
        if fault == "ratelimited_bare":  # a 429 that names no wait
            return _err("ratelimited", 429)
        if fault == "echo":  # a broken proxy or server repeating the credential in the error
            return _err(f"token {token} is not valid here")
        if fault == "5xx":
            return JSONResponse({"ok": False, "error": "internal_error"}, status_code=503)
        handler = getattr(self, "_" + method.replace(".", "_"), None)
        if handler is None:
            return _err("unknown_method", 404)
        return await handler(args, token) if method == "chat.postMessage" else handler(args, token)

    def _before_write(self, fault: str | None, args: dict[str, Any]) -> tuple[Channel, str, bool] | Response:
        """What chat.postMessage and chat.update answer before acting (a fault that acts first, the channel, the
        text), else (channel, the text Slack keeps, whether it truncated it past MAX_TEXT)."""
        if fault == "ratelimited":
            return _err("ratelimited", 429, **{"Retry-After": "1"})
        if fault == "error_before":
            return JSONResponse({"ok": False, "error": "service_unavailable"}, status_code=503)
        ch, err = self._channel(args)
        if ch is None:
            return err  # type: ignore[return-value]
        text = args.get("text")
        if not isinstance(text, str) or not text:
            return _err("no_text")
        if len(text) <= MAX_TEXT:
            return ch, text, False
        if self.world.too_long == "refuse":
            return _err("msg_too_long")
        return ch, text[:MAX_TEXT], True

    def _read_fault(self, method: str) -> str | None:
        with self.world.lock:
            queue = self.world.read_faults.get(method)
            return queue.pop(0) if queue else None

    def _auth_test(self, args: dict[str, Any], token: str) -> Response:
        body = fixture("auth_test")
        body.update({"team_id": TEAM, "user_id": BOT_USER, "bot_id": BOT_ID, "user": "replybot"})
        return JSONResponse(body)

    def _users_conversations(self, args: dict[str, Any], token: str) -> Response:
        with self.world.lock:
            mine = [c for c in self.world.channels.values() if BOT_USER in c.members]
        start = int(args.get("cursor") or 0)
        limit = int(args.get("limit") or 100)
        page = mine[start:start + limit]
        nxt = str(start + limit) if start + limit < len(mine) else ""
        chans = []
        for c in page:
            item = copy.deepcopy(fixture("conversation"))
            item.update({"id": c.id, "is_im": c.is_im, "is_channel": not c.is_im, "is_member": True})
            chans.append(item)
        return _ok(channels=chans, response_metadata={"next_cursor": nxt})

    def _channel(self, args: dict[str, Any]) -> tuple[Channel | None, Response | None]:
        ch = self.world.channels.get(str(args.get("channel", "")))
        if ch is None:
            return None, _err("channel_not_found")
        if BOT_USER not in ch.members:
            return None, _err("not_in_channel")
        return ch, None

    @staticmethod
    def _window(msgs: list[Msg], args: dict[str, Any]) -> list[Msg]:
        inclusive = str(args.get("inclusive", "")).lower() in ("true", "1")
        lo, hi = Decimal(str(args.get("oldest") or 0)), args.get("latest")
        out = []
        for m in msgs:
            t = Decimal(m.ts)
            if (t > lo or (inclusive and t == lo)) and (hi is None or t < Decimal(str(hi))
                                                        or (inclusive and t == Decimal(str(hi)))):
                out.append(m)
        return out

    @staticmethod
    def _page(items: list[Any], args: dict[str, Any]) -> tuple[list[Any], str]:
        start, limit = int(args.get("cursor") or 0), int(args.get("limit") or 100)
        return items[start:start + limit], (str(start + limit) if start + limit < len(items) else "")

    def _conversations_history(self, args: dict[str, Any], token: str) -> Response:
        ch, err = self._channel(args)
        if ch is None:
            return err  # type: ignore[return-value]
        with self.world.lock:
            top = [m for m in ch.messages if not m.thread_ts or m.thread_ts == m.ts]
            threads = Counter(m.thread_ts for m in ch.messages if m.thread_ts and m.thread_ts != m.ts)
            latest = {m.thread_ts: m.ts for m in ch.messages if m.thread_ts and m.thread_ts != m.ts}
            meta = str(args.get("include_all_metadata", "")).lower() in ("true", "1")
            msgs = sorted(self._window(top, args), key=lambda m: Decimal(m.ts), reverse=True)
            page, nxt = self._page(msgs, args)
            out = []
            for m in page:
                j = m.json(metadata=meta)
                if threads[m.ts]:
                    j.update({"thread_ts": m.ts, "reply_count": threads[m.ts], "latest_reply": latest[m.ts]})
                out.append(j)
        return _ok(messages=out, has_more=bool(nxt), response_metadata={"next_cursor": nxt})

    def _conversations_replies(self, args: dict[str, Any], token: str) -> Response:
        ch, err = self._channel(args)
        if ch is None:
            return err  # type: ignore[return-value]
        ts = str(args.get("ts", ""))
        with self.world.lock:
            target = next((m for m in ch.messages if m.ts == ts), None)
            if target is None:
                return _err("thread_not_found")
            root = target.thread_ts or target.ts
            thread = [m for m in ch.messages if m.ts == root or m.thread_ts == root]
            parent = [m for m in thread if m.ts == root]
            rest = self._window([m for m in thread if m.ts != root], args)
            meta = str(args.get("include_all_metadata", "")).lower() in ("true", "1")
            page, nxt = self._page(parent + sorted(rest, key=lambda m: Decimal(m.ts)), args)
            out = [m.json(metadata=meta) for m in page]
        return _ok(messages=out, has_more=bool(nxt), response_metadata={"next_cursor": nxt})

    async def _chat_postMessage(self, args: dict[str, Any], token: str) -> Response:
        w = self.world
        with w.lock:
            w.post_requests += 1
            fault = w.post_faults.pop(0) if w.post_faults else None
        checked = self._before_write(fault, args)
        if isinstance(checked, Response):
            return checked
        ch, text, truncated = checked
        with w.lock:
            thread_ts = args.get("thread_ts") if isinstance(args.get("thread_ts"), str) else None
            if thread_ts and not any(m.ts == thread_ts for m in ch.messages):
                return _err("thread_not_found")
            msg = Msg(w._ts(), BOT_USER, text, thread_ts=thread_ts, bot_id=BOT_ID,
                      metadata=args.get("metadata") if isinstance(args.get("metadata"), dict) else None, token=token)
            ch.messages.append(msg)
            w.post_tokens[token] += 1
        if fault == "lost":
            return DropResponse(status_code=200)
        if fault == "error_after":
            return JSONResponse({"ok": False, "error": "internal_error"}, status_code=500)
        if fault == "hold":
            w.held_token = token
            w.held.set()
            while not w.release_held.is_set():
                await asyncio.sleep(0.05)
            w.held.clear()
        body = fixture("chat_postMessage")
        body.update({"channel": ch.id, "ts": msg.ts})
        body["message"].update({"ts": msg.ts, "text": text, "user": BOT_USER, "bot_id": BOT_ID})
        if thread_ts:
            body["message"]["thread_ts"] = thread_ts
        return JSONResponse(_truncated(body) if truncated else body)

    def _chat_update(self, args: dict[str, Any], token: str) -> Response:
        """chat.update: replace one of the bot's messages' text (its metadata kept unless given), history kept."""
        w = self.world
        with w.lock:
            w.update_requests += 1
            now = w.now()
            w._update_times = [t for t in w._update_times if now - t < 60.0]
            over = w.update_per_minute is not None and len(w._update_times) >= w.update_per_minute
            if not over:
                w._update_times.append(now)
            fault = w.update_faults.pop(0) if w.update_faults and not over else None
        if over:  # the tier's minute is spent: a 429 until its oldest request is a minute old
            wait = max(1, int(60.0 - (now - w._update_times[0])) + 1)
            return _err("ratelimited", 429, **{"Retry-After": str(wait)})
        checked = self._before_write(fault, args)
        if isinstance(checked, Response):
            return checked
        ch, text, truncated = checked
        with w.lock:
            msg = next((m for m in ch.messages if m.ts == args.get("ts")), None)
            if msg is None:
                return _err("message_not_found")
            if msg.user != BOT_USER:  # only the caller's own messages (a bot token edits the bot's)
                return _err("cant_update_message")
            if w.edit_window_s is not None and w.now() - float(msg.ts) > w.edit_window_s:
                return _err("edit_window_closed")
            msg.history.append(msg.text)
            msg.text = text
            msg.edited_ts = w._ts()
            meta = args.get("metadata")
            if isinstance(meta, dict):  # left out: kept; {}: removed (chat.update's metadata argument)
                msg.metadata = meta or None
        if fault == "lost":
            return DropResponse(status_code=200)
        if fault == "error_after":
            return JSONResponse({"ok": False, "error": "internal_error"}, status_code=500)
        body = fixture("chat_update")
        body.update({"channel": ch.id, "ts": msg.ts, "text": text})
        body["message"].update({"text": text, "user": BOT_USER, "bot_id": BOT_ID, "ts": msg.ts})
        if msg.thread_ts:
            body["message"]["thread_ts"] = msg.thread_ts
        return JSONResponse(_truncated(body) if truncated else body)

    def _chat_delete(self, args: dict[str, Any], token: str) -> Response:
        ch, err = self._channel(args)
        if ch is None:
            return err  # type: ignore[return-value]
        with self.world.lock:
            hit = [m for m in ch.messages if m.ts == args.get("ts") and m.user == BOT_USER]
            if not hit:
                return _err("message_not_found")
            ch.messages.remove(hit[0])
        return _ok(channel=ch.id, ts=args.get("ts"))


class EventsSender:
    """The Events API: signed POSTs to the Request URL, retried at once, after 1 and 5 minutes when not acked."""

    RETRY_AFTER_MIN = (0.0, 1.0, 5.0)

    def __init__(self, world: SlackWorld, urls: list[str], *, secret: str = SIGNING_SECRET, minute_s: float = 60.0,
                 ack_timeout_s: float = 3.0, retry_all: bool = False, extra_event_ids: int = 0,
                 pick: Callable[[list[str]], str] | None = None) -> None:
        self.world, self.urls, self.secret = world, urls, secret
        self.minute_s, self.ack_timeout_s = minute_s, ack_timeout_s
        self.retry_all, self.extra_event_ids = retry_all, extra_event_ids
        self.pick = pick or (lambda urls: urls[0])
        self.sent: list[tuple[str, int, int | None]] = []  # (event_id, retry number, status or None)
        self._queue: list[tuple[float, int, dict[str, Any], int, str]] = []
        self._seq = itertools.count()
        self._lock = threading.Condition()
        self._stop = False
        self._http = httpx.Client(timeout=ack_timeout_s)
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"slack-events-{i}") for i in range(4)]
        world.on_user_message.append(self._heard)
        for t in self._threads:
            t.start()

    def _heard(self, ch: Channel, msg: Msg, bodies: list[dict[str, Any]]) -> None:
        bodies = list(bodies)
        for _ in range(self.extra_event_ids if bodies else 0):
            again = copy.deepcopy(bodies[0])
            again["event_id"] = f"Ev{uuid.uuid4().hex[:10].upper()}"
            bodies.append(again)
        for body in bodies:
            self._schedule(time.monotonic(), body, 0, "")

    def _schedule(self, due: float, body: dict[str, Any], retry: int, reason: str) -> None:
        with self._lock:
            heapq.heappush(self._queue, (due, next(self._seq), body, retry, reason))
            self._lock.notify()

    def deliver(self, body: dict[str, Any], *, retry: int = 0, reason: str = "", url: str | None = None,
                timestamp: int | None = None) -> httpx.Response | None:
        """POST one signed delivery; the response, or None when it timed out or failed."""
        raw = json.dumps(body).encode()
        stamp = str(timestamp if timestamp is not None else int(time.time()))
        headers = {"Content-Type": "application/json", "X-Slack-Request-Timestamp": stamp,
                   "X-Slack-Signature": slack_sign(self.secret, stamp, raw)}
        if retry:
            headers.update({"X-Slack-Retry-Num": str(retry), "X-Slack-Retry-Reason": reason})
        try:
            return self._http.post(url or self.pick(self.urls), content=raw, headers=headers)
        except httpx.HTTPError:
            return None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._lock.wait(0.05 if self._queue else 0.5)
                if self._stop:
                    return
                _due, _n, body, retry, reason = heapq.heappop(self._queue)
            resp = self.deliver(body, retry=retry, reason=reason)
            status = resp.status_code if resp is not None else None
            self.sent.append((body["event_id"], retry, status))
            acked = status is not None and 200 <= status < 300
            if retry < 3 and (not acked or self.retry_all):
                why = "http_timeout" if status is None else ("http_error" if not acked else "http_timeout")
                after_min = self.RETRY_AFTER_MIN[retry]
                self._schedule(time.monotonic() + after_min * self.minute_s, body, retry + 1, why)

    def pending(self) -> int:
        """Deliveries (and retries) not yet sent."""
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        """Stop the sender threads."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        for t in self._threads:
            t.join(2)
        self._http.close()


class SocketServer:
    """Socket Mode on a real WebSocket: envelopes acked by id; unacked ones sent again on the next connection."""

    def __init__(self, world: SlackWorld) -> None:
        from websockets.sync.server import serve

        self.world = world
        self.unacked: dict[str, dict[str, Any]] = {}  # envelope id -> envelope
        self.lose_acks = False
        self.connections = 0
        self.delivered: list[tuple[str, int]] = []  # (event_id, retry_attempt)
        self._lock = threading.Lock()
        self._clients: list[Any] = []
        self._server = serve(self._handler, "127.0.0.1", 0)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="slack-socket")
        self._thread.start()
        world.on_user_message.append(self._heard)

    def url(self) -> str:
        """A fresh single-use connection URL, as apps.connections.open hands out."""
        return f"ws://127.0.0.1:{self.port}/link/?ticket={uuid.uuid4().hex}&app_id={APP_ID}"

    def _heard(self, ch: Channel, msg: Msg, bodies: list[dict[str, Any]]) -> None:
        for body in bodies:
            env = copy.deepcopy(fixture("socket_events_api"))
            env.update({"envelope_id": str(uuid.uuid4()), "payload": body, "retry_attempt": 0, "retry_reason": ""})
            with self._lock:
                self.unacked[env["envelope_id"]] = env
                clients = list(self._clients)
            for ws in clients[:1]:  # Slack picks one of the app's connections
                self._send(ws, env)

    def _send(self, ws: Any, env: dict[str, Any]) -> None:
        try:
            ws.send(json.dumps(env))
            self.delivered.append((env["payload"]["event_id"], env["retry_attempt"]))
        except Exception:  # a closing connection: the envelope stays unacked and goes out on the next one
            pass

    def _handler(self, ws: Any) -> None:
        hello = fixture("socket_hello")
        hello["connection_info"]["app_id"] = APP_ID
        ws.send(json.dumps(hello))
        with self._lock:
            self.connections += 1
            self._clients.append(ws)
            again = list(self.unacked.values())
        lose = self.lose_acks
        for env in again:  # redelivery after a reconnect
            env["retry_attempt"] += 1
            env["retry_reason"] = "timeout"
            self._send(ws, env)
        try:
            for raw in ws:
                try:
                    ack = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(ack, dict) and not lose:
                    with self._lock:
                        self.unacked.pop(str(ack.get("envelope_id")), None)
        except Exception:
            pass
        finally:
            with self._lock:
                if ws in self._clients:
                    self._clients.remove(ws)

    def disconnect(self, reason: str = "refresh_requested") -> None:
        """Send every connection a ``disconnect`` (clients reconnect), then close them."""
        msg = fixture("socket_disconnect")
        msg["reason"] = reason
        with self._lock:
            clients = list(self._clients)
        for ws in clients:
            try:
                ws.send(json.dumps(msg))
                ws.close()
            except Exception:
                pass

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._thread.join(2)
