"""The policy step: whether a found parent should be answered at all.

Two stages, so that the cheap rules cost nothing and the costly ones are spent
only on parents nobody has answered yet:

1. ``reason_to_skip`` (no I/O), before the read-only pre-check: never the
   bot's own posts, accounts flagged as bots, allow/deny lists of accounts and
   keywords, an age limit, and the depth the adapter already knows.
2. ``limit_reason`` (store reads, maybe one platform read), after the pre-check:
   per-author and global caps per hour, and the measured thread depth.

Every reason is a short stable word (``SKIP_REASONS``). A final one (``FINAL_SKIPS``) is a
``skipped`` event that ``replyd explain`` shows. The others pass with time: the pipeline keeps such a
parent as a waiting row until ``room_at`` (``Pipeline._hold``), so no path drops it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replyd.clock import Clock
from replyd.errors import PlatformError
from replyd.log import get_logger
from replyd.platforms.base import Identity, Parent, Platform, ThreadDepth

if TYPE_CHECKING:
    from replyd.config import PolicyConfig
    from replyd.store import Store

log = get_logger("replyd.policy")

HOUR_S = 3600.0
# How long a parent whose thread depth could not be read waits before it is offered again.
DEPTH_RETRY_S = 300.0

SKIP_REASONS = {
    "own_post": "the parent is the bot's own post",
    "author_is_bot": "the author is flagged as a bot (policy.skip_bots)",
    "account_denied": "the author is in policy.deny_accounts",
    "account_not_allowed": "policy.allow_accounts is set and the author is not in it",
    "keyword_denied": "the text contains a word from policy.deny_keywords",
    "keyword_missing": "policy.allow_keywords is set and the text contains none of them",
    "too_old": "the parent is older than policy.max_age_s",
    "too_deep": "the parent is deeper in its thread than policy.max_depth",
    "unreadable": "the adapter could not read the item (a malformed mail); its log line names it",
    "depth_unknown": "policy.max_depth is set and the thread depth could not be read (kept waiting, offered again)",
    "author_cap": "policy.max_per_author_per_hour replies to this author in the last hour (kept waiting)",
    "hourly_cap": "policy.max_per_hour replies in the last hour (kept waiting)",
    # The email adapter's refusals (``Parent.extra["refused"]``): what a stranger's headers say cannot override them.
    "auto_reply": "the mail is an auto-reply (RFC 3834 Auto-Submitted, vendor markers, a null return path)",
    "bulk_mail": "the mail is bulk or list mail (Precedence, List-Id, List-Unsubscribe)",
    "robot_sender": "the mail is from a robot address (mailer-daemon, no-reply, postmaster, list owners)",
    "mail_loop": "the mail's X-Loop names the desk",
    "loop_breaker": "the adapter's loop breaker: this address had its most answers in the window (kept waiting)",
}
# Reasons an adapter sets on the parent itself (``Parent.extra["refused"]``).
ADAPTER_SKIPS = frozenset({"auto_reply", "bulk_mail", "robot_sender", "mail_loop"})

# Reasons that stay true for a parent once they are (its age only grows, its author and text do not change;
# an operator who changes the lists rearms): a row that waits to be offered again ends ``skipped`` on them.
# The others (caps, an unreadable depth) pass with time: the parent waits in a row until ``room_at``.
FINAL_SKIPS = frozenset({"own_post", "author_is_bot", "account_denied", "account_not_allowed", "keyword_denied",
                         "keyword_missing", "too_old", "too_deep", "unreadable", *ADAPTER_SKIPS})
# Reasons that count this bot's recent replies: a page's parents not posted yet may fill them (``pending``).
CAP_SKIPS = frozenset({"author_cap", "hourly_cap", "loop_breaker"})


def _account(value: str) -> str:
    return value.strip().removeprefix("@").casefold()


@dataclass(frozen=True)
class Policy:
    """Rules deciding whether a found parent is answered; the defaults only skip self and bots."""

    skip_bots: bool = True
    max_age_s: float | None = None
    allow_accounts: frozenset[str] = field(default_factory=frozenset)
    deny_accounts: frozenset[str] = field(default_factory=frozenset)
    allow_keywords: tuple[str, ...] = ()
    deny_keywords: tuple[str, ...] = ()
    max_depth: int | None = None
    max_per_author_per_hour: int | None = None
    max_per_hour: int | None = None

    @classmethod
    def build(cls, **kw: Any) -> Policy:
        """Return a Policy with account and keyword lists normalised (case-folded, no leading @)."""
        for name in ("allow_accounts", "deny_accounts"):
            if name in kw:
                kw[name] = frozenset(_account(a) for a in kw[name] if a.strip())
        for name in ("allow_keywords", "deny_keywords"):
            if name in kw:
                kw[name] = tuple(k.casefold() for k in kw[name] if k.strip())
        return cls(**kw)

    @classmethod
    def from_config(cls, pc: PolicyConfig) -> Policy:
        """Return the Policy a bot's ``[bots.policy]`` section describes."""
        return cls.build(
            skip_bots=pc.skip_bots,
            max_age_s=pc.max_age_s,
            allow_accounts=pc.allow_accounts,
            deny_accounts=pc.deny_accounts,
            allow_keywords=pc.allow_keywords,
            deny_keywords=pc.deny_keywords,
            max_depth=pc.max_depth,
            max_per_author_per_hour=pc.max_per_author_per_hour,
            max_per_hour=pc.max_per_hour,
        )

    @staticmethod
    def _matches(accounts: Iterable[str], parent: Parent) -> bool:
        # Ids are compared case-folded too: a list entry is written by a person, not served by the platform.
        # author_handle is one the platform vouches for (never a display name: extra["author_name"] holds that).
        names = {_account(parent.author_id)}
        if parent.author_handle:
            names.add(_account(parent.author_handle))
        return not names.isdisjoint(accounts)

    def reason_to_skip(self, parent: Parent, me: Identity, clock: Clock) -> str | None:
        """Return why ``parent`` must not be answered (rules needing no I/O), or None to go on."""
        if parent.extra.get("unreadable"):
            return "unreadable"  # the adapter could not read the item: reported, never answered
        if parent.author_id == me.sender_id:
            return "own_post"
        if parent.extra.get("refused") in ADAPTER_SKIPS:  # before the lists: an allowed address's auto-reply too
            return str(parent.extra["refused"])
        if self.deny_accounts and self._matches(self.deny_accounts, parent):
            return "account_denied"
        allowed = bool(self.allow_accounts) and self._matches(self.allow_accounts, parent)
        if self.allow_accounts and not allowed:
            return "account_not_allowed"
        # An explicitly allowed account is answered even when flagged as a bot: the operator said so.
        if self.skip_bots and parent.author_is_bot and not allowed:
            return "author_is_bot"
        if self.deny_keywords or self.allow_keywords:
            text = parent.text.casefold()
            if any(k in text for k in self.deny_keywords):
                return "keyword_denied"
            if self.allow_keywords and not any(k in text for k in self.allow_keywords):
                return "keyword_missing"
        if self.max_age_s is not None and parent.created_at is not None:
            if clock.now() - parent.created_at > self.max_age_s:
                return "too_old"
        if self.max_depth is not None and parent.thread_depth > self.max_depth:
            return "too_deep"  # the adapter's depth is a lower bound: already too deep
        return None

    def limit_reason(self, parent: Parent, store: Store, platform: Platform, me: Identity, clock: Clock, *,
                     pending: Sequence[Parent] = ()) -> str | None:
        """Return why ``parent`` must not be answered now (caps, measured depth), or None to go on. ``pending``:
        parents let through before it and not posted yet (a page's), counted in the caps as if they were."""
        if self.max_per_hour is not None or self.max_per_author_per_hour is not None:
            since = clock.now() - HOUR_S
            if self.max_per_hour is not None:
                n = store.count_opened_since(platform.instance, me.sender_id, since) + len(pending)
                if n >= self.max_per_hour:
                    return "hourly_cap"
            if self.max_per_author_per_hour is not None:
                for who in _counted(parent):  # the destination and, when another, the sender: each has its cap
                    n = store.count_opened_since(platform.instance, me.sender_id, since, author_id=who)
                    if n + sum(1 for p in pending if who in _counted(p)) >= self.max_per_author_per_hour:
                        return "author_cap"
        if _loop_broken(parent, store, platform, me, clock, pending):
            return "loop_breaker"
        if self.max_depth is not None and parent.thread_depth >= 1:
            if isinstance(platform, ThreadDepth):
                try:
                    depth = platform.thread_depth(parent, self.max_depth)
                except PlatformError as exc:
                    # Fail closed: a loop guard that cannot see the depth must not let the reply through.
                    log.warning("replyd.policy.depth_failed", parent_id=parent.id, error=exc.detail[:200])
                    return "depth_unknown"
                if depth > self.max_depth:
                    return "too_deep"
        return None

    def room_at(self, reason: str, parent: Parent, store: Store, platform: Platform, me: Identity,
                clock: Clock) -> float:
        """When the limit ``reason`` may let ``parent`` through: a cap when its oldest counted reply is an hour
        old (a parent still held then waits for the next one), an unreadable depth after ``DEPTH_RETRY_S``."""
        now = clock.now()
        if reason not in CAP_SKIPS:
            return now + DEPTH_RETRY_S
        breaker = getattr(platform, "loop_breaker", None)
        window_s = float(breaker[1]) if reason == "loop_breaker" and isinstance(breaker, tuple) else HOUR_S
        # Per address (the destination, the sender): the first time one of their counted replies leaves the window.
        # A parent the other address still holds back waits again then.
        whom: tuple[str | None, ...] = (None,) if reason == "hourly_cap" else _counted(parent)
        found = [store.oldest_opened_since(platform.instance, me.sender_id, now - window_s, author_id=who)
                 for who in whom]
        oldest = min((t for t in found if t is not None), default=None)
        # Only the page's own posts fill it (none opened yet): they open now. A cap counts a reply exactly an
        # hour (a window) old, so the room comes a second later.
        return max(now, oldest if oldest is not None else now) + window_s + 1.0


def _counted(parent: Parent) -> tuple[str, ...]:
    """The addresses a reply to ``parent`` counts against: its author (where the answer goes) and, when another,
    the sender the platform verified (``Parent.origin_id``). A sender naming many destinations stays one sender."""
    origin = parent.origin_id
    return (parent.author_id[:255],) if origin is None else (parent.author_id[:255], origin)


def _loop_broken(parent: Parent, store: Store, platform: Platform, me: Identity, clock: Clock,
                 pending: Sequence[Parent]) -> bool:
    """Whether the adapter's loop breaker (``platform.loop_breaker``: answers, window in seconds) holds ``parent``'s
    author or sender back: that many answers counted to one of them in the window, whatever the policy's caps say."""
    breaker = getattr(platform, "loop_breaker", None)
    if not isinstance(breaker, tuple):  # an adapter without one (a test double's attribute is no tuple either)
        return False
    most, window_s = breaker
    for who in _counted(parent):  # the destination, then the sender when another
        n = store.count_opened_since(platform.instance, me.sender_id, clock.now() - window_s, author_id=who)
        n += sum(1 for p in pending if who in _counted(p))
        if n >= most:
            log.warning("replyd.policy.loop_broken", platform=platform.instance, author=who, answers=n,
                        window_s=window_s)
            return True
    return False
