"""Liveness of a running daemon: per bot and path, when it last worked and how it fails now.

Pollers and the sweep report every run here (``ok`` / ``failed``); readiness,
the status page, ``replyd status`` and ``/metrics`` read it. A path is *stale*
when it has had no successful run for ``stale_after_intervals`` × its interval
(at least ``stale_min_s``), counted from its last success or, before the first
one, from when the daemon started tracking it: a frozen platform makes a poll
hang or fail, and either way the last success ages past the bound.

Time comes from the daemon's clock (injected), so tests move it without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


from replyd import metrics
from replyd import store as st
from replyd.clock import Clock

SWEEP = "sweep"


class Heartbeat(Protocol):
    """What a poller or the sweep reports after each run of one path."""

    def ok(self, path: str) -> None:
        """Record a run of ``path`` that finished without an error."""

    def failed(self, path: str, error: str) -> None:
        """Record a run of ``path`` that failed with ``error`` (short, secret-free)."""


@dataclass
class PathHealth:
    """One path of one bot: its schedule and its recent record."""

    interval_s: float
    since: float
    last_ok: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    failures: int = 0  # in a row, reset by a success
    runs: int = 0

    def age_s(self, now: float) -> float:
        """Seconds since the last success (or since tracking began, before the first one)."""
        return max(0.0, now - (self.last_ok if self.last_ok is not None else self.since))


def ago(seconds: float) -> str:
    """Say a duration the way an operator reads it: ``12 s``, ``3 min``, ``2 h``, ``4 d``."""
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172_800:
        return f"{s // 3600} h"
    return f"{s // 86_400} d"


def describe(path: str, h: dict[str, Any]) -> str:
    """One line in words: ``inbox: last ok 3 min ago, 7 failures in a row: HTTP 503``."""
    if h["last_ok"] is None:
        words = f"{path}: no successful run yet ({ago(h['age_s'])} since start)"
    else:
        words = f"{path}: last ok {ago(h['age_s'])} ago"
    if h["failures"]:
        n = h["failures"]
        error = str(h["last_error"])
        error = error[len(path) + 2:] if error.startswith(f"{path}: ") else error  # adapters prefix the operation
        words += f", {n} failure{'s' if n != 1 else ''} in a row: {error}"
    if h["stale"]:
        words += f" — STALE (limit {ago(h['stale_after_s'])})"
    return words


class Liveness:
    """Every bot's paths and sweep; thread-safe (scheduler jobs report from their threads)."""

    def __init__(self, clock: Clock, *, stale_after_intervals: float = 3.0, stale_min_s: float = 60.0) -> None:
        self.clock = clock
        self.stale_after_intervals = stale_after_intervals
        self.stale_min_s = stale_min_s
        self._paths: dict[tuple[str, str], PathHealth] = {}
        self._keys: dict[str, tuple[str, str]] = {}  # bot -> (platform instance, sender id)
        self._clocks: dict[str, Callable[[], dict[str, Any]]] = {}  # bot -> its platform clock's view
        self._lock = threading.Lock()

    def track(self, bot: str, path: str, interval_s: float) -> None:
        """Start watching ``path`` of ``bot``, scheduled every ``interval_s``."""
        with self._lock:
            self._paths[(bot, path)] = PathHealth(interval_s=interval_s, since=self.clock.now())

    def identify(self, bot: str, platform: str, sender_id: str) -> None:
        """Tell which key prefix ``bot`` writes, to find its oldest due open row."""
        self._keys[bot] = (platform, sender_id)

    def platform_clock(self, bot: str, view: Callable[[], dict[str, Any]]) -> None:
        """Show ``view()`` (the bot's platform clock as measured in this process) in every snapshot."""
        self._clocks[bot] = view

    def beat(self, bot: str) -> BotHeartbeat:
        """Return the ``Heartbeat`` one bot's pollers report to."""
        return BotHeartbeat(self, bot)

    def ok(self, bot: str, path: str) -> None:
        """Record a successful run."""
        now = self.clock.now()
        with self._lock:
            h = self._paths.get((bot, path))
            if h is None:
                return
            h.last_ok, h.failures, h.runs = now, 0, h.runs + 1
        metrics.poll(bot, path, ok=True)

    def failed(self, bot: str, path: str, error: str) -> None:
        """Record a failed run."""
        now = self.clock.now()
        with self._lock:
            h = self._paths.get((bot, path))
            if h is None:
                return
            h.last_error, h.last_error_at, h.failures, h.runs = error[:200], now, h.failures + 1, h.runs + 1
        metrics.poll(bot, path, ok=False)

    def stale_after_s(self, h: PathHealth) -> float:
        """The bound past which ``h`` counts as stale."""
        return max(self.stale_after_intervals * h.interval_s, self.stale_min_s)

    def snapshot(self, store: st.Store | None = None) -> dict[str, dict[str, Any]]:
        """Return, per bot, each path's record, staleness and words, and the oldest due open row's age."""
        now = self.clock.now()
        with self._lock:
            items = [(k, PathHealth(**vars(h))) for k, h in self._paths.items()]
        out: dict[str, dict[str, Any]] = {}
        for (bot, path), h in items:
            b = out.setdefault(bot, {"paths": {}, "stale": [], "oldest_due_open_age_s": None})
            d = {"interval_s": h.interval_s, "last_ok": h.last_ok, "age_s": round(h.age_s(now), 1),
                 "failures": h.failures, "last_error": h.last_error, "last_error_at": h.last_error_at,
                 "runs": h.runs, "stale_after_s": self.stale_after_s(h)}
            d["stale"] = d["age_s"] > d["stale_after_s"]
            d["words"] = describe(path, d)
            b["paths"][path] = d
            if d["stale"]:
                b["stale"].append(path)
        for bot, b in out.items():
            view = self._clocks.get(bot)
            b["platform_clock"] = view() if view is not None else None
        if store is not None:
            for bot, b in out.items():
                key = self._keys.get(bot)
                if key is not None:
                    due = store.oldest_due_open(*key, now)
                    b["oldest_due_open_age_s"] = None if due is None else round(now - due, 1)
        return out

    def problems(self) -> list[str]:
        """Reasons the daemon is not ready because of liveness (empty when every path is fresh)."""
        return [f"bot {bot}: {p['words']}" for bot, b in sorted(self.snapshot().items())
                for p in b["paths"].values() if p["stale"]]

    def last_success(self) -> list[tuple[str, str, float | None]]:
        """(bot, path, last success epoch or None) for every tracked path, for ``/metrics``."""
        with self._lock:
            return [(bot, path, h.last_ok) for (bot, path), h in sorted(self._paths.items())]


class BotHeartbeat:
    """The ``Heartbeat`` of one bot."""

    __slots__ = ("live", "bot")

    def __init__(self, live: Liveness, bot: str) -> None:
        self.live = live
        self.bot = bot

    def ok(self, path: str) -> None:
        """Record a successful run of ``path``."""
        self.live.ok(self.bot, path)

    def failed(self, path: str, error: str) -> None:
        """Record a failed run of ``path``."""
        self.live.failed(self.bot, path, error)


def error_words(exc: BaseException) -> str:
    """A short, class-free description of why a run failed (adapters already say ``inbox: HTTP 503 (…)``)."""
    detail = (str(getattr(exc, "detail", "") or exc).splitlines() or [""])[0][:160]
    status = getattr(exc, "status", None)
    if status and f"HTTP {status}" not in detail:
        detail = f"HTTP {status}: {detail}"
    return detail or "failed without a message"

