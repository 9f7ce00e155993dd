"""The one posting function: every reply replyd sends leaves through ``Guard.post``.

``Guard`` is the sync face of the guard's decisions (``replyd.core``, where they and their order are
documented): it runs each effect the core yields in the calling thread, as the guard always did. The other
face, over the same core, is ``replyd.aio.AsyncGuard``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from replyd import deadline, metrics
from replyd.core import (  # noqa: F401  (the names callers have always imported from here)
    MIN_SEND_FRACTION,
    PAGE_CLOSES,
    PAGE_MAX,
    Call,
    PageCloses,
    Compose,
    Drive,
    Effect,
    GuardCore,
    Lease,
    Edit,
    Pull,
    Respond,
    Send,
    SendWatch,
    Step,
    Steps,
    page_chunks,
    snapshot_json,
    text_hash,
)
from replyd.outcome import Outcome, Status
from replyd.outcome import classify as _classify  # noqa: F401  (as above: core's name for it)
from replyd.log import get_logger
from replyd.platforms.base import EditReply, Parent
from replyd.responders.base import settled
from replyd import stream as streams
from replyd.store import Key, Reply
from replyd import store as st

log = get_logger("replyd.guard")


def _sync_compose(compose: Compose, effect: Respond, idle_s: float) -> Callable[[Parent], object]:
    """``compose`` as a sync call: an ``async def`` responder (or one returning an awaitable) is awaited; a
    streamed answer is handed back as a ``Stream`` (``effect.stream``) or drained to its whole text."""

    def call(parent: Parent) -> object:
        got = settled(compose(parent))
        stream = streams.as_stream(got)
        if stream is None:
            return got
        return stream if effect.stream else streams.drain(stream, idle_s)

    return call


class Guard(GuardCore):
    """Posts replies for one bot on one platform, each parent at most once (the sync face of ``GuardCore``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watcher: threading.Thread | None = None
        self._watch_lock = threading.Lock()
        self._stop_watch = threading.Event()

    # -- the driver: each effect the core yields, run here, in the calling thread --------------------

    def _run(self, steps: Steps) -> Any:
        """Drive ``steps`` to its end in this thread; return the decision's value.

        ``Drive``'s protocol written out as one loop (no object, no method call per effect: a sixth of a page's
        post loop): each effect's result is sent in, its exception thrown in where it arose; an exception the
        decision does not catch goes on to the caller."""
        do, send, throw = self._do, steps.send, steps.throw
        try:
            effect = next(steps)
            while True:
                try:
                    result = do(effect)
                except BaseException as exc:
                    effect = throw(exc)
                    continue
                effect = send(result)
        except StopIteration as stop:
            return stop.value

    def _do(self, effect: Effect) -> Any:
        if type(effect) is Call:
            return effect.fn(*effect.args, **effect.kwargs)
        if type(effect) is Send:
            with metrics.watching_send(self.platform.instance), deadline.within(effect.budget_s):
                return self.platform.send(effect.parent, effect.text, provider_key=effect.provider_key)
        if type(effect) is Respond:
            return metrics.timed_responder(_sync_compose(effect.compose, effect, self.stream_idle_s), effect.parent,
                                           self.platform.instance)
        if type(effect) is Pull:
            if effect.close:
                return streams.close(effect.stream)
            return streams.pull(effect.stream, effect.timeout_s)
        if type(effect) is Edit:
            with deadline.within(effect.budget_s):
                return cast(EditReply, self.platform).edit(effect.parent, effect.reply_id, effect.text)
        return getattr(self, effect.name)(*effect.args)  # a Step: the face's own (maybe wrapped) method

    # -- the public face ------------------------------------------------------------------------------

    def check(self, parent_id: str) -> Outcome | None:
        """Return what blocks ``post`` for ``parent_id``, read-only; None if a post would claim it."""
        return cast("Outcome | None", self._run(self.check_steps(parent_id)))

    def retire(self, parent_id: str, reason: str) -> bool:
        """End a row that waits to be offered again as ``skipped`` with ``reason``; True if this call moved it."""
        return cast(bool, self._run(self.retire_steps(parent_id, reason)))

    def keep_received(self, parents: Sequence[Parent], *, path: str, detail: dict[str, Any], doing: str) -> int:
        """Record ``parents`` as ``released`` rows (their snapshot, no attempt spent, event ``received``) where their
        key has none, in one durable commit; return how many rows it made. A ``StoreError`` means none is kept.
        Re-find's re-offer (``Pollers.reoffer``) offers such a row from its snapshot if nothing claims it first."""
        now = self.clock.now()
        rows = [(self.key(p.id), {"state": st.RELEASED, "attempt": 1, "created_at": now, "updated_at": now,
                                  "path": path, "snapshot": snapshot_json(p), "author_id": p.author_id[:255],
                                  "origin_id": p.origin_id,
                                  "owner": self.owner, "provider_key": self.provider_key(p.id)})
                for p in parents]
        return self.store.insert_absent(rows, {"kind": "received", "owner": self.owner,
                                               "detail": {"path": path, **detail}}, doing=doing)

    @metrics.observe_post
    def post(self, parent: Parent, text: str | Compose, *, path: str = "api") -> Outcome:
        """Reply to ``parent`` at most once; ``text`` is the reply or a responder to call once."""
        return cast(Outcome, self._run(self.post_steps(parent, text, path=path)))

    def post_page(self, items: Sequence[tuple[Parent, str | Compose]], *, path: str = "api",
                  done: list[Outcome] | None = None) -> list[Outcome]:
        """Reply to each parent of one page at most once, its keys claimed in one transaction; in order.

        An exception (``StoreError``, ``ContentionError``) stops the page where it is raised: what the page sent
        is closed, the rows it claimed for the posts after it are handed back (``released``, no attempt used;
        where the store refuses, they wait for the sweep (``open``) or their hold (``composing``)), and the
        exception goes on. ``done``: a list the page appends each outcome to as it comes, so a caller that
        catches the exception knows which items ended (the first ``len(done)``, in order)."""
        outs: list[Outcome] = [] if done is None else done
        for chunk in page_chunks(list(items), PAGE_MAX):
            if len(chunk) == 1:  # nothing to share: the single path itself, with no page to set up
                outs.append(self.post(chunk[0][0], chunk[0][1], path=path))
                continue
            keys = [self.key(p.id) for p, _ in chunk]
            rows = self.claim_page(chunk, path=path)
            page = self.page_closes(keys, rows)
            token = PAGE_CLOSES.set(page)
            start = len(outs)
            try:
                for (p, t), row in zip(chunk, rows, strict=True):
                    outs.append(self.post_claimed(p, t, path=path, claimed=row))
            except Exception as exc:  # the page stops here: what it sent is closed all the same
                PAGE_CLOSES.reset(token)
                self._fix(outs, start, self._run(self.close_page_steps(page)))
                reached = len(outs) - start + 1
                self._run(self.unclaim_page_steps(list(zip(keys, rows, strict=True))[reached:], exc))
                raise
            except BaseException:  # the process is going away: its open rows are the sweep's
                PAGE_CLOSES.reset(token)
                raise
            PAGE_CLOSES.reset(token)
            self._fix(outs, start, self._run(self.close_page_steps(page)))  # the page's closes: one relaxed commit
        return outs

    @staticmethod
    def _fix(outs: list[Outcome], start: int, fixed: dict[Key, Outcome]) -> None:
        """Put the page's close results (``close_page_steps``) in place of the outcomes from ``start`` on."""
        for i in range(start, len(outs)):
            outs[i] = fixed.get(outs[i].key, outs[i])

    def claim_page(self, items: Sequence[tuple[Parent, str | Compose]], *, path: str = "api") -> list[st.Row | None]:
        """Claim the new keys of ``items`` (at most ``PAGE_MAX``) in one transaction; per item its row or None."""
        steps = self.claim_page_steps([(p, t if isinstance(t, str) else None) for p, t in items], path)
        return cast("list[st.Row | None]", self._run(steps))

    @metrics.observe_post
    def post_claimed(self, parent: Parent, text: str | Compose, *, path: str = "api",
                     claimed: st.Row | None = None) -> Outcome:
        """``post`` after ``claim_page`` (``claimed`` None: this post claims alone, as ``post`` does)."""
        return cast(Outcome, self._run(self.post_steps(parent, text, path=path, claimed=claimed)))

    def watch_sends(self) -> int:
        """Push the deadline of every row whose send has run past half its budget; return how many moved."""
        if not self.sends.overdue(self.clock.now(), self.send_timeout_s / 2):
            return 0  # the usual tick, every second for every bot: no steps to drive
        return cast(int, self._run(self.watch_steps()))

    # -- the seams (Step): each a method, so a test or the chaos shim can wrap it --------------------

    def _claim(self, key: Key, parent: Parent, path: str, text: str | None) -> st.Row | Outcome:
        """Take the key atomically; return the claimed row, or an Outcome if not ours."""
        return cast("st.Row | Outcome", self._run(self.claim_steps(key, parent, path, text)))

    def _open_composed(self, key: Key, row: Reply | st.Row, text: str) -> st.Row | Outcome:
        """Turn our composing claim into a durable open row, unless the lease was lost."""
        return cast("st.Row | Outcome", self._run(self.open_steps(key, row, text)))

    def _send(self, key: Key, parent: Parent, row: Reply | st.Row, text: str) -> Outcome:
        """Send an open row's text and record its fate."""
        return cast(Outcome, self._run(self.send_steps(key, parent, row, text)))

    def _close(self, key: Key, attempt: int, reply_id: str, kind: str, status: Status = Status.POSTED) -> Outcome:
        """Close our row with the reply id; a lost close is left to the sweep."""
        return cast(Outcome, self._run(self.close_steps(key, attempt, reply_id, kind, status)))

    # -- the send watch thread ---------------------------------------------------------------------

    def _start_watch(self) -> None:
        if self._watcher is not None:
            return
        with self._watch_lock:
            if self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._watch_loop, name="replyd-send-watch", daemon=True)
            self._watcher.start()

    def _watch_loop(self) -> None:
        assert self._watch_interval_s is not None
        while not self._stop_watch.wait(self._watch_interval_s):
            try:
                self.watch_sends()
            except Exception as exc:  # the watch must outlive any one failure
                log.error("replyd.guard.watch_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def close(self) -> None:
        """Stop the send watch thread (the guard can still post; the thread restarts on the next send)."""
        self._stop_watch.set()
        t, self._watcher = self._watcher, None
        if t is not None:
            t.join(timeout=5.0)
        self._stop_watch = threading.Event()
