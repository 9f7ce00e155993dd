"""The ``replyd`` command line: run, demo, status, explain, check, sweep, log, rearm, adopt, export, db, config."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from replyd import lag
from replyd import log as rlog
from replyd import store as st
from replyd.clock import DatabaseClock
from replyd.config import Config
from replyd.errors import ConfigError, ReplydError, StoreError
from replyd.guard import Status, _classify
from replyd.store import Key, Store

EXIT_CODES = """Exit codes: 0 done; 1 a negative answer (check: not answered; explain, rearm: no such row;
adopt: not every parent read back); 2 an error (config, store, platform, usage), one line on stderr;
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
# Off a terminal: no wrapping at 80 columns (tables keep their width) and never markup (text from posts has brackets).
out = Console(markup=False, highlight=False, width=None if sys.stdout.isatty() else 10_000)
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
_VERBOSE = {"on": False}

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", envvar="REPLYD_CONFIG", help="TOML config file (default: built-in defaults).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
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
    cfg = Config.load(config, secrets=secrets)
    if store:
        cfg.store.url = store if "://" in store else f"sqlite:///{Path(store).expanduser().resolve()}"
    rlog.configure(cfg.log.format, "debug" if _VERBOSE["on"] else cfg.log.level)
    if _VERBOSE["on"]:
        import logging

        logging.getLogger("alembic").setLevel(logging.INFO)
    return cfg


def _store(cfg: Config) -> Store:
    """Open the store for a command that may write (adopt): never migrate a server database from here."""
    url = cfg.store.url or st.default_url()
    embedded = url.startswith("sqlite")
    s = Store.open(url, migrate=embedded and cfg.store.auto_migrate)
    if not embedded and cfg.store.db_clock:
        s.clock = DatabaseClock(s.db_epoch)  # `sweep --once` from another machine decides on the daemons' time
    return s


def _existing_store(cfg: Config) -> Store:
    """Open a store that must already exist, for read commands: never create a file, never migrate.

    Under the systemd unit the daemon's store lives in its own state directory; an admin's shell
    would otherwise get a fresh empty store and the false answer "nothing answered".
    """
    url = cfg.store.url or st.default_url()
    _require_file(url)
    s = Store.open(url, migrate=False)
    if not s.is_sqlite and cfg.store.db_clock:
        s.clock = DatabaseClock(s.db_epoch)
    return s


def _emit_json(data: Any) -> None:
    """Print JSON on stdout, unwrapped, whatever the terminal."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def parse_time(text: str, now: float) -> float:
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
        raise ConfigError(f"--since: {text!r} is not a time: use ISO 8601 (2026-12-01, 2026-12-01T08:00Z), "
                          "a duration back from now (90s, 15m, 2h, 7d) or epoch seconds") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def _ts(t: float | None) -> str:
    return "" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def run(config: ConfigOpt = None, grace_s: Annotated[float, typer.Option(help="Seconds to finish in-flight sends on stop.")] = 30.0) -> None:
    """Run the daemon: pollers, guard and sweep, until SIGTERM/SIGINT."""
    from replyd.daemon import Daemon

    cfg = _load(config)
    if not cfg.bots:
        raise ConfigError(f"{cfg.source}: no [[bots]] configured; see config/ for examples, or try `replyd demo`")
    raise typer.Exit(Daemon(cfg).run_forever(grace_s))


@app.command()
def demo(
    as_json: JsonOpt = False,
    quick: Annotated[bool, typer.Option(help="Fewer parents per scenario.")] = False,
) -> None:
    """Run the simulated platform and show naive bots against replyd, scenario by scenario."""
    from replyd import demo as demo_mod

    raise typer.Exit(demo_mod.main(as_json=as_json, quick=quick))


@app.command()
def mcp(
    config: ConfigOpt = None,
    transport: Annotated[str, typer.Option(help="stdio (an agent host starts this process) or http (streamable HTTP).")] = "stdio",
    host: Annotated[str | None, typer.Option(help="HTTP: address to bind (default: mcp.host).")] = None,
    port: Annotated[int | None, typer.Option(min=0, max=65535, help="HTTP: port (default: mcp.port; 0: any free port).")] = None,
) -> None:
    """Serve the MCP tools (check_parent, begin_reply, finish_reply, reply_once, explain) for LLM agents."""
    try:
        from replyd import mcp as mcp_mod
    except ModuleNotFoundError as exc:
        raise ConfigError(f"replyd mcp needs the MCP SDK ({exc.name} is missing): pip install 'replyd[mcp]'") from None
    if transport not in ("stdio", "http"):
        raise ConfigError(f"--transport: unknown transport {transport!r} (use stdio or http)")
    cfg = _load(config)
    mc = cfg.mcp
    # Checked first: a missing token fails before any bot logs in.
    token = mc.http_token(host) if transport == "http" else ""
    service, close = mcp_mod.open_service(cfg)
    try:
        if transport == "stdio":
            mcp_mod.serve_stdio(service)
        else:
            mcp_mod.serve_http(service, host=host or mc.host, port=mc.port if port is None else port, path=mc.path,
                               token=token, names=mc.hosts)
    finally:
        close()


@app.command()
def status(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    overdue_after_s: Annotated[float, typer.Option(
        "--overdue-after-s", help="List waiting rows this many seconds past their bound.")] = 600.0,
    store: StoreOpt = None,
) -> None:
    """Show row counts by platform and state, the oldest open rows, rows that waited past their bound, and (from
    the daemon) each path's liveness."""
    cfg = _load(config, secrets=False, store=store)
    s = _existing_store(cfg)
    counts = s.counts()
    oldest = s.oldest_open(5)
    now = s.clock.now()
    # Every non-terminal state has a job that moves it on (sweep, re-find): a row listed here is one they did not.
    overdue = s.overdue(now, overdue_after_s)
    daemon = _daemon_liveness(cfg)
    if as_json:
        data = {
            "store": s.url,
            "counts": [{"platform": p, "state": state, "rows": n} for (p, state), n in sorted(counts.items())],
            "oldest_open": [{"platform": r.platform, "parent_id": r.parent_id, "age_s": round(now - (r.opened_at or now), 1)} for r in oldest],
            "overdue": [{"platform": r.platform, "parent_id": r.parent_id, "state": r.state, "attempt": r.attempt,
                         "over_s": round(over, 1)} for r, over in overdue],
            "daemon": daemon,
            "listing": lag.summaries(s),  # per platform instance: configured and in-use delay, observed lag
        }
        _emit_json(data)
        return
    out.print(f"store: {s.url}")
    _print_liveness(daemon)
    t = Table("platform", *st.STATES, title="rows by state")
    for plat in sorted({p for p, _ in counts}):
        t.add_row(plat, *[str(counts.get((plat, state), 0)) for state in st.STATES])
    out.print(t if counts else "no rows yet: nothing answered")
    if oldest:
        o = Table("platform", "parent id", "opened", "age (s)", title="oldest open rows")
        for r in oldest:
            o.add_row(r.platform, r.parent_id, _ts(r.opened_at), f"{now - (r.opened_at or now):.0f}")
        out.print(o)
    if overdue:
        t = Table("platform", "parent id", "state", "attempt", "past its bound (s)",
                  title=f"rows waiting more than {overdue_after_s:.0f} s past their bound")
        for r, over in overdue:
            t.add_row(r.platform, r.parent_id, r.state, str(r.attempt), f"{over:.0f}")
        out.print(t)


def _daemon_liveness(cfg: Config) -> dict[str, Any]:
    """Ask the running daemon's API (when the config enables it) how every bot's paths are doing.

    Only the daemon knows when a poll last worked; the store does not record it.
    """
    import httpx

    ac = cfg.api
    if not ac.enabled:
        return {"reachable": False, "url": None, "error": "the config does not enable [api]; liveness needs it",
                "liveness": {}}
    host = "127.0.0.1" if ac.host in ("0.0.0.0", "", "::") else ac.host
    url = f"http://{host if ':' not in host else f'[{host}]'}:{ac.port}"
    token = os.environ.get(ac.token_env) if ac.token_env else None
    try:
        r = httpx.get(url + "/v1/status", timeout=3.0, headers={"Authorization": f"Bearer {token}"} if token else {})
        live = r.json().get("liveness", {}) if r.status_code in (200, 503) else None
        problem = None if live is not None else f"HTTP {r.status_code}"
    except (httpx.HTTPError, ValueError) as exc:
        live, problem = None, str(exc) or "no answer"
    if live is None:
        return {"reachable": False, "url": url, "error": f"daemon not reachable at {url}: {problem}", "liveness": {}}
    return {"reachable": True, "url": url, "error": None, "liveness": live}


def _print_liveness(daemon: dict[str, Any]) -> None:
    """Each bot's paths in words; a stale path red and marked STALE."""
    if not daemon["reachable"]:
        out.print(Text(f"daemon: {daemon['error']}", style="yellow"))
        return
    out.print(f"daemon: {daemon['url']}")
    for bot, b in sorted(daemon["liveness"].items()):
        for path, p in sorted(b["paths"].items()):
            style = "bold red" if p["stale"] else ("yellow" if p["failures"] else "green")
            out.print(Text(f"  {bot} {p['words']}", style=style))
        if b.get("oldest_due_open_age_s") is not None:
            out.print(Text(f"  {bot} oldest due open row: {b['oldest_due_open_age_s']:.0f} s past its deadline",
                           style="yellow"))


def _rows_for(s: Store, parent: str, platform: str | None) -> list[st.Reply]:
    rows = s.find(parent, platform)
    if not rows:
        err.print(f"no row for parent id {parent!r}" + (f" on {platform}" if platform else "") + " (ids are exact: case and leading zeros matter)")
    return rows


@app.command()
def explain(
    parent: Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.")],
    platform: Annotated[str | None, typer.Option(help="Platform instance, when several have this id.")] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Show the whole history of one parent's key."""
    cfg = _load(config, secrets=False, store=store)
    s = _existing_store(cfg)
    rows = s.find(parent, platform)
    if not rows:
        # A parent the policy skipped (or a dry run showed) has events but no row.
        events = s.find_events(parent, platform)
        if not events:
            _rows_for(s, parent, platform)
            raise typer.Exit(1)
        _explain_unclaimed(parent, events, as_json)
        return
    docs: list[dict[str, Any]] = []
    for r in rows:
        events = s.history(Key(r.platform, r.sender_id, r.parent_id))
        doc = {"row": {k: v for k, v in r.model_dump().items() if k != "snapshot"},
               "events": [{**e.model_dump(exclude={"detail"}), "detail": json.loads(e.detail)} for e in events]}
        docs.append(doc)
        if not as_json:
            out.print(f"{r.platform} sender {r.sender_id} parent {r.parent_id}: "
                      f"{r.state} attempt {r.attempt} reply {r.reply_id or '-'} (found by {r.path or '-'})")
            t = Table("at", "event", "state", "attempt", "owner", "detail")
            for e in events:
                t.add_row(_ts(e.at), e.kind, e.state or "", str(e.attempt or ""), e.owner or "", e.detail)
            out.print(t)
    if as_json:
        _emit_json(docs)


def _explain_unclaimed(parent: str, events: list[st.Event], as_json: bool) -> None:
    """Print the events of a parent that has no row: why it was skipped, what a dry run would have sent."""
    docs = []
    for (platform, sender), group in itertools.groupby(events, key=lambda e: (e.platform, e.sender_id)):
        evs = list(group)
        reasons = sorted({json.loads(e.detail).get("reason", "") for e in evs if e.kind == "skipped"} - {""})
        docs.append({"row": None, "platform": platform, "sender_id": sender, "skip_reasons": reasons,
                     "events": [{**e.model_dump(exclude={"detail"}), "detail": json.loads(e.detail)} for e in evs]})
        if not as_json:
            why = f"skipped by policy ({', '.join(reasons)})" if reasons else "never claimed"
            out.print(f"{platform} sender {sender} parent {parent}: no row, {why}")
            t = Table("at", "event", "detail")
            for e in evs:
                t.add_row(_ts(e.at), e.kind, e.detail)
            out.print(t)
    if as_json:
        _emit_json(docs)


@app.command()
def check(
    parent: Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.")],
    platform: Annotated[str | None, typer.Option(help="Platform instance.")] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """The card's verify step on the live log: an answered parent prints 'already answered'; nothing is sent."""
    cfg = _load(config, secrets=False, store=store)
    s = _existing_store(cfg)
    rows = s.find(parent, platform)
    results = []
    for r in rows:
        o = _classify(r, Key(r.platform, r.sender_id, r.parent_id), s.clock.now())
        results.append({"platform": r.platform, "sender_id": r.sender_id, "parent_id": r.parent_id,
                        "status": o.status.value, "reply_id": o.reply_id})
    code = 0 if any(x["status"] == Status.ALREADY_ANSWERED.value for x in results) else 1
    if as_json:
        _emit_json({"parent_id": parent, "answered": code == 0, "keys": results})
    elif not rows:
        out.print(f"not answered: no row for {parent!r}; a post would claim it")
    for x in [] if as_json else results:
        extra = f" (reply {x['reply_id']})" if x["reply_id"] else ""
        out.print(f"{x['status'].replace('_', ' ')}{extra}: {x['platform']} sender {x['sender_id']}; nothing sent")
    raise typer.Exit(code)


@app.command()
def sweep(
    config: ConfigOpt = None,
    store: StoreOpt = None,
    once: Annotated[bool, typer.Option("--once", help="One pass, then exit (the only mode for now).")] = True,
) -> None:
    """Read back due open rows once for every configured bot."""
    import httpx

    from replyd.daemon import build_bot
    from replyd.sweep import Bot, Sweeper

    cfg = _load(config, store=store)
    if not cfg.bots:
        raise ConfigError(f"{cfg.source}: no [[bots]] configured; nothing to sweep")
    s = _existing_store(cfg)  # an absent store has nothing to sweep: never create one here
    owner = cfg.replica_id or st.make_owner()
    with httpx.Client(timeout=cfg.guard.send_timeout_s) as http:
        bots = [build_bot(cfg, bc, s, http, s.clock, owner) for bc in cfg.bots]
        sc = cfg.sweep
        r = Sweeper(s, [Bot(b.platform, b.identity, b.guard.lag) for b in bots], owner=owner, batch=sc.batch,
                    lease_s=sc.lease_s, retry_s=sc.retry_s, max_attempts=cfg.guard.max_attempts,
                    on_duplicate=sc.on_duplicate, config=sc).run_once()
    out.print(f"swept {r.leased}: closed {r.closed}, reconciled {r.reconciled}, not_landed {r.not_landed}, gave_up {r.gave_up}, "
              f"left open {r.left_open}, duplicates {r.duplicates}, read-back errors {r.readback_errors}")


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


def _instance_of(cfg: Config, name: str) -> str | None:
    """Return the platform instance of bot ``name`` without any request, or None if no such bot."""
    import httpx

    from replyd.clock import SystemClock
    from replyd.platforms.base import make_platform

    for b in cfg.bots:
        if b.name == name:
            with httpx.Client() as http:  # building an adapter makes no request
                return make_platform(b.platform, {"listing_delay_s": 10.0, **b.settings}, http=http,
                                     clock=SystemClock()).instance
    return None


@app.command("log")
def log_cmd(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    state: Annotated[str | None, typer.Option(help="Only events that recorded this state.")] = None,
    platform: Annotated[str | None, typer.Option(help="Only platform instances containing this text.")] = None,
    path: Annotated[str | None, typer.Option(help="Only keys found by this path (inbox, search, refind, api, ...).")] = None,
    kind: Annotated[str | None, typer.Option(help="Only this event kind (claimed, closed, rejected, rearmed, adopted, ...).")] = None,
    parent: Annotated[str | None, typer.Option(help="Only this parent id (exact).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="How many events, newest first.")] = 50,
    since: Annotated[str | None, typer.Option(help="Only events at or after: ISO 8601, a duration back (2h), epoch.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events as they are recorded "
                                                                "(oldest first; Ctrl-C stops).")] = False,
    every_s: Annotated[float, typer.Option("--every", min=0.1, help="With --follow: seconds between looks.")] = 1.0,
    store: StoreOpt = None,
) -> None:
    """Show recent events of the answered-log, newest first (with --follow: then every new one, as it comes)."""
    from replyd import library

    cfg = _load(config, secrets=False, store=store)
    if state is not None and state not in st.STATES:
        raise ConfigError(f"--state: unknown state {state!r} (known: {', '.join(st.STATES)})")
    s = _existing_store(cfg)
    filters = {"kind": kind, "state": state, "platform": platform, "path": path, "parent_id": parent}
    start = parse_time(since, s.clock.now()) if since is not None else None
    evs = library.events(s, limit=limit, since=start, **filters)
    if not follow:
        if as_json:
            _emit_json(evs)
        elif not evs:
            out.print("no events match")
        else:
            t = Table("at (UTC)", "platform", "parent id", "event", "state", "attempt", "path", "detail", title="recent events")
            for e in evs:
                t.add_row(*_event_cells(e))
            out.print(t)
        return
    # Follow: oldest first, one line (or one JSON object) per event, by increasing event id.
    last = max((e["id"] for e in evs), default=0)
    try:
        while True:
            for e in sorted(evs, key=lambda e: e["id"]):
                if as_json:
                    sys.stdout.write(json.dumps(e, default=str) + "\n")
                else:
                    sys.stdout.write("  ".join(c for c in _event_cells(e) if c) + "\n")
                last = max(last, e["id"])
            sys.stdout.flush()
            time.sleep(every_s)
            evs = [e for e in library.events(s, limit=1000, since=start, **filters) if e["id"] > last]
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _event_cells(e: dict[str, Any]) -> tuple[str, ...]:
    detail = e["detail"] if isinstance(e["detail"], str) else json.dumps(e["detail"], sort_keys=True)
    return (_ts(e["at"]), e["platform"], e["parent_id"], e["kind"], e["state"] or "", str(e["attempt"] or ""),
            e["path"] or "", detail)


@app.command()
def rearm(
    platform: Annotated[str, typer.Argument(help="A bot name from the config, or the platform instance as stored.")],
    parent: Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.")],
    sender: Annotated[str | None, typer.Option(help="Own sender id, when several accounts share the instance.")] = None,
    reason: Annotated[str, typer.Option(help="Why, recorded on the rearmed event.")] = "",
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Let a rejected, given-up or declined parent be answered again (recorded as a rearmed event)."""
    from replyd import library

    cfg = _load(config, store=store)
    instance = _instance_of(cfg, platform) or platform
    s = _existing_store(cfg)
    rows = [r for r in s.find(parent, instance) if sender is None or r.sender_id == sender]
    if not rows:
        err.print(f"no row for parent id {parent!r} on {instance} (ids are exact: case and leading zeros matter)")
        raise typer.Exit(1)
    if len(rows) > 1:
        err.print(f"{len(rows)} accounts have a row for {parent!r} on {instance}: pass --sender "
                  f"({', '.join(r.sender_id for r in rows)})")
        raise typer.Exit(1)
    res = library.rearm(s, Key(rows[0].platform, rows[0].sender_id, parent), by="cli", reason=reason,
                        owner=cfg.replica_id or None)
    if as_json:
        _emit_json({"rearmed": res.rearmed, "previous_state": res.previous,
                    "state": res.row.state if res.row else None})
    elif res.rearmed:
        out.print(f"rearmed: {instance} parent {parent} was {res.previous}, now released; the next find may answer it")
    else:
        err.print(f"not rearmed: the key is {res.previous}; only {', '.join(library.REARMABLE)} can be rearmed")
    raise typer.Exit(0 if res.rearmed else 1)


@app.command()
def adopt(
    config: ConfigOpt = None,
    bot: Annotated[str | None, typer.Option(help="Only this bot (default: every configured bot).")] = None,
    parent: Annotated[list[str] | None, typer.Option("--parent", help="A parent id or URL (repeatable).")] = None,
    lookback_s: Annotated[float | None, typer.Option(min=1, help="Adopt parents found in this window (default: the "
                                                                 "bot's refind_lookback_s when no --parent).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Read back and report; record nothing.")] = False,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Record the bot's existing replies as answered, so a fresh install does not answer old threads again."""
    import httpx

    from replyd import library
    from replyd.clock import SystemClock
    from replyd.daemon import login
    from replyd.errors import PlatformError
    from replyd.platforms.base import make_platform

    cfg = _load(config, store=store)
    bots = _bot_config(cfg, bot)
    s = _store(cfg)
    owner = cfg.replica_id or st.make_owner()
    clock = SystemClock()
    report: dict[str, Any] = {}
    incomplete = False
    with httpx.Client(timeout=cfg.guard.send_timeout_s) as http:
        for bc in bots:
            plat = make_platform(bc.platform, {"listing_delay_s": 10.0, **bc.settings}, http=http, clock=clock)
            ident = login(bc, plat)
            parents = []
            failed: list[str] = []
            for ref in parent or []:
                try:
                    parents.append(plat.resolve(ref))
                except PlatformError as exc:
                    failed.append(ref)
                    err.print(f"{bc.name}: cannot resolve {ref!r}: {exc.detail or type(exc).__name__}")
            if not parent or lookback_s is not None:
                window = lookback_s if lookback_s is not None else bc.pollers.refind_lookback_s
                parents.extend(plat.refind(clock.now() - window))
            res = library.adopt(s, plat, ident, parents, owner=owner, dry_run=dry_run)
            res.unknown.extend(failed)
            incomplete = incomplete or bool(res.unknown)
            report[bc.name] = {"platform": plat.instance, "sender_id": ident.sender_id, "parents": len(parents),
                               "dry_run": dry_run, **res.as_dict()}
    if as_json:
        _emit_json(report)
    else:
        t = Table("bot", "parents", "adopted", "already tracked", "no own reply", "not read back", "duplicates",
                  title="adopt" + (" (dry run: nothing recorded)" if dry_run else ""))
        for name, r in report.items():
            t.add_row(name, str(r["parents"]), str(len(r["adopted"])), str(len(r["tracked"])),
                      str(len(r["unanswered"])), str(len(r["unknown"])), str(sum(len(v) for v in r["duplicates"].values())))
        out.print(t)
        if incomplete:
            err.print("some parents could not be read back conclusively: run adopt again before starting the daemon")
    raise typer.Exit(1 if incomplete else 0)


@app.command()
def export(
    config: ConfigOpt = None,
    table: Annotated[str, typer.Option(help="replies (one row per key) or events (the audit log).")] = "replies",
    fmt: Annotated[str, typer.Option("--format", help="csv or json.")] = "csv",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
    since: Annotated[str | None, typer.Option(help="Only rows updated (events recorded) at or after: ISO 8601, "
                                                   "a duration back (2h, 7d) or epoch seconds.")] = None,
    store: StoreOpt = None,
) -> None:
    """Write the answered-log (or its events) as CSV or JSON; times in ISO 8601 (UTC)."""
    from replyd import library

    cfg = _load(config, secrets=False, store=store)
    if table not in library.TABLES:
        raise ConfigError(f"--table: unknown table {table!r} (known: {', '.join(library.TABLES)})")
    if fmt not in ("csv", "json"):
        raise ConfigError(f"--format: unknown format {fmt!r} (use csv or json)")
    s = _existing_store(cfg)
    start = parse_time(since, s.clock.now()) if since is not None else None
    if output is None:
        n = library.export(s, sys.stdout, table=table, fmt=fmt, since=start)
    else:
        with output.open("w", newline="", encoding="utf-8") as fh:
            n = library.export(s, fh, table=table, fmt=fmt, since=start)
        err.print(f"wrote {n} {table} row(s) to {output}")


@db_app.command("upgrade")
def db_upgrade(config: ConfigOpt = None, revision: str = "head", store: StoreOpt = None) -> None:
    """Apply schema migrations (run by one replica before the others start); creates a SQLite store."""
    cfg = _load(config, secrets=False, store=store)
    s = Store(st.make_engine(cfg.store.url or st.default_url()))
    s.upgrade(revision)
    out.print(f"store {s.url} is at revision {revision}")


@db_app.command("current")
def db_current(config: ConfigOpt = None, as_json: JsonOpt = False, store: StoreOpt = None) -> None:
    """Print the schema revision of the store and the newest known one (never creates a store)."""
    from replyd import migrate

    cfg = _load(config, secrets=False, store=store)
    _require_file(cfg.store.url or st.default_url())
    s = Store(st.make_engine(cfg.store.url or st.default_url()))
    try:
        current, head = migrate.revisions(s.engine)
    except Exception as exc:  # the driver's error, mapped here as the store's own methods do
        raise StoreError(f"store {s.url}: cannot read the schema revision: {str(exc).splitlines()[0][:200]}") from None
    if as_json:
        _emit_json({"store": s.url, "revision": current, "head": head, "current": current == head})
    else:
        out.print(f"store {s.url}: revision {current or 'none'} (newest: {head})")


@config_app.command("check")
def config_check(
    path: Annotated[Path, typer.Argument(help="The TOML file to check.")],
    online: Annotated[bool, typer.Option("--online", help="Also open the store (no migration) and log every bot "
                                                          "in once (no retry), as the daemon would.")] = False,
) -> None:
    """Validate a config file (and the environment variables it names) without starting anything."""
    import httpx

    from replyd.clock import SystemClock
    from replyd.platforms.base import make_platform, registered_kinds
    from replyd.responders import make_responder

    cfg = Config.load(path)
    kinds = registered_kinds()
    platforms = []
    http = httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0))  # building adapters makes no request
    try:
        for b in cfg.bots:
            if b.platform not in kinds:
                raise ConfigError(f"{path}: bots.{b.name}.platform: unknown platform {b.platform!r} (known: {', '.join(kinds)})")
            try:
                platforms.append((b, make_platform(b.platform, b.settings, http=http, clock=SystemClock())))
                make_responder(b.responder.kind, b.responder.model_dump(exclude={"kind"}))
            except ConfigError as exc:
                raise ConfigError(f"{path}: bots.{b.name}: {exc}") from None
        if cfg.api.enabled:
            from replyd.api import check_bind

            try:
                check_bind(cfg.api.host, cfg.api.token())
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
        try:
            if cfg.mcp.token_env:  # `replyd mcp --transport http` needs it; stdio does not
                cfg.mcp.http_token()
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        out.print(f"{path}: ok ({len(cfg.bots)} bot(s))")
        if online:
            _check_online(cfg, platforms)
    finally:
        http.close()


def _check_online(cfg: Config, platforms: list) -> None:
    """Try the store and each bot's identity once; print one line per check; raise when any failed."""
    from replyd.errors import PlatformError

    failed = 0
    url = cfg.store.url or st.default_url()
    try:
        path = st.sqlite_file(url) if url.startswith("sqlite") else None
        if path is not None and not path.is_file():
            out.print(f"store {st.redact_url(url)}: no file yet (the daemon creates it on its first start)")
        else:
            s = Store.open(url, migrate=False)
            s.dispose()
            out.print(f"store {s.url}: ok, schema current")
    except StoreError as exc:
        failed += 1
        err.print(f"replyd: {exc}")
    for bc, plat in platforms:
        try:
            ident = plat.whoami()
            out.print(f"bot {bc.name}: logged in at {plat.instance} as {ident.handle or ident.sender_id}")
        except PlatformError as exc:
            failed += 1
            if exc.status in (401, 403):
                names = ", ".join(bc.variables()) or "the config file"
                err.print(f"replyd: bot {bc.name}: {plat.instance} refused the login (HTTP {exc.status}): check {names}")
            else:
                err.print(f"replyd: bot {bc.name}: cannot log in at {plat.instance}: {exc.detail or exc}")
    if failed:
        raise typer.Exit(2)


def _require_file(url: str) -> None:
    """Raise StoreError when a SQLite store's file does not exist (read commands never create one)."""
    if url.startswith("sqlite"):
        path = st.sqlite_file(url)
        if path is not None and not path.is_file():
            raise StoreError(f"no store at {path}: nothing was ever recorded there (a daemon creates it on its "
                             f"first start); name the store with --store or REPLYD_STORE__URL")


def _fail(message: str, code: int = 2) -> None:
    """Print ``replyd: message`` as one plain line on stderr and exit with ``code``."""
    sys.stderr.write("replyd: " + " ".join(rlog.mask(message).split()) + "\n")
    sys.exit(code)


def main() -> None:
    """Entry point: an expected failure is one plain line on stderr and exit 2 (see ``EXIT_CODES``)."""
    try:
        app()
    except ReplydError as exc:
        _fail(str(exc))
    except OSError as exc:  # a file named on the command line cannot be read or written (export -o ...)
        _fail(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
    except KeyboardInterrupt:
        sys.exit(130)
