"""The ``replyd`` command line: run, demo, status, explain, check, sweep, log, rearm, adopt, export, db, config."""

from __future__ import annotations

import itertools
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from replyd import lag
from replyd import log as rlog
from replyd import store as st
from replyd.clock import DatabaseClock
from replyd.config import Config
from replyd.errors import ConfigError, ReplydError
from replyd.guard import Status, _classify
from replyd.store import Key, Store

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Answer each post, thread or ticket exactly once.")
db_app = typer.Typer(no_args_is_help=True, help="The answered-log's schema.")
config_app = typer.Typer(no_args_is_help=True, help="Config files.")
app.add_typer(db_app, name="db")
app.add_typer(config_app, name="config")
out = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", envvar="REPLYD_CONFIG", help="TOML config file (default: built-in defaults).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _load(config: Path | None) -> Config:
    cfg = Config.load(config)
    rlog.configure(cfg.log.format, cfg.log.level)
    return cfg


def _store(cfg: Config) -> Store:
    """Open the store for a read-mostly command: never migrate a server database from here."""
    url = cfg.store.url or st.default_url()
    embedded = url.startswith("sqlite")
    s = Store.open(url, migrate=embedded and cfg.store.auto_migrate)
    if not embedded and cfg.store.db_clock:
        s.clock = DatabaseClock(s.db_epoch)  # `sweep --once` from another machine decides on the daemons' time
    return s


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
def status(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    overdue_after_s: Annotated[float, typer.Option(
        "--overdue-after-s", help="List waiting rows this many seconds past their bound.")] = 600.0,
) -> None:
    """Show row counts by platform and state, the oldest open rows, and rows that waited past their bound."""
    cfg = _load(config)
    s = _store(cfg)
    counts = s.counts()
    oldest = s.oldest_open(5)
    now = s.clock.now()
    # Every non-terminal state has a job that moves it on (sweep, re-find): a row listed here is one they did not.
    overdue = s.overdue(now, overdue_after_s)
    if as_json:
        data = {
            "store": s.url,
            "counts": [{"platform": p, "state": state, "rows": n} for (p, state), n in sorted(counts.items())],
            "oldest_open": [{"platform": r.platform, "parent_id": r.parent_id, "age_s": round(now - (r.opened_at or now), 1)} for r in oldest],
            "overdue": [{"platform": r.platform, "parent_id": r.parent_id, "state": r.state, "attempt": r.attempt,
                         "over_s": round(over, 1)} for r, over in overdue],
            "listing": lag.summaries(s),  # per platform instance: configured and in-use delay, observed lag
        }
        out.print_json(json.dumps(data))
        return
    out.print(f"store: {s.url}")
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
) -> None:
    """Show the whole history of one parent's key."""
    cfg = _load(config)
    s = _store(cfg)
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
            out.print(f"[bold]{r.platform}[/] sender {r.sender_id} parent {r.parent_id}: "
                      f"[bold]{r.state}[/] attempt {r.attempt} reply {r.reply_id or '-'} (found by {r.path or '-'})")
            t = Table("at", "event", "state", "attempt", "owner", "detail")
            for e in events:
                t.add_row(_ts(e.at), e.kind, e.state or "", str(e.attempt or ""), e.owner or "", e.detail)
            out.print(t)
    if as_json:
        out.print_json(json.dumps(docs, default=str))


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
            out.print(f"[bold]{platform}[/] sender {sender} parent {parent}: no row, {why}")
            t = Table("at", "event", "detail")
            for e in evs:
                t.add_row(_ts(e.at), e.kind, e.detail)
            out.print(t)
    if as_json:
        out.print_json(json.dumps(docs, default=str))


@app.command()
def check(
    parent: Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.")],
    platform: Annotated[str | None, typer.Option(help="Platform instance.")] = None,
    config: ConfigOpt = None,
) -> None:
    """The card's verify step on the live log: an answered parent prints 'already answered'; nothing is sent."""
    cfg = _load(config)
    s = _store(cfg)
    rows = s.find(parent, platform)
    if not rows:
        out.print(f"not answered: no row for {parent!r}; a post would claim it")
        raise typer.Exit(1)
    code = 1
    for r in rows:
        o = _classify(r, Key(r.platform, r.sender_id, r.parent_id), s.clock.now())
        words = o.status.value.replace("_", " ")
        extra = f" (reply {o.reply_id})" if o.reply_id else ""
        out.print(f"{words}{extra}: {r.platform} sender {r.sender_id}; nothing sent")
        if o.status is Status.ALREADY_ANSWERED:
            code = 0
    raise typer.Exit(code)


@app.command()
def sweep(
    config: ConfigOpt = None,
    once: Annotated[bool, typer.Option("--once", help="One pass, then exit (the only mode for now).")] = True,
) -> None:
    """Read back due open rows once for every configured bot."""
    import httpx

    from replyd.daemon import build_bot
    from replyd.sweep import Bot, Sweeper

    cfg = _load(config)
    if not cfg.bots:
        raise ConfigError(f"{cfg.source}: no [[bots]] configured; nothing to sweep")
    s = _store(cfg)
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
    from replyd.platform import make_platform

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
) -> None:
    """Show recent events of the answered-log, newest first."""
    from replyd import library

    cfg = _load(config)
    if state is not None and state not in st.STATES:
        raise ConfigError(f"--state: unknown state {state!r} (known: {', '.join(st.STATES)})")
    s = _store(cfg)
    evs = library.events(s, limit=limit, kind=kind, state=state, platform=platform, path=path, parent_id=parent)
    if as_json:
        out.print_json(json.dumps(evs, default=str))
        return
    if not evs:
        out.print("no events match")
        return
    t = Table("at (UTC)", "platform", "parent id", "event", "state", "attempt", "path", "detail", title="recent events")
    for e in evs:
        t.add_row(_ts(e["at"]), e["platform"], e["parent_id"], e["kind"], e["state"] or "", str(e["attempt"] or ""),
                  e["path"] or "", json.dumps(e["detail"], sort_keys=True) if not isinstance(e["detail"], str) else e["detail"])
    out.print(t)


@app.command()
def rearm(
    platform: Annotated[str, typer.Argument(help="A bot name from the config, or the platform instance as stored.")],
    parent: Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.")],
    sender: Annotated[str | None, typer.Option(help="Own sender id, when several accounts share the instance.")] = None,
    reason: Annotated[str, typer.Option(help="Why, recorded on the rearmed event.")] = "",
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Let a rejected, given-up or declined parent be answered again (recorded as a rearmed event)."""
    from replyd import library

    cfg = _load(config)
    instance = _instance_of(cfg, platform) or platform
    s = _store(cfg)
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
        out.print_json(json.dumps({"rearmed": res.rearmed, "previous_state": res.previous,
                                   "state": res.row.state if res.row else None}))
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
) -> None:
    """Record the bot's existing replies as answered, so a fresh install does not answer old threads again."""
    import httpx

    from replyd import library
    from replyd.clock import SystemClock
    from replyd.daemon import _whoami
    from replyd.errors import PlatformError
    from replyd.platform import make_platform

    cfg = _load(config)
    bots = _bot_config(cfg, bot)
    s = _store(cfg)
    owner = cfg.replica_id or st.make_owner()
    clock = SystemClock()
    report: dict[str, Any] = {}
    incomplete = False
    with httpx.Client(timeout=cfg.guard.send_timeout_s) as http:
        for bc in bots:
            plat = make_platform(bc.platform, {"listing_delay_s": 10.0, **bc.settings}, http=http, clock=clock)
            ident = _whoami(plat)
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
        out.print_json(json.dumps(report))
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
    since: Annotated[float | None, typer.Option(help="Only rows updated (events recorded) at or after this epoch.")] = None,
) -> None:
    """Write the answered-log (or its events) as CSV or JSON."""
    from replyd import library

    cfg = _load(config)
    if table not in library.TABLES:
        raise ConfigError(f"--table: unknown table {table!r} (known: {', '.join(library.TABLES)})")
    if fmt not in ("csv", "json"):
        raise ConfigError(f"--format: unknown format {fmt!r} (use csv or json)")
    s = _store(cfg)
    if output is None:
        n = library.export(s, sys.stdout, table=table, fmt=fmt, since=since)
    else:
        with output.open("w", newline="", encoding="utf-8") as fh:
            n = library.export(s, fh, table=table, fmt=fmt, since=since)
        err.print(f"wrote {n} {table} row(s) to {output}")


@db_app.command("upgrade")
def db_upgrade(config: ConfigOpt = None, revision: str = "head") -> None:
    """Apply schema migrations (run by one replica before the others start)."""
    cfg = _load(config)
    s = Store(st.make_engine(cfg.store.url or st.default_url()))
    s.upgrade(revision)
    out.print(f"store {s.url} is at revision {revision}")


@db_app.command("current")
def db_current(config: ConfigOpt = None) -> None:
    """Print the schema revision of the store and the newest known one."""
    from replyd import migrate

    cfg = _load(config)
    s = Store(st.make_engine(cfg.store.url or st.default_url()))
    current, head = migrate.revisions(s.engine)
    out.print(f"store {s.url}: revision {current or 'none'} (newest: {head})")


@config_app.command("check")
def config_check(path: Annotated[Path, typer.Argument(help="The TOML file to check.")]) -> None:
    """Validate a config file (and the environment variables it names) without starting anything."""
    from replyd.platform import registered_kinds
    from replyd.responders import make_responder

    import httpx

    from replyd.clock import SystemClock
    from replyd.platform import make_platform

    cfg = Config.load(path)
    kinds = registered_kinds()
    with httpx.Client() as http:  # adapters validate settings without any request
        for b in cfg.bots:
            if b.platform not in kinds:
                raise ConfigError(f"{path}: bots.{b.name}.platform: unknown platform {b.platform!r} (known: {', '.join(kinds)})")
            try:
                make_platform(b.platform, b.settings, http=http, clock=SystemClock())
                make_responder(b.responder.kind, b.responder.model_dump(exclude={"kind"}))
            except ConfigError as exc:
                raise ConfigError(f"{path}: bots.{b.name}: {exc}") from None
    if cfg.api.enabled:
        from replyd.api import check_bind

        try:
            check_bind(cfg.api.host, cfg.api.token())
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    out.print(f"{path}: ok ({len(cfg.bots)} bot(s))")


def main() -> None:
    """Entry point: map replyd's errors to a clear message and exit code 2."""
    try:
        app()
    except ReplydError as exc:
        err.print(f"replyd: {type(exc).__name__}: {rlog.mask(str(exc))}")
        sys.exit(2)
