"""The answered-log: one row per key ``(platform instance, own sender id, parent id as served)`` in
``replies``; every state change appends to ``events`` in the same transaction; pollers keep their positions
in ``cursors``; own replies' listing lag in ``listing_lag`` / ``listing_delay``.

``Store.open(url)`` returns the backend the URL names: ``SQLiteStore`` (embedded default) or ``PostgresStore``
(several replicas). Both follow one contract (``AnsweredLog``); callers see ``Row`` / ``Event`` records and
never a SQLAlchemy object.
"""

from replyd.store.base import ClaimsInGroup, Store
from replyd.store.contract import AnsweredLog
from replyd.store.engine import default_sqlite_path, default_url, redact_url, sqlite_file
from replyd.store.hotsql import hot_sql
from replyd.store.model import (
    CLAIM_COMMIT_LEVELS,
    CLOSED,
    COMPOSING,
    DECLINED,
    DURABILITIES,
    GAVE_UP,
    NOT_LANDED,
    OPEN,
    PART_PATH,
    PARTS,
    REJECTED,
    RELEASED,
    REOFFERED,
    REPLY_ID_EVENTS,
    SKIPPED,
    STATES,
    SWEPT,
    TERMINAL,
    UNCONFIRMED,
    Claim,
    Durability,
    Event,
    Expect,
    Key,
    ListingDelay,
    Reply,
    Row,
    lease_holder,
    make_owner,
)
from replyd.store.postgres import PostgresStore
from replyd.store.schema import EXPORT_COLUMNS as EXPORT_TABLES
from replyd.store.schema import record_fields
from replyd.store.sqlite import SQLITE_BUSY_TIMEOUT_MS, SQLiteStore
from replyd.store.unit import Tx

__all__ = [
    "CLAIM_COMMIT_LEVELS", "CLOSED", "COMPOSING", "DECLINED", "DURABILITIES", "EXPORT_TABLES", "GAVE_UP",
    "NOT_LANDED", "OPEN", "PART_PATH", "PARTS", "REJECTED", "RELEASED", "REOFFERED", "REPLY_ID_EVENTS", "SKIPPED",
    "SQLITE_BUSY_TIMEOUT_MS", "STATES", "SWEPT", "TERMINAL", "UNCONFIRMED", "AnsweredLog", "Claim", "ClaimsInGroup",
    "Durability", "Event", "Expect", "Key",
    "ListingDelay", "PostgresStore", "Reply", "Row", "SQLiteStore", "Store", "Tx", "default_sqlite_path",
    "default_url", "hot_sql", "lease_holder", "make_owner", "record_fields", "redact_url", "sqlite_file",
]
