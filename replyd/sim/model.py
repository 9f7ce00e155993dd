"""The simulated platform's values: knobs, accounts, statuses, notifications, and listing pages.

Plain dataclasses the world (``world.py``) keeps behind its lock and the app (``app.py``) renders.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

FIRST_ID = 113_000_000_000_000_000
IDEMPOTENCY_TTL_S = 3600.0  # Mastodon keeps Idempotency-Key for one hour
MAX_CHARS = 500  # Mastodon's default character limit
VISIBILITIES = ("public", "unlisted", "private", "direct")

CREATE_FAULTS = ("ok", "lost_drop", "lost_504", "error_500_before", "error_503_before", "rate_limit_429")
READ_FAULTS = ("ok", "error_502")

# Local mentions only; a trailing @domain is tolerated and ignored.
_MENTION_RE = re.compile(r"(?<![\w/@])@([A-Za-z0-9_]+)(?:@[A-Za-z0-9.-]+\w)?")

_WORDS = (
    "coffee", "weather", "release", "train", "garden", "concert", "bug", "deploy",
    "recipe", "library", "river", "bicycle", "meeting", "podcast", "sunset",
)


class SimError(Exception):
    """A request the simulated platform refuses; carries the HTTP status and JSON body."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(f"{status}: {error}")
        self.status = status
        self.body = {"error": error}


@dataclass
class Knobs:
    """Timing and fault settings; each field is settable in-process and by ``POST /_sim/config``."""

    listing_delay_s: float = 0.0
    latency_s: float = 0.0
    lost_drop_rate: float = 0.0
    lost_504_rate: float = 0.0
    error_500_before_rate: float = 0.0
    # Setting it starts an outage: every create fails with HTTP 500 (nothing created) for this many seconds
    # from then (World.outages records each window; 0 ends a running one).
    error_500_for_s: float = 0.0
    rate_limit_rate: float = 0.0
    readback_error_rate: float = 0.0
    lost_edit_rate: float = 0.0  # edits (PUT /api/v1/statuses/:id) done whose answer is dropped
    # Each create (POST /api/v1/statuses) waits this long in front of the app before it is done, as behind a
    # loaded proxy or queue: a client may give up first and the post still lands. Reads are not held.
    create_hold_s: float = 0.0
    retry_after_s: int = 1
    # X-RateLimit-* headers only; no request is refused for it. Real Mastodon allows 300
    # per 5 minutes; the default is higher so fast tests never see "remaining 0".
    rate_limit_budget: int = 10_000
    idempotency: bool = True
    # The instance's post limit, served as /api/v2/instance configuration.statuses.max_characters.
    max_characters: int = MAX_CHARS


@dataclass
class Account:
    """A simulated user or bot; ``token`` is its bearer token."""

    id: str
    username: str
    token: str
    bot: bool = False
    display_name: str = ""
    created_at: float = 0.0


@dataclass
class Status:
    """One post. ``visible_at`` is when read endpoints start showing it."""

    id: str
    account_id: str
    text: str
    created_at: float
    visible_at: float
    in_reply_to_id: str | None = None
    in_reply_to_account_id: str | None = None
    visibility: str = "public"
    mention_ids: list[str] = field(default_factory=list)
    spoiler_text: str = ""
    sensitive: bool = False
    language: str = "en"
    via_api: bool = False
    idempotency_key: str | None = None
    deleted_at: float | None = None
    edited_at: float | None = None  # the last edit (PUT /api/v1/statuses/:id), as Mastodon's ``edited_at``
    edits: int = 0  # how many times it was edited: what the stream tests count


@dataclass
class Notification:
    """A mention notification for ``account_id`` about ``status_id``."""

    id: str
    account_id: str
    from_account_id: str
    status_id: str
    created_at: float
    visible_at: float
    type: str = "mention"


T = TypeVar("T")


def paginate(
    items: Sequence[T],
    *,
    key: Any,
    limit: int,
    max_id: int | None = None,
    since_id: int | None = None,
    min_id: int | None = None,
) -> list[T]:
    """Mastodon paging over ``items`` sorted newest first; the result is newest first too.

    ``since_id`` keeps the newest ``limit`` items above it (a gap may be skipped);
    ``min_id`` keeps the ``limit`` items just above it, which is what a poller
    walking forward needs.
    """
    sel = [
        x
        for x in items
        if (max_id is None or key(x) < max_id)
        and (since_id is None or key(x) > since_id)
        and (min_id is None or key(x) > min_id)
    ]
    if limit <= 0:
        return []
    return sel[-limit:] if min_id is not None else sel[:limit]
