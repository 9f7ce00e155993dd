"""A write outage on the sim (every send 500 for 40 s, 5 min, or 30 min with REPLYD_LONG_OUTAGE=1) under traffic,
two `replyd run` replicas on PostgreSQL, one SIGKILLed and restarted during it: every parent answered once (counted by the sim) soon after
the outage ends, and no attempt spent on the outage (the store's rows and events, as `explain` shows them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from replyd import store as st
from replyd.clock import SystemClock
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.test_daemon import ROOT, wait_until
from tests.test_replicas import fresh_pg  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BOT = "replybot"
# The accelerated config: every interval short so a 5-minute outage costs 5 minutes, not an afternoon.
SEND_TIMEOUT_S = 2.0
LISTING_DELAY_S = 0.5
PROBE_S, PROBE_MAX_S = 1.0, 4.0
REFIND_S = 1.0
BACKOFF_MAX_S = 2.0
# A replica SIGKILLed inside a sweep pass leaves its leased rows held until the lease ends (docs/OPERATIONS.md:
# "delays those rows by at most sweep.lease_s"); the default 120 s would hold them 100 s past a 40 s outage's end.
SWEEP_LEASE_S = 4.0
DRAIN_S = 0.1  # per held parent: its claim, responder, open and send on this shared 2-core machine


def write_config(path: Path, base_url: str, url: str) -> Path:
    """A replica's config: the shared store, inbox and re-find, the breaker on short intervals."""
    path.write_text(f"""
[store]
url = "{url}"

[log]
format = "json"

[guard]
send_timeout_s = {SEND_TIMEOUT_S}
compose_lease_s = 5.0
retry_backoff_s = 0.5
retry_backoff_max_s = {BACKOFF_MAX_S}

[guard.breaker]
window = 5
min_failures = 3
probe_s = {PROBE_S}
probe_max_s = {PROBE_MAX_S}

[sweep]
interval_s = 0.5
retry_s = 0.5
lease_s = {SWEEP_LEASE_S}

[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "SIM_TOKEN"
listing_delay_s = {LISTING_DELAY_S}
timeout_s = 1.5

[bots.pollers]
inbox_interval_s = 0.5
refind_interval_s = {REFIND_S}
refind_lookback_s = 3600
refind_batch = 1000
jitter_s = 0.1

[bots.responder]
kind = "template"
""")
    os.chmod(path, 0o600)
    return path


def start(cfg: Path, rid: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """One `replyd run` replica."""
    return subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                            env={**env, "REPLYD_REPLICA_ID": rid}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=log.open("ab"))


def events_in(log: Path, name: str) -> int:
    """How many JSON log lines of a replica carry the event ``name``."""
    return sum(1 for line in log.read_text(errors="replace").splitlines() if f'"{name}"' in line)


def breaker_story(log: Path, since: float, until: float) -> list[tuple[float, str, str]]:
    """A replica's breaker and send events between two instants, seconds from ``since``: what a timing
    failure needs to say why the first answer after the outage came late."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            at = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        name = rec.get("event", "")
        if since <= at <= until and name.startswith(("replyd.breaker.", "replyd.guard.", "replyd.sweep.")):
            out.append((round(at - since, 2), name, str(rec.get("parent_id", rec.get("next_probe_s", "")))))
    return out[:60]


def open_rows(url: str, platform: str, sender_id: str) -> list[str]:
    """The parents whose rows are not closed yet."""
    s = Store.open(url)
    try:
        return [r.parent_id for r in s.rows_in(platform, sender_id, list(st.STATES), limit=5000)
                if r.state != st.CLOSED]
    finally:
        s.dispose()


LONG = os.environ.get("REPLYD_LONG_OUTAGE") == "1"  # the 30-minute case: 35 minutes of wall time, on request


@pytest.mark.parametrize("outage_s,rate_per_s", [
    pytest.param(40.0, 1.0, id="40s", marks=pytest.mark.timeout(900)),
    pytest.param(300.0, 0.5, id="5min", marks=pytest.mark.timeout(900)),
    pytest.param(1800.0, 0.2, id="30min", marks=[
        pytest.mark.timeout(3000),
        pytest.mark.skipif(not LONG, reason="a 30-minute outage takes 35 minutes: set REPLYD_LONG_OUTAGE=1")]),
])
def test_outage_pauses_sends_and_spends_no_attempt(outage_s, rate_per_s, fresh_pg, tmp_path):
    """Every parent is answered exactly once, within the bound after the outage's end; no row gave up and
    every row's counted attempts (attempt - excused) is its one landing send."""
    url = fresh_pg
    Store.open(url).dispose()
    world = World(SystemClock(), seed=29, listing_delay_s=0.3)
    bot = world.add_account(BOT, bot=True)
    logs = {rid: tmp_path / f"{rid}.log" for rid in ("a", "b")}
    procs: dict[str, subprocess.Popen] = {}
    with SimServer(world) as srv:
        cfg = write_config(tmp_path / "replica.toml", srv.base_url, url)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SIM_TOKEN": bot.token}
        try:
            for rid in logs:
                procs[rid] = start(cfg, rid, env, logs[rid])
            traffic = world.start_traffic(rate_per_s, target=BOT, users=8)
            time.sleep(6.0)
            world.configure(error_500_for_s=outage_s)
            start_at, end_at = world.outages[-1]
            time.sleep(outage_s / 2)
            procs["b"].send_signal(signal.SIGKILL)  # mid-outage: its breaker state dies with it
            procs["b"].wait(10)
            procs["b"] = start(cfg, "b", env, logs["b"])
            time.sleep(max(0.0, end_at - time.time()) + 8.0)
            traffic.stop()
            with world.lock:
                parents = [s for s in world.statuses.values() if s.account_id != bot.id and not s.in_reply_to_id]
            answered = lambda: all(world.replies_by(bot.id).get(p.id) for p in parents)  # noqa: E731
            assert wait_until(answered, 120), logs["a"].read_text()[-3000:]
            # Every row closed while the replicas still run: on a loaded machine a reply can land after its
            # send's timeout, and its row closes only when a sweep has read it back (after the listing delay).
            # A row that never closes fails below, with its history.
            wait_until(lambda: not open_rows(url, f"mastodon:{srv.base_url}", bot.id), 60, every_s=1.0)
            time.sleep(3.0)  # a few more rounds of every path: a duplicate would show now
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait(30)
    per = world.replies_by(bot.id)
    assert [per.get(p.id, 0) for p in parents] == [1] * len(parents), "a parent answered twice or never"
    report = world.report()
    assert report["duplicates"] == 0
    with world.lock:
        replies = {s.in_reply_to_id: s.created_at for s in world.statuses.values()
                   if s.account_id == bot.id and s.in_reply_to_id}
    during = [p for p in parents if p.created_at < end_at]
    assert any(start_at <= p.created_at < end_at for p in during), "no traffic during the outage"
    none_during = [p.id for p in parents if start_at + 0.5 < replies[p.id] < end_at]
    assert not none_during, f"replies landed during the outage: {none_during}"
    held = [p for p in during if start_at <= p.created_at]
    after = sorted(replies[p.id] - end_at for p in during if replies[p.id] >= start_at)
    first_s, last_s = min(replies[p.id] - end_at for p in held), after[-1]
    # Resuming: the next probe leaves within one probe interval (the cap) of the end, offered by the next
    # re-find run; it lands at once.
    resume_bound_s = PROBE_MAX_S + REFIND_S + LISTING_DELAY_S
    # The last: a failed probe's row is proven not landed (send timeout + listing delay, a sweep interval),
    # waits its back-off and one re-find run; and the backlog drains at the sends' pace (DRAIN_S each). A row the
    # replica SIGKILLed mid-outage had leased for its sweep waits out that lease first (SWEEP_LEASE_S).
    # The drain's pace is the machine's: on a loaded one (a parallel suite) each send takes longer than
    # DRAIN_S, so the pace measured between the replies after the end is used when slower; what the bound
    # guards is a parent left waiting (a back-off, an attempt spent), not the machine's speed.
    gaps = sorted(b - a for a, b in zip(after, after[1:], strict=False))
    pace_s = max(DRAIN_S, gaps[len(gaps) // 2] if gaps else 0.0)
    bound_s = (PROBE_MAX_S + SEND_TIMEOUT_S + LISTING_DELAY_S + 1.0 + BACKOFF_MAX_S + 2 * REFIND_S
               + SWEEP_LEASE_S + pace_s * len(held))
    print(f"\noutage {outage_s:.0f} s, {len(parents)} parents ({len(held)} posted during it): after its end the "
          f"first answer {first_s:.1f} s (bound {resume_bound_s:.1f} s), median {after[len(after) // 2]:.1f} s, "
          f"last {last_s:.1f} s (bound {bound_s:.1f} s, drain {pace_s:.2f} s a send); "
          f"creates attempted {report['creates_attempted']}, "
          f"500s {report['faults_injected']}")
    s = Store.open(url)
    try:
        rows = s.rows_in(f"mastodon:{srv.base_url}", bot.id, list(st.STATES), limit=5000)
        spent = {r.parent_id: (r.attempt, r.excused) for r in rows if r.attempt - r.excused != 1}
        gave_up = [e for r in rows for e in s.history(st.Key(r.platform, r.sender_id, r.parent_id))
                   if e.kind == "gave_up"]
        story = {pid: [(round(e.at - start_at, 2), e.kind, e.attempt, e.owner and e.owner.split(":")[0], e.detail)
                       for e in s.history(st.Key(f"mastodon:{srv.base_url}", bot.id, pid))] for pid in spent}
        excused = sum(1 for r in rows for e in s.history(st.Key(r.platform, r.sender_id, r.parent_id))
                      if e.kind == "excused")
        # A row not closed: its whole history, so a failure says which path left it (seen once under a loaded
        # CI-style run, never alone).
        unclosed = {r.parent_id: [(round(e.at - start_at, 2), e.kind, e.state, e.attempt, e.detail)
                                  for e in s.history(st.Key(r.platform, r.sender_id, r.parent_id))]
                    for r in rows if r.state != st.CLOSED}
    finally:
        s.dispose()
    assert not unclosed and len(rows) == len(parents), unclosed
    assert not gave_up and not spent, (gave_up, spent, story)  # 0 attempts spent by the outage
    opened = sum(events_in(log, "replyd.breaker.opened") for log in logs.values())
    closed = sum(events_in(log, "replyd.breaker.closed") for log in logs.values())
    print(f"breaker opened {opened}, closed {closed}; not-landed proofs excused {excused}")
    assert opened >= 2 and closed >= 1  # both replicas paused (the killed one too); they resumed
    # Timing last: a slow drain on a loaded machine must not hide the counts above.
    late = {rid: breaker_story(log, end_at, end_at + first_s + 1.0) for rid, log in logs.items()}
    assert first_s <= resume_bound_s, f"first answer {first_s:.1f} s after the end: {late}"
    assert last_s <= bound_s
    assert report["outages"] == [[start_at, end_at]]
