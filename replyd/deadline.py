"""Whole-operation deadlines: a budget in seconds that every network read and write inside it shares.

httpx's timeouts are per phase (connect, each write, each read), so a send
with ``timeout_s = 1`` can stay in flight for several seconds: a server that
trickles interim ``1xx`` lines or body bytes resets the read timeout at each
one. The guard's row deadline assumes a send ends within ``send_timeout_s``,
so the guard opens a budget with :func:`within` and the network backend of
replyd's HTTP client (``replyd.platforms._http.make_client``) cuts every socket
operation to what is left of it: the whole request, 1xx lines and body
included, ends by the deadline. The budget is carried by a context variable,
so it follows the calling thread (and task) and nests (the inner one can only
shorten it).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("replyd_deadline", default=None)


class within:  # used as ``with deadline.within(s) as at:``, like a function
    """Run the body under a budget of ``seconds`` (monotonic); ``as`` gives the absolute deadline.

    A class, not ``@contextmanager``: it wraps every send, and a generator-based manager costs about a
    microsecond more per use."""

    __slots__ = ("_seconds", "_token")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def __enter__(self) -> float:
        outer = _DEADLINE.get()
        mine = time.monotonic() + self._seconds
        at = mine if outer is None or mine < outer else outer
        self._token = _DEADLINE.set(at)
        return at

    def __exit__(self, *_exc: object) -> None:
        _DEADLINE.reset(self._token)


def remaining() -> float | None:
    """Return the seconds left in the current budget (may be <= 0), or None when there is none."""
    at = _DEADLINE.get()
    return None if at is None else at - time.monotonic()


# The worker threads a cut left running (``to_thread``), for the ``outliving`` block around the cut call.
_LEFT: contextvars.ContextVar[list[asyncio.Future[Any]] | None] = contextvars.ContextVar("replyd_left", default=None)


class outliving:  # used as ``with deadline.outliving() as left:``
    """Collect, in ``left``, the ``to_thread`` calls cut (cancelled) inside the block while their thread still ran.

    A thread cannot be stopped: a send cut at its budget on the loop may still act from its thread (an SDK whose
    own timeout is longer than replyd's budget, a DNS lookup). The caller keeps watching what is left."""

    __slots__ = ("_token",)

    def __enter__(self) -> list[asyncio.Future[Any]]:
        left: list[asyncio.Future[Any]] = []
        self._token = _LEFT.set(left)
        return left

    def __exit__(self, *_exc: object) -> None:
        _LEFT.reset(self._token)


async def to_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a worker thread, the budget carried (as ``asyncio.to_thread``); cut while the
    thread runs, its future goes to the enclosing ``outliving`` block (or is only left to finish)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    running = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        if not running.done():
            left = _LEFT.get()
            if left is not None:
                left.append(running)
            else:  # nobody watches it: its error must not be reported as never retrieved
                running.add_done_callback(_retrieve)
        raise


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
