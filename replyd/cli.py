"""The ``replyd`` command line: run, demo, status, explain, check, sweep, db, config."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from replyd import log as rlog
from replyd import store as st
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
    return Store.open(cfg.store.url or None, migrate=cfg.store.auto_migrate)


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
def status(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Show row counts by platform and state, and the oldest open rows."""
    cfg = _load(config)
    s = _store(cfg)
    counts = s.counts()
    oldest = s.oldest_open(5)
    now = s.clock.now()
    if as_json:
        data = {
            "store": s.url,
            "counts": [{"platform": p, "state": state, "rows": n} for (p, state), n in sorted(counts.items())],
            "oldest_open": [{"platform": r.platform, "parent_id": r.parent_id, "age_s": round(now - (r.opened_at or now), 1)} for r in oldest],
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
    rows = _rows_for(s, parent, platform)
    if not rows:
        raise typer.Exit(1)
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
        r = Sweeper(s, [Bot(b.platform, b.identity) for b in bots], owner=owner, batch=sc.batch, lease_s=sc.lease_s,
                    retry_s=sc.retry_s, max_attempts=cfg.guard.max_attempts, on_duplicate=sc.on_duplicate).run_once()
    out.print(f"swept {r.leased}: closed {r.closed}, not_landed {r.not_landed}, gave_up {r.gave_up}, "
              f"left open {r.left_open}, duplicates {r.duplicates}, read-back errors {r.readback_errors}")


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
                make_platform(b.platform, {"listing_delay_s": 10.0, **b.settings}, http=http, clock=SystemClock())
                make_responder(b.responder.kind, b.responder.model_dump(exclude={"kind"}))
            except ConfigError as exc:
                raise ConfigError(f"{path}: bots.{b.name}: {exc}") from None
    out.print(f"{path}: ok ({len(cfg.bots)} bot(s))")


def main() -> None:
    """Entry point: map replyd's errors to a clear message and exit code 2."""
    try:
        app()
    except ReplydError as exc:
        err.print(f"replyd: {type(exc).__name__}: {rlog.mask(str(exc))}")
        sys.exit(2)
