"""The HTTP adapters' send on ``httpx.AsyncClient`` (``platforms._http.StepSend.asend``) under the asyncio face.

One send written as steps, two drivers: here the async driver is shown to run on the loop (no worker thread,
no blocking client), to keep one reply per parent against the sim losing 20 % of create answers, to end by
the whole-send deadline against servers that stall or trickle (ambiguous, never "not sent"), and to map every
failure exactly as the sync driver does (the same table, the same cases, both drivers).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from replyd import aio, deadline
from replyd import store as st
from replyd.clock import FakeClock
from replyd.errors import DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.guard import Status
from replyd.platforms import _http
from replyd.platforms.base import AsyncSend, Identity, Parent, make_platform, platform_class, registered_kinds
from replyd.platforms.mastodon import MastodonPlatform
from replyd.sim import SimServer, World
from tests.fixtures_server import FixtureServer, Reply, closed_port_url, html_error, load_fixture
from tests.fixtures_server import fixture_server, fixture_server_session, http_client  # noqa: F401  (fixtures)
from tests.test_aio import BOT_TOKEN, bot_replies, parents_on, start_sim
from tests.test_state_holes import Trickle

STATUSES = "/api/v1/statuses"
SEND_TIMEOUT_S = 10.0


# -- who made each request: the transport spy ------------------------------------------------------------


class Spy:
    """Records every request httpx's transports make: (transport, method, path, thread id)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, str, str, int]] = []
        sync_send, async_send = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request

        def on_sync(transport: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
            self.seen.append(("sync", request.method, request.url.path, threading.get_ident()))
            return sync_send(transport, request)

        async def on_async(transport: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
            self.seen.append(("async", request.method, request.url.path, threading.get_ident()))
            return await async_send(transport, request)

        monkeypatch.setattr(httpx.HTTPTransport, "handle_request", on_sync)
        monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", on_async)

    def creates(self) -> list[tuple[str, int]]:
        """(transport, thread id) of every status create."""
        return [(kind, tid) for kind, method, path, tid in self.seen if method == "POST" and path == STATUSES]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """A transport spy for this test."""
    return Spy(monkeypatch)


# -- the user path: open_guard on Mastodon (the sim) sends on the AsyncClient, on the loop ---------------


def test_open_guard_sends_through_the_async_client_on_the_loop(tmp_path, spy: Spy) -> None:
    """``aio.open_guard(url, "mastodon", settings)``: every create leaves through ``httpx.AsyncClient`` on the
    loop's own thread (no worker thread, no blocking client), five paths at once give one reply, and the
    session closes the client it made."""
    world = World(listing_delay_s=0.0)
    bot = world.add_account("replybot", bot=True)
    world.add_account("alice")

    async def main(base_url: str) -> tuple[int, list[Any], MastodonPlatform]:
        parents = [world.post("alice", f"@replybot question {i}") for i in range(4)]
        settings = {"base_url": base_url, "token": bot.token, "listing_delay_s": 0.5}
        async with aio.open_guard(f"sqlite:///{tmp_path}/r.sqlite3", "mastodon", settings) as g:
            assert isinstance(g.platform, AsyncSend)
            outs = await asyncio.gather(*(g.post(p.id, "hello") for p in parents for _ in range(5)))
            return threading.get_ident(), outs, g.platform  # type: ignore[return-value]

    with SimServer(world) as sim:
        loop_thread, outs, platform = asyncio.run(main(sim.base_url))
    assert sum(o.status is Status.POSTED for o in outs) == 4, [o.status for o in outs]
    assert all(world.replies_by(bot.id)[p] == 1 for p in world.replies_by(bot.id)), world.replies_by(bot.id)
    assert spy.creates() == [("async", loop_thread)] * 4
    assert platform._aclient_mine is None  # closed with the session


def test_the_adapters_async_client_is_built_off_the_loop(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new ``AsyncClient`` loads the CA bundle into an SSL context (~20 ms): the first sends of a loop build it on
    a thread, never on the loop's, and eight first sends at once build it once."""
    built: list[tuple[int, httpx.AsyncClient]] = []
    make = _http.make_async_client

    def spying(*a: Any, **kw: Any) -> httpx.AsyncClient:
        time.sleep(0.05)  # widen the window in which the first sends race
        client = make(*a, **kw)
        built.append((threading.get_ident(), client))
        return client

    monkeypatch.setattr(_http, "make_async_client", spying)
    world = World(listing_delay_s=0.0)
    bot = world.add_account("replybot", bot=True)
    world.add_account("alice")

    async def main(base_url: str) -> tuple[int, Any, list[Any]]:
        parents = [world.post("alice", f"@replybot question {i}") for i in range(8)]
        settings = {"base_url": base_url, "token": bot.token, "listing_delay_s": 0.5}
        async with aio.open_guard(f"sqlite:///{tmp_path}/r.sqlite3", "mastodon", settings) as g:
            outs = await asyncio.gather(*(g.post(p.id, "hello") for p in parents))
            assert all(o.status is Status.POSTED for o in outs), outs
            open_now = [c for _t, c in built if not c.is_closed]
            return threading.get_ident(), g.platform._aclient_mine[0].result(), open_now  # type: ignore[attr-defined]

    with SimServer(world) as sim:
        loop_thread, in_use, open_now = asyncio.run(main(sim.base_url))
    assert built and all(tid != loop_thread for tid, _c in built), built
    assert [c for _t, c in built] == open_now == [in_use]


def test_concurrent_async_client_posts_with_lost_answers_one_reply_each(store_url: str, spy: Spy) -> None:
    """Mastodon on the sim losing 20 % of create answers (after creating), through the asyncio face on the
    adapter's AsyncClient: 300 parents, each posted once plus 3 rival posts from other tasks, then swept and
    offered again until every row is closed: one reply per parent counted on the sim, every create on the loop."""
    n = 300
    with start_sim("--lost-drop-rate", "0.2", "--seed", "131") as sim:
        parents = parents_on(sim, n)

        async def run() -> tuple[int, dict[str, int]]:
            settings = {"base_url": sim.base_url, "token": BOT_TOKEN, "listing_delay_s": 0.5}
            async with aio.open_guard(store_url, "mastodon", settings, send_timeout_s=SEND_TIMEOUT_S) as g:
                calls = [g.post(p, f"answer to {p.id}") for p in parents]
                calls += [g.post(p, "rival") for p in parents for _ in range(3)]
                random.Random(131).shuffle(calls)
                await asyncio.gather(*calls)
                return threading.get_ident(), await settle(g, parents)

        loop_thread, states = asyncio.run(run())
        counts = bot_replies(sim)
        report = sim.report()
    assert report["faults_injected"].get("lost_drop", 0) >= n // 10, report["faults_injected"]
    assert [p.id for p in parents if counts.get(p.id) != 1] == [], "parents without exactly one reply"
    assert report["duplicates"] == 0
    assert states.get(st.CLOSED) == n, states
    creates = spy.creates()
    assert len(creates) >= n and set(creates) == {("async", loop_thread)}, set(creates)


async def settle(g: aio.AsyncGuardSession, parents: list[Parent], rounds: int = 6) -> Counter[str]:
    """The daemon's way on, a few rounds at most: once every open row is past its deadline, sweep, and offer
    again the parents whose row is not closed yet; the rows' states at the end."""
    states: Counter[str] = Counter()
    for _ in range(rounds):
        await asyncio.sleep(SEND_TIMEOUT_S + 0.7)
        await g.sweep()
        rows = [await g.guard.store_thread.run(g.store.get, g.guard.key(p.id)) for p in parents]
        states = Counter(row.state for row in rows)
        unsettled = [p for p, row in zip(parents, rows, strict=True) if row.state != st.CLOSED]
        if not unsettled:
            break
        await asyncio.gather(*(g.post(p, f"answer to {p.id}", path="refind") for p in unsettled))
    return states


# -- the whole-send deadline on the async driver --------------------------------------------------------


class Silent(Trickle):
    """A raw HTTP server that reads one request and never answers (the request left: outcome unknown)."""

    def __init__(self) -> None:
        self.got = threading.Event()
        super().__init__()

    def _serve(self) -> None:
        try:
            self.conn, _ = self.sock.accept()
            self.conn.recv(65536)
        except OSError:
            return  # closed before any request: what the deadline-gone test expects
        self.got.set()

    def close(self) -> None:
        """Stop listening and drop the connection."""
        for c in (self.sock, getattr(self, "conn", None)):
            if c is not None:
                c.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    """A server that never answers."""
    srv = Silent()
    yield srv
    srv.close()


def mastodon_at(url: str, http: httpx.Client, **settings: Any) -> MastodonPlatform:
    """A Mastodon adapter for ``url`` (a per-request timeout far above the deadlines these tests set)."""
    return make_platform("mastodon", {"base_url": url, "token": "tok-SECRET-deadline", "timeout_s": 20.0,
                                      "idempotency": False, "listing_delay_s": 5.0, **settings},
                         http=http, clock=FakeClock())


@pytest.mark.parametrize("server", ["silent", "trickle"])
def test_asend_ends_by_the_whole_send_deadline(server: str, request: pytest.FixtureRequest,
                                               http_client: httpx.Client) -> None:
    """``asend`` under ``deadline.within(1)`` (no face around it, per-request timeout 20 s) against a server that
    never answers, or one that trickles 102 lines under the read timeout and answers at 3 s: it ends by the
    deadline as ``MaybeSent`` (the request left), and the trickling server's 200 never reached it."""
    port = request.getfixturevalue("silent").port if server == "silent" else (trickle := Trickle()).port
    plat = mastodon_at(f"http://127.0.0.1:{port}", http_client)

    async def send() -> float:
        t0 = time.monotonic()
        with deadline.within(1.0), pytest.raises(MaybeSent) as err:
            await plat.asend(Parent(id="1", author_id="a"), "hi", provider_key="k")
        assert "deadline" in err.value.detail or "ReadTimeout" in err.value.detail, err.value.detail
        assert "tok-SECRET" not in err.value.detail
        await plat.aclose()
        return time.monotonic() - t0

    took = asyncio.run(send())
    assert took < 1.5, f"asend took {took:.2f} s past a 1 s deadline"
    if server == "trickle":
        assert not trickle.answered.is_set()


def test_async_face_post_to_a_stalling_server_is_uncertain(store: st.Store, clock: FakeClock,
                                                           silent: Silent, http_client: httpx.Client) -> None:
    """Through the asyncio face with ``send_timeout_s = 1``: a create the server swallows is ``uncertain``
    (the row stays open for the sweep), never "not sent", and the post returns by the deadline."""
    plat = mastodon_at(f"http://127.0.0.1:{silent.port}", http_client)

    async def post() -> tuple[Any, float, st.Key]:
        g = aio.AsyncGuard(store, plat, Identity(sender_id="7", handle="bot"), clock=clock, send_timeout_s=1.0,
                           watch_interval_s=None)
        t0 = time.monotonic()
        try:
            return await g.post(Parent(id="1", author_id="a"), "hi"), time.monotonic() - t0, g.key("1")
        finally:
            await g.aclose()
            await plat.aclose()

    out, took, key = asyncio.run(post())
    assert out.status is Status.UNCERTAIN, out
    assert silent.got.is_set() and took < 2.5, took
    assert store.get(key).state == st.OPEN


def test_a_deadline_gone_before_the_request_is_not_sent(silent: Silent, http_client: httpx.Client) -> None:
    """A budget spent before the exchange starts: the async driver sends nothing (``DefinitelyNotSent``)."""
    plat = mastodon_at(f"http://127.0.0.1:{silent.port}", http_client)

    async def send() -> None:
        with deadline.within(-1.0), pytest.raises(DefinitelyNotSent):
            await plat.asend(Parent(id="1", author_id="a"), "hi", provider_key="k")
        await plat.aclose()

    asyncio.run(send())
    time.sleep(0.1)
    assert not silent.got.is_set()


# -- the error table: one table, both drivers ---------------------------------------------------------------


def fx(name: str) -> bytes:
    """A recorded Mastodon body."""
    return load_fixture("mastodon", name)


# Each case: what the server answers to the create, the error the send must raise (class, status).
CASES: dict[str, tuple[Reply | str, type[PlatformError], int | None]] = {
    "500": (Reply(status=500, body={"error": "We're sorry"}), MaybeSent, 500),
    "502-html": (html_error(502), MaybeSent, 502),
    "504": (Reply(status=504, body=b"upstream timed out", content_type="text/plain"), MaybeSent, 504),
    "429": (Reply(status=429, body={"error": "Too many requests"}, headers={"retry-after": "7"}), RateLimited, 429),
    "401": (Reply(status=401, body={"error": "The access token is invalid"}), DefinitelyNotSent, 401),
    "403": (Reply(status=403, body={"error": "forbidden"}), DefinitelyNotSent, 403),
    "408": (Reply(status=408, body={"error": "timeout"}), DefinitelyNotSent, 408),
    "404": (Reply(status=404, body={"error": "Record not found"}), Rejected, 404),
    "422": (Reply(status=422, body={"error": "Validation failed"}), Rejected, 422),
    "302": (Reply(status=302, headers={"location": "/elsewhere"}), MaybeSent, 302),
    "drop-mid-body": (Reply(fault="drop"), MaybeSent, None),
    "read-timeout": (Reply(body=fx("status_post_reply.json"), delay_s=2.0), MaybeSent, None),
    "garbled-2xx": (Reply(body=b'{"id": '), MaybeSent, 200),
    "no-id-2xx": (Reply(body={"url": "x"}), MaybeSent, 200),
    "oversize-2xx": (Reply(body=b"x" * (_http.MAX_RESPONSE_BYTES + 1), content_type="text/plain"), MaybeSent, 200),
    "refused": ("refused", DefinitelyNotSent, None),
    "dns": ("dns", DefinitelyNotSent, None),
}


def send_by(driver: str, plat: MastodonPlatform) -> PlatformError:
    """The error one send of ``plat`` raises, driven by ``driver`` (``send`` in this thread, or ``asend`` on a
    loop through an ``httpx.AsyncClient``)."""
    parent = Parent(id="117020583245459824", author_id="a", extra={"acct": "alice"})
    try:
        if driver == "sync":
            plat.send(parent, "hi", provider_key="k")
        else:
            async def run() -> None:
                async with httpx.AsyncClient(trust_env=False) as c:
                    plat._aclient = c
                    await plat.asend(parent, "hi", provider_key="k")

            asyncio.run(run())
    except PlatformError as exc:
        return exc
    raise AssertionError(f"{driver}: the send succeeded")


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_error_table_is_one_for_both_drivers(case: str, driver: str, fixture_server: FixtureServer,
                                             http_client: httpx.Client) -> None:
    """Every failure of a create maps by the module table to the same error on the sync and the async driver:
    transport errors (refused, DNS, a cut body, a read timeout), every status class, unreadable and oversize
    2xx bodies; no secret in a detail."""
    answer, cls, status = CASES[case]
    if answer == "refused":
        url = closed_port_url()
    elif answer == "dns":
        url = "http://replyd-test.invalid"
    else:
        url = fixture_server.url
        fixture_server.route("POST", STATUSES, answer)
    plat = MastodonPlatform.from_settings({"base_url": url, "token": "tok-SECRET-table", "timeout_s": 0.5,
                                           "allow_insecure_http": True}, http=http_client, clock=FakeClock())
    err = send_by(driver, plat)
    assert type(err) is cls, f"{driver}: {type(err).__name__}: {err.detail}"
    assert err.status == status, err.detail
    assert err.detail.startswith("send") and "tok-SECRET" not in err.detail
    if cls is RateLimited:
        assert err.retry_after_s == 7.0
    if case == "read-timeout":
        assert "ReadTimeout" in err.detail


# -- no blocking request on the loop ---------------------------------------------------------------------


def test_a_blocking_request_inside_async_steps_is_refused(http_client: httpx.Client) -> None:
    """Steps driven on the loop that make a blocking request (a sync ``_call`` inside ``_send_steps``) fail at
    once rather than stall the event loop; the same steps driven in a thread make it."""
    plat = mastodon_at("http://127.0.0.1:9", http_client)

    def steps() -> _http.HttpSteps[str]:
        plat._call("GET", "/api/v1/accounts/verify_credentials", what="whoami")
        return (yield from ())  # pragma: no cover

    async def run() -> None:
        async with httpx.AsyncClient() as c:
            with pytest.raises(RuntimeError, match="blocking HTTP request"):
                await _http.run_async(c, steps())

    asyncio.run(run())
    with pytest.raises(DefinitelyNotSent):  # in a thread the request is made (nothing listens on port 9)
        _http.run_sync(http_client, steps())


def test_adapters_that_send_through_steps_offer_asend() -> None:
    """Which HTTP adapters' send is steps (``asend`` on an AsyncClient) and which stay on a worker thread."""
    native = {kind for kind in registered_kinds() if issubclass(platform_class(kind), _http.StepSend)}
    assert native == {"mastodon", "discourse", "github", "matrix", "whatsapp"}
    assert {"slack", "discord", "telegram", "bluesky", "email"} <= set(registered_kinds()) - native
