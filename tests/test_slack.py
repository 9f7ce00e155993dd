"""The Slack adapter against the stateful fake over real HTTP and WebSocket; replies counted by the fake.

Covers the adapter contract (identity, resolve, send created / lost / refused / rate-limited / 5xx,
read-back found / not found / partial / failed, delete, paging, settings errors), the Events API
receiver (v0 signatures, the replay window, url_verification, retries) and Socket Mode (acks,
redelivery after a reconnect, disconnect).
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from replyd.clock import FakeClock, SystemClock
from replyd.errors import ConfigError, DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.hooks import Hook, Receiver, slack_sign, slack_verify
from replyd.platforms.base import EditReply, Parent, Pending, PostLimit, ThreadDepth
from replyd.platforms.slack import SlackPlatform, ts_order
from tests.slack_fake import (
    APP_TOKEN,
    BOT_TOKENS,
    BOT_USER,
    SIGNING_SECRET,
    SlackWebApi,
    SlackWorld,
    SocketServer,
    fixture,
)
from tests.test_daemon import wait_until

GENERAL, RANDOM, DM, ALICE = "C0GENERAL1", "C0RANDOM01", "D0DM000001", "U0ALICE001"


@pytest.fixture
def world() -> SlackWorld:
    """A workspace with the bot in #general and a DM, and #random without it."""
    w = SlackWorld()
    w.add_channel(GENERAL, BOT_USER, ALICE)
    w.add_channel(DM, BOT_USER, ALICE)
    w.add_channel(RANDOM, ALICE)
    return w


@pytest.fixture
def socket_server(world: SlackWorld) -> Iterator[SocketServer]:
    """The Socket Mode side of the fake."""
    s = SocketServer(world)
    yield s
    s.close()


@pytest.fixture
def api(world: SlackWorld, socket_server: SocketServer) -> Iterator[SlackWebApi]:
    """The Web API side of the fake on a real HTTP server."""
    with SlackWebApi(world, socket_url=socket_server.url) as a:
        yield a


def make(api: SlackWebApi, clock: Any = None, **settings: Any) -> SlackPlatform:
    """An adapter for the fake's bot, identified (as the daemon does at start)."""
    plat = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "app_token": APP_TOKEN, "api_url": api.url,
                                        **settings}, http=httpx.Client(timeout=5.0), clock=clock or SystemClock())
    plat.whoami()
    return plat


def mention(world: SlackWorld, text: str = "can you help?", **kw: Any) -> str:
    """Alice names the bot in #general; the parent id as served."""
    return world.say(GENERAL, ALICE, f"<@{BOT_USER}> {text}", **kw)


# -- identity, settings --------------------------------------------------------------------------


def test_identity_is_the_bot_user_id_and_the_token_never_shows(api) -> None:
    """auth.test's user_id is the sender id; the token is in no repr, log line or error."""
    with capture_logs() as logs:
        plat = make(api)
        assert plat.whoami().sender_id == BOT_USER and plat.instance == "slack"
        with pytest.raises(DefinitelyNotSent) as bad:
            SlackPlatform.from_settings({"token": "xoxb-0000-not-a-known-token", "api_url": api.url},
                                        http=httpx.Client(), clock=SystemClock()).whoami()
    assert "invalid_auth" in bad.value.detail
    api.world.read_faults["conversations.replies"] = ["echo"]  # an error text repeating the token
    with pytest.raises(Rejected) as echoed:
        plat.resolve(mention(api.world))
    assert echoed.value.detail == "conversations.replies: unexpected_error"
    text = json.dumps(logs, default=str) + repr(plat) + repr(plat.s) + str(bad.value)
    assert BOT_TOKENS[0] not in text and APP_TOKEN not in text and "xoxb-0000" not in text


@pytest.mark.parametrize(("settings", "key", "words"), [
    ({}, "token", "required"),
    ({"token": "xoxp-user-token"}, "token", "bot token"),
    ({"token": "xoxb-1", "app_token": "xoxb-2"}, "app_token", "app-level token"),
    ({"token": "xoxb-1", "colour": "red"}, "colour", "unknown key"),
    ({"token": "xoxb-1", "channels": ["#general"]}, "channels", "channel ids"),
    ({"token": "xoxb-1", "api_url": "http://slack.example/api"}, "api_url", "clear text"),
    ({"token": "xoxb-1", "page_limit": 5000}, "page_limit", "999"),
    ({"token": "xoxb-1", "rate_per_minute": {"chat.postMessage": 0}}, "rate_per_minute", "at least 1"),
    ({"token": "xoxb-1", "search_queries": ["help"]}, "search_queries", "user token"),
    ({"token": "xoxb-1", "max_post_chars": 40_001}, "max_post_chars", "40000"),  # Slack truncates past it
    ({"token": "xoxb-1", "max_post_chars": 10}, "max_post_chars", "20"),
])
def test_settings_errors_are_one_line_naming_the_key(settings, key, words) -> None:
    """Each bad setting is one ConfigError line naming the key; a token's value is never echoed."""
    with pytest.raises(ConfigError) as err:
        SlackPlatform.from_settings(settings, http=httpx.Client(), clock=SystemClock())
    msg = str(err.value)
    assert f"slack setting '{key}'" in msg and words in msg and "\n" not in msg
    assert "xoxp-user-token" not in msg and "xoxb-2" not in msg


# -- parsing: the Events API's published shapes -----------------------------------------------------


def test_published_events_parse_to_the_served_id_and_both_events_of_a_mention_are_one_parent(api, world) -> None:
    """app_mention and message.im (Slack's examples) give '<channel>:<ts>'; message + app_mention of one
    mention are the same parent; own, edited, bot and unaddressed messages are none."""
    plat = make(api)
    ex = fixture("event_app_mention")
    ex["event"]["text"] = f"<@{BOT_USER}> what time is it?"
    [p] = plat.parse_webhook("", ex)
    assert p.id == f"{ex['event']['channel']}:{ex['event']['ts']}" and p.extra["thread_ts"] is None
    trailing = {**ex, "event": {**ex["event"], "ts": "1700000000.000100"}}  # a float would drop the zeros
    assert [x.id for x in plat.parse_webhook("", trailing)] == [f"{ex['event']['channel']}:1700000000.000100"]
    [d] = plat.parse_webhook("", fixture("event_message_im"))
    assert d.id == "D024BE91L:1355517523.000005" and d.author_id == "U2147483697"
    pid = mention(world)
    ch = world.channels[GENERAL]
    msg_ev, mention_ev = world.events_for(ch, ch.messages[-1])
    assert msg_ev["event_id"] != mention_ev["event_id"]
    assert [x.id for x in plat.parse_webhook("", msg_ev)] == [x.id for x in plat.parse_webhook("", mention_ev)] == [pid]
    own = {**msg_ev, "event": {**msg_ev["event"], "user": BOT_USER}}
    edited = {**msg_ev, "event": {**msg_ev["event"], "subtype": "message_changed"}}
    bot = {**msg_ev, "event": {**msg_ev["event"], "subtype": "bot_message"}}
    plain = {**msg_ev, "event": {**msg_ev["event"], "text": "no name here"}}
    assert plat.parse_webhook("", own) == "own message"
    assert "message_changed" in plat.parse_webhook("", edited) and "bot_message" in plat.parse_webhook("", bot)
    [unaddressed] = plat.parse_webhook("", plain)  # a parent, outside the scope: dropped, counted (not ignored)
    assert plat.webhook_scope("", plain, unaddressed) == "not_addressed"
    assert plat.webhook_scope("", msg_ev, plat.parse_webhook("", msg_ev)[0]) is None
    assert plat.webhook_challenge(fixture("url_verification")) == {"challenge": fixture("url_verification")["challenge"]}
    assert plat.webhook_challenge(msg_ev) is None


def test_a_thread_reply_is_answered_in_its_thread(api, world) -> None:
    """A mention inside a thread is its own parent, answered with thread_ts = the thread's root."""
    plat = make(api)
    root = world.say(GENERAL, ALICE, "a question for everyone")
    root_ts = root.partition(":")[2]
    inner = mention(world, "and you?", thread_ts=root_ts)
    [p] = [x for x in plat.inbox(None).parents if x.id == inner] or [plat.resolve(inner)]
    assert p.extra["thread_ts"] == root_ts and p.thread_depth == 1
    plat.send(p, "here", provider_key="k")
    [reply] = world.thread_replies(root)
    assert reply.thread_ts == root_ts and reply.metadata["event_payload"]["parent"] == inner


def test_thread_depth_is_one_inside_a_thread_and_zero_outside(api, world) -> None:
    """Slack threads are flat: the max_depth policy sees 1 for a message in a thread, 0 for any other, with no request."""
    plat = make(api)
    root = world.say(GENERAL, ALICE, "a question for everyone")
    inner = plat.resolve(mention(world, "and you?", thread_ts=root.partition(":")[2]))
    top = plat.resolve(mention(world, "a new question"))
    assert isinstance(plat, ThreadDepth)
    assert (plat.thread_depth(inner, 5), plat.thread_depth(top, 5)) == (1, 0)


# -- resolve -----------------------------------------------------------------------------------------


def test_resolve_a_served_id_or_a_permalink(api, world) -> None:
    """The served id and the archive permalink give the same parent; unknown and malformed refs are refused."""
    plat = make(api)
    pid = world.say(GENERAL, ALICE, "no mention, named by an operator")
    ts = pid.partition(":")[2]
    by_id = plat.resolve(pid)
    by_link = plat.resolve(f"https://acme.slack.com/archives/{GENERAL}/p{ts.replace('.', '')}")
    assert by_id == by_link and by_id.id == pid
    with pytest.raises(Rejected, match="thread_not_found"):
        plat.resolve(f"{GENERAL}:1000000000.000001")
    with pytest.raises(Rejected, match="channel_not_found"):
        plat.resolve(f"C0NOWHERE1:{ts}")
    with pytest.raises(Rejected, match="expected"):
        plat.resolve("general 12.5")


# -- send --------------------------------------------------------------------------------------------


def test_send_created_lands_once_in_the_parents_thread(api, world) -> None:
    """A send is one message in the parent's thread, tagged with the parent id; the reply id is '<channel>:<ts>'."""
    plat = make(api)
    pid = mention(world)
    sent = plat.send(plat.resolve(pid), "on it", provider_key="key-1")
    [reply] = world.bot_replies(pid)
    assert sent.reply_id == f"{GENERAL}:{reply.ts}" and reply.thread_ts == pid.partition(":")[2]
    assert reply.metadata == {"event_type": "replyd_reply", "event_payload": {"parent": pid}}


def test_a_prompt_injection_pings_nobody_but_the_author(api, world) -> None:
    """A reply echoing <!channel>, <!here>, <!everyone>, a user group and a stranger keeps only the author's
    mention live, sent and edited (Slack's history is the ground truth); ``allow_mentions`` lets them through."""
    from tests.test_mentions import INJECTION, injected, slack_pings

    plat = make(api)
    parent = plat.resolve(mention(world, f"{INJECTION} <@{ALICE}>"))
    sent = plat.send(parent, injected(parent), provider_key="key-1")
    plat.edit(parent, sent.reply_id, injected(parent) + " (edited)")
    assert [slack_pings(t) for t in world.history_of(sent.reply_id)] == [[f"@{ALICE}"]] * 2
    loose = make(api, allow_mentions=True).send(parent, injected(parent), provider_key="key-2")
    assert "!channel" in slack_pings(world.text_of(loose.reply_id))


def test_send_lost_response_is_maybe_sent_and_the_read_back_finds_it(api, world) -> None:
    """The message was created and the answer lost: MaybeSent, and the read-back names the reply."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    world.post_faults = ["lost"]
    with pytest.raises(MaybeSent):
        plat.send(parent, "on it", provider_key="k")
    [reply] = world.bot_replies(parent.id)
    rb = plat.read_back([Pending(parent, time.time())], sender_id=BOT_USER)
    assert parent.id in rb.checked and [r.reply_id for r in rb.found[parent.id]] == [f"{GENERAL}:{reply.ts}"]


@pytest.mark.parametrize(("fault", "created"), [("error_after", 1), ("error_before", 0)])
def test_send_5xx_is_maybe_sent(api, world, fault, created) -> None:
    """A 5xx after the request left may have posted (Slack cannot say): MaybeSent either way."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    world.post_faults = [fault]
    with pytest.raises(MaybeSent):
        plat.send(parent, "on it", provider_key="k")
    assert len(world.bot_replies(parent.id)) == created


def test_send_refused_by_the_error_table(api, world) -> None:
    """channel_not_found, not_in_channel, msg_too_long are Rejected; invalid_auth is DefinitelyNotSent."""
    plat = make(api)
    ts = mention(world).partition(":")[2]
    world.too_long = "refuse"  # msg_too_long has no published threshold: the fake refuses past 40,000 when asked
    for channel, text, code in (("C0GONE0001", "x", "channel_not_found"), (RANDOM, "x", "not_in_channel"),
                                (GENERAL, "x" * 40_001, "msg_too_long")):
        with pytest.raises(Rejected, match=code):
            plat.send(Parent(id=f"{channel}:{ts}", author_id=ALICE), text, provider_key="k")
    world.tokens = ("xoxb-rotated",)
    with pytest.raises(DefinitelyNotSent, match="invalid_auth"):
        plat.send(Parent(id=f"{GENERAL}:{ts}", author_id=ALICE), "x", provider_key="k")
    assert world.bot_replies(f"{GENERAL}:{ts}") == []


def test_send_ratelimited_honours_retry_after_before_sending_again(api, world) -> None:
    """HTTP 429 + Retry-After is RateLimited with that wait; until it passes the adapter refuses without a request."""
    clock = FakeClock(time.time())
    plat = make(api, clock)
    parent = plat.resolve(mention(world))
    world.post_faults = ["ratelimited"]
    with pytest.raises(RateLimited) as first:
        plat.send(parent, "on it", provider_key="k")
    assert first.value.retry_after_s == 1.0 and world.post_requests == 1
    with pytest.raises(RateLimited):
        plat.send(parent, "on it", provider_key="k")
    assert world.post_requests == 1 and world.bot_replies(parent.id) == []  # refused here, nothing sent
    clock.advance(1.5)
    plat.send(parent, "on it", provider_key="k")
    assert world.post_requests == 2 and len(world.bot_replies(parent.id)) == 1


def test_a_429_without_retry_after_blocks_the_method_for_a_minute(api, world) -> None:
    """A 429 naming no wait still stops that method (60 s on the injected clock); other methods go on."""
    clock = FakeClock(time.time())
    plat = make(api, clock)
    pid = mention(world)
    world.read_faults["conversations.replies"] = ["ratelimited_bare"]
    with pytest.raises(RateLimited):
        plat.resolve(pid)
    with pytest.raises(RateLimited, match="not sent"):
        plat.resolve(pid)
    assert api.calls["conversations.replies"] == 1
    plat.inbox(None)  # conversations.history is another method's budget
    clock.advance(61.0)
    assert plat.resolve(pid).id == pid and api.calls["conversations.replies"] == 2


def test_method_tier_budget_refuses_before_sending(api, world) -> None:
    """A method's per-minute budget (its tier) refuses locally once spent and refills on the injected clock."""
    clock = FakeClock(time.time())
    plat = make(api, clock, rate_per_minute={"conversations.replies": 2}, channels=[GENERAL])
    pid = mention(world)
    plat.resolve(pid)
    plat.resolve(pid)
    with pytest.raises(RateLimited, match="tier budget") as spent:
        plat.resolve(pid)
    assert api.calls["conversations.replies"] == 2 and spent.value.retry_after_s == pytest.approx(30.0)
    clock.advance(30.0)
    assert plat.resolve(pid).id == pid and api.calls["conversations.replies"] == 3


def test_a_text_past_40000_characters_lands_truncated_and_is_logged(api, world) -> None:
    """Slack posts text past 40,000 characters cut there, with the message_truncated warning: it landed (no
    error to retry), the adapter says so in its log."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    with capture_logs() as logs:
        sent = plat.send(parent, "y" * 40_005, provider_key="k")
    assert world.text_of(sent.reply_id) == "y" * 40_000
    assert [e["method"] for e in logs if e["event"] == "replyd.slack.truncated"] == ["chat.postMessage"]


# -- edit (chat.update) ------------------------------------------------------------------------------


def test_edit_replaces_the_whole_text_keeps_the_metadata_and_the_history(api, world) -> None:
    """chat.update sets the reply's whole text (twice is harmless); the fake's history keeps every text, and the
    read-back still finds the edited reply under its parent (its replyd metadata sent again)."""
    plat = make(api)
    assert isinstance(plat, EditReply)
    parent = plat.resolve(mention(world))
    sent = plat.send(parent, "first words", provider_key="k")
    plat.edit(parent, sent.reply_id, "first words and more")
    plat.edit(parent, sent.reply_id, "first words and more")
    assert world.text_of(sent.reply_id) == "first words and more"
    assert world.history_of(sent.reply_id) == ["first words", "first words and more", "first words and more"]
    assert world.message(sent.reply_id).metadata == {"event_type": "replyd_reply", "event_payload": {"parent": parent.id}}
    rb = plat.read_back([Pending(parent, time.time())], sender_id=BOT_USER)
    assert [r.reply_id for r in rb.found[parent.id]] == [sent.reply_id]
    assert len(world.bot_replies(parent.id)) == 1 and api.calls["chat.update"] == 2


@pytest.mark.parametrize(("fault", "edited"), [("lost", True), ("error_after", True), ("error_before", False)])
def test_edit_lost_or_5xx_is_maybe_sent_and_trying_again_is_harmless(api, world, fault, edited) -> None:
    """A lost answer or a 5xx may have edited (Slack cannot say): MaybeSent; the edit tried again sets the same
    text, one message still."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    sent = plat.send(parent, "draft", provider_key="k")
    world.update_faults = [fault]
    with pytest.raises(MaybeSent):
        plat.edit(parent, sent.reply_id, "final")
    assert world.text_of(sent.reply_id) == ("final" if edited else "draft")
    plat.edit(parent, sent.reply_id, "final")
    assert world.text_of(sent.reply_id) == "final" and len(world.bot_replies(parent.id)) == 1


def test_edit_that_provably_did_not_act_is_definitely_not_sent(api, world) -> None:
    """A refused token, a refused connection: DefinitelyNotSent, the text unchanged."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    sent = plat.send(parent, "draft", provider_key="k")
    world.tokens = ("xoxb-rotated",)
    with pytest.raises(DefinitelyNotSent, match="invalid_auth"):
        plat.edit(parent, sent.reply_id, "final")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    gone = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "api_url": closed}, http=httpx.Client(timeout=2.0),
                                       clock=SystemClock())
    with pytest.raises(DefinitelyNotSent):
        gone.edit(parent, sent.reply_id, "final")
    assert world.history_of(sent.reply_id) == ["draft"]


def test_edit_refused_by_the_error_table(api, world) -> None:
    """message_not_found (deleted), cant_update_message (a person's message), edit_window_closed, msg_too_long
    and a malformed id are Rejected; nothing changes on the fake."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    gone = plat.send(parent, "to delete", provider_key="k")
    plat.delete(gone.reply_id)
    with pytest.raises(Rejected, match="message_not_found"):
        plat.edit(parent, gone.reply_id, "x")
    with pytest.raises(Rejected, match="cant_update_message"):
        plat.edit(parent, parent.id, "x")  # Alice's own message
    sent = plat.send(parent, "kept", provider_key="k")
    world.too_long = "refuse"
    with pytest.raises(Rejected, match="msg_too_long"):
        plat.edit(parent, sent.reply_id, "x" * 40_001)
    world.edit_window_s = -1.0  # the workspace's edit window has closed on every message
    with pytest.raises(Rejected, match="edit_window_closed"):
        plat.edit(parent, sent.reply_id, "x")
    with pytest.raises(Rejected):
        plat.edit(parent, "not-an-id", "x")
    assert world.history_of(sent.reply_id) == ["kept"] and world.text_of(parent.id).endswith("can you help?")


def test_edit_ratelimited_honours_retry_after_and_the_tier(api, world) -> None:
    """A 429 with Retry-After is RateLimited with that wait and no request until it passes; past Tier 3's
    minute (the fake's budget) Slack's own 429 says how long to wait."""
    clock = FakeClock(time.time())
    plat = make(api, clock)
    parent = plat.resolve(mention(world))
    sent = plat.send(parent, "draft", provider_key="k")
    world.update_faults = ["ratelimited"]
    with pytest.raises(RateLimited) as first:
        plat.edit(parent, sent.reply_id, "v1")
    assert first.value.retry_after_s == 1.0 and world.update_requests == 1
    with pytest.raises(RateLimited, match="not sent"):
        plat.edit(parent, sent.reply_id, "v1")
    assert world.update_requests == 1 and world.text_of(sent.reply_id) == "draft"
    clock.advance(1.5)
    plat.edit(parent, sent.reply_id, "v1")
    world.update_per_minute = world.update_requests + 1  # the fake's tier: one more edit this minute, then a 429
    plat.edit(parent, sent.reply_id, "v2")
    with pytest.raises(RateLimited) as tier:
        plat.edit(parent, sent.reply_id, "v3")
    assert 1.0 <= tier.value.retry_after_s <= 61.0 and world.text_of(sent.reply_id) == "v2"


# -- read-back ---------------------------------------------------------------------------------------


def test_read_back_found_not_found_partial_and_failed(api, world) -> None:
    """Found: the tagged reply; not found: checked and empty; a failed thread leaves only its parents unchecked."""
    plat = make(api)
    a, b, c = (plat.resolve(mention(world, f"q{i}")) for i in range(3))
    plat.send(a, "answer a", provider_key="k")
    world.say(GENERAL, BOT_USER, "an untagged message in b's thread", thread_ts=b.extra["ts"], push=False)
    pend = [Pending(p, time.time()) for p in (a, b, c)]
    rb = plat.read_back(pend, sender_id=BOT_USER)
    assert rb.checked == {a.id, b.id, c.id} and list(rb.found) == [a.id]  # b's untagged message is no answer
    world.read_faults["conversations.replies"] = ["5xx"]  # the first thread read (sorted: a's) fails
    partial = plat.read_back(pend, sender_id=BOT_USER)
    assert partial.checked == {b.id, c.id} and partial.found == {}
    world.read_faults["conversations.replies"] = ["5xx", "ratelimited"]
    failed = plat.read_back(pend, sender_id=BOT_USER)  # a: 5xx, b: 429 -> conversations.replies blocked for c too
    assert failed.checked == set() and failed.found == {}


def test_read_back_pages_a_long_thread_and_a_truncated_walk_checks_nothing(api, world) -> None:
    """Replies past the first page are found; a thread longer than max_pages pages stays unchecked."""
    plat = make(api, page_limit=3)
    parent = plat.resolve(mention(world))
    for i in range(7):
        world.say(GENERAL, ALICE, f"chatter {i}", thread_ts=parent.extra["ts"], push=False)
    sent = plat.send(parent, "late answer", provider_key="k")
    rb = plat.read_back([Pending(parent, time.time())], sender_id=BOT_USER)
    assert parent.id in rb.checked and [r.reply_id for r in rb.found[parent.id]] == [sent.reply_id]
    short = make(api, page_limit=3, max_pages=2)
    rb2 = short.read_back([Pending(parent, time.time())], sender_id=BOT_USER)
    assert rb2.checked == set()


# -- delete, paging ----------------------------------------------------------------------------------


def test_delete_removes_one_reply_and_a_gone_one_is_done(api, world) -> None:
    """chat.delete removes the reply; deleting it again is no error; a malformed id is refused."""
    plat = make(api)
    parent = plat.resolve(mention(world))
    sent = plat.send(parent, "dup", provider_key="k")
    plat.delete(sent.reply_id)
    assert world.bot_replies(parent.id) == []
    plat.delete(sent.reply_id)
    with pytest.raises(Rejected):
        plat.delete("not-an-id")


def test_inbox_pages_every_channel_and_the_cursor_moves_on(api, world) -> None:
    """Mentions in channels and every DM, across pages; the cursor gives only newer ones; #random is not read."""
    plat = make(api, page_limit=2)
    want = [mention(world, f"m{i}") for i in range(3)] + [world.say(DM, ALICE, f"dm {i}") for i in range(2)]
    world.say(GENERAL, ALICE, "not for the bot")
    world.say(RANDOM, ALICE, f"<@{BOT_USER}> in a channel the bot is not in")
    page = plat.inbox(None)
    assert [p.id for p in page.parents] == want
    later = mention(world, "later")
    assert [p.id for p in plat.inbox(page.cursor).parents] == [later]
    assert [p.id for p in plat.refind(0.0)] == [*want, later]
    assert set(json.loads(page.cursor)) == {GENERAL, DM}


def test_inbox_finds_a_mention_inside_a_thread_new_or_older_than_the_cursor(api, world) -> None:
    """A mention posted as a thread reply (not in conversations.history) is read from its thread, also when the
    thread started before the cursor; one beyond thread_window_s is not."""
    clock = FakeClock(time.time())
    plat = make(api, clock)
    old_root = world.say(GENERAL, ALICE, "an old discussion")
    cursor = plat.inbox(None).cursor
    root = world.say(GENERAL, ALICE, "something broke")
    inner = mention(world, "look?", thread_ts=root.partition(":")[2])
    late = mention(world, "and this old one?", thread_ts=old_root.partition(":")[2])
    page = plat.inbox(cursor)
    assert sorted(p.id for p in page.parents) == sorted([inner, late])
    assert plat.inbox(page.cursor).parents == []
    clock.advance(2 * 86_400)  # the old thread's parent is now outside thread_window_s
    later = mention(world, "still there?", thread_ts=old_root.partition(":")[2])
    assert later not in [p.id for p in plat.inbox(page.cursor).parents]


# -- Events API receiver -----------------------------------------------------------------------------


def _receiver(plat: SlackPlatform, now: float, offered: list) -> Receiver:
    class Out:  # the Outcome the receiver logs
        class status:
            value = "posted"

    def offer(parent: Parent, path: str) -> Any:
        offered.append((parent.id, path))
        return Out()

    return Receiver({"s": Hook("s", "slack", SIGNING_SECRET, plat, offer, instance=plat.instance)}, now=lambda: now)


def _signed(body: dict, stamp: int, secret: str = SIGNING_SECRET, **extra: str) -> tuple[dict[str, str], bytes]:
    raw = json.dumps(body).encode()
    return {"x-slack-request-timestamp": str(stamp), "x-slack-signature": slack_sign(secret, str(stamp), raw),
            **extra}, raw


def test_slack_signature_and_replay_window() -> None:
    """v0 HMAC of 'v0:{ts}:{body}' verifies; another body, secret or a timestamp over 5 minutes away does not."""
    body, now = b'{"type":"event_callback"}', 1_800_000_000
    good = {"x-slack-request-timestamp": str(now), "x-slack-signature": slack_sign(SIGNING_SECRET, str(now), body)}
    assert slack_verify(SIGNING_SECRET, body, good, now + 299)
    assert not slack_verify(SIGNING_SECRET, body, good, now + 301)  # a replay, genuine signature
    assert not slack_verify(SIGNING_SECRET, body + b" ", good, now)
    assert not slack_verify("another-signing-secret-0000000", body, good, now)
    assert not slack_verify(SIGNING_SECRET, body, {**good, "x-slack-request-timestamp": "soon"}, now)
    assert not slack_verify(SIGNING_SECRET, body, {"x-slack-request-timestamp": str(now)}, now)


def test_receiver_answers_the_challenge_acks_retries_and_refuses_replays(api, world) -> None:
    """url_verification → 200 + challenge; a delivery and its retries → 202 each (the guard dedupes);
    a forged or replayed delivery → 401 and nothing offered."""
    plat = make(api)
    now = int(time.time())
    offered: list = []
    rec = _receiver(plat, now, offered)
    try:
        h, b = _signed(fixture("url_verification"), now)
        ans = rec.receive("s", h, b)
        assert (ans.status, ans.body) == (200, {"challenge": fixture("url_verification")["challenge"]})
        mention(world)
        ch = world.channels[GENERAL]
        ev = world.events_for(ch, ch.messages[-1])[1]
        for retry in range(4):
            extra = {"x-slack-retry-num": str(retry), "x-slack-retry-reason": "http_timeout"} if retry else {}
            h, b = _signed(ev, now, **extra)
            assert rec.receive("s", h, b).status == 202
        h, b = _signed(ev, now - 600)  # captured and replayed ten minutes later
        assert rec.receive("s", h, b).status == 401
        h, b = _signed(ev, now, secret="not-the-signing-secret-000000")
        assert rec.receive("s", h, b).status == 401
    finally:
        rec.close(wait=True)
    assert offered == [(f"{GENERAL}:{ch.messages[-1].ts}", "webhook")] * 4


def test_the_fake_retries_an_unacked_delivery_as_slack_does(world) -> None:
    """The fake's Events API sender (what the daemon tests rely on): a delivery never acked 2xx is sent 4 times,
    X-Slack-Retry-Num 1-3 with a reason, each signed; an acked one once."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.fakes_forum import AppServer
    from tests.slack_fake import EventsSender

    seen: list[tuple[str, str | None, str | None, bool]] = []

    async def endpoint(request: Request) -> Response:
        body = await request.body()
        ok = slack_verify(SIGNING_SECRET, body, request.headers, time.time())
        ev = json.loads(body)["event"]
        seen.append((ev["channel"], request.headers.get("x-slack-retry-num"),
                     request.headers.get("x-slack-retry-reason"), ok))
        return Response(status_code=500 if ev["channel"] == DM else 200)

    server = AppServer(Starlette(routes=[Route("/", endpoint, methods=["POST"])]))
    server.start()
    sender = EventsSender(world, [server.url + "/"], minute_s=0.05)
    try:
        world.say(DM, ALICE, "failing endpoint")
        mention(world)
        assert wait_until(lambda: sender.pending() == 0 and len(seen) == 6, 10)
    finally:
        sender.close()
        server.stop()
    dm = [(n, r) for c, n, r, ok in seen if c == DM and ok]
    assert dm == [(None, None), ("1", "http_error"), ("2", "http_error"), ("3", "http_error")]
    assert [(n, ok) for c, n, _r, ok in seen if c == GENERAL] == [(None, True), (None, True)]  # message, app_mention


# -- Socket Mode -------------------------------------------------------------------------------------


def test_socket_mode_acks_every_envelope_and_reads_redeliveries_after_a_reconnect(api, world, socket_server) -> None:
    """Envelopes are acked by id (none left unacked); acks lost on one connection come again on the next,
    as the same parents; a disconnect ends the stream."""
    plat = make(api)
    got: list[str] = []
    stop = threading.Event()

    def read() -> None:
        got.extend(p.id for p in plat.stream(stop))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_until(lambda: socket_server.connections == 1, 10)
    dm = world.say(DM, ALICE, "hello bot")
    assert wait_until(lambda: got == [dm] and not socket_server.unacked, 10)
    socket_server.lose_acks = True  # acks of the next connection never arrive
    socket_server.disconnect()
    reader.join(10)
    assert not reader.is_alive()  # disconnect: the stream returned, the runner reconnects
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_until(lambda: socket_server.connections == 2, 10)
    pid = mention(world)
    assert wait_until(lambda: got.count(pid) == 2, 10)  # message + app_mention
    assert len(socket_server.unacked) == 2
    socket_server.lose_acks = False
    socket_server.disconnect()
    reader.join(10)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_until(lambda: got.count(pid) == 4 and not socket_server.unacked, 10)  # redelivered, acked
    assert {a for _e, a in socket_server.delivered} == {0, 1}
    stop.set()
    reader.join(5)


def test_socket_mode_offers_only_the_listed_channels(api, world, socket_server) -> None:
    """With `channels` set, a Socket Mode envelope of a DM outside them is acked and not offered (the poll would
    not read it either); a mention in a listed channel is."""
    plat = make(api, channels=[GENERAL])
    got: list[str] = []
    stop = threading.Event()
    reader = threading.Thread(target=lambda: got.extend(p.id for p in plat.stream(stop)), daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: socket_server.connections == 1, 10)
        world.say(DM, ALICE, "hello bot")
        pid = mention(world)
        assert wait_until(lambda: pid in got and not socket_server.unacked, 10)
    finally:
        stop.set()
        reader.join(5)
    assert set(got) == {pid}


def test_socket_mode_without_an_app_token_or_with_a_refused_one_is_not_sent(api) -> None:
    """No app token, or one Slack refuses: DefinitelyNotSent (the stream runner backs off and retries)."""
    plain = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "api_url": api.url}, http=httpx.Client(),
                                        clock=SystemClock())
    with pytest.raises(DefinitelyNotSent, match="app_token"):
        next(iter(plain.stream(threading.Event())))
    wrong = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "app_token": "xapp-1-wrong", "api_url": api.url},
                                        http=httpx.Client(), clock=SystemClock())
    with pytest.raises(DefinitelyNotSent, match="invalid_auth"):
        next(iter(wrong.stream(threading.Event())))


# -- the daemon: config check, the webhook route ----------------------------------------------------


def test_config_check_names_a_wrong_slack_token_without_showing_it(tmp_path) -> None:
    """`replyd config check config/slack.toml`: ok with Slack's token kinds; a user token in the bot slot is one
    line naming the key, exit 2, the value not shown."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "SLACK_APP_TOKEN": "xapp-1-A0-secretvalue"}
    run = [sys.executable, "-m", "replyd", "config", "check", str(root / "config" / "slack.toml")]
    ok = subprocess.run(run, env={**env, "SLACK_BOT_TOKEN": "xoxb-1-secretvalue"}, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(run, env={**env, "SLACK_BOT_TOKEN": "xoxp-1-secretvalue"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "slack setting 'token': must be a bot token" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "secretvalue" not in bad.stderr + bad.stdout


def _slack_daemon(api: SlackWebApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: str = "") -> Any:
    """A daemon (not started) with Slack bot ``s`` on the fake, Events API push on, polls off."""
    from replyd.config import Config
    from replyd.daemon import Daemon

    monkeypatch.setenv("SLACK_BOT_TOKEN", BOT_TOKENS[0])
    monkeypatch.setenv("SLACK_SIGNING_SECRET", SIGNING_SECRET)
    cfg = tmp_path / "slack.toml"
    cfg.write_text(f"""
[store]
url = "sqlite:///{tmp_path / 'r.sqlite3'}"
[api]
enabled = true
port = 0
[sweep]
interval_s = 0.5
[[bots]]
name = "s"
platform = "slack"
[bots.settings]
api_url = "{api.url}"
token_env = "SLACK_BOT_TOKEN"
listing_delay_s = 0.5
{settings}
[bots.pollers]
inbox_interval_s = 0
refind_interval_s = 0
[bots.push]
kind = "slack"
secret_env = "SLACK_SIGNING_SECRET"
""")
    cfg.chmod(0o600)
    return Daemon(Config.load(cfg))


def test_daemon_route_answers_url_verification_and_refuses_unsigned(api, world, tmp_path, monkeypatch) -> None:
    """POST /v1/hooks/{bot} of a running daemon: Slack's signed url_verification gets the challenge, an
    unsigned delivery 401, a signed mention 202 and one reply counted by the fake."""
    d = _slack_daemon(api, tmp_path, monkeypatch)
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/s"
        now = int(time.time())
        with httpx.Client(timeout=5.0) as http:
            h, b = _signed(fixture("url_verification"), now)
            r = http.post(url, headers=h, content=b)
            assert r.status_code == 200 and r.json() == {"challenge": fixture("url_verification")["challenge"]}
            assert http.post(url, content=b).status_code == 401
            pid = mention(world)
            ch = world.channels[GENERAL]
            for ev in world.events_for(ch, ch.messages[-1]):
                h, b = _signed(ev, now)
                assert http.post(url, headers=h, content=b).status_code == 202
        assert wait_until(lambda: world.bot_replies(pid), 10)
    finally:
        d.stop(grace_s=5)  # waits for the receiver's offers under way: both events have been offered
    assert len(world.bot_replies(pid)) == 1


def test_daemon_drops_other_workspaces_unaddressed_and_unlisted_channels(api, world, tmp_path, monkeypatch,
                                                                         capfd) -> None:
    """Over HTTP with correct signatures: an event of another workspace the app is installed in, a channel
    message that names nobody and a DM outside `channels` are acked 202 and dropped (counted, logged), nothing
    is posted for them; the mention in the listed channel is answered once."""
    from tests.test_hooks import dropped_lines, scraped

    d = _slack_daemon(api, tmp_path, monkeypatch, f'channels = ["{GENERAL}"]')
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/s"
        now = int(time.time())
        ch, dm = world.channels[GENERAL], world.channels[DM]
        foreign = mention(world, "from the other workspace")
        other_team = copy.deepcopy(world.events_for(ch, ch.messages[-1])[1])
        other_team["team_id"] = "T0OTHER001"
        for a in other_team["authorizations"]:
            a["team_id"] = "T0OTHER001"
        plain = world.say(GENERAL, ALICE, "lunch anyone?")
        [plain_ev] = world.events_for(ch, ch.messages[-1])
        direct = world.say(DM, ALICE, "a word in private")
        [dm_ev] = world.events_for(dm, dm.messages[-1])
        before = {r: scraped(d.api.url, "replyd_webhook_dropped_total", platform="s", reason=r)
                  for r in ("other_workspace", "not_addressed", "channel_not_listed")}
        with httpx.Client(timeout=5.0) as http:
            got = [http.post(url, headers=h, content=b) for h, b in (_signed(e, now) for e in (other_team, plain_ev,
                                                                                                 dm_ev))]
            pid = mention(world)
            for ev in world.events_for(ch, ch.messages[-1]):
                h, b = _signed(ev, now)
                assert http.post(url, headers=h, content=b).status_code == 202
        assert wait_until(lambda: world.bot_replies(pid), 10)
        after = {r: scraped(d.api.url, "replyd_webhook_dropped_total", platform="s", reason=r) for r in before}
    finally:
        d.stop(grace_s=5)
    assert [len(world.bot_replies(p)) for p in (foreign, plain, direct, pid)] == [0, 0, 0, 1]
    assert [(r.status_code, r.json()) for r in got] == [
        (202, {"accepted": 0, "dropped": ["other_workspace"]}),
        (202, {"accepted": 0, "dropped": ["not_addressed"]}),
        (202, {"accepted": 0, "dropped": ["channel_not_listed"]})]
    assert {r: after[r] - before[r] for r in before} == {"other_workspace": 1, "not_addressed": 1,
                                                          "channel_not_listed": 1}
    out, err = capfd.readouterr()
    assert [(e["bot"], e["reason"]) for e in dropped_lines(out + err)] == [
        ("s", "other_workspace"), ("s", "not_addressed"), ("s", "channel_not_listed")]


@pytest.mark.parametrize("stamp", [b"\xb2", b"\xb9\xb2\xb3", "\u0661\u0662".encode(), b"1e9", b"-5", b"12 34", b""])
def test_a_non_ascii_digit_timestamp_is_a_401_not_a_500(api, world, tmp_path, monkeypatch, capfd, stamp) -> None:
    """Over HTTP before authentication: X-Slack-Request-Timestamp "\xb2" ("²".isdigit() is True, int() fails) and
    other non-timestamps get the one bad-signature 401, one log line, no traceback; an unknown bot the same."""
    d = _slack_daemon(api, tmp_path, monkeypatch)
    d.start()
    try:
        body = json.dumps(fixture("url_verification")).encode()
        sig = slack_sign(SIGNING_SECRET, stamp.decode("latin-1"), body).encode()
        with httpx.Client(timeout=5.0) as http:
            for bot in ("s", "nobody"):
                r = http.post(f"{d.api.url}/v1/hooks/{bot}", content=body,
                              headers=[(b"x-slack-request-timestamp", stamp), (b"x-slack-signature", sig)])
                assert r.status_code == 401, (bot, r.status_code, r.text)
                assert r.json() == {"error": "bad_signature", "detail": "the delivery is not signed with this "
                                    "hook's secret (or its timestamp is stale)"}
    finally:
        d.stop(grace_s=5)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "ValueError" not in out + err
    assert SIGNING_SECRET not in out + err


# -- answers in parts: the real guard and sweep on the fake --------------------------------------------------

PART_CHARS = 120
LONG = " ".join(f"Sentence {i} of a long answer says one more thing." for i in range(6))


def _parts_bot(api: SlackWebApi, world: SlackWorld, store: Any, clock: FakeClock,
               chars: int = PART_CHARS) -> tuple[SlackPlatform, Any, Any]:
    """A Slack adapter posting at most ``chars`` a message, the real guard over ``store`` (streamed answers
    edited at most every second) and a sweeper."""
    from replyd.guard import Guard
    from replyd.sweep import Bot, Sweeper

    world.now = clock.now  # Slack's ts on the test's clock, so the sweep's deadlines and the fake's agree
    plat = make(api, clock, max_post_chars=chars, listing_delay_s=1.0)
    me = plat.whoami()
    g = Guard(store, plat, me, clock=clock, send_timeout_s=5.0, watch_interval_s=None, compose_lease_s=30.0,
              stream_edit_interval_s=1.0)
    return plat, g, Sweeper(store, [Bot(plat, me)], clock=clock, retry_s=1.0)


def _thread(world: SlackWorld, parent_id: str) -> list[Any]:
    """The bot's messages in the parent's thread, oldest first, read on the fake."""
    return sorted(world.thread_replies(parent_id), key=lambda m: ts_order(m.ts))


def _answered(m: Any) -> str:
    """The parent id a message's replyd metadata names."""
    return m.metadata["event_payload"]["parent"]


@pytest.mark.parametrize("where", ["channel", "dm"])
def test_a_long_answer_goes_out_in_parts_in_the_parents_thread(api, world, store, clock, where) -> None:
    """Three parts through the guard: three messages in the parent's thread, in order, each once, each tagged
    with the part before it (the first with the parent); the parts' rows closed with their own replies; the
    inbox and re-find offer only the person's message, never a part (in a DM, where every message is offered)."""
    from replyd import store as st
    from replyd.guard import Status
    from replyd.parts import Limit, part_id, split

    plat, g, _ = _parts_bot(api, world, store, clock)
    assert isinstance(plat, PostLimit) and plat.post_limit(Parent(id="x", author_id="y")).size == PART_CHARS
    expected = split(LONG, Limit(PART_CHARS))
    assert len(expected) == 3
    parent = plat.resolve(mention(world) if where == "channel" else world.say(DM, ALICE, "a long question"))
    out = g.post(parent, LONG)
    assert out.status is Status.POSTED and [p.state for p in out.parts] == [st.CLOSED] * 3
    msgs = _thread(world, parent.id)
    ids = [f"{parent.extra['channel']}:{m.ts}" for m in msgs]
    assert [m.text for m in msgs] == expected and all(m.thread_ts == parent.extra["ts"] for m in msgs)
    assert [_answered(m) for m in msgs] == [parent.id, ids[0], ids[1]]
    rows = [store.peek(g.key(part_id(parent.id, k))) for k in (1, 2, 3)]
    assert [r.reply_id for r in rows] == ids == [p.reply_id for p in out.parts]
    assert g.post(parent, LONG).status is Status.ALREADY_ANSWERED and len(_thread(world, parent.id)) == 3
    assert [p.id for p in plat.inbox(None).parents] == [parent.id]
    assert [p.id for p in plat.refind(clock.now() - 3600)] == [parent.id]


def test_a_lost_part_is_closed_by_the_sweep_with_its_own_reply(api, world, store, clock) -> None:
    """Part 2's answer lost (it landed): the sweep reads the thread and closes part 2 with part 2's own reply,
    not part 1's (the read-back, and read_parents, ask about part 1's id, which only part 2's metadata names);
    the next offer sends part 3 only: three messages, in order, each once."""
    from replyd import store as st
    from replyd.guard import Status
    from replyd.parts import Limit, part_id, split

    plat, g, sweeper = _parts_bot(api, world, store, clock)
    parent = plat.resolve(mention(world))
    world.post_faults = ["ok", "lost"]
    out = g.post(parent, LONG)
    assert out.status is Status.UNCERTAIN and [p.state for p in out.parts[:2]] == [st.CLOSED, st.OPEN]
    first, second = (f"{GENERAL}:{m.ts}" for m in _thread(world, parent.id))
    clock.advance(10)
    sweeper.run_once()
    assert store.peek(g.key(part_id(parent.id, 2))).reply_id == second
    look = plat.read_parents([Pending(plat.part_parent(parent, first), clock.now())], sender_id=BOT_USER)
    assert [r.reply_id for r in look.found.get(first, [])] == [second]
    done = g.post(parent, LONG)
    assert done.status is Status.POSTED and done.state == st.CLOSED
    assert [m.text for m in _thread(world, parent.id)] == split(LONG, Limit(PART_CHARS))
    assert world.post_requests == 3


def test_a_part_that_never_landed_is_proven_so_and_sent_again(api, world, store, clock) -> None:
    """Part 2 refused with a 503 before Slack made it (MaybeSent): the sweep finds no reply to part 1 and proves
    part 2 not landed; the next offer sends it again, then part 3: three messages, in order, each once."""
    from replyd.guard import Status
    from replyd.parts import Limit, split

    plat, g, sweeper = _parts_bot(api, world, store, clock)
    parent = plat.resolve(mention(world))
    world.post_faults = ["ok", "error_before"]
    assert g.post(parent, LONG).status is Status.UNCERTAIN
    clock.advance(10)
    assert sweeper.run_once().not_landed == 1
    assert g.post(parent, LONG).status is Status.POSTED
    assert [m.text for m in _thread(world, parent.id)] == split(LONG, Limit(PART_CHARS))


@pytest.mark.parametrize("fault", [None, "lost"])
def test_a_streamed_answer_is_one_message_per_part_grown_by_chat_update(api, world, store, clock, fault) -> None:
    """A streamed responder through the guard: each part posted once in the parent's thread and grown by
    chat.update (an edit whose answer was lost simply tried again) to the final text, every word once, in order;
    the fake's history shows the growth and no part was posted twice."""
    from replyd.guard import Status
    from tests.test_stream import WORDS, Streamer

    plat, g, _ = _parts_bot(api, world, store, clock, chars=60)
    parent = plat.resolve(mention(world))
    world.update_faults = [fault] if fault else []
    out = g.post(parent, Streamer(clock))
    assert out.status is Status.POSTED, out
    msgs = _thread(world, parent.id)
    assert len(msgs) == len(out.parts) >= 4 and world.post_requests == len(msgs)
    assert " ".join(m.text for m in msgs) == " ".join(WORDS) and all(len(m.text) <= 60 for m in msgs)
    assert [f"{GENERAL}:{m.ts}" for m in msgs] == [p.reply_id for p in out.parts]
    assert [_answered(m) for m in msgs] == [parent.id] + [f"{GENERAL}:{m.ts}" for m in msgs[:-1]]
    assert sum(len(m.history) for m in msgs) >= len(msgs)  # grown by edits, not re-posted
    assert world.update_faults == []  # the fault was met
