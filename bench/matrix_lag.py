"""Measure Synapse's listing lag for the bot's own replies (what the Matrix read-back relies on).

For each of N replies the bot sends through the adapter (``PUT .../send/m.room.message/{txnId}``
with a reply relation), the clock starts when the send returns and stops when
the reply first appears in the room's ``/messages`` read as the bot and
filtered on the bot as sender (the read-back listing), polled back to back.
Prints p50 / p90 / p99 / max and a JSON line.

    .venv/bin/python bench/matrix_lag.py            # 120 sends
    .venv/bin/python bench/matrix_lag.py -n 300

Needs the test extra (matrix-synapse); starts its own homeserver on SQLite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from replyd.clock import SystemClock
from replyd.platforms.base import Pending
from replyd.platforms.matrix import MatrixPlatform
from tests.synapse_server import start_synapse


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    """Run the measurement and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=120, help="replies to send (default 120)")
    args = ap.parse_args()
    with start_synapse() as hs, httpx.Client(trust_env=False) as http:
        alice = hs.people["alice"]
        room = hs.create_room(alice)
        bot = MatrixPlatform.from_settings({"base_url": hs.base_url, "token": hs.bot.token}, http=http,
                                           clock=SystemClock())
        me = bot.whoami().sender_id
        lags_ms: list[float] = []
        reads: list[int] = []
        for i in range(args.n):
            parent = bot.resolve(f"{room}/{hs.say(alice, room, f'{me} question {i}')}")
            sent = bot.send(parent, f"answer {i}", provider_key=uuid.uuid4().hex)
            t0 = time.perf_counter()
            n = 0
            while True:
                n += 1
                rb = bot.read_back([Pending(parent, opened_at=time.time())], sender_id=me)
                if any(r.reply_id == sent.reply_id for r in rb.found.get(parent.id, [])):
                    break
                if time.perf_counter() - t0 > 60:
                    raise SystemExit(f"reply {i} never listed")
            lags_ms.append((time.perf_counter() - t0) * 1000)
            reads.append(n)
        row = {"n": args.n, "p50_ms": round(_pct(lags_ms, 0.5), 1), "p90_ms": round(_pct(lags_ms, 0.9), 1),
               "p99_ms": round(_pct(lags_ms, 0.99), 1), "max_ms": round(max(lags_ms), 1),
               "mean_ms": round(statistics.mean(lags_ms), 1), "reads_max": max(reads),
               "first_read_found": sum(1 for r in reads if r == 1)}
        print(f"listing lag over {args.n} sends (send returned -> in /messages filtered on the bot):")
        print(f"  p50 {row['p50_ms']} ms  p90 {row['p90_ms']} ms  p99 {row['p99_ms']} ms  max {row['max_ms']} ms; "
              f"found by the first read: {row['first_read_found']}/{args.n}")
        print(json.dumps(row))


if __name__ == "__main__":
    main()
