"""Child processes of the answers-in-parts tests (spawn-safe): one post of a long answer, SIGKILLed at a chosen
point between its parts, and the responder whose calls the tests count (a line per call in a file)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from replyd.guard import Guard
from replyd.parts import part_id
from replyd.platforms.base import Parent
from replyd.store import Key, Store

# Where a child dies: inside the responder (the compose cut short), or after part k's claim, send or close.
POINTS = ("compose", "claim", "send", "close")


def answer_text(parent_id: str, n_parts: int, size: int) -> str:
    """A deterministic answer to ``parent_id`` that a ``size``-character limit splits into ``n_parts`` parts: one
    sentence of about three quarters of ``size`` per part (two never fit in one post)."""
    tag = "".join(c for c in parent_id if c.isalnum())[-6:]
    sentences = []
    for k in range(n_parts):
        words: list[str] = []
        while len(" ".join(words)) < int(size * 0.75):
            words.append(f"{tag}p{k + 1}w{len(words)}")
        sentences.append(" ".join(words) + ".")
    return " ".join(sentences)


def note_call(calls: str, parent_id: str) -> None:
    """Note one responder call for ``parent_id`` in the file ``calls``: one line, O_APPEND, synced."""
    fd = os.open(calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{parent_id}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class Responder:
    """Compose ``text`` once per call, noting the call in ``calls``; die mid-compose when ``die`` is set."""

    def __init__(self, calls: str, text: str, die: bool = False) -> None:
        self.calls, self.text, self.die = calls, text, die

    def __call__(self, parent: Parent) -> str:
        """Note the call (one line, O_APPEND), then answer (or die before answering)."""
        note_call(self.calls, parent.id)
        if self.die:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.text


def arm(g: Guard, parent_id: str, part: int, point: str, n_parts: int) -> None:
    """Make ``g`` SIGKILL its process right after part ``part``'s claim commits, after its send returned (before
    the close), or after its close committed. An answer of one part is one post under the parent's own key:
    its "claim" is the open commit after the compose."""
    one = n_parts == 1
    target = Key(g.platform.instance, g.identity.sender_id, parent_id if one else part_id(parent_id, part))

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    claim, opened, close = g._claim, g._open_composed, g._close

    def claimed(key: Key, *a: Any) -> Any:
        out = claim(key, *a)
        if key == target and point == "claim" and not one:
            die()
        return out

    def opening(key: Key, *a: Any) -> Any:
        out = opened(key, *a)
        if key == target and point == "claim":
            die()
        return out

    def closing(key: Key, *a: Any) -> Any:
        if key == target and point == "send":
            die()
        out = close(key, *a)
        if key == target and point == "close":
            die()
        return out

    g._claim, g._open_composed, g._close = claimed, opening, closing  # type: ignore[method-assign]


def post_and_die(kind: str, settings: dict, store_url: str, parent: dict, calls: str, text: str,
                 n_parts: int, part: int, point: str) -> None:
    """Post ``parent``'s long answer through a guard on a real adapter; SIGKILL this process at (part, point)."""
    import httpx

    from replyd.clock import SystemClock
    from replyd.platforms.base import make_platform

    with httpx.Client(trust_env=False) as http:
        platform = make_platform(kind, settings, http=http, clock=SystemClock())
        g = Guard(Store.open(store_url), platform, platform.whoami(), send_timeout_s=3.0, compose_lease_s=2.0)
        if point != "compose":
            arm(g, parent["id"], part, point, n_parts)
        g.post(Parent.from_snapshot(parent), Responder(calls, text, die=point == "compose"), path="inbox")
    raise SystemExit(3)  # reached when the planned point never came (the answer has fewer parts): a test failure


def calls_per_parent(calls: str | Path) -> dict[str, int]:
    """How many times the responder was called for each parent id."""
    out: dict[str, int] = {}
    path = Path(calls)
    for line in (path.read_text().splitlines() if path.exists() else []):
        if line.strip():
            out[line.strip()] = out.get(line.strip(), 0) + 1
    return out


class StreamResponder:
    """Stream ``text`` word by word (an async generator, ``pause_s`` between words), noting each call in
    ``calls``; SIGKILL the process when asked for word ``die_at`` (the stream cut short mid-answer)."""

    def __init__(self, calls: str, text: str, die_at: int | None = None, pause_s: float = 0.01) -> None:
        self.calls, self.text, self.die_at, self.pause_s = calls, text, die_at, pause_s

    def __call__(self, parent: Parent) -> Any:
        """Note the call (one line, O_APPEND), then return the stream."""
        note_call(self.calls, parent.id)
        return self._words()

    async def _words(self) -> Any:
        import asyncio

        for i, word in enumerate(self.text.split(" ")):
            if i == self.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(self.pause_s)
            yield (" " if i else "") + word


def stream_and_die(kind: str, settings: dict, store_url: str, parent: dict, calls: str, text: str,
                   part: int, point: str, die_at: int | None) -> None:
    """Stream ``parent``'s answer through a guard on a real adapter (edits every 0.05 s); SIGKILL this process
    at word ``die_at`` of the stream, or at (part, point) of the parts it posts."""
    import httpx

    from replyd.clock import SystemClock
    from replyd.platforms.base import make_platform

    with httpx.Client(trust_env=False) as http:
        platform = make_platform(kind, settings, http=http, clock=SystemClock())
        g = Guard(Store.open(store_url), platform, platform.whoami(), send_timeout_s=3.0, compose_lease_s=2.0,
                  stream_edit_interval_s=0.05)
        if die_at is None:
            arm(g, parent["id"], part, point, n_parts=2)  # a streamed answer's parts always have their own keys
        g.post(Parent.from_snapshot(parent), StreamResponder(calls, text, die_at=die_at), path="inbox")
    raise SystemExit(3)  # reached when the planned point never came: a test failure


def run_children(target: Any, jobs: list[tuple], width: int = 4) -> list[int | None]:
    """Run ``target(*job)`` in spawned children, ``width`` at a time; return their exit codes in order."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    codes: list[int | None] = []
    for i in range(0, len(jobs), width):
        procs = [ctx.Process(target=target, args=job) for job in jobs[i:i + width]]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            codes.append(p.exitcode)
    return codes


def settled_twice(g: Guard, sweeper: Any, parents: dict[str, Parent], responder: Any, pause_s: float) -> None:
    """Two more sweeps and offers of every parent once all answers closed: each must be ``already_answered``
    (nothing sent again); ``responder(parent_id)`` makes the responder offered."""
    import time

    for _ in range(2):
        sweeper.run_once()
        for pid, parent in parents.items():
            out = g.post(parent, responder(pid))
            assert out.status.value == "already_answered", (pid, out)
        time.sleep(pause_s)
