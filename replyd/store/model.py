"""The answered-log's vocabulary: row states, the key, and the plain records every store method returns."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal, NamedTuple

# States of a row. Terminal ones are only left by an operator's rearm.
COMPOSING = "composing"
OPEN = "open"
CLOSED = "closed"
RELEASED = "released"
REJECTED = "rejected"
NOT_LANDED = "not_landed"
GAVE_UP = "gave_up"
DECLINED = "declined"
SKIPPED = "skipped"  # re-offered, and the policy now rules it out for good (too old, denied ...): reason in error
# A send that may have landed on a platform without read-back (``platforms.base.NoReadBack``): never retried on its
# own; an operator resolves it (``replyd rearm`` sends again, ``replyd confirm`` marks it answered).
UNCONFIRMED = "unconfirmed"
# An answer in several parts (``replyd.parts``), composed and stored; its parts are rows of their own, being sent.
# The parent's row closes when every part's row has closed (reply id: the first part's).
PARTS = "parts"
PART_PATH = "part"  # the ``path`` of a part's own row: re-find offers its answer's row, never the part itself
STATES = (COMPOSING, OPEN, CLOSED, RELEASED, REJECTED, NOT_LANDED, GAVE_UP, DECLINED, SKIPPED, UNCONFIRMED, PARTS)
TERMINAL = (CLOSED, REJECTED, GAVE_UP, DECLINED, SKIPPED, UNCONFIRMED)
# Rows that wait for a path to move them on: re-find re-offers them (see ``reoffer_due``).
REOFFERED = (NOT_LANDED, RELEASED, COMPOSING, PARTS)
# Rows the sweep leases once their deadline has passed (the deadline says what it is for; see Store.lease_due).
SWEPT = (OPEN, CLOSED, NOT_LANDED, GAVE_UP)

# Events whose detail names own reply ids (how a row closed, late answers, duplicates found and deleted), sends
# that may have landed without one (maybe_sent), and verifications done: what the sweep's verification reads.
REPLY_ID_EVENTS = ("closed", "already_landed", "late_landing", "swept_found", "reconciled", "duplicate_detected",
                   "duplicate_deleted", "maybe_sent", "late_maybe_sent", "verified")
# Events that close a row because its answer is on the platform: one per answer (the status page's chart).
ANSWERED_EVENTS = ("closed", "already_landed", "swept_found", "reconciled", "confirmed")
# Rows that wait for an operator's decision: rearm any, confirm an unconfirmed one (the page's actions).
DECIDABLE = (UNCONFIRMED, GAVE_UP, REJECTED, DECLINED, SKIPPED)

# PostgreSQL ``synchronous_commit`` levels a durable write (the claim, the open) may ask for: "local" waits for
# the primary's disk, "on" / "remote_write" / "remote_apply" also for a synchronous standby (when
# ``synchronous_standby_names`` names one), so a claim survives a failover. Closes stay relaxed.
CLAIM_COMMIT_LEVELS = ("local", "on", "remote_write", "remote_apply")

# The newest migration (replyd/migrations/versions). A read command compares the store's revision with it
# without importing alembic or SQLAlchemy; a test keeps it equal to alembic's head.
SCHEMA_HEAD = "0009"

# How commits wait for the disk. "as_asked": the claim and the open durable, closes and notes relaxed (a lost
# close leaves the row open for the sweep). "durable" / "relaxed": every commit so (the benchmarks' variants).
Durability = Literal["as_asked", "durable", "relaxed"]
DURABILITIES: tuple[str, ...] = ("as_asked", "durable", "relaxed")


@dataclass(frozen=True)
class Key:
    """The answered-log key: platform instance, own sender id, parent id as served."""

    platform: str
    sender_id: str
    parent_id: str


class Record(SimpleNamespace):
    """A row read from the store as plain attributes: no ORM state, no connection behind it."""

    def model_dump(self, *, exclude: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
        """The record as a dict (column order), without the names in ``exclude``."""
        return {k: v for k, v in self.__dict__.items() if k not in exclude}

    def model_copy(self, *, update: Mapping[str, Any] | None = None) -> Any:
        """A copy with ``update`` applied."""
        return type(self)(**{**self.__dict__, **(update or {})})


class Row(Record):
    """One ``replies`` row: where one key's answer stands (the only row type the store returns)."""

    @classmethod
    def of(cls, key: Key, values: Mapping[str, Any]) -> Row:
        """The row ``values`` describe for ``key``, every column the values leave out at its default."""
        from replyd.store.schema import REPLY_DEFAULTS

        # Filled in place, in column order, not through keyword arguments: 0.9 µs instead of 2.2 (timeit), once
        # per row a page claims.
        row = cls.__new__(cls)
        d = row.__dict__
        d.update(REPLY_DEFAULTS)
        d.update(values)
        d["platform"], d["sender_id"], d["parent_id"] = key.platform, key.sender_id, key.parent_id
        return row


# The name callers knew the row by (it was the ORM class): the same type, not a second one.
Reply = Row


class Event(Record):
    """One ``events`` entry: a transition (or note) of one key; ``detail`` is its JSON text."""


class ListingDelay(Record):
    """The listing delay one platform instance uses now: ``configured_s``, ``in_use_s``, ``updated_at``."""


class Claim(NamedTuple):
    """What ``Store.claim`` did: ``won`` with the ``values`` written, else the ``row`` that stands (None if unseen)."""

    won: bool
    row: Row | None
    values: Mapping[str, Any] | None


# What a page claim compares on a row that stands (``Store.claim_page``): its states, attempt and lease holder.
Expect = tuple[Sequence[str], int, "str | None"]


def lease_holder(row: Any) -> str | None:
    """The lease holder a reclaim must still find: a composing row's, none for other states."""
    return row.lease_owner if row.state == COMPOSING and row.lease_owner else None


def make_owner() -> str:
    """Return an id for this process, used as row owner and lease holder."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
