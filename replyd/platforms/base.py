"""The platform Protocol, its optional features, the values adapters exchange, settings and the registry.

An adapter speaks one platform's API and nothing else: it never touches the
store and never decides whether to answer. Every error it meets is mapped into
``replyd.errors`` at its boundary (see ``errors.py`` for which class means what).

Ids are opaque strings exactly as the platform serves them: adapters must not
convert them to int, fold their case or rewrite URIs.
"""

from __future__ import annotations

import asyncio

import hashlib
import importlib
import pkgutil
from pathlib import Path
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, ClassVar, Protocol, Self, runtime_checkable

import httpx
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, StringConstraints, ValidationError

from replyd.clock import Clock
from replyd.errors import ConfigError
from replyd.parts import Limit


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
    # Platform data a reply needs later (CIDs, root refs, topic ids, repo/number). ``extra["from"]``: the sender
    # the platform verified, when the answer may go to someone else (email's From; ``author_id`` is the destination).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def origin_id(self) -> str | None:
        """Who sent this parent when that is not ``author_id`` (email: the From, the answer going to a checked
        Reply-To), cut to the store's 255 characters; None when the author sent it. Caps count both."""
        origin = self.extra.get("from")
        if not isinstance(origin, str) or not origin or origin[:255] == self.author_id[:255]:
            return None
        return origin[:255]

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


@dataclass(frozen=True)
class Receipt:
    """A platform's delivery report of one message the bot sent (WhatsApp's ``statuses`` webhook)."""

    status: str  # the platform's word: sent, delivered, read, failed
    message_id: str  # the sent message's id (the reply id)
    provider_key: str | None = None  # replyd's key, when the report carries it back
    parent_id: str | None = None  # the parent it answers, when the report carries it back
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Identity:
    """Who the bot is on one platform: the stable id is the sender half of the key."""

    sender_id: str
    handle: str = ""


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


# --- optional features: small Protocols the core checks with isinstance ----------------------


@runtime_checkable
class ParentReplies(Protocol):
    """Optional: read own replies from each parent itself (its thread, its comments), with no own-feed walk."""

    def read_parents(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Like ``read_back``, every parent by its own listing: a look that does not share the walk's blind spots."""
        ...


@runtime_checkable
class ReplyLinks(Protocol):
    """Optional: an adapter that knows the web address of one of the bot's own replies from its id."""

    def reply_url(self, reply_id: str, identity: Identity) -> str:
        """Return the link a person opens to see reply ``reply_id`` ("" when it cannot be built)."""
        ...


@runtime_checkable
class Addressing(Protocol):
    """Optional: an adapter that can tell whether a parent addresses the bot (MCP's ``addressed`` scope asks it)."""

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """Whether ``parent`` mentions the bot, replies to it or is a direct message to it, per the platform's own
        fields (never its text)."""
        ...


@runtime_checkable
class ThreadDepth(Protocol):
    """Optional: an adapter that can count a parent's ancestors (the ``max_depth`` policy asks it)."""

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return how many ancestors ``parent`` has, counting at most ``limit + 1``."""
        ...


@runtime_checkable
class PostLimit(Protocol):
    """Optional: an adapter that knows how long one post may be and how an answer's parts follow each other.

    An answer longer than ``post_limit`` is sent in parts (``replyd.parts``), each part under its own key; the
    first part answers the parent, each later one the parent ``part_parent`` names (a thread chain on Mastodon
    and Bluesky: part k+1 answers part k). Without this feature an answer is sent whole, as one post.
    """

    def post_limit(self, parent: Parent) -> Limit | None:
        """How long a reply to ``parent`` may be (what the adapter adds to it, a mention, already taken off);
        None: any length."""
        ...

    def part_parent(self, parent: Parent, previous_reply_id: str) -> Parent:
        """The parent the next part of an answer to ``parent`` answers, after the part ``previous_reply_id``."""
        ...


@runtime_checkable
class EditReply(Protocol):
    """Optional: an adapter that can replace the text of one of the bot's own replies.

    A streamed answer (a responder that yields text as it comes, ``replyd.stream``) posts its first part once
    and then grows it by edits; a resumed answer corrects a landed part by an edit, never by a second post.
    An edit sets the whole text, so doing it twice is harmless: the guard retries an edit whose outcome is
    unknown. Errors as ``send``'s table: ``DefinitelyNotSent`` / ``MaybeSent`` (tried again), ``RateLimited``
    (tried again after its wait), ``Rejected`` (the reply cannot be edited: gone, too old, too long; the guard
    stops editing it).
    """

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """Replace the text of the bot's reply ``reply_id`` (sent as a reply to ``parent``) with ``text``."""
        ...


@runtime_checkable
class AsyncSend(Protocol):
    """Optional: an adapter whose send is a coroutine; ``replyd.aio`` awaits it (else it runs ``send`` on a
    worker thread). Only the guard's faces may call it."""

    async def asend(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Post ``text`` as a reply to ``parent``, as ``send`` does, without blocking the event loop."""
        ...


@runtime_checkable
class LoopBound(Protocol):
    """Optional: an adapter whose async calls belong to one event loop (a bot's own client); ``replyd.aio``
    binds the loop it runs on, so the calls its worker threads make (login, the sweep) run there."""

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the adapter's async calls on ``loop`` when called from another thread."""
        ...


@runtime_checkable
class ProviderKeys(Protocol):
    """Optional: an adapter whose idempotency key has a platform-specific form (a Bluesky record key)."""

    def provider_key(self, sender_id: str, parent_id: str) -> str:
        """Return the key for (sender, parent): the same on every attempt."""
        ...


@runtime_checkable
class WebhookSource(Protocol):
    """Optional: an adapter that can read its platform's webhook deliveries."""

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """Return the parents a delivery of ``event`` names, or a short reason it names none to answer."""
        ...

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """None when the bot's own polling would find ``parent``; else why not, as one reason word (no I/O).

        A webhook (a GitHub App's, an organisation's, a Slack app in several workspaces) delivers more than
        the bot's config asks for: a parent is offered only inside what the pollers would have found.
        """
        ...


@runtime_checkable
class WebhookReceipts(Protocol):
    """Optional: an adapter whose webhook also reports on the bot's own sent messages (WhatsApp's ``statuses``)."""

    def webhook_receipts(self, payload: Any) -> list[Receipt]:
        """Return the delivery reports in ``payload`` (none: an empty list); no I/O."""
        ...


@runtime_checkable
class WebhookChallenge(Protocol):
    """Optional: an adapter whose platform checks the webhook URL with a handshake delivery (Slack's url_verification)."""

    def webhook_challenge(self, payload: Any) -> dict[str, Any] | None:
        """Return the body answering a handshake delivery, or None when ``payload`` is not one."""
        ...


@runtime_checkable
class WebhookAnswer(Protocol):
    """Optional: an adapter whose platform wants a body in the answer to an accepted delivery (Discord's deferred
    interaction response), not the receiver's own 202."""

    def webhook_answer(self, payload: Any) -> dict[str, Any] | None:
        """Return the body of a 200 answering an accepted ``payload``, or None for the receiver's usual answer."""
        ...


@runtime_checkable
class StreamSource(Protocol):
    """Optional: an adapter that can hold its platform's push stream open."""

    instance: str

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """Yield parents as the platform pushes them, until the stream ends or ``stop`` is set."""
        ...


@runtime_checkable
class ResumableStream(Protocol):
    """Optional: a stream whose events are gone once dispatched unless its session is resumed (Discord's Gateway).

    The runner records every parent the stream yields as a waiting row before it asks for the next one, so
    the adapter may count all it yielded as recorded. ``hold_session`` lends it the store: ``load`` and
    ``save`` read and write one text (the session, never a secret); ``holder`` names this process."""

    def hold_session(self, load: Callable[[], str | None], save: Callable[[str], None], holder: str) -> None:
        """Load the stored session on the next connect and save it as recorded events move it on."""
        ...


@runtime_checkable
class MeasuresClock(Protocol):
    """Optional: an adapter that measures its platform's clock against replyd's (every HTTP adapter does)."""

    def clock_view(self) -> dict[str, Any]:
        """Return the measured offset (``offset_s``: platform minus replyd, None unmeasured) and its samples."""
        ...


@runtime_checkable
class NoReadBack(Protocol):
    """Optional: a platform where a bot cannot list what it sent (Telegram, WhatsApp): the no-read-back class.

    The core reads this capability, never a platform name. On such a platform the promise is *at most once,
    every doubt reported*: a send the adapter answered ``MaybeSent`` for (a lost response, a 5xx, a read
    timeout), or an open row a crash left behind, is never judged by a read-back (there is none) and never
    retried on its own. The guard leaves the row ``open`` as everywhere; the sweep, once the row's deadline has
    passed, moves it to ``unconfirmed`` (event ``unconfirmed``, log ``replyd.reply.unconfirmed``) instead of
    reading back. An operator resolves it: ``replyd rearm`` sends again, ``replyd confirm`` marks it answered.
    Provably-unsent failures (``DefinitelyNotSent``: connect refused, 429, 401) are released and retried as on
    every platform. Such an adapter's ``read_back`` returns an empty ``ReadBack`` (nothing checked), so a
    caller that reads back anyway learns nothing, and never "not found".
    """

    def no_read_back(self) -> str:
        """Why the bot's own replies cannot be listed here (one sentence, for operators and docs)."""
        ...


def reads_back(platform: object) -> bool:
    """Whether ``platform`` can list the bot's own replies (False for a ``NoReadBack`` adapter)."""
    return not isinstance(platform, NoReadBack)


def default_provider_key(instance: str, sender_id: str, parent_id: str) -> str:
    """Return the idempotency key for a (sender, parent): the same on every attempt."""
    raw = f"replyd\x1f{instance}\x1f{sender_id}\x1f{parent_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:40]


# --- settings ----------------------------------------------------------------------------


class PlatformSettings(BaseModel):
    """An adapter's settings: unknown keys refused, types strict, each error one line naming the key.

    Every adapter subclasses it once (``<Adapter>.Settings``); secrets are ``SecretStr`` so a
    model's repr never shows them.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    kind: str | None = None  # the config's selector, passed along with the rest
    # The first part of the answered-log key (default "<kind>:<the adapter's root URL>").
    instance: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = None
    listing_delay_s: float = Field(0.0, ge=0)  # seconds before a sweep may trust a read-back

    @classmethod
    def load(cls, kind: str, raw: Mapping[str, Any]) -> Self:
        """Validate ``raw``; raise ``ConfigError("<kind> setting '<key>': …")`` for the first problem."""
        try:
            return cls.model_validate(plain_settings(raw), context={"kind": kind})
        except ValidationError as exc:
            err = exc.errors(include_url=False, include_input=False)[0]
            key = str(err["loc"][0]) if err["loc"] else "?"
            if err["type"] == "extra_forbidden":
                known = ", ".join(sorted(set(cls.model_fields) - {"kind"}))
                raise ConfigError(f"{kind} setting {key!r}: unknown key (known: {known})") from None
            # A validator's own words ("required, …") replace pydantic's prefix; values are never quoted.
            msg = str(err["msg"]).removeprefix("Value error, ")
            raise ConfigError(f"{kind} setting {key!r}: {msg}") from None


def _token(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("required, a non-empty string")
    value = value.strip()
    # The value is deliberately never echoed: it is a secret.
    if any(c.isspace() for c in value) or not value.isprintable() or not value.isascii():
        raise ValueError("contains whitespace or non-ASCII characters")
    return value


def plain_settings(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with each ``SecretStr`` (a secret the config loader resolved) as its string, for a settings model.

    The model validates it like any value and wraps it again where the field is a secret.
    """
    return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in raw.items()}


# A token-like secret: printable ASCII without whitespace, hidden in every repr.
Token = Annotated[SecretStr, BeforeValidator(_token)]
# A non-empty string, whitespace trimmed.
Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
# A list of non-empty strings (a tuple is accepted too).
Texts = Annotated[list[Text], Field(strict=False)]


# --- registry ----------------------------------------------------------------------------

_REGISTRY: dict[str, type] = {}


def register_platform(kind: str) -> Callable[[type], type]:
    """Class decorator: make an adapter constructible by ``kind`` from config.

    The class must offer ``from_settings(settings, *, http, clock)``, a
    classmethod that validates ``settings`` (raising ``ConfigError`` naming the
    key) and returns an instance.
    """

    def deco(cls: type) -> type:
        cls.kind = kind  # type: ignore[attr-defined]
        _REGISTRY[kind] = cls
        return cls

    return deco


def _load_builtin() -> None:
    """Import every adapter module of this package (each registers itself): a new platform is one module."""
    here = Path(__file__).resolve().parent  # this package's folder: base.py never imports its package
    for mod in pkgutil.iter_modules([str(here)]):
        if not mod.name.startswith("_") and mod.name != "base":
            importlib.import_module(f"{__package__}.{mod.name}")


def make_platform(
    kind: str, settings: Mapping[str, Any], *, http: httpx.Client, clock: Clock
) -> Platform:
    """Build the adapter registered as ``kind`` (importing the built-in adapters first)."""
    _load_builtin()
    try:
        cls = _REGISTRY[kind]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ConfigError(f"unknown platform kind {kind!r} (known: {known})") from None
    return cls.from_settings(settings, http=http, clock=clock)  # type: ignore[attr-defined,no-any-return]


def platform_class(kind: str) -> type:
    """The adapter class registered as ``kind`` (which optional features it offers is a property of it)."""
    _load_builtin()
    return _REGISTRY[kind]


def registered_kinds() -> list[str]:
    """Return the platform kinds that can be configured."""
    _load_builtin()
    return sorted(_REGISTRY)
