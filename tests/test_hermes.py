"""hermes-agent's real Telegram adapter against replyd's Bot API fake: naive, it answers one message three times;
through ``replyd.integrations.hermes`` once, and the lost answer ends ``unconfirmed``, never resent.

The scenario: the first ``sendMessage`` creates the message and its answer is lost (hermes retries the send:
a second message); Telegram's webhook delivery of the update is not acknowledged once, so it comes twice
(hermes runs the turn again: a third). The fake counts the bot's messages replying to the parent.

hermes-agent pins versions the test extras cannot share (openai 2.x, websockets 15...), so it lives in its own
venv: ``make hermes`` builds it and runs this file there (REPLYD_HERMES_REQUIRED=1: no skip). In the main venv
this file skips (tests/ci_allowed_skips.toml says why).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import tempfile
import time

import pytest

if importlib.util.find_spec("hermes_cli") is None:  # hermes-agent's own package
    if os.environ.get("REPLYD_HERMES_REQUIRED"):
        raise RuntimeError("REPLYD_HERMES_REQUIRED is set but hermes-agent is not importable: run `make hermes`")
    pytest.skip("hermes-agent is not installed here; `make hermes` runs this file in its own venv",
                allow_module_level=True)

os.environ.setdefault("HERMES_HOME", tempfile.mkdtemp(prefix="replyd-hermes-home-"))  # hermes writes there

from gateway.config import PlatformConfig
from plugins.platforms.telegram.adapter import _build_adapter

from replyd import store as st
from replyd.sim.telegram import TOKEN, TelegramApi, TelegramWorld, WebhookSender
from tests.hermes_common import connected

CHAT = 5000000002  # a private chat with grace: no mention gating


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def telegram(monkeypatch):
    """The Bot API fake, and hermes' webhook mode pointed at a free local port."""
    world = TelegramWorld()
    world.chat(CHAT, type="private", title="grace")
    api = TelegramApi(world).start()
    port = free_port()
    monkeypatch.setenv("TELEGRAM_WEBHOOK_URL", f"http://127.0.0.1:{port}/telegram")
    monkeypatch.setenv("TELEGRAM_WEBHOOK_PORT", str(port))
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", "replyd-test-secret-0123456789")
    monkeypatch.setenv("HERMES_TELEGRAM_DISABLE_FALLBACK_IPS", "1")  # no DNS-over-HTTPS lookup
    try:
        yield world, api
    finally:
        api.stop()


async def run_hermes(world: TelegramWorld, api: TelegramApi, store_url: str | None) -> dict:
    """hermes' Telegram adapter answers one message; its first answer lost, its update delivered twice."""
    config = PlatformConfig(enabled=True, token=TOKEN, extra={
        "base_url": f"{api.url}/bot",  # python-telegram-bot's base_url: the fake instead of api.telegram.org
        "fallback_ips": ["149.154.167.220"],  # a public Telegram address, so hermes does not look one up
    })
    adapter = _build_adapter(config)
    turns = await connected(adapter, store_url)
    parent = world.post(CHAT, "what time is it?")
    world.send_faults.append("lost")  # the first sendMessage creates the message; its answer never arrives
    sender = WebhookSender(world, lose_acks=0.4, seed=3).start()  # seed 3: the first ack lost, the second kept
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            if len(turns) >= 2 and not adapter._active_sessions and not adapter._pending_messages:
                break
        await asyncio.sleep(3.5)  # hermes' own send retries sleep 1 s, then 2 s
        out = {"parent": parent, "turns": len(turns), "deliveries": max(sender.deliveries.values()),
               "replies": world.bot_replies(parent), "sends": world.send_requests}
        if store_url is not None:
            session = adapter._replyd.session
            await session.sweep()  # past the send deadline: no read-back on Telegram, so "unconfirmed"
            row = await asyncio.to_thread(session.store.get, session.guard.key(parent))
            out["state"] = row.state if row is not None else None  # None: nothing went through replyd
            blocked = await session.check(parent)  # what a post of this parent would meet now
            out["again"] = blocked.status.value if blocked is not None else "claimable"
    finally:
        sender.stop()
        await adapter.disconnect()
    return out


def test_naive_hermes_answers_a_lost_send_and_a_redelivery_again(telegram):
    """Without replyd: hermes resends after the lost answer and runs the redelivered update's turn again."""
    world, api = telegram
    out = asyncio.run(run_hermes(world, api, None))
    assert out["deliveries"] == 2 and out["turns"] == 2, out
    assert out["replies"] == 3, out  # the lost one, hermes' retry of it, the redelivery's turn
    assert len(world.unanswered) == 1


def test_hermes_through_replyd_answers_once_and_reports_the_lost_send(telegram, tmp_path):
    """Through replyd: one message on the platform, the lost answer ``unconfirmed`` in the store, nothing resent."""
    world, api = telegram
    out = asyncio.run(run_hermes(world, api, f"sqlite:///{tmp_path}/replyd.sqlite3"))
    assert out["deliveries"] == 2 and out["turns"] == 2, out  # hermes ran the turn twice all the same
    assert out["replies"] == 1 and out["sends"] == 1, out
    assert world.unanswered == [f"{CHAT}:2"]  # the one message is the lost one
    assert out["state"] == st.UNCONFIRMED and out["again"] == "unconfirmed", out
