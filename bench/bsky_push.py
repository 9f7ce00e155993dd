"""Measure how soon a mention of the bot can be known on the Bluesky reference network (@atproto/dev-env).

For each of N mentions (alice posts through ``createRecord``), the clock starts when createRecord returns
and stops when the mention first shows in

- ``firehose frame``: the PDS's ``com.atproto.sync.subscribeRepos`` (a reader decoding every frame);
- ``firehose parent``: replyd's firehose (``replyd/platforms/bluesky_firehose.py``): the frame, decoded,
  filtered and read back from the AppView as the poller's parent (what replyd offers with path ``stream``);
- ``listNotifications``: the bot's notifications on the AppView, polled every ``--interval-ms`` (10 ms):
  the floor of the notification poll (a real poll adds its interval, 30 s by default).

One mention at a time. Prints p50 / p90 / p99 / max per source and a JSON line.

    .venv/bin/python bench/bsky_push.py            # 50 mentions
    .venv/bin/python bench/bsky_push.py -n 200

Needs ``make bsky-deps``, PostgreSQL (root@127.0.0.1), Redis (127.0.0.1:6379) and the ``bluesky`` extra.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import libipld
from websockets.sync.client import connect

from bench.bsky_lag import _login, cli
from replyd.clock import SystemClock
from replyd.platforms.bluesky import BlueskyPlatform
from replyd.platforms.bluesky_firehose import Firehose, commit_posts, firehose_url
from tests.bsky_network import BskyNetwork

SOURCES = ("firehose frame", "firehose parent", "listNotifications")


def measure(net: BskyNetwork, n: int, interval_s: float = 0.01, timeout_s: float = 30.0) -> dict[str, list[float]]:
    """Post ``n`` mentions of the bot one at a time; return the seconds until each source showed each."""
    seen: dict[tuple[str, str], float] = {}
    stop = threading.Event()

    def frames() -> None:
        with connect(firehose_url(net.pds), proxy=None, compression=None, max_size=8 << 20) as ws:
            while not stop.is_set():
                try:
                    frame = ws.recv(timeout=0.5)
                except TimeoutError:
                    continue
                _header, body = libipld.decode_dag_cbor_multi(frame)
                for uri, _record in commit_posts(body):
                    seen.setdefault(("firehose frame", uri), time.monotonic())

    with httpx.Client(trust_env=False) as http:
        platform = BlueskyPlatform.from_settings(
            {"service": net.pds, "identifier": net.bot.handle, "app_password": net.bot_app_password,
             "appview_did": net.appview_did}, http=http, clock=SystemClock())
        firehose = Firehose(platform, net.pds)

        def parents() -> None:
            for parent in firehose.stream(stop):
                seen.setdefault(("firehose parent", parent.id), time.monotonic())

        readers = [threading.Thread(target=f, daemon=True) for f in (frames, parents)]
        for t in readers:
            t.start()
        while firehose.opened == 0:
            time.sleep(0.05)
        time.sleep(0.5)
        token = _login(net)  # a session of the bot's, as its poll uses
        out: dict[str, list[float]] = {s: [] for s in SOURCES}
        for i in range(n):
            post = net.post(net.people["alice.test"], f"push latency sample {i}?", mention=net.bot)
            t0 = time.monotonic()
            uri = post["uri"]
            notified = None
            while time.monotonic() - t0 < timeout_s:
                resp = http.get(f"{net.pds}/xrpc/app.bsky.notification.listNotifications", timeout=30,
                                headers={"authorization": f"Bearer {token}", "atproto-proxy": net.proxy},
                                params={"limit": 5})
                if notified is None and resp.status_code == 200 and any(
                        x["uri"] == uri for x in resp.json()["notifications"]):
                    notified = time.monotonic()
                if notified is not None and all((s, uri) in seen for s in SOURCES[:2]):
                    break
                time.sleep(interval_s)
            if notified is None or any((s, uri) not in seen for s in SOURCES[:2]):
                raise RuntimeError(f"{uri}: not seen everywhere within {timeout_s}s ({seen.keys()})")
            out["listNotifications"].append(notified - t0)
            for s in SOURCES[:2]:
                out[s].append(seen[(s, uri)] - t0)
        stop.set()
        for t in readers:
            t.join(5)
    return out


def main() -> int:
    """Start a network, measure, print the table and a JSON line."""
    return cli(measure, __doc__, n=50, width=18)


if __name__ == "__main__":
    raise SystemExit(main())
