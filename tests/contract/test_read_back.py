"""Adapter contract: read-back finds own replies, says which parents it looked at conclusively, and no more."""

from __future__ import annotations

import re

import pytest

from replyd.errors import MaybeSent, PlatformError
from replyd.platforms.base import ParentReplies, Parent, Pending, Platform, ReadBack
from tests.contract.harnesses import Harness


def _pending(harness: Harness, adapter: Platform, parent: Parent, opened_at: float) -> Pending:
    return Pending(parent, opened_at, provider_key=harness.provider_key(adapter, parent.id))


def _answer(harness: Harness, adapter: Platform, parent: Parent) -> str:
    return adapter.send(parent, "here is how", provider_key=harness.provider_key(adapter, parent.id)).reply_id


def _lost_answer(harness: Harness, adapter: Platform, parent: Parent) -> None:
    """Answer ``parent`` with the send's response lost on the way back (the reply exists on the platform)."""
    harness.fail_next_send("lost")
    try:
        adapter.send(parent, "here is how", provider_key=harness.provider_key(adapter, parent.id))
    except MaybeSent:
        pass
    assert harness.reply_count(parent.id) == 1


def test_read_back_found_after_a_lost_response(harness: Harness) -> None:
    """A reply whose answer was lost is found under its parent, and that parent counts as checked."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    opened = harness.clock.now()
    _lost_answer(harness, adapter, parent)
    me = adapter.whoami().sender_id
    rb = harness.eventually(lambda: adapter.read_back([_pending(harness, adapter, parent, opened)], sender_id=me),
                            lambda rb: parent.id in rb.found)
    assert isinstance(rb, ReadBack)
    assert parent.id in rb.checked
    assert len(rb.found[parent.id]) == 1
    assert rb.found[parent.id][0].parent_id == parent.id


def test_read_back_found_is_the_sent_reply_oldest_first(harness: Harness) -> None:
    """A sent reply is found by the id send returned; found lists only asked-for parents."""
    adapter = harness.adapter()
    parent, other = harness.parent(adapter), harness.parent(adapter)
    opened = harness.clock.now()
    reply_id = _answer(harness, adapter, parent)
    me = adapter.whoami().sender_id
    pending = [_pending(harness, adapter, parent, opened), _pending(harness, adapter, other, opened)]
    rb = harness.eventually(lambda: adapter.read_back(pending, sender_id=me), lambda rb: parent.id in rb.found)
    assert [r.reply_id for r in rb.found[parent.id]] == [reply_id]
    assert set(rb.found) == {parent.id}


def test_read_back_not_found_is_checked_without_replies(harness: Harness) -> None:
    """A parent with no reply is checked (the listing reached back to its opening) and absent from found."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    opened = harness.clock.now()
    me = adapter.whoami().sender_id
    rb = harness.eventually(lambda: adapter.read_back([_pending(harness, adapter, parent, opened)], sender_id=me),
                            lambda rb: parent.id in rb.checked)
    assert parent.id in rb.checked
    assert parent.id not in rb.found


def test_read_back_partial_checks_only_what_was_read(harness: Harness) -> None:
    """When the reads about one parent fail, that parent is not checked; the other is, with its reply."""
    adapter = harness.adapter()
    broken, fine = harness.parent(adapter, place=1), harness.parent(adapter, place=2)
    opened = harness.clock.now()
    reply_id = _answer(harness, adapter, fine)
    _answer(harness, adapter, broken)
    me = adapter.whoami().sender_id
    harness.break_reads(broken)
    pending = [_pending(harness, adapter, broken, opened), _pending(harness, adapter, fine, opened)]
    rb = harness.eventually(lambda: adapter.read_back(pending, sender_id=me), lambda rb: fine.id in rb.found)
    assert broken.id not in rb.checked
    assert broken.id not in rb.found
    assert fine.id in rb.checked
    assert [r.reply_id for r in rb.found[fine.id]] == [reply_id]


@pytest.mark.parametrize("failure", ["5xx", "unreachable"])
def test_read_back_failed_checks_nothing(harness: Harness, failure: str) -> None:
    """When every read fails (5xx, or no server), read-back raises a PlatformError or checks nothing: never "not found"."""
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    opened = harness.clock.now()
    me = adapter.whoami().sender_id
    if failure == "5xx":
        harness.break_reads(None)
    else:
        adapter = harness.unreachable()
    try:
        rb = adapter.read_back([_pending(harness, adapter, parent, opened)], sender_id=me)
    except PlatformError:
        return
    assert rb.checked == set()
    assert rb.found == {}


def test_read_parents_finds_the_reply_without_the_own_feed(harness: Harness) -> None:
    """``ParentReplies``: a reply whose answer was lost is found by its parent's own listing, and checked."""
    adapter = harness.adapter()
    if not isinstance(adapter, ParentReplies):
        pytest.skip(f"{harness.kind}: the adapter has no per-parent read (ParentReplies)")
    parent, other = harness.parent(adapter), harness.parent(adapter)
    opened = harness.clock.now()
    _lost_answer(harness, adapter, parent)
    me = adapter.whoami().sender_id
    pending = [_pending(harness, adapter, parent, opened), _pending(harness, adapter, other, opened)]
    paths: list[str] = []
    hooks = getattr(harness, "http", None)
    if hooks is not None:
        hooks.event_hooks["request"].append(lambda req: paths.append(req.url.path))
    try:
        rb = harness.eventually(lambda: adapter.read_parents(pending, sender_id=me),
                                lambda rb: parent.id in rb.found and other.id in rb.checked)
    finally:
        if hooks is not None:
            hooks.event_hooks["request"].pop()
    assert len(rb.found[parent.id]) == 1 and parent.id in rb.checked
    assert other.id not in rb.found
    feed = FEED_PATHS.get(harness.kind)
    assert feed is None or not [p for p in paths if re.search(feed, p)], paths  # no own-feed walk


# The own-feed listing of each adapter that has one: read_parents must not read it.
FEED_PATHS = {"mastodon": r"/accounts/[^/]+/statuses$", "discourse": r"/user_actions", "github": r"/issues/comments$",
              "bluesky": r"getAuthorFeed"}
