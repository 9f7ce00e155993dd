"""One pipeline for every discovery path: policy -> pre-check -> responder -> guard."""

from __future__ import annotations

import structlog

from replyd.clock import Clock
from replyd.guard import Guard, Outcome
from replyd.platform import Parent
from replyd.policy import Policy
from replyd.responders import Responder

log = structlog.get_logger("replyd.pipeline")


class Pipeline:
    """Offers found parents to the guard; the responder runs only for claimable keys."""

    def __init__(self, guard: Guard, responder: Responder, policy: Policy, clock: Clock) -> None:
        self.guard = guard
        self.responder = responder
        self.policy = policy
        self.clock = clock

    def offer(self, parent: Parent, path: str) -> Outcome | None:
        """Answer ``parent`` if policy allows and nobody has; None when skipped by policy."""
        reason = self.policy.reason_to_skip(parent, self.guard.identity, self.clock)
        if reason:
            log.debug("replyd.pipeline.skipped", parent_id=parent.id, path=path, reason=reason)
            return None
        # Read-only pre-check: an answered or in-flight parent costs no write and no responder call.
        blocked = self.guard.check(parent.id)
        if blocked is not None:
            return blocked
        return self.guard.post(parent, self.responder, path=path)
