"""hermes-agent's real Discord adapter (discord.py) against replyd's Discord fakes: naive, one message gets two
answers; through ``replyd.integrations.hermes`` one, and the lost answer is found by reading the channel back.

The scenario: a DM over the real Gateway protocol; the first create's answer is lost (the message is made,
the connection drops). hermes sends the answer again as plain text. The fake counts the bot's replies.
A RESUME's replay of a message hermes already saw is not a second turn: its seen-set drops it in-process.

hermes-agent lives in its own venv, as in ``tests/test_hermes.py``: ``make hermes`` runs this file there.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import tempfile

import pytest

if importlib.util.find_spec("hermes_cli") is None:  # hermes-agent's own package
    if os.environ.get("REPLYD_HERMES_REQUIRED"):
        raise RuntimeError("REPLYD_HERMES_REQUIRED is set but hermes-agent is not importable: run `make hermes`")
    pytest.skip("hermes-agent is not installed here; `make hermes` runs this file in its own venv",
                allow_module_level=True)

os.environ.setdefault("HERMES_HOME", tempfile.mkdtemp(prefix="replyd-hermes-home-"))  # hermes writes there

import discord
import yarl
from gateway.config import PlatformConfig
from plugins.platforms.discord.adapter import _build_adapter

from replyd import store as st
from tests.discord_fake import BOT_TOKENS, DiscordRest, DiscordWorld, Gateway
from tests.hermes_common import connected

USER = "222333444555666777"  # the person who asks, on hermes' allow list


@pytest.fixture
def discord_fakes(monkeypatch):
    """The REST and Gateway fakes; discord.py's REST root and Gateway URL pointed at them."""
    world = DiscordWorld()
    gw = Gateway(world, heartbeat_ms=500, content_allowed=True, replay_seen=1)
    monkeypatch.setenv("DISCORD_ALLOWED_USERS", USER)
    monkeypatch.setenv("DISCORD_COMMAND_SYNC_POLICY", "off")  # the fake has no application commands
    with DiscordRest(world, gateway_url=gw.url) as rest:
        monkeypatch.setattr(discord.http.Route, "BASE", rest.url)
        monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY", yarl.URL(gw.url() + "/"))
        try:
            yield world, gw
        finally:
            gw.close()


async def run_hermes(world: DiscordWorld, gw: Gateway, store_url: str | None) -> dict:
    """hermes' Discord adapter answers one DM; the answer to its first create is lost."""
    adapter = _build_adapter(PlatformConfig(enabled=True, token=BOT_TOKENS[0]))
    turns = await connected(adapter, store_url)
    try:
        cid = world.add_channel(dm=True)
        world.create_faults.append("lost")  # the first create makes the message; its answer never arrives
        parent = world.say(cid, USER, "what time is it?")
        for _ in range(150):
            await asyncio.sleep(0.1)
            if turns and world.lost_answers:
                break
        await asyncio.sleep(4.0)  # hermes' fallback send, if any
        out = {"parent": parent, "turns": len(turns), "lost": world.lost_answers,
               "replies": len(world.bot_replies(parent))}
        if store_url is not None:
            session = adapter._replyd.session
            await asyncio.sleep(1.5)  # past the send deadline and the listing delay: the sweep reads back
            await session.sweep()
            row = await asyncio.to_thread(session.store.get, session.guard.key(parent))
            out["state"] = row.state if row is not None else None
            out["reply_id"] = row.reply_id if row is not None else None
            out["on_platform"] = [m.id for m in world.bot_replies(parent)]
    finally:
        await adapter.disconnect()
    return out


def test_naive_hermes_answers_a_lost_send_again(discord_fakes):
    """Without replyd: hermes takes the lost answer for a failure and sends the answer a second time."""
    world, gw = discord_fakes
    out = asyncio.run(run_hermes(world, gw, None))
    assert out["turns"] == 1 and out["lost"] == 1, out
    assert out["replies"] == 2, out  # the lost one and hermes' plain-text fallback


def test_hermes_discord_through_replyd_answers_once_and_reads_the_lost_one_back(discord_fakes, tmp_path):
    """Through replyd: one message on the platform; the sweep finds the lost answer and closes the row with it."""
    world, gw = discord_fakes
    out = asyncio.run(run_hermes(world, gw, f"sqlite:///{tmp_path}/replyd.sqlite3"))
    assert out["turns"] == 1 and out["lost"] == 1, out
    assert out["replies"] == 1, out  # hermes' fallback met the row in doubt: nothing sent again
    channel = out["parent"].split(":")[0]
    assert out["state"] == st.CLOSED and [out["reply_id"]] == [f"{channel}:{m}" for m in out["on_platform"]], out
