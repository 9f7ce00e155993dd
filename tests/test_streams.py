"""Stream discovery (Mastodon's notification stream) against the sim over real HTTP; replies counted by the sim."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.errors import DefinitelyNotSent
from replyd.platforms.base import make_platform
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.test_daemon import wait_until

BOT = "replybot"


@pytest.fixture
def sim():
    """A sim in this process with the bot account and its token in the environment."""
    world = World(SystemClock(), seed=4, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    world.add_account("alice")
    with SimServer(world) as srv:
        os.environ["SIM_TOKEN"] = bot.token
        yield srv, world, bot
    os.environ.pop("SIM_TOKEN", None)


def test_stream_yields_the_inbox_parent_and_ends_when_cut(sim) -> None:
    """A mention pushed on the stream is the parent the inbox poll builds; a cut ends it; a refused one raises."""
    srv, world, bot = sim
    with httpx.Client(timeout=5.0) as http:
        plat = make_platform("mastodon", {"base_url": srv.base_url, "token": bot.token}, http=http,
                             clock=SystemClock())
        got: list = []
        stop = threading.Event()
        reader = threading.Thread(target=lambda: got.extend(plat.stream(stop)), daemon=True)
        reader.start()
        assert wait_until(lambda: world.streams_served == 1, 10)
        status = world.post("alice", "hello there", mention=[BOT])
        assert wait_until(lambda: len(got) == 1, 10)
        [polled] = plat.inbox(None).parents
        assert got[0] == polled and got[0].id == status.id
        world.cut_streams(refuse_s=30)
        reader.join(10)
        assert not reader.is_alive()  # the server closed it: the generator returned
        with pytest.raises(DefinitelyNotSent, match="stream"):
            list(plat.stream(stop))  # refused (503) while the streaming server is down: a read, nothing sent


def _config(tmp_path: Path, base_url: str, *, inbox_s: float | None) -> Path:
    inbox = f"inbox_interval_s = {inbox_s}" if inbox_s is not None else ""
    cfg = tmp_path / "stream.toml"
    cfg.write_text(f"""
[store]
url = "sqlite:///{tmp_path / 'r.sqlite3'}"

[log]
format = "json"

[guard]
send_timeout_s = 2.0

[sweep]
interval_s = 0.5

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "SIM_TOKEN"
listing_delay_s = 0.5

[bots.pollers]
{inbox}
refind_interval_s = 0
jitter_s = 0

[bots.push]
kind = "mastodon_stream"

[bots.responder]
kind = "template"
""")
    os.chmod(cfg, 0o600)
    return cfg


def _closed_paths(db: Path, instance: str, sender_id: str) -> dict[str, str]:
    """Parent id -> the path that answered it, for the closed rows of the log."""
    s = Store.open(f"sqlite:///{db}")
    try:
        return {r.parent_id: r.path for r in s.rows_in(instance, sender_id, [st.CLOSED], limit=10_000)}
    finally:
        s.dispose()


def test_mentions_are_answered_from_the_stream_with_the_poll_as_backstop_only(sim, tmp_path) -> None:
    """With a stream and the default backstop (the poll every 300 s) every mention is answered once, by the stream."""
    srv, world, bot = sim
    d = Daemon(Config.load(_config(tmp_path, srv.base_url, inbox_s=None)))
    assert d.cfg.bots[0].inbox_interval_s() == 300.0
    d.start()
    try:
        assert wait_until(lambda: world.streams_served >= 1, 15)
        parents = [world.post("alice", f"question {i}?", mention=[BOT]).id for i in range(5)]
        assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents), 20)
        time.sleep(1.0)
    finally:
        d.stop(grace_s=3)
    assert [world.replies_by(bot.id).get(p, 0) for p in parents] == [1] * 5
    paths = _closed_paths(tmp_path / "r.sqlite3", f"mastodon:{srv.base_url}", bot.id)
    assert {paths[p] for p in parents} == {"stream"}


@pytest.mark.slow
def test_stream_cut_and_refused_the_gap_is_answered_once(sim, tmp_path) -> None:
    """The stream is cut and refused for 30 s while mentions arrive: the backstop and the reconnect answer each once."""
    srv, world, bot = sim
    d = Daemon(Config.load(_config(tmp_path, srv.base_url, inbox_s=1.0)))
    d.start()
    try:
        assert wait_until(lambda: world.streams_served >= 1, 15)
        before = [world.post("alice", f"before {i}?", mention=[BOT]).id for i in range(3)]
        assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in before), 20)
        world.cut_streams(refuse_s=30.0)
        gap = [world.post("alice", f"in the gap {i}?", mention=[BOT]).id for i in range(4)]
        served = world.streams_served
        # The backstop poll answers the gap while the stream is refused; the stream comes back after the outage.
        assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in gap), 20)
        assert wait_until(lambda: world.streams_served > served, 75)
        after = [world.post("alice", f"after {i}?", mention=[BOT]).id for i in range(3)]
        everything = before + gap + after
        assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in everything), 20)
        time.sleep(1.5)
    finally:
        d.stop(grace_s=3)
    per = world.replies_by(bot.id)
    assert [per.get(p, 0) for p in everything] == [1] * len(everything)
    assert world.report()["duplicates"] == 0


def test_a_first_empty_inbox_poll_marks_the_start_so_a_burst_is_read_whole(sim) -> None:
    """A bot whose first poll found nothing reads every mention of a later burst, not only the newest page."""
    srv, world, bot = sim
    with httpx.Client(timeout=5.0) as http:
        plat = make_platform("mastodon", {"base_url": srv.base_url, "token": bot.token, "page_limit": 10},
                             http=http, clock=SystemClock())
        first = plat.inbox(None)
        assert first.parents == [] and first.cursor is not None
        burst = [world.post("alice", f"question {i}?", mention=[BOT]).id for i in range(35)]
        time.sleep(0.3)  # the sim lists new posts after its 0.2 s listing delay
        page = plat.inbox(first.cursor)
        assert [p.id for p in page.parents] == burst


def test_a_kept_stream_records_each_parent_before_reading_on_and_a_failed_record_ends_it() -> None:
    """With ``keep`` (a ``ResumableStream``): each parent is recorded before the source is asked for the next,
    its offer runs on the other thread; a record that fails closes the source at that parent, never offered.
    Plant: offering before keeping (or keeping after asking for the next) breaks the order asserted here."""
    from replyd.platforms.base import Parent
    from replyd.streams import StreamRunner

    trail: list[str] = []
    offered = threading.Event()

    class Source:
        instance = "fake"

        connects = 0

        def stream(self, stop: threading.Event):
            self.connects += 1
            if self.connects > 1:  # the reconnect after the failure: nothing more to read
                stop.wait()
                return
            try:
                for pid in ("p1", "p2", "p3"):
                    trail.append(f"yield {pid}")
                    yield Parent(id=pid, author_id="u")
                    trail.append(f"resumed after {pid}")
            finally:
                trail.append("closed")

    def keep(parents) -> None:
        trail.append(f"kept {parents[0].id}")
        if parents[0].id == "p2":
            raise OSError("the store is gone")

    def offer(parent, path):
        trail.append(f"offered {parent.id} by {threading.current_thread().name}")
        offered.set()
        return type("Out", (), {"status": type("S", (), {"value": "posted"})})()

    runner = StreamRunner("b", Source(), offer, lambda: None, keep=keep).start()  # type: ignore[arg-type]
    assert wait_until(lambda: "closed" in trail and offered.is_set() and runner._offers.empty(), 5)
    time.sleep(0.3)  # an offer taken from the queue is written to the trail by now
    runner.stop()
    reads = [t for t in trail if not t.startswith("offered")]
    assert reads == ["yield p1", "kept p1", "resumed after p1", "yield p2", "kept p2", "closed"], trail
    assert [t for t in trail if t.startswith("offered")] == ["offered p1 by replyd-stream-offer-b"], trail
