"""The async face behind the sync face's API, so the guard's contract and model tests run on both faces.

``BlockingAsyncGuard(...)`` takes ``Guard``'s arguments, builds a ``replyd.aio.AsyncGuard`` and runs each of
its coroutines on a private event loop thread, waiting for the result: a test written against ``Guard``
drives the async face's driver (store calls on its store thread, the send on a worker thread) unchanged.
Attributes are shared with the async guard (``claiming``, ``breaker``, ``owner`` ...), and a seam replaced on
the instance (``g._close = die``) is the async face's seam: a plain function's result is awaited as is.

``StoreOnFace`` is a store reached the way the async face reaches it (every call on its ``StoreThread``,
awaited from the harness loop; a transaction whole on one store thread), so the store contract suite runs on
both faces (``store_on``: the store as is, or behind the async face's threads).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from replyd.aio import AsyncGuard, StoreThread
from replyd.guard import Guard
from replyd.store import Store
from replyd.store.aiopg import AsyncHotPath
from replyd.store.postgres import PostgresStore

_LOOP: asyncio.AbstractEventLoop | None = None
_LOCK = threading.Lock()


def loop() -> asyncio.AbstractEventLoop:
    """One loop thread for every harness guard of the process (started on first use)."""
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="test-aio-face", daemon=True).start()
        return _LOOP


class _Seam:
    """A plain callable set as a seam of the async face: awaited as a coroutine."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        return await out if inspect.isawaitable(out) else out


class BlockingAsyncGuard:
    """``Guard``'s API over an ``AsyncGuard``: every coroutine method runs on the harness loop and is waited for."""

    face = "async"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_g", asyncio.run_coroutine_threadsafe(self._make(args, kwargs), loop()).result())

    @staticmethod
    async def _make(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AsyncGuard:
        return AsyncGuard(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._g, name)
        if inspect.iscoroutinefunction(value) or isinstance(value, _Seam):
            return lambda *a, **kw: asyncio.run_coroutine_threadsafe(value(*a, **kw), loop()).result()
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") and callable(value) and name in ("_close", "_open_composed", "_send", "_claim"):
            value = _Seam(value)
        setattr(self._g, name, value)

    def settle(self) -> None:
        """Wait until every send cut at its real-time budget has returned on its thread, and its late close is
        written: a test's steps are sequential, so such a send must not act inside the next one."""
        asyncio.run_coroutine_threadsafe(self._settled(), loop()).result()

    async def _settled(self) -> None:
        g = self._g
        while g.sends.running() or g._late:
            if g._late:
                await asyncio.gather(*list(g._late), return_exceptions=True)
            else:
                await asyncio.sleep(0.005)
        await g.store_thread.run(int)  # the store thread runs its calls in order: those queued before have ended

    def close(self) -> None:
        """Stop the async guard's watch task and its store thread."""
        asyncio.run_coroutine_threadsafe(self._g.aclose(), loop()).result()


def _on(thread: StoreThread, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run as the async face runs a store call: awaited from the loop, on ``thread``."""
    return asyncio.run_coroutine_threadsafe(thread.run(fn, *args, **kwargs), loop()).result()


class _CallsOn:
    """An object whose every call runs on a store thread (a ``Tx`` inside a transaction on the face)."""

    def __init__(self, inner: Any, thread: StoreThread) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_thread", thread)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value) or name.startswith("__"):
            return value
        return lambda *a, **kw: _on(self._thread, value, *a, **kw)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)  # ``store.clock = ...``, ``store.claim_commit = ...``: the store's own


class StoreOnFace(_CallsOn):
    """A store reached as ``replyd.aio`` reaches it: each call on the face's ``StoreThread`` (one on SQLite, four
    on PostgreSQL, as ``open_guard`` starts them), a transaction entered, used and left on one store thread;
    on PostgreSQL the hot-path calls (claim, compare-and-set, reads of a row) on the loop through psycopg's async
    connection (``AsyncHotPath``), as ``AsyncGuard`` runs them."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, StoreThread(store, 1 if store.is_sqlite else 4))
        object.__setattr__(self, "_tx_thread", StoreThread(store, 1))  # a whole transaction on one thread
        object.__setattr__(self, "_hot", AsyncHotPath(store) if isinstance(store, PostgresStore) else None)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if self._hot is None or not callable(value) or name.startswith("_"):
            return super().__getattr__(name)

        def call(*a: Any, **kw: Any) -> Any:
            hot = self._hot.steps(value, a, kw)
            if hot is None:
                return _on(self._thread, value, *a, **kw)
            return asyncio.run_coroutine_threadsafe(self._hot.run(*hot), loop()).result()

        return call

    @contextmanager
    def transaction(self, **kwargs: Any) -> Iterator[Any]:
        """The store's transaction, every step of it on one store thread (as the face runs one: one call)."""
        cm = _on(self._tx_thread, self._inner.transaction, **kwargs)
        tx = _on(self._tx_thread, cm.__enter__)
        try:
            yield _CallsOn(tx, self._tx_thread)
        except BaseException as exc:
            if not _on(self._tx_thread, cm.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            _on(self._tx_thread, cm.__exit__, None, None, None)

    def close(self) -> None:
        """Stop the face's store threads (the store itself stays open: its owner disposes it)."""
        self._thread.close()
        self._tx_thread.close()
        if self._hot is not None:
            asyncio.run_coroutine_threadsafe(self._hot.aclose(), loop()).result()


def raw(store: Any) -> Store:
    """The store behind ``store`` (itself when it is one)."""
    return store._inner if isinstance(store, StoreOnFace) else store


FACES = {"sync": Guard, "async": BlockingAsyncGuard}


@pytest.fixture(params=sorted(FACES))
def face(request: pytest.FixtureRequest) -> type:
    """The guard class of one face: ``Guard`` or the async face behind the same API."""
    return FACES[request.param]


@contextmanager
def store_on(face: type, store: Store) -> Iterator[Any]:
    """``store`` as ``face`` reaches it: as is (the sync face), or through the async face's store threads."""
    if face is Guard:
        yield store
        return
    faced = StoreOnFace(store)
    try:
        yield faced
    finally:
        faced.close()


class CountingThread(StoreThread):
    """The face's store thread, counting what it was given to run (by function name)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, 2)
        self.names: list[str] = []

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Count ``fn``, then run it on the thread as the face does."""
        self.names.append(getattr(fn, "__name__", repr(fn)))
        return await super().run(fn, *args, **kwargs)


def probed(store: Store, platform: Any, posts: Any, *, start: Any = None) -> tuple[list[Any], list[float], list[str]]:
    """Run ``await posts(guard)`` on a fresh loop with an ``AsyncGuard`` over ``store`` and a loop-lag probe
    (a 1 ms sleep's overshoot); ``start()`` is called once the probe runs. Returns the outcomes, the lags and
    the names of the calls the store thread ran."""

    async def run() -> tuple[list[Any], list[float], list[str]]:
        thread = CountingThread(store)
        g = AsyncGuard(store, platform, platform.whoami(), watch_interval_s=None, store_thread=thread)
        lags: list[float] = []
        stop = asyncio.Event()

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t0 - 0.001)

        watcher = asyncio.create_task(probe())
        if start is not None:
            start()
        outs = await posts(g)
        stop.set()
        await watcher
        await g.aclose()
        return outs, lags, thread.names

    return asyncio.run(run())
