"""A parent a path has seen is answered once or waits in a row ``replyd status`` shows: on a busy store and
under the policy's caps, on the paths that cannot find a parent again (Telegram's ``getUpdates``, whose next
offset confirms the update for good; WhatsApp's webhook, never delivered again after a 2xx).

Real adapters against the stateful fakes over HTTP, the real guard, pipeline and pollers, SQLite and
PostgreSQL; replies are counted on the fake's side.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa

from replyd import store as st
from replyd.clock import FakeClock
from replyd.config import PollerConfig
from replyd.guard import Guard
from replyd.hooks import Hook, Receiver
from replyd.pipeline import Pipeline
from replyd.platforms.whatsapp import WhatsAppPlatform
from replyd.policy import HOUR_S, Policy
from replyd.pollers import Pollers
from replyd.store import sqlite as sqlite_store
from tests.api_harness import replyd_cli
from tests.test_telegram import GROUP, api, make, world  # noqa: F401 (the fake's fixtures)
from tests.whatsapp_fake import APP_SECRET, PHONE_ID, VERIFY_TOKEN, WhatsAppApi, WhatsAppWorld, sign
from tests.whatsapp_fake import TOKEN as WA_TOKEN

BUSY_MS = 300  # the store's busy (lock) timeout in these tests: a held lock outlasts it at once


def _bot(store: st.Store, plat: Any, clock: FakeClock, policy: Policy) -> tuple[Guard, Pipeline, Pollers]:
    """The daemon's parts for one bot: guard, pipeline (a fixed answer) and pollers."""
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    pipe = Pipeline(guard, lambda p: f"answer to {p.id}", policy, clock)
    return guard, pipe, Pollers(store, plat, pipe, PollerConfig(), clock)


def _busy_url(url: str) -> str:
    """The store URL with a short lock timeout on PostgreSQL (SQLite's busy timeout is patched instead)."""
    if url.startswith("sqlite"):
        return url
    return sa.engine.make_url(url).update_query_dict({"options": f"-c lock_timeout={BUSY_MS}"}).render_as_string(
        hide_password=False)


class _WriteLock:
    """Another process's writer holding the store's write lock (SQLite ``BEGIN IMMEDIATE``, PostgreSQL
    ``LOCK TABLE replies IN EXCLUSIVE MODE``): reads go on, writes wait past the busy timeout."""

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite"):
            self.conn: Any = sqlite3.connect(st.sqlite_file(url), isolation_level=None)
            self.conn.execute("BEGIN IMMEDIATE")
        else:
            u = sa.engine.make_url(url)
            self.conn = psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)
            self.conn.execute("LOCK TABLE replies IN EXCLUSIVE MODE")

    def free(self) -> None:
        if self.conn is not None:
            self.conn.rollback()
            self.conn.close()
            self.conn = None


@pytest.fixture
def busy_store(store_url: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[st.Store]:
    """A store whose writers give up on a held lock after ``BUSY_MS`` (a ContentionError)."""
    monkeypatch.setattr(sqlite_store, "SQLITE_BUSY_TIMEOUT_MS", BUSY_MS)
    s = st.Store.open(_busy_url(store_url), clock=clock)
    yield s
    s.dispose()


def test_a_busy_store_holds_the_offset_so_every_update_is_answered_once(api, world, busy_store, store_url,
                                                                          clock) -> None:
    """The write lock is held past the busy timeout while a burst is claimed, then let go: nothing is claimed,
    the offset is not saved (the updates stay on Telegram's side), and the next polls answer each parent once."""
    plat = make(api, clock=clock)
    guard, _, polls = _bot(busy_store, plat, clock, Policy())
    ids = [world.post(GROUP, f"question {i}", user_id=5000000100 + i) for i in range(6)]
    lock, offer_page = _WriteLock(store_url), polls.pipeline.offer_page

    def offer_then_free(parents: list, path: str) -> list:
        try:
            return offer_page(parents, path)
        finally:
            lock.free()  # the lock ends after the claims gave up, before the poller would save the offset

    polls.pipeline.offer_page = offer_then_free  # type: ignore[method-assign]
    polls.inbox()
    polls.pipeline.offer_page = offer_page  # type: ignore[method-assign]
    assert busy_store.get_cursor(plat.instance, guard.identity.sender_id, "inbox") is None
    assert world.reply_counts() == {} and len(world.pending_updates()) == 6
    polls.inbox()  # the same batch again: answered
    polls.inbox()  # the saved offset confirms it
    assert world.reply_counts() == {pid: 1 for pid in ids}
    assert world.pending_updates() == []
    assert {busy_store.get(guard.key(pid)).state for pid in ids} == {st.CLOSED}


def _events(store: st.Store, guard: Guard, ids: list[str]) -> int:
    return sum(len(store.history(guard.key(pid))) for pid in ids)


def test_a_burst_over_the_hourly_cap_waits_in_rows_and_each_parent_is_answered_once(api, world, store, store_url,
                                                                                     clock) -> None:
    """max_per_hour = 10 and a burst of 24 updates: 10 answered, 14 wait as rows ``replyd status`` shows with
    the reason, though the next offset confirms the updates; re-offers while the cap is full send and write
    nothing; each hour lets 10 more through, until all 24 are answered once."""
    plat = make(api, clock=clock)
    guard, _, polls = _bot(store, plat, clock, Policy.build(max_per_hour=10))
    ids = [world.post(GROUP, f"question {i}", user_id=5000000100 + i) for i in range(24)]
    polls.inbox()
    polls.inbox()  # the saved offset confirms the burst: Telegram never serves it again
    assert world.pending_updates() == [] and sum(world.reply_counts().values()) == 10
    assert store.waiting_reasons() == {(plat.instance, "hourly_cap"): 14}
    shown = replyd_cli("status", "--store", store_url)
    assert "waiting 14 on telegram (hourly_cap 14)" in shown.stdout, shown.stdout + shown.stderr
    as_json = json.loads(replyd_cli("status", "--json", "--store", store_url).stdout)["waiting"]
    assert as_json == [{"platform": plat.instance, "reason": "hourly_cap", "rows": 14}]
    noted = _events(store, guard, ids)
    for _ in range(3):  # the cap is still full: no send, no write, no event
        clock.advance(60.0)
        polls.reoffer()
    assert _events(store, guard, ids) == noted and sum(world.reply_counts().values()) == 10
    for _ in range(3):
        clock.advance(HOUR_S + 1.0)
        polls.reoffer()
    assert world.reply_counts() == {pid: 1 for pid in ids}
    assert store.waiting_reasons() == {}
    # Held again after an hour (the cap still full) adds no event: one "held" per parent that waited.
    held = sorted(sum(e.kind == "held" for e in store.history(guard.key(pid))) for pid in ids)
    assert held == [0] * 10 + [1] * 14


@contextmanager
def _whatsapp(store: st.Store, clock: FakeClock, policy: Policy) -> Iterator[tuple[WhatsAppWorld, Hook, Pollers]]:
    """The Cloud API fake, a bot on it, and its webhook hook (offers through the pipeline, rows kept first)."""
    wa_world = WhatsAppWorld(now=clock.now)
    wa = WhatsAppApi(wa_world).start()
    try:
        plat = WhatsAppPlatform.from_settings({"token": WA_TOKEN, "phone_number_id": PHONE_ID, "api_url": wa.url},
                                              http=httpx.Client(timeout=5.0), clock=clock)
        plat.whoami()
        guard, pipe, polls = _bot(store, plat, clock, policy)
        yield wa_world, Hook("wa", "whatsapp", APP_SECRET, plat, pipe.offer, plat.instance, guard=guard,
                             verify_token=VERIFY_TOKEN, offer_page=pipe.offer_page), polls
    finally:
        wa.stop()


def _deliver(wa_world: WhatsAppWorld, hook: Hook, raws: list[bytes] | None = None) -> list[int]:
    """POST each queued delivery (or ``raws``) to the hook, one at a time (each one's offers end before the
    next: offers running at once may overshoot a cap by one, docs/POLICY.md); their answers' statuses."""
    if raws is None:
        with wa_world.lock:
            raws, wa_world.queue = [json.dumps(p).encode() for p in wa_world.queue], []
    statuses = []
    for raw in raws:
        rx = Receiver({"wa": hook})
        statuses.append(rx.receive("wa", {"x-hub-signature-256": sign(APP_SECRET, raw)}, raw).status)
        rx.close()
    return statuses


def test_a_burst_over_the_author_cap_on_the_whatsapp_webhook_waits_in_rows(store, clock) -> None:
    """WhatsApp delivers once (a 2xx ends it) and cannot re-find: with max_per_author_per_hour = 1, a customer's
    second and third messages wait as rows named by the cap and are answered once, an hour apart."""
    with _whatsapp(store, clock, Policy.build(max_per_author_per_hour=1)) as (wa_world, hook, polls):
        ids = [wa_world.customer_says("16505551234", f"question {i}") for i in range(3)]
        ids.append(wa_world.customer_says("16505550000", "another customer"))
        assert all(code < 300 for code in _deliver(wa_world, hook))
        assert sum(wa_world.reply_counts().values()) == 2
        assert store.waiting_reasons() == {(hook.instance, "author_cap"): 2}
        for _ in range(3):
            clock.advance(HOUR_S + 1.0)
            polls.reoffer()
        assert wa_world.reply_counts() == {pid: 1 for pid in ids}
        assert store.waiting_reasons() == {}


def test_a_busy_store_answers_whatsapp_deliveries_503_and_their_retries_are_answered_once(busy_store, store_url,
                                                                                          clock) -> None:
    """The write lock held past the busy timeout: no delivery of the burst is acked (503, nothing kept or
    offered), so Meta sends each again; once the lock is gone each parent is answered exactly once."""
    with _whatsapp(busy_store, clock, Policy()) as (wa_world, hook, _):
        ids = [wa_world.customer_says(f"1650555{i:04d}", f"question {i}") for i in range(4)]
        with wa_world.lock:
            raws, wa_world.queue = [json.dumps(p).encode() for p in wa_world.queue], []
        lock = _WriteLock(store_url)
        try:
            refused = _deliver(wa_world, hook, raws)
        finally:
            lock.free()
        assert refused == [503] * 4 and wa_world.reply_counts() == {}
        assert all(code < 300 for code in _deliver(wa_world, hook, raws))  # Meta's retries
        assert wa_world.reply_counts() == {pid: 1 for pid in ids}


def test_rearm_makes_the_row_of_a_parent_the_policy_skipped(api, world, store, store_url, clock) -> None:
    """A final skip leaves no row, only its event (with the parent's snapshot): ``replyd rearm`` makes a
    ``released`` row from it, and the next re-offer answers it once under the changed policy."""
    plat = make(api, clock=clock)
    guard, _, polls = _bot(store, plat, clock, Policy.build(deny_keywords=["refund"]))
    pid = world.post(GROUP, "about my refund")
    polls.inbox()
    polls.inbox()
    assert store.get(guard.key(pid)) is None and world.pending_updates() == []
    done = replyd_cli("rearm", "--json", "--store", store_url, "--", "telegram", pid)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == {"rearmed": True, "previous_state": "skipped", "state": "released"}
    again = replyd_cli("rearm", "--store", store_url, "--", "telegram", pid)
    assert again.returncode == 1 and "released" in again.stderr
    _, _, fixed = _bot(store, plat, clock, Policy())  # the operator changed the list, then rearmed
    fixed.reoffer()
    fixed.reoffer()
    assert world.reply_counts() == {pid: 1}


def test_a_held_row_is_due_for_re_offer_only_once_its_not_before_passed(store, clock) -> None:
    """``reoffer_due`` and ``senders_waiting`` skip a released row whose ``not_before`` is ahead: the daemon's
    re-offer job reads nothing for a bot whose rows all wait for a cap's hour."""
    key = st.Key("telegram", "7", "p")
    with store.transaction() as tx:
        assert tx.insert_new(key, {"state": st.RELEASED, "attempt": 1, "created_at": 0.0, "updated_at": 0.0,
                                   "not_before": 100.0, "error": "policy: hourly_cap"})
    assert store.reoffer_due("telegram", "7", now=99.0, after=None, limit=10) == []
    assert store.senders_waiting(99.0) == set()
    assert [r.parent_id for r in store.reoffer_due("telegram", "7", now=100.0, after=None, limit=10)] == ["p"]
    assert store.senders_waiting(100.0) == {("telegram", "7")}
    assert store.waiting_reasons() == {("telegram", "hourly_cap"): 1}


def test_the_re_offer_pages_walk_every_waiting_row_once_ties_included(store) -> None:
    """Pages of 2 walk 7 waiting rows (three share one ``updated_at``) in order, each row once; other states,
    other bots, part rows and a held row are never in a page."""
    def row(pid: str, state: str, at: float, **more: object) -> None:
        with store.transaction() as tx:
            assert tx.insert_new(st.Key(more.pop("platform", "telegram"), "7", pid),
                                 {"state": state, "attempt": 1, "created_at": at, "updated_at": at, **more})

    for pid, at in (("a", 1.0), ("c", 2.0), ("b", 2.0), ("d", 2.0), ("e", 3.0)):
        row(pid, st.RELEASED, at)
    row("f", st.RELEASED, 4.0)
    row("g", st.COMPOSING, 5.0, lease_until=10.0)
    row("h", st.COMPOSING, 0.5, lease_until=99.0)  # its composer still holds it
    row("i", st.OPEN, 0.5)
    row("j", st.RELEASED, 0.5, not_before=99.0)  # held
    row("k", st.RELEASED, 0.5, path=st.PART_PATH)  # a part: its answer's row is offered
    row("l", st.RELEASED, 0.5, platform="mastodon")  # another bot
    pages, after = [], None
    for _ in range(6):
        rows = store.reoffer_due("telegram", "7", now=50.0, after=after, limit=2)
        pages.append([r.parent_id for r in rows])
        if len(rows) < 2:
            break
        after = (rows[-1].updated_at, rows[-1].parent_id)
    assert pages == [["a", "b"], ["c", "d"], ["e", "f"], ["g"]]
