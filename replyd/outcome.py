"""What one post or check came to: a ``Status`` the caller acts on, with the row's state behind it.

A light module: the CLI's read commands import it without the guard.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from replyd import store as st
from replyd.store import Key


class Status(enum.StrEnum):
    """What happened to one call of ``Guard.post``, as a value the caller acts on."""

    POSTED = "posted"  # this call sent the reply; reply_id set
    ALREADY_ANSWERED = "already_answered"  # a reply exists; reply_id set
    IN_FLIGHT = "in_flight"  # someone holds the key, or it awaits the sweep
    NOT_SENT = "not_sent"  # provably not sent; retry later (retry_after_s)
    UNCERTAIN = "uncertain"  # this call's send may have landed; the sweep decides
    REJECTED = "rejected"  # the platform refused; terminal until rearmed
    GAVE_UP = "gave_up"  # attempts exhausted; terminal until rearmed
    UNCONFIRMED = "unconfirmed"  # a send may have landed where nothing can read it back; an operator resolves it
    DECLINED = "declined"  # the responder chose not to answer
    DRY_RUN = "dry_run"  # shadow mode: the reply was logged, nothing was sent or claimed
    SKIPPED = "skipped"  # the policy said not to answer (detail: the reason); nothing was claimed


@dataclass(frozen=True)
class PartOutcome:
    """Where one part of an answer in several parts stands: its row's state (None: not claimed yet), its reply."""

    part: int
    state: str | None = None
    reply_id: str | None = None

    @property
    def landed(self) -> bool:
        """True when this part's row is closed with its reply."""
        return self.state == st.CLOSED


@dataclass(frozen=True)
class Outcome:
    """The result of one ``Guard.post`` or ``Guard.check`` call."""

    status: Status
    key: Key
    state: str | None = None
    attempt: int = 0
    reply_id: str | None = None  # an answer in parts: its first part's reply
    detail: str = ""
    retry_after_s: float | None = None
    parts: tuple[PartOutcome, ...] = ()  # an answer in several parts: every part, in order (empty: one post)

    @property
    def sent(self) -> bool:
        """True when this call made the platform create a reply."""
        return self.status is Status.POSTED


def classify(row: Any, key: Key, now: float) -> Outcome:
    """Describe an existing row (a store ``Row`` or the guard's ``Reply``) the caller may not claim."""
    s = row.state
    if s == st.CLOSED:
        return Outcome(Status.ALREADY_ANSWERED, key, s, row.attempt, row.reply_id)
    if s == st.REJECTED:
        return Outcome(Status.REJECTED, key, s, row.attempt, detail=row.error or "")
    if s == st.GAVE_UP:
        return Outcome(Status.GAVE_UP, key, s, row.attempt, detail=row.error or "")
    if s == st.UNCONFIRMED:
        return Outcome(Status.UNCONFIRMED, key, s, row.attempt, row.reply_id, detail=row.error or "")
    if s == st.DECLINED:
        return Outcome(Status.DECLINED, key, s, row.attempt)
    if s == st.SKIPPED:  # retired by re-find: the policy rules the parent out (the reason is in error)
        return Outcome(Status.SKIPPED, key, s, row.attempt, detail=(row.error or "").removeprefix("policy: "))
    if s in (st.RELEASED, st.NOT_LANDED) and row.not_before and row.not_before > now:
        return Outcome(Status.NOT_SENT, key, s, row.attempt, detail="backing off", retry_after_s=row.not_before - now)
    return Outcome(Status.IN_FLIGHT, key, s, row.attempt)
