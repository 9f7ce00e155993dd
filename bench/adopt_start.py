"""What adopting at start costs: requests and seconds of ``replyd.daemon.adopt_window`` against the sim.

    PYTHONPATH=. python -m bench.adopt_start [--parents 200] [--store sqlite|URL]

The sim (in this process, its Idempotency-Key off) holds ``--parents`` mentions of the bot, every one answered
by the bot. Three stores are timed: a new empty one (every parent adopted), one that knows the older half
(a backup restored: the newer half adopted), and one that knows them all (an ordinary restart: no read-back).
One JSON line per store: seconds, HTTP requests by path, rows adopted.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from replyd import library
from replyd.clock import SystemClock
from replyd.config import BotConfig
from replyd.daemon import adopt_window
from replyd.platforms.base import make_platform
from replyd.sim import SimServer, World
from replyd.store import Store


def main() -> None:
    """Run the three cases and print one JSON line each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--parents", type=int, default=200)
    ap.add_argument("--store", default="sqlite", help="sqlite (a temporary file) or a store URL (cleaned first)")
    args = ap.parse_args()
    world = World(SystemClock(), seed=5, listing_delay_s=0.0)
    world.configure(idempotency=False)
    bot, alice = world.add_account("replybot", bot=True), world.add_account("alice")
    parents = [world.post(alice, f"@replybot q{i}").id for i in range(args.parents)]
    for pid in parents:
        world.post(bot, "@alice a", in_reply_to_id=pid)
    with SimServer(world) as srv, tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'r.sqlite3'}" if args.store == "sqlite" else args.store
        bc = BotConfig.model_validate({"name": "b", "platform": "mastodon",
                                       "settings": {"base_url": srv.base_url, "token": bot.token, "max_pages": 20},
                                       "pollers": {"search_interval_s": 0, "refind_lookback_s": 86_400}})
        for case, known in (("new_store", 0), ("restored_half", args.parents // 2), ("restart", args.parents)):
            store = Store.open(url)
            with store.engine.begin() as c:
                for t in ("replies", "events", "cursors"):
                    c.exec_driver_sql(f"DELETE FROM {t}")
            seen: Counter[str] = Counter()
            with httpx.Client(event_hooks={"request": [lambda r: seen.update([r.url.path])]}) as http:  # noqa: B023 - the client closes in this iteration
                plat = make_platform("mastodon", bc.settings, http=http, clock=SystemClock())
                ident = plat.whoami()
                if known:
                    library.adopt(store, plat, ident, [plat.resolve(p) for p in parents[:known]])
                seen.clear()
                t0 = time.perf_counter()
                res = adopt_window(store, bc, plat, ident, SystemClock(), "bench")
                took = time.perf_counter() - t0
            store.dispose()
            assert res is not None
            paths: Counter[str] = Counter()
            for p, n in seen.items():
                paths["own statuses" if "/accounts/" in p else p.rsplit("/", 1)[-1]] += n
            print(json.dumps({"case": case, "parents": args.parents, "known_before": known, "seconds": round(took, 3),
                              "requests": sum(seen.values()), "by_path": dict(paths), "adopted": len(res.adopted),
                              "tracked": len(res.tracked)}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("REPLYD_LOG__LEVEL", "warning")
    main()
