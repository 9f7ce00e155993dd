"""The daemon's per-bot work (Pollers → Pipeline → Guard, then the sweep), driven by hand on a platform fake."""

from __future__ import annotations

from typing import Any

from replyd.config import PollerConfig
from replyd.pipeline import Pipeline
from replyd.platforms.base import Parent
from replyd.policy import Policy
from replyd.pollers import Pollers


def pollers_for(w: dict[str, Any], query: str, calls: list[str], policy: Policy | None = None) -> Pollers:
    """Pollers for the fake's bot with a counting responder, built as the daemon builds them."""

    def respond(parent: Parent) -> str:
        calls.append(parent.id)
        return f"answer to {parent.id}"

    pipe = Pipeline(w["guard"], respond, policy or Policy(), w["clock"])
    return Pollers(w["store"], w["plat"], pipe, PollerConfig(search_queries=[query], refind_lookback_s=3600), w["clock"])


def run_paths(pollers: Pollers, w: dict[str, Any], rounds: int = 3) -> None:
    """Every path several times, as the scheduled jobs would, with sweeps past the deadline in between."""
    for _ in range(rounds):
        pollers.inbox()
        pollers.search()
        pollers.refind()
        w["clock"].advance(10.0 + w["plat"].listing_delay_s + 1)
        w["sweeper"].run_once()
