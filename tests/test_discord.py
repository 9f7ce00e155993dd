"""The Discord adapter against the stateful fake (tests/discord_fake.py) over real HTTP and a real WebSocket."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from replyd.clock import SystemClock
from replyd.errors import ConfigError, DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.platforms.base import Pending, ProviderKeys, make_platform
from replyd.platforms.discord import NONCE_LEN, DiscordPlatform, _resume_url, discord_nonce
from tests.discord_fake import BOT_ID, BOT_TOKENS, DiscordRest, DiscordWorld, Gateway

ALICE, BOB = "53908099506183680", "53908099506183681"


@pytest.fixture
def world() -> DiscordWorld:
    """A fresh guild with a nonce window of two minutes."""
    return DiscordWorld()


@pytest.fixture
def rest(world: DiscordWorld) -> Iterator[DiscordRest]:
    """The REST fake on an ephemeral port."""
    with DiscordRest(world) as api:
        yield api


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """A plain client (no proxies from the environment)."""
    with httpx.Client(trust_env=False) as c:
        yield c


def adapter(rest: DiscordRest, http: httpx.Client, **extra: Any) -> DiscordPlatform:
    """The adapter as the daemon builds it, by kind from settings."""
    settings = {"api_url": rest.url, "token": BOT_TOKENS[0], "listing_delay_s": 0, **extra}
    p = make_platform("discord", settings, http=http, clock=SystemClock())
    assert isinstance(p, DiscordPlatform)
    return p


def send_key(p: DiscordPlatform, parent_id: str) -> str:
    """The key the guard passes: the adapter's ProviderKeys answer."""
    assert isinstance(p, ProviderKeys)
    return p.provider_key(p.whoami().sender_id, parent_id)


def test_identity_and_a_reply_carries_nonce_reference_and_no_everyone_ping(world, rest, http) -> None:
    """whoami is /users/@me; the reply references the parent, enforces a 25-character nonce and pings no @everyone."""
    p = adapter(rest, http)
    assert p.whoami().sender_id == BOT_ID
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    key = send_key(p, pid)
    assert len(key) == NONCE_LEN and key == discord_nonce("discord", BOT_ID, pid)
    sent = p.send(p.resolve(pid), "hi @everyone", provider_key=key)
    [reply] = world.bot_replies(pid)
    assert sent.reply_id == f"{cid}:{reply.id}" and reply.nonce == key
    assert reply.reference == pid.partition(":")[2]
    assert "everyone" not in reply.mentions


def test_a_prompt_injection_pings_nobody_but_the_replied_author(world, rest, http) -> None:
    """A reply echoing @everyone, @here, a role and a stranger notifies only the author it replies to, sent and
    edited (the fake applies allowed_mentions as Discord does); ``allow_mentions`` lets them through."""
    from tests.test_mentions import INJECTION, injected

    p = adapter(rest, http)
    cid = world.add_channel()
    pid = world.say(cid, ALICE, f"{INJECTION} <@175928847299117063> <@&41771983423143936>")
    parent = p.resolve(pid)
    sent = p.send(parent, injected(parent), provider_key=send_key(p, pid))
    p.edit(parent, sent.reply_id, injected(parent) + " (edited)")
    [reply] = world.bot_replies(pid)
    assert reply.pinged == [ALICE] and reply.edits
    assert all(not re.search(r"@(everyone|here)\b", t) for t in world.history(sent.reply_id))
    loose = adapter(rest, http, allow_mentions=True)
    pid = world.say(cid, ALICE, f"{INJECTION} <@175928847299117063>")
    loose.send(loose.resolve(pid), injected(loose.resolve(pid)), provider_key=send_key(loose, pid))
    [reply] = world.bot_replies(pid)
    assert "everyone" in reply.pinged and "175928847299117063" in reply.pinged


def test_a_lost_answer_retried_with_the_same_nonce_gets_the_earlier_message(world, rest, http) -> None:
    """Created, answer lost (MaybeSent); the retry with the same key answers the first message: one on the fake."""
    p = adapter(rest, http)
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    parent = p.resolve(pid)
    world.create_faults = ["lost"]
    with pytest.raises(MaybeSent):
        p.send(parent, "first words", provider_key=send_key(p, pid))
    sent = p.send(parent, "reworded retry", provider_key=send_key(p, pid))
    assert [f"{cid}:{m.id}" for m in world.bot_replies(pid)] == [sent.reply_id]
    assert world.nonce_hits == 1


def test_a_slow_answer_timed_out_and_retried_while_it_lands_makes_one_message(world, rest, http) -> None:
    """The answer takes 1.5 s, the adapter waits 0.5 s (MaybeSent); the retry at once, same nonce: one message."""
    p = adapter(rest, http, timeout_s=0.5)
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    parent = p.resolve(pid)
    world.create_delay_s = 1.5
    with pytest.raises(MaybeSent):
        p.send(parent, "first", provider_key=send_key(p, pid))
    world.create_delay_s = 0.0
    sent = p.send(parent, "again", provider_key=send_key(p, pid))
    assert [f"{cid}:{m.id}" for m in world.bot_replies(pid)] == [sent.reply_id]


def test_past_the_nonce_window_the_read_back_finds_the_reply_by_author_and_reference(world, rest, http) -> None:
    """With a window of 0 s the nonce protects nothing: the read-back (author id + message_reference, never
    text) is what closes the row; the bot's unreferenced message and another author's reply do not count."""
    world.nonce_window_s = 0.0
    p = adapter(rest, http)
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    other = world.say(cid, BOB, "me too?")
    world.create_faults = ["lost"]
    with pytest.raises(MaybeSent):
        p.send(p.resolve(pid), "answer", provider_key=send_key(p, pid))
    world.say(cid, BOB, "answer", mention=False, reply_to=pid.partition(":")[2])  # same text, not the bot's
    world.create(cid, {"content": "answer"}, BOT_TOKENS[0])  # the bot's, but no reference
    rb = p.read_back([Pending(p.resolve(pid), time.time() - 5), Pending(p.resolve(other), time.time() - 5)],
                     sender_id=BOT_ID)
    assert rb.checked == {pid, other}
    assert [r.reply_id for r in rb.found[pid]] == [f"{cid}:{m.id}" for m in world.bot_replies(pid)]
    assert other not in rb.found


def test_read_back_is_one_walk_per_channel_and_a_failed_walk_checks_nothing(world, rest, http) -> None:
    """Three parents in one channel: one listing request; a 500 on it leaves all three unchecked."""
    p = adapter(rest, http)
    cid = world.add_channel()
    pids = [world.say(cid, ALICE, f"q{i}") for i in range(3)]
    pend = [Pending(p.resolve(x), time.time() - 5) for x in pids]
    before = rest.calls.get("messages GET", 0)
    assert p.read_back(pend, sender_id=BOT_ID).checked == set(pids)
    assert rest.calls["messages GET"] - before == 1
    world.read_faults = ["5xx"]
    assert p.read_back(pend, sender_id=BOT_ID).checked == set()


@pytest.mark.parametrize(("setup", "error"), [
    ("too_long", Rejected), ("forbidden", Rejected), ("parent_deleted", Rejected), ("error_before", MaybeSent),
    ("error_after", MaybeSent), ("nonce_deleted", Rejected),
])
def test_the_error_table(world, rest, http, setup, error) -> None:
    """50035, 50013, a deleted parent (fail_if_not_exists: nothing posted), 5xx, and 10008 for a nonce whose
    message was deleted (not posted again)."""
    p = adapter(rest, http)
    cid = world.add_channel(forbidden=setup == "forbidden")
    pid = world.say(cid, ALICE, "help?")
    parent = p.resolve(pid)
    text = "x" * 2001 if setup == "too_long" else "ok"
    if setup == "parent_deleted":
        world.find(cid, pid.partition(":")[2]).deleted = True  # type: ignore[union-attr]
    if setup in ("error_before", "error_after"):
        world.create_faults = [setup]
    if setup == "nonce_deleted":
        p.send(parent, "ok", provider_key=send_key(p, pid))
        world.bot_replies(pid)[0].deleted = True
    with pytest.raises(error):
        p.send(parent, text, provider_key=send_key(p, pid))
    made = 0 if setup in ("too_long", "forbidden", "parent_deleted", "error_before", "nonce_deleted") else 1
    assert len(world.bot_replies(pid)) == made


def test_rate_limits_block_the_bucket_or_everything(world, rest, http) -> None:
    """A bucket 429 (Retry-After 65) blocks that channel's creates, not reads; a global 429 blocks every request."""
    p = adapter(rest, http)
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    parent = p.resolve(pid)
    world.create_faults = ["ratelimited"]
    with pytest.raises(RateLimited) as got:
        p.send(parent, "ok", provider_key=send_key(p, pid))
    assert got.value.retry_after_s == 65
    n = world.create_requests
    with pytest.raises(RateLimited):
        p.send(parent, "ok", provider_key=send_key(p, pid))
    assert world.create_requests == n  # refused locally: nothing left
    p.resolve(pid)  # reads still go
    q = adapter(rest, http)
    world.create_faults = ["global"]
    with pytest.raises(RateLimited) as got:
        q.send(q.resolve(pid), "ok", provider_key=send_key(q, pid))
    assert got.value.retry_after_s == 2
    with pytest.raises(RateLimited):
        q.resolve(pid)


def test_a_bucket_limit_over_http_is_met_with_429s_and_nothing_doubles(world, rest, http) -> None:
    """The fake enforces 2 creates per 30 s per channel: the third is RateLimited, never sent."""
    world.bucket_limit = (2, 30.0)
    p = adapter(rest, http)
    cid = world.add_channel()
    pids = [world.say(cid, ALICE, f"q{i}") for i in range(3)]
    outcomes = []
    for pid in pids:
        try:
            p.send(p.resolve(pid), "ok", provider_key=send_key(p, pid))
            outcomes.append("sent")
        except RateLimited:
            outcomes.append("limited")
    assert "limited" in outcomes and sum(len(world.bot_replies(x)) for x in pids) == outcomes.count("sent")


def test_bad_token_is_definitely_not_sent(world, rest, http) -> None:
    """401 on /users/@me: DefinitelyNotSent, the token never in the detail."""
    p = adapter(rest, http, token="not-the-token-SECRET")
    with pytest.raises(DefinitelyNotSent) as got:
        p.whoami()
    assert "SECRET" not in got.value.detail


def test_inbox_finds_mentions_replies_to_the_bot_and_dms_only(world, rest, http) -> None:
    """The backstop poll: a mention, a reply to the bot's message and a DM; not a channel message for others."""
    cid, dm = world.add_channel(), world.add_channel(dm=True)
    p = adapter(rest, http, channels=[cid, dm])
    mention = world.say(cid, ALICE, "help?")
    world.say(cid, BOB, "chatter", mention=False)
    p.send(p.resolve(mention), "answer", provider_key=send_key(p, mention))
    mine = world.bot_replies(mention)[0].id
    reply = world.say(cid, BOB, "thanks bot", mention=False, reply_to=mine)
    private = world.say(dm, ALICE, "psst", mention=False)
    page = p.inbox(None)
    assert [x.id for x in page.parents] == [mention, reply, private]
    assert p.inbox(page.cursor).parents == []


def test_settings_errors_are_one_line_naming_the_key() -> None:
    """Bad settings: the key named, the token never echoed."""
    for raw, key in [({}, "token"), ({"token": "Bot SECRETSECRET"}, "token"),
                     ({"token": "t", "channels": ["#general"]}, "channels"),
                     ({"token": "t", "gateway_url": "ws://example.com"}, "gateway_url"),
                     ({"token": "t", "page_limit": 101}, "page_limit"),
                     ({"token": "t", "search_queries": ["x"]}, "search_queries")]:
        with pytest.raises(ConfigError) as got:
            DiscordPlatform.Settings.load("discord", raw)
        assert f"'{key}'" in str(got.value) and "SECRET" not in str(got.value)


# --- the Gateway ------------------------------------------------------------------------


def _collect(p: DiscordPlatform, out: list[str], stop: threading.Event) -> threading.Thread:
    """Run the adapter's stream as StreamRunner does (reconnect on end), collecting parent ids."""

    def run() -> None:
        while not stop.is_set():
            try:
                for parent in p.stream(stop):
                    out.append(parent.id)
            except Exception:
                pass
            stop.wait(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _until(cond: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not cond():
        time.sleep(0.05)
    assert cond()


def test_gateway_identify_dispatch_resume_with_seq_and_replays(world, http) -> None:
    """IDENTIFY, a mention dispatched; a forced reconnect RESUMEs with the last seq seen; a replay of
    already-seen events yields the same parent id again (the guard's key makes it harmless)."""
    gw = Gateway(world, heartbeat_ms=300, replay_seen=2)
    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            p = adapter(api, http)
            cid = world.add_channel()
            got: list[str] = []
            stop = threading.Event()
            t = _collect(p, got, stop)
            _until(lambda: gw.connections == 1)
            first = world.say(cid, ALICE, "one")
            world.say(cid, BOB, "not for the bot", mention=False)
            _until(lambda: first in got)
            # Bob's message is dispatched too (seq 3): wait until the client has read every dispatch, or the
            # seq it resumes with is one the test never saw.
            _until(lambda: p._session["seq"] == max(s.seq for s in gw.sessions.values()))
            seq_seen = p._session["seq"]
            gw.force_reconnect()
            _until(lambda: gw.resumes)
            assert gw.identifies == 1 and gw.resumes[0][1] == seq_seen
            second = world.say(cid, ALICE, "two")
            _until(lambda: second in got)
            assert got.count(first) == 2 and got.count(second) == 1  # the replayed one, same id
            stop.set()
            t.join(3)
    finally:
        gw.close()


def test_gateway_events_missed_while_down_come_on_resume(world, http) -> None:
    """A message dispatched while the client is away is replayed after RESUME (seq honoured, not from zero)."""
    gw = Gateway(world, heartbeat_ms=300)
    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            p = adapter(api, http)
            cid = world.add_channel()
            got: list[str] = []
            stop = threading.Event()
            t = _collect(p, got, stop)
            _until(lambda: gw.connections == 1)
            a = world.say(cid, ALICE, "a")
            _until(lambda: a in got)
            stop.set()
            t.join(3)
            missed = world.say(cid, ALICE, "while away")
            stop2 = threading.Event()
            t2 = _collect(p, got, stop2)
            _until(lambda: missed in got)
            assert got.count(a) == 1  # nothing before the seq again
            stop2.set()
            t2.join(3)
    finally:
        gw.close()


def test_gateway_invalid_session_identifies_afresh_and_4014_names_the_intent(world, http) -> None:
    """INVALID_SESSION d:false → a new IDENTIFY; asking for MESSAGE_CONTENT where it is not allowed → 4014."""
    gw = Gateway(world, heartbeat_ms=300)
    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            p = adapter(api, http)
            got: list[str] = []
            stop = threading.Event()
            t = _collect(p, got, stop)
            _until(lambda: gw.connections == 1)
            gw.invalidate(resumable=False)
            _until(lambda: gw.identifies == 2)
            stop.set()
            t.join(3)
            q = adapter(api, http, message_content=True)
            with pytest.raises(DefinitelyNotSent, match="MESSAGE_CONTENT"):
                list(q.stream(threading.Event()))
    finally:
        gw.close()


def test_gateway_zombie_connection_is_closed_and_resumed(world, http) -> None:
    """No heartbeat ACK: the adapter ends the connection and the next one RESUMEs."""
    gw = Gateway(world, heartbeat_ms=200)
    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            p = adapter(api, http)
            got: list[str] = []
            stop = threading.Event()
            gw.stop_acks = True
            t = _collect(p, got, stop)
            _until(lambda: gw.identifies == 1)
            _until(lambda: len(gw.resumes) >= 1, 5)
            stop.set()
            t.join(3)
    finally:
        gw.close()


def test_a_stored_session_resumes_after_a_restart_from_the_last_recorded_seq(world, http) -> None:
    """A process that yielded a DM but never came back for the next frame (it died before recording it) stored
    the seq before that DM: a new process RESUMEs the stored session (no IDENTIFY) and Discord replays the DM.
    Plant: counting a frame's seq before its parents are yielded stores the DM's seq and it is never replayed."""
    gw = Gateway(world, heartbeat_ms=300)
    slot: dict[str, str] = {}
    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            first = adapter(api, http)
            first.hold_session(lambda: slot.get("v"), lambda v: slot.__setitem__("v", v), "process-1")
            g = first.stream(threading.Event())
            got: list[Any] = []
            t = threading.Thread(target=lambda: got.append(next(g)), daemon=True)
            t.start()
            _until(lambda: gw.connections == 1)
            dm = world.say(world.add_channel(dm=True), ALICE, "hello?", mention=False)
            t.join(10)
            assert [x.id for x in got] == [dm]
            g.close()  # the reader stops here: the DM was read, never recorded
            stored = json.loads(slot["v"])
            (sid, session), = gw.sessions.items()
            dm_seq = next(n for n, f in session.events if f.get("t") == "MESSAGE_CREATE")
            assert stored["session_id"] == sid and stored["seq"] < dm_seq and BOT_TOKENS[0] not in slot["v"]
            second = adapter(api, http)
            second.hold_session(lambda: slot.get("v"), lambda v: slot.__setitem__("v", v), "process-2")
            again: list[str] = []
            stop = threading.Event()
            t2 = _collect(second, again, stop)
            _until(lambda: dm in again)
            assert gw.identifies == 1 and gw.resumes == [(sid, stored["seq"])]
            _until(lambda: json.loads(slot["v"])["seq"] >= dm_seq and json.loads(slot["v"])["holder"] == "process-2")
            stop.set()
            t2.join(3)
    finally:
        gw.close()


def test_a_process_that_loads_a_live_session_takes_the_slot_and_the_other_identifies(world, http) -> None:
    """Two processes on one slot (replica_id left empty): B, starting, RESUMEs the session A stored and holds the
    slot; A, at its next connect, sees its session taken and IDENTIFYs a new one, and never writes over B's.
    Plant: saving without the holder check makes A write its new session over B's and the slot flips."""
    gw = Gateway(world, heartbeat_ms=200)
    slot: dict[str, str] = {}
    stops = [threading.Event(), threading.Event()]

    def hold(p: DiscordPlatform, name: str) -> DiscordPlatform:
        p.hold_session(lambda: slot.get("v"), lambda v: slot.__setitem__("v", v), name)
        return p

    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            got_a: list[str] = []
            t_a = _collect(hold(adapter(api, http), "A"), got_a, stops[0])
            _until(lambda: "v" in slot and json.loads(slot["v"])["holder"] == "A")
            first = json.loads(slot["v"])["session_id"]
            got_b: list[str] = []
            t_b = _collect(hold(adapter(api, http), "B"), got_b, stops[1])
            _until(lambda: gw.resumes and json.loads(slot["v"])["holder"] == "B")
            assert gw.resumes[0][0] == first and gw.identifies == 1
            gw.force_reconnect()  # both reconnect: B resumes the session, A identifies afresh
            _until(lambda: gw.identifies == 2 and gw.connections == 2)
            time.sleep(1.0)  # five heartbeats: A's saves meet B's fresh slot
            stored = json.loads(slot["v"])
            assert stored["holder"] == "B" and stored["session_id"] == first
            dm = world.say(world.add_channel(dm=True), ALICE, "to both", mention=False)
            _until(lambda: dm in got_a and dm in got_b)
            for stop, t in zip(stops, (t_a, t_b), strict=True):
                stop.set()
                t.join(3)
    finally:
        gw.close()


def test_a_resume_url_the_token_must_not_travel_to_is_never_kept() -> None:
    """READY's (or the stored) resume URL: wss://, or ws:// to loopback only (RESUME carries the token)."""
    assert _resume_url("wss://gateway-us-east1-b.discord.gg") == "wss://gateway-us-east1-b.discord.gg"
    assert _resume_url("ws://127.0.0.1:8080") == "ws://127.0.0.1:8080"
    assert [_resume_url(u) for u in ("ws://gateway.example.com", "https://discord.gg", "wss://", 7, None)] == [None] * 5


def test_thread_depth_walks_the_reference_chain_one_request_a_level(world, rest, http) -> None:
    """ThreadDepth: a top-level message is 0; a reply three deep is 3; the walk stops at limit + 1."""
    from replyd.platforms.base import ThreadDepth

    p = adapter(rest, http)
    assert isinstance(p, ThreadDepth)
    cid = world.add_channel()
    top = world.say(cid, ALICE, "top")
    chain = [top]
    for i in range(3):
        chain.append(world.say(cid, BOB if i % 2 == 0 else ALICE, f"re {i}", reply_to=chain[-1].partition(":")[2]))
    assert p.thread_depth(p.resolve(top), 10) == 0
    deepest = p.resolve(chain[-1])
    assert p.thread_depth(deepest, 10) == 3
    assert p.thread_depth(deepest, 1) == 2  # capped at limit + 1, like every adapter's
    assert p.thread_depth(deepest, 0) == 1  # a reply with limit 0: no request needed


# --- edits (EditReply) and answers in parts (PostLimit) -----------------------------------------


def _sent(p: DiscordPlatform, world: DiscordWorld, text: str = "first words") -> tuple[Any, str]:
    """A person's mention and the bot's reply to it: (parent, reply id)."""
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    parent = p.resolve(pid)
    return parent, p.send(parent, text, provider_key=send_key(p, pid)).reply_id


def test_an_edit_sets_the_content_and_the_fake_keeps_its_history(world, rest, http) -> None:
    """EditReply over HTTP: the message's content is the last text set (the fake's ground truth), each edit in
    its history, the same text again is harmless, and no new message is made."""
    from replyd.platforms.base import EditReply

    p = adapter(rest, http)
    assert isinstance(p, EditReply)
    parent, rid = _sent(p, world)
    p.edit(parent, rid, "first words, and more")
    p.edit(parent, rid, "first words, and more, and the end")
    p.edit(parent, rid, "first words, and more, and the end")
    assert world.text(rid) == "first words, and more, and the end"
    end = "first words, and more, and the end"
    assert world.history(rid) == ["first words, and more", end, end]
    assert [f"{m.channel_id}:{m.id}" for m in world.bot_replies(parent.id)] == [rid]


@pytest.mark.parametrize(("fault", "error", "acted"), [
    ("lost", MaybeSent, True), ("error_after", MaybeSent, True), ("error_before", MaybeSent, False),
])
def test_an_edit_whose_answer_is_lost_may_have_acted_and_is_safe_to_repeat(world, rest, http, fault, error,
                                                                          acted) -> None:
    """A dropped answer or a 5xx is MaybeSent (the fake tells whether it acted); the repeat sets the same text."""
    p = adapter(rest, http)
    parent, rid = _sent(p, world)
    world.edit_faults = [fault]
    with pytest.raises(error):
        p.edit(parent, rid, "grown answer")
    assert world.text(rid) == ("grown answer" if acted else "first words")
    p.edit(parent, rid, "grown answer")
    assert world.text(rid) == "grown answer" and len(world.bot_replies(parent.id)) == 1


def test_an_edit_rate_limited_waits_and_sends_nothing_meanwhile(world, rest, http) -> None:
    """A bucket 429 on the edit is RateLimited with Retry-After; the next edit is refused locally, not sent."""
    p = adapter(rest, http)
    parent, rid = _sent(p, world)
    world.edit_faults = ["ratelimited"]
    with pytest.raises(RateLimited) as got:
        p.edit(parent, rid, "grown")
    assert got.value.retry_after_s == 65
    n = world.edit_requests
    with pytest.raises(RateLimited):
        p.edit(parent, rid, "grown")
    assert world.edit_requests == n and world.text(rid) == "first words"


@pytest.mark.parametrize("case", ["gone", "not_ours", "too_long", "empty"])
def test_an_edit_the_platform_refuses_is_rejected_and_changes_nothing(world, rest, http, case) -> None:
    """10008 (deleted), 50005 (another author's message), 50035 (over 2,000 code points, empty): Rejected."""
    p = adapter(rest, http)
    parent, rid = _sent(p, world)
    target, text = rid, "new text"
    if case == "gone":
        p.delete(rid)
    if case == "not_ours":
        target = parent.id  # Alice's message
    if case == "too_long":
        text = "é" * 2001
    if case == "empty":
        text = ""
    with pytest.raises(Rejected) as got:
        p.edit(parent, target, text)
    assert got.value.status == {"gone": 404, "not_ours": 403}.get(case, 400)
    if case != "gone":
        assert world.text(rid) == "first words" and world.text(parent.id).endswith("help?")


def test_the_post_limit_is_2000_code_points_and_the_fake_refuses_one_more(world, rest, http) -> None:
    """PostLimit: 2,000 in replyd.parts' "chars" (code points, Discord's unit): 2,000 emoji go, 2,001 are 50035."""
    from replyd.platforms.base import PostLimit

    p = adapter(rest, http)
    assert isinstance(p, PostLimit)
    cid = world.add_channel()
    pid = world.say(cid, ALICE, "help?")
    limit = p.post_limit(p.resolve(pid))
    assert (limit.size, limit.unit) == (2000, "chars")
    with pytest.raises(Rejected):
        p.send(p.resolve(pid), "👍" * 2001, provider_key=send_key(p, pid))
    sent = p.send(p.resolve(pid), "👍" * 2000, provider_key=send_key(p, pid))
    assert world.text(sent.reply_id) == "👍" * 2000


# --- a 3-part answer through the real guard and sweep, on SQLite and PostgreSQL ----------------------

LONG = " ".join(f"Sentence {i} of a long answer, which says something worth reading." for i in range(75))


@pytest.fixture
def clock():
    """The store's fake clock at today's time: the fake's snowflakes are made on it."""
    from replyd.clock import FakeClock

    return FakeClock(time.time())


@pytest.fixture
def chain(store, clock, http):
    """A Discord fake on the fake clock, its adapter, a guard and a sweeper over ``store``."""
    from replyd.guard import Guard
    from replyd.sweep import Bot, Sweeper

    w = DiscordWorld(now=clock.now)
    with DiscordRest(w) as api:
        p = make_platform("discord", {"api_url": api.url, "token": BOT_TOKENS[0], "listing_delay_s": 0},
                          http=http, clock=clock)
        g = Guard(store, p, p.whoami(), clock=clock, send_timeout_s=5.0, watch_interval_s=None)
        yield w, api, p, g, Sweeper(store, [Bot(p, p.whoami())], clock=clock, retry_s=1.0)


def _thread(w: DiscordWorld, parent_id: str) -> list[Any]:
    """The bot's messages from ``parent_id`` down the reference chain (each part answering the one before)."""
    cid, _, at = parent_id.partition(":")
    out = []
    while True:
        kids = [m for m in w.channels[cid].messages if m.author_id == BOT_ID and m.reference == at and not m.deleted]
        assert len(kids) <= 1, f"{len(kids)} bot messages answer {at}"
        if not kids:
            return out
        out.append(kids[0])
        at = kids[0].id


def test_a_three_part_answer_is_three_messages_in_a_reference_chain(chain, store) -> None:
    """One message per part, in order, each a reply to the one before; each part's row closed with its message."""
    from replyd import store as st
    from replyd.guard import Status
    from replyd.parts import Limit, part_id, split

    w, _api, p, g, _ = chain
    cid = w.add_channel()
    pid = w.say(cid, ALICE, "tell me everything")
    parts = split(LONG, Limit(2000))
    assert len(parts) == 3
    out = g.post(p.resolve(pid), LONG)
    assert out.status is Status.POSTED and [x.state for x in out.parts] == [st.CLOSED] * 3
    msgs = _thread(w, pid)
    assert [m.content for m in msgs] == parts
    assert sum(m.author_id == BOT_ID for m in w.channels[cid].messages) == 3
    for k, m in enumerate(msgs, 1):
        assert store.peek(g.key(part_id(pid, k))).reply_id == f"{cid}:{m.id}"


def test_a_lost_part_two_is_closed_by_the_sweep_with_its_own_message(chain, store, clock) -> None:
    """Part 2's answer lost: the sweep's read-back (author + message_reference to part 1) closes part 2's row with
    part 2's own message; the next offer sends part 3 as a reply to it. Nothing is sent twice."""
    from replyd import store as st
    from replyd.guard import Status
    from replyd.parts import part_id

    w, _api, p, g, sweeper = chain
    w.nonce_window_s = 0.0  # the nonce cannot save the retry: only the read-back can close the row
    cid = w.add_channel()
    pid = w.say(cid, ALICE, "tell me everything")
    parent = p.resolve(pid)
    w.create_faults = [None, "lost"]  # type: ignore[list-item]
    assert g.post(parent, LONG).status is Status.UNCERTAIN
    assert w.lost_answers == 1
    clock.advance(30)
    sweeper.run_once()
    first, second = [m for m in w.channels[cid].messages if m.author_id == BOT_ID]  # in the order they were made
    row = store.peek(g.key(part_id(pid, 2)))
    assert row.state == st.CLOSED and row.reply_id == f"{cid}:{second.id}"  # plant: part 1's id, or left open
    assert [m.id for m in _thread(w, pid)] == [first.id, second.id]
    assert g.post(parent, LONG).status is Status.POSTED
    msgs = _thread(w, pid)
    assert [m.id for m in msgs[:2]] == [first.id, second.id] and len(msgs) == 3
    assert sum(m.author_id == BOT_ID for m in w.channels[cid].messages) == 3 and w.create_requests == 3


def test_the_bots_own_parts_are_never_offered_and_a_reply_to_one_is(chain, http) -> None:
    """The backstop poll and resolve skip the bot's parts; a person's reply to part 2 is offered and addresses
    the bot (Addressing); a part's parent does not claim to address it."""
    w, api, _p, g, _ = chain
    cid = w.add_channel()
    pid = w.say(cid, ALICE, "tell me everything")
    p = make_platform("discord", {"api_url": api.url, "token": BOT_TOKENS[0], "channels": [cid]}, http=http,
                      clock=g.clock)
    page = p.inbox(None)
    assert [x.id for x in page.parents] == [pid]
    g.post(page.parents[0], LONG)
    part2 = _thread(w, pid)[1]
    assert p.inbox(page.cursor).parents == []
    with pytest.raises(Rejected):
        p.resolve(f"{cid}:{part2.id}")  # an own message is never a parent
    later = w.say(cid, BOB, "thanks, but why?", mention=False, reply_to=part2.id)
    [offered] = p.inbox(page.cursor).parents
    assert offered.id == later and p.addresses(offered, p.whoami())
    assert p.addresses(page.parents[0], p.whoami())
    assert not p.addresses(p.part_parent(page.parents[0], f"{cid}:{part2.id}"), p.whoami())


@contextlib.contextmanager
def _streaming(world: DiscordWorld, http: httpx.Client) -> Iterator[tuple[Gateway, DiscordPlatform, list[str]]]:
    """A Gateway and REST fake, an adapter streaming from it (connected) and the parent ids it yields."""
    gw = Gateway(world, heartbeat_ms=300)
    stop = threading.Event()
    try:
        with DiscordRest(world, gateway_url=gw.url) as api:
            p = adapter(api, http)
            got: list[str] = []
            t = _collect(p, got, stop)
            _until(lambda: gw.connections == 1)
            try:
                yield gw, p, got
            finally:
                stop.set()
                t.join(3)
    finally:
        gw.close()


def test_edits_heard_on_the_gateway_are_never_parents(world, http) -> None:
    """The Gateway dispatches MESSAGE_UPDATE for the bot's edits (and a person's): the stream offers only the
    mentions' MESSAGE_CREATE, once each."""
    with _streaming(world, http) as (gw, p, got):
        cid = world.add_channel()
        pid = world.say(cid, ALICE, "help?")
        _until(lambda: pid in got)
        rid = p.send(p.resolve(pid), "part one", provider_key=send_key(p, pid)).reply_id
        p.edit(p.resolve(pid), rid, "part one, grown")
        world.amend(pid, f"<@{BOT_ID}> help? (edited)")
        later = world.say(cid, BOB, "and me?")
        _until(lambda: later in got)
        sent = [s for s in gw.sessions.values()][0].events
        assert sum(f.get("t") == "MESSAGE_UPDATE" for _seq, f in sent) == 2
        assert got == [pid, later]  # plant: MESSAGE_UPDATE read as a new message offers Alice's edit again


def test_an_interaction_answer_is_edited_through_its_original_response(world, rest, http) -> None:
    """An interaction's first part is its deferred response: an edit PATCHes @original with the token held; a
    process that does not hold the token edits nothing (DefinitelyNotSent)."""
    from tests.discord_fake import InteractionSender, Msg

    p = adapter(rest, http)
    cid = world.add_channel()
    sender = InteractionSender(world, [])
    try:
        [parent] = p.parse_webhook("interaction", sender.payload(cid, ALICE, "why?"))  # type: ignore[misc]
    finally:
        sender.close()
    it = world.interactions[parent.id]
    it.original = Msg(world.snowflake(), cid, BOT_ID, "")  # the deferred response Discord made on the type 5
    world.channels[cid].messages.append(it.original)
    rid = p.send(parent, "the start", provider_key=send_key(p, parent.id)).reply_id
    p.edit(parent, rid, "the start, and the rest")
    assert world.text(rid) == "the start, and the rest" and it.edits == 2
    with pytest.raises(DefinitelyNotSent):
        adapter(rest, http).edit(parent, rid, "from elsewhere")
    assert world.text(rid) == "the start, and the rest"


def test_a_streamed_answer_is_one_message_per_part_grown_by_edits(chain, store, clock) -> None:
    """A streamed responder through the real guard: each part posted once (a reference chain), grown by Edit
    Message over HTTP; the messages' final contents are the whole answer, each within 2,000 code points."""
    from replyd import store as st
    from replyd.guard import Guard, Status
    from tests.test_stream import Streamer

    w, _api, p, _g, _ = chain
    g = Guard(store, p, p.whoami(), clock=clock, send_timeout_s=5.0, watch_interval_s=None, compose_lease_s=60.0,
              stream_edit_interval_s=1.0)
    words = [f"word{i:03d}-" + "x" * 40 for i in range(100)]  # 100 words of 48: 4,899 characters
    cid = w.add_channel()
    pid = w.say(cid, ALICE, "stream it")
    out = g.post(p.resolve(pid), Streamer(clock, words=words))
    assert out.status is Status.POSTED, out
    msgs = _thread(w, pid)
    assert len(msgs) == len(out.parts) == 3 and all(len(m.content) <= 2000 for m in msgs)
    assert " ".join(m.content for m in msgs) == " ".join(words)
    assert sum(len(m.edits) for m in msgs) >= len(msgs) and w.edit_requests == sum(len(m.edits) for m in msgs)
    assert sum(m.author_id == BOT_ID for m in w.channels[cid].messages) == 3
    assert store.peek(g.key(pid)).state == st.CLOSED
