"""Responders write the reply text; a responder may decline (return None or "").

A responder is an object with one async method, ``respond(parent)``, registered
by name and configured per bot under ``[bots.responder]`` (``kind`` plus the
responder's own settings). The guard calls it at most once per claim, after
the read-only pre-check, so an answered, in-flight, rejected or given-up
parent never costs a call.

The daemon's jobs run in threads; ``ResponderRunner`` runs the coroutine on
one shared event loop thread (so HTTP clients keep their connection pools),
bounds it with ``timeout_s`` and maps every failure to ``ResponderError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import httpx
import stamina
import structlog

from replyd import __version__
from replyd import log as rlog
from replyd.errors import ConfigError, ResponderError
from replyd.platforms.base import Parent
from replyd.platforms._http import INSECURE_HTTP, BearerAuth, redact, require_https, retry_after_s, server_error_text

log = structlog.get_logger("replyd.responder")


@runtime_checkable
class Responder(Protocol):
    """Turns a parent into reply text, or None/"" to decline."""

    async def respond(self, parent: Parent) -> str | None:
        """Return the reply for ``parent``, or None/"" to decline; raise on failure."""
        ...


Factory = Callable[[Mapping[str, Any]], Responder]
_REGISTRY: dict[str, Factory] = {}


def register_responder(kind: str) -> Callable[[Factory], Factory]:
    """Decorator: make a responder factory configurable as ``kind``."""

    def deco(factory: Factory) -> Factory:
        _REGISTRY[kind] = factory
        return factory

    return deco


def responder_kinds() -> list[str]:
    """Return the registered responder kinds, sorted."""
    return sorted(_REGISTRY)


def make_responder(kind: str, settings: Mapping[str, Any]) -> Responder:
    """Build the responder registered as ``kind`` from its settings; raise ConfigError."""
    try:
        factory = _REGISTRY[kind]
    except KeyError:
        raise ConfigError(f"responder.kind: unknown responder {kind!r} (known: {', '.join(responder_kinds())})") from None
    return factory(settings)


# -- running async responders from worker threads ----------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def responder_loop() -> asyncio.AbstractEventLoop:
    """Return the shared event loop responders run on, starting its thread on first use."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="replyd-responders", daemon=True).start()
            _loop = loop
        return _loop


def _checked(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ResponderError(f"responder returned {type(value).__name__}, expected text or None")


class ResponderRunner:
    """Calls an async responder from a sync caller, with a timeout; every failure is a ResponderError."""

    def __init__(self, responder: Responder, *, timeout_s: float = 60.0, name: str = "") -> None:
        self.responder = responder
        self.timeout_s = timeout_s
        self.name = name or type(responder).__name__

    def __call__(self, parent: Parent) -> str | None:
        """Return the responder's text for ``parent`` (None/"" declines); raise ResponderError."""
        coro = asyncio.wait_for(self.responder.respond(parent), self.timeout_s)
        fut = asyncio.run_coroutine_threadsafe(coro, responder_loop())
        try:
            return _checked(fut.result(self.timeout_s + 5.0))
        except ResponderError:
            raise
        except (TimeoutError, asyncio.TimeoutError):
            fut.cancel()
            raise ResponderError(f"{self.name}: no answer within {self.timeout_s:g} s") from None
        except Exception as exc:  # a responder's own bug must not stop the poller
            raise ResponderError(f"{self.name}: {type(exc).__name__}: {exc}"[:300]) from exc

    def close(self) -> None:
        """Release what the responder holds (HTTP clients, child processes)."""
        aclose = getattr(self.responder, "aclose", None)
        if aclose is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(aclose(), responder_loop()).result(10.0)
        except Exception as exc:  # shutdown goes on regardless
            log.warning("replyd.responder.close_failed", responder=self.name, error=str(exc)[:200])


def timeout_setting(settings: Mapping[str, Any], default_s: float = 60.0) -> float:
    """Return ``timeout_s`` from a responder's settings, validated; raise ConfigError."""
    v = settings.get("timeout_s", default_s)
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 3600:
        raise ConfigError(f"responder.timeout_s: must be a number of seconds in (0, 3600], got {v!r}")
    return float(v)


# -- template ---------------------------------------------------------------------------

_FIELDS = ("id", "author_id", "author_handle", "text", "url")


class TemplateResponder:
    """Formats a fixed template over the parent's fields (``{author_handle}``, ``{text}``…)."""

    def __init__(self, template: str, *, key: str = "template") -> None:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as exc:
            raise ConfigError(f"responder.{key}: not a valid format string: {exc}") from None
        unknown = names - set(_FIELDS)
        if unknown:
            raise ConfigError(f"responder.{key}: unknown field(s) {sorted(unknown)}; use {list(_FIELDS)}")
        self.template = template

    async def respond(self, parent: Parent) -> str | None:
        """Return the template filled with the parent's fields."""
        return self.template.format(**{f: getattr(parent, f) for f in _FIELDS})


@register_responder("template")
def _template(settings: Mapping[str, Any]) -> Responder:
    unknown = set(settings) - {"template", "timeout_s"}
    if unknown:
        raise ConfigError(f"responder: unknown setting(s) {sorted(unknown)} for kind 'template'")
    template = settings.get("template", "Thanks for your post, @{author_handle}! (answered once by replyd)")
    if not isinstance(template, str) or not template.strip():
        raise ConfigError("responder.template: must be a non-empty string")
    return TemplateResponder(template)


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


# -- settings checks shared by the responders below ---------------------------------------------


def _settings(settings: Mapping[str, Any], kind: str, allowed: set[str]) -> dict[str, Any]:
    """Return ``settings`` with any ``<key>_env`` resolved; raise ConfigError on unknown keys."""
    out = dict(settings)
    if any(k.endswith("_env") for k in out):  # normally resolved by the config loader already
        from replyd.config import resolve_env  # late: config imports the heavier pydantic stack

        out = resolve_env(out, "responder")
    unknown = set(out) - allowed - {"timeout_s"}
    if unknown:
        raise ConfigError(f"responder: unknown setting(s) {sorted(unknown)} for kind {kind!r}")
    return out


def _number(settings: Mapping[str, Any], key: str, default: Any, *, lo: float, hi: float,
            integer: bool = False) -> Any:
    """Return the number ``key`` (``default`` if absent; None stays None); raise ConfigError."""
    v = settings.get(key, default)
    if v is None and default is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or not lo <= v <= hi:
        noun = "an integer" if integer else "a number"
        raise ConfigError(f"responder.{key}: must be {noun} in [{lo:g}, {hi:g}], got {v!r}")
    return v


def _text(settings: Mapping[str, Any], key: str, default: str | None = None, *, required: bool = False) -> str | None:
    """Return the non-empty string ``key`` (``default`` if absent); raise ConfigError."""
    v = settings.get(key, default)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v.strip():
        what = "missing" if v is None else f"got {type(v).__name__} {v!r}"[:80]
        raise ConfigError(f"responder.{key}: must be a non-empty string ({what})")
    return v


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url``: what errors and logs may show (paths and queries may hold tokens)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{port}" if port else "")


def _http_url(settings: Mapping[str, Any], key: str, default: str | None = None) -> str:
    """Return the http(s) URL ``key``; raise ConfigError (never echoing the URL: it may hold a token)."""
    url = _text(settings, key, default, required=True)
    assert url is not None
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  (validates the port)
    except ValueError:
        raise ConfigError(f"responder.{key}: the port is not a number in 0-65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"responder.{key}: must be an http:// or https:// URL with a host "
                          f"(got scheme {parts.scheme or 'none'!r})")
    return url


def _safe(text: str, secrets: Sequence[str], limit: int = 300) -> str:
    """``text`` with the given and every registered secret masked, cut to ``limit`` characters."""
    return rlog.mask(redact(text, secrets))[:limit]


PAYLOAD_VERSION = 1


def responder_payload(parent: Parent) -> bytes:
    """The JSON a ``command`` (stdin) or ``webhook`` (POST body) gets: the parent plus ``replyd_version``."""
    doc = {"replyd_version": PAYLOAD_VERSION, **parent.snapshot()}
    return json.dumps(doc, ensure_ascii=False, default=str).encode("utf-8")


def _declined(text: str) -> str | None:
    """Return None for an empty or whitespace-only reply (a decline), else ``text``."""
    return text if text.strip() else None


# -- command ------------------------------------------------------------------------------------

# The child's whole environment is these (when set) plus its ``env_pass``: never replyd's tokens.
CHILD_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_STDERR_KEEP = 8192  # bytes of stderr kept (the tail)
_STDERR_LOG = 2000  # characters of stderr logged
_STDERR_ERROR = 300  # characters of stderr in a ResponderError


@dataclass
class _Output:
    """What a child wrote: its stdout (up to the cap), the tail of its stderr."""

    stdout: bytearray
    stderr: bytearray
    overflow: bool = False
    stderr_cut: bool = False


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's process group (it leads its own session), so its helpers die too, then the child.

    The group outlives its leader while any member lives and its id cannot be reused meanwhile, so this is
    right after the child exited too: ``killpg`` kills the leftovers, or finds no group (the id could only
    name another group after the kernel's pid numbers wrap around within these microseconds).
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes) -> None:
    """Write ``data`` to the child's stdin and close it; a child that does not read it is fine."""
    if stdin is None:
        return
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stdin.close()


async def _stderr_tail(stream: asyncio.StreamReader | None, out: _Output) -> None:
    """Drain the child's stderr, keeping its last ``_STDERR_KEEP`` bytes."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        out.stderr += chunk
        if len(out.stderr) > _STDERR_KEEP:
            del out.stderr[: len(out.stderr) - _STDERR_KEEP]
            out.stderr_cut = True


class CommandResponder:
    """Runs a program (argv, never a shell) with the parent as JSON on stdin; its stdout is the reply.

    Empty or whitespace-only stdout declines; trailing newlines are stripped. A
    non-zero exit, a timeout, invalid UTF-8 or more than ``max_output_bytes`` is a
    ``ResponderError``. The child gets a fresh environment (``CHILD_ENV`` plus
    ``env_pass``), runs in its own session, and its process group is killed
    (and the child reaped) whenever it ends: reply, error, timeout, overflow or
    cancellation, so nothing it started outlives it.
    """

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 30.0, env_pass: Sequence[str] = (),
                 cwd: str | None = None, max_output_bytes: int = 64 * 1024) -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.env_pass = tuple(env_pass)
        self.cwd = cwd
        self.max_output_bytes = max_output_bytes
        self.program = Path(self.argv[0]).name
        self.name = f"command {self.program}"

    def __repr__(self) -> str:
        return f"CommandResponder(program={self.program!r}, timeout_s={self.timeout_s:g})"

    def child_env(self) -> dict[str, str]:
        """The child's complete environment: ``CHILD_ENV`` and ``env_pass`` variables that are set."""
        return {k: os.environ[k] for k in (*CHILD_ENV, *self.env_pass) if k in os.environ}

    async def respond(self, parent: Parent) -> str | None:
        """Run the command once for ``parent``; return its stdout (empty declines); raise ResponderError."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.child_env(), cwd=self.cwd, start_new_session=True)
        except OSError as exc:
            raise ResponderError(f"{self.name}: cannot start: {exc.strerror or exc}") from None
        out = _Output(bytearray(), bytearray())
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(self._stdout(proc, out), _stderr_tail(proc.stderr, out),
                                     _feed(proc.stdin, responder_payload(parent)))
                await proc.wait()
        except TimeoutError:
            raise ResponderError(f"{self.name}: timed out after {self.timeout_s:g} s (killed)") from None
        finally:
            # Always, whatever the main child did: helpers it left in its group (a backgrounded `sleep &`
            # holding stdout, a daemonised tool) die with it. Then reap the main child (no zombie).
            _kill_group(proc)
            await proc.wait()
            self._log_stderr(proc.returncode, out)
        return self._reply(proc.returncode, out)

    async def _stdout(self, proc: asyncio.subprocess.Process, out: _Output) -> None:
        """Read stdout up to the cap; past it, flag the overflow and kill the child."""
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            out.stdout += chunk
            if len(out.stdout) > self.max_output_bytes:
                out.overflow = True
                _kill_group(proc)
                return

    def _stderr_text(self, out: _Output) -> str:
        """The kept stderr, decoded leniently, secrets masked (a cut first line is dropped)."""
        text = out.stderr.decode("utf-8", "replace")
        if out.stderr_cut and "\n" in text:
            text = text.split("\n", 1)[1]  # the cut may have split a secret: drop the partial line
        return rlog.mask(text)

    def _log_stderr(self, code: int | None, out: _Output) -> None:
        """Log what the child wrote to stderr (always, if anything), truncated and masked."""
        if not out.stderr.strip():
            return
        log.info("replyd.responder.stderr", responder="command", program=self.program, exit_code=code,
                 stderr=self._stderr_text(out)[-_STDERR_LOG:])

    def _reply(self, code: int | None, out: _Output) -> str | None:
        """Turn the finished child's exit code and output into the reply; raise ResponderError."""
        if out.overflow:
            raise ResponderError(f"{self.name}: wrote more than {self.max_output_bytes} bytes to stdout (killed)")
        if code != 0:
            lines = [ln.strip() for ln in self._stderr_text(out).splitlines() if ln.strip()]
            tail = " | ".join(lines[-3:])[-_STDERR_ERROR:]
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            raise ResponderError(f"{self.name}: {how}" + (f"; stderr: {tail}" if tail else "; no stderr"))
        try:
            text = out.stdout.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ResponderError(f"{self.name}: stdout is not valid UTF-8 (at byte {exc.start})") from None
        return _declined(text.rstrip("\r\n"))


def _check_program(program: str, cwd: str | None) -> None:
    """Raise ConfigError unless ``program`` is an executable file (on PATH when it has no slash)."""
    if "/" in program:
        path = Path(cwd or ".") / program
        if path.is_file() and os.access(path, os.X_OK):
            return
        raise ConfigError(f"responder.command[0]: {program!r} is not an executable file")
    if shutil.which(program, path=os.environ.get("PATH", os.defpath)) is None:
        raise ConfigError(f"responder.command[0]: program {program!r} not found on PATH")


@register_responder("command")
def _command(settings: Mapping[str, Any]) -> Responder:
    """Build a ``command`` responder from its settings; raise ConfigError."""
    s = _settings(settings, "command", {"command", "env_pass", "cwd", "max_output_bytes"})
    argv = s.get("command")
    if isinstance(argv, str):
        raise ConfigError("responder.command: must be a list of strings (argv), not a string: replyd runs "
                          'no shell, so write e.g. command = ["python3", "bot.py", "--flag"]')
    if not isinstance(argv, list) or not argv:
        raise ConfigError("responder.command: required: a non-empty list of strings (argv)")
    for i, arg in enumerate(argv):
        if not isinstance(arg, str) or "\0" in arg or (i == 0 and not arg):
            raise ConfigError(f"responder.command[{i}]: must be a {'non-empty ' if i == 0 else ''}string "
                              f"without NUL, got {type(arg).__name__}")
    env_pass = s.get("env_pass", [])
    if not isinstance(env_pass, list) or not all(isinstance(n, str) and _ENV_NAME.match(n) for n in env_pass):
        raise ConfigError(f"responder.env_pass: must be a list of environment variable names, got {env_pass!r}"[:200])
    cwd = s.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not Path(cwd).is_dir()):
        raise ConfigError(f"responder.cwd: must name an existing directory, got {cwd!r}")
    _check_program(argv[0], cwd)
    return CommandResponder(
        argv,
        timeout_s=timeout_setting(s, 30.0),
        env_pass=env_pass,
        cwd=cwd,
        max_output_bytes=_number(s, "max_output_bytes", 64 * 1024, lo=1, hi=16 * 1024 * 1024, integer=True),
    )


# -- HTTP plumbing shared by webhook and openai ---------------------------------------------------

# Only these prove the request never reached the server; anything later may have acted.
_CONNECT_FAILED = (httpx.ConnectError, httpx.ConnectTimeout)
MAX_RESPONSE_BYTES = 1024 * 1024
_MISSING = object()
_HOP_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})


class _JsonPost:
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


def _retries(settings: Mapping[str, Any]) -> int:
    """The ``retries`` setting (connect failures only), default 2."""
    return int(_number(settings, "retries", 2, lo=0, hi=10, integer=True))


# -- webhook ------------------------------------------------------------------------------------

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
        self._hmac_secret = hmac_secret
        self._headers = {"user-agent": f"replyd/{__version__}", **extra, "content-type": "application/json"}
        self._post = _JsonPost("webhook", url, timeout_s=timeout_s, retries=retries, secrets=secrets)

    def __repr__(self) -> str:
        return f"WebhookResponder(url={self._post.origin!r}, signed={self._hmac_secret is not None})"

    async def respond(self, parent: Parent) -> str | None:
        """POST ``parent``; return the answer's ``text`` (null, "" or a 204 declines); raise ResponderError."""
        body = responder_payload(parent)
        headers = dict(self._headers)
        if self._hmac_secret:
            ts = str(int(time.time()))
            headers["x-replyd-timestamp"] = ts
            headers["x-replyd-signature"] = webhook_signature(self._hmac_secret, ts, body)
        resp = await self._post.post(body, headers)
        if resp.status_code == 204:
            return None
        if resp.status_code != 200:
            raise self._post.status_error(resp)
        text = self._post.field(self._post.json_object(resp), "text", "text", (str, type(None)))
        return None if text is None else _declined(text)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._post.aclose()


@register_responder("webhook")
def _webhook(settings: Mapping[str, Any]) -> Responder:
    """Build a ``webhook`` responder from its settings; raise ConfigError."""
    s = _settings(settings, "webhook", {"url", "retries", "hmac_secret", "headers"})
    url = _http_url(s, "url")
    secret = _text(s, "hmac_secret")
    if secret is not None and len(secret) < 16:
        raise ConfigError("responder.hmac_secret: too short (use at least 16 characters, e.g. `openssl rand -hex 32`)")
    headers = s.get("headers", {})
    if not isinstance(headers, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ConfigError("responder.headers: must be a table of string names to string values")
    if not all(k.isascii() and k.isprintable() and v.isascii() and v.isprintable() and k.strip()
               for k, v in headers.items()):
        raise ConfigError("responder.headers: names and values must be printable ASCII on one line")
    reserved = sorted(k for k in headers if k.lower() in _RESERVED_HEADERS)
    if reserved:
        raise ConfigError(f"responder.headers: {reserved} are set by replyd")
    return WebhookResponder(url, timeout_s=timeout_setting(s, 30.0), retries=_retries(s), hmac_secret=secret,
                            headers=headers)


# -- openai (any OpenAI-compatible chat completions endpoint) -------------------------------------

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
        self._post = _JsonPost("openai", base_url.rstrip("/") + "/chat/completions", timeout_s=timeout_s,
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


@register_responder("openai")
def _openai(settings: Mapping[str, Any]) -> Responder:
    """Build an ``openai`` responder from its settings; raise ConfigError."""
    s = _settings(settings, "openai", {"base_url", "model", "system_prompt", "prompt_template", "max_tokens",
                                       "temperature", "api_key", "retries", "decline_marker", INSECURE_HTTP})
    base_url = _http_url(s, "base_url", OPENAI_BASE_URL)
    insecure = s.get(INSECURE_HTTP, False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"responder.{INSECURE_HTTP}: must be true or false")
    require_https(base_url, allowed=insecure, where="responder.base_url")
    api_key = _text(s, "api_key")
    if api_key is not None:
        api_key = api_key.strip()  # a key read from a file often ends with a newline
        if not api_key.isascii() or not api_key.isprintable() or any(c.isspace() for c in api_key):
            raise ConfigError("responder.api_key: contains whitespace or non-ASCII characters")
    if api_key is None and urlsplit(base_url).hostname == "api.openai.com":
        raise ConfigError("responder.api_key_env: required for api.openai.com (name the variable holding the key)")
    model = _text(s, "model", required=True)
    assert model is not None
    return OpenAIResponder(
        model,
        base_url=base_url,
        api_key=api_key,
        system_prompt=_text(s, "system_prompt", DEFAULT_SYSTEM_PROMPT) or DEFAULT_SYSTEM_PROMPT,
        prompt_template=_text(s, "prompt_template", DEFAULT_PROMPT_TEMPLATE) or DEFAULT_PROMPT_TEMPLATE,
        max_tokens=_number(s, "max_tokens", 300, lo=1, hi=100_000, integer=True),
        temperature=_number(s, "temperature", None, lo=0, hi=2),
        timeout_s=timeout_setting(s, 60.0),
        retries=_retries(s),
        decline_marker=_text(s, "decline_marker"),
    )
