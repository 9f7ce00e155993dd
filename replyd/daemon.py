"""The daemon: wires store, adapters, guards, pollers and the sweep onto one scheduler.

With ``[api] enabled`` it also serves the sidecar API and status page
(``replyd.api``) from a thread; the API starts before the bots log in, so
``/healthz`` answers at once and ``/readyz`` says when every bot is ready.

Bots start and fail independently. At start every bot's adapter and
responder are built (a config error stops the daemon: exit 2) and every bot
tries its login once, all at the same time; a refused login (HTTP 401/403)
stops the daemon too, with one line naming the bot and the variable. A bot
whose platform cannot be reached (refused connection, DNS, 5xx, timeout)
keeps retrying its start in the background, waiting ``health.start_retry_s``
doubled per failure up to ``health.start_retry_max_s``, not ready and shown
with its reason, while the others run; once it logs in, its pollers, sweep,
stream or webhooks start and it answers its backlog. Each bot is swept on
its own job, so one platform's read-back errors are never another bot's.

Threads do not grow with the bots: every scheduled run takes a
thread of one pool of ``daemon.job_threads``. Every bot's polls are slots
of one timetable (``replyd.timetable``: one heap, one thread) that hands
each due poll to the pool as a one-shot run: a bot's run never overlaps
itself (a run due while the last one still runs or waits for a thread is
skipped, ``replyd.poll.skipped``); the pool's queue is first in, first out,
so one slow platform holds at most one thread per path and never starves
the others.
The sweep and the re-offer are one daemon-wide tick each: one store query
names the bots with rows due, and only those get a one-shot run (never two
of one bot at once); the others' sweep is recorded as a successful look. A
failed login's next attempt is a one-shot job too, and one thread watches
the sends of every bot's guard.

Reload (SIGHUP): a thread of its own reads and checks the config again, then diffs the bots by name.
Added bots log in and start as at start; removed ones leave the timetable, the ticks, the fleet and
liveness at once, their runs under way finish and then their guard closes; changed ones do both. The
other bots' polls never pause. A broken file, or a change outside ``[[bots]]``, is refused in one line.

Shutdown (SIGTERM/SIGINT): stop claiming at once, let running API requests
and jobs finish within ``grace_s``, leave open rows to the sweep of the next
start, exit 0.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import stamina
import structlog
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from apscheduler.executors.pool import BasePoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from replyd import library, metrics
from replyd import store as st
from replyd.breaker import Breaker, BreakerListener
from replyd.clock import Clock, DatabaseClock, SystemClock
from replyd.config import BotConfig, Config
from replyd.errors import ConfigError, DefinitelyNotSent, MaybeSent, PlatformError, ReplydError
from replyd.fleet import Fleet
from replyd.guard import Guard
from replyd.jobs import JobPool
from replyd.lag import ListingLag
from replyd.liveness import SWEEP, Heartbeat, Liveness, error_words
from replyd.log import get_logger
from replyd.pipeline import Pipeline
from replyd.platforms.base import (Identity, MeasuresClock, Platform, ResumableStream, StreamSource, WebhookSource,
                                   make_platform, reads_back)
from replyd.platforms._http import make_client
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.responders import Responder, make_responder, runner_bound_s
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from replyd.timetable import Timetable

if TYPE_CHECKING:
    from replyd.api import Api, ApiServer
    from replyd.hooks import Receiver
    from replyd.streams import StreamRunner

# The timetable wakes on these ticks and fires every poll due by then (see replyd.timetable for the figures).
POLL_TICK_S = 0.25

log = get_logger("replyd.daemon")


class _NoSkipWarning(logging.Filter):
    """Drop APScheduler's unlabelled "skipped: maximum number of running instances" warning (see ``_on_skipped``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but that one."""
        return "maximum number of running instances" not in str(record.msg)


_SKIP_FILTER = _NoSkipWarning()


class _JobPool(BasePoolExecutor):
    """APScheduler's thread-pool executor over the daemon's one job pool, which one-shot runs are submitted to too
    (not as APScheduler date jobs: a date job's removal after it ran races the scheduler's shutdown)."""

    def __init__(self, pool: JobPool) -> None:
        super().__init__(pool)


@dataclass
class BotRuntime:
    """Everything one configured bot runs with."""

    cfg: BotConfig
    platform: Platform
    identity: Identity
    guard: Guard
    pipeline: Pipeline
    pollers: Pollers


def _passing(exc: Exception) -> bool:
    """Whether a failed login may be a passing outage (retried): never refused credentials."""
    return isinstance(exc, (DefinitelyNotSent, MaybeSent)) and getattr(exc, "status", None) not in (401, 403)


def _login_error(bc: BotConfig, platform: Platform, exc: PlatformError) -> ReplydError:
    """The one-line error of a failed login: refused credentials name the variable that held them."""
    if exc.status in (401, 403):
        names = bc.variables()
        held = (f"the environment variable{'s' if len(names) > 1 else ''} {', '.join(names)}" if names
                else "the credentials in the config file")
        return ConfigError(f"bot {bc.name}: {platform.instance} refused the login (HTTP {exc.status}): check {held}")
    return type(exc)(f"bot {bc.name}: cannot log in at {platform.instance}: {exc.detail or exc}", status=exc.status)


def login(bc: BotConfig, platform: Platform) -> Identity:
    """Ask the platform who the bot is; retry a passing outage, never refused credentials.

    Every failure names the bot; refused credentials name the variable that held them.
    """
    try:
        # retry_context, not the decorator: its retry log names no callable and shows no arguments.
        for attempt in stamina.retry_context(on=_passing, attempts=5, wait_initial=0.5, wait_max=10.0):
            with attempt:
                return platform.whoami()
    except PlatformError as exc:
        raise _login_error(bc, platform, exc) from None
    raise AssertionError("unreachable")  # pragma: no cover - retry_context either returns or raises


class NotAdopted(ReplydError):
    """A bot's start-up adoption did not finish (a read failed or was inconclusive): no path may run yet."""


def adopt_window(store: Store, bc: BotConfig, platform: Platform, identity: Identity, clock: Clock,
                 owner: str) -> library.AdoptResult | None:
    """Record the bot's own replies to every parent its paths can find now, before any of them runs.

    Every start does this, whatever the store holds: a store that is new, lost or restored from an older
    backup has no row for parents answered since, and would answer them again. Parents with a row cost no
    read-back. None when the platform cannot list own replies (nothing to adopt from). NotAdopted unless
    every parent was read back conclusively (what was read is recorded; the next attempt reads the rest).
    """
    if not reads_back(platform):
        return None
    pc = bc.pollers
    try:
        parents = library.window_parents(store, platform, identity.sender_id, lookback_s=pc.refind_lookback_s,
                                         now=clock.now(), queries=pc.search_queries if pc.search_interval_s else ())
    except PlatformError as exc:
        raise NotAdopted(f"adopting: cannot list its parents: {exc.detail or exc}") from None
    res = library.adopt(store, platform, identity, parents, owner=owner)
    log.info("replyd.bot.adopted", bot=bc.name, platform=platform.instance, parents=len(parents),
             adopted=len(res.adopted), tracked=len(res.tracked), unanswered=len(res.unanswered),
             unknown=len(res.unknown))
    if res.unknown:
        raise NotAdopted(f"adopting: {len(res.unknown)} parent(s) not read back conclusively yet")
    return res


def login_once(bc: BotConfig, platform: Platform) -> Identity:
    """Ask the platform who the bot is, once (the daemon retries a passing outage itself, in the background)."""
    try:
        return platform.whoami()
    except PlatformError as exc:
        raise _login_error(bc, platform, exc) from None


def build_guard(cfg: Config, bc: BotConfig, store: Store, http: httpx.Client, clock: Clock,
                owner: str, *, platform: Platform | None = None,
                identity: Identity | None = None,
                breaker_listener: BreakerListener | None = None,
                watch_interval_s: float | None = 1.0) -> tuple[Platform, Identity, Guard]:
    """Build one bot's adapter (unless given), log it in (unless its identity is given), return both and its guard.

    ``watch_interval_s=None``: the guard starts no send-watch thread of its own (the daemon watches every guard
    from one).
    """
    # Each adapter owns its listing-delay default (Discourse 30 s, GitHub 60 s…); never override it here.
    platform = platform or make_platform(bc.platform, bc.settings, http=http, clock=clock)
    identity = identity or login(bc, platform)
    send_timeout_s = cfg.guard.send_timeout_s
    adapter_timeout_s = float(bc.settings.get("timeout_s", 15.0))
    if send_timeout_s < adapter_timeout_s:
        # A live send may then outlast the row's deadline: the sweep could look before it lands (the
        # late close and the retry's verifying read-back still catch it, but later than they should).
        log.warning("replyd.bot.send_timeout_short", bot=bc.name, guard_send_timeout_s=send_timeout_s,
                    adapter_timeout_s=adapter_timeout_s, hint="set guard.send_timeout_s >= the adapter's timeout_s")
    # One listing delay per bot, shared by its guard (deadlines) and the sweep (looks); learned per instance.
    lag = ListingLag(store, platform.instance, platform.listing_delay_s, cfg.sweep, clock=clock, bot=bc.name)
    guard = Guard(
        store,
        platform,
        identity,
        clock=clock,
        lag=lag,
        owner=owner,
        max_attempts=cfg.guard.max_attempts,
        send_timeout_s=send_timeout_s,
        compose_lease_s=cfg.guard.compose_lease_s,
        stream_edit_interval_s=cfg.guard.stream_edit_interval_s,
        stream_idle_s=cfg.guard.stream_idle_s,
        dry_run=cfg.guard.dry_run or bc.policy.dry_run,
        responder_backoff_s=cfg.guard.responder_backoff_s,
        responder_backoff_max_s=cfg.guard.responder_backoff_max_s,
        watch_interval_s=watch_interval_s,
        breaker=Breaker(cfg.guard.breaker, clock, bot=bc.name, platform=platform.instance,
                        listener=breaker_listener),
    )
    return platform, identity, guard


def build_bot(cfg: Config, bc: BotConfig, store: Store, http: httpx.Client, clock: Clock, owner: str,
              heartbeat: Heartbeat | None = None, *, platform: Platform | None = None,
              identity: Identity | None = None, responder: Responder | None = None,
              breaker_listener: BreakerListener | None = None, watch_interval_s: float | None = 1.0) -> BotRuntime:
    """Build one bot's adapter, identity, guard, pipeline and pollers (reusing any of them already built)."""
    platform, identity, guard = build_guard(cfg, bc, store, http, clock, owner, platform=platform, identity=identity,
                                            breaker_listener=breaker_listener, watch_interval_s=watch_interval_s)
    rsettings = bc.responder.model_dump(exclude={"kind"})
    responder = responder or make_responder(bc.responder.kind, rsettings)
    # The runner's bound is a backstop: a responder's own timeout (which also kills a child) fires first.
    responder_timeout_s = runner_bound_s(responder, rsettings)
    if responder_timeout_s >= cfg.guard.compose_lease_s:
        # The composing lease would expire mid-call: another replica could call the responder too
        # (never send twice: opening checks the lease owner), wasting a call.
        log.warning("replyd.bot.responder_timeout_long", bot=bc.name, responder_timeout_s=responder_timeout_s,
                    compose_lease_s=cfg.guard.compose_lease_s, hint="set guard.compose_lease_s above the responder's timeout_s")
    pipeline = Pipeline(guard, responder, Policy.from_config(bc.policy), clock, responder_timeout_s=responder_timeout_s)
    pollers = Pollers(store, platform, pipeline, bc.pollers, clock, heartbeat)
    log.info("replyd.bot.ready", bot=bc.name, platform=platform.instance, sender_id=identity.sender_id)
    return BotRuntime(bc, platform, identity, guard, pipeline, pollers)


@dataclass
class Prepared:
    """A configured bot before its login: adapter and responder built (their config errors raised) at start."""

    cfg: BotConfig
    platform: Platform
    responder: Responder
    timeout_s: float  # the adapter's per-request timeout: bounds how long a path may go without a success


class Daemon:
    """The long-running replyd process."""

    def __init__(self, cfg: Config, *, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.owner = cfg.replica_id or st.make_owner()
        self.stopping = threading.Event()
        self.grace_expired = False  # set by stop() when running jobs outlived the grace
        self.fatal: str | None = None  # why the daemon must stop on its own (run_forever exits 2)
        self._fatal_set = threading.Event()
        self._clock_stale = threading.Event()  # set on a new database connection: re-anchor the clock
        self.store: Store | None = None
        self.http: httpx.Client | None = None
        self.bots: list[BotRuntime] = []
        self.sweepers: dict[str, Sweeper] = {}  # by bot name: each bot sweeps on its own job
        self.scheduler: BackgroundScheduler | None = None
        # Every bot's polls: one heap and one thread (APScheduler's job per bot and path cost 0.25 ms a run).
        self.timetable = Timetable(self._fire_poll, tick_s=POLL_TICK_S)
        self._polls: dict[str, Callable[[], None]] = {}  # "bot:path" -> its run
        self.guards: dict[str, Guard] = {}  # by bot name, for the API; filled as bots log in
        self.api: ApiServer | None = None
        self.hooks: Receiver | None = None
        self.streams: list[StreamRunner] = []
        self.liveness: Liveness | None = None
        self._start_lock = threading.Lock()  # a bot started in the background joins the running daemon under it
        self._starting: set[str] = set()  # bots whose login is retried (a one-shot job per attempt)
        self._busy: set[str] = set()  # one-shot jobs (sweep, re-offer, start) queued or running, by job id
        self._busy_lock = threading.Lock()
        self._jobs: JobPool | None = None  # the one job pool: polls first, then the scheduler's and one-shot runs
        self._keys: dict[str, tuple[str, str]] = {}  # started bot -> (platform instance, sender id)
        self._watcher: threading.Thread | None = None  # the one send watch over every bot's guard
        self._secrets: dict[str, str] = {}  # webhook secrets by push bot name
        self._verify_tokens: dict[str, str] = {}  # webhook verify tokens by push bot name (set at start)
        self.fleet: Fleet | None = None  # on PostgreSQL: which bots' discovery runs here (replyd.fleet)
        self._runners: dict[str, StreamRunner] = {}  # the push streams held open, by bot name
        self._api: Api | None = None
        self._wanted: dict[str, Prepared] = {}  # configured bots by name: a start whose Prepared is not here stops
        self._retired: list[BotRuntime] = []  # bots a reload removed, until their poll runs under way end
        self._reload_lock = threading.Lock()
        self._inflight: dict[int, int] = {}  # poll runs under way, by id() of their BotRuntime

    def start(self) -> None:
        """Open the store, start the API if configured, log every bot in (retrying unreachable ones in the
        background), and start the scheduled jobs."""
        ac = self.cfg.api
        token: str | None = None
        # Webhook secrets first: a push bot with no secret, or no API to receive on, never starts.
        push = {bc.name: bc.push for bc in self.cfg.bots if bc.push is not None and bc.push.webhook}
        if push and not ac.enabled:
            raise ConfigError(f"bots ({', '.join(push)}): push webhooks arrive through the API: set api.enabled = true")
        self._secrets = {name: pc.secret() for name, pc in push.items()}
        self._verify_tokens = {name: pc.verify_token() for name, pc in push.items() if pc.verify_token_env}
        if ac.enabled:
            # Imported here: uvicorn and starlette cost nothing when the API is off (sweep, adopt, ...).
            from replyd.api import Api, ApiServer, check_bind

            token = ac.token()
            check_bind(ac.host, token)  # before anything is opened: a public API without a token never starts
        self.store = Store.open(self.cfg.store.url or None, clock=self.clock, migrate=self.cfg.store.auto_migrate,
                                claim_commit=self.cfg.store.claim_commit)
        self._use_db_clock()
        self._check_claim_commit()
        hc = self.cfg.health
        self.liveness = Liveness(self.clock, stale_after_intervals=hc.stale_after_intervals, stale_min_s=hc.stale_min_s,
                                 failures_not_ready=hc.failures_not_ready)
        # Every send through this client ends within guard.send_timeout_s in total (replyd.deadline). One client
        # for every bot: its pool keeps a connection per host for each job thread that may be talking to it.
        threads = self.cfg.daemon.job_threads
        self.http = make_client(self.cfg.guard.send_timeout_s,
                                limits=httpx.Limits(max_connections=4 * threads + 16, max_keepalive_connections=threads))
        # Every config error (settings, responder, push kind) before anything is served or contacted.
        prepared = [self._prepare(bc) for bc in self.cfg.bots]
        self._wanted = {p.cfg.name: p for p in prepared}
        self._start_fleet(prepared)
        for bc in self.cfg.bots:
            self.liveness.expect(bc.name)
        if ac.enabled:
            from replyd.hooks import Receiver

            # Filled as push bots log in, like the guards; until then a delivery is checked against its secret.
            self.hooks = Receiver({}, waiting={n: (pc.kind, self._secrets[n]) for n, pc in push.items()})
            api = Api(self.store, self.guards, expected=[b.name for b in self.cfg.bots], token=token, host=ac.host,
                      hosts=ac.hosts, open_routes=ac.open_routes, refresh_s=ac.refresh_s,
                      max_body_bytes=ac.max_body_bytes, liveness=self.liveness, hooks=self.hooks,
                      webhook_bots=list(push))
            self._api = api
            self.api = ApiServer(api.app, host=ac.host, port=ac.port, grace_s=self.cfg.guard.send_timeout_s).start()
        # Upkeep (a sweep pass, a re-offer) waits for the polls at most one sweep interval (replyd.jobs).
        self._jobs = JobPool(threads, patience_s=self.cfg.sweep.interval_s)
        try:
            self.scheduler = BackgroundScheduler(
                # A fixed pool, whatever the number of bots: a run that finds every thread busy waits in the pool's
                # queue (first in, first out). coalesce: runs missed while waiting are one run, not a burst.
                executors={"default": _JobPool(self._jobs)},
                # misfire_grace_time=None: a run the scheduler itself starts late (a stopped process, a busy
                # interpreter) still runs once, coalesced, rather than being dropped until the next interval.
                job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            )
            # A run still going when the next is due is one labelled event, not APScheduler's bare warning.
            logging.getLogger("apscheduler.scheduler").addFilter(_SKIP_FILTER)
            self.scheduler.add_listener(self._on_skipped, EVENT_JOB_MAX_INSTANCES)
            if isinstance(self.clock, DatabaseClock):
                self.scheduler.add_job(self.sync_clock, "interval", seconds=self.cfg.store.clock_sync_s, id="clock")
            sc = self.cfg.sweep
            # Jitter spreads sweep passes across replicas (leases already keep them from sharing rows).
            self.scheduler.add_job(self.sweep_tick, "interval", seconds=sc.interval_s, jitter=sc.interval_s / 2,
                                   id=SWEEP, next_run_time=_now_dt())
            if any(bc.pollers.refind_interval_s <= 0 for bc in self.cfg.bots):
                self.scheduler.add_job(self.reoffer_tick, "interval", seconds=sc.interval_s, id="reoffer",
                                       next_run_time=_now_dt())
            self.scheduler.start()
            self.timetable.start()
            first = self._first_logins(prepared)
            for got in first:
                # A refused login or a platform that answers "no" (not an outage) stops the daemon, in config order.
                if isinstance(got, BaseException) and not (isinstance(got, PlatformError) and _passing(got)
                                                           or isinstance(got, NotAdopted)):
                    raise got
            for p, got in zip(prepared, first, strict=True):
                if isinstance(got, Identity):
                    self._start_bot(p, got)
                else:
                    self._retry_start(p, got)
        except BaseException:
            self._abort()
            raise
        log.info("replyd.daemon.started", owner=self.owner, bots=len(self.bots), starting=len(self._starting),
                 store=self.store.url, job_threads=threads)

    def _prepare(self, bc: BotConfig) -> Prepared:
        """Build one bot's adapter and responder and check its push kind: config errors only, no request."""
        assert self.http is not None
        platform = make_platform(bc.platform, bc.settings, http=self.http, clock=self.clock)
        responder = make_responder(bc.responder.kind, bc.responder.model_dump(exclude={"kind"}))
        if bc.push is not None and bc.push.webhook and not isinstance(platform, WebhookSource):
            raise ConfigError(f"bots.{bc.name}.push: the {bc.platform} adapter cannot read webhook deliveries")
        if bc.push is not None and not bc.push.webhook and not isinstance(platform, StreamSource):
            raise ConfigError(f"bots.{bc.name}.push: the {bc.platform} adapter has no push stream")
        return Prepared(bc, platform, responder, float(bc.settings.get("timeout_s", 15.0)))

    def _first_logins(self, prepared: list[Prepared]) -> list[Identity | BaseException]:
        """Every bot's first login attempt, at the same time (one slow platform delays no other's verdict)."""
        def attempt(p: Prepared) -> Identity | BaseException:
            try:
                identity = login_once(p.cfg, p.platform)
            except Exception as exc:  # judged by the caller: refused, outage, or a bug
                return exc
            try:
                self._adopt(p, identity)
            except Exception as exc:  # retried like an outage: the bot's paths wait for it
                return exc if isinstance(exc, NotAdopted) else NotAdopted(f"adopting: {error_words(exc)}")
            return identity

        if not prepared:
            return []
        with ThreadPoolExecutor(max_workers=min(self.cfg.daemon.job_threads, len(prepared)),
                                thread_name_prefix="replyd-login") as pool:
            return list(pool.map(attempt, prepared))

    def _retry_start(self, p: Prepared, exc: BaseException) -> None:
        """Keep trying ``p``'s login in the background (doubling waits, capped); start the bot once it works.

        Each attempt is a one-shot job on the pool, the next scheduled by the last: a thousand bots whose
        platform is down cost no thread while they wait.
        """
        hc, name = self.cfg.health, p.cfg.name
        self._starting.add(name)
        self._start_waiting(p, exc, hc.start_retry_s)
        self._attempt_later(p, hc.start_retry_s)

    def _attempt_later(self, p: Prepared, wait_s: float) -> None:
        """Schedule ``p``'s next login attempt in ``wait_s``; a failure schedules the one after, waiting twice as long."""
        assert self.scheduler is not None
        name, max_s = p.cfg.name, self.cfg.health.start_retry_max_s

        def attempt() -> None:
            if self.stopping.is_set() or self._wanted.get(name) is not p:
                return  # stopping, or a reload removed or changed the bot: its attempts end here
            try:
                identity = login_once(p.cfg, p.platform)
            except ConfigError as err:  # refused credentials: tried again only when a reload changes the bot
                assert self.liveness is not None
                self.liveness.start_failed(name, str(err))
                log.error("replyd.bot.start_failed", bot=name, platform=p.platform.instance, error=str(err))
                self._starting.discard(name)
                return
            except Exception as err:  # an outage (or an adapter's bug): wait longer, try again
                self._start_waiting(p, err, min(wait_s * 2, max_s))
                self._attempt_later(p, min(wait_s * 2, max_s))
                return
            try:
                self._adopt(p, identity)
                self._start_bot(p, identity)
            except Exception as err:  # e.g. the store failed while building it: try again later
                self._start_waiting(p, err, min(wait_s * 2, max_s))
                self._attempt_later(p, min(wait_s * 2, max_s))
                return
            if self._wanted.get(name) is p:  # else a reload's new start of this name owns the flag
                self._starting.discard(name)

        if not self.stopping.is_set():
            # No job id: APScheduler removes a one-shot job by id after submitting it, which could remove this
            # attempt's successor when it reuses the id (the attempt may finish first).
            self.scheduler.add_job(attempt, "date", run_date=_now_dt(wait_s), name=f"{name}:start")

    def _adopt(self, p: Prepared, identity: Identity) -> None:
        """Run ``adopt_window`` for a logged-in bot before it starts (unless its config turns it off)."""
        assert self.liveness is not None and self.store is not None
        if not p.cfg.pollers.adopt_at_start:
            return
        self.liveness.adopting(p.cfg.name)
        adopt_window(self.store, p.cfg, p.platform, identity, self.clock, self.owner)

    def _start_waiting(self, p: Prepared, exc: BaseException, wait_s: float) -> None:
        """Record and log one failed start attempt of ``p``; the next is in ``wait_s``."""
        assert self.liveness is not None
        reason = (str(exc).splitlines() or [""])[0][:300] or type(exc).__name__
        if not isinstance(exc, ReplydError):
            reason = f"{type(exc).__name__}: {reason}"
        self.liveness.starting(p.cfg.name, reason, wait_s)
        log.warning("replyd.bot.start_retrying", bot=p.cfg.name, platform=p.platform.instance, error=reason,
                    retry_in_s=round(wait_s, 1))

    def _start_bot(self, p: Prepared, identity: Identity) -> None:
        """Build a logged-in bot and join it to the running daemon: guard, API, hooks, stream, jobs, sweep."""
        assert self.liveness is not None and self.store is not None and self.http is not None
        assert self.scheduler is not None
        bc, name = p.cfg, p.cfg.name
        with self._start_lock:
            if self.stopping.is_set() or self._wanted.get(name) is not p:
                return  # stopping, or a reload removed or changed the bot while it logged in
            bot = build_bot(self.cfg, bc, self.store, self.http, self.clock, self.owner, self.liveness.beat(name),
                            platform=p.platform, identity=identity, responder=p.responder,
                            breaker_listener=self.liveness,  # an open breaker makes the bot not ready
                            watch_interval_s=None)  # watched by the daemon's one send watch (_watch_sends)
            self._watch(bot, p.timeout_s)
            sc = self.cfg.sweep
            self.sweepers[name] = Sweeper(
                self.store, [Bot(bot.platform, bot.identity, bot.guard.lag, bot.guard.breaker, name=name)], clock=self.clock,
                owner=self.owner, batch=sc.batch, lease_s=sc.lease_s, retry_s=sc.retry_s,
                max_attempts=self.cfg.guard.max_attempts, on_duplicate=sc.on_duplicate, config=sc,
                guard_config=self.cfg.guard,
            )
            self.bots.append(bot)
            self.guards[name] = bot.guard
            if bc.push is not None and bc.push.webhook and self.hooks is not None:
                self._add_hook(name, bc.push.kind, self._secrets[name], bot)
            elif bc.push is not None and self._discovers(name):
                self._runners[name] = self._add_stream(name, bot).start()
            pc = bc.pollers
            for path, every_s, fn in (
                ("inbox", bc.inbox_interval_s(), bot.pollers.inbox),
                ("search", pc.search_interval_s if pc.search_queries else 0, bot.pollers.search),
                ("refind", pc.refind_interval_s, bot.pollers.refind),
            ):
                if every_s > 0:
                    job_id = f"{name}:{path}"
                    self._polls[job_id] = self._current(job_id, bot, self._tracked(
                        name, path, _with_context(self._leased(name, path, fn), bot=name, platform=bot.platform.instance)))
                    self.timetable.add(job_id, every_s, jitter_s=pc.jitter_s or 0.0)
            # Its sweep (and, with re-find off, the re-offer of its waiting rows) runs from the daemon's ticks.
            self._keys[name] = (bot.platform.instance, bot.identity.sender_id)
            self._start_watch()
            # Its backlog at once, not at the next tick: rows left open by the last run, rows waiting for a path.
            self._once(f"{name}:{SWEEP}", self.sweep_bot, name)
            if pc.refind_interval_s <= 0:
                self._once(f"{name}:reoffer", bot.pollers.reoffer_guarded)
            self.liveness.started(name)
        log.info("replyd.bot.started", bot=name, platform=bot.platform.instance)

    # -- reload (SIGHUP) --------------------------------------------------------------------------

    def reload_from(self, load: Callable[[], Config]) -> dict[str, list[str]] | None:
        """Load and check the config again (``load``) and run its bots; refused in one line, nothing changed."""
        try:
            got = self.reload(load())
        except Exception as exc:  # a broken file, a section that needs a restart, or a bug: the running set stays
            words = str(exc) if isinstance(exc, ReplydError) else f"{type(exc).__name__}: {exc}"
            log.error("replyd.daemon.reload_refused", error=" ".join(words.split())[:1000],
                      hint="the running bots keep going; fix the file and reload again")
            return None
        return got

    def reload(self, cfg: Config) -> dict[str, list[str]] | None:
        """Run ``cfg``'s bots from now on, diffed by name: start the added, stop the removed, restart the changed.

        ``cfg`` is loaded and preflighted by the caller. A bot changed when its section or a secret it resolves
        differs. A change outside ``[[bots]]`` (``mcp`` aside: ``run`` serves none) needs a restart: ConfigError
        naming the keys, and nothing changes. A removed bot's runs under way finish; its guard closes after.
        """
        with self._reload_lock:
            if self.stopping.is_set():
                return None
            moved = _restart_keys(self.cfg, cfg)
            if moved:
                raise ConfigError(f"{cfg.source}: {', '.join(moved)} changed: needs a restart, not a reload")
            push = {bc.name: bc.push for bc in cfg.bots if bc.push is not None and bc.push.webhook}
            if push and self.hooks is None:
                raise ConfigError(f"bots ({', '.join(push)}): push webhooks arrive through the API: needs a restart")
            secrets = {n: pc.secret() for n, pc in push.items()}
            tokens = {n: pc.verify_token() for n, pc in push.items() if pc.verify_token_env}
            old = {bc.name: bc for bc in self.cfg.bots}
            new = {bc.name: bc for bc in cfg.bots}

            def same(n: str) -> bool:
                return (old[n].model_dump() == new[n].model_dump() and self._secrets.get(n) == secrets.get(n)
                        and self._verify_tokens.get(n) == tokens.get(n))

            removed = [n for n in old if n not in new]
            changed = [n for n in new if n in old and not same(n)]
            added = [n for n in new if n not in old]
            prepared = [self._prepare(new[n]) for n in [*changed, *added]]  # config errors before anything stops
            for n in [*removed, *changed]:
                self._remove_bot(n)
            self.cfg = cfg
            self._secrets, self._verify_tokens = secrets, tokens
            if self._api is not None:
                self._api.expected = [bc.name for bc in cfg.bots]
                self._api.webhook_bots = frozenset(push)
            if self.fleet is not None:
                self.fleet.set_bots([bc.name for bc in cfg.bots], {p.cfg.name: _poll_bound_s(p) for p in prepared})
            for p in prepared:
                self._wanted[p.cfg.name] = p
                if self.liveness is not None:
                    self.liveness.expect(p.cfg.name)
                if self.hooks is not None and p.cfg.name in push:
                    self.hooks.waiting[p.cfg.name] = (push[p.cfg.name].kind, secrets[p.cfg.name])
            if self.fleet is not None and prepared:
                try:
                    self.fleet.beat()  # the added bots' leases now, not at the next heartbeat
                except Exception as exc:  # the heartbeat thread tries again
                    log.error("replyd.fleet.beat_failed", error=str(exc)[:300])
            self._start_added(prepared)
            got = {"added": added, "removed": removed, "changed": changed}
            log.info("replyd.daemon.reloaded", source=cfg.source, bots=len(cfg.bots), **got)
            return got

    def _start_added(self, prepared: list[Prepared]) -> None:
        """Log in and start the bots a reload added or changed, as at start; a refused login stops only that bot."""
        assert self.scheduler is not None and self.liveness is not None
        if any(p.cfg.pollers.refind_interval_s <= 0 for p in prepared) and self.scheduler.get_job("reoffer") is None:
            sc = self.cfg.sweep
            self.scheduler.add_job(self.reoffer_tick, "interval", seconds=sc.interval_s, id="reoffer",
                                   next_run_time=_now_dt())
        for p, got in zip(prepared, self._first_logins(prepared), strict=True):
            if isinstance(got, Identity):
                self._start_bot(p, got)
            elif isinstance(got, NotAdopted) or isinstance(got, PlatformError) and _passing(got):
                self._retry_start(p, got)
            else:  # refused credentials, or a platform that answers "no": this bot waits for the next reload
                self.liveness.start_failed(p.cfg.name, str(got))
                log.error("replyd.bot.start_failed", bot=p.cfg.name, platform=p.platform.instance, error=str(got))

    def _remove_bot(self, name: str) -> None:
        """Stop bot ``name`` (a reload removed or changed it): no poll, sweep, stream or webhook from now on.

        Its runs under way finish (every send is claimed first); its guard and responder close after them.
        """
        with self._start_lock:
            self._wanted.pop(name, None)  # a login still being retried ends at its next attempt
            self._starting.discard(name)
            for job_id in [j for j in self._polls if j.rpartition(":")[0] == name]:
                self.timetable.remove(job_id)
                del self._polls[job_id]
            self._keys.pop(name, None)  # out of the sweep and re-offer ticks
            self.sweepers.pop(name, None)
            runner = self._runners.pop(name, None)
            if runner is not None:
                runner.stop(timeout_s=0.0)
                self.streams.remove(runner)
            if self.hooks is not None:
                self.hooks.hooks.pop(name, None)
                self.hooks.waiting.pop(name, None)
            self.guards.pop(name, None)
            if self.liveness is not None:
                self.liveness.forget(name)
            bot = next((b for b in self.bots if b.cfg.name == name), None)
            if bot is not None:
                self.bots.remove(bot)
                self._retired.append(bot)
        if bot is not None:
            threading.Thread(target=self._close_when_idle, args=(bot,), name=f"replyd-retire-{name}",
                             daemon=True).start()
        log.info("replyd.bot.stopping", bot=name)

    def _close_when_idle(self, bot: BotRuntime) -> None:
        """Close a removed bot's responder and guard once its poll runs under way have ended."""
        while not self.stopping.wait(0.2):
            with self._busy_lock:
                if not self._inflight.get(id(bot)):
                    self._inflight.pop(id(bot), None)
                    break
        else:
            return  # the daemon's stop closes it
        with self._start_lock:
            if bot not in self._retired:
                return
            self._retired.remove(bot)
        bot.pipeline.close()
        bot.guard.close()
        log.info("replyd.bot.stopped", bot=bot.cfg.name, platform=bot.platform.instance)

    def _once(self, job_id: str, fn, *args: object, urgent: bool = False) -> bool:
        """Run ``fn(*args)`` once on the pool (``urgent``: a poll, on the pool's first lane), unless the run of
        ``job_id`` before is still queued or running.

        Return whether it was submitted; a run refused for that is reported as skipped, like an interval job's.
        """
        assert self._jobs is not None
        with self._busy_lock:
            if job_id in self._busy:
                refused = True
            else:
                refused = False
                self._busy.add(job_id)
        if refused:
            self._skipped(job_id)
            return False

        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:  # a future would swallow it: say it, as APScheduler does for its jobs
                log.error("replyd.job.failed", job=job_id, error=f"{type(exc).__name__}: {exc}"[:300])
            finally:
                with self._busy_lock:
                    self._busy.discard(job_id)

        try:
            self._jobs.run_soon(run, urgent=urgent)
        except RuntimeError:  # the pool is shut down: the daemon is stopping, nothing will run it
            with self._busy_lock:
                self._busy.discard(job_id)
            return False
        return True

    def _fire_poll(self, job_id: str) -> None:
        """A poll is due (the timetable): run it on the pool, or skip it while its last run is queued or running.

        A bot whose lease another replica holds is not polled here; its path counts as looked (liveness)."""
        if self.stopping.is_set():
            return
        bot, _, path = job_id.rpartition(":")
        run = self._polls.get(job_id)
        if run is None:
            return  # a reload removed the bot after this run came due
        if not self._discovers(bot):
            if self.liveness is not None:
                self.liveness.ok(bot, path)
            return
        self._once(job_id, run, urgent=True)

    def _current(self, job_id: str, bot: BotRuntime, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``, run only while it is still ``job_id``'s poll (a reload may have removed the bot since it queued);
        its runs under way are counted, so a removed bot closes once they end."""

        def run() -> None:
            if self._polls.get(job_id) is not run:
                return
            with self._busy_lock:
                self._inflight[id(bot)] = self._inflight.get(id(bot), 0) + 1
            try:
                fn()
            finally:
                with self._busy_lock:
                    self._inflight[id(bot)] -= 1

        run.__name__ = getattr(fn, "__name__", "poll")
        return run

    def _discovers(self, bot: str) -> bool:
        """Whether this replica runs ``bot``'s discovery now: always without a fleet, else while it holds the lease."""
        return self.fleet is None or self.fleet.holds(bot)

    def _leased(self, bot: str, path: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` run only while this replica still holds ``bot`` (its lease may have gone while the run waited)."""
        if self.fleet is None:
            return fn

        def run() -> None:
            if self._discovers(bot):
                fn()
            elif self.liveness is not None:
                self.liveness.ok(bot, path)

        run.__name__ = getattr(fn, "__name__", "poll")
        return run

    def _start_fleet(self, prepared: list[Prepared]) -> None:
        """On PostgreSQL (unless ``fleet.enabled`` is false), beat once and hold this replica's share of the bots."""
        assert self.store is not None
        fc = self.cfg.fleet
        if self.store.is_sqlite or not fc.enabled:
            return
        grace_s = {p.cfg.name: _poll_bound_s(p) for p in prepared}
        self.fleet = Fleet(self.store, self.owner, [p.cfg.name for p in prepared], self.clock,
                           heartbeat_s=fc.heartbeat_s, bot_lease_s=fc.bot_lease_s, grace_s=grace_s,
                           on_gain=self._gained, on_loss=self._lost, on_clash=self._step_aside).start()

    def _step_aside(self, why: str) -> None:
        """Another live process uses this replica id and started first: stop, and leave its fleet row alone."""
        self.fatal = why
        self._fatal_set.set()

    def _gained(self, name: str) -> None:
        """This replica now runs ``name``'s discovery: read its cursors afresh, open its stream."""
        with self._start_lock:
            bot = next((b for b in self.bots if b.cfg.name == name), None)
            if bot is None or self.stopping.is_set():
                return  # not started yet: its start opens the stream if the lease is still held
            bot.pollers.forget_cursors()  # the last holder moved them
            if bot.cfg.push is not None and not bot.cfg.push.webhook and name not in self._runners:
                self._runners[name] = self._add_stream(name, bot).start()

    def _lost(self, name: str) -> None:
        """Another replica runs ``name``'s discovery now: close its stream (without waiting for the thread)."""
        with self._start_lock:
            runner = self._runners.pop(name, None)
            if runner is not None:
                runner.stop(timeout_s=0.0)
                self.streams.remove(runner)

    def sweep_tick(self) -> None:
        """Sweep the bots with due rows (one store query for all), each on a one-shot job; the others looked: ok."""
        if self.stopping.is_set() or self.store is None:
            return
        if self._clock_stale.is_set():
            self.sync_clock()
        live, started = self.liveness, list(self._keys.items())
        try:
            due = self.store.senders_due(self.clock.now())
        except Exception as exc:  # a store outage must not kill the scheduler job; every bot's sweep failed
            log.error("replyd.sweep.failed", error=str(exc)[:300])
            for name, _ in started:
                if live is not None:
                    live.failed(name, SWEEP, error_words(exc))
            return
        for name, key in started:
            if key in due:
                self._once(f"{name}:{SWEEP}", self.sweep_bot, name)
            elif live is not None:
                live.ok(name, SWEEP)  # nothing due: this bot's pass had nothing to do

    def reoffer_tick(self) -> None:
        """Re-offer the waiting rows of the bots with re-find off that have any (one store query for all)."""
        if self.stopping.is_set() or self.store is None:
            return
        try:
            waiting = self.store.senders_waiting(self.clock.now())
        except Exception as exc:  # the next tick looks again; each bot's own run reports to liveness
            log.error("replyd.poller.store_failed", path="refind", error=str(exc)[:300])
            return
        if not waiting:
            return
        for b in list(self.bots):
            name = b.cfg.name
            if b.cfg.pollers.refind_interval_s <= 0 and self._keys.get(name) in waiting:
                self._once(f"{name}:reoffer", b.pollers.reoffer_guarded)

    def _start_watch(self) -> None:
        """Start the one thread that watches the running sends of every bot's guard (once)."""
        if self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch_sends, name="replyd-send-watch", daemon=True)
        self._watcher.start()

    def _watch_sends(self) -> None:
        """Push the deadline of any send running past half its budget, every guard, until the daemon stops.

        A thread of its own, not a pool job: it must tick while every job thread is busy sending.
        """
        interval_s = min(1.0, self.cfg.guard.send_timeout_s / 4)
        while not self.stopping.wait(interval_s):
            retired = [(b.cfg.name, b.guard) for b in list(self._retired)]  # their sends in flight still count
            for name, guard in [*self.guards.items(), *retired]:
                try:
                    guard.watch_sends()
                except Exception as exc:  # the watch must outlive any one failure
                    log.error("replyd.guard.watch_failed", bot=name, error=f"{type(exc).__name__}: {exc}"[:300])

    def _tracked(self, bot: str, path: str, fn):
        """Wrap a job so liveness sees its run in flight (a run that hangs counts while it hangs)."""
        live = self.liveness
        assert live is not None

        def job() -> None:
            with live.running(bot, path):
                fn()

        job.__name__ = getattr(fn, "__name__", "job")
        return job

    def _on_skipped(self, event: JobSubmissionEvent) -> None:
        """A run of a job was skipped because the previous one still runs: one replyd event naming bot and path."""
        self._skipped(event.job_id)

    def _skipped(self, job_id: str) -> None:
        """Report a run of ``job_id`` (``bot:path``) not started because the one before still runs or waits."""
        bot, _, path = job_id.rpartition(":")
        if not bot:
            log.info("replyd.job.skipped", job=job_id)
            return
        instance = next((b.platform.instance for b in list(self.bots) if b.cfg.name == bot), None)
        metrics.poll_skipped(bot, path)
        log.info("replyd.poll.skipped", bot=bot, platform=instance, path=path,
                 hint="the previous run still runs (a slow or frozen platform, or a long responder)")

    def _abort(self) -> None:
        """Undo a start that failed: no job, no server, no thread left behind."""
        self.stopping.set()
        self.timetable.stop()
        if self.fleet is not None:
            self.fleet.stop()
        if self.scheduler is not None and self.scheduler.running:
            self.scheduler.shutdown(wait=False)  # and the job pool under it
        elif self._jobs is not None:
            self._jobs.shutdown(wait=False)
        if self.api is not None:
            self.api.stop()
        for runner in self.streams:
            runner.stop()

    def _watch(self, bot: BotRuntime, timeout_s: float) -> None:
        """Track the bot's scheduled paths and sweep in the liveness record; label its metrics by name."""
        assert self.liveness is not None
        pc, name = bot.cfg.pollers, bot.cfg.name
        for path, every_s, jitter_s in (("inbox", bot.cfg.inbox_interval_s(), pc.jitter_s),
                                        ("search", pc.search_interval_s if pc.search_queries else 0, pc.jitter_s),
                                        ("refind", pc.refind_interval_s, pc.jitter_s),
                                        (SWEEP, self.cfg.sweep.interval_s, self.cfg.sweep.interval_s / 2)):
            if every_s > 0:
                self.liveness.track(name, path, every_s, timeout_s, jitter_s or 0.0)
        self.liveness.identify(name, bot.platform.instance, bot.identity.sender_id)
        if isinstance(bot.platform, MeasuresClock):
            self.liveness.platform_clock(name, bot.platform.clock_view)
        metrics.name_platform(bot.platform.instance, name)
        metrics.breaker_state(bot.platform.instance, bool(bot.guard.breaker and bot.guard.breaker.is_open))

    def _use_db_clock(self) -> None:
        """On PostgreSQL, replace the wall clock by the database's (see ``DatabaseClock``)."""
        assert self.store is not None
        if self.store.is_sqlite or not self.cfg.store.db_clock or not isinstance(self.clock, SystemClock):
            return  # one machine's clock (SQLite), or a clock a test injected
        self.clock = DatabaseClock(self.store.db_epoch)
        self.store.clock = self.clock
        self.store.on_connect(self._on_db_connect)
        skew_s = round(self.clock.skew_s, 3)
        log.info("replyd.clock.synced", source="database", skew_s=skew_s)
        if abs(skew_s) > 1.0:
            log.warning("replyd.clock.skewed", skew_s=skew_s,
                        hint="this machine's clock disagrees with the database's; replyd uses the database's")

    def _add_hook(self, name: str, kind: str, secret: str, bot: BotRuntime) -> None:
        """Receive ``kind`` webhooks for bot ``name`` (its adapter reads them: checked by ``_prepare``)."""
        from replyd.hooks import Hook

        assert self.hooks is not None and isinstance(bot.platform, WebhookSource)
        self.hooks.hooks[name] = Hook(name, kind, secret, bot.platform, bot.pipeline.offer,
                                      instance=bot.platform.instance, guard=bot.guard,
                                      verify_token=self._verify_tokens.get(name, ""),
                                      offer_page=bot.pipeline.offer_page)
        log.info("replyd.hooks.ready", bot=name, platform=bot.platform.instance, kind=kind,
                 path=f"/v1/hooks/{name}")

    def _add_stream(self, name: str, bot: BotRuntime) -> StreamRunner:
        """Hold bot ``name``'s push stream open (its adapter offers one: checked by ``_prepare``); return its runner."""
        from replyd.streams import StreamRunner

        assert isinstance(bot.platform, StreamSource)
        keep = None
        if isinstance(bot.platform, ResumableStream):  # its events come once: recorded first, session stored
            store, inst, sender = bot.guard.store, bot.platform.instance, bot.identity.sender_id
            slot = f"gateway:{self.cfg.replica_id}" if self.cfg.replica_id else "gateway"
            bot.platform.hold_session(lambda: store.get_cursor(inst, sender, slot),
                                      lambda value: store.set_cursor(inst, sender, slot, value), self.owner)
            keep = functools.partial(bot.guard.keep_received, path="stream", detail={},
                                     doing="recording a streamed parent")
        runner = StreamRunner(name, bot.platform, bot.pipeline.offer, bot.pollers.inbox, keep=keep,
                              unreadable=bot.pollers.unreadable)
        self.streams.append(runner)
        return runner

    def _check_claim_commit(self) -> None:
        """Warn when store.claim_commit asks for a synchronous standby the server does not have."""
        assert self.store is not None
        try:
            problem = self.store.claim_commit_problem()
        except Exception as exc:  # a role without the rights to look: say so, start anyway
            log.warning("replyd.store.claim_commit_unchecked", level=self.store.claim_commit, error=str(exc)[:200])
            return
        if problem:
            log.warning("replyd.store.claim_commit_unsafe", level=self.store.claim_commit, problem=problem,
                        hint="see docs/OPERATIONS.md, 'High availability'")

    def _on_db_connect(self, *_args: object) -> None:
        # A new server connection may be a new primary (a failover): its clock is the one to follow now.
        self._clock_stale.set()

    def sync_clock(self) -> None:
        """Re-anchor the database clock (scheduled, and after a reconnect; a failure keeps the last anchor)."""
        if not isinstance(self.clock, DatabaseClock):
            return
        self._clock_stale.clear()
        before_s = self.clock.skew_s
        try:
            step_s = self.clock.sync()
        except Exception as exc:  # the monotonic carry-forward stays valid while the database is away
            log.warning("replyd.clock.sync_failed", error=str(exc)[:200])
            return
        skew_s = round(self.clock.skew_s, 3)
        if abs(skew_s) > 1.0 and abs(skew_s - before_s) > 1.0:
            # This machine's wall clock stepped (or the database's did): decisions follow the database's.
            log.warning("replyd.clock.skewed", skew_s=skew_s, step_s=round(step_s, 3))
        else:
            log.debug("replyd.clock.synced", source="database", step_s=round(step_s, 4), skew_s=skew_s)

    def sweep_once(self) -> None:
        """Run one sweep pass for every started bot (tests; the scheduler runs ``sweep_bot`` per bot)."""
        if self._clock_stale.is_set() and not self.stopping.is_set():
            self.sync_clock()  # a reconnect re-anchors the clock at the next tick, bots or not
        for name in list(self.sweepers):
            self.sweep_bot(name)

    def sweep_bot(self, name: str) -> None:
        """Run one sweep pass of bot ``name`` (scheduled; failures are logged and reported, never raised)."""
        sweeper = self.sweepers.get(name)
        if sweeper is None or self.stopping.is_set():
            return
        if self._clock_stale.is_set():
            self.sync_clock()
        live = self.liveness
        with live.running(name, SWEEP) if live is not None else _nothing():
            try:
                r = sweeper.run_once()
            except Exception as exc:  # a store outage must not kill the scheduler job
                log.error("replyd.sweep.failed", bot=name, error=str(exc)[:300])
                if live is not None:
                    live.failed(name, SWEEP, error_words(exc))
                return
            if live is not None:
                if r.readback_errors:
                    live.failed(name, SWEEP, f"{r.readback_errors} read-back error(s)")
                else:
                    live.ok(name, SWEEP)

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop claiming, let running jobs finish within ``grace_s``, release resources."""
        if self.stopping.is_set():
            return
        self.stopping.set()  # also ends the background start attempts
        with self._start_lock:  # a bot starting right now finishes joining first, then sees the flag
            pass
        for b in [*self.bots, *self._retired]:
            b.guard.claiming = False
        log.info("replyd.daemon.stopping", grace_s=grace_s)
        if self.api is not None:
            # Before the HTTP client closes: running API posts still use it.
            self.api.stop()
        for runner in self.streams:
            runner.stop()  # no new offers; one under way finishes like a scheduled job's
        self.timetable.stop()  # no poll submitted from here on; those on the pool finish below
        if self.scheduler is not None:
            t = threading.Thread(target=self.scheduler.shutdown, kwargs={"wait": True}, daemon=True)
            t.start()
            t.join(grace_s)
            if t.is_alive():
                self.grace_expired = True
                log.warning("replyd.daemon.grace_expired", hint="open rows are left to the sweep")
        if self.fleet is not None:
            # Polls are done: the others may take the bots now. Not when stepping aside: the row is the other's.
            self.fleet.stop(leave=not self.grace_expired and self.fatal is None)
        if self._watcher is not None:
            self._watcher.join(5.0)  # it saw `stopping` within its interval
        for b in [*self.bots, *self._retired]:
            b.pipeline.close()
            b.guard.close()
        if self.hooks is not None:
            self.hooks.close(wait=True)  # offers under way finish before the HTTP client closes
        if self.http is not None:
            self.http.close()
        if self.store is not None:
            self.store.dispose()
        log.info("replyd.daemon.stopped")

    def run_forever(self, grace_s: float = 30.0, load: Callable[[], Config] | None = None) -> int:
        """Start, wait for SIGTERM/SIGINT, stop gracefully; return the exit code.

        With ``load`` (the checked config, read again), SIGHUP reloads the bots on a thread of its own.
        """
        done = threading.Event()
        hup = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            log.info("replyd.daemon.signal", signal=signal.Signals(signum).name)
            done.set()
            hup.set()  # wakes the reload thread to end

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if load is not None:
            # Before the start: a SIGHUP while starting is a reload once started, never the default exit.
            signal.signal(signal.SIGHUP, lambda _signum, _frame: hup.set())
        self.start()
        if load is not None:
            threading.Thread(target=self._reloads, args=(load, hup, done), name="replyd-reload", daemon=True).start()
        while not done.wait(1.0) and not self._fatal_set.is_set():
            pass
        self.stop(grace_s)
        if self.fatal is not None:
            log.error("replyd.daemon.stopped_itself", reason=self.fatal)
            return 2
        return 0

    def _reloads(self, load: Callable[[], Config], hup: threading.Event, done: threading.Event) -> None:
        """Reload on each SIGHUP (``hup``), one at a time, until the daemon stops (never in the signal handler)."""
        while True:
            hup.wait()
            if done.is_set() or self.stopping.is_set():
                return
            hup.clear()  # a SIGHUP during this reload runs one more after it
            log.info("replyd.daemon.signal", signal="SIGHUP")
            self.reload_from(load)


_RELOADED = ("bots", "mcp", "source")  # what a reload may change; `replyd run` serves no MCP


def _restart_keys(old: Config, new: Config) -> list[str]:
    """The keys outside ``[[bots]]`` whose value differs: each needs a restart, not a reload."""
    was, now = old.model_dump(exclude=set(_RELOADED)), new.model_dump(exclude=set(_RELOADED))
    out: list[str] = []
    for section, a in was.items():
        b = now.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{section}.{k}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(section)
    return out


def _poll_bound_s(p: Prepared) -> float:
    """How long a bot's last poll may still run: the adapter's timeout, and a long poll's wait on Telegram."""
    return p.timeout_s + float(p.cfg.settings.get("long_poll_s", 0) or 0)


def _with_context(fn, **context: str):
    """Run ``fn`` with ``context`` bound to every log line it emits (the guard's and the adapter's included)."""

    def job() -> None:
        with structlog.contextvars.bound_contextvars(**context):
            fn()

    job.__name__ = getattr(fn, "__name__", "job")  # APScheduler names the job after it
    return job


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _now_dt(in_s: float = 0.0):
    from datetime import datetime, timedelta, timezone

    return datetime.now(timezone.utc) + timedelta(seconds=in_s)
