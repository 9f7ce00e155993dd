"""Schema migrations (alembic), run in-process so an upgrade never needs a config file.

Several replicas may start at once: on PostgreSQL the upgrade holds an
advisory lock, so exactly one migrates and the others wait and find it done.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.util import CommandError
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

# Any fixed 64-bit number works; this one spells "replyd" in ASCII.
_ADVISORY_LOCK_ID = 0x7265706C7964


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", "replyd:migrations")
    return cfg


def head() -> str:
    """Return the newest revision this replyd knows."""
    return ScriptDirectory.from_config(_config()).get_current_head() or ""


def revisions(engine: Engine) -> tuple[str | None, str]:
    """Return (the database's revision, the newest known revision)."""
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    return current, head()


def known(revision: str) -> bool:
    """Whether ``revision`` is one of this replyd's migrations (not one a newer replyd wrote)."""
    try:
        return ScriptDirectory.from_config(_config()).get_revision(revision) is not None
    except CommandError:
        return False


@contextmanager
def _sqlite_lock(engine: Engine) -> Iterator[None]:
    """Serialise migrations of one SQLite file across processes with an flock."""
    db = engine.url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        yield
        return
    # Owner-only like the store it guards (os.open: the mode applies when the file is created).
    with os.fdopen(os.open(f"{db}.migrate.lock", os.O_CREAT | os.O_RDWR | os.O_APPEND, 0o600), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision``."""
    if revision == "head" and revisions(engine)[0] == head():
        return  # the common start: nothing to do, take no lock
    if engine.dialect.name == "sqlite":
        with _sqlite_lock(engine):
            _upgrade(engine, revision)
    else:
        _upgrade(engine, revision)


def _upgrade(engine: Engine, revision: str) -> None:
    cfg = _config()
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({_ADVISORY_LOCK_ID})")
            conn.commit()
        try:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        finally:
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_ADVISORY_LOCK_ID})")
                conn.commit()
