"""Slack, issue 23: replyd against the frameworks' TTL seen-set, on one scenario, counted by the fake Slack.

Each run is ``tests/slack_scenario.py``: 12 messages (8 channel mentions, 4 DMs) pushed by the Events API
(every delivery retried 3 times as Slack does on a lost ack, plus one more event id per message) to
replica ``a`` and by Socket Mode (one forced reconnect) to replica ``b``; 3 ``chat.postMessage`` answers
lost after the message was created; the replica holding one send is SIGKILLed mid-send and restarted; the
replica composing one slow message is SIGKILLed mid-compose and restarted.

- ``replyd``: two ``replyd run`` replicas on one PostgreSQL, backstop poll every 2 s;
- ``naive (event_id)`` / ``naive (client_msg_id)``: ``bench/slack_naive.py``, two replicas sharing a Redis
  seen-set (SET NX, TTL 10 Slack minutes), marked on receipt, ack first, one retry of a failed post.

    .venv/bin/python bench/slack_duplicates.py --runs 3

Prints a markdown table (for docs/BENCHMARKS.md) and, with ``--json``, the raw counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import pg_databases, tmpdir  # noqa: E402
from tests import slack_scenario  # noqa: E402

VARIANTS = (("replyd", "replyd", ""), ("naive (event_id)", "naive", "event_id"),
            ("naive (client_msg_id)", "naive", "client_msg_id"))


def main() -> None:
    """Run every variant ``--runs`` times and print the fake's counts side by side."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows: dict[str, list[slack_scenario.Result]] = {name: [] for name, _k, _n in VARIANTS}
    with tmpdir("slack") as tmp:
        for run in range(a.runs):
            for name, kind, key in VARIANTS:
                where = tmp / f"{run}-{kind}-{key or 'pg'}"
                if kind == "replyd":
                    with pg_databases(1, "slack") as [url]:
                        res = slack_scenario.run(kind, where, store_url=url, messages=a.messages,
                                                 kill_mid_compose=True)
                else:
                    res = slack_scenario.run(kind, where, messages=a.messages, kill_mid_compose=True,
                                             naive_key=key)
                rows[name].append(res)
                print(f"run {run + 1} {name}: duplicates {res.duplicates}, lost {res.lost}, "
                      f"extra responder calls {res.extra_calls}, killed {res.killed}", file=sys.stderr)
    print("| bot | runs | messages | deliveries (Events API + Socket Mode) | replies | duplicates | lost answers "
          "| responder calls | calls beyond one per message |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, results in rows.items():
        msgs = sum(len(r.parents) for r in results)
        print(f"| {name} | {len(results)} | {msgs} | {sum(r.deliveries for r in results)} "
              f"| {sum(sum(r.replies.values()) for r in results)} | {sum(r.duplicates for r in results)} "
              f"| {sum(r.lost for r in results)} | {sum(sum(r.calls.values()) for r in results)} "
              f"| {sum(r.extra_calls for r in results)} |")
    if a.json:
        print(json.dumps({n: [r.__dict__ for r in rs] for n, rs in rows.items()}, default=str, indent=1))


if __name__ == "__main__":
    main()
