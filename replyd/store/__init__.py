"""The answered-log: one row per key ``(platform instance, own sender id, parent id as served)`` in
``replies``; every state change appends to ``events`` in the same transaction; pollers keep their positions
in ``cursors``; own replies' listing lag in ``listing_lag`` / ``listing_delay``.

``Store.open(url)`` returns the backend the URL names: ``SQLiteStore`` (embedded default) or ``PostgresStore``
(several replicas). Both follow one contract (``AnsweredLog``); callers see ``Row`` / ``Event`` records and
never a SQLAlchemy object.
"""

from typing import TYPE_CHECKING, Any

# The light names (states, keys, records) come from ``model`` at once. The rest loads on first use, so that
# ``import replyd.store.model`` (and the CLI's read commands) never import SQLAlchemy.
from replyd.store.model import (
    ANSWERED_EVENTS,
    CLAIM_COMMIT_LEVELS,
    CLOSED,
    DECIDABLE,
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

if TYPE_CHECKING:
    from replyd.store.base import ClaimsInGroup, Store
    from replyd.store.contract import AnsweredLog
    from replyd.store.engine import redact_url, sqlite_file
    from replyd.store.location import default_sqlite_path, default_url
    from replyd.store.hotsql import hot_sql
    from replyd.store.postgres import PostgresStore
    from replyd.store.schema import EXPORT_TABLES
    from replyd.store.schema import record_fields
    from replyd.store.sqlite import SQLITE_BUSY_TIMEOUT_MS, SQLiteStore
    from replyd.store.unit import Tx

# name -> the module that defines it. The backends register with ``Store`` on import: ``__getattr__`` loads both.
_HEAVY = {
    "ClaimsInGroup": "base", "Store": "base", "AnsweredLog": "contract", "redact_url": "engine",
    "sqlite_file": "engine", "default_sqlite_path": "location", "default_url": "location", "hot_sql": "hotsql",
    "PostgresStore": "postgres", "EXPORT_TABLES": "schema", "record_fields": "schema",
    "SQLITE_BUSY_TIMEOUT_MS": "sqlite", "SQLiteStore": "sqlite", "Tx": "unit",
}


def __getattr__(name: str) -> Any:
    """Load a store name on first use (PEP 562), with both backends so ``Store.open`` knows them."""
    import importlib

    if name not in _HEAVY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module("replyd.store.sqlite")
    importlib.import_module("replyd.store.postgres")
    module = f"replyd.store.{_HEAVY[name]}"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ANSWERED_EVENTS", "CLAIM_COMMIT_LEVELS", "CLOSED", "COMPOSING", "DECIDABLE", "DECLINED", "DURABILITIES", "EXPORT_TABLES", "GAVE_UP",
    "NOT_LANDED", "OPEN", "PART_PATH", "PARTS", "REJECTED", "RELEASED", "REOFFERED", "REPLY_ID_EVENTS", "SKIPPED",
    "SQLITE_BUSY_TIMEOUT_MS", "STATES", "SWEPT", "TERMINAL", "UNCONFIRMED", "AnsweredLog", "Claim", "ClaimsInGroup",
    "Durability", "Event", "Expect", "Key",
    "ListingDelay", "PostgresStore", "Reply", "Row", "SQLiteStore", "Store", "Tx", "default_sqlite_path",
    "default_url", "hot_sql", "lease_holder", "make_owner", "record_fields", "redact_url", "sqlite_file",
]
