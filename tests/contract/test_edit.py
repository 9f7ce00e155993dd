"""Adapter contract for ``EditReply`` (for streamed answers): an edit replaces the bot's reply's text,
never adds a reply; doing it again (after a lost answer) is harmless; a failure maps into the error tree.

Runs on every adapter whose class offers ``EditReply`` (``FEATURE``); the text and the reply count are read on
the platform's side (``Harness.reply_text``, ``Harness.reply_count``).
"""

from __future__ import annotations

import pytest

from replyd.errors import DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.platforms.base import EditReply, Pending
from tests.contract.harnesses import Harness

FEATURE = EditReply


def _sent(harness: Harness):
    """A fresh adapter, a parent and the bot's reply to it (the platform's own count: one)."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    sent = adapter.send(parent, "first words", provider_key=harness.provider_key(adapter, parent.id))
    assert harness.reply_count(parent.id) == 1
    return adapter, parent, sent


def test_edit_replaces_the_text_and_again_is_the_same(harness: Harness) -> None:
    """After an edit the reply shows the new text and is still the one reply; the same edit again changes
    nothing (an edit sets the whole text)."""
    adapter, parent, sent = _sent(harness)
    adapter.edit(parent, sent.reply_id, "first words and the rest")
    assert "first words and the rest" in harness.reply_text(sent.reply_id)
    adapter.edit(parent, sent.reply_id, "first words and the rest")
    assert "first words and the rest" in harness.reply_text(sent.reply_id)
    assert harness.reply_count(parent.id) == 1


@pytest.mark.parametrize("fault", ["lost", "error_before"])
def test_an_edit_whose_answer_is_unknown_is_safe_to_repeat(harness: Harness, fault: str) -> None:
    """A lost answer (the edit was done) or a 5xx is an error of the tree; the edit repeated shows the text,
    and the reply is still one."""
    adapter, parent, sent = _sent(harness)
    harness.fail_next_edit(fault)
    with pytest.raises((MaybeSent, DefinitelyNotSent)):
        adapter.edit(parent, sent.reply_id, "second text")
    assert harness.faults_met()
    adapter.edit(parent, sent.reply_id, "second text")
    assert "second text" in harness.reply_text(sent.reply_id)
    assert harness.reply_count(parent.id) == 1


def test_a_rate_limited_edit_says_how_long_to_wait(harness: Harness) -> None:
    """A 429 on an edit is ``RateLimited`` with the platform's wait."""
    adapter, parent, sent = _sent(harness)
    harness.fail_next_edit("rate_limited")
    with pytest.raises(RateLimited) as err:
        adapter.edit(parent, sent.reply_id, "later text")
    assert err.value.retry_after_s is not None and err.value.retry_after_s > 0
    assert "first words" in harness.reply_text(sent.reply_id)


def test_an_edit_of_a_deleted_reply_is_rejected(harness: Harness) -> None:
    """The reply is gone: the edit is ``Rejected`` (the guard stops editing it), nothing is created."""
    adapter, parent, sent = _sent(harness)
    adapter.delete(sent.reply_id)
    with pytest.raises(Rejected):
        adapter.edit(parent, sent.reply_id, "too late")
    assert harness.reply_count(parent.id) == 0


def test_an_edited_reply_is_read_back_as_the_one_reply(harness: Harness) -> None:
    """Read-back finds the edited reply under its parent, by its id, once (an edit is not a second reply)."""
    adapter, parent, sent = _sent(harness)
    opened = harness.clock.now()
    adapter.edit(parent, sent.reply_id, "edited once")
    adapter.edit(parent, sent.reply_id, "edited twice")
    key = harness.provider_key(adapter, parent.id)
    harness.clock.advance(5)
    me = adapter.whoami().sender_id
    try:
        rb = harness.eventually(lambda: adapter.read_back([Pending(parent, opened - 5, provider_key=key)],
                                                          sender_id=me),
                                lambda rb: parent.id in rb.found)
    except PlatformError as exc:  # pragma: no cover  (a read-back failure is the case failing, said plainly)
        pytest.fail(f"read-back failed: {exc}")
    assert [r.reply_id for r in rb.found[parent.id]] == [sent.reply_id]
