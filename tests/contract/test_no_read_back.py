"""Adapter contract of the no-read-back class (``NoReadBack``: Telegram): these cases replace the read-back ones.

On such a platform nothing the bot sent can be listed, so the promise is at most once, every doubt
reported: a send that may have landed ends ``unconfirmed`` and no path sends it again until an operator
rearms it; a provably-unsent failure is retried as everywhere. Replies are counted on the platform.
"""

from __future__ import annotations

from typing import Any

import pytest

from replyd import library
from replyd import store as st
from replyd.guard import Status
from replyd.platforms.base import NoReadBack, Pending
from tests.contract.test_guard_flow import Flow, flow  # noqa: F401  (the guard + sweep fixture)

NO_READ_BACK = True  # tests/contract/conftest.py: only adapters of this class run these cases


def _die(*args: Any, **kwargs: Any) -> None:
    """The process dies right after the send (before the close)."""
    raise SystemExit("killed before close")


def _never_again(flow: Flow, parent: Any) -> None:
    """Every path, sweeps a day apart: the row stays unconfirmed and nothing more is sent."""
    for path in ("inbox", "webhook", "refind"):
        assert flow.guard.post(parent, f"again from {path}", path=path).status is Status.UNCONFIRMED
        flow.harness.clock.advance(86_400.0)
        assert flow.sweeper().run_once().unconfirmed == 0
    assert flow.store.reoffer_due(flow.adapter.instance, flow.guard.identity.sender_id, now=flow.harness.clock.now(),
                                  after=None, limit=100) == []


def test_the_adapter_declares_no_read_back_and_reads_back_nothing(flow: Flow) -> None:
    """The capability is declared; read_back checks no parent, so no row is ever judged "not found"."""
    parent = flow.harness.parent(flow.adapter)
    assert isinstance(flow.adapter, NoReadBack) and flow.adapter.no_read_back()
    sent = flow.adapter.send(parent, "hi", provider_key="k")
    rb = flow.adapter.read_back([Pending(parent, flow.harness.clock.now())], sender_id=flow.guard.identity.sender_id)
    assert rb.checked == set() and rb.found == {} and flow.harness.reply_ids(parent.id) == [sent.reply_id]


def test_lost_answer_ends_unconfirmed_and_is_never_sent_again(flow: Flow) -> None:
    """The reply lands, its answer is lost: uncertain, the sweep marks it unconfirmed, no path sends it again."""
    parent = flow.harness.parent(flow.adapter)
    flow.harness.fail_next_send("lost")
    assert flow.guard.post(parent, "hello").status is Status.UNCERTAIN
    assert flow.row(parent).state == st.OPEN
    assert flow.sweep().unconfirmed == 1 and flow.row(parent).state == st.UNCONFIRMED
    _never_again(flow, parent)
    assert flow.harness.reply_count(parent.id) == 1


def test_5xx_ends_unconfirmed_and_rearm_sends_once_more(flow: Flow) -> None:
    """A 5xx (nothing created, but nothing proves it): unconfirmed, not retried; an operator's rearm sends once."""
    parent = flow.harness.parent(flow.adapter)
    flow.harness.fail_next_send("error_before")
    assert flow.guard.post(parent, "hi").status is Status.UNCERTAIN
    assert flow.sweep().unconfirmed == 1
    _never_again(flow, parent)
    assert flow.harness.reply_count(parent.id) == 0
    assert library.rearm(flow.store, flow.guard.key(parent.id), by="test").rearmed
    out = flow.guard.post(parent, "hi")
    assert out.status is Status.POSTED and flow.harness.reply_ids(parent.id) == [out.reply_id]


def test_crash_between_send_and_close_ends_unconfirmed_and_confirm_closes(flow: Flow,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies after the send: the row ends unconfirmed; confirm (the operator saw it) closes it for good."""
    parent = flow.harness.parent(flow.adapter)
    with monkeypatch.context() as m:
        m.setattr(flow.guard, "_close", _die)
        pytest.raises(SystemExit, flow.guard.post, parent, "hello")
    landed = flow.harness.reply_ids(parent.id)
    assert len(landed) == 1 and flow.guard.post(parent, "hello").status is Status.IN_FLIGHT
    assert flow.sweep().unconfirmed == 1
    res = library.confirm(flow.store, flow.guard.key(parent.id), by="test", reply_id=landed[0])
    assert res.confirmed and res.row.state == st.CLOSED
    assert flow.guard.post(parent, "hello").status is Status.ALREADY_ANSWERED
    assert flow.harness.reply_ids(parent.id) == landed


@pytest.mark.parametrize("fault", ["rate_limited", "refused"])
def test_provably_unsent_or_refused_is_never_unconfirmed(flow: Flow, fault: str) -> None:
    """A 429 releases the row (retried after the wait, one reply); a refusal is rejected: neither is a doubt."""
    parent = flow.harness.parent(flow.adapter)
    flow.harness.fail_next_send(fault)
    out = flow.guard.post(parent, "hi")
    assert out.status is (Status.NOT_SENT if fault == "rate_limited" else Status.REJECTED)
    flow.harness.clock.advance(120.0)
    if fault == "rate_limited":
        assert flow.guard.post(parent, "hi").status is Status.POSTED
    assert flow.sweep().unconfirmed == 0
    assert flow.harness.reply_count(parent.id) == (1 if fault == "rate_limited" else 0)
