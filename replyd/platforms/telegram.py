"""The Telegram adapter: a Bot API bot answering mentions, replies to it, commands and private messages.

Settings (``[bots.settings]`` with ``platform = "telegram"``):

=======================  ====================================================================
``token``                required; the bot token from @BotFather (``token_env = "TELEGRAM_BOT_TOKEN"``)
``api_url``              the Bot API root (default ``https://api.telegram.org``; a local Bot API server)
``mode``                 ``"polling"`` (``getUpdates`` by the inbox poll, default) or ``"webhook"``
                         (deliveries through ``[bots.push] kind = "telegram"``; the inbox poll then
                         asks nothing: the Bot API refuses ``getUpdates`` while a webhook is set)
``long_poll_s``          ``getUpdates`` ``timeout`` (0-50 s, default 25): the request waits that long
``updates_limit``        ``getUpdates`` ``limit`` (1-100, default 100)
``timeout_s``            per request (a poll's timeout is ``timeout_s + long_poll_s``)
``part_marker``          end each part of an answer longer than one message with " (k/n)" (default false)
``chats``                chat ids the bot answers in (default: every chat; a private chat's id is the user's)
``instance``             the answered-log instance (default ``telegram``)
=======================  ====================================================================

Ids: the sender id is the bot's user id from ``getMe``; a parent id is ``"<chat id>:<message id>"`` as
the Bot API serves both numbers (decimal, a negative chat id for groups): one opaque id. A reply is a
``sendMessage`` with ``reply_parameters = {message_id}`` (and ``message_thread_id`` when the parent is
in a forum topic); its reply id is ``"<chat id>:<message id>"`` of the message the call returns.

Long answers (``PostLimit``): a text is "1-4096 characters after entities parsing"; the Bot API counts lengths
in UTF-16 code units (entities: #messageentity, core.telegram.org/api/entities), and so does ``replyd.parts``
with the unit ``utf16``: a part is at most 4,096 units whatever its script or emoji (an emoji beyond the Basic
Multilingual Plane counts two, and is never cut in half). Part k+1 replies (``reply_parameters``) to part k's message, in the
parent's forum topic. Streamed answers (``EditReply``): ``editMessageText`` of the bot's own message with the
whole text; "message is not modified" (the text is already that: a repeated edit, or one whose answer was
lost) is success, the one ``description`` the adapter reads, as the Bot API gives that case no code of its own.

The guarantee class: **no read-back** (``NoReadBack``). The Bot API has no idempotency key for
``sendMessage`` and a bot cannot read a chat's history, so a send whose answer was lost can never be
looked up: it ends ``unconfirmed`` for an operator, never retried on its own (``docs/PLATFORMS.md``).

Discovery: ``getUpdates`` long polling (``inbox``): the page's cursor is the highest ``update_id`` + 1,
saved by the poller only after every parent of the batch was offered; the next ``getUpdates`` sends it
as ``offset``, which is what confirms (drops) the batch on Telegram's side, so a crash before the offer
re-reads the batch. Webhooks (``parse_webhook`` through ``replyd.hooks``): ``setWebhook`` with a
``secret_token``; every delivery's ``X-Telegram-Bot-Api-Secret-Token`` is compared in constant time
and the delivery acked at once. Inbox: every message of a private chat; in groups, a message that
mentions the bot (``mention`` entity of its username, or ``text_mention`` of its id), replies to one of
its messages, or is a command (``/cmd`` or ``/cmd@thisbot``). In groups the bot sees only these unless
its privacy mode is off (@BotFather ``/setprivacy``): with it off it sees every message, and this
filter still offers only the addressed ones. Messages by bots (the bot itself included) are skipped.

Error mapping (the Bot API answers ``{"ok": false, "error_code", "description", "parameters"}`` with
the HTTP status equal to ``error_code``)::

    what happened                                          sendMessage        editMessageText    reads
    -----------------------------------------------------  -----------------  -----------------  -----------------
    connect refused, DNS, connect timeout                  DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    read timeout, reset, lost response                     MaybeSent          MaybeSent          DefinitelyNotSent
    429 ``Too Many Requests: retry after N``               RateLimited (``parameters.retry_after``), every column
    401 ``Unauthorized`` (a bad or revoked token)          DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    400 ``Bad Request: message is not modified``           Rejected           done (no error)    Rejected
    400 ``Bad Request: …`` (message to reply not found,    Rejected           Rejected           Rejected
    chat not found, text is empty, message is too long,
    message to edit not found, message can't be edited;
    a group migrated to a supergroup:
    ``parameters.migrate_to_chat_id``)
    403 ``Forbidden: bot was blocked by the user`` /       Rejected           Rejected           DefinitelyNotSent
    ``bot was kicked`` / ``bot is not a member``
    409 ``Conflict: …`` (a webhook is set, or another      Rejected           Rejected           DefinitelyNotSent
    ``getUpdates`` runs)
    5xx, a 2xx body without ``result``                     MaybeSent          MaybeSent          DefinitelyNotSent / BadResponse
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import httpx
from pydantic import Field, SecretStr

from replyd.errors import BadResponse, DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.parts import Limit
from replyd.platforms import _http, unreadable
from replyd.platforms.base import Identity, Page, Parent, Pending, ReadBack, Sent, Token, register_platform

NO_READ_BACK = ("the Bot API lets a bot send but not read a chat's history or list its own messages, and "
                "sendMessage takes no idempotency key: a send whose answer was lost cannot be looked up")
_PARENT = re.compile(r"^(-?[0-9]{1,20}):([0-9]{1,12})$")
_LINK = re.compile(r"^https://t\.me/(?:c/([0-9]{1,20})|([A-Za-z0-9_]{4,64}))/(?:[0-9]{1,12}/)?([0-9]{1,12})$")
_DESCRIPTION = re.compile(r"[^\x20-\x7e]")
MAX_TEXT_UTF16 = 4096  # a message's text, in UTF-16 code units (module docstring)
PART_UNITS = MAX_TEXT_UTF16  # a part of a long answer: counted in UTF-16 code units (replyd.parts' "utf16")
NOT_MODIFIED = "message is not modified"  # the one 400 an edit takes as done (module docstring)


def split_id(parent_id: str) -> tuple[int, int]:
    """``"<chat id>:<message id>"`` → (chat id, message id); ``Rejected`` when it is not that form."""
    m = _PARENT.match(parent_id)
    if m is None:
        raise Rejected(f"telegram id {parent_id[:80]!r}: expected '<chat id>:<message id>'")
    return int(m.group(1)), int(m.group(2))


def _message_id(msg: dict[str, Any]) -> str | None:
    """The served id (``<chat id>:<message id>``) of a message, for the report of one that cannot be read."""
    chat = msg.get("chat")
    cid, mid = chat.get("id") if isinstance(chat, dict) else None, msg.get("message_id")
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (cid, mid))
    return f"{cid}:{mid}" if ints else None


def utf16_slice(text: str, offset: int, length: int) -> str:
    """The part of ``text`` an entity names: Telegram counts offsets and lengths in UTF-16 code units."""
    raw = text.encode("utf-16-le")
    return raw[2 * offset:2 * (offset + length)].decode("utf-16-le", errors="replace")


@register_platform("telegram")
class TelegramPlatform(_http.HttpPlatform):
    """A Telegram bot as a replyd platform: private messages, mentions, replies and commands in, replies out."""

    kind: ClassVar[str] = "telegram"
    ITEM_ID: ClassVar[str] = "update_id"

    class Settings(_http.HttpSettings):
        """``[bots.settings]`` with ``platform = "telegram"`` (the table in the module docstring)."""

        URLS: ClassVar[tuple[str, ...]] = ("api_url",)
        token: Token
        api_url: _http.Url = "https://api.telegram.org"
        mode: Literal["polling", "webhook"] = "polling"
        long_poll_s: int = Field(25, ge=0, le=50)
        updates_limit: int = Field(100, ge=1, le=100)
        allowed_updates: list[str] = ["message"]
        part_marker: bool = False  # end each part of a long answer with " (k/n)"
        chats: list[int] = []  # the chats answered in; empty: every chat the bot is in

    s: Settings

    def __init__(self, settings: Settings | None = None, /, *, http: httpx.Client, clock: Any, **kw: Any) -> None:
        super().__init__(settings, http=http, clock=clock, **kw)
        self.instance = self.s.instance or "telegram"

    @property
    def root(self) -> str:
        """The Bot API root; each method is ``/bot<token>/<method>`` under it (the token never leaves a detail)."""
        return self.s.api_url

    def _auth_headers(self) -> Mapping[str, SecretStr]:
        return {}  # the token is in the path, masked in every detail by ``_secrets``

    # --- capability: the no-read-back class -------------------------------------------------

    def no_read_back(self) -> str:
        """Why nothing the bot sent can be listed here (``NoReadBack``)."""
        return NO_READ_BACK

    # --- transport ---------------------------------------------------------------------------

    def _api(self, method: str, body: Mapping[str, Any], *, acts: bool, extra_timeout_s: float = 0.0) -> Any:
        """One Bot API call; its ``result``, or the mapped error (see the module's table)."""
        self.limits.check(self._buckets(method), what=method)
        # A long poll waits up to ``long_poll_s`` by design: its request timeout is that much longer.
        timeout = httpx.Timeout(self.s.timeout_s + extra_timeout_s) if extra_timeout_s else self._timeout
        url = f"{self.root}/bot{self.s.token.get_secret_value()}/{method}"
        t0 = self._clock.now()
        resp = _http.request(self._http, "POST", url, what=method, acts=acts, secrets=self._secrets(),
                             timeout=timeout, json=dict(body))
        self.platform_clock.note_date(resp, t0, self._clock.now())
        data = _http.error_json(resp)
        if not 200 <= resp.status_code < 300:
            self._refuse(method, resp, data, acts=acts)
        if not isinstance(data, dict) or data.get("ok") is not True or "result" not in data:
            if acts:
                raise MaybeSent(f"{method}: HTTP {resp.status_code} without ok/result (after a 2xx)",
                                status=resp.status_code)
            raise BadResponse(f"{method}: body without ok/result", status=resp.status_code)
        return data["result"]

    def _refuse(self, method: str, resp: httpx.Response, data: Any, *, acts: bool) -> None:
        """Raise the error a non-2xx Bot API answer means (the module's table)."""
        status = resp.status_code
        desc = data.get("description") if isinstance(data, dict) else None
        text = _DESCRIPTION.sub("?", desc[:200]) if isinstance(desc, str) else ""
        params = data.get("parameters") if isinstance(data, dict) and isinstance(data.get("parameters"), dict) else {}
        detail = _http.redact(f"{method}: HTTP {status}" + (f" ({text})" if text else ""), self._secrets())
        if status == 429:
            wait = params.get("retry_after")
            wait_s = float(wait) if isinstance(wait, int | float) and not isinstance(wait, bool) and wait >= 0 else None
            if wait_s is None:
                wait_s = _http.retry_after_s(resp, self._clock.now())
            self.limits.block(method, wait_s if wait_s is not None else 1.0)  # no request of it until then
            self.log.warning("replyd.telegram.rate_limited", what=method, wait_s=wait_s)
            raise RateLimited(detail, status=status, retry_after_s=wait_s)
        if status == 401:
            raise DefinitelyNotSent(detail, status=status)
        if status == 409:
            self.log.warning("replyd.telegram.conflict", what=method, detail=text)
            raise (Rejected if acts else DefinitelyNotSent)(detail, status=status)
        if status == 403:
            raise (Rejected if acts else DefinitelyNotSent)(detail, status=status)
        if 400 <= status < 500:
            migrated = params.get("migrate_to_chat_id")
            if isinstance(migrated, int) and not isinstance(migrated, bool):
                detail += f" (the group is now supergroup {migrated})"
            raise Rejected(detail, status=status)
        raise (MaybeSent if acts else DefinitelyNotSent)(detail, status=status)

    # --- identity and parsing ------------------------------------------------------------------

    def whoami(self) -> Identity:
        """``getMe``: the bot's user id (the sender half of the key) and username."""
        me = self._api("getMe", {}, acts=False)
        uid = _http.field(me, "id", "getMe", int)
        username = me.get("username") if isinstance(me.get("username"), str) else ""
        self._me = Identity(sender_id=str(uid), handle=username or str(uid))
        self.log.info("replyd.telegram.identified", platform=self.instance, user_id=str(uid), username=username)
        return self._me

    def _addressed(self, msg: dict[str, Any], me: Identity) -> str | None:
        """None when ``msg`` addresses the bot (a private message, a mention, a reply to it, a command); else why not."""
        chat = msg.get("chat") or {}
        sender = msg.get("from") or {}
        if not isinstance(chat, dict) or not isinstance(sender, dict):
            return "unreadable"
        if str(sender.get("id")) == me.sender_id or sender.get("is_bot") is True:
            return "from_a_bot"
        if chat.get("type") == "private":
            return None
        replied = msg.get("reply_to_message")
        if isinstance(replied, dict) and isinstance(replied.get("from"), dict) \
                and str(replied["from"].get("id")) == me.sender_id:
            return None
        text = msg.get("text") if isinstance(msg.get("text"), str) else msg.get("caption")
        entities = msg.get("entities") if "text" in msg else msg.get("caption_entities")
        if not isinstance(text, str) or not isinstance(entities, list):
            return "not_addressed"
        handle = "@" + me.handle.lower()
        for e in entities:
            if not isinstance(e, dict):
                continue
            kind, off, length = e.get("type"), e.get("offset"), e.get("length")
            if not isinstance(off, int) or not isinstance(length, int):
                continue
            if kind == "text_mention" and isinstance(e.get("user"), dict) and str(e["user"].get("id")) == me.sender_id:
                return None
            piece = utf16_slice(text, off, length).lower()
            if kind == "mention" and piece == handle:
                return None
            if kind == "bot_command" and off == 0:
                _, at, target = piece.partition("@")
                if not at or "@" + target == handle:
                    return None
        return "not_addressed"

    def _parent(self, msg: Any) -> Parent:
        """A Bot API ``Message`` as a parent (``BadResponse`` when its ids are unreadable)."""
        if not isinstance(msg, dict):
            raise BadResponse("message: not an object")
        chat_id = _http.field(msg, "chat.id", "message", int)
        message_id = _http.field(msg, "message_id", "message", int)
        sender = msg.get("from") if isinstance(msg.get("from"), dict) else {}
        chat = msg["chat"]
        extra: dict[str, Any] = {"chat_id": chat_id, "message_id": message_id, "chat_type": chat.get("type"),
                                 "addressed": True}
        if isinstance(sender.get("first_name"), str):
            extra["author_name"] = sender["first_name"]
        replied = msg.get("reply_to_message")
        if isinstance(replied, dict) and isinstance(replied.get("message_id"), int):
            extra["reply_to"] = replied["message_id"]
        if msg.get("is_topic_message") is True and isinstance(msg.get("message_thread_id"), int):
            extra["message_thread_id"] = msg["message_thread_id"]
        url = ""
        if isinstance(chat.get("username"), str) and chat.get("type") in ("supergroup", "channel"):
            url = f"https://t.me/{chat['username']}/{message_id}"
        date = msg.get("date")
        return Parent(
            id=f"{chat_id}:{message_id}",
            author_id=str(sender.get("id", "")),
            author_handle=str(sender.get("username") or ""),  # a first name is the sender's pick, never a handle
            author_is_bot=sender.get("is_bot") is True,
            text=msg.get("text") if isinstance(msg.get("text"), str) else str(msg.get("caption") or ""),
            url=url,
            created_at=float(date) if isinstance(date, int) and not isinstance(date, bool) else None,
            extra=extra,
        )

    def _from_update(self, update: Any) -> Parent | str:
        """The parent an ``Update`` names, or why it names none to answer."""
        if not isinstance(update, dict):
            self._skipped("update", "an update is not an object", update)
            return "unreadable"
        msg = update.get("message")
        if not isinstance(msg, dict):
            return "not_a_message"  # edits, channel posts, callbacks, member changes: nothing to answer
        identity = self._identity()  # a request of its own: its failure fails the page, not this update
        try:
            why = self._addressed(msg, identity)
            if why is not None:
                return why
            chat = msg.get("chat") or {}
            if self.s.chats and chat.get("id") not in self.s.chats:
                return "chat_not_listed"  # a signed update from a group the operator did not list
            return self._parent(msg)
        except unreadable.ERRORS as exc:
            self._skipped("update", exc, update, _message_id(msg))
            return "unreadable"

    # --- discovery --------------------------------------------------------------------------

    def inbox(self, cursor: str | None) -> Page:
        """``getUpdates`` from ``cursor`` (the offset); the page's cursor is the highest ``update_id`` + 1.

        Nothing here confirms the batch: the poller saves the cursor after every parent was offered, and the
        next poll's ``offset`` confirms it on Telegram's side. In webhook mode nothing is asked.
        """
        if self.s.mode == "webhook":
            return Page(parents=[], cursor=cursor)
        body: dict[str, Any] = {"timeout": self.s.long_poll_s, "limit": self.s.updates_limit,
                                "allowed_updates": self.s.allowed_updates}
        if cursor is not None and cursor.lstrip("-").isdigit() and cursor.isascii():
            body["offset"] = int(cursor)
        updates = self._api("getUpdates", body, acts=False, extra_timeout_s=float(self.s.long_poll_s))
        if not isinstance(updates, list):
            raise BadResponse("getUpdates: result is not an array")
        parents: list[Parent] = []
        top = int(body["offset"]) - 1 if "offset" in body else None  # the highest update_id passed
        unnamed = 0  # updates after ``top`` whose id cannot be read: ids increase, each is at least one more
        for u in updates:
            uid = u.get("update_id") if isinstance(u, dict) else None
            if isinstance(uid, int) and not isinstance(uid, bool):
                if top is None or uid > top:
                    top, unnamed = uid, 0
            else:
                unnamed += 1
            found = self._from_update(u)
            if isinstance(found, Parent):
                parents.append(found)
        # Past the unnamed ones too: an offset at most one past the last update served skips nothing unserved.
        return Page(parents=parents, cursor=str(top + 1 + unnamed) if top is not None else cursor)

    def search(self, query: str, cursor: str | None) -> Page:
        """Bots cannot search Telegram: an empty page."""
        return Page(parents=[], cursor=cursor)

    def refind(self, since: float) -> list[Parent]:
        """Nothing to re-read: a bot cannot list a chat's history (updates are the only way in)."""
        return []

    def resolve(self, ref: str) -> Parent:
        """``"<chat id>:<message id>"`` (or a ``https://t.me/c/<id>/<msg>`` link of a private supergroup) as a parent."""
        ref = ref.strip()
        m = _LINK.match(ref)
        if m is not None and m.group(1):
            ref = f"-100{m.group(1)}:{m.group(3)}"
        elif m is not None:
            raise Rejected(f"telegram link {ref[:80]!r}: a public link names the chat by username; pass "
                           "'<chat id>:<message id>'")
        chat_id, message_id = split_id(ref)
        return Parent(id=ref, author_id="", extra={"chat_id": chat_id, "message_id": message_id})

    # --- WebhookSource ----------------------------------------------------------------------------

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """A webhook delivery is one ``Update``: its parent, or why it names none."""
        found = self._from_update(payload)
        return [found] if isinstance(found, Parent) else found

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """Every parent ``parse_webhook`` returns addresses the bot (a webhook serves only this bot's updates)."""
        return None

    def set_webhook(self, url: str, secret_token: str, *, drop_pending_updates: bool = False) -> None:
        """``setWebhook`` with ``secret_token``: Telegram sends it in ``X-Telegram-Bot-Api-Secret-Token``."""
        self._api("setWebhook", {"url": url, "secret_token": secret_token, "allowed_updates": self.s.allowed_updates,
                                 "drop_pending_updates": drop_pending_updates}, acts=True)

    def delete_webhook(self, *, drop_pending_updates: bool = False) -> None:
        """``deleteWebhook``: back to ``getUpdates`` (pending updates kept unless dropped)."""
        self._api("deleteWebhook", {"drop_pending_updates": drop_pending_updates}, acts=True)

    # --- send, read-back, delete --------------------------------------------------------------------

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """``sendMessage`` replying to the parent (in its forum topic); ``provider_key`` has no use here."""
        chat_id, message_id = split_id(parent.id)
        body: dict[str, Any] = {"chat_id": chat_id, "text": self._at_names(parent, text),
                                "reply_parameters": {"message_id": message_id, "allow_sending_without_reply": False}}
        thread = parent.extra.get("message_thread_id") if isinstance(parent.extra, dict) else None
        if isinstance(thread, int) and not isinstance(thread, bool):
            body["message_thread_id"] = thread
        try:
            result = self._api("sendMessage", body, acts=True)
        except (DefinitelyNotSent, MaybeSent, Rejected) as exc:
            raise self._send_failed(parent, exc) from None
        try:
            rid = f"{_http.field(result, 'chat.id', 'sendMessage', int)}:{_http.field(result, 'message_id', 'sendMessage', int)}"
        except BadResponse as exc:
            raise MaybeSent(f"{exc.detail} (after a 2xx)") from None
        return Sent(reply_id=rid)

    # --- answers in parts and streamed answers (PostLimit, EditReply) ------------------------------

    def post_limit(self, parent: Parent) -> Limit:
        """``PostLimit``: the 4,096 UTF-16 code units Telegram allows, counted as Telegram counts them."""
        return Limit(PART_UNITS, "utf16", self.s.part_marker)

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """``PostLimit``: the next part replies to the previous part's message, in the parent's chat and topic."""
        chat_id, message_id = split_id(previous_reply_id)
        me = self._identity()
        extra: dict[str, Any] = {"chat_id": chat_id, "message_id": message_id,
                                 "chat_type": parent.extra.get("chat_type"), "part_of": parent.id}
        if isinstance(parent.extra.get("message_thread_id"), int):
            extra["message_thread_id"] = parent.extra["message_thread_id"]
        return Parent(id=previous_reply_id, author_id=me.sender_id, author_handle=me.handle, author_is_bot=True,
                      extra=extra)

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """``EditReply``: ``editMessageText`` of the bot's message ``reply_id``; "message is not modified" is done."""
        chat_id, message_id = split_id(reply_id)

        def edit_text() -> None:
            try:
                self._api("editMessageText", {"chat_id": chat_id, "message_id": message_id,
                                              "text": self._at_names(parent, text)}, acts=True)
            except Rejected as exc:
                # The text already is ``text``: an edit repeated after its answer was lost, or set twice.
                if exc.status != 400 or NOT_MODIFIED not in exc.detail.lower():
                    raise

        self._edited(parent, reply_id, text, edit_text)

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Nothing can be read back on Telegram: nothing checked, so nothing is ever judged "not found"."""
        return ReadBack()

    def delete(self, reply_id: str) -> None:
        """``deleteMessage`` of one of the bot's own messages."""
        chat_id, message_id = split_id(reply_id)
        try:
            self._api("deleteMessage", {"chat_id": chat_id, "message_id": message_id}, acts=True)
        except Rejected as exc:
            if exc.status != 400:
                raise
            # The Bot API answers every "cannot" with 400 (already deleted, or too old to delete): logged, done.
            self.log.info("replyd.telegram.deleted", reply_id=reply_id, already_gone=True, detail=exc.detail)
            return
        self.log.info("replyd.telegram.deleted", reply_id=reply_id, already_gone=False)

    # --- ThreadDepth -------------------------------------------------------------------------------

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """1 when the parent replies to a message, else 0: the Bot API shows one level (``reply_to_message``) and
        a bot cannot read further up, so this is a lower bound (``max_depth`` stops a loop one level late)."""
        return min(1, limit + 1) if parent.extra.get("reply_to") is not None else 0

    # --- Addressing -------------------------------------------------------------------------------

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """A parent this adapter found addresses the bot (the inbox and webhooks offer nothing else)."""
        return parent.extra.get("addressed") is True
