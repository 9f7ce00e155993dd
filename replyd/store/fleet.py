"""The fleet's tables: replicas' heartbeats and bot leases, written by one transaction per heartbeat.

A heartbeat (``Fleet.fleet_beat``) records this replica's time, reads the live replicas, frees the leases
of replicas whose heartbeat lapsed (their bots, their rows' composing and sweep leases), then settles every
bot lease by compare-and-set on the rows it locked: renew what it holds and still targets, release what
it holds but no longer targets, take what is free and targeted at it. Who targets what is the caller's
(``replyd.fleet``: rendezvous hashing over the live set); this module only reads and writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from replyd.store.schema import BOT_LEASES, REPLICAS, REPLIES

_CHUNK = 500  # SQLite's bound-parameter limit, with room to spare


def _batches(conn: Connection, bots: Sequence[str]) -> list[sa.ColumnElement[bool]]:
    """``bot IN (...)`` conditions covering ``bots``: one array parameter on PostgreSQL (a statement with
    thousands of placeholders costs more to convert than to run), chunks under SQLite's parameter limit."""
    col = BOT_LEASES.c.bot
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import ARRAY

        return [col == sa.any_(sa.bindparam("bots", list(bots), type_=ARRAY(sa.Text)))]
    return [col.in_(bots[i:i + _CHUNK]) for i in range(0, len(bots), _CHUNK)]


@dataclass
class Beat:
    """What one heartbeat saw and did: the live replicas, the bots held (and until when), the dead freed."""

    live: list[str]
    held: dict[str, float]
    dead: dict[str, int] = field(default_factory=dict)  # replica id -> rows whose leases were freed
    taken: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    clash: float | None = None  # another live process with this replica id: its start time


class FleetLeases:
    """The fleet's part of the store (mixed into ``Store``)."""

    def _tx(self, *, write: bool = True, relaxed: bool = False,
            doing: str = "writing") -> AbstractContextManager[Connection]:
        """A transaction (``Store._tx``)."""
        raise NotImplementedError

    def _lock_rows(self, q: sa.Select) -> sa.Select:
        """``q`` locking the rows it reads until the transaction ends (PostgreSQL: ``FOR UPDATE``)."""
        return q

    def fleet_beat(self, owner: str, bots: Sequence[str], *, now: float, lease_s: float, started_at: float,
                   target: Callable[[str, Sequence[str]], str], grace_s: Mapping[str, float] | None = None,
                   first: bool = False) -> Beat:
        """One heartbeat of replica ``owner`` serving ``bots``, in one transaction; return what it holds now.

        Live: a heartbeat within ``lease_s``. ``target(bot, live)`` names the replica that should run a bot.
        A released bot is free from ``now + grace_s[bot]`` (its last poll may still be in flight). A bot free
        for a whole lease is taken by anyone serving it: its target may not serve it (configs that differ).
        ``first``: this process's first beat. On a later beat, a row whose start time is not ``started_at`` means
        another live process uses this replica id: ``Beat.clash`` is that process's start time.
        """
        grace_s = grace_s or {}
        r, b = REPLICAS.c, BOT_LEASES.c
        with self._tx(relaxed=True, doing="writing the fleet's heartbeat") as conn:
            clash = None
            mine = conn.execute(self._lock_rows(sa.select(r.started_at).where(r.owner == owner))).first()
            if mine is None:
                conn.execute(sa.insert(REPLICAS).values(owner=owner, heartbeat_at=now, started_at=started_at))
            else:
                # Another process beat under this id since this one's last beat: its start time is in the row.
                # (At a first beat the row may be a dead predecessor's: that is no clash.)
                if not first and mine.started_at != started_at:
                    clash = float(mine.started_at)
                conn.execute(sa.update(REPLICAS).where(r.owner == owner).values(heartbeat_at=now, started_at=started_at))
            seen = {o: at for o, at in conn.execute(sa.select(r.owner, r.heartbeat_at))}
            live = sorted(o for o, at in seen.items() if at >= now - lease_s or o == owner)
            dead = {o: self._free_dead(conn, o, now, lease_s) for o in seen if o not in live}
            dead = {o: n for o, n in dead.items() if n >= 0}  # -1: another replica freed it first
            rows: dict[str, tuple[str | None, float, str | None]] = {}
            for names in _batches(conn, bots):
                q = self._lock_rows(sa.select(b.bot, b.holder, b.until, b.wanted_by).where(names).order_by(b.bot))
                rows.update({name: (holder, until, wanted) for name, holder, until, wanted in conn.execute(q)})
            out = Beat(live=live, held={}, dead=dead, clash=clash)
            inserts, sets, asks = [], [], []
            for bot in bots:
                goal = target(bot, live)
                mine = goal == owner
                if bot not in rows:
                    inserts.append({"bot": bot, "holder": owner if mine else None,
                                    "until": now + lease_s if mine else now})
                    continue
                holder, until, wanted = rows[bot]
                if holder == owner and (mine or wanted != goal):
                    sets.append({"k": bot, "h": owner, "u": now + lease_s})  # renew: nobody live asked for it
                elif holder == owner:
                    sets.append({"k": bot, "h": None, "u": now + grace_s.get(bot, 0.0)})
                    out.released.append(bot)
                elif (mine and until <= now) or until < now - lease_s:
                    sets.append({"k": bot, "h": owner, "u": now + lease_s})
                    out.taken.append(bot)
                elif mine and holder is not None and wanted != owner:
                    asks.append({"k": bot})  # held by another live replica: ask it to hand over
            if asks:
                conn.execute(sa.update(BOT_LEASES).where(b.bot == sa.bindparam("k"))
                             .values(wanted_by=owner), asks)
            # One statement per (holder, until): a heartbeat's renewals share both, so a replica holding
            # thousands of bots renews them in one UPDATE, not one each.
            groups: dict[tuple[str | None, float], list[str]] = {}
            for row in sets:
                groups.setdefault((row["h"], row["u"]), []).append(row["k"])
            for (holder, until), names in groups.items():
                for cond in _batches(conn, names):
                    conn.execute(sa.update(BOT_LEASES).where(cond).values(holder=holder, until=until, wanted_by=None))
            for row in inserts:
                # A row another replica inserted meanwhile wins: this one settles it at its next heartbeat.
                ins = sa.insert(BOT_LEASES).values(**row).prefix_with("OR IGNORE", dialect="sqlite")
                if conn.dialect.name == "postgresql":
                    from sqlalchemy.dialects.postgresql import insert as pg_insert

                    ins = pg_insert(BOT_LEASES).values(**row).on_conflict_do_nothing()
                if conn.execute(ins).rowcount == 1 and row["holder"] == owner:
                    out.taken.append(row["bot"])
            q = sa.select(b.bot, b.until).where(b.holder == owner, b.until > now)
            served = set(bots)  # once: a set built per row made a beat quadratic in the bots
            out.held = {name: until for name, until in conn.execute(q) if name in served}
            out.taken = [t for t in out.taken if t in out.held]
        return out

    def _free_dead(self, conn: Connection, dead: str, now: float, lease_s: float) -> int:
        """Forget replica ``dead`` (its heartbeat lapsed) and free its bots and its rows' leases now.

        Return how many rows' leases were freed, or -1 when another replica forgot it first (or it beat since).
        """
        r, b, c = REPLICAS.c, BOT_LEASES.c, REPLIES.c
        gone = conn.execute(sa.delete(REPLICAS).where(r.owner == dead, r.heartbeat_at < now - lease_s)).rowcount
        if gone != 1:
            return -1
        conn.execute(sa.update(BOT_LEASES).where(b.holder == dead).values(holder=None, until=now))
        # Composing rows are then waiting rows (re-offered); swept rows are due to any sweeper. A daemon's
        # composing claim holds "<owner>/<n>" (each claim its own holder); a sweep lease holds the owner.
        mine = sa.or_(c.lease_owner == dead, c.lease_owner.startswith(f"{dead}/", autoescape=True))
        return conn.execute(sa.update(REPLIES).where(mine, c.lease_until > now).values(lease_until=now)).rowcount

    def fleet_leave(self, owner: str, *, now: float) -> None:
        """Leave the fleet (a graceful stop): forget this replica and free its bots at once."""
        r, b = REPLICAS.c, BOT_LEASES.c
        with self._tx(relaxed=True, doing="leaving the fleet") as conn:
            conn.execute(sa.update(BOT_LEASES).where(b.holder == owner).values(holder=None, until=now))
            conn.execute(sa.delete(REPLICAS).where(r.owner == owner))

    def fleet_view(self) -> dict[str, Any]:
        """The fleet as stored: every replica's heartbeat and every bot's lease (``replyd status``, tests)."""
        with self._tx(write=False, doing="reading the fleet") as conn:
            replicas = {o: at for o, at in conn.execute(sa.select(REPLICAS.c.owner, REPLICAS.c.heartbeat_at))}
            leases = {bot: (holder, until) for bot, holder, until in
                      conn.execute(sa.select(BOT_LEASES.c.bot, BOT_LEASES.c.holder, BOT_LEASES.c.until))}
        return {"replicas": replicas, "leases": leases}
