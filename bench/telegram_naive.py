"""Telegram, naive gateway against replyd, side by side on the Bot API fake.

The naive gateway does what the frameworks do (python-telegram-bot's ``Updater``, aiogram's polling):
the ``getUpdates`` offset lives in memory (confirmed by the next poll), and a ``sendMessage`` that fails
is retried once. replyd: the inbox poller (offset saved after the offer), the guard on SQLite and the
sweep (no read-back: an ambiguous send ends ``unconfirmed``). Both meet the same faults: 20 % of
``sendMessage`` answers lost after the message is created, and a restart right after a batch is served
(the naive one loses its offset with its memory; replyd's is in the store). Counted on the fake.

    .venv/bin/python -m bench.telegram_naive --parents 60 --seed 1

Section ``telegram`` of ``bench/run.py`` (``measure``/``tables``, over several seeds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from typing import Any

import httpx

from bench.common import Table, verdict
from replyd import store as st
from replyd.clock import SystemClock
from replyd.config import PollerConfig
from replyd.guard import Guard
from replyd.pipeline import Pipeline
from replyd.platforms.telegram import TelegramPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.sweep import Bot, Sweeper
from tests.telegram_fake import TOKEN, TelegramApi, TelegramWorld

GROUP = -1001000000009


class NaiveGateway:
    """Offset in memory, confirmed by the next poll; a failed sendMessage retried once."""

    def __init__(self, url: str) -> None:
        """A gateway with no offset yet (a fresh process) on the fake at ``url``."""
        self.url, self.offset, self.http = f"{url}/bot{TOKEN}", None, httpx.Client(timeout=3.0)

    def poll_once(self) -> list[dict]:
        """One getUpdates with the in-memory offset; the offset moves past the batch at once."""
        body = {"timeout": 0, "limit": 5, **({"offset": self.offset} if self.offset is not None else {})}
        updates = self.http.post(f"{self.url}/getUpdates", json=body).json()["result"]
        if updates:
            self.offset = updates[-1]["update_id"] + 1
        return updates

    def answer(self, update: dict) -> None:
        """sendMessage as a reply; on any failure, once more."""
        msg = update["message"]
        body = {"chat_id": msg["chat"]["id"], "text": "noted", "reply_parameters": {"message_id": msg["message_id"]}}
        for _ in range(2):
            try:
                if self.http.post(f"{self.url}/sendMessage", json=body).status_code == 200:
                    return
            except httpx.HTTPError:
                pass


def _world(parents: int, seed: int) -> tuple[TelegramWorld, list[str]]:
    """A fake with ``parents`` questions in one group and 20 % of sendMessage answers lost."""
    world = TelegramWorld(seed=seed)
    world.chat(GROUP, type="supergroup")
    ids = [world.post(GROUP, f"question {i}") for i in range(parents)]
    world.lose_fraction = 0.2
    return world, ids


def naive(parents: int, seed: int) -> dict:
    """The naive gateway: poll, answer, restart (memory lost) after answering the second batch, go on to the end."""
    world, ids = _world(parents, seed)
    api = TelegramApi(world).start()
    try:
        gw, batches = NaiveGateway(api.url), 0
        while True:
            batch = gw.poll_once()
            if not batch:
                break
            batches += 1
            for u in batch:
                gw.answer(u)
            if batches == 2:
                gw = NaiveGateway(api.url)  # a restart before the next poll confirmed the batch: the offset is gone
    finally:
        api.stop()
    return _count("naive", world, ids, unconfirmed=0)


def replyd(parents: int, seed: int) -> dict:
    """replyd on SQLite with the same faults and the same restart."""
    world, ids = _world(parents, seed)
    api = TelegramApi(world).start()
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-"))
    store = st.Store.open(f"sqlite:///{tmp / 'r.sqlite3'}")
    clock = SystemClock()

    def start() -> tuple[Pollers, Sweeper]:
        """A fresh process's poller and sweeper on the same store: what a restart gives."""
        plat = TelegramPlatform.from_settings({"token": TOKEN, "api_url": api.url, "long_poll_s": 0,
                                               "updates_limit": 5}, http=httpx.Client(timeout=3.0), clock=clock)
        guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=3.0)
        pipe = Pipeline(guard, lambda parent: "noted", Policy(), clock)
        return (Pollers(store, plat, pipe, PollerConfig(), clock),
                Sweeper(store, [Bot(plat, plat.whoami(), name="bench")], clock=clock))

    try:
        polls, sweeper = start()
        for n in range(4 * parents):
            before = world.batches
            if n == 2:
                polls, sweeper = start()  # a restart: replyd's offset is in the store
            polls.inbox()
            if world.batches == before and not world.pending_updates():
                break
        store.clock = clock
        import time

        time.sleep(3.5)  # past the send deadline: the sweep judges what is still open
        sweeper.run_once()
        unconfirmed = len(store.rows_in("telegram", polls.sender_id, [st.UNCONFIRMED], limit=10_000))
    finally:
        store.dispose()
        api.stop()
    return _count("replyd", world, ids, unconfirmed=unconfirmed)


def _count(kind: str, world: TelegramWorld, ids: list[str], *, unconfirmed: int) -> dict:
    """What the fake counted for one run."""
    counts = world.reply_counts()
    return {"kind": kind, "parents": len(ids), "duplicates": sum(max(0, counts[p] - 1) for p in ids),
            "unanswered": sum(1 for p in ids if counts[p] == 0), "lost_landings": len(world.lost_parents),
            "unconfirmed_reported": unconfirmed, "send_requests": world.send_requests}


FIELDS = ("parents", "duplicates", "unanswered", "lost_landings", "unconfirmed_reported", "send_requests")


def measure(parents: int = 60, seeds: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """Both gateways on each seed; the fake's counts summed per gateway."""
    out: dict[str, dict[str, int]] = {}
    for seed in seeds:
        for fn in (naive, replyd):
            got = fn(parents, seed)
            tot = out.setdefault(got["kind"], dict.fromkeys(FIELDS, 0))
            for f in FIELDS:
                tot[f] += got[f]
    return {"parents": parents, "seeds": list(seeds), "variants": out}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """Section 14: duplicates, unanswered parents and reported lost landings, counted on the fake."""
    seeds = len(res["seeds"])
    t = Table(f"14. Telegram: a naive gateway and replyd side by side, {res['parents']} parents × {seeds} "
              f"seed{'s' if seeds != 1 else ''}",
              ["gateway", "parents", "duplicates", "unanswered", "lost landings", "reported as unconfirmed",
               "sendMessage requests"])
    for name, v in res["variants"].items():
        t.rows.append([name, str(v["parents"]), str(v["duplicates"]), str(v["unanswered"]), str(v["lost_landings"]),
                       str(v["unconfirmed_reported"]) + (" (never told)" if name == "naive" else ""),
                       str(v["send_requests"])])
    mine = res["variants"]["replyd"]
    t.verdicts.append(verdict(mine["duplicates"] == 0 and mine["unconfirmed_reported"] == mine["lost_landings"],
                              f"replyd: {mine['duplicates']} duplicates (goal 0), {mine['unconfirmed_reported']} of "
                              f"{mine['lost_landings']} lost landings reported as unconfirmed (goal all)"))
    t.notes.append(
        "Both run against the Bot API fake (`tests/telegram_fake.py`) with the same faults: 20 % of `sendMessage` "
        "answers lost after the message is created, and a restart after the second `getUpdates` batch was answered, "
        "before the next poll confirmed it. The naive gateway is what the frameworks do (python-telegram-bot's "
        "`Updater`, aiogram's polling): the offset in memory, a failed `sendMessage` retried once. replyd: the inbox "
        "poller (its offset saved in the store after the offer), the guard on SQLite, one sweep past the send "
        "deadline; Telegram has no read-back, so a send whose answer was lost ends `unconfirmed`. Counted on the fake; "
        "lost landings are the sends the fake created and whose answer it dropped.")
    t.notes.append(
        "Reading: the naive duplicates come from the retried lost answers and from the batch the restart served "
        "again; replyd sends each parent once and reports every send whose answer was lost. "
        "Alone: `.venv/bin/python -m bench.telegram_naive --parents N --seed S` (one seed, JSON lines).")
    return [t]


def main() -> None:
    """Run both and print one JSON line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parents", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    for fn in (naive, replyd):
        print(json.dumps(fn(a.parents, a.seed)))


if __name__ == "__main__":
    main()
