"""The platform Protocol, the values adapters exchange with the core, and the registry.

An adapter speaks one platform's API and nothing else: it never touches the
store and never decides whether to answer. Every error it meets is mapped into
``replyd.errors`` at its boundary (see ``errors.py`` for which class means what).

Ids are opaque strings exactly as the platform serves them: adapters must not
convert them to int, fold their case or rewrite URIs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import httpx

from replyd.clock import Clock
from replyd.errors import ConfigError


@dataclass(frozen=True)
class Identity:
    """Who the bot is on one platform: the stable id is the sender half of the key."""

    sender_id: str
    handle: str = ""


@dataclass(frozen=True)
class Parent:
    """A post, thread or ticket the bot may answer; ``id`` is the served form."""

    id: str
    author_id: str
    author_handle: str = ""
    author_is_bot: bool = False
    text: str = ""
    url: str = ""
    created_at: float | None = None
    thread_depth: int = 0
    # Platform data a reply needs later (CIDs, root refs, topic ids, repo/number).
    extra: dict[str, Any] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        """Return a JSON-safe dict that ``from_snapshot`` turns back into this parent."""
        return asdict(self)

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any]) -> Parent:
        """Rebuild a parent stored by ``snapshot`` (unknown keys are ignored)."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


@dataclass(frozen=True)
class Page:
    """One poll's worth of parents and the cursor to persist after handling them."""

    parents: list[Parent]
    cursor: str | None = None


@dataclass(frozen=True)
class Sent:
    """What a successful send returned: the reply id read back from the response."""

    reply_id: str
    url: str = ""


@dataclass(frozen=True)
class OwnReply:
    """A reply by the bot found on the platform during read-back."""

    reply_id: str
    parent_id: str
    created_at: float | None = None


@dataclass(frozen=True)
class Pending:
    """An open row the sweep asks an adapter about."""

    parent: Parent
    opened_at: float
    provider_key: str | None = None


@dataclass
class ReadBack:
    """Read-back result: own replies per parent, and which parents were checked.

    A parent absent from ``checked`` was not looked at conclusively (a page
    failed, the feed did not reach back far enough): its row stays open.
    ``found`` lists own replies oldest first.
    """

    found: dict[str, list[OwnReply]] = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)


@runtime_checkable
class Platform(Protocol):
    """What replyd needs from a platform: who am I, find, send, read back, delete."""

    kind: ClassVar[str]
    instance: str
    listing_delay_s: float

    def whoami(self) -> Identity:
        """Return the bot's stable identity (``verify_credentials`` id, DID, user id)."""
        ...

    def inbox(self, cursor: str | None) -> Page:
        """Return parents addressed to the bot newer than ``cursor`` (mentions, replies)."""
        ...

    def search(self, query: str, cursor: str | None) -> Page:
        """Return parents matching ``query`` newer than ``cursor``, ids resolved to served form."""
        ...

    def refind(self, since: float) -> list[Parent]:
        """Re-read everything addressed to the bot since epoch ``since``, with no cursor."""
        ...

    def resolve(self, ref: str) -> Parent:
        """Turn a URL, short id or served id into the parent in its served form."""
        ...

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Post ``text`` as a reply to ``parent``. Only ``replyd.guard`` may call this."""
        ...

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find the bot's own replies to the pending parents, batched where possible."""
        ...

    def delete(self, reply_id: str) -> None:
        """Delete one of the bot's own replies (used for ``on_duplicate = delete_newer``)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class ReplyLinks(Protocol):
    """Optional: an adapter that knows the web address of one of the bot's own replies from its id."""

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """Return the link a person opens to see reply ``reply_id`` ("" when it cannot be built)."""
        ...


def default_provider_key(instance: str, sender_id: str, parent_id: str) -> str:
    """Return the idempotency key for a (sender, parent): the same on every attempt."""
    raw = f"replyd\x1f{instance}\x1f{sender_id}\x1f{parent_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:40]


_REGISTRY: dict[str, type] = {}


def register_platform(kind: str) -> Callable[[type], type]:
    """Class decorator: make an adapter constructible by ``kind`` from config.

    The class must offer ``from_settings(settings, *, http, clock)``, a
    classmethod that validates ``settings`` (raising ``ConfigError`` naming the
    key) and returns an instance.
    """

    def deco(cls: type) -> type:
        cls.kind = kind
        _REGISTRY[kind] = cls
        return cls

    return deco


def make_platform(
    kind: str, settings: Mapping[str, Any], *, http: httpx.Client, clock: Clock
) -> Platform:
    """Build the adapter registered as ``kind`` (importing the built-in adapters first)."""
    import replyd.platforms  # noqa: F401  (registers the built-in adapters)

    try:
        cls = _REGISTRY[kind]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ConfigError(f"unknown platform kind {kind!r} (known: {known})") from None
    return cls.from_settings(settings, http=http, clock=clock)


def registered_kinds() -> list[str]:
    """Return the platform kinds that can be configured."""
    import replyd.platforms  # noqa: F401

    return sorted(_REGISTRY)
