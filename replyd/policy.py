"""The policy step: whether a found parent should be answered at all."""

from __future__ import annotations

from dataclasses import dataclass

from replyd.clock import Clock
from replyd.platform import Identity, Parent


@dataclass(frozen=True)
class Policy:
    """Rules applied before the pre-check: never yourself, skip bots, age limit."""

    skip_bots: bool = True
    max_age_s: float | None = None

    def reason_to_skip(self, parent: Parent, me: Identity, clock: Clock) -> str | None:
        """Return why ``parent`` must not be answered, or None to go on."""
        if parent.author_id == me.sender_id:
            return "own_post"
        if self.skip_bots and parent.author_is_bot:
            return "author_is_bot"
        if self.max_age_s is not None and parent.created_at is not None:
            if clock.now() - parent.created_at > self.max_age_s:
                return "too_old"
        return None
