"""The demo's push scenario: the sim sends webhooks as platforms do (redelivered, late, reordered, some never),
to a naive webhook bot and to replyd; the sim counts duplicates, lost answers and the time to answer.

A naive webhook bot is what the frameworks give: a handler that answers each delivery it is handed, or one
that first checks a seen-set of delivery ids. The delivery id does not name the mention: Discourse's retry of
a failed delivery is a new ``web_hook_event`` with a new ``X-Discourse-Event-Id`` (GitHub's redelivery keeps
its GUID), and a dropped delivery never arrives at all. replyd takes the same deliveries through its receiver
(the guard's key is the mention, whichever path found it) with the inbox poll as the backstop.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from replyd.api import ApiServer
from replyd.clock import SystemClock
from replyd.sim import SimServer, World
from replyd.sim.webhooks import SenderFaults, WebhookSender

BOT = "replybot"
# Every delivery twice (a retry or a redelivery), one in five never sent, copies up to 0.3 s apart.
FAULTS = SenderFaults(duplicates=1, drop_rate=0.2, reorder_s=0.3)
BACKSTOP_S = 2.0  # replyd's inbox poll behind the webhooks (300 s by default; short so the demo stays short)
POLL_ONLY_S = 3.0  # the poll-only row's inbox interval (30 s by default)


@dataclass(frozen=True)
class PushRow:
    """One bot in the push scenario: how it is run and what its row is called."""

    name: str
    bot: str  # "naive", "naive-seen", "replyd" or "replyd-poll"
    kind: str = "discourse"


ROWS = [
    PushRow("naive: answers each delivery", "naive"),
    PushRow("naive: seen-set of X-Discourse-Event-Id", "naive-seen"),
    PushRow("naive: seen-set of X-GitHub-Delivery", "naive-seen", kind="github"),
    PushRow("replyd: webhooks + backstop poll", "replyd"),
    PushRow(f"replyd: poll only, inbox every {POLL_ONLY_S:g} s", "replyd-poll"),
]


class NaiveHookBot:
    """A framework-style webhook handler: verify the signature, answer the mention, optionally skip seen ids."""

    def __init__(self, sim_url: str, token: str, secret: str, kind: str, *, seen_set: bool) -> None:
        self.http = httpx.Client(base_url=sim_url, headers={"Authorization": f"Bearer {token}"}, timeout=5.0)
        self.secret = secret.encode()
        self.sig_header, self.id_header = (("x-hub-signature-256", "x-github-delivery") if kind == "github"
                                           else ("x-discourse-event-signature", "x-discourse-event-id"))
        self.seen: set[str] | None = set() if seen_set else None
        self.lock = threading.Lock()

        async def hook(request: Request) -> JSONResponse:
            body = await request.body()
            good = "sha256=" + hmac.new(self.secret, body, hashlib.sha256).hexdigest()
            if not hmac.compare_digest(good, request.headers.get(self.sig_header, "")):
                return JSONResponse({"error": "bad signature"}, status_code=401)
            self.handle(request.headers.get(self.id_header, ""), json.loads(body))
            return JSONResponse({"ok": True})

        self.server = ApiServer(Starlette(routes=[Route("/hook", hook, methods=["POST"])])).start()
        self.url = f"{self.server.url}/hook"

    def handle(self, delivery_id: str, notification: dict[str, Any]) -> None:
        """Answer the delivery's mention unless its delivery id was seen (with a seen-set)."""
        with self.lock:
            if self.seen is not None:
                if delivery_id in self.seen:
                    return
                self.seen.add(delivery_id)
        status_id = notification["status"]["id"]
        self.http.post("/api/v1/statuses", data={"status": f"answer to {status_id}", "in_reply_to_id": status_id})

    def close(self) -> None:
        """Stop serving and release the client."""
        self.server.stop()
        self.http.close()


@contextmanager
def _replyd(sim_url: str, token: str, secret: str, tmp: Path, *, push: bool) -> Iterator[str]:
    """A real replyd daemon (API, receiver, pollers, sweep) on SQLite against the sim; yields its hook URL."""
    from replyd.config import Config
    from replyd.daemon import Daemon

    push_toml = (f'[bots.push]\nkind = "discourse"\nsecret_env = "REPLYD_DEMO_HOOK_SECRET"\n'
                 f"backstop_interval_s = {BACKSTOP_S}\n") if push else ""
    cfg = tmp / f"push-{'hooks' if push else 'poll'}.toml"
    cfg.write_text(f"""[store]
url = "sqlite:///{tmp / f'push-{push}.sqlite3'}"
[api]
enabled = true
port = 0
[sweep]
interval_s = 0.5
[[bots]]
name = "demo"
platform = "mastodon"
[bots.settings]
base_url = "{sim_url}"
token_env = "REPLYD_DEMO_TOKEN"
listing_delay_s = 0.5
[bots.pollers]
{'' if push else f'inbox_interval_s = {POLL_ONLY_S}'}
refind_interval_s = 0
[bots.responder]
kind = "template"
{push_toml}""")
    os.chmod(cfg, 0o600)
    saved = {k: os.environ.get(k) for k in ("REPLYD_DEMO_TOKEN", "REPLYD_DEMO_HOOK_SECRET")}
    os.environ.update(REPLYD_DEMO_TOKEN=token, REPLYD_DEMO_HOOK_SECRET=secret)
    d = Daemon(Config.load(cfg))
    try:
        d.start()
        assert d.api is not None
        yield f"{d.api.url}/v1/hooks/demo"
    finally:
        d.stop(grace_s=2)
        for k, v in saved.items():  # the demo's process environment as it was
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _times(world: World, bot_id: str, parents: list[str]) -> list[float]:
    """Seconds from each answered parent's creation to the bot's first reply to it, by the sim's clock."""
    with world.lock:
        first: dict[str, float] = {}
        for s in world.statuses.values():
            if s.account_id == bot_id and s.in_reply_to_id in parents and s.deleted_at is None:
                first[s.in_reply_to_id] = min(first.get(s.in_reply_to_id, s.created_at), s.created_at)
        return [first[p] - world.statuses[p].created_at for p in parents if p in first]


def run_row(world: World, sim_url: str, row: PushRow, n: int, tmp: Path, timeout_s: float = 15.0) -> dict[str, Any]:
    """Post ``n`` mentions while the sim pushes them to ``row``'s bot; count replies and times on the sim."""
    world.reset(keep_accounts=True)
    world.configure(listing_delay_s=0.3)
    bot = world.account(BOT)
    users = [world.find_account(u) or world.add_account(u) for u in ("user1", "user2", "user3")]
    secret = secrets.token_hex(16)
    bot_cm = (_replyd(sim_url, bot.token, secret, tmp, push=row.bot == "replyd") if row.bot.startswith("replyd")
              else _naive(sim_url, bot.token, secret, row))
    sender: WebhookSender | None = None
    parents: list[str] = []
    with bot_cm as url:
        if row.bot != "replyd-poll":
            sender = WebhookSender(world, url, secret, kind=row.kind, account=BOT, faults=FAULTS, seed=7).start()
        try:
            for i in range(n):
                parents.append(world.post(users[i % 3], f"question {i}?", mention=[BOT]).id)
                time.sleep(0.1)  # a trickle of mentions, as they arrive on a real platform
            # A naive bot is done when the last copy was handed to it; replyd when every mention is answered.
            done = ((lambda: sender is not None and sender.pending() == 0) if not row.bot.startswith("replyd")
                    else (lambda: all(world.replies_by(bot.id).get(p) for p in parents)))
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and not done():
                time.sleep(0.1)
            time.sleep(0.5)  # let late answers land before counting
        finally:
            if sender is not None:
                sender.close()
    per = world.replies_by(bot.id)
    times = sorted(_times(world, bot.id, parents))
    return {
        "name": row.name, "parents": n,
        "duplicates": sum(max(0, per.get(p, 0) - 1) for p in parents),
        "lost": sum(1 for p in parents if not per.get(p)),
        "deliveries_dropped": len(sender.dropped) if sender else 0,
        "copies_sent": len(sender.log) if sender else 0,
        "answer_p50_s": round(median(times), 2) if times else None,
        "answer_max_s": round(times[-1], 2) if times else None,
    }


@contextmanager
def _naive(sim_url: str, token: str, secret: str, row: PushRow) -> Iterator[str]:
    """A naive webhook bot for ``row``, serving; yields its hook URL."""
    bot = NaiveHookBot(sim_url, token, secret, row.kind, seen_set=row.bot == "naive-seen")
    try:
        yield bot.url
    finally:
        bot.close()


def run_push(n: int, done: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run every push row on a sim of its own over real HTTP; return the JSON-ready rows."""
    rows = []
    world = World(SystemClock(), seed=7)
    world.add_account(BOT, bot=True)
    with SimServer(world) as srv, tempfile.TemporaryDirectory(prefix="replyd-demo-push-") as tmpd:
        sim_url = srv.base_url
        for row in ROWS:
            rows.append(run_row(world, sim_url, row, n, Path(tmpd)))
            if done:
                done(rows[-1])
    return rows


def table(rows: list[dict[str, Any]]) -> Any:
    """The push rows as a rich table (duplicates and lost answers counted, times measured, by the sim)."""
    from rich.table import Table

    t = Table(title="push: webhooks sent twice, 1 in 5 dropped, reordered (times from post to reply, by the sim)")
    for col in ("bot", "dup", "lost", "answer p50", "answer max"):
        t.add_column(col, justify="left" if col == "bot" else "right", no_wrap=col == "bot")
    for r in rows:
        good = r["name"].startswith("replyd")
        t.add_row(r["name"], _mark(r["duplicates"], good), _mark(r["lost"], good),
                  f"{r['answer_p50_s']} s", f"{r['answer_max_s']} s")
    return t


def _mark(v: int, replyd: bool) -> str:
    """A replyd figure in green when 0, red otherwise; a naive bot's plain."""
    return str(v) if not replyd else (f"[green]{v}[/]" if v == 0 else f"[red]{v}[/]")


def failed(rows: list[dict[str, Any]]) -> list[str]:
    """The replyd rows that duplicated or lost an answer (the demo's exit code)."""
    return [r["name"] for r in rows if r["name"].startswith("replyd") and (r["duplicates"] or r["lost"])]


def show(console: Any, n: int) -> list[dict[str, Any]]:
    """Run the push rows with progress on ``console`` (a spinner, or a line per row when piped); print the table."""
    console.print(f"\n[bold]push[/]: {n} mentions; the sim sends each as a Discourse (or GitHub) webhook, "
                  "as those platforms do: retried, reordered, sometimes never.")
    if console.is_terminal:
        with console.status("running: push") as line:
            rows = run_push(n, done=lambda r: line.update(f"running: push, {r['name']} done"))
    else:
        rows = run_push(n, done=lambda r: print(f"[push] {r['name']}: dup {r['duplicates']}, lost {r['lost']}, "
                                                f"answer p50 {r['answer_p50_s']} s", flush=True))
    console.print(table(rows))
    console.print("naive bots lose what was never delivered; a seen-set of delivery ids stops GitHub's redeliveries "
                  "but not Discourse's retries (a new id each). replyd keys the mention, and its backstop poll "
                  f"(every {BACKSTOP_S:g} s here, 300 s by default) answers the dropped.")
    return rows
