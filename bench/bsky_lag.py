"""Measure the AppView listing lag of the Bluesky reference network (@atproto/dev-env).

For each of N replies the bot posts through ``com.atproto.repo.createRecord``
(at a replyd rkey, as replyd posts them), the clock starts when createRecord
returns and stops when the reply first appears in

- ``app.bsky.feed.getAuthorFeed`` (the batched read-back listing),
- ``app.bsky.feed.getPostThread`` of the parent (what people see),
- ``com.atproto.repo.getRecord`` on the PDS (replyd's fast-path read-back).

Each listing is polled in its own thread every ``--interval-ms`` (default
10 ms; the whole network is one Node process, so hammering it harder slows
the indexer being measured), so the resolution is about one interval plus one
round trip. Prints p50 / p90 / p99 / max per listing
and a JSON line.

    .venv/bin/python bench/bsky_lag.py            # 100 posts
    .venv/bin/python bench/bsky_lag.py -n 300

Needs ``make bsky-deps``, PostgreSQL (root@127.0.0.1) and Redis (127.0.0.1:6379).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replyd.platforms.bluesky import POST_NSID, rkey_for
from tests.bsky_network import BskyNetwork, start_network


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _login(net: BskyNetwork) -> str:
    resp = net.http.post(f"{net.pds}/xrpc/com.atproto.server.createSession",
                         json={"identifier": net.bot.did, "password": net.bot_app_password}, timeout=30)
    resp.raise_for_status()
    return resp.json()["accessJwt"]


def _seen_in_feed(net: BskyNetwork, token: str, uri: str) -> bool:
    resp = net.http.get(f"{net.pds}/xrpc/app.bsky.feed.getAuthorFeed", timeout=30,
                        headers={"authorization": f"Bearer {token}", "atproto-proxy": net.proxy},
                        params={"actor": net.bot.did, "filter": "posts_with_replies", "limit": 5})
    return resp.status_code == 200 and any(i["post"]["uri"] == uri for i in resp.json()["feed"])


def _seen_in_thread(net: BskyNetwork, token: str, parent: str, uri: str) -> bool:
    resp = net.http.get(f"{net.pds}/xrpc/app.bsky.feed.getPostThread", timeout=30,
                        headers={"authorization": f"Bearer {token}", "atproto-proxy": net.proxy},
                        params={"uri": parent, "depth": 1, "parentHeight": 0})
    return resp.status_code == 200 and any(
        r.get("post", {}).get("uri") == uri for r in resp.json()["thread"].get("replies", []))


def _seen_as_record(net: BskyNetwork, token: str, rkey: str) -> bool:
    resp = net.http.get(f"{net.pds}/xrpc/com.atproto.repo.getRecord", timeout=30,
                        headers={"authorization": f"Bearer {token}"},
                        params={"repo": net.bot.did, "collection": POST_NSID, "rkey": rkey})
    return resp.status_code == 200


def measure(net: BskyNetwork, n: int, interval_s: float = 0.01, timeout_s: float = 30.0) -> dict[str, list[float]]:
    """Post ``n`` replies as the bot; return the lag samples (seconds) per listing."""
    token = _login(net)
    alice = net.people["alice.test"]
    root = net.post(alice, "lag benchmark: reply to this", mention=net.bot)
    net.wait_indexed(root["uri"])
    lags: dict[str, list[float]] = {"getAuthorFeed": [], "getPostThread": [], "getRecord": []}
    for i in range(n):
        rkey = rkey_for(net.bot.did, f"{root['uri']}#bench{i}")
        record = {
            "$type": POST_NSID,
            "text": f"lag sample {i}",
            "createdAt": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
            "reply": {"root": root, "parent": root},
        }
        resp = net.http.post(f"{net.pds}/xrpc/com.atproto.repo.createRecord", timeout=30,
                             headers={"authorization": f"Bearer {token}"},
                             json={"repo": net.bot.did, "collection": POST_NSID, "rkey": rkey, "record": record})
        t0 = time.monotonic()
        resp.raise_for_status()
        uri = resp.json()["uri"]
        checks = {
            # B023: poll_all calls these in this iteration
            "getAuthorFeed": lambda: _seen_in_feed(net, token, uri),  # noqa: B023
            "getPostThread": lambda: _seen_in_thread(net, token, root["uri"], uri),  # noqa: B023
            "getRecord": lambda: _seen_as_record(net, token, rkey),  # noqa: B023
        }
        for name, lag in poll_all(checks, t0, interval_s, timeout_s, what=uri).items():
            lags[name].append(lag)
    return lags


def poll_all(checks: dict[str, Callable[[], bool]], t0: float, interval_s: float, timeout_s: float,
             what: str) -> dict[str, float]:
    """Poll every check in its own thread until it holds; return seconds since ``t0`` per check."""
    seen: dict[str, float] = {}

    def poll(name: str, check: Callable[[], bool]) -> None:
        while time.monotonic() - t0 < timeout_s:
            if check():
                seen[name] = time.monotonic() - t0
                return
            time.sleep(interval_s)

    threads = [threading.Thread(target=poll, args=(k, c)) for k, c in checks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [name for name in checks if name not in seen]
    if missing:
        raise RuntimeError(f"{what} not seen in {', '.join(missing)} within {timeout_s}s")
    return seen


def summarize(lags: dict[str, list[float]], width: int = 14) -> dict[str, dict[str, float]]:
    """Print one line per source (p50/p90/p99/max in ms) and return the figures."""
    summary = {}
    for name, xs in lags.items():
        ms = [x * 1000 for x in xs]
        summary[name] = {
            "n": len(ms),
            "p50_ms": round(_pct(ms, 0.50), 1),
            "p90_ms": round(_pct(ms, 0.90), 1),
            "p99_ms": round(_pct(ms, 0.99), 1),
            "max_ms": round(max(ms), 1),
            "mean_ms": round(statistics.fmean(ms), 1),
        }
        s = summary[name]
        print(f"{name:{width}s} n={s['n']}  p50 {s['p50_ms']:7.1f} ms  p90 {s['p90_ms']:7.1f} ms  "
              f"p99 {s['p99_ms']:7.1f} ms  max {s['max_ms']:7.1f} ms")
    return summary


def report(lags: dict[str, list[float]], width: int = 14) -> dict[str, dict[str, float]]:
    """Print p50 / p90 / p99 / max per listing and the JSON line; return the summary."""
    summary = summarize(lags, width)
    print(json.dumps(summary))
    return summary


def cli(measure: Callable[..., dict[str, list[float]]], doc: str, *, n: int = 100, width: int = 14) -> int:
    """The command line the Bluesky lag scripts share: start a network, ``measure(net, n, interval_s)``, report."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("-n", type=int, default=n, help=f"number of posts (default {n})")
    ap.add_argument("--interval-ms", type=float, default=10.0, help="poll interval per listing (default 10)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, start_network(Path(tmp)) as net:
        print(f"network up in {net.startup_ms} ms: pds {net.pds}, appview {net.bsky}", file=sys.stderr)
        lags = measure(net, args.n, interval_s=args.interval_ms / 1000)
    report(lags, width)
    return 0


def main() -> int:
    """Measure the raw listings."""
    return cli(measure, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
