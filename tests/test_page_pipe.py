"""The daemon's pipeline on the group claim: a page of found parents (a poll's, a webhook delivery's,
re-find's) goes through the per-parent steps and is claimed in ONE durable transaction, then composed and sent one
by one. Replies and responder calls are counted on the platform side (``MemoryPlatform``), never from replyd's log;
claim transactions are counted in the database (SQLite's statement trace, PostgreSQL's transaction ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from replyd import store as st
from replyd.clock import FakeClock, SystemClock
from replyd.config import PollerConfig
from replyd.errors import ContentionError, StoreError
from replyd.guard import PAGE_MAX, Guard, Outcome, Status
from replyd.hooks import Hook, Receiver
from replyd.pipeline import Pipeline
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from replyd.transitions import planting
from tests import workers
from tests.test_store_contract import event_notes

SEND_TIMEOUT = 5.0
LISTING_DELAY = 1.0


def world(store: Store, clock: FakeClock, *, instance: str = "memory:test", policy: Policy | None = None,
          respond: Callable[[Parent], str | None] | None = None) -> dict:
    """A bot as the daemon builds it (guard, pipeline, pollers) on a memory platform, with a counting responder."""
    plat = MemoryPlatform(instance=instance, clock=clock, listing_delay_s=LISTING_DELAY)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=SEND_TIMEOUT, watch_interval_s=None)
    calls: list[str] = []

    def compose(parent: Parent) -> str | None:
        calls.append(parent.id)
        return respond(parent) if respond is not None else f"answer to {parent.id}"

    pipe = Pipeline(guard, compose, policy or Policy(), clock)
    pollers = Pollers(store, plat, pipe, PollerConfig(refind_lookback_s=3600), clock)
    return {"plat": plat, "guard": guard, "pipe": pipe, "pollers": pollers, "calls": calls}


@contextmanager
def claim_transactions(store: Store, store_url: str) -> Iterator[Callable[[], dict[str, int]]]:
    """Yield a reader: for each parent with a ``claimed`` event written meanwhile, the transaction that wrote it."""
    if not store.is_sqlite:
        with event_notes(store_url, "parent_id TEXT, kind TEXT, tx BIGINT",
                         "NEW.parent_id, NEW.kind, txid_current()") as notes:
            yield lambda: {pid: tx for pid, kind, tx in notes() if kind == "claimed"}
        return
    trace: list[tuple[int, str]] = []
    store.dispose()  # connections opened from here on are traced
    remove = store.on_connect(lambda dbc: dbc.set_trace_callback(lambda sql, c=id(dbc): trace.append((c, sql))))  # noqa: B008 - each connection's id, bound when it opens

    def read() -> dict[str, int]:
        tx: dict[int, int] = {}
        seen: dict[str, int] = {}
        for n, (conn, sql) in enumerate(trace):
            u = sql.strip()
            if u.upper().startswith("BEGIN"):
                tx[conn] = n
            elif u.upper().startswith("INSERT INTO EVENTS") and "'claimed'" in u:
                # One statement may hold a page's events, a (…, parent_id, kind, …) row each.
                for before in u.split("'claimed'")[:-1]:
                    seen[before.rstrip(", ").rsplit("'", 2)[-2]] = tx[conn]
        return seen

    try:
        yield read
    finally:
        remove()


def test_a_poll_page_of_new_parents_is_one_claim_transaction(store, store_url, clock):
    """A poll page of 6 new parents: every claim in ONE transaction, one responder call and one reply per parent
    on the platform, the cursor saved; the next poll finds nothing new."""
    w = world(store, clock)
    parents = [w["plat"].add_parent(f"n{i}") for i in range(6)]
    with claim_transactions(store, store_url) as claims:
        w["pollers"].inbox()
        txs = claims()
    assert sorted(txs) == sorted(p.id for p in parents)
    assert len(set(txs.values())) == 1, txs
    assert {p.id: w["plat"].reply_count(p.id) for p in parents} == {p.id: 1 for p in parents}
    assert sorted(w["calls"]) == sorted(p.id for p in parents)
    assert w["pollers"].outcomes == {"posted": 6}
    assert all(store.get(w["guard"].key(p.id)).state == st.CLOSED for p in parents)
    w["pollers"].inbox()
    assert w["plat"].send_calls == 6 and w["pollers"].outcomes == {"posted": 6}


def test_a_page_larger_than_a_claim_is_claimed_in_pages(store, store_url, clock):
    """Re-find's window of PAGE_MAX + 3 new parents: two claim transactions (PAGE_MAX, then 3), one reply each."""
    w = world(store, clock)
    parents = [w["plat"].add_parent(f"r{i}") for i in range(PAGE_MAX + 3)]
    with claim_transactions(store, store_url) as claims:
        w["pollers"].refind()
        txs = claims()
    assert sorted(txs) == sorted(p.id for p in parents)
    assert sorted(list(txs.values()).count(t) for t in set(txs.values())) == [3, PAGE_MAX]
    assert [w["plat"].reply_count(p.id) for p in parents] == [1] * len(parents)


def test_a_page_with_one_claimable_parent_takes_the_single_path(store, clock, monkeypatch):
    """A page whose only claimable parent is one (the others skipped or answered) posts it with Guard.post: no page
    claim; a page of two claims as a page."""
    w = world(store, clock)
    plat, guard = w["plat"], w["guard"]
    done = plat.add_parent("done")
    assert guard.post(done, "earlier").status is Status.POSTED
    pages: list[int] = []
    real = Guard.post_page
    monkeypatch.setattr(Guard, "post_page", lambda self, items, **kw: pages.append(len(items)) or real(self, items, **kw))
    outs = w["pipe"].offer_page([done, plat.add_parent("own", author_id=plat.sender_id), plat.add_parent("one")],
                                "inbox")
    assert [o.status for o in outs] == [Status.ALREADY_ANSWERED, Status.SKIPPED, Status.POSTED]
    assert pages == [] and plat.reply_count("one") == 1
    assert [o.status for o in w["pipe"].offer_page([plat.add_parent("a"), plat.add_parent("b")], "inbox")] == \
        [Status.POSTED, Status.POSTED]
    assert pages == [2]


def _mixed(w: dict, store: Store, clock: FakeClock) -> list[Parent]:
    """One page of every kind of parent, the same in each world: policy skips, answered, in flight, waiting rows,
    new ones, caps the page itself fills, a measured depth, a repeated parent, a declined answer."""
    plat, guard = w["plat"], w["guard"]
    now = clock.now()
    mk = plat.add_parent
    answered = mk("answered", author_id="capped")
    assert guard.post(answered, "an earlier answer").status is Status.POSTED
    assert guard.post(mk("capped-2", author_id="capped"), "another earlier answer").status is Status.POSTED
    with store.transaction() as tx:
        tx.insert_new(guard.key("inflight"), {"state": st.COMPOSING, "attempt": 1, "created_at": now,
                                              "updated_at": now, "lease_owner": "other", "lease_until": now + 60})
        tx.insert_new(guard.key("released"), {"state": st.RELEASED, "attempt": 1, "created_at": now,
                                              "updated_at": now})
        with planting():  # a row judged earlier: no event makes not_landed from no row
            tx.insert_new(guard.key("judged"), {"state": st.NOT_LANDED, "attempt": 1, "created_at": now,
                                                "updated_at": now})
    return [
        mk("new-1", author_id="ann"),
        mk("own", author_id=plat.sender_id),                       # policy: the bot's own post
        answered,                                                  # answered (its author is capped too)
        mk("inflight"),                                            # another replica composes it
        mk("new-2", author_id="ann"),
        mk("new-1", author_id="ann"),                              # the same parent again, in the same group
        mk("spam", text="buy spam now"),                           # policy: a denied keyword
        mk("released", author_id="rita"),                          # waits for a path: claimed in the page
        mk("cat-1", author_id="cat"),
        mk("cat-2", author_id="cat"),
        mk("cat-3", author_id="cat"),                              # cat's third: capped by its group's posts
        mk("ann-3", author_id="ann"),                              # ann's third: capped by the earlier posts
        mk("judged", author_id="jude"),                            # not landed: its second attempt
        mk("deep", author_id="dora", thread_depth=1, extra={"depth": 5}),  # the measured depth rules it out
        mk("declines", author_id="dee"),                           # the responder writes nothing
        mk("new-3", author_id="bob"),
    ]


def test_a_mixed_page_gives_the_outcomes_of_offering_one_by_one(store, clock):
    """A page of every kind of parent (skipped, answered, in flight, waiting, new, capped by the page's own posts,
    too deep, repeated, declined) gives, parent by parent, the outcomes, replies, responder calls and depth reads
    that offering each alone gives; the outcomes are the expected ones."""
    policy = Policy.build(deny_keywords=["spam"], max_per_author_per_hour=2, max_depth=2)
    respond = lambda p: None if p.id == "declines" else f"answer to {p.id}"  # noqa: E731
    page_w = world(store, clock, instance="memory:page", policy=policy, respond=respond)
    one_w = world(store, clock, instance="memory:one", policy=policy, respond=respond)
    page, alone = _mixed(page_w, store, clock), _mixed(one_w, store, clock)
    by_page = page_w["pipe"].offer_page(page, "inbox")
    one_by_one = [one_w["pipe"].offer(p, "inbox") for p in alone]

    def seen(outs: list[Outcome], w: dict) -> list[tuple]:
        return [(o.key.parent_id, o.status, o.state, o.attempt, o.detail, w["plat"].reply_count(o.key.parent_id))
                for o in outs]

    assert seen(by_page, page_w) == seen(one_by_one, one_w)
    assert sorted(page_w["calls"]) == sorted(one_w["calls"]) == ["cat-1", "cat-2", "declines", "judged", "new-1",
                                                                 "new-2", "new-3", "released"]
    assert page_w["plat"].depth_calls == one_w["plat"].depth_calls == 1
    assert [(o.status, o.detail if o.status is Status.SKIPPED else None) for o in by_page] == [
        (Status.POSTED, None), (Status.SKIPPED, "own_post"), (Status.ALREADY_ANSWERED, None),
        (Status.IN_FLIGHT, None), (Status.POSTED, None), (Status.ALREADY_ANSWERED, None),
        (Status.SKIPPED, "keyword_denied"), (Status.POSTED, None), (Status.POSTED, None), (Status.POSTED, None),
        (Status.SKIPPED, "author_cap"), (Status.SKIPPED, "author_cap"),
        (Status.POSTED, None), (Status.SKIPPED, "too_deep"), (Status.DECLINED, None), (Status.POSTED, None)]
    assert store.get(page_w["guard"].key("judged")).attempt == 2


def test_a_composed_page_takes_each_lease_before_its_compose(store, clock):
    """The page claim holds its composing rows for a short while (the sweep's delay); each row takes its whole
    compose lease right before its compose, so a slow responder keeps its parent as a claim of its own would."""
    w = world(store, clock)
    guard = w["guard"]
    leases: dict[str, tuple[float, float]] = {}

    def respond(p: Parent) -> str:
        row = store.get(guard.key(p.id))
        leases[p.id] = (row.lease_until, clock.now())
        clock.advance(guard.page_hold_s() + 1)  # slower than the page's hold: the lease taken before it holds
        return "slow answer"

    parents = [w["plat"].add_parent(f"s{i}") for i in range(3)]
    rows = guard.claim_page([(p, respond) for p in parents], path="inbox")
    assert {r.state for r in rows} == {st.COMPOSING}
    assert guard.page_hold_s() == SEND_TIMEOUT + LISTING_DELAY < guard.compose_lease_s
    assert all(r.lease_until - clock.now() == pytest.approx(guard.page_hold_s()) for r in rows)
    outs = [guard.post_claimed(p, respond, path="inbox", claimed=r) for p, r in zip(parents, rows, strict=True)]
    assert [o.status for o in outs] == [Status.POSTED] * 3
    assert all(until - at == pytest.approx(guard.compose_lease_s) for until, at in leases.values()), leases
    assert [w["plat"].reply_count(p.id) for p in parents] == [1, 1, 1]


def test_a_page_row_claimed_again_by_the_same_guard_is_composed_once(store, clock):
    """The page's hold on a composing row ran out and another path of the SAME guard (one owner) claimed it and
    is composing: when the page reaches that row it finds the lease not its own and calls no responder (each
    claim is its own lease holder; with the guard's owner as holder both composed, a second LLM call)."""
    w = world(store, clock)
    guard = w["guard"]
    calls: list[str] = []
    parents = [w["plat"].add_parent(f"r{i}") for i in range(2)]
    rows = guard.claim_page([(p, lambda q: "page answer") for p in parents], path="inbox")
    clock.advance(guard.page_hold_s() + 1)  # the page is slow to reach its rows: their hold has ended
    page_out: dict[str, Outcome] = {}

    def refind_answer(p: Parent) -> str:
        calls.append(f"refind {p.id}")
        # While this path composes under its own new lease, the page reaches the same row.
        page_out[p.id] = guard.post_claimed(p, lambda q: (calls.append(f"page {q.id}"), "page answer")[1],
                                            path="inbox", claimed=rows[1])
        return "refind answer"

    out = guard.post(parents[1], refind_answer, path="refind")
    assert calls == ["refind r1"], calls
    assert page_out["r1"].status is Status.IN_FLIGHT, page_out
    assert out.status is Status.POSTED and w["plat"].reply_count("r1") == 1
    assert [r["text"] for r in w["plat"].replies() if r["parent_id"] == "r1"] == ["refind answer"]


class FailingOpen:
    """The store, its next open commit raising ``exc`` once ``fail_next`` is set (a busy or a broken store)."""

    def __init__(self, inner: Store, exc: Exception) -> None:
        self._inner, self.exc = inner, exc
        self.fail_next = False

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name == "cas_event":
            def cas(*a, **kw):
                if self.fail_next and (kw.get("event") or {}).get("kind") == "opened":
                    self.fail_next = False
                    raise self.exc
                return attr(*a, **kw)
            return cas
        return attr


@pytest.mark.parametrize("exc", [ContentionError("store busy while opening"), StoreError("disk I/O error")])
def test_a_store_failure_mid_page_loses_nothing(store, clock, exc):
    """The open commit of the 2nd parent of a polled page fails: the 1st stays posted and counted; a busy store
    hands the rest back and the page goes on (as offering one by one does), a broken one ends the page (the
    poller logs it, the cursor stays); the next poll and re-find's re-offer answer every parent once."""
    w = world(store, clock)
    plat, guard = w["plat"], w["guard"]
    failing = FailingOpen(store, exc)
    guard.store = failing  # type: ignore[assignment]
    parents = [plat.add_parent(f"f{i}") for i in range(4)]
    real_compose = w["pipe"].compose

    def compose(p: Parent) -> str | None:
        failing.fail_next = p.id == "f1" and "f1" not in w["calls"]  # its first open only
        return real_compose(p)

    w["pipe"].compose = compose
    w["pollers"].inbox()
    busy = isinstance(exc, ContentionError)
    assert plat.reply_count("f0") == 1 and w["pollers"].outcomes["posted"] == (3 if busy else 1)
    assert [plat.reply_count(p.id) for p in parents[2:]] == ([1, 1] if busy else [0, 0])
    if not busy:  # the page ended: its unreached rows were handed back, not left held
        assert {store.get(guard.key(p)).state for p in ("f2", "f3")} == {st.RELEASED}
        assert store.get_cursor(plat.instance, plat.sender_id, "inbox") is None
    clock.advance(guard.compose_lease_s + 1)  # f1's own lease (it was being composed) ends
    w["pollers"].inbox()
    w["pollers"].reoffer()
    assert [plat.reply_count(p.id) for p in parents] == [1, 1, 1, 1]
    assert sorted(w["calls"]).count("f1") == 2 and len(w["calls"]) == 5  # f1 composed again: nothing had left


def test_a_webhook_delivery_is_offered_as_one_page(store, store_url, clock):
    """A delivery of 4 parents (kept as released rows before the ack) is claimed in ONE transaction by the
    bot's pipeline: one reply per parent, each outcome logged on its own."""
    w = world(store, clock)
    plat, guard = w["plat"], w["guard"]
    parents = [plat.add_parent(f"h{i}") for i in range(4)]
    hook = Hook("b", "github", "s", plat, w["pipe"].offer, instance=plat.instance, guard=guard,  # type: ignore[arg-type]
                offer_page=w["pipe"].offer_page)
    assert Receiver._keep(hook, parents, "d1")
    assert {store.get(guard.key(p.id)).state for p in parents} == {st.RELEASED}
    with claim_transactions(store, store_url) as claims:
        Receiver._offer(hook, parents, "d1")
        txs = claims()
    assert sorted(txs) == sorted(p.id for p in parents) and len(set(txs.values())) == 1, txs
    assert [plat.reply_count(p.id) for p in parents] == [1] * 4


@pytest.mark.slow
@pytest.mark.parametrize("where,kill_at", [("after_claim", 0), ("compose", 0), ("compose", 3), ("before_send", 0),
                                           ("before_send", 3), ("after_send", 0), ("after_send", 3),
                                           ("after_send", 5), ("before_close", 0), ("before_close", 5)])
def test_sigkill_at_every_point_of_a_pipeline_page(store_url, tmp_path, where, kill_at):
    """The daemon's poll page (6 new parents, a responder) SIGKILLed right after its page claim, while composing,
    before/after the k-th send or before the k-th close: after one sweep delay the restarted bot's own jobs (the
    sweep, the poll that reads the page again, re-find's re-offer) answer every parent the kill did not hold in
    its compose lease, and after that lease the last one; one reply per parent on the platform."""
    journal, n = str(tmp_path / "journal.jsonl"), 6
    workers.run_until_sigkilled(workers.crash_in_pipeline_page, store_url, journal, n, kill_at, where)

    clock = FakeClock(SystemClock().now())
    store = Store.open(store_url, clock=clock)
    plat = MemoryPlatform(journal=journal, clock=clock, listing_delay_s=LISTING_DELAY)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=SEND_TIMEOUT, watch_interval_s=None)
    pollers = Pollers(store, plat, Pipeline(g, lambda p: f"answer to {p.id}", Policy(), clock),
                      PollerConfig(refind_lookback_s=3600), clock)
    parents = [plat.add_parent(f"g{i}") for i in range(n)]
    sweeper = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock)
    held = {f"g{kill_at}"} if where == "compose" else set()  # composing at the kill: its own lease, as alone
    try:
        assert {store.get(g.key(p.id)).state for p in parents} <= {st.COMPOSING, st.OPEN, st.CLOSED}
        clock.advance(SEND_TIMEOUT + LISTING_DELAY + 1)  # one sweep delay: past every open row's deadline
        sweeper.run_once()
        pollers.inbox()  # the cursor was never saved: the page is read again
        pollers.reoffer()
        answered = {p.id: plat.reply_count(p.id) for p in parents}
        assert answered == {p.id: 0 if p.id in held else 1 for p in parents}, answered
        clock.advance(g.compose_lease_s)
        pollers.reoffer()
        assert {p.id: plat.reply_count(p.id) for p in parents} == {p.id: 1 for p in parents}
        assert {store.get(g.key(p.id)).state for p in parents} == {st.CLOSED}
    finally:
        store.dispose()
