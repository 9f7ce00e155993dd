"""replyd: answer each post, thread or ticket exactly once."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The library API, imported on first use so `import replyd` (and the sim, the CLI) stays light.
_LAZY = {
    "open_guard": "replyd.library",
    "GuardSession": "replyd.library",
    "submit": "replyd.library",
    "rearm": "replyd.library",
    "adopt": "replyd.library",
    "Guard": "replyd.guard",
    "Outcome": "replyd.guard",
    "Status": "replyd.guard",
    "Parent": "replyd.platforms.base",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import the library API lazily: ``from replyd import open_guard``."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'replyd' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
