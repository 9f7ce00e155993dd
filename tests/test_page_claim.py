"""The group claim: the new keys of one page claimed in one transaction, then each parent posted as alone.

Replies are counted on the platform (``MemoryPlatform``'s journal), never from the answered-log.
"""

from __future__ import annotations


import pytest

from replyd import store as st
from replyd.breaker import Breaker
from replyd.config import BreakerConfig
from replyd.clock import FakeClock, SystemClock
from replyd.guard import PAGE_MAX, Guard, Status
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests import workers
from tests.aio_harness import FACES



@pytest.fixture(params=sorted(FACES))
def face(request: pytest.FixtureRequest) -> str:
    """Each test on the sync face and on the async one."""
    return request.param


def claims(store: Store, guard: Guard, pid: str) -> int:
    """How many ``claimed`` events the parent's key has."""
    return sum(1 for e in store.history(guard.key(pid)) if e.kind == "claimed")


def test_a_page_posts_each_parent_once_in_order(store, clock, face):
    """A page of 20 (two claims: 16 + 4): one reply per parent on the platform, outcomes in the page's order; the
    same page again sends nothing."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = FACES[face](store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    try:
        parents = [plat.add_parent(f"p{i}") for i in range(PAGE_MAX + 4)]
        outs = g.post_page([(p, f"re {p.id}") for p in parents], path="inbox")
        assert [o.key.parent_id for o in outs] == [p.id for p in parents]
        assert all(o.status is Status.POSTED for o in outs), outs
        assert {p.id: plat.reply_count(p.id) for p in parents} == {p.id: 1 for p in parents}
        assert all(claims(store, g, p.id) == 1 for p in parents)
        again = g.post_page([(p, "again") for p in parents], path="refind")
        assert {o.status for o in again} == {Status.ALREADY_ANSWERED} and plat.send_calls == len(parents)
    finally:
        g.close()


def test_keys_with_a_row_are_claimed_alone_as_before(store, clock, face):
    """In a page, an answered key is reported, a released one is reclaimed (its own claim), a new one joins the
    page claim; one reply each."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = FACES[face](store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    try:
        done, freed, new = (plat.add_parent(pid) for pid in ("done", "freed", "new"))
        assert g.post(done, "first").status is Status.POSTED
        store.insert_absent([(g.key("freed"), {"state": st.RELEASED, "attempt": 1, "created_at": clock.now(),
                                               "updated_at": clock.now(), "snapshot": "{}"})],
                            {"kind": "received", "owner": "hook"})
        outs = g.post_page([(done, "x"), (freed, "x"), (new, "x")], path="inbox")
        assert [o.status for o in outs] == [Status.ALREADY_ANSWERED, Status.POSTED, Status.POSTED]
        assert [plat.reply_count(p) for p in ("done", "freed", "new")] == [1, 1, 1]
    finally:
        g.close()


def test_composed_page_claims_once_and_calls_each_responder_once(store, clock, face):
    """A page with a responder: its keys claimed ``composing`` in one page claim (a released row among them
    reclaimed), each row composed once under its own lease, opened and sent; one reply each."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = FACES[face](store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    calls: list[str] = []
    pages: list[int] = []

    def compose(parent: Parent) -> str:
        calls.append(parent.id)
        return f"composed for {parent.id}"

    try:
        parents = [plat.add_parent(f"c{i}") for i in range(6)]
        store.insert_absent([(g.key("c2"), {"state": st.RELEASED, "attempt": 1, "created_at": clock.now(),
                                            "updated_at": clock.now(), "snapshot": "{}"})],
                            {"kind": "received", "owner": "hook"})
        claim_page = store.claim_page
        store.claim_page = lambda rows, **kw: pages.append(len(rows)) or claim_page(rows, **kw)  # type: ignore[method-assign]
        outs = g.post_page([(p, compose) for p in parents], path="inbox")
        assert all(o.status is Status.POSTED for o in outs), outs
        assert pages == [6] and all(claims(store, g, p.id) == 1 for p in parents)
        assert sorted(calls) == sorted(p.id for p in parents)
        assert [r["text"] for r in plat.replies() if r["parent_id"] == "c3"] == ["composed for c3"]
    finally:
        g.close()


def test_a_page_stopped_by_an_exception_hands_back_what_it_had_not_reached(store, clock):
    """An exception in the 2nd post of a page: the 1st is closed and in ``done``, the rows claimed for the 3rd and
    4th go back ``released`` (no attempt used), the exception goes on; the next page answers them once."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = Guard(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    parents = [plat.add_parent(f"x{i}") for i in range(4)]
    send = g._send

    def failing_send(key, parent, row, text):
        if parent.id == "x1":
            raise RuntimeError("a bug before the request")
        return send(key, parent, row, text)

    g._send = failing_send  # type: ignore[method-assign]
    done: list = []
    with pytest.raises(RuntimeError):
        g.post_page([(p, "x") for p in parents], path="inbox", done=done)
    assert [(o.key.parent_id, o.status) for o in done] == [("x0", Status.POSTED)]
    assert [store.get(g.key(f"x{i}")).state for i in range(4)] == [st.CLOSED, st.OPEN, st.RELEASED, st.RELEASED]
    assert [e.kind for e in store.history(g.key("x2"))] == ["claimed", "page_stopped"]
    g._send = send  # type: ignore[method-assign]
    outs = g.post_page([(p, "x") for p in parents], path="inbox")
    assert [o.status for o in outs] == [Status.ALREADY_ANSWERED, Status.IN_FLIGHT, Status.POSTED, Status.POSTED]
    assert [plat.reply_count(p.id) for p in parents] == [1, 0, 1, 1]
    assert all(store.get(g.key(f"x{i}")).attempt == 1 for i in range(4))


def test_an_exception_in_an_async_page_lets_the_other_posts_end(store, clock):
    """The async face: an exception in the 2nd post of a page; the posts running beside it end and are closed in
    the page's close, the exception goes on, ``done`` holds the outcomes before it; one reply each."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    g = FACES["async"](store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    try:
        parents = [plat.add_parent(f"y{i}") for i in range(4)]
        send = g._g._send  # the async face's own seam (a coroutine function): awaited by the harness

        def failing_send(key, parent, row, text):
            if parent.id == "y1":
                raise RuntimeError("a bug before the request")
            return send(key, parent, row, text)

        g._send = failing_send
        done: list = []
        with pytest.raises(RuntimeError):
            g.post_page([(p, "x") for p in parents], path="inbox", done=done)
        assert [(o.key.parent_id, o.status) for o in done] == [("y0", Status.POSTED)]
        assert [store.get(g.key(f"y{i}")).state for i in range(4)] == [st.CLOSED, st.OPEN, st.CLOSED, st.CLOSED]
        assert [plat.reply_count(p.id) for p in parents] == [1, 0, 1, 1]
    finally:
        g.close()


def test_a_breaker_open_after_the_page_claim_hands_the_rows_back_unsent(store, clock):
    """The breaker opens between the page claim and the sends: the claimed rows go back to ``released`` (no
    attempt spent, nothing sent) and are answered once the breaker closes."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    cfg = BreakerConfig(min_failures=3, probe_s=5.0)
    breaker = Breaker(cfg, clock, bot="b1", platform=plat.instance)
    g = Guard(store, plat, plat.whoami(), clock=clock, watch_interval_s=None, breaker=breaker)
    parents = [plat.add_parent(f"b{i}") for i in range(4)]
    rows = g.claim_page([(p, "x") for p in parents], path="inbox")
    assert all(r is not None and r.state == st.OPEN for r in rows)
    for i in range(cfg.min_failures):  # other sends of the bot fail meanwhile: the breaker opens
        breaker.record(breaker.admit(), ("elsewhere", i), True)
    assert breaker.is_open
    outs = [g.post_claimed(p, "x", path="inbox", claimed=r) for p, r in zip(parents, rows, strict=True)]
    assert {o.status for o in outs} == {Status.NOT_SENT} and plat.send_calls == 0
    assert {store.get(g.key(p.id)).state for p in parents} == {st.RELEASED}
    clock.advance(cfg.probe_s + 1)  # the probe may leave: the first post is it, and its success closes the breaker
    assert all(g.post(p, "x").status is Status.POSTED for p in parents)
    assert [plat.reply_count(p.id) for p in parents] == [1] * 4
    assert all(store.get(g.key(p.id)).attempt == 1 for p in parents)


@pytest.mark.slow
@pytest.mark.parametrize("where,kill_at", [("after_claim", 0), ("before_send", 0), ("before_send", 3),
                                           ("after_send", 0), ("after_send", 3), ("after_send", 5),
                                           ("before_close", 0)])
def test_sigkill_at_every_point_of_a_page_then_one_sweep(store_url, tmp_path, where, kill_at, face):
    """A process SIGKILLed right after its page claim, before/after its k-th send, or after every send as the
    page's one close starts: after one sweep (a listing delay on) and the page found again, every parent has
    exactly one reply on the platform."""
    journal, n = str(tmp_path / "journal.jsonl"), 6
    workers.run_until_sigkilled(workers.crash_in_page, store_url, journal, n, kill_at, where, face)

    clock = FakeClock(SystemClock().now())
    store = Store.open(store_url, clock=clock)
    plat = MemoryPlatform(journal=journal, clock=clock, listing_delay_s=1.0)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=5.0, watch_interval_s=None)
    parents = [Parent(id=f"g{i}", author_id="u") for i in range(n)]
    try:
        assert {store.get(g.key(p.id)).state for p in parents} <= {st.OPEN, st.CLOSED}
        clock.advance(10)  # past every open row's deadline (send_timeout_s + the listing delay)
        Sweeper(store, [Bot(plat, plat.whoami())], clock=clock).run_once()
        outs = g.post_page([(p, "x") for p in parents], path="refind")
        assert all(o.status in (Status.POSTED, Status.ALREADY_ANSWERED) for o in outs), outs
        assert {p.id: plat.reply_count(p.id) for p in parents} == {p.id: 1 for p in parents}
    finally:
        store.dispose()


@pytest.mark.postgres
def test_a_page_s_statements_are_planned_once_not_on_every_page(pg_url):
    """On PostgreSQL a page's claim and close statements run on a cached generic plan once the server has seen a
    few: neither is planned again on each page. The close once was (a custom plan through the state index,
    cheaper on paper than its by-key generic one, on every page): a third of the close's server time."""
    import psycopg

    from replyd.store.aiopg import conninfo
    from tests.conftest import _truncate

    _truncate(pg_url)
    store = Store.open(pg_url)
    plat = MemoryPlatform(listing_delay_s=5.0)
    g = Guard(store, plat, plat.whoami(), watch_interval_s=None)
    try:
        n = iter(range(1_000_000))

        def page() -> None:
            parents = [plat.add_parent(f"p{next(n)}") for _ in range(PAGE_MAX)]
            assert all(o.status is Status.POSTED for o in g.post_page([(p, "x") for p in parents]))

        def plans() -> dict[str, tuple[int, int]]:
            """(generic, custom) plans so far of each statement prepared on the session the pages run on."""
            with store._driver("reading the prepared statements") as fairy:
                cur = fairy.driver_connection.cursor()
                cur.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
                return {s: (gen, cus) for s, gen, cus in cur.fetchall()}

        for _ in range(40):  # closed rows, as a live table has: the planner's statistics then see few open ones
            page()
        with psycopg.connect(conninfo(store.engine.url), autocommit=True) as c:
            c.execute("ANALYZE replies")  # as autovacuum does; it also drops every cached plan
        for _ in range(8):
            page()
        before = plans()
        for _ in range(12):
            page()
        after = plans()
        runs = {s: (gen - before.get(s, (0, 0))[0], cus - before.get(s, (0, 0))[1]) for s, (gen, cus) in after.items()}
        # The page's two writes (its claim and its close, each ONE statement over the page's arrays).
        sets = {("claim" if "INSERT INTO replies" in s else "close"): d for s, d in runs.items()
                if "unnest" in s and ("INSERT INTO replies" in s or "UPDATE replies" in s)}
        assert sets == {"claim": (12, 0), "close": (12, 0)}, sets
    finally:
        g.close()
        store.dispose()
