"""Answers in several parts on the sim (a real HTTP server, Mastodon-compatible) through the Mastodon adapter:
answers of 1 to 6 parts, a real OS process SIGKILLed at every point between parts (inside the compose, after each
part's claim, after its send, after its close), then the answers resumed with 20 % of creates' answers lost.

Counted on the server: every parent has exactly its parts, each once, in order (a chain: part k+1 answers part k),
with the composed text; the responder was called once per answer, plus once more only where a kill cut the
compose short.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.guard import Guard
from replyd.parts import split
from replyd.platforms.mastodon import MastodonPlatform
from replyd.sim import SimServer, World
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.parts_workers import (Responder, answer_text, calls_per_parent, post_and_die, run_children,
                                 settled_twice)

MAX_CHARS = 120  # the sim instance's post limit (served by /api/v2/instance)
ASKER = "asker"


def _settings(srv: SimServer, token: str) -> dict:
    return {"base_url": srv.base_url, "token": token, "listing_delay_s": 0.3, "timeout_s": 3.0}


def _chain(world: World, bot_id: str, parent_id: str) -> list[str]:
    """The bot's statuses from ``parent_id`` down the chain, read on the server; fails on a fork (a duplicate)."""
    texts, at = [], parent_id
    with world.lock:
        mine = [s for s in world.statuses.values() if s.account_id == bot_id and s.deleted_at is None]
    while True:
        kids = [s for s in mine if s.in_reply_to_id == at]
        assert len(kids) <= 1, f"{len(kids)} bot replies to {at}: {[k.text for k in kids]}"
        if not kids:
            return texts
        texts.append(kids[0].text)
        at = kids[0].id


def _world(tmp_path: Path, seed: int) -> tuple[World, Any, Any, str, Path]:
    """A sim limited to MAX_CHARS with the bot and the asker; a migrated SQLite store; the responder's call file."""
    world = World(SystemClock(), seed=seed, listing_delay_s=0.2)
    world.configure(max_characters=MAX_CHARS)
    bot = world.add_account("replybot", bot=True)
    asker = world.add_account(ASKER)
    url = f"sqlite:///{tmp_path / 'r.sqlite3'}"
    Store.open(url).dispose()  # the schema, once, before the children race to open it
    return world, bot, asker, url, tmp_path / "calls.txt"


@pytest.mark.slow
def test_answers_in_parts_survive_sigkill_at_every_point_and_lost_answers(tmp_path: Path) -> None:
    """1-6 part answers, a kill at every point of each, then resumed with 20 % lost creates: each parent has
    exactly its parts once, in order, with the composed text; one responder call per answer (+1 per cut compose)."""
    world, bot, asker, url, calls = _world(tmp_path, seed=32)
    with SimServer(world) as srv, httpx.Client(trust_env=False) as http:
        settings = _settings(srv, bot.token)
        plat = MastodonPlatform.from_settings(settings, http=http, clock=SystemClock())
        ident = plat.whoami()
        plan: list[tuple[str, int, int, str]] = []  # (parent id, parts, part killed at, point)
        for n in range(1, 7):
            points = [(1, "compose")] + [(k, p) for k in range(1, n + 1) for p in ("claim", "send", "close")]
            for k, point in points:
                plan.append((world.post(asker, f"question {n}/{k}/{point}", mention=[bot]).id, n, k, point))
        fresh = [(world.post(asker, f"fresh question {n}", mention=[bot]).id, n) for n in range(1, 7)]
        time.sleep(0.5)  # the sim's listing delay: read endpoints show a status 0.2 s after it was made
        parents = {pid: plat.resolve(pid) for pid, *_ in plan} | {pid: plat.resolve(pid) for pid, _ in fresh}
        size = plat.post_limit(parents[fresh[0][0]]).size  # the instance's limit less the "@asker " mention
        texts = {pid: answer_text(pid, n, size) for pid, n, *_ in plan} | {pid: answer_text(pid, n, size)
                                                                        for pid, n in fresh}
        expected = {pid: split(t, plat.post_limit(parents[pid])) for pid, t in texts.items()}
        assert all(len(expected[pid]) == n for pid, n, *_ in plan)

        # Every kill point: each child dies by SIGKILL where it was told to.
        jobs = [("mastodon", settings, url, parents[pid].snapshot(), str(calls), texts[pid], n, k, point)
                for pid, n, k, point in plan]
        codes = run_children(post_and_die, jobs)
        assert codes == [-signal.SIGKILL] * len(jobs), list(zip(plan, codes, strict=False))

        # Resumed with lost answers: every path is the next offer of the parent, and the sweep between offers.
        world.configure(lost_drop_rate=0.2)
        g = Guard(Store.open(url), plat, ident, send_timeout_s=3.0, compose_lease_s=2.0, watch_interval_s=None)
        sweeper = Sweeper(g.store, [Bot(plat, ident)], retry_s=0.5)
        deadline = time.monotonic() + 300
        waiting = set(parents)
        while waiting and time.monotonic() < deadline:
            for pid in sorted(waiting):
                out = g.post(parents[pid], Responder(str(calls), texts[pid]), path="inbox")
                if out.state == st.CLOSED:
                    waiting.discard(pid)
            sweeper.run_once()
            time.sleep(0.3)
        assert not waiting, {pid: g.store.peek(g.key(pid)).state for pid in waiting}
        # More sweeps and offers once the answers closed: nothing may be sent again.
        world.configure(lost_drop_rate=0.0)
        settled_twice(g, sweeper, parents, lambda pid: Responder(str(calls), texts[pid]), 0.5)

        for pid in parents:
            assert _chain(world, bot.id, pid) == [f"@{ASKER} {p}" for p in expected[pid]], pid
        with world.lock:
            sent = sum(1 for s in world.statuses.values() if s.account_id == bot.id and s.deleted_at is None)
        assert sent == sum(len(e) for e in expected.values())
        made = calls_per_parent(calls)
        cut = {pid for pid, _, _, point in plan if point == "compose"}
        assert made == {pid: 1 + (pid in cut) for pid in parents}
        assert world.report()["faults_injected"].get("lost_drop", 0) > 0  # the lost answers did happen
        g.store.dispose()
