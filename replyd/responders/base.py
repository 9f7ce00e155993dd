"""What every responder kind shares: the Protocol, the registry, ``ResponderRunner`` and the settings base.

A responder is an object with one async method, ``respond(parent)``, registered
by name and configured per bot under ``[bots.responder]`` (``kind`` plus the
responder's own settings). The guard calls it at most once per claim, after
the read-only pre-check, so an answered, in-flight, rejected or given-up
parent never costs a call.

The daemon's jobs run in threads; ``ResponderRunner`` runs the coroutine on
one shared event loop thread (so HTTP clients keep their connection pools),
bounds it with ``timeout_s`` and maps every failure to ``ResponderError``.

Each kind's settings are a ``ResponderSettings`` model: unknown keys are refused,
numbers are not read from strings, secrets are ``SecretStr``, and every problem
becomes one ``ConfigError`` line naming ``responder.<key>`` (never a secret's value).
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import json
import threading
import typing
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Annotated, Any, ClassVar, Protocol, Self, runtime_checkable

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError

from replyd import log as rlog
from replyd.errors import ConfigError, ResponderError
from replyd.log import get_logger
from replyd.platforms.base import Parent, plain_settings  # the kind modules take it from here: one import line to move with it

log = get_logger("replyd.responder")


@runtime_checkable
class Responder(Protocol):
    """Turns a parent into reply text, or None/"" to decline."""

    async def respond(self, parent: Parent) -> str | None:
        """Return the reply for ``parent``, or None/"" to decline; raise on failure."""
        ...


@runtime_checkable
class Streaming(Protocol):
    """Optional: a responder that can stream its reply (an LLM's tokens); ``ResponderRunner`` hands the stream to
    the guard, which shows it as it comes where the platform edits replies (``replyd.stream``)."""

    def stream(self, parent: Parent) -> AsyncIterator[str]:
        """The reply for ``parent`` as it is written; nothing (or only blanks) declines; raise on failure."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A responder holding resources (HTTP clients, child processes) that ``aclose`` releases."""

    async def aclose(self) -> None:
        """Release what the responder holds."""
        ...


@runtime_checkable
class Bounded(Protocol):
    """A responder that bounds each call itself (``timeout_s``; a command's also kills its child)."""

    timeout_s: float


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


# -- settings ---------------------------------------------------------------------------------------

TimeoutS = Annotated[float, Field(gt=0, le=3600)]


def _nonblank(v: str) -> str:
    """Refuse an empty or whitespace-only string."""
    if not v.strip():
        raise ValueError("must be a non-empty string")
    return v


NonBlank = Annotated[str, AfterValidator(_nonblank)]


class ResponderSettings(BaseModel):
    """The settings every kind accepts (``timeout_s``); each kind's model adds its own and sets ``kind``.

    Strict: a number written as a string, or true for a number, is an error, as in the TOML the
    operator wrote. A check that spans keys raises ``ValueError("<key>: ...")`` from a model
    validator: it names its key itself.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    kind: ClassVar[str] = "responder"

    timeout_s: TimeoutS = 60.0

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> Self:
        """Validate ``settings`` (resolving any ``<key>_env`` the loader left); raise one-line ConfigError."""
        raw = dict(settings)
        if any(k.endswith("_env") for k in raw):  # normally resolved by the config loader already
            from replyd.config import resolve_env  # late: config imports the heavier pydantic-settings stack

            raw = resolve_env(raw, "responder")
        try:
            return cls.model_validate(plain_settings(raw))  # a resolved secret arrives as a SecretStr
        except ValidationError as exc:
            raise settings_error(cls, exc) from None


def settings_error(model: type[ResponderSettings], exc: ValidationError) -> ConfigError:
    """One line for every problem pydantic found: unknown keys by kind, else ``responder.<key>: <problem>``."""
    errors = exc.errors()
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        # A secret is written as <key>_env (the loader reads the variable), so that is the name to suggest.
        known = [f"{k}_env" if _is_secret(f.annotation) else k for k, f in model.model_fields.items()]
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.7)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
        return ConfigError(f"responder: unknown setting(s) {unknown} for kind {model.kind!r} ({hint})")
    return ConfigError("; ".join(_problem(model, e) for e in errors))


def _problem(model: type[ResponderSettings], err: Any) -> str:
    """``responder.<key>[i]: <problem>``; the value is shown only when it is a number of a non-secret key."""
    loc = err["loc"]
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a model validator: its message starts with the key it is about
        return f"responder.{msg}"
    key = str(loc[0])
    path = key + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])
    field = model.model_fields.get(key)
    if err["type"] == "missing":
        what = field.description if field is not None else None
        return f"responder.{path}: required" + (f": {what}" if what else "")
    msg = msg[:1].lower() + msg[1:]
    value = err.get("input")
    secret = field is not None and _is_secret(field.annotation)
    if err["type"].endswith("_type") or err["type"].endswith("_parsing"):
        msg += f", got {type(value).__name__}"
    elif err["type"] == "literal_error" and not secret:  # one of a few words: show what was written instead
        msg += f", got {value!r:.40}" if isinstance(value, str) else f", got {type(value).__name__}"
    elif not secret and isinstance(value, int | float) and not isinstance(value, bool):
        msg += f", got {value!r}"
    return f"responder.{path}: {msg}"


def _is_secret(annotation: Any) -> bool:
    """Whether a field holds a secret (``SecretStr``, alone, in a union or annotated)."""
    return annotation is SecretStr or any(_is_secret(a) for a in typing.get_args(annotation))


def secret_value(secret: SecretStr | None) -> str | None:
    """The plain value of an optional secret setting."""
    return None if secret is None else secret.get_secret_value()


def timeout_setting(settings: Mapping[str, Any], default_s: float = 60.0) -> float:
    """Return ``timeout_s`` from a responder's settings, validated; raise ConfigError."""
    try:
        return ResponderSettings.model_validate({"timeout_s": settings.get("timeout_s", default_s)}).timeout_s
    except ValidationError as exc:
        raise settings_error(ResponderSettings, exc) from None


def runner_bound_s(responder: Responder, settings: Mapping[str, Any]) -> float:
    """The runner's bound for ``responder``: its own ``timeout_s`` (else its settings') plus 5 s, a backstop."""
    own_s = responder.timeout_s if isinstance(responder, Bounded) else timeout_setting(settings)
    return float(own_s) + 5.0


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


def settled(value: object) -> object:
    """Return ``value``, or what it resolves to when it is awaitable (an ``async def`` responder's coroutine).

    A sync caller (the sync guard, the daemon's worker threads) cannot await, so the awaitable runs on the
    shared responder loop and this thread waits for it; calling from that loop itself would deadlock.
    """
    if not inspect.isawaitable(value):
        return value
    loop = responder_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise ResponderError("an awaitable responder result cannot be waited for on the responder loop itself")

    async def wait() -> object:
        return await value

    return asyncio.run_coroutine_threadsafe(wait(), loop).result()


def _checked(value: object) -> str | None:
    """Return the responder's result if it is text or None; raise ResponderError for anything else."""
    if value is None or isinstance(value, str):
        return value
    raise ResponderError(f"responder returned {type(value).__name__}, expected text or None")


class ResponderRunner:
    """Calls an async responder from a sync caller, with a timeout; every failure is a ResponderError."""

    def __init__(self, responder: Responder, *, timeout_s: float = 60.0, name: str = "") -> None:
        self.responder = responder
        self.timeout_s = timeout_s
        self.name = name or type(responder).__name__

    def __call__(self, parent: Parent) -> str | None | AsyncIterator[str]:
        """Return the responder's text for ``parent`` (None/"" declines), or its stream (a ``Streaming``
        responder); raise ResponderError."""
        if isinstance(self.responder, Streaming):
            return self._stream(parent)
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
            # Masked, on one line: a library responder's exception may quote a key it was given, over lines.
            text = " ".join(f"{self.name}: {type(exc).__name__}: {exc}".split())
            raise ResponderError(rlog.mask(text)[:300]) from exc

    async def _stream(self, parent: Parent) -> AsyncIterator[str]:
        """The responder's stream, its whole length bounded by ``timeout_s`` and every failure a masked one-line
        ResponderError (the guard pulls each chunk within its own idle bound)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.timeout_s
        source = self.responder.stream(parent)  # type: ignore[attr-defined]
        try:
            async for chunk in source:
                if loop.time() > until:
                    raise ResponderError(f"{self.name}: the stream went on past {self.timeout_s:g} s")
                yield _checked(chunk) or ""
        except ResponderError:
            raise
        except Exception as exc:  # as __call__: a responder's own failure, masked, on one line
            text = " ".join(f"{self.name}: {type(exc).__name__}: {exc}".split())
            raise ResponderError(rlog.mask(text)[:300]) from exc
        finally:
            if isinstance(source, AsyncGenerator):  # closed now, so its HTTP stream is released at once
                await source.aclose()

    def close(self) -> None:
        """Release what the responder holds (HTTP clients, child processes)."""
        if not isinstance(self.responder, Closable):
            return
        try:
            asyncio.run_coroutine_threadsafe(self.responder.aclose(), responder_loop()).result(10.0)
        except Exception as exc:  # shutdown goes on regardless
            log.warning("replyd.responder.close_failed", responder=self.name, error=str(exc)[:200])


# -- helpers for the kinds ---------------------------------------------------------------------


PAYLOAD_VERSION = 1


def responder_payload(parent: Parent) -> bytes:
    """The JSON a ``command`` (stdin) or ``webhook`` (POST body) gets: the parent plus ``replyd_version``.

    Raise ResponderError for a parent no UTF-8 can carry (a lone surrogate), before anything is started or sent.
    """
    doc = {"replyd_version": PAYLOAD_VERSION, **parent.snapshot()}
    try:
        return json.dumps(doc, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as exc:  # a platform's JSON may carry a lone surrogate ("\ud800"): no UTF-8 holds it
        raise ResponderError(f"the parent's text cannot be sent as UTF-8 (a lone surrogate at character {exc.start})") from None


def declined(text: str) -> str | None:
    """Return None for an empty or whitespace-only reply (a decline), else ``text``."""
    return text if text.strip() else None
