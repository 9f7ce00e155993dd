"""Streamed answers on the sim (a real HTTP server, Mastodon-compatible, which edits statuses in place) through
the Mastodon adapter: answers of 1 to 3 parts streamed word by word, a real OS process SIGKILLed mid-stream
(before its first post, halfway, at its last word) and after each part's claim, send and close, then every
answer resumed with 20 % of creates' answers and 20 % of edits' answers lost.

Counted on the server: every parent has exactly its parts, each posted once, in order (a chain: part k+1
answers part k), each showing its final text (edits, never a second post); the responder was called once per
answer, plus once more where a kill cut its stream short (a stream is not durable until it ends).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.guard import Guard
from replyd.parts import split
from replyd.platforms.mastodon import MastodonPlatform
from replyd.sim import SimServer
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.parts_workers import (StreamResponder, answer_text, calls_per_parent, run_children, settled_twice,
                                 stream_and_die)
from tests.test_parts_sim import ASKER, _chain, _settings, _world


@pytest.mark.slow
def test_streamed_answers_survive_sigkill_mid_stream_and_lost_answers(tmp_path: Path) -> None:
    """1-3 part streamed answers, a kill mid-stream and at every part's claim/send/close, then resumed with lost
    creates and edits: each parent shows exactly its parts once, in order, with the final text; responder calls
    = 1 per answer + 1 per stream cut by a kill; edits happened (the parts grew by edits)."""
    world, bot, asker, url, calls = _world(tmp_path, seed=33)
    with SimServer(world) as srv, httpx.Client(trust_env=False) as http:
        settings = _settings(srv, bot.token)
        plat = MastodonPlatform.from_settings(settings, http=http, clock=SystemClock())
        ident = plat.whoami()
        # (parent, parts, part, point, where in the stream to die: its first word, halfway, its last word)
        plan: list[tuple[str, int, int, str, float | None]] = []
        for n in range(1, 4):
            points = [(1, "stream", at) for at in (0.0, 0.5, 1.0)]
            points += [(k, p, None) for k in range(1, n + 1) for p in ("claim", "send", "close")]
            for k, point, at in points:
                pid = world.post(asker, f"question {n}/{k}/{point}/{at}", mention=[bot]).id
                plan.append((pid, n, k, point, at))
        fresh = [(world.post(asker, f"fresh question {n}", mention=[bot]).id, n) for n in range(1, 4)]
        time.sleep(0.5)
        parents = {pid: plat.resolve(pid) for pid, *_ in plan} | {pid: plat.resolve(pid) for pid, _ in fresh}
        size = plat.post_limit(parents[fresh[0][0]]).size
        texts = {pid: answer_text(pid, n, size) for pid, n, *_ in plan} | {pid: answer_text(pid, n, size)
                                                                        for pid, n in fresh}
        expected = {pid: split(t, plat.post_limit(parents[pid])) for pid, t in texts.items()}
        assert all(len(expected[pid]) == n for pid, n, *_ in plan)

        def word(pid: str, at: float | None) -> int | None:
            """The stream's word to die at: the second, the middle or the last (never past the end)."""
            words = len(texts[pid].split(" "))
            return None if at is None else max(1, min(words - 1, round(at * (words - 1))))

        jobs = [("mastodon", settings, url, parents[pid].snapshot(), str(calls), texts[pid], k, point, word(pid, at))
                for pid, n, k, point, at in plan]
        codes = run_children(stream_and_die, jobs, width=3)
        assert codes == [-signal.SIGKILL] * len(jobs), list(zip(plan, codes, strict=False))
        with world.lock:
            cut_posts = {pid: len(_chain(world, bot.id, pid)) for pid in parents}
        assert any(cut_posts.values())  # the kills left posts for the resumed answers to edit

        world.configure(lost_drop_rate=0.2, lost_edit_rate=0.2)
        g = Guard(Store.open(url), plat, ident, send_timeout_s=3.0, compose_lease_s=2.0, watch_interval_s=None,
                  stream_edit_interval_s=0.05)
        sweeper = Sweeper(g.store, [Bot(plat, ident)], retry_s=0.5)
        deadline = time.monotonic() + 300
        waiting = set(parents)
        while waiting and time.monotonic() < deadline:
            for pid in sorted(waiting):
                out = g.post(parents[pid], StreamResponder(str(calls), texts[pid], pause_s=0.0), path="inbox")
                if out.state == st.CLOSED:
                    waiting.discard(pid)
            sweeper.run_once()
            time.sleep(0.3)
        assert not waiting, {pid: g.store.peek(g.key(pid)).state for pid in waiting}
        world.configure(lost_drop_rate=0.0, lost_edit_rate=0.0)
        settled_twice(g, sweeper, parents, lambda pid: StreamResponder(str(calls), texts[pid], pause_s=0.0), 0.5)

        for pid in parents:
            assert _chain(world, bot.id, pid) == [f"@{ASKER} {p}" for p in expected[pid]], pid
        with world.lock:
            mine = [s for s in world.statuses.values() if s.account_id == bot.id and s.deleted_at is None]
        assert len(mine) == sum(len(e) for e in expected.values())  # one post per part, nothing else
        assert sum(s.edits for s in mine) >= len(mine)  # the parts grew by edits
        made = calls_per_parent(calls)
        cut = {pid for pid, *_ in plan}  # every kill point lies inside the stream
        assert made == {pid: 1 + (pid in cut) for pid in parents}
        report = world.report()
        assert report["faults_injected"].get("lost_drop", 0) > 0
        g.store.dispose()
