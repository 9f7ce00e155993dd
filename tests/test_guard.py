"""Contract tests of the guard and the sweep, run on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import threading

import pytest

from replyd import store as st
from replyd.config import GuardConfig
from replyd.errors import StoreError
from replyd.guard import Guard, Status
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, LeaseKeeper, Sweeper
from tests.aio_harness import face  # noqa: F401  (the face fixture: every guard test on both faces)


@pytest.fixture
def plat(clock):
    """A scripted in-memory platform with a 5 s listing delay."""
    return MemoryPlatform(clock=clock, listing_delay_s=5.0)


@pytest.fixture
def guard(store, plat, clock, face):
    """The guard over the parametrised store, on each face (sync, and async behind the same API)."""
    g = face(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    yield g
    g.close()


@pytest.fixture
def sweeper(store, plat, clock):
    """A sweeper over the same bot."""
    return Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, retry_s=30.0)


def kinds(store: Store, guard: Guard, pid: str) -> list[str]:
    return [e.kind for e in store.history(guard.key(pid))]


def test_first_post_sends_and_closes_with_reply_id(guard, plat, store):
    """A new parent is sent once and its row closed with the reply id from the send."""
    out = guard.post(plat.add_parent("p1"), "hello")
    assert out.status is Status.POSTED and out.sent
    assert plat.reply_count("p1") == 1
    row = store.get(guard.key("p1"))
    assert row.state == st.CLOSED and row.reply_id == out.reply_id == plat.replies()[0]["reply_id"]
    assert kinds(store, guard, "p1") == ["claimed", "closed"]


def test_reworded_retry_hits_same_key(guard, plat):
    """A second post with other words reports already answered and sends nothing."""
    first = guard.post(plat.add_parent("p1"), "hello")
    again = guard.post(plat.parents["p1"], "a completely different wording")
    assert again.status is Status.ALREADY_ANSWERED and again.reply_id == first.reply_id
    assert plat.send_calls == 1 and plat.reply_count("p1") == 1


@pytest.mark.parametrize("a,b", [("abc", "ABC"), ("0123", "123"), ("at://did:plc:x/app.bsky.feed.post/3k", "at://did:plc:X/app.bsky.feed.post/3k")])
def test_parent_ids_are_opaque(guard, plat, a, b):
    """Ids that differ only in case or leading zeros are different keys."""
    assert guard.post(plat.add_parent(a), "x").status is Status.POSTED
    assert guard.post(plat.add_parent(b), "x").status is Status.POSTED
    assert plat.reply_count(a) == 1 and plat.reply_count(b) == 1


def test_provably_not_sent_releases_without_using_an_attempt(guard, plat, store):
    """A refused connect releases the row; the next post sends with attempt still 1."""
    plat.script = ["not_sent"]
    out = guard.post(plat.add_parent("p1"), "x")
    assert out.status is Status.NOT_SENT and store.get(guard.key("p1")).state == st.RELEASED
    out = guard.post(plat.parents["p1"], "x")
    assert out.status is Status.POSTED and out.attempt == 1
    assert plat.reply_count("p1") == 1


def test_rate_limited_backs_off_until_retry_after(guard, plat, clock):
    """A 429 releases with a not-before time; posts before it send nothing."""
    plat.script = ["rate_limited"]
    out = guard.post(plat.add_parent("p1"), "x")
    assert out.status is Status.NOT_SENT and out.retry_after_s == pytest.approx(30.0)
    assert guard.post(plat.parents["p1"], "x").status is Status.NOT_SENT
    assert plat.send_calls == 1
    clock.advance(31)
    assert guard.post(plat.parents["p1"], "x").status is Status.POSTED
    assert plat.reply_count("p1") == 1


def test_rejected_is_terminal(guard, plat):
    """A platform refusal is recorded and later posts send nothing."""
    plat.script = ["rejected"]
    assert guard.post(plat.add_parent("p1"), "x").status is Status.REJECTED
    assert guard.post(plat.parents["p1"], "x").status is Status.REJECTED
    assert plat.send_calls == 1 and plat.reply_count("p1") == 0


def test_lost_response_is_closed_by_the_sweep(guard, plat, sweeper, clock, store):
    """A reply that landed but whose response was lost is found by the sweep, not resent."""
    plat.script = ["lost"]
    assert guard.post(plat.add_parent("p1"), "x").status is Status.UNCERTAIN
    assert guard.post(plat.parents["p1"], "x").status is Status.IN_FLIGHT
    assert sweeper.run_once().leased == 0  # deadline not reached: no read-back yet
    clock.advance(16)
    r = sweeper.run_once()
    assert r.closed == 1 and r.not_landed == 0
    row = store.get(guard.key("p1"))
    assert row.state == st.CLOSED and row.reply_id == plat.replies()[0]["reply_id"]
    assert guard.post(plat.parents["p1"], "x").status is Status.ALREADY_ANSWERED
    assert plat.reply_count("p1") == 1


def test_a_pass_longer_than_its_lease_keeps_its_rows(guard, plat, store, clock):
    """A pass whose read-back outlives sweep.lease_s renews its leases: another sweeper leases nothing meanwhile,
    and the pass decides its row when the read-back returns (the lease stays short for a replica that dies)."""
    plat.script = ["lost"]
    assert guard.post(plat.add_parent("p1"), "x").status is Status.UNCERTAIN
    clock.advance(16)
    ticks = [0.0]
    # The test makes the renewals; the keeper's own thread may find one due too when it wakes (and, on a loaded
    # machine, write it a step late): a renewal never shortens a lease, so the two never undo each other.
    keeper = LeaseKeeper(monotonic=lambda: ticks[0])
    slow = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, owner="slow", lease_s=0.3, keeper=keeper)
    other = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, owner="other", lease_s=0.3)
    entered, go_on = threading.Event(), threading.Event()
    read_back = plat.read_back

    def held_read_back(*args, **kwargs):
        entered.set()
        assert go_on.wait(30)
        return read_back(*args, **kwargs)

    plat.read_back = held_read_back
    got: list = []
    t = threading.Thread(target=lambda: got.append(slow.run_once()))
    t.start()
    try:
        assert entered.wait(30)
        for _ in range(5):  # 1 s of the shared clock in steps shorter than the lease, each renewed
            before = keeper.renewed
            clock.advance(0.2)
            ticks[0] += 0.1  # a third of the lease: the renewal is due
            keeper.renew_due()
            assert keeper.renewed > before, "the running pass's lease was not renewed"
        plat.read_back = read_back  # the other sweeper's own read-back, if it leased anything, runs at once
        assert other.run_once().leased == 0
    finally:
        go_on.set()
        t.join(30)
    assert got and got[0].closed == 1
    assert store.get(guard.key("p1")).state == st.CLOSED and plat.reply_count("p1") == 1


def test_the_keepers_thread_renews_a_held_lease_on_its_own(store, clock):
    """With nobody calling it, the keeper's thread renews a hold once a third of its lease has passed (real time,
    a 30 ms lease): the row's lease moves on with the shared clock."""
    key = st.Key("memory:keeper", "bot", "p1")
    with store.transaction() as tx:
        assert tx.insert_new(key, {"state": st.OPEN, "attempt": 1, "created_at": 0.0, "updated_at": 0.0,
                                   "deadline_at": 1.0})
    now = clock.now()
    assert len(store.lease_due(key.platform, key.sender_id, now=now, limit=5, lease_s=0.03, owner="me")) == 1
    renewed = threading.Event()

    class Signalling:
        """The store, telling the test when a renewal committed."""

        def renew_leases(self, *args, **kwargs):
            held = store.renew_leases(*args, **kwargs)
            renewed.set()
            return held

    keeper = LeaseKeeper()
    clock.advance(0.01)  # inside the lease: a renewal moves its end from now + 0.03 to now + 0.04
    with keeper.holding(Signalling(), [key], owner="me", lease_s=0.03, clock=clock):
        assert renewed.wait(10)
    assert store.get(key).lease_until == pytest.approx(now + 0.04)


def test_a_slow_renewal_does_not_push_the_next_one_back(store, clock):
    """The next renewal is due a third of the lease after this one was found due, however long its store write
    took: a write that ends 0.09 s (of a 0.3 s lease) after it was due leaves the next due at 0.1 s + 0.1 s."""
    key = st.Key("memory:keeper", "bot", "p2")
    with store.transaction() as tx:
        assert tx.insert_new(key, {"state": st.OPEN, "attempt": 1, "created_at": 0.0, "updated_at": 0.0,
                                   "deadline_at": 1.0})
    assert len(store.lease_due(key.platform, key.sender_id, now=clock.now(), limit=5, lease_s=0.3, owner="me")) == 1
    ticks = [0.0]

    class Slow:
        """The store, its renewal write taking 0.09 s of the keeper's clock."""

        def renew_leases(self, *args, **kwargs):
            ticks[0] += 0.09
            return store.renew_leases(*args, **kwargs)

    keeper = LeaseKeeper(monotonic=lambda: ticks[0])
    with keeper.holding(Slow(), [key], owner="me", lease_s=0.3, clock=clock), keeper._cond:
        # Held: the keeper's own thread cannot look for due holds meanwhile, so only the test renews.
        ticks[0] = 0.1
        keeper.renew_due()  # due at 0.1, its write ends at 0.19
        ticks[0] = 0.2
        keeper.renew_due()  # due at 0.1 + 0.1, not 0.19 + 0.1
    assert keeper.renewed == 2


def test_not_landed_allows_exactly_one_retry_then_gives_up(guard, plat, store, clock):
    """An ambiguous failure that did not land gets one more attempt; a second miss gives up (proven retries not
    excused, max_proven_retries 0: max_attempts alone bounds them)."""
    sweeper = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, retry_s=30.0,
                      guard_config=GuardConfig(max_proven_retries=0))
    plat.script = ["error_before", "error_before"]
    guard.post(plat.add_parent("p1"), "x")
    clock.advance(16)
    assert sweeper.run_once().not_landed == 1
    out = guard.post(plat.parents["p1"], "x")
    assert out.status is Status.UNCERTAIN and out.attempt == 2
    clock.advance(16)
    assert sweeper.run_once().gave_up == 1
    assert guard.post(plat.parents["p1"], "x").status is Status.GAVE_UP
    assert plat.send_calls == 2 and store.get(guard.key("p1")).state == st.GAVE_UP


def test_retry_after_not_landed_posts_once(guard, plat, sweeper, clock):
    """After not_landed the one retry sends and closes: exactly one reply in total."""
    plat.script = ["error_before"]
    guard.post(plat.add_parent("p1"), "x")
    clock.advance(16)
    sweeper.run_once()
    out = guard.post(plat.parents["p1"], "reworded")
    assert out.status is Status.POSTED and out.attempt == 2
    assert plat.reply_count("p1") == 1
    clock.advance(6)  # the verifying read-back after the retry finds one reply: no duplicate
    r = sweeper.run_once()
    assert (r.verified, r.duplicates) == (1, 0)


def test_retry_after_not_landed_sends_the_answer_composed_before(guard, plat, sweeper, clock, store):
    """A composed answer is kept with its open commit: the retry after not_landed sends that same text, and the
    responder is not called again."""
    calls = []

    def responder(parent):
        calls.append(parent.id)
        return f"answer {len(calls)}"

    plat.script = ["error_before"]
    assert guard.post(plat.add_parent("p1"), responder).status is Status.UNCERTAIN
    assert store.answer(guard.key("p1")) == ["answer 1"]
    clock.advance(16)
    assert sweeper.run_once().not_landed == 1
    out = guard.post(plat.parents["p1"], responder)
    assert out.status is Status.POSTED and out.attempt == 2
    assert calls == ["p1"] and [r["text"] for r in plat.replies()] == ["answer 1"]


def test_failed_readback_leaves_row_open(guard, plat, sweeper, clock, store):
    """A read-back error is never 'not found': the row stays open and is swept again later."""
    plat.script = ["lost"]
    guard.post(plat.add_parent("p1"), "x")
    clock.advance(16)
    plat.readback_failures = 1
    r = sweeper.run_once()
    assert r.readback_errors == 1 and r.left_open == 1 and r.not_landed == 0
    assert store.get(guard.key("p1")).state == st.OPEN
    assert sweeper.run_once().leased == 0  # backed off
    clock.advance(31)
    assert sweeper.run_once().closed == 1


def test_listing_slower_than_configured_is_a_measured_limit(guard, plat, sweeper, clock, store):
    """If the real listing delay exceeds the configured one, the retry can duplicate and is reported."""
    plat.real_listing_delay_s = 100.0
    plat.script = ["lost"]
    guard.post(plat.add_parent("p1"), "x")
    clock.advance(16)
    assert sweeper.run_once().not_landed == 1  # looked too early
    assert guard.post(plat.parents["p1"], "x").status is Status.POSTED
    assert plat.reply_count("p1") == 2  # the documented limit
    # The retry's close keeps a deadline: one verifying read-back reports the late first reply.
    assert store.get(guard.key("p1")).deadline_at is not None
    clock.advance(101)
    r = sweeper.run_once()
    assert r.verified == 1 and r.duplicates == 1
    assert "duplicate_detected" in kinds(store, guard, "p1")
    assert store.get(guard.key("p1")).deadline_at is None
    assert sweeper.run_once().leased == 0  # verified once, never again
    plat.script = ["lost"]
    guard.post(plat.add_parent("p2"), "x")
    plat._replies.append({**plat.replies()[-1], "reply_id": "extra", "at": clock.now()})
    plat.real_listing_delay_s = None
    clock.advance(16)
    r = sweeper.run_once()
    assert r.duplicates == 1 and "duplicate_detected" in kinds(store, guard, "p2")


def test_delete_newer_duplicate(store, plat, clock, guard):
    """With on_duplicate=delete_newer the newer own reply is deleted and the oldest kept."""
    sw = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, on_duplicate="delete_newer")
    plat.script = ["lost"]
    guard.post(plat.add_parent("p1"), "x")
    clock.advance(1)
    plat._replies.append({**plat.replies()[0], "reply_id": "newer", "at": clock.now()})
    clock.advance(16)
    assert sw.run_once().duplicates == 1
    assert [r["reply_id"] for r in plat.replies()] != [] and "newer" not in [r["reply_id"] for r in plat.replies()]
    assert store.get(guard.key("p1")).reply_id != "newer"


def test_already_landed_closes_with_existing_reply(guard, plat, store):
    """A platform saying 'already a value at key' closes the row with that reply, no failure."""
    plat.script = ["lost"]
    guard.post(plat.add_parent("p1"), "x")
    existing = plat.replies()[0]["reply_id"]
    # Simulate a second process retrying a released row at the same provider key.
    with store.transaction() as tx:
        tx.cas_event(guard.key("p1"), states=[st.OPEN], attempt=1, values={"state": st.RELEASED})
    plat.script = ["already_landed"]
    out = guard.post(plat.parents["p1"], "x")
    assert out.status is Status.ALREADY_ANSWERED and out.reply_id == existing and not out.sent
    assert plat.reply_count("p1") == 1


def test_responder_called_once_and_not_for_answered(guard, plat):
    """The responder runs once per parent; an answered parent costs no responder call."""
    calls = []

    def responder(parent):
        calls.append(parent.id)
        return f"hi {parent.id}"

    assert guard.post(plat.add_parent("p1"), responder).status is Status.POSTED
    assert guard.post(plat.parents["p1"], responder).status is Status.ALREADY_ANSWERED
    assert calls == ["p1"]


def test_responder_failure_consumes_no_attempt(guard, plat, store, clock):
    """A responder exception releases the composing row with attempt unchanged and a doubling backoff; nothing is sent."""
    calls = []

    def boom(parent):
        calls.append(parent.id)
        raise RuntimeError("model timeout")

    out = guard.post(plat.add_parent("p1"), boom)
    assert out.status is Status.NOT_SENT and plat.send_calls == 0 and out.retry_after_s == 30.0
    row = store.get(guard.key("p1"))
    assert row.state == st.RELEASED and row.attempt == 1 and row.not_before == clock.now() + 30.0
    # Backing off: a re-discovery inside the window costs no responder call.
    assert guard.post(plat.parents["p1"], boom).status is Status.NOT_SENT and calls == ["p1"]
    clock.advance(31)
    assert guard.post(plat.parents["p1"], boom).retry_after_s == 60.0  # second failure in a row: doubled
    clock.advance(61)
    assert guard.post(plat.parents["p1"], lambda p: "ok").status is Status.POSTED
    assert store.get(guard.key("p1")).attempt == 1 and plat.send_calls == 1 and len(calls) == 2


def test_decline_is_recorded(guard, plat, store):
    """An empty responder answer declines: nothing sent, state declined."""
    assert guard.post(plat.add_parent("p1"), lambda p: "").status is Status.DECLINED
    assert store.get(guard.key("p1")).state == st.DECLINED and plat.send_calls == 0


def test_expired_composing_lease_is_claimable(guard, plat, store, clock):
    """A composing row whose lease expired (its process died) is claimable, same attempt."""
    with store.transaction() as tx:
        tx.insert_new(guard.key("p1"), {"state": st.COMPOSING, "attempt": 1, "created_at": clock.now(),
                                                  "updated_at": clock.now(), "lease_owner": "dead", "lease_until": clock.now() + 60})
    plat.add_parent("p1")
    assert guard.post(plat.parents["p1"], "x").status is Status.IN_FLIGHT
    clock.advance(61)
    out = guard.post(plat.parents["p1"], "x")
    assert out.status is Status.POSTED and out.attempt == 1


def test_check_is_read_only(guard, plat):
    """check() reports the state and never sends."""
    assert guard.check("p1") is None
    guard.post(plat.add_parent("p1"), "x")
    out = guard.check("p1")
    assert out.status is Status.ALREADY_ANSWERED and plat.send_calls == 1


def test_failing_database_sends_nothing(tmp_path, clock):
    """A store that cannot be written raises StoreError naming storage, and nothing is sent."""
    path = tmp_path / "ro.sqlite3"
    Store.open(f"sqlite:///{path}").dispose()
    ro = Store.open(f"sqlite:///file:{path}?mode=ro&uri=true", clock=clock, migrate=False)
    plat = MemoryPlatform(clock=clock)
    g = Guard(ro, plat, plat.whoami(), clock=clock)
    with pytest.raises(StoreError, match="store unavailable while claiming"):
        g.post(plat.add_parent("p1"), "x")
    assert plat.send_calls == 0 and plat.replies() == []


def test_unreachable_postgres_sends_nothing(clock):
    """A PostgreSQL store that is down raises StoreError at open; the guard never reaches send."""
    with pytest.raises(StoreError, match="store unavailable"):
        Store.open("postgresql+psycopg://root@127.0.0.1:1/none", clock=clock)


def test_ambiguous_send_pushes_deadline_past_its_return(store, plat, clock):
    """A send that returns late and ambiguous is swept one listing delay after it returned, not before."""
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=1.0)
    orig = plat.send

    def slow_lost(parent, text, *, provider_key):
        clock.advance(50)  # the send outlives send_timeout_s
        return orig(parent, text, provider_key=provider_key)

    plat.send = slow_lost
    plat.script = ["lost"]
    g.post(plat.add_parent("p1"), "x")
    row = store.get(g.key("p1"))
    assert row.deadline_at == pytest.approx(clock.now() + plat.listing_delay_s)


class _KeyedPlatform(MemoryPlatform):
    """A memory platform that names its own idempotency keys (as Bluesky does with its rkeys)."""

    def provider_key(self, sender_id: str, parent_id: str) -> str:
        """The platform's own key for this parent."""
        return f"own-{sender_id}-{parent_id}"


def test_provider_key_is_the_adapters_own_when_it_offers_one(store, clock):
    """An adapter offering ProviderKeys names the key the guard stores and sends; another gets replyd's default."""
    kp, pp = _KeyedPlatform(clock=clock), MemoryPlatform(instance="memory:plain", clock=clock)
    keyed = Guard(store, kp, kp.whoami(), clock=clock, send_timeout_s=10.0)
    plain = Guard(store, pp, pp.whoami(), clock=clock, send_timeout_s=10.0)
    assert keyed.provider_key("p1") == f"own-{keyed.identity.sender_id}-p1"
    assert plain.provider_key("p1") != f"own-{plain.identity.sender_id}-p1" and len(plain.provider_key("p1")) > 0
    assert keyed.post(keyed.platform.add_parent("p2"), "x").status is Status.POSTED
    assert store.get(keyed.key("p2")).provider_key == f"own-{keyed.identity.sender_id}-p2"



def test_every_attempt_sends_the_rows_provider_key(store, clock):
    """A parent retried after a send proven not landed sends the row's provider key again (a nonce, a Message-ID
    that dedupes on the platform): the same key on every attempt, never one per attempt."""
    kp = _KeyedPlatform(clock=clock)
    keys: list[str] = []
    orig = kp.send

    def recording(parent, text, *, provider_key):
        keys.append(provider_key)
        return orig(parent, text, provider_key=provider_key)

    kp.send = recording
    g = Guard(store, kp, kp.whoami(), clock=clock, send_timeout_s=10.0)
    sweeper = Sweeper(store, [Bot(kp, kp.whoami())], clock=clock)
    kp.script = ["error_before"]  # a 502: nothing created, nothing proves it; the sweep judges it not landed
    parent = kp.add_parent("p1")
    assert g.post(parent, "x").status is Status.UNCERTAIN
    clock.advance(kp.listing_delay_s + 60.0)
    sweeper.run_once()
    assert g.post(parent, "x").status is Status.POSTED
    row = store.get(g.key("p1"))
    assert row.attempt == 2 and keys == [row.provider_key, row.provider_key], (row.attempt, keys)
