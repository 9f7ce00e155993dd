"""The async face behind the sync face's API, so the guard's contract and model tests run on both faces.

``BlockingAsyncGuard(...)`` takes ``Guard``'s arguments, builds a ``replyd.aio.AsyncGuard`` and runs each of
its coroutines on a private event loop thread, waiting for the result: a test written against ``Guard``
drives the async face's driver (store calls on its store thread, the send on a worker thread) unchanged.
Attributes are shared with the async guard (``claiming``, ``breaker``, ``owner`` ...), and a seam replaced on
the instance (``g._close = die``) is the async face's seam: a plain function's result is awaited as is.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import pytest

from replyd.aio import AsyncGuard
from replyd.guard import Guard

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

    def close(self) -> None:
        """Stop the async guard's watch task and its store thread."""
        asyncio.run_coroutine_threadsafe(self._g.aclose(), loop()).result()


FACES = {"sync": Guard, "async": BlockingAsyncGuard}


@pytest.fixture(params=sorted(FACES))
def face(request: pytest.FixtureRequest) -> type:
    """The guard class of one face: ``Guard`` or the async face behind the same API."""
    return FACES[request.param]
