"""`replyd run` with a streaming LLM (the ``openai`` kind, ``stream = true``) against the sim over HTTP: a real
local server streams each answer token by token as server-sent events; the daemon is SIGKILLed mid-stream and
restarted. Counted on the sim: every mention's answer is its parts, each posted once, in order, grown by edits
to the model's whole text; the LLM was called once per mention plus once per stream the kill cut short.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from replyd.clock import SystemClock
from replyd.parts import Limit, split
from replyd.serve import ThreadedServer
from replyd.sim import SimServer, World
from tests.test_compose_kill import _settled, _start, _wait
from tests.test_parts_sim import _chain

BOT, ASKER, MAX_CHARS = "replybot", "alice", 120
TOKENS = [f" token{i:02d}" for i in range(60)]  # 60 words, about 480 characters: five parts of 113


class StreamingLLM:
    """An OpenAI-compatible /v1/chat/completions streaming ``TOKENS`` one every ``pause_s`` (SSE); counts calls
    (each question's too) and how many streams are running."""

    def __init__(self, pause_s: float = 0.04) -> None:
        self.pause_s, self.calls, self.running, self.sent = pause_s, 0, 0, 0
        self.asked: Counter[str] = Counter()  # the last user message of each call
        self.lock = threading.Lock()
        self.server = ThreadedServer(Starlette(routes=[Route("/v1/chat/completions", self._completions,
                                                             methods=["POST"])]), name="llm")

    async def _completions(self, request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        assert body.get("stream") is True
        question = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        with self.lock:
            self.calls += 1
            self.asked[question] += 1

        async def events():
            with self.lock:
                self.running += 1
            try:
                for t in TOKENS:
                    await asyncio.sleep(self.pause_s)
                    doc = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": t}}]}
                    yield f"data: {json.dumps(doc)}\n\n"
                    with self.lock:
                        self.sent += 1
                yield "data: [DONE]\n\n"
            finally:
                with self.lock:
                    self.running -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


def _config(path: Path, sim_url: str, llm_url: str, db: Path) -> Path:
    """A daemon config: inbox and re-find, a streaming openai responder, edits at most every 0.2 s."""
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 2.0
compose_lease_s = 6.0
stream_edit_interval_s = 0.2

[sweep]
interval_s = 0.5
retry_s = 0.5

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{sim_url}"
token_env = "SIM_TOKEN"
listing_delay_s = 0.5
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.4
refind_interval_s = 0.7
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "openai"
base_url = "{llm_url}/v1"
model = "gpt-test"
stream = true
timeout_s = 20
""")
    os.chmod(path, 0o600)
    return path


@pytest.mark.slow
def test_a_daemon_streaming_an_llm_survives_sigkill_mid_stream(tmp_path: Path) -> None:
    """Mentions answered by a streamed LLM answer, `replyd run` SIGKILLed mid-stream and restarted: each
    answer's parts posted once, in order, with the whole text; edits, never re-posts; LLM calls counted."""
    world = World(SystemClock(), seed=7, listing_delay_s=0.2)
    world.configure(max_characters=MAX_CHARS)
    bot = world.add_account(BOT, bot=True)
    world.add_account(ASKER)
    llm = StreamingLLM()
    db, log = tmp_path / "r.sqlite3", tmp_path / "daemon.log"
    with SimServer(world) as sim:
        llm.server.start()
        os.environ["SIM_TOKEN"] = bot.token
        try:
            cfg = _config(tmp_path / "c.toml", sim.base_url, llm.server.url, db)
            parents = [world.post(ASKER, f"@{BOT} question {i}").id for i in range(3)]
            proc = _start(cfg, log)
            try:
                # Kill once a stream is well under way: some parts posted, the answer not finished.
                assert _wait(lambda: llm.sent >= 25 and llm.running, 60), log.read_text()[-3000:]
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                with llm.lock:
                    asked_at_kill = Counter(llm.asked)
                posted_at_kill = {p: len(_chain(world, bot.id, p)) for p in parents}
                assert any(posted_at_kill.values())
                proc = _start(cfg, log)
                expected = split("".join(TOKENS), Limit(MAX_CHARS - len(f"@{ASKER} ")))
                whole = [f"@{ASKER} {p}" for p in expected]
                done = _wait(lambda: all(_chain(world, bot.id, p) == whole for p in parents) and _settled(db), 90)
                assert done, ({p: _chain(world, bot.id, p) for p in parents}, log.read_text()[-3000:])
                time.sleep(2.0)  # more rounds of every path and the sweep: nothing may be posted again
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
        finally:
            os.environ.pop("SIM_TOKEN", None)
            llm.server.stop()
    for p in parents:
        assert _chain(world, bot.id, p) == whole, p
    mine = [s for s in world.statuses.values() if s.account_id == bot.id and s.deleted_at is None]
    assert len(mine) == len(parents) * len(expected)  # one post per part, nothing else
    assert all(s.edits for s in mine)  # every part grew by edits
    assert world.report()["duplicates"] == 0
    # Each question asked once by each daemon at most: once before the kill, and once more after it only if the
    # killed daemon had asked it (its stream cut, or its answer not stored before the kill).
    events = [line for line in log.read_text().splitlines() if '"replyd.guard.' in line or "warning" in line]
    seen = (dict(llm.asked), dict(asked_at_kill), events[-60:])
    assert len(llm.asked) == len(parents), seen
    assert all(n <= 1 for n in asked_at_kill.values()), seen
    assert all(n - asked_at_kill[q] <= 1 for q, n in llm.asked.items()), seen
    assert llm.calls > len(parents), seen  # the kill cut a stream: it was asked again
