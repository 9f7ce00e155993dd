"""The log's reads for people, as named SQL both backends take, run through one ``fetch`` function.

The store runs these queries through SQLAlchemy (``Reads``). The CLI's read commands run the same text
straight through stdlib ``sqlite3`` (``SQLiteReader``): no SQLAlchemy, SQLModel or pydantic to import.

Rules for the SQL here: named parameters as ``:name``; no literal ``%`` and no ``::`` cast, so one text
serves sqlite3 and psycopg (``for_driver`` rewrites the parameters for psycopg).
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from replyd.clock import Clock, SystemClock
from replyd.errors import ContentionError, SchemaError, StoreError
from replyd.lag_summary import LISTING_LAG_WINDOW, LagSummary
from replyd.store.model import (COMPOSING, NOT_LANDED, OPEN, PART_PATH, PARTS, RELEASED, SCHEMA_HEAD, Event,
                                Key, ListingDelay, Row)

_KEY = "platform = :platform AND sender_id = :sender_id AND parent_id = :parent_id"
# A waiting row's bound: a composing row's lease, an open row's deadline, a held row's back-off.
_BOUND = (f"CASE WHEN state = '{COMPOSING}' THEN COALESCE(lease_until, updated_at) "
          f"WHEN state = '{OPEN}' THEN COALESCE(deadline_at, updated_at) "
          f"WHEN state IN ('{RELEASED}', '{NOT_LANDED}') THEN COALESCE(not_before, updated_at) "
          "ELSE updated_at END")
_WHY = "CASE WHEN error LIKE :policy_like THEN error ELSE state END"

SQL: dict[str, str] = {
    "schema_revision": "SELECT version_num FROM alembic_version",
    "counts": "SELECT platform, state, COUNT(*) AS n FROM replies GROUP BY platform, state",
    "oldest_open": f"SELECT * FROM replies WHERE state = '{OPEN}' ORDER BY opened_at LIMIT :limit",
    "in_parts": f"SELECT * FROM replies WHERE state = '{PARTS}' ORDER BY updated_at LIMIT :limit",
    "overdue": (f"SELECT *, {_BOUND} AS bound_at FROM replies "
                f"WHERE state IN ('{COMPOSING}', '{OPEN}', '{RELEASED}', '{NOT_LANDED}') AND {_BOUND} < :before "
                "ORDER BY bound_at LIMIT :limit"),
    "waiting_reasons": (f"SELECT platform, {_WHY} AS why, COUNT(*) AS n FROM replies "
                        f"WHERE state IN ('{RELEASED}', '{NOT_LANDED}') AND path <> '{PART_PATH}' "
                        "GROUP BY platform, why"),
    "duplicate_events": "SELECT platform, sender_id, detail FROM events WHERE kind = 'duplicate_detected'",
    "event_key_counts": ("SELECT platform, sender_id, COUNT(DISTINCT parent_id) AS n FROM events "
                         "WHERE kind = :kind GROUP BY platform, sender_id"),
    "path_counts": ("SELECT platform, sender_id, path, COUNT(*) AS n, MAX(created_at) AS last FROM replies "
                    "GROUP BY platform, sender_id, path ORDER BY platform, sender_id, path"),
    "listing_delays": "SELECT * FROM listing_delay",
    "lag_platforms": "SELECT DISTINCT platform FROM listing_lag",
    "lag_samples": ("SELECT lower_s, upper_s FROM listing_lag WHERE platform = :platform AND upper_s IS NOT NULL "
                    "ORDER BY seen_at DESC LIMIT :limit"),
    "peek": f"SELECT * FROM replies WHERE {_KEY}",
    "answer": f"SELECT parts FROM answers WHERE {_KEY}",
    "history": f"SELECT * FROM events WHERE {_KEY} ORDER BY id",
    "find": "SELECT * FROM replies WHERE parent_id = :parent_id",
    "find_on": "SELECT * FROM replies WHERE parent_id = :parent_id AND platform = :platform",
    "find_events": "SELECT * FROM events WHERE parent_id = :parent_id ORDER BY id",
    "find_events_on": "SELECT * FROM events WHERE parent_id = :parent_id AND platform = :platform ORDER BY id",
    "event_kinds": "SELECT DISTINCT kind FROM events",
}

# ``events_with_path``: each event with its key's row's path; the filters are ANDed in when given.
_EVENTS_WITH_PATH = ("SELECT e.*, r.path AS path FROM events AS e LEFT OUTER JOIN replies AS r "
                     "ON e.platform = r.platform AND e.sender_id = r.sender_id AND e.parent_id = r.parent_id")
_EVENT_FILTERS = {
    "kind": "e.kind = :kind",
    "state": "e.state = :state",
    "platform": "e.platform LIKE :platform ESCAPE '/'",  # contains: the value's wildcards escaped
    "path": "r.path = :path",
    "parent_id": "e.parent_id = :parent_id",
    "since": "e.at >= :since",
}


def for_driver(sql: str, paramstyle: str) -> str:
    """``sql`` in the driver's parameter style: ``:name`` (sqlite3) or ``%(name)s`` (psycopg's pyformat)."""
    return sql if paramstyle == "named" else re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql)


def _contains(text: str) -> str:
    """A LIKE pattern (escape ``/``) that matches any value containing ``text`` as typed."""
    return "%" + text.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"


class Reader:
    """The answered-log's reads for people (status, explain, check, log), over ``_read_sql``.

    Every method is one named query above plus plain Python: the store and the CLI share each one. A
    backend gives ``_read_sql``: run one text with named parameters, return the rows as dicts.
    """

    clock: Clock

    def _read_sql(self, sql: str, params: Mapping[str, Any], doing: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _rows(self, name: str, doing: str, **params: Any) -> list[dict[str, Any]]:
        return self._read_sql(SQL[name], params, doing)

    def counts(self) -> dict[tuple[str, str], int]:
        """Row counts by (platform, state)."""
        return {(m["platform"], m["state"]): int(m["n"]) for m in self._rows("counts", "counting rows")}

    def oldest_open(self, limit: int = 10) -> list[Row]:
        """The oldest open rows."""
        return [Row(**m) for m in self._rows("oldest_open", "reading open rows", limit=limit)]

    def in_parts(self, limit: int = 10) -> list[Row]:
        """The answers being sent in parts (state ``parts``), the longest waiting first."""
        return [Row(**m) for m in self._rows("in_parts", "reading answers in parts", limit=limit)]

    def overdue(self, now: float, grace_s: float, limit: int = 50) -> list[tuple[Row, float]]:
        """Non-terminal rows past their bound by more than ``grace_s``, most overdue first, with seconds over.

        The bound: a composing row's lease, an open row's sweep deadline, a released or not_landed row's
        back-off (or its last change). A job moves each on within ``grace_s`` (sweep, re-find): a row listed
        here is one they did not move.
        """
        out = []
        for m in self._rows("overdue", "reading overdue rows", before=now - grace_s, limit=limit):
            at = m.pop("bound_at")
            out.append((Row(**m), now - at))
        return out

    def waiting_reasons(self) -> dict[tuple[str, str], int]:
        """Rows waiting to be offered again (released, not_landed) by (platform, why).

        The why is the policy's reason for a parent a limit holds back (its error "policy: <reason>"), else
        the row's state.
        """
        rows = self._rows("waiting_reasons", "counting waiting rows", policy_like="policy: %")
        return {(m["platform"], m["why"].removeprefix("policy: ")): int(m["n"]) for m in rows}

    def duplicate_counts(self) -> dict[tuple[str, str], int]:
        """The own replies beyond the first found for one parent, by (platform, sender id).

        Summed from the ``duplicate_detected`` events (each names the newer replies it found). The count an
        operator sees is then the one the log recorded, whoever found them (sweep, adopt).
        """
        out: dict[tuple[str, str], int] = {}
        for m in self._rows("duplicate_events", "counting duplicates"):
            try:
                newer = json.loads(m["detail"] or "{}").get("newer") or []
            except (ValueError, AttributeError):
                newer = [None]  # an event written by hand: one duplicate at least
            key = (m["platform"], m["sender_id"])
            out[key] = out.get(key, 0) + (len(newer) if isinstance(newer, list) else 1)
        return out

    def event_key_counts(self, kind: str) -> dict[tuple[str, str], int]:
        """How many keys have an event of ``kind`` (``unreadable``: items a path moved past), per bot."""
        return {(m["platform"], m["sender_id"]): int(m["n"])
                for m in self._rows("event_key_counts", "counting events", kind=kind)}

    def path_counts(self) -> list[tuple[str, str, str, int, float | None]]:
        """Per bot and discovery path: (platform, sender_id, path, rows, newest created_at), in that order."""
        return [(m["platform"], m["sender_id"], m["path"], int(m["n"]), m["last"])
                for m in self._rows("path_counts", "reading paths")]

    def listing_delays(self) -> dict[str, ListingDelay]:
        """The recorded listing delay of every platform instance."""
        return {m["platform"]: ListingDelay(**m) for m in self._rows("listing_delays", "reading listing delays")}

    def lag_platforms(self) -> list[str]:
        """The platform instances with lag samples."""
        return [m["platform"] for m in self._rows("lag_platforms", "reading listing lag")]

    def lag_samples(self, platform: str, limit: int) -> list[tuple[float, float]]:
        """The newest ``limit`` complete samples of ``platform`` as (lower_s, upper_s), newest first."""
        return [(float(m["lower_s"]), float(m["upper_s"]))
                for m in self._rows("lag_samples", "reading listing lag", platform=platform, limit=limit)]

    def listing(self, window: int = LISTING_LAG_WINDOW) -> list[dict[str, Any]]:
        """Every platform instance's observed lag and delays, for ``replyd status``."""
        delays = self.listing_delays()
        out = []
        for plat in sorted(set(delays) | set(self.lag_platforms())):
            s = LagSummary.of(plat, self.lag_samples(plat, window))
            d = delays.get(plat)
            out.append({"platform": plat, "configured_s": d.configured_s if d else None,
                        "in_use_s": d.in_use_s if d else None, "samples": s.samples, "observed_p50_s": s.p50_s,
                        "observed_p99_s": s.p99_s, "listed_p99_s": s.upper_p99_s})
        return out

    def peek(self, key: Key) -> Row | None:
        """The row of ``key`` as it stands, or None (the full store overrides it with its hot-path read)."""
        rows = self._rows("peek", "reading a row", **_key(key))
        return Row(**rows[0]) if rows else None

    def answer(self, key: Key) -> list[str] | None:
        """The parts of ``key``'s composed answer, in order (``replyd.parts``), or None if it has none stored."""
        rows = self._rows("answer", "reading a composed answer", **_key(key))
        return None if not rows or rows[0]["parts"] is None else list(json.loads(rows[0]["parts"]))

    def history(self, key: Key) -> list[Event]:
        """Every event of ``key`` in order."""
        return [Event(**m) for m in self._rows("history", "reading history", **_key(key))]

    def find(self, parent_id: str, platform: str | None = None) -> list[Row]:
        """Every row whose parent id is exactly ``parent_id`` (any sender)."""
        name, params = ("find_on", {"platform": platform}) if platform else ("find", {})
        return [Row(**m) for m in self._rows(name, "finding a parent", parent_id=parent_id, **params)]

    def find_events(self, parent_id: str, platform: str | None = None) -> list[Event]:
        """Every event for ``parent_id`` (any sender), oldest first: skips leave events but no row."""
        name, params = ("find_events_on", {"platform": platform}) if platform else ("find_events", {})
        return [Event(**m) for m in self._rows(name, "finding events", parent_id=parent_id, **params)]

    def event_kinds(self) -> list[str]:
        """Every event kind this store has recorded, sorted (what ``replyd log --kind`` may ask for)."""
        return sorted(m["kind"] for m in self._rows("event_kinds", "reading event kinds"))

    def events_with_path(self, *, limit: int = 50, kind: str | None = None, state: str | None = None,
                         platform: str | None = None, path: str | None = None, parent_id: str | None = None,
                         since: float | None = None) -> list[dict[str, Any]]:
        """The newest events, newest first, each with the ``path`` of its key's row (None without one).

        ``platform`` matches any instance containing it; ``state`` is the state the event recorded; ``path``
        is the discovery path stored on the key's row. ``detail`` stays the stored JSON text.
        """
        given = {"kind": kind or None, "state": state or None, "platform": _contains(platform) if platform else None,
                 "path": path or None, "parent_id": parent_id, "since": since}
        params = {k: v for k, v in given.items() if v is not None}
        where = " AND ".join(_EVENT_FILTERS[k] for k in params)
        sql = _EVENTS_WITH_PATH + (f" WHERE {where}" if where else "") + " ORDER BY e.id DESC LIMIT :limit"
        return self._read_sql(sql, {**params, "limit": limit}, "reading events")


def event_dict(m: Mapping[str, Any]) -> dict[str, Any]:
    """An event row as a dict with its ``detail`` JSON parsed (left as stored when it is not JSON)."""
    d = dict(m)
    try:
        d["detail"] = json.loads(d.get("detail") or "{}")
    except ValueError:
        pass  # an event written by hand: show it as stored
    return d


def _key(key: Key) -> dict[str, str]:
    return {"platform": key.platform, "sender_id": key.sender_id, "parent_id": key.parent_id}


class SQLiteReader(Reader):
    """A ``Reader`` over a SQLite file through stdlib ``sqlite3``: what the CLI's read commands open.

    It never creates the file, never migrates and never writes. A store not at this replyd's schema is
    refused with the command that fixes it (the full store's check names the revisions).
    """

    def __init__(self, path: Path, *, url: str, clock: Clock | None = None, busy_timeout_s: float = 30.0) -> None:
        self.url = url
        self.clock = clock or SystemClock()
        try:
            self._conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=busy_timeout_s,
                                         check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the store {path}: {exc}") from None
        self._conn.row_factory = sqlite3.Row

    def require_schema(self) -> None:
        """Raise SchemaError unless the store's schema is this replyd's newest revision."""
        try:
            rows = self._conn.execute(SQL["schema_revision"]).fetchall()
        except sqlite3.Error:
            rows = []
        current = rows[0][0] if rows else None
        if current != SCHEMA_HEAD:
            raise SchemaError(f"store schema is at {current or 'nothing'}, replyd needs {SCHEMA_HEAD}: "
                              "run `replyd db upgrade`")

    def _read_sql(self, sql: str, params: Mapping[str, Any], doing: str) -> list[dict[str, Any]]:
        try:
            return [dict(r) for r in self._conn.execute(sql, dict(params))]
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise ContentionError(f"store busy while {doing}: {exc}") from None
            raise StoreError(f"store error while {doing}: {exc}") from None
        except sqlite3.Error as exc:
            raise StoreError(f"store error while {doing}: {exc}") from None

    def dispose(self) -> None:
        """Close the connection."""
        self._conn.close()
