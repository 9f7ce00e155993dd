"""The daemon: wires store, adapters, guards, pollers and the sweep onto one scheduler.

With ``[api] enabled`` it also serves the sidecar API and status page
(``replyd.api``) from a thread; the API starts before the bots log in, so
``/healthz`` answers at once and ``/readyz`` says when every bot is ready.

Shutdown (SIGTERM/SIGINT): stop claiming at once, let running API requests
and jobs finish within ``grace_s``, leave open rows to the sweep of the next
start, exit 0.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import stamina
import structlog
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from replyd import metrics
from replyd import store as st
from replyd.clock import Clock, DatabaseClock, SystemClock
from replyd.config import BotConfig, Config
from replyd.errors import ConfigError, DefinitelyNotSent, MaybeSent, PlatformError
from replyd.guard import Guard
from replyd.lag import ListingLag
from replyd.liveness import SWEEP, Heartbeat, Liveness, error_words
from replyd.pipeline import Pipeline
from replyd.platforms.base import Identity, MeasuresClock, Platform, StreamSource, WebhookSource, make_platform
from replyd.platforms._http import make_client
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.responders import make_responder, runner_bound_s
from replyd.store import Store
from replyd.sweep import Bot, Sweeper

if TYPE_CHECKING:
    from replyd.api import ApiServer
    from replyd.hooks import Receiver
    from replyd.streams import StreamRunner

log = structlog.get_logger("replyd.daemon")


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
        if exc.status in (401, 403):
            names = bc.variables()
            held = (f"the environment variable{'s' if len(names) > 1 else ''} {', '.join(names)}" if names
                    else "the credentials in the config file")
            raise ConfigError(f"bot {bc.name}: {platform.instance} refused the login (HTTP {exc.status}): "
                              f"check {held}") from None
        raise type(exc)(f"bot {bc.name}: cannot log in at {platform.instance}: {exc.detail or exc}",
                        status=exc.status) from None
    raise AssertionError("unreachable")  # pragma: no cover - retry_context either returns or raises


def build_guard(cfg: Config, bc: BotConfig, store: Store, http: httpx.Client, clock: Clock,
                owner: str) -> tuple[Platform, Identity, Guard]:
    """Build one bot's adapter, log it in, and return it with its identity and guard."""
    # Each adapter owns its listing-delay default (Discourse 30 s, GitHub 60 s…); never override it here.
    platform = make_platform(bc.platform, bc.settings, http=http, clock=clock)
    identity = login(bc, platform)
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
        dry_run=cfg.guard.dry_run or bc.policy.dry_run,
        responder_backoff_s=cfg.guard.responder_backoff_s,
        responder_backoff_max_s=cfg.guard.responder_backoff_max_s,
    )
    return platform, identity, guard


def build_bot(cfg: Config, bc: BotConfig, store: Store, http: httpx.Client, clock: Clock, owner: str,
              heartbeat: Heartbeat | None = None) -> BotRuntime:
    """Build one bot's adapter, identity, guard, pipeline and pollers."""
    platform, identity, guard = build_guard(cfg, bc, store, http, clock, owner)
    rsettings = bc.responder.model_dump(exclude={"kind"})
    responder = make_responder(bc.responder.kind, rsettings)
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


class Daemon:
    """The long-running replyd process."""

    def __init__(self, cfg: Config, *, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.owner = cfg.replica_id or st.make_owner()
        self.stopping = threading.Event()
        self._clock_stale = threading.Event()  # set on a new database connection: re-anchor the clock
        self.store: Store | None = None
        self.http: httpx.Client | None = None
        self.bots: list[BotRuntime] = []
        self.sweeper: Sweeper | None = None
        self.scheduler: BackgroundScheduler | None = None
        self.guards: dict[str, Guard] = {}  # by bot name, for the API; filled as bots log in
        self.api: ApiServer | None = None
        self.hooks: Receiver | None = None
        self.streams: list[StreamRunner] = []
        self.liveness: Liveness | None = None

    def start(self) -> None:
        """Open the store, start the API if configured, log every bot in, and start the scheduled jobs."""
        ac = self.cfg.api
        token: str | None = None
        # Webhook secrets first: a push bot with no secret, or no API to receive on, never starts.
        push = {bc.name: bc.push for bc in self.cfg.bots if bc.push is not None and bc.push.webhook}
        if push and not ac.enabled:
            raise ConfigError(f"bots ({', '.join(push)}): push webhooks arrive through the API: set api.enabled = true")
        secrets = {name: pc.secret() for name, pc in push.items()}
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
        self.liveness = Liveness(self.clock, stale_after_intervals=hc.stale_after_intervals, stale_min_s=hc.stale_min_s)
        # Every send through this client ends within guard.send_timeout_s in total (replyd.deadline).
        self.http = make_client(self.cfg.guard.send_timeout_s)
        if ac.enabled:
            from replyd.hooks import Receiver

            self.hooks = Receiver({})  # filled as push bots log in, like the guards
            api = Api(self.store, self.guards, expected=[b.name for b in self.cfg.bots], token=token, host=ac.host,
                      hosts=ac.hosts, open_routes=ac.open_routes, refresh_s=ac.refresh_s,
                      max_body_bytes=ac.max_body_bytes, liveness=self.liveness, hooks=self.hooks)
            self.api = ApiServer(api.app, host=ac.host, port=ac.port, grace_s=self.cfg.guard.send_timeout_s).start()
        try:
            for bc in self.cfg.bots:
                bot = build_bot(self.cfg, bc, self.store, self.http, self.clock, self.owner,
                                self.liveness.beat(bc.name))
                self._watch(bot)
                self.bots.append(bot)
                self.guards[bc.name] = bot.guard
                if bc.push is not None and bc.push.webhook and self.hooks is not None:
                    self._add_hook(bc.name, bc.push.kind, secrets[bc.name], bot)
                elif bc.push is not None:
                    self._add_stream(bc.name, bot)
        except BaseException:
            if self.api is not None:
                self.api.stop()
            raise
        sc = self.cfg.sweep
        self.sweeper = Sweeper(
            self.store,
            [Bot(b.platform, b.identity, b.guard.lag) for b in self.bots],
            clock=self.clock,
            owner=self.owner,
            batch=sc.batch,
            lease_s=sc.lease_s,
            retry_s=sc.retry_s,
            max_attempts=self.cfg.guard.max_attempts,
            on_duplicate=sc.on_duplicate,
            config=sc,
        )
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(max_workers=max(4, 3 * len(self.bots) + 1))},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30},
        )
        for b in self.bots:
            pc = b.cfg.pollers
            for name, every_s, fn in (
                ("inbox", b.cfg.inbox_interval_s(), b.pollers.inbox),
                ("search", pc.search_interval_s if pc.search_queries else 0, b.pollers.search),
                ("refind", pc.refind_interval_s, b.pollers.refind),
            ):
                if every_s > 0:
                    fn = _with_context(fn, bot=b.cfg.name, platform=b.platform.instance)
                    self.scheduler.add_job(fn, "interval", seconds=every_s, jitter=pc.jitter_s or None,
                                           id=f"{b.cfg.name}:{name}", next_run_time=_now_dt())
            if pc.refind_interval_s <= 0:
                # Re-find off: its re-offer of waiting rows (released, not_landed, a dead composer's) still runs,
                # at the sweep's pace, so no row waits for a path that will never come.
                self.scheduler.add_job(b.pollers.reoffer_guarded, "interval", seconds=sc.interval_s,
                                       id=f"{b.cfg.name}:reoffer", next_run_time=_now_dt())
        if isinstance(self.clock, DatabaseClock):
            self.scheduler.add_job(self.sync_clock, "interval", seconds=self.cfg.store.clock_sync_s, id="clock")
        # Jitter spreads sweep passes across replicas (leases already keep them from sharing rows).
        self.scheduler.add_job(self.sweep_once, "interval", seconds=sc.interval_s, jitter=sc.interval_s / 2,
                               id="sweep", next_run_time=_now_dt())
        self.scheduler.start()
        for runner in self.streams:
            runner.start()
        log.info("replyd.daemon.started", owner=self.owner, bots=len(self.bots), store=self.store.url)

    def _watch(self, bot: BotRuntime) -> None:
        """Track the bot's scheduled paths and sweep in the liveness record; label its metrics by name."""
        assert self.liveness is not None
        pc, name = bot.cfg.pollers, bot.cfg.name
        for path, every_s in (("inbox", bot.cfg.inbox_interval_s()),
                              ("search", pc.search_interval_s if pc.search_queries else 0),
                              ("refind", pc.refind_interval_s), (SWEEP, self.cfg.sweep.interval_s)):
            if every_s > 0:
                self.liveness.track(name, path, every_s)
        self.liveness.identify(name, bot.platform.instance, bot.identity.sender_id)
        if isinstance(bot.platform, MeasuresClock):
            self.liveness.platform_clock(name, bot.platform.clock_view)
        metrics.name_platform(bot.platform.instance, name)

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
        """Receive ``kind`` webhooks for bot ``name`` (its adapter must read them)."""
        from replyd.hooks import Hook

        assert self.hooks is not None
        if not isinstance(bot.platform, WebhookSource):
            raise ConfigError(f"bots.{name}.push: the {bot.cfg.platform} adapter cannot read webhook deliveries")
        self.hooks.hooks[name] = Hook(name, kind, secret, bot.platform, bot.pipeline.offer,
                                      instance=bot.platform.instance)
        log.info("replyd.hooks.ready", bot=name, platform=bot.platform.instance, kind=kind,
                 path=f"/v1/hooks/{name}")

    def _add_stream(self, name: str, bot: BotRuntime) -> None:
        """Hold bot ``name``'s push stream open (started with the scheduler); its adapter must offer one."""
        from replyd.streams import StreamRunner

        if not isinstance(bot.platform, StreamSource):
            raise ConfigError(f"bots.{name}.push: the {bot.cfg.platform} adapter has no push stream")
        self.streams.append(StreamRunner(name, bot.platform, bot.pipeline.offer, bot.pollers.inbox))

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
        """Run one sweep pass (scheduled; failures are logged, never raised)."""
        if self.sweeper is None or self.stopping.is_set():
            return
        if self._clock_stale.is_set():
            self.sync_clock()
        try:
            r = self.sweeper.run_once()
        except Exception as exc:  # a store outage must not kill the scheduler job
            log.error("replyd.sweep.failed", error=str(exc)[:300])
            self._sweep_beat(error_words(exc))
            return
        # One pass covers every bot; a read-back error is not attributed to one, so every bot's sweep reports it.
        self._sweep_beat(f"{r.readback_errors} read-back error(s)" if r.readback_errors else None)

    def _sweep_beat(self, error: str | None) -> None:
        if self.liveness is None:
            return
        for b in self.bots:
            if error is None:
                self.liveness.ok(b.cfg.name, SWEEP)
            else:
                self.liveness.failed(b.cfg.name, SWEEP, error)

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop claiming, let running jobs finish within ``grace_s``, release resources."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        for b in self.bots:
            b.guard.claiming = False
        log.info("replyd.daemon.stopping", grace_s=grace_s)
        if self.api is not None:
            # Before the HTTP client closes: running API posts still use it.
            self.api.stop()
        for runner in self.streams:
            runner.stop()  # no new offers; one under way finishes like a scheduled job's
        if self.scheduler is not None:
            t = threading.Thread(target=self.scheduler.shutdown, kwargs={"wait": True}, daemon=True)
            t.start()
            t.join(grace_s)
            if t.is_alive():
                log.warning("replyd.daemon.grace_expired", hint="open rows are left to the sweep")
        for b in self.bots:
            b.pipeline.close()
            b.guard.close()
        if self.hooks is not None:
            self.hooks.close(wait=True)  # offers under way finish before the HTTP client closes
        if self.http is not None:
            self.http.close()
        if self.store is not None:
            self.store.dispose()
        log.info("replyd.daemon.stopped")

    def run_forever(self, grace_s: float = 30.0) -> int:
        """Start, wait for SIGTERM/SIGINT, stop gracefully; return the exit code."""
        done = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            log.info("replyd.daemon.signal", signal=signal.Signals(signum).name)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        while not done.wait(1.0):
            pass
        self.stop(grace_s)
        return 0


def _with_context(fn, **context: str):  # noqa: ANN001, ANN202
    """Run ``fn`` with ``context`` bound to every log line it emits (the guard's and the adapter's included)."""

    def job() -> None:
        with structlog.contextvars.bound_contextvars(**context):
            fn()

    job.__name__ = getattr(fn, "__name__", "job")  # APScheduler names the job after it
    return job


def _now_dt():  # noqa: ANN202
    from datetime import datetime, timezone

    return datetime.now(timezone.utc)
