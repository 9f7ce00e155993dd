"""Adapter contract: inbox and search cursors move forward: every new parent once, none again from the last cursor."""

from __future__ import annotations

from replyd.platforms.base import Page, Platform
from tests.contract.harnesses import Harness, Post, tag

NEW_POSTS = 3
MAX_POLLS = 8


def _follow(fetch, cursor: str | None, want: set[str], harness: Harness) -> tuple[list[str], str | None]:
    """Poll ``fetch(cursor)`` until every wanted id was offered and a page offered none of them; return all offered."""
    offered: list[str] = []
    for _ in range(MAX_POLLS if not harness.patience_s else MAX_POLLS * 4):
        page = fetch(cursor)
        assert isinstance(page, Page)
        ids = [p.id for p in page.parents]
        offered += ids
        cursor = page.cursor if page.cursor is not None else cursor
        if want <= set(offered) and not want & set(ids):
            break
    return offered, cursor


def _new_posts(harness: Harness, word: str) -> list[Post]:
    posts = [harness.post(f"{word} question {i}") for i in range(NEW_POSTS)]
    harness.settle(posts)
    return posts


def _check(adapter: Platform, fetch, harness: Harness, word: str, backstop=None) -> None:
    # A first poll on a platform with something to find: the cursor it returns is the starting point.
    seed = harness.post(f"{word} first question")
    harness.settle([seed])
    start = harness.eventually(lambda: fetch(None), lambda page: page.cursor is not None).cursor
    since = harness.clock.now() - 60
    posts = _new_posts(harness, word)
    want = {p.id for p in posts}
    offered, cursor = _follow(fetch, start, want, harness)
    missed = want - set(offered)
    if missed and backstop is not None:
        # A cursor may jump a gap wider than its page budget when the path has a backstop that reads it again.
        missed -= {p.id for p in backstop(since)}
    assert not missed, f"never offered: {missed}"
    ours = [i for i in offered if i in want]
    assert len(ours) == len(set(ours)), f"offered twice across cursors: {ours}"
    assert not want & {p.id for p in fetch(cursor).parents}


def test_inbox_cursor_moves_forward(harness: Harness) -> None:
    """Mentions made after a poll come from its cursor over small pages (or the re-find backstop), each once; the last cursor offers none."""
    adapter = harness.adapter(**harness.small_pages)
    # The backstop is the bot's re-find with its usual page budget (the small one is the inbox's under test).
    _check(adapter, adapter.inbox, harness, tag(), backstop=harness.adapter().refind)


def test_search_cursor_moves_forward(harness: Harness) -> None:
    """Posts matching a query made after a search come from its cursor, each once; the last cursor offers none."""
    adapter = harness.adapter(**harness.small_pages)
    word = tag()
    _check(adapter, lambda cursor: adapter.search(word, cursor), harness, word)
