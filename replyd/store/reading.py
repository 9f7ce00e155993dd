"""Reading the answered-log for people: recent events, paths, and exports as CSV or JSON.

The CLI's read commands and the HTTP API use these. The module needs the store alone, never the guard.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any, TextIO

from replyd import store as st
from replyd.errors import ConfigError
from replyd.store import Store
from replyd.store.reader import event_dict as _event_dict


def events(
    store: Store,
    *,
    limit: int = 50,
    kind: str | None = None,
    state: str | None = None,
    platform: str | None = None,
    path: str | None = None,
    parent_id: str | None = None,
    since: float | None = None,
) -> list[dict[str, Any]]:
    """Return the newest events, newest first, with the path that found each key.

    ``platform`` matches any instance containing it; ``state`` is the state the
    event recorded; ``path`` is the discovery path stored on the key's row.
    """
    return [_event_dict(m) for m in store.events_with_path(limit=limit, kind=kind, state=state, platform=platform,
                                                          path=path, parent_id=parent_id, since=since)]


def paths(store: Store) -> list[dict[str, Any]]:
    """Per bot and discovery path: how many keys it found, and when it last found one (epoch seconds).

    A path whose newest find is old has stopped finding (a poller down, a
    search that matches nothing); the keys themselves are not listed.
    """
    return [{"platform": p, "sender_id": s, "path": path, "rows": n, "last_found_at": last}
            for p, s, path, n, last in store.path_counts()]


TABLES = st.EXPORT_TABLES


def iter_table(store: Store, table: str, *, since: float | None = None) -> Iterator[dict[str, Any]]:
    """Yield every row of ``replies`` or ``events`` (oldest first), optionally updated/at since ``since``."""
    if table not in TABLES:
        raise ConfigError(f"export: unknown table {table!r} (known: {', '.join(TABLES)})")
    for m in store.export_rows(table, since=since):
        yield _event_dict(m) if table == "events" else m


# Columns holding an epoch; exports write them as ISO 8601 (UTC), as every other tool reads times.
TIME_COLUMNS = frozenset({"at", "created_at", "updated_at", "opened_at", "deadline_at", "closed_at", "not_before",
                          "lease_until"})


def iso(t: float | None) -> str | None:
    """An epoch as ISO 8601 in UTC with milliseconds (``2026-12-01T14:22:43.123+00:00``); None stays None."""
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def export(store: Store, out: TextIO, *, table: str = "replies", fmt: str = "csv", since: float | None = None) -> int:
    """Write ``table`` to ``out`` as CSV or a JSON array, times in ISO 8601; return the number of rows written."""
    if fmt not in ("csv", "json"):
        raise ConfigError(f"export: unknown format {fmt!r} (use csv or json)")
    if table not in TABLES:
        raise ConfigError(f"export: unknown table {table!r} (known: {', '.join(TABLES)})")
    columns = list(TABLES[table])
    n = 0
    rows = ({k: iso(v) if k in TIME_COLUMNS and isinstance(v, (int, float)) else v for k, v in r.items()}
            for r in iter_table(store, table, since=since))
    if fmt == "csv":
        w = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        w.writeheader()
        for row in rows:
            if "detail" in row and not isinstance(row["detail"], str):
                row["detail"] = json.dumps(row["detail"], sort_keys=True)
            w.writerow(row)
            n += 1
        return n
    out.write("[")
    for row in rows:
        out.write(("," if n else "") + "\n" + json.dumps(row, default=str, sort_keys=True))
        n += 1
    out.write("\n]\n" if n else "]\n")
    return n
