"""Where the embedded store lives, and which file a plain SQLite URL names. Stdlib only: no SQLAlchemy."""

from __future__ import annotations

import os
from pathlib import Path


def default_sqlite_path() -> Path:
    """Return ``$XDG_STATE_HOME/replyd/replyd.sqlite3`` (else under ``~/.local/state``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "replyd" / "replyd.sqlite3"


def default_url() -> str:
    """Return the SQLAlchemy URL of the embedded default store."""
    return f"sqlite:///{default_sqlite_path()}"


def plain_sqlite_file(url: str) -> Path | None:
    """The file of a plain ``sqlite:///path`` URL; None for any other (a query, a ``file:`` URI, memory, a server).

    SQLAlchemy reads ``sqlite:///rel`` as a relative path and ``sqlite:////abs`` as an absolute one: so
    does this. A URL it cannot read this simply is left to ``sqlalchemy.engine.make_url``.
    """
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    db = url[len(prefix):]
    if not db or db == ":memory:" or db.startswith("file:") or any(c in db for c in "?%#"):
        return None
    return Path(db).expanduser()
