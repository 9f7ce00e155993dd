"""The fleet's leases on a store, with a clock the test moves: contenders, expiry, handover, a dead replica.

Every case runs on SQLite and on PostgreSQL (the daemon uses the fleet on PostgreSQL only; the SQL is one).
"""

from __future__ import annotations

from collections import Counter

import pytest
import sqlalchemy as sa

from replyd.clock import FakeClock
from replyd.fleet import Fleet, target
from replyd.store import Store
from tests.test_replicas import fresh_pg  # noqa: F401  (the fixture)

BOTS = [f"bot{i:03d}" for i in range(60)]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A database of this test's own: a replica another test left beating (named "a" or "b" too, on the real
    clock) must not join these fleets, which run on a fake clock."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'replyd.sqlite3'}"
    return request.getfixturevalue("fresh_pg")
BEAT_S, LEASE_S = 1.0, 4.0


def fleet(store: Store, owner: str, clock: FakeClock, **kw) -> Fleet:
    return Fleet(store, owner, BOTS, clock, heartbeat_s=BEAT_S, bot_lease_s=LEASE_S, **kw)


def beat_all(*fleets: Fleet, rounds: int, clock: FakeClock) -> None:
    for _ in range(rounds):
        for f in fleets:
            f.beat()
        clock.advance(BEAT_S)


def holders(*fleets: Fleet) -> Counter[str]:
    """How many replicas hold each bot now (never more than one)."""
    return Counter(b for f in fleets for b in f.held())


def test_rendezvous_share_is_even_and_stable() -> None:
    live = ["r1", "r2", "r3"]
    share = Counter(target(f"bot{i}", live) for i in range(1000))
    assert all(280 <= n <= 390 for n in share.values()), share
    moved = sum(target(f"bot{i}", live) != target(f"bot{i}", [*live, "r4"]) for i in range(1000))
    assert 180 <= moved <= 320  # a join moves about a quarter: only the bots the new replica targets


def test_two_contenders_one_holder_each_bot_even_share(store: Store, clock: FakeClock) -> None:
    a, b = fleet(store, "a", clock), fleet(store, "b", clock)
    a.beat()
    assert a.held() == BOTS  # alone: it takes everything
    beat_all(b, a, b, rounds=1, clock=clock)  # a releases b's targets; b takes them once free
    beat_all(a, b, rounds=2, clock=clock)
    h = holders(a, b)
    assert set(h) == set(BOTS) and set(h.values()) == {1}
    assert sorted(b.held()) == sorted(x for x in BOTS if target(x, ["a", "b"]) == "b")
    assert 20 <= len(b.held()) <= 40


def test_never_two_holders_during_handover(store: Store, clock: FakeClock) -> None:
    fleets = [fleet(store, "a", clock)]
    for name in ["b", "c", "d"]:
        fleets.append(fleet(store, name, clock))
        for _ in range(4):
            for f in fleets:
                f.beat()
                assert max(holders(*fleets).values(), default=1) == 1
            clock.advance(BEAT_S / 2)
    assert set(holders(*fleets)) == set(BOTS)


def test_expiry_a_silent_holder_loses_its_bots_and_its_row_leases(store: Store, clock: FakeClock) -> None:
    a, b = fleet(store, "a", clock), fleet(store, "b", clock)
    beat_all(a, b, rounds=3, clock=clock)
    mine = set(a.held())
    assert mine and set(b.held()) == set(BOTS) - mine
    now = clock.now()
    # A composing row (a daemon's claim holds "<owner>/<n>") and a swept row leased by "a", both still live;
    # and a row of replica "a_x" (a name "a" begins), which must keep its lease.
    with store.engine.begin() as c:
        for parent, state, holder in (("p1", "composing", "a/7"), ("p2", "open", "a"), ("p3", "composing", "a_x/1")):
            c.execute(sa.text(
                "INSERT INTO replies (platform, sender_id, parent_id, state, attempt, created_at, updated_at, path,"
                " snapshot, lease_owner, lease_until, excused) VALUES ('sim', 's', :p, :st, 1, :now, :now, 'inbox',"
                " '{}', :holder, :until, 0)"), {"p": parent, "st": state, "now": now, "until": now + 120,
                                               "holder": holder})
    # "a" stops beating: its leases hold for LEASE_S, then "b" sees it dead, takes its bots and frees its rows.
    for _ in range(int(LEASE_S / BEAT_S) + 2):
        clock.advance(BEAT_S)
        b.beat()
        assert not mine & set(b.held()) or clock.now() >= now + LEASE_S
    assert set(b.held()) == set(BOTS)
    assert not a.holds(next(iter(mine)))  # its own flag ran out with its lease
    with store.engine.begin() as c:
        untils = dict(c.execute(sa.text("SELECT parent_id, lease_until FROM replies")).all())
    assert untils["p1"] <= clock.now() and untils["p2"] <= clock.now() and untils["p3"] == now + 120
    assert "a" not in store.fleet_view()["replicas"]


def test_release_waits_out_the_last_poll(store: Store, clock: FakeClock) -> None:
    grace = {bot: 3.0 for bot in BOTS}
    a, b = fleet(store, "a", clock, grace_s=grace), fleet(store, "b", clock, grace_s=grace)
    a.beat()
    b.beat()  # registers; its targets are held by "a"
    a.beat()  # "a" releases them, free only in 3 s
    b.beat()
    assert b.held() == []
    clock.advance(3.5)
    b.beat()
    assert b.held() and not set(b.held()) & set(a.held())


def test_graceful_leave_frees_bots_at_once(store: Store, clock: FakeClock) -> None:
    a, b = fleet(store, "a", clock), fleet(store, "b", clock)
    beat_all(a, b, rounds=3, clock=clock)
    a.stop()
    b.beat()
    assert set(b.held()) == set(BOTS)


def test_a_bot_its_target_does_not_serve_is_taken_after_a_lease(store: Store, clock: FakeClock) -> None:
    """Configs that differ: the target never beats for that bot, so another takes it once free a whole lease."""
    a = Fleet(store, "a", BOTS, clock, heartbeat_s=BEAT_S, bot_lease_s=LEASE_S, target_of=lambda bot, live: "zz")
    zz = Fleet(store, "zz", [], clock, heartbeat_s=BEAT_S, bot_lease_s=LEASE_S)
    zz.beat()
    a.beat()
    assert a.held() == []
    for _ in range(int(LEASE_S / BEAT_S) + 2):
        clock.advance(BEAT_S)
        zz.beat()
        a.beat()
    assert a.held() == BOTS


@pytest.fixture
def gains(store: Store, clock: FakeClock) -> list[tuple[str, str]]:
    return []


def test_hooks_announce_gains_and_losses(store: Store, clock: FakeClock, gains) -> None:
    a = fleet(store, "a", clock, on_gain=lambda x: gains.append(("gain", x)), on_loss=lambda x: gains.append(("loss", x)))
    b = fleet(store, "b", clock)
    a.beat()
    assert sorted(x for k, x in gains if k == "gain") == BOTS
    b.beat()
    a.beat()
    lost = {x for k, x in gains if k == "loss"}
    assert lost == {x for x in BOTS if target(x, ["a", "b"]) == "b"}


def test_set_bots_drops_a_removed_bot_and_takes_an_added_one(store: Store, clock: FakeClock) -> None:
    """A reload's new bot list: the dropped bot is not held from now on, the added one at the next beat."""
    f = fleet(store, "a", clock)
    f.beat()
    assert "bot000" in f.held()
    f.set_bots([*BOTS[1:], "new"])
    assert "bot000" not in f.held()
    f.beat()
    held = f.held()
    assert "new" in held and "bot000" not in held and len(held) == len(BOTS)


def test_two_live_processes_with_one_replica_id_the_later_steps_aside(store: Store, clock: FakeClock) -> None:
    """A second live process under one replica id is seen at its next beat; only the later one is told to stop.
    A restart under the same id (the old process dead) is no clash."""
    bots = [f"b{i}" for i in range(6)]
    told: dict[str, list[str]] = {"old": [], "new": [], "restart": []}
    old = Fleet(store, "same", bots, clock, heartbeat_s=1, bot_lease_s=4, on_clash=told["old"].append)
    old.beat()
    clock.advance(0.5)
    new = Fleet(store, "same", bots, clock, heartbeat_s=1, bot_lease_s=4, on_clash=told["new"].append)
    new.beat()  # its first beat: the row may be a dead predecessor's, so no clash yet
    assert told == {"old": [], "new": [], "restart": []}
    clock.advance(0.5)
    old.beat()  # the row's start time is the newcomer's: a clash, but the old one started first
    clock.advance(0.5)
    new.beat()  # the row's start time is the old one's: the newcomer steps aside
    assert told["old"] == [] and len(told["new"]) == 1 and "'same' is in use" in told["new"][0], told
    clock.advance(10)  # both gone; a restart under the same id beats twice
    restart = Fleet(store, "same", bots, clock, heartbeat_s=1, bot_lease_s=4, on_clash=told["restart"].append)
    restart.beat()
    clock.advance(1)
    restart.beat()
    assert told["restart"] == [] and restart.held() == bots
