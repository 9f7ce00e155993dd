"""The WhatsApp adapter and its webhooks against the stateful Cloud API fake over real HTTP.

Covers identity, the ``messages`` webhook's parents, the reply's body (context, callback data), the error
table (the 24-hour window refused with its reason, the rate limits retried, 5xx and lost answers
ambiguous, an expired token), the ``hub.challenge`` handshake, the ``X-Hub-Signature-256`` check, and the
status callbacks: a ``sent``/``delivered``/``read`` report of a send whose answer was lost confirms its row
(open or ``unconfirmed``), never another bot's or another parent's; a ``failed`` report is kept and logged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from replyd import store as st
from replyd.clock import FakeClock, SystemClock
from replyd.errors import DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.guard import Guard, Status
from replyd.hooks import Hook, Receiver
from replyd.platforms.base import NoReadBack, Parent, reads_back
from replyd.platforms.whatsapp import WhatsAppPlatform, callback_data
from replyd.sweep import Bot, Sweeper
from tests.whatsapp_fake import (APP_SECRET, DISPLAY, PHONE_ID, TOKEN, VERIFY_TOKEN, WINDOW_S, WhatsAppApi,
                                 WhatsAppWorld, fixture, sign)

ADA = "16505551234"


@pytest.fixture
def world(clock: FakeClock) -> WhatsAppWorld:
    """The fake's state on the test's clock (the 24-hour window is measured on it)."""
    return WhatsAppWorld(now=clock.now)


@pytest.fixture
def api(world: WhatsAppWorld) -> Iterator[WhatsAppApi]:
    """The Graph API side of the fake on a real HTTP server."""
    a = WhatsAppApi(world).start()
    yield a
    a.stop()


def make(api: WhatsAppApi, clock: Any = None, **settings: Any) -> WhatsAppPlatform:
    """An adapter for the fake's number, identified (as the daemon does at start)."""
    plat = WhatsAppPlatform.from_settings({"token": TOKEN, "phone_number_id": PHONE_ID, "api_url": api.url,
                                           **settings}, http=httpx.Client(timeout=5.0), clock=clock or SystemClock())
    plat.whoami()
    return plat


def deliveries(world: WhatsAppWorld) -> list[bytes]:
    """Take every queued webhook delivery, as Meta would POST it."""
    with world.lock:
        out, world.queue = [json.dumps(p).encode() for p in world.queue], []
    return out


def signed(raw: bytes) -> dict[str, str]:
    """The header Meta signs a delivery with."""
    return {"x-hub-signature-256": sign(APP_SECRET, raw)}


def inbound(plat: WhatsAppPlatform, world: WhatsAppWorld, text: str = "hello") -> Parent:
    """A customer's message as the webhook serves it to the adapter."""
    world.customer_says(ADA, text)
    [raw] = deliveries(world)
    [parent] = plat.parse_webhook("", json.loads(raw))
    return parent


def test_identity_is_the_phone_number_id_and_the_class_is_no_read_back(api) -> None:
    """whoami: the phone-number-id (sender half of the key) and the display number; NoReadBack declared."""
    plat = make(api)
    me = plat.whoami()
    assert (me.sender_id, me.handle) == (PHONE_ID, DISPLAY)
    assert isinstance(plat, NoReadBack) and not reads_back(plat) and plat.instance == "whatsapp"
    bad = WhatsAppPlatform.from_settings({"token": "EAAwrong0123456789", "phone_number_id": PHONE_ID,
                                          "api_url": api.url}, http=httpx.Client(), clock=SystemClock())
    with pytest.raises(DefinitelyNotSent) as err:
        bad.whoami()
    assert err.value.status == 401 and "code 190" in err.value.detail and "EAAwrong" not in str(err.value)


def test_the_documented_payloads_parse_to_parents_and_receipts(api) -> None:
    """The docs' text message: parent = the wamid as served, author the wa_id, place the phone-number-id;
    status reports are receipts, not parents; another number's change is not this bot's."""
    plat = WhatsAppPlatform.from_settings({"token": TOKEN, "phone_number_id": "106540352242922", "api_url": api.url},
                                          http=httpx.Client(), clock=SystemClock())
    [p] = plat.parse_webhook("", fixture("webhook_text_message"))
    assert p.id == "wamid.HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzODEwMTQ0RgA="
    # The profile name is the sender's pick: shown (author_name), never the handle the policy matches.
    assert (p.author_id, p.author_handle, p.text) == ("16505551234", "16505551234", "Does it come in another color?")
    assert p.extra["author_name"] == "Sheena Nelson"
    assert p.extra["phone_number_id"] == "106540352242922" and p.created_at == 1749416383.0
    assert plat.parse_webhook("", fixture("webhook_status_sent")) == "statuses_only"
    [r] = plat.webhook_receipts(fixture("webhook_status_failed"))
    assert r.status == "failed" and r.provider_key is None and r.errors[0].startswith("131026")
    other = json.loads(json.dumps(fixture("webhook_text_message")).replace("106540352242922", "999"))
    assert plat.parse_webhook("", other) == "other_phone_number" and plat.webhook_receipts(other) == []


def test_a_reply_is_in_context_with_the_key_in_the_callback_data(api, world, clock) -> None:
    """POST /messages: to the wa_id, type text, context.message_id = the parent, replyd's key carried back."""
    plat = make(api, clock=clock)
    parent = inbound(plat, world)
    sent = plat.send(parent, "answer", provider_key="k" * 40)
    [m] = world.sent
    assert (m["id"], m["to"], m["context"], m["text"]) == (sent.reply_id, ADA, parent.id, "answer")
    assert m["biz"] == callback_data("k" * 40, parent.id) and world.reply_counts()[parent.id] == 1


@pytest.mark.parametrize(("fault", "error"), [("ratelimited", RateLimited), ("pair", RateLimited),
                                              ("error_before", MaybeSent), ("error_after", MaybeSent),
                                              ("lost", MaybeSent)])
def test_the_error_table(api, world, clock, fault, error) -> None:
    """Rate limits (130429, 131056) are provably unsent with a wait; 5xx and a lost answer are ambiguous."""
    plat = make(api, clock=clock)
    parent = inbound(plat, world)
    world.send_faults = [fault]
    with pytest.raises(error) as err:
        plat.send(parent, "answer", provider_key="k")
    if error is RateLimited:
        assert err.value.retry_after_s and not world.sent
    assert TOKEN not in str(err.value)


def test_outside_the_24_hour_window_is_rejected_with_the_reason(api, world, store, clock) -> None:
    """131047: Rejected, its reason on the row; nothing sent, nothing retried."""
    plat = make(api, clock=clock)
    parent = inbound(plat, world)
    clock.advance(WINDOW_S + 1)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    out = guard.post(parent, "too late")
    row = store.get(guard.key(parent.id))
    assert out.status is Status.REJECTED and row.state == st.REJECTED and "24-hour" in row.error
    assert "131047" in row.error and world.sent == []
    with pytest.raises(Rejected):
        plat.send(parent, "x", provider_key="k")


def _receiver(plat: WhatsAppPlatform, guard: Guard | None, offered: list | None = None) -> Receiver:
    def offer(parent: Parent, path: str) -> Any:
        if offered is not None:
            offered.append(parent)
        assert guard is not None
        return guard.post(parent, "answer", path=path)

    return Receiver({"wa": Hook("wa", "whatsapp", APP_SECRET, plat, offer, plat.instance, guard=guard,
                                verify_token=VERIFY_TOKEN)})


def test_the_verification_handshake(api, store, clock) -> None:
    """hub.mode=subscribe with the verify token: 200 and the challenge; any other token, mode or bot: one 403."""
    plat = make(api, clock=clock)
    rx = _receiver(plat, None)
    good = {"hub.mode": "subscribe", "hub.verify_token": VERIFY_TOKEN, "hub.challenge": "1158201444"}
    assert rx.challenge("wa", good).status == 200 and rx.challenge("wa", good).body == {"challenge": "1158201444"}
    bad = [{**good, "hub.verify_token": VERIFY_TOKEN[:-1] + "x"}, {**good, "hub.mode": "unsubscribe"},
           {k: v for k, v in good.items() if k != "hub.verify_token"}, {**good, "hub.challenge": "<script>"}]
    answers = [rx.challenge("wa", q) for q in bad] + [rx.challenge("nobody", good)]
    assert {(a.status, json.dumps(a.body)) for a in answers} == {(403, json.dumps(answers[0].body))}
    rx.close()
    from starlette.testclient import TestClient

    from replyd.api.app import Api
    with TestClient(Api(store, {}, hooks=_receiver(plat, None)).app, base_url="http://127.0.0.1") as http:
        got = http.get("/v1/hooks/wa", params=good)
        assert (got.status_code, got.text) == (200, "1158201444")
        assert http.get("/v1/hooks/wa", params={**good, "hub.verify_token": "nope"}).status_code == 403
        assert VERIFY_TOKEN not in http.get("/v1/hooks/wa", params=bad[0]).text


def test_only_a_delivery_signed_with_the_app_secret_is_accepted(api, world, store, clock) -> None:
    """No signature, another secret's, or a changed body: the one 401, nothing kept or offered; signed: kept first."""
    plat = make(api, clock=clock)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    offered: list = []
    rx = _receiver(plat, guard, offered)
    wamid = world.customer_says(ADA, "hi")
    [raw] = deliveries(world)
    with capture_logs() as logs:
        refused = [rx.receive("wa", {}, raw), rx.receive("wa", {"x-hub-signature-256": sign("other-secret", raw)}, raw),
                   rx.receive("wa", signed(raw), raw.replace(b"hi", b"ho"))]
    assert [a.status for a in refused] == [401, 401, 401] and store.get(guard.key(wamid)) is None
    assert APP_SECRET not in json.dumps(logs, default=str)
    assert rx.receive("wa", signed(raw), raw).status == 202
    assert rx.receive("wa", signed(raw), raw).status == 202  # Meta delivers at least once
    rx.close()
    assert [p.id for p in offered] == [wamid, wamid] and world.reply_counts()[wamid] == 1
    assert store.get(guard.key(wamid)).state == st.CLOSED


def test_a_status_callback_confirms_the_lost_send_open_or_unconfirmed(api, world, store, clock) -> None:
    """Lost answers: a sent/delivered/read report closes the row with the landed id (still open, or already
    unconfirmed), event ``confirmed``; a report with no callback key, or another parent's, confirms nothing."""
    plat = make(api, clock=clock)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    sweeper = Sweeper(store, [Bot(plat, plat.whoami(), name="wa")], clock=clock)
    rx = _receiver(plat, guard)
    a, b, c = (inbound(plat, world, t) for t in ("a", "b", "c"))
    world.send_faults = ["lost", "lost", "lost"]
    assert [guard.post(p, "answer").status for p in (a, b, c)] == [Status.UNCERTAIN] * 3
    reports = deliveries(world)
    assert len(reports) == 9
    # a: its reports arrive while the row is still open.
    for raw in reports[:3]:
        assert rx.receive("wa", signed(raw), raw).status == 202
    row = store.get(guard.key(a.id))
    assert row.state == st.CLOSED and row.reply_id == world.lost_ids[0]
    clock.advance(60.0)
    assert sweeper.run_once().unconfirmed == 2  # b and c
    # b: a forged report naming b's parent with a's key, and one without replyd's key: nothing confirmed.
    forged = json.loads(reports[3])
    st_b = forged["entry"][0]["changes"][0]["value"]["statuses"][0]
    st_b["biz_opaque_callback_data"] = callback_data(guard.provider_key(a.id), b.id)
    bare = json.loads(reports[4])
    del bare["entry"][0]["changes"][0]["value"]["statuses"][0]["biz_opaque_callback_data"]
    for body in (forged, bare):
        raw = json.dumps(body).encode()
        assert rx.receive("wa", signed(raw), raw).status == 202
    assert store.get(guard.key(b.id)).state == st.UNCONFIRMED
    # c's reports (late: the row is unconfirmed) confirm c, and only c.
    for raw in reports[6:]:
        assert rx.receive("wa", signed(raw), raw).status == 202
    rx.close()
    rows = {p.id: store.get(guard.key(p.id)) for p in (a, b, c)}
    assert [rows[p.id].state for p in (a, b, c)] == [st.CLOSED, st.UNCONFIRMED, st.CLOSED]
    assert rows[c.id].reply_id == world.lost_ids[2]
    assert [e.kind for e in store.history(guard.key(c.id))][-2:] == ["unconfirmed", "confirmed"]
    assert guard.post(b, "again").status is Status.UNCONFIRMED and world.send_requests == 3


def test_a_failed_status_is_kept_and_reported(api, world, store, clock) -> None:
    """A ``failed`` report of replyd's send: an event ``delivery_failed`` with the codes, an error log; state kept."""
    plat = make(api, clock=clock)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    rx = _receiver(plat, guard)
    p = inbound(plat, world)
    out = guard.post(p, "answer")
    body = fixture("webhook_status_failed")
    s = body["entry"][0]["changes"][0]["value"]
    s["metadata"]["phone_number_id"] = PHONE_ID
    s["statuses"][0].update(id=out.reply_id, biz_opaque_callback_data=callback_data(guard.provider_key(p.id), p.id))
    raw = json.dumps(body).encode()
    with capture_logs() as logs:
        assert rx.receive("wa", signed(raw), raw).status == 202
    rx.close()
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["replyd.hooks.delivery_failed"]
    events = store.history(guard.key(p.id))
    assert events[-1].kind == "delivery_failed" and store.get(guard.key(p.id)).state == st.CLOSED
