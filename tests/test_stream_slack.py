"""Streamed answers on Slack's fake (``tests/slack_fake.py``: the Web API over real HTTP, ``chat.postMessage`` and
``chat.update`` from Slack's documentation) through the Slack adapter: answers of 1 and 3 parts streamed word
by word, a real OS process SIGKILLed mid-stream and at each part's claim, send and close, then every answer
resumed with 20 % of ``chat.postMessage`` and ``chat.update`` answers lost.

Counted on the fake: every parent's thread holds exactly its parts, each posted once, in order (each tagged
with the part before it), each showing its final text; the parts grew by ``chat.update`` (the fake's edit
history), never by a second post; responder calls = 1 per answer + 1 per stream a kill cut short.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.guard import Guard
from replyd.parts import Limit, split
from replyd.platforms.slack import SlackPlatform, ts_order
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.parts_workers import (StreamResponder, answer_text, calls_per_parent, run_children, settled_twice,
                                 stream_and_die)
from tests.slack_fake import APP_TOKEN, BOT_TOKENS, BOT_USER, SlackWebApi, SlackWorld

CHARS = 80
GENERAL, ALICE = "C0GENERAL1", "U0ALICE001"


def _faults(rng: random.Random, n: int) -> list[str]:
    """``n`` answers of which about one in five is lost (the write acted, the connection dropped)."""
    return ["lost" if rng.random() < 0.2 else "" for _ in range(n)]


@pytest.mark.slow
def test_streamed_answers_on_slack_survive_sigkill_and_lost_answers(tmp_path: Path) -> None:
    """1- and 3-part streamed answers, a kill mid-stream and at every part's claim/send/close, resumed with
    lost answers: each thread holds its parts once, in order, with the final text; edits, never re-posts."""
    world = SlackWorld()
    world.add_channel(GENERAL, BOT_USER, ALICE)
    world.update_per_minute = None  # Slack's Tier 3 minute is test_slack's; here every kill and retry edits
    url = f"sqlite:///{tmp_path / 'r.sqlite3'}"
    Store.open(url).dispose()
    calls = tmp_path / "calls.txt"
    with SlackWebApi(world) as api, httpx.Client(trust_env=False, timeout=5.0) as http:
        settings = {"token": BOT_TOKENS[0], "app_token": APP_TOKEN, "api_url": api.url, "max_post_chars": CHARS,
                    "listing_delay_s": 0.3, "timeout_s": 3.0}
        plat = SlackPlatform.from_settings(settings, http=http, clock=SystemClock())
        ident = plat.whoami()
        plan: list[tuple[str, int, int, str, bool]] = []  # (parent, parts, part, point, die mid-stream)
        for n in (1, 3):
            points = [(1, "stream", True)] + [(k, p, False) for k in range(1, n + 1) for p in ("claim", "send", "close")]
            for k, point, mid in points:
                plan.append((world.say(GENERAL, ALICE, f"<@{BOT_USER}> q {n}/{k}/{point}"), n, k, point, mid))
        fresh = [(world.say(GENERAL, ALICE, f"<@{BOT_USER}> fresh {n}"), n) for n in (1, 3)]
        parents = {pid: plat.resolve(pid) for pid, *_ in plan} | {pid: plat.resolve(pid) for pid, _ in fresh}
        texts = {pid: answer_text(pid, n, CHARS) for pid, n, *_ in plan} | {pid: answer_text(pid, n, CHARS)
                                                                         for pid, n in fresh}
        expected = {pid: split(t, Limit(CHARS)) for pid, t in texts.items()}
        assert all(len(expected[pid]) == n for pid, n, *_ in plan)

        jobs = [("slack", settings, url, parents[pid].snapshot(), str(calls), texts[pid], k, point,
                 len(texts[pid].split(" ")) // 2 if mid else None) for pid, n, k, point, mid in plan]
        codes = run_children(stream_and_die, jobs)
        assert codes == [-signal.SIGKILL] * len(jobs), list(zip(plan, codes, strict=False))
        assert any(world.thread_replies(pid) for pid in parents)  # the kills left posts to edit and complete

        rng = random.Random(32)
        g = Guard(Store.open(url), plat, ident, send_timeout_s=3.0, compose_lease_s=2.0, watch_interval_s=None,
                  stream_edit_interval_s=0.05)
        sweeper = Sweeper(g.store, [Bot(plat, ident)], retry_s=0.5)
        time.sleep(2.5)  # the killed composers' leases expire
        deadline = time.monotonic() + 240
        waiting = set(parents)
        while waiting and time.monotonic() < deadline:
            world.post_faults, world.update_faults = _faults(rng, 50), _faults(rng, 50)
            for pid in sorted(waiting):
                out = g.post(parents[pid], StreamResponder(str(calls), texts[pid], pause_s=0.0), path="inbox")
                if out.state == st.CLOSED:
                    waiting.discard(pid)
            world.post_faults, world.update_faults = [], []
            sweeper.run_once()
            time.sleep(0.5)
        assert not waiting, {pid: g.store.peek(g.key(pid)).state for pid in waiting}
        settled_twice(g, sweeper, parents, lambda pid: StreamResponder(str(calls), texts[pid], pause_s=0.0), 0.4)

        for pid in parents:
            msgs = sorted(world.thread_replies(pid), key=lambda m: ts_order(m.ts))
            assert [m.text for m in msgs] == expected[pid], pid  # each part once, in order, its final text
            tags = [m.metadata["event_payload"]["parent"] for m in msgs]
            assert tags == [pid] + [f"{GENERAL}:{m.ts}" for m in msgs[:-1]], pid
        everything = [m for pid in parents for m in world.thread_replies(pid)]
        assert len(everything) == sum(len(e) for e in expected.values())
        assert sum(len(m.history) for m in everything) >= len(everything)  # the parts grew by chat.update
        made = calls_per_parent(calls)
        assert made == {pid: 1 + (pid in {p for p, *_ in plan}) for pid in parents}
        g.store.dispose()
