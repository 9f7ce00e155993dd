"""One unreadable item never stops a path: on the real fakes, with the real guard and store.

Poll: a poison update (a text with a lone surrogate, which UTF-16 cannot encode, or a date too large for a
float) sits between good ones on the Telegram fake. The pollers answer every good one (counted on the fake's
side), record the poison as an ``unreadable`` event that ``replyd status`` counts, and save the offset past
it, so the next poll confirms the batch. Before the rule the page raised and its offset never moved.
Then one hostile message among good ones on the Slack, Discord, Telegram and WhatsApp fakes (hypothesis),
webhook deliveries (Telegram, WhatsApp, Slack), a poison Bluesky firehose commit through the stream runner,
and ``replyd status``. On the held streams (Discord's Gateway, Slack's Socket Mode, Mastodon's notification
stream) one hostile event among good ones: reported under its id, the connection kept, and every good one
answered through the guard, counted on the fake's side.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as hs
from structlog.testing import capture_logs

from replyd import metrics
from replyd.clock import FakeClock, SystemClock
from replyd.config import PollerConfig
from replyd.guard import Guard
from replyd.hooks import Hook, Receiver, sign
from replyd.pipeline import Pipeline
from replyd.platforms.base import Identity, make_platform
from replyd.platforms.telegram import TelegramPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.store import Key, Store
from tests.conftest import IN_CI
from tests.fuzz_harness import hostile_item
from tests.telegram_fake import BOT_ID, BOT_USERNAME, TOKEN, TelegramApi, TelegramWorld
from tests.test_cli import env  # noqa: F401  (a pytest fixture by name)

GROUP = -1001234567890
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=IN_CI)
SECRET = "s3cret-token_for-the-webhook-0123"


@pytest.fixture
def world() -> TelegramWorld:
    w = TelegramWorld()
    w.chat(GROUP, type="supergroup", title="replyd testers", username="replyd_testers")
    return w


@pytest.fixture
def api(world: TelegramWorld) -> Iterator[TelegramApi]:
    a = TelegramApi(world).start()
    yield a
    a.stop()


def _poison(world: TelegramWorld, how: str) -> str:
    """Queue an update addressing the bot that the adapter cannot read; return its message's served id."""
    good = world.post(GROUP, "placeholder")
    chat_id, mid = good.split(":")
    with world.lock:
        _, _, update = world.updates[-1]
        msg = update["message"]
        if how == "surrogate":
            msg["text"] = f"@{BOT_USERNAME} \ud800"  # valid JSON ("\\ud800"), but no UTF-16 holds it
        else:
            msg["date"] = 10 ** 400  # a JSON integer no float holds
    return good


def _count(name: str, **labels: str) -> float:
    """The sum of the counter's samples with these labels (every platform label when none is named)."""
    return sum(sample.value for metric in getattr(metrics, "UNREADABLE", metrics.POLLS).collect()
               for sample in metric.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("how", ["surrogate", "huge_date"])
def test_a_poison_update_is_recorded_and_the_offset_moves_past_it(api, world, store: Store, clock: FakeClock,
                                                                  how: str) -> None:
    plat = TelegramPlatform.from_settings({"token": TOKEN, "api_url": api.url, "long_poll_s": 0},
                                          http=httpx.Client(timeout=5.0), clock=clock)
    me = plat.whoami()
    guard = Guard(store, plat, me, clock=clock, send_timeout_s=10.0, watch_interval_s=None)
    pollers = Pollers(store, plat, Pipeline(guard, lambda p: f"answer to {p.id}", Policy(), clock),
                      PollerConfig(), clock)
    first = world.post(GROUP, "one")
    bad = _poison(world, how)
    rest = [world.post(GROUP, f"m{i}") for i in range(2)]
    before = _count("replyd_unreadable_items_total", path="inbox")
    with capture_logs() as logs:
        pollers.inbox()
    assert [world.bot_replies(pid) for pid in (first, *rest)] == [1, 1, 1], logs
    assert world.bot_replies(bad) == 0
    unread = [e for e in logs if e["event"] == "replyd.poller.unreadable"]
    assert [e["item_id"] for e in unread] == [bad] and unread[0]["path"] == "inbox"
    assert [e.kind for e in store.history(Key(plat.instance, me.sender_id, bad))] == ["unreadable"]
    assert store.event_key_counts("unreadable") == {(plat.instance, str(BOT_ID)): 1}
    assert _count("replyd_unreadable_items_total", path="inbox") == before + 1
    cursor = store.get_cursor(plat.instance, me.sender_id, "inbox")
    assert cursor is not None and int(cursor) > max(u for u, _, _ in world.updates)
    pollers.inbox()  # the saved offset confirms the whole batch, the poison with it
    assert world.pending_updates() == []
    assert sum(world.reply_counts().values()) == 3


def test_a_poison_webhook_delivery_is_acked_and_recorded(api, world, store: Store, clock: FakeClock) -> None:
    """Telegram resends a delivery it got no 2xx for and holds the ones after it: an unreadable one is
    answered 200, recorded, and the next delivery is accepted."""
    plat = TelegramPlatform.from_settings({"token": TOKEN, "api_url": api.url, "long_poll_s": 0, "mode": "webhook"},
                                          http=httpx.Client(timeout=5.0), clock=clock)
    me = plat.whoami()
    guard = Guard(store, plat, me, clock=clock, send_timeout_s=10.0, watch_interval_s=None)
    offered: list[str] = []

    def offer(parent: Any, path: str) -> Any:
        offered.append(parent.id)
        return guard.post(parent, "thanks", path=path)

    rx = Receiver({"tg": Hook("tg", "telegram", SECRET, plat, offer, plat.instance, guard=guard)})
    bad = _poison(world, "surrogate")
    good = world.post(GROUP, "two")
    headers = {"x-telegram-bot-api-secret-token": SECRET}
    try:
        answers = [rx.receive("tg", headers, json.dumps(u).encode()) for _, _, u in world.updates]
    finally:
        rx.close()
    assert [a.status for a in answers] == [202, 202], answers
    assert answers[0].body["accepted"] == 0 and answers[1].body["parents"] == [good]
    assert offered == [good] and world.bot_replies(good) == 1
    assert [e.kind for e in store.history(Key(plat.instance, me.sender_id, bad))] == ["unreadable"]


# -- one hostile message among good ones, on each stateful fake ------------------------------------------------


def test_slack_one_hostile_message_never_costs_the_good_ones() -> None:
    from replyd.platforms.slack import SlackPlatform
    from tests.slack_fake import BOT_TOKENS, BOT_USER, SlackWebApi, SlackWorld

    world = SlackWorld()
    world.add_channel("C0GENERAL1", BOT_USER, "U0ALICE001")
    with SlackWebApi(world) as api:
        good = [world.say("C0GENERAL1", "U0ALICE001", f"<@{BOT_USER}> q{i}", push=False) for i in range(3)]
        victim = world.say("C0GENERAL1", "U0ALICE001", f"<@{BOT_USER}> poison", push=False)
        msg = world.channels["C0GENERAL1"].messages[-1]
        sample = msg.json(metadata=False)

        @FUZZ
        @given(bad=hostile_item([sample]))
        @example(bad={**sample, "ts": "NaN"})  # Decimal("NaN") refuses every comparison: the page raised
        def check(bad: Any) -> None:
            msg.json = lambda *a, **kw: copy.deepcopy(bad)
            plat = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "api_url": api.url},
                                               http=httpx.Client(timeout=5.0), clock=SystemClock())
            got = {p.id for p in plat.inbox(None).parents} | {p.id for p in plat.refind(0.0)}
            assert set(good) <= got, bad

        check()
    assert victim not in good


def test_discord_one_hostile_message_never_costs_the_good_ones() -> None:
    from tests.discord_fake import BOT_TOKENS, DiscordRest, DiscordWorld

    world = DiscordWorld()
    cid = world.add_channel()
    with DiscordRest(world) as api, httpx.Client(trust_env=False) as http:
        good = [world.say(cid, "53908099506183680", f"q{i}") for i in range(3)]
        world.say(cid, "53908099506183680", "poison")
        msg = world.channels[cid].messages[-1]
        sample = msg.json(world)

        @FUZZ
        @given(bad=hostile_item([sample]))
        def check(bad: Any) -> None:
            msg.json = lambda *a, **kw: copy.deepcopy(bad)
            plat = make_platform("discord", {"api_url": api.url, "token": BOT_TOKENS[0], "channels": [cid],
                                             "listing_delay_s": 0}, http=http, clock=SystemClock())
            got = {p.id for p in plat.inbox(None).parents} | {p.id for p in plat.refind(0.0)}
            assert set(good) <= got, bad

        check()


def test_telegram_one_hostile_update_never_costs_the_good_ones(api, world) -> None:
    plat = TelegramPlatform.from_settings({"token": TOKEN, "api_url": api.url, "long_poll_s": 0},
                                          http=httpx.Client(timeout=5.0), clock=SystemClock())
    good = [world.post(GROUP, f"q{i}") for i in range(3)]
    world.post(GROUP, "poison")
    sample = copy.deepcopy(world.updates[-1][2])
    kept = list(world.updates)

    @FUZZ
    @given(bad=hostile_item([sample]))
    @example(bad={**sample, "message": {**sample["message"], "text": f"@{BOT_USERNAME} \ud800"}})
    def check(bad: Any) -> None:
        world.updates = [*kept[:-1], (kept[-1][0], kept[-1][1], copy.deepcopy(bad))]
        page = plat.inbox(None)
        assert set(good) <= {p.id for p in page.parents}, bad
        assert page.cursor == str(kept[-1][0] + 1)  # past the hostile update, the last one

    check()


def test_whatsapp_one_hostile_message_in_a_delivery_never_costs_the_good_ones() -> None:
    """A signed delivery whose ``messages[]`` holds one message of an unexpected shape: the receiver accepts the
    good ones (202, offered), whatever the hostile one is."""
    from replyd.platforms.whatsapp import WhatsAppPlatform
    from tests.whatsapp_fake import APP_SECRET, PHONE_ID, TOKEN as WA_TOKEN, WhatsAppWorld

    world = WhatsAppWorld()
    wamids = [world.customer_says(f"1650555{i:04d}", f"q{i}") for i in range(4)]
    msgs = [copy.deepcopy(world.inbound[w]) for w in wamids]
    plat = WhatsAppPlatform.from_settings({"token": WA_TOKEN, "phone_number_id": PHONE_ID,
                                           "api_url": "http://127.0.0.1:9"}, http=httpx.Client(), clock=SystemClock())

    @FUZZ
    @given(bad=hostile_item([msgs[-1]]), at=hs.integers(0, 3))
    @example(bad={**msgs[-1], "timestamp": "\xb2"}, at=1)  # "²".isdigit(), and float("²") raises
    def check(bad: Any, at: int) -> None:
        offered: list[str] = []
        rx = Receiver({"w": Hook("w", "whatsapp", APP_SECRET, plat, lambda p, path: offered.append(p.id),
                                 instance=plat.instance)})
        page = [*msgs[:-1]]
        page.insert(at, copy.deepcopy(bad))
        body = json.dumps(world._envelope({"contacts": [], "messages": page})).encode()
        try:
            answer = rx.receive("w", {"x-hub-signature-256": sign(APP_SECRET, body)}, body)
        finally:
            rx.close()
        assert answer.status == 202 and set(wamids[:-1]) <= set(answer.body["parents"]), (answer, bad)
        assert set(wamids[:-1]) <= set(offered)

    check()


def test_whatsapp_an_unreadable_message_is_reported_and_the_others_accepted(store: Store, clock: FakeClock) -> None:
    """A message whose sender is no phone number: reported (log, counter, an event of its key in the bot's store)
    and left out; the delivery's other messages are accepted and kept."""
    from replyd.platforms.whatsapp import WhatsAppPlatform
    from tests.whatsapp_fake import APP_SECRET, PHONE_ID, TOKEN as WA_TOKEN, WhatsAppWorld

    world = WhatsAppWorld()
    wamids = [world.customer_says(f"1650555{i:04d}", f"q{i}") for i in range(3)]
    msgs = [copy.deepcopy(world.inbound[w]) for w in wamids]
    msgs[1]["from"] = {"wa_id": "16505550001"}
    plat = WhatsAppPlatform.from_settings({"token": WA_TOKEN, "phone_number_id": PHONE_ID,
                                           "api_url": "http://127.0.0.1:9"}, http=httpx.Client(), clock=clock)
    guard = Guard(store, plat, Identity(PHONE_ID), clock=clock, send_timeout_s=10.0, watch_interval_s=None)
    rx = Receiver({"w": Hook("w", "whatsapp", APP_SECRET, plat, lambda p, path: None, instance=plat.instance,
                             guard=guard)})
    body = json.dumps(world._envelope({"contacts": [], "messages": msgs})).encode()
    before = _count("replyd_unreadable_items_total", path="webhook")
    with capture_logs() as logs:
        try:
            answer = rx.receive("w", {"x-hub-signature-256": sign(APP_SECRET, body)}, body)
        finally:
            rx.close()
    assert answer.status == 202 and answer.body["parents"] == [wamids[0], wamids[2]], answer
    assert [(e["item_id"], e["path"]) for e in logs if e["event"] == "replyd.poller.unreadable"] == [(wamids[1], "webhook")]
    assert [e.kind for e in store.history(Key(plat.instance, PHONE_ID, wamids[1]))] == ["unreadable"]
    assert _count("replyd_unreadable_items_total", path="webhook") == before + 1


# -- a stream ---------------------------------------------------------------------------------------------------


def _car(blocks: dict[bytes, Any]) -> bytes:
    """A CAR v1 of ``blocks`` (CID bytes -> value), rooted at the first."""
    import libipld

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
            n >>= 7
            if not n:
                return bytes(out)

    header = libipld.encode_dag_cbor({"version": 1, "roots": [next(iter(blocks))]})
    return varint(len(header)) + header + b"".join(
        varint(len(k) + len(d)) + k + d for k, d in ((k, libipld.encode_dag_cbor(v)) for k, v in blocks.items()))


def test_a_poison_firehose_commit_is_recorded_and_the_stream_goes_on(store: Store) -> None:
    """A commit whose post record has facets of another type (the record's own check raised TypeError) comes
    before a real mention: the runner records the poison under its URI, offers the mention, and the firehose
    cursor passes both. Before the rule the stream raised, reconnected from the same cursor, and raised again."""
    import libipld

    from replyd.platforms import unreadable
    from replyd.platforms.bluesky_firehose import Firehose
    from replyd.streams import StreamRunner
    from tests.test_bluesky_firehose import FRAMES, StubBluesky, ws_server
    from tests.test_daemon import wait_until

    meta = json.loads((FRAMES / "frames.json").read_text())
    good = (FRAMES / "mention.bin").read_bytes()
    header, body = libipld.decode_dag_cbor_multi(good)
    _, blocks = libipld.decode_car(body["blocks"])
    op = body["ops"][0]
    record = {**blocks[op["cid"]], "facets": 5}
    path = op["path"][:-1] + ("a" if op["path"][-1] != "a" else "b")
    poison = libipld.encode_dag_cbor(header) + libipld.encode_dag_cbor(
        {**body, "seq": body["seq"] - 1, "ops": [{**op, "path": path}], "blocks": _car({op["cid"]: record})})
    poison_uri = f"at://{body['repo']}/{path}"
    stub = StubBluesky(meta["bot_did"])
    offered: list[str] = []

    def offer(parent: Any, path: str) -> Any:
        offered.append(parent.id)
        return type("Out", (), {"status": type("S", (), {"value": "posted"})})()

    with ws_server([poison, good]) as (url, _paths):
        firehose = Firehose(stub, url)  # type: ignore[arg-type]
        runner = StreamRunner("b", firehose, offer, lambda: None,
                              unreadable=unreadable.recorder(store, stub.instance, meta["bot_did"]))
        runner.start()
        try:
            assert wait_until(lambda: meta["mention_uri"] in offered, 10), offered
        finally:
            runner.stop()
    assert [e.kind for e in store.history(Key(stub.instance, meta["bot_did"], poison_uri))] == ["unreadable"]
    assert json.loads(store.history(Key(stub.instance, meta["bot_did"], poison_uri))[0].detail)["path"] == "stream"
    assert firehose.cursor == body["seq"]


def test_status_counts_unreadable_items_per_bot(env) -> None:
    """Two items a path could not read (one reported twice: recorded once): ``replyd status`` counts 2 for the
    bot, in JSON and in its table."""
    from replyd.platforms import unreadable
    from tests.test_cli import replyd

    store = Store.open()
    sink = unreadable.recorder(store, "memory:cli", "bot-1")
    with unreadable.reporting("inbox", sink):
        for item in ("n-1", "n-2", "n-1"):
            unreadable.report("memory:cli", "inbox", item, KeyError("status"))
        unreadable.report("memory:cli", "inbox", None, "not an object")  # no id: logged and counted only
    store.dispose()
    r = replyd("status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["unreadable"] == [{"platform": "memory:cli", "sender_id": "bot-1", "items": 2}]
    text = replyd("status", env=env).stdout
    assert "unreadable items" in text and "bot-1" in text


def test_a_slack_delivery_unreadable_as_a_whole_is_answered_200() -> None:
    """Slack resends a delivery it got no 2xx for: one that can never be read is answered 200 (accepted 0),
    counted, and nothing is offered."""
    from replyd.hooks import slack_sign
    from replyd.platforms.slack import SlackPlatform
    from tests.slack_fake import BOT_TOKENS, SIGNING_SECRET

    plat = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "api_url": "http://127.0.0.1:9"},
                                       http=httpx.Client(), clock=SystemClock())
    offered: list[str] = []
    now = 1_800_000_000.0
    rx = Receiver({"s": Hook("s", "slack", SIGNING_SECRET, plat, lambda p, path: offered.append(p.id),
                             instance=plat.instance)}, now=lambda: now)
    body = json.dumps({"type": "event_callback", "team_id": "T0TEAM0001",
                       "event": {"type": "message", "channel": 5, "user": "U0ALICE001", "ts": "1.2"}}).encode()
    stamp = str(int(now))
    before = _count("replyd_unreadable_items_total", path="webhook")
    try:
        answer = rx.receive("s", {"x-slack-request-timestamp": stamp,
                                  "x-slack-signature": slack_sign(SIGNING_SECRET, stamp, body)}, body)
    finally:
        rx.close()
    assert answer.status == 200 and answer.body["accepted"] == 0 and "event.channel" in answer.body["unreadable"]
    assert offered == [] and _count("replyd_unreadable_items_total", path="webhook") == before + 1


# -- one hostile event among good ones on a held stream, answered through the guard -----------------------------


def _stream_runner(store: Store, plat: Any, *, keep: bool) -> tuple[Any, Any]:
    """The bot's stream as the daemon runs it: each parent offered to a guard (``thanks``), unreadable events kept by
    the store's recorder, a stream whose events come once (Discord's Gateway) recording each parent first. The
    inbox poll (the backstop) is left out: only the stream may answer."""
    import functools

    from replyd.platforms import unreadable
    from replyd.streams import StreamRunner

    me = plat.whoami()
    guard = Guard(store, plat, me, send_timeout_s=10.0, watch_interval_s=None)
    kept = functools.partial(guard.keep_received, path="stream", detail={}, doing="recording a streamed parent")
    runner = StreamRunner("b", plat, lambda parent, path: guard.post(parent, "thanks", path=path), lambda: None,
                          keep=kept if keep else None, unreadable=unreadable.recorder(store, plat.instance, me.sender_id))
    return me, runner


def test_discord_gateway_one_hostile_message_create_never_costs_the_good_ones(store: Store) -> None:
    """A ``MESSAGE_CREATE`` of an unexpected shape (``type`` a list) between guild mentions and DMs on the Gateway:
    recorded ``unreadable`` under its id, the connection kept (no reconnect), every good one answered once on the
    fake. Plant: parsing the dispatch without ``_read`` raises, the runner reconnects, RESUME replays the poison
    and no message after it is ever answered."""
    from tests.discord_fake import BOT_TOKENS, DiscordRest, DiscordWorld, Gateway, Msg
    from tests.test_daemon import wait_until

    world = DiscordWorld()
    guild, dm = world.add_channel(), world.add_channel(dm=True)
    gw = Gateway(world, heartbeat_ms=300)

    def poison(msg: Any) -> None:  # heard before the Gateway dispatches it
        if msg.content.endswith("poison"):
            body = Msg.json(msg, world)
            msg.json = lambda *a, **kw: {**copy.deepcopy(body), "type": [0]}

    world.on_message.insert(0, poison)
    alice = "53908099506183680"
    try:
        with DiscordRest(world, gateway_url=gw.url) as api, httpx.Client(trust_env=False, timeout=5.0) as http:
            plat = make_platform("discord", {"api_url": api.url, "token": BOT_TOKENS[0], "listing_delay_s": 0},
                                 http=http, clock=SystemClock())
            me, runner = _stream_runner(store, plat, keep=True)
            runner.start()
            try:
                assert wait_until(lambda: gw.connections == 1, 10)
                good = [world.say(guild, alice, "q0"), world.say(dm, alice, "q1", mention=False)]
                bad = world.say(guild, alice, "poison")
                good += [world.say(guild, alice, "q2"), world.say(dm, alice, "q3", mention=False)]
                assert wait_until(lambda: all(len(world.bot_replies(p)) == 1 for p in good), 15), \
                    [len(world.bot_replies(p)) for p in good]
            finally:
                runner.stop()
    finally:
        gw.close()
    assert world.bot_replies(bad) == [] and runner.connects == 1
    assert [e.kind for e in store.history(Key(plat.instance, me.sender_id, bad))] == ["unreadable"]
    assert json.loads(store.history(Key(plat.instance, me.sender_id, bad))[0].detail)["path"] == "stream"


def test_slack_socket_mode_one_hostile_envelope_never_costs_the_good_ones(store: Store) -> None:
    """An envelope whose event has a ``subtype`` of another type between mentions and DMs in Socket Mode: recorded
    ``unreadable`` under its ``<channel>:<ts>``, the connection kept, every good one answered once on the fake.
    Plant: parsing the envelope without ``_read`` raises and ends the connection; the poison is never reported."""
    from replyd.platforms.slack import SlackPlatform
    from tests.slack_fake import APP_TOKEN, BOT_TOKENS, BOT_USER, SlackWebApi, SlackWorld, SocketServer
    from tests.test_daemon import wait_until

    general, dm, alice = "C0GENERAL1", "D0DM000001", "U0ALICE001"
    world = SlackWorld()
    world.add_channel(general, BOT_USER, alice)
    world.add_channel(dm, BOT_USER, alice)
    sock = SocketServer(world)

    def poison(_ch: Any, msg: Any, bodies: list[dict[str, Any]]) -> None:  # before the socket server hears it
        if msg.text.endswith("poison"):
            for body in bodies:
                body["event"]["subtype"] = []

    world.on_user_message.insert(0, poison)
    try:
        with SlackWebApi(world, socket_url=sock.url) as api, httpx.Client(trust_env=False, timeout=5.0) as http:
            plat = SlackPlatform.from_settings({"token": BOT_TOKENS[0], "app_token": APP_TOKEN, "api_url": api.url},
                                               http=http, clock=SystemClock())
            me, runner = _stream_runner(store, plat, keep=False)
            runner.start()
            try:
                assert wait_until(lambda: sock.connections == 1, 10)
                good = [world.say(general, alice, f"<@{BOT_USER}> q0"), world.say(dm, alice, "q1")]
                bad = world.say(general, alice, f"<@{BOT_USER}> poison")
                good += [world.say(general, alice, f"<@{BOT_USER}> q2"), world.say(dm, alice, "q3")]
                assert wait_until(lambda: all(len(world.bot_replies(p)) == 1 for p in good), 15), \
                    [len(world.bot_replies(p)) for p in good]
            finally:
                runner.stop()
    finally:
        sock.close()
    assert world.bot_replies(bad) == [] and runner.connects == 1 and not sock.unacked
    assert [e.kind for e in store.history(Key(plat.instance, me.sender_id, bad))] == ["unreadable"]


def test_mastodon_stream_one_hostile_notification_never_costs_the_good_ones(store: Store, monkeypatch) -> None:
    """A mention notification whose status has an impossible ``created_at``, pushed in one burst with good ones on
    the sim's notification stream: recorded ``unreadable`` under its notification id, the stream kept, every good
    one answered once on the sim. Plant: a mention read without its catch raises, the stream reconnects and the
    good ones pushed with the poison are never answered by it."""
    from replyd.sim import SimServer, World
    from replyd.sim import app as sim_app
    from tests.test_daemon import wait_until

    world = World(SystemClock(), seed=4, listing_delay_s=0.2)
    bot = world.add_account("replybot", bot=True)
    world.add_account("alice")
    hostile: dict[str, str] = {}
    real = sim_app.notification_json

    def served(w: Any, n: Any) -> dict[str, Any]:
        item = real(w, n)
        if "poison" in w.statuses[n.status_id].text:
            hostile[n.status_id] = item["id"]
            return {**item, "status": {**item["status"], "created_at": "2026-13-45T99:99:99Z"}}
        return item

    monkeypatch.setattr(sim_app, "notification_json", served)
    with SimServer(world) as srv, httpx.Client(trust_env=False, timeout=5.0) as http:
        plat = make_platform("mastodon", {"base_url": srv.base_url, "token": bot.token}, http=http,
                             clock=SystemClock())
        me, runner = _stream_runner(store, plat, keep=False)
        runner.start()
        try:
            assert wait_until(lambda: world.streams_served == 1, 10)
            good = [world.post("alice", "q0", mention=["replybot"]).id]
            bad = world.post("alice", "poison", mention=["replybot"]).id
            good += [world.post("alice", f"q{i}", mention=["replybot"]).id for i in (1, 2)]
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) == 1 for p in good), 15), \
                world.replies_by(bot.id)
        finally:
            runner.stop()
    assert bad not in world.replies_by(bot.id) and runner.connects == 1
    assert [e.kind for e in store.history(Key(plat.instance, me.sender_id, hostile[bad]))] == ["unreadable"]
