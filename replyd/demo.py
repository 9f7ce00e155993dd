"""``replyd demo``: the simulated platform, a naive bot and replyd, scenario by scenario.

Every figure in the table is counted by the simulated platform (replies per
parent and account), never by replyd's own log. The naive bot is what most
bots do today: a seen-set per discovery path, written after the send, retries
on errors, and (where it checks at all) a match on reply text.

Crashes are injected with httpx event hooks on the bot's own client: a
``SimulatedCrash`` (a BaseException, like SystemExit) raised before the request
leaves or after the platform answered; the bot is then rebuilt from what it
persisted, as a restarted process would be.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from replyd import demo_push
from replyd import log as rlog
from replyd import store as st
from replyd.clock import SystemClock
from replyd.config import PollerConfig, SweepConfig
from replyd.guard import Guard
from replyd.lag import ListingLag
from replyd.pipeline import Pipeline
from replyd.platforms.base import make_platform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.sim import SimServer, World
from replyd.store import Store
from replyd.sweep import Bot, Sweeper

QUERY = "help"
BOT = "replybot"


class SimulatedCrash(BaseException):
    """The bot process 'dies' here (BaseException: nothing in the bot catches it)."""


@dataclass
class Faults:
    """Crashes still to inject into the bot's next reply POSTs."""

    crash_before: int = 0
    crash_after: int = 0

    def hooks(self) -> dict[str, list[Callable[..., None]]]:
        """httpx event hooks that raise SimulatedCrash around reply POSTs."""

        def on_request(req: httpx.Request) -> None:
            if req.method == "POST" and req.url.path.endswith("/api/v1/statuses") and self.crash_before > 0:
                self.crash_before -= 1
                raise SimulatedCrash("before send")

        def on_response(resp: httpx.Response) -> None:
            req = resp.request
            if req.method == "POST" and req.url.path.endswith("/api/v1/statuses") and self.crash_after > 0 and resp.status_code < 300:
                self.crash_after -= 1
                raise SimulatedCrash("after send, before close")

        return {"request": [on_request], "response": [on_response]}


@dataclass
class Scenario:
    """One row of the table: how the world misbehaves and how bots find parents."""

    name: str
    paths: tuple[str, ...] = ("inbox",)
    replicas: int = 1
    real_delay_s: float = 0.4
    configured_delay_s: float = 1.0
    create_faults: Callable[[int], list[str]] = lambda n: []
    crash_before: int = 0
    crash_after: int = 0
    reworded: bool = False
    idempotency: bool = True
    learned_delay: bool = True  # sweep.listing_delay_auto (replyd's default); off: the configured delay only

    @property
    def listing_delay_ok(self) -> bool:
        """True when replyd's configured listing delay covers the platform's real one."""
        return self.configured_delay_s >= self.real_delay_s


SCENARIOS = [
    Scenario("three paths find the same parents", paths=("inbox", "search", "refind")),
    Scenario("three replicas, one platform", replicas=3),
    Scenario("lost responses (dropped, 504)", create_faults=lambda n: ["lost_drop", "lost_504"] * n),
    Scenario("crash before send", crash_before=2),
    Scenario("crash after send, before close", crash_after=2),
    Scenario("reworded retry after a timeout", create_faults=lambda n: ["lost_504"] * n, reworded=True),
    # The limit rows: the configured delay 10x too short, today's behaviour (the configured delay only).
    Scenario("listing delay > configured, no Idempotency-Key", real_delay_s=3.0, configured_delay_s=0.3,
             create_faults=lambda n: ["lost_drop"] * n, idempotency=False, learned_delay=False),
    Scenario("listing delay > configured, Idempotency-Key", real_delay_s=3.0, configured_delay_s=0.3,
             create_faults=lambda n: ["lost_drop"] * n, idempotency=True, learned_delay=False),
    # The same limit with the learned delay: every other response arrives, so replyd sees its replies listed late
    # (the lag is measured from the sends it knows) and waits that long before it calls a lost one not landed.
    Scenario("listing delay > configured, no key, learned", real_delay_s=3.0,
             configured_delay_s=0.3, create_faults=lambda n: ["ok", "lost_drop"] * n, idempotency=False),
]


# -- the naive bot -------------------------------------------------------------------------


class NaiveBot:
    """A typical bot: per-path seen-sets saved after the send, blind retries, text matching."""

    def __init__(self, base_url: str, token: str, state: Path, faults: Faults, *, reworded: bool) -> None:
        self.state = state
        self.faults = faults
        self.reworded = reworded
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=5.0,
                                 event_hooks=faults.hooks())
        self.seen: dict[str, list[str]] = json.loads(state.read_text()) if state.exists() else {}
        self.me = self.http.get("/api/v1/accounts/verify_credentials").json()["id"]

    def _found(self, path: str) -> list[dict[str, Any]]:
        if path == "search":
            return self.http.get("/api/v2/search", params={"q": QUERY, "type": "statuses"}).json()["statuses"]
        return [n["status"] for n in self.http.get("/api/v1/notifications", params={"types[]": "mention"}).json()]

    def poll(self, path: str) -> None:
        """Answer everything this path finds that this path has not seen."""
        seen = set(self.seen.get(path, []))
        for status in self._found(path):
            if status["id"] in seen or status["account"]["id"] == self.me:
                continue
            self._answer(status["id"])
            seen.add(status["id"])
            self.seen[path] = sorted(seen)
            self.state.write_text(json.dumps(self.seen))  # written after the send, as most bots do

    def _answer(self, parent_id: str) -> None:
        for attempt in range(3):
            text = f"answer #{attempt} to {parent_id}" if self.reworded else f"answer to {parent_id}"
            try:
                r = self.http.post("/api/v1/statuses", data={"status": text, "in_reply_to_id": parent_id})
                if r.status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if self.reworded and self._text_already_there(parent_id, f"answer #{attempt + 1} to {parent_id}"):
                return  # the text check: never finds a reworded reply

    def _text_already_there(self, parent_id: str, text: str) -> bool:
        ctx = self.http.get(f"/api/v1/statuses/{parent_id}/context").json()
        return any(text in d.get("content", "") and d["account"]["id"] == self.me for d in ctx.get("descendants", []))

    def close(self) -> None:
        """Release the HTTP client."""
        self.http.close()


# -- replyd ---------------------------------------------------------------------------------


class ReplydBot:
    """replyd's real guard, pipeline, pollers and sweep, in-process, against the sim over HTTP."""

    def __init__(self, db_url: str, base_url: str, token: str, sc: Scenario, faults: Faults, calls: list[str]) -> None:
        self.clock = SystemClock()
        self.store = Store.open(db_url, clock=self.clock)
        self.http = httpx.Client(timeout=5.0, event_hooks=faults.hooks())
        self.platform = make_platform("mastodon", {
            "base_url": base_url, "token": token, "listing_delay_s": sc.configured_delay_s,
            "idempotency": sc.idempotency, "timeout_s": 5.0,
        }, http=self.http, clock=self.clock)
        self.identity = self.platform.whoami()
        # One listing delay shared by the guard (deadlines) and the sweep (looks), as the daemon shares it.
        cfg = SweepConfig(listing_delay_auto=sc.learned_delay)
        self.lag = ListingLag(self.store, self.platform.instance, sc.configured_delay_s, cfg, clock=self.clock)
        self.guard = Guard(self.store, self.platform, self.identity, clock=self.clock, send_timeout_s=0.5, lag=self.lag)

        def responder(parent):
            calls.append(parent.id)
            return f"answer to {parent.id}"

        pipe = Pipeline(self.guard, responder, Policy(), self.clock)
        self.pollers = Pollers(self.store, self.platform, pipe,
                               PollerConfig(search_queries=[QUERY], refind_lookback_s=3600), self.clock)
        self.sweeper = Sweeper(self.store, [Bot(self.platform, self.identity, self.lag)], clock=self.clock,
                               retry_s=0.5, config=cfg)

    def step(self, paths: tuple[str, ...]) -> None:
        """Run each discovery path once and one sweep pass (the scheduler's work, inline)."""
        for p in paths:
            getattr(self.pollers, p)()
        self.sweeper.run_once()
        self.pollers.refind() if "refind" not in paths else None  # re-offers not_landed parents

    def unsettled(self) -> int:
        """Rows not yet closed (open, not_landed, released, composing)."""
        counts = self.store.counts()
        return sum(n for (_, s), n in counts.items() if s in (st.OPEN, st.NOT_LANDED, st.RELEASED, st.COMPOSING))

    def retries(self) -> int:
        """Keys that needed a second attempt."""
        rows = self.store.rows_in(self.platform.instance, self.identity.sender_id, st.STATES, limit=100_000)
        return sum(1 for r in rows if r.attempt > 1)

    def gave_up(self) -> set[str]:
        """Parents replyd reported as given up (not counted as silently lost)."""
        rows = self.store.rows_in(self.platform.instance, self.identity.sender_id, [st.GAVE_UP], limit=100_000)
        return {r.parent_id for r in rows}

    def close(self) -> None:
        """Release the client and the pool."""
        self.http.close()
        self.store.dispose()


# -- running ----------------------------------------------------------------------------------


@dataclass
class Result:
    """Figures of one bot in one scenario, counted by the sim."""

    duplicates: int = 0
    lost: int = 0
    retries: int = 0
    replies: int = 0
    responder_calls: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    delay_in_use_s: float = 0.0


def _count(world: World, bot_id: str, parents: list[str], reported: set[str] | None = None) -> tuple[int, int, int]:
    per = world.replies_by(bot_id)
    dups = sum(max(0, per.get(p, 0) - 1) for p in parents)
    lost = sum(1 for p in parents if per.get(p, 0) == 0 and p not in (reported or set()))
    return dups, lost, sum(per.get(p, 0) for p in parents)


def _setup(world: World, sc: Scenario, n: int) -> tuple[str, list[str]]:
    world.reset(keep_accounts=True)
    world.configure(listing_delay_s=sc.real_delay_s, idempotency=True)
    bot = world.account(BOT)
    parents = [s.id for s in world.generate(n, target=BOT, query_word=QUERY, query_fraction=1.0, users=4)]
    world.queue_faults(next_creates=sc.create_faults(n)[: 2 * n])
    time.sleep(sc.real_delay_s + 0.05)  # let the parents become visible to readers
    return bot.id, parents


def run_naive(world: World, url: str, sc: Scenario, n: int, tmp: Path) -> Result:
    """Run the naive bot(s) through the scenario; count on the platform."""
    t0 = time.monotonic()
    bot_id, parents = _setup(world, sc, n)
    token = world.account(BOT).token
    faults = Faults(sc.crash_before, sc.crash_after)
    slug = "".join(c if c.isalnum() else "-" for c in sc.name)
    bots = [NaiveBot(url, token, tmp / f"naive-{slug}-{i}.json", faults, reworded=sc.reworded) for i in range(sc.replicas)]
    for i, b in enumerate(bots):
        for _round in range(3):
            try:
                for path in sc.paths:
                    b.poll(path)
                break
            except SimulatedCrash:
                b.close()
                bots[i] = b = NaiveBot(url, token, b.state, faults, reworded=sc.reworded)
    for b in bots:
        b.close()
    time.sleep(sc.real_delay_s)
    dups, lost, replies = _count(world, bot_id, parents)
    return Result(dups, lost, 0, replies, seconds=time.monotonic() - t0)


def run_replyd(world: World, url: str, sc: Scenario, n: int, tmp: Path, timeout_s: float = 40.0) -> Result:
    """Run replyd replica(s) through the scenario until every row settles; count on the platform."""
    t0 = time.monotonic()
    bot_id, parents = _setup(world, sc, n)
    token = world.account(BOT).token
    slug = "".join(c if c.isalnum() else "-" for c in sc.name)
    db_url = f"sqlite:///{tmp / f'replyd-{slug}.sqlite3'}"
    faults = Faults(sc.crash_before, sc.crash_after)
    calls: list[str] = []
    lock = threading.Lock()
    bots = [ReplydBot(db_url, url, token, sc, faults, calls) for _ in range(sc.replicas)]

    def replica(i: int) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                bots[i].step(sc.paths)
            except SimulatedCrash:
                with lock:  # the process died: start a new one over the same database
                    bots[i].close()
                    bots[i] = ReplydBot(db_url, url, token, sc, faults, calls)
                continue
            per = world.replies_by(bot_id)
            if bots[i].unsettled() == 0 and all(per.get(p, 0) or p in bots[i].gave_up() for p in parents):
                return
            time.sleep(0.2)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(sc.replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(min(sc.real_delay_s, 3.5))  # let late landings show before counting
    dups, lost, replies = _count(world, bot_id, parents, bots[0].gave_up())
    res = Result(dups, lost, bots[0].retries(), replies, len(calls), time.monotonic() - t0,
                 delay_in_use_s=max(b.lag.delay_s() for b in bots))
    for b in bots:
        b.close()
    return res


def run_all(n: int, progress: Callable[[str], None] | None = None,
            done: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run every scenario for the naive bot and for replyd; return the JSON-ready rows.

    ``progress`` hears each scenario's name as it starts, ``done`` each finished row.
    """
    rows = []
    world = World(SystemClock(), seed=7)
    world.add_account(BOT, bot=True)
    with SimServer(world) as srv, tempfile.TemporaryDirectory(prefix="replyd-demo-") as tmpd:
        tmp = Path(tmpd)
        for sc in SCENARIOS:
            if progress:
                progress(sc.name)
            naive = run_naive(world, srv.base_url, sc, n, tmp)
            rep = run_replyd(world, srv.base_url, sc, n, tmp)
            rows.append({
                "name": sc.name,
                "listing_delay_ok": sc.listing_delay_ok,
                "learned_delay": sc.learned_delay,
                "parents": n,
                "naive": {"duplicates": naive.duplicates, "lost": naive.lost, "replies": naive.replies},
                "replyd": {"duplicates": rep.duplicates, "lost": rep.lost, "retries": rep.retries, "replies": rep.replies,
                           "responder_calls": rep.responder_calls, "seconds": round(rep.seconds, 1),
                           "configured_delay_s": sc.configured_delay_s, "delay_in_use_s": round(rep.delay_in_use_s, 2)},
            })
            if done:
                done(rows[-1])
    return rows


def main(*, as_json: bool = False, quick: bool = False) -> int:
    """Print the table (or JSON); exit 0 when replyd made no duplicate and lost nothing where the delay is right."""
    import logging

    from rich.console import Console
    from rich.table import Table

    rlog.configure("console", "error")  # the table is the output; warnings would drown it
    logging.getLogger("uvicorn").setLevel(logging.ERROR)
    structlog.get_logger("replyd.demo")
    n = 4 if quick else 10
    console = Console(stderr=as_json, width=None if Console().is_terminal else 120)
    if as_json:
        rows = run_all(n)
        push = demo_push.run_push(n + 4)
        print(json.dumps({"scenarios": rows, "push": push}, indent=2))
    else:
        console.print(f"[bold]replyd demo[/]: a simulated Mastodon-compatible platform over real HTTP, {n} parents per scenario,")
        console.print("a naive bot (per-path seen-set written after the send, blind retries, text match) against replyd.")
        console.print("Every figure is counted by the platform, not by the bots.\n")
        if console.is_terminal:
            with console.status("running…") as status_line:
                rows = run_all(n, progress=lambda name: status_line.update(f"running: {name}"))
        else:
            # Piped or logged: no spinner to show progress, so one line per scenario as it finishes.
            total = len(SCENARIOS)

            def finished(r: dict[str, Any]) -> None:
                print(f"[{len(done_rows) + 1}/{total}] {r['name']}: naive dup {r['naive']['duplicates']}, "
                      f"replyd dup {r['replyd']['duplicates']}, replyd lost {r['replyd']['lost']} "
                      f"({r['replyd']['seconds']} s)", flush=True)
                done_rows.append(r)

            done_rows: list[dict[str, Any]] = []
            rows = run_all(n, done=finished)
            print(flush=True)
        t = Table(title="duplicates on the platform / answers lost", show_lines=False)
        for col in ("scenario", "delay ok", "naive dup", "naive lost", "replyd dup", "replyd lost", "retries", "calls"):
            t.add_column(col, justify="left" if col == "scenario" else "right", no_wrap=col == "scenario")
        for r in rows:
            t.add_row(r["name"], "yes" if r["listing_delay_ok"] else "[yellow]no[/]",
                      str(r["naive"]["duplicates"]), str(r["naive"]["lost"]),
                      _good(r["replyd"]["duplicates"]), _good(r["replyd"]["lost"]), str(r["replyd"]["retries"]),
                      f"{r['replyd']['responder_calls']}/{r['parents']}")
        console.print(t)
        ok = [r for r in rows if r["listing_delay_ok"]]
        console.print(f"with a correct listing delay: naive duplicates {sum(r['naive']['duplicates'] for r in ok)} -> "
                      f"replyd {sum(r['replyd']['duplicates'] for r in ok)}; answers lost: replyd {sum(r['replyd']['lost'] for r in ok)}")
        console.print("limit rows (listing delay longer than configured): with the configured delay only, the retry "
                      "after not_landed can duplicate; Mastodon's Idempotency-Key closes it within its ~1 h window.")
        for r in rows:
            if not r["listing_delay_ok"] and r.get("learned_delay"):
                console.print(f"learned delay ({r['name']}): configured {r['replyd']['configured_delay_s']:g} s, "
                              f"in use {r['replyd']['delay_in_use_s']:g} s (learned from the replies it saw listed "
                              f"late): replyd dup {r['replyd']['duplicates']}.")
        push = demo_push.show(console, n + 4)
    bad = [r for r in rows if r["listing_delay_ok"] and (r["replyd"]["duplicates"] or r["replyd"]["lost"])]
    return 1 if bad or demo_push.failed(push) else 0


def _good(v: int) -> str:
    return f"[green]{v}[/]" if v == 0 else f"[red]{v}[/]"
