"""Discord interactions: the Ed25519 check, PING, the deferred answer, the 15-minute token, and two replicas."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa
from nacl.signing import SigningKey

from replyd.clock import FakeClock
from replyd.errors import Rejected
from replyd.hooks import Hook, Receiver, discord_verify
from replyd.platforms.base import make_platform
from replyd.platforms.discord import DiscordPlatform
from tests import discord_scenario
from tests.discord_fake import BOT_ID, BOT_TOKENS, InteractionSender, Msg
from tests.test_discord import rest, world  # noqa: F401  (the fake's fixtures)

ALICE = "53908099506183680"


def _signed(key: SigningKey, body: dict, stamp: int | None = None) -> tuple[dict[str, str], bytes]:
    raw = json.dumps(body).encode()
    ts = str(stamp if stamp is not None else int(time.time()))
    return {"x-signature-ed25519": key.sign(ts.encode() + raw).signature.hex(), "x-signature-timestamp": ts}, raw


@contextlib.contextmanager
def _interacting(world, rest) -> Iterator[tuple[DiscordPlatform, InteractionSender, str, FakeClock]]:
    """An adapter on the fake clock, an interaction sender and a channel; the sender closed at the end."""
    clock = FakeClock(time.time())
    with httpx.Client(trust_env=False) as http:
        p = make_platform("discord", {"api_url": rest.url, "token": BOT_TOKENS[0]}, http=http, clock=clock)
        assert isinstance(p, DiscordPlatform)
        sender = InteractionSender(world, [])
        try:
            yield p, sender, world.add_channel(), clock
        finally:
            sender.close()


def test_ed25519_check_refuses_forged_altered_stale_and_malformed() -> None:
    """A genuine signature passes; another key, an altered body, a timestamp 6 minutes old, non-hex: refused."""
    key = SigningKey.generate()
    pub = bytes(key.verify_key).hex()
    now = time.time()
    headers, raw = _signed(key, {"type": 1})
    assert discord_verify(pub, raw, headers, now)
    assert not discord_verify(pub, raw, _signed(SigningKey.generate(), {"type": 1})[0], now)
    assert not discord_verify(pub, raw + b" ", headers, now)
    assert not discord_verify(pub, raw, _signed(key, {"type": 1}, int(now) - 360)[0], now)
    assert not discord_verify(pub, raw, {**headers, "x-signature-ed25519": "zz" * 64}, now)


def test_receiver_pings_defers_and_drops_forged_deliveries(world, rest) -> None:
    """PING → PONG; a signed command → 200 type 5 and its parent offered (id: the interaction id); the same
    command under another key → the one 401, nothing offered."""
    with httpx.Client(trust_env=False) as http:
        p = make_platform("discord", {"api_url": rest.url, "token": BOT_TOKENS[0]}, http=http, clock=FakeClock())
        sender = InteractionSender(world, [])
        offered: list[str] = []

        class Out:
            status = type("S", (), {"value": "posted"})()

        hook = Hook("d", "discord", sender.public_key, p, lambda parent, path: offered.append(parent.id) or Out())
        recv = Receiver({"d": hook})
        try:
            cid = world.add_channel()
            assert recv.receive("d", *_signed(sender.key, {"type": 1})).body == {"type": 1}
            body = sender.payload(cid, ALICE, "how?")
            ans = recv.receive("d", *_signed(sender.key, body))
            assert (ans.status, ans.body) == (200, {"type": 5})
            forged = sender.payload(cid, ALICE, "forged")
            assert recv.receive("d", *_signed(SigningKey.generate(), forged)).status == 401
            recv.close(wait=True)
            assert offered == [body["id"]]
        finally:
            sender.close()


def test_an_answer_past_the_token_life_is_reported_not_sent(world, rest) -> None:
    """The token lives 15 minutes from receipt: a send after 14:55 (with a 15 s timeout) is Rejected with no
    request; one in time edits the deferred response once and the read-back sees it."""
    with _interacting(world, rest) as (p, sender, cid, clock):
        late, ok = (sender.payload(cid, ALICE, q) for q in ("late", "ok"))
        [late_parent] = p.parse_webhook("", late)  # type: ignore[misc]
        for body in (late, ok):
            it = world.interactions[body["id"]]
            it.acks, it.original = 1, Msg(world.snowflake(), cid, BOT_ID, "")  # as after a type 5 answer
        clock.advance(900 - 5)
        with pytest.raises(Rejected, match="15 minutes"):
            p.send(late_parent, "too late", provider_key="k")
        assert world.interactions[late["id"]].edits == 0 and rest.calls.get("original PATCH", 0) == 0
        [ok_parent] = p.parse_webhook("", ok)  # type: ignore[misc]
        sent = p.send(ok_parent, "in time", provider_key="k")
        assert world.interactions[ok["id"]].edits == 1
        from replyd.platforms.base import Pending

        rb = p.read_back([Pending(ok_parent, clock.now())], sender_id=BOT_ID)
        assert [r.reply_id for r in rb.found[ok_parent.id]] == [sent.reply_id]


def test_expired_interaction_tokens_are_forgotten_and_an_answer_pings_nobody(world, rest) -> None:
    """A token past its 15 minutes (and the last request's timeout) is dropped: log lines stop being masked with
    it and memory stops growing; an interaction's answer echoing mentions notifies nobody."""
    from tests.test_mentions import INJECTION, injected

    with _interacting(world, rest) as (p, sender, cid, clock):
        old = [sender.payload(cid, ALICE, f"q{i}") for i in range(20)]
        for body in old:
            p.parse_webhook("", body)
        assert all(body["token"] in p._secrets() for body in old)
        clock.advance(900 + 15 + 61)
        new = sender.payload(cid, ALICE, INJECTION)
        [parent] = p.parse_webhook("", new)  # type: ignore[misc]
        held = p._secrets()
        assert new["token"] in held and not any(body["token"] in held for body in old)
        assert len(p._interactions) == 1
        it = world.interactions[new["id"]]
        it.acks, it.original = 1, Msg(world.snowflake(), cid, BOT_ID, "")  # as after a type 5 answer
        p.send(parent, injected(parent) + " <@175928847299117063> <@&41771983423143936>", provider_key="k")
        assert it.edits == 1 and it.original.pinged == [] and "@everyone" not in it.original.content


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_interactions_delivered_twice_one_ack_one_answer_each(pg_url, tmp_path) -> None:
    """8 interactions, each delivered to both `replyd run` replicas at once: one initial response (type 5,
    under 3 s) and one answer (the deferred response edited once, no follow-up message) each, counted on the
    fake; a forged delivery is 401 at both and never acknowledged."""
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay")
    eng.dispose()
    res = discord_scenario.interactions_run(tmp_path, store_url=pg_url, count=8, deliveries=2)
    logs = "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in ("a", "b"))
    assert res.acks == {i: 1 for i in res.interactions}, (res, logs)
    assert max(res.ack_s) < 3.0, res.ack_s
    assert res.edits == {i: 1 for i in res.interactions}, (res, logs)
    assert res.followups == {i: 0 for i in res.interactions}, res
    assert res.forged_statuses == [401, 401] and res.forged_acks == 0, res
