"""Bring your own send: a platform made of the calls a bot already has (its SDK's client), sync or async.

::

    platform = OwnPlatform(
        instance="mastodon:https://social.example",
        whoami=lambda: client.me()["id"],                        # the account's stable id
        send=lambda parent, text, key: client.status_post(text, in_reply_to_id=parent.id,
                                                          idempotency_key=key)["id"],
        read_back=lambda parent_ids: {...},                      # parent id -> own reply ids found
        listing_delay_s=10.0,
    )

``send(parent, text, provider_key)`` returns the reply id (or a ``Sent``); ``whoami()`` the sender id (or an
``Identity``); ``read_back(parent_ids)`` a mapping from each parent it looked at conclusively to the own reply
ids it found there (an empty list: looked, none; a parent left out: not looked, its row stays open). Each may
be an ``async def``: the async face (``replyd.aio``) awaits it on its loop, the sync face on the shared
responder loop.

Errors: a ``replyd.errors.PlatformError`` raised by a call passes as is; an httpx error (``httpx.HTTPError``,
or ``HTTPStatusError`` from ``raise_for_status()``) is mapped by the shared table of ``replyd.platforms._http``
(:func:`from_httpx`), so "could the request have acted" is answered once for adapters and your calls alike;
anything else raised by ``send`` is ambiguous (the row stays open for the sweep, never retried blind).

Without ``read_back`` (``read_back=None``, or left out) the platform is of the no-read-back class
(``platforms.base.NoReadBack``, as Telegram's adapter): the promise is *at most once, every doubt reported*.
An ambiguous send (a lost answer, a 5xx, a timeout after the request left, anything unmapped) leaves its row
``open``; once its deadline passes the sweep moves it to ``unconfirmed`` (never read back, never retried on
its own) until an operator confirms it (``replyd confirm``, ``library.confirm``) or rearms it. A provably
unsent failure (a refused connection, a 429) is released and retried as on every platform (docs/LIBRARY.md).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import httpx

from replyd import deadline
from replyd.clock import SystemClock
from replyd.errors import ConfigError, PlatformError, Rejected
from replyd.platforms._http import raise_for_status, transport_error
from replyd.platforms.base import Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent

# Why an OwnPlatform without read_back is of the no-read-back class (``NoReadBack.no_read_back``).
NO_READ_BACK = ("no read_back call was given: the bot's own replies cannot be listed, so a send whose answer "
                "was lost cannot be looked up")


def from_httpx(exc: BaseException, *, what: str, acting: bool) -> BaseException:
    """The replyd error for an httpx exception (the shared table of ``_http.py``); any other exception as is."""
    if isinstance(exc, httpx.HTTPStatusError):
        try:
            raise_for_status(exc.response, what=what, acts=acting, now=SystemClock().now)
        except PlatformError as mapped:
            return mapped
        return exc  # a 2xx raised as an error by the caller: not ours to judge
    if isinstance(exc, (httpx.HTTPError, httpx.InvalidURL)):
        return transport_error(exc, what=what, acting=acting)
    return exc


def _settle(value: Any, home: asyncio.AbstractEventLoop | None) -> Any:
    """A sync caller's view of an awaitable result: run on the bot's own loop (``home``, where its client
    lives) when the caller is a worker thread of it (the async face's sweep), else on the responder loop."""
    if home is not None and inspect.isawaitable(value) and home.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not home:
            async def wait() -> Any:
                return await value

            return asyncio.run_coroutine_threadsafe(wait(), home).result()
    from replyd.responders.base import settled  # responders import platforms: imported when first needed

    return settled(value)


class OwnPlatform:
    """A platform of the user's own calls (``whoami``, ``send``, ``read_back``), for the guard's two faces.

    Built without ``read_back`` it is an ``OwnPlatformNoReadBack`` (the no-read-back class).
    """

    kind: ClassVar[str] = "own"

    def __new__(cls, *args: Any, **kwargs: Any) -> OwnPlatform:
        # The capability is a method the core checks with isinstance (``NoReadBack``): only an instance
        # without read_back may have it, so the class is chosen here, from the one argument that decides.
        if cls is OwnPlatform and kwargs.get("read_back") is None:
            cls = OwnPlatformNoReadBack
        return super().__new__(cls)

    def __init__(self, *, instance: str, whoami: Callable[[], Any], send: Callable[[Parent, str, str], Any],
                 read_back: Callable[[list[str]], Any] | None = None, listing_delay_s: float = 10.0,
                 delete: Callable[[str], Any] | None = None) -> None:
        if not instance or not instance.strip():
            raise ConfigError("OwnPlatform: instance must name the platform instance (e.g. 'mastodon:https://host')")
        if read_back is not None and not callable(read_back):
            raise ConfigError("OwnPlatform: read_back must be a call (parent ids -> own reply ids) or None")
        self.instance = instance
        self.listing_delay_s = float(listing_delay_s)
        self._whoami, self._post, self._read, self._delete = whoami, send, read_back, delete
        # The loop the bot's async calls belong to (its client's connections are bound to one loop).
        self._home: asyncio.AbstractEventLoop | None = None

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the async calls on ``loop`` when called from a thread (``replyd.aio`` binds its own loop)."""
        self._home = loop

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.instance!r})"

    # -- identity and discovery (discovery is the bot's own: these find nothing) ------------------------

    def whoami(self) -> Identity:
        """The bot's stable identity, from the user's ``whoami``."""
        got = _settle(self._whoami(), self._home)
        return got if isinstance(got, Identity) else Identity(sender_id=str(got))

    def inbox(self, cursor: str | None) -> Page:
        """Nothing: the bot finds its parents itself."""
        return Page([], cursor)

    def search(self, query: str, cursor: str | None) -> Page:
        """Nothing: the bot finds its parents itself."""
        return Page([], cursor)

    def refind(self, since: float) -> list[Parent]:
        """Nothing: the bot finds its parents itself."""
        return []

    def resolve(self, ref: str) -> Parent:
        """The id as given is the served id (the user's SDK gave it)."""
        return Parent(id=ref, author_id="")

    # -- the send: only the guard's faces call these ----------------------------------------------

    @staticmethod
    def _sent(value: Any) -> Sent:
        if isinstance(value, Sent):
            return value
        if value is None or not str(value):
            raise PlatformError("send: returned no reply id (outcome unknown)")
        return Sent(reply_id=str(value))

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Post through the user's ``send`` (awaited when it is async); map httpx errors by the shared table."""
        return self._post_mapped(parent, text, provider_key)

    def _post_mapped(self, parent: Parent, text: str, provider_key: str) -> Sent:
        try:
            return self._sent(_settle(self._post(parent, text, provider_key), self._home))
        except Exception as exc:
            raise from_httpx(exc, what="send", acting=True) from None

    async def asend(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """The same, on the event loop (a sync ``send`` runs on a worker thread)."""
        if self._home is None:
            self._home = asyncio.get_running_loop()
        try:
            if inspect.iscoroutinefunction(self._post):
                return self._sent(await self._post(parent, text, provider_key))
        except Exception as exc:
            raise from_httpx(exc, what="send", acting=True) from None
        # A sync send on a worker thread, through replyd's: cut at its budget, the face keeps watching the thread.
        return await deadline.to_thread(self._post_mapped, parent, text, provider_key)

    # -- the sweep's read-back and duplicates ------------------------------------------------------

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Ask the user's ``read_back`` about the pending parents; only the parents it answered are checked."""
        ids = [p.parent.id for p in pending]
        try:
            found = _settle(self._read(ids), self._home)
        except Exception as exc:
            raise from_httpx(exc, what="read back", acting=False) from None
        if not isinstance(found, Mapping):
            raise PlatformError(f"read_back: returned {type(found).__name__}, expected a mapping of parent id to ids")
        out = ReadBack()
        asked = set(ids)
        for parent_id, replies in found.items():
            if parent_id not in asked:
                continue
            reply_ids = [replies] if isinstance(replies, str) else list(replies or ())
            out.checked.add(parent_id)
            if reply_ids:
                out.found[parent_id] = [OwnReply(reply_id=str(r), parent_id=parent_id) for r in reply_ids]
        return out

    def delete(self, reply_id: str) -> None:
        """Delete a duplicate through the user's ``delete``, if one was given."""
        if self._delete is None:
            raise Rejected("delete: this OwnPlatform was given no delete call")
        try:
            _settle(self._delete(reply_id), self._home)
        except Exception as exc:
            raise from_httpx(exc, what="delete", acting=True) from None

    def close(self) -> None:
        """Nothing to release: the user's client is the user's."""


class OwnPlatformNoReadBack(OwnPlatform):
    """An ``OwnPlatform`` without ``read_back``: the no-read-back class (``NoReadBack``), every doubt reported."""

    def no_read_back(self) -> str:
        """Why the bot's own replies cannot be listed here (``NoReadBack``)."""
        return NO_READ_BACK

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Nothing can be read back: nothing checked, so no row is ever judged "not found" (and retried)."""
        return ReadBack()
