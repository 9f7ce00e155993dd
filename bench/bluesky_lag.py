"""Measure the listing lag replyd's read-back sees on the Bluesky reference network (@atproto/dev-env).

For each of N parents (a person mentions the bot), the bot replies through the adapter's ``send`` at the
rkey the guard would use (``provider_key``); the clock starts when the send returns and stops when the
adapter's own ``read_back`` first lists the reply, polled every ``--interval-ms``:

- ``read_back``: the row as the sweep passes it (``provider_key`` = the reply's rkey), i.e. the
  ``getRecord`` fast path on the PDS: the lag the learned delay (``replyd.lag``) measures on Bluesky;
- ``read_back_feed``: the same reply asked with an rkey that holds nothing, so the adapter falls back to
  its own feed (``getAuthorFeed``) and threads on the AppView: the lag of a reply made at another rkey.

Prints p50 / p90 / p99 / max per listing and a JSON line.

    .venv/bin/python bench/bluesky_lag.py            # 100 sends
    .venv/bin/python bench/bluesky_lag.py -n 200

Needs ``make bsky-deps`` (tests/bsky/node_modules), PostgreSQL and Redis, like the Bluesky tests.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.bsky_lag import cli, poll_all
from replyd import log as rlog
from replyd.clock import SystemClock
from replyd.platforms.base import Pending
from replyd.platforms.bluesky import BlueskyPlatform, tid_encode
from tests.bsky_network import BskyNetwork

LISTINGS = ("read_back", "read_back_feed")


def _adapter(net: BskyNetwork, http: httpx.Client) -> BlueskyPlatform:
    return BlueskyPlatform.from_settings(
        {"service": net.pds, "identifier": net.bot.handle, "app_password": net.bot_app_password,
         "appview_did": net.appview_did, "listing_delay_s": 5.0}, http=http, clock=SystemClock())


def measure(net: BskyNetwork, n: int, interval_s: float, timeout_s: float = 60.0) -> dict[str, list[float]]:
    """Send ``n`` replies as the bot; return the lag samples (seconds) per listing."""
    with httpx.Client(trust_env=False) as h1, httpx.Client(trust_env=False) as h2, \
            httpx.Client(trust_env=False) as h3:
        bot = _adapter(net, h1)
        readers = {"read_back": _adapter(net, h2), "read_back_feed": _adapter(net, h3)}
        me = bot.whoami().sender_id
        people = list(net.people.values())
        lags: dict[str, list[float]] = {k: [] for k in LISTINGS}
        for i in range(n):
            post = net.post(people[i % len(people)], f"lag question {i}", mention=net.bot)
            net.wait_indexed(post["uri"])
            parent = bot.resolve(post["uri"])
            key = bot.provider_key(me, parent.id)
            opened = time.time()
            sent = bot.send(parent, f"lag answer {i}", provider_key=key)
            t0 = time.monotonic()
            # An rkey nothing was created at (a TID from 1 s before the send): only the feed and threads can list it.
            elsewhere = tid_encode(int((opened - 1.0) * 1e6), i % 1024)
            asks = {"read_back": Pending(parent, opened_at=opened, provider_key=key),
                    "read_back_feed": Pending(parent, opened_at=opened, provider_key=elsewhere)}

            def listed(name: str) -> bool:
                rb = readers[name].read_back([asks[name]], sender_id=me)  # noqa: B023 - poll_all calls it in this iteration
                return any(r.reply_id == sent.reply_id for r in rb.found.get(parent.id, []))  # noqa: B023 - as above

            checks = {name: (lambda name=name: listed(name)) for name in LISTINGS}
            for name, lag in poll_all(checks, t0, interval_s, timeout_s, what=f"reply {i}").items():
                lags[name].append(lag)
        return lags


def main() -> int:
    """Start the network, measure, print the table and a JSON line (replyd's own log: warnings, on stderr)."""
    rlog.configure("console", "warning")
    return cli(measure, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
