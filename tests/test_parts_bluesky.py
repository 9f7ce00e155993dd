"""Answers in several parts on the real Bluesky reference network (@atproto/dev-env): 300-grapheme parts, a
thread chain (part k+1 answers part k, the thread's root kept), real OS processes SIGKILLed between parts, and
20 % of createRecord answers lost by a proxy in front of the PDS.

Counted in the bot's repo on the PDS (listRecords): every parent has exactly its parts, each once, in order, with
the composed text; the responder was called once per answer, plus once where a kill cut the compose short.
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
from replyd.parts import length, split
from replyd.platforms.bluesky import BlueskyPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.parts_workers import Responder, answer_text, calls_per_parent, post_and_die, run_children
from tests.test_bluesky_network import PdsProxy

pytestmark = pytest.mark.slow


def _bot_posts(net: Any) -> list[dict[str, Any]]:
    """Every post in the bot's repo on the PDS (listRecords, every page)."""
    out, cursor = [], None
    while True:
        r = net.xrpc("GET", "com.atproto.repo.listRecords", params={
            "repo": net.bot.did, "collection": "app.bsky.feed.post", "limit": 100,
            **({"cursor": cursor} if cursor else {})})
        r.raise_for_status()
        body = r.json()
        out += body["records"]
        cursor = body.get("cursor")
        if not cursor or not body["records"]:
            return out


def _chain(posts: list[dict[str, Any]], parent_uri: str, root_uri: str) -> list[str]:
    """The bot's posts from ``parent_uri`` down the chain; fails on a fork (a duplicate) or a wrong root."""
    texts, at = [], parent_uri
    while True:
        kids = [p for p in posts if p["value"].get("reply", {}).get("parent", {}).get("uri") == at]
        assert len(kids) <= 1, f"{len(kids)} bot posts answer {at}"
        if not kids:
            return texts
        assert kids[0]["value"]["reply"]["root"]["uri"] == root_uri
        texts.append(kids[0]["value"]["text"])
        at = kids[0]["uri"]


def test_answers_in_parts_on_the_dev_env_survive_kills_and_lost_answers(bsky_network: Any, tmp_path: Path) -> None:
    """1-6 part answers; a 3-part answer killed at every point (compose, each part's claim, send, close) and one
    kill in every other size; then resumed and fresh answers sent with 20 % of create answers lost: each parent
    has exactly its parts once, in order, in one thread; one responder call per answer (+1 per cut compose)."""
    net = bsky_network
    proxy = PdsProxy(net.pds)
    db, calls = tmp_path / "r.sqlite3", tmp_path / "calls.txt"
    url = f"sqlite:///{db}"
    Store.open(url).dispose()
    settings = {"service": proxy.url, "identifier": net.bot.handle, "app_password": net.bot_app_password,
                "appview_did": net.appview_did, "listing_delay_s": 1.0, "instance": f"bluesky:{net.pds}"}
    try:
        with httpx.Client(trust_env=False) as http:
            plat = BlueskyPlatform.from_settings(settings, http=http, clock=SystemClock())
            ident = plat.whoami()
            before = {p["uri"] for p in _bot_posts(net)}

            def ask(text: str) -> Any:
                post = net.post(net.people["alice.test"], text, mention=net.bot)
                net.wait_indexed(post["uri"])
                return plat.resolve(post["uri"])

            plan: list[tuple[Any, int, int, str]] = [(ask("three parts, compose killed"), 3, 1, "compose")]
            plan += [(ask(f"three parts, {point} of part {k}"), 3, k, point)
                     for k in range(1, 4) for point in ("claim", "send", "close")]
            rotate = ["claim", "send", "close", "compose", "send"]
            plan += [(ask(f"{n} parts, {rotate[i]}"), n, min(n, 2), rotate[i]) for i, n in enumerate((1, 2, 4, 5, 6))]
            fresh = [(ask(f"{n} parts, no kill"), n) for n in range(1, 7)]
            parents = {p.id: p for p, *_ in plan} | {p.id: p for p, _ in fresh}
            sizes = {p.id: n for p, n, *_ in plan} | {p.id: n for p, n in fresh}
            # Graphemes beyond ASCII, so a split by code points would come out wrong.
            texts = {pid: answer_text(pid, n, 300).replace("w1", "é👍🏽") for pid, n in sizes.items()}
            expected = {pid: split(t, plat.post_limit(parents[pid])) for pid, t in texts.items()}
            assert {pid: len(e) for pid, e in expected.items()} == sizes
            assert all(length(part, "graphemes") <= 300 < len(part.encode()) or length(part, "graphemes") <= 300
                       for e in expected.values() for part in e)

            jobs = [("bluesky", settings, url, p.snapshot(), str(calls), texts[p.id], n, k, point)
                    for p, n, k, point in plan]
            codes = run_children(post_and_die, jobs, width=3)
            assert codes == [-signal.SIGKILL] * len(jobs), list(zip([(n, k, pt) for _, n, k, pt in plan], codes, strict=False))

            proxy.drop_rate = 0.2
            g = Guard(Store.open(url), plat, ident, send_timeout_s=3.0, compose_lease_s=2.0, watch_interval_s=None)
            sweeper = Sweeper(g.store, [Bot(plat, ident)], retry_s=0.5)
            waiting, deadline = set(parents), time.monotonic() + 300
            while waiting and time.monotonic() < deadline:
                for pid in sorted(waiting):
                    if g.post(parents[pid], Responder(str(calls), texts[pid]), path="inbox").state == st.CLOSED:
                        waiting.discard(pid)
                sweeper.run_once()
                time.sleep(0.5)
            assert not waiting, {pid: g.store.peek(g.key(pid)).state for pid in waiting}
            proxy.drop_rate = 0.0
            sweeper.run_once()
            assert all(g.post(p, Responder(str(calls), texts[pid])).status.value == "already_answered"
                       for pid, p in parents.items())

            posts = [p for p in _bot_posts(net) if p["uri"] not in before]
            for pid, parent in parents.items():
                root = parent.extra.get("root_uri") or pid
                assert _chain(posts, pid, root) == expected[pid], pid
            assert len(posts) == sum(sizes.values())
            cut = {p.id for p, _, _, point in plan if point == "compose"}
            assert calls_per_parent(calls) == {pid: 1 + (pid in cut) for pid in parents}
            g.store.dispose()
    finally:
        proxy.close()
