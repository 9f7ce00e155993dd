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

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("replyd_deadline", default=None)


@contextmanager
def within(seconds: float) -> Iterator[float]:
    """Run the body under a budget of ``seconds`` (monotonic); yield the absolute deadline."""
    outer = _DEADLINE.get()
    mine = time.monotonic() + seconds
    at = mine if outer is None else min(outer, mine)
    token = _DEADLINE.set(at)
    try:
        yield at
    finally:
        _DEADLINE.reset(token)


def remaining() -> float | None:
    """Return the seconds left in the current budget (may be <= 0), or None when there is none."""
    at = _DEADLINE.get()
    return None if at is None else at - time.monotonic()
