"""The Slack scenario with real OS processes: two replicas, every message by every path, faults, a SIGKILL.

``run(kind, …)`` starts the fake Slack (Web API, Events API sender, Socket Mode server) in this process
and two bot replicas as subprocesses: replica ``a`` receives the Events API (every delivery retried
three times as Slack does on a lost ack, plus the same message under extra event ids), replica ``b``
holds a Socket Mode connection (asked to reconnect mid-run, so unacked envelopes come again). Some
``chat.postMessage`` answers are lost after the message is created; one send is held open and the
replica sending it is SIGKILLed and restarted; optionally one replica is SIGKILLed while it composes.

``kind = "replyd"``: ``replyd run`` on PostgreSQL with the backstop poll on and a counting ``command``
responder. ``kind = "naive"``: ``bench/slack_naive.py`` (TTL seen-set in Redis, marked on receipt).
Replies are counted by the fake (the bot's messages in each parent's thread); responder calls from the
responders' own log. Used by ``tests/test_slack_replicas.py`` and ``bench/slack_naive_vs_replyd.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.slack_fake import (
    APP_TOKEN,
    BOT_TOKENS,
    BOT_USER,
    SIGNING_SECRET,
    EventsSender,
    SlackWebApi,
    SlackWorld,
    SocketServer,
)

ROOT = Path(__file__).resolve().parents[1]
GENERAL, HELP, DMS = "C0GENERAL1", "C0HELPDSK1", ("D0DMALICE1", "D0DMBOBBY1")
PEOPLE = ("U0ALICE001", "U0BOBBY001")

# The replyd replicas' responder: logs each call (parent id, the replica's pid), sleeps like an LLM call.
RESPONDER = """
import json, os, sys, time
p = json.load(sys.stdin)
with open(sys.argv[1], "a") as f:
    f.write(p["id"] + " " + str(os.getppid()) + "\\n")
time.sleep(float(sys.argv[2]) * (10 if "slow" in p.get("text", "") else 1))
print("thanks, we are on it")
"""


@dataclass
class Result:
    """What the fake counted for one run."""

    kind: str
    parents: list[str]
    replies: dict[str, int]
    calls: dict[str, int]
    deliveries: int
    post_requests: int
    killed: list[str] = field(default_factory=list)
    killed_at: list[tuple[str, float]] = field(default_factory=list)  # (replica id, epoch of the SIGKILL)
    elapsed_s: float = 0.0

    @property
    def duplicates(self) -> int:
        """Replies beyond the first, summed over parents."""
        return sum(max(0, n - 1) for n in self.replies.values())

    @property
    def lost(self) -> int:
        """Parents never answered."""
        return sum(1 for n in self.replies.values() if n == 0)

    @property
    def extra_calls(self) -> int:
        """Responder calls beyond one per parent."""
        return sum(max(0, self.calls.get(p, 0) - 1) for p in self.parents)


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replyd_config(path: Path, *, api_url: str, store_url: str, port: int, push: str, calls: Path,
                  compose_s: float) -> Path:
    """One replica's config: the Slack bot, its push kind, the backstop poll, the counting responder."""
    script = path.parent / "responder.py"
    script.write_text(RESPONDER)
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
compose_lease_s = 8.0

[sweep]
interval_s = 0.5

[[bots]]
name = "slack"
platform = "slack"

[bots.settings]
api_url = "{api_url}"
token_env = "SLACK_BOT_TOKEN"
app_token_env = "SLACK_APP_TOKEN"
team_id = "T0FAKE001"
listing_delay_s = 2.0   # the adapter default: a send still in flight when its replica died lands well inside it
inbox_lookback_s = 600
timeout_s = 5.0

[bots.pollers]
inbox_interval_s = 2.0
refind_interval_s = 0
jitter_s = 0.2

[bots.push]
kind = "{push}"
secret_env = "SLACK_SIGNING_SECRET"

[bots.responder]
kind = "command"
command = ["{sys.executable}", "{script}", "{calls}", "{compose_s}"]
timeout_s = 30
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


def replica_head(store_url: str, port: int, name: str, platform: str) -> str:
    """The top of a no-read-back replica's config: store, JSON log, API on ``port``, short deadlines, one bot."""
    return f"""
store = {{ url = "{store_url}" }}
log = {{ format = "json", level = "info" }}
api = {{ enabled = true, port = {port} }}
guard = {{ send_timeout_s = 3.0 }}
sweep = {{ interval_s = 0.5 }}

[[bots]]
name = "{name}"
platform = "{platform}"
"""


def row_states(url: str) -> dict[str, str]:
    """Every answered-log row's parent id and state, read straight from the database."""
    import sqlalchemy as sa

    eng = sa.create_engine(url)
    with eng.connect() as c:
        rows = dict(c.exec_driver_sql("SELECT parent_id, state FROM replies").all())
    eng.dispose()
    return rows


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


def run(kind: str, tmp: Path, *, store_url: str = "", redis_url: str = "redis://127.0.0.1:6379/0",
        messages: int = 12, lost: int = 3, kill_mid_send: bool = True, kill_mid_compose: bool = False,
        minute_s: float = 0.5, extra_event_ids: int = 1, naive_key: str = "event_id", compose_s: float = 0.2,
        settle_s: float = 4.0, timeout_s: float = 90.0) -> Result:
    """Run the scenario once against ``kind`` ("replyd" or "naive") and return the fake's counts."""
    t0 = time.monotonic()
    tmp.mkdir(parents=True, exist_ok=True)
    world = SlackWorld()
    world.add_channel(GENERAL, BOT_USER, *PEOPLE)
    world.add_channel(HELP, BOT_USER, *PEOPLE)
    world.add_channel(DMS[0], BOT_USER, PEOPLE[0])
    world.add_channel(DMS[1], BOT_USER, PEOPLE[1])
    sock = SocketServer(world)
    calls = tmp / "calls.txt"
    calls.touch()
    replicas: dict[str, Replica] = {}
    killed: list[str] = []
    killed_at: list[tuple[str, float]] = []
    with SlackWebApi(world, socket_url=sock.url) as api:
        ports = {"a": free_port(), "b": free_port()}
        for i, rid in enumerate(("a", "b")):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "REPLYD_REPLICA_ID": rid,
                   "SLACK_BOT_TOKEN": BOT_TOKENS[i], "SLACK_APP_TOKEN": APP_TOKEN,
                   "SLACK_SIGNING_SECRET": SIGNING_SECRET}
            if kind == "replyd":
                (tmp / rid).mkdir(exist_ok=True)
                cfg = replyd_config(tmp / rid / "replyd.toml", api_url=api.url, store_url=store_url, port=ports[rid],
                                    push="slack" if rid == "a" else "slack_socket", calls=calls, compose_s=compose_s)
                argv = [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"]
            else:
                argv = [sys.executable, "-m", "bench.slack_naive", "--api-url", api.url, "--port", str(ports[rid]),
                        "--mode", "events" if rid == "a" else "socket", "--redis", redis_url,
                        "--prefix", f"naive-{uuid.uuid4().hex[:8]}", "--ttl-s", str(10 * minute_s),
                        "--key", naive_key, "--calls", str(calls), "--compose-s", str(compose_s)]
            replicas[rid] = Replica(rid, argv, env, tmp / f"{rid}.log").start()
        hook = (f"http://127.0.0.1:{ports['a']}/v1/hooks/slack" if kind == "replyd"
                else f"http://127.0.0.1:{ports['a']}/")
        health = f"http://127.0.0.1:{ports['a']}/healthz" if kind == "replyd" else hook
        _wait(lambda: _up(health) and sock.connections >= 1, 60, f"{kind} replicas did not come up")
        sender = EventsSender(world, [hook], minute_s=minute_s, retry_all=True, extra_event_ids=extra_event_ids)
        by_token = {BOT_TOKENS[0]: "a", BOT_TOKENS[1]: "b"}
        faults = ["lost"] * lost
        if kill_mid_send:
            faults.insert(min(1, len(faults)), "hold")
        world.post_faults = faults

        def killer() -> None:
            if world.held.wait(timeout_s):
                rid = by_token[world.held_token]
                replicas[rid].kill()
                killed_at.append((rid, time.time()))  # after death: every event it wrote is older
                killed.append(f"{rid}: mid-send")
                world.release_held.set()
                replicas[rid].start()

        def compose_killer(parent: str) -> None:
            end = time.monotonic() + timeout_s
            while time.monotonic() < end:
                pids = [line.partition(" ")[2] for line in calls.read_text().splitlines()
                        if line.partition(" ")[0] == parent]
                if pids:
                    live = [r for r, rep in replicas.items() if rep.proc and str(rep.proc.pid) in pids]
                    if not live:
                        return  # the composing process has died already (the mid-send kill)
                    replicas[live[0]].kill()
                    killed_at.append((live[0], time.time()))
                    killed.append(f"{live[0]}: mid-compose")
                    replicas[live[0]].start()
                    return
                time.sleep(0.05)

        watchers = [threading.Thread(target=killer, daemon=True)] if kill_mid_send else []
        parents: list[str] = []
        try:
            for w in watchers:
                w.start()
            for i in range(messages):
                who = PEOPLE[i % 2]
                slow = " (slow)" if kill_mid_compose and i == 2 else ""
                if i % 3 == 2:
                    parents.append(world.say(DMS[i % 2], who, f"a question in private {i}{slow}"))
                else:
                    parents.append(world.say(GENERAL if i % 2 else HELP, who,
                                             f"<@{BOT_USER}> question {i}{slow}, please?"))
                if slow:
                    t = threading.Thread(target=compose_killer, args=(parents[-1],), daemon=True)
                    t.start()
                    watchers.append(t)
                if i == messages // 2:
                    sock.disconnect()  # Socket Mode reconnects; envelopes not acked yet come again
                time.sleep(0.1)
            _wait(lambda: sender.pending() == 0, timeout_s, "the Events API retries did not finish")
            try:
                _wait(lambda: all(world.thread_replies(p) for p in parents), timeout_s if kind == "replyd" else 5,
                      "not every parent was answered")
            except TimeoutError:
                if kind == "replyd":
                    raise
            time.sleep(settle_s)  # late duplicates, if any, land now
        finally:
            world.release_held.set()
            for rep in replicas.values():
                rep.stop()
            sender.close()
            sock.close()
    made = Counter(line.partition(" ")[0] for line in calls.read_text().splitlines())
    return Result(kind=kind, parents=parents, replies={p: len(world.thread_replies(p)) for p in parents},
                  calls={p: made.get(p, 0) for p in parents}, deliveries=len(sender.sent) + len(sock.delivered),
                  post_requests=world.post_requests, killed=killed, killed_at=killed_at, elapsed_s=round(time.monotonic() - t0, 1))


# What replyd's HTTP client says when the transport, not the fake's fault plan, made a send ambiguous: a
# timeout before the answer came, or a kept-alive connection the server closed as the request went out.
_TRANSPORT = ("timeout", "timed out", "remoteprotocolerror", "readerror", "writeerror", "disconnected")


def transport_ambiguous(url: str) -> set[str]:
    """Parents with a send the transport made ambiguous (a timeout, a connection closed under the request):
    unknown to the fake's own plan, yet rightly unconfirmed."""
    import sqlalchemy as sa

    eng = sa.create_engine(url)
    with eng.connect() as c:
        rows = c.exec_driver_sql("SELECT parent_id, detail FROM events WHERE kind = 'maybe_sent'").all()
    eng.dispose()
    return {p for p, d in rows if any(word in str(d).lower() for word in _TRANSPORT)}


def cut_before_send(url: str, owners: set[str]) -> set[str]:
    """Parents whose last attempt was opened by one of ``owners`` (replicas that were SIGKILLed) and never heard
    of again from it: no close, no maybe_sent, no release. A kill between the open commit and the request
    leaves exactly that; a test also checks the platform never saw the send."""
    import sqlalchemy as sa

    eng = sa.create_engine(url)
    with eng.connect() as c:
        rows = c.exec_driver_sql("SELECT parent_id, kind, attempt, owner FROM events ORDER BY id").all()
    eng.dispose()
    opened: dict[str, tuple[int, str]] = {}
    heard: set[tuple[str, int, str]] = set()
    for p, kind, attempt, owner in rows:
        if kind == "opened":
            opened[p] = (attempt, owner)
        elif kind in ("closed", "maybe_sent", "late_maybe_sent", "released", "too_late", "rejected", "late_landing"):
            heard.add((p, attempt, owner))
    return {p for p, (attempt, owner) in opened.items() if owner in owners and (p, attempt, owner) not in heard}


def events_of(url: str, parents: set[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Each parent's events in order (kind, state, attempt, owner, detail): what an unexplained row went through."""
    import sqlalchemy as sa

    eng = sa.create_engine(url)
    with eng.connect() as c:
        rows = c.exec_driver_sql("SELECT parent_id, kind, state, attempt, owner, detail FROM events ORDER BY id").all()
    eng.dispose()
    out: dict[str, list[tuple[Any, ...]]] = {p: [] for p in parents}
    for p, *rest in rows:
        if p in out:
            out[p].append(tuple(rest))
    return out
