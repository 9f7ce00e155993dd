"""The listing delay in use for one platform instance: configured, or learned from the observed listing lag.

Every own reply whose send time replyd knows (the guard closed its row from the send's response) is a free
measurement: the sweep looks for it in the batched own-feed read-back from the configured delay on, and
records its age at the last look that did not list it (``lower_s``, a proven lag: 0 when the first look
listed it) and at the first look that did (``upper_s``). Samples live in the store (``listing_lag``), so a
restart keeps them and replicas share them.

The delay in use is ``max(configured, factor x percentile(lower_s))``, at most ``listing_delay_max_s``
(never below the configured value), once ``listing_delay_min_samples`` samples exist. The estimate runs on
the lower bounds on purpose: a look at a delay the estimate itself chose always lists the reply, so an
estimate built on upper bounds would feed on itself and grow to the cap; a lower bound is only ever raised
by a reply that really was not listed yet.

Before that (the warm-up) the delay in use is ``factor x`` the longest lag proven so far, counting the
replies still unlisted, as soon as a look proves it (no refresh, no store read): a reply replyd knows landed
and saw unlisted at age A proves the platform can take A, and without it every lost response of the first
minutes is judged at the configured delay. After the warm-up the percentile rules, so that one reply the
platform never lists (deleted at once) cannot hold the delay at the cap. The proofs are this process's own
looks; other replicas learn the lag at their next refresh, once the samples are complete in the store.

A lag is an interval, and both its ends are read on one step-free clock: the process that sent the reply
notes its monotonic time (``sent``) and measures the age of its own looks on it. A wall clock that NTP or an
operator steps between the send and a look would otherwise prove a lag the platform never had (a replica
stepped back 30 s makes every reply it sends look 30 s old to the others: the chaos campaign's seed 1201
found the learned delay at 90 s that way). Looks by another replica count only on the database's clock
(``store.db_clock``), which every replica shares and no local step moves; elsewhere they still verify the
close but are no sample.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from replyd.clock import Clock, SystemClock, monotonic_of, shared
from replyd.config import SweepConfig
from replyd.errors import ReplydError
from replyd.lag_summary import LagSummary, percentile
from replyd.log import get_logger
from replyd.store import Store, Tx

log = get_logger("replyd.lag")

RETENTION_S = 7 * 86_400.0  # samples older than this are forgotten
FAR_BELOW = 2.0  # a configured delay below observed / FAR_BELOW is a warning
MIN_STEP_S = 0.5  # the finest resolution a lag is measured at (between two looks)
MAX_SENT = 100_000  # sends remembered for their monotonic time (a bound on memory at any send rate)


def effective_delay(configured_s: float, lower: Sequence[float], cfg: SweepConfig,
                    proven: Sequence[float] = ()) -> float:
    """The listing delay to use: until enough samples, factor x the longest proven lag (``lower`` and the
    still unlisted ``proven``); then factor x the percentile of ``lower``; capped, never below configured."""
    if not cfg.listing_delay_auto:
        return configured_s
    if len(lower) < cfg.listing_delay_min_samples:
        learned = cfg.listing_delay_factor * max([*lower, *proven], default=0.0)
    else:
        learned = cfg.listing_delay_factor * percentile(lower, cfg.listing_delay_percentile)
    return max(configured_s, min(cfg.listing_delay_max_s, learned))


class ListingLag:
    """The listing delay in use for one platform instance, refreshed from the shared samples."""

    def __init__(self, store: Store, platform: str, configured_s: float, cfg: SweepConfig | None = None, *,
                 clock: Clock | None = None, bot: str = "") -> None:
        self.store = store
        self.platform = platform
        self.configured_s = float(configured_s)
        self.cfg = cfg or SweepConfig()
        self.clock = clock or store.clock or SystemClock()
        self._monotonic = monotonic_of(self.clock)
        # Another process's send time is comparable with our now only on the database's clock.
        self._wall_is_shared = shared(self.clock)
        self.bot = bot
        self._in_use = self._published = self.configured_s
        self._next_refresh = float("-inf")
        self._refreshes = 0
        self._warned = False
        self._lock = threading.Lock()
        # This process's sends: reply id -> monotonic time of the send's response (oldest first).
        self._sent: OrderedDict[str, float] = OrderedDict()
        self._prune_at = float("-inf")  # the monotonic time from which the next send prunes ``_sent``
        self._sent_lock = threading.Lock()
        # Warm-up: reply id -> (monotonic sent, longest proven lag) of this process's looks; _samples: lower_s.
        self._proven: dict[str, tuple[float, float]] = {}
        self._samples: list[float] = []
        self._proven_lock = threading.Lock()
        self.summary = LagSummary(platform, 0, 0.0, 0.0, 0.0)

    def delay_s(self) -> float:
        """The listing delay in use now, as last refreshed (no I/O: the guard reads it on its hot path)."""
        return self._in_use

    def view(self) -> dict[str, Any]:
        """This process's view for the API and status page: configured, in use, observed (as last refreshed)."""
        s = self.summary
        return {"platform": self.platform, "configured_s": self.configured_s, "in_use_s": round(self._in_use, 3),
                "auto": self.cfg.listing_delay_auto, "samples": s.samples, "observed_p50_s": s.p50_s,
                "observed_p99_s": s.p99_s, "listed_p99_s": s.upper_p99_s}

    def refresh_if_due(self) -> float:
        """Refresh from the store when the last refresh is older than ``listing_lag_refresh_s`` (the sweep's job)."""
        if self.clock.now() >= self._next_refresh:
            return self.refresh()
        return self._in_use

    def verify_delay_s(self) -> float:
        """When a close is verified: the delay in use, or what every sample so far suggests if longer.

        Verifying late costs nothing but a later look, so it follows the observed lag even with
        ``listing_delay_auto`` off and before the warm-up ends (capped like the delay in use).
        """
        in_use = self._in_use
        learned = min(self.cfg.listing_delay_max_s, self.cfg.listing_delay_factor * self.summary.p99_s)
        return max(in_use, learned)

    def step_s(self) -> float:
        """How long after a look that did not list a known reply the sweep looks again (the lag's resolution)."""
        return min(self.cfg.retry_s, max(MIN_STEP_S, self.configured_s / 2))

    def refresh(self) -> float:
        """Recompute the delay in use from the newest samples; a store failure keeps the last value."""
        if not self._lock.acquire(blocking=False):
            return self._in_use  # another thread is refreshing: its value is as good
        try:
            now = self.clock.now()
            self._next_refresh = now + self.cfg.listing_lag_refresh_s
            try:
                samples = self.store.lag_samples(self.platform, self.cfg.listing_lag_window)
                if self._refreshes % 100 == 0:
                    self.store.lag_prune(self.platform, now - RETENTION_S)
            except ReplydError as exc:  # store failure or contention: keep what we have
                log.warning("replyd.lag.refresh_failed", bot=self.bot, platform=self.platform, error=str(exc)[:200])
                return self._in_use
            self._refreshes += 1
            self.summary = LagSummary.of(self.platform, samples)
            self._samples = [lo for lo, _ in samples]
            new = effective_delay(self.configured_s, self._samples, self.cfg, self._proven_now())
            self._warn_if_short(len(samples))
            # Compared with what was last published: the warm-up raises _in_use between refreshes.
            old, self._in_use = self._published, new
            if abs(new - old) > 0.05 * max(old, 1e-9) or self._refreshes == 1:
                self._publish(old, new)
                self._published = new
            return new
        finally:
            self._lock.release()

    def _publish(self, old: float, new: float) -> None:
        """Log a change once and share it with the operator (``replyd status``) through the store."""
        if new != old:
            log.info("replyd.lag.delay_changed", bot=self.bot, platform=self.platform, old_s=round(old, 3),
                     new_s=round(new, 3), configured_s=self.configured_s, p99_s=self.summary.p99_s,
                     samples=self.summary.samples)
        try:
            self.store.set_listing_delay(self.platform, self.configured_s, new)
        except ReplydError as exc:  # store failure or contention: keep what we have
            log.warning("replyd.lag.save_failed", bot=self.bot, platform=self.platform, error=str(exc)[:200])

    def _warn_if_short(self, n: int) -> None:
        observed = self.summary.p99_s
        if self._warned or n < self.cfg.listing_delay_min_samples or observed <= FAR_BELOW * self.configured_s:
            return
        self._warned = True
        log.warning("replyd.lag.configured_short", bot=self.bot, platform=self.platform,
                    configured_s=self.configured_s, observed_p99_s=observed,
                    key=f"bots.{self.bot or '<name>'}.settings.listing_delay_s",
                    hint="the platform lists replies much later than configured: raise the key"
                    + ("" if self.cfg.listing_delay_auto else " (or set sweep.listing_delay_auto = true)"))

    def sent(self, reply_id: str) -> None:
        """Note that this process's send just made ``reply_id`` (the guard, as it closes the row): its looks
        measure the reply's age on the monotonic clock from now."""
        mono = self._monotonic()
        with self._sent_lock:
            self._sent[reply_id] = mono
            # Pruned at most once per listing_delay_max_s (or past MAX_SENT), not on every send: a reply is
            # looked at until listing_delay_max_s, so keeping one up to 3x that long costs memory only.
            if mono >= self._prune_at or len(self._sent) > MAX_SENT:
                horizon = mono - 2 * self.cfg.listing_delay_max_s
                while self._sent and (len(self._sent) > MAX_SENT or next(iter(self._sent.values())) < horizon):
                    self._sent.popitem(last=False)
                self._prune_at = mono + self.cfg.listing_delay_max_s

    def age_s(self, reply_id: str, sent_at: float, now: float) -> float | None:
        """An own reply's age at a look now, on one step-free clock; None when no such clock measured it."""
        with self._sent_lock:
            mono_sent = self._sent.get(reply_id)
        if mono_sent is not None:
            return max(0.0, self._monotonic() - mono_sent)
        if self._wall_is_shared:
            return max(0.0, now - sent_at)
        return None  # sent by another replica (or before a restart) and timed on a wall clock that can step

    def look(self, tx: Tx, sender_id: str, reply_id: str, *, sent_at: float, now: float,
             listed: bool) -> None:
        """Record one read-back's look for an own reply sent at ``sent_at`` (inside the sweep's transaction)."""
        age = self.age_s(reply_id, sent_at, now)
        if age is None:
            return
        if tx.lag_look(self.platform, sender_id, reply_id, sent_at=sent_at, age_s=age, listed=listed, now=now):
            from replyd import metrics  # here, not at the top: `replyd status` reads lag without Prometheus

            metrics.listing_lag(self.platform, age)
        if not listed:
            self._prove(reply_id, age)

    def _prove(self, reply_id: str, age_s: float) -> None:
        """Warm-up: a known reply unlisted at ``age_s`` raises the delay in use at once (no store read)."""
        if not self.cfg.listing_delay_auto or len(self._samples) >= self.cfg.listing_delay_min_samples:
            return
        mono = self._monotonic()
        with self._proven_lock:
            sent, before = self._proven.get(reply_id, (mono - age_s, 0.0))
            self._proven[reply_id] = (sent, max(before, age_s))
        new = effective_delay(self.configured_s, self._samples, self.cfg, self._proven_now())
        if new > self._in_use:
            # Only up between refreshes: the refresh publishes it (and logs the change) from the sweep's thread.
            self._in_use = new

    def _proven_now(self) -> list[float]:
        """The warm-up's proven lags of replies sent within ``listing_delay_max_s`` (older ones are dropped)."""
        with self._proven_lock:
            horizon = self._monotonic() - self.cfg.listing_delay_max_s
            self._proven = {k: v for k, v in self._proven.items() if v[0] >= horizon}
            return [lo for _, lo in self._proven.values()]

