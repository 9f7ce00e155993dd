"""Fuzzing the other adapters' parsing (Discourse, GitHub, Bluesky: whichever modules exist).

Each adapter is built from settings (as the daemon does) against a local
server that serves its recorded responses (``shared/fixtures/<platform>``) by
path, with the response of one drawn route replaced by a hypothesis mutation
(see ``tests/fuzz_harness.py``). Every entry point must return a whole value or
raise a ``ReplydError``. The parents given to ``send`` and ``read_back`` come
from the adapter's own parse of the unmutated fixtures where it yields any.
"""

from __future__ import annotations

import importlib.util
import os
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from replyd.clock import FakeClock
from replyd.errors import ReplydError
from replyd.platforms.base import Parent, Pending, make_platform
from tests.fixtures_server import (  # noqa: F401  (pytest fixtures by name)
    FixtureServer,
    fixture_server,
    fixture_server_session,
    fixtures_dir,
    http_client,
)
from tests.conftest import IN_CI
from tests.fuzz_harness import Call, RoutedServer, mutated, one_hostile_item, run_call

# Under CI=true the examples are the same every run (a landing must not hang on a lucky draw); locally they
# are fresh each time, which is how the fuzz keeps finding new mutations (two adapter bugs this way so far).
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=IN_CI)


def _fx(platform: str, name: str) -> bytes:
    return (fixtures_dir(platform) / name).read_bytes()


def _issue(platform: str) -> bytes:
    return json.dumps(json.loads(_fx(platform, "search_issues.json"))["items"][0]).encode()


def _issues(platform: str) -> bytes:
    return json.dumps(json.loads(_fx(platform, "search_issues.json"))["items"]).encode()


def _posts(platform: str) -> bytes:
    return json.dumps({"posts": [json.loads(_fx(platform, "getPostThread.json"))["thread"]["post"]]}).encode()


SESSION = json.dumps({"did": "did:plc:fuzzbotfuzzbotfuzzbot", "handle": "fuzz.bsky.test", "accessJwt": "a.b.c",
                      "refreshJwt": "d.e.f", "active": True}).encode()

SPECS: dict[str, dict[str, Any]] = {
    "discourse": {
        "settings": {"api_key": "k-fuzz-0123456789", "api_username": "bot", "search_queries": ["help"]},
        "url_key": "base_url",
        "routes": lambda: [
            ("GET", r"/u/[^/]+\.json", _fx("discourse", "user.json")),
            ("GET", r"/session/current\.json", _fx("discourse", "user.json")),
            ("GET", r"/notifications\.json", _fx("discourse", "notifications.json")),
            ("GET", r"/search\.json", _fx("discourse", "search.json")),
            ("GET", r"/user_actions\.json", _fx("discourse", "user_actions_replies.json")),
            ("GET", r"/t/[^/]+/posts\.json", _fx("discourse", "topic.json")),
            ("GET", r"/t/[^/]+/\d+\.json", _fx("discourse", "topic.json")),
            ("GET", r"/t/[^/]+\.json", _fx("discourse", "topic.json")),
            ("GET", r"/posts/[^/]+\.json", _fx("discourse", "post_created.json")),
            ("POST", r"/posts\.json", _fx("discourse", "post_created.json")),
        ],
    },
    "github": {
        "settings": {"token": "ghp_fuzz0123456789abcdef", "repos": ["octo/repo"], "search_queries": ["help"]},
        "url_key": "api_url",
        "routes": lambda: [
            ("GET", r"/user", _fx("github", "user.json")),
            ("GET", r"/users/[^/]+", _fx("github", "user.json")),
            ("GET", r"/notifications", _fx("github", "notifications.json")),
            ("GET", r"/search/issues", _fx("github", "search_issues.json")),
            ("GET", r"/repos/[^/]+/[^/]+/issues/comments", _fx("github", "repo_issue_comments.json")),
            ("GET", r"/repos/[^/]+/[^/]+/issues/\d+/comments", _fx("github", "issue_comments.json")),
            ("POST", r"/repos/[^/]+/[^/]+/issues/\d+/comments", _fx("github", "issue_comment_created.json")),
            ("GET", r"/repos/[^/]+/[^/]+/issues/\d+", _issue("github")),
            ("GET", r"/repos/[^/]+/[^/]+/issues", _issues("github")),
            ("GET", r"/repos/[^/]+/[^/]+/pulls/\d+", _issue("github")),
        ],
    },
    "bluesky": {
        "settings": {"identifier": "fuzz.bsky.test", "app_password": "abcd-efgh-ijkl-mnop"},
        "url_key": "service",
        "routes": lambda: [
            ("POST", r"/xrpc/com\.atproto\.server\.createSession", SESSION),
            ("GET", r"/xrpc/com\.atproto\.server\.getSession", SESSION),
            ("GET", r"/xrpc/app\.bsky\.notification\.listNotifications", _fx("bluesky", "listNotifications.json")),
            ("GET", r"/xrpc/app\.bsky\.feed\.searchPosts", _fx("bluesky", "searchPosts.json")),
            ("GET", r"/xrpc/app\.bsky\.feed\.getPostThread", _fx("bluesky", "getPostThread.json")),
            ("GET", r"/xrpc/app\.bsky\.feed\.getPosts", _posts("bluesky")),
            ("GET", r"/xrpc/com\.atproto\.identity\.resolveHandle",
             json.dumps({"did": "did:plc:5ggrdjcno27omroqpqljpqqp"}).encode()),
            ("GET", r"/xrpc/app\.bsky\.feed\.getAuthorFeed", _fx("bluesky", "getAuthorFeed.json")),
            ("POST", r"/xrpc/com\.atproto\.repo\.createRecord", _fx("bluesky", "createRecord.json")),
            ("GET", r"/xrpc/com\.atproto\.repo\.getRecord", _fx("bluesky", "createRecord.json")),
        ],
    },
}
# Matrix's bodies are recorded from the session's real Synapse (test_fuzzed_matrix), not from files.
SPECS["matrix"] = {"settings": {"token": "syt_fuzz_0123456789", "search_queries": ["help"]}, "url_key": "base_url",
                   "routes": None}
PRESENT = [k for k in SPECS if SPECS[k]["routes"] and importlib.util.find_spec(f"replyd.platforms.{k}") is not None]


def build(kind: str, url: str, http: httpx.Client) -> Any:
    spec = SPECS[kind]
    return make_platform(kind, {**spec["settings"], spec["url_key"]: url, "listing_delay_s": 1.0, "timeout_s": 5.0,
                                "max_pages": 2}, http=http, clock=FakeClock(1.8e9))


def sample_parent(kind: str, rs: RoutedServer, url: str, http: httpx.Client) -> Parent:
    """A parent the adapter itself parsed from the unmutated fixtures, else a bare one."""
    rs.override = {}
    plat = build(kind, url, http)
    for fn in (lambda: plat.inbox(None).parents, lambda: plat.search("help", None).parents, lambda: plat.refind(0.0)):
        try:
            got = fn()
        except ReplydError:
            continue
        if got:
            return got[0]
    return Parent(id="1", author_id="2", author_handle="someone")


def calls(parent: Parent) -> list[Call]:
    pend = [Pending(parent=parent, opened_at=1.7e9)]
    ids = {parent.id}
    return [
        Call("whoami", -1, lambda p: p.whoami()),
        Call("inbox", -1, lambda p: p.inbox(None)),
        Call("search", -1, lambda p: p.search("help", None)),
        Call("refind", -1, lambda p: p.refind(0.0)),
        Call("resolve", -1, lambda p: p.resolve(parent.url or parent.id)),
        Call("send", -1, lambda p: p.send(parent, "thanks", provider_key="k-fuzz")),
        Call("read_back", -1, lambda p: p.read_back(pend, sender_id=p.whoami().sender_id), ids),
    ]


@pytest.mark.parametrize("kind", PRESENT)
def test_fuzzed_adapter(kind: str, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Any route mutated, any entry point called: a whole value or a ReplydError."""
    fuzz(kind, RoutedServer(fixture_server, SPECS[kind]["routes"]()), fixture_server, http_client)


def test_fuzzed_matrix(synapse: Any, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The Matrix adapter on bodies recorded from the real Synapse of this session, one route mutated at a time."""
    fuzz("matrix", RoutedServer(fixture_server, matrix_routes(synapse)), fixture_server, http_client)


def matrix_routes(hs: Any, tag: str = "") -> list[tuple[str, str, bytes]]:
    """Record each response the Matrix adapter reads from Synapse, for a fresh bot (named with ``tag``) in one room."""
    bot = hs.register(f"fuzzbot{tag}{os.getpid()}{len(hs.people)}x{id(hs) % 997}")
    alice = hs.people["alice"]
    room = hs.create_room(alice, invite_bot=False)
    hs.api("POST", f"/rooms/{room}/invite", alice, json_body={"user_id": bot.user_id})
    hs.api("POST", f"/rooms/{room}/join", bot, json_body={})
    parent = hs.api("PUT", f"/rooms/{room}/send/m.room.message/fuzz1", alice, json_body={
        "msgtype": "m.text", "body": f"{bot.user_id} help", "m.mentions": {"user_ids": [bot.user_id]}})["event_id"]
    sent = hs.api("PUT", f"/rooms/{room}/send/m.room.message/fuzz2", bot, json_body={
        "msgtype": "m.text", "body": "thanks", "m.relates_to": {"m.in_reply_to": {"event_id": parent}}})
    messages_filter = json.dumps({"types": ["m.room.message"]})
    bodies = {
        "whoami": hs.api("GET", "/account/whoami", bot),
        "sync": hs.api("GET", "/sync", bot, params={"timeout": "0", "filter": json.dumps(
            {"room": {"timeline": {"types": ["m.room.message"], "limit": 10}}})}),
        "search": hs.api("POST", "/search", bot, json_body={"search_categories": {"room_events": {
            "search_term": "help", "keys": ["content.body"], "order_by": "recent"}}}),
        "joined": hs.api("GET", "/joined_rooms", bot),
        "messages": hs.api("GET", f"/rooms/{room}/messages", bot, params={"dir": "b", "filter": messages_filter}),
        "event": hs.api("GET", f"/rooms/{room}/event/{parent}", bot),
    }
    api = r"/_matrix/client/v3"
    return [(m, api + rx, json.dumps(body).encode()) for m, rx, body in [
        ("GET", r"/account/whoami", bodies["whoami"]),
        ("GET", r"/sync", bodies["sync"]),
        ("POST", r"/search", bodies["search"]),
        ("GET", r"/joined_rooms", bodies["joined"]),
        ("GET", r"/rooms/[^/]+/messages", bodies["messages"]),
        ("GET", r"/rooms/[^/]+/event/[^/]+", bodies["event"]),
        ("PUT", r"/rooms/[^/]+/send/m\.room\.message/[^/]+", sent),
    ]]


def fuzz(kind: str, rs: RoutedServer, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Draw entry points and one mutated route at a time; every call returns a whole value or a ReplydError."""
    parent = sample_parent(kind, rs, fixture_server.url, http_client)
    entry = calls(parent)
    reads: dict[str, list[int]] = {}
    for call in entry:  # which routes each entry point reads, so that the mutation lands where it looks
        rs.override, rs.hits = {}, []
        try:
            call.fn(build(kind, fixture_server.url, http_client))
        except ReplydError:
            pass
        reads[call.name] = sorted(set(rs.hits)) or list(range(len(rs.routes)))

    ran: list[str] = []

    @FUZZ
    @given(data=hs.data())
    def check(data) -> None:
        call = data.draw(hs.sampled_from(entry), label="call")
        route = data.draw(hs.sampled_from(reads[call.name]), label="route")
        what, reply = data.draw(mutated(rs.routes[route][2]), label="mutation")
        rs.override = {route: reply}
        rs.served.clear()
        ran.append(what)
        run_call(build(kind, fixture_server.url, http_client), call, rs)

    check()
    assert len(ran) >= 20, ran  # the fuzz really ran
    if os.environ.get("FUZZ_SHOW"):
        print(kind, len(ran), sorted(set(w.split()[0] for w in ran)))


def test_matrix_relation_ignores_ids_that_are_not_strings() -> None:
    """A reply relation whose event id is a list or a number (what the fuzz met in a read-back) is no relation."""
    from replyd.platforms.matrix import _relation

    assert _relation({"m.relates_to": {"m.in_reply_to": {"event_id": []}}}) == (None, None)
    assert _relation({"m.relates_to": {"rel_type": "m.thread", "event_id": 7}}) == (None, None)
    assert _relation({"m.relates_to": {"m.in_reply_to": {"event_id": "$a"}, "rel_type": "m.thread",
                                       "event_id": "$root"}}) == ("$a", "$root")
    assert _relation("not a dict") == (None, None)


# -- one hostile item among good ones ----------------------------------------------------------------------
# How each fake answers the create of a reply: (method, route, the recorded reply made a new one for the request).
CREATES: dict[str, tuple[str, str, Any]] = {
    "discourse": ("POST", r"/posts\.json", lambda rec, body, n: {
        **body, "id": 900_000 + n, "topic_id": rec.form()["topic_id"],
        "reply_to_post_number": rec.form()["reply_to_post_number"]}),
    "github": ("POST", r"/repos/[^/]+/[^/]+/issues/\d+/comments", lambda rec, body, n: {
        **body, "id": 9_000_000_000 + n, "issue_url": "https://api.github.com" + rec.path.removesuffix("/comments")}),
    "bluesky": ("POST", r"/xrpc/com\.atproto\.repo\.createRecord", lambda rec, body, n: {
        **body, "uri": f"at://{rec.form()['repo']}/{rec.form()['collection']}/{rec.form()['rkey']}"}),
    "matrix": ("PUT", r"/_matrix/client/v3/rooms/[^/]+/send/m\.room\.message/[^/]+",
               lambda rec, body, n: {**body, "event_id": f"$fuzzreply{n}"}),
}
# Where each listing keeps its items: (entry point, the route it reads, the path to the item list in its body).
HOSTILE_PAGES: dict[str, list[tuple[str, str, tuple]]] = {
    "discourse": [("inbox", r"/notifications\.json", ("notifications",)), ("search", r"/search\.json", ("posts",)),
                  ("refind", r"/notifications\.json", ("notifications",))],
    "github": [("inbox", r"/notifications", ()), ("search", r"/search/issues", ("items",)),
               ("refind", r"/repos/[^/]+/[^/]+/issues", ())],
    "bluesky": [("inbox", r"/xrpc/app\.bsky\.notification\.listNotifications", ("notifications",)),
                ("search", r"/xrpc/app\.bsky\.feed\.searchPosts", ("posts",)),
                ("refind", r"/xrpc/app\.bsky\.notification\.listNotifications", ("notifications",))],
}
@pytest.mark.parametrize("kind", [k for k in PRESENT if k in HOSTILE_PAGES])
def test_one_hostile_item_never_costs_the_good_ones(kind: str, fixture_server: FixtureServer,
                                                    http_client: httpx.Client) -> None:
    """A page with one item of an unexpected shape: the listing returns, with every parent the page had, and
    each of them is answered through the guard, one create each on the fake."""
    one_hostile_item(SPECS[kind]["routes"](), HOSTILE_PAGES[kind], fixture_server,
                     lambda: build(kind, fixture_server.url, http_client), send=CREATES[kind])


def test_matrix_one_hostile_item_never_costs_the_good_ones(synapse: Any, fixture_server: FixtureServer,
                                                           http_client: httpx.Client) -> None:
    """Matrix's sync timeline, search results and room messages, each with one hostile event among good ones: the
    good ones answered through the guard, one event sent each on the fake."""
    routes = matrix_routes(synapse, "hostile")
    sync = json.loads(next(body for _, rx, body in routes if rx.endswith("/sync")))
    room = next(iter(sync["rooms"]["join"]))
    api = r"/_matrix/client/v3"
    one_hostile_item(routes, [("inbox", api + r"/sync", ("rooms", "join", room, "timeline", "events")),
                              ("search", api + r"/search", ("search_categories", "room_events", "results")),
                              ("refind", api + r"/rooms/[^/]+/messages", ("chunk",))],
                     fixture_server, lambda: build("matrix", fixture_server.url, http_client), send=CREATES["matrix"])
