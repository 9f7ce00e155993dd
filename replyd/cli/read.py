"""The read commands: status, explain, check, log, export. They open only an existing store and never migrate.

What they print comes from platforms (ids, handles) and API callers (the free-form
``path``), so every value is passed through ``shown`` on its way to the terminal:
control characters (C0, DEL, C1, so every ESC/CSI/OSC sequence) and the Unicode
bidirectional and line-separator controls are printed as ``\\x1b`` / ``\\u202e``
escapes, never interpreted by the terminal. The store keeps the values as they came.
JSON output is already safe (``json.dumps`` escapes every control character).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from replyd.cli.common import (ConfigOpt, JsonOpt, ParentArg, StoreOpt, _emit_json, _existing_store, _load, _read_store, _ts, err, lazy,
                               out, parse_time)
from replyd.errors import ConfigError
from replyd.terminal import shown

if TYPE_CHECKING:
    from replyd.config import Config

st = lazy("replyd.store")
NO_CONFIG = "no config given (--config FILE or REPLYD_CONFIG): the daemon's liveness comes from its [api]"


class _Table(Table):
    """A rich Table whose text cells go through ``shown`` (rich passes ESC and C1 through as they are)."""

    def add_row(self, *cells: Any, **kw: Any) -> None:
        """Add a row, escaping every text cell."""
        super().add_row(*(shown(c) if isinstance(c, str) else c for c in cells), **kw)


def _say(text: str, style: str | None = None) -> None:
    """Print one line made of stored values, escaped."""
    out.print(Text(shown(text), style=style or ""))


def status(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    overdue_after_s: Annotated[float, typer.Option(
        "--overdue-after-s", help="List waiting rows this many seconds past their bound.")] = 600.0,
    store: StoreOpt = None,
) -> None:
    """Show row counts by platform and state, the oldest open rows, rows that waited past their bound, and (from
    the daemon) each path's liveness."""
    s, cfg = _read_store(config, store)
    counts = s.counts()
    oldest = s.oldest_open(5)
    now = s.clock.now()
    # Every non-terminal state has a job that moves it on (sweep, re-find): a row listed here is one they did not.
    overdue = s.overdue(now, overdue_after_s)
    # Rows a path offers again, by why they wait (a cap's reason, else their state).
    waiting = s.waiting_reasons()
    listing = s.listing()
    # Answers in several parts not all sent yet: which parts landed, per parent.
    partial = [(r, _parts_of(s, r)) for r in s.in_parts(10)]
    dups = s.duplicate_counts()
    senders = {(p, snd) for p, snd, *_ in s.path_counts()} | set(dups)
    unread = s.event_key_counts("unreadable")  # items a path could not read and moved past, per bot
    s.dispose()  # every read is done: no pooled connection is left to the interpreter's exit
    daemon = _daemon_liveness(cfg)
    # Per bot (platform, sender): every one with rows, named when the daemon says which bot it is.
    names = {(b.get("platform"), b.get("sender_id")): n for n, b in daemon.pop("bots", {}).items()}
    duplicates = [{"bot": names.get(k), "platform": k[0], "sender_id": k[1], "duplicates": dups.get(k, 0)}
                  for k in sorted(senders)]
    if as_json:
        data = {
            "store": s.url,
            "counts": [{"platform": p, "state": state, "rows": n} for (p, state), n in sorted(counts.items())],
            "oldest_open": [{"platform": r.platform, "parent_id": r.parent_id, "age_s": round(now - (r.opened_at or now), 1)} for r in oldest],
            "overdue": [{"platform": r.platform, "parent_id": r.parent_id, "state": r.state, "attempt": r.attempt,
                         "over_s": round(over, 1)} for r, over in overdue],
            "daemon": daemon,
            "in_parts": [{"platform": r.platform, "parent_id": r.parent_id, "parts": len(ps),
                          "landed": [p["part"] for p in ps if p["state"] == st.CLOSED],
                          "states": [p["state"] for p in ps]} for r, ps in partial],
            "listing": listing,  # per platform instance: configured and in-use delay, observed lag
            "duplicates": duplicates,  # per bot: own replies beyond the first found for one parent
            "unreadable": [{"platform": p, "sender_id": sid, "items": n} for (p, sid), n in sorted(unread.items())],
            "waiting": [{"platform": p, "reason": why, "rows": n} for (p, why), n in sorted(waiting.items())],
        }
        _emit_json(data)
        return
    _say(f"store: {s.url}")
    _print_liveness(daemon)
    t = _Table("platform", *st.STATES, title="rows by state")
    for plat in sorted({p for p, _ in counts}):
        t.add_row(plat, *[str(counts.get((plat, state), 0)) for state in st.STATES])
    out.print(t if counts else "no rows yet: nothing answered")
    for plat in sorted({p for p, _ in waiting}):
        whys = sorted((why, n) for (p, why), n in waiting.items() if p == plat)
        _say(f"waiting {sum(n for _, n in whys)} on {plat} ({', '.join(f'{why} {n}' for why, n in whys)}): "
             "offered again when due")
    if oldest:
        o = _Table("platform", "parent id", "opened", "age (s)", title="oldest open rows")
        for r in oldest:
            o.add_row(r.platform, r.parent_id, _ts(r.opened_at), f"{now - (r.opened_at or now):.0f}")
        out.print(o)
    if partial:
        t = _Table("platform", "parent id", "parts landed", "parts' states", title="answers being sent in parts")
        for r, ps in partial:
            t.add_row(r.platform, r.parent_id, f"{sum(p['state'] == st.CLOSED for p in ps)} of {len(ps)}",
                      " ".join(p["state"] or "-" for p in ps))
        out.print(t)
    _print_listing(listing)
    _print_duplicates(duplicates)
    if unread:
        t = _Table("platform", "sender id", "items", title="unreadable items (each an event: replyd log --kind unreadable)")
        for (plat, sid), n in sorted(unread.items()):
            t.add_row(plat, sid, str(n))
        out.print(t)
    if overdue:
        t = _Table("platform", "parent id", "state", "attempt", "past its bound (s)",
                  title=f"rows waiting more than {overdue_after_s:.0f} s past their bound")
        for r, over in overdue:
            t.add_row(r.platform, r.parent_id, r.state, str(r.attempt), f"{over:.0f}")
        out.print(t)


def _print_duplicates(rows: list[dict[str, Any]]) -> None:
    """Per bot, the duplicates the log recorded: a line when there are none, a red table when there are."""
    if not any(r["duplicates"] for r in rows):
        if rows:
            _say("duplicates detected: none")
        return
    t = _Table("bot", "platform", "sender id", "duplicates", title="duplicates detected (own replies beyond the first)")
    for r in rows:
        n = r["duplicates"]
        t.add_row(r["bot"] or "—", r["platform"], r["sender_id"], Text(str(n), style="bold red") if n else "0")
    out.print(t)


def _print_listing(rows: list[dict[str, Any]]) -> None:
    """The listing delay per platform instance: configured, in use (learned), observed lag."""
    if not rows:
        return
    t = _Table("platform", "configured (s)", "in use (s)", "samples", "observed p50 (s)", "observed p99 (s)",
              title="listing delay")
    for r in rows:
        used = "—" if r["in_use_s"] is None else f"{r['in_use_s']:g}"
        t.add_row(r["platform"], "—" if r["configured_s"] is None else f"{r['configured_s']:g}",
                  Text(used, style="yellow") if r["in_use_s"] and r["in_use_s"] > (r["configured_s"] or 0) else used,
                  str(r["samples"]), f"{r['observed_p50_s']:g}", f"{r['observed_p99_s']:g}")
    out.print(t)


def _daemon_liveness(cfg: Config | None) -> dict[str, Any]:
    """Ask the running daemon's API (when the config enables it) how every bot's paths are doing.

    Only the daemon knows when a poll last worked; the store does not record it. ``cfg`` None: no config given.
    """
    if cfg is None or not cfg.api.enabled:
        why = (NO_CONFIG if cfg is None or cfg.source == "defaults"
               else f"{cfg.source} does not enable [api]; liveness needs it")
        return {"reachable": False, "url": None, "error": why, "liveness": {}}
    ac = cfg.api
    import httpx  # only to ask a daemon: a store-only status never loads it
    host = "127.0.0.1" if ac.host in ("0.0.0.0", "", "::") else ac.host
    url = f"http://{host if ':' not in host else f'[{host}]'}:{ac.port}"
    token = os.environ.get(ac.token_env) if ac.token_env else None
    try:
        r = httpx.get(url + "/v1/status", timeout=3.0, headers={"Authorization": f"Bearer {token}"} if token else {})
        data = r.json() if r.status_code in (200, 503) else None
        live = data.get("liveness", {}) if isinstance(data, dict) else None
        bots = data.get("bots", {}) if isinstance(data, dict) else {}
        problem = None if live is not None else f"HTTP {r.status_code}"
        if r.status_code in (401, 403):  # the daemon answered: name the token, never its value
            var = ac.token_env or "api.token_env"
            problem = (f"HTTP {r.status_code}, the API token was refused: "
                       + (f"set {var} to the daemon's token" if not token else f"{var} holds a token the daemon refuses"))
    except (httpx.HTTPError, ValueError) as exc:
        live, problem = None, str(exc) or "no answer"
    if live is None:
        where = "the daemon at" if problem and "token" in problem else "daemon not reachable at"
        return {"reachable": False, "url": url, "error": f"{where} {url}: {problem}", "liveness": {}}
    return {"reachable": True, "url": url, "error": None, "liveness": live, "bots": bots}


def _print_liveness(daemon: dict[str, Any]) -> None:
    """Each bot's paths in words; a stale path red and marked STALE."""
    if not daemon["reachable"]:
        _say(f"daemon: {daemon['error']}", "yellow")
        return
    _say(f"daemon: {daemon['url']}")
    for bot, b in sorted(daemon["liveness"].items()):
        start, brk = b.get("start"), b.get("breaker")
        if start and start["state"] != "running":  # not ready: its platform not reached yet, or the login refused
            out.print(Text(f"  {bot} {start['words']}", style="bold red"))
        if brk and brk["open"]:
            out.print(Text(f"  {bot} write breaker open{': ' + brk['reason'] if brk.get('reason') else ''}",
                           style="bold red"))
        for _path, p in sorted(b["paths"].items()):
            style = "bold red" if p["stale"] or p.get("failing") else ("yellow" if p["failures"] else "green")
            _say(f"  {bot} {p['words']}", style)
        pc = b.get("platform_clock")
        if pc:
            if pc.get("offset_s") is None:
                _say(f"  {bot} platform clock: not measured yet (read-back windows a day wide)")
            else:
                from replyd.platforms._http import SKEW_WARN_S

                skewed = abs(pc["offset_s"]) >= SKEW_WARN_S
                _say(f"  {bot} platform clock: {pc['offset_s']:+.1f} s from replyd's "
                     f"({pc['samples']} samples, {pc['source']})", "yellow" if skewed else None)
        if b.get("oldest_due_open_age_s") is not None:
            _say(f"  {bot} oldest due open row: {b['oldest_due_open_age_s']:.0f} s past its deadline", "yellow")


def _parent_rows(parent: str, platform: str | None, config: Path | None, store: str | None) -> tuple[Any, list[st.Reply]]:
    """Open the existing store for reading (no secrets resolved) and return it with the rows of ``parent``."""
    s, _cfg = _read_store(config, store)
    return s, s.find(parent, platform)


def explain(
    parent: ParentArg,
    platform: Annotated[str | None, typer.Option(help="Platform instance, when several have this id.")] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    store: StoreOpt = None,
) -> None:
    """Show the whole history of one parent's key."""
    s, rows = _parent_rows(parent, platform, config, store)
    if not rows:
        # A parent the policy skipped (or a dry run showed) has events but no row.
        events = s.find_events(parent, platform)
        if not events:
            err.print(shown(f"no row for parent id {parent!r}") + (f" on {platform}" if platform else "") + " (ids are exact: case and leading zeros matter)")
            raise typer.Exit(1)
        _explain_unclaimed(parent, events, as_json)
        return
    docs: list[dict[str, Any]] = []
    for r in rows:
        events = s.history(st.Key(r.platform, r.sender_id, r.parent_id))
        doc = {"row": {k: v for k, v in r.model_dump().items() if k != "snapshot"},
               "events": [{**e.model_dump(exclude={"detail"}), "detail": json.loads(e.detail)} for e in events]}
        parts = _parts_of(s, r)
        if parts:
            doc["parts"] = parts
        docs.append(doc)
        if not as_json:
            _say(f"{r.platform} sender {r.sender_id} parent {r.parent_id}: "
                 f"{r.state} attempt {r.attempt} reply {r.reply_id or '-'} (found by {r.path or '-'})")
            t = _Table("at", "event", "state", "attempt", "owner", "detail")
            for e in events:
                t.add_row(_ts(e.at), e.kind, e.state or "", str(e.attempt or ""), e.owner or "", e.detail)
            out.print(t)
            if parts:
                landed = sum(1 for p in parts if p["state"] == st.CLOSED)
                t = _Table("part", "state", "attempt", "reply", "text", title=f"{landed} of {len(parts)} parts landed")
                for p in parts:
                    t.add_row(str(p["part"]), p["state"] or "not claimed", str(p["attempt"] or ""),
                              p["reply_id"] or "-", p["text"][:60])
                out.print(t)
    if as_json:
        _emit_json(docs)


def _parts_of(s: Any, r: st.Row) -> list[dict[str, Any]]:
    """The parts of an answer sent in several parts, each with its own row's state (empty: one post)."""
    from replyd.parts import part_id

    key = st.Key(r.platform, r.sender_id, r.parent_id)
    texts = s.answer(key) or []
    if len(texts) < 2 and r.state != st.PARTS:
        return []  # a one-post answer: its row is the whole story (a stored text is not a part)
    out = []
    for k, text in enumerate(texts, 1):
        row = s.peek(st.Key(r.platform, r.sender_id, part_id(r.parent_id, k)))
        out.append({"part": k, "state": row.state if row else None, "attempt": row.attempt if row else None,
                    "reply_id": row.reply_id if row else None, "text": text})
    return out


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
            _say(f"{platform} sender {sender} parent {parent}: no row, {why}")
            t = _Table("at", "event", "detail")
            for e in evs:
                t.add_row(_ts(e.at), e.kind, e.detail)
            out.print(t)
    if as_json:
        _emit_json(docs)


def check(parent: ParentArg, platform: Annotated[str | None, typer.Option(help="Platform instance.")] = None,
          config: ConfigOpt = None, as_json: JsonOpt = False, store: StoreOpt = None) -> None:
    """The card's verify step on the live log: an answered parent prints 'already answered'; nothing is sent."""
    from replyd.outcome import Status, classify

    s, rows = _parent_rows(parent, platform, config, store)
    results = []
    for r in rows:
        o = classify(r, st.Key(r.platform, r.sender_id, r.parent_id), s.clock.now())
        results.append({"platform": r.platform, "sender_id": r.sender_id, "parent_id": r.parent_id,
                        "status": o.status.value, "reply_id": o.reply_id})
    code = 0 if any(x["status"] == Status.ALREADY_ANSWERED.value for x in results) else 1
    if as_json:
        _emit_json({"parent_id": parent, "answered": code == 0, "keys": results})
    elif not rows:
        _say(f"not answered: no row for {parent!r}; a post would claim it")
    for x in [] if as_json else results:
        extra = f" (reply {x['reply_id']})" if x["reply_id"] else ""
        _say(f"{x['status'].replace('_', ' ')}{extra}: {x['platform']} sender {x['sender_id']}; nothing sent")
    raise typer.Exit(code)


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
    from replyd.store.reader import event_dict

    if state is not None and state not in st.STATES:
        raise ConfigError(f"--state: unknown state {state!r} (known: {', '.join(st.STATES)})")
    s, _cfg = _read_store(config, store)
    filters = {"kind": kind, "state": state, "platform": platform, "path": path, "parent_id": parent}
    start = parse_time(since, s.clock.now()) if since is not None else None

    def look(limit: int) -> list[dict[str, Any]]:
        return [event_dict(m) for m in s.events_with_path(limit=limit, since=start, **filters)]

    evs = look(limit)
    if not evs and kind is not None and kind not in (kinds := s.event_kinds()):
        raise ConfigError(f"--kind: no event of kind {kind!r} was ever recorded here "
                          f"(recorded: {', '.join(kinds) or 'none yet'})")
    if not follow:
        if as_json:
            _emit_json(evs)
        elif not evs:
            out.print("no events match")
        else:
            t = _Table("at (UTC)", "platform", "parent id", "event", "state", "attempt", "path", "detail", title="recent events")
            for e in evs:
                t.add_row(*_event_cells(e))
            out.print(t)
        return
    # Follow: oldest first, one line (or one JSON object) per event, by increasing event id. Ctrl-C only sets a
    # flag the loop reads between looks: a KeyboardInterrupt raised inside a look could leave the store's
    # connection pool holding its lock, and the exit then waited on it (CI once saw no exit in 15 s).
    last = max((e["id"] for e in evs), default=0)
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: stop.set())
    try:
        while not stop.is_set():
            for e in sorted(evs, key=lambda e: e["id"]):
                if as_json:
                    sys.stdout.write(json.dumps(e, default=str) + "\n")
                else:
                    sys.stdout.write(shown("  ".join(c for c in _event_cells(e) if c)) + "\n")
                last = max(last, e["id"])
            sys.stdout.flush()
            if stop.wait(every_s):
                break
            evs = [e for e in look(1000) if e["id"] > last]
    finally:
        signal.signal(signal.SIGINT, previous)
    raise typer.Exit(0)


def _event_cells(e: dict[str, Any]) -> tuple[str, ...]:
    detail = e["detail"] if isinstance(e["detail"], str) else json.dumps(e["detail"], sort_keys=True)
    return (_ts(e["at"]), e["platform"], e["parent_id"], e["kind"], e["state"] or "", str(e["attempt"] or ""),
            e["path"] or "", detail)


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
    from replyd.store import reading as library

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
        with _owner_only(output) as fh:
            n = library.export(s, fh, table=table, fmt=fmt, since=start)
        err.print(f"wrote {n} {table} row(s) to {output}")


def _owner_only(path: Path) -> Any:
    """Open ``path`` for writing text, readable by its owner only (0600): the log holds who was answered, and how.

    A new file is created with mode 0600 (no window in which it has another mode);
    an existing regular file is truncated and set to 0600 through the open descriptor.
    A device or pipe (``-o /dev/stdout``) is written as it is.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"--output: cannot write {str(path)!r}: {exc.strerror or exc}") from None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w", newline="", encoding="utf-8")
