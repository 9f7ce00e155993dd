"""Answers in several parts: the split, and the guard's walk of the parts on both faces and databases.

The answer is composed once and stored before its first part leaves; each part has its own key (the parent id
as served plus the part number) and is claimed, sent and closed as any reply is; part k+1 answers part k. The
replies are counted on the platform (the memory platform's own list), never from replyd's log. The crash and
lost-answer runs on real servers are in tests/test_parts_sim.py and tests/test_bluesky_network.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from replyd import store as st
from replyd.guard import Guard, Status
from replyd.parts import Limit, graphemes, length, part_id, split
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Key
from replyd.sweep import Bot, Sweeper
from tests.aio_harness import face  # noqa: F401  (the face fixture: both faces)

LIMIT = 60
URL = "https://example.org/a/rather/long/path/to/a/page?with=query&and=more"


# -- the split ------------------------------------------------------------------------------------


def test_a_text_that_fits_is_one_part_unchanged():
    """A text within the limit is one part, exactly as given."""
    assert split("  short answer ", Limit(LIMIT)) == ["short answer"]


def test_parts_keep_words_and_urls_whole_and_in_order():
    """Every part is within the limit, no word or URL is cut, and the parts are the text's words in order."""
    text = " ".join(["word"] * 30 + [URL] + ["more"] * 20)
    parts = split(text, Limit(80))
    assert len(parts) > 2
    assert all(len(p) <= 80 for p in parts)
    assert " ".join(parts).split() == text.split()
    assert sum(URL in p for p in parts) == 1


def test_sentences_are_preferred_to_spaces():
    """A cut falls after a sentence when one is in reach (not in the first third of the part)."""
    text = "First sentence is here and is long. " + "Second one follows with more words in it. " * 3
    parts = split(text, Limit(LIMIT))
    assert all(p.endswith(".") for p in parts)


def test_a_word_longer_than_a_post_is_cut_inside():
    """Only a word longer than a whole post is cut inside it."""
    parts = split("x" * 130, Limit(LIMIT))
    assert [len(p) for p in parts] == [60, 60, 10]


def test_graphemes_are_counted_as_bluesky_counts_them():
    """An accented letter, a skin-toned emoji, a flag and a family sequence are one grapheme each."""
    assert graphemes("e\u0301👍🏽🇫🇷👨\u200d👩\u200d👧") == ["e\u0301", "👍🏽", "🇫🇷", "👨\u200d👩\u200d👧"]
    text = "👍🏽 " * 40
    assert len(split(text, Limit(30, "graphemes"))) == 3  # 80 graphemes; by code points it would be 5+
    assert all(length(p, "graphemes") <= 30 for p in split(text, Limit(30, "graphemes")))


def test_the_marker_is_off_by_default_and_counted_when_on():
    """"(k/n)" is added only when asked, and counted in the part's length."""
    text = "word " * 40
    assert not any("(1/" in p for p in split(text, Limit(LIMIT)))
    marked = split(text, Limit(LIMIT, marker=True))
    assert marked[0].endswith(f"(1/{len(marked)})") and all(len(p) <= LIMIT for p in marked)


@settings(max_examples=200, deadline=None)
@given(hs.text(alphabet=hs.sampled_from(list("ab cd.\n\u0301👍")), max_size=600), hs.integers(20, 120))
def test_any_text_splits_within_the_limit_losing_nothing_but_cut_whitespace(text, size):
    """Property: each part within the limit and not blank; the parts are the text minus whitespace at cuts."""
    parts = split(text, Limit(size, "graphemes"))
    if not text.strip():
        assert parts == [""]
        return
    assert all(p and length(p, "graphemes") <= size for p in parts)
    assert "".join("".join(p.split()) for p in parts) == "".join(text.split())


@settings(max_examples=300, deadline=None)
@given(hs.text(alphabet=hs.sampled_from(list("ab c.\n😀🇫é")), max_size=500), hs.integers(20, 90))
def test_utf16_parts_are_within_the_limit_in_utf16_units(text, size):
    """Property (Telegram counts UTF-16 code units): no part over ``size`` units, an astral emoji never split
    in two, nothing lost but whitespace at cuts."""
    parts = split(text, Limit(size, "utf16"))
    if not text.strip():
        return
    assert all(p and len(p.encode("utf-16-le")) // 2 <= size for p in parts)
    assert all(p.encode("utf-16-le").decode("utf-16-le") == p for p in parts)  # no lone surrogate half
    assert "".join("".join(p.split()) for p in parts) == "".join(text.split())


def test_utf16_gives_a_plain_text_the_whole_room_and_an_emoji_two_units():
    """A plain answer's part is the whole limit; one of emoji beyond the BMP, half of it."""
    assert [len(p) for p in split("a" * 100, Limit(40, "utf16"))] == [40, 40, 20]
    assert [len(p) for p in split("😀" * 50, Limit(40, "utf16"))] == [20, 20, 10]
    odd = split("😀" * 50, Limit(41, "utf16"))  # a cut at 41 units would fall between an emoji's two halves
    assert all(len(p.encode("utf-16-le")) // 2 <= 41 for p in odd) and "".join(odd) == "😀" * 50


# -- the guard ------------------------------------------------------------------------------------


def _chain(plat: MemoryPlatform, parent_id: str) -> list[dict]:
    """The bot's replies from ``parent_id`` down the chain (part k+1 answers part k), read on the platform."""
    out, at = [], parent_id
    while True:
        kids = [r for r in plat.replies() if r["parent_id"] == at and r["sender_id"] == plat.sender_id]
        assert len(kids) <= 1, f"{len(kids)} own replies to {at}"
        if not kids:
            return out
        out.append(kids[0])
        at = kids[0]["reply_id"]


class Counting:
    """A responder returning ``text``, counting its calls."""

    def __init__(self, text: str) -> None:
        self.text, self.calls = text, 0

    def __call__(self, parent):
        """Answer (and count the call)."""
        self.calls += 1
        return self.text


@pytest.fixture
def world(store, clock, face):
    """A memory platform limited to LIMIT characters, a guard of ``face`` over it and a sweeper."""
    plat = MemoryPlatform(clock=clock, post_chars=LIMIT, listing_delay_s=1.0)
    g = face(store, plat, plat.whoami(), clock=clock, send_timeout_s=5.0, watch_interval_s=None)
    sweeper = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, retry_s=1.0)
    return plat, g, sweeper


TEXT = " ".join(f"Sentence number {i} is in this answer." for i in range(8))


def test_a_long_answer_goes_out_in_parts_each_once_in_a_chain(world, store):
    """One responder call, the stored parts sent in order as a chain, each under its own key; the parent's row
    closes with the first part's reply and a second post sends nothing."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    r = Counting(TEXT)
    out = g.post(parent, r)
    expected = split(TEXT, Limit(LIMIT))
    assert out.status is Status.POSTED and len(expected) > 2
    assert [p.state for p in out.parts] == [st.CLOSED] * len(expected)
    chain = _chain(plat, "p1")
    assert [c["text"] for c in chain] == expected == store.answer(g.key("p1"))
    assert out.reply_id == chain[0]["reply_id"] and [p.reply_id for p in out.parts] == [c["reply_id"] for c in chain]
    keys = {c["provider_key"] for c in chain}
    assert len(keys) == len(chain)  # plant: one provider key for every part
    head = store.peek(g.key("p1"))
    assert head.state == st.CLOSED and head.reply_id == chain[0]["reply_id"]
    again = g.post(parent, r)
    assert again.status is Status.ALREADY_ANSWERED and r.calls == 1 and len(plat.replies()) == len(expected)


def test_each_part_has_its_own_key_derived_from_the_parents(world, store):
    """The parts' rows are keyed parent id + part number, each closed with its own reply."""
    plat, g, _ = world
    g.post(plat.add_parent("p2"), TEXT)
    n = len(split(TEXT, Limit(LIMIT)))
    rows = [store.peek(Key(plat.instance, plat.sender_id, part_id("p2", k))) for k in range(1, n + 1)]
    assert all(r is not None and r.state == st.CLOSED for r in rows)
    assert len({r.reply_id for r in rows}) == n
    assert all(r.path == st.PART_PATH for r in rows)


def test_a_lost_part_is_closed_by_the_sweep_and_the_answer_resumes_after_it(world, store, clock):
    """Part 2's answer lost: the walk stops there (uncertain); the sweep finds it on the platform and closes it;
    the next offer sends parts 3.. without calling the responder or sending part 2 again."""
    plat, g, sweeper = world
    parent = plat.add_parent("p3")
    plat.script = ["ok", "lost"]
    r = Counting(TEXT)
    out = g.post(parent, r)
    assert out.status is Status.UNCERTAIN and out.state == st.PARTS
    assert [p.state for p in out.parts[:2]] == [st.CLOSED, st.OPEN] and all(p.state is None for p in out.parts[2:])
    assert "1 of" in out.detail
    # Before the sweep: the part that may have landed blocks the walk; it is never sent again.
    waiting = g.post(parent, r)
    assert waiting.status is Status.IN_FLIGHT and waiting.state == st.PARTS and len(plat.replies()) == 2
    clock.advance(10)
    sweeper.run_once()
    done = g.post(parent, r)
    assert done.status is Status.POSTED and done.state == st.CLOSED
    assert r.calls == 1
    assert [c["text"] for c in _chain(plat, "p3")] == split(TEXT, Limit(LIMIT))
    assert len(plat.replies()) == len(done.parts)


def test_a_part_proven_not_landed_gets_its_one_retry(world, store, clock):
    """Part 2 fails ambiguously without creating anything (a 502): the sweep proves it not landed, the next
    offer sends it again (attempt 2) and the answer completes, every part once."""
    plat, g, sweeper = world
    parent = plat.add_parent("p4")
    plat.script = ["ok", "error_before"]
    r = Counting(TEXT)
    assert g.post(parent, r).status is Status.UNCERTAIN
    clock.advance(10)
    assert sweeper.run_once().not_landed == 1
    assert g.post(parent, r).status is Status.POSTED
    p2 = store.peek(g.key(part_id("p4", 2)))
    assert p2.state == st.CLOSED and p2.attempt == 2
    assert [c["text"] for c in _chain(plat, "p4")] == split(TEXT, Limit(LIMIT)) and r.calls == 1


def test_a_rejected_part_ends_the_answer_rejected(world, store):
    """A part the platform refuses ends the parent's row rejected (an operator rearms it), parts before it kept."""
    plat, g, _ = world
    plat.script = ["ok", "rejected"]
    out = g.post(plat.add_parent("p5"), TEXT)
    assert out.status is Status.REJECTED
    assert store.peek(g.key("p5")).state == st.REJECTED
    assert [p.state for p in out.parts[:2]] == [st.CLOSED, st.REJECTED]


def test_check_lets_a_post_resume_an_answer_in_parts(world, store):
    """``check`` does not block an answer in parts (a post resumes it) and blocks it once it is closed."""
    plat, g, _ = world
    plat.script = ["ok", "lost"]
    parent = plat.add_parent("p6")
    g.post(parent, TEXT)
    assert store.peek(g.key("p6")).state == st.PARTS
    assert g.check("p6") is None


def test_an_answer_in_parts_is_offered_again_but_never_a_part_itself(world, store, clock):
    """Re-find's page of waiting rows holds the parent's row (parts), never a part's own row."""
    plat, g, _ = world
    plat.script = ["ok", "rejected"]
    g.post(plat.add_parent("p7"), TEXT)  # rejected: terminal, not offered
    plat.script = ["ok", "not_sent"]
    g.post(plat.add_parent("p8"), TEXT)  # part 2 released: waits; the parent's row is in parts
    rows = store.reoffer_due(plat.instance, plat.sender_id, now=clock.now() + 100, after=None, limit=50)
    assert [r.parent_id for r in rows] == ["p8"]


def test_a_platform_without_a_limit_sends_one_post(store, clock, face):
    """No PostLimit (or no limit set): the answer is one post, whatever its length, as before."""
    plat = MemoryPlatform(clock=clock)
    g = face(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    out = g.post(plat.add_parent("q1"), TEXT)
    assert out.status is Status.POSTED and not out.parts and len(plat.replies()) == 1


def test_the_compose_lease_api_sends_a_long_text_in_parts(world, store):
    """begin / finish (the library's compose lease) with a long text: stored under the lease, sent in parts."""
    plat, g, _ = world
    if isinstance(g, Guard):
        from replyd import library

        lease = library.begin(g, plat.add_parent("p9"), owner="agent")
        out = library.finish(g, lease, TEXT)
    else:
        lease = g.begin(plat.add_parent("p9"), owner="agent")
        out = g.finish(lease, TEXT)
    assert out.status is Status.POSTED and len(out.parts) == len(split(TEXT, Limit(LIMIT)))
    assert [c["text"] for c in _chain(plat, "p9")] == split(TEXT, Limit(LIMIT))


def test_explain_and_status_show_which_parts_landed(tmp_path, clock):
    """``replyd explain --json`` lists a partly sent answer's parts: text, state and reply of each (the first
    closed, the second open after a lost answer, the rest not claimed); ``replyd status --json`` lists the
    answer among those being sent in parts, with the parts that landed."""
    import json
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'r.sqlite3'}"
    store = st.Store.open(url, clock=clock)
    plat = MemoryPlatform(clock=clock, post_chars=LIMIT, script=["ok", "lost"])
    g = Guard(store, plat, plat.whoami(), clock=clock, watch_interval_s=None)
    g.post(plat.add_parent("px"), TEXT)
    store.dispose()
    r = subprocess.run([sys.executable, "-m", "replyd", "explain", "px", "--store", url, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)[0]
    assert doc["row"]["state"] == st.PARTS
    parts = doc["parts"]
    assert [p["text"] for p in parts] == split(TEXT, Limit(LIMIT))
    assert [p["state"] for p in parts[:2]] == [st.CLOSED, st.OPEN] and {p["state"] for p in parts[2:]} == {None}
    assert parts[0]["reply_id"] == plat.replies()[0]["reply_id"]
    r = subprocess.run([sys.executable, "-m", "replyd", "status", "--store", url, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    partial = json.loads(r.stdout)["in_parts"]
    assert partial == [{"platform": plat.instance, "parent_id": "px", "parts": len(parts), "landed": [1],
                        "states": [st.CLOSED, st.OPEN] + [None] * (len(parts) - 2)}]


def test_a_retry_of_a_one_post_answer_sends_the_stored_text_without_composing(world, store, clock):
    """A composed answer in one post is stored with its open row: its retry (proven not landed) sends the same
    text and the responder is not called again (plant: a retry that re-composes)."""
    plat, g, sweeper = world
    plat.post_chars = None  # one post, whatever its length
    parent = plat.add_parent("one")
    plat.script = ["error_before"]
    r = Counting("the answer, composed once")
    assert g.post(parent, r).status is Status.UNCERTAIN
    clock.advance(10)
    assert sweeper.run_once().not_landed == 1
    r.text = "a different answer: the responder must not be asked"
    out = g.post(parent, r)
    assert out.status is Status.POSTED and out.attempt == 2 and r.calls == 1
    assert [x["text"] for x in plat.replies()] == ["the answer, composed once"]
