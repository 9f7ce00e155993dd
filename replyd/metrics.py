"""Prometheus metrics: counters the guard and the sweep bump, gauges read from the store at scrape time.

The counters are process-wide (one daemon, many bots: the ``platform`` label
tells them apart) and belong to no registry of their own; ``registry(store)``
builds the one ``/metrics`` serves, adding the store's row gauges, which are
computed when scraped so they are never stale and cost nothing between
scrapes.

The guard is a hot path: every hook here is a label lookup and an increment,
O(1), with no I/O.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

from prometheus_client import PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from replyd.errors import (
    AlreadyLanded,
    BadResponse,
    ContentionError,
    DefinitelyNotSent,
    MaybeSent,
    RateLimited,
    Rejected,
    ReplydError,
    StoreError,
)

SENDS = Counter(
    "replyd_sends", "Send requests made to a platform (attempts, whatever their fate).", ["platform"], registry=None
)
SEND_SECONDS = Histogram(
    "replyd_send_seconds", "Time spent in one platform send.", ["platform"], registry=None,
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
OUTCOMES = Counter(
    "replyd_outcomes",
    "Results of Guard.post, and of API/library submissions its read-only pre-check answered, by status "
    "(posted, already_answered, in_flight, ...; store_error and contended when it raised).",
    ["platform", "status"],
    registry=None,
)
ANSWER_LATENCY = Histogram(
    "replyd_answer_latency_seconds",
    "From a parent's creation (its platform time) to replyd posting its answer; parents with no time are left out.",
    ["platform"], registry=None,
    buckets=(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, 21600.0),
)
PLATFORM_ERRORS = Counter(
    "replyd_platform_errors",
    "Errors a platform adapter reported, by operation (send, read_back, resolve) and kind.",
    ["platform", "op", "kind"],
    registry=None,
)
RESPONDER_CALLS = Counter(
    "replyd_responder_calls", "Responder calls by result (ok, declined, failed).", ["platform", "result"], registry=None
)
RESPONDER_SECONDS = Histogram(
    "replyd_responder_seconds", "Time spent in one responder call.", ["platform"], registry=None,
    buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
SWEEP_ROWS = Counter(
    "replyd_sweep_rows",
    "Rows the sweep decided, by result (closed, not_landed, gave_up, left_open, verified, reconciled, unconfirmed, "
    "moved: changed under the lease by another writer).",
    ["platform", "result"],
    registry=None,
)
DUPLICATES = Counter(
    "replyd_duplicates_detected",
    "Own replies beyond the first found on the platform for one parent.",
    ["platform"],
    registry=None,
)
TOO_LATE = Counter(
    "replyd_sends_too_late",
    "Sends the guard did not make: past the row's deadline when due to leave (a stall after the open commit).",
    ["platform"],
    registry=None,
)
SKIPS = Counter(
    "replyd_policy_skips",
    "Found parents the policy did not answer, by reason (author_is_bot, too_deep, hourly_cap, ...).",
    ["platform", "reason"],
    registry=None,
)
LISTING_LAG = Histogram(
    "replyd_listing_lag_seconds",
    "Age of an own reply (from its send's response) when the own-feed read-back first listed it.",
    ["platform"], registry=None,
    buckets=(0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)
WEBHOOKS = Counter(
    "replyd_webhook_deliveries",
    "Webhook deliveries by result (accepted, ignored, dropped, bad_signature, bad_body, unreadable, store_failed).",
    ["platform", "result"],
    registry=None,
)
WEBHOOK_DROPS = Counter(
    "replyd_webhook_dropped",
    "Parents a signed webhook delivery named outside the bot's scope (what its pollers would find), by reason.",
    ["platform", "reason"],
    registry=None,
)
POLLS = Counter(
    "replyd_polls",
    "Runs of a discovery path (inbox, search, refind) or of the sweep, by result (ok, error).",
    ["platform", "path", "result"],
    registry=None,
)
BREAKER_OPEN = Gauge(
    "replyd_breaker_open",
    "1 while the bot's write-path breaker is open (sends paused by a platform-wide failure), else 0.",
    ["platform"],
    registry=None,
)
POLL_SKIPS = Counter(
    "replyd_poll_skipped",
    "Scheduled runs of a path skipped because its previous run still ran (a slow or frozen platform).",
    ["platform", "path"],
    registry=None,
)
UNREADABLE = Counter(
    "replyd_unreadable_items",
    "Items of a page, delivery or stream a path could not read: reported, left out, and the path moved past them.",
    ["platform", "path"],
    registry=None,
)
PLATFORM_CLOCK_OFFSET = Gauge(
    "replyd_platform_clock_offset_seconds",
    "The platform's clock minus replyd's, as measured from its responses (created_at of own replies, Date).",
    ["platform"], registry=None,
)
SHARED = (SENDS, SEND_SECONDS, ANSWER_LATENCY, OUTCOMES, PLATFORM_ERRORS, RESPONDER_CALLS, RESPONDER_SECONDS, SWEEP_ROWS,
          DUPLICATES, TOO_LATE, SKIPS, POLLS, WEBHOOKS, WEBHOOK_DROPS, LISTING_LAG, POLL_SKIPS, BREAKER_OPEN,
          PLATFORM_CLOCK_OFFSET, UNREADABLE)

# The `platform` label is the bot's name (or a short instance), never a URL: instance -> label.
_LABELS: dict[str, str] = {}


def name_platform(instance: str, label: str) -> None:
    """Label series of platform ``instance`` with ``label`` (the bot's name) from now on."""
    old = platform_label(instance)
    _LABELS[instance] = label
    if old != label:
        try:  # a gauge holds its last value: the series under the old label would stay, stale
            PLATFORM_CLOCK_OFFSET.remove(old)
        except KeyError:
            pass
    # list(): one atomic copy; bots already started add children from job threads while another bot starts.
    for k in [k for k in list(_CHILDREN) if k[1] and k[1][0] == instance]:
        _CHILDREN.pop(k, None)  # rebuilt with the new label on next use
    _SEND_CHILDREN.pop(instance, None)


def platform_label(instance: str) -> str:
    """The ``platform`` label of ``instance``: the bot's name, else the instance without its URL scheme."""
    label = _LABELS.get(instance)
    if label is None:
        kind, _, rest = instance.partition(":")
        host = rest.split("://", 1)[-1].rstrip("/") if rest else ""
        label = f"{kind}:{host}" if host else instance
    return label

# Most specific first: subclasses before their bases.
_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (RateLimited, "rate_limited"),
    (DefinitelyNotSent, "definitely_not_sent"),
    (AlreadyLanded, "already_landed"),
    (MaybeSent, "maybe_sent"),
    (Rejected, "rejected"),
    (BadResponse, "bad_response"),
)
_SWEEP_RESULTS = ("closed", "not_landed", "gave_up", "left_open", "verified", "reconciled", "unconfirmed", "moved")

# Labelled children by (metric name, labels): `labels()` validates and locks on every call (~3 µs);
# a dict hit is ~0.1 µs. A racing first call at worst builds the same child twice.
_CHILDREN: dict[tuple[str, tuple[str, ...]], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    key = (metric._name, labels)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN.setdefault(key, metric.labels(platform_label(labels[0]), *labels[1:]))
    return child


def error_kind(exc: BaseException) -> str:
    """Return the metric label for an adapter error (``unexpected`` for an unmapped one)."""
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return kind
    return "platform_error" if isinstance(exc, ReplydError) else "unexpected"


def skipped(platform: str, reason: str) -> None:
    """Count one policy skip (every offer, not only the first one recorded as an event)."""
    _child(SKIPS, platform, reason).inc()


def webhook(platform: str, result: str) -> None:
    """Count one webhook delivery by what the receiver did with it."""
    _child(WEBHOOKS, platform, result).inc()


def webhook_dropped(platform: str, reason: str) -> None:
    """Count one webhook parent dropped as outside the bot's scope, by reason word."""
    _child(WEBHOOK_DROPS, platform, reason).inc()


def unreadable(platform: str, path: str) -> None:
    """Count one item a path of ``platform`` could not read (and moved past)."""
    _child(UNREADABLE, platform, path).inc()


def too_late(platform: str) -> None:
    """Count a send the guard held back because the row's deadline had passed before it could leave."""
    _child(TOO_LATE, platform).inc()


def outcome(platform: str, status: str) -> None:
    """Count one post result that did not go through ``Guard.post`` (a pre-check answered it)."""
    _child(OUTCOMES, platform, status).inc()


def breaker_state(platform: str, is_open: bool) -> None:
    """Set the ``replyd_breaker_open`` gauge of ``platform``'s bot."""
    _child(BREAKER_OPEN, platform).set(1 if is_open else 0)


def platform_error(platform: str, op: str, exc: BaseException) -> None:
    """Count one adapter error of operation ``op`` on ``platform``."""
    _child(PLATFORM_ERRORS, platform, op, error_kind(exc)).inc()


# Per platform, the two children every send touches, found with one lookup (``_child`` builds a key per call).
_SEND_CHILDREN: dict[str, tuple[Any, Any]] = {}


def _send_children(platform: str) -> tuple[Any, Any]:
    return _SEND_CHILDREN.setdefault(platform, (_child(SENDS, platform), _child(SEND_SECONDS, platform)))


class watching_send:  # used as ``with metrics.watching_send(...)``, like a function
    """Context manager around one platform send: counts it, times it, and counts its error kind."""

    __slots__ = ("platform", "seconds", "t0")

    def __init__(self, platform: str) -> None:
        self.platform = platform
        self.t0 = 0.0

    def __enter__(self) -> None:
        sends, self.seconds = _SEND_CHILDREN.get(self.platform) or _send_children(self.platform)
        sends.inc()
        self.t0 = time.perf_counter()

    def __exit__(self, exc_type: Any, exc: BaseException | None, _tb: Any) -> Literal[False]:
        self.seconds.observe(time.perf_counter() - self.t0)
        if exc is not None:
            platform_error(self.platform, "send", exc)
        return False  # never swallow: the guard maps the error


F = TypeVar("F", bound=Callable[..., Any])
P = TypeVar("P")
R = TypeVar("R")


def _count_post(guard: Any, out: Any = None, exc: BaseException | None = None, parent: Any = None) -> None:
    """Count one ``post``'s Outcome status, or the store error it raised (other errors are not outcomes); time a
    posted answer from its parent's creation."""
    if exc is None:
        label = out.status.value
        created = getattr(parent, "created_at", None)
        if label == "posted" and isinstance(created, int | float):
            _child(ANSWER_LATENCY, guard.platform.instance).observe(max(0.0, guard.clock.now() - created))
    elif isinstance(exc, ContentionError):
        label = "contended"
    elif isinstance(exc, StoreError):
        label = "store_error"
    else:
        return
    _child(OUTCOMES, guard.platform.instance, label).inc()


def observe_post(fn: F) -> F:
    """Decorate ``Guard.post`` (or the async face's): count each call's Outcome status (or its store error)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapper(guard: Any, *args: Any, **kwargs: Any) -> Any:
            """Await the async face's ``post`` and count its result."""
            try:
                out = await fn(guard, *args, **kwargs)
            except BaseException as exc:
                _count_post(guard, exc=exc)
                raise
            _count_post(guard, out, parent=args[0] if args else kwargs.get("parent"))
            return out

        return awrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(guard: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``Guard.post`` and count its result."""
        try:
            out = fn(guard, *args, **kwargs)
        except BaseException as exc:
            _count_post(guard, exc=exc)
            raise
        _count_post(guard, out, parent=args[0] if args else kwargs.get("parent"))
        return out

    return wrapper  # type: ignore[return-value]


def responder_called(platform: str, seconds: float, text: object = None, *, failed: bool = False) -> None:
    """Count one responder call by result and time it (both faces); a streamed answer counts as written."""
    _child(RESPONDER_SECONDS, platform).observe(seconds)
    written = text.strip() if isinstance(text, str) else text is not None
    result = "failed" if failed else "ok" if written else "declined"
    _child(RESPONDER_CALLS, platform, result).inc()


def timed_responder(compose: Callable[[P], R], parent: P, platform: str) -> R:
    """Call the responder once, counting the call by result and timing it; errors propagate."""
    t0 = time.perf_counter()
    try:
        text = compose(parent)
    except BaseException:
        responder_called(platform, time.perf_counter() - t0, failed=True)
        raise
    responder_called(platform, time.perf_counter() - t0, text)
    return text


def listing_lag(platform: str, seconds: float) -> None:
    """Observe one own reply's listing lag (its age when a read-back first listed it)."""
    _child(LISTING_LAG, platform).observe(seconds)


def platform_clock_offset(platform: str, seconds: float) -> None:
    """Set the measured offset of platform instance ``platform``'s clock from replyd's."""
    _child(PLATFORM_CLOCK_OFFSET, platform).set(seconds)


def poll(bot: str, path: str, *, ok: bool) -> None:
    """Count one run of a path of ``bot`` (its label is the bot's name already)."""
    POLLS.labels(bot, path, "ok" if ok else "error").inc()


def poll_skipped(bot: str, path: str) -> None:
    """Count one skipped run of a path of ``bot`` (its previous run still ran)."""
    POLL_SKIPS.labels(bot, path).inc()


def sweep_pass(platform: str, res: Any) -> None:
    """Count one sweep pass's decisions (a ``SweepResult``)."""
    for name in _SWEEP_RESULTS:
        n = getattr(res, name, 0)
        if n:
            _child(SWEEP_ROWS, platform, name).inc(n)
    if res.duplicates:
        _child(DUPLICATES, platform).inc(res.duplicates)


class StoreCollector:
    """Row gauges read from the store at scrape time; a store outage reports ``replyd_store_up 0``.

    The rows read are kept ``cache_s`` seconds: scrapes of an opened ``/metrics`` cost the store two
    queries that often at most, however often they come. A failed read is not kept; 0 reads every scrape."""

    def __init__(self, store: Any, cache_s: float = 0.0) -> None:
        self.store = store
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._read: tuple[float, Any, Any] | None = None  # (read at, counts, oldest open rows)

    def _rows(self) -> tuple[float, Any, Any]:
        now = self.store.clock.now()
        with self._lock:  # concurrent scrapes wait for one read instead of each making their own
            if self._read is None or not 0 <= now - self._read[0] < self.cache_s:
                self._read = (now, self.store.counts(), self.store.oldest_open(1))
            return now, self._read[1], self._read[2]

    def describe(self) -> list[Metric]:
        """Declare nothing up front, so registering never queries the store."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield store_up, rows by state, open rows, duplicates found and the oldest open row's age."""
        from replyd import store as st

        up = GaugeMetricFamily("replyd_store_up", "1 when the answered-log answered the scrape's queries.")
        try:
            now, counts, oldest = self._rows()
        except ReplydError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        rows = GaugeMetricFamily("replyd_rows", "Rows of the answered-log by platform and state.", labels=["platform", "state"])
        open_rows = GaugeMetricFamily("replyd_open_rows", "Rows in state open (sent or sending, not yet closed).",
                                      labels=["platform"])
        for plat in sorted({p for p, _ in counts}):
            # Every state for every platform, so a series never vanishes when it reaches zero.
            label = platform_label(plat)
            for state in st.STATES:
                rows.add_metric([label, state], counts.get((plat, state), 0))
            open_rows.add_metric([label], counts.get((plat, st.OPEN), 0))
        yield rows
        yield open_rows
        dups = GaugeMetricFamily("replyd_duplicates", "Own replies beyond the first found for one parent, as the "
                                 "answered-log recorded them (sweep and adopt), by bot.", labels=["platform"])
        try:
            found = self.store.duplicate_counts()
        except ReplydError:
            found = {}
        per = {platform_label(plat): 0 for plat, _ in counts}  # a series for every bot, 0 included
        for (plat, _sender), n in found.items():
            per[platform_label(plat)] = per.get(platform_label(plat), 0) + n
        for label, n in sorted(per.items()):
            dups.add_metric([label], n)
        yield dups
        age = GaugeMetricFamily("replyd_oldest_open_row_age_seconds", "Age of the oldest open row; 0 when none is open.")
        first = oldest[0] if oldest else None
        age.add_metric([], max(0.0, now - (first.opened_at or first.created_at)) if first else 0.0)
        yield age


class LivenessCollector:
    """Per bot and path, read at scrape time: last success, failures in a row, stale, failing, the run in flight;
    per bot: up (started) and its write breaker."""

    def __init__(self, liveness: Any) -> None:
        self.liveness = liveness

    def describe(self) -> list[Metric]:
        """Declare nothing up front."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield each tracked path's and each configured bot's gauges."""
        last = GaugeMetricFamily("replyd_poll_last_success_timestamp_seconds",
                                 "Unix time of the last successful run of a path (0: none yet).",
                                 labels=["platform", "path"])
        fails = GaugeMetricFamily("replyd_poll_consecutive_failures", "Failed runs of a path since its last success.",
                                  labels=["platform", "path"])
        stale = GaugeMetricFamily("replyd_poll_stale", "1 when a path had no success for longer than its staleness bound.",
                                  labels=["platform", "path"])
        failing = GaugeMetricFamily("replyd_poll_failing",
                                    "1 when a path failed health.failures_not_ready runs in a row or its run in flight "
                                    "is stuck (the daemon is then not ready).", labels=["platform", "path"])
        running = GaugeMetricFamily("replyd_poll_running_seconds",
                                    "How long the run of a path in flight has run (0: none in flight).",
                                    labels=["platform", "path"])
        up = GaugeMetricFamily("replyd_bot_up", "1 when the bot logged in and its jobs run; 0 while its start is "
                               "retried (platform unreachable) or after its login was refused.", labels=["platform"])
        attempts = GaugeMetricFamily("replyd_bot_start_failures",
                                     "Failed start attempts of a bot not running yet (0 once it runs).",
                                     labels=["platform"])
        for bot, b in sorted(self.liveness.snapshot().items()):
            for path, p in sorted(b["paths"].items()):
                last.add_metric([bot, path], p["last_ok"] or 0.0)
                fails.add_metric([bot, path], p["failures"])
                stale.add_metric([bot, path], 1 if p["stale"] else 0)
                failing.add_metric([bot, path], 1 if p["failing"] else 0)
                running.add_metric([bot, path], p["running_s"] or 0.0)
            start = b.get("start")
            if start is not None:
                up.add_metric([bot], 1 if start["state"] == "running" else 0)
                attempts.add_metric([bot], 0 if start["state"] == "running" else start["attempts"])
        yield from (last, fails, stale, failing, running, up, attempts)  # replyd_breaker_open: BREAKER_OPEN


def build_info() -> Metric:
    """``replyd_build_info{version, python}`` = 1."""
    import platform as pyplatform

    from replyd import __version__

    info = GaugeMetricFamily("replyd_build_info", "replyd's version and Python's, as labels; always 1.",
                             labels=["version", "python"])
    info.add_metric([__version__, pyplatform.python_version()], 1)
    return info


class _Static:
    """A collector yielding fixed metric families."""

    def __init__(self, *families: Metric) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        """Yield the families."""
        yield from self.families


def registry(store: Any | None = None, liveness: Any | None = None, *, store_cache_s: float = 0.0) -> CollectorRegistry:
    """Return a registry: the process-wide counters, build info, process and Python platform collectors, and,
    given a store and a liveness record, the row gauges (rows kept ``store_cache_s``) and each path's last success."""
    reg = CollectorRegistry(auto_describe=False)
    for m in SHARED:
        reg.register(m)
    reg.register(_Static(build_info()))
    for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR):
        reg.register(c)
    if store is not None:
        reg.register(StoreCollector(store, store_cache_s))
    if liveness is not None:
        reg.register(LivenessCollector(liveness))
    return reg
