"""The embeddable API: open a guard over a store and a platform and post once, plus the operator actions.

A Python agent uses ``open_guard`` and gets the very ``Guard.post`` the daemon
and the HTTP API use, so its answers share one answered-log with them::

    with open_guard("sqlite:///replyd.sqlite3", "mastodon",
                    {"base_url": "https://mastodon.example", "token_env": "MASTODON_TOKEN"}) as g:
        outcome = g.post("113000000000000001", "Thanks!")

The operator actions (``rearm``, ``adopt``, ``events``, ``export``) live here
too, so the CLI and the HTTP API change state through the same few functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from replyd import metrics
from replyd import store as st
from replyd.clock import Clock, DatabaseClock, SystemClock
from replyd.config import resolve_env
from replyd.errors import BadResponse, ConfigError, PlatformError
from replyd.guard import Compose, Guard, Lease, Outcome, snapshot_json
from replyd.log import get_logger
from replyd.platforms.base import Identity, OwnReply, Parent, Pending, Platform, ReadBack, make_platform
from replyd.platforms._http import make_client
from replyd.store import Event, Key, Reply, Store
from replyd.store.reading import (  # noqa: F401  (the names callers have imported from here)
    TABLES, TIME_COLUMNS, _event_dict, events, export, iso, iter_table, paths)
from replyd.sweep import Bot, Sweeper, SweepResult

log = get_logger("replyd.library")

# Terminal states an operator may send back to claimable.
REARMABLE = (st.REJECTED, st.GAVE_UP, st.DECLINED, st.SKIPPED, st.UNCONFIRMED)


# -- posting ---------------------------------------------------------------------------------


def submit(guard: Guard, parent: str | Parent, text: str | Compose, *, path: str = "api") -> Outcome:
    """Resolve ``parent`` (an id or URL) through the adapter and post through ``Guard.post``.

    A parent id that already has a blocking row (answered, in flight, refused)
    is reported without a platform request. A ``PlatformError`` raised here
    always comes from the resolve: nothing was sent.
    """
    found = unblocked(guard, parent)
    if isinstance(found, Outcome):
        metrics.outcome(guard.platform.instance, found.status.value)
        return found
    return guard.post(found, text, path=path)


def unblocked(guard: Guard, parent: str | Parent) -> Parent | Outcome:
    """Return what blocks ``parent`` (read-only pre-check on the id as given), else the parent resolved.

    The pre-check comes first so an answered or in-flight parent costs no
    platform request. A ``PlatformError`` raised here comes from the resolve.
    """
    if isinstance(parent, Parent):
        return parent
    blocked = guard.check(parent)
    if blocked is not None:
        return blocked
    try:
        return guard.platform.resolve(parent)
    except PlatformError as exc:
        metrics.platform_error(guard.platform.instance, "resolve", exc)
        raise
    except Exception as exc:  # an adapter bug on a read path: report it as an unreadable answer
        metrics.platform_error(guard.platform.instance, "resolve", exc)
        log.error("replyd.library.resolve_failed", parent_id=parent, error=f"{type(exc).__name__}: {exc}"[:300])
        raise BadResponse(f"resolve: {type(exc).__name__}") from None


# -- compose leases: begin, compose elsewhere, finish ------------------------------------------------


def _as_holder(guard: Guard, owner: str) -> Guard:
    """The same guard acting as ``owner`` (``GuardCore._as_holder``)."""
    return guard._as_holder(owner)


def begin(guard: Guard, parent: Parent, *, owner: str, path: str = "api") -> Lease | Outcome:
    """Claim ``parent``'s key as ``composing`` for ``owner`` (nothing is sent); else say what blocks it.

    For callers that compose somewhere else (an LLM agent): only the lease
    holder spends tokens on the reply, and ``finish`` posts it. A lease that
    runs out (``guard.compose_lease_s``) was provably never sent, so the key
    goes back to claimable without using an attempt.
    """
    holder = guard if guard.dry_run or not guard.claiming else _as_holder(guard, owner)
    return holder._run(holder.begin_steps(parent, owner=owner, path=path))


def finish(guard: Guard, lease: Lease, text: str) -> Outcome:
    """Post ``text`` under ``lease``: open the composing row while the lease is live and ours, then send.

    Raises ``LeaseLost`` (nothing sent) when the lease ran out or the key is
    no longer this holder's; the message says where the key stands.
    """
    if not text or not text.strip():
        raise ValueError("text: must not be empty")
    holder = _as_holder(guard, lease.owner)
    return holder._run(holder.finish_steps(lease, text))


def _where(guard: Guard, key: Key, row: st.Row | None, now: float) -> str:
    """Say in words where a key stands now, for a lease refusal."""
    return guard.where(key, row, now)


class GuardSession:
    """One bot's guard over one store, with the connections it opened; close it (or use ``with``)."""

    def __init__(
        self,
        store: Store,
        platform: Platform,
        identity: Identity,
        guard: Guard,
        *,
        http: httpx.Client | None = None,
        owns_store: bool = True,
    ) -> None:
        self.store = store
        self.platform = platform
        self.identity = identity
        self.guard = guard
        self._http = http
        self._owns_store = owns_store

    def post(self, parent: str | Parent, text: str | Compose, *, path: str = "library") -> Outcome:
        """Reply to ``parent`` (id, URL or Parent) at most once; ``text`` may be a responder."""
        return submit(self.guard, parent, text, path=path)

    def check(self, parent_id: str) -> Outcome | None:
        """Return what blocks a post to ``parent_id`` (read-only), or None if a post would claim it."""
        return self.guard.check(parent_id)

    def history(self, parent_id: str) -> list[Event]:
        """Return every event of this bot's key for ``parent_id``."""
        return self.store.history(self.guard.key(parent_id))

    def sweep(self, *, on_duplicate: str = "report") -> SweepResult:
        """Bound this bot's due open rows by reading back (run it periodically without the daemon)."""
        sweeper = Sweeper(self.store, [Bot(self.platform, self.identity, self.guard.lag)], clock=self.guard.clock,
                          owner=self.guard.owner, max_attempts=self.guard.max_attempts, on_duplicate=on_duplicate)
        return sweeper.run_once()

    def rearm(self, parent_id: str, *, by: str = "library", reason: str = "") -> RearmResult:
        """Send a rejected, given-up or declined key back to claimable."""
        return rearm(self.store, self.guard.key(parent_id), by=by, reason=reason, owner=self.guard.owner)

    def adopt(self, parents: Sequence[Parent]) -> AdoptResult:
        """Record own replies that already exist on the platform as answered (see ``adopt``)."""
        return adopt(self.store, self.platform, self.identity, parents, owner=self.guard.owner)

    def close(self) -> None:
        """Release the HTTP client and the store connections this session opened."""
        self.guard.close()
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._owns_store:
            self.store.dispose()

    def __enter__(self) -> GuardSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_guard(
    store_url: str | None,
    platform: str | Platform,
    settings: Mapping[str, Any] | None = None,
    *,
    clock: Clock | None = None,
    max_attempts: int = 2,
    send_timeout_s: float = 30.0,
    compose_lease_s: float = 120.0,
    dry_run: bool = False,
    migrate: bool = True,
    db_clock: bool = True,
) -> GuardSession:
    """Open the store at ``store_url`` (None: the embedded default), log the bot in, return a session.

    ``platform`` is an adapter kind (``"mastodon"``, ...) configured by
    ``settings`` — the same keys as a ``[bots.settings]`` table, ``*_env`` keys
    read from the environment — or an adapter instance you built. On PostgreSQL the
    guard takes its time from the database (``db_clock``, as the daemon does) unless
    a ``clock`` is given, so its deadlines agree with the daemons' on other machines.
    """
    if not isinstance(platform, str) and settings:
        raise ConfigError("open_guard: settings are for a platform kind; an adapter instance is already configured")
    store = Store.open(store_url, clock=clock, migrate=migrate)
    http: httpx.Client | None = None
    try:
        if clock is None:
            clock = DatabaseClock(store.db_epoch) if db_clock and not store.is_sqlite else SystemClock()
            store.clock = clock
        if isinstance(platform, str):
            resolved = resolve_env(dict(settings or {}), f"open_guard({platform!r}).settings")
            # Every send through this client ends within send_timeout_s in total (replyd.deadline).
            http = make_client(send_timeout_s)
            adapter = make_platform(platform, {"listing_delay_s": 10.0, **resolved}, http=http, clock=clock)
        else:
            adapter = platform
        identity = adapter.whoami()
    except Exception:
        store.dispose()
        if http is not None:
            http.close()
        raise
    guard = Guard(store, adapter, identity, clock=clock, max_attempts=max_attempts, send_timeout_s=send_timeout_s,
                  compose_lease_s=compose_lease_s, dry_run=dry_run)
    log.info("replyd.library.opened", platform=adapter.instance, sender_id=identity.sender_id, store=store.url)
    return GuardSession(store, adapter, identity, guard, http=http)


# -- rearm -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RearmResult:
    """What a rearm did: ``previous`` is the state it found (None: no row)."""

    key: Key
    rearmed: bool
    previous: str | None
    row: Reply | None


def rearm(store: Store, key: Key, *, by: str, reason: str = "", owner: str | None = None) -> RearmResult:
    """Move a rejected, given-up or declined key to ``released`` (compare-and-set, event ``rearmed``).

    The attempt is kept, so a rearmed key gets exactly one more try before it
    can give up again; a key in any other state is left alone. A parent the policy
    skipped has no row, only a ``skipped`` event: its row is made from the snapshot
    that event carries (``released``, attempt 1), so the next re-offer may answer it.
    """
    now = store.clock.now()
    skip = store.last_event(key, ["skipped"])
    noted = json.loads(skip.detail) if skip is not None else {}
    with store.transaction(doing="rearming") as tx:
        row = tx.get(key)
        if row is None and noted.get("snapshot"):
            made = _rearm_skipped(tx, key, noted, now, by=by, reason=reason, owner=owner)
            current = tx.get(key)
            log.info("replyd.library.rearmed" if made else "replyd.library.rearm_refused", platform=key.platform,
                     parent_id=key.parent_id, previous=st.SKIPPED, by=by)
            return RearmResult(key, made, st.SKIPPED, current)
        if row is None:
            return RearmResult(key, False, None, None)
        if row.state not in REARMABLE:
            return RearmResult(key, False, row.state, row)
        values = {"state": st.RELEASED, "updated_at": now, "error": None, "not_before": None,
                  "lease_owner": None, "lease_until": None}
        ok = tx.cas_event(key, states=[row.state], attempt=row.attempt, values=values)
        if ok:
            tx.append_event(key, "rearmed", state=st.RELEASED, attempt=row.attempt, owner=owner,
                            detail={"from": row.state, "by": by, **({"reason": reason} if reason else {})})
        current = tx.get(key)
    log.info("replyd.library.rearmed" if ok else "replyd.library.rearm_refused", platform=key.platform,
             parent_id=key.parent_id, previous=row.state, by=by)
    return RearmResult(key, ok, row.state, current)


@dataclass(frozen=True)
class ConfirmResult:
    """What a confirm did: ``previous`` is the state it found (None: no row)."""

    key: Key
    confirmed: bool
    previous: str | None
    row: Reply | None


def confirm(store: Store, key: Key, *, by: str, reply_id: str | None = None, reason: str = "",
            owner: str | None = None, states: tuple[str, ...] = (st.UNCONFIRMED,)) -> ConfirmResult:
    """Mark an ``unconfirmed`` key answered: ``closed`` (with ``reply_id`` when the operator knows it), event
    ``confirmed``; compare-and-set, so a key in any other state is left alone.

    For a platform without read-back (``NoReadBack``): the operator saw the reply land (in the chat), so the
    parent must never be answered again. Nothing is sent or read on the platform. ``states``: a platform's own
    proof of the landing (WhatsApp's status webhook, ``replyd.hooks``) also closes a row still ``open`` (its send's
    answer lost, the sweep not yet past its deadline).
    """
    now = store.clock.now()
    with store.transaction(doing="confirming") as tx:
        row = tx.get(key)
        if row is None:
            return ConfirmResult(key, False, None, None)
        if row.state not in states:
            return ConfirmResult(key, False, row.state, row)
        values = {"state": st.CLOSED, "updated_at": now, "closed_at": now, "error": None, "deadline_at": None,
                  "reply_id": reply_id or row.reply_id, "lease_owner": None, "lease_until": None}
        ok = tx.cas_event(key, states=[row.state], attempt=row.attempt, values=values)
        if ok:
            tx.append_event(key, "confirmed", state=st.CLOSED, attempt=row.attempt, owner=owner,
                            detail={"by": by, **({"reply_id": reply_id} if reply_id else {}),
                                    **({"reason": reason} if reason else {})})
        current = tx.get(key)
    log.info("replyd.library.confirmed" if ok else "replyd.library.confirm_refused", platform=key.platform,
             parent_id=key.parent_id, previous=row.state, by=by)
    return ConfirmResult(key, ok, row.state, current)


def _rearm_skipped(tx: Any, key: Key, skip: Mapping[str, Any], now: float, *, by: str, reason: str,
                   owner: str | None) -> bool:
    """Make the ``released`` row of a parent the policy skipped (no row) from its skip event's snapshot, event
    ``rearmed``; False when the key has a row by now."""
    snapshot = skip["snapshot"]
    values = {"state": st.RELEASED, "attempt": 1, "created_at": now, "updated_at": now,
              "path": str(skip.get("path") or "rearm")[:64], "snapshot": snapshot, "owner": owner,
              "author_id": str(json.loads(snapshot).get("author_id", ""))[:255]}
    if not tx.insert_new(key, values):
        return False
    tx.append_event(key, "rearmed", state=st.RELEASED, attempt=1, owner=owner,
                    detail={"from": st.SKIPPED, "by": by, **({"reason": reason} if reason else {})})
    return True


def rearm_many(store: Store, bots: Sequence[tuple[str, str]], *, state: str, since: float | None = None, by: str,
               reason: str = "", owner: str | None = None, dry_run: bool = False,
               limit: int = 1000) -> list[RearmResult]:
    """Rearm each row of ``bots`` ((platform instance, sender id) pairs) in ``state`` changed at or after ``since``.

    Oldest change first, at most ``limit`` rows in all; each goes through ``rearm`` (compare-and-set, event
    ``rearmed``), so a row that moved on since it was read is left alone (``rearmed`` False, ``previous`` its
    new state). ``dry_run``: nothing changes; each matching row is returned as found, ``rearmed`` False.
    """
    if state not in REARMABLE:
        raise ConfigError(f"state: {state!r} cannot be rearmed (only {', '.join(REARMABLE)})")
    out: list[RearmResult] = []
    for platform, sender_id in bots:
        for row in store.rows_in(platform, sender_id, [state], limit=limit - len(out), since=since):
            key = Key(row.platform, row.sender_id, row.parent_id)
            out.append(RearmResult(key, False, row.state, row) if dry_run
                       else rearm(store, key, by=by, reason=reason, owner=owner))
        if len(out) >= limit:
            break
    log.info("replyd.library.rearmed_many", platform=",".join(sorted({p for p, _ in bots})), state=state, since=since,
             matched=len(out), dry_run=dry_run,
             rearmed=sum(r.rearmed for r in out), by=by)
    return out


# -- adopt -----------------------------------------------------------------------------------


@dataclass
class AdoptResult:
    """Per parent: adopted (reply id), already tracked, read back with no own reply, or not conclusively read."""

    adopted: dict[str, str] = field(default_factory=dict)
    tracked: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    duplicates: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {"adopted": self.adopted, "tracked": self.tracked, "unanswered": self.unanswered,
                "unknown": self.unknown, "duplicates": self.duplicates}


def adopt(
    store: Store,
    platform: Platform,
    identity: Identity,
    parents: Sequence[Parent],
    *,
    owner: str | None = None,
    dry_run: bool = False,
) -> AdoptResult:
    """Read back the bot's existing replies to ``parents`` and record each found one as ``closed``.

    So a fresh install does not answer threads the bot answered before replyd.
    Parents that already have a row are left alone; a read-back that fails or
    is inconclusive records nothing (the normal path will claim those, and the
    platform's own idempotency is then the only guard).
    """
    owner = owner or st.make_owner()
    result = AdoptResult()
    fresh: dict[str, Parent] = {}
    unique: dict[str, Parent] = {}
    for p in parents:
        unique.setdefault(p.id, p)
    ids = list(unique)
    for at in range(0, len(ids), 500):  # one statement per 500 parents, not one per parent
        chunk = ids[at:at + 500]
        for pid, row in zip(chunk, store.rows_of([Key(platform.instance, identity.sender_id, i) for i in chunk]), strict=True):
            if row is not None:
                result.tracked.append(pid)
            else:
                fresh[pid] = unique[pid]
    if not fresh:
        return result
    # A reply cannot predate its parent, so the parent's time bounds how far back to read.
    pending = [Pending(parent=p, opened_at=p.created_at or 0.0) for p in fresh.values()]
    try:
        rb = platform.read_back(pending, sender_id=identity.sender_id)
    except Exception as exc:  # not read is not "not answered"
        metrics.platform_error(platform.instance, "read_back", exc)
        log.warning("replyd.library.adopt_readback_failed", platform=platform.instance, error=str(exc)[:300])
        rb = ReadBack()
    now = store.clock.now()
    found: list[tuple[str, Parent, list[OwnReply]]] = []
    for pid, parent in fresh.items():
        mine = rb.found.get(pid) or []
        if not mine:
            (result.unanswered if pid in rb.checked else result.unknown).append(pid)
            continue
        if len(mine) > 1:
            result.duplicates[pid] = [m.reply_id for m in mine[1:]]
        if dry_run:
            result.adopted[pid] = mine[0].reply_id
        else:
            found.append((pid, parent, mine))
    for at in range(0, len(found), 100):  # one commit per 100 parents: a commit per parent was 25 ms on SQLite
        won: dict[str, str] = {}
        with store.transaction(doing="adopting") as tx:
            for pid, parent, mine in found[at:at + 100]:
                key, first = Key(platform.instance, identity.sender_id, pid), mine[0].reply_id
                values = {"state": st.CLOSED, "attempt": 1, "created_at": now, "updated_at": now, "closed_at": now,
                          "reply_id": first, "path": "adopt", "owner": owner, "snapshot": snapshot_json(parent)}
                if not tx.insert_new(key, values):
                    continue  # claimed by a path between our check and our insert
                won[pid] = first
                tx.append_event(key, "adopted", state=st.CLOSED, attempt=1, owner=owner,
                                detail={"reply_id": first, "replies": len(mine)})
                if len(mine) > 1:
                    tx.append_event(key, "duplicate_detected", state=st.CLOSED, attempt=1, owner=owner,
                                    detail={"kept": first, "newer": result.duplicates[pid], "action": "report"})
        result.adopted.update(won)
        result.tracked += [pid for pid, _, _ in found[at:at + 100] if pid not in won]
    log.info("replyd.library.adopted", platform=platform.instance, adopted=len(result.adopted),
             tracked=len(result.tracked), unanswered=len(result.unanswered), unknown=len(result.unknown))
    return result


def window_parents(store: Store, platform: Platform, sender_id: str, *, lookback_s: float, now: float,
                   queries: Sequence[str] = ()) -> list[Parent]:
    """Every parent the bot's paths can find now: the re-find window, and the inbox and searches read from
    their saved cursors (read only: no cursor moves)."""
    parents = list(platform.refind(now - lookback_s))
    parents += platform.inbox(store.get_cursor(platform.instance, sender_id, "inbox")).parents
    for q in queries:
        parents += platform.search(q, store.get_cursor(platform.instance, sender_id, f"search:{q}")).parents
    return parents
