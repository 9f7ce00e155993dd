"""The Matrix adapter on a real Synapse homeserver (tests/synapse_server.py), and the guard/sweep over it.

People write through Synapse's client-server API; the bot's replies are
counted by reading the room as one of the people, never from replyd's log.
Lost responses come from a small proxy between the adapter and Synapse that
forwards a send and hangs up before answering.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from replyd import store as st
from replyd.clock import FakeClock, SystemClock
from replyd.errors import DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.guard import Guard, Status
from replyd.platforms.base import Identity, Parent, Pending, ReplyLinks
from replyd.platforms.matrix import MatrixPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.synapse_server import DropProxy, Synapse
from tests.workers import crash_before_close_on

SEND_TIMEOUT_S = 10.0
CTX = mp.get_context("spawn")


@dataclass
class World:
    """One test's view: the homeserver, a room, the adapter as the bot, a store, a guard."""

    hs: Synapse
    room: str
    http: httpx.Client
    platform: MatrixPlatform
    me: Identity
    store: Store
    clock: FakeClock

    def adapter(self, base_url: str | None = None, **settings: Any) -> MatrixPlatform:
        """Another adapter for the bot (through a proxy, say)."""
        return MatrixPlatform.from_settings(self.settings(**({"base_url": base_url} if base_url else {}), **settings),
                                            http=self.http, clock=self.clock)

    def guard(self, platform: MatrixPlatform | None = None) -> Guard:
        """A guard on this store posting through ``platform``."""
        return Guard(self.store, platform or self.platform, self.me, clock=self.clock, send_timeout_s=SEND_TIMEOUT_S)

    def sweep(self, platform: MatrixPlatform | None = None) -> Any:
        """Move the clock past every deadline and listing delay and run one sweep pass."""
        self.clock.advance(SEND_TIMEOUT_S + 60)
        return Sweeper(self.store, [Bot(platform or self.platform, self.me)], clock=self.clock).run_once()

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The bot's adapter settings (for a child process), same instance as ``platform``."""
        return {"base_url": self.hs.base_url, "token": self.hs.bot.token, "listing_delay_s": 0.5,
                "instance": self.platform.instance, **extra}

    def key(self, parent_id: str) -> Any:
        """The answered-log key of ``parent_id``."""
        return self.guard().key(parent_id)

    def parent(self, who: str = "alice", text: str = "help please", **kw: Any) -> Parent:
        """``who`` mentions the bot in the room; the parent as the bot's inbox would serve it."""
        event_id = self.hs.say(self.hs.people[who], self.room, f"{self.hs.bot.user_id} {text}", **kw)
        return self.platform.resolve(f"https://matrix.to/#/{self.room}/{event_id}")

    def replies(self, parent_id: str) -> list[str]:
        """The bot's replies to ``parent_id`` as carol (another member) reads the room."""
        return self.hs.replies_by(self.room, self.hs.bot.user_id, self.hs.people["carol"]).get(parent_id, [])


@pytest.fixture
def world(synapse: Synapse, tmp_path: Any) -> Iterator[World]:
    """A fresh room (alice owns it; the bot and carol joined) and a fresh answered-log."""
    hs = synapse
    room = hs.create_room(hs.people["alice"], others=(hs.people["carol"], hs.people["bob"]))
    with httpx.Client(trust_env=False) as http:
        clock = FakeClock(SystemClock().now())
        store = Store.open(f"sqlite:///{tmp_path / 'replyd.sqlite3'}", clock=clock)
        platform = MatrixPlatform.from_settings({"base_url": hs.base_url, "token": hs.bot.token,
                                                 "listing_delay_s": 0.5}, http=http, clock=clock)
        yield World(hs, room, http, platform, platform.whoami(), store, clock)
        store.dispose()


# --- the adapter contract on the real server ----------------------------------------------


def test_inbox_finds_mentions_once_and_moves_its_cursor(world: World) -> None:
    """``/sync`` offers each mention (m.mentions or the id in the body) once; other talk and own messages never."""
    hs, alice, bob = world.hs, world.hs.people["alice"], world.hs.people["bob"]
    start = world.platform.inbox(None).cursor
    by_mentions = hs.say(alice, world.room, "hey bot, help")  # m.mentions only, no id in the body
    by_body = hs.say(bob, world.room, f"{hs.bot.user_id}: help", use_mentions=False)
    hs.say(alice, world.room, "just chatting", mention_bot=False)
    hs.say(hs.bot, world.room, f"I am {hs.bot.user_id}")  # its own words never call the bot
    # Follow the cursor chain: Synapse caches a /sync answer for two minutes (``sync_response_cache_duration``,
    # default 2m), so on the suite's shared homeserver ``start`` may come from an identical earlier request and
    # the next page may end before these events; they then come one page later, never twice. Other rooms the
    # bot is in (other tests' rooms) may show up too: only this room's parents count.
    seen: list[Parent] = []
    cursor = start
    for _ in range(6):
        page = world.platform.inbox(cursor)
        assert page.cursor and page.cursor != cursor
        seen += [p for p in page.parents if p.extra["room_id"] == world.room]
        cursor = page.cursor
        if len(seen) >= 2:
            break
    assert [p.id for p in seen] == [by_mentions, by_body]
    assert seen[1].author_id == bob.user_id
    assert [p for p in world.platform.inbox(cursor).parents if p.extra["room_id"] == world.room] == []


def test_send_replies_in_the_room_with_the_relation_and_read_back_finds_it(world: World) -> None:
    """The reply lands in the parent's room with ``m.in_reply_to`` = the parent; read_back finds and checks it."""
    parent = world.parent()
    sent = world.platform.send(parent, "on it", provider_key=uuid.uuid4().hex)
    ev = next(e for e in world.hs.messages(world.room, world.hs.people["carol"]) if e["event_id"] == sent.reply_id)
    assert ev["sender"] == world.me.sender_id and ev["content"]["body"] == "on it"
    assert ev["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": parent.id}}
    rb = world.platform.read_back([Pending(parent, opened_at=world.clock.now() - 5)], sender_id=world.me.sender_id)
    assert parent.id in rb.checked and [r.reply_id for r in rb.found[parent.id]] == [sent.reply_id]
    assert isinstance(world.platform, ReplyLinks) and world.platform.reply_url(sent.reply_id, world.me) == sent.url
    assert world.adapter().reply_url(sent.reply_id, world.me) == ""  # a process that never saw its room


def test_a_prompt_injection_pings_nobody_but_the_author(world: World) -> None:
    """A reply echoing ``@room`` and every other mention form names only the author in ``m.mentions`` and shows no
    live ``@room`` in its body, posted and edited, as carol reads the room; ``allow_mentions`` keeps the text."""
    from tests.test_mentions import INJECTION, injected

    carol = world.hs.people["carol"]
    parent = world.parent(text=INJECTION)
    sent = world.platform.send(parent, injected(parent), provider_key=uuid.uuid4().hex)
    ev = next(e for e in world.hs.messages(world.room, carol) if e["event_id"] == sent.reply_id)
    assert ev["content"]["m.mentions"] == {"user_ids": [parent.author_id]} and "@mallory" in ev["content"]["body"]
    world.platform.edit(parent, sent.reply_id, injected(parent) + " (edited)")
    for body in (ev["content"]["body"], world.hs.reply_text(world.room, sent.reply_id, carol)):
        assert not re.search(r"(?<!\w)@room\b", body)
    loose = world.adapter(allow_mentions=True).send(parent, injected(parent), provider_key=uuid.uuid4().hex)
    assert re.search(r"(?<!\w)@room\b", world.hs.reply_text(world.room, loose.reply_id, carol))


def test_reply_to_a_threaded_parent_stays_in_the_thread(world: World) -> None:
    """A parent inside a thread gets a reply with ``rel_type = m.thread`` on the same root."""
    root = world.hs.say(world.hs.people["bob"], world.room, "thread root", mention_bot=False)
    parent = world.parent(thread_root=root)
    assert parent.extra["thread_root"] == root and parent.thread_depth == 1
    sent = world.platform.send(parent, "threaded answer", provider_key=uuid.uuid4().hex)
    ev = next(e for e in world.hs.messages(world.room, world.hs.people["carol"]) if e["event_id"] == sent.reply_id)
    rel = ev["content"]["m.relates_to"]
    assert (rel["rel_type"], rel["event_id"], rel["m.in_reply_to"]["event_id"]) == ("m.thread", root, parent.id)


def test_a_repeated_transaction_id_returns_the_same_event(world: World) -> None:
    """Sending again with the same txnId returns the SAME event id and the room holds one reply (pinned)."""
    parent = world.parent()
    key = world.guard().provider_key(parent.id)
    first = world.platform.send(parent, "once", provider_key=key)
    again = world.adapter().send(parent, "once, a retry", provider_key=key)  # another client, same token
    assert again.reply_id == first.reply_id
    assert world.replies(parent.id) == [first.reply_id]


def test_refind_search_and_resolve_find_the_same_parent(world: World) -> None:
    """Re-find (room /messages), search (/search) and resolve (matrix.to) all serve the parent's event id."""
    parent = world.parent(text=f"searchword{uuid.uuid4().hex[:8]}")
    word = parent.text.split()[-1]
    assert parent.id in [p.id for p in world.platform.refind(world.clock.now() - 60)]
    page = world.platform.search(word, None)
    assert [p.id for p in page.parents] == [parent.id] and page.cursor
    assert world.platform.search(word, page.cursor).parents == []
    assert world.platform.resolve(f"{world.room}/{parent.id}").id == parent.id


def test_thread_depth_follows_in_reply_to(world: World) -> None:
    """``thread_depth`` counts the ``m.in_reply_to`` chain, capped at ``limit + 1``."""
    alice, bob = world.hs.people["alice"], world.hs.people["bob"]
    a = world.hs.say(alice, world.room, "top", mention_bot=False)
    b = world.hs.say(bob, world.room, "re top", mention_bot=False, reply_to=a)
    parent = world.parent(reply_to=b)
    assert world.platform.thread_depth(parent, 5) == 2
    assert world.platform.thread_depth(parent, 0) == 1


# --- errors from the real server --------------------------------------------------------


def test_send_to_a_room_the_bot_is_not_in_is_definitely_not_sent(world: World) -> None:
    """M_FORBIDDEN (not joined) maps to DefinitelyNotSent; a gone room id to Rejected."""
    alice = world.hs.people["alice"]
    other = world.hs.create_room(alice, invite_bot=False)
    ev = world.hs.say(alice, other, "not for the bot")
    parent = Parent(id=ev, author_id=alice.user_id, extra={"room_id": other})
    with pytest.raises(DefinitelyNotSent) as exc:
        world.platform.send(parent, "x", provider_key=uuid.uuid4().hex)
    assert exc.value.status == 403 and "M_FORBIDDEN" in exc.value.detail and not isinstance(exc.value, RateLimited)


def test_an_unknown_token_is_definitely_not_sent_and_never_echoed(world: World) -> None:
    """M_UNKNOWN_TOKEN (401) is DefinitelyNotSent; the token never appears in the error."""
    bad = world.adapter(token="syt_not_a_real_token_0123456789")
    with pytest.raises(DefinitelyNotSent) as exc:
        bad.whoami()
    assert exc.value.status == 401 and "M_UNKNOWN_TOKEN" in exc.value.detail and "syt_not" not in str(exc.value)


def test_password_login_on_a_fixed_device_keeps_the_transaction_scope(world: World) -> None:
    """Two password logins on one device_id: a retry after re-login still returns the first event."""
    parent = world.parent()
    key = uuid.uuid4().hex
    settings = {"base_url": world.hs.base_url, "user": world.hs.bot.localpart,
                "password": world.hs.bot.password, "device_id": "REPLYDTEST"}
    first = MatrixPlatform.from_settings(settings, http=world.http, clock=world.clock)
    sent = first.send(parent, "logged in", provider_key=key)
    second = MatrixPlatform.from_settings(settings, http=world.http, clock=world.clock)  # a daemon restart
    assert second.send(parent, "logged in again", provider_key=key).reply_id == sent.reply_id
    assert world.replies(parent.id) == [sent.reply_id]


def test_rate_limit_body_sets_retry_after() -> None:
    """M_LIMIT_EXCEEDED with ``retry_after_ms`` becomes RateLimited with that wait (Synapse's limits are raised here)."""
    p = MatrixPlatform(base_url="http://127.0.0.1:1", token="t", http=httpx.Client(), clock=FakeClock())
    req = httpx.Request("PUT", "http://127.0.0.1:1/x")
    resp = httpx.Response(429, json={"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 2500}, request=req)
    with pytest.raises(RateLimited) as exc:
        p._raise_for_status(resp, what="send", acts=None)
    assert exc.value.retry_after_s == 2.5
    with pytest.raises(MaybeSent):
        p._raise_for_status(httpx.Response(502, text="bad gateway", request=req), what="send", acts=None)


# --- the guard and the sweep over lost responses -----------------------------------------


def test_lost_response_then_retry_returns_the_same_event(world: World) -> None:
    """A send whose answer is lost is UNCERTAIN; the retry with the same txnId returns the first event: one reply."""
    proxy = DropProxy(world.hs.base_url)
    try:
        lossy = world.adapter(proxy.url)
        parent = world.parent()
        proxy.drop_sends = 1
        out = world.guard(lossy).post(parent, "answer", path="inbox")
        assert out.status is Status.UNCERTAIN and proxy.forwarded_sends == [200]
        first = world.replies(parent.id)
        assert len(first) == 1  # it landed though the answer never came
        # The provider key is stored on the row: a retry (this process or after a restart) reuses it.
        row = world.store.get(world.guard().key(parent.id))
        again = lossy.send(parent, "answer", provider_key=row.provider_key)
        assert again.reply_id == first[0]
        assert world.replies(parent.id) == first
    finally:
        proxy.close()


def _crash_after_send(world: World, parent: Parent) -> None:
    child = CTX.Process(target=crash_before_close_on,
                        args=("matrix", world.settings(), world.store.url, parent.snapshot(), "the first answer"))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL


def test_crash_before_close_then_sweep(world: World) -> None:
    """SIGKILL between the send and the close: a restart waits (IN_FLIGHT), the sweep closes with the landed event."""
    parent = world.parent()
    _crash_after_send(world, parent)
    assert world.store.get(world.key(parent.id)).state == st.OPEN
    assert world.guard().post(parent, "after restart").status is Status.IN_FLIGHT
    assert world.sweep().closed == 1
    landed = world.replies(parent.id)
    assert len(landed) == 1 and world.store.get(world.key(parent.id)).reply_id == landed[0]


def test_crash_and_lagging_listing_retry_returns_the_same_event(world: World) -> None:
    """Crash before close, a sweep whose listing lags (not_landed), then the retry: Synapse answers the first event."""
    parent = world.parent()
    _crash_after_send(world, parent)
    landed = world.replies(parent.id)
    assert len(landed) == 1
    proxy = DropProxy(world.hs.base_url)
    try:
        proxy.hide = set(landed)  # the read-back the sweep makes does not show it yet
        assert world.sweep(world.adapter(proxy.url)).not_landed == 1
        assert world.store.get(world.key(parent.id)).state == st.NOT_LANDED
    finally:
        proxy.close()
    out = world.guard().post(parent, "the retry, reworded", path="refind")  # a restarted daemon's retry
    row = world.store.get(world.key(parent.id))
    assert (out.status, out.reply_id) == (Status.POSTED, landed[0])  # the same txnId: the same event
    assert (row.state, row.attempt, row.reply_id) == (st.CLOSED, 2, landed[0])
    verify = world.sweep()
    assert (verify.verified, verify.duplicates) == (1, 0)
    assert world.replies(parent.id) == landed


def test_a_retry_after_a_synapse_crash_returns_the_same_event(world: World) -> None:
    """Synapse SIGKILLed and restarted between two sends of one txnId: the same event (the mapping is on disk)."""
    parent = world.parent()
    key = world.guard().provider_key(parent.id)
    first = world.platform.send(parent, "before the crash", provider_key=key)
    world.hs.stop(signal.SIGKILL)
    world.hs.start()
    assert world.platform.send(parent, "after the crash", provider_key=key).reply_id == first.reply_id
    assert world.replies(parent.id) == [first.reply_id]


def test_the_transaction_scope_is_the_device(world: World) -> None:
    """The same txnId from another device of the bot is a new transaction: a second event (why device_id is fixed)."""
    parent = world.parent()
    key = uuid.uuid4().hex
    first = world.platform.send(parent, "from the registration device", provider_key=key)
    other = world.adapter(token=None, user=world.hs.bot.localpart, password=world.hs.bot.password,
                          device_id="ANOTHERDEVICE")
    second = other.send(parent, "from another device", provider_key=key)
    assert second.reply_id != first.reply_id
    assert world.replies(parent.id) == [first.reply_id, second.reply_id]


def test_read_back_that_cannot_reach_the_open_time_checks_nothing(world: World) -> None:
    """A room walk cut by ``max_pages`` before the open time leaves the parent unchecked (open), not "not found"."""
    parent = world.parent()
    world.platform.send(parent, "the reply", provider_key=uuid.uuid4().hex)
    for i in range(2):  # newer own messages push the reply off one short page
        world.platform.send(world.parent(text=f"other {i}"), "another reply", provider_key=uuid.uuid4().hex)
    short = world.adapter(page_limit=1, max_pages=1)
    pending = [Pending(parent, opened_at=world.clock.now() - 5)]
    rb = short.read_back(pending, sender_id=world.me.sender_id)
    assert parent.id not in rb.checked and parent.id not in rb.found
    assert parent.id in world.adapter(page_limit=1, max_pages=10).read_back(pending, sender_id=world.me.sender_id).checked


def test_inbox_fills_a_limited_timeline_back_to_its_cursor(world: World) -> None:
    """More mentions than one sync's timeline holds: the gap is paged back with /messages, none is lost."""
    small = world.adapter(page_limit=2)
    start = small.inbox(None).cursor
    sent = [world.hs.say(world.hs.people["alice"], world.room, f"mention {i}") for i in range(5)]
    page = small.inbox(start)
    assert [p.id for p in page.parents] == sent


def test_invites_are_joined_only_by_policy(world: World) -> None:
    """An invite is left alone by default and accepted by the inbox with ``join_invites = true``."""
    hs = world.hs
    room = hs.create_room(hs.people["bob"], bot_joins=False)

    def joined() -> bool:
        return room in hs.api("GET", "/joined_rooms", hs.bot)["joined_rooms"]

    world.platform.inbox(None)
    assert not joined()
    world.adapter(join_invites=True).inbox(None)
    assert joined()


def test_a_search_gap_whose_next_batch_synapse_refuses_is_given_up(world: World) -> None:
    """A gap cursor whose next_batch Synapse refuses (400): counted three polls, then the newest cursor (re-find's
    backstop covers the gap); each refused poll offers nothing and raises nothing."""
    from replyd.platforms._http import GapCursor

    word = f"gapword{uuid.uuid4().hex[:8]}"
    world.parent(text=f"{word} first")
    first = world.platform.search(word, None)
    assert first.cursor and len(first.parents) == 1
    cursor = GapCursor(first.cursor, first.cursor, "not-a-next-batch").encode()
    for i in range(GapCursor.MAX_REFUSED):
        page = world.platform.search(word, cursor)
        assert page.parents == []
        cursor = page.cursor
        assert (GapCursor.decode(cursor) is None) == (i == GapCursor.MAX_REFUSED - 1), cursor
    assert cursor == first.cursor


# --- edits (EditReply: a streamed answer grows its reply by replacement events) ---------------


def _edit_content(text: str, reply_id: str, **relates: Any) -> dict[str, Any]:
    """A replacement's content as another client of the bot would send it (``relates`` added to m.relates_to)."""
    return {"msgtype": "m.text", "body": f"* {text}", "m.new_content": {"msgtype": "m.text", "body": text},
            "m.relates_to": {"rel_type": "m.replace", "event_id": reply_id, **relates}}


@pytest.mark.parametrize("threaded", [False, True], ids=["room", "thread"])
def test_a_reply_edited_twice_reads_back_as_one_reply_with_the_latest_text(world: World, threaded: bool) -> None:
    """Two edits are two m.replace events (no m.in_reply_to, mentions kept in m.new_content, none notified again);
    the room, the read-back and the sweep still see exactly one reply, with the reply's id."""
    hs, carol = world.hs, world.hs.people["carol"]
    root = hs.say(hs.people["bob"], world.room, "thread root", mention_bot=False) if threaded else None
    parent = world.parent(thread_root=root) if threaded else world.parent()
    out = world.guard().post(parent, "Looking", path="inbox")
    assert out.status is Status.POSTED
    world.platform.edit(parent, out.reply_id, "Looking into it")
    world.platform.edit(parent, out.reply_id, "Looking into it: widgets spin.")
    edits = hs.edits(world.room, out.reply_id, carol)
    assert [e["sender"] for e in edits] == [world.me.sender_id] * 2
    last = edits[-1]["content"]
    assert last["m.relates_to"] == {"rel_type": "m.replace", "event_id": out.reply_id}
    assert (last["body"], last["m.mentions"]) == ("* Looking into it: widgets spin.", {})
    assert last["m.new_content"] == {"msgtype": "m.text", "body": "Looking into it: widgets spin.",
                                     "m.mentions": {"user_ids": [parent.author_id]}}
    assert hs.reply_text(world.room, out.reply_id, carol) == "Looking into it: widgets spin."
    original = hs.api("GET", f"/rooms/{world.room}/event/{out.reply_id}", carol)["content"]
    assert original["body"] == "Looking" and original["m.relates_to"]["m.in_reply_to"] == {"event_id": parent.id}
    assert world.replies(parent.id) == [out.reply_id]
    rb = world.platform.read_back([Pending(parent, opened_at=world.clock.now() - 5)], sender_id=world.me.sender_id)
    assert parent.id in rb.checked and [r.reply_id for r in rb.found[parent.id]] == [out.reply_id]
    res = world.sweep()
    assert (res.verified, res.duplicates) == (1, 0)


def test_a_lost_edit_answer_retried_is_the_same_edit_event(world: World) -> None:
    """The edit lands but its answer is lost (MaybeSent); the retry is the same txnId: Synapse answers with the
    first edit event and the room holds one edit."""
    from urllib.parse import quote

    from replyd.platforms.matrix import edit_txn_id

    hs, carol = world.hs, world.hs.people["carol"]
    proxy = DropProxy(hs.base_url)
    try:
        lossy = world.adapter(proxy.url)
        parent = world.parent()
        sent = lossy.send(parent, "Looking", provider_key=uuid.uuid4().hex)
        proxy.drop_sends = 1
        with pytest.raises(MaybeSent):
            lossy.edit(parent, sent.reply_id, "the whole answer")
        [edit] = hs.edits(world.room, sent.reply_id, carol)  # it landed though the answer never came
        lossy.edit(parent, sent.reply_id, "the whole answer")  # the guard's retry of an unknown edit
        assert proxy.forwarded_sends == [200, 200, 200] and proxy.dropped == 1
        assert [e["event_id"] for e in hs.edits(world.room, sent.reply_id, carol)] == [edit["event_id"]]
        path = f"/rooms/{quote(world.room, safe='')}/send/m.room.message/{edit_txn_id(sent.reply_id, 'the whole answer')}"
        again = hs.api("PUT", path, hs.bot, json_body=_edit_content("the whole answer", sent.reply_id))
        assert again["event_id"] == edit["event_id"]  # the transaction's event, as the adapter's retry got it
        lossy.edit(parent, sent.reply_id, "the whole answer, grown")  # a new text is a new edit
        assert len(hs.edits(world.room, sent.reply_id, carol)) == 2
        assert hs.reply_text(world.room, sent.reply_id, carol) == "the whole answer, grown"
        assert world.replies(parent.id) == [sent.reply_id]
    finally:
        proxy.close()


def test_an_edit_refused_too_large_not_joined_rate_limited_foreign_or_redacted(world: World) -> None:
    """An edit whose event is over Synapse's 65,536 bytes (the text rides twice) is Rejected; a room the bot is not
    in hides the reply (404, Rejected); M_LIMIT_EXCEEDED is RateLimited with retry_after_ms; another's message
    or a redacted reply is Rejected before any edit is sent. Nothing is edited."""
    from tests.contract.proxy import FaultProxy, Rule
    from tests.fixtures_server import Reply

    hs, carol = world.hs, world.hs.people["carol"]
    parent = world.parent()
    sent = world.platform.send(parent, "Looking", provider_key=uuid.uuid4().hex)
    with pytest.raises(Rejected) as err:
        world.platform.edit(parent, sent.reply_id, "x" * 40_000)
    assert "M_TOO_LARGE" in err.value.detail
    alice = hs.people["alice"]
    other = hs.create_room(alice, invite_bot=False)
    elsewhere = Parent(id=parent.id, author_id=alice.user_id, extra={"room_id": other})
    with pytest.raises(Rejected) as err2:  # the reply read first is not there (Synapse hides the room: 404)
        world.platform.edit(elsewhere, sent.reply_id, "in a room the bot is not in")
    assert err2.value.status == 404 and "M_NOT_FOUND" in err2.value.detail
    proxy = FaultProxy(hs.base_url)
    try:
        limit = Reply(429, {"errcode": "M_LIMIT_EXCEEDED", "error": "Too Many Requests", "retry_after_ms": 2500})
        proxy.add(Rule("PUT", r"/send/m\.room\.message/replyd-edit-", answer=limit))
        with pytest.raises(RateLimited) as err3:
            world.adapter(proxy.url).edit(parent, sent.reply_id, "grown")
        assert err3.value.retry_after_s == 2.5 and proxy.rules[0].hits == 1
    finally:
        proxy.close()
    assert hs.edits(world.room, sent.reply_id, carol) == [] and hs.reply_text(world.room, sent.reply_id, carol) == "Looking"
    with pytest.raises(Rejected) as err4:  # alice's message: Synapse would take the edit, every client ignore it
        world.platform.edit(parent, parent.id, "not the bot's")
    assert "not one of the bot's" in err4.value.detail
    world.platform.delete(sent.reply_id)
    with pytest.raises(Rejected) as err5:  # a redacted reply: Synapse would take the edit, no client show it
        world.platform.edit(parent, sent.reply_id, "after the redaction")
    assert "redacted" in err5.value.detail
    assert hs.edits(world.room, sent.reply_id, carol) == [] and hs.edits(world.room, parent.id, carol) == []


def test_the_sweep_counts_no_edit_as_a_duplicate_even_one_carrying_in_reply_to(world: World) -> None:
    """Edits by the adapter and one by another client of the bot that (against the spec) keeps m.in_reply_to beside
    m.replace: the read-back finds one reply and a delete_newer sweep deletes nothing (an edit counted as a reply
    would be a "duplicate" it redacts)."""
    from urllib.parse import quote

    hs, carol = world.hs, world.hs.people["carol"]
    parent = world.parent()
    out = world.guard().post(parent, "Looking", path="inbox")
    world.platform.edit(parent, out.reply_id, "Looking into it")
    path = f"/rooms/{quote(world.room, safe='')}/send/m.room.message/{uuid.uuid4().hex}"
    hs.api("PUT", path, hs.bot, json_body=_edit_content("Looking into it, again", out.reply_id,
                                                       **{"m.in_reply_to": {"event_id": parent.id}}))
    opened = world.clock.now() - 5
    world.clock.advance(SEND_TIMEOUT_S + 60)
    res = Sweeper(world.store, [Bot(world.platform, world.me)], clock=world.clock, on_duplicate="delete_newer").run_once()
    assert (res.verified, res.duplicates) == (1, 0)
    rb = world.platform.read_back([Pending(parent, opened_at=opened)], sender_id=world.me.sender_id)
    assert [r.reply_id for r in rb.found[parent.id]] == [out.reply_id]
    assert len(hs.edits(world.room, out.reply_id, carol)) == 2  # nothing redacted
    assert hs.reply_text(world.room, out.reply_id, carol) == "Looking into it, again"
    assert world.replies(parent.id) == [out.reply_id]


def test_a_streamed_answer_is_one_reply_grown_by_edits_through_lost_edit_answers(world: World) -> None:
    """A streamed responder through the guard, every third send's answer lost (edits included): one reply whose
    latest replacement is the whole answer, no edit event made twice by a retry, and a delete_newer sweep that
    verifies one reply and deletes nothing."""
    from tests.test_stream import Streamer

    hs, carol = world.hs, world.hs.people["carol"]
    proxy = DropProxy(hs.base_url)
    try:
        lossy = world.adapter(proxy.url)
        parent = world.parent()
        proxy.drop_every = 3
        words = [f"w{i:02d}" for i in range(20)]
        out = world.guard(lossy).post(parent, Streamer(world.clock, words=words, step_s=0.4, asynchronous=False))
        assert out.status is Status.POSTED, out
        assert proxy.dropped >= 1, proxy.forwarded_sends
    finally:
        proxy.close()
    assert world.replies(parent.id) == [out.reply_id]
    edits = hs.edits(world.room, out.reply_id, carol)
    bodies = [e["content"]["m.new_content"]["body"] for e in edits]
    assert edits and len(bodies) == len(set(bodies))  # a retried edit is the same event, never a second one
    assert hs.reply_text(world.room, out.reply_id, carol) == " ".join(words)
    world.clock.advance(SEND_TIMEOUT_S + 60)
    res = Sweeper(world.store, [Bot(world.platform, world.me)], clock=world.clock, on_duplicate="delete_newer").run_once()
    assert (res.verified, res.duplicates) == (1, 0)
    assert len(hs.edits(world.room, out.reply_id, carol)) == len(edits)
