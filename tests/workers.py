"""Functions run in child OS processes by the race and crash tests (spawn-safe)."""

from __future__ import annotations

import os
import random
import signal

from replyd.guard import Guard
from replyd.platforms.base import Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store


def run_until_sigkilled(target, *args) -> None:
    """Run ``target(*args)`` in a spawned child process and check that it died by SIGKILL (its planned crash)."""
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=target, args=args)
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL, f"{target.__name__}{args}: exit code {child.exitcode}"


def _guard(url: str, journal: str, script: list[str] | None = None, face: str = "sync") -> Guard:
    store = Store.open(url)
    plat = MemoryPlatform(journal=journal, script=script or [], listing_delay_s=1.0)
    if face == "async":
        from tests.aio_harness import BlockingAsyncGuard  # the async face's driver behind Guard's API

        return BlockingAsyncGuard(store, plat, plat.whoami(), send_timeout_s=5.0)  # type: ignore[return-value]
    return Guard(store, plat, plat.whoami(), send_timeout_s=5.0)


def race_one(url: str, journal: str, parent_id: str, barrier, results, face: str = "sync") -> None:
    """Wait at the barrier with every other process, then post the same parent once (on ``face``)."""
    g = _guard(url, journal, face=face)
    barrier.wait()
    out = g.post(Parent(id=parent_id, author_id="u"), f"reply from {os.getpid()}")
    g.store.dispose()
    results.put(out.status.value)


def race_many(url: str, journal: str, n_parents: int, seed: int, barrier, results) -> None:
    """Post every parent in a shuffled order after the barrier; report how many this process sent."""
    g = _guard(url, journal)
    ids = [f"p{i}" for i in range(n_parents)]
    random.Random(seed).shuffle(ids)
    barrier.wait()
    sent = sum(1 for pid in ids if g.post(Parent(id=pid, author_id="u"), "x").sent)
    g.store.dispose()
    results.put(sent)


def crash_in(url: str, journal: str, parent_id: str, where: str, face: str = "sync") -> None:
    """Post one parent on ``face`` and die by SIGKILL at ``where``: before_send, after_send or before_close."""
    script = {"before_send": ["crash_before"], "after_send": ["crash_after"]}.get(where, [])
    g = _guard(url, journal, script, face)
    if where == "before_close":
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        g._close = die  # the send has returned; the process dies before the close commits
    g.post(Parent(id=parent_id, author_id="u"), "x")
    raise SystemExit(3)  # unreachable when the kill happened


def crash_before_close_on(kind: str, settings: dict, store_url: str, parent: dict, text: str) -> None:
    """Post through the guard on a real platform adapter; SIGKILL this process after the send, before the close."""
    import httpx

    from replyd.clock import SystemClock
    from replyd.platforms.base import make_platform

    with httpx.Client(trust_env=False) as http:
        platform = make_platform(kind, settings, http=http, clock=SystemClock())
        g = Guard(Store.open(store_url), platform, platform.whoami(), send_timeout_s=10.0)

        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        g._close = die  # the send has returned; the process dies before the close commits
        g.post(Parent.from_snapshot(parent), text, path="inbox")
    raise SystemExit(3)  # unreachable when the kill happened


def crash_in_page(url: str, journal: str, n: int, kill_at: int, where: str, face: str = "sync") -> None:
    """Post a page of ``n`` parents (``g0``…) through one page claim; SIGKILL this process at send ``kill_at``
    (``before_send`` / ``after_send``), right after the page claim commits (``after_claim``: nothing sent), or
    after every send, as the page's one close transaction starts (``before_close``: every row still open)."""
    if where in ("after_claim", "before_close"):
        script: list[str] = []
    else:
        script = ["ok"] * kill_at + ["crash_before" if where == "before_send" else "crash_after"]
    g = _guard(url, journal, script, face)
    parents = [Parent(id=f"g{i}", author_id="u") for i in range(n)]
    if where == "after_claim":
        g.claim_page([(p, "x") for p in parents], path="inbox")
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "before_close":
        g.store.close_many = lambda *a, **kw: os.kill(os.getpid(), signal.SIGKILL)  # the store the face calls
    g.post_page([(p, "x") for p in parents], path="inbox")
    raise SystemExit(3)  # unreachable when the kill happened


def crash_in_pipeline_page(url: str, journal: str, n: int, kill_at: int, where: str) -> None:
    """The daemon's inbox poll of a page of ``n`` new parents (``g0``…) through the pipeline (group claim, a
    responder); SIGKILL this process right after the page claim commits (``after_claim``), in the ``kill_at``-th
    compose (``compose``), before/after the ``kill_at``-th send (``before_send`` / ``after_send``) or as the
    ``kill_at``-th close starts (``before_close``; the last: every reply sent, none of the page left to close)."""
    from replyd.clock import SystemClock
    from replyd.config import PollerConfig
    from replyd.pipeline import Pipeline
    from replyd.policy import Policy
    from replyd.pollers import Pollers

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    sends = {"before_send": "crash_before", "after_send": "crash_after"}
    g = _guard(url, journal, ["ok"] * kill_at + [sends[where]] if where in sends else [])
    composed: list[str] = []

    def respond(parent: Parent) -> str:
        if where == "compose" and len(composed) == kill_at:
            die()
        composed.append(parent.id)
        return f"answer to {parent.id}"

    if where == "after_claim":
        claim_page = g.store.claim_page
        g.store.claim_page = lambda *a, **kw: (claim_page(*a, **kw), die())  # the page's claim commits, then death
    if where == "before_close":
        closes: list[object] = []
        close = g._close

        def dying_close(*a):
            if len(closes) == kill_at:
                die()
            closes.append(a)
            return close(*a)

        g._close = dying_close  # type: ignore[method-assign]
    for i in range(n):
        g.platform.add_parent(f"g{i}")
    clock = SystemClock()
    Pollers(g.store, g.platform, Pipeline(g, respond, Policy(), clock), PollerConfig(), clock).inbox()
    raise SystemExit(3)  # unreachable when the kill happened
