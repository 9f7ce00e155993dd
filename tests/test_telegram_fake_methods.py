"""The Telegram fake's methods a gateway calls around its answers (openclaw's Telegram channel calls all five):
the documented successes, and the refusals a wrong call gets."""

from __future__ import annotations

import httpx
import pytest

from replyd.sim.telegram import TOKEN, TelegramApi, TelegramWorld


@pytest.fixture
def bot():
    world = TelegramWorld()
    world.chat(5000001, type="private", title="grace")
    api = TelegramApi(world).start()
    with httpx.Client(base_url=f"{api.url}/bot{TOKEN}", timeout=10) as http:
        def call(method: str, **args: object) -> tuple[int, dict]:
            r = http.post(f"/{method}", json=args)
            return r.status_code, r.json()
        try:
            yield world, call
        finally:
            api.stop()


def test_commands_are_set_read_and_deleted(bot) -> None:
    world, call = bot
    cmds = [{"command": "status", "description": "How the bot is"}, {"command": "help_me", "description": "Help"}]
    assert call("setMyCommands", commands=cmds) == (200, {"ok": True, "result": True})
    assert call("getMyCommands") == (200, {"ok": True, "result": cmds})
    assert call("deleteMyCommands") == (200, {"ok": True, "result": True})
    assert call("getMyCommands")[1]["result"] == []
    for bad in ([{"command": "Status", "description": "upper case"}], [{"command": "x", "description": ""}],
                [{"command": "x" * 33, "description": "too long"}], "not a list"):
        status, body = call("setMyCommands", commands=bad)
        assert status == 400 and body["ok"] is False, bad


def test_chat_action_reaction_and_get_chat(bot) -> None:
    world, call = bot
    parent = world.post(5000001, "hello", mention=False)
    mid = int(parent.split(":")[1])
    assert call("sendChatAction", chat_id=5000001, action="typing")[0] == 200
    assert call("sendChatAction", chat_id=5000001, action="dancing")[0] == 400
    assert call("sendChatAction", chat_id=42, action="typing") == (
        400, {"ok": False, "error_code": 400, "description": "Bad Request: chat not found"})
    assert call("setMessageReaction", chat_id=5000001, message_id=mid,
                reaction=[{"type": "emoji", "emoji": "👍"}]) == (200, {"ok": True, "result": True})
    assert call("setMessageReaction", chat_id=5000001, message_id=mid + 99)[0] == 400
    status, body = call("getChat", chat_id="5000001")
    assert status == 200 and body["result"]["id"] == 5000001 and body["result"]["type"] == "private"
    assert call("getChat", chat_id=7)[0] == 400
    assert call("noSuchMethod")[0] == 404
