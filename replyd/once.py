"""``@once``: the guard around one send function, for the simplest bot (a decorator, sync or ``async def``).

::

    @once("sqlite:///replyd.sqlite3", instance="telegram:my_bot", sender="7000000001")
    def reply(parent_id: str, text: str, provider_key: str) -> str:
        return str(bot.send_message(chat, text, reply_to=parent_id).message_id)   # the reply's id

    reply("42:1001", "Thanks!")      # Outcome(posted); called again for "42:1001": already_answered

The decorated function is the send: it gets the parent id exactly as given, the text, and the provider key
(the same on every attempt; pass it on where the platform has an idempotency key) and returns the reply's
id. Calling the decorated function posts through the guard (``Guard.post`` of a bring-your-own platform,
``replyd.platforms.own``): at most once per (instance, sender, parent), the claim durable before the send.
``text`` may also be a responder (called once, inside the claim, only when the parent is not answered).

Without ``read_back`` the guarantee is the no-read-back class: a send whose outcome is unknown (a timeout
after the request left, a 5xx; httpx errors are mapped by the adapters' one table) is never retried on its
own and is reported (``uncertain``, then ``unconfirmed`` after ``sweep()``); with ``read_back(parent ids) ->
{parent id: [reply ids]}`` the sweep decides it, and a send proven not landed gets its one retry. An
``async def`` send makes an ``async def`` wrapper on the asyncio face (``replyd.aio``), opened on the first
call's loop. ``close()`` (``aclose()``) releases the store.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from replyd.core import Compose, Outcome
from replyd.platforms.base import Identity, Parent
from replyd.platforms.own import OwnPlatform
from replyd.sweep import SweepResult

__all__ = ["once"]


def once(store_url: str | None, *, instance: str, sender: str, read_back: Callable[[list[str]], Any] | None = None,
         listing_delay_s: float = 10.0, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Make ``send(parent_id, text, provider_key) -> reply id`` post each parent at most once (module docstring).

    ``instance`` names the platform instance and ``sender`` the bot's own id on it (with the parent id, the
    key); ``options`` are ``replyd.library.open_guard``'s (``max_attempts``, ``send_timeout_s``, ...).
    """

    def decorate(send: Callable[..., Any]) -> Any:
        def platform() -> OwnPlatform:
            return OwnPlatform(instance=instance, whoami=lambda: Identity(sender_id=sender),
                               send=lambda parent, text, key: send(parent.id, text, key), read_back=read_back,
                               listing_delay_s=listing_delay_s)

        if inspect.iscoroutinefunction(send):
            return functools.wraps(send)(_AsyncOnce(store_url, platform, options))
        return functools.wraps(send)(_Once(store_url, platform, options))

    return decorate


class _Once:
    """The sync wrapper: a guard session opened on the first call (thread-safe), reused after."""

    def __init__(self, store_url: str | None, platform: Callable[[], OwnPlatform], options: dict[str, Any]) -> None:
        self._url, self._platform, self._options = store_url, platform, options
        self._session: Any = None
        self._lock = threading.Lock()

    def _open(self) -> Any:
        with self._lock:
            if self._session is None:
                from replyd.library import open_guard

                self._session = open_guard(self._url, self._platform(), **self._options)
            return self._session

    def __call__(self, parent: str | Parent, text: str | Compose) -> Outcome:
        """Post ``text`` (or the responder's text) as the reply to ``parent``, at most once."""
        return self._open().post(parent, text)

    def sweep(self) -> SweepResult:
        """Judge the sends left open once their listing delay passed (``unconfirmed`` without read-back)."""
        return self._open().sweep()

    def close(self) -> None:
        """Release the store (the next call opens it again)."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()


class _AsyncOnce:
    """The ``async def`` wrapper: an asyncio-face session opened on the first call's loop, reused after."""

    def __init__(self, store_url: str | None, platform: Callable[[], OwnPlatform], options: dict[str, Any]) -> None:
        self._url, self._platform, self._options = store_url, platform, options
        self._cm: Any = None
        self._session: Any = None
        self._lock: Any = None

    async def _open(self) -> Any:
        import asyncio

        from replyd import aio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._session is None:
                self._cm = aio.open_guard(self._url, self._platform(), **self._options)
                self._session = await self._cm.__aenter__()
            return self._session

    async def __call__(self, parent: str | Parent, text: str | Compose) -> Outcome:
        """Post ``text`` (or the responder's text) as the reply to ``parent``, at most once."""
        return await (await self._open()).post(parent, text)

    async def sweep(self) -> SweepResult:
        """Judge the sends left open once their listing delay passed (``unconfirmed`` without read-back)."""
        return await (await self._open()).sweep()

    async def aclose(self) -> None:
        """Release the store (the next call opens it again)."""
        cm, self._cm, self._session = self._cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)
