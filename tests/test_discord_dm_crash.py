"""DMs a `replyd run` process received on its Gateway connection but had not claimed, then a SIGKILL.

A bot cannot list its DMs: the backstop poll never finds one, so a DM is answered only if the process recorded
it (a ``released`` row, offered again by re-find) or Discord replays it (RESUME of the stored session). Each
test kills a real process at a chosen point and counts the bot's replies on the Discord fake.

- ``both``: the first DM's send is held (the stream's offer is busy), more DMs arrive, SIGKILL at once.
- ``recorded``: the rows of the waiting DMs are in the store before the SIGKILL; the session has expired when
  the process restarts (INVALID_SESSION): the rows alone must bring every DM back.
- ``replayed``: the process is stopped (SIGSTOP) while the DMs are dispatched, so none is recorded, then
  killed: RESUME of the stored session alone must bring them back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from replyd.store import Key, Store
from tests.discord_fake import BOT_ID, BOT_TOKENS, DiscordRest, DiscordWorld, Gateway
from tests.discord_scenario import PEOPLE, Replica, _up, _wait, free_port, replyd_config

pytestmark = pytest.mark.slow

DMS = 8


def _rows(url: str, parents: list[str]) -> dict[str, tuple[str, str]]:
    """(state, path) of each parent's row in the store the process writes."""
    store = Store.open(url)
    try:
        got = {p: store.get(Key("discord", BOT_ID, p)) for p in parents}
    finally:
        store.dispose()
    return {p: (r.state, r.path) for p, r in got.items() if r is not None}


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc): a signal is delivered after kill() returns."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


def _dispatched(gw: Gateway, parents: list[str]) -> bool:
    sent = {mid for _sid, mid in gw.dispatched}
    return all(p.partition(":")[2] in sent for p in parents)


@pytest.mark.parametrize("case", ["both", "recorded", "replayed"])
def test_dms_received_but_not_claimed_at_a_sigkill_are_answered_once(store_url, tmp_path: Path, case: str) -> None:
    world = DiscordWorld(seed=7)
    guild = world.add_channel()
    dms = [world.add_channel(dm=True) for _ in range(3)]
    gw = Gateway(world, heartbeat_ms=1000)
    with DiscordRest(world, gateway_url=gw.url) as api:
        port = free_port()
        cfg = replyd_config(tmp_path / "replyd.toml", api_url=api.url, store_url=store_url, port=port,
                            channels=[guild], listing_delay_s=1.0)  # the DMs are in no listed channel
        # Re-offer runs at start and then every sweep interval: 60 s keeps it from claiming the kept rows
        # before the SIGKILL (the held send keeps the stream's own offers waiting).
        cfg.write_text(cfg.read_text().replace("[sweep]\ninterval_s = 0.5", "[sweep]\ninterval_s = 60.0"))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "DISCORD_BOT_TOKEN": BOT_TOKENS[0]}
        argv = [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"]
        log = tmp_path / "replyd.log"
        proc = Replica("a", argv, env, log).start()
        try:
            _wait(lambda: _up(f"http://127.0.0.1:{port}/healthz") and gw.connections == 1, 60, "replyd not up")
            # The first DM's create is held: the stream's offer of it waits while more DMs arrive.
            world.create_faults = ["hold"]
            first = world.say(dms[0], PEOPLE[0], "first", mention=False)
            _wait(world.held.is_set, 20, "the first DM was not sent")
            if case == "replayed":
                assert proc.proc is not None
                proc.proc.send_signal(signal.SIGSTOP)  # nothing it is sent now can be read, let alone recorded
                _wait(lambda: _stopped(proc.proc.pid), 5, "replyd did not stop")
            rest = [world.say(dms[i % 3], PEOPLE[i % 2], f"dm {i}", mention=False) for i in range(1, DMS)]
            _wait(lambda: _dispatched(gw, rest), 10, "the fake did not dispatch every DM")
            if case == "recorded":
                _wait(lambda: len(_rows(store_url, rest)) == len(rest), 4, "the waiting DMs were not recorded")
                # Recorded, not claimed: the offers wait behind the held send (read timeout 5 s).
                assert set(_rows(store_url, rest).values()) == {("released", "stream")}, _rows(store_url, rest)
            proc.kill()
            if case == "replayed":
                assert _rows(store_url, rest) == {}, "a DM was recorded by a stopped process"
            if case == "recorded":
                # The fake holds a session while it still sees the killed connection: under load it sees the
                # close late, and expire() would leave that session resumable.
                _wait(lambda: gw.connections == 0, 10, "the fake still holds the killed connection")
                gw.expire()  # past the resume window: the restart's RESUME is refused
            world.release_held.set()
            resumes = len(gw.resumes)
            proc.start()
            parents = [first, *rest]
            _wait(lambda: all(world.bot_replies(p) for p in parents), 60,
                  f"not every DM answered: {[p for p in parents if not world.bot_replies(p)]}")
            time.sleep(3.0)  # a late second answer, if any, lands now
            replies = {p: len(world.bot_replies(p)) for p in parents}
        finally:
            world.release_held.set()
            if proc.proc is not None and proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)
            proc.stop()
            gw.close()
    text = log.read_text(errors="replace")
    assert replies == {p: 1 for p in parents}, (replies, text[-3000:])
    assert len(gw.resumes) > resumes, "the restarted process did not RESUME its stored session"
    if case == "recorded":
        # One refused RESUME, then a new session (a plant that loads the refused session again loops here).
        assert gw.invalid_answers == 1 and text.count("replyd.discord.resume_failed") == 1, text[-3000:]
        assert gw.identifies == 2
    if case == "replayed":
        assert gw.invalid_answers == 0 and gw.identifies == 1 and "replyd.discord.resumed" in text
