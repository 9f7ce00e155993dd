"""The ``template`` kind: a format string over the parent's fields."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator

from replyd.errors import ConfigError
from replyd.responders.base import NonBlank, Parent, Responder, ResponderSettings, register_responder

_FIELDS = ("id", "author_id", "author_handle", "text", "url")
DEFAULT_TEMPLATE = "Thanks for your post, @{author_handle}! (answered once by replyd)"


def check_template(template: str) -> str:
    """Return ``template`` if it is a format string over ``_FIELDS`` only; raise ValueError saying why not."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(f"not a valid format string: {exc}") from None
    unknown = names - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; use {list(_FIELDS)}")
    return template


# A setting holding a template: non-empty, and only the parent's fields.
TemplateText = Annotated[NonBlank, AfterValidator(check_template)]


class TemplateResponder:
    """Formats a fixed template over the parent's fields (``{author_handle}``, ``{text}``…)."""

    def __init__(self, template: str, *, key: str = "template") -> None:
        try:
            self.template = check_template(template)
        except ValueError as exc:
            raise ConfigError(f"responder.{key}: {exc}") from None

    async def respond(self, parent: Parent) -> str | None:
        """Return the template filled with the parent's fields."""
        return self.template.format(**{f: getattr(parent, f) for f in _FIELDS})


class TemplateSettings(ResponderSettings):
    """The ``template`` kind's settings."""

    kind: ClassVar[str] = "template"

    template: TemplateText = DEFAULT_TEMPLATE


@register_responder("template")
def _template(settings: Mapping[str, Any]) -> Responder:
    """Build a ``template`` responder from its settings; raise ConfigError."""
    return TemplateResponder(TemplateSettings.parse(settings).template)
