"""Fuzzing the Mastodon adapter's parsing with mutated recorded responses over real local HTTP.

See ``tests/fuzz_harness.py`` for the mutations and what a call may do. Also
end to end: a fuzzed inbox page offered through the real pollers, pipeline and
guard never makes the guard send to a parent that was not whole.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from replyd.clock import FakeClock
from replyd.config import PollerConfig
from replyd.guard import Guard
from replyd.pipeline import Pipeline
from replyd.platforms.base import Parent, Pending
from replyd.platforms.mastodon import MastodonPlatform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.store import Store
from tests.fixtures_server import (  # noqa: F401  (pytest fixtures by name)
    FixtureServer,
    fixture_server,
    fixture_server_session,
    http_client,
    load_fixture,
)
from tests.fuzz_harness import Call, RoutedServer, mutated, one_hostile_item, run_call

SENDER = "117020565966271181"
CTX_PARENT = "110446983926957470"
REPLY_PARENT = "117020583245459824"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def fx(name: str) -> bytes:
    return load_fixture("mastodon", name)


def routes() -> list[tuple[str, str, bytes]]:
    return [
        ("GET", r"/api/v1/accounts/verify_credentials", fx("verify_credentials.json")),
        ("GET", r"/api/v1/notifications", fx("notifications_mention.json")),
        ("GET", r"/api/v2/search", fx("search_v2.json")),
        ("GET", r"/api/v1/accounts/[^/]+/statuses", fx("account_statuses.json")),
        ("GET", r"/api/v1/statuses/[^/]+/context", fx("status_context.json")),
        ("GET", r"/api/v1/statuses/[^/]+", fx("status_post_reply.json")),
        ("POST", r"/api/v1/statuses", fx("status_post_reply.json")),
    ]


def calls() -> list[Call]:
    parent = Parent(id=REPLY_PARENT, author_id="1", author_handle="alice", extra={"acct": "alice", "visibility": "public"})
    pend = [Pending(parent=Parent(id=CTX_PARENT, author_id="9"), opened_at=1.0e9),
            Pending(parent=Parent(id="117020580489281910", author_id="9"), opened_at=1.0e9)]
    return [
        Call("whoami", 0, lambda p: p.whoami()),
        Call("inbox", 1, lambda p: p.inbox(None)),
        Call("inbox_cursor", 1, lambda p: p.inbox("1")),
        Call("refind", 1, lambda p: p.refind(0.0)),
        Call("search", 2, lambda p: p.search("help", None)),
        Call("resolve", 5, lambda p: p.resolve("117020583258292382")),
        Call("send", 6, lambda p: p.send(parent, "thanks", provider_key="k-1")),
        Call("read_back_feed", 3, lambda p: p.read_back(pend, sender_id=SENDER), {x.parent.id for x in pend}),
        Call("read_back_context", 4, lambda p: p.read_back(pend, sender_id="43"), {x.parent.id for x in pend}),
    ]


def make(url: str, http: httpx.Client) -> MastodonPlatform:
    return MastodonPlatform(base_url=url, token="tok-fuzz-SECRET-0123456789", http=http, clock=FakeClock(1.8e9),
                            timeout_s=5.0, max_pages=3)


def test_unmutated_fixtures_parse(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Baseline: every call succeeds on the recorded bodies (so a fuzz error is the mutation's doing)."""
    rs = RoutedServer(fixture_server, routes())
    for call in calls():
        outcome, value = run_call(make(fixture_server.url, http_client), call, rs)
        assert outcome == "ok", (call.name, value)


@pytest.mark.parametrize("call", calls(), ids=lambda c: c.name)
def test_fuzzed_response(call: Call, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A mutated response gives a whole result or a replyd error, never another exception or a half parent."""
    rs = RoutedServer(fixture_server, routes())
    raw = rs.routes[call.route][2]

    ran: list[str] = []

    @FUZZ
    @given(m=mutated(raw))
    def check(m) -> None:
        what, reply = m
        rs.override = {call.route: reply}
        rs.served.clear()
        ran.append(what)
        run_call(make(fixture_server.url, http_client), call, rs)

    check()
    assert len(ran) >= 20, ran  # the fuzz really ran


@FUZZ
@given(m=mutated(load_fixture("mastodon", "notifications_mention.json")))
def test_fuzzed_inbox_never_sends_to_a_half_parsed_parent(m, fixture_server_session: FixtureServer, tmp_path_factory) -> None:
    """Pollers -> pipeline -> guard on a fuzzed inbox page: no crash, and a send only for a whole parent."""
    what, reply = m
    rs = RoutedServer(fixture_server_session, routes())
    rs.override = {1: reply}
    db = tmp_path_factory.mktemp("fuzz") / "r.sqlite3"
    store = Store.open(f"sqlite:///{db}")
    sent_to: list[str] = []
    with httpx.Client(trust_env=False) as http:
        plat = make(fixture_server_session.url, http)
        real_send = plat.send

        def send(parent: Parent, text: str, *, provider_key: str):
            from tests.fuzz_harness import check_parent

            check_parent(parent, rs.served)
            sent_to.append(parent.id)
            return real_send(parent, text, provider_key=provider_key)

        plat.send = send  # type: ignore[method-assign]
        me = plat.whoami()
        guard = Guard(store, plat, me, send_timeout_s=5.0)
        pipe = Pipeline(guard, lambda p: "thanks", Policy(skip_bots=False), guard.clock)
        pollers = Pollers(store, plat, pipe, PollerConfig(), guard.clock)
        pollers.inbox()  # must not raise: every failure is logged and retried on the next poll
        pollers.refind()
    store.dispose()
    assert len(sent_to) == len(set(sent_to))


def test_one_hostile_item_never_costs_the_good_ones(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A notification or search page with one item of an unexpected shape: every good parent still returned, and
    answered through the guard, one status created each on the fake."""
    one_hostile_item(routes(), [("inbox", r"/api/v1/notifications", ()), ("refind", r"/api/v1/notifications", ()),
                                ("search", r"/api/v2/search", ("statuses",))],
                     fixture_server, lambda: make(fixture_server.url, http_client),
                     send=("POST", r"/api/v1/statuses", lambda rec, body, n: {
                         **body, "id": str(117_020_583_258_300_000 + n), "in_reply_to_id": rec.form()["in_reply_to_id"]}))
