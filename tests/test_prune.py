"""`replyd prune`: old events and done rows go in short batches; nothing a path or the sweep may still move goes.

The rows are made by the real guard on both stores. A pruned parent found again is skipped as too old by the
policy, never answered twice: that is what makes a done row safe to delete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


from replyd.guard import Guard, Status
from replyd.pipeline import Pipeline
from replyd.platforms.memory import MemoryPlatform
from replyd.policy import Policy
from replyd.store import Key, Store
from replyd.store.retention import prune

ROOT = Path(__file__).resolve().parents[1]
DAY_S = 86_400.0
INSTANCE = "mastodon:http://127.0.0.1:9"  # what the CLI test's config names (base_url below)


def _story(store: Store, clock) -> tuple[Guard, MemoryPlatform]:
    """Rows of every kind, 100 days old, then a few made today."""
    plat = MemoryPlatform(instance=INSTANCE, clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    for i in range(5):
        g.post(plat.add_parent(f"old-{i}"), "hello")  # closed, verified below
    from replyd.platforms.base import Parent

    g.post(Parent(id="old-notime", author_id="user-1"), "hello")  # closed, but no parent time: kept
    plat.script = ["lost"]
    g.post(plat.add_parent("old-open"), "hello")  # open: the sweep still owes it a look
    plat.script = ["rejected"]
    g.post(plat.add_parent("old-rejected"), "hello")
    store.record(Key(INSTANCE, plat.sender_id, "old-skip"), "skipped", owner="t", detail={"reason": "too_old"})
    # Verification done: the closes' looks are not pending any more (the sweep clears deadline_at).
    with store.engine.begin() as c:
        c.exec_driver_sql("UPDATE replies SET deadline_at = NULL WHERE state = 'closed'")
    clock.advance(100 * DAY_S)
    for i in range(3):
        g.post(plat.add_parent(f"new-{i}"), "hello")
    return g, plat


def test_prune_deletes_only_what_can_never_matter_and_a_pruned_parent_is_not_answered_again(store, clock):
    g, plat = _story(store, clock)
    now = clock.now()
    before = {r.parent_id: r.state for r in store.rows_in(INSTANCE, plat.sender_id, ["closed", "open", "rejected"])}
    assert len(before) == 11
    cut = [(INSTANCE, plat.sender_id, now - 30 * DAY_S)]
    dry = prune(store, cut, events_before=now - 90 * DAY_S, dry_run=True, batch=2)
    assert dry["rows"][0]["deleted"] == 6 and dry["rows"][0]["kept_no_platform_time"] == 1
    assert len(store.find("old-0")) == 1  # a dry run deletes nothing

    rep = prune(store, cut, events_before=now - 90 * DAY_S, batch=2)
    assert rep["rows"][0]["deleted"] == 6  # old-0..4 and old-rejected
    left = {r.parent_id: r.state for r in store.rows_in(INSTANCE, plat.sender_id, ["closed", "open", "rejected"])}
    assert set(left) == {"old-notime", "old-open", "new-0", "new-1", "new-2"}
    assert store.history(g.key("old-0")) == []  # a pruned row's events go with it
    assert [e.kind for e in store.history(g.key("old-open"))] == ["claimed", "maybe_sent"]  # a live row keeps all
    assert store.history(g.key("old-notime")) == []  # a kept done row loses its old events, never its row
    assert store.find_events("old-skip") == []  # an old skip with no row went
    assert rep["events"] >= 3 and dry["events"] > rep["events"]  # the dry run counted the pruned rows' events too

    # The pruned parent found again (a re-find, an inbox replay): the policy skips it as too old.
    pipe = Pipeline(g, lambda _p: "again", Policy.build(max_age_s=30 * DAY_S), clock)
    out = pipe.offer(plat.parents["old-0"], "refind")
    assert out.status is Status.SKIPPED and out.detail == "too_old"
    assert sum(1 for r in plat.replies() if r["parent_id"] == "old-0") == 1  # counted on the platform


def test_prune_keeps_every_event_of_a_row_a_job_may_still_move(store, clock):
    g, plat = _story(store, clock)
    now = clock.now()
    prune(store, [], events_before=now - 1.0)  # every event is old: only finished keys lose theirs
    assert [e.kind for e in store.history(g.key("old-open"))] == ["claimed", "maybe_sent"]
    assert store.history(g.key("new-0"))  # closed today: its close's look is pending (deadline_at set)
    assert store.history(g.key("old-0")) == []  # closed, verified: its story is over


def test_cli_prune_dry_run_then_real_on_the_default_store(tmp_path):
    state = tmp_path / "state"
    os.environ["XDG_STATE_HOME"] = str(state)
    try:
        from replyd.clock import FakeClock

        clock = FakeClock(start=time.time() - 100 * DAY_S)  # the story's "today" is the CLI's now
        s = Store.open(clock=clock)
        _story(s, clock)
        s.dispose()
    finally:
        del os.environ["XDG_STATE_HOME"]
    cfg = tmp_path / "bot.toml"
    cfg.write_text('[[bots]]\nname = "helper"\nplatform = "mastodon"\n[bots.settings]\nbase_url = "http://127.0.0.1:9"\n'
                   'token_env = "HELPER_TOKEN_UNSET"\n[bots.policy]\nmax_age_s = 2592000\n')
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "replyd", "prune", "--config", str(cfg), *args], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    r = run("--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    dry = json.loads(r.stdout)
    assert dry["dry_run"] and dry["rows"][0]["deleted"] == 6 and dry["events"] > 0
    r = run()
    assert r.returncode == 0, r.stderr
    assert "deleted 6 done rows" in r.stdout and "kept 1 with no parent time" in r.stdout, r.stdout
    again = json.loads(run("--json").stdout)
    assert again["rows"][0]["deleted"] == 0 and again["events"] == 0  # nothing left to prune
    bad = run("--events-before", "yesterday")
    assert bad.returncode == 2 and "--events-before" in bad.stderr and "\n" not in bad.stderr.strip()
