"""Section 9: time to answer — polling with the defaults against the notification stream, one daemon, one sim.

The daemon runs in this process (its real scheduler, guard, pollers and sweep) on SQLite against the sim
over HTTP; the sim posts ``n`` parents that mention the bot at a steady rate. Time to answer is the sim's:
from the moment it accepted a parent to the moment it accepted the bot's reply (the template responder
takes no time). Requests per answered parent are every API request the sim served, the held stream
counting once.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Table, tmpdir, verdict
from bench.simcount import counting_sim
from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.sim import World

BOT = "replybot"
MODES = {
    "poll (defaults: inbox every 30 s)": "",
    "stream + backstop poll (300 s)": '[bots.push]\nkind = "mastodon_stream"\n',
}


def _config(path: Path, base_url: str, db: Path, push: str) -> Path:
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "warning"

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "BENCH_SIM_TOKEN"
listing_delay_s = 1.0

{push}
[bots.responder]
kind = "template"
""")
    os.chmod(path, 0o600)
    return path


def _one(mode: str, push: str, n: int, rate_per_s: float, timeout_s: float) -> dict[str, Any]:
    world = World(SystemClock(), seed=9, listing_delay_s=0.2)
    bot = world.add_account(BOT, bot=True)
    with tmpdir("tta") as tmp, counting_sim(world) as (srv, counts):
        os.environ["BENCH_SIM_TOKEN"] = bot.token
        d = Daemon(Config.load(_config(tmp / "c.toml", srv.base_url, tmp / "r.sqlite3", push)))
        d.start()
        try:
            time.sleep(2.0)  # logged in, first polls done, stream open
            counts.clear()
            traffic = world.start_traffic(rate_per_s, total=n, target=BOT, users=20)
            traffic.join(n / rate_per_s + 30)
            parents = [s for s in world.statuses.values() if not s.in_reply_to_id and s.account_id != bot.id]
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and not all(world.replies_by(bot.id).get(p.id) for p in parents):
                time.sleep(0.2)
            requests = sum(counts.values())
        finally:
            d.stop(grace_s=5)
            os.environ.pop("BENCH_SIM_TOKEN", None)
    replies = {s.in_reply_to_id: s for s in world.statuses.values() if s.account_id == bot.id and s.in_reply_to_id}
    waits = sorted(replies[p.id].created_at - p.created_at for p in parents if p.id in replies)
    report = world.report()
    return {"mode": mode, "parents": len(parents), "answered": len(waits), "duplicates": report["duplicates"],
            "p50_s": statistics.median(waits) if waits else None,
            "p99_s": waits[int(0.99 * (len(waits) - 1))] if waits else None,
            "requests": requests, "per_parent": requests / max(1, len(waits))}


def measure(n: int = 200, *, rate_per_s: float = 5.0, timeout_s: float = 90.0) -> dict[str, Any]:
    """Both modes, one after the other, on the same parent traffic."""
    return {"n": n, "rate_per_s": rate_per_s,
            "modes": [_one(mode, push, n, rate_per_s, timeout_s) for mode, push in MODES.items()]}


def tables(res: dict[str, Any], cmd: str) -> list[Table]:
    """The time-to-answer table."""
    t = Table(f"9. Time to answer: {res['n']} parents at {res['rate_per_s']:g}/s, polling against the stream",
              ["discovery", "parents", "answered", "duplicates (sim)", "p50 s", "p99 s", "requests (sim)",
               "requests per answered parent"])
    for m in res["modes"]:
        t.rows.append([m["mode"], str(m["parents"]), str(m["answered"]), str(m["duplicates"]),
                       f"{m['p50_s']:.2f}", f"{m['p99_s']:.2f}", f"{m['requests']:,}", f"{m['per_parent']:.2f}"])
    push = res["modes"][-1]
    t.verdicts.append(verdict(push["p50_s"] <= 1.0, f"push p50 {push['p50_s']:.2f} s (goal ≤ 1 s, no responder time)"))
    t.verdicts.append(verdict(push["per_parent"] <= 1.1,
                              f"push {push['per_parent']:.2f} platform requests per answered parent (goal ≤ 1.1)"))
    t.notes.append(
        "One `replyd run` daemon in process (scheduler, guard, pollers, sweep) on SQLite against the sim over "
        "HTTP, template responder; the sim posts the parents (each mentions the bot) at a steady rate and "
        "counts every API request from the first parent on (the held stream is one request) and every reply. "
        f"Time to answer: the sim's clock, parent accepted to reply accepted. Command: `{cmd} --only timetoanswer`."
    )
    return [t]
