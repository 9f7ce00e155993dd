"""Adapter contract: send, and what each fault the platform can answer means (counted on the platform)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from replyd.errors import DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.platforms._http import HttpPlatform
from replyd.platforms.base import AsyncSend, Parent, Platform, Sent
from tests.contract.harnesses import RETRY_AFTER_S, Harness

Send = Callable[[Platform, Parent, str, str], Sent]


@pytest.fixture(params=["sync", "async"])
def send(request: pytest.FixtureRequest) -> Send:
    """The adapter's send as each face makes it: ``send`` in this thread (the sync face), or as the asyncio
    face does, on an event loop: ``asend`` where the adapter offers it (its send written as steps, on the
    adapter's own ``httpx.AsyncClient``), else ``send`` on a worker thread."""
    if request.param == "sync":
        return lambda adapter, parent, text, key: adapter.send(parent, text, provider_key=key)

    def on_loop(adapter: Platform, parent: Parent, text: str, key: str) -> Sent:
        async def main() -> Sent:
            try:
                if isinstance(adapter, AsyncSend):
                    return await adapter.asend(parent, text, provider_key=key)
                return await asyncio.to_thread(adapter.send, parent, text, provider_key=key)
            finally:
                if isinstance(adapter, HttpPlatform):
                    await adapter.aclose()  # the AsyncClient it made on this loop

        return asyncio.run(main())

    return on_loop


def test_send_created_returns_the_reply_id(harness: Harness, send: Send) -> None:
    """A created reply comes back as Sent with its id, and exactly one reply exists under the parent."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    sent = send(adapter, parent, "here is how", harness.provider_key(adapter, parent.id))
    assert isinstance(sent, Sent) and isinstance(sent.reply_id, str) and sent.reply_id
    assert harness.reply_count(parent.id) == 1


def test_send_lost_response_is_never_not_sent(harness: Harness, send: Send) -> None:
    """The reply landed but its answer was lost: MaybeSent (or Sent after a probe), never a release; one reply."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    harness.fail_next_send("lost")
    try:
        outcome = send(adapter, parent, "here is how", harness.provider_key(adapter, parent.id))
    except MaybeSent:
        outcome = None
    if outcome is not None:  # an adapter may probe and learn the reply's id (Bluesky: getRecord at the rkey)
        assert harness.probes_unclear_sends, f"{outcome} from a send whose answer was lost"
        assert isinstance(outcome, Sent) and outcome.reply_id
    assert harness.reply_count(parent.id) == 1


@pytest.mark.parametrize("fault", ["garbled", "no_id"])
def test_send_unreadable_success_is_never_not_sent(harness: Harness, fault: str, send: Send) -> None:
    """A 2xx whose body is unreadable or lacks the id: MaybeSent (or Sent after a probe), never a release; one reply."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    harness.fail_next_send(fault)
    try:
        outcome = send(adapter, parent, "here is how", harness.provider_key(adapter, parent.id))
    except MaybeSent:
        outcome = None
    if outcome is not None:
        assert harness.probes_unclear_sends, f"{outcome} from a send whose answer was unreadable"
        assert isinstance(outcome, Sent) and outcome.reply_id
    assert harness.reply_count(parent.id) == 1


def test_send_connection_refused_is_definitely_not_sent(harness: Harness, send: Send) -> None:
    """Nothing listening at the server's address: DefinitelyNotSent (not RateLimited), and nothing exists."""
    parent = harness.parent(harness.adapter())
    adapter = harness.unreachable()
    with pytest.raises(DefinitelyNotSent) as err:
        send(adapter, parent, "here is how", harness.provider_key(adapter, parent.id))
    assert not isinstance(err.value, RateLimited)
    assert harness.reply_count(parent.id) == 0


def test_send_refused_is_rejected_and_creates_nothing(harness: Harness, send: Send) -> None:
    """A refusal for good (422 / 400) is Rejected: not retried, not ambiguous; nothing exists."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    harness.fail_next_send("refused")
    with pytest.raises(Rejected):
        send(adapter, parent, "here is how", harness.provider_key(adapter, parent.id))
    assert harness.reply_count(parent.id) == 0


def test_send_rate_limited_is_not_sent_with_the_wait(harness: Harness, send: Send) -> None:
    """A rate-limit answer is RateLimited (a DefinitelyNotSent) carrying the platform's wait; nothing exists."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    harness.fail_next_send("rate_limited")
    with pytest.raises(RateLimited) as err:
        send(adapter, parent, "here is how", harness.provider_key(adapter, parent.id))
    assert isinstance(err.value, DefinitelyNotSent)
    assert RETRY_AFTER_S - 5 <= err.value.retry_after_s <= RETRY_AFTER_S + 5
    assert harness.reply_count(parent.id) == 0


def test_send_5xx_before_acting_is_maybe_sent_then_one_retry_lands_once(harness: Harness, send: Send) -> None:
    """A 5xx may hide a landed reply: MaybeSent, never a release; nothing exists, and the retry makes one."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    key = harness.provider_key(adapter, parent.id)
    harness.fail_next_send("error_before")
    with pytest.raises(MaybeSent) as err:
        send(adapter, parent, "here is how", key)
    assert not isinstance(err.value, DefinitelyNotSent)
    assert harness.reply_count(parent.id) == 0
    sent = send(adapter, parent, "here is how", key)
    assert sent.reply_id
    assert harness.reply_count(parent.id) == 1
