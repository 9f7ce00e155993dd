"""Configuration: a TOML file, then ``REPLYD_*`` environment overrides.

Nested keys are overridden with a double underscore:
``REPLYD_STORE__URL=postgresql+psycopg://…`` or ``REPLYD_SWEEP__INTERVAL_S=5``.

Secrets never live in the file: any platform or responder setting whose name
ends in ``_env`` names an environment variable, read at load time
(``token_env = "MASTODON_TOKEN"`` gives the adapter ``token``). Every error
names the file, the key and the problem.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator,
                      model_validator)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from replyd import log as rlog
from replyd.errors import ConfigError
from replyd.lag_summary import LISTING_LAG_WINDOW
from replyd.log import get_logger
from replyd.net import MIN_PUBLIC_TOKEN, is_loopback  # noqa: F401  (MIN_PUBLIC_TOKEN: importable from here too)

logger = get_logger("replyd.config")



# The words a boolean may be written as: TOML's own true/false, and what an environment variable carries.
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _plain_booleans(cls, data: Any) -> Any:
        """A boolean is true or false (or 1/0 from an environment variable): "yes" or "on" is a mistake."""
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            value = data.get(name)
            if field.annotation is bool and isinstance(value, str):
                if value.strip().lower() not in _BOOL_WORDS:
                    raise ValueError(f"{name}: {value!r} is not a boolean (use true or false)")
                data = {**data, name: _BOOL_WORDS[value.strip().lower()]}
        return data


class StoreConfig(_Strict):
    """Where the answered-log lives."""

    url: str = ""  # empty: SQLite under $XDG_STATE_HOME/replyd/
    auto_migrate: bool = True
    # PostgreSQL: every replica takes its time from the database server (re-read every clock_sync_s),
    # so replicas on machines whose clocks disagree still agree on deadlines and leases.
    db_clock: bool = True
    clock_sync_s: float = Field(60.0, gt=0)
    # PostgreSQL: synchronous_commit for the claim and the open (the writes a failover must not lose); unset
    # keeps the server's. "remote_apply" (or "on") with a synchronous standby: no claim lost in a failover.
    claim_commit: Literal["local", "on", "remote_write", "remote_apply"] | None = None


class LogConfig(_Strict):
    """How replyd logs."""

    format: Literal["auto", "console", "json"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class BreakerConfig(_Strict):
    """The per-bot write-path breaker (``replyd.breaker``): a platform-wide send failure pauses sending."""

    enabled: bool = True
    window: int = Field(10, ge=2, le=1000)  # the last N sends judged
    min_failures: int = Field(5, ge=1)  # at least this many of them failed (5xx, timeout, maybe sent, refused)
    failure_ratio: float = Field(0.6, gt=0, le=1.0)  # and at least this share of the window ("most")
    probe_s: float = Field(5.0, gt=0)  # first probe (one real send) this long after opening
    probe_max_s: float = Field(120.0, gt=0)  # the probe interval doubles per failed probe, up to this


class GuardConfig(_Strict):
    """The posting function's limits."""

    # Sends that may each have landed (outside an outage) before a parent is given up.
    max_attempts: int = Field(2, ge=1, le=5)
    # A parent whose sends an outage swallowed (proven not landed while the breaker was open) is retried, with
    # a back-off from retry_backoff_s doubling up to retry_backoff_max_s, until this long after its first claim.
    retry_horizon_s: float = Field(6 * 3600.0, gt=0)
    retry_backoff_s: float = Field(5.0, ge=0)
    retry_backoff_max_s: float = Field(300.0, ge=0)
    # A retry's send that the sweep proves not landed by two reads (the batched walk and the parent's own replies,
    # ParentReplies), after the listing delay in use, is excused like an outage's: no attempt, the same back-off
    # and horizon. At most this many per parent (0: never); past it such proofs count against max_attempts again,
    # so a platform whose parent listing lags past the delay costs a bounded number of duplicates.
    max_proven_retries: int = Field(8, ge=0, le=100)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    send_timeout_s: float = Field(30.0, gt=0)
    compose_lease_s: float = Field(120.0, gt=0)
    # A streamed answer (a responder with stream = true) on a platform that edits: its reply is edited at most this
    # often while text comes (platforms rate-limit edits); a stream silent for stream_idle_s has failed.
    stream_edit_interval_s: float = Field(1.0, ge=0)
    stream_idle_s: float = Field(60.0, gt=0)
    dry_run: bool = False  # every bot: log what would be sent, send and claim nothing
    responder_backoff_s: float = Field(30.0, gt=0)  # after a responder failure; doubles per failure in a row
    responder_backoff_max_s: float = Field(3600.0, gt=0)


class SweepConfig(_Strict):
    """The read-back sweep."""

    interval_s: float = Field(15.0, gt=0)
    batch: int = Field(1000, ge=1, le=5000)
    # How long a replica that dies mid-pass keeps its leased rows from the others; a longer pass renews its leases
    # every third of it (sweep.LeaseKeeper), so it need not cover the slowest read-back.
    lease_s: float = Field(30.0, gt=0)
    retry_s: float = Field(60.0, gt=0)
    on_duplicate: Literal["report", "delete_newer"] = "report"
    # The listing delay in use per platform instance (replyd.lag): max(configured, factor x the observed lag's
    # percentile), at most listing_delay_max_s, once listing_delay_min_samples sends were measured.
    listing_delay_auto: bool = True
    listing_delay_factor: float = Field(2.0, ge=1.0, le=10.0)
    listing_delay_percentile: float = Field(99.0, gt=0, le=100)
    listing_delay_min_samples: int = Field(10, ge=1)
    listing_delay_max_s: float = Field(600.0, gt=0)
    listing_lag_window: int = Field(LISTING_LAG_WINDOW, ge=10, le=100_000)  # newest samples the percentile is taken over
    listing_lag_refresh_s: float = Field(10.0, gt=0)
    # not_landed and gave_up rows are looked at again at these multiples of the delay in use (at most
    # reconcile_max_s after they were judged): an own reply found then closes them as reconciled.
    reconcile_after: list[float] = Field(default_factory=lambda: [10.0, 100.0])
    reconcile_max_s: float = Field(86_400.0, gt=0)

    @field_validator("reconcile_after")
    @classmethod
    def _multiples(cls, v: list[float]) -> list[float]:
        if any(x <= 0 for x in v):
            raise ValueError("every multiple must be > 0")
        return sorted(v)


class HealthConfig(_Strict):
    """When readiness turns false, and how a bot whose platform cannot be reached at start retries its start.

    A path (inbox, search, refind, the sweep) is failing after ``failures_not_ready`` failed runs in a row,
    or while a run is in flight longer than its interval plus the adapter's ``timeout_s``; stale after no
    success for ``stale_after_intervals`` × its interval (at least ``stale_min_s``).
    """

    stale_after_intervals: float = Field(3.0, gt=0)  # × the path's interval
    stale_min_s: float = Field(60.0, ge=0)  # never stale sooner than this
    failures_not_ready: int = Field(2, ge=1)  # failed runs in a row that make a path (and so the daemon) not ready
    start_retry_s: float = Field(1.0, gt=0)  # first wait before a start attempt again; doubles per failure
    start_retry_max_s: float = Field(60.0, gt=0)  # the doubling's cap


class DaemonConfig(_Strict):
    """How ``replyd run`` runs its bots' jobs.

    Every scheduled run (each bot's inbox, search and re-find polls, the sweep and re-offer passes of the bots
    that have rows due, a failed login's next attempt) takes a thread of one pool of ``job_threads``, however
    many bots there are: a bot's runs never overlap, and a run that waits for a thread waits in order.
    """

    # Enough for the platform requests in flight at once (each poll holds its thread while it waits); more bots
    # need no more threads unless their polls take longer than the interval divided among them.
    job_threads: int = Field(16, ge=1, le=1024)


class FleetConfig(_Strict):
    """Replicas on PostgreSQL share the bots: each bot's discovery runs where its lease is held (``replyd.fleet``).

    Off unless ``enabled`` (PostgreSQL only); SQLite is one replica on one machine and never uses it. A replica beats every
    ``heartbeat_s``; one silent for ``bot_lease_s`` is dead: its bots and its rows' leases go to the others.
    """

    enabled: bool = False  # true: each bot's discovery on one replica; false: every replica polls every bot
    heartbeat_s: float = Field(5.0, gt=0)
    bot_lease_s: float = Field(20.0, gt=0)

    @model_validator(mode="after")
    def _lease_covers_beats(self) -> FleetConfig:
        if self.bot_lease_s < 2 * self.heartbeat_s:
            raise ValueError("bot_lease_s must be at least twice heartbeat_s (a late heartbeat must not lose a bot)")
        return self


class ApiConfig(_Strict):
    """The sidecar HTTP API and status page the daemon serves.

    With a token, every route but ``/healthz`` needs it (``open_routes`` may
    open ``readyz`` and ``metrics`` for probes and scrapers); without one,
    writes are refused and only a loopback ``host`` is allowed. A non-loopback
    ``host`` needs a token of at least 32 characters. Requests whose ``Host``
    header names something other than an IP address, localhost, ``host`` or one
    of ``hosts`` are refused (DNS rebinding). The token itself never lives in
    the file: ``token_env`` names the environment variable that holds it.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(8787, ge=0, le=65535)  # 0: an ephemeral port (tests)
    token_env: str = ""
    hosts: list[str] = []  # further names clients reach the API by (a reverse proxy's, a DNS name)
    open_routes: list[Literal["readyz", "metrics"]] = []  # served without the token
    refresh_s: int = Field(5, ge=1, le=3600)  # the status page's auto-refresh
    max_body_bytes: int = Field(65_536, ge=1024)

    def token(self) -> str | None:
        """Return the API token from ``$token_env`` (None when unset); raise ConfigError if named but empty."""
        return _env_token("api.token_env", self.token_env)


def _env_token(key: str, var: str) -> str | None:
    """Read a bearer token from the environment variable ``var`` (None when unnamed); mask it in every log."""
    if not var:
        return None
    value = os.environ.get(var)
    if not value:
        raise ConfigError(f"{key}: environment variable {var!r} is not set")
    rlog.add_secret(value)
    return value


McpParents = Literal["addressed", "any"]


def origin_of(value: str) -> str | None:
    """The normal form of an ``Origin`` value (``scheme://host[:port]``, lower case, default port dropped), or None."""
    from urllib.parse import urlsplit

    v = value.strip()
    if not v or not v.isascii() or not v.isprintable() or " " in v:
        return None
    try:
        u = urlsplit(v)
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or u.path or u.query or u.fragment or u.username \
            or u.password is not None:
        return None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    keep = port is not None and port != {"http": 80, "https": 443}[u.scheme]
    return f"{u.scheme}://{host}" + (f":{port}" if keep else "")


class McpScope(_Strict):
    """What one MCP client may do: which bots, which parents, how many claims in one session.

    ``parents = "addressed"`` (the default, over HTTP and stdio): the tools act
    only on a parent that addresses the bot (the adapter's ``Addressing``: a
    mention, a reply to it, a DM) or that one of the bot's own discovery paths
    already found (a row or skip event of that bot's key from a path other than
    a face). ``"any"``: any parent the bot's policy allows.
    """

    bots: list[str] | None = None  # None: every configured bot
    parents: McpParents = "addressed"
    # begin_reply leases plus reply_once calls that reach the guard, per MCP session
    max_replies_per_session: int = Field(20, ge=1, le=100_000)
    # Protocol 2026-07-28 has no sessions: such requests of one token count together over this rolling window.
    stateless_window_s: float = Field(3600.0, gt=0)

    @field_validator("bots")
    @classmethod
    def _some_bots(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("names no bot (omit it to allow every configured bot)")
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"lists a bot twice ({sorted({b for b in v if v.count(b) > 1})})")
        return v

    def check_bots(self, key: str, configured: list[str]) -> None:
        """ConfigError (one line, naming ``key``) when the scope names a bot the config does not define."""
        unknown = [b for b in self.bots or [] if b not in configured]
        if unknown:
            raise ConfigError(f"{key}.bots: no bot named {unknown[0]!r} (bots: {', '.join(configured) or 'none'})")


class McpTokenConfig(McpScope):
    """One more bearer token for ``replyd mcp --transport http``, with its own scope (``[[mcp.tokens]]``)."""

    token_env: str = Field(min_length=1)
    bots: list[str]  # type: ignore[assignment]  # required: a token names the bots it may use


class McpConfig(McpScope):
    """``replyd mcp``: the scope of its clients (stdio and the main token) and the HTTP door.

    HTTP always needs a bearer token (every tool may post); a non-loopback
    bind needs one as long as the API's. The Host rule is the API's: an IP
    address, ``localhost``, the bind address or one of ``hosts``. A request
    carrying an ``Origin`` header is refused (403) unless it is one of
    ``origins`` (the MCP spec's DNS-rebinding rule); no ``Origin`` (a
    non-browser client) passes. ``tokens`` adds tokens with scopes of their own.
    """

    host: str = "127.0.0.1"
    port: int = Field(8788, ge=0, le=65535)  # 0: an ephemeral port (tests)
    path: str = Field("/mcp", pattern=r"^/[A-Za-z0-9._~/-]*$")
    token_env: str = ""
    hosts: list[str] = []  # further names clients reach the server by (a reverse proxy's, a DNS name)
    origins: list[str] = []  # browser origins allowed to call (scheme://host[:port]); none by default
    tokens: list[McpTokenConfig] = []

    @field_validator("origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        out = []
        for o in v:
            norm = origin_of(o)
            if norm is None:
                raise ValueError(f"{o[:80]!r} is not an origin (scheme://host[:port], http or https, no path)")
            out.append(norm)
        return out

    @model_validator(mode="after")
    def _distinct_tokens(self) -> McpConfig:
        names = [self.token_env, *(t.token_env for t in self.tokens)]
        dup = sorted({n for n in names if n and names.count(n) > 1})
        if dup:
            raise ValueError(f"tokens: variable {dup[0]!r} is named twice (each token has one scope)")
        return self

    def check_bots(self, key: str, configured: list[str]) -> None:  # type: ignore[override]
        """ConfigError when this scope or a token's names a bot the config does not define."""
        super().check_bots(key, configured)
        for i, t in enumerate(self.tokens):
            t.check_bots(f"{key}.tokens.{i}", configured)

    def token(self) -> str | None:
        """Return the MCP token from ``$token_env`` (None when unset); raise ConfigError if named but empty."""
        return _env_token("mcp.token_env", self.token_env)

    def http_token(self, host: str | None = None) -> str:
        """Return the main token HTTP needs; ConfigError when there is none, or a short one guards a public bind."""
        tokens = self.http_tokens(host)
        return next(iter(tokens), "")

    def http_tokens(self, host: str | None = None) -> dict[str, McpScope]:
        """Every bearer token HTTP accepts and its scope (the main one first); ConfigError naming the bad one."""
        bind = host or self.host
        out: dict[str, McpScope] = {}
        main = self.token()
        if main:
            out[main] = self
        for i, t in enumerate(self.tokens):
            value = _env_token(f"mcp.tokens.{i}.token_env", t.token_env)
            if value in out:
                raise ConfigError(f"mcp.tokens.{i}.token_env: holds the same token as another entry "
                                  "(each token has one scope)")
            out[value] = t  # type: ignore[index]
        if not out:
            raise ConfigError("mcp.token_env: MCP over HTTP needs a bearer token (every tool may post): set "
                              "mcp.token_env to the name of an environment variable holding one")
        for i, (value, scope) in enumerate(out.items()):
            key = "mcp.token_env" if scope is self else f"mcp.tokens.{i - (1 if main else 0)}.token_env"
            if not is_loopback(bind) and len(value) < MIN_PUBLIC_TOKEN:
                raise ConfigError(f"{key}: the token is {len(value)} characters; a non-loopback bind ({bind!r}) "
                                  f"needs at least {MIN_PUBLIC_TOKEN}")
        return out


class PollerConfig(_Strict):
    """How often each discovery path runs for one bot (0 disables a path)."""

    inbox_interval_s: float = Field(30.0, ge=0)
    search_interval_s: float = Field(120.0, ge=0)
    search_queries: list[str] = []
    refind_interval_s: float = Field(600.0, ge=0)
    refind_lookback_s: float = Field(86_400.0, gt=0)
    # Rows re-find offers again per run (released, not_landed, expired composing); it walks all of them
    # page by page across runs, so a page of rows that cannot move never hides the rows behind it.
    refind_batch: int = Field(500, ge=1, le=100_000)
    jitter_s: float = Field(2.0, ge=0)
    # Before any path runs, record the own replies the platform shows over the paths' window (replyd.daemon):
    # a new, lost or restored store then never answers what the platform shows answered.
    adopt_at_start: bool = True


class PolicyConfig(_Strict):
    """Whether to answer a found parent at all (see docs/POLICY.md); every skip is an event."""

    skip_bots: bool = True  # stops bot-to-bot loops with accounts that say they are bots
    max_age_s: float | None = Field(None, gt=0)  # do not answer posts older than this
    allow_accounts: list[str] = []  # ids or handles (case-insensitive, leading @ optional); empty: everyone
    deny_accounts: list[str] = []
    allow_keywords: list[str] = []  # case-insensitive substrings; empty: any text
    deny_keywords: list[str] = []
    max_depth: int | None = Field(None, ge=0)  # 0: only top-level posts; stops loops with unflagged bots
    max_per_author_per_hour: int | None = Field(None, ge=1)
    max_per_hour: int | None = Field(None, ge=1)
    dry_run: bool = False  # this bot only: log what would be sent, send and claim nothing


class ResponderConfig(BaseModel):
    """What writes the reply: ``kind`` plus that responder's own settings."""

    model_config = ConfigDict(extra="allow")
    kind: str = "template"


class PushConfig(_Strict):
    """Push discovery for one bot: webhook deliveries (received by the API) or a held stream."""

    kind: Literal["github", "discourse", "slack", "discord", "telegram", "whatsapp", "mastodon_stream", "slack_socket",
                  "bluesky_firehose", "discord_gateway", "imap_idle"]
    # Webhooks: the environment variable holding the secret the platform signs deliveries with.
    secret_env: str = ""
    # WhatsApp (Meta) webhooks: the variable holding the verify token the GET handshake must show.
    verify_token_env: str = ""
    # The inbox poll stays on as the backstop, at this interval unless pollers.inbox_interval_s is set.
    backstop_interval_s: float = Field(300.0, gt=0)

    @property
    def webhook(self) -> bool:
        """Whether deliveries arrive through the API (else the daemon holds a stream open)."""
        return self.kind not in ("mastodon_stream", "slack_socket", "bluesky_firehose", "discord_gateway", "imap_idle")

    @model_validator(mode="after")
    def _secret_for_webhooks(self) -> PushConfig:
        if self.webhook and not self.secret_env:
            raise ValueError(f"secret_env: a {self.kind} webhook needs the variable holding its signing secret")
        if self.kind == "whatsapp" and not self.verify_token_env:
            raise ValueError("verify_token_env: a whatsapp webhook needs the variable holding its verify token")
        return self

    def verify_token(self) -> str:
        """Return the handshake's verify token from the environment; a ConfigError naming the variable if unusable."""
        value = _env_token("push.verify_token_env", self.verify_token_env) or ""
        if len(value) < 16:
            raise ConfigError(f"push.verify_token_env: environment variable {self.verify_token_env!r} is shorter "
                              "than 16 characters")
        return value

    def secret(self) -> str:
        """Return the secret from the environment (masked in logs); a ConfigError naming the variable if unusable."""
        value = _env_token("push.secret_env", self.secret_env) or ""
        if len(value) < 16:
            raise ConfigError(f"push.secret_env: environment variable {self.secret_env!r} is shorter than 16 characters")
        return value


class BotConfig(_Strict):
    """One account on one platform."""

    name: str
    platform: str
    settings: dict[str, Any] = {}
    pollers: PollerConfig = PollerConfig()
    policy: PolicyConfig = PolicyConfig()
    responder: ResponderConfig = ResponderConfig()
    push: PushConfig | None = None  # webhooks or a stream feed the same pipeline; the pollers stay on as the backstop

    def inbox_interval_s(self) -> float:
        """The inbox poll's interval: a push bot's backstop interval unless ``pollers.inbox_interval_s`` is set."""
        if self.push is None or "inbox_interval_s" in self.pollers.model_fields_set:
            return self.pollers.inbox_interval_s
        return self.push.backstop_interval_s
    # setting -> the environment variable it was read from (``token`` -> ``MASTODON_TOKEN``), for error messages
    _env_vars: dict[str, str] = PrivateAttr(default_factory=dict)

    def variables(self) -> list[str]:
        """The environment variables this bot's platform settings were read from (its credentials)."""
        return sorted(set(self._env_vars.values()))

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or not v.replace("-", "").replace("_", "").isalnum():
            raise ValueError("must be letters, digits, '-' or '_'")
        return v

    @model_validator(mode="after")
    def _stream_fits_platform(self) -> BotConfig:
        # A stream is one platform's own (webhook kinds only name a signature scheme, so they are not checked).
        wants = {"mastodon_stream": "mastodon", "bluesky_firehose": "bluesky", "discord_gateway": "discord",
                 "imap_idle": "email"}.get(self.push.kind if self.push else "")
        if wants and self.platform != wants:
            raise ValueError(f"push.kind {self.push.kind!r} is for platform {wants!r}, not {self.platform!r}")  # type: ignore[union-attr]
        return self


class Config(BaseSettings):
    """The whole replyd configuration."""

    model_config = SettingsConfigDict(env_prefix="REPLYD_", env_nested_delimiter="__", extra="forbid")

    replica_id: str = ""  # empty: host:pid:random
    store: StoreConfig = StoreConfig()
    log: LogConfig = LogConfig()
    guard: GuardConfig = GuardConfig()
    sweep: SweepConfig = SweepConfig()
    api: ApiConfig = ApiConfig()
    mcp: McpConfig = McpConfig()
    health: HealthConfig = HealthConfig()
    daemon: DaemonConfig = DaemonConfig()
    fleet: FleetConfig = FleetConfig()
    bots: list[BotConfig] = []
    source: str = Field("", exclude=True)

    @field_validator("bots")
    @classmethod
    def _unique_names(cls, bots: list[BotConfig]) -> list[BotConfig]:
        """Refuse two bots with one name (the name keys metrics, logs and the CLI's --bot)."""
        names = [b.name for b in bots]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate bot name(s) {sorted(dup)}")
        return bots

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Environment first, then the file's values."""
        return (env_settings, init_settings)

    @classmethod
    def load(cls, path: str | Path | None = None, *, secrets: bool = True) -> Config:
        """Load ``path`` (or defaults when None) with environment overrides; raise ConfigError.

        With ``secrets=False`` the ``*_env`` keys are left unresolved: commands that never call a
        platform or a responder (status, log, explain, ...) need none of those variables.
        """
        data: dict[str, Any] = {}
        where = "defaults"
        if path is not None:
            p = Path(path)
            where = str(p)
            try:
                raw = p.read_bytes()
            except OSError as exc:
                raise ConfigError(f"{where}: cannot read config file: {exc.strerror}") from None
            try:
                data = tomllib.loads(raw.decode("utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{where}: not valid TOML: {exc}") from None
        _check_env_names(data, where)
        try:
            cfg = cls(**data)
        except SettingsError as exc:
            m = re.search(r'field "(\w+)"', str(exc))
            var = f"REPLYD_{m.group(1).upper()}" if m else "a REPLYD_* variable"
            raise ConfigError(f"{where}: environment variable {var}: not valid JSON for a section ({exc})") from None
        except ValidationError as exc:
            problems = "; ".join(_problem(err, where, data) for err in exc.errors())
            raise ConfigError(problems) from None
        cfg.source = where
        try:
            cfg.mcp.check_bots("mcp", [b.name for b in cfg.bots])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        literal = False
        for b in cfg.bots:
            raw = list(b.settings.items()) + list((b.responder.model_extra or {}).items())
            for k, v in raw:
                # A secret written into the file itself (not through *_env): mask it, and mind the mode.
                if isinstance(v, str) and not k.endswith("_env") and any(w in k.lower() for w in SECRET_WORDS):
                    rlog.add_secret(v)
                    literal = True
            b.settings = _hide_literal_secrets(b.settings)
            b.responder = ResponderConfig(kind=b.responder.kind,
                                          **_hide_literal_secrets(dict(b.responder.model_extra or {})))
            b._env_vars = {k[: -len("_env")]: v for k, v in b.settings.items() if k.endswith("_env") and isinstance(v, str)}
            if not secrets:
                continue
            b.settings = resolve_env(b.settings, f"{where}: bots.{b.name}.settings")
            extra = resolve_env(dict(b.responder.model_extra or {}), f"{where}: bots.{b.name}.responder")
            b.responder = ResponderConfig(kind=b.responder.kind, **extra)
        if literal and path is not None:
            _warn_if_world_readable(Path(path))
        return cfg


def _env_source(loc: tuple[Any, ...]) -> str | None:
    """Return the REPLYD_* variable that set the value at ``loc``, if one did (the most specific wins)."""
    parts = [str(x) for x in loc if not isinstance(x, int)]
    for n in range(len(parts), 0, -1):
        name = "REPLYD_" + "__".join(parts[:n]).upper()
        if name in os.environ:
            return name
    return None


def _problem(err: Any, where: str, data: dict[str, Any]) -> str:
    """Describe one validation error: bots by name, the variable when the value came from one, a suggestion
    for an unknown key."""
    loc = tuple(err["loc"])
    parts = []
    for i, x in enumerate(loc):
        if isinstance(x, int) and i > 0 and loc[i - 1] == "bots":
            bots = data.get("bots")
            name = bots[x].get("name") if isinstance(bots, list) and x < len(bots) and isinstance(bots[x], dict) else None
            named = isinstance(name, str) and name and name.replace("-", "").replace("_", "").isalnum()
            parts.append(str(name) if named else str(x))  # a bot by its name; by its index when the name is bad
        else:
            parts.append(str(x))
    dotted = ".".join(parts) or "(top)"
    var = _env_source(loc)
    origin = f"environment variable {var} (overrides {where})" if var else where
    msg = err["msg"].removeprefix("Value error, ")  # a validator's own words need no pydantic prefix
    if err.get("type") == "extra_forbidden" and loc:
        hint = suggest(str(loc[-1]), fields_at(Config, loc[:-1]))
        msg += f" (did you mean {hint}?)" if hint else f" (known: {', '.join(fields_at(Config, loc[:-1]))})"
    return f"{origin}: {dotted}: {msg}"


def suggest(name: str, known: list[str]) -> str | None:
    """The closest known name to a misspelt one, if any is close."""
    hits = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1, cutoff=0.7)
    return next((k for k in known if hits and k.lower() == hits[0]), None)


def fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed at ``loc`` inside ``model`` (list indexes skipped; [] past a free-form table)."""
    cur: Any = model
    for x in loc:
        if isinstance(x, int):
            continue
        fields = getattr(cur, "model_fields", None)
        if not fields or x not in fields:
            return []
        ann = fields[x].annotation
        args = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        cur = args[0] if args else ann
    fields = getattr(cur, "model_fields", None) or {}
    return [k for k in fields if not fields[k].exclude]


# REPLYD_* variables that are not settings: the CLI's config path, and test/bench harness knobs.
_NOT_SETTINGS = ("REPLYD_CONFIG",)


def _check_env_names(data: dict[str, Any], where: str) -> None:
    """Refuse a ``REPLYD_<SECTION>__<KEY>`` (or a near miss of a setting) that names no setting.

    pydantic-settings ignores unknown variables, so ``REPLYD_SWEP__INTERVAL_S=5`` would silently do
    nothing. Variables a config names through ``*_env`` (secrets) are never settings and pass.
    """
    named = set(_env_names(data))
    flat: list[str] = []
    for top in fields_at(Config, ()):
        subs = fields_at(Config, (top,))
        flat += [f"{top}__{k}".upper() for k in subs] if subs and top != "bots" else [top.upper()]
    for var in sorted(os.environ):
        if not var.startswith("REPLYD_") or var in named or var in _NOT_SETTINGS:
            continue
        rest = var[len("REPLYD_"):]
        if rest in flat or (rest.split("__")[0] in ("STORE", "LOG", "GUARD", "SWEEP", "API", "HEALTH", "BOTS")
                            and "__" not in rest):
            continue
        # Checked: the nested shape (SECTION__KEY), a single-underscore miss of one (SWEEP_INTERVAL_S), a near
        # miss of a top-level key. Other REPLYD_* names (a token variable like REPLYD_API_TOKEN) are not settings.
        single = {f.replace("__", "_"): f for f in flat if "__" in f}
        top = [f for f in flat if "__" not in f]
        hint = single.get(rest) or suggest(rest, flat if "__" in rest else top)
        if "__" in rest or hint:
            where_hint = f" (did you mean REPLYD_{hint}?)" if hint else f" (known sections: {', '.join(fields_at(Config, ()))})"
            raise ConfigError(f"environment variable {var} (overrides {where}): no such setting{where_hint}; "
                              "it would be ignored")


def _env_names(data: Any) -> list[str]:
    """Every variable a config names through a ``*_env`` key, at any depth."""
    out: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(k, str) and k.endswith("_env") and isinstance(v, str):
                out.append(v)
            else:
                out += _env_names(v)
    elif isinstance(data, list):
        for v in data:
            out += _env_names(v)
    return out


SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey")


def _hide_literal_secrets(settings: dict[str, Any]) -> dict[str, Any]:
    """A secret written into the file itself (a string under a key naming a secret) as a ``SecretStr``."""
    return {k: SecretStr(v) if isinstance(v, str) and not k.endswith("_env") and any(w in k.lower() for w in SECRET_WORDS)
            else v for k, v in settings.items()}


def resolve_env(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """Replace every ``<key>_env = "VAR"`` by ``<key> = SecretStr($VAR)``; register the value as a secret.

    The platform and responder settings models read a ``SecretStr`` wherever they read
    a string (``platforms.base.plain_settings``), so a secret stays hidden until the adapter uses it.
    """
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if k.endswith("_env") and not isinstance(v, str):
            raise ConfigError(f"{where}.{k}: must name an environment variable (a string), got {type(v).__name__}")
        if k.endswith("_env"):
            name = k[: -len("_env")]
            value = os.environ.get(v)
            if value is None or value == "":
                raise ConfigError(f"{where}.{k}: environment variable {v!r} is not set")
            rlog.add_secret(value)
            out[name] = SecretStr(value)  # hidden in every repr of the config; the settings models take it as is
        else:
            out[k] = v
    return out


def _warn_if_world_readable(p: Path) -> None:
    try:
        mode = p.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("replyd.config.readable", path=str(p), mode=oct(mode & 0o777),
                       hint="this file holds a secret and others can read it: chmod 600, or use <key>_env")
