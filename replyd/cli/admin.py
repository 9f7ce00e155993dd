"""The commands that write or administer: sweep, rearm, adopt, db upgrade/current, config check."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from replyd.cli.common import (ConfigOpt, JsonOpt, StoreOpt, _bot_config, _emit_json, _existing_store, _instance_of,
                               _load, _require_file, _senders_on, _store, _ts, err, lazy, out, parse_time, preflight)
from replyd.errors import ConfigError, StoreError

if TYPE_CHECKING:
    from replyd.config import Config
    from replyd.store import Store

st = lazy("replyd.store")


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
    bot: Annotated[str | None, typer.Argument(help="A bot name from the config, or the platform instance as stored.",
                                              show_default=False)] = None,
    parent: Annotated[str | None, typer.Argument(help="Parent id exactly as the platform serves it.",
                                                 show_default=False)] = None,
    state: Annotated[str | None, typer.Option(help="Rearm every row in this state instead of one parent: "
                                                   "gave_up, rejected, declined, skipped or unconfirmed.")] = None,
    since: Annotated[str | None, typer.Option(help="With --state: only rows that changed since then (2h, 7d, "
                                                   "2026-12-01T08:00Z, epoch seconds); default: any time.")] = None,
    only_bot: Annotated[str | None, typer.Option("--bot", help="With --state: only this bot (name or instance); "
                                                               "default: every configured bot, else every bot in the store.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --state: list what would be rearmed; change nothing.")] = False,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="With --state: at most this many rows.")] = 1000,
    sender: Annotated[str | None, typer.Option(help="Own sender id, when several accounts share the instance.")] = None,
    reason: Annotated[str, typer.Option(help="Why, recorded on the rearmed event.")] = "",
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Let a rejected, given-up, declined or skipped parent be answered again (a rearmed event), or many with --state.

    Reads the store only: no platform secret is needed and no request is made. A bot name needs the config
    (--config or REPLYD_CONFIG) for its platform instance; the store says which account posts there.
    """
    cfg = _load(config, secrets=False, store=store)
    bulk = state is not None or since is not None
    if parent is None and not bulk:
        raise ConfigError("rearm: name a bot and a parent (rearm BOT PARENT), or rows by state "
                          "(rearm --state gave_up [--since 2h] [--bot B] [--dry-run])")
    if parent is not None and (bulk or only_bot or dry_run):
        raise ConfigError("rearm: BOT PARENT rearms one parent; --state, --since, --bot and --dry-run select many "
                          "instead: use one form or the other")
    if bulk and bot is not None:
        raise ConfigError(f"rearm: with --state name the bot with --bot {bot}, not as an argument")
    s = _existing_store(cfg)
    if bulk:
        _rearm_many(cfg, s, state=state or "gave_up", since=since, bot=only_bot, sender=sender, dry_run=dry_run,
                    limit=limit, reason=reason, as_json=as_json)
        return
    assert bot is not None and parent is not None
    from replyd import library

    key = _skipped_key(cfg, s, bot, parent, sender)
    if key is None:
        instance, row = _one_row(cfg, s, bot, parent, sender)
        key = st.Key(row.platform, row.sender_id, parent)
    instance = key.platform
    res = library.rearm(s, key, by="cli", reason=reason, owner=cfg.replica_id or None)
    if as_json:
        _emit_json({"rearmed": res.rearmed, "previous_state": res.previous,
                    "state": res.row.state if res.row else None})
    elif res.rearmed:
        out.print(f"rearmed: {instance} parent {parent} was {res.previous}, now released; the next find may answer it")
    else:
        err.print(f"not rearmed: the key is {res.previous}; only {', '.join(library.REARMABLE)} can be rearmed")
    raise typer.Exit(0 if res.rearmed else 1)


def _skipped_key(cfg: Any, s: Any, bot: str, parent: str, sender: str | None) -> st.Key | None:
    """The key of a parent the policy skipped (events, no row) for one account, or None (``_one_row`` then)."""
    instance = _instance_of(cfg, bot) or bot
    if s.find(parent, instance):
        return None
    senders = {e.sender_id for e in s.find_events(parent, instance) if e.kind == "skipped"}
    senders = {sid for sid in senders if sender is None or sid == sender}
    return st.Key(instance, senders.pop(), parent) if len(senders) == 1 else None


def _one_row(cfg: Any, s: Any, bot: str, parent: str, sender: str | None) -> tuple[str, Any]:
    """The bot's instance and its one row for ``parent`` (rearm, confirm), or exit 1 naming what is wrong."""
    instance = _instance_of(cfg, bot) or bot
    rows = [r for r in s.find(parent, instance) if sender is None or r.sender_id == sender]
    if not rows:
        err.print(f"no row for parent id {parent!r} on {instance} (ids are exact: case and leading zeros matter)"
                  + _elsewhere(cfg, s, bot, parent))
        raise typer.Exit(1)
    if len(rows) > 1:
        err.print(f"{len(rows)} accounts have a row for {parent!r} on {instance}: pass --sender "
                  f"({', '.join(r.sender_id for r in rows)})")
        raise typer.Exit(1)
    return instance, rows[0]


def confirm(
    bot: Annotated[str, typer.Argument(help="A bot name from the config, or the platform instance as stored.",
                                       show_default=False)],
    parent: Annotated[str, typer.Argument(help="Parent id exactly as the platform serves it.", show_default=False)],
    reply_id: Annotated[str | None, typer.Option("--reply-id", help="The landed reply's id, when you know it.")] = None,
    sender: Annotated[str | None, typer.Option(help="Own sender id, when several accounts share the instance.")] = None,
    reason: Annotated[str, typer.Option(help="Why, recorded on the confirmed event.")] = "",
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Mark an unconfirmed parent answered (you saw the reply land): closed, event confirmed; never sent again.

    For platforms without read-back (Telegram): ``replyd rearm BOT PARENT`` sends again instead. Reads and
    writes the store only: no platform secret is needed and no request is made.
    """
    cfg = _load(config, secrets=False, store=store)
    s = _existing_store(cfg)
    from replyd import library

    instance, row = _one_row(cfg, s, bot, parent, sender)
    res = library.confirm(s, st.Key(row.platform, row.sender_id, parent), by="cli", reply_id=reply_id,
                          reason=reason, owner=cfg.replica_id or None)
    if as_json:
        _emit_json({"confirmed": res.confirmed, "previous_state": res.previous,
                    "state": res.row.state if res.row else None})
    elif res.confirmed:
        out.print(f"confirmed: {instance} parent {parent} was unconfirmed, now closed; it will not be answered again")
    else:
        err.print(f"not confirmed: the key is {res.previous}; only an unconfirmed key can be confirmed")
    raise typer.Exit(0 if res.confirmed else 1)


def _elsewhere(cfg: Config, s: Store, bot: str, parent: str) -> str:
    """Why a bot/parent pair found no row, when the id has rows under another instance or the bot is unknown."""
    others = sorted({(r.platform, r.sender_id) for r in s.find(parent)})
    hint = ""
    if not any(b.name == bot for b in cfg.bots):
        hint = (f"; {bot!r} is no bot of {cfg.source}" if cfg.bots else
                f"; {bot!r} is taken as a platform instance: to name a bot, pass its config (--config or REPLYD_CONFIG)")
    if others:
        hint += "; rows for this id: " + ", ".join(f"{p} (sender {sid})" for p, sid in others)
    return hint


def _rearm_many(cfg: Config, s: Store, *, state: str, since: str | None, bot: str | None, sender: str | None,
                dry_run: bool, limit: int, reason: str, as_json: bool) -> None:
    """Rearm (or list, with ``dry_run``) every row in ``state`` changed since ``since``; one line each and a count."""
    from replyd import library

    since_t = parse_time(since, s.clock.now()) if since is not None else None
    refs = [bot] if bot is not None else [b.name for b in cfg.bots]
    if refs:
        instances = [_instance_of(cfg, r) or r for r in refs]
        pairs = [(i, sid) for i in instances for sid in _senders_on(s, i)]
    else:  # no config and no --bot: every account the store has rows for
        pairs = sorted({(p, sid) for p, sid, *_ in s.path_counts()})
    pairs = [(i, sid) for i, sid in pairs if sender is None or sid == sender]
    results = library.rearm_many(s, pairs, state=state, since=since_t, by="cli", reason=reason,
                                 owner=cfg.replica_id or None, dry_run=dry_run, limit=limit)
    done = sum(r.rearmed for r in results)
    lost = [r for r in results if not r.rearmed and not dry_run]
    if as_json:
        _emit_json({"dry_run": dry_run, "state": state, "since": since_t, "matched": len(results), "rearmed": done,
                    "parents": [{"platform": r.key.platform, "sender_id": r.key.sender_id, "parent_id": r.key.parent_id,
                                 "previous_state": r.previous, "rearmed": r.rearmed,
                                 "state": r.row.state if r.row else None} for r in results]})
    else:
        for r in results:
            now = ("would be rearmed" if dry_run else "rearmed" if r.rearmed
                   else f"not rearmed: it is {r.row.state if r.row else 'gone'} now")
            out.print(f"{r.key.platform} {r.key.sender_id} {r.key.parent_id}: was {r.previous}, {now}")
        window = f" changed since {_ts(since_t)} UTC" if since_t is not None else ""
        if dry_run:
            out.print(f"dry run: {len(results)} {state} parent(s){window} would be rearmed; nothing changed")
        else:
            out.print(f"rearmed {done} of {len(results)} {state} parent(s){window}")
        if len(results) >= limit:
            err.print(f"stopped at --limit {limit}: run again for the rest")
    raise typer.Exit(1 if lost else 0)


def prune(
    config: ConfigOpt = None,
    events_before: Annotated[str | None, typer.Option(
        "--events-before", help="Delete events older than this (90d, 2026-09-01, epoch) of keys whose story is "
                                "over; default: 90d. 'never' keeps every event.")] = "90d",
    margin_s: Annotated[float, typer.Option("--margin-s", min=0, help="Rows go only when older than the bot's "
                                                                    "policy.max_age_s plus this.")] = 86_400.0,
    bot: Annotated[str | None, typer.Option(help="Only this bot's rows (default: every configured bot).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")] = False,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Delete old events and rows that can never matter again (see docs/OPERATIONS.md, Pruning).

    A bot's done rows go only when it sets policy.max_age_s (older parents are never answered) and the row's
    snapshot has the parent's time. Rows a job may still move, unconfirmed and gave_up rows are never deleted.
    """
    from replyd.store.retention import prune as prune_store

    cfg = _load(config, secrets=False, store=store)
    s = _existing_store(cfg)
    now = s.clock.now()
    cutoffs: list[tuple[str, str, float]] = []
    skipped: list[str] = []
    for bc in (_bot_config(cfg, bot) if cfg.bots or bot else []):
        instance = _instance_of(cfg, bc.name)
        if bc.policy.max_age_s is None or instance is None:
            skipped.append(bc.name)
            continue
        cutoffs += [(instance, sender, now - bc.policy.max_age_s - margin_s) for sender in _senders_on(s, instance)]
    before = None if events_before in (None, "never") else parse_time(events_before, now, "--events-before")
    if before is not None and before > now - margin_s:
        raise ConfigError(f"--events-before: {events_before!r} is less than --margin-s ({margin_s:g} s) ago")
    report = prune_store(s, cutoffs, events_before=before, dry_run=dry_run)
    report["bots_without_max_age"] = skipped
    s.dispose()
    if as_json:
        _emit_json(report)
        return
    verb = "would delete" if dry_run else "deleted"
    for r in report["rows"]:
        out.print(f"{r['platform']} sender {r['sender_id']}: {verb} {r['deleted']} done rows older than "
                  f"{_ts(r['before'])} UTC; kept {r['kept_no_platform_time']} with no parent time")
    for name in skipped:
        out.print(f"bot {name}: rows kept (policy.max_age_s is not set: an old parent may still be answered)")
    out.print(f"events: {verb} {report['events']}" + (f" older than {_ts(before)} UTC" if before is not None else
                                                          " (none: --events-before never)"))


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
                parents.extend(library.window_parents(s, plat, ident.sender_id, lookback_s=window, now=clock.now(),
                                                      queries=bc.pollers.search_queries))
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
    s = st.Store.open(cfg.store.url or st.default_url(), migrate=None)
    s.upgrade(revision)
    out.print(f"store {s.url} is at revision {revision}")


def db_current(config: ConfigOpt = None, as_json: JsonOpt = False, store: StoreOpt = None) -> None:
    """Print the schema revision of the store and the newest known one (never creates a store)."""
    cfg = _load(config, secrets=False, store=store)
    _require_file(cfg.store.url or st.default_url())
    s = st.Store.open(cfg.store.url or st.default_url(), migrate=None)
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
    """Validate a config file as `replyd run` does before it starts anything (and the variables it names)."""
    cfg = _load(path)
    preflight(cfg)  # exactly run's checks: a config passes both or neither
    if online:
        _check_online(cfg)
    out.print(f"{path}: ok ({len(cfg.bots)} bot(s))")  # last: never "ok" before an online check failed


def _check_online(cfg: Config) -> None:
    """Open the store, then try each bot's identity once, as `run` does; one line per check; exit 2 on a failure."""
    import httpx

    from replyd import migrate
    from replyd.clock import SystemClock
    from replyd.errors import PlatformError, SchemaError
    from replyd.platforms.base import make_platform

    failed = 0
    url = cfg.store.url or st.default_url()
    try:
        path = st.sqlite_file(url) if url.startswith("sqlite") else None
        if path is not None and not path.is_file():
            if not cfg.store.auto_migrate:  # `run` would create the file and then find no schema
                raise StoreError(f"store {st.redact_url(url)}: no file, and store.auto_migrate is false: "
                                 "run `replyd db upgrade` first")
            out.print(f"store {st.redact_url(url)}: no file yet (the daemon creates it on its first start)")
        else:
            # As `run` opens it, but never migrating: a behind schema is fine when run would migrate it.
            s = st.Store.open(url, migrate=None if cfg.store.auto_migrate else False)
            try:  # one real round trip; never a query of the tables, which `run` may be about to create
                current, head = s.schema_revision()
            except StoreError as exc:  # say which store
                raise type(exc)(f"store {s.url}: {exc}") from None
            finally:
                s.dispose()
            if current and not migrate.known(current):  # as `run` would find when it migrates
                raise SchemaError(f"store {s.url}: the schema is at {current}, a revision this replyd does not know "
                                  "(a newer replyd may have migrated this store)")
            note = "schema current" if current == head else f"schema {current or 'none'}, `run` migrates to {head}"
            out.print(f"store {s.url}: ok, {note}")
    except StoreError as exc:
        err.print(f"replyd: {exc}")
        raise typer.Exit(2) from None  # as `run`, which never logs a bot in without its store
    with httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0)) as http:
        for bc in cfg.bots:
            plat = make_platform(bc.platform, bc.settings, http=http, clock=SystemClock())
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
