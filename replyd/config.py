"""Configuration: a TOML file, then ``REPLYD_*`` environment overrides.

Nested keys are overridden with a double underscore:
``REPLYD_STORE__URL=postgresql+psycopg://…`` or ``REPLYD_SWEEP__INTERVAL_S=5``.

Secrets never live in the file: any platform or responder setting whose name
ends in ``_env`` names an environment variable, read at load time
(``token_env = "MASTODON_TOKEN"`` gives the adapter ``token``). Every error
names the file, the key and the problem.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from replyd import log as rlog
from replyd.errors import ConfigError

logger = structlog.get_logger("replyd.config")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StoreConfig(_Strict):
    """Where the answered-log lives."""

    url: str = ""  # empty: SQLite under $XDG_STATE_HOME/replyd/
    auto_migrate: bool = True
    # PostgreSQL: every replica takes its time from the database server (re-read every clock_sync_s),
    # so replicas on machines whose clocks disagree still agree on deadlines and leases.
    db_clock: bool = True
    clock_sync_s: float = Field(60.0, gt=0)


class LogConfig(_Strict):
    """How replyd logs."""

    format: Literal["auto", "console", "json"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class GuardConfig(_Strict):
    """The posting function's limits."""

    max_attempts: int = Field(2, ge=1, le=5)
    send_timeout_s: float = Field(30.0, gt=0)
    compose_lease_s: float = Field(120.0, gt=0)
    dry_run: bool = False  # every bot: log what would be sent, send and claim nothing
    responder_backoff_s: float = Field(30.0, gt=0)  # after a responder failure; doubles per failure in a row
    responder_backoff_max_s: float = Field(3600.0, gt=0)


class SweepConfig(_Strict):
    """The read-back sweep."""

    interval_s: float = Field(15.0, gt=0)
    batch: int = Field(1000, ge=1, le=5000)
    lease_s: float = Field(120.0, gt=0)
    retry_s: float = Field(60.0, gt=0)
    on_duplicate: Literal["report", "delete_newer"] = "report"
    # The listing delay in use per platform instance (replyd.lag): max(configured, factor x the observed lag's
    # percentile), at most listing_delay_max_s, once listing_delay_min_samples sends were measured.
    listing_delay_auto: bool = True
    listing_delay_factor: float = Field(2.0, ge=1.0, le=10.0)
    listing_delay_percentile: float = Field(99.0, gt=0, le=100)
    listing_delay_min_samples: int = Field(10, ge=1)
    listing_delay_max_s: float = Field(600.0, gt=0)
    listing_lag_window: int = Field(500, ge=10, le=100_000)  # newest samples the percentile is taken over
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


class ApiConfig(_Strict):
    """The sidecar HTTP API and status page the daemon serves.

    Writes always need the bearer token; reads need it too when ``host`` is not
    a loopback address (and the daemon refuses to start there without one).
    The token itself never lives in the file: ``token_env`` names the
    environment variable that holds it.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(8787, ge=0, le=65535)  # 0: an ephemeral port (tests)
    token_env: str = ""
    refresh_s: int = Field(5, ge=1, le=3600)  # the status page's auto-refresh
    max_body_bytes: int = Field(65_536, ge=1024)

    def token(self) -> str | None:
        """Return the API token from ``$token_env`` (None when unset); raise ConfigError if named but empty."""
        if not self.token_env:
            return None
        value = os.environ.get(self.token_env)
        if not value:
            raise ConfigError(f"api.token_env: environment variable {self.token_env!r} is not set")
        rlog.add_secret(value)
        return value


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


class BotConfig(_Strict):
    """One account on one platform."""

    name: str
    platform: str
    settings: dict[str, Any] = {}
    pollers: PollerConfig = PollerConfig()
    policy: PolicyConfig = PolicyConfig()
    responder: ResponderConfig = ResponderConfig()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or not v.replace("-", "").replace("_", "").isalnum():
            raise ValueError("must be letters, digits, '-' or '_'")
        return v


class Config(BaseSettings):
    """The whole replyd configuration."""

    model_config = SettingsConfigDict(env_prefix="REPLYD_", env_nested_delimiter="__", extra="forbid")

    replica_id: str = ""  # empty: host:pid:random
    store: StoreConfig = StoreConfig()
    log: LogConfig = LogConfig()
    guard: GuardConfig = GuardConfig()
    sweep: SweepConfig = SweepConfig()
    api: ApiConfig = ApiConfig()
    bots: list[BotConfig] = []
    source: str = Field("", exclude=True)

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
    def load(cls, path: str | Path | None = None) -> Config:
        """Load ``path`` (or defaults when None) with environment overrides; raise ConfigError."""
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
        try:
            cfg = cls(**data)
        except SettingsError as exc:
            m = re.search(r'field "(\w+)"', str(exc))
            var = f"REPLYD_{m.group(1).upper()}" if m else "a REPLYD_* variable"
            raise ConfigError(f"{where}: environment variable {var}: not valid JSON for a section ({exc})") from None
        except ValidationError as exc:
            problems = "; ".join(_problem(err, where) for err in exc.errors())
            raise ConfigError(problems) from None
        cfg.source = where
        names = [b.name for b in cfg.bots]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"{where}: bots: duplicate bot name(s) {sorted(dup)}")
        literal = False
        for b in cfg.bots:
            raw = list(b.settings.items()) + list((b.responder.model_extra or {}).items())
            for k, v in raw:
                # A secret written into the file itself (not through *_env): mask it, and mind the mode.
                if isinstance(v, str) and not k.endswith("_env") and any(w in k.lower() for w in SECRET_WORDS):
                    rlog.add_secret(v)
                    literal = True
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


def _problem(err: Any, where: str) -> str:
    """Describe one validation error, naming the environment variable when the value came from one."""
    dotted = ".".join(str(x) for x in err["loc"]) or "(top)"
    var = _env_source(tuple(err["loc"]))
    origin = f"environment variable {var} (overrides {where})" if var else where
    return f"{origin}: {dotted}: {err['msg']}"


SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey")


def resolve_env(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """Replace every ``<key>_env = "VAR"`` by ``<key> = $VAR``; register the value as a secret."""
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
            out[name] = value
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
