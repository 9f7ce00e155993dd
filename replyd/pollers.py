"""Discovery paths of one bot: inbox, search and re-find, each feeding the one pipeline a page at a time
(``Pipeline.offer_page``: one group claim per page).

Cursors are saved only after every parent of a page was offered, so a crash
re-reads the page and the guard drops what was already answered. A parent the
store was too busy to take (``ContentionError``: nothing written, nothing sent)
holds the cursor too: the rest of the page is offered, the cursor is not saved,
and the next poll reads the page again. On Telegram the saved offset confirms
the updates for good, so saving it past such a parent would lose it. A parent a
cap holds back is a waiting row (``Pipeline._hold``): the cursor moves on. A poll that
finds nothing writes nothing and reads no cursor: each path's cursor is read
from the store once, then kept here as this process saved it. On a fleet
(``replyd.fleet``) a replica that gains a bot reads its cursors again. Replicas
that poll one bot (a handover, or the fleet off) each poll from their own; a
page another replica already offered is offered again and the guard drops it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from replyd import metrics
from replyd.clock import Clock
from replyd.config import PollerConfig
from replyd.errors import ContentionError, PlatformError, RateLimited, StoreError
from replyd.guard import Outcome, Status
from replyd.liveness import Heartbeat, error_words
from replyd.log import get_logger
from replyd.pipeline import Pipeline
from replyd.platforms import unreadable
from replyd.platforms.base import Parent, Platform
from replyd.policy import FINAL_SKIPS
from replyd.store import Reply, Store

log = get_logger("replyd.poller")


class Pollers:
    """The three discovery paths of one bot."""

    def __init__(self, store: Store, platform: Platform, pipeline: Pipeline, cfg: PollerConfig, clock: Clock,
                 heartbeat: Heartbeat | None = None) -> None:
        self.store = store
        self.heartbeat = heartbeat  # told every run's result (the daemon's liveness); an unexpected error tells nothing
        self.platform = platform
        self.pipeline = pipeline
        self.cfg = cfg
        self.clock = clock
        self.sender_id = pipeline.guard.identity.sender_id
        self.outcomes: dict[str, int] = {}
        self._reoffer_after: tuple[float, str] | None = None  # where the last re-offer page ended
        self._cursors: dict[str, str | None] = {}  # by cursor name: as read once, then as this process saved it
        # Where an item a path cannot read is kept (the bot's hooks and stream report through it too).
        self.unreadable = unreadable.recorder(store, platform.instance, self.sender_id)

    def _cursor(self, name: str) -> str | None:
        """The path's cursor: read from the store the first time only (a store read per empty poll is waste)."""
        if name not in self._cursors:
            self._cursors[name] = self.store.get_cursor(self.platform.instance, self.sender_id, name)
        return self._cursors[name]

    def forget_cursors(self) -> None:
        """Read every cursor from the store again at its next use (another replica polled this bot meanwhile)."""
        self._cursors.clear()

    def _advance(self, name: str, old: str | None, new: str | None) -> None:
        """Save the cursor the page ended at, only when it moved: a poll that found nothing writes nothing."""
        if new and new != old:
            self.store.set_cursor(self.platform.instance, self.sender_id, name, new)
            self._cursors[name] = new

    def _offer_all(self, parents: Iterable[Parent], path: str,
                   then: Callable[[Parent, Outcome], None] | None = None) -> int:
        """Offer a page as one group (``Pipeline.offer_page``); count each parent's outcome (and hand it to
        ``then``); return how many were offered. A busy store for one parent does not stop the page: the others
        are offered, then a ``ContentionError`` is raised, so the cursor is not saved past it. Any other
        exception is raised once the parents before it are counted (the cursor is not saved either)."""
        page = list(parents)
        offered, busy = 0, []
        for p, out in zip(page, self.pipeline.offer_page(page, path), strict=False):  # an exception ends the page early
            if isinstance(out, ContentionError):
                busy.append(p.id)  # nothing was written or sent for it: the page is read again
                continue
            if isinstance(out, Exception):
                raise out
            offered += 1
            if isinstance(out, Outcome):
                self.outcomes[out.status.value] = self.outcomes.get(out.status.value, 0) + 1
                if then is not None:
                    then(p, out)
        if busy:
            raise ContentionError(f"store busy for {len(busy)} of {len(page)} parents (first {busy[0]!r}); "
                                  "the cursor stays, the next poll reads them again")
        return offered

    def _beat(self, path: str, exc: BaseException | None = None) -> None:
        if self.heartbeat is None:
            return
        if exc is None:
            self.heartbeat.ok(path)
        else:
            self.heartbeat.failed(path, error_words(exc))

    def _guarded(self, path: str, fn) -> None:
        try:
            with unreadable.reporting(path, self.unreadable):  # one unreadable item is recorded; the page goes on
                fn()
            self._beat(path)
        except RateLimited as exc:
            self._beat(path, exc)
            metrics.platform_error(self.platform.instance, path, exc)
            log.warning("replyd.poller.rate_limited", path=path, platform=self.platform.instance, retry_after_s=exc.retry_after_s)
        except PlatformError as exc:
            self._beat(path, exc)
            metrics.platform_error(self.platform.instance, path, exc)
            log.warning("replyd.poller.failed", path=path, platform=self.platform.instance, error=str(exc)[:300])
        except StoreError as exc:
            self._beat(path, exc)
            log.error("replyd.poller.store_failed", path=path, platform=self.platform.instance, error=str(exc))
        except ContentionError as exc:
            self._beat(path, exc)
            log.warning("replyd.poller.contended", path=path, platform=self.platform.instance, error=str(exc))

    def inbox(self) -> None:
        """Read mentions and replies since the saved cursor."""

        def run() -> None:
            cursor = self._cursor("inbox")
            page = self.platform.inbox(cursor)
            self._offer_all(page.parents, "inbox")
            self._advance("inbox", cursor, page.cursor)

        self._guarded("inbox", run)

    def search(self) -> None:
        """Run every configured query since its saved cursor."""
        for q in self.cfg.search_queries:

            def run(q: str = q) -> None:
                name = f"search:{q}"
                cursor = self._cursor(name)
                page = self.platform.search(q, cursor)
                self._offer_all(page.parents, "search")
                self._advance(name, cursor, page.cursor)

            self._guarded("search", run)

    def refind(self) -> None:
        """Re-read the lookback window with no cursor, then offer one page of waiting rows again."""

        def run() -> None:
            since = self.clock.now() - self.cfg.refind_lookback_s
            self._offer_all(self.platform.refind(since), "refind")
            self.reoffer()

        self._guarded("refind", run)

    def reoffer_guarded(self) -> None:
        """``reoffer`` as a scheduled job of its own (when re-find is off): failures are logged, never raised."""
        self._guarded("refind", self.reoffer)

    def reoffer(self) -> int:
        """Offer the next page of rows that wait for a path (released, not_landed, expired composing); return how many.

        A row a cap holds (error "policy: hourly_cap") comes once its ``not_before`` passed; still capped, it
        gets a later one and no event (``Pipeline._hold``), so a full hour costs no write per pass.

        Each row is offered from its own snapshot, so a parent whose discovery path moved on (a search cursor
        saved past it while it was composing) is not left behind. The pages rotate through the whole set
        across runs. A row the policy now rules out for good ends ``skipped`` with the reason (``replyd
        explain`` shows it), so it does not come back.
        """
        rows = self.store.reoffer_due(self.platform.instance, self.sender_id, now=self.clock.now(),
                                      after=self._reoffer_after, limit=self.cfg.refind_batch)
        # A short page ends the walk: the next run starts again from the oldest.
        self._reoffer_after = (rows[-1].updated_at, rows[-1].parent_id) if len(rows) == self.cfg.refind_batch else None

        def retire(parent: Parent, out: Outcome) -> None:
            if out.status is Status.SKIPPED and out.detail in FINAL_SKIPS:
                self.pipeline.guard.retire(parent.id, out.detail)

        return self._offer_all([p for p in map(self._snapshot_parent, rows) if p is not None], "refind", retire)

    def _snapshot_parent(self, r: Reply) -> Parent | None:
        """The parent as first found, from the row's snapshot; None (logged) when there is none to use."""
        try:
            data = json.loads(r.snapshot or "{}")
            return Parent.from_snapshot(data) if data else None
        except (ValueError, TypeError, KeyError) as exc:
            log.error("replyd.poller.bad_snapshot", parent_id=r.parent_id, error=f"{type(exc).__name__}: {exc}"[:200])
            return None

    def answered(self) -> int:
        """Return how many offers this bot's pollers turned into posts."""
        return self.outcomes.get(Status.POSTED.value, 0)
