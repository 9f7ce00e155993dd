"""The ``openai`` responder with ``stream = true``: server-sent events from an OpenAI-compatible server (a real
local HTTP server serving the documented ``chat.completion.chunk`` events), handed to the guard as a stream.

Through ``ResponderRunner`` (what the daemon calls): the tokens in order, the request asking for a stream, a
declined answer (the decline marker) showing nothing, every failure one masked ResponderError line. Through the
guard on the sim over HTTP: the answer posted once per part and grown by edits to the model's whole text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from replyd.clock import SystemClock
from replyd.errors import ResponderError
from replyd.guard import Guard, Status
from replyd.platforms.base import Parent
from replyd.platforms.mastodon import MastodonPlatform
from replyd.responders import ResponderRunner, make_responder
from replyd.sim import SimServer, World
from replyd.store import Store
from replyd.stream import as_stream, drain
from tests.fixtures_server import FixtureServer, Reply, fixture_server, fixture_server_session  # noqa: F401

COMPLETIONS = "/v1/chat/completions"
API_KEY = "sk-LEAKCHECK-stream-0123456789abcdef"
PARENT = Parent(id="p1", author_id="a1", author_handle="alice", text="when does the ferry run?")


def events(*tokens: str, finish: str = "stop", done: bool = True) -> Reply:
    """An OpenAI chat completions stream: a role chunk, one chunk per token, the finish chunk, ``[DONE]``."""
    def chunk(delta: dict[str, Any], reason: str | None = None) -> str:
        doc = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-test",
               "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
        return f"data: {json.dumps(doc)}\n\n"

    body = chunk({"role": "assistant", "content": ""}) + "".join(chunk({"content": t}) for t in tokens)
    body += chunk({}, finish) + ("data: [DONE]\n\n" if done else "")
    return Reply(body=body, content_type="text/event-stream")


def settings(server: FixtureServer, **extra: Any) -> dict[str, Any]:
    """openai settings with ``stream = true`` pointing at the fixture server's /v1."""
    return {"base_url": f"{server.url}/v1/", "model": "gpt-test", "api_key": API_KEY, "stream": True, **extra}


def streamed(server: FixtureServer, **extra: Any) -> str:
    """Call the responder once through a ResponderRunner, as the daemon does, and read its whole stream."""
    runner = ResponderRunner(make_responder("openai", settings(server, **extra)), timeout_s=20.0, name="openai")
    try:
        got = runner(PARENT)
        stream = as_stream(got)
        assert stream is not None, f"a streaming responder returned {type(got).__name__}"
        return drain(stream, 10.0)
    finally:
        runner.close()


def test_the_tokens_come_in_order_and_the_request_asks_for_a_stream(fixture_server: FixtureServer) -> None:
    """The stream is the model's tokens in order; the request is the usual one plus ``"stream": true``."""
    fixture_server.route("POST", COMPLETIONS, events("The ferry", " runs", " every hour", " from 9."))
    assert streamed(fixture_server) == "The ferry runs every hour from 9."
    [req] = fixture_server.requests_to("POST", COMPLETIONS)
    body = json.loads(req.body)
    assert body["stream"] is True and body["model"] == "gpt-test" and body["messages"][1]["content"]
    assert req.headers["accept"] == "text/event-stream" and req.headers["authorization"] == f"Bearer {API_KEY}"


def test_the_decline_marker_is_held_back_so_a_declined_answer_shows_nothing(fixture_server: FixtureServer) -> None:
    """Tokens that spell the decline marker are never handed on; an answer merely starting like it is."""
    fixture_server.route("POST", COMPLETIONS, events("SK", "IP"))
    assert streamed(fixture_server, decline_marker="SKIP") == ""
    fixture_server.route("POST", COMPLETIONS, events("SK", "Y is", " clear"))
    assert streamed(fixture_server, decline_marker="SKIP") == "SKY is clear"


@pytest.mark.parametrize(("reply", "needle"), [
    (Reply(401, {"error": {"message": "bad key"}}), "unauthorized"),
    (Reply(429, {"error": {"message": "slow down"}}, {"retry-after": "7"}), "rate limited"),
    (Reply(body={"choices": []}), "not an event stream"),
    (Reply(body="data: {not json\n\n", content_type="text/event-stream"), "not JSON"),
    (Reply(body='data: {"error": {"message": "overloaded"}}\n\n', content_type="text/event-stream"), "error"),
    (Reply(body="data: " + json.dumps({"choices": [{"delta": {"content": "half"}}]}) + "\n\n",
           content_type="text/event-stream", fault="drop"), "failed"),
], ids=["401", "429", "not-sse", "garbage-event", "error-event", "dropped"])
def test_a_failure_is_one_masked_line(fixture_server: FixtureServer, reply: Reply, needle: str) -> None:
    """Every failure of the stream is a ResponderError naming the problem, on one line, without the key."""
    fixture_server.route("POST", COMPLETIONS, reply)
    with pytest.raises(ResponderError) as err:
        streamed(fixture_server)
    msg = str(err.value)
    assert msg.startswith("openai: ") and needle in msg and "\n" not in msg and API_KEY not in msg, msg


def test_the_guard_posts_the_stream_once_per_part_and_edits_it_to_the_whole_answer(
        fixture_server: FixtureServer, tmp_path) -> None:
    """Through the sync guard on the sim (what the daemon runs): each part posted once, grown by edits; the
    parts are the model's whole answer."""
    tokens = [f" word{i:02d}" for i in range(80)]
    fixture_server.route("POST", COMPLETIONS, events(*tokens))
    world = World(SystemClock(), listing_delay_s=0.0)
    world.configure(max_characters=200)
    bot = world.add_account("replybot", bot=True)
    world.add_account("alice")
    runner = ResponderRunner(make_responder("openai", settings(fixture_server)), timeout_s=20.0, name="openai")
    with SimServer(world) as sim, httpx.Client(trust_env=False) as http:
        plat = MastodonPlatform.from_settings({"base_url": sim.base_url, "token": bot.token, "listing_delay_s": 0.2},
                                              http=http, clock=SystemClock())
        parent = world.post("alice", "@replybot tell me everything")
        g = Guard(Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}"), plat, plat.whoami(), watch_interval_s=None,
                  stream_edit_interval_s=0.0)
        out = g.post(plat.resolve(parent.id), runner)
        assert out.status is Status.POSTED, out
        mine = sorted((s for s in world.statuses.values() if s.account_id == bot.id), key=lambda s: s.created_at)
        assert len(mine) == len(out.parts) >= 3
        words = " ".join(s.text.removeprefix("@alice ") for s in mine).split()
        assert words == [t.strip() for t in tokens]
        assert all(s.edits for s in mine)  # each part grew by edits after its one post
        g.store.dispose()
    runner.close()
