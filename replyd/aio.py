"""The asyncio face of the guard: the same decisions (``replyd.core``), never blocking the event loop.

::

    async with open_guard("sqlite:///replyd.sqlite3", platform) as g:
        outcome = await g.post(parent, "Thanks!")          # or an ``async def`` responder
        lease = await g.begin(parent, owner="agent-1")     # compose elsewhere, then
        outcome = await g.finish(lease, text)
        await g.sweep()

How each effect of the core runs here (the sync face, ``replyd.guard.Guard``, runs them in the caller's thread):

- store calls, whole transactions included, on the store's own thread (``StoreThread``: one per store,
  so SQLite sees one writer and each claim still commits durably before the send; PostgreSQL gets
  ``store_threads`` connections' worth of parallelism through the same synchronous driver);
- the send: ``asend`` awaited where the adapter offers ``AsyncSend`` (the bring-your-own platform; the HTTP
  adapters whose send is written as steps, ``platforms._http.StepSend``, on their ``httpx.AsyncClient``,
  the whole-send deadline applied by the async driver), else the adapter's sync ``send`` on a worker thread
  (Slack, Discord, Telegram, Bluesky, email: its client honours the deadline there, ``replyd.deadline``
  being a context variable the thread inherits); either way the whole send is also cut at its budget on the
  loop (a cut send is ambiguous: the sweep decides);
- the responder: an ``async def`` responder (or a ``Responder``) awaited on the loop, a plain function on a
  worker thread (it may block: an LLM call);
- a ``Step`` (claim, open, send, close) is this face's own coroutine method, so tests can wrap it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

from replyd import deadline, metrics
from replyd.admission import Admission
from replyd import store as st
from replyd.core import (PAGE_CLOSES, PAGE_MAX, Call, Compose, Drive, Edit, Effect, GuardCore, Lease, Pull, Respond, Send,
                         Steps, page_chunks)
from replyd.errors import BadResponse, MaybeSent, PlatformError
from replyd.log import get_logger
from replyd.outcome import Outcome, Status
from replyd.platforms.base import AsyncSend, EditReply, Identity, LoopBound, Parent, Platform, Sent
from replyd import stream as streams
from replyd.responders.base import Responder, _checked
from replyd.store import Event, Key, Reply, Store
from replyd.store.aiopg import AsyncHotPath
from replyd.store.postgres import PostgresStore
from replyd.store.sqlite import SQLiteStore
from replyd.sweep import Bot, Sweeper, SweepResult

log = get_logger("replyd.aio")

# The most claims one group commit takes (what waits beyond it forms the next group).
GROUP_MAX = 64
SETTLE_PER_TURN = 4  # claims of a group settled per loop turn (``_settle_some``)

T = TypeVar("T")

__all__ = ["AsyncGuard", "AsyncGuardSession", "Lease", "Outcome", "Status", "StoreThread", "open_guard"]


class StoreThread:
    """The thread(s) one store's calls run on, off the event loop (one by default: a single SQLite writer).

    Not ``run_in_executor``: a post makes two or three store calls, and the executor's hop (work item, wrapped
    concurrent future, chained callbacks) measured ~100 µs against ~40 µs for a plain queue and one
    ``call_soon_threadsafe`` with the result. The hop is most of what the async face costs over the sync one.
    """

    def __init__(self, store: Store, threads: int = 1) -> None:
        self.store = store
        self._calls: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        # Claims waiting together commit together where the store can (SQLite: one fsync for the group, not one
        # each): under many posts the store thread is mostly fsync, and each one costs the machine's kernel
        # CPU besides (the loop's lag under load). One claim waiting alone takes the plain path.
        self._group = store if isinstance(store, st.ClaimsInGroup) else None
        self._claim = store.claim if self._group is not None else None
        self.grouped = 0  # claims answered by a group commit (for tests and benchmarks)
        self._threads = [threading.Thread(target=self._serve, name=f"replyd-store-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        calls = self._calls
        while (call := calls.get()) is not None:
            if self._group is None or call[2] != self._claim:
                self._one(call)
                continue
            claims: list[tuple[Any, ...]] = [call]
            others: list[tuple[Any, ...]] = []
            stop = False
            while len(claims) < GROUP_MAX:  # what else is waiting: calls of other tasks, any order is a valid one
                try:
                    nxt = calls.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                (claims if nxt[2] == self._claim else others).append(nxt)
            if len(claims) > 1:
                self._claims(claims)
            else:
                self._one(call)
            for c in others:
                self._one(c)
            del call, claims, others
            if stop:
                return

    def _one(self, call: tuple[Any, ...]) -> None:
        loop, fut, fn, args, kwargs = call
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting coroutine, as run_in_executor would
            _hand(loop, fut, None, exc)
        else:
            _hand(loop, fut, result, None)
        del call, fut, fn, args, kwargs  # no reference kept to a result while the thread waits

    def _claims(self, calls: list[tuple[Any, ...]]) -> None:
        """Commit the waiting claims as one group; each one the group did not take runs alone."""
        assert self._group is not None
        try:
            got: list[Any] = self._group.claim_group([(c[3], c[4]) for c in calls])
        except Exception:  # the group's transaction failed, nothing written: each claim gets its own answer
            got = [None] * len(calls)
        done: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for c, claim in zip(calls, got, strict=True):
            if claim is None:
                self._one(c)
            else:
                self.grouped += 1
                done.setdefault(c[0], []).append((c[1], claim))
        for loop, settled in done.items():
            try:
                loop.call_soon_threadsafe(_settle_some, settled)
            except RuntimeError:  # the loop closed: nobody left to tell
                pass

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the store's thread and await its result (or exception)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, fut, fn, args, kwargs))
        return await fut

    def close(self) -> None:
        """Stop the thread(s) once their queued calls ran."""
        for _ in self._threads:
            self._calls.put(None)
        for t in self._threads:
            t.join()


def _hand(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """Give a store call's result to its future on the loop (a closed loop has nobody left to tell)."""
    try:
        loop.call_soon_threadsafe(_settle, fut, result, exc)
    except RuntimeError:
        pass


def _settle_some(done: list[tuple[asyncio.Future[Any], Any]]) -> None:
    """Settle a group's claims a few per loop turn: each wakes a post that then runs to its send, and a group's
    posts all woken in one turn held the loop ~20 ms (the loop-lag run on SQLite, 64 posts past their claim)."""
    for fut, claim in done[:SETTLE_PER_TURN]:
        _settle(fut, claim, None)
    if len(done) > SETTLE_PER_TURN:
        asyncio.get_running_loop().call_soon(_settle_some, done[SETTLE_PER_TURN:])


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():  # the awaiting coroutine was cancelled: the call ran anyway, its result unread
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncGuard(GuardCore):
    """Posts replies for one bot on one platform, each parent at most once, from coroutines (the async face)."""

    def __init__(self, store: Store, platform: Platform, identity: Identity, *,
                 store_thread: StoreThread | None = None, max_in_flight: int = 64, async_pg: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(store, platform, identity, **kwargs)
        # Posts past the claim at once: a thousand gathered posts must not all claim, then wait their turn for
        # the store and the connection pool while their send budgets run out (an attempt each); one waiting here
        # has claimed nothing. Within ``max_in_flight`` the window follows the loop's lag (replyd.admission):
        # against a platform a few ms away 16 answers parsed in one turn held the loop 8-20 ms, against one
        # 300 ms away the loop idles and a small fixed bound would only cap the throughput.
        self._slots = Admission(max_in_flight)
        self._own_thread = store_thread is None
        self.store_thread = store_thread or StoreThread(store)
        # PostgreSQL's claims, closes and reads run on the loop through psycopg's async connections (no thread
        # hop, no GIL shared with a store thread); a store without statement steps (SQLite) uses the thread.
        # The class decides, not the instance: a proxy (a test's slow store) must not have its planning call,
        # which runs on the loop, taken for a store call.
        self.hot_path: AsyncHotPath | None = (AsyncHotPath(store) if async_pg and isinstance(store, PostgresStore)
                                              else None)
        # SQLite: a close (relaxed: no fsync) is written on the loop when it needs no wait (see write_now).
        self._now: SQLiteStore | None = store if isinstance(store, SQLiteStore) else None
        self._watcher: asyncio.Task[None] | None = None
        self._late: set[asyncio.Task[Outcome]] = set()  # closes of sends that returned after their budget
        self._closing = False
        # Once, not per send: a runtime Protocol check walks the Protocol's members (~18 µs a post).
        self._awaits_send = isinstance(platform, AsyncSend)

    # -- the driver: each effect the core yields, awaited ------------------------------------------

    async def _run(self, steps: Steps) -> Any:
        """Drive ``steps`` to its end on the loop, awaiting each effect; return the decision's value."""
        run = Drive(steps)
        while not run.done:
            try:
                got = await self._do(cast(Effect, run.effect))  # not None until done
            except BaseException as exc:
                run.fail(exc)
            else:
                run.ok(got)
        return run.value

    async def _do(self, effect: Effect) -> Any:
        if type(effect) is Call:
            if self.hot_path is not None:
                hot = self.hot_path.steps(effect.fn, effect.args, effect.kwargs)
                if hot is not None:
                    return await self.hot_path.run(*hot)
            elif self._now is not None:
                done, got = self._now.write_now(effect.fn, effect.args, effect.kwargs)
                if done:
                    return got
            return await self.store_thread.run(effect.fn, *effect.args, **effect.kwargs)
        if type(effect) is Send:
            return await self._send_once(effect)
        if type(effect) is Respond:
            return await self._respond(effect.compose, effect.parent, stream=effect.stream)
        if type(effect) is Pull:
            if effect.close:
                return await streams.aclose(effect.stream)
            return await streams.apull(effect.stream, effect.timeout_s)
        if type(effect) is Edit:
            return await self._edit(effect)
        return await getattr(self, effect.name)(*effect.args)  # a Step: this face's own (maybe wrapped) method

    async def _send_once(self, effect: Send) -> Sent:
        """The adapter's send within the effect's budget, on the loop (``asend``) or on a worker thread."""
        platform = self.platform
        with metrics.watching_send(platform.instance), deadline.within(effect.budget_s), \
                deadline.outliving() as left:
            try:
                async with asyncio.timeout(effect.budget_s) as cut:
                    if self._awaits_send:
                        return await cast(AsyncSend, platform).asend(effect.parent, effect.text,
                                                                     provider_key=effect.provider_key)
                    # The copied context carries the deadline: the thread's HTTP client (replyd's) ends by it.
                    return await deadline.to_thread(platform.send, effect.parent, effect.text,
                                                    provider_key=effect.provider_key)
            except TimeoutError:
                if not cut.expired():
                    raise  # the adapter's own TimeoutError: an unmapped error after the request may have left
                # Cut at the budget: the request may have acted (never "not sent"); the sweep reads back.
                raise MaybeSent(f"send: the whole deadline ({effect.budget_s:.1f} s) passed (outcome unknown)") from None
            finally:
                if left:
                    # Cut at the budget or cancelled by the caller (``wait_for`` around a post) while its thread
                    # runs: a thread cannot be stopped (an SDK's own timeout, a DNS lookup), so the send stays
                    # watched until it returns, the sweep never judges a request still running (a retry would
                    # land beside it), and a reply it makes closes the row.
                    self.sends.outlive(effect.token)
                    asyncio.gather(*left, return_exceptions=True).add_done_callback(
                        functools.partial(self._send_returned, effect))

    def _send_returned(self, effect: Send, returned: asyncio.Future[list[Any]]) -> None:
        """A send its caller stopped waiting for returned at last (on the loop): unwatch it; a reply it made
        closes the row."""
        watched = self.sends.ended(effect.token)
        if watched is None:
            return
        key, attempt = watched
        results = [] if returned.cancelled() else returned.result()
        sent = next((r for r in results if isinstance(r, Sent)), None)
        if sent is None:  # the row stays open: the sweep reads back (or marks it unconfirmed)
            errors = [f"{type(r).__name__}: {r}"[:300] for r in results if isinstance(r, BaseException)]
            log.warning("replyd.guard.late_send_failed", platform=self.platform.instance, parent_id=key.parent_id,
                        attempt=attempt, error="; ".join(errors) or None)
            return
        log.warning("replyd.guard.late_send", platform=self.platform.instance, parent_id=key.parent_id,
                    attempt=attempt, reply_id=sent.reply_id)
        if self._closing:
            return  # the guard is closing: the row stays open for the sweep, which reads the reply back
        task = asyncio.get_running_loop().create_task(self._close(key, attempt, sent.reply_id, "closed"))
        self._late.add(task)
        task.add_done_callback(self._late_closed)

    def _late_closed(self, task: asyncio.Task[Outcome]) -> None:
        self._late.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:  # a lost close is the sweep's
            log.error("replyd.guard.late_close_failed", platform=self.platform.instance,
                      error=f"{type(exc).__name__}: {exc}"[:300])

    async def _edit(self, effect: Edit) -> None:
        """The adapter's edit within the effect's budget, on a worker thread (a cut edit's outcome is unknown)."""
        with deadline.within(effect.budget_s):
            try:
                async with asyncio.timeout(effect.budget_s):
                    await asyncio.to_thread(cast(EditReply, self.platform).edit, effect.parent, effect.reply_id,
                                            effect.text)
            except TimeoutError:
                raise MaybeSent(f"edit: the whole deadline ({effect.budget_s:.1f} s) passed (outcome unknown)") from None

    async def _respond(self, compose: Compose | Responder, parent: Parent, *,
                       stream: bool = False) -> str | streams.Stream | None:
        """Call the responder once, timed and counted like the sync face's; a streamed answer comes back as a
        ``Stream`` (``stream``: the core shows it as it comes) or drained to its whole text."""
        t0 = time.perf_counter()
        try:
            raw: object  # what the responder gave: text, None, an awaitable of it, or a stream
            if isinstance(compose, Responder):
                raw = await compose.respond(parent)
            elif inspect.iscoroutinefunction(compose) or inspect.isasyncgenfunction(compose):
                raw = compose(parent)  # an async generator is made here, read on this loop
                if inspect.isawaitable(raw):
                    raw = await raw
            else:
                raw = await asyncio.to_thread(compose, parent)  # a plain function may block (an LLM call)
                if inspect.isawaitable(raw):
                    raw = await raw
            got = streams.as_stream(raw)
            if got is not None:
                if stream:
                    metrics.responder_called(self.platform.instance, time.perf_counter() - t0, "stream")
                    return got
                raw = await streams.adrain(got, self.stream_idle_s)
            text = _checked(raw)
        except BaseException:
            metrics.responder_called(self.platform.instance, time.perf_counter() - t0, failed=True)
            raise
        metrics.responder_called(self.platform.instance, time.perf_counter() - t0, text)
        return text

    # -- the public face ------------------------------------------------------------------------------

    async def check(self, parent_id: str) -> Outcome | None:
        """Return what blocks ``post`` for ``parent_id``, read-only; None if a post would claim it."""
        return cast("Outcome | None", await self._run(self.check_steps(parent_id)))

    async def retire(self, parent_id: str, reason: str) -> bool:
        """End a row that waits to be offered again as ``skipped`` with ``reason``; True if this call moved it."""
        return cast(bool, await self._run(self.retire_steps(parent_id, reason)))

    @metrics.observe_post
    async def post(self, parent: Parent, text: str | Compose, *, path: str = "api") -> Outcome:
        """Reply to ``parent`` at most once; ``text`` is the reply or a responder (sync or async) to call once."""
        await self._slots.enter()
        try:
            return cast(Outcome, await self._run(self.post_steps(parent, text, path=path)))
        finally:
            self._slots.leave()

    async def post_page(self, items: Sequence[tuple[Parent, str | Compose]], *, path: str = "api",
                        done: list[Outcome] | None = None) -> list[Outcome]:
        """Reply to each parent of one page at most once, its keys claimed in one transaction; in order (the posts
        after the claim run concurrently, within ``max_in_flight``).

        An exception in a post stops the page as on the sync face, once the posts under way have ended (they run
        beside it): what the page sent is closed and the first exception, in the page's order, goes on; ``done``
        gets the outcomes before it, in order. A dying post (a ``BaseException``: the process is going away, or
        the page is cancelled) cancels the others and leaves the page's open rows to the sweep."""
        outs: list[Outcome] = [] if done is None else done
        for chunk in page_chunks(list(items), PAGE_MAX):
            if len(chunk) == 1:  # nothing to share: the single path itself, with no page to set up
                outs.append(await self.post(chunk[0][0], chunk[0][1], path=path))
                continue
            rows = await self.claim_page(chunk, path=path)
            page = self.page_closes([self.key(p.id) for p, _ in chunk], rows)
            token = PAGE_CLOSES.set(page)  # the page's tasks copy this context: only they defer their closes
            tasks = [asyncio.ensure_future(self.post_claimed(p, t, path=path, claimed=row))
                     for (p, t), row in zip(chunk, rows, strict=True)]
            PAGE_CLOSES.reset(token)
            try:
                await _all_or_dying(tasks)
            except BaseException:  # cancelled, or the process is going away: its open rows are the sweep's
                for t in tasks:
                    t.cancel()
                raise
            errors = [t.exception() for t in tasks]  # each one read: none is left to asyncio's "never retrieved"
            first = next((i for i, e in enumerate(errors) if e is not None), len(tasks))
            fixed = await self._run(self.close_page_steps(page))  # the page's closes: one relaxed commit
            outs += [fixed.get(o.key, o) for o in (t.result() for t in tasks[:first])]
            failed = errors[first] if first < len(errors) else None
            if failed is not None:  # the page stops here: what it sent is closed all the same
                raise failed
        return outs

    async def claim_page(self, items: Sequence[tuple[Parent, str | Compose]], *,
                         path: str = "api") -> list[st.Row | None]:
        """Claim the new keys of ``items`` (at most ``PAGE_MAX``) in one transaction; per item its row or None."""
        steps = self.claim_page_steps([(p, t if isinstance(t, str) else None) for p, t in items], path)
        return cast("list[st.Row | None]", await self._run(steps))

    @metrics.observe_post
    async def post_claimed(self, parent: Parent, text: str | Compose, *, path: str = "api",
                           claimed: st.Row | None = None) -> Outcome:
        """``post`` after ``claim_page`` (``claimed`` None: this post claims alone, as ``post`` does)."""
        await self._slots.enter()
        try:
            return cast(Outcome, await self._run(self.post_steps(parent, text, path=path, claimed=claimed)))
        finally:
            self._slots.leave()

    async def begin(self, parent: Parent, *, owner: str, path: str = "api") -> Lease | Outcome:
        """Claim ``parent``'s key as ``composing`` for ``owner`` (nothing is sent); else say what blocks it."""
        holder = self if self.dry_run or not self.claiming else self._as_holder(owner)
        return cast("Lease | Outcome", await holder._run(holder.begin_steps(parent, owner=owner, path=path)))

    async def finish(self, lease: Lease, text: str) -> Outcome:
        """Post ``text`` under ``lease`` (raises ``LeaseLost``, nothing sent, when it is not held any more)."""
        if not text or not text.strip():
            raise ValueError("text: must not be empty")
        holder = self._as_holder(lease.owner)
        return cast(Outcome, await holder._run(holder.finish_steps(lease, text)))

    async def watch_sends(self) -> int:
        """Push the deadline of every row whose send has run past half its budget; return how many moved."""
        return cast(int, await self._run(self.watch_steps()))

    # -- the seams (Step) ---------------------------------------------------------------------------

    async def _claim(self, key: Key, parent: Parent, path: str, text: str | None) -> st.Row | Outcome:
        """Take the key atomically; return the claimed row, or an Outcome if not ours."""
        return cast("st.Row | Outcome", await self._run(self.claim_steps(key, parent, path, text)))

    async def _open_composed(self, key: Key, row: Reply | st.Row, text: str) -> st.Row | Outcome:
        """Turn our composing claim into a durable open row, unless the lease was lost."""
        return cast("st.Row | Outcome", await self._run(self.open_steps(key, row, text)))

    async def _send(self, key: Key, parent: Parent, row: Reply | st.Row, text: str) -> Outcome:
        """Send an open row's text and record its fate."""
        return cast(Outcome, await self._run(self.send_steps(key, parent, row, text)))

    async def _close(self, key: Key, attempt: int, reply_id: str, kind: str, status: Status = Status.POSTED) -> Outcome:
        """Close our row with the reply id; a lost close is left to the sweep."""
        return cast(Outcome, await self._run(self.close_steps(key, attempt, reply_id, kind, status)))

    # -- the send watch task ----------------------------------------------------------------------

    def _start_watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_loop(), name="replyd-send-watch")

    async def _watch_loop(self) -> None:
        assert self._watch_interval_s is not None
        while True:
            await asyncio.sleep(self._watch_interval_s)
            try:
                await self.watch_sends()
            except Exception as exc:  # the watch must outlive any one failure
                log.error("replyd.guard.watch_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    async def aclose(self) -> None:
        """Stop the send watch (and the store thread this guard started)."""
        self._slots.close()
        self._closing = True
        if self._late:  # a late close under way ends first (one store write each)
            await asyncio.gather(*self._late, return_exceptions=True)
        task, self._watcher = self._watcher, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.hot_path is not None:
            await self.hot_path.aclose()
        if self._own_thread:
            await asyncio.to_thread(self.store_thread.close)


class AsyncGuardSession:
    """One bot's async guard over one store, with the connections it opened (``async with open_guard(...)``)."""

    def __init__(self, guard: AsyncGuard, *, owns_store: bool = True, http: Any = None) -> None:
        self.guard = guard
        self.store = guard.store
        self.platform = guard.platform
        self.identity = guard.identity
        self._owns_store = owns_store
        self._http = http

    async def post(self, parent: str | Parent, text: str | Compose, *, path: str = "library") -> Outcome:
        """Reply to ``parent`` (id, URL or Parent) at most once; ``text`` may be a responder (sync or async)."""
        found = await self._unblocked(parent)
        if isinstance(found, Outcome):
            metrics.outcome(self.platform.instance, found.status.value)
            return found
        return await self.guard.post(found, text, path=path)

    async def _unblocked(self, parent: str | Parent) -> Parent | Outcome:
        """What blocks ``parent`` (read-only, on the id as given), else the parent resolved (on a thread)."""
        if isinstance(parent, Parent):
            return parent
        blocked = await self.guard.check(parent)
        if blocked is not None:
            return blocked
        try:
            return await asyncio.to_thread(self.platform.resolve, parent)
        except PlatformError as exc:
            metrics.platform_error(self.platform.instance, "resolve", exc)
            raise
        except Exception as exc:  # an adapter bug on a read path: report it as an unreadable answer
            metrics.platform_error(self.platform.instance, "resolve", exc)
            raise BadResponse(f"resolve: {type(exc).__name__}") from None

    async def check(self, parent_id: str) -> Outcome | None:
        """Return what blocks a post to ``parent_id`` (read-only), or None if a post would claim it."""
        return await self.guard.check(parent_id)

    async def begin(self, parent: Parent, *, owner: str, path: str = "library") -> Lease | Outcome:
        """Take a compose lease on ``parent`` for ``owner`` (see ``replyd.library.begin``)."""
        return await self.guard.begin(parent, owner=owner, path=path)

    async def finish(self, lease: Lease, text: str) -> Outcome:
        """Post ``text`` under ``lease`` (see ``replyd.library.finish``)."""
        return await self.guard.finish(lease, text)

    async def history(self, parent_id: str) -> list[Event]:
        """Return every event of this bot's key for ``parent_id``."""
        return await self.guard.store_thread.run(self.store.history, self.guard.key(parent_id))

    async def sweep(self, *, on_duplicate: str = "report") -> SweepResult:
        """Bound this bot's due open rows by reading back: the sync sweeper, on a worker thread."""
        g = self.guard
        sweeper = Sweeper(self.store, [Bot(self.platform, self.identity, g.lag)], clock=g.clock, owner=g.owner,
                          max_attempts=g.max_attempts, on_duplicate=on_duplicate)
        return await asyncio.to_thread(sweeper.run_once)

    async def aclose(self) -> None:
        """Release the guard's watch, its store thread, the HTTP clients and the store this session opened."""
        await self.guard.aclose()
        aclose = getattr(self.platform, "aclose", None)  # the AsyncClient an HTTP adapter made for asend
        if aclose is not None:
            await aclose()
        if self._http is not None:
            await asyncio.to_thread(self._http.close)
            self._http = None
        if self._owns_store:
            await asyncio.to_thread(self.store.dispose)

    async def __aenter__(self) -> AsyncGuardSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@asynccontextmanager
async def open_guard(store_url: str | None, platform: str | Platform, settings: Mapping[str, Any] | None = None, *,
                     store_threads: int | None = None, **options: Any) -> AsyncIterator[AsyncGuardSession]:
    """Open the store, log the bot in (all on threads), yield an async session; close it all on exit.

    ``options`` are ``replyd.library.open_guard``'s (``clock``, ``max_attempts``, ``send_timeout_s``,
    ``compose_lease_s``, ``dry_run``, ``migrate``, ``db_clock``); ``store_threads``: how many threads run
    store calls (default 1 on SQLite, its one writer; 4 on PostgreSQL).
    """
    from replyd.library import open_guard as open_sync  # the one place a bot is opened: the sync library's

    if isinstance(platform, LoopBound):
        platform.bind_loop(asyncio.get_running_loop())  # its login (on a thread below) runs on this loop
    session = await asyncio.to_thread(open_sync, store_url, platform, settings, **options)
    sync = session.guard
    threads = store_threads or (1 if session.store.is_sqlite else 4)
    guard = AsyncGuard(session.store, session.platform, session.identity, clock=sync.clock, owner=sync.owner,
                       max_attempts=sync.max_attempts, send_timeout_s=sync.send_timeout_s,
                       compose_lease_s=sync.compose_lease_s, dry_run=sync.dry_run, lag=sync.lag,
                       store_thread=StoreThread(session.store, threads))
    guard._own_thread = True  # the session's guard stops the thread it was given
    out = AsyncGuardSession(guard, http=session._http)
    session._http = None  # the async session closes it
    try:
        yield out
    finally:
        await out.aclose()


async def _all_or_dying(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every task ended; a task that dies (a ``BaseException`` that is not an ``Exception``) cancels the
    others, and its exception is raised once they ended."""
    pending = set(tasks)
    while pending:
        ended, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for t in ended:
            exc = None if t.cancelled() else t.exception()
            if exc is not None and not isinstance(exc, Exception):
                for other in pending:
                    other.cancel()
                if pending:
                    await asyncio.wait(pending)
                raise exc
