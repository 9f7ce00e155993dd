"""The ``webhook`` kind: POSTs the parent as JSON to a URL (HMAC-signed when ``hmac_secret`` is set)."""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, SecretStr, field_validator

from replyd import __version__
from replyd import log as rlog
from replyd.net import require_https
from replyd.responders.base import (Parent, Responder, TimeoutS, declined, register_responder, responder_payload,
                                    secret_value)
from replyd.responders.jsonpost import HttpSettings, HttpUrlText, JsonPost

_SENSITIVE_HEADER = re.compile(r"auth|cookie|token|secret|key|signature|session", re.IGNORECASE)
_RESERVED_HEADERS = {"x-replyd-signature", "x-replyd-timestamp", "content-type", "content-length", "host"}


def webhook_signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=<hex>``: the HMAC-SHA256 with ``secret`` of ``f"{timestamp}.".encode() + body``."""
    mac = hmac.new(secret.encode("utf-8"), timestamp.encode("ascii") + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


class WebhookResponder:
    """POSTs the parent as JSON to a URL (HMAC-signed when ``hmac_secret`` is set).

    The answer: 200 with ``{"text": "..."}`` is the reply (null or "" declines),
    204 declines, anything else is a ``ResponderError``. Only a failed connect is
    retried: after that the webhook may have acted.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2, hmac_secret: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        extra = dict(headers or {})
        secrets = [v for k, v in extra.items() if _SENSITIVE_HEADER.search(k)]
        if hmac_secret:
            secrets.append(hmac_secret)
        for value in secrets:
            rlog.add_secret(value)
        self.timeout_s = timeout_s
        # Held as SecretStr: a traceback's locals or a debugger's view of this object never shows them.
        self._hmac_secret = SecretStr(hmac_secret) if hmac_secret else None
        self._headers: dict[str, str | SecretStr] = {
            "user-agent": f"replyd/{__version__}",
            **{k: SecretStr(v) if _SENSITIVE_HEADER.search(k) else v for k, v in extra.items()},
            "content-type": "application/json",
        }
        self._post = JsonPost("webhook", url, timeout_s=timeout_s, retries=retries, secrets=secrets)

    def __repr__(self) -> str:
        return f"WebhookResponder(url={self._post.origin!r}, signed={self._hmac_secret is not None})"

    async def respond(self, parent: Parent) -> str | None:
        """POST ``parent``; return the answer's ``text`` (null, "" or a 204 declines); raise ResponderError."""
        body = responder_payload(parent)
        headers = {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in self._headers.items()}
        if self._hmac_secret:
            ts = str(int(time.time()))
            headers["x-replyd-timestamp"] = ts
            headers["x-replyd-signature"] = webhook_signature(self._hmac_secret.get_secret_value(), ts, body)
        resp = await self._post.post(body, headers)
        if resp.status_code == 204:
            return None
        if resp.status_code != 200:
            raise self._post.status_error(resp)
        text = self._post.field(self._post.json_object(resp), "text", "text", (str, type(None)))
        return None if text is None else declined(text)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._post.aclose()


class WebhookSettings(HttpSettings):
    """The ``webhook`` kind's settings."""

    kind: ClassVar[str] = "webhook"

    url: HttpUrlText = Field(description="the http:// or https:// URL to POST to")
    timeout_s: TimeoutS = 30.0
    hmac_secret: SecretStr | None = None
    headers: dict[str, str] = {}
    allow_insecure_http: bool = False  # INSECURE_HTTP: credentials over http:// to a non-loopback host

    def credentials(self) -> bool:
        """True when a call carries a secret: a signature under ``hmac_secret`` or a sensitive header."""
        return self.hmac_secret is not None or any(_SENSITIVE_HEADER.search(k) for k in self.headers)

    @field_validator("hmac_secret")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        """A signing secret of at least 16 characters (the error never shows it)."""
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("too short (use at least 16 characters, e.g. `openssl rand -hex 32`)")
        return v

    @field_validator("headers")
    @classmethod
    def _headers(cls, headers: dict[str, str]) -> dict[str, str]:
        """Headers on one printable ASCII line each (no header injection), none of those replyd sets."""
        if not all(k.isascii() and k.isprintable() and v.isascii() and v.isprintable() and k.strip()
                   for k, v in headers.items()):
            raise ValueError("names and values must be printable ASCII on one line")
        reserved = sorted(k for k in headers if k.lower() in _RESERVED_HEADERS)
        if reserved:
            raise ValueError(f"{reserved} are set by replyd")
        return headers


@register_responder("webhook")
def _webhook(settings: Mapping[str, Any]) -> Responder:
    """Build a ``webhook`` responder from its settings; raise ConfigError."""
    s = WebhookSettings.parse(settings)
    if s.credentials():  # the openai kind's rule: no token (nor a signature under one) in clear to another host
        require_https(s.url, allowed=s.allow_insecure_http, where="responder.url")
    return WebhookResponder(s.url, timeout_s=s.timeout_s, retries=s.retries, hmac_secret=secret_value(s.hmac_secret),
                            headers=s.headers)
