"""One pipeline for every discovery path: policy -> pre-check -> limits -> responder -> guard.

The order is what makes responders cheap: the static policy needs no I/O, the
pre-check is one read, caps and the measured thread depth are paid only for
parents nobody has answered, and the responder runs only inside a claim.

A page of parents (a poll's, a webhook delivery's, re-find's) goes through the
same steps per parent, in order; the parents they let through are claimed
together, in one durable transaction (``Guard.post_page``), then composed and
sent one by one, each row under its own lease and open commit. A parent offered
alone (``offer``) is a page of one, and a page of one claims alone (``Guard.post``).

What a path has seen is never dropped unaccounted for. A parent a passing limit holds back (a cap, an
unreadable depth) is kept as a waiting ``released`` row: its snapshot, ``error`` "policy: <reason>" and
``not_before`` when the limit may let it through. Re-find's re-offer (``Pollers.reoffer``) offers it again
then, on every platform, also on those that cannot re-find (Telegram, WhatsApp). A row already held
for that reason is not noted again. A final skip (``FINAL_SKIPS``) writes no row: its ``skipped`` event
carries the parent's snapshot, so an operator's rearm can make the row. A busy store (``ContentionError``)
writes nothing: the path must not move past the parent (``Pollers``: the cursor is held; a webhook's
kept row waits, or the delivery is answered 503).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence

from replyd import metrics
from replyd.clock import Clock
from replyd.errors import ContentionError, StoreError
from replyd.guard import PAGE_MAX, Guard, Outcome, Status, snapshot_json
from replyd.log import get_logger
from replyd.platforms.base import Parent
from replyd.policy import CAP_SKIPS, FINAL_SKIPS, Policy
from replyd.store import COMPOSING, RELEASED, lease_holder
from replyd.responders import Responder, ResponderRunner

log = get_logger("replyd.pipeline")

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
        """Answer ``parent`` if policy allows and nobody has; a policy skip is a SKIPPED outcome. A page of one:
        what would end its offer is raised."""
        got = self.offer_page([parent], path)[0]
        if isinstance(got, Exception):
            raise got
        return got

    def offer_page(self, parents: Sequence[Parent], path: str) -> list[Outcome | Exception]:
        """Offer one page of found parents; per parent, in order, its Outcome or the exception its offer raised.

        Each parent goes through the steps ``offer`` takes (policy, read-only pre-check, limits); those let
        through are claimed together (``Guard.post_page``: one durable transaction, up to ``PAGE_MAX``), one
        alone through ``Guard.post``. The outcomes are the ones offering one by one would give: a parent that is
        in the group already, or a cap the group's posts may fill, posts the group first. A ``ContentionError`` is
        one parent's (the page goes on; the rows the page claimed after it are handed back and claimed again); any
        other exception ends the page: it is the last entry, the parents after it are not offered (their rows,
        when the page claimed them, are handed back or wait for the sweep), as when one by one stops there.
        """
        return _Page(self, list(parents), path).run()

    def _screen(self, parent: Parent, path: str) -> Outcome | None:
        """The steps before the limits: the policy skip (no I/O) and the read-only pre-check (one read); None: go on."""
        # Debug only (a no-op at info): which path found what, for tracing a parent across paths and replicas.
        log.debug("replyd.pipeline.offered", platform=self.guard.platform.instance, parent_id=parent.id, path=path)
        reason = self.policy.reason_to_skip(parent, self.guard.identity, self.clock)
        if reason:
            return self._skip(parent, path, reason)
        # Read-only pre-check: an answered or in-flight parent costs no write and no responder call.
        return self.guard.check(parent.id)

    def _limit(self, parent: Parent, pending: Sequence[Parent]) -> str | None:
        """Why the limits (caps, measured depth) hold ``parent`` back, counting ``pending`` in the caps; None: go on."""
        return self.policy.limit_reason(parent, self.guard.store, self.guard.platform, self.guard.identity,
                                        self.clock, pending=pending)

    def _skip(self, parent: Parent, path: str, reason: str) -> Outcome:
        """Record a policy skip once per (parent, reason) and return it as an outcome; a passing limit holds the
        parent as a waiting row instead (``_hold``)."""
        self.skips[reason] = self.skips.get(reason, 0) + 1
        metrics.skipped(self.guard.platform.instance, reason)
        key = self.guard.key(parent.id)
        if reason not in FINAL_SKIPS:
            return self._hold(parent, path, reason)
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
                    # The snapshot lets an operator's rearm make the parent's row (a skip writes none).
                    self.guard.store.record(key, "skipped", owner=self.guard.owner,
                                            detail={"reason": reason, "path": path,
                                                    "author": parent.author_handle or parent.author_id,
                                                    "snapshot": snapshot_json(parent)})
                self._recorded[mark] = None
                if len(self._recorded) > _SEEN_SKIPS:
                    self._recorded.popitem(last=False)
            except StoreError as exc:  # a skip note is for explain only; nothing is sent either way
                log.warning("replyd.pipeline.skip_not_recorded", parent_id=parent.id, reason=reason, error=str(exc))
        return Outcome(Status.SKIPPED, key, detail=reason)

    def _hold(self, parent: Parent, path: str, reason: str) -> Outcome:
        """Keep a parent a passing limit holds back as a waiting ``released`` row (one durable commit) until the
        limit may let it through; its error names the reason. A store failure is raised: nothing holds it yet."""
        guard, now = self.guard, self.clock.now()
        key = guard.key(parent.id)
        until = self.policy.room_at(reason, parent, guard.store, guard.platform, guard.identity, self.clock)
        error = f"policy: {reason}"
        held = {"not_before": until, "error": error, "updated_at": now, "lease_owner": None, "lease_until": None}
        new = {**held, "state": RELEASED, "attempt": 1, "created_at": now, "path": path,
               "snapshot": snapshot_json(parent), "author_id": parent.author_id[:255], "origin_id": parent.origin_id,
               "owner": guard.owner,
               "provider_key": guard.provider_key(parent.id)}
        note = {"path": path, "reason": reason, "until": until}
        with guard.store.transaction(doing="holding a parent a limit holds back") as tx:
            if tx.insert_new(key, new):
                tx.append_event(key, "held", state=RELEASED, attempt=1, owner=guard.owner, detail=note)
                noted = True
            else:  # a waiting row (kept by a webhook, or re-offered): it waits on, noted once per reason
                row, noted = tx.get(key), False
                if row is not None and guard._claimable(row, now):
                    state = RELEASED if row.state in (RELEASED, COMPOSING) else row.state
                    event = None if row.error == error else {"kind": "held", "state": state, "attempt": row.attempt,
                                                             "owner": guard.owner, "detail": {**note, "from": row.state}}
                    noted = tx.cas_event(key, states=[row.state], attempt=row.attempt, values={**held, "state": state},
                                         lease_owner=lease_holder(row), event=event) and event is not None
        if noted:
            log.info("replyd.pipeline.held", parent_id=parent.id, path=path, reason=reason, until=until,
                     author=parent.author_handle or parent.author_id)
        return Outcome(Status.SKIPPED, key, detail=reason, retry_after_s=max(0.0, until - now))

    def close(self) -> None:
        """Release the responder's resources (HTTP clients, child processes)."""
        close = getattr(self.compose, "close", None)
        if callable(close):
            close()


class _Page:
    """One page's offer (``Pipeline.offer_page``): each parent's steps in order, the parents they let through
    gathered into a group that is claimed and posted together (``post``) when it is full, when a parent must
    see its posts first (the same parent again, a cap it may fill) and at the end."""

    def __init__(self, pipe: Pipeline, parents: list[Parent], path: str) -> None:
        self.pipe, self.parents, self.path = pipe, parents, path
        self.got: dict[int, Outcome | Exception] = {}
        self.group: list[int] = []  # indexes let through, not posted yet
        self.stop: int | None = None  # the index whose exception ends the page

    def run(self) -> list[Outcome | Exception]:
        for i, parent in enumerate(self.parents):
            if len(self.group) >= PAGE_MAX or any(self.parents[j].id == parent.id for j in self.group):
                self.post()
            if self.stop is not None:
                break
            try:
                out = self.pipe._screen(parent, self.path)
                if out is None:
                    reason = self.pipe._limit(parent, [self.parents[j] for j in self.group])
                    if reason in CAP_SKIPS and self.group:  # one by one, the group's posts would be counted
                        self.post()
                        if self.stop is not None:
                            break
                        reason = self.pipe._limit(parent, ())
                    out = self.pipe._skip(parent, self.path, reason) if reason else None
            except ContentionError as exc:  # nothing claimed or sent for this one; the page goes on
                self.got[i] = exc
                continue
            except Exception as exc:  # the page ends here, after the parents before it were offered
                self.post()
                if self.stop is None:
                    self.got[i], self.stop = exc, i
                break
            if out is None:
                self.group.append(i)
            else:
                self.got[i] = out
        self.post()
        end = len(self.parents) if self.stop is None else self.stop + 1
        return [self.got[i] for i in range(end)]

    def post(self) -> None:
        """Claim and post the group: together (``Guard.post_page``), or alone (``Guard.post``) if it is one."""
        guard, compose, path = self.pipe.guard, self.pipe.compose, self.path
        while self.group and self.stop is None:
            group, self.group = self.group, []
            done: list[Outcome] = []
            try:
                if len(group) == 1:
                    done.append(guard.post(self.parents[group[0]], compose, path=path))
                else:
                    guard.post_page([(self.parents[j], compose) for j in group], path=path, done=done)
            except Exception as exc:
                if len(done) == len(group):  # every post ended; what failed after them is a bug: not a parent's
                    raise
                failed = group[len(done)]
                self.got[failed] = exc
                if isinstance(exc, ContentionError):
                    self.group = group[len(done) + 1:]  # handed back by the page: claimed again, as a group
                else:
                    self.stop = failed
            finally:
                self.got.update(zip(group, done, strict=False))  # done stops at the failed one
