"""What every ``replyd`` command shares: the typer apps, the consoles, the common options, config and store opening."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from typing import TYPE_CHECKING

import typer

from replyd.errors import ConfigError, StoreError

# Heavy modules (SQLAlchemy, pydantic, structlog, rich) are imported inside the functions that use them.
# `replyd --version` and `replyd -h` then start at once: a test holds `--version` to that.
if TYPE_CHECKING:
    from replyd.config import Config
    from replyd.store import Store

EXIT_CODES = """Exit codes: 0 done; 1 a negative answer (check: not answered; explain, rearm: no such row;
rearm --state: a row moved on before it was rearmed; adopt: not every parent read back); 2 an error (config, store, platform, usage), one line on stderr;
130 interrupted."""

_CTX = {"help_option_names": ["-h", "--help"]}
# rich_markup_mode=None: plain click help and usage errors, never boxes or markup off a terminal.
app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings=_CTX, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="Answer each post, thread or ticket exactly once.\n\n" + EXIT_CODES)
db_app = typer.Typer(no_args_is_help=True, context_settings=_CTX, rich_markup_mode=None, help="The answered-log's schema.")
config_app = typer.Typer(no_args_is_help=True, context_settings=_CTX, rich_markup_mode=None, help="Config files.")
app.add_typer(db_app, name="db")
app.add_typer(config_app, name="config")


def lazy(name: str) -> Any:
    """Module ``name``, loaded on its first attribute access: a command pays only for what it uses."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


class _Console:
    """A rich Console made on first use, so a command that prints nothing never imports rich."""

    def __init__(self, stderr: bool = False) -> None:
        self._stderr = stderr
        self._console: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            if self._stderr:
                self._console = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
            else:  # off a terminal: no wrapping at 80 columns, never markup (text from posts has brackets)
                self._console = Console(markup=False, highlight=False, width=None if sys.stdout.isatty() else 10_000)
        return getattr(self._console, name)


out = _Console()
err = _Console(stderr=True)
_VERBOSE = {"on": False}

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", envvar="REPLYD_CONFIG", help="TOML config file (default: built-in defaults).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ParentArg = Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.")]
StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="The store: a SQLAlchemy URL or a SQLite file path (default: store.url, "
                                 "REPLYD_STORE__URL, else $XDG_STATE_HOME/replyd/replyd.sqlite3)."),
]


def _version(value: bool) -> None:
    if value:
        from replyd import __version__

        print(f"replyd {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", "-V", is_eager=True, callback=_version,
                                          help="Print the version and exit.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logs, migrations included.")] = False,
) -> None:
    """Answer each post, thread or ticket exactly once."""
    _VERBOSE["on"] = verbose


def _load(config: Path | None, *, secrets: bool = True, store: str | None = None) -> Config:
    """Load the config (``secrets=False``: leave ``*_env`` unresolved) and configure logging."""
    from replyd import log as rlog
    from replyd.config import Config

    cfg = Config.load(config, secrets=secrets)
    if store:
        cfg.store.url = store if "://" in store else f"sqlite:///{Path(store).expanduser().resolve()}"
    rlog.configure(cfg.log.format, "debug" if _VERBOSE["on"] else cfg.log.level)
    if _VERBOSE["on"]:
        import logging

        logging.getLogger("alembic").setLevel(logging.INFO)
    return cfg


def _store(cfg: Config) -> Store:
    """Open the store for a command that may write (adopt): never migrate a server database from here, but
    give a database with no schema at all one (nothing else can be using it yet)."""
    from replyd import store as st
    from replyd.clock import DatabaseClock

    url = cfg.store.url or st.default_url()
    embedded = url.startswith("sqlite")
    migrate = embedded and cfg.store.auto_migrate
    if not migrate:
        s = st.Store.open(url, migrate=None)
        if s.schema_revision()[0] is None:
            s.upgrade()
        s.dispose()
    s = st.Store.open(url, migrate=migrate)
    if not embedded and cfg.store.db_clock:
        s.clock = DatabaseClock(s.db_epoch)  # `sweep --once` from another machine decides on the daemons' time
    return s


def preflight(cfg: Config) -> None:
    """Every check ``replyd run`` makes before it opens the store or contacts a platform; ConfigError/StoreError.

    ``replyd run`` and ``replyd config check`` both call this, so the two never disagree on a config: the
    secrets (resolved by ``Config.load``), every bot's adapter and responder settings, push (a webhook needs the
    API and a secret of 16+ characters; the adapter must read webhooks or hold the stream), the API's bind,
    token and opened routes, a set MCP token's length on a public bind, and the store's URL and directory.
    """
    import httpx

    from replyd import store as st
    from replyd.clock import SystemClock
    from replyd.platforms.base import StreamSource, WebhookSource, make_platform, registered_kinds
    from replyd.responders import make_responder

    where = cfg.source
    if not cfg.bots:
        raise ConfigError(f"{where}: no [[bots]] configured; see config/ for examples, or try `replyd demo`")
    kinds = registered_kinds()
    with httpx.Client() as http:  # building an adapter makes no request
        for b in cfg.bots:
            if b.platform not in kinds:
                raise ConfigError(f"{where}: bots.{b.name}.platform: unknown platform {b.platform!r} "
                                  f"(known: {', '.join(kinds)})")
            try:
                plat = make_platform(b.platform, b.settings, http=http, clock=SystemClock())
                make_responder(b.responder.kind, b.responder.model_dump(exclude={"kind"}))
                if b.push is not None and b.push.webhook:
                    if not cfg.api.enabled:
                        raise ConfigError(f"push: {b.push.kind} webhooks arrive through the API: set api.enabled = true")
                    b.push.secret()
                    if not isinstance(plat, WebhookSource):
                        raise ConfigError(f"push: the {b.platform} adapter cannot read webhook deliveries")
                elif b.push is not None and not isinstance(plat, StreamSource):
                    raise ConfigError(f"push: the {b.platform} adapter has no push stream")
            except ConfigError as exc:
                raise ConfigError(f"{where}: bots.{b.name}: {exc}") from None
    try:
        if cfg.api.enabled:
            from replyd.api import check_bind
            from replyd.api.gate import open_paths

            check_bind(cfg.api.host, cfg.api.token())
            open_paths(cfg.api.open_routes)
        # `replyd run` never serves MCP: an unset token is fine (stdio, or `replyd mcp` refuses it itself), but a
        # token that is set and too short for the configured public bind is a broken config either way.
        set_main = bool(cfg.mcp.token_env and os.environ.get(cfg.mcp.token_env))
        set_scoped = bool(cfg.mcp.tokens) and all(os.environ.get(t.token_env) for t in cfg.mcp.tokens)
        if set_main or set_scoped:
            cfg.mcp.http_tokens()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    check_store_url(cfg.store.url or st.default_url())


def check_store_url(url: str) -> None:
    """Refuse (StoreError) a store URL ``Store.open`` would refuse for its scheme or, for SQLite, its file or
    directory, without connecting or creating anything (a probe file or directory is made and removed)."""
    from replyd import store as st
    from replyd.store.engine import is_sqlite_url, parse_url
    from replyd.store.postgres import PostgresStore

    parsed = parse_url(url)
    if not is_sqlite_url(parsed):
        PostgresStore.make_engine(parsed).dispose()  # the scheme and its driver; an engine connects lazily
        return
    db = st.sqlite_file(url)
    if db is None:
        return
    if db.exists():
        if not db.is_file():
            raise StoreError(f"store {db}: not a regular file")
        try:
            os.close(os.open(db, os.O_RDWR))  # opened for writing, nothing written
        except OSError as exc:
            raise StoreError(f"store {db}: cannot write it: {exc.strerror}") from None
    # The nearest directory that exists must take a new entry: the database (and its -wal and -shm files) or the
    # missing directories above it.
    near = db.parent
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise StoreError(f"cannot create the store {db}: {near} is not a directory")
    try:
        if near == db.parent:
            fd, probe = tempfile.mkstemp(prefix=".replyd-probe-", dir=near)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".replyd-probe-", dir=near))
    except OSError as exc:
        raise StoreError(f"cannot create the store {db}: {near}: {exc.strerror}") from None


def _existing_store(cfg: Config) -> Store:
    """Open a store that must already exist, for read commands: never create a file, never migrate.

    Under the systemd unit the daemon's store lives in its own state directory; an admin's shell
    would otherwise get a fresh empty store and the false answer "nothing answered".
    """
    from replyd import store as st
    from replyd.clock import DatabaseClock

    url = cfg.store.url or st.default_url()
    _require_file(url)
    s = st.Store.open(url, migrate=False)
    if not s.is_sqlite and cfg.store.db_clock:
        s.clock = DatabaseClock(s.db_epoch)
    return s


def _light_settings() -> bool:
    """True when no REPLYD_* variable (but REPLYD_CONFIG) could change a default: the config is then not loaded."""
    return not any(k.startswith("REPLYD_") and k != "REPLYD_CONFIG" for k in os.environ)


def _read_store(config: Path | None, store: str | None) -> tuple[Any, Config | None]:
    """The store a read command reads (status, explain, check, log), and the config when one was given.

    A plain SQLite file opens a ``SQLiteReader``: stdlib sqlite3, no SQLAlchemy or SQLModel to import. Any
    other store opens the full ``Store``, which has the same reads. Without a config (nor a REPLYD_*
    variable) the config is not loaded at all: its defaults name the store.
    """
    from replyd.store.location import default_url, plain_sqlite_file

    cfg = None
    if config is not None or not _light_settings() or _VERBOSE["on"]:
        cfg = _load(config, secrets=False, store=store)
        url = cfg.store.url or default_url()
    else:
        url = (store if "://" in store else f"sqlite:///{Path(store).expanduser().resolve()}") if store else default_url()
    path = plain_sqlite_file(url)
    if path is None:
        if cfg is None:
            cfg = _load(config, secrets=False, store=store)
        return _existing_store(cfg), cfg
    from replyd.store.reader import SQLiteReader

    _require_file(url)
    reader = SQLiteReader(path, url=url)
    try:
        reader.require_schema()
    except StoreError:
        reader.dispose()
        raise
    return reader, cfg


def _emit_json(data: Any) -> None:
    """Print JSON on stdout, unwrapped, whatever the terminal."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def parse_time(text: str, now: float, option: str = "--since") -> float:
    """Read a point in time: epoch seconds, ISO 8601 (a date, or a date and time; UTC unless it says), or a
    duration back from ``now`` (``90s``, ``15m``, ``2h``, ``7d``, ``1h30m``)."""
    t = text.strip()
    try:
        return float(t)
    except ValueError:
        pass
    m = _DURATION.fullmatch(t.lower())
    if m and any(m.groups()):
        d, h, mi, sec = (float(g) if g else 0.0 for g in m.groups())
        return now - (d * 86_400 + h * 3600 + mi * 60 + sec)
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a time: use ISO 8601 (2026-12-01, 2026-12-01T08:00Z), "
                          "a duration back from now (90s, 15m, 2h, 7d) or epoch seconds") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def _ts(t: float | None) -> str:
    return "" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _require_file(url: str) -> None:
    """Raise StoreError when a SQLite store's file does not exist (read commands never create one)."""
    from replyd.store.location import plain_sqlite_file

    if url.startswith("sqlite"):
        path = plain_sqlite_file(url)
        if path is None:  # a URL with a query or a URI: SQLAlchemy reads it
            from replyd import store as st

            path = st.sqlite_file(url)
        if path is not None and not path.is_file():
            raise StoreError(f"no store at {path}: nothing was ever recorded there (a daemon creates it on its "
                             f"first start); name the store with --store or REPLYD_STORE__URL")


def _bot_config(cfg: Config, name: str | None) -> list:
    """Return the configured bots, or the one named ``name``."""
    if not cfg.bots:
        raise ConfigError(f"{cfg.source}: no [[bots]] configured; this command needs a config with bots")
    if name is None:
        return list(cfg.bots)
    hits = [b for b in cfg.bots if b.name == name]
    if not hits:
        raise ConfigError(f"{cfg.source}: no bot named {name!r} (bots: {', '.join(b.name for b in cfg.bots)})")
    return hits


# Stand-ins for a bot's credentials, to build its adapter for its instance alone; the next is tried when an adapter
# refuses one for its form (Slack tells its token kinds by prefix).
_STAND_INS = ("replyd-unresolved", "xoxb-replyd-unresolved", "xapp-replyd-unresolved")


def _instance_of(cfg: Config, name: str) -> str | None:
    """Return the platform instance of bot ``name`` from its settings alone, or None if no bot has that name.

    The instance (the first part of every key the bot writes) comes from settings such as ``base_url``,
    ``instance`` or ``team_id``, never from a credential: each ``*_env`` setting gets a stand-in value, so no
    secret is read and no request is made.
    """
    import httpx

    from replyd.clock import SystemClock
    from replyd.platforms.base import make_platform

    bc = next((b for b in cfg.bots if b.name == name), None)
    if bc is None:
        return None
    plain = {k: v for k, v in bc.settings.items() if not k.endswith("_env")}
    tries = {k[: -len("_env")]: 0 for k in bc.settings if k.endswith("_env")}
    while True:
        settings = {"listing_delay_s": 10.0, **plain, **{k: _STAND_INS[i] for k, i in tries.items()}}
        try:
            with httpx.Client() as http:  # building an adapter makes no request
                return make_platform(bc.platform, settings, http=http, clock=SystemClock()).instance
        except ConfigError as exc:
            m = re.search(r"setting '(\w+)'", str(exc))
            key = m.group(1) if m else ""
            if key not in tries or tries[key] + 1 >= len(_STAND_INS):
                raise ConfigError(f"{cfg.source}: bots.{name}: {exc}") from None
            tries[key] += 1


def _senders_on(s: Store, instance: str) -> list[str]:
    """The sender ids the store has rows for on platform ``instance`` (one per account posting there)."""
    return sorted({sender for platform, sender, *_ in s.path_counts() if platform == instance})
