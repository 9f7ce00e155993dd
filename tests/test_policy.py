"""The reply policy and the pipeline around it: every rule, caps on a real store, skip events, dry run, economy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replyd import store as st
from replyd.clock import FakeClock
from replyd.errors import MaybeSent
from replyd.guard import Guard, Status
from replyd.pipeline import Pipeline
from replyd.platforms.base import Identity, Parent
from replyd.platforms.memory import MemoryPlatform
from replyd.policy import SKIP_REASONS, Policy
from replyd.responders import FunctionResponder
from replyd.store import Store
from replyd.transitions import planting

ROOT = Path(__file__).resolve().parents[1]
ME = Identity("bot-1", "replybot")


def parent(**kw) -> Parent:
    """A parent with sensible defaults for policy checks."""
    base = {"id": "p1", "author_id": "u-7", "author_handle": "Alice@example.social", "text": "How do I reset my password?",
            "created_at": 1_000.0}
    return Parent(**{**base, **kw})


@pytest.mark.parametrize(
    ("policy", "overrides", "reason"),
    [
        (Policy(), {"author_id": "bot-1"}, "own_post"),
        (Policy(), {"author_is_bot": True}, "author_is_bot"),
        (Policy(skip_bots=False), {"author_is_bot": True}, None),
        (Policy.build(deny_accounts=["@alice@example.social"]), {}, "account_denied"),
        (Policy.build(deny_accounts=["U-7"]), {}, "account_denied"),
        (Policy.build(allow_accounts=["bob"]), {}, "account_not_allowed"),
        (Policy.build(allow_accounts=["alice@EXAMPLE.social"]), {}, None),
        (Policy.build(allow_accounts=["alice@example.social"]), {"author_is_bot": True}, None),
        (Policy.build(deny_keywords=["PASSWORD"]), {}, "keyword_denied"),
        (Policy.build(allow_keywords=["refund", "invoice"]), {}, "keyword_missing"),
        (Policy.build(allow_keywords=["reset"]), {}, None),
        (Policy(max_age_s=3600), {"created_at": 1_000.0 - 1.0}, "too_old"),
        (Policy(max_age_s=3600), {"created_at": None}, None),
        (Policy(max_depth=1), {"thread_depth": 2}, "too_deep"),
        (Policy(max_depth=1), {"thread_depth": 1}, None),
    ],
)
def test_static_rules(policy, overrides, reason):
    """Each rule needing no I/O gives its own reason word, and only when it applies."""
    clock = FakeClock(start=1_000.0 + 3600.0)
    assert policy.reason_to_skip(parent(**overrides), ME, clock) == reason
    if reason:
        assert reason in SKIP_REASONS


class DeepPlatform(MemoryPlatform):
    """A memory platform whose threads have a scripted depth (or fail to say)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.depth_calls = 0
        self.depth_error = False

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return the scripted depth from ``extra``; raise MaybeSent when told to fail."""
        self.depth_calls += 1
        if self.depth_error:
            raise MaybeSent("context read timed out")
        return int(parent.extra["depth"])


@pytest.fixture
def world(store, clock):
    """A guard on a depth-aware memory platform, and a counting responder."""
    plat = DeepPlatform(clock=clock, listing_delay_s=5.0)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0)
    calls: list[str] = []

    def respond(p: Parent) -> str:
        calls.append(p.id)
        return f"hi {p.author_handle}"

    return {"plat": plat, "guard": guard, "calls": calls, "respond": respond, "store": store, "clock": clock}


def test_hourly_and_author_caps_count_the_store(world):
    """Caps count rows opened in the last hour on the real store; an hour later the parent is answered."""
    plat, guard, clock = world["plat"], world["guard"], world["clock"]
    pipe = Pipeline(guard, world["respond"], Policy(max_per_hour=3, max_per_author_per_hour=2), clock)
    outs = [pipe.offer(plat.add_parent(f"a{i}", author_id="alice"), "inbox").status for i in range(3)]
    assert outs == [Status.POSTED, Status.POSTED, Status.SKIPPED]
    assert pipe.offer(plat.add_parent("b0", author_id="bob"), "inbox").status is Status.POSTED
    capped = pipe.offer(plat.add_parent("c0", author_id="carol"), "inbox")
    assert (capped.status, capped.detail) == (Status.SKIPPED, "hourly_cap")
    assert world["calls"] == ["a0", "a1", "b0"] and plat.send_calls == 3
    clock.advance(3601)
    assert pipe.offer(plat.parents["a2"], "refind").status is Status.POSTED
    assert pipe.offer(plat.parents["c0"], "refind").status is Status.POSTED
    assert pipe.skips == {"author_cap": 1, "hourly_cap": 1}


def test_measured_depth_is_paid_only_for_unanswered_parents(world):
    """max_depth reads the platform's depth after the pre-check; a failed read skips (fail closed)."""
    plat, guard, clock = world["plat"], world["guard"], world["clock"]
    pipe = Pipeline(guard, world["respond"], Policy(max_depth=2), clock)
    assert pipe.offer(plat.add_parent("top", thread_depth=0, extra={"depth": 0}), "inbox").status is Status.POSTED
    assert plat.depth_calls == 0  # a top-level post needs no read
    deep = plat.add_parent("deep", thread_depth=1, extra={"depth": 3})
    assert pipe.offer(deep, "inbox").detail == "too_deep" and plat.depth_calls == 1
    ok = plat.add_parent("ok", thread_depth=1, extra={"depth": 2})
    assert pipe.offer(ok, "inbox").status is Status.POSTED and plat.depth_calls == 2
    assert pipe.offer(ok, "search").status is Status.ALREADY_ANSWERED and plat.depth_calls == 2
    plat.depth_error = True
    unknown = pipe.offer(plat.add_parent("x", thread_depth=1, extra={"depth": 1}), "inbox")
    assert unknown.detail == "depth_unknown" and world["calls"] == ["top", "ok"]


def test_skip_is_one_event_per_reason_and_refind_adds_none(world):
    """A skip is recorded once per (parent, reason), even from a new process; a new reason adds one more."""
    plat, guard, clock, store = world["plat"], world["guard"], world["clock"], world["store"]
    p = plat.add_parent("s1", author_id="spammer", text="buy now")
    pipe = Pipeline(guard, world["respond"], Policy.build(deny_keywords=["buy now"]), clock)
    for path in ("inbox", "search", "refind"):
        assert pipe.offer(p, path).detail == "keyword_denied"
    # A restarted process has an empty memory of recorded skips: the store still prevents a second event.
    again = Pipeline(guard, world["respond"], Policy.build(deny_keywords=["buy now"]), clock)
    again.offer(p, "refind")
    other = Pipeline(guard, world["respond"], Policy.build(deny_accounts=["spammer"]), clock)
    other.offer(p, "inbox")
    events = store.history(guard.key("s1"))
    assert [(e.kind, json.loads(e.detail)["reason"]) for e in events] == [
        ("skipped", "keyword_denied"), ("skipped", "account_denied")]
    assert json.loads(events[0].detail)["path"] == "inbox" and store.get(guard.key("s1")) is None
    assert world["calls"] == [] and plat.send_calls == 0


def test_precheck_spares_the_responder_for_every_blocked_state(world):
    """Answered, in-flight, rejected, given-up and declined parents never cost a responder call."""
    plat, guard, clock, store = world["plat"], world["guard"], world["clock"], world["store"]
    pipe = Pipeline(guard, world["respond"], Policy(), clock)
    blocked = {"closed": st.CLOSED, "open": st.OPEN, "rejected": st.REJECTED, "gave_up": st.GAVE_UP,
               "declined": st.DECLINED, "composing": st.COMPOSING}
    for pid, state in blocked.items():
        p = plat.add_parent(pid)
        with planting(), store.transaction() as tx:  # each blocked state planted as it stands
            tx.insert_new(guard.key(pid), {
                "state": state, "attempt": 2 if state == st.GAVE_UP else 1, "created_at": clock.now(),
                "updated_at": clock.now(), "path": "inbox", "snapshot": "{}", "reply_id": "r" if state == st.CLOSED else None,
                "lease_owner": "other", "lease_until": clock.now() + 100})
        out = pipe.offer(p, "refind")
        assert out.status in {Status.ALREADY_ANSWERED, Status.IN_FLIGHT, Status.REJECTED, Status.GAVE_UP,
                              Status.DECLINED}, (pid, out)
    assert world["calls"] == [] and plat.send_calls == 0


def test_dry_run_calls_the_responder_once_and_sends_nothing(world, store, clock):
    """Shadow mode logs and records the reply once, claims nothing; switching it off answers for real."""
    plat = world["plat"]
    shadow = Guard(store, plat, plat.whoami(), clock=clock, dry_run=True)
    pipe = Pipeline(shadow, FunctionResponder(world["respond"]), Policy(), clock)
    p = plat.add_parent("d1", author_handle="dora")
    first = pipe.offer(p, "inbox")
    assert (first.status, first.detail) == (Status.DRY_RUN, "dry run: would post")
    assert pipe.offer(p, "search").status is Status.DRY_RUN and world["calls"] == ["d1"]
    events = store.history(shadow.key("d1"))
    assert [e.kind for e in events] == ["would_post"] and json.loads(events[0].detail)["text"] == "hi dora"
    assert store.get(shadow.key("d1")) is None and plat.send_calls == 0
    live = Pipeline(world["guard"], world["respond"], Policy(), clock)
    assert live.offer(p, "refind").status is Status.POSTED and plat.send_calls == 1
    pipe.close()


def test_async_responder_failure_backs_off_through_the_runner(world):
    """A failing async responder (via the runner) releases with a backoff; no attempt is used, nothing sent."""
    plat, guard, clock, store = world["plat"], world["guard"], world["clock"], world["store"]
    n = {"calls": 0}

    async def flaky(p: Parent) -> str:
        n["calls"] += 1
        if n["calls"] == 1:
            raise ConnectionError("model endpoint down")
        return "fine now"

    pipe = Pipeline(guard, FunctionResponder(flaky), Policy(), clock, responder_timeout_s=5.0)
    p = plat.add_parent("f1")
    out = pipe.offer(p, "inbox")
    assert out.status is Status.NOT_SENT and "model endpoint down" in out.detail and out.retry_after_s == 30.0
    assert pipe.offer(p, "search").status is Status.NOT_SENT and n["calls"] == 1  # inside the backoff
    clock.advance(30.5)
    assert pipe.offer(p, "refind").status is Status.POSTED and n["calls"] == 2
    assert store.get(guard.key("f1")).attempt == 1 and plat.send_calls == 1
    kinds = [e.kind for e in store.history(guard.key("f1"))]
    assert kinds.count("responder_failed") == 1 and kinds[-1] == "closed"
    pipe.close()


def test_explain_shows_a_skipped_parent_without_a_row(tmp_path):
    """`replyd explain` names the skip reason of a parent the policy never let through."""
    db = tmp_path / "replyd.sqlite3"
    store = Store.open(f"sqlite:///{db}")
    plat = MemoryPlatform(instance="memory:explain")
    guard = Guard(store, plat, plat.whoami())
    pipe = Pipeline(guard, lambda p: "hi", Policy(), guard.clock)
    pipe.offer(plat.add_parent("bot-post-9", author_is_bot=True), "inbox")
    store.dispose()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "REPLYD_STORE__URL": f"sqlite:///{db}"}
    r = subprocess.run([sys.executable, "-m", "replyd", "explain", "bot-post-9"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no row, skipped by policy (author_is_bot)" in r.stdout and "memory:explain" in r.stdout
    j = subprocess.run([sys.executable, "-m", "replyd", "explain", "bot-post-9", "--json"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=60)
    assert json.loads(j.stdout)[0]["skip_reasons"] == ["author_is_bot"]
