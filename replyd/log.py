"""structlog, configured once: console in a terminal, JSON otherwise, secrets masked."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import MutableMapping
from typing import Any

import structlog
from structlog._config import _CONFIG as _structlog_config  # read, never written: see Logger

from replyd.terminal import shown

# The method structlog's filtering loggers have for a level they filter out (those below critical filter
# out info); see ``Logger``.
_NOP = vars(structlog.make_filtering_bound_logger(logging.CRITICAL))["info"]

_SECRETS: set[str] = set()
_lock = threading.Lock()
MASK = "***"


_W = 4  # a secret this long or longer is found by its first _W characters
_index: tuple[dict[str, list[str]], list[str]] | None = None  # built on first use after a change


def add_secret(value: str) -> None:
    """Register a secret so no log line ever shows it, however short (a short one masks more than it should,
    which is the lesser harm: a 5-character password is still a password)."""
    global _index
    if value and value not in _SECRETS:
        with _lock:
            _SECRETS.add(value)
            _index = None


def _built() -> tuple[dict[str, list[str]], list[str]]:
    """The secrets by their first ``_W`` characters (each list longest first), and the shorter ones."""
    global _index
    with _lock:
        if _index is None:
            by_prefix: dict[str, list[str]] = {}
            short: list[str] = []
            for secret in sorted(_SECRETS, key=len, reverse=True):
                if len(secret) >= _W:
                    by_prefix.setdefault(secret[:_W], []).append(secret)
                else:
                    short.append(secret)
            _index = (by_prefix, short)
        return _index


def mask(text: str) -> str:
    """Return ``text`` with every registered secret replaced by ``***`` (the longest one where several start at
    the same place: one may contain another). One pass over ``text`` looking up each window of ``_W`` characters:
    a daemon of a thousand bots has a thousand tokens, and scanning for each of them on every log line (sorted
    on every call) was a sixth of its CPU."""
    if not _SECRETS:
        return text
    by_prefix, short = _index or _built()
    out: list[str] = []
    i = last = 0
    end = len(text) - _W
    while i <= end:
        for secret in by_prefix.get(text[i:i + _W], ()):
            if text.startswith(secret, i):
                out += (text[last:i], MASK)
                i = last = i + len(secret)
                break
        else:
            i += 1
    if out:
        text = "".join(out) + text[last:]
    for secret in short:  # shorter than a window: few, if any
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def _mask_secrets(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if not _SECRETS:
        return event
    for k, v in list(event.items()):
        if isinstance(v, str):
            event[k] = mask(v)
        elif isinstance(v, BaseException):
            event[k] = mask(f"{type(v).__name__}: {v}")
    return event


def _escape_controls(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console only: platform ids and API paths in string values reach a terminal escaped (JSON escapes itself)."""
    for k, v in list(event.items()):
        if isinstance(v, str) and k != "exception":
            event[k] = shown(v)
    return event


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at write time (tests swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog for the process (``fmt``: auto, console or json)."""
    stream = stream or _Stderr()
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        # show_locals=False: a frame's locals may hold a token.
        renderer = structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False)
            if _has_rich() else structlog.dev.plain_traceback
        )
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # One stdlib handler renders both structlog events and other libraries' records (APScheduler,
    # uvicorn): one lock, one format, so JSON lines never interleave with plain text.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, stamp],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info if fmt == "json" else structlog.processors.StackInfoRenderer(),
                _mask_secrets,
                *([] if fmt == "json" else [_escape_controls]),
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_replyd", False):
            root.removeHandler(h)
    handler._replyd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # alembic: 9 INFO lines per migration run on every command; `replyd -v` turns them back on.
    for noisy in ("apscheduler", "httpx", "httpcore", "uvicorn.access", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


class Logger:
    """A module's logger (``log = get_logger("replyd.<noun>")``): structlog's, rebuilt only when structlog's
    configuration changes, so a call costs a few identity checks instead of a new bound logger.

    structlog's lazy proxy binds afresh on every call: 2.3 µs for an event the level filters out, 0.5 µs
    through this class (timeit, one run); the proxy was 5.7 % of a 16-parent page's samples (py-spy). Its own cache
    (``cache_logger_on_first_use``) would pin whatever configuration the first call saw, and ``configure``,
    ``replyd -v`` and the tests' ``capture_logs`` change it later; this one follows every change.
    """

    __slots__ = ("_name", "_bound", "_seen", "_quiet_debug", "_quiet_info")

    def __init__(self, name: str) -> None:
        self._name = name
        self._bound: Any = None
        self._seen: tuple[Any, ...] = ()
        # Whether the level filters these out (structlog's filtering logger makes them a no-op): then the call
        # returns before passing its keywords on, 0.6 µs instead of 2.4 (timeit), two per post on a page.
        self._quiet_debug = self._quiet_info = False

    def _get(self) -> Any:
        c = _structlog_config
        seen = self._seen
        # What a bound logger keeps from the configuration (capture_logs edits the processors list in place,
        # which a bound logger sees by itself).
        if (not seen or seen[0] is not c.default_wrapper_class or seen[1] is not c.default_processors
                or seen[2] is not c.logger_factory or seen[3] is not c.default_context_class):
            # Read before the build: a configure() racing with it leaves ``_seen`` old, so the next call rebuilds
            # (read after, it would pair the new configuration with a logger built on the old one, for good).
            now = (c.default_wrapper_class, c.default_processors, c.logger_factory, c.default_context_class)
            bound = structlog.get_logger(self._name).bind()
            methods = vars(type(bound))
            self._quiet_debug, self._quiet_info = methods.get("debug") is _NOP, methods.get("info") is _NOP
            self._bound = bound  # before ``_seen``: a thread that sees the new ``_seen`` finds this logger
            self._seen = now
            return bound
        return self._bound

    def debug(self, event: str, *args: Any, **kw: Any) -> Any:
        """Log ``event`` at debug level."""
        bound = self._get()
        return None if self._quiet_debug else bound.debug(event, *args, **kw)

    def info(self, event: str, *args: Any, **kw: Any) -> Any:
        """Log ``event`` at info level."""
        bound = self._get()
        return None if self._quiet_info else bound.info(event, *args, **kw)

    def warning(self, event: str, *args: Any, **kw: Any) -> Any:
        """Log ``event`` at warning level."""
        return self._get().warning(event, *args, **kw)

    def error(self, event: str, *args: Any, **kw: Any) -> Any:
        """Log ``event`` at error level."""
        return self._get().error(event, *args, **kw)

    def bind(self, **kw: Any) -> Any:
        """A bound logger with ``kw`` in every event (fixed to the configuration of now, as structlog's is)."""
        return self._get().bind(**kw)


def get_logger(name: str) -> Logger:
    """The logger a module keeps for its events (``replyd.<noun>.<verb>``)."""
    return Logger(name)
