"""A scripted platform for tests: in memory, or shared between processes through a journal file.

Each ``send`` consumes the next step of ``script`` (default "ok"), so a test
says exactly which fault the next send meets. With ``journal`` set, every
created reply is appended to that file (one JSON line, ``O_APPEND``) and read
back from it, so several OS processes see one platform and a test counts the
replies that really exist.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from replyd.clock import Clock, SystemClock
from replyd.parts import Limit
from replyd.errors import AlreadyLanded, BadResponse, DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, PlatformSettings, ReadBack, Sent, Text, register_platform,
)

# What a scripted send can meet.
STEPS = (
    "ok",  # created, answered
    "not_sent",  # refused before acting (connect refused)
    "rate_limited",  # 429 before acting
    "rejected",  # 422
    "lost",  # created, then the response is lost (MaybeSent)
    "error_before",  # 5xx-ish ambiguity, but nothing was created (MaybeSent)
    "crash_before",  # the process dies before the request leaves
    "crash_after",  # the process dies after the platform created the reply
    "already_landed",  # the platform says a reply already exists at this key
)


# What a scripted edit can meet.
EDIT_STEPS = ("ok", "lost", "error_before", "rate_limited", "rejected", "not_sent")


@register_platform("memory")
class MemoryPlatform:
    """An in-memory (or journal-file) platform whose every send follows a script."""

    def __init__(
        self,
        *,
        instance: str = "memory:test",
        sender_id: str = "bot-1",
        listing_delay_s: float = 0.0,
        journal: str | Path | None = None,
        clock: Clock | None = None,
        script: Sequence[str] = (),
        post_chars: int | None = None,
    ) -> None:
        self.instance = instance
        self.sender_id = sender_id
        self.listing_delay_s = listing_delay_s
        self.clock = clock or SystemClock()
        self.journal = Path(journal) if journal else None
        self.script = list(script)
        self.readback_failures = 0  # the next N read-backs raise
        self.real_listing_delay_s: float | None = None  # when the platform is slower than configured
        self.send_calls = 0
        self.readback_calls = 0
        self.parent_reads = 0  # read_parents calls
        self.feed_misses: set[str] = set()  # reply ids read_back never lists (an own-feed walk's blind spot)
        self.depth_calls = 0
        self.depth_failures = 0  # the next N thread_depth calls raise DefinitelyNotSent
        self.post_chars = post_chars  # PostLimit: a reply's most characters (None: any length)
        self.parents: dict[str, Parent] = {}
        self._replies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.edit_script: list[str] = []  # EditReply: what the next edits meet (EDIT_STEPS; default "ok")
        self.edit_calls = 0

    class Settings(PlatformSettings):
        """``platform = "memory"``: a scripted platform, alone or shared between processes by a journal file."""

        instance: Text = "memory:test"
        sender_id: Text = "bot-1"  # the bot's id on this platform
        post_chars: int | None = Field(None, ge=20)  # a reply's most characters: longer answers go in parts
        journal: Text | None = None  # a file every process appends its replies to (one platform for all)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, http: httpx.Client, clock: Clock) -> MemoryPlatform:
        """Validate ``settings`` (``ConfigError`` names the key) and build the platform."""
        return cls(**cls.Settings.load(cls.kind, settings).model_dump(exclude={"kind"}), clock=clock)

    # -- world setup for tests ----------------------------------------------------

    def add_parent(self, parent_id: str, author_id: str = "user-1", **kw: Any) -> Parent:
        """Create a parent post the bot can find."""
        p = Parent(id=parent_id, author_id=author_id, created_at=self.clock.now(), **kw)
        self.parents[parent_id] = p
        return p

    def replies(self) -> list[dict[str, Any]]:
        """Return every reply that exists on the platform (all processes, with a journal), each with its current
        text and ``edits``, how many times it was edited."""
        if self.journal is None:
            with self._lock:
                lines = list(self._replies)
        elif not self.journal.exists():
            return []
        else:
            lines = [json.loads(line) for line in self.journal.read_text().splitlines() if line.strip()]
        out: dict[str, dict[str, Any]] = {}
        for rec in lines:
            if "edit" in rec:  # an edit replaces a reply's text; it is never a reply of its own
                if rec["edit"] in out:
                    out[rec["edit"]] = {**out[rec["edit"]], "text": rec["text"],
                                        "edits": out[rec["edit"]]["edits"] + 1}
                continue
            out[rec["reply_id"]] = {**rec, "edits": 0}
        return list(out.values())

    def _append(self, rec: dict[str, Any]) -> None:
        """Record ``rec`` on the platform: in memory, or one ``O_APPEND`` line of the journal."""
        if self.journal is None:
            with self._lock:
                self._replies.append(rec)
            return
        # One write() with O_APPEND: lines from racing processes never interleave.
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def reply_count(self, parent_id: str) -> int:
        """Return how many replies by the bot exist under ``parent_id``."""
        return sum(1 for r in self.replies() if r["parent_id"] == parent_id and r["sender_id"] == self.sender_id)

    # -- Protocol ------------------------------------------------------------------

    def whoami(self) -> Identity:
        """Return the configured sender id."""
        return Identity(self.sender_id, "bot")

    def inbox(self, cursor: str | None) -> Page:
        """Return every parent added after ``cursor`` (its index)."""
        items = list(self.parents.values())
        start = int(cursor) if cursor else 0
        return Page(items[start:], str(len(items)))

    def search(self, query: str, cursor: str | None) -> Page:
        """Return parents whose text contains ``query``."""
        return Page([p for p in self.parents.values() if query.lower() in p.text.lower()], cursor)

    def refind(self, since: float) -> list[Parent]:
        """Return parents created since ``since``."""
        return [p for p in self.parents.values() if (p.created_at or 0) >= since]

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """Whether the parent lists the bot in ``extra["mention_ids"]`` (tests set it with ``add_parent``)."""
        return identity.sender_id in (parent.extra.get("mention_ids") or [])

    def post_limit(self, parent: Parent) -> Limit | None:
        """``PostLimit``: ``post_chars`` characters (tests set it), else no limit."""
        return None if self.post_chars is None else Limit(self.post_chars, "chars")

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """``PostLimit``: a thread chain, each part answering the one before it."""
        return Parent(id=previous_reply_id, author_id=self.sender_id)

    def resolve(self, ref: str) -> Parent:
        """Return the parent with id ``ref`` (or a bare parent if unknown)."""
        return self.parents.get(ref) or Parent(id=ref, author_id="")

    def _create(self, parent: Parent, text: str, provider_key: str) -> str:
        reply_id = f"r-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        rec = {
            "reply_id": reply_id,
            "parent_id": parent.id,
            "sender_id": self.sender_id,
            "at": self.clock.now(),
            "text": text,
            "provider_key": provider_key,
        }
        self._append(rec)
        return reply_id

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Follow the next script step; create the reply when the step says so."""
        self.send_calls += 1
        step = self.script.pop(0) if self.script else "ok"
        if step not in STEPS:
            raise ValueError(f"unknown script step {step!r}")
        if step == "crash_before":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == "not_sent":
            raise DefinitelyNotSent("connection refused")
        if step == "rate_limited":
            raise RateLimited("429", retry_after_s=30.0)
        if step == "rejected":
            raise Rejected("422 validation failed", status=422)
        if step == "error_before":
            raise MaybeSent("502 bad gateway", status=502)
        if step == "already_landed":
            mine = [r for r in self.replies() if r["parent_id"] == parent.id and r["sender_id"] == self.sender_id]
            raise AlreadyLanded("already a value at key", reply_id=mine[0]["reply_id"] if mine else None)
        reply_id = self._create(parent, text, provider_key)
        if step == "crash_after":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == "lost":
            raise MaybeSent("connection reset after the request was sent")
        return Sent(reply_id)

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """``EditReply``: follow the next edit script step; replace the reply's text when the step says so."""
        self.edit_calls += 1
        step = self.edit_script.pop(0) if self.edit_script else "ok"
        if step not in EDIT_STEPS:
            raise ValueError(f"unknown edit script step {step!r}")
        if step == "not_sent":
            raise DefinitelyNotSent("connection refused")
        if step == "rate_limited":
            raise RateLimited("429", retry_after_s=5.0)
        if step == "error_before":
            raise MaybeSent("502 bad gateway", status=502)
        if not any(r["reply_id"] == reply_id for r in self.replies()) or step == "rejected":
            raise Rejected(f"reply {reply_id} cannot be edited (gone)", status=404)
        self._append({"edit": reply_id, "text": text, "at": self.clock.now()})
        if step == "lost":
            raise MaybeSent("connection reset after the edit was sent")

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Return own replies visible after the (real) listing delay; all pending are checked."""
        self.readback_calls += 1
        if self.readback_failures > 0:
            self.readback_failures -= 1
            raise BadResponse("read-back failed (scripted)")
        return self._listed(pending, sender_id, self.feed_misses)

    def read_parents(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """``ParentReplies``: each parent's own replies after the listing delay, ``feed_misses`` included."""
        self.parent_reads += 1
        return self._listed(pending, sender_id, set())

    def _listed(self, pending: Sequence[Pending], sender_id: str, missed: set[str]) -> ReadBack:
        delay = self.listing_delay_s if self.real_listing_delay_s is None else self.real_listing_delay_s
        now = self.clock.now()
        wanted = {p.parent.id for p in pending}
        found: dict[str, list[OwnReply]] = {}
        for r in sorted(self.replies(), key=lambda r: r["at"]):
            if (r["sender_id"] == sender_id and r["parent_id"] in wanted and r["at"] + delay <= now
                    and r["reply_id"] not in missed):
                found.setdefault(r["parent_id"], []).append(OwnReply(r["reply_id"], r["parent_id"], r["at"]))
        return ReadBack(found=found, checked=wanted)

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return the scripted depth: ``parent.extra["depth"]``, else ``parent.thread_depth``.

        ``depth_failures`` makes the next calls fail as a refused read would.
        """
        self.depth_calls += 1
        if self.depth_failures > 0:
            self.depth_failures -= 1
            raise DefinitelyNotSent("thread depth read failed (scripted)")
        depth = parent.extra.get("depth", parent.thread_depth)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise BadResponse(f"thread_depth: scripted depth {depth!r} is not a non-negative integer")
        return depth

    def delete(self, reply_id: str) -> None:
        """Remove one reply (in-memory mode only)."""
        with self._lock:
            self._replies = [r for r in self._replies if r.get("reply_id", r.get("edit")) != reply_id]

    def close(self) -> None:
        """Nothing to release."""
