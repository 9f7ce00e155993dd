"""A plain function as a responder (library use and tests; not a configurable kind: it has no settings)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from replyd.responders.base import Parent


class FunctionResponder:
    """Adapts a plain function (sync or async) to the Responder protocol (library use, tests)."""

    def __init__(self, fn: Callable[[Parent], Any]) -> None:
        self.fn = fn

    async def respond(self, parent: Parent) -> str | None:
        """Return what the wrapped function returns for ``parent``."""
        if asyncio.iscoroutinefunction(self.fn):
            return await self.fn(parent)
        # A blocking function must not hold the loop every responder shares.
        return await asyncio.to_thread(self.fn, parent)
