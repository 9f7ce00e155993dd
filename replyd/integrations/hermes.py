"""hermes-agent's Telegram and Discord answers through replyd's asyncio guard (docs/INTEGRATIONS.md, "hermes-agent").

One line per adapter (or the hermes plugin entry ``register`` below)::

    from replyd.integrations.hermes import guard
    adapter = guard(adapter, "sqlite:////var/lib/hermes/replyd.sqlite3")

What is guarded: a turn's final answer (hermes marks it ``metadata["notify"]``) to the message it replies to
(``reply_to``). The parent is ``"<chat>:<message id>"`` as the platform served it; the bot is the account the
adapter logged in as. The answer's create call that carries the reply reference (Telegram's ``sendMessage`` with
``reply_to_message_id``, Discord's create message with ``message_reference``) goes through ``AsyncGuard.post``:
claimed durably before it leaves, sent at most once per parent, whatever runs the turn again (a redelivered
update, a reconnect's replay) and whatever hermes retries itself (a send whose answer was lost). Progress
bubbles, streamed previews and the later chunks of a long answer pass unguarded.

Telegram has no read-back: a send whose answer was lost stays open, the sweep marks it ``unconfirmed`` for an
operator (``replyd confirm`` / ``replyd rearm``), and nothing is sent again. Discord reads its channel back.

How it hooks in: hermes has no hook around a platform's send, so ``guard`` wraps two calls of the one adapter
instance it is given (no hermes file or class is changed): the adapter's ``send`` (it names the parent) and its
client's create call (``adapter._bot.send_message``; discord.py's ``send_message`` on the client's http and on its
connection state's, which ``channel.send`` uses: one request each).
The guard opens after the adapter's ``connect`` (the bot id is known then) and closes after ``disconnect``.

Nothing here imports hermes, python-telegram-bot or discord.py until an adapter is guarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

import httpx

from replyd.errors import DefinitelyNotSent, RateLimited
from replyd.outcome import Outcome, Status
from replyd.platforms.base import Parent

__all__ = ["Held", "guard", "register"]

# The parent a final answer replies to, set by the adapter's wrapped ``send`` for the create calls it makes.
_PARENT: ContextVar[str | None] = ContextVar("replyd_hermes_parent", default=None)
# The one create request of the post under way, for the guard's platform ``send``.
_CALL: ContextVar[Callable[[], Awaitable[str]] | None] = ContextVar("replyd_hermes_call", default=None)


class Held:
    """One hermes adapter's guard (``adapter._replyd``): opened after its connect, closed after its disconnect."""

    def __init__(self, adapter: Any, kind: str, store_url: str, *, sweep_every_s: float = 60.0,
                 options: Mapping[str, Any] | None = None) -> None:
        self.adapter, self.kind, self.store_url = adapter, kind, store_url
        self.sweep_every_s, self.options = sweep_every_s, dict(options or {})
        self.session: Any = None  # the replyd.aio.AsyncGuardSession, once connected
        self._stack: contextlib.AsyncExitStack | None = None
        self._sweeps: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Open the guard on the running loop, as the account the adapter is logged in as."""
        from replyd import aio
        from replyd.platforms.own import OwnPlatform

        me = await self._whoami()
        read_back = self._discord_read_back if self.kind == "discord" else None
        platform = OwnPlatform(instance=f"{self.kind}:hermes", whoami=lambda: me, send=self._send,
                               read_back=read_back, listing_delay_s=1.0)
        stack = contextlib.AsyncExitStack()
        self.session = await stack.enter_async_context(aio.open_guard(self.store_url, platform, **self.options))
        self._stack = stack
        if self.sweep_every_s > 0:
            self._sweeps = asyncio.create_task(self._sweep_forever())

    async def close(self) -> None:
        """Stop the sweeps and close the guard."""
        if self._sweeps is not None:
            self._sweeps.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeps
            self._sweeps = None
        if self._stack is not None:
            stack, self._stack, self.session = self._stack, None, None
            await stack.aclose()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_every_s)
            with contextlib.suppress(Exception):  # a failed sweep is logged by replyd; the next one tries again
                await self.session.sweep()

    async def _whoami(self) -> str:
        if self.kind == "telegram":
            bot = _unwrapped(self.adapter._bot)
            await bot.initialize()
            return str(bot.id)
        return str(self.adapter._client.user.id)

    async def post(self, parent_id: str, text: str, call: Callable[[], Awaitable[str]]) -> Outcome:
        """``call`` (the one create request) through the guard, for ``parent_id``."""
        token = _CALL.set(call)
        try:
            return await self.session.post(Parent(id=parent_id, author_id=""), text or "")
        finally:
            _CALL.reset(token)

    @staticmethod
    async def _send(parent: Parent, text: str, provider_key: str) -> str:
        call = _CALL.get()
        if call is None:  # only this module's posts reach here
            raise DefinitelyNotSent("replyd.integrations.hermes: no create request under way")
        return await call()

    async def _discord_read_back(self, parent_ids: list[str]) -> dict[str, list[str]]:
        """The bot's messages after each parent that reference it (one channel listing each)."""
        http, me, found = self.adapter._client.http, str(self.adapter._client.user.id), {}
        for p in parent_ids:
            channel, _, mid = p.partition(":")
            try:
                messages = await _unwrapped_http(http).logs_from(int(channel), 100, after=int(mid))
            except Exception:  # not conclusive: the row stays open
                continue
            found[p] = [f"{channel}:{m['id']}" for m in messages if str(m["author"]["id"]) == me
                        and str((m.get("message_reference") or {}).get("message_id")) == mid]
        return found


def guard(adapter: Any, store_url: str, *, sweep_every_s: float = 60.0, **options: Any) -> Any:
    """Route ``adapter``'s final answers (a hermes Telegram or Discord adapter) through replyd; returns it.

    ``store_url``: replyd's store (``sqlite:///...`` or ``postgresql+psycopg://...``); ``options`` go to
    ``replyd.aio.open_guard`` (``send_timeout_s``...). The sweep runs every ``sweep_every_s`` (0: never; call
    ``await adapter._replyd.session.sweep()`` yourself)."""
    if getattr(adapter, "_replyd", None) is not None:
        return adapter
    kind = str(getattr(getattr(adapter, "platform", None), "value", getattr(adapter, "platform", ""))).lower()
    if kind not in ("telegram", "discord"):
        raise ValueError(f"replyd.integrations.hermes guards Telegram and Discord adapters, not {kind!r}")
    held = Held(adapter, kind, store_url, sweep_every_s=sweep_every_s, options=options)
    adapter._replyd = held
    connect, disconnect, send = adapter.connect, adapter.disconnect, adapter.send

    async def guarded_connect(*args: Any, **kwargs: Any) -> Any:
        ok = await connect(*args, **kwargs)
        if ok and held.session is None:
            await held.open()
        return ok

    async def guarded_disconnect(*args: Any, **kwargs: Any) -> Any:
        try:
            return await disconnect(*args, **kwargs)
        finally:
            await held.close()

    async def guarded_send(chat_id: str, content: str, reply_to: str | None = None,
                           metadata: dict[str, Any] | None = None) -> Any:
        if reply_to is None or not (metadata or {}).get("notify") or held.session is None:
            return await send(chat_id, content, reply_to=reply_to, metadata=metadata)
        _wrap_client(held)  # a reconnect may have made a new client
        token = _PARENT.set(f"{chat_id}:{reply_to}")
        try:
            return await send(chat_id, content, reply_to=reply_to, metadata=metadata)
        finally:
            _PARENT.reset(token)

    adapter.connect, adapter.disconnect, adapter.send = guarded_connect, guarded_disconnect, guarded_send
    return adapter


def register(ctx: Any) -> None:
    """A hermes plugin's entry: Telegram and Discord registered again, their adapters guarded.

    hermes' platform registry lets a plugin replace a platform ("last writer wins"); this keeps every field of the
    bundled entry and wraps its factory. The store: ``REPLYD_HERMES_STORE`` (default ``sqlite:///replyd.sqlite3``)."""
    from gateway.platform_registry import platform_registry

    url = os.environ.get("REPLYD_HERMES_STORE", "sqlite:///replyd.sqlite3")
    for name in ("telegram", "discord"):
        entry = platform_registry.get(name)
        if entry is None or getattr(entry.adapter_factory, "replyd_guarded", False):
            continue
        fields = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
        make = fields.pop("adapter_factory")
        fields.pop("source", None)

        def factory(config: Any, make: Callable[[Any], Any] = make) -> Any:
            adapter = make(config)
            return adapter if adapter is None else guard(adapter, url)

        factory.replyd_guarded = True  # type: ignore[attr-defined]
        ctx.register_platform(adapter_factory=factory, **fields)


# -- the create calls -------------------------------------------------------------------------------------------


def _wrap_client(held: Held) -> None:
    a = held.adapter
    if held.kind == "telegram" and not isinstance(a._bot, _TelegramBot):
        a._bot = _TelegramBot(a._bot, held)
    elif held.kind == "discord":
        # discord.py's channel.send() calls the connection state's http, not the client's: wrap both.
        state = getattr(a._client, "_connection", None)
        http = getattr(state, "http", None) or a._client.http
        if not isinstance(http, _DiscordHttp):
            http = _DiscordHttp(_unwrapped_http(http), held)
        a._client.http = http
        if state is not None:
            state.http = http


def _unwrapped(bot: Any) -> Any:
    return bot._real if isinstance(bot, _TelegramBot) else bot


def _unwrapped_http(http: Any) -> Any:
    return http._real if isinstance(http, _DiscordHttp) else http


def _mapped_httpx(exc: BaseException, what: str) -> BaseException | None:
    """replyd's reading of the httpx error under an SDK's error (None: there is none)."""
    from replyd.platforms.own import from_httpx

    cause = exc.__cause__
    if isinstance(cause, (httpx.HTTPError, httpx.InvalidURL)):
        return from_httpx(cause, what=what, acting=True)
    return None


def _telegram_error(exc: Exception) -> BaseException:
    """The replyd error for a python-telegram-bot error of ``sendMessage`` (anything unmapped is ambiguous)."""
    from telegram import error as tg

    if isinstance(exc, tg.RetryAfter):
        wait = exc.retry_after
        return RateLimited(str(exc), retry_after_s=float(getattr(wait, "total_seconds", lambda: wait)()))
    if isinstance(exc, (tg.BadRequest, tg.Forbidden, tg.InvalidToken, tg.ChatMigrated)):
        return DefinitelyNotSent(str(exc), status=400)  # the Bot API answered an error: no message was created
    return _mapped_httpx(exc, "sendMessage") or exc


class _TelegramBot:
    """``adapter._bot`` with ``send_message`` of a final answer through the guard; the rest as the bot's."""

    def __init__(self, bot: Any, held: Held) -> None:
        self._real, self._held = bot, held

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def send_message(self, *args: Any, **kwargs: Any) -> Any:
        parent = _PARENT.get()
        if parent is None or kwargs.get("reply_to_message_id") is None or self._held.session is None:
            return await self._real.send_message(*args, **kwargs)
        box: dict[str, Any] = {}

        async def call() -> str:
            try:
                msg = await self._real.send_message(*args, **kwargs)
            except Exception as exc:
                box["exc"] = exc
                raise _telegram_error(exc) from exc
            box["msg"] = msg
            return f"{msg.chat_id}:{msg.message_id}"

        out = await self._held.post(parent, str(kwargs.get("text", "")), call)
        if out.status is Status.POSTED:
            return box["msg"]
        if out.status is Status.ALREADY_ANSWERED:  # the answer is there: hermes reads only its id
            return SimpleNamespace(message_id=int(str(out.reply_id).rpartition(":")[2]), chat_id=parent.split(":")[0])
        if "exc" in box and out.status in (Status.NOT_SENT, Status.REJECTED):
            raise box["exc"]  # provably not sent: hermes' own handling (plain-text fallback, flood wait) goes on
        from telegram.error import TimedOut

        # A timeout is what hermes does not send again: it may have landed. Here replyd knows it may have.
        raise TimedOut(f"replyd: {out.status.value} for {parent}: the answer may be there; not sent again")


def _discord_error(exc: Exception) -> BaseException:
    """The replyd error for a discord.py error of a create call (anything unmapped is ambiguous)."""
    import discord

    if isinstance(exc, discord.RateLimited):
        return RateLimited(str(exc), retry_after_s=float(exc.retry_after))
    if isinstance(exc, discord.HTTPException) and 400 <= exc.status < 500:
        if exc.status == 429:
            return RateLimited(str(exc))
        return DefinitelyNotSent(str(exc), status=exc.status)
    if exc.__class__.__name__ == "ClientConnectorError":  # aiohttp: the connection was never made
        return DefinitelyNotSent(str(exc))
    return exc


class _DiscordHttp:
    """``adapter._client.http`` with ``send_message`` of a final answer through the guard; the rest as its own."""

    def __init__(self, http: Any, held: Held) -> None:
        self._real, self._held = http, held

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def send_message(self, channel_id: Any, *, params: Any) -> Any:
        parent = _PARENT.get()
        payload = getattr(params, "payload", None) or {}
        if parent is None or not payload.get("message_reference") or self._held.session is None:
            return await self._real.send_message(channel_id, params=params)
        box: dict[str, Any] = {}

        async def call() -> str:
            try:
                data = await self._real.send_message(channel_id, params=params)
            except Exception as exc:
                box["exc"] = exc
                raise _discord_error(exc) from exc
            box["data"] = data
            return f"{channel_id}:{data['id']}"

        out = await self._held.post(parent, str(payload.get("content") or ""), call)
        if out.status is Status.POSTED:
            return box["data"]
        if out.status is Status.ALREADY_ANSWERED:  # the answer is there: hermes gets it as discord.py reads it
            channel, _, mid = str(out.reply_id).partition(":")
            return await self._real.get_message(int(channel), int(mid))
        if "exc" in box and out.status in (Status.NOT_SENT, Status.REJECTED):
            raise box["exc"]
        raise TimeoutError(f"replyd: {out.status.value} for {parent}: timed out, the answer may be there; "
                           "not sent again")
