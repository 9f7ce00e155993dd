"""The simulated platform with a sim-side request counter (per method and route)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import replyd.sim.server as sim_server
from replyd.sim import SimServer, World

_ID = re.compile(r"/\d+")


class CountingApp:
    """ASGI middleware counting every Mastodon API request (admin ``/_sim`` routes are not counted)."""

    def __init__(self, app: Any, counts: Counter[str]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and not scope.get("path", "").startswith("/_sim"):
            self.counts[f"{scope['method']} {_ID.sub('/:id', scope['path'])}"] += 1
        await self.app(scope, receive, send)


@contextmanager
def counting_sim(world: World) -> Iterator[tuple[SimServer, Counter[str]]]:
    """Serve ``world`` over real HTTP from a thread; yield the server and its live request counter."""
    counts: Counter[str] = Counter()
    original = sim_server.build_app
    sim_server.build_app = lambda w: CountingApp(original(w), counts)  # type: ignore[assignment]
    try:
        srv = SimServer(world).start()
    finally:
        sim_server.build_app = original  # type: ignore[assignment]
    try:
        yield srv, counts
    finally:
        srv.stop()


def reads(counts: Counter[str]) -> int:
    """GET requests."""
    return sum(v for k, v in counts.items() if k.startswith("GET "))


def posts(counts: Counter[str]) -> int:
    """Status creations."""
    return counts.get("POST /api/v1/statuses", 0)
