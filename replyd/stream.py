"""Streamed answers: a responder that yields its text as it comes (an LLM's tokens), and how a face reads it.

A responder may return an async iterator of text (an ``async def`` generator), or a plain iterator of text,
instead of the text itself. Where the platform can edit a reply (``platforms.base.EditReply``) the guard posts
the first part once there is text, then grows that reply by edits as text arrives (at most one edit per
``GuardCore.stream_edit_interval_s``); a part that fills is frozen and the next part is posted answering it.
Where it cannot (Bluesky), the face drains the stream and the answer is sent as any composed answer.

The rules that keep it exactly once (``core.GuardCore._stream_steps``): every part is a row of its own
(``parts.part_id``), claimed, sent and closed as any part; an edit only ever targets a part's closed reply
(an edit sets the whole text, so repeating one is harmless); a part whose send is ambiguous is never edited
and never sent again by the stream: the stream goes on to its end, the answer is stored, and the parts walk
resumes once the sweep judged that part. A stream cut short (a crash, a failure) leaves the parent's row
``composing``; its next offer composes again and edits the parts already posted, never posting them again.

This module holds the face-side plumbing: recognising a stream, pulling its next chunk within a timeout, and
draining it into one text, for the sync face (on the shared responder loop) and the async face (on its own).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from dataclasses import dataclass

from replyd.errors import ResponderError

__all__ = ["Stream", "aclose", "adrain", "apull", "as_stream", "close", "drain", "pull"]


@dataclass(eq=False)
class Stream:
    """A responder's streamed answer: the iterator, async or not, the face pulls text from."""

    source: AsyncIterator[object] | Iterator[object]

    @property
    def is_async(self) -> bool:
        """True for an async iterator (pulled on an event loop)."""
        return isinstance(self.source, AsyncIterator)


def as_stream(value: object) -> Stream | None:
    """``value`` as a Stream when a responder returned one (an async iterator, or an iterator not a string)."""
    if isinstance(value, AsyncIterator | Iterator) and not isinstance(value, str | bytes):
        return Stream(value)
    return None


def _chunk(value: object) -> str:
    """One chunk of a stream as text, or a one-line ResponderError."""
    if isinstance(value, str):
        return value
    raise ResponderError(f"a streamed answer yielded {type(value).__name__}, expected text")


_END = object()


async def apull(stream: Stream, timeout_s: float) -> str | None:
    """The stream's next chunk, None at its end; a ResponderError if none came within ``timeout_s``."""
    source = stream.source
    try:
        if isinstance(source, AsyncIterator):  # stream.is_async, written out so the type narrows
            value = await asyncio.wait_for(anext(source, _END), timeout_s)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(next, source, _END), timeout_s)
    except TimeoutError:
        raise ResponderError(f"a streamed answer sent nothing for {timeout_s:g} s") from None
    return None if value is _END else _chunk(value)


def pull(stream: Stream, timeout_s: float) -> str | None:
    """``apull`` from a thread that has no loop: an async stream is read on the shared responder loop."""
    source = stream.source
    if not isinstance(source, AsyncIterator):  # not stream.is_async, written out so the type narrows
        value = next(source, _END)
        return None if value is _END else _chunk(value)
    from replyd.responders.base import responder_loop

    future = asyncio.run_coroutine_threadsafe(apull(stream, timeout_s), responder_loop())
    return future.result()


async def adrain(stream: Stream, timeout_s: float) -> str:
    """The whole text of a stream (for a platform that cannot edit): every chunk, each within ``timeout_s``."""
    parts: list[str] = []
    while (chunk := await apull(stream, timeout_s)) is not None:
        parts.append(chunk)
    return "".join(parts)


def drain(stream: Stream, timeout_s: float) -> str:
    """``adrain`` from a thread that has no loop."""
    parts: list[str] = []
    while (chunk := pull(stream, timeout_s)) is not None:
        parts.append(chunk)
    return "".join(parts)


async def aclose(stream: Stream) -> None:
    """Stop a stream the guard no longer reads (a lost lease, a failure): its generator's ``finally`` runs."""
    source = stream.source
    try:
        if isinstance(source, AsyncGenerator):
            await asyncio.wait_for(source.aclose(), 5)
        elif isinstance(source, Generator):
            source.close()
    except Exception:  # closing is best effort: the stream is abandoned either way
        pass


def close(stream: Stream) -> None:
    """``aclose`` from a thread that has no loop (an async stream is closed on the shared responder loop)."""
    if not stream.is_async:
        if isinstance(stream.source, Generator):
            stream.source.close()
        return
    from replyd.responders.base import responder_loop

    try:
        asyncio.run_coroutine_threadsafe(aclose(stream), responder_loop()).result(timeout=10)
    except Exception:  # best effort, as aclose
        pass
