"""The ``openai`` kind: any OpenAI-compatible ``/chat/completions`` endpoint writes the reply."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx
from pydantic import Field, SecretStr, field_validator, model_validator

from replyd import __version__
from replyd import log as rlog
from replyd.net import require_https
from replyd.platforms._http import BearerAuth, retry_after_s
from replyd.responders.base import NonBlank, Parent, Responder, TimeoutS, log, register_responder, secret_value
from replyd.responders.jsonpost import MAX_RESPONSE_BYTES, HttpSettings, HttpUrlText, JsonPost
from replyd.responders.template import TemplateResponder, TemplateText

DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly assistant replying to a post on a social network or forum. "
    "Answer helpfully in the language of the post, in plain text, in at most three sentences."
)
DEFAULT_PROMPT_TEMPLATE = "@{author_handle} wrote:\n{text}"
OPENAI_BASE_URL = "https://api.openai.com/v1"


class OpenAIResponder:
    """Asks an OpenAI-compatible ``/chat/completions`` endpoint for the reply.

    The messages are the system prompt and the parent formatted by
    ``prompt_template``. The reply is ``choices[0].message.content``, stripped;
    null, empty or equal to ``decline_marker`` declines.
    """

    def __init__(self, model: str, *, base_url: str = OPENAI_BASE_URL, api_key: str | None = None,
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
                 max_tokens: int = 300, temperature: float | None = None, timeout_s: float = 60.0,
                 retries: int = 2, decline_marker: str | None = None) -> None:
        if api_key:
            rlog.add_secret(api_key)
        self.model = model
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.decline_marker = decline_marker.strip() if decline_marker else None
        self._prompt = TemplateResponder(prompt_template, key="prompt_template")
        self._post = JsonPost("openai", base_url.rstrip("/") + "/chat/completions", timeout_s=timeout_s,
                               retries=retries, auth=BearerAuth(api_key) if api_key else None,
                               secrets=[api_key] if api_key else [])

    def __repr__(self) -> str:
        return f"OpenAIResponder(model={self.model!r}, url={self._post.origin!r})"

    def request(self, user_text: str) -> dict[str, Any]:
        """The chat completions request body for ``user_text``."""
        req: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": self.system_prompt},
                         {"role": "user", "content": user_text}],
            "max_tokens": self.max_tokens,
        }
        if self.temperature is not None:
            req["temperature"] = self.temperature
        return req

    async def respond(self, parent: Parent) -> str | None:
        """Ask the model once about ``parent``; return its answer (empty or decline_marker declines)."""
        user_text = await self._prompt.respond(parent) or ""
        body = json.dumps(self.request(user_text), ensure_ascii=False).encode("utf-8")
        resp = await self._post.post(body, {"content-type": "application/json", "accept": "application/json",
                                            "user-agent": f"replyd/{__version__}"})
        self._check_status(resp)
        data = self._post.json_object(resp)
        if "choices" not in data and data.get("error"):
            raise self._post.status_error(resp, "answered 200 without 'choices'")
        choices = self._post.field(data, "choices", "choices", list)
        if not choices:
            raise self._post.error("field 'choices' is empty")
        first = choices[0]
        if not isinstance(first, dict):
            raise self._post.error(f"field 'choices[0]' is {type(first).__name__}, expected dict")
        message = self._post.field(first, "message", "choices[0].message", dict)
        content = self._post.field(message, "content", "choices[0].message.content", (str, type(None)))
        if first.get("finish_reason") == "length":
            log.warning("replyd.responder.truncated", responder="openai", model=self.model,
                        hint="the reply hit max_tokens; raise it or ask for shorter answers in system_prompt")
        text = (content or "").strip()
        if not text or text == self.decline_marker:
            return None
        return text

    def _check_status(self, resp: httpx.Response) -> None:
        """Raise ResponderError for any status but 200, saying what it means."""
        status = resp.status_code
        if status == 200:
            return
        if status in (401, 403):
            raise self._post.status_error(resp, f"unauthorized (HTTP {status}; check api_key_env)")
        if status == 429:
            wait = retry_after_s(resp, time.time())
            hint = f"retry-after {wait:g} s" if wait is not None else "no retry-after"
            raise self._post.status_error(resp, f"rate limited (HTTP 429, {hint})")
        if status >= 500:
            raise self._post.status_error(resp, f"server error (HTTP {status})")
        raise self._post.status_error(resp)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._post.aclose()


class OpenAIStreamResponder(OpenAIResponder):
    """The ``openai`` kind with ``stream = true``: also ``Streaming``, the answer handed on as the model writes it."""

    async def stream(self, parent: Parent) -> AsyncIterator[str]:
        """``Streaming``: ask the model once with ``"stream": true`` and yield the answer's text as its server-sent
        events bring it (``choices[0].delta.content``) until ``data: [DONE]``. Text that could still be the
        ``decline_marker`` is held back, so a declined answer shows nothing. A connect failure is retried as in
        ``respond``; nothing is retried once the request may have arrived."""
        from httpx_sse import SSEError, aconnect_sse

        user_text = await self._prompt.respond(parent) or ""
        req = {**self.request(user_text), "stream": True}
        headers = {"accept": "text/event-stream", "user-agent": f"replyd/{__version__}"}
        held, shown = "", False
        try:
            async with aconnect_sse(self._post._http(), "POST", self._post.url, json=req, headers=headers) as source:
                resp = source.response
                if resp.status_code != 200 or "text/event-stream" not in resp.headers.get("content-type", ""):
                    body = (await resp.aread())[:MAX_RESPONSE_BYTES]
                    full = httpx.Response(resp.status_code, headers=resp.headers, content=body, request=resp.request)
                    self._check_status(full)
                    raise self._post.error(f"answered HTTP 200 with {resp.headers.get('content-type') or 'no type'}, "
                                           "not an event stream (does the server support \"stream\"?)")
                async for event in source.aiter_sse():
                    if event.data.strip() == "[DONE]":
                        break
                    delta = self._delta(event.data)
                    if not delta:
                        continue
                    if shown:
                        yield delta
                        continue
                    held += delta  # the answer so far could still be the decline marker: not shown yet
                    if self.decline_marker and self.decline_marker.startswith(held.strip()):
                        continue
                    shown = True
                    yield held
        except (httpx.HTTPError, SSEError) as exc:
            raise self._post.error(f"the stream from {self._post.origin} failed (not retried: the request may have "
                                   f"arrived): {type(exc).__name__}: {exc}") from None
        if not shown and held.strip() != (self.decline_marker or ""):
            yield held  # a short answer that looked like the start of the marker

    def _delta(self, data: str) -> str:
        """One event's text: ``choices[0].delta.content`` (absent in the role and finish events)."""
        try:
            doc = json.loads(data)
        except ValueError:
            raise self._post.error("an event of the stream is not JSON") from None
        if not isinstance(doc, dict):
            raise self._post.error(f"an event of the stream is {type(doc).__name__}, expected a JSON object")
        if doc.get("error"):
            raise self._post.error(f"the stream ended with an error: {str(doc['error'])[:200]}")
        choices = doc.get("choices") or []
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if first.get("finish_reason") == "length":
            log.warning("replyd.responder.truncated", responder="openai", model=self.model,
                        hint="the reply hit max_tokens; raise it or ask for shorter answers in system_prompt")
        delta = first.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        return content if isinstance(content, str) else ""


class OpenAISettings(HttpSettings):
    """The ``openai`` kind's settings."""

    kind: ClassVar[str] = "openai"

    base_url: HttpUrlText = OPENAI_BASE_URL
    model: NonBlank = Field(description="the model name, e.g. gpt-4o-mini")
    api_key: SecretStr | None = None
    system_prompt: NonBlank = DEFAULT_SYSTEM_PROMPT
    prompt_template: TemplateText = DEFAULT_PROMPT_TEMPLATE
    max_tokens: int = Field(300, ge=1, le=100_000)
    temperature: float | None = Field(None, ge=0, le=2)
    decline_marker: NonBlank | None = None
    # Stream the answer (server-sent events): where the platform edits replies, the first part is posted as soon
    # as text comes and grown by edits (docs/RESPONDERS.md); elsewhere the whole answer is sent when it ends.
    stream: bool = False
    allow_insecure_http: bool = False  # INSECURE_HTTP, the platforms' name for the same choice
    timeout_s: TimeoutS = 60.0

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key(cls, value: Any) -> Any:
        """Strip a key (one read from a file often ends with a newline); refuse whitespace or non-ASCII inside."""
        if isinstance(value, str):
            value = value.strip()
            if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
                raise ValueError("contains whitespace or non-ASCII characters")
        return value

    @model_validator(mode="after")
    def _key_for_openai(self) -> OpenAISettings:
        """api.openai.com needs a key (other servers may run without one)."""
        if self.api_key is None and urlsplit(self.base_url).hostname == "api.openai.com":
            raise ValueError("api_key_env: required for api.openai.com (name the variable holding the key)")
        return self


@register_responder("openai")
def _openai(settings: Mapping[str, Any]) -> Responder:
    """Build an ``openai`` responder from its settings; raise ConfigError."""
    s = OpenAISettings.parse(settings)
    require_https(s.base_url, allowed=s.allow_insecure_http, where="responder.base_url")
    kind = OpenAIStreamResponder if s.stream else OpenAIResponder
    return kind(
        s.model, base_url=s.base_url, api_key=secret_value(s.api_key), system_prompt=s.system_prompt,
        prompt_template=s.prompt_template, max_tokens=s.max_tokens, temperature=s.temperature,
        timeout_s=s.timeout_s, retries=s.retries, decline_marker=s.decline_marker,
    )
