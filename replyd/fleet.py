"""The fleet: replicas on PostgreSQL share the bots, so each bot's discovery runs on one replica at a time.

Every replica beats every ``heartbeat_s`` (``Store.fleet_beat``: one transaction for all its bots). A beat
records its time, reads the live replicas (a heartbeat within ``bot_lease_s``, on the database clock) and
settles each bot's lease by compare-and-set. Each bot has one target among the live replicas, by rendezvous
hashing (highest random weight): an even share, and a join or a leave moves only the bots it must.
A holder releases a bot that is no longer its target; the target takes it once free. A released bot is
free only after its last poll's bound (``grace_s``): two pollers never overlap on Telegram's ``getUpdates``.

A replica whose heartbeat lapsed is dead: the first to see it frees its bots and its rows' composing and
sweep leases at once, not when each lease runs out. Its bots go to their new targets at their next beat.

The daemon asks ``holds(bot)`` before each poll (an in-memory flag, expiring on its own when beats fail)
and starts or stops a bot's stream on ``on_gain`` / ``on_loss``. Sends that reach a replica (webhooks,
the API, MCP) never ask: the guard's claim is what keeps an answer single, lease or not.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence

from replyd.clock import Clock
from replyd.log import get_logger
from replyd.store import Store

log = get_logger("replyd.fleet")

_SHOWN = 20  # bot names listed in one event; the count says the rest


@functools.lru_cache(maxsize=65536)  # a beat asks it for every bot and live replica
def weight(replica: str, bot: str) -> int:
    """The rendezvous weight of ``replica`` for ``bot``: stable across processes and machines."""
    return int.from_bytes(hashlib.blake2b(f"{replica}\0{bot}".encode(), digest_size=8).digest(), "big")


def target(bot: str, live: Sequence[str]) -> str:
    """The live replica that should run ``bot``'s discovery: the highest weight (ties by name)."""
    return max(live, key=lambda r: (weight(r, bot), r))


class Fleet:
    """One replica's view of the fleet: its heartbeat thread and the bots it holds."""

    def __init__(self, store: Store, owner: str, bots: Sequence[str], clock: Clock, *, heartbeat_s: float,
                 bot_lease_s: float, grace_s: Mapping[str, float] | None = None,
                 on_gain: Callable[[str], None] | None = None, on_loss: Callable[[str], None] | None = None,
                 on_clash: Callable[[str], None] | None = None,
                 target_of: Callable[[str, Sequence[str]], str] = target) -> None:
        self.store = store
        self.owner = owner
        self.bots = list(bots)
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.bot_lease_s = bot_lease_s
        self.grace_s = dict(grace_s or {})
        self.on_gain = on_gain
        self.on_loss = on_loss
        self.on_clash = on_clash
        self._beaten = False  # a beat has been written: the replicas row holds this process's start time
        self.target_of = target_of
        self.live: list[str] = []
        self._held: dict[str, float] = {}  # bot -> lease end, as the last beat wrote it
        self._active: set[str] = set()  # bots whose gain was announced and loss not yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None

    def holds(self, bot: str) -> bool:
        """Whether this replica runs ``bot``'s discovery now: its lease is held and not past its end."""
        until = self._held.get(bot)
        return until is not None and self.clock.now() < until

    def held(self) -> list[str]:
        """The bots this replica holds now, sorted."""
        return sorted(b for b in list(self._held) if self.holds(b))

    def set_bots(self, bots: Sequence[str], grace_s: Mapping[str, float] | None = None) -> None:
        """Serve ``bots`` from the next beat on (a reload); a bot dropped here is not held from now on."""
        with self._lock:
            self.bots = list(bots)
            self.grace_s = {**self.grace_s, **(grace_s or {})}
            self._held = {b: until for b, until in self._held.items() if b in self.bots}
            self._active &= set(self.bots)  # a dropped bot is no loss to announce: the daemon removed it

    def beat(self) -> None:
        """One heartbeat: write it, settle the leases, announce gains and losses (raises on a store failure)."""
        now = self.clock.now()
        if self._started_at is None:
            self._started_at = now
        got = self.store.fleet_beat(self.owner, list(self.bots), now=now, lease_s=self.bot_lease_s,
                                    started_at=self._started_at, target=self.target_of, grace_s=self.grace_s,
                                    first=not self._beaten)
        self._beaten = True
        if got.clash is not None:
            self._clashed(got.clash)
        if got.live != self.live:
            log.info("replyd.fleet.changed", replicas=len(got.live), live=got.live[:_SHOWN])
        self.live = got.live
        for dead, rows in got.dead.items():
            log.warning("replyd.fleet.replica_dead", replica=dead, rows_freed=rows)
        with self._lock:
            served = set(self.bots)  # a set: a list here made each beat quadratic in the bots
            self._held = {b: until for b, until in got.held.items() if b in served}  # none a reload dropped
        self._announce()

    def _clashed(self, other_started_at: float) -> None:
        """Another live process beats under this replica id. The one that started later steps aside."""
        newer = other_started_at < (self._started_at or 0.0)
        log.error("replyd.fleet.replica_id_in_use", replica=self.owner, other_started_at=other_started_at,
                  stepping_aside=newer)
        if newer and self.on_clash is not None:
            self.on_clash(f"replica_id {self.owner!r} is in use by another live process (started at "
                          f"{other_started_at:.0f}): give each replica its own id, or leave replica_id empty")

    def _announce(self) -> None:
        """Tell the daemon which bots it gained and lost since the last announcement (expired leases too)."""
        held = set(self.held())
        gained, lost = sorted(held - self._active), sorted(self._active - held)
        self._active = held
        if gained:
            log.info("replyd.fleet.gained", bots=len(gained), names=gained[:_SHOWN], held=len(held))
        if lost:
            log.info("replyd.fleet.lost", bots=len(lost), names=lost[:_SHOWN], held=len(held))
        for bot, hook in [*((b, self.on_loss) for b in lost), *((b, self.on_gain) for b in gained)]:
            if hook is None:
                continue
            try:
                hook(bot)
            except Exception as exc:  # one bot's stream must not stop the heartbeat
                log.error("replyd.fleet.hook_failed", bot=bot, error=f"{type(exc).__name__}: {exc}"[:300])

    def start(self) -> Fleet:
        """Beat once now (the bots this replica takes run at once), then every ``heartbeat_s`` on a thread."""
        try:
            self.beat()
        except Exception as exc:  # the thread tries again; until then this replica polls nothing
            log.error("replyd.fleet.beat_failed", error=str(exc)[:300])
        self._thread = threading.Thread(target=self._run, name="replyd-fleet", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.beat()
            except Exception as exc:  # leases run out on their own: holds() turns false at their end
                log.error("replyd.fleet.beat_failed", error=str(exc)[:300])
                self._announce()

    def stop(self, *, leave: bool = True) -> None:
        """Stop beating; with ``leave``, free this replica's bots now (a graceful stop), not at lease end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        with self._lock:
            self._held = {}
        if leave:
            try:
                self.store.fleet_leave(self.owner, now=self.clock.now())
                log.info("replyd.fleet.left", replica=self.owner)
            except Exception as exc:  # the others see the heartbeat lapse instead
                log.warning("replyd.fleet.leave_failed", error=str(exc)[:300])
