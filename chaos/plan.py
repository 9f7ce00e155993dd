"""What one chaos run does: topology, timings and the faults, all drawn from a seeded RNG.

Every run is "configured correctly" by construction: the listing delay replyd
is told is at least the platform's real one, and the faults that move time
(latency spikes, a replica's clock stepping forward) stay inside the margin
the configuration leaves, unless the platform honours ``Idempotency-Key`` in
that run, in which case they may be as large as they like. Anything beyond
that is a *limit*, measured separately by ``chaos.limits``.

The margin: a row claimed at ``t0`` is swept no earlier than
``t0 + send_timeout + listing_delay`` on the sweeping replica's clock. The
reply the send created is listed at ``t0 + ε + latency + real_delay``. So a
sweep can only miss a landed reply when ``latency + real_delay + ε + (how far
the sweeper's clock moved ahead since the claim)`` exceeds
``send_timeout + listing_delay``. ``slack`` below is that budget minus a
generous ε for a loaded two-CPU machine.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

# Fault families a run may draw; every run draws at least three.
FAMILIES = (
    "lost_drop",  # the post lands, the connection is cut mid-response
    "lost_504",  # the post lands, the proxy answers 504 (5xx after create)
    "error_before",  # 500 / 503 before anything is created (5xx before create)
    "storm_429",  # windows where most creates are refused with 429 + Retry-After
    "readback_errors",  # the read-back listings answer 502
    "latency",  # latency spikes on every request
    "kill",  # SIGKILL a replica at a random moment, restart it
    "kill_on_create",  # SIGKILL the sender after the platform created its post, before the answer
    "clock",  # a replica's wall clock steps forward or back (moves nothing on PostgreSQL with store.db_clock)
    "db_outage",  # PostgreSQL: cut and refuse connections (proxy); SQLite: files made immutable
    "platform_clock",  # the platform's clock steps forward
    "stall_open",  # one replica's open commit answers past send timeout + listing delay (proxy hold / a pause)
    "platform_clock_offset",  # the platform's clock runs 70-300 s ahead of or behind replyd's, the whole run
)
EPSILON_S = 0.5


@dataclass
class Event:
    """One scheduled fault: at ``at`` seconds into the run."""

    at: float
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """Everything one run needs, reproducible from (seed, index)."""

    index: int
    seed: int
    db: str
    replicas: int
    parents: int
    traffic_s: float
    idempotency: bool
    ld_real: float
    ld_conf: float
    send_timeout: float
    max_attempts: int
    families: list[str]
    rates: dict[str, float]
    events: list[Event]
    chaos_s: float
    db_clock: bool = True  # PostgreSQL: replicas take their time from the database (store.db_clock); off = wall clocks
    sweep: dict[str, Any] = field(default_factory=dict)  # further [sweep] settings (chaos.limits' learned delay)
    platform_offset_s: float = 0.0  # the platform's clock minus replyd's, constant for the run (platform_clock_offset)

    @property
    def slack(self) -> float:
        """Seconds of latency plus forward clock movement a sweep tolerates (see module doc)."""
        return self.send_timeout + self.ld_conf - self.ld_real - EPSILON_S

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        d = asdict(self)
        d["slack"] = round(self.slack, 3)
        return d


def draw(seed: int, index: int, *, short: bool, postgres: bool) -> Plan:
    """Draw run ``index`` of the sequence seeded by ``seed``."""
    rng = random.Random(f"replyd-chaos:{seed}:{index}")
    # Families forced by rotation so that even a few runs cover all of them (the short set's four runs too).
    k = -(-len(FAMILIES) // 4) if short else 2
    forced = {FAMILIES[(k * index + j) % len(FAMILIES)] for j in range(k)}
    if short and index == 0:
        forced.add("db_outage")  # the SQLite run of the short set makes its database unwritable
    families = sorted(f for f in FAMILIES if f in forced or rng.random() < 0.45)
    while len(families) < 3:
        f = rng.choice(FAMILIES)
        if f not in families:
            families.append(f)
    families.sort()
    if short:  # alternate, so that a few runs cover both stores and several replicas
        db = "postgres" if postgres and index % 2 == 1 else "sqlite"
        replicas = rng.choice((2, 3)) if db == "postgres" else rng.choice((1, 2))
    else:
        db = "postgres" if postgres and rng.random() < 0.6 else "sqlite"
        replicas = rng.choice((1, 2, 3, 3)) if db == "postgres" else rng.choice((1, 1, 2))
    idempotency = rng.random() < 0.5
    send_timeout = round(rng.uniform(1.5, 3.0), 2)
    ld_real = round(rng.uniform(0.1, 1.0), 2)
    ld_conf = round(ld_real + rng.uniform(0.2, 1.0), 2)
    parents = rng.randint(12, 20) if short else rng.randint(20, 45)
    traffic_s = round(rng.uniform(4.0, 6.0) if short else rng.uniform(6.0, 12.0), 1)
    chaos_s = traffic_s + 2.0
    max_attempts = rng.choice((3, 3, 4, 5))
    plan = Plan(index, seed, db, replicas, parents, traffic_s, idempotency, ld_real, ld_conf, send_timeout,
                max_attempts, families, {}, [], chaos_s)
    slack = plan.slack
    rates = plan.rates
    ev = plan.events

    def at() -> float:
        return round(rng.uniform(0.5, chaos_s), 2)

    if "lost_drop" in families:
        rates["lost_drop_rate"] = round(rng.uniform(0.05, 0.3), 3)
    if "lost_504" in families:
        rates["lost_504_rate"] = round(rng.uniform(0.05, 0.3), 3)
    if "error_before" in families:
        rates["error_500_before_rate"] = round(rng.uniform(0.05, 0.2), 3)
        for _ in range(rng.randint(1, 2)):
            ev.append(Event(at(), "queue_503", {"n": rng.randint(1, 3)}))
    if "readback_errors" in families:
        rates["readback_error_rate"] = round(rng.uniform(0.1, 0.5), 3)
    if "storm_429" in families:
        for _ in range(rng.randint(1, 2)):
            ev.append(Event(at(), "storm_429", {"duration": round(rng.uniform(0.8, 2.5), 2),
                                                "rate": round(rng.uniform(0.6, 1.0), 2)}))
    if "latency" in families:
        # Beyond the margin only where the platform dedupes by Idempotency-Key.
        top = max(send_timeout * 1.5, 3.0) if idempotency else max(0.2, slack / 2)
        for _ in range(rng.randint(1, 3)):
            ev.append(Event(at(), "latency", {"duration": round(rng.uniform(0.5, 2.0), 2),
                                              "latency": round(rng.uniform(min(0.2, top), top), 2),
                                              "scope": rng.choice(("all", "create"))}))
    if "kill" in families:
        for _ in range(rng.randint(1, 3)):
            ev.append(Event(at(), "kill", {"replica": rng.randrange(replicas),
                                           "restart_after": round(rng.uniform(0.1, 1.5), 2)}))
    if "kill_on_create" in families:
        for _ in range(rng.randint(1, 2)):
            # In the first half of the faults: creates must still come after it, even on a loaded machine
            # where a storm or a paused breaker holds them (the short chaos test requires the kill met).
            ev.append(Event(round(rng.uniform(0.5, max(0.5, chaos_s / 2)), 2), "kill_on_create",
                            {"restart_after": round(rng.uniform(0.1, 1.0), 2)}))
    if "db_outage" in families:
        for _ in range(rng.randint(1, 2)):
            scope = "all" if replicas == 1 or rng.random() < 0.6 else rng.randrange(replicas)
            ev.append(Event(at(), "db_outage", {"duration": round(rng.uniform(0.8, 3.0), 2), "scope": scope}))
    if "platform_clock" in families:
        # Forward only: listings show posts sooner. (Backward = a longer real listing delay: a limit.)
        ev.append(Event(at(), "platform_clock", {"jump": round(rng.uniform(1.0, 120.0), 1)}))
    if "stall_open" in families:
        # Past the row's deadline: the sweep can judge it and re-find answer before the held thread goes on.
        for _ in range(rng.randint(1, 3)):
            ev.append(Event(at(), "stall_open", {"replica": rng.randrange(replicas),
                                                 "hold": round(send_timeout + ld_conf + rng.uniform(0.5, 2.0), 2)}))
    if "platform_clock_offset" in families:
        # Not a listing delay: the platform lists on its own clock; only the times it serves are off.
        plan.platform_offset_s = round(rng.choice((-1, 1)) * rng.uniform(70.0, 300.0), 1)
    if "clock" in families:
        _clock_steps(plan, rng)
    ev.sort(key=lambda e: e.at)
    plan.chaos_s = max([chaos_s] + [e.at for e in ev])
    return plan


def _clock_steps(plan: Plan, rng: random.Random) -> None:
    """Replica clock steps. Without provider idempotency every step (and the restore) moves a clock by at
    most ``slack / 2`` and steps are ``send_timeout + listing_delay + 1`` seconds apart, so no row sees its
    sweeper's clock move ahead by more than the margin; with it, steps of 5-30 s in either direction."""
    gap = plan.send_timeout + plan.ld_conf + 1.0
    offsets = [0.0] * plan.replicas
    t = rng.uniform(0.5, 2.0)
    for _ in range(rng.randint(1, 3)):
        r = rng.randrange(plan.replicas)
        if plan.idempotency:
            # Minutes would do as well for safety; a step back only delays sweeps by its size, and a run has
            # to settle in reasonable time after the final restore.
            new = round(rng.choice((-1, 1)) * rng.uniform(5.0, 30.0), 1)
        else:
            bound = max(0.05, plan.slack / 4)
            new = round(rng.uniform(-bound, bound), 2)  # any step between two such values is <= slack / 2
        plan.events.append(Event(round(t, 2), "clock", {"replica": r, "offset": new}))
        offsets[r] = new
        t += gap if not plan.idempotency else rng.uniform(0.5, 3.0)
    t = max(t, plan.chaos_s)
    for r, o in enumerate(offsets):
        if o:
            plan.events.append(Event(round(t, 2), "clock", {"replica": r, "offset": 0.0, "restore": True}))
