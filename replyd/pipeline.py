"""One pipeline for every discovery path: policy -> pre-check -> limits -> responder -> guard.

The order is what makes responders cheap: the static policy needs no I/O, the
pre-check is one read, caps and the measured thread depth are paid only for
parents nobody has answered, and the responder runs only inside a claim.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable

import structlog

from replyd import metrics
from replyd.clock import Clock
from replyd.errors import StoreError
from replyd.guard import Guard, Outcome, Status
from replyd.platforms.base import Parent
from replyd.policy import Policy
from replyd.responders import Responder, ResponderRunner

log = structlog.get_logger("replyd.pipeline")

# How many (parent, reason) skips one process remembers as already recorded.
_SEEN_SKIPS = 50_000


class Pipeline:
    """Offers found parents to the guard; the responder runs only for claimable keys."""

    def __init__(
        self,
        guard: Guard,
        responder: Responder | Callable[[Parent], str | None],
        policy: Policy,
        clock: Clock,
        *,
        responder_timeout_s: float = 60.0,
    ) -> None:
        self.guard = guard
        self.policy = policy
        self.clock = clock
        # An async Responder runs on the shared responder loop; a plain function is called as is.
        if isinstance(responder, Responder):
            self.compose: Callable[[Parent], str | None] = ResponderRunner(responder, timeout_s=responder_timeout_s)  # type: ignore[arg-type]
        else:
            self.compose = responder  # type: ignore[assignment]
        self._recorded: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.skips: dict[str, int] = {}

    def offer(self, parent: Parent, path: str) -> Outcome:
        """Answer ``parent`` if policy allows and nobody has; a policy skip is a SKIPPED outcome."""
        # Debug only (a no-op at info): which path found what, for tracing a parent across paths and replicas.
        log.debug("replyd.pipeline.offered", platform=self.guard.platform.instance, parent_id=parent.id, path=path)
        reason = self.policy.reason_to_skip(parent, self.guard.identity, self.clock)
        if reason:
            return self._skip(parent, path, reason)
        # Read-only pre-check: an answered or in-flight parent costs no write and no responder call.
        blocked = self.guard.check(parent.id)
        if blocked is not None:
            return blocked
        reason = self.policy.limit_reason(parent, self.guard.store, self.guard.platform, self.guard.identity, self.clock)
        if reason:
            return self._skip(parent, path, reason)
        return self.guard.post(parent, self.compose, path=path)

    def _skip(self, parent: Parent, path: str, reason: str) -> Outcome:
        """Record a policy skip once per (parent, reason) and return it as an outcome."""
        self.skips[reason] = self.skips.get(reason, 0) + 1
        metrics.skipped(self.guard.platform.instance, reason)
        key = self.guard.key(parent.id)
        mark = (parent.id, reason)
        if mark in self._recorded:
            self._recorded.move_to_end(mark)
        else:
            log.info("replyd.pipeline.skipped", parent_id=parent.id, path=path, reason=reason,
                     author=parent.author_handle or parent.author_id)
            try:
                # Re-found parents (re-find reads the whole lookback window) must not add an event every pass.
                last = self.guard.store.last_event(key, ["skipped"])
                if last is None or json.loads(last.detail).get("reason") != reason:
                    self.guard.store.record(key, "skipped", owner=self.guard.owner,
                                            detail={"reason": reason, "path": path,
                                                    "author": parent.author_handle or parent.author_id})
                self._recorded[mark] = None
                if len(self._recorded) > _SEEN_SKIPS:
                    self._recorded.popitem(last=False)
            except StoreError as exc:  # a skip note is for explain only; nothing is sent either way
                log.warning("replyd.pipeline.skip_not_recorded", parent_id=parent.id, reason=reason, error=str(exc))
        return Outcome(Status.SKIPPED, key, detail=reason)

    def close(self) -> None:
        """Release the responder's resources (HTTP clients, child processes)."""
        close = getattr(self.compose, "close", None)
        if callable(close):
            close()
