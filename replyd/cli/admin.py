"""The commands that write or administer: sweep, rearm, adopt, db upgrade/current, config check."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from replyd import store as st
from replyd.cli.common import (ConfigOpt, JsonOpt, ParentArg, StoreOpt, _bot_config, _emit_json, _existing_store,
                               _instance_of, _load, _require_file, _store, err, out)
from replyd.config import Config
from replyd.errors import ConfigError, StoreError
from replyd.store import Key, Store


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
                    on_duplicate=sc.on_duplicate, config=sc, guard_config=cfg.guard).run_once()
    out.print(f"swept {r.leased}: closed {r.closed}, reconciled {r.reconciled}, not_landed {r.not_landed}, gave_up {r.gave_up}, "
              f"left open {r.left_open}, duplicates {r.duplicates}, read-back errors {r.readback_errors}")


def rearm(
    platform: Annotated[str, typer.Argument(help="A bot name from the config, or the platform instance as stored.")],
    parent: ParentArg,
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


def db_upgrade(config: ConfigOpt = None, revision: str = "head", store: StoreOpt = None) -> None:
    """Apply schema migrations (run by one replica before the others start); creates a SQLite store."""
    cfg = _load(config, secrets=False, store=store)
    s = Store.open(cfg.store.url or st.default_url(), migrate=None)
    s.upgrade(revision)
    out.print(f"store {s.url} is at revision {revision}")


def db_current(config: ConfigOpt = None, as_json: JsonOpt = False, store: StoreOpt = None) -> None:
    """Print the schema revision of the store and the newest known one (never creates a store)."""
    cfg = _load(config, secrets=False, store=store)
    _require_file(cfg.store.url or st.default_url())
    s = Store.open(cfg.store.url or st.default_url(), migrate=None)
    try:
        current, head = s.schema_revision()
    except StoreError as exc:  # mapped by the store; say which store
        raise type(exc)(f"store {s.url}: {exc}") from None
    if as_json:
        _emit_json({"store": s.url, "revision": current, "head": head, "current": current == head})
    else:
        out.print(f"store {s.url}: revision {current or 'none'} (newest: {head})")


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
