"""Bot-to-bot loops: two replyd bots on the sim that mention each other stop by policy, not by luck."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import build_bot
from replyd.sim import SimServer, World
from replyd.store import Store

ROUNDS = 8


def bot_config(path: Path, name: str, other: str, base_url: str, db: Path, policy: str,
               allow_mentions: bool = True) -> Config:
    """Write and load the config of one replyd whose template mentions the other bot (a live mention only with
    ``allow_mentions``: the loops below are the operator's choice, stopped by policy)."""
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[[bots]]
name = "{name}"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "LOOP_TOKEN_{name.upper()}"
listing_delay_s = 0.0
allow_mentions = {str(allow_mentions).lower()}

[bots.policy]
{policy}

[bots.responder]
kind = "template"
template = "@{{author_handle}} hello from {name}, what do you think @{other}?"
""")
    os.chmod(path, 0o600)
    return Config.load(path)


def run_loop(tmp_path: Path, *, flagged: bool, policy: str,
             allow_mentions: bool = True) -> tuple[list[int], World, dict[str, Store], dict]:
    """Run both bots' inbox poll in rounds after one human mention; return replies after each round."""
    world = World(SystemClock(), seed=5, listing_delay_s=0.0)
    accounts = {n: world.add_account(n, bot=flagged) for n in ("alpha", "beta")}
    human = world.add_account("hana")
    stores: dict[str, Store] = {}
    bots = {}
    with SimServer(world) as srv, httpx.Client(timeout=10.0) as http:
        for name, other in (("alpha", "beta"), ("beta", "alpha")):
            os.environ[f"LOOP_TOKEN_{name.upper()}"] = accounts[name].token
            cfg = bot_config(tmp_path / f"{name}.toml", name, other, srv.base_url, tmp_path / f"{name}.sqlite3", policy,
                             allow_mentions)
            stores[name] = Store.open(cfg.store.url, clock=SystemClock())
            bots[name] = build_bot(cfg, cfg.bots[0], stores[name], http, SystemClock(), f"replica-{name}")
        world.post(human, "anyone around to help?", mention=[accounts["alpha"], accounts["beta"]])
        totals = []
        for _ in range(ROUNDS):
            for name in ("alpha", "beta"):
                bots[name].pollers.inbox()
            totals.append(sum(sum(world.replies_by(a.id).values()) for a in accounts.values()))
        for b in bots.values():
            b.pipeline.close()
    return totals, world, stores, {n: bots[n].guard for n in bots}


def skipped_reasons(store: Store) -> list[str]:
    """Return the reasons of every skip event in ``store`` (a cap's is ``held``: the parent waits in a row)."""
    return [json.loads(e.detail)["reason"] for e in store.recent_events(500) if e.kind in ("skipped", "held")]


def test_bots_flagged_as_bots_stop_after_one_answer_each(tmp_path):
    """With skip_bots (the default) and both accounts flagged, each bot answers the human once and skips the other."""
    totals, world, stores, _ = run_loop(tmp_path, flagged=True, policy="")
    assert totals == [2] * ROUNDS
    for name in ("alpha", "beta"):
        assert "author_is_bot" in skipped_reasons(stores[name])
        stores[name].dispose()


def test_unflagged_bots_stop_at_max_depth(tmp_path):
    """Accounts not flagged as bots: max_depth = 2 ends the exchange at depth 3 and records too_deep."""
    totals, world, stores, guards = run_loop(tmp_path, flagged=False, policy="max_depth = 2")
    # Depth 0: the human; each bot answers depths 0, 1 and 2: three replies each, then silence.
    assert totals[-1] == 6 and totals[-3:] == [6, 6, 6]
    for name in ("alpha", "beta"):
        assert skipped_reasons(stores[name]).count("too_deep") == 1
        stores[name].dispose()


def test_a_mention_the_operator_did_not_allow_starts_no_loop(tmp_path):
    """By default a bot's mention of another account is defused: the other bot is never called, no loop starts."""
    totals, world, stores, _ = run_loop(tmp_path, flagged=False, policy="", allow_mentions=False)
    assert totals == [2] * ROUNDS  # each bot answered the human once, and nothing after
    for s in stores.values():
        s.dispose()


def test_unflagged_bots_loop_without_a_policy(tmp_path):
    """The control: with skip_bots on but no flag and no depth limit the loop really runs, growing every round."""
    totals, _, stores, _ = run_loop(tmp_path, flagged=False, policy="")
    assert totals[-1] >= 2 * ROUNDS and all(b > a for a, b in zip(totals, totals[1:], strict=False))
    for s in stores.values():
        s.dispose()


@pytest.mark.parametrize("policy", ["max_per_author_per_hour = 2"])
def test_unflagged_bots_stop_at_the_author_cap(tmp_path, policy):
    """The per-author cap also ends the exchange: each bot answers the other at most twice an hour."""
    totals, world, stores, _ = run_loop(tmp_path, flagged=False, policy=policy)
    assert totals[-1] == totals[-3] and totals[-1] <= 2 + 2 * 2
    for name in ("alpha", "beta"):
        assert "author_cap" in skipped_reasons(stores[name])
        stores[name].dispose()
