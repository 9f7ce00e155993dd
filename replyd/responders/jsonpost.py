"""The HTTP plumbing and settings the ``webhook`` and ``openai`` kinds share.

``JsonPost`` makes one JSON POST: a capped read, retries only after a failed connect,
errors that show a URL's origin only, with secrets masked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import stamina
from pydantic import AfterValidator, Field

from replyd import log as rlog
from replyd.errors import ResponderError
from replyd.platforms._http import redact, server_error_text
from replyd.responders.base import NonBlank, ResponderSettings


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url``: what errors and logs may show (paths and queries may hold tokens)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{port}" if port else "")


def _http_url(url: str) -> str:
    """Refuse anything but an http(s) URL with a host (never echoing the URL: it may hold a token)."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  (validates the port)
    except ValueError:
        raise ValueError("the port is not a number in 0-65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host (got scheme {parts.scheme or 'none'!r})")
    return url


def _safe(text: str, secrets: Sequence[str], limit: int = 300) -> str:
    """``text`` with the given and every registered secret masked, cut to ``limit`` characters."""
    return rlog.mask(redact(text, secrets))[:limit]


HttpUrlText = Annotated[NonBlank, AfterValidator(_http_url)]


class HttpSettings(ResponderSettings):
    """The settings of a kind that POSTs over HTTP: ``retries`` (after a failed connect only)."""

    retries: int = Field(2, ge=0, le=10)


# Only these prove the request never reached the server; anything later may have acted.
_CONNECT_FAILED = (httpx.ConnectError, httpx.ConnectTimeout)
MAX_RESPONSE_BYTES = 1024 * 1024
_MISSING = object()
_HOP_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})


class JsonPost:
    """POSTs JSON to one URL for a responder: a lazy AsyncClient, retries only on failed connects,
    a capped body, and errors that show the origin only, with secrets masked."""

    def __init__(self, name: str, url: str, *, timeout_s: float, retries: int, auth: httpx.Auth | None = None,
                 secrets: Sequence[str] = (), backoff_s: float = 0.25) -> None:
        self.name = name
        self.url = url
        self.origin = _origin(url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._auth = auth
        self._secrets = tuple(s for s in secrets if s)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        """The client, created on first use (on the responders' loop); redirects are never followed."""
        if self._client is None or self._client.is_closed:
            # The overall deadline is the asyncio.timeout in post(); connects get a share so retries fit.
            timeout = httpx.Timeout(self.timeout_s + 5.0, connect=min(10.0, self.timeout_s))
            self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, auth=self._auth)
        return self._client

    async def aclose(self) -> None:
        """Close the client, if one was created."""
        if self._client is not None:
            await self._client.aclose()

    def error(self, what: str) -> ResponderError:
        """A ResponderError ``<name>: <what>`` with secrets masked."""
        return ResponderError(_safe(f"{self.name}: {what}", self._secrets))

    def status_error(self, resp: httpx.Response, what: str = "") -> ResponderError:
        """A ResponderError for an unexpected status, with the server's short error text if any."""
        status = resp.status_code
        what = what or (f"{self.origin} answered HTTP {status}"
                        + (" (redirects are not followed)" if 300 <= status < 400 else ""))
        server = server_error_text(resp)
        return self.error(what + (f": {server}" if server else ""))

    async def post(self, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        """POST ``body``; return the response with its body read (any status); raise ResponderError."""
        attempts = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                async for attempt in stamina.retry_context(
                    on=_CONNECT_FAILED, attempts=self.retries + 1, timeout=None,
                    wait_initial=self.backoff_s, wait_max=2.0, wait_jitter=0.1,
                ):
                    with attempt:
                        attempts += 1
                        return await self._once(body, headers)
        except TimeoutError:
            raise self.error(f"no answer from {self.origin} within {self.timeout_s:g} s "
                             "(not retried: the request may have arrived)") from None
        except _CONNECT_FAILED as exc:
            raise self.error(f"could not connect to {self.origin} after {attempts} attempt(s): "
                             f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:  # read/write errors, protocol errors: it may have arrived
            raise self.error(f"request to {self.origin} failed (not retried: it may have arrived): "
                             f"{type(exc).__name__}: {exc}") from None
        raise self.error("no attempt was made")  # unreachable: stamina either returns or raises

    async def _once(self, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        """One POST; read at most ``MAX_RESPONSE_BYTES`` of the (decoded) body."""
        async with self._http().stream("POST", self.url, content=body, headers=headers) as resp:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
                raise self.error(f"response from {self.origin} is larger than {MAX_RESPONSE_BYTES} bytes")
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > MAX_RESPONSE_BYTES:
                    raise self.error(f"response from {self.origin} is larger than {MAX_RESPONSE_BYTES} bytes")
        kept = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in _HOP_HEADERS]
        return httpx.Response(resp.status_code, headers=kept, content=bytes(buf), request=resp.request)

    def json_object(self, resp: httpx.Response) -> dict[str, Any]:
        """The body as a JSON object; raise ResponderError saying what is wrong with it."""
        try:
            data = json.loads(resp.content)
        except RecursionError:
            raise self.error(f"body nests too deeply to parse (HTTP {resp.status_code})") from None
        except (ValueError, UnicodeDecodeError):
            ctype = resp.headers.get("content-type", "").split(";")[0].strip() or "no content-type"
            raise self.error(f"body is not JSON ({ctype}, HTTP {resp.status_code})") from None
        if not isinstance(data, dict):
            raise self.error(f"body is not a JSON object (got {type(data).__name__})")
        return data

    def field(self, obj: dict[str, Any], key: str, path: str, expect: type | tuple[type, ...]) -> Any:
        """Return ``obj[key]`` if it has the ``expect`` type(s); raise ResponderError naming ``path``."""
        value = obj.get(key, _MISSING)
        if value is _MISSING:
            raise self.error(f"field {path!r} is missing")
        if not isinstance(value, expect):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in _as_tuple(expect))
            raise self.error(f"field {path!r} is {type(value).__name__}, expected {names}")
        return value


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    """``t`` as a tuple of types."""
    return t if isinstance(t, tuple) else (t,)
