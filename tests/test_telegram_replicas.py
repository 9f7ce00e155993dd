"""Telegram end to end: two `replyd run` replicas on PostgreSQL against the Bot API fake, every fault at once.

Phase 1, webhooks: every update is POSTed to a random replica with the secret token, and 30 % of the 2xx
acks are treated as lost, so deliveries repeat (to either replica); 20 % of ``sendMessage`` answers are lost
after the message is created (all through both phases). Phase 2, ``getUpdates``: the webhook is deleted, the
replicas restart polling in small batches; one send is held open and its replica SIGKILLed and restarted;
right after the next batch is served both are SIGKILLed, the cursors table is emptied (the offset lost) and they start again, so the
unconfirmed batch is served again. Counted on the fake: no parent has two replies; every parent is
answered or ``unconfirmed`` (and ``replyd status`` reports them); the unconfirmed rows are exactly the
sends whose answer was lost after landing, plus only sends in flight at a SIGKILL (each listed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.slack_scenario import Replica, _up, _wait, free_port
from tests.slack_scenario import replica_head
from tests.slack_scenario import row_states as _rows
from tests.slack_scenario import cut_before_send, events_of, transport_ambiguous
from tests.telegram_fake import TOKEN, TelegramApi, TelegramWorld, WebhookSender

ROOT = Path(__file__).resolve().parents[1]
SECRET = "tg-webhook-secret_0123456789abcdef"
GROUPS = (-1001000000001, -1001000000002)
DMS = (5000000001, 5000000003)


def _config(path: Path, *, api_url: str, store_url: str, port: int, mode: str) -> Path:
    push = '[bots.push]\nkind = "telegram"\nsecret_env = "TG_SECRET"\n' if mode == "webhook" else ""
    path.write_text(replica_head(store_url, port, "tg", "telegram") + f"""
[bots.settings]
api_url = "{api_url}"
token_env = "TG_TOKEN"
mode = "{mode}"
long_poll_s = 1
updates_limit = 3
timeout_s = 3.0

[bots.pollers]
inbox_interval_s = 0.2
search_interval_s = 0
refind_interval_s = 0
jitter_s = 0.0

{push}
[bots.responder]
kind = "template"
template = "noted"
""")
    os.chmod(path, 0o600)
    return path


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_webhook_redeliveries_lost_offset_lost_answers_sigkill(pg_url, tmp_path) -> None:
    """0 duplicates on the fake; every parent answered or unconfirmed and reported; unconfirmed = lost landings."""
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    eng.dispose()
    world = TelegramWorld(seed=33)
    for g in GROUPS:
        world.chat(g, type="supergroup")
    for d in DMS:
        world.chat(d, type="private", title="someone")
    api = TelegramApi(world).start()
    ports = {"a": free_port(), "b": free_port()}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TG_TOKEN": TOKEN, "TG_SECRET": SECRET}
    kills: list[tuple[str, float]] = []  # (what, monotonic time)

    def replicas(mode: str) -> dict[str, Replica]:
        out = {}
        ports.update({"a": free_port(), "b": free_port()})  # fresh each phase: another test may hold the old ones
        for rid in ("a", "b"):
            (tmp_path / mode / rid).mkdir(parents=True, exist_ok=True)
            cfg = _config(tmp_path / mode / rid / "replyd.toml", api_url=f"{api.url}/{rid}", store_url=pg_url,
                          port=ports[rid], mode=mode)
            argv = [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "3"]
            out[rid] = Replica(rid, argv, {**env, "REPLYD_REPLICA_ID": f"{mode}-{rid}"},
                               tmp_path / f"{rid}.log").start()
        for rid in out:
            _wait(lambda rid=rid: _up(f"http://127.0.0.1:{ports[rid]}/healthz"), 120, f"replica {rid} did not start")
        return out

    def post(i: int) -> str:
        if i % 3 == 2:
            return world.post(DMS[i % 2], f"private question {i}", user_id=DMS[i % 2], mention=False)
        return world.post(GROUPS[i % 2], f"question {i}")

    def settled() -> set[str]:
        return {p for p, s in _rows(pg_url).items() if s in ("closed", "unconfirmed")}

    parents: list[str] = []
    sender = None
    reps: dict[str, Replica] = {}
    try:
        # -- phase 1: webhooks, redelivered (acks lost), 20 % of sendMessage answers lost ------------------
        world.webhook = {"url": "", "secret_token": SECRET}  # setWebhook, as the operator does once
        world.lose_fraction = 0.2
        reps = replicas("webhook")
        hooks = [f"http://127.0.0.1:{ports[r]}/v1/hooks/tg" for r in ("a", "b")]
        sender = WebhookSender(world, hooks, lose_acks=0.3, retry_s=0.1).start()
        for i in range(16):
            parents.append(post(i))
            time.sleep(0.1)
        _wait(lambda: not world.pending_updates(), 90, "webhook deliveries did not finish")
        _wait(lambda: settled() >= set(parents), 60, "phase 1: not every parent answered or unconfirmed")
        sender.stop()
        for r in reps.values():
            r.stop()
        # -- phase 2: getUpdates, a SIGKILL mid-send, then a restart that lost the offset -----------------
        world.webhook = None  # deleteWebhook
        world.send_faults = ["", "hold"]
        for i in range(16, 30):
            parents.append(post(i))
        reps = replicas("polling")

        assert world.held.wait(60), "no send was held"
        held = world.held_tag
        reps[held].kill()  # mid-send: the message is created, its answer never comes
        kills.append((f"{held} mid-send", time.monotonic()))
        world.release_held.set()
        start = world.batches
        for i in range(30, 36):  # new updates: the next batch served is one whose offset is about to be lost
            parents.append(post(i))
        _wait(lambda: world.batches > start, 60, "no getUpdates batch served after the mid-send kill")
        for r in reps.values():  # right after a batch was served: its offset was never sent back
            if r.proc is not None and r.proc.poll() is None:
                r.kill()
        kills.append(("both after a served batch", time.monotonic()))
        eng = sa.create_engine(pg_url)
        with eng.begin() as c:
            c.exec_driver_sql("DELETE FROM cursors")  # the offset is lost
        eng.dispose()
        for r in reps.values():
            r.start()
        _wait(lambda: settled() >= set(parents), 180, "phase 2: not every parent answered or unconfirmed")
        time.sleep(2.0)  # a late duplicate, if any, lands now
    finally:
        world.release_held.set()
        if sender is not None:
            sender.stop()
        for r in reps.values():
            r.stop()
        api.stop()
    logs = "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in ("a", "b"))
    counts = world.reply_counts()
    rows = _rows(pg_url)
    dups = {p: counts[p] for p in parents if counts[p] > 1}
    assert not dups, (dups, logs)
    assert all(rows.get(p) in ("closed", "unconfirmed") for p in parents), logs
    unconfirmed = {p for p in parents if rows[p] == "unconfirmed"}
    lost = set(world.lost_parents)
    assert lost <= unconfirmed, (lost - unconfirmed, logs)
    # Beyond the lost landings, only a send the SIGKILL cut between the fake's answer and the close, or between
    # the open commit and the request (the fake never saw it: a no-read-back platform cannot tell), or one the
    # transport made ambiguous on a loaded machine (a timeout, a kept-alive connection closed under the request).
    in_flight = {p for at, p in world.send_times if any(0 <= k - at <= 2.0 for _, k in kills)}
    never_sent = cut_before_send(pg_url, {"polling-a", "polling-b"}) - {p for _, p in world.send_times}
    unexplained = unconfirmed - lost - in_flight - never_sent - transport_ambiguous(pg_url)
    if unexplained:  # printed first: the assertion's message is cut
        print("unexplained unconfirmed rows:", events_of(pg_url, unexplained))
    assert not unexplained, (unexplained, in_flight, logs)
    assert all(counts[p] == 1 for p in parents if rows[p] == "closed")
    assert any(n > 1 for n in world.served.values()), "the lost offset re-served no update"
    assert sum(sender.deliveries.values()) > 16 and kills[0][0].endswith("mid-send"), (sender.deliveries, kills)
    cfg = tmp_path / "polling" / "a" / "replyd.toml"
    out = subprocess.run([sys.executable, "-m", "replyd", "status", "--json", "--config", str(cfg)], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    shown = sum(c["rows"] for c in json.loads(out.stdout)["counts"] if c["state"] == "unconfirmed")
    assert shown == len(unconfirmed) and lost, (shown, unconfirmed, out.stderr)
    print(f"parents {len(parents)}, deliveries {sum(sender.deliveries.values())}, sendMessage {world.send_requests}, "
          f"lost landings {len(lost)}, unconfirmed {len(unconfirmed)} (in flight at a kill "
          f"{len(unconfirmed - lost)}), duplicates 0, re-served updates {sum(n > 1 for n in world.served.values())}")


# Replica A as `replyd run`, but its hook workers never offer: what a SIGKILL between the ack and the claim leaves.
_NEVER_OFFERS = """
import runpy, sys, threading
from replyd import hooks
hooks.Receiver._offer = staticmethod(lambda hook, parent, delivery: threading.Event().wait())
sys.argv = ["replyd", *sys.argv[1:]]
runpy.run_module("replyd", run_name="__main__")
"""


@pytest.mark.postgres
def test_a_delivery_acked_by_a_replica_killed_before_its_claim_is_answered_by_the_other(pg_url, tmp_path) -> None:
    """A acks a webhook delivery (2xx: Telegram never sends it again) and is SIGKILLed before it claims; B's
    re-find re-offers the row A kept before its ack: one reply on the fake."""
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    eng.dispose()
    world = TelegramWorld(seed=34)
    world.chat(GROUPS[0], type="supergroup")
    api = TelegramApi(world).start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TG_TOKEN": TOKEN, "TG_SECRET": SECRET}
    reps: dict[str, Replica] = {}
    sender = None
    try:
        for rid, head in (("a", [sys.executable, "-c", _NEVER_OFFERS]), ("b", [sys.executable, "-m", "replyd"])):
            port = free_port()
            (tmp_path / rid).mkdir()
            cfg = _config(tmp_path / rid / "replyd.toml", api_url=f"{api.url}/{rid}", store_url=pg_url, port=port,
                          mode="webhook")
            reps[rid] = Replica(rid, [*head, "run", "--config", str(cfg), "--grace-s", "3"],
                                {**env, "REPLYD_REPLICA_ID": f"ack-{rid}"}, tmp_path / f"{rid}.log")
            reps[rid].port = port  # type: ignore[attr-defined]
        a = reps["a"].start()
        _wait(lambda: _up(f"http://127.0.0.1:{a.port}/healthz"), 60, "replica a did not start")
        world.webhook = {"url": "", "secret_token": SECRET}
        pid = world.post(GROUPS[0], "question for the bot")
        sender = WebhookSender(world, [f"http://127.0.0.1:{a.port}/v1/hooks/tg"], retry_s=0.1).start()
        _wait(lambda: not world.pending_updates(), 20, "replica a did not ack the delivery")
        sender.stop()
        # One ack. Before A's bot has started, its hook answers 503 (Retry-After: Telegram delivers again), which
        # a loaded machine may show once before the ack; anything else would be a second acked delivery.
        assert sender.statuses[202] == 1 and set(sender.statuses) <= {202, 503}, sender.statuses
        a.kill()  # acked, never claimed: Telegram will not deliver it again, getUpdates is refused (webhook set)
        assert world.reply_counts()[pid] == 0
        reps["b"].start()
        _wait(lambda: world.reply_counts()[pid] >= 1, 30, "the acked parent was never answered")
        time.sleep(1.0)  # a second reply, if any, lands now
    finally:
        if sender is not None:
            sender.stop()
        for r in reps.values():
            r.stop()
        api.stop()
    rows = _rows(pg_url)
    assert world.reply_counts()[pid] == 1 and rows == {pid: "closed"}, rows
    eng = sa.create_engine(pg_url)
    with eng.connect() as c:
        events = [(k, o) for k, o in c.exec_driver_sql("SELECT kind, owner FROM events ORDER BY id").all()]
    eng.dispose()
    assert events[:2] == [("received", "ack-a"), ("claimed", "ack-b")], events  # kept by A, claimed by B


@pytest.mark.slow
@pytest.mark.postgres
def test_two_polling_replicas_share_getupdates_without_a_conflict(pg_url, tmp_path) -> None:
    """The fleet on: one replica runs getUpdates at a time, across a handover to a newcomer and back on its
    graceful stop. Counted on the fake: 0 conflicts (409), 0 duplicates, the lost answer ``unconfirmed``."""
    from replyd.fleet import target

    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    world = TelegramWorld(seed=35)
    world.chat(GROUPS[0], type="supergroup")
    world.send_faults = ["", "", "lost"]  # the third answer is lost after its message was created
    api = TelegramApi(world).start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TG_TOKEN": TOKEN}
    # Ids whose rendezvous target is the newcomer: its start is a handover, not a no-op.
    n = next(i for i in range(100) if target("tg", [f"fleet{i}-a", f"fleet{i}-b"]) == f"fleet{i}-b")
    reps: dict[str, Replica] = {}
    ports: dict[str, int] = {}
    for rid in ("a", "b"):
        ports[rid] = free_port()
        (tmp_path / rid).mkdir()
        cfg = _config(tmp_path / rid / "replyd.toml", api_url=f"{api.url}/{rid}", store_url=pg_url,
                      port=ports[rid], mode="polling")
        # A long poll of 4 s: the handover comes while the last holder's getUpdates waits, as in production.
        text = cfg.read_text().replace("long_poll_s = 1\n", "long_poll_s = 4\n")
        cfg.write_text(text + "\n[fleet]\nenabled = true\nheartbeat_s = 0.5\nbot_lease_s = 2.0\n")
        reps[rid] = Replica(rid, [sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "3"],
                            {**env, "REPLYD_REPLICA_ID": f"fleet{n}-{rid}"}, tmp_path / f"{rid}.log")

    def holder() -> str | None:
        with eng.connect() as c:
            return c.exec_driver_sql("SELECT holder FROM bot_leases WHERE bot = 'tg'").scalar()

    def settled() -> set[str]:
        return {p for p, s in _rows(pg_url).items() if s in ("closed", "unconfirmed")}

    parents: list[str] = []
    try:
        reps["a"].start()
        _wait(lambda: _up(f"http://127.0.0.1:{ports['a']}/healthz"), 60, "replica a did not start")
        for i in range(5):
            parents.append(world.post(GROUPS[0], f"question {i}"))
        _wait(lambda: settled() >= set(parents), 60, "a alone: not every parent answered or unconfirmed")
        reps["b"].start()  # its target: a hands the bot over once its long poll (on an empty queue) is over
        _wait(lambda: holder() == f"fleet{n}-b", 60, "b never took the bot")
        for i in range(5, 15):
            parents.append(world.post(GROUPS[0], f"question {i}"))
            time.sleep(0.3)
        _wait(lambda: settled() >= set(parents), 60, "handover: not every parent answered or unconfirmed")
        reps["b"].stop()  # graceful: a takes the bot back at once
        for i in range(15, 20):
            parents.append(world.post(GROUPS[0], f"question {i}"))
        _wait(lambda: settled() >= set(parents), 60, "back on a: not every parent answered or unconfirmed")
        time.sleep(2.0)  # a late duplicate or conflict, if any, shows now
    finally:
        for r in reps.values():
            r.stop()
        api.stop()
    logs = "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in ("a", "b"))
    eng.dispose()
    counts, rows = world.reply_counts(), _rows(pg_url)
    assert world.conflicts == 0, (world.conflicts, logs)
    assert not {p: counts[p] for p in parents if counts[p] > 1}, logs
    unconfirmed = {p for p in parents if rows[p] == "unconfirmed"}
    assert set(world.lost_parents) == unconfirmed and len(unconfirmed) == 1, (world.lost_parents, unconfirmed)
    assert all(counts[p] == 1 for p in parents if rows[p] == "closed")
    print(f"parents {len(parents)}, getUpdates conflicts {world.conflicts}, unconfirmed {len(unconfirmed)}, "
          f"duplicates 0")
