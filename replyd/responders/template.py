"""The ``template`` kind: a format string over the parent's fields."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator

from replyd.errors import ConfigError
from replyd.responders.base import NonBlank, Parent, Responder, ResponderSettings, register_responder

# author_handle is what the platform vouches for (empty when there is none); author_name is a display name
# the sender chose (the adapter's extra["author_name"]), else the handle, else the id.
_FIELDS = ("id", "author_id", "author_handle", "author_name", "text", "url")
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
        name = parent.extra.get("author_name")
        shown = name if isinstance(name, str) and name else parent.author_handle or parent.author_id
        return self.template.format(id=parent.id, author_id=parent.author_id, author_handle=parent.author_handle,
                                    author_name=shown, text=parent.text, url=parent.url)


class TemplateSettings(ResponderSettings):
    """The ``template`` kind's settings."""

    kind: ClassVar[str] = "template"

    template: TemplateText = DEFAULT_TEMPLATE


@register_responder("template")
def _template(settings: Mapping[str, Any]) -> Responder:
    """Build a ``template`` responder from its settings; raise ConfigError."""
    return TemplateResponder(TemplateSettings.parse(settings).template)
