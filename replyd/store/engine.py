"""Database URLs (defaults, redaction, secrets), the error mapping, and what every backend's engine shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa

from replyd.errors import ContentionError, SchemaError, StoreError
from replyd.store.location import default_sqlite_path, default_url  # noqa: F401  (their light home)


def sqlite_file(url: str) -> Path | None:
    """Return the file a SQLite URL names (None for an in-memory database or a ``file:`` URI)."""
    db = sa.engine.make_url(url).database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db).expanduser()


# Query parameters of a database URL that carry a secret (libpq takes ``?password=``, ``?sslpassword=``).
_SECRET_PARAM_WORDS = ("password", "secret", "token")


def _secret_params(url: sa.URL) -> list[str]:
    return [k for k in url.query if any(w in k.lower() for w in _SECRET_PARAM_WORDS)]


def redact_url(url: str | sa.URL) -> str:
    """Return ``url`` with its password and any secret query parameter replaced by ``***``, for people and logs."""
    try:
        parsed = sa.engine.make_url(url)
        hidden = _secret_params(parsed)
        if hidden:
            parsed = parsed.update_query_dict({k: "***" for k in hidden})
        return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")
    except Exception:  # an unparsable URL is reported by the caller; never echo it raw
        return "<unparsable database URL>"


def _register_url_secrets(url: sa.URL) -> None:
    """Register the URL's password and secret query values with the log masker."""
    from replyd import log as rlog

    values: list[Any] = [url.password] + [url.query[k] for k in _secret_params(url)]
    for v in values:
        for one in (v if isinstance(v, tuple) else (v,)):
            if one:
                rlog.add_secret(str(one))


def map_db_error(exc: BaseException, doing: str) -> Exception:
    """Map a DBAPI/SQLAlchemy error to ContentionError or StoreError."""
    text = str(getattr(exc, "orig", exc)).lower()
    if "database is locked" in text or "lock timeout" in text or "could not serialize" in text:
        return ContentionError(f"store busy while {doing}: another writer holds the lock")
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        return SchemaError(f"store schema missing while {doing}: run `replyd db upgrade`")
    detail = str(getattr(exc, "orig", exc)).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return StoreError(f"store unavailable while {doing}: {detail}")



def parse_url(url: str) -> sa.URL:
    """Parse a store URL (its secrets registered with the log masker); StoreError naming it, redacted, if bad."""
    try:
        parsed = sa.engine.make_url(url)
    except Exception as exc:
        raise StoreError(f"bad store URL {redact_url(url)!r}: {exc}") from None
    _register_url_secrets(parsed)
    return parsed


def is_sqlite_url(parsed: sa.URL) -> bool:
    """Whether ``parsed`` names a SQLite database."""
    return parsed.drivername.startswith("sqlite")
