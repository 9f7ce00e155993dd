"""The write-path breaker of one bot: a platform-wide send failure pauses sending instead of spending attempts.

A 5xx, a timeout or any other "maybe sent" is not evidence about the parent it was sent for when most sends
of the bot fail the same way: the platform is down. So the guard asks the breaker before every claim and
tells it every send's fate (``GuardCore._admit_steps`` / ``_paused_steps`` / ``_record_steps``):

closed
    every send goes; the last ``window`` sends are judged: ``min_failures`` failures that are also at least
    ``failure_ratio`` of the window open the breaker. The failures in that window are handed back to the
    guard, which marks their rows (``outage_send`` events) so the sweep's not-landed proof of them spends no
    attempt (``Sweeper``; replicas see the marks through the store).
open
    no claim leaves for a send; the guard holds new parents in ``released`` (no attempt used). Once the
    probe interval has passed, one call is admitted as the probe: a real parent's send. A probe that fails
    doubles the interval (up to ``probe_max_s``); any send that lands (a probe, or one admitted before the
    breaker opened) closes the breaker.

State lives in memory per process: each replica judges its own sends and opens on its own (in an outage
every replica's sends fail, so each opens after ``min_failures`` of its own). A restarted process starts
closed and may send up to ``min_failures`` more into the outage; those are marked when it opens. The
sweep also excuses a not-landed proof of a send made while this process's breaker was open
(``open_during``), which covers a replica killed before it could mark its own failures.

Time is the injected clock's ``now`` (the database clock in the daemon), so it compares with rows' times.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from replyd import metrics
from replyd.clock import Clock
from replyd.config import BreakerConfig
from replyd.log import get_logger

log = get_logger("replyd.breaker")

_KEPT_SPELLS = 64  # open periods remembered for ``open_during`` (the sweep looks back one send's bound)


class Admit(enum.Enum):
    """What the breaker said to one call of the guard."""

    SEND = "send"  # closed: send
    PROBE = "probe"  # open: this call's send is the probe
    REFUSED = "refused"  # open: do not send now


@dataclass(frozen=True)
class Ticket:
    """The breaker's answer to one call: ``kind``, and which probe it is (``seq``) when it is one."""

    kind: Admit
    seq: int = 0


SEND = Ticket(Admit.SEND)
REFUSED = Ticket(Admit.REFUSED)


@runtime_checkable
class BreakerListener(Protocol):
    """Told when a bot's breaker opens or closes (the readiness record shows it)."""

    def set_breaker(self, bot: str, open: bool, reason: str) -> None:  # the state's name
        """Record that ``bot``'s breaker is now ``open`` (True) or closed, and why."""
        ...


class Breaker:
    """One bot's write-path breaker; thread-safe (the bot's paths post from several scheduler threads)."""

    def __init__(self, cfg: BreakerConfig, clock: Clock, *, bot: str, platform: str,
                 listener: BreakerListener | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.bot = bot
        self.platform = platform
        self.listener = listener
        self._lock = threading.Lock()
        self._window: deque[tuple[bool, Hashable | None]] = deque(maxlen=cfg.window)
        self._opened_at: float | None = None
        self._interval_s = cfg.probe_s
        self._next_probe_at = 0.0
        self._probe_since: float | None = None  # a probe is out since then
        self._probe_seq = 0  # which one (a late verdict of an older probe must not end the current one)
        self._seq = itertools.count(1)
        self._spells: deque[tuple[float, float | None]] = deque(maxlen=_KEPT_SPELLS)
        self.reason = ""

    @property
    def is_open(self) -> bool:
        """True while sends are paused."""
        return self._opened_at is not None

    def retry_in_s(self) -> float:
        """Seconds until the next probe may leave (0 when closed)."""
        with self._lock:
            return 0.0 if self._opened_at is None else max(0.0, self._next_probe_at - self.clock.now())

    def admit(self) -> Ticket:
        """Ask before a claim: send, send as the probe, or refuse."""
        if not self.cfg.enabled:
            return SEND
        with self._lock:
            if self._opened_at is None:
                return SEND
            now = self.clock.now()
            # A probe whose caller vanished without a verdict must not pause the bot for good.
            stuck = self._probe_since is not None and now - self._probe_since > self.cfg.probe_max_s
            if now < self._next_probe_at or (self._probe_since is not None and not stuck):
                return REFUSED
            self._probe_since, self._probe_seq = now, next(self._seq)
            ticket = Ticket(Admit.PROBE, self._probe_seq)
        log.info("replyd.breaker.probe", bot=self.bot, platform=self.platform, interval_s=self._interval_s)
        return ticket

    def abandon(self, ticket: Ticket) -> None:
        """The call holding ``ticket`` sent nothing (its key was not claimable): if it was the probe, the next
        call may probe. A no-op once the ticket's send was recorded."""
        with self._lock:
            self._end_probe(ticket)

    def _end_probe(self, ticket: Ticket) -> None:
        if ticket.kind is Admit.PROBE and ticket.seq == self._probe_seq:
            self._probe_since, self._probe_seq = None, 0

    def record(self, ticket: Ticket, ref: Hashable, failed: bool | None) -> list[Hashable]:
        """Tell the fate of the send admitted with ``ticket`` (``ref`` names it: the guard's (key, attempt)).

        ``failed``: True for a platform-wide kind of failure, False for an answer (landed, refused), None for
        a verdict that says nothing about the platform's health (rate limited). Returns the refs of failed
        sends the outage swallowed, to be marked: the window's failures when this call opened the breaker,
        this send when it failed while the breaker was open.
        """
        if not self.cfg.enabled or failed is None:
            self.abandon(ticket)
            return []
        with self._lock:
            now = self.clock.now()
            probe = ticket.kind is Admit.PROBE and ticket.seq == self._probe_seq
            self._end_probe(ticket)
            if self._opened_at is not None:
                if not failed:
                    self._close(now, ticket.kind)
                    return []
                if probe:
                    self._interval_s = min(self.cfg.probe_max_s, self._interval_s * 2)
                    self._next_probe_at = now + self._interval_s
                    log.warning("replyd.breaker.probe_failed", bot=self.bot, platform=self.platform,
                                next_probe_s=self._interval_s)
                return [ref]
            self._window.append((failed, ref))
            failures = [r for f, r in self._window if f]
            if len(failures) < self.cfg.min_failures or len(failures) < self.cfg.failure_ratio * len(self._window):
                return []
            self._open(now, len(failures), len(self._window))
            return failures

    def open_during(self, since: float, until: float) -> bool:
        """True if this breaker was open at any time between ``since`` and ``until``."""
        with self._lock:
            return any(start <= until and (end is None or end >= since) for start, end in self._spells)

    def _open(self, now: float, failed: int, of: int) -> None:
        self._opened_at = now
        self._interval_s = self.cfg.probe_s
        self._next_probe_at = now + self._interval_s
        self._window.clear()
        self._spells.append((now, None))
        self.reason = f"{failed} of the last {of} sends failed"
        metrics.breaker_state(self.platform, True)
        log.error("replyd.breaker.opened", bot=self.bot, platform=self.platform, reason=self.reason,
                  probe_s=self._interval_s)
        self._tell(True)

    def _close(self, now: float, by: Admit) -> None:
        opened, self._opened_at = self._opened_at, None
        self._spells[-1] = (self._spells[-1][0], now)
        self._interval_s = self.cfg.probe_s
        self.reason = ""
        metrics.breaker_state(self.platform, False)
        log.warning("replyd.breaker.closed", bot=self.bot, platform=self.platform, by=by.value,
                    open_s=round(now - (opened or now), 3))
        self._tell(False)

    def _tell(self, is_open: bool) -> None:
        if self.listener is not None:
            try:
                self.listener.set_breaker(self.bot, is_open, self.reason)
            except Exception as exc:  # the readiness record must never stop a send decision
                log.error("replyd.breaker.listener_failed", bot=self.bot, platform=self.platform,
                          error=f"{type(exc).__name__}: {exc}"[:200])
