"""A stateful fake of the Telegram Bot API, built from its documentation (sources: fixtures/telegram/SOURCES.md).

Shipped in the package so the docs' examples run anywhere: ``TelegramApi(TelegramWorld()).start()``.

- ``TelegramWorld``: chats, users and messages (sequential message ids per chat), the update queue, and the
  counts tests trust, on the platform side: ``bot_replies(parent_id)`` counts the bot's messages replying to
  a parent; ``unanswered`` lists the bot messages created whose ``sendMessage`` answer never reached the
  client (lost, 5xx after creating, held). ``send_faults`` (popped per ``sendMessage``): ``"lost"`` created then
  the connection drops, ``"error_after"`` created then HTTP 502, ``"error_before"`` 502 and nothing created,
  ``"ratelimited"`` 429 with ``parameters.retry_after``, ``"blocked"`` 403, ``"hold"`` created and the answer
  held until ``release_held`` (then the connection drops). Without ``reply_parameters`` the message is a plain
  one in the chat (``bot_messages(chat_id)`` counts those too). ``lose_fraction`` loses that share of the answers
  at random (seeded). A text longer than 4,096 UTF-16 code units is refused ("message is too long").
- ``editMessageText`` on the bot's own messages: ``edit_faults`` as ``send_faults`` (``"lost"`` edited then the
  connection drops, ``"error_after"`` edited then 502, ``"error_before"`` 502 and nothing edited,
  ``"ratelimited"`` 429); the same text again is 400 "message is not modified"; someone else's message, or one
  older than ``edit_window_s``, "message can't be edited"; a missing one "message to edit not found". Each
  message keeps its edit history (``history``); ``text(reply_id)`` is its current text: an edit's ground truth.
- ``getUpdates`` as documented: an update is confirmed (dropped) once a higher ``offset`` is asked; a negative
  offset keeps the last ``-offset``; kept for 24 h (on ``now``) otherwise; ``timeout`` long-polls; a second
  poller ends the first with 409; 409 while a webhook is set.
- ``WebhookSender``: after ``setWebhook`` delivers every pending update in order, with the ``secret_token``
  header, one at a time, repeating a delivery that was not answered 2xx (``lose_acks``: this share of the
  2xx answers is treated as lost, so the delivery repeats, to any of ``urls``).
- ``restart()``: the Bot API server stops and starts on the same port (state kept: Telegram's is durable).
- What a gateway calls around its answers (openclaw's Telegram channel): ``setMyCommands`` (validated, kept for
  ``getMyCommands``), ``deleteMyCommands``, ``sendChatAction`` (a documented action), ``setMessageReaction`` (an
  existing message), ``getChat``; an unknown chat is 400 "chat not found". Any other method is 404.
"""

from __future__ import annotations

import asyncio
import copy
import email
import email.policy
import json
import re
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from replyd.sim.fakes import AppServer, DropResponse

FIXTURES = Path(__file__).parent / "fixtures" / "telegram"
BOT_ID, BOT_USERNAME = 7000000001, "replyd_test_bot"
TOKEN = "7000000001:AAFakeTokenForTestsOnly-0123456789ab"
KEEP_S = 86_400.0  # "they will not be kept longer than 24 hours"
MAX_TEXT = 4096  # "1-4096 characters after entities parsing", counted here in UTF-16 code units (SOURCES.md)


def utf16_len(text: str) -> int:
    """``text``'s length in UTF-16 code units (a code point outside the BMP counts 2)."""
    return len(text.encode("utf-16-le")) // 2


def fixture(name: str) -> Any:
    """One of the Bot-API-shaped JSON bodies in replyd/sim/fixtures/telegram."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _err(name: str, status: int | None = None) -> JSONResponse:
    body = fixture(name)
    return JSONResponse(body, status_code=status or body["error_code"])


@dataclass
class Chat:
    """One chat: its type and the messages in it."""

    id: int
    type: str = "supergroup"
    title: str = "replyd testers"
    username: str | None = None
    next_id: int = 1
    messages: dict[int, dict[str, Any]] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": self.type}
        if self.type == "private":
            out["first_name"] = self.title
        else:
            out["title"] = self.title
        if self.username:
            out["username"] = self.username
        return out


class TelegramWorld:
    """The Bot API's state in memory, and the platform-side counts."""

    def __init__(self, *, now: Callable[[], float] = time.time, seed: int = 1) -> None:
        self.now = now
        self.lock = threading.Lock()
        self.chats: dict[int, Chat] = {}
        self.commands: list[dict[str, str]] = []  # setMyCommands' list (getMyCommands)
        self.updates: list[tuple[int, float, dict[str, Any]]] = []  # (update_id, stored_at, update)
        self.next_update = 100_000_001
        self.send_faults: list[str] = []
        self.edit_faults: list[str] = []  # as send_faults, popped per editMessageText
        self.edit_requests = 0
        self.lost_edits = 0  # edits that acted but whose answer never reached the client
        self.edit_window_s: float | None = None  # past it, "message can't be edited" (None: no limit)
        self.edits: dict[tuple[int, int], list[str]] = {}  # (chat, message) -> every text an edit set
        self.lose_fraction = 0.0
        self.rng = random.Random(seed)
        self.send_requests = 0
        self.send_times: list[tuple[float, str]] = []  # (arrival, parent id) of every sendMessage
        self.unanswered: list[str] = []  # reply ids created whose answer never reached the client
        self.lost_parents: list[str] = []  # parents of those
        self.webhook: dict[str, Any] | None = None  # {"url", "secret_token"}
        self.webhook_changed = threading.Event()
        self.poll_generation = 0  # a new getUpdates ends the one before (409)
        self.conflicts = 0  # getUpdates answered 409 because another one came (two pollers of one bot)
        self.held = threading.Event()
        self.release_held = threading.Event()
        self.get_updates_offsets: list[int | None] = []
        self.held_tag = ""  # the api_url tag of the client whose send is held
        self.served: Counter[int] = Counter()  # update_id -> times getUpdates returned it
        self.batches = 0  # non-empty getUpdates answers
        self.batch_served = threading.Event()

    # --- the people's side -------------------------------------------------------------------

    def chat(self, chat_id: int, **kw: Any) -> Chat:
        """The chat ``chat_id`` (made on first use)."""
        with self.lock:
            if chat_id not in self.chats:
                self.chats[chat_id] = Chat(chat_id, **kw)
            return self.chats[chat_id]

    def post(self, chat_id: int, text: str, *, user_id: int = 5000000002, username: str | None = "grace",
             mention: bool = True, reply_to: int | None = None, thread_id: int | None = None,
             first_name: str | None = None) -> str:
        """A person posts in a chat; the update is queued; returns the parent id ``"<chat>:<message>"``.
        ``username=None``: an account without a username (Telegram then shows only its chosen first name)."""
        chat = self.chat(chat_id)
        with self.lock:
            mid = chat.next_id
            chat.next_id += 1
            sender: dict[str, Any] = {"id": user_id, "is_bot": False, "first_name": first_name or username or "someone"}
            if username is not None:
                sender["username"] = username
            msg: dict[str, Any] = {"message_id": mid, "from": sender,
                                   "chat": chat.json(), "date": int(self.now()), "text": text}
            if mention and chat.type != "private":
                msg["text"] = f"@{BOT_USERNAME} {text}"
                msg["entities"] = [{"offset": 0, "length": len(BOT_USERNAME) + 1, "type": "mention"}]
            if reply_to is not None and reply_to in chat.messages:
                msg["reply_to_message"] = copy.deepcopy({k: v for k, v in chat.messages[reply_to].items()
                                                         if k != "reply_to_message"})
            if thread_id is not None:
                msg["message_thread_id"], msg["is_topic_message"] = thread_id, True
            chat.messages[mid] = msg
            self._queue({"message": msg})
        return f"{chat_id}:{mid}"

    def _queue(self, body: dict[str, Any]) -> None:
        uid = self.next_update
        self.next_update += 1
        self.updates.append((uid, self.now(), {"update_id": uid, **copy.deepcopy(body)}))

    # --- counts -----------------------------------------------------------------------------

    def bot_replies(self, parent_id: str) -> int:
        """How many bot messages reply to ``parent_id``: the platform's count of answers."""
        chat_id, _, mid = parent_id.partition(":")
        chat = self.chats.get(int(chat_id))
        if chat is None:
            return 0
        with self.lock:
            return sum(1 for m in chat.messages.values() if m["from"]["id"] == BOT_ID
                       and (m.get("reply_to_message") or {}).get("message_id") == int(mid))

    def bot_messages(self, chat_id: int) -> int:
        """How many messages the bot sent in chat ``chat_id``, replies or not."""
        chat = self.chats.get(chat_id)
        with self.lock:
            return sum(1 for m in chat.messages.values() if m["from"]["id"] == BOT_ID) if chat else 0

    def reply_counts(self) -> Counter[str]:
        """Bot replies per parent id."""
        out: Counter[str] = Counter()
        with self.lock:
            for chat in self.chats.values():
                for m in chat.messages.values():
                    if m["from"]["id"] == BOT_ID and m.get("reply_to_message"):
                        out[f"{chat.id}:{m['reply_to_message']['message_id']}"] += 1
        return out

    def pending_updates(self) -> list[int]:
        """The update ids still stored (not confirmed, not expired)."""
        with self.lock:
            self._expire()
            return [u for u, _, _ in self.updates]

    def _expire(self) -> None:
        cut = self.now() - KEEP_S
        self.updates = [u for u in self.updates if u[1] >= cut]

    # --- the bot's side -----------------------------------------------------------------------

    def _target(self, fault: str | None, args: dict[str, Any]) -> Chat | JSONResponse:
        """The chat a sending or editing method acts in, or the refusal that comes first: a fault refusing it before
        it acts (429, 502, 403 blocked), a chat not found, a text that is empty or too long."""
        if fault == "ratelimited":
            return _err("error_429")
        if fault == "error_before":
            return JSONResponse({"ok": False, "error_code": 502, "description": "Bad Gateway"}, status_code=502)
        if fault == "blocked":
            return _err("error_403_blocked")
        chat = self.find_chat(args)
        return chat if isinstance(chat, JSONResponse) else _bad_text(args.get("text")) or chat

    def find_chat(self, args: dict[str, Any]) -> Chat | JSONResponse:
        """The chat ``args["chat_id"]`` names, or 400 "chat not found"."""
        chat_id = args.get("chat_id")
        if isinstance(chat_id, str) and chat_id.isascii() and chat_id.removeprefix("-").isdigit():
            chat_id = int(chat_id)  # "Integer or String": a JSON body may carry the id as a string
        chat = self.chats.get(chat_id) if isinstance(chat_id, int) else None
        if chat is None:
            return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: chat not found"},
                                status_code=400)
        return chat

    def send_message(self, args: dict[str, Any]) -> tuple[str, dict[str, Any] | JSONResponse]:
        """Create the bot's message (or refuse): (fault, message or error response)."""
        with self.lock:
            self.send_requests += 1
            fault = self.send_faults.pop(0) if self.send_faults else None
            if fault is None and self.lose_fraction and self.rng.random() < self.lose_fraction:
                fault = "lost"
        chat = self._target(fault, args)
        if not isinstance(chat, Chat):
            return fault or "", chat
        text = args.get("text")
        rp = args.get("reply_parameters") or {}
        target = rp.get("message_id") if isinstance(rp, dict) else None
        with self.lock:
            if target is not None and target not in chat.messages:
                return "", _err("error_400_reply_not_found")
            mid = chat.next_id
            chat.next_id += 1
            msg = {"message_id": mid, "from": {"id": BOT_ID, "is_bot": True, "first_name": "Replyd Test",
                                               "username": BOT_USERNAME},
                   "chat": chat.json(), "date": int(self.now()), "text": text}
            if target is not None:  # without reply_parameters: a plain message in the chat, as Telegram sends it
                msg["reply_to_message"] = copy.deepcopy({k: v for k, v in chat.messages[target].items()
                                                         if k != "reply_to_message"})
            if isinstance(args.get("message_thread_id"), int):
                msg["message_thread_id"] = args["message_thread_id"]
            chat.messages[mid] = msg
            parent = f"{chat.id}:{target}" if target is not None else str(chat.id)  # a plain message: its chat
            self.send_times.append((time.monotonic(), parent))
            if fault in ("lost", "error_after", "hold"):
                self.unanswered.append(f"{chat.id}:{mid}")
                self.lost_parents.append(parent)
        return fault or "", msg

    def edit_message(self, args: dict[str, Any]) -> tuple[str, dict[str, Any] | JSONResponse]:
        """Replace the text of one of the bot's messages (or refuse): (fault, message or error response)."""
        with self.lock:
            self.edit_requests += 1
            fault = self.edit_faults.pop(0) if self.edit_faults else None
        chat = self._target(fault, args)
        if not isinstance(chat, Chat):
            return fault or "", chat
        text = args.get("text")
        with self.lock:
            msg = chat.messages.get(args.get("message_id"))  # type: ignore[arg-type]
            if msg is None:
                return "", _err("error_400_edit_not_found")
            if msg["from"]["id"] != BOT_ID or (self.edit_window_s is not None
                                               and self.now() - msg["date"] > self.edit_window_s):
                return "", _err("error_400_cant_be_edited")
            if msg["text"] == text:
                return "", _err("error_400_not_modified")
            msg["text"], msg["edit_date"] = text, int(self.now())
            self.edits.setdefault((chat.id, msg["message_id"]), []).append(str(text))
            if fault in ("lost", "error_after"):
                self.lost_edits += 1
            return fault or "", copy.deepcopy(msg)

    def text(self, reply_id: str) -> str:
        """The current text of message ``"<chat>:<message>"`` on the platform (edits applied): ground truth."""
        chat_id, _, mid = reply_id.partition(":")
        with self.lock:
            return str(self.chats[int(chat_id)].messages[int(mid)]["text"])

    def history(self, reply_id: str) -> list[str]:
        """Every text edits set on message ``"<chat>:<message>"``, oldest first (not its first text)."""
        chat_id, _, mid = reply_id.partition(":")
        with self.lock:
            return list(self.edits.get((int(chat_id), int(mid)), []))


def _bad_text(text: Any) -> JSONResponse | None:
    """The Bot API's refusal of a message text (empty, or longer than 4,096 UTF-16 code units), else None."""
    if not isinstance(text, str) or not text.strip():
        return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: message text is empty"},
                            status_code=400)
    if utf16_len(text) > MAX_TEXT:
        return _err("error_400_too_long")
    return None


# Parameters whose form value is the string as sent (never decoded as JSON, "123" is a text).
_STRING_PARAMS = frozenset({"text", "caption", "secret_token", "url", "description"})


async def _arguments(request: Request) -> dict[str, Any]:
    """A method's parameters, passed as the Bot API takes them: a JSON body, or a query string, an urlencoded or
    multipart form whose values are strings, numbers or JSON-serialised objects (python-telegram-bot sends forms)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("application/x-www-form-urlencoded", "multipart/form-data") or (not kind and request.query_params):
        fields = dict(request.query_params) | (_form(request.headers["content-type"], await request.body()) if kind
                                                else {})
        out: dict[str, Any] = {}
        for name, value in fields.items():
            try:
                out[name] = value if name in _STRING_PARAMS else json.loads(value)
            except ValueError:
                out[name] = value
        return out
    raw = await request.body()
    return json.loads(raw) if raw else {}


def _form(content_type: str, raw: bytes) -> dict[str, str]:
    """An urlencoded or multipart form's fields, read without python-multipart (not a replyd dependency)."""
    if not content_type.lower().startswith("multipart/form-data"):
        return dict(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True))
    msg = email.message_from_bytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw,
                                   policy=email.policy.HTTP)
    out: dict[str, str] = {}
    for part in msg.iter_parts():  # type: ignore[attr-defined]
        if name := part.get_param("name", header="content-disposition"):
            out[name] = (part.get_payload(decode=True) or b"").decode("utf-8", "replace")
    return out


class TelegramApi:
    """The Bot API over HTTP: ``/bot<token>/<method>`` with JSON bodies."""

    def __init__(self, world: TelegramWorld, *, token: str = TOKEN) -> None:
        self.world, self.token = world, token
        # A path prefix before /bot<token> (``api_url = <fake>/<tag>``) names the client in a test (Telegram has
        # none): which replica held a send, for instance.
        self.app = Starlette(routes=[Route("/bot{token}/{method}", self._endpoint, methods=["GET", "POST"]),
                                     Route("/{tag}/bot{token}/{method}", self._endpoint, methods=["GET", "POST"])])
        self.server = AppServer(self.app, name="telegram-fake")

    @property
    def url(self) -> str:
        """The Bot API root (``api_url``)."""
        return self.server.url

    def start(self) -> TelegramApi:
        """Serve on an ephemeral port."""
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop()

    def restart(self) -> None:
        """Stop and serve again on the same port: every connection cut, the state kept."""
        self.server.stop()
        self.server.start()  # the port it had: AppServer keeps it

    async def _endpoint(self, request: Request) -> Response:
        if request.path_params["token"] != self.token:
            return _err("error_401")
        method = request.path_params["method"]
        try:
            args = await _arguments(request)
        except ValueError:
            return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: invalid JSON"}, 400)
        handler = getattr(self, f"_m_{method}", None)
        if handler is None:
            return JSONResponse({"ok": False, "error_code": 404, "description": "Not Found"}, status_code=404)
        if method == "sendMessage":
            args = {**args, "_tag": request.path_params.get("tag", "")}
        return await handler(args)

    async def _m_getMe(self, args: dict[str, Any]) -> Response:
        return JSONResponse(fixture("getMe"))

    async def _m_getUpdates(self, args: dict[str, Any]) -> Response:
        w = self.world
        if w.webhook is not None:
            return _err("error_409_webhook")
        offset = args.get("offset")
        limit = args.get("limit") if isinstance(args.get("limit"), int) else 100
        timeout = args.get("timeout") if isinstance(args.get("timeout"), int) else 0
        with w.lock:
            w.poll_generation += 1
            mine = w.poll_generation
            w.get_updates_offsets.append(offset if isinstance(offset, int) else None)
            w._expire()
            if isinstance(offset, int) and offset < 0:
                w.updates = w.updates[offset:]  # the last -offset kept, the others forgotten
            elif isinstance(offset, int):
                w.updates = [u for u in w.updates if u[0] >= offset]  # a higher offset confirms
        deadline = time.monotonic() + max(0, min(timeout, 50))
        while True:
            with w.lock:
                if w.poll_generation != mine:
                    w.conflicts += 1
                    return _err("error_409_other_poll")
                if w.webhook is not None:
                    return _err("error_409_webhook")
                batch = [copy.deepcopy(u) for _, _, u in w.updates[:max(1, min(limit, 100))]]
            if batch or time.monotonic() >= deadline:
                if batch:
                    with w.lock:
                        w.served.update(uid for uid, _, _ in w.updates[:len(batch)])  # a test's update may be no object
                        w.batches += 1
                    w.batch_served.set()
                # ASCII-escaped JSON (as json.dumps writes it): a test's lone surrogate reaches the client as "\ud800".
                return Response(json.dumps({"ok": True, "result": batch}), media_type="application/json")
            await asyncio.sleep(0.05)

    @staticmethod
    def _answer(fault: str, out: dict[str, Any] | Response) -> Response | None:
        """The answer of a refusal, or of a fault after the method acted (the connection dropped, a 502); None when
        the result is to be answered."""
        if isinstance(out, Response):
            return out
        if fault == "lost":
            return DropResponse(status_code=200)
        if fault == "error_after":
            return JSONResponse({"ok": False, "error_code": 502, "description": "Bad Gateway"}, status_code=502)
        return None

    async def _m_sendMessage(self, args: dict[str, Any]) -> Response:
        fault, out = self.world.send_message(args)
        if (answer := self._answer(fault, out)) is not None:
            return answer
        if fault == "hold":
            self.world.held_tag = args.get("_tag", "")
            self.world.held.set()
            while not self.world.release_held.is_set():
                await asyncio.sleep(0.05)
            return DropResponse(status_code=200)
        return JSONResponse({"ok": True, "result": out})

    async def _m_editMessageText(self, args: dict[str, Any]) -> Response:
        fault, out = self.world.edit_message(args)
        return self._answer(fault, out) or JSONResponse({"ok": True, "result": out})

    async def _m_deleteMessage(self, args: dict[str, Any]) -> Response:
        w = self.world
        chat = w.chats.get(args.get("chat_id"))  # type: ignore[arg-type]
        with w.lock:
            msg = chat.messages.get(args.get("message_id")) if chat else None  # type: ignore[arg-type]
            if msg is None or msg["from"]["id"] != BOT_ID:
                return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: message to delete "
                                     "not found"}, status_code=400)
            del chat.messages[msg["message_id"]]  # type: ignore[union-attr]
        return JSONResponse({"ok": True, "result": True})

    # -- what a gateway calls around its answers (openclaw's Telegram channel, grammY): documented, no state kept
    # beyond the command list. core.telegram.org/bots/api#setmycommands, #deletemycommands, #getmycommands,
    # #sendchataction, #setmessagereaction, #getchat.

    _ACTIONS = frozenset({"typing", "upload_photo", "record_video", "upload_video", "record_voice", "upload_voice",
                          "upload_document", "choose_sticker", "find_location", "record_video_note",
                          "upload_video_note"})

    async def _m_setMyCommands(self, args: dict[str, Any]) -> Response:
        commands = args.get("commands")
        if isinstance(commands, str):
            try:
                commands = json.loads(commands)
            except ValueError:
                commands = None
        ok = isinstance(commands, list) and len(commands) <= 100 and all(
            isinstance(c, dict) and isinstance(c.get("command"), str) and re.fullmatch(r"[a-z0-9_]{1,32}", c["command"])
            and isinstance(c.get("description"), str) and 1 <= len(c["description"]) <= 256 for c in commands)
        if not ok:
            return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: BOT_COMMANDS_INVALID"}, 400)
        with self.world.lock:
            self.world.commands = [{"command": c["command"], "description": c["description"]} for c in commands]
        return JSONResponse({"ok": True, "result": True})

    async def _m_deleteMyCommands(self, args: dict[str, Any]) -> Response:
        with self.world.lock:
            self.world.commands = []
        return JSONResponse({"ok": True, "result": True})

    async def _m_getMyCommands(self, args: dict[str, Any]) -> Response:
        with self.world.lock:
            return JSONResponse({"ok": True, "result": list(self.world.commands)})

    async def _m_sendChatAction(self, args: dict[str, Any]) -> Response:
        chat = self.world.find_chat(args)
        if isinstance(chat, JSONResponse):
            return chat
        if args.get("action") not in self._ACTIONS:
            return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: wrong parameter action "
                                 "in request"}, 400)
        return JSONResponse({"ok": True, "result": True})

    async def _m_setMessageReaction(self, args: dict[str, Any]) -> Response:
        chat = self.world.find_chat(args)
        if isinstance(chat, JSONResponse):
            return chat
        mid = args.get("message_id")
        mid = int(mid) if isinstance(mid, str) and mid.isdigit() else mid
        with self.world.lock:
            if mid not in chat.messages:
                return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request: message to react "
                                     "not found"}, 400)
        return JSONResponse({"ok": True, "result": True})

    async def _m_getChat(self, args: dict[str, Any]) -> Response:
        chat = self.world.find_chat(args)
        if isinstance(chat, JSONResponse):
            return chat
        return JSONResponse({"ok": True, "result": {**chat.json(), "accent_color_id": 0, "max_reaction_count": 11}})

    async def _m_setWebhook(self, args: dict[str, Any]) -> Response:
        w = self.world
        with w.lock:
            w.webhook = {"url": args.get("url"), "secret_token": args.get("secret_token")}
            if args.get("drop_pending_updates"):
                w.updates.clear()
            w.poll_generation += 1
        w.webhook_changed.set()
        return JSONResponse(fixture("setWebhook"))

    async def _m_deleteWebhook(self, args: dict[str, Any]) -> Response:
        w = self.world
        with w.lock:
            w.webhook = None
            if args.get("drop_pending_updates"):
                w.updates.clear()
        w.webhook_changed.set()
        return JSONResponse({"ok": True, "result": True, "description": "Webhook was deleted"})


class WebhookSender:
    """Telegram's webhook side: each pending update POSTed in order until some URL answers 2xx."""

    def __init__(self, world: TelegramWorld, urls: list[str] | None = None, *, timeout_s: float = 5.0,
                 retry_s: float = 0.2, lose_acks: float = 0.0, seed: int = 2) -> None:
        self.world, self.urls, self.timeout_s, self.retry_s = world, urls, timeout_s, retry_s
        self.lose_acks = lose_acks
        self.rng = random.Random(seed)
        self.deliveries: Counter[int] = Counter()  # update_id -> POSTs made
        self.statuses: Counter[int] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telegram-webhooks", daemon=True)

    def start(self) -> WebhookSender:
        """Deliver in the background."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop delivering."""
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        w = self.world
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                with w.lock:
                    hook = dict(w.webhook) if w.webhook else None
                    w._expire()
                    head = copy.deepcopy(w.updates[0]) if w.updates and hook else None
                if head is None:
                    self._stop.wait(0.05)
                    continue
                uid, _, update = head
                url = self.rng.choice(self.urls) if self.urls else str(hook["url"])  # type: ignore[index]
                headers = {"content-type": "application/json"}
                if hook.get("secret_token"):  # type: ignore[union-attr]
                    headers["X-Telegram-Bot-Api-Secret-Token"] = str(hook["secret_token"])  # type: ignore[index]
                self.deliveries[uid] += 1
                try:
                    status = client.post(url, content=json.dumps(update).encode(), headers=headers).status_code
                except httpx.HTTPError:
                    status = 0
                self.statuses[status] += 1
                ok = 200 <= status < 300 and not (self.lose_acks and self.rng.random() < self.lose_acks)
                if ok:
                    with w.lock:
                        w.updates = [u for u in w.updates if u[0] != uid]
                else:
                    self._stop.wait(self.retry_s)
