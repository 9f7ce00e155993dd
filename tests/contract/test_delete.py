"""Adapter contract: delete removes the bot's own reply, and a reply already gone counts as deleted."""

from __future__ import annotations

from replyd.platforms.base import Pending
from tests.contract.harnesses import Harness


def test_delete_removes_the_reply_and_twice_is_done(harness: Harness) -> None:
    """After delete no reply is left and read-back finds none; deleting it again raises nothing (gone = done)."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    opened = harness.clock.now()
    key = harness.provider_key(adapter, parent.id)
    sent = adapter.send(parent, "one too many", provider_key=key)
    assert harness.reply_count(parent.id) == 1
    adapter.delete(sent.reply_id)
    assert harness.reply_count(parent.id) == 0
    adapter.delete(sent.reply_id)
    assert harness.reply_count(parent.id) == 0
    me = adapter.whoami().sender_id
    rb = harness.eventually(lambda: adapter.read_back([Pending(parent, opened, provider_key=key)], sender_id=me),
                            lambda rb: parent.id in rb.checked and parent.id not in rb.found)
    assert parent.id in rb.checked and parent.id not in rb.found


def test_delete_meeting_not_found_is_done(harness: Harness) -> None:
    """A delete answered with the platform's 404 is done, not an error (the reply is already gone)."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    sent = adapter.send(parent, "one too many", provider_key=harness.provider_key(adapter, parent.id))
    harness.answer_next_delete_gone()
    adapter.delete(sent.reply_id)
    assert harness.faults_met(), "the delete met the injected 'not found'"
