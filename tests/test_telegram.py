"""The Telegram adapter and the no-read-back class against the stateful Bot API fake over real HTTP.

Covers identity, the inbox filter (private, mention, reply to the bot, command, forum topic; the rest
dropped), ``getUpdates`` offsets (nothing confirmed before the poller saves the cursor), the error
table, the webhook secret token, and the guard + sweep on a platform without read-back: a lost answer
ends ``unconfirmed`` and is never sent again on its own; a 429 is retried; rearm and confirm resolve it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from replyd import library
from replyd import store as st
from replyd.clock import FakeClock, SystemClock
from replyd.config import PollerConfig
from replyd.errors import DefinitelyNotSent, MaybeSent, RateLimited, Rejected, StoreError
from replyd.guard import Guard, Status
from replyd.hooks import Hook, Receiver
from replyd.platforms.base import NoReadBack, Parent, Pending, reads_back
from replyd.platforms.telegram import TelegramPlatform, utf16_slice
from replyd.pollers import Pollers
from replyd.sweep import Bot, Sweeper
from tests.telegram_fake import BOT_ID, TOKEN, TelegramApi, TelegramWorld, WebhookSender, fixture

GROUP, DM = -1001234567890, 5000000001
SECRET = "s3cret-token_for-the-webhook-0123"


@pytest.fixture
def world() -> TelegramWorld:
    """A supergroup and a private chat with the bot."""
    w = TelegramWorld()
    w.chat(GROUP, type="supergroup", title="replyd testers", username="replyd_testers")
    w.chat(DM, type="private", title="Ada")
    return w


@pytest.fixture
def api(world: TelegramWorld) -> Iterator[TelegramApi]:
    """The Bot API side of the fake on a real HTTP server."""
    a = TelegramApi(world).start()
    yield a
    a.stop()


def make(api: TelegramApi, clock: Any = None, **settings: Any) -> TelegramPlatform:
    """An adapter for the fake's bot, identified (as the daemon does at start)."""
    plat = TelegramPlatform.from_settings({"token": TOKEN, "api_url": api.url, "long_poll_s": 0, **settings},
                                          http=httpx.Client(timeout=5.0), clock=clock or SystemClock())
    plat.whoami()
    return plat


# -- identity, capability, parsing -------------------------------------------------------------------


def test_identity_is_getme_id_and_the_token_never_shows(api) -> None:
    """getMe's id is the sender id; the token (in the URL path) is in no repr, log line or error."""
    with capture_logs() as logs:
        plat = make(api)
        bad = TelegramPlatform.from_settings({"token": "1:wrong", "api_url": api.url}, http=httpx.Client(),
                                             clock=SystemClock())
        with pytest.raises(DefinitelyNotSent) as refused:
            bad.whoami()
    assert plat.whoami().sender_id == str(BOT_ID) and plat.whoami().handle == "replyd_test_bot"
    assert refused.value.status == 401
    text = json.dumps(logs, default=str) + repr(plat) + repr(plat.s) + str(refused.value)
    assert TOKEN not in text and "1:wrong" not in text


def test_the_adapter_is_in_the_no_read_back_class() -> None:
    """Telegram declares NoReadBack; its read_back checks nothing, so nothing is ever "not found"."""
    plat = TelegramPlatform.from_settings({"token": TOKEN}, http=httpx.Client(), clock=SystemClock())
    assert isinstance(plat, NoReadBack) and not reads_back(plat) and "history" in plat.no_read_back()
    rb = plat.read_back([Pending(Parent("1:2", "3"), 0.0)], sender_id=str(BOT_ID))
    assert rb.checked == set() and rb.found == {}


def test_entity_offsets_are_utf16_code_units() -> None:
    """A mention after an emoji (two UTF-16 units) is found at its UTF-16 offset."""
    assert utf16_slice("\U0001f600 @replyd_test_bot hi", 3, 16) == "@replyd_test_bot"


def test_inbox_offers_what_addresses_the_bot_and_drops_the_rest(api, world) -> None:
    """Private message, mention, reply to the bot, /cmd@bot and a forum topic are parents; the rest is not."""
    plat = make(api)
    for name in ("update_private", "update_group_mention", "update_group_reply", "update_group_command",
                 "update_forum_topic", "update_group_unaddressed"):
        u = fixture(name)
        world.updates.append((u["update_id"], world.now(), u))
    world.updates.append((100000007, world.now(), {"update_id": 100000007, "edited_message": fixture(
        "update_private")["message"]}))
    page = plat.inbox(None)
    ids = [p.id for p in page.parents]
    assert ids == [f"{DM}:1", f"{GROUP}:42", f"{GROUP}:44", f"{GROUP}:45", "-1009876543210:77"]
    assert page.cursor == "100000008"
    topic = page.parents[-1]
    assert topic.extra["message_thread_id"] == 70 and plat.addresses(topic, plat.whoami())
    assert page.parents[1].url == "https://t.me/replyd_testers/42"


def test_inbox_confirms_nothing_until_the_next_poll_sends_the_saved_offset(api, world) -> None:
    """getUpdates is never called with the new offset by inbox itself: the batch stays until the next poll."""
    plat = make(api)
    a, b = world.post(GROUP, "one"), world.post(GROUP, "two")
    page = plat.inbox(None)
    assert [p.id for p in page.parents] == [a, b]
    assert len(world.pending_updates()) == 2, "the batch was confirmed before the poller offered it"
    again = plat.inbox(None)  # a crash lost the offset: the same batch is served again
    assert [p.id for p in again.parents] == [a, b]
    c = world.post(GROUP, "three")
    nxt = plat.inbox(page.cursor)
    assert [p.id for p in nxt.parents] == [c] and len(world.pending_updates()) == 1


class _Pipe:
    """A pipeline stand-in that fails (a store outage) on the ``fail_at``-th offer."""

    def __init__(self, guard: Any, fail_at: int) -> None:
        self.guard, self.fail_at, self.offered = guard, fail_at, []

    def offer(self, parent: Parent, path: str) -> Any:
        if len(self.offered) + 1 == self.fail_at:
            raise StoreError("store down (test)")
        self.offered.append(parent.id)
        return None

    def offer_page(self, parents: list[Parent], path: str) -> list[Any]:
        """Each parent's offer in turn; a failure ends the page (its last entry), as ``Pipeline.offer_page``."""
        got: list[Any] = []
        for parent in parents:
            try:
                got.append(self.offer(parent, path))
            except StoreError as exc:
                got.append(exc)
                break
        return got


def test_a_batch_interrupted_mid_offer_is_served_again(api, world, tmp_path) -> None:
    """The poller saves the offset only after every update was offered: one failing offer re-reads the batch."""
    plat = make(api)
    store = st.Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    guard = type("G", (), {"identity": plat.whoami()})()
    ids = [world.post(GROUP, f"m{i}") for i in range(3)]
    pipe = _Pipe(guard, fail_at=2)
    polls = Pollers(store, plat, pipe, PollerConfig(), SystemClock())  # type: ignore[arg-type]
    polls.inbox()
    assert store.get_cursor(plat.instance, str(BOT_ID), "inbox") is None
    pipe.fail_at = 0
    polls.inbox()
    assert pipe.offered == [ids[0], *ids]  # the first again, then all three
    assert store.get_cursor(plat.instance, str(BOT_ID), "inbox") is not None
    polls.inbox()  # the saved offset confirms the batch
    assert world.pending_updates() == []
    store.dispose()


def test_webhook_mode_asks_nothing_and_getupdates_conflicts_with_a_webhook(api, world) -> None:
    """With a webhook set getUpdates is a 409 (a read: DefinitelyNotSent); mode = webhook never asks."""
    plat = make(api)
    plat.set_webhook("http://127.0.0.1:9/hook", SECRET)
    with pytest.raises(DefinitelyNotSent) as conflict:
        plat.inbox(None)
    assert conflict.value.status == 409
    quiet = make(api, mode="webhook")
    before = len(world.get_updates_offsets)
    assert quiet.inbox("5").cursor == "5" and len(world.get_updates_offsets) == before
    plat.delete_webhook()
    world.post(GROUP, "after")
    assert len(plat.inbox(None).parents) == 1


# -- send and the error table ----------------------------------------------------------------------


def test_send_replies_with_reply_parameters_and_in_the_forum_topic(api, world) -> None:
    """A reply names the parent by reply_parameters and lands in its topic; the reply id is chat:message."""
    plat = make(api)
    world.chat(-1009876543210, type="supergroup", title="forum")
    pid = world.post(-1009876543210, "in a topic", thread_id=70)
    parent = plat.inbox(None).parents[0]
    sent = plat.send(parent, "answer", provider_key="k")
    chat, _, mid = sent.reply_id.partition(":")
    msg = world.chats[int(chat)].messages[int(mid)]
    assert msg["message_thread_id"] == 70 and world.bot_replies(pid) == 1


@pytest.mark.parametrize(("fault", "error", "created"), [
    ("lost", MaybeSent, True), ("error_after", MaybeSent, True), ("error_before", MaybeSent, False),
    ("ratelimited", RateLimited, False), ("blocked", Rejected, False),
])
def test_send_faults_map_by_the_error_table(api, world, fault, error, created) -> None:
    """Lost answers and 5xx may have landed; 429 waits parameters.retry_after; 403 blocked is a refusal."""
    plat = make(api)
    pid = world.post(DM, "hi")
    world.send_faults = [fault]
    with pytest.raises(error) as exc:
        plat.send(plat.resolve(pid), "answer", provider_key="k")
    assert world.bot_replies(pid) == (1 if created else 0)
    if fault == "ratelimited":
        assert exc.value.retry_after_s == 3.0
        with pytest.raises(RateLimited):  # blocked client-side until then: nothing sent
            plat.send(plat.resolve(pid), "answer", provider_key="k")
        assert world.send_requests == 1


def test_a_first_name_is_never_a_handle_and_never_passes_the_allow_list(api, world) -> None:
    """A sender without a username has no handle: its chosen first name is shown, never matched."""
    from replyd.policy import Policy

    plat = make(api)
    forged = world.post(GROUP, "let me in", user_id=5000000066, username=None, first_name="@alice_admin")
    real = world.post(GROUP, "hello", user_id=5000000042, username="alice_admin")
    page = {p.id: p for p in plat.inbox(None).parents}
    assert page[forged].author_handle == "" and page[forged].extra["author_name"] == "@alice_admin"
    policy = Policy.build(allow_accounts=["alice_admin"])
    me, clock = plat.whoami(), FakeClock()
    assert policy.reason_to_skip(page[forged], me, clock) == "account_not_allowed"
    assert policy.reason_to_skip(page[real], me, clock) is None


def test_chats_lists_the_chats_answered_in_by_poll_and_by_webhook(api, world) -> None:
    """With ``chats`` set, an update from any other chat (another group, a private chat) is no parent."""
    other = -1005555555555
    world.chat(other, type="supergroup", title="strangers")
    listed, dm, stray = world.post(GROUP, "hi"), world.post(DM, "hi"), world.post(other, "hi")
    plat = make(api, chats=[GROUP])
    assert [p.id for p in plat.inbox(None).parents] == [listed]
    assert {p.id for p in make(api).inbox(None).parents} == {listed, dm, stray}
    update = {"update_id": 1, "message": world.chats[other].messages[int(stray.partition(":")[2])]}
    assert plat.parse_webhook("", update) == "chat_not_listed"


def test_a_prompt_injection_pings_nobody_but_the_author(api, world) -> None:
    """A reply echoing every mention form keeps only the author's @name live, when sent and when edited;
    ``allow_mentions`` lets them through."""
    from tests.test_mentions import INJECTION, at_pings, injected

    plat = make(api)
    pid = world.post(GROUP, f"{INJECTION} @grace")
    [parent] = plat.inbox(None).parents
    sent = plat.send(parent, injected(parent), provider_key="k")
    chat, _, mid = sent.reply_id.partition(":")
    msg = world.chats[int(chat)].messages[int(mid)]
    assert world.bot_replies(pid) == 1 and at_pings(msg["text"]) == ["grace"]
    plat.edit(parent, sent.reply_id, injected(parent) + " (edited)")
    assert at_pings(msg["text"]) == ["grace"] and msg["text"].endswith("(edited)")
    loose = make(api, allow_mentions=True)
    sent = loose.send(parent, injected(parent), provider_key="k2")
    chat, _, mid = sent.reply_id.partition(":")
    assert "mallory@evil.example" in at_pings(world.chats[int(chat)].messages[int(mid)]["text"])


def test_send_refusals_and_an_unreachable_api(api, world) -> None:
    """A reply to a missing message is 400 Rejected; a refused connection provably sent nothing."""
    plat = make(api)
    with pytest.raises(Rejected) as gone:
        plat.send(plat.resolve(f"{GROUP}:999"), "x", provider_key="k")
    assert gone.value.status == 400 and "replied not found" in gone.value.detail
    with pytest.raises(Rejected):
        plat.resolve("not-an-id")
    dead = TelegramPlatform.from_settings({"token": TOKEN, "api_url": "http://127.0.0.1:9"}, http=httpx.Client(),
                                          clock=SystemClock())
    with pytest.raises(DefinitelyNotSent):
        dead.send(Parent(f"{GROUP}:1", ""), "x", provider_key="k")


# -- the webhook secret token ------------------------------------------------------------------------


def _receiver(plat: TelegramPlatform, offered: list) -> Receiver:
    def offer(parent: Parent, path: str) -> Any:
        offered.append(parent.id)
        return type("O", (), {"status": Status.POSTED})()

    return Receiver({"tg": Hook("tg", "telegram", SECRET, plat, offer, plat.instance)})


def test_webhook_deliveries_need_the_secret_token(api, world) -> None:
    """The X-Telegram-Bot-Api-Secret-Token must equal the secret: missing or wrong is the one 401."""
    plat = make(api)
    offered: list = []
    rx = _receiver(plat, offered)
    body = json.dumps(fixture("update_group_mention")).encode()
    assert rx.receive("tg", {}, body).status == 401
    assert rx.receive("tg", {"x-telegram-bot-api-secret-token": SECRET[:-1] + "x"}, body).status == 401
    assert rx.receive("tg", {"x-telegram-bot-api-secret-token": SECRET + " \u00e9"}, body).status == 401
    ok = rx.receive("tg", {"x-telegram-bot-api-secret-token": SECRET}, body)
    rx.close()
    assert ok.status == 202 and offered == [f"{GROUP}:42"]
    unaddressed = _receiver(plat, offered).receive("tg", {"x-telegram-bot-api-secret-token": SECRET},
                                                   json.dumps(fixture("update_group_unaddressed")).encode())
    assert unaddressed.status == 202 and unaddressed.body["accepted"] == 0


def test_an_accepted_delivery_is_a_durable_row_before_its_ack_and_a_down_store_is_503(api, world, store, clock) -> None:
    """Each parent of an accepted delivery is a ``released`` row (snapshot, event ``received``) before the 2xx and
    before the offer, which claims it as re-find would; a store that cannot commit: 503, nothing offered."""
    plat = make(api, clock=clock)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    seen: list = []

    def offer(parent: Parent, path: str) -> Any:
        seen.append(store.get(guard.key(parent.id)))  # what another replica's re-find could see by now
        return guard.post(parent, "answer", path=path)

    rx = Receiver({"tg": Hook("tg", "telegram", SECRET, plat, offer, plat.instance, guard=guard)})
    head = {"x-telegram-bot-api-secret-token": SECRET}
    pid = world.post(GROUP, "hello")
    [update] = [u for _, _, u in world.updates]
    ok = rx.receive("tg", head, json.dumps(update).encode())
    rx.close()
    assert ok.status == 202 and [(r.state, r.attempt, r.path) for r in seen] == [(st.RELEASED, 1, "webhook")]
    assert json.loads(seen[0].snapshot)["id"] == pid and world.bot_replies(pid) == 1
    assert [e.kind for e in store.history(guard.key(pid))][:2] == ["received", "claimed"]
    assert store.get(guard.key(pid)).state == st.CLOSED
    down = st.Store.open("postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2", clock=clock, migrate=None)
    dead = Guard(down, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    offered: list = []
    rx = Receiver({"tg": Hook("tg", "telegram", SECRET, plat, lambda p, path: offered.append(p), plat.instance,
                              guard=dead)})
    with capture_logs() as logs:
        refused = rx.receive("tg", head, json.dumps(update).encode())
    rx.close()
    down.dispose()
    assert refused.status == 503 and refused.body["error"] == "store_unavailable" and offered == []
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["replyd.hooks.store_failed"]


def test_the_fake_redelivers_until_acked(api, world) -> None:
    """The fake's webhook side repeats a delivery that was not answered 2xx, with the secret header."""
    from tests.fixtures_server import FixtureServer, Reply

    hook = FixtureServer()
    hook.start()
    hook.route("POST", "/hook", Reply(status=500, body={}), Reply(status=200, body={}))
    make(api).set_webhook(hook.url + "/hook", SECRET)
    world.post(GROUP, "x")
    sender = WebhookSender(world, retry_s=0.05).start()
    try:
        import time
        t = time.monotonic() + 5
        while world.pending_updates() and time.monotonic() < t:
            time.sleep(0.05)
    finally:
        sender.stop()
        hook.stop()
    got = hook.requests_to("POST", "/hook")
    assert len(got) == 2 and all(r.headers["x-telegram-bot-api-secret-token"] == SECRET for r in got)


# -- the no-read-back class through the guard and the sweep ------------------------------------------


def _guard(store: st.Store, plat: TelegramPlatform, clock: FakeClock) -> tuple[Guard, Sweeper]:
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    return g, Sweeper(store, [Bot(plat, plat.whoami(), name="tg")], clock=clock)


def test_a_lost_answer_ends_unconfirmed_and_is_never_sent_again(api, world, store, clock) -> None:
    """Lost response: uncertain, then unconfirmed by the sweep (alert line); no path sends it again."""
    plat = make(api, clock=clock)
    guard, sweeper = _guard(store, plat, clock)
    pid = world.post(GROUP, "hello")
    parent = plat.inbox(None).parents[0]
    world.send_faults = ["lost"]
    assert guard.post(parent, "answer", path="inbox").status is Status.UNCERTAIN
    clock.advance(60.0)
    with capture_logs() as logs:
        res = sweeper.run_once()
    assert res.unconfirmed == 1
    alert = [e for e in logs if e["event"] == "replyd.reply.unconfirmed"]
    assert alert and alert[0]["bot"] == "tg" and alert[0]["platform"] == "telegram" and alert[0]["log_level"] == "error"
    row = store.get(guard.key(pid))
    assert row.state == st.UNCONFIRMED and row.deadline_at is None
    for _ in range(3):  # every path, every sweep, a day later: nothing more is sent
        assert guard.post(parent, "answer", path="refind").status is Status.UNCONFIRMED
        clock.advance(86_400.0)
        sweeper.run_once()
    assert world.bot_replies(pid) == 1 and world.send_requests == 1
    assert store.reoffer_due(plat.instance, str(BOT_ID), now=clock.now(), after=None, limit=10) == []


def test_rearm_sends_again_and_confirm_marks_answered(api, world, store, clock) -> None:
    """An operator resolves unconfirmed rows: rearm lets one more send leave; confirm closes without one."""
    plat = make(api, clock=clock)
    guard, sweeper = _guard(store, plat, clock)
    a, b = world.post(GROUP, "a"), world.post(GROUP, "b")
    pa, pb = plat.inbox(None).parents
    world.send_faults = ["error_before", "lost"]  # a 502 that created nothing, an answer lost after creating
    assert guard.post(pa, "x").status is Status.UNCERTAIN and guard.post(pb, "x").status is Status.UNCERTAIN
    clock.advance(60.0)
    assert sweeper.run_once().unconfirmed == 2
    assert library.rearm(store, guard.key(a), by="test").rearmed
    assert guard.post(pa, "x").status is Status.POSTED
    res = library.confirm(store, guard.key(b), by="test", reply_id=world.unanswered[0])
    assert res.confirmed and res.row.state == st.CLOSED and res.row.reply_id == world.unanswered[0]
    assert guard.post(pb, "x").status is Status.ALREADY_ANSWERED
    assert not library.confirm(store, guard.key(b), by="test").confirmed  # only an unconfirmed key
    assert world.reply_counts() == {a: 1, b: 1}


def test_provably_unsent_failures_are_retried_as_everywhere(api, world, store, clock) -> None:
    """A 429 (nothing created) releases the row: the next offer after retry_after sends once."""
    plat = make(api, clock=clock)
    guard, sweeper = _guard(store, plat, clock)
    pid = world.post(DM, "hi")
    parent = plat.inbox(None).parents[0]
    world.send_faults = ["ratelimited"]
    assert guard.post(parent, "x").status is Status.NOT_SENT
    assert store.get(guard.key(pid)).state == st.RELEASED
    clock.advance(5.0)
    plat.limits = type(plat.limits)(clock.now)  # the fake clock moved; the adapter's block ran on it
    assert guard.post(parent, "x").status is Status.POSTED
    clock.advance(60.0)
    assert sweeper.run_once().unconfirmed == 0 and world.bot_replies(pid) == 1


def test_status_and_confirm_on_the_command_line(api, world, tmp_path) -> None:
    """`replyd status --json` counts the unconfirmed row; `replyd confirm telegram PARENT --reply-id` closes it;
    `replyd rearm --state unconfirmed --dry-run` lists what would be sent again."""
    from tests.api_harness import replyd_cli

    clock = FakeClock()
    db = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    store = st.Store.open(db, clock=clock)
    plat = make(api, clock=clock)
    guard, sweeper = _guard(store, plat, clock)
    a, b = world.post(GROUP, "a"), world.post(GROUP, "b")
    world.send_faults = ["lost", "lost"]
    for p in plat.inbox(None).parents:
        guard.post(p, "x")
    clock.advance(60.0)
    sweeper.run_once()
    store.dispose()
    shown = json.loads(replyd_cli("status", "--json", "--store", db).stdout)
    assert {(c["state"], c["rows"]) for c in shown["counts"]} == {("unconfirmed", 2)}
    dry = replyd_cli("rearm", "--state", "unconfirmed", "--dry-run", "--json", "--store", db)
    assert dry.returncode == 0 and a in dry.stdout and b in dry.stdout, dry.stderr
    # A group's parent id starts with "-": "--" ends the options, as for any command line.
    done = replyd_cli("confirm", "--reply-id", world.unanswered[0], "--json", "--store", db, "--", "telegram", a)
    assert done.returncode == 0 and json.loads(done.stdout)["state"] == "closed", done.stderr
    assert world.reply_counts() == {a: 1, b: 1}


def test_a_second_poller_ends_the_first_with_409_and_nothing_is_confirmed(api, world) -> None:
    """Two replicas long-polling at once: the earlier poll ends 409 (a read: DefinitelyNotSent), the later
    one serves the update; neither confirms it."""
    import threading
    import time

    plat, other = make(api, long_poll_s=5), make(api, long_poll_s=5)
    got: dict[str, Any] = {}

    def poll(name: str, p: TelegramPlatform) -> None:
        got[name] = _outcome(lambda: p.inbox(None))

    def generation(n: int) -> None:
        end = time.monotonic() + 5
        while world.poll_generation < n and time.monotonic() < end:
            time.sleep(0.02)

    threads = [threading.Thread(target=poll, args=("first", plat)), threading.Thread(target=poll, args=("second", other))]
    threads[0].start()
    generation(1)
    threads[1].start()
    generation(2)
    threads[0].join(10)
    pid = world.post(GROUP, "while two poll")
    threads[1].join(10)
    assert isinstance(got["first"], DefinitelyNotSent) and got["first"].status == 409, got
    assert [p.id for p in got["second"].parents] == [pid] and len(world.pending_updates()) == 1


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # the test looks at what the poll raised
        return exc


# -- edits (EditReply) and answers in parts (PostLimit) --------------------------------------------


def _sent(plat: TelegramPlatform, world: TelegramWorld, text: str = "first words") -> tuple[Parent, str]:
    """A person's message in the group and the bot's reply to it: (parent, reply id)."""
    world.post(GROUP, "hello")
    parent = plat.inbox(None).parents[-1]
    return parent, plat.send(parent, text, provider_key="k").reply_id


def test_an_edit_sets_the_text_and_the_same_text_again_is_done(api, world) -> None:
    """EditReply over HTTP: the message's text is the last one set (the fake's ground truth); setting it again is
    the Bot API's 400 "message is not modified", which is success (nothing raised, nothing changed)."""
    from replyd.platforms.base import EditReply

    plat = make(api)
    assert isinstance(plat, EditReply)
    parent, rid = _sent(plat, world)
    plat.edit(parent, rid, "first words, and more")
    plat.edit(parent, rid, "first words, and more")
    assert world.text(rid) == "first words, and more" and world.history(rid) == ["first words, and more"]
    assert world.edit_requests == 2 and world.bot_replies(parent.id) == 1


@pytest.mark.parametrize(("fault", "acted"), [("lost", True), ("error_after", True), ("error_before", False)])
def test_an_edit_whose_answer_is_lost_is_maybe_sent_and_its_repeat_is_done(api, world, fault, acted) -> None:
    """A dropped answer or a 502 is MaybeSent (the fake tells whether it acted); the repeat of an edit that acted
    meets "message is not modified" and is done: one edit on the platform, the text as set."""
    plat = make(api)
    parent, rid = _sent(plat, world)
    world.edit_faults = [fault]
    with pytest.raises(MaybeSent):
        plat.edit(parent, rid, "grown answer")
    assert world.text(rid) == ("grown answer" if acted else "first words")
    plat.edit(parent, rid, "grown answer")  # plant: "not modified" taken as a refusal
    assert world.text(rid) == "grown answer" and world.history(rid) == ["grown answer"]


def test_an_edit_rate_limited_waits_retry_after_and_sends_nothing_meanwhile(api, world) -> None:
    """429 with parameters.retry_after: RateLimited; the next edit is refused locally until then."""
    plat = make(api)
    parent, rid = _sent(plat, world)
    world.edit_faults = ["ratelimited"]
    with pytest.raises(RateLimited) as got:
        plat.edit(parent, rid, "grown")
    assert got.value.retry_after_s == 3.0
    with pytest.raises(RateLimited):
        plat.edit(parent, rid, "grown")
    assert world.edit_requests == 1 and world.text(rid) == "first words"


@pytest.mark.parametrize("case", ["gone", "not_ours", "too_old", "too_long", "empty"])
def test_an_edit_the_bot_api_refuses_is_rejected_and_changes_nothing(api, world, case) -> None:
    """Message to edit not found, can't be edited (another's, past the window), too long, empty: Rejected."""
    plat = make(api)
    parent, rid = _sent(plat, world)
    target, text = rid, "new text"
    if case == "gone":
        plat.delete(rid)
    if case == "not_ours":
        target = parent.id
    if case == "too_old":
        world.edit_window_s = -1.0
    if case == "too_long":
        text = "👍" * 2049  # 4,098 UTF-16 code units
    if case == "empty":
        text = " "
    with pytest.raises(Rejected) as got:
        plat.edit(parent, target, text)
    assert got.value.status == 400
    if case != "gone":
        assert world.text(rid) == "first words" and world.history(rid) == []


def test_the_post_limit_never_lets_a_part_exceed_4096_utf16_units(api, world) -> None:
    """Telegram counts UTF-16 code units and so does the limit ("utf16"): a part of emoji (2 units each) fits, a
    plain answer gets the whole 4,096 units; the fake refuses 4,097 units as the Bot API does."""
    from replyd.parts import split
    from tests.telegram_fake import utf16_len

    plat = make(api)
    pid = world.post(DM, "hi")
    parent = plat.resolve(pid)
    with pytest.raises(Rejected):
        plat.send(parent, "a" * 4095 + "👍", provider_key="k")  # 4,097 units
    limit = plat.post_limit(parent)
    parts = split("👍 " * 3000, limit)
    for p in parts:  # plant: a limit of 4,096 code points (the first part is 5,462 units, refused)
        plat.send(parent, p, provider_key="k")
    assert world.bot_replies(pid) == len(parts) == 3 and max(utf16_len(p) for p in parts) <= 4096
    assert (limit.size, limit.unit) == (4096, "utf16")
    assert [len(p) for p in split("ab " * 3000, limit)][0] > 4000  # plain text: the whole room, not half


LONG = " ".join(f"Sentence {i} of a long answer, which says something worth reading." for i in range(150))


def _thread(world: TelegramWorld, parent_id: str) -> list[dict[str, Any]]:
    """The bot's messages from ``parent_id`` down the reply chain (each part answering the one before)."""
    chat_id, _, at = parent_id.partition(":")
    msgs = world.chats[int(chat_id)].messages
    out = []
    mid = int(at)
    while True:
        kids = [m for m in msgs.values() if m["from"]["id"] == BOT_ID
                and (m.get("reply_to_message") or {}).get("message_id") == mid]
        assert len(kids) <= 1, f"{len(kids)} bot messages answer {mid}"
        if not kids:
            return out
        out.append(kids[0])
        mid = kids[0]["message_id"]


def test_a_three_part_answer_is_three_messages_each_replying_to_the_one_before(api, world, store, clock) -> None:
    """Through the real guard: one message per part, in order, in the parent's forum topic, each a reply to the
    previous part; each part's row closed with its own message."""
    from replyd.parts import part_id, split

    plat = make(api, clock=clock)
    guard, _ = _guard(store, plat, clock)
    world.chat(-1009876543210, type="supergroup", title="forum")
    pid = world.post(-1009876543210, "tell me everything", thread_id=70)
    parent = plat.inbox(None).parents[0]
    parts = split(LONG, plat.post_limit(parent))
    assert len(parts) == 3
    out = guard.post(parent, LONG)
    assert out.status is Status.POSTED
    msgs = _thread(world, pid)
    assert [m["text"] for m in msgs] == parts and all(m["message_thread_id"] == 70 for m in msgs)
    assert world.send_requests == 3 and sum(world.reply_counts().values()) == 3
    for k, m in enumerate(msgs, 1):
        assert store.get(guard.key(part_id(pid, k))).reply_id == f"-1009876543210:{m['message_id']}"


def test_a_lost_part_ends_unconfirmed_and_is_never_sent_again(api, world, store, clock) -> None:
    """No read-back: part 2's answer lost leaves it open, the sweep makes it unconfirmed and the answer with it;
    no later offer or sweep sends part 2 again or goes on to part 3."""
    from replyd.parts import part_id

    plat = make(api, clock=clock)
    guard, sweeper = _guard(store, plat, clock)
    pid = world.post(GROUP, "tell me everything")
    parent = plat.inbox(None).parents[0]
    world.send_faults = ["", "lost"]
    assert guard.post(parent, LONG).status is Status.UNCERTAIN
    clock.advance(60.0)
    assert sweeper.run_once().unconfirmed == 1
    assert store.get(guard.key(part_id(pid, 2))).state == st.UNCONFIRMED
    for _ in range(3):
        assert guard.post(parent, LONG, path="refind").status is Status.UNCONFIRMED
        clock.advance(86_400.0)
        sweeper.run_once()
    assert store.get(guard.key(pid)).state == st.UNCONFIRMED
    assert world.send_requests == 2 and len(_thread(world, pid)) == 2 and world.unanswered == [
        f"{GROUP}:{_thread(world, pid)[1]['message_id']}"]


def test_the_bots_own_parts_are_never_offered_and_a_reply_to_one_is(api, world, store, clock) -> None:
    """The inbox skips the bot's parts (from a bot); a person's reply to part 2 is offered and addresses the bot;
    a part's parent does not claim to address it."""
    plat = make(api, clock=clock)
    guard, _ = _guard(store, plat, clock)
    world.post(GROUP, "tell me everything")
    page = plat.inbox(None)
    guard.post(page.parents[0], LONG)
    part2 = _thread(world, page.parents[0].id)[1]
    world._queue({"message": part2})  # even were the bot's own message delivered, it is not a parent
    assert plat.inbox(page.cursor).parents == []
    later = world.post(GROUP, "thanks, but why?", mention=False, reply_to=part2["message_id"])
    [offered] = plat.inbox(page.cursor).parents
    assert offered.id == later and plat.addresses(offered, plat.whoami())
    assert not plat.addresses(plat.part_parent(page.parents[0], f"{GROUP}:{part2['message_id']}"), plat.whoami())


def test_a_streamed_answer_is_one_message_per_part_grown_by_edits(api, world, store, clock) -> None:
    """A streamed responder through the real guard: each part sent once (a reply chain), grown by editMessageText;
    the final texts are the whole answer, each within 4,096 UTF-16 code units though every word carries an emoji
    (plant: an edit that does nothing leaves the first words only)."""
    from tests.telegram_fake import utf16_len
    from tests.test_stream import Streamer

    plat = make(api, clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, compose_lease_s=60.0,
              stream_edit_interval_s=1.0)
    words = [f"word{i:03d}👍" + "x" * 40 for i in range(200)]  # 47 code points, 48 UTF-16 units each: 3 parts
    pid = world.post(GROUP, "stream it")
    out = g.post(plat.inbox(None).parents[0], Streamer(clock, words=words))
    assert out.status is Status.POSTED, out
    msgs = _thread(world, pid)
    assert len(msgs) == len(out.parts) == 3 and all(utf16_len(m["text"]) <= 4096 for m in msgs)
    assert " ".join(m["text"] for m in msgs) == " ".join(words)
    assert sum(len(world.history(f"{GROUP}:{m['message_id']}")) for m in msgs) >= len(msgs)
    assert world.send_requests == 3 and store.get(g.key(pid)).state == st.CLOSED
