"""Discovery paths of one bot: inbox, search and re-find, each feeding the one pipeline.

Cursors are saved only after every parent of a page was offered, so a crash
re-reads the page and the guard drops what was already answered.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import structlog

from replyd import metrics
from replyd import store as st
from replyd.clock import Clock
from replyd.config import PollerConfig
from replyd.errors import ContentionError, PlatformError, RateLimited, StoreError
from replyd.guard import Outcome, Status
from replyd.liveness import Heartbeat, error_words
from replyd.pipeline import Pipeline
from replyd.platform import Parent, Platform
from replyd.store import Store

log = structlog.get_logger("replyd.poller")


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

    def _offer_all(self, parents: Iterable[Parent], path: str) -> None:
        for p in parents:
            try:
                out = self.pipeline.offer(p, path)
            except ContentionError as exc:
                # Nothing was sent; the next poll offers it again. One busy key must not stop the page.
                log.warning("replyd.poller.contended", path=path, parent_id=p.id, error=str(exc))
                continue
            if isinstance(out, Outcome):
                self.outcomes[out.status.value] = self.outcomes.get(out.status.value, 0) + 1

    def _beat(self, path: str, exc: BaseException | None = None) -> None:
        if self.heartbeat is None:
            return
        if exc is None:
            self.heartbeat.ok(path)
        else:
            self.heartbeat.failed(path, error_words(exc))

    def _guarded(self, path: str, fn) -> None:  # noqa: ANN001
        try:
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

    def inbox(self) -> None:
        """Read mentions and replies since the saved cursor."""

        def run() -> None:
            cursor = self.store.get_cursor(self.platform.instance, self.sender_id, "inbox")
            page = self.platform.inbox(cursor)
            self._offer_all(page.parents, "inbox")
            if page.cursor and page.cursor != cursor:
                self.store.set_cursor(self.platform.instance, self.sender_id, "inbox", page.cursor)

        self._guarded("inbox", run)

    def search(self) -> None:
        """Run every configured query since its saved cursor."""
        for q in self.cfg.search_queries:

            def run(q: str = q) -> None:
                name = f"search:{q}"
                cursor = self.store.get_cursor(self.platform.instance, self.sender_id, name)
                page = self.platform.search(q, cursor)
                self._offer_all(page.parents, "search")
                if page.cursor and page.cursor != cursor:
                    self.store.set_cursor(self.platform.instance, self.sender_id, name, page.cursor)

            self._guarded("search", run)

    def refind(self) -> None:
        """Re-read the lookback window with no cursor, and re-offer not_landed and released parents."""

        def run() -> None:
            since = self.clock.now() - self.cfg.refind_lookback_s
            self._offer_all(self.platform.refind(since), "refind")
            rows = self.store.rows_in(self.platform.instance, self.sender_id, [st.NOT_LANDED, st.RELEASED])
            self._offer_all((Parent.from_snapshot(json.loads(r.snapshot)) for r in rows if r.snapshot != "{}"), "refind")

        self._guarded("refind", run)

    def answered(self) -> int:
        """Return how many offers this bot's pollers turned into posts."""
        return self.outcomes.get(Status.POSTED.value, 0)
