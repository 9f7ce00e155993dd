"""The sim's webhook sender: signed deliveries that replyd's receiver accepts, with duplicates, reordering, delays
and drops that do what they say (counted at the receiver), and a daemon that answers each mention once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from replyd import store as st
from replyd.api import ApiServer
from replyd.clock import FakeClock, SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.errors import BadResponse
from replyd.hooks import KINDS, Hook, Receiver
from replyd.platforms.base import Parent, make_platform
from replyd.sim import SimServer, World
from replyd.sim.webhooks import SenderFaults, WebhookSender
from replyd.store import Store
from tests.test_daemon import wait_until
from tests.test_hooks import COUNTING_RESPONDER, ROOT, _free_port, _ready
from tests.test_streams import _config as stream_config

BOT = "replybot"
SECRET = "sim-hook-secret-0123456789abcdef"


class CountingReceiver:
    """replyd's Receiver behind a real HTTP route that counts what arrives (delivery id, answer) before answering."""

    def __init__(self, platform, kind: str) -> None:
        self.kind = kind
        self.arrivals: list[tuple[str, int, list[str]]] = []  # (delivery id, HTTP status, parent ids)
        self.offered: list[Parent] = []
        self.receiver = Receiver({BOT: Hook(BOT, kind, SECRET, platform, self._offer, instance=platform.instance)})
        self.server = ApiServer(Starlette(routes=[Route("/hook", self._hook, methods=["POST"])]))

    def _offer(self, parent: Parent, path: str) -> SimpleNamespace:
        assert path == "webhook"
        self.offered.append(parent)
        return SimpleNamespace(status=SimpleNamespace(value="recorded"))

    async def _hook(self, request: Request) -> JSONResponse:
        body = await request.body()
        answer = self.receiver.receive(BOT, request.headers, body)
        delivery = request.headers.get(KINDS[self.kind].delivery, "")
        self.arrivals.append((delivery, answer.status, list(answer.body.get("parents", []))))
        return JSONResponse(answer.body, status_code=answer.status)

    def first_arrivals(self) -> list[str]:
        """Parent ids in the order their delivery first arrived."""
        seen: dict[str, None] = {}
        for _d, _s, parents in self.arrivals:
            for p in parents:
                seen.setdefault(p, None)
        return list(seen)


@pytest.fixture
def world_on_fake_clock():
    """A sim on a fake clock (due times come from it), served over real HTTP, with the bot and alice."""
    world = World(FakeClock(1_750_000_000.0), seed=3)
    bot = world.add_account(BOT, bot=True)
    world.add_account("alice")
    with SimServer(world) as srv, httpx.Client(timeout=5.0) as http:
        plat = make_platform("mastodon", {"base_url": srv.base_url, "token": bot.token, "listing_delay_s": 0},
                             http=http, clock=world.clock)
        yield world, plat


def _receiver(plat, kind: str):
    rec = CountingReceiver(plat, kind)
    rec.server.start()
    return rec


@pytest.mark.parametrize("kind", ["github", "discourse"])
def test_signed_deliveries_verify_and_carry_the_inbox_parent(world_on_fake_clock, kind) -> None:
    """Each kind's signed delivery gets 202 from replyd's receiver and offers the inbox poll's own parent;
    signed with another secret, every delivery is a 401 and nothing is offered."""
    world, plat = world_on_fake_clock
    rec = _receiver(plat, kind)
    sender = WebhookSender(world, f"{rec.server.url}/hook", SECRET, kind=kind, account=BOT)
    forger = WebhookSender(world, f"{rec.server.url}/hook", "not-the-secret-0123456789", kind=kind, account=BOT)
    try:
        posted = [world.post("alice", f"question {i}?", mention=[BOT]).id for i in range(3)]
        assert sender.pump() == 3 and forger.pump() == 3
        rec.receiver.close(wait=True)
    finally:
        sender.close(), forger.close(), rec.server.stop()
    assert [s for _d, s, _p in rec.arrivals] == [202] * 3 + [401] * 3
    world.post("alice", "after the senders closed?", mention=[BOT])
    assert sender.pending() == 0 and forger.pending() == 0  # a closed sender hears no more mentions
    assert len({d for d, _s, _p in rec.arrivals[:3]}) == 3  # one delivery id per mention
    inbox = {p.id: p for p in plat.inbox(None).parents}
    assert sorted(p.id for p in rec.offered) == sorted(posted)  # two offer workers: any order
    assert all(p == inbox[p.id] for p in rec.offered)  # the same Parent, so the same guard key


def test_a_delivery_that_is_not_a_mention_is_refused_with_a_reason(world_on_fake_clock) -> None:
    """Another event is ignored with its name; a signed mention delivery that is no notification is a 422 naming
    the problem; neither offers anything."""
    world, plat = world_on_fake_clock
    assert plat.parse_webhook("status.created", {}) == "status.created is not answered"
    with pytest.raises(BadResponse, match="notification object of type mention"):
        plat.parse_webhook("mention", {"type": "follow"})
    rec = _receiver(plat, "github")
    sender = WebhookSender(world, f"{rec.server.url}/hook", SECRET, account=BOT)
    try:
        with httpx.Client(timeout=5.0) as http:
            for body in (b'{"type": "mention", "status": []}', b'["not", "an", "object"]'):
                answer = http.post(f"{rec.server.url}/hook", content=body, headers=sender.headers("d-1", body))
                assert answer.status_code == 422 and answer.json()["error"] == "unreadable_delivery"
        rec.receiver.close(wait=True)
    finally:
        sender.close(), rec.server.stop()
    assert rec.offered == []


def test_duplicates_drops_and_delays_are_what_the_receiver_counts(world_on_fake_clock) -> None:
    """30 mentions, each duplicated twice, 30 % dropped, sent 2 s late: nothing before 2 s, then every surviving
    delivery arrives three times under one id, and no dropped mention arrives at all."""
    world, plat = world_on_fake_clock
    rec = _receiver(plat, "github")
    faults = SenderFaults(duplicates=2, drop_rate=0.3, delay_s=2.0)
    sender = WebhookSender(world, f"{rec.server.url}/hook", SECRET, account=BOT, faults=faults, seed=5)
    try:
        posted = [world.post("alice", f"question {i}?", mention=[BOT]).id for i in range(30)]
        world.clock.advance(1.9)
        assert sender.pump() == 0 and rec.arrivals == []
        world.clock.advance(0.2)
        sender.pump()
    finally:
        sender.close(), rec.server.stop()
    per_delivery = Counter(d for d, _s, _p in rec.arrivals)
    assert 0 < len(sender.dropped) < 30
    assert len(per_delivery) == 30 - len(sender.dropped)
    assert set(per_delivery.values()) == {3}
    arrived = set(rec.first_arrivals())
    assert arrived == set(posted) - set(sender.dropped) and not arrived & set(sender.dropped)
    assert rec.first_arrivals() == [p for p in posted if p in arrived]  # no reordering asked: posting order


def test_reorder_crosses_deliveries_and_duplicate_rate_picks_some() -> None:
    """reorder_s > 0 makes mentions arrive out of posting order; duplicate_rate 0.5 duplicates about half; each
Discourse copy carries its own event id."""
    world = World(FakeClock(1_750_000_000.0), seed=3)
    bot = world.add_account(BOT, bot=True)
    world.add_account("alice")
    with SimServer(world) as srv, httpx.Client(timeout=5.0) as http:
        plat = make_platform("mastodon", {"base_url": srv.base_url, "token": bot.token}, http=http, clock=world.clock)
        rec = _receiver(plat, "discourse")
        faults = SenderFaults(duplicates=1, duplicate_rate=0.5, reorder_s=3.0)
        sender = WebhookSender(world, f"{rec.server.url}/hook", SECRET, kind="discourse", account=BOT,
                               faults=faults, seed=9)
        try:
            posted = []
            for i in range(20):
                posted.append(world.post("alice", f"question {i}?", mention=[BOT]).id)
                world.clock.advance(0.1)
            world.clock.advance(3.0)
            sender.pump()
        finally:
            sender.close(), rec.server.stop()
    order = rec.first_arrivals()
    assert sorted(order) == sorted(posted) and order != posted
    copies = Counter(Counter(p for _d, _s, parents in rec.arrivals for p in parents).values())
    assert set(copies) == {1, 2} and 4 <= copies[2] <= 16
    assert len({d for d, _s, _p in rec.arrivals}) == len(rec.arrivals)  # a Discourse retry is a new event id


def test_bad_sender_settings_are_refused_with_the_field_named() -> None:
    """A negative delay, a rate above 1 or an unknown kind is a ValueError naming it."""
    with pytest.raises(ValueError, match="delay_s"):
        SenderFaults(delay_s=-1)
    with pytest.raises(ValueError, match="drop_rate"):
        SenderFaults(drop_rate=1.5)
    world = World(FakeClock(0.0))
    world.add_account(BOT, bot=True)
    with pytest.raises(ValueError, match="slack"):
        WebhookSender(world, "http://127.0.0.1:9/hook", SECRET, kind="slack", account=BOT)


def test_admin_route_starts_reports_and_stops_a_sender() -> None:
    """POST /_sim/webhooks starts a sender (a sim in another process can push too), GET reports it, an unknown
    setting is a 400 naming it, and the secret never appears in a report."""
    world = World(SystemClock(), seed=2)
    bot = world.add_account(BOT, bot=True)
    world.add_account("alice")
    with SimServer(world) as srv, httpx.Client(base_url=srv.base_url, timeout=5.0) as http:
        plat = make_platform("mastodon", {"base_url": srv.base_url, "token": bot.token}, http=http,
                             clock=world.clock)
        rec = _receiver(plat, "github")
        try:
            bad = http.post("/_sim/webhooks", json={"url": f"{rec.server.url}/hook", "secret": SECRET,
                                                    "account": BOT, "dup": 2})
            assert bad.status_code == 400 and "dup" in bad.json()["error"]
            started = http.post("/_sim/webhooks", json={"url": f"{rec.server.url}/hook", "secret": SECRET,
                                                        "account": BOT, "duplicates": 1})
            assert started.status_code == 200 and started.json()["faults"]["duplicates"] == 1
            http.post("/_sim/posts", json={"account": "alice", "text": "help?", "mention": [BOT]})
            assert wait_until(lambda: http.get("/_sim/webhooks").json()["copies_sent"] == 2, 10)
            stopped = http.post("/_sim/webhooks", json={"stop": True}).json()
            assert stopped["stopped"] and SECRET not in str(stopped)
            assert http.get("/_sim/webhooks").json() == {"running": False}
        finally:
            rec.server.stop()
    assert [s for _d, s, _p in rec.arrivals] == [202, 202]


# -- the daemon: push with the backstop poll ------------------------------------------------------


def _config(tmp_path: Path, base_url: str, *, backstop_s: float) -> Path:
    """test_streams' daemon config with the API on and Discourse-signed webhooks instead of the stream."""
    cfg = stream_config(tmp_path, base_url, inbox_s=None)
    push = f'kind = "discourse"\nsecret_env = "SIM_HOOK_SECRET"\nbackstop_interval_s = {backstop_s}'
    cfg.write_text("[api]\nenabled = true\nport = 0\n" + cfg.read_text().replace('kind = "mastodon_stream"', push))
    return cfg


def test_daemon_answers_each_mention_once_and_the_backstop_answers_the_dropped(tmp_path, monkeypatch) -> None:
    """Every delivery three times, reordered, 30 % dropped: the sim counts one reply per mention and no duplicate;
    the dropped mentions are answered by the backstop poll, the others by their webhook."""
    world = World(SystemClock(), seed=4, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    world.add_account("alice")
    monkeypatch.setenv("SIM_TOKEN", bot.token)
    monkeypatch.setenv("SIM_HOOK_SECRET", SECRET)
    with SimServer(world) as srv:
        d = Daemon(Config.load(_config(tmp_path, srv.base_url, backstop_s=1.0)))
        d.start()
        assert d.api is not None
        faults = SenderFaults(duplicates=2, drop_rate=0.3, reorder_s=0.5)
        sender = WebhookSender(world, f"{d.api.url}/v1/hooks/sim", SECRET, kind="discourse", account=BOT,
                               faults=faults, seed=11).start()
        try:
            parents = []
            for i in range(12):
                parents.append(world.post("alice", f"question {i}?", mention=[BOT]).id)
                time.sleep(random.Random(i).uniform(0, 0.1))  # traffic spacing, not a timing assertion
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents), 30)
            assert wait_until(lambda: sender.pending() == 0, 10)
            time.sleep(1.5)  # every queued offer and one more backstop poll have run: nothing may answer again
        finally:
            sender.close()
            d.stop(grace_s=3)
    assert world.report()["duplicates"] == 0
    assert [world.replies_by(bot.id).get(p, 0) for p in parents] == [1] * len(parents)
    report = sender.report()
    assert report["by_status"] == {"202": report["copies_sent"]} and report["copies_sent"] == 3 * report["mentions_delivered"]
    assert sender.dropped, "seed 11 drops some deliveries"
    s = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    try:
        paths = {r.parent_id: r.path for r in s.rows_in(f"mastodon:{srv.base_url}", bot.id, [st.CLOSED], limit=1000)}
    finally:
        s.dispose()
    assert {paths[p] for p in sender.dropped} == {"inbox"}
    assert "webhook" in {paths[p] for p in parents if p not in sender.dropped}


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_on_postgres_behind_a_balancer_answer_each_mention_once(tmp_path, pg_url, monkeypatch) -> None:
    """Two `replyd run` processes on one PostgreSQL; the sim sends every delivery three times, reordered, 20 %
    dropped, each copy to a random replica: one reply per mention (counted by the sim), one responder call each."""
    import sqlalchemy as sa

    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, replicas, bot_leases")
    eng.dispose()
    world = World(SystemClock(), seed=6, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    world.add_account("alice")
    calls, script = tmp_path / "calls.txt", tmp_path / "responder.py"
    script.write_text(COUNTING_RESPONDER)
    calls.touch()
    procs, ports = [], []
    with SimServer(world) as srv:
        for rid in ("a", "b"):
            ports.append(_free_port())
            (tmp_path / rid).mkdir()
            cfg = _config(tmp_path / rid, srv.base_url, backstop_s=1.0)
            text = cfg.read_text().replace("port = 0", f"port = {ports[-1]}").replace(
                f'url = "sqlite:///{tmp_path / rid / "r.sqlite3"}"', f'url = "{pg_url}"').replace(
                'kind = "template"', f'kind = "command"\ncommand = ["{sys.executable}", "{script}", "{calls}"]')
            assert pg_url in text and "command" in text
            cfg.write_text(text)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "REPLYD_REPLICA_ID": rid, "SIM_TOKEN": bot.token,
                   "SIM_HOOK_SECRET": SECRET}
            procs.append(subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s",
                                           "5"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=(tmp_path / f"{rid}.log").open("wb")))
        faults = SenderFaults(duplicates=2, drop_rate=0.2, reorder_s=0.5)
        sender = WebhookSender(world, [f"http://127.0.0.1:{p}/v1/hooks/sim" for p in ports], SECRET,
                               kind="discourse", account=BOT, faults=faults, seed=13)
        try:
            with httpx.Client(timeout=5.0) as http:
                # Ready, not only up: a delivery to a bot still starting is answered 503 (deliver again).
                assert wait_until(lambda: all(_ready(http, p) for p in ports), 30), (tmp_path / "a.log").read_text()[-2000:]
            sender.start()
            parents = [world.post("alice", f"question {i}?", mention=[BOT]).id for i in range(12)]
            assert wait_until(lambda: all(world.replies_by(bot.id).get(p) for p in parents), 40)
            assert wait_until(lambda: sender.pending() == 0, 10)
            time.sleep(2.0)  # queued offers and one more backstop poll on each replica have run
        finally:
            sender.close()
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(20)
    assert world.report()["duplicates"] == 0
    assert [world.replies_by(bot.id).get(p, 0) for p in parents] == [1] * len(parents)
    assert {s.url for s in sender.log} == {f"http://127.0.0.1:{p}/v1/hooks/sim" for p in ports}  # both got copies
    assert {s.http_status for s in sender.log} == {202} and sender.dropped
    made = Counter(calls.read_text().split())
    assert sorted(made) == sorted(parents) and set(made.values()) == {1}, made
