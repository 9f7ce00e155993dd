"""Responders write the reply text; a responder may decline (return None or "").

Registered by name and configured per bot under ``[bots.responder]``. The
guard calls a responder at most once per claim, after the pre-check, so an
answered parent never costs a call.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from replyd.errors import ConfigError
from replyd.platform import Parent


@runtime_checkable
class Responder(Protocol):
    """Turns a parent into reply text, or None to decline."""

    def __call__(self, parent: Parent) -> str | None:
        """Return the reply for ``parent``, or None/"" to decline."""
        ...


_REGISTRY: dict[str, Callable[[Mapping[str, Any]], Responder]] = {}


def register_responder(kind: str) -> Callable[[Callable[[Mapping[str, Any]], Responder]], Callable[[Mapping[str, Any]], Responder]]:
    """Decorator: make a responder factory configurable as ``kind``."""

    def deco(factory: Callable[[Mapping[str, Any]], Responder]) -> Callable[[Mapping[str, Any]], Responder]:
        _REGISTRY[kind] = factory
        return factory

    return deco


def make_responder(kind: str, settings: Mapping[str, Any]) -> Responder:
    """Build the responder registered as ``kind`` from its settings."""
    try:
        factory = _REGISTRY[kind]
    except KeyError:
        raise ConfigError(f"unknown responder kind {kind!r} (known: {', '.join(sorted(_REGISTRY))})") from None
    return factory(settings)


_FIELDS = ("id", "author_id", "author_handle", "text", "url")


class TemplateResponder:
    """Formats a fixed template over the parent's fields (``{author_handle}``, ``{text}``…)."""

    def __init__(self, template: str) -> None:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f}
        unknown = names - set(_FIELDS)
        if unknown:
            raise ConfigError(f"responder.template: unknown field(s) {sorted(unknown)}; use {list(_FIELDS)}")
        self.template = template

    def __call__(self, parent: Parent) -> str | None:
        """Return the template filled with the parent's fields."""
        return self.template.format(**{f: getattr(parent, f) for f in _FIELDS})


@register_responder("template")
def _template(settings: Mapping[str, Any]) -> Responder:
    template = settings.get("template", "Thanks for your post, @{author_handle}! (answered once by replyd)")
    if not isinstance(template, str) or not template.strip():
        raise ConfigError("responder.template: must be a non-empty string")
    return TemplateResponder(template)
