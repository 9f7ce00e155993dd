"""Streamed answers: a responder that yields text as it comes, shown by one post per part and edits.

On the memory platform (both faces, SQLite and PostgreSQL): the first part is posted once when text arrives and
edited as more comes; a part that fills is frozen and the next part answers it; the last edit carries the
final text; a stream cut short (a crash, a failure) leaves its posts, which the next composition edits and
completes, never posting a part twice; an ambiguous part is never edited nor sent again by the stream. Every
count is read on the platform (its replies and their edits). The real-server runs, with SIGKILL, are in
tests/test_stream_sim.py.
"""

from __future__ import annotations

import pytest

from replyd import store as st
from replyd.guard import Status
from replyd.parts import part_id
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Key
from replyd.sweep import Bot, Sweeper
from tests.aio_harness import face  # noqa: F401  (the face fixture: both faces)
from tests.test_parts import _chain  # the bot's replies down the chain, read on the platform

LIMIT = 60
WORDS = [f"w{i:02d}" for i in range(60)]  # 60 words of 3 letters: 239 characters, four or five parts of 60


class Crash(BaseException):
    """Stands for the process dying mid-stream: not an Exception, so no face or core handler catches it."""


class Streamer:
    """A streamed responder: yields ``words`` one at a time, moving the fake clock ``step_s`` before each;
    ``crash_after``: raise Crash after that many words (the process "dies" mid-stream). Counts its calls."""

    def __init__(self, clock, words=WORDS, step_s: float = 0.4, crash_after: int | None = None,
                 fail_after: int | None = None, asynchronous: bool = True) -> None:
        self.clock, self.words, self.step_s = clock, list(words), step_s
        self.crash_after, self.fail_after, self.asynchronous = crash_after, fail_after, asynchronous
        self.calls = 0

    def _chunks(self):
        for i, w in enumerate(self.words):
            if self.crash_after is not None and i == self.crash_after:
                raise Crash
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("the model's stream broke")
            self.clock.advance(self.step_s)
            yield (" " if i else "") + w

    def __call__(self, parent):
        """Start one streamed answer (and count the call)."""
        self.calls += 1
        if not self.asynchronous:
            return self._chunks()

        async def agen():
            for chunk in self._chunks():
                yield chunk

        return agen()


def _text(chain: list[dict]) -> str:
    """The answer as the platform shows it now: the parts' current texts, joined."""
    return " ".join(r["text"] for r in chain)


@pytest.fixture
def world(store, clock, face):
    """A memory platform limited to LIMIT characters, a guard of ``face`` over it (edits at most every 1 s)."""
    plat = MemoryPlatform(clock=clock, post_chars=LIMIT, listing_delay_s=1.0)
    g = face(store, plat, plat.whoami(), clock=clock, send_timeout_s=5.0, watch_interval_s=None,
             compose_lease_s=30.0, stream_edit_interval_s=1.0)
    sweeper = Sweeper(store, [Bot(plat, plat.whoami())], clock=clock, retry_s=1.0)
    return plat, g, sweeper


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async-generator", "generator"])
def test_a_stream_is_one_post_per_part_grown_by_edits_to_the_final_text(world, clock, asynchronous):
    """Each part posted once, in a chain, edited as text came; the final texts are the whole answer."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    responder = Streamer(clock, asynchronous=asynchronous)
    out = g.post(parent, responder)
    assert out.status is Status.POSTED, out
    chain = _chain(plat, "p1")
    assert len(chain) == len(out.parts) >= 4
    assert _text(chain) == " ".join(WORDS)  # the final text, every word once, in order
    assert all(len(r["text"]) <= LIMIT for r in chain)
    assert sum(r["edits"] for r in chain) >= len(chain)  # grown by edits, not re-posted
    assert responder.calls == 1
    assert [p.reply_id for p in out.parts] == [r["reply_id"] for r in chain]
    assert g.store.peek(Key("memory:test", "bot-1", "p1")).state == st.CLOSED


def test_edits_are_throttled_by_the_interval(world, clock):
    """At most one edit of a growing part per ``stream_edit_interval_s`` (plus the freeze and final edits)."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    out = g.post(parent, Streamer(clock, step_s=0.1))  # 60 words in 6 s
    assert out.status is Status.POSTED
    edits = plat.edit_calls
    # 6 s of stream: at most one edit a second of the growing part, one per frozen part, and the final ones.
    assert 0 < edits <= 6 + 2 * len(out.parts), edits


def test_a_stream_cut_by_a_crash_is_edited_and_completed_never_posted_twice(world, clock):
    """A crash mid-stream leaves its parts; the next composition (after the lease) edits them and adds the rest."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    with pytest.raises(Crash):
        g.post(parent, Streamer(clock, crash_after=25))
    before = _chain(plat, "p1")
    assert 1 <= len(before) < 4
    assert g.store.peek(Key("memory:test", "bot-1", "p1")).state == st.COMPOSING
    assert g.post(parent, Streamer(clock)).status is Status.IN_FLIGHT  # the lease still holds
    clock.advance(31.0)
    responder = Streamer(clock)
    out = g.post(parent, responder)
    assert out.status is Status.POSTED, out
    chain = _chain(plat, "p1")
    assert [r["reply_id"] for r in chain[:len(before)]] == [r["reply_id"] for r in before]
    assert _text(chain) == " ".join(WORDS)
    assert responder.calls == 1


def test_a_failed_stream_is_released_and_its_parts_edited_by_the_next_composition(world, clock):
    """A stream that breaks is a responder failure (backoff, no attempt); its posts are reused, not repeated."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    out = g.post(parent, Streamer(clock, fail_after=30))
    assert out.status is Status.NOT_SENT and out.state == st.RELEASED
    first = _chain(plat, "p1")
    assert first and [p.reply_id for p in out.parts] == [r["reply_id"] for r in first]  # reported honestly
    assert "shown before the stream stopped" in out.detail
    clock.advance(out.retry_after_s + 1)
    out = g.post(parent, Streamer(clock))
    assert out.status is Status.POSTED
    chain = _chain(plat, "p1")
    assert chain[0]["reply_id"] == first[0]["reply_id"] and _text(chain) == " ".join(WORDS)


def test_an_ambiguous_part_is_neither_edited_nor_resent_and_the_sweep_resumes_it(world, clock):
    """Part 1's answer lost: no edit of an unknown reply, no second post; the sweep closes it, a re-offer
    edits it to its final text and sends the rest."""
    plat, g, sweeper = world
    parent = plat.add_parent("p1")
    plat.script = ["lost"]
    out = g.post(parent, Streamer(clock))
    assert out.state == st.PARTS and not out.sent
    assert len(_chain(plat, "p1")) == 1 and plat.edit_calls == 0
    clock.advance(10.0)
    sweeper.run_once()
    assert g.store.peek(Key("memory:test", "bot-1", part_id("p1", 1))).state == st.CLOSED
    out = g.post(parent, Streamer(clock))
    assert out.status is Status.POSTED, out
    chain = _chain(plat, "p1")
    assert _text(chain) == " ".join(WORDS) and chain[0]["edits"] == 1


def test_a_failed_final_edit_keeps_the_answer_open_until_an_edit_lands(world, clock):
    """The final text must be shown: edits failing three times leave the answer in ``parts``; the next
    offer edits again and closes it."""
    plat, g, sweeper = world
    parent = plat.add_parent("p1")
    plat.script = ["lost"]
    g.post(parent, Streamer(clock))
    clock.advance(10.0)
    sweeper.run_once()
    plat.edit_script = ["error_before"] * 3
    out = g.post(parent, Streamer(clock))
    assert out.state == st.PARTS and "edit failed" in out.detail
    out = g.post(parent, Streamer(clock))
    assert out.status is Status.POSTED and _text(_chain(plat, "p1")) == " ".join(WORDS)


def test_a_refused_edit_is_noted_and_the_answer_goes_on(world, clock):
    """A platform refusing an edit (the reply deleted) ends that part's edits; the other parts are sent."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    plat.edit_script = ["rejected"] * 100
    out = g.post(parent, Streamer(clock))
    assert out.status is Status.POSTED
    chain = _chain(plat, "p1")
    assert len(chain) == len(out.parts)
    assert any(e.kind == "edit_refused" for e in g.store.history(Key("memory:test", "bot-1", part_id("p1", 1))))


class NoEdits(MemoryPlatform):
    """The memory platform without ``EditReply`` (as Bluesky): streams are drained and sent as parts."""

    edit = None  # type: ignore[assignment]


def test_without_edits_the_stream_is_sent_whole_when_it_ends(store, clock, face):
    """A platform that cannot edit gets the parts when the stream ends: one post per part, no edit."""
    plat = NoEdits(clock=clock, post_chars=LIMIT, listing_delay_s=1.0)
    g = face(store, plat, plat.whoami(), clock=clock, send_timeout_s=5.0, watch_interval_s=None)
    parent = plat.add_parent("p1")
    out = g.post(parent, Streamer(clock))
    assert out.status is Status.POSTED
    chain = _chain(plat, "p1")
    assert _text(chain) == " ".join(WORDS) and all(r["edits"] == 0 for r in chain)


def test_an_empty_stream_declines(world, clock):
    """A stream that yields nothing but blanks is a decline: nothing posted."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    out = g.post(parent, Streamer(clock, words=["", " "]))
    assert out.status is Status.DECLINED and _chain(plat, "p1") == []


def test_a_runaway_stream_is_cut_at_the_most_parts_an_answer_may_have(world, clock):
    """A stream that never ends posts at most MAX_PARTS parts, then stops reading it; the answer closes."""
    from replyd.parts import MAX_PARTS

    plat, g, _ = world
    parent = plat.add_parent("p1")
    words = [f"w{i:04d}" for i in range(MAX_PARTS * 20)]  # 20 words of 5 letters a part of 60: far too many
    out = g.post(parent, Streamer(clock, words=words, step_s=0.0))
    assert out.status is Status.POSTED and len(out.parts) == MAX_PARTS
    assert len(_chain(plat, "p1")) == MAX_PARTS


def test_a_cut_stream_finished_by_a_plain_text_composition_edits_its_part(world, clock):
    """The composition after a cut stream returns plain text that fits one post: it edits the part the stream
    posted (the answer goes on in parts), never a second reply to the parent."""
    plat, g, _ = world
    parent = plat.add_parent("p1")
    with pytest.raises(Crash):
        g.post(parent, Streamer(clock, crash_after=5))
    [first] = _chain(plat, "p1")
    clock.advance(31.0)
    out = g.post(parent, lambda p: "a short answer after all")
    assert out.status is Status.POSTED, out
    [part] = _chain(plat, "p1")
    assert part["reply_id"] == first["reply_id"] and part["text"] == "a short answer after all"
