"""Responders write the reply text; a responder may decline (return None or "").

One module per kind (``template``, ``command``, ``webhook``, ``openai``; ``function``
for library use), each with its settings model; ``base`` holds the Protocol,
the registry, ``ResponderRunner`` and the settings base; ``jsonpost`` the HTTP
plumbing the webhook and openai kinds share. Importing this package registers
every kind.
"""

from __future__ import annotations

from replyd.responders.base import (
    PAYLOAD_VERSION,
    Bounded,
    Closable,
    Factory,
    Responder,
    ResponderRunner,
    ResponderSettings,
    make_responder,
    register_responder,
    responder_kinds,
    responder_loop,
    responder_payload,
    runner_bound_s,
    timeout_setting,
)
from replyd.responders.command import CHILD_ENV, CommandResponder, CommandSettings
from replyd.responders.function import FunctionResponder
from replyd.responders.jsonpost import MAX_RESPONSE_BYTES
from replyd.responders.openai import (
    DEFAULT_PROMPT_TEMPLATE,
    DEFAULT_SYSTEM_PROMPT,
    OPENAI_BASE_URL,
    OpenAIResponder,
    OpenAISettings,
)
from replyd.responders.template import TemplateResponder, TemplateSettings
from replyd.responders.webhook import WebhookResponder, WebhookSettings, webhook_signature

__all__ = [
    "CHILD_ENV",
    "DEFAULT_PROMPT_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "MAX_RESPONSE_BYTES",
    "OPENAI_BASE_URL",
    "PAYLOAD_VERSION",
    "Bounded",
    "Closable",
    "CommandResponder",
    "CommandSettings",
    "Factory",
    "FunctionResponder",
    "OpenAIResponder",
    "OpenAISettings",
    "Responder",
    "ResponderRunner",
    "ResponderSettings",
    "TemplateResponder",
    "TemplateSettings",
    "WebhookResponder",
    "WebhookSettings",
    "make_responder",
    "register_responder",
    "responder_kinds",
    "responder_loop",
    "responder_payload",
    "runner_bound_s",
    "timeout_setting",
    "webhook_signature",
]
