"""Stream discovery: a held connection on which the platform pushes mentions (Mastodon's notification stream,
Slack's Socket Mode: each envelope acknowledged by the adapter before its parent is offered here).

One thread per streaming bot reads the adapter's stream and offers each parent to the bot's pipeline with
path ``stream``: the same ``Parent`` the inbox poll builds, so the same key. A stream is a latency win,
never a second guard and never the only path: each time it (re)connects, the inbox poll runs once at
once (what arrived while it was down is read there), and the poll keeps running as the backstop. A
broken stream reconnects after a doubling back-off (1 s up to ``max_backoff_s``, with jitter), reset by
the first event that arrives.

A stream whose events the platform never sends again (``ResumableStream``: Discord's Gateway, where a bot
cannot list its DMs) is read with ``keep``: each parent is recorded as a ``released`` row (one durable
commit) before the next event is read, then queued for a second thread that offers it. A slow responder
then holds no event unrecorded; a crash leaves the rows to re-find's re-offer. A failed record ends the
stream: the adapter resumes from the last event recorded.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from replyd.errors import PlatformError
from replyd.log import get_logger
from replyd.platforms.base import Parent, StreamSource
from replyd.platforms.unreadable import Sink, reporting

if TYPE_CHECKING:
    from replyd.guard import Outcome

log = get_logger("replyd.streams")

_QUEUED = 1000  # kept parents waiting for their offer; past it they wait in their rows for re-find


class _KeepFailed(Exception):
    """A streamed parent could not be recorded (already logged): the stream ends and resumes before it."""


class StreamRunner:
    """Keeps one bot's stream open on a thread of its own and feeds its parents to the pipeline."""

    def __init__(
        self,
        bot: str,
        source: StreamSource,
        offer: Callable[[Parent, str], Outcome],
        catch_up: Callable[[], None],
        *,
        max_backoff_s: float = 60.0,
        keep: Callable[[Sequence[Parent]], object] | None = None,
        unreadable: Sink | None = None,
    ) -> None:
        self.bot = bot
        self.source = source
        self.offer = offer
        self.catch_up = catch_up  # the inbox poll: reads what the stream missed while it was down
        self.max_backoff_s = max_backoff_s
        self.keep = keep  # records parents as waiting rows (durable); None: offer each as it is read
        # Where an event the adapter cannot read is kept (the bot's ``Pollers.unreadable``); None: logged only.
        self.unreadable = unreadable
        self.stop_event = threading.Event()
        self.connects = 0
        self.offered = 0
        self._thread: threading.Thread | None = None
        self._offers: queue.Queue[Parent] = queue.Queue(maxsize=_QUEUED)
        self._offerer: threading.Thread | None = None

    def start(self) -> StreamRunner:
        """Start the stream thread (a daemon thread: a stuck read never blocks exit), and with ``keep`` the offers'."""
        self._thread = threading.Thread(target=self._run, name=f"replyd-stream-{self.bot}", daemon=True)
        self._thread.start()
        if self.keep is not None:
            self._offerer = threading.Thread(target=self._offer_kept, name=f"replyd-stream-offer-{self.bot}",
                                             daemon=True)
            self._offerer.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ask the threads to stop; the reader ends at the next event, heartbeat or read timeout. Kept parents
        still queued wait in their rows for re-find's re-offer."""
        self.stop_event.set()
        for thread in (self._thread, self._offerer):
            if thread is not None:
                thread.join(timeout_s)

    def _run(self) -> None:
        backoff_s = 1.0
        platform = self.source.instance
        while not self.stop_event.is_set():
            self.connects += 1
            try:
                log.info("replyd.streams.connecting", bot=self.bot, platform=platform, attempt=self.connects)
                self.catch_up()
                with reporting("stream", self.unreadable or (lambda _bad: None)):  # one bad event never ends it
                    for parent in self.source.stream(self.stop_event):
                        backoff_s = 1.0  # the stream works: a later break starts the back-off afresh
                        if self.keep is None:
                            self._offer(parent)
                        else:
                            self._keep(parent)
                if self.stop_event.is_set():
                    return
                log.warning("replyd.streams.closed", bot=self.bot, platform=platform)
            except PlatformError as exc:
                log.warning("replyd.streams.failed", bot=self.bot, platform=platform, error=str(exc)[:300],
                            retry_in_s=round(backoff_s, 1))
            except _KeepFailed:  # logged; the adapter resumes from the last event recorded
                pass
            except Exception as exc:  # an adapter bug must not end push discovery for good
                log.error("replyd.streams.crashed", bot=self.bot, platform=platform,
                          error=f"{type(exc).__name__}: {exc}"[:300], retry_in_s=round(backoff_s, 1))
            self.stop_event.wait(backoff_s * random.uniform(0.8, 1.2))
            backoff_s = min(self.max_backoff_s, backoff_s * 2)

    def _keep(self, parent: Parent) -> None:
        """Record ``parent`` (a failure ends the stream, unrecorded), then queue its offer; a full queue drops
        the offer, never the parent: its row waits for re-find's re-offer."""
        assert self.keep is not None
        try:
            self.keep([parent])
        except Exception as exc:
            log.error("replyd.streams.keep_failed", bot=self.bot, platform=self.source.instance, parent_id=parent.id,
                      error=f"{type(exc).__name__}: {exc}"[:300])
            raise _KeepFailed from exc
        try:
            self._offers.put_nowait(parent)
        except queue.Full:
            log.warning("replyd.streams.offer_deferred", bot=self.bot, platform=self.source.instance,
                        parent_id=parent.id, queued=_QUEUED)

    def _offer_kept(self) -> None:
        """The offers of kept parents, in arrival order, on a thread of their own."""
        while not self.stop_event.is_set():
            try:
                parent = self._offers.get(timeout=0.5)
            except queue.Empty:
                continue
            self._offer(parent)

    def _offer(self, parent: Parent) -> None:
        try:
            out = self.offer(parent, "stream")
            self.offered += 1
            log.info("replyd.streams.offered", bot=self.bot, platform=self.source.instance, parent_id=parent.id,
                     status=out.status.value)
        except Exception as exc:  # the poll backstop finds it again
            log.error("replyd.streams.offer_failed", bot=self.bot, platform=self.source.instance,
                      parent_id=parent.id, error=f"{type(exc).__name__}: {exc}"[:300])
