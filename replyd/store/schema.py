"""The tables (SQLModel definitions the migrations are checked against) and the column lists derived from them.

Only the store package uses these: callers get ``Row`` / ``Event`` records, never table objects.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlmodel import Field, SQLModel


class ReplyTable(SQLModel, table=True):
    """One key of the answered-log and where its answer stands."""

    __tablename__ = "replies"
    __table_args__ = (
        sa.Index("ix_replies_due", "state", "deadline_at"),
        sa.Index("ix_replies_opened", "platform", "sender_id", "opened_at"),
    )

    platform: str = Field(primary_key=True, max_length=255)
    sender_id: str = Field(primary_key=True, max_length=255)
    parent_id: str = Field(primary_key=True, max_length=1024)
    state: str = Field(max_length=16)
    attempt: int = 1
    created_at: float
    updated_at: float
    opened_at: float | None = None
    deadline_at: float | None = None
    closed_at: float | None = None
    not_before: float | None = None
    reply_id: str | None = Field(default=None, max_length=1024)
    provider_key: str | None = Field(default=None, max_length=255)
    text_hash: str | None = Field(default=None, max_length=64)
    path: str = Field(default="", max_length=64)
    snapshot: str = Field(default="{}", sa_type=sa.Text)
    owner: str | None = Field(default=None, max_length=255)
    lease_owner: str | None = Field(default=None, max_length=255)
    lease_until: float | None = None
    error: str | None = Field(default=None, sa_type=sa.Text)
    author_id: str | None = Field(default=None, max_length=255)  # the parent's author, for per-author caps
    # Attempts whose send an outage swallowed (proven not landed, marked by the breaker): not counted
    # against max_attempts; the parent is retried until guard.retry_horizon_s instead.
    excused: int = 0
    # Who sent the parent, when the answer goes to someone else (email: the From, with a checked Reply-To as
    # author_id); None when it is author_id. Per-author caps and the loop breaker count a name in either column.
    origin_id: str | None = Field(default=None, max_length=255)


class EventTable(SQLModel, table=True):
    """An append-only record of one transition (or skip) of one key."""

    __tablename__ = "events"
    __table_args__ = (sa.Index("ix_events_key", "platform", "sender_id", "parent_id"),
                      sa.Index("ix_events_kind_at", "kind", "at"))

    id: int | None = Field(default=None, primary_key=True)
    at: float = Field(index=True)
    platform: str = Field(max_length=255)
    sender_id: str = Field(max_length=255)
    parent_id: str = Field(max_length=1024)
    kind: str = Field(max_length=32)
    state: str | None = Field(default=None, max_length=16)
    attempt: int | None = None
    owner: str | None = Field(default=None, max_length=255)
    detail: str = Field(default="{}", sa_type=sa.Text)


class AnswerTable(SQLModel, table=True):
    """An answer composed once and sent in several parts (``replyd.parts``): stored before its first part leaves."""

    __tablename__ = "answers"

    platform: str = Field(primary_key=True, max_length=255)
    sender_id: str = Field(primary_key=True, max_length=255)
    parent_id: str = Field(primary_key=True, max_length=1024)
    parts: str = Field(sa_type=sa.Text)  # a JSON list of the parts' texts, in order
    created_at: float


class CursorTable(SQLModel, table=True):
    """Where one poller of one bot stopped reading."""

    __tablename__ = "cursors"

    platform: str = Field(primary_key=True, max_length=255)
    sender_id: str = Field(primary_key=True, max_length=255)
    name: str = Field(primary_key=True, max_length=255)
    value: str = Field(sa_type=sa.Text)
    updated_at: float


class ListingLagTable(SQLModel, table=True):
    """How long one own reply took to be listed by the own-feed read-back (see ``replyd.lag``).

    ``lower_s``: its age at the last read-back that did not list it (0 if the first look did), a proven lag;
    ``upper_s``: its age when a read-back first listed it (None while it is still unlisted).
    """

    __tablename__ = "listing_lag"
    __table_args__ = (sa.Index("ix_listing_lag_seen", "platform", "seen_at"),)

    platform: str = Field(primary_key=True, max_length=255)
    reply_id: str = Field(primary_key=True, max_length=1024)
    sender_id: str = Field(max_length=255)
    sent_at: float
    lower_s: float
    upper_s: float | None = None
    seen_at: float | None = None


class ListingDelayTable(SQLModel, table=True):
    """The listing delay one platform instance uses now: configured, or learned (``replyd.lag``)."""

    __tablename__ = "listing_delay"

    platform: str = Field(primary_key=True, max_length=255)
    configured_s: float
    in_use_s: float
    updated_at: float


class ReplicaTable(SQLModel, table=True):
    """One replica of the fleet (PostgreSQL only) and its last heartbeat (``replyd.fleet``)."""

    __tablename__ = "replicas"

    owner: str = Field(primary_key=True, max_length=255)  # the replica id: its rows' owner and lease holder
    heartbeat_at: float
    started_at: float


class BotLeaseTable(SQLModel, table=True):
    """Which replica runs one bot's discovery (polls, stream) until when (``replyd.fleet``).

    A row with no holder is free from ``until`` on: a handover waits out the last holder's poll in flight.
    A holder hands over only a bot its target asked for (``wanted_by``): a target that does not serve the bot
    (configs that differ) never asks, and the bot stays where it runs.
    """

    __tablename__ = "bot_leases"

    bot: str = Field(primary_key=True, max_length=255)  # the configured bot name
    holder: str | None = Field(default=None, max_length=255)
    until: float
    wanted_by: str | None = Field(default=None, max_length=255)  # the target, asking the holder to hand over


METADATA = SQLModel.metadata
REPLIES = ReplyTable.__table__
EVENTS = EventTable.__table__
CURSORS = CursorTable.__table__
ANSWERS = AnswerTable.__table__
LISTING_LAG = ListingLagTable.__table__
LISTING_DELAY = ListingDelayTable.__table__
REPLICAS = ReplicaTable.__table__
BOT_LEASES = BotLeaseTable.__table__

# The hot path's prebuilt statements are derived from these, never from hand-typed column lists.
REPLY_COLUMNS = tuple(c.name for c in REPLIES.columns)
EVENT_COLUMNS = tuple(c.name for c in EVENTS.columns if not c.primary_key)
KEY_COLUMNS = tuple(c.name for c in REPLIES.primary_key.columns)
REPLY_DEFAULTS: dict[str, Any] = {
    c.name: c.default.arg if c.default is not None and c.default.is_scalar else None for c in REPLIES.columns
}
REPLY_SET = frozenset(REPLY_COLUMNS)
# The tables an export may name, and their columns in order.
EXPORT_COLUMNS: dict[str, tuple[str, ...]] = {"replies": REPLY_COLUMNS,
                                              "events": tuple(c.name for c in EVENTS.columns)}
EXPORT_TABLES = EXPORT_COLUMNS  # the name ``replyd.store`` exports it by


def record_fields(table: str) -> dict[str, tuple[Any, Any]]:
    """Each column of ``replies`` or ``events`` as (annotation, default or ...) for a pydantic model: no ORM object."""
    model = {"replies": ReplyTable, "events": EventTable}[table]
    return {n: (f.annotation, ... if f.is_required() else f.default) for n, f in model.model_fields.items()}
