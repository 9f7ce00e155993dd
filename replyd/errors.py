"""The one exception tree of replyd.

Every boundary (HTTP to a platform, SQL to the store, TOML to the config) maps
what it meets into these classes, so callers decide on a class, never on a
library's exception::

    ReplydError
    ├── ConfigError                 bad config file, key or value
    ├── StoreError                  the answered-log cannot be read or written
    │   └── SchemaError             the database schema is missing or behind
    ├── ContentionError             another writer holds the key (retryable)
    ├── LeaseLost                   a compose lease expired or another holder has the key; nothing sent
    ├── ResponderError              a responder failed; nothing was sent (retried with backoff)
    └── PlatformError               anything a platform adapter reports
        ├── DefinitelyNotSent       the request provably never acted
        │   ├── RateLimited         refused before acting; has retry_after_s
        │   └── NotBuilt            the request could not be built; it never reached the transport
        ├── MaybeSent               the request may have landed
        │   └── AlreadyLanded       the platform says the reply exists already
        ├── Rejected                the platform refused the content or target
        └── BadResponse             a response we cannot parse (read paths)

Only ``DefinitelyNotSent`` (and its subclass) may release a claim: anything
else after the request left leaves the row open for the sweep.
"""

from __future__ import annotations


class ReplydError(Exception):
    """Base of every error replyd raises on purpose."""


class ConfigError(ReplydError):
    """A config file, key or value is wrong; the message names which."""


class StoreError(ReplydError):
    """The answered-log cannot be read or written; nothing was sent."""


class SchemaError(StoreError):
    """The database schema is missing or older than this replyd."""


class ContentionError(ReplydError):
    """Another writer holds the key right now; retry later, nothing was sent."""


class LeaseLost(ReplydError):
    """A compose lease is no longer its holder's (expired, or the key moved on); nothing was sent."""


class PlatformError(ReplydError):
    """Base of the errors a platform adapter raises.

    ``status`` is the HTTP status when there was one; ``detail`` is a short,
    secret-free description for logs and events.
    """

    def __init__(self, detail: str = "", *, status: int | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


class DefinitelyNotSent(PlatformError):
    """The request provably did not act (refused connect, DNS, 4xx before acting)."""


class RateLimited(DefinitelyNotSent):
    """The platform refused for rate reasons before acting; retry after ``retry_after_s``."""

    def __init__(
        self, detail: str = "", *, status: int | None = 429, retry_after_s: float | None = None
    ) -> None:
        super().__init__(detail, status=status)
        self.retry_after_s = retry_after_s


class NotBuilt(DefinitelyNotSent):
    """The request could not be built from its values (a header, a body: often a value from a parent), so it
    never reached the transport: no byte left. Says nothing about the platform's health (the write breaker
    does not count it)."""


class MaybeSent(PlatformError):
    """The request left and its fate is unknown (timeout, reset, 5xx after send)."""


class AlreadyLanded(MaybeSent):
    """The platform reports that the reply already exists (e.g. a Bluesky rkey taken)."""

    def __init__(self, detail: str = "", *, status: int | None = None, reply_id: str | None = None) -> None:
        super().__init__(detail, status=status)
        self.reply_id = reply_id


class Rejected(PlatformError):
    """The platform refused this reply for good (validation, gone parent, forbidden)."""


class BadResponse(PlatformError):
    """A platform response could not be parsed; the message names the field."""


class ResponderError(ReplydError):
    """A responder failed (exception, timeout, non-zero exit, bad output); nothing was sent.

    A responder failure costs no attempt: the guard releases the claim with a
    backoff and the next discovery calls the responder again. ``detail`` is a
    short, secret-free description for logs and events.
    """

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail

