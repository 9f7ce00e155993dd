"""The store's contract: every method the rest of replyd may call, named for what it does.

Both backends (``SQLiteStore``, ``PostgresStore``) implement it through the shared base; the contract suite
(``tests/test_store_contract.py``) runs against each. Nothing here exposes SQLAlchemy: rows come back as
``Row`` / ``Event`` records, and several steps that must commit together run on a ``Tx`` from ``transaction()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from replyd.clock import Clock
from replyd.store.model import Claim, Event, Expect, Key, ListingDelay, Row
from replyd.store.unit import Tx


@runtime_checkable
class AnsweredLog(Protocol):
    """The answered-log: one row per key, an event per change, cursors, listing-lag records."""

    clock: Clock
    is_sqlite: bool
    claim_commit: str | None  # PostgreSQL's synchronous_commit level for claims (None: the server's; SQLite: None)

    # lifecycle and schema
    @property
    def url(self) -> str:
        """The store URL with every secret hidden."""
    def dispose(self) -> None:
        """Close every pooled connection."""
    def upgrade(self, revision: str = "head") -> None:
        """Apply schema migrations up to ``revision``."""
    def require_schema(self) -> None:
        """Raise SchemaError unless the schema is current."""
    def schema_revision(self) -> tuple[str | None, str]:
        """(the database's revision, the newest known)."""
    def ping(self) -> None:
        """One real query; StoreError when the store cannot answer."""
    def db_epoch(self) -> float:
        """The database's clock in epoch seconds."""
    def on_connect(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``callback(driver connection)`` on every new database connection; return its remover."""
    def claim_commit_problem(self) -> str | None:
        """Why the configured claim commit level cannot hold now (None when it can)."""

    # the guard's hot path and the one write vocabulary
    def peek(self, key: Key) -> Row | None:
        """``key``'s row, or None."""
    def rows_of(self, keys: Sequence[Key]) -> list[Row | None]:
        """Each key's row or None, in order: one read for a page."""
    def get(self, key: Key) -> Row | None:
        """``key``'s row, or None."""
    def claim(self, key: Key, new: Mapping[str, Any], reclaim: Callable[[Row], Mapping[str, Any] | None],
              event: Mapping[str, Any], *, relaxed: bool = False, doing: str = "claiming") -> Claim:
        """Insert ``new`` or compare-and-set ``reclaim(row)``, atomically, with its event."""
    def cas_event(self, key: Key, *, states: Sequence[str], attempt: int | None, values: Mapping[str, Any],
                  event: Mapping[str, Any] | None = None, otherwise: Mapping[str, Any] | None = None,
                  lease_owner: str | None = None, due_by: float | None = None,
                  deadline_at_least: float | None = None, answer: tuple[Sequence[str], float] | None = None,
                  relaxed: bool = False, doing: str = "writing") -> bool:
        """Compare-and-set on (state, attempt[, lease]) with its event, in one transaction (with ``answer``,
        ``(parts, at)``, stored for the key when the row was set)."""
    def record(self, key: Key, kind: str, *, owner: str | None = None, detail: Mapping[str, Any] | None = None) -> None:
        """Append one note event carrying the row's state and attempt."""
    def insert_absent(self, rows: Sequence[tuple[Key, Mapping[str, Any]]], event: Mapping[str, Any], *,
                      doing: str = "recording found parents") -> int:
        """Insert each key's row unless the key has one, each new row with ``event``, in one durable transaction."""
    def claim_new(self, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any]]], *, relaxed: bool = False,
                  doing: str = "claiming a page") -> list[bool]:
        """The group claim: each missing key's row with its own event, all in one transaction; which were made."""
    def claim_page(self, rows: Sequence[tuple[Key, Mapping[str, Any], Mapping[str, Any], Expect | None]], *,
                   relaxed: bool = False, doing: str = "claiming a page") -> list[bool]:
        """The group claim: each new key's row inserted, each expected row compared-and-set, with its event, in
        one transaction; which were written."""
    def transaction(self, *, relaxed: bool = False, doing: str = "writing") -> AbstractContextManager[Tx]:
        """Several compare-and-sets and events committed together."""

    # reads
    def history(self, key: Key) -> list[Event]:
        """Every event of ``key``, oldest first."""
    def answer(self, key: Key) -> list[str] | None:
        """The parts of ``key``'s composed answer (``Tx.put_answer``), or None."""
    def last_event(self, key: Key, kinds: Sequence[str] | None = None) -> Event | None:
        """The newest event of ``key`` (of ``kinds``)."""
    def count_events(self, key: Key, kind: str, *, after_kinds: Sequence[str] = ()) -> int:
        """Events of ``kind`` newer than the last of ``after_kinds``."""
    def find(self, parent_id: str, platform: str | None = None) -> list[Row]:
        """Rows of ``parent_id`` under any sender."""
    def find_events(self, parent_id: str, platform: str | None = None) -> list[Event]:
        """Events of ``parent_id`` under any sender, oldest first."""
    def recent_events(self, limit: int = 50) -> list[Event]:
        """The newest events, newest first."""
    def event_kinds(self) -> list[str]:
        """Every event kind recorded, sorted."""
    def events_with_path(self, *, limit: int = 50, kind: str | None = None, state: str | None = None,
                         platform: str | None = None, path: str | None = None, parent_id: str | None = None,
                         since: float | None = None) -> list[dict[str, Any]]:
        """The newest events with their row's discovery path, filtered."""
    def counts(self) -> dict[tuple[str, str], int]:
        """Row counts by (platform, state)."""
    def duplicate_counts(self) -> dict[tuple[str, str], int]:
        """Own replies beyond the first found for one parent, by (platform, sender)."""
    def event_key_counts(self, kind: str) -> dict[tuple[str, str], int]:
        """How many keys have an event of ``kind``, by (platform, sender)."""
    def path_counts(self) -> list[tuple[str, str, str, int, float | None]]:
        """(platform, sender, path, rows, newest find) per discovery path."""
    def answers_since(self, since: float, limit: int = 20_000) -> list[tuple[float, float | None]]:
        """(close time, row created_at) of each answer closed since ``since``."""
    def decidable(self, states: Sequence[str], limit: int = 20) -> list[Row]:
        """Rows waiting for an operator's decision, the most recently changed first."""
    def count_opened_since(self, platform: str, sender_id: str, since: float, author_id: str | None = None) -> int:
        """A bot's rows opened since ``since`` (per author: ``author_id`` as the row's author or its origin)."""
    def oldest_opened_since(self, platform: str, sender_id: str, since: float,
                            author_id: str | None = None) -> float | None:
        """The earliest open time of the rows ``count_opened_since`` counts."""
    def oldest_open(self, limit: int = 10) -> list[Row]:
        """The oldest open rows."""
    def in_parts(self, limit: int = 10) -> list[Row]:
        """The answers being sent in parts, the longest waiting first."""
    def oldest_due_open(self, platform: str, sender_id: str, now: float) -> float | None:
        """The deadline of a bot's oldest open row past it."""
    def rows_in(self, platform: str, sender_id: str, states: Sequence[str], limit: int = 500, *,
                since: float | None = None) -> list[Row]:
        """A bot's rows in ``states`` (changed at or after ``since``), oldest update first."""
    def reoffer_due(self, platform: str, sender_id: str, *, now: float, after: tuple[float, str] | None,
                    limit: int) -> list[Row]:
        """One page of a bot's rows waiting to be offered again."""
    def senders_waiting(self, now: float) -> set[tuple[str, str]]:
        """(platform, sender id) of every bot with a row ``reoffer_due`` would return."""
    def senders_due(self, now: float) -> set[tuple[str, str]]:
        """(platform, sender id) of every bot with a row ``lease_due`` would lease."""
    def waiting_reasons(self) -> dict[tuple[str, str], int]:
        """Waiting rows by (platform, the policy's reason or the row's state)."""
    def overdue(self, now: float, grace_s: float, limit: int = 50) -> list[tuple[Row, float]]:
        """Non-terminal rows past their bound by more than ``grace_s``, with seconds over."""
    def export_rows(self, table: str, *, since: float | None = None) -> Iterator[dict[str, Any]]:
        """Every row of ``replies`` or ``events`` as dicts."""

    # sweep leases, cursors, listing lag
    def lease_due(self, platform: str, sender_id: str, *, now: float, limit: int, lease_s: float,
                  owner: str) -> list[Row]:
        """Lease up to ``limit`` due rows no live lease holds."""
    def renew_leases(self, keys: Sequence[Key], *, owner: str, now: float, until: float) -> int:
        """Move to ``until`` the sweep leases on ``keys`` that ``owner`` still holds at ``now``; how many it held."""
    def get_cursor(self, platform: str, sender_id: str, name: str) -> str | None:
        """A poller's saved position."""
    def set_cursor(self, platform: str, sender_id: str, name: str, value: str) -> None:
        """Save a poller's position."""
    def lag_samples(self, platform: str, limit: int) -> list[tuple[float, float]]:
        """The newest complete listing-lag samples (lower_s, upper_s)."""
    def lag_prune(self, platform: str, before: float) -> None:
        """Forget samples sent before ``before``."""
    def lag_platforms(self) -> list[str]:
        """Platform instances with lag samples."""
    def set_listing_delay(self, platform: str, configured_s: float, in_use_s: float) -> None:
        """Record the listing delay in use."""
    def listing_delays(self) -> dict[str, ListingDelay]:
        """The recorded listing delay of every platform instance."""
