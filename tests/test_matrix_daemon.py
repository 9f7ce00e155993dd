"""The daemon on a real Synapse: three discovery paths find the same parents, each gets one reply.

Each test's bot is an account of its own in one fresh room, so its inbox and
re-find see nothing from the other Matrix tests. Replies are counted by
reading the room as another member, never from replyd's log.
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from replyd.config import Config
from replyd.daemon import Daemon
from replyd.pipeline import Pipeline
from tests.synapse_server import DropProxy, Synapse, User
from tests.test_daemon import _start_daemon, settled, wait_until

pytestmark = pytest.mark.slow
THREE = {"inbox", "search", "refind"}


def write_config(path: Path, base_url: str, db: Path, word: str) -> Path:
    """A daemon config for one Matrix bot with all three paths on short intervals."""
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "info"

[guard]
send_timeout_s = 5.0

[sweep]
interval_s = 0.5
retry_s = 0.5

[[bots]]
name = "matrix"
platform = "matrix"

[bots.settings]
base_url = "{base_url}"
token_env = "REPLYD_TEST_MATRIX_TOKEN"
listing_delay_s = 0.5
timeout_s = 5.0

[bots.pollers]
inbox_interval_s = 0.4
search_interval_s = 0.5
search_queries = ["{word}"]
refind_interval_s = 0.7
refind_lookback_s = 3600
jitter_s = 0

[bots.responder]
kind = "template"
""")
    os.chmod(path, 0o600)
    return path


@dataclass
class Scene:
    """A fresh bot in a fresh room with ``n`` parents mentioning it (half by m.mentions, half by the body)."""

    hs: Synapse
    bot: User
    room: str
    word: str
    parents: list[str]

    def replies(self) -> dict[str, list[str]]:
        """The bot's replies per parent, read as carol."""
        return self.hs.replies_by(self.room, self.bot.user_id, self.hs.people["carol"])


def scene(hs: Synapse, n: int) -> Scene:
    """Register a bot, make a room with alice, bob, carol and the bot, and have the people mention it ``n`` times."""
    bot = hs.register(f"daemonbot{uuid.uuid4().hex[:6]}")
    alice, bob, carol = (hs.people[p] for p in ("alice", "bob", "carol"))
    room = hs.create_room(alice, invite_bot=False, others=(bob, carol))
    hs.api("POST", f"/rooms/{room}/invite", alice, json_body={"user_id": bot.user_id})
    hs.api("POST", f"/rooms/{room}/join", bot, json_body={})
    word = f"helpword{uuid.uuid4().hex[:6]}"
    parents = []
    for i in range(n):
        who = (alice, bob)[i % 2]
        if i % 2:  # the id in the body only, as an older client writes it
            parents.append(hs.say(who, room, f"{bot.user_id} {word} number {i}", mention_bot=False))
        else:
            parents.append(hs.api("PUT", f"/rooms/{room}/send/m.room.message/{uuid.uuid4().hex}", who, json_body={
                "msgtype": "m.text", "body": f"{word} number {i}", "m.mentions": {"user_ids": [bot.user_id]}},
            )["event_id"])
    return Scene(hs, bot, room, word, parents)


def run_daemon(sc: Scene, base_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """Run the daemon until every parent has a reply, every path offered each, and the log settled."""
    offered: dict[str, set[str]] = {}
    real_offer = Pipeline.offer_page

    def spy(self: Pipeline, parents, path: str):
        """Note which path found each parent of a page (one alone is a page of one), then offer it as the daemon
        would."""
        for parent in parents:
            offered.setdefault(parent.id, set()).add(path)
        return real_offer(self, parents, path)

    monkeypatch.setattr(Pipeline, "offer_page", spy)
    monkeypatch.setenv("REPLYD_TEST_MATRIX_TOKEN", sc.bot.token)
    db = tmp_path / "r.sqlite3"
    d = Daemon(Config.load(write_config(tmp_path / "c.toml", base_url, db, sc.word)))
    d.start()
    try:
        assert wait_until(lambda: all(sc.replies().get(p) for p in sc.parents), 60), sc.replies()
        assert wait_until(lambda: all(offered.get(p) == THREE for p in sc.parents), 60), \
            {p: offered.get(p) for p in sc.parents}
        assert wait_until(lambda: settled(db), 30)
    finally:
        d.stop(grace_s=5)
    return offered


def test_three_paths_one_reply_per_parent(synapse: Synapse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parents found by inbox, search and re-find (each seen offering every one) get exactly one reply each."""
    sc = scene(synapse, 6)
    run_daemon(sc, synapse.base_url, tmp_path, monkeypatch)
    per = sc.replies()
    assert {p: len(per.get(p, [])) for p in sc.parents} == {p: 1 for p in sc.parents}
    assert set(per) == set(sc.parents)  # nothing else in the room was answered


def test_lost_responses_still_one_reply_per_parent(synapse: Synapse, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a proxy losing the answer of every other send (and the first three), each parent still gets one reply."""
    sc = scene(synapse, 8)
    proxy = DropProxy(synapse.base_url)
    proxy.drop_sends, proxy.drop_every = 3, 2
    try:
        run_daemon(sc, proxy.url, tmp_path, monkeypatch)
    finally:
        proxy.close()
    assert proxy.dropped >= 4  # the run really lost answers of sends Synapse carried out
    per = sc.replies()
    assert {p: len(per.get(p, [])) for p in sc.parents} == {p: 1 for p in sc.parents}
    assert set(per) == set(sc.parents)


def test_replyd_run_sigkilled_and_restarted_one_reply_per_parent(synapse: Synapse, tmp_path: Path) -> None:
    """``replyd run`` SIGKILLed mid-run through a proxy losing send answers, then restarted: one reply per parent."""
    sc = scene(synapse, 12)
    proxy = DropProxy(synapse.base_url)
    proxy.drop_every = 3
    db = tmp_path / "r.sqlite3"
    cfg = write_config(tmp_path / "c.toml", proxy.url, db, sc.word)
    log = tmp_path / "daemon.log"
    os.environ["REPLYD_TEST_MATRIX_TOKEN"] = sc.bot.token  # inherited by the child processes
    try:
        first = _start_daemon(cfg, log)
        try:
            assert wait_until(lambda: sum(map(len, sc.replies().values())) >= 3, 60), log.read_text()[-3000:]
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        second = _start_daemon(cfg, log)
        try:
            assert wait_until(lambda: all(sc.replies().get(p) for p in sc.parents) and settled(db), 150), \
                log.read_text()[-3000:]
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(20) == 0
    finally:
        os.environ.pop("REPLYD_TEST_MATRIX_TOKEN", None)
        proxy.close()
    assert proxy.dropped >= 1
    per = sc.replies()
    assert {p: len(per.get(p, [])) for p in sc.parents} == {p: 1 for p in sc.parents}
