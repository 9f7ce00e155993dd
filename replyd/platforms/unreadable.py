"""One unreadable item never stops a path: a page's raw items are read one by one (``read_one``).

An item whose parse raises (a field missing, a value of another type, a
notification of an unexpected shape, a document nested too deeply) is that
item's failure: it is reported once and the page goes on without it, so the
path's cursor moves past it. An item that cannot be read today will not be
read tomorrow either.

Each report is logged (``replyd.poller.unreadable``), counted in
``replyd_unreadable_items_total{platform,path}`` and handed to the sink the
running path installed with ``reporting`` (the pollers, the webhook receiver
and the streams record it as an ``unreadable`` event when the item's id is
known, which ``replyd status`` counts per bot). Adapters never touch the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from replyd import metrics
from replyd.errors import BadResponse, PlatformError
from replyd.log import get_logger

T = TypeVar("T")
log = get_logger("replyd.poller")

# What reading one item may raise: the adapter's own BadResponse, and what a parse of an unexpected shape
# raises before any check catches it. Any other error (a platform error of a request) fails the page.
ERRORS: tuple[type[BaseException], ...] = (BadResponse, KeyError, TypeError, ValueError, AttributeError,
                                           IndexError, ArithmeticError, RecursionError)


@dataclass(frozen=True)
class Item:
    """One item a path could not read: the platform instance, the path, its id (None unknown) and why."""

    platform: str
    path: str
    item_id: str | None
    problem: str


# Keeps one report; False when it knew the item already (then it is neither logged nor counted again).
Sink = Callable[[Item], "bool | None"]
_SINK: ContextVar[tuple[str, Sink] | None] = ContextVar("replyd_unreadable_sink", default=None)


@contextmanager
def reporting(path: str, sink: Sink) -> Iterator[None]:
    """Within this block, each unreadable item is reported as read on ``path`` and handed to ``sink``."""
    token = _SINK.set((path, sink))
    try:
        yield
    finally:
        _SINK.reset(token)


def problem_words(problem: BaseException | str) -> str:
    """What was wrong with an item, in one short line (a BadResponse's detail, else the exception's type)."""
    if isinstance(problem, PlatformError):
        return (problem.detail or type(problem).__name__)[:300]
    if isinstance(problem, BaseException):
        # The message of a KeyError or TypeError may quote the item's text: its type and a short message only.
        return f"{type(problem).__name__}: {str(problem)[:120]}"
    return problem[:300]


def item_id(item: Any, field: str = "id") -> str | None:
    """The item's own id for the report: ``item[field]`` when it is a string or an int, else None."""
    value = item.get(field) if isinstance(item, dict) else None
    return str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) and str(value) else None


def report(platform: str, what: str, item_ident: str | None, problem: BaseException | str) -> None:
    """Report one unreadable item of ``platform`` read by ``what``: handed to the sink, then logged and counted
    unless the sink knew it already (re-find reads its window again each run)."""
    installed = _SINK.get()
    path = installed[0] if installed is not None else what
    bad = Item(platform=platform, path=path, item_id=item_ident, problem=problem_words(problem))
    if installed is not None:
        try:
            if installed[1](bad) is False:
                log.debug("replyd.poller.unreadable_again", platform=platform, path=path, item_id=item_ident)
                return
        except Exception as exc:  # the report is still logged and counted: the page goes on
            log.error("replyd.poller.unreadable_not_recorded", platform=platform, path=path, item_id=item_ident,
                      error=f"{type(exc).__name__}: {exc}"[:200])
    log.warning("replyd.poller.unreadable", platform=platform, path=path, what=what, item_id=item_ident,
                problem=bad.problem)
    metrics.unreadable(platform, path)


def read_one(platform: str, what: str, item: Any, read: Callable[[Any], T], *, id_field: str = "id",
             ident: str | None = None) -> tuple[bool, T | None]:
    """``(True, read(item))``, or ``(False, None)`` once the item was reported unreadable (named ``ident``, else
    by its ``id_field``)."""
    try:
        return True, read(item)
    except ERRORS as exc:
        report(platform, what, ident if ident is not None else item_id(item, id_field), exc)
        return False, None


def recorder(store: Any, platform: str, sender_id: str, remember: int = 4096) -> Sink:
    """A sink that keeps each report whose item has an id as an ``unreadable`` event of the bot's key for it
    (``replyd status`` counts them per bot, ``replyd explain <id>`` shows why), once per process: the last
    ``remember`` ids kept are known again without a write."""
    from replyd.store import Key

    kept: OrderedDict[tuple[str, str], None] = OrderedDict()
    lock = threading.Lock()  # the bot's poll jobs, webhook workers and stream thread report through one sink

    def record(bad: Item) -> bool:
        if bad.item_id is None:
            return True
        seen = (bad.path, bad.item_id)
        with lock:
            if seen in kept:
                kept.move_to_end(seen)
                return False
        store.record(Key(platform, sender_id, bad.item_id), "unreadable", detail={"path": bad.path, "problem": bad.problem})
        with lock:  # only once written: a failed write is tried again at the next report
            kept[seen] = None
            while len(kept) > remember:
                kept.popitem(last=False)
        return True

    return record
