"""The library API: open_guard posts through the same Guard.post and the same log as the daemon and its API."""

from __future__ import annotations

import threading
import time

import pytest

from replyd import GuardSession, library, open_guard
from replyd.errors import ConfigError, LeaseLost
from replyd.guard import Guard, Status
from replyd.platforms.memory import MemoryPlatform
from tests.api_harness import running


def test_library_and_api_share_one_log(tmp_path, monkeypatch):
    """A post through the library and one through the daemon's API are the same key: one reply, either order."""
    with running(tmp_path, monkeypatch) as h:
        settings = {"base_url": h.sim.base_url, "token_env": "SIM_TOKEN", "listing_delay_s": 0.2}
        with open_guard(f"sqlite:///{h.db}", "mastodon", settings) as g:
            assert isinstance(g, GuardSession) and g.platform.instance == h.instance
            first = h.parent()
            lib = g.post(first, "from the library")
            assert lib.status is Status.POSTED
            with h.client() as c:
                api = c.post("/v1/replies", json={"platform": "sim", "parent_id": first, "text": "from the API"})
            assert api.status_code == 200 and api.json()["reply_id"] == lib.reply_id
            second = h.parent()
            with h.client() as c:
                assert c.post("/v1/replies", json={"platform": "sim", "parent_id": second, "text": "api"}).status_code == 201
            assert g.post(second, "library, reworded").status is Status.ALREADY_ANSWERED
            assert g.check(second).status is Status.ALREADY_ANSWERED
            assert [e.kind for e in g.history(first)] == ["claimed", "closed"]
        assert h.bot_replies(first) == 1 and h.bot_replies(second) == 1


def test_library_sweep_closes_a_lost_send(tmp_path, monkeypatch):
    """A send whose response was lost stays open; the session's sweep closes it from the read-back."""
    with running(tmp_path, monkeypatch) as h:
        settings = {"base_url": h.sim.base_url, "token_env": "SIM_TOKEN", "listing_delay_s": 0.2}
        with open_guard(f"sqlite:///{h.db}", "mastodon", settings, send_timeout_s=0.5) as g:
            pid = h.parent()
            h.world.queue_faults(next_creates=["lost_drop"])
            assert g.post(pid, "hello").status is Status.UNCERTAIN
            time.sleep(1.0)
            assert g.sweep().closed == 1
            assert g.post(pid, "hello").status is Status.ALREADY_ANSWERED
        assert h.bot_replies(pid) == 1


def test_open_guard_with_an_adapter_instance_and_a_responder(tmp_path):
    """An adapter instance works too; a responder runs once per parent; rearm and adopt are on the session."""
    plat = MemoryPlatform(instance="memory:lib")
    calls = []

    def respond(parent):
        """Count the call and answer."""
        calls.append(parent.id)
        return "hi"

    with open_guard(f"sqlite:///{tmp_path / 'r.sqlite3'}", plat) as g:
        p = plat.add_parent("p1")
        assert g.post(p, respond).status is Status.POSTED
        assert g.post(p, respond).status is Status.ALREADY_ANSWERED
        assert calls == ["p1"] and plat.reply_count("p1") == 1
        plat.script = ["rejected"]
        assert g.post(plat.add_parent("p2"), "x").status is Status.REJECTED
        res = g.rearm("p2", reason="fixed the text")
        assert res.rearmed and res.previous == "rejected" and res.row.state == "released"
        assert g.post(plat.parents["p2"], "better").status is Status.POSTED
        assert g.rearm("p2").rearmed is False
    with pytest.raises(ConfigError, match="settings"):
        open_guard(f"sqlite:///{tmp_path / 'r.sqlite3'}", plat, {"x": 1})
    with pytest.raises(ConfigError, match="NOPE_NOT_SET"):
        open_guard(f"sqlite:///{tmp_path / 'r.sqlite3'}", "mastodon", {"base_url": "http://x", "token_env": "NOPE_NOT_SET"})


# -- compose leases (library.begin / library.finish), on SQLite and the real PostgreSQL -----------------


def _leasing(store, clock, **kw):
    """A guard with a 60 s compose lease over an in-memory platform."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    return plat, Guard(store, plat, plat.whoami(), clock=clock, compose_lease_s=60.0, **kw)


def test_lease_expires_on_the_clock_and_only_the_holder_posts(store, clock):
    """A lease blocks others until it runs out; then the dead holder is refused and the new holder posts once."""
    plat, guard = _leasing(store, clock)
    parent = plat.add_parent("p1")
    a = library.begin(guard, parent, owner="agent-a")
    assert isinstance(a, library.Lease) and a.until == clock.now() + 60.0
    blocked = library.begin(guard, parent, owner="agent-b")
    assert not isinstance(blocked, library.Lease) and blocked.status is Status.IN_FLIGHT
    clock.advance(61.0)
    with pytest.raises(LeaseLost, match="expired 1.0 s ago"):
        library.finish(guard, a, "late text")
    b = library.begin(guard, parent, owner="agent-b")
    assert isinstance(b, library.Lease) and b.attempt == a.attempt == 1  # an expired lease uses no attempt
    with pytest.raises(LeaseLost, match="another holder is composing"):
        library.finish(guard, a, "from the dead holder")
    forged = library.Lease(b.key, "agent-a", b.attempt, b.until)  # the right key, the wrong holder
    with pytest.raises(LeaseLost, match="not held any more"):
        library.finish(guard, forged, "hijack")
    done = library.finish(guard, b, "the answer")
    assert done.status is Status.POSTED and plat.send_calls == 1 and plat.reply_count("p1") == 1
    with pytest.raises(LeaseLost, match="already_answered"):
        library.finish(guard, b, "twice")
    answered = library.begin(guard, parent, owner="agent-c")
    assert not isinstance(answered, library.Lease) and answered.status is Status.ALREADY_ANSWERED
    kinds = [e.kind for e in store.history(guard.key("p1"))]
    assert kinds == ["claimed", "claimed", "opened", "closed"], kinds
    assert [e.owner for e in store.history(guard.key("p1"))][:3] == ["agent-a", "agent-b", "agent-b"]


def test_dry_run_takes_no_lease(store, clock):
    """In dry run begin claims nothing: no row, no event."""
    plat, guard = _leasing(store, clock, dry_run=True)
    got = library.begin(guard, plat.add_parent("p1"), owner="agent-a")
    assert not isinstance(got, library.Lease) and got.status is Status.DRY_RUN
    assert store.get(guard.key("p1")) is None and store.history(guard.key("p1")) == []


def test_lease_holders_share_the_guard_send_watch(store, clock):
    """Posting under many leases starts at most the guard's one send-watch thread, never one per holder."""
    plat = MemoryPlatform(clock=clock, listing_delay_s=5.0)
    guard = Guard(store, plat, plat.whoami(), clock=clock, compose_lease_s=60.0, watch_interval_s=30.0)

    def watchers() -> int:
        return sum(t.name == "replyd-send-watch" and t.is_alive() for t in threading.enumerate())

    before = watchers()
    try:
        for i in range(5):
            lease = library.begin(guard, plat.add_parent(f"p{i}"), owner=f"agent-{i}")
            assert library.finish(guard, lease, "hi").status is Status.POSTED
        assert watchers() - before == 1
    finally:
        guard.close()
