"""The PostgreSQL hot path on the event loop: psycopg's async connections run the store's statement steps.

The async face's claims, closes and reads would otherwise each take a trip to a store thread and back (two
thread wake-ups, and the GIL shared with the loop while the thread runs the driver). Here the loop sends the
statement and waits on the socket like any other I/O: no thread, and the decisions between statements are the
store's own (``PostgresStore.hot_steps``), the ones the sync hot path runs. Everything else (transactions,
page claims, the sweep's reads) stays on the store thread.

Connections are autocommit, as the sync hot path's: each statement is its own transaction, and the durability
of a claim or the relaxed commit of a close is inside the statement (``set_config(…, true)``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import psycopg
import sqlalchemy as sa

from replyd.log import get_logger
from replyd.store.base import Stmts
from replyd.store.engine import map_db_error

log = get_logger("replyd.store")

__all__ = ["AsyncHotPath", "HotSteps"]


@runtime_checkable
class HotSteps(Protocol):
    """A store whose hot-path calls can be handed over as statement steps (PostgreSQL)."""

    engine: sa.Engine

    def hot_steps(self, fn: Callable[..., Any], args: Sequence[Any],
                  kwargs: Mapping[str, Any]) -> tuple[Stmts[Any], str] | None:
        """The statements of ``fn(*args, **kwargs)`` and what it is doing, or None when it is not a hot call."""


def conninfo(url: sa.URL) -> str:
    """The psycopg connection string of a SQLAlchemy URL (driver name dropped, password kept)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncHotPath:
    """Up to ``size`` psycopg async connections of one store, running its hot-path steps on the loop."""

    def __init__(self, store: HotSteps, size: int = 8, connect_timeout_s: float = 5.0) -> None:
        self.store = store
        self._conninfo = conninfo(store.engine.url)
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(size)

    def steps(self, fn: Callable[..., Any], args: Sequence[Any],
              kwargs: Mapping[str, Any]) -> tuple[Stmts[Any], str] | None:
        """The statements of a store call, when it is one this path runs (else None: the store thread runs it)."""
        return self.store.hot_steps(fn, args, kwargs)

    async def run(self, steps: Stmts[Any], doing: str) -> Any:
        """Run ``steps``' statements on one connection; return their result. Errors map as the sync path's."""
        async with self._slots:
            conn = await self._connection(doing)
            cur = conn.cursor()  # one per call, not per statement: a cursor costs ~15 µs to make
            try:
                stmt = next(steps)
                while True:
                    await cur.execute(*stmt)
                    rows = await cur.fetchall() if cur.description is not None else []
                    stmt = steps.send(rows)
            except StopIteration as done:
                self._idle.append(conn)
                return done.value
            except psycopg.Error as exc:
                # A statement that failed leaves an autocommit connection usable; a broken one is dropped.
                if conn.broken or conn.closed:
                    await _close(conn)
                else:
                    self._idle.append(conn)
                raise map_db_error(exc, doing) from None
            except (asyncio.CancelledError, KeyboardInterrupt):
                # Cancelled mid-statement (the caller's task, a shutdown): the connection's state is unknown.
                await _close(conn)
                raise
            except BaseException:  # the steps' own Python raised between statements: the connection is clean
                self._idle.append(conn)
                raise

    async def _connection(self, doing: str) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn = self._idle.pop()
            if not (conn.closed or conn.broken):
                return conn
        try:
            return await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True,
                                                         connect_timeout=max(1, int(self._connect_timeout_s)),
                                                         application_name="replyd")
        except psycopg.Error as exc:
            raise map_db_error(exc, doing) from None

    async def aclose(self) -> None:
        """Close every idle connection (one in use is closed by its call)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn)


async def _close(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        await conn.close()
    except Exception:  # closing a broken connection may fail too: nothing left to release
        pass
