"""Liveness of a running daemon: per bot, whether it started, and per path, when it last worked and how it fails now.

Pollers and the sweep report every run here (``ok`` / ``failed``), and the
daemon wraps each run in ``running`` so a run that hangs is seen while it
hangs; readiness, the status page, ``replyd status`` and ``/metrics`` read it.

A path is *failing* (not ready) as soon as ``failures_not_ready`` runs in a
row failed, or its current run has been in flight longer than its interval
plus the adapter's request timeout (a frozen platform makes requests time
out, not fail fast: the stuck run counts while it hangs), or it is *overdue*:
no success for one interval plus its jitter plus one request timeout while a
run is in flight or the last run failed. Overdue is counted from the last
success, not from the run's start: a frozen platform's runs each end at the
request timeout (one failure, not yet N) and the next starts an interval
later, so a count of failures or a run's own age sees a freeze only an
interval + a timeout after the first run met it; the last success came before
the freeze, so the fastest path turns the daemon not ready within its
interval + timeout of it. The re-find path is due every few seconds, so a
freeze shows within one inbox interval. A run merely late to start (a busy
scheduler) is not overdue: nothing has failed yet. A success clears all three. A path is *stale* when it has had no successful run for
``stale_after_intervals`` × its interval (at least ``stale_min_s``), counted
from its last success or, before the first one, from when the daemon started
tracking it: the backstop for a path that neither fails nor succeeds.

A bot is *starting* until its first login worked (the daemon retries a
platform it cannot reach in the background), *failed* when the platform
refused the login, *running* after. Its write breaker (``set_breaker``, called
by the guard's per-bot breaker through ``breaker.BreakerListener``) makes it
not ready while open.

Time comes from the daemon's clock (injected), so tests move it without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from replyd import metrics
from replyd import store as st
from replyd.clock import Clock

SWEEP = "sweep"
STARTING, RUNNING, FAILED = "starting", "running", "failed"
StartState = Literal["starting", "running", "failed"]


class Heartbeat(Protocol):
    """What a poller or the sweep reports after each run of one path."""

    def ok(self, path: str) -> None:
        """Record a run of ``path`` that finished without an error."""

    def failed(self, path: str, error: str) -> None:
        """Record a run of ``path`` that failed with ``error`` (short, secret-free)."""


@dataclass
class BotStart:
    """One configured bot's start and write breaker."""

    state: StartState = STARTING
    reason: str | None = None  # why it is not running (the last start error), secret-free
    attempts: int = 0  # start attempts that failed
    since: float = 0.0  # when it entered ``state``
    next_try_at: float | None = None  # the next start attempt, while starting
    breaker_open: bool = False
    breaker_reason: str | None = None
    breaker_since: float | None = None
    adopting: bool = False  # reading its own replies back before any path runs (replyd.daemon.adopt_window)


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
    timeout_s: float = 0.0  # the adapter's request timeout: a run in flight past interval + this is stuck
    jitter_s: float = 0.0  # the scheduler's jitter on this path: a run may start this much past its interval
    running_since: float | None = None  # the run in flight started then (None: none is)

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
    if h.get("running_s") is not None and h.get("stuck"):
        words += f", a run in flight for {ago(h['running_s'])} (no answer)"
    elif h.get("overdue") and h.get("running_s") is not None:
        words += f", a run in flight (due every {ago(h['interval_s'])})"
    if h["stale"]:
        words += f" — STALE (limit {ago(h['stale_after_s'])})"
    elif h.get("failing"):
        words += " — FAILING"
    return words


def describe_start(b: dict[str, Any]) -> str:
    """A bot that is not running, in words: ``starting (attempt 3 failed, next in 8 s): connection refused``."""
    if b["state"] == RUNNING:
        return "running"
    if b["state"] == FAILED:
        return f"failed to start: {b['reason']}"
    if b.get("adopting") and not b["attempts"]:
        return "adopting: reading its own replies back before it answers anything"
    if not b["attempts"]:
        return "starting"
    nxt = "" if b.get("next_try_s") is None else f", next in {ago(b['next_try_s'])}"
    n = b["attempts"]
    return f"starting ({n} attempt{'s' if n != 1 else ''} failed{nxt}): {b['reason']}"


class Liveness:
    """Every bot's paths and sweep; thread-safe (scheduler jobs report from their threads)."""

    def __init__(self, clock: Clock, *, stale_after_intervals: float = 3.0, stale_min_s: float = 60.0,
                 failures_not_ready: int = 2) -> None:
        self.clock = clock
        self.stale_after_intervals = stale_after_intervals
        self.stale_min_s = stale_min_s
        self.failures_not_ready = failures_not_ready
        self._paths: dict[tuple[str, str], PathHealth] = {}
        self._bots: dict[str, BotStart] = {}
        self._keys: dict[str, tuple[str, str]] = {}  # bot -> (platform instance, sender id)
        self._clocks: dict[str, Callable[[], dict[str, Any]]] = {}  # bot -> its platform clock's view
        self._lock = threading.Lock()

    def track(self, bot: str, path: str, interval_s: float, timeout_s: float = 0.0, jitter_s: float = 0.0) -> None:
        """Start watching ``path`` of ``bot``, scheduled every ``interval_s`` (+ up to ``jitter_s``), its requests
        bounded by ``timeout_s``."""
        with self._lock:
            self._paths[(bot, path)] = PathHealth(interval_s=interval_s, since=self.clock.now(), timeout_s=timeout_s,
                                                  jitter_s=jitter_s)

    # -- a bot's start and breaker ---------------------------------------------------------------

    def expect(self, bot: str) -> None:
        """Note a configured bot that has not started yet."""
        with self._lock:
            self._bots.setdefault(bot, BotStart(since=self.clock.now()))

    def forget(self, bot: str) -> None:
        """Drop ``bot`` and its paths (removed by a reload): neither ready nor stale from now on."""
        with self._lock:
            for key in [k for k in self._paths if k[0] == bot]:
                del self._paths[key]
            self._bots.pop(bot, None)
            self._keys.pop(bot, None)
            self._clocks.pop(bot, None)

    def starting(self, bot: str, reason: str, retry_in_s: float) -> None:
        """Record a failed start attempt of ``bot`` (``reason``, secret-free); the next is in ``retry_in_s``."""
        now = self.clock.now()
        with self._lock:
            b = self._bots.setdefault(bot, BotStart(since=now))
            b.state, b.reason, b.attempts, b.next_try_at = STARTING, reason[:300], b.attempts + 1, now + retry_in_s

    def adopting(self, bot: str) -> None:
        """Record that ``bot`` logged in and reads its own replies back before any path runs."""
        now = self.clock.now()
        with self._lock:
            self._bots.setdefault(bot, BotStart(since=now)).adopting = True

    def started(self, bot: str) -> None:
        """Record that ``bot`` logged in and its jobs run."""
        now = self.clock.now()
        with self._lock:
            b = self._bots.setdefault(bot, BotStart(since=now))
            b.state, b.reason, b.since, b.next_try_at, b.adopting = RUNNING, None, now, None, False

    def start_failed(self, bot: str, reason: str) -> None:
        """Record that ``bot`` will not start (its platform refused the login): no more attempts."""
        now = self.clock.now()
        with self._lock:
            b = self._bots.setdefault(bot, BotStart(since=now))
            b.state, b.reason, b.since, b.next_try_at = FAILED, reason[:300], now, None

    def retry_in_s(self, bot: str) -> float | None:
        """Seconds until ``bot``'s next start attempt (None when it is not waiting for one)."""
        with self._lock:
            b = self._bots.get(bot)
            at = b.next_try_at if b is not None and b.state == STARTING else None
        return None if at is None else max(0.0, at - self.clock.now())

    def set_breaker(self, bot: str, open: bool, reason: str = "") -> None:
        """Record ``bot``'s write breaker state (``breaker.BreakerListener``); open makes the bot not ready."""
        now = self.clock.now()
        with self._lock:
            b = self._bots.setdefault(bot, BotStart(since=now))
            if b.breaker_open != open:
                b.breaker_since = now
            b.breaker_open, b.breaker_reason = open, (reason[:300] or None) if open else None

    @contextmanager
    def running(self, bot: str, path: str) -> Iterator[None]:
        """Mark a run of ``path`` in flight for as long as the block runs (a hung run is seen while it hangs)."""
        now = self.clock.now()
        with self._lock:
            h = self._paths.get((bot, path))
            if h is not None:
                h.running_since = now
        try:
            yield
        finally:
            with self._lock:
                if h is not None:
                    h.running_since = None

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

    @staticmethod
    def stuck_after_s(h: PathHealth) -> float:
        """How long a run of ``h`` may be in flight before it counts as failing: its interval plus a request's timeout."""
        return h.interval_s + h.timeout_s

    @staticmethod
    def overdue_after_s(h: PathHealth) -> float:
        """How long ``h`` may go without a success while its runs hang or fail: interval + jitter + a request's
        timeout (an interval again when the timeout is not known, so a slow healthy run is never counted)."""
        return h.interval_s + h.jitter_s + (h.timeout_s if h.timeout_s > 0 else h.interval_s)

    def snapshot(self, store: st.Store | None = None) -> dict[str, dict[str, Any]]:
        """Return, per bot, each path's record, staleness and words, and the oldest due open row's age."""
        now = self.clock.now()
        with self._lock:
            items = [(k, PathHealth(**vars(h))) for k, h in self._paths.items()]
            starts = [(bot, BotStart(**vars(b))) for bot, b in self._bots.items()]
        out: dict[str, dict[str, Any]] = {}

        def entry(bot: str) -> dict[str, Any]:
            return out.setdefault(bot, {"paths": {}, "stale": [], "failing": [], "oldest_due_open_age_s": None,
                                        "start": None, "breaker": None})

        for bot, st_ in sorted(starts):
            b = entry(bot)
            b["start"] = {"state": st_.state, "reason": st_.reason, "attempts": st_.attempts,
                          "since": st_.since, "adopting": st_.adopting,
                          "next_try_s": None if st_.next_try_at is None else round(max(0.0, st_.next_try_at - now), 1)}
            b["start"]["words"] = describe_start(b["start"])
            b["breaker"] = {"open": st_.breaker_open, "reason": st_.breaker_reason, "since": st_.breaker_since}
        for (bot, path), h in items:
            b = entry(bot)
            running_s = None if h.running_since is None else round(max(0.0, now - h.running_since), 1)
            d = {"interval_s": h.interval_s, "last_ok": h.last_ok, "age_s": round(h.age_s(now), 1),
                 "failures": h.failures, "last_error": h.last_error, "last_error_at": h.last_error_at,
                 "runs": h.runs, "stale_after_s": self.stale_after_s(h), "running_s": running_s,
                 "stuck": running_s is not None and running_s > self.stuck_after_s(h)}
            d["overdue"] = (running_s is not None or h.failures > 0) and h.age_s(now) > self.overdue_after_s(h)
            d["stale"] = d["age_s"] > d["stale_after_s"]
            d["failing"] = d["stuck"] or d["overdue"] or h.failures >= self.failures_not_ready
            d["words"] = describe(path, d)
            b["paths"][path] = d
            if d["stale"]:
                b["stale"].append(path)
            if d["failing"]:
                b["failing"].append(path)
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

    def problems(self, *, detail: bool = True) -> list[str]:
        """Reasons the daemon is not ready because of liveness (empty when every bot runs and every path is fine).

        Without ``detail``, only generic words (``bot x: not started``, ``bot x: inbox failing``): no error text,
        no address, for a probe that showed no token.
        """
        out: list[str] = []
        for bot, b in sorted(self.snapshot().items()):
            start, breaker = b["start"], b["breaker"]
            if start is not None and start["state"] != RUNNING:
                out.append(f"bot {bot}: {start['words']}" if detail else f"bot {bot}: not started")
            if breaker is not None and breaker["open"]:
                out.append(f"bot {bot}: write breaker open" + (f": {breaker['reason']}" if detail and breaker["reason"]
                                                               else ""))
            for path, p in sorted(b["paths"].items()):
                if p["stale"] or p["failing"]:
                    out.append(f"bot {bot}: {p['words']}" if detail
                               else f"bot {bot}: {path} {'stale' if p['stale'] else 'failing'}")
        return out

    def not_running(self) -> set[str]:
        """The bots that have not started (still starting, or failed to)."""
        with self._lock:
            return {bot for bot, b in self._bots.items() if b.state != RUNNING}

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

    def breaker(self, open: bool, reason: str = "") -> None:
        """Record this bot's write breaker state (for a guard that knows only its own bot)."""
        self.live.set_breaker(self.bot, open, reason)


def error_words(exc: BaseException) -> str:
    """A short, class-free description of why a run failed (adapters already say ``inbox: HTTP 503 (…)``)."""
    detail = (str(getattr(exc, "detail", "") or exc).splitlines() or [""])[0][:160]
    status = getattr(exc, "status", None)
    if status and f"HTTP {status}" not in detail:
        detail = f"HTTP {status}: {detail}"
    return detail or "failed without a message"

