"""The Discord scenario with real OS processes: two replicas, every message by every path, faults, a SIGKILL.

``run(tmp, …)`` starts the fake Discord (REST and Gateway, ``tests/discord_fake.py``) in this process and
two ``replyd run`` replicas on PostgreSQL as subprocesses, each holding its own Gateway session (every
message is dispatched to both), each polling the listed channels as the backstop. Mid-run every Gateway
connection is closed: the replicas RESUME and the fake replays what they had already seen (``replay_seen``).
A share of creates lose their answer after the message is made (``lose_ratio``); one create is held and the
replica sending it is SIGKILLed and restarted. ``nonce_window_s`` may be set shorter than the listing delay:
then a retry after the sweep's judgement is not deduplicated by Discord, and only the read-back stops it.

``naive(…)`` is the other side: a discord.py-style bot in a thread that answers every MESSAGE_CREATE that
mentions it (RESUME replays included) and retries a failed create once, without a nonce.
Replies are counted by the fake: the bot's messages referencing each parent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.discord_fake import BOT_ID, BOT_TOKENS, DiscordRest, DiscordWorld, Gateway

ROOT = Path(__file__).resolve().parents[1]
PEOPLE = ("53908099506183680", "53908099506183681")


@dataclass
class Result:
    """What the fake counted for one run."""

    parents: list[str]
    replies: dict[str, int]
    create_requests: int
    lost_answers: int
    nonce_hits: int
    resumes: int
    dispatched: int
    replayed: int = 0  # MESSAGE_CREATEs sent again to a session that had them (RESUME replays)
    killed: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def duplicates(self) -> int:
        """Replies beyond the first, summed over parents."""
        return sum(max(0, n - 1) for n in self.replies.values())

    @property
    def lost(self) -> int:
        """Parents never answered."""
        return sum(1 for n in self.replies.values() if n == 0)


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replyd_config(path: Path, *, api_url: str, store_url: str, port: int, channels: list[str],
                  listing_delay_s: float, push: str = "discord_gateway") -> Path:
    """One replica's config: the Discord bot on the Gateway, the backstop poll, a template responder."""
    path.write_text(f"""
[store]
url = "{store_url}"

[log]
format = "json"
level = "info"

[api]
enabled = true
port = {port}

[guard]
send_timeout_s = 5.0

[sweep]
interval_s = 0.5

[[bots]]
name = "discord"
platform = "discord"

[bots.settings]
api_url = "{api_url}"
token_env = "DISCORD_BOT_TOKEN"
channels = {json.dumps(channels)}
listing_delay_s = {listing_delay_s}
inbox_lookback_s = 600
timeout_s = 5.0

[bots.pollers]
inbox_interval_s = 2.0
refind_interval_s = 0
jitter_s = 0.2

[bots.push]
kind = "{push}"

[bots.responder]
kind = "template"
template = "thanks <@{{author_id}}>, we are on it"
""")
    os.chmod(path, 0o600)
    return path


class Replica:
    """One bot process that can be SIGKILLed and started again with the same arguments."""

    def __init__(self, rid: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.rid, self.argv, self.env, self.log = rid, argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        """Start (or start again) the process."""
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("ab"))
        return self

    def kill(self) -> None:
        """SIGKILL, no grace."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 20 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _replayed(gw: Gateway) -> int:
    seen = Counter(gw.dispatched)
    return sum(n - 1 for n in seen.values())


def _world(nonce_window_s: float) -> tuple[DiscordWorld, list[str]]:
    world = DiscordWorld(nonce_window_s=nonce_window_s, seed=34)
    return world, [world.add_channel(), world.add_channel(), world.add_channel(dm=True)]


def _say_all(world: DiscordWorld, channels: list[str], gw: Gateway, messages: int) -> list[str]:
    parents = []
    for i in range(messages):
        who = PEOPLE[i % 2]
        cid = channels[i % 3]
        parents.append(world.say(cid, who, f"question {i}", mention=cid != channels[2]))
        if i == messages // 2:
            gw.force_reconnect()  # every replica RESUMEs; the fake replays events they had seen
        time.sleep(0.1)
    return parents


def run(tmp: Path, *, store_url: str, messages: int = 15, lose_ratio: float = 0.2, kill_mid_send: bool = True,
        nonce_window_s: float = 120.0, listing_delay_s: float = 2.0, settle_s: float = 5.0,
        timeout_s: float = 90.0) -> Result:
    """Run the scenario once against two ``replyd run`` replicas and return the fake's counts."""
    t0 = time.monotonic()
    tmp.mkdir(parents=True, exist_ok=True)
    world, channels = _world(nonce_window_s)
    gw = Gateway(world, heartbeat_ms=2000, replay_seen=3)
    replicas: dict[str, Replica] = {}
    killed: list[str] = []
    with DiscordRest(world, gateway_url=gw.url) as api:
        ports = {"a": free_port(), "b": free_port()}
        for i, rid in enumerate(("a", "b")):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "REPLYD_REPLICA_ID": rid, "DISCORD_BOT_TOKEN": BOT_TOKENS[i]}
            (tmp / rid).mkdir(exist_ok=True)
            cfg = replyd_config(tmp / rid / "replyd.toml", api_url=api.url, store_url=store_url, port=ports[rid],
                                channels=channels, listing_delay_s=listing_delay_s)
            argv = [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"]
            replicas[rid] = Replica(rid, argv, env, tmp / f"{rid}.log").start()
        _wait(lambda: all(_up(f"http://127.0.0.1:{p}/healthz") for p in ports.values()) and gw.connections >= 2,
              60, "replicas did not come up")
        by_token = {BOT_TOKENS[0]: "a", BOT_TOKENS[1]: "b"}
        if kill_mid_send:
            world.create_faults = [None, "hold"]  # type: ignore[list-item]  # the second create is held
        world.lose_ratio = lose_ratio

        def killer() -> None:
            if world.held.wait(timeout_s):
                rid = by_token[world.held_token]
                replicas[rid].kill()
                killed.append(f"{rid}: mid-send")
                world.release_held.set()
                replicas[rid].start()

        watcher = threading.Thread(target=killer, daemon=True)
        parents: list[str] = []
        try:
            if kill_mid_send:
                watcher.start()
            parents = _say_all(world, channels, gw, messages)
            _wait(lambda: all(world.bot_replies(p) for p in parents), timeout_s, "not every parent was answered")
            time.sleep(settle_s)  # late duplicates, if any, land now
        finally:
            world.release_held.set()
            for rep in replicas.values():
                rep.stop()
            gw.close()
    return Result(parents=parents, replies={p: len(world.bot_replies(p)) for p in parents},
                  create_requests=world.create_requests, lost_answers=world.lost_answers, nonce_hits=world.nonce_hits,
                  resumes=len(gw.resumes), dispatched=len(gw.dispatched), replayed=_replayed(gw), killed=killed,
                  elapsed_s=round(time.monotonic() - t0, 1))


def naive(tmp: Path, *, messages: int = 15, lose_ratio: float = 0.2, settle_s: float = 2.0) -> Result:
    """A discord.py-style bot: answers every MESSAGE_CREATE mentioning it (replays too), retries a failed create."""
    from websockets.sync.client import connect

    t0 = time.monotonic()
    world, channels = _world(120.0)
    gw = Gateway(world, heartbeat_ms=2000, replay_seen=3)
    stop = threading.Event()
    with DiscordRest(world, gateway_url=gw.url) as api, httpx.Client(timeout=5) as http:
        head = {"Authorization": f"Bot {BOT_TOKENS[0]}"}

        def answer(d: dict[str, Any]) -> None:
            body = {"content": "thanks", "message_reference": {"message_id": d["id"]}}
            for _ in range(2):  # the usual "retry once on error"
                try:
                    if http.post(f"{api.url}/channels/{d['channel_id']}/messages", json=body,
                                 headers=head).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass

        def bot() -> None:
            session: dict[str, Any] = {}
            while not stop.is_set():
                try:
                    with connect(gw.url()) as ws:
                        ws.recv()
                        if session:
                            ws.send(json.dumps({"op": 6, "d": {"token": BOT_TOKENS[0], **session}}))
                        else:
                            ws.send(json.dumps({"op": 2, "d": {"token": BOT_TOKENS[0], "intents": 4608,
                                                               "properties": {}}}))
                        while not stop.is_set():
                            try:
                                f = json.loads(ws.recv(timeout=0.5))
                            except TimeoutError:
                                ws.send(json.dumps({"op": 1, "d": session.get("seq")}))
                                continue
                            if f.get("s"):
                                session["seq"] = f["s"]
                            if f.get("t") == "READY":
                                session["session_id"] = f["d"]["session_id"]
                            if f.get("t") == "MESSAGE_CREATE" and f["d"]["author"]["id"] != BOT_ID:
                                answer(f["d"])
                except Exception:
                    time.sleep(0.2)

        t = threading.Thread(target=bot, daemon=True)
        t.start()
        _wait(lambda: gw.connections >= 1, 10, "naive bot did not connect")
        world.lose_ratio = lose_ratio
        parents = _say_all(world, channels, gw, messages)
        time.sleep(settle_s)
        stop.set()
        t.join(3)
        gw.close()
    return Result(parents=parents, replies={p: len(world.bot_replies(p)) for p in parents},
                  create_requests=world.create_requests, lost_answers=world.lost_answers, nonce_hits=world.nonce_hits,
                  resumes=len(gw.resumes), dispatched=len(gw.dispatched), replayed=_replayed(gw), elapsed_s=round(time.monotonic() - t0, 1))


@dataclass
class InteractionsResult:
    """What the fake counted for the interactions run."""

    interactions: list[str]
    acks: dict[str, int]
    ack_s: list[float]
    edits: dict[str, int]
    followups: dict[str, int]
    forged_statuses: list[int | None]
    forged_acks: int


def interactions_run(tmp: Path, *, store_url: str, count: int = 8, deliveries: int = 2,
                     timeout_s: float = 60.0) -> InteractionsResult:
    """Two ``replyd run`` replicas receiving interactions (kind "discord"); each delivered to both, plus a forged one."""
    from nacl.signing import SigningKey

    from tests.discord_fake import InteractionSender

    tmp.mkdir(parents=True, exist_ok=True)
    world, channels = _world(120.0)
    with DiscordRest(world) as api:
        ports = {"a": free_port(), "b": free_port()}
        sender = InteractionSender(world, [f"http://127.0.0.1:{ports[r]}/v1/hooks/discord" for r in ("a", "b")],
                                   deliveries=deliveries)
        replicas = {}
        for i, rid in enumerate(("a", "b")):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "REPLYD_REPLICA_ID": rid, "DISCORD_BOT_TOKEN": BOT_TOKENS[i],
                   "DISCORD_PUBLIC_KEY": sender.public_key}
            (tmp / rid).mkdir(exist_ok=True)
            cfg = replyd_config(tmp / rid / "replyd.toml", api_url=api.url, store_url=store_url, port=ports[rid],
                                channels=channels, listing_delay_s=2.0, push='discord"\nsecret_env = "DISCORD_PUBLIC_KEY')
            argv = [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"]
            replicas[rid] = Replica(rid, argv, env, tmp / f"{rid}.log").start()
        try:
            _wait(lambda: all(_up(f"http://127.0.0.1:{p}/healthz") for p in ports.values()), 60, "replicas not up")
            _wait(lambda: all(httpx.post(f"http://127.0.0.1:{p}/v1/hooks/discord", content=b"{}").status_code == 401
                              for p in ports.values()), 30, "hooks not ready")
            ids = [sender.fire(channels[i % 3], PEOPLE[i % 2], f"question {i}") for i in range(count)]
            forged = sender.payload(channels[0], PEOPLE[0], "forged")
            before = len(sender.statuses)
            for url in sender.urls:
                sender.deliver(forged, url, key=SigningKey.generate())
            forged_statuses = sender.statuses[before:]
            _wait(lambda: all(world.interactions[i].edits for i in ids), timeout_s, "not every interaction answered")
            time.sleep(3.0)  # late second answers, if any, land now
        finally:
            for rep in replicas.values():
                rep.stop()
            sender.close()
    its = world.interactions
    return InteractionsResult(interactions=ids, acks={i: its[i].acks for i in ids},
                              ack_s=[s for i in ids for s in its[i].ack_s], edits={i: its[i].edits for i in ids},
                              followups={i: len(its[i].followups) for i in ids}, forged_statuses=forged_statuses,
                              forged_acks=its[forged["id"]].acks)
