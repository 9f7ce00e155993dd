"""Slack: replyd against the frameworks' TTL seen-set, on one scenario, counted by the fake Slack.

Each run is ``tests/slack_scenario.py``: 12 messages (8 channel mentions, 4 DMs) pushed by the Events API
(every delivery retried 3 times as Slack does on a lost ack, plus one more event id per message) to
replica ``a`` and by Socket Mode (one forced reconnect) to replica ``b``; 3 ``chat.postMessage`` answers
lost after the message was created; the replica holding one send is SIGKILLed mid-send and restarted; the
replica composing one slow message is SIGKILLed mid-compose and restarted.

- ``replyd``: two ``replyd run`` replicas on one PostgreSQL, backstop poll every 2 s;
- ``naive (event_id)`` / ``naive (client_msg_id)``: ``bench/slack_naive.py``, two replicas sharing a Redis
  seen-set (SET NX, TTL 10 Slack minutes), marked on receipt, ack first, one retry of a failed post.

    .venv/bin/python bench/slack_duplicates.py --runs 3

Section ``slack`` of ``bench/run.py``; alone it prints the table and, with ``--json``, the counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Table, pg_databases, tmpdir, verdict  # noqa: E402
from tests import slack_scenario  # noqa: E402

VARIANTS = (("replyd", "replyd", ""), ("naive (event_id)", "naive", "event_id"),
            ("naive (client_msg_id)", "naive", "client_msg_id"))


def measure(runs: int = 3, messages: int = 12) -> dict[str, Any]:
    """Run every variant ``runs`` times on the scenario; the fake's counts per variant and run."""
    rows: dict[str, list[slack_scenario.Result]] = {name: [] for name, _k, _n in VARIANTS}
    with tmpdir("slack") as tmp:
        for run in range(runs):
            for name, kind, key in VARIANTS:
                where = tmp / f"{run}-{kind}-{key or 'pg'}"
                if kind == "replyd":
                    with pg_databases(1, "slack") as [url]:
                        res = slack_scenario.run(kind, where, store_url=url, messages=messages,
                                                 kill_mid_compose=True)
                else:
                    res = slack_scenario.run(kind, where, messages=messages, kill_mid_compose=True,
                                             naive_key=key)
                rows[name].append(res)
                print(f"run {run + 1} {name}: duplicates {res.duplicates}, lost {res.lost}, "
                      f"extra responder calls {res.extra_calls}, killed {res.killed}", file=sys.stderr)
    return {"runs": runs, "messages": messages, "variants": {
        name: {"messages": sum(len(r.parents) for r in results),
               "deliveries": sum(r.deliveries for r in results),
               "replies": sum(sum(r.replies.values()) for r in results),
               "duplicates": sum(r.duplicates for r in results),
               "lost": sum(r.lost for r in results),
               "calls": sum(sum(r.calls.values()) for r in results),
               "extra_calls": sum(r.extra_calls for r in results)} for name, results in rows.items()}}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The side-by-side table: duplicates and lost answers counted by the fake Slack."""
    t = Table(f"10. Slack: replyd against the frameworks' TTL seen-set, {res['runs']} runs of "
              f"{res['messages']} messages", ["bot", "messages", "deliveries (Events API + Socket Mode)", "replies",
                                               "duplicates", "lost answers", "responder calls",
                                               "calls beyond one per message"])
    for name, v in res["variants"].items():
        t.rows.append([name, str(v["messages"]), str(v["deliveries"]), str(v["replies"]), str(v["duplicates"]),
                       str(v["lost"]), str(v["calls"]), str(v["extra_calls"])])
    mine = res["variants"]["replyd"]
    t.verdicts.append(verdict(mine["duplicates"] == 0 and mine["lost"] == 0,
                              f"replyd: {mine['duplicates']} duplicates, {mine['lost']} lost answers (goal 0 and 0)"))
    t.notes.append(
        "Counted by the fake Slack (`tests/slack_fake.py`): two replicas per bot; every message by the Events API "
        "(3 retries + one more event id) and by Socket Mode (a forced reconnect); 3 `chat.postMessage` answers lost; "
        "one replica SIGKILLed mid-send, one mid-compose, both restarted. replyd's calls beyond one per message are "
        "composes the mid-compose SIGKILL cut short (the answer died with the process). "
        f"Command: `{cmd} --only slack` (or `.venv/bin/python bench/slack_duplicates.py --runs N`).")
    return [t]


def main() -> None:
    """Run every variant ``--runs`` times and print the fake's counts side by side."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = measure(a.runs, a.messages)
    for t in tables(res, ".venv/bin/python bench/run.py"):
        print(t.markdown())
    if a.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
