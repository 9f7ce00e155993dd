"""The daemon on a real Synapse: three discovery paths find the same parents, each gets one reply.

The bot here is an account of its own in one fresh room, so its inbox and
re-find see nothing from the other Matrix tests. Replies are counted by
reading the room as another member, never from replyd's log.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from replyd.config import Config
from replyd.daemon import Daemon
from replyd.pipeline import Pipeline
from tests.synapse_server import Synapse
from tests.test_daemon import settled, wait_until

pytestmark = pytest.mark.slow


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


def test_three_paths_one_reply_per_parent(synapse: Synapse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parents found by inbox, search and re-find (each seen offering every one) get exactly one reply each."""
    hs = synapse
    bot = hs.register(f"daemonbot{uuid.uuid4().hex[:6]}")
    alice, bob, carol = (hs.people[p] for p in ("alice", "bob", "carol"))
    room = hs.create_room(alice, invite_bot=False, others=(bob, carol))
    hs.api("POST", f"/rooms/{room}/invite", alice, json_body={"user_id": bot.user_id})
    hs.api("POST", f"/rooms/{room}/join", bot, json_body={})
    word = f"helpword{uuid.uuid4().hex[:6]}"
    parents = []
    for i in range(6):
        who = (alice, bob)[i % 2]
        parents.append(hs.say(who, room, f"{bot.user_id} {word} number {i}", mention_bot=False) if i % 3 == 0
                       else hs.api("PUT", f"/rooms/{room}/send/m.room.message/{uuid.uuid4().hex}", who, json_body={
                           "msgtype": "m.text", "body": f"{word} number {i}",
                           "m.mentions": {"user_ids": [bot.user_id]}})["event_id"])
    offered: dict[str, set[str]] = {}
    real_offer = Pipeline.offer

    def spy(self: Pipeline, parent, path: str):  # noqa: ANN001, ANN202
        """Note which path found the parent, then offer it as the daemon would."""
        offered.setdefault(parent.id, set()).add(path)
        return real_offer(self, parent, path)

    monkeypatch.setattr(Pipeline, "offer", spy)
    monkeypatch.setenv("REPLYD_TEST_MATRIX_TOKEN", bot.token)
    db = tmp_path / "r.sqlite3"
    d = Daemon(Config.load(write_config(tmp_path / "c.toml", hs.base_url, db, word)))
    three = {"inbox", "search", "refind"}

    def per_parent() -> dict[str, list[str]]:
        return hs.replies_by(room, bot.user_id, carol)

    d.start()
    try:
        assert wait_until(lambda: all(per_parent().get(p) for p in parents), 60), per_parent()
        assert wait_until(lambda: all(offered.get(p) == three for p in parents), 60), \
            {p: offered.get(p) for p in parents}
        assert wait_until(lambda: settled(db), 30)
    finally:
        d.stop(grace_s=5)
    per = per_parent()
    assert {p: len(per.get(p, [])) for p in parents} == {p: 1 for p in parents}
    assert set(per) == set(parents)  # nothing else in the room was answered
