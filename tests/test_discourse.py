"""The Discourse adapter over real local HTTP: recorded bodies, error mapping, paging, and a stateful fake forum."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from replyd.clock import FakeClock
from replyd.errors import (
    BadResponse,
    DefinitelyNotSent,
    MaybeSent,
    PlatformError,
    RateLimited,
    Rejected,
)
from replyd.guard import Guard, Status
from replyd.platforms.base import Identity, Parent, Pending, Platform, Sent
from replyd.platforms import _http
from replyd.platforms.discourse import DiscoursePlatform
from replyd.sweep import Bot, Sweeper
from tests.fakes_forum import (  # noqa: F401  (pytest finds the fixtures by name)
    FakeDiscourse,
    FakeHost,
    fresh_store,
    injection_pings_only_the_author,
    iso_ms,
    nodelay_fixture_server_session,
    shared_tls_http_client,
    edit_and_sweep,
    store_template,
    walk_edit_faults,
)
from tests.fixtures_server import (  # noqa: F401  (pytest finds the fixtures by name)
    FixtureServer,
    Recorded,
    Reply,
    closed_port_url,
    fixture_server,
    html_error,
    load_fixture,
)

KEY = "disc-key-SECRET-0011223344556677"
USER = "discourse1"


def fx(name: str) -> bytes:
    """A recorded Discourse body, byte for byte."""
    return load_fixture("discourse", name)


def fxj(name: str) -> Any:
    """A recorded Discourse body, parsed."""
    return json.loads(fx(name))


def make(url: str, http: httpx.Client, clock: FakeClock | None = None, **settings: Any) -> DiscoursePlatform:
    """An adapter for ``url`` with the test key."""
    base = {"base_url": url, "api_key": KEY, "api_username": USER}
    return DiscoursePlatform.from_settings({**base, **settings}, http=http, clock=clock or FakeClock())


def post_body(pid: int, topic_id: int, number: int, user_id: int = 5, username: str = "alice", **changes: Any) -> dict[str, Any]:
    """A post as /posts/{id}.json serves it, cloned from the recorded post_created.json."""
    body = fxj("post_created.json")
    body.update(
        id=pid, topic_id=topic_id, post_number=number, user_id=user_id, username=username,
        topic_slug=f"topic-{topic_id}", raw=f"post {pid}", **changes,
    )
    return body


def parent(pid: str = "19152", topic_id: int = 1148, number: int = 3) -> Parent:
    """A parent as inbox would return it."""
    return Parent(id=pid, author_id="3428", extra={"topic_id": topic_id, "post_number": number})


def notification(nid: int, ntype: int, topic_id: int, number: int, post_id: int, created: str) -> dict[str, Any]:
    """A notification cloned from the recorded private-message one."""
    item = copy.deepcopy(fxj("notifications.json")["notifications"][1])
    item.update(id=nid, notification_type=ntype, topic_id=topic_id, post_number=number, created_at=created)
    item["data"]["original_post_id"] = post_id
    return item


class NotificationFeed:
    """Serves /notifications.json like Discourse: newest first, ``offset`` paging, ``load_more_notifications``."""

    def __init__(self, items: list[dict[str, Any]], page: int) -> None:
        self.items = sorted(items, key=lambda i: i["id"], reverse=True)
        self.page = page

    def __call__(self, rec: Recorded) -> Reply:
        offset = int(rec.param("offset") or 0)
        return Reply(body={
            "notifications": self.items[offset : offset + self.page],
            "total_rows_notifications": len(self.items),
            "seen_notification_id": self.items[0]["id"] if self.items else None,
            "load_more_notifications": f"/notifications?offset={offset + self.page}&username={USER}",
        })


def posts_by_id(bodies: dict[int, dict[str, Any]]):
    """Route handler factory: /posts/{id}.json answers from ``bodies``."""

    def handler(rec: Recorded) -> Reply:
        pid = int(rec.path.rsplit("/", 1)[1].split(".")[0])
        return Reply(body=bodies[pid]) if pid in bodies else Reply(status=404, body={"errors": ["not found"], "error_type": "not_found"})

    return handler


def route_posts(server: FixtureServer, bodies: dict[int, dict[str, Any]]) -> None:
    """Serve each body at its /posts/{id}.json."""
    for pid, body in bodies.items():
        server.route("GET", f"/posts/{pid}.json", Reply(body=body))


# --- settings and registration ------------------------------------------------------------


def test_settings_defaults_and_instance(http_client: httpx.Client) -> None:
    """from_settings fills the documented defaults and derives the instance from base_url."""
    p = make("https://forum.example/", http_client)
    assert p.instance == "discourse:https://forum.example"
    assert p.listing_delay_s == 30.0
    assert p.kind == "discourse" and isinstance(p, Platform)
    assert p.search_queries == ()
    q = make("https://forum.example", http_client, instance="discourse:prod", listing_delay_s=5, search_queries=["bot help"])
    assert (q.instance, q.listing_delay_s, q.search_queries) == ("discourse:prod", 5.0, ("bot help",))
    u = DiscoursePlatform.from_settings(
        {"base_url": "https://forum.example", "user_api_key": KEY}, http=http_client, clock=FakeClock()
    )
    assert u.instance == "discourse:https://forum.example"


# --- every recorded fixture parses -----------------------------------------------------------


def test_user_fixture_whoami(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """whoami reads /u/{username}.json (recorded) and returns user.id as a string, sending both key headers."""
    fixture_server.route("GET", f"/u/{USER}.json", Reply(body=fx("user.json")))
    assert make(fixture_server.url, http_client).whoami() == Identity(sender_id="1", handle="discourse1")
    rec = fixture_server.requests[-1]
    assert (rec.headers["api-key"], rec.headers["api-username"]) == (KEY, USER)


def test_user_api_key_whoami_uses_session_current(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a User API key, whoami reads /session/current.json and sends only User-Api-Key."""
    user = fxj("user.json")["user"]
    fixture_server.route("GET", "/session/current.json", Reply(body={"current_user": user}))
    p = DiscoursePlatform.from_settings({"base_url": fixture_server.url, "user_api_key": KEY}, http=http_client, clock=FakeClock())
    assert p.whoami() == Identity(sender_id="1", handle="discourse1")
    rec = fixture_server.requests[-1]
    assert rec.headers["user-api-key"] == KEY and "api-key" not in rec.headers


def test_notifications_fixture_inbox(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded notifications: the badge (12) is passed over, the PM (6) resolves via data.original_post_id."""
    fixture_server.route("GET", "/notifications.json", Reply(body=fx("notifications.json")))
    route_posts(fixture_server, {14: post_body(14, 10, 1, user_id=-2, username="discobot")})
    page = make(fixture_server.url, http_client).inbox(None)
    [p] = page.parents
    assert (p.id, p.author_id, p.author_handle, p.author_is_bot) == ("14", "-2", "discobot", True)
    assert p.extra["topic_id"] == 10 and p.extra["post_number"] == 1 and p.extra["private_message"] is True
    assert page.cursor == "3"  # the newest notification, even though it was not a parent
    assert [r.path for r in fixture_server.requests] == ["/notifications.json", "/posts/14.json"]


def test_a_mangled_copy_of_a_notification_never_hides_the_good_one(fixture_server: FixtureServer,
                                                                    http_client: httpx.Client) -> None:
    """The recorded PM notification served twice, its second copy without ``notification_type`` (one hostile item
    of the fuzz): the copy is reported and the good one still offered. Before, the page kept the last item of
    each id and the post was lost."""
    body = fxj("notifications.json")
    mangled = {k: v for k, v in body["notifications"][1].items() if k != "notification_type"}
    body["notifications"].append(mangled)
    fixture_server.route("GET", "/notifications.json", Reply(body=body))
    route_posts(fixture_server, {14: post_body(14, 10, 1, user_id=-2, username="discobot")})
    with capture_logs() as logs:
        page = make(fixture_server.url, http_client).inbox(None)
    assert [p.id for p in page.parents] == ["14"] and page.cursor == "3"
    assert [e["item_id"] for e in logs if e["event"] == "replyd.poller.unreadable"] == ["2"]


def test_post_created_fixture_send(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """send posts topic_id + reply_to_post_number + raw as JSON and returns the recorded post's id."""
    fixture_server.route("POST", "/posts.json", Reply(body=fx("post_created.json")))
    with capture_logs() as logs:
        sent = make(fixture_server.url, http_client).send(parent("27", 21, 1), "hello", provider_key="k")
    assert sent == Sent(reply_id="29", url="")
    rec = fixture_server.requests[-1]
    assert rec.form() == {"topic_id": 21, "reply_to_post_number": 1, "raw": "hello"}
    # The recorded body created a topic (reply_to_post_number null): the post exists, so it is Sent, loudly.
    assert any(e["event"] == "replyd.discourse.reply_fields_differ" for e in logs)


def test_search_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded search hit is resolved through /posts/{id}.json for its author; order:latest is added."""
    fixture_server.route("GET", "/search.json", Reply(body=fx("search.json")))
    route_posts(fixture_server, {16: post_body(16, 13, 1, user_id=1, username="discourse1")})
    page = make(fixture_server.url, http_client).search("ecf65fcd", None)
    [p] = page.parents
    assert (p.id, p.author_id, page.cursor) == ("16", "1", "16")
    assert fixture_server.requests[0].param("q") == "ecf65fcd order:latest"
    again = make(fixture_server.url, http_client).search("ecf65fcd", "16")
    assert again.parents == [] and again.cursor == "16"


def test_topic_fixture_read_back_and_resolve(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded topic: with user_actions failing, the topic read finds the own reply (post 4 answers post 3)."""
    fixture_server.route("GET", "/user_actions.json", Reply(status=500, body={"errors": ["boom"]}))
    fixture_server.route("GET", "/t/1148.json", Reply(body=fx("topic.json")))
    rb = make(fixture_server.url, http_client).read_back([Pending(parent(), opened_at=1_450_000_000.0)], sender_id="2544")
    assert [r.reply_id for r in rb.found["19152"]] == ["19162"]
    assert rb.checked == {"19152"}
    # The recorded stream lists ids 1..22, none above the parent's id: nothing more is fetched.
    assert not fixture_server.requests_to("GET", "/t/1148/posts.json")
    fixture_server.route("GET", "/t/1148/4.json", Reply(body=fx("topic.json")))
    got = make(fixture_server.url, http_client).resolve(f"{fixture_server.url}/t/support-ublock-origin/1148/4")
    assert (got.id, got.author_id, got.extra["reply_to_post_number"], got.thread_depth) == ("19162", "2544", 3, 1)
    assert got.url == f"{fixture_server.url}/t/support-ublock-origin/1148/4"


def test_user_actions_fixture_read_back(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded user_actions entry (post 48 answering post 2 of topic 39) closes that parent; a short page is the end."""
    fixture_server.route("GET", "/user_actions.json", Reply(body=fx("user_actions_replies.json")))
    pending = [Pending(parent("47", 39, 2), opened_at=1_467_000_000.0), Pending(parent("50", 39, 3), opened_at=1_467_000_000.0)]
    rb = make(fixture_server.url, http_client).read_back(pending, sender_id="11")
    assert {k: [r.reply_id for r in v] for k, v in rb.found.items()} == {"47": ["48"]}
    assert rb.checked == {"47", "50"}
    [rec] = fixture_server.requests
    assert (rec.param("username"), rec.param("filter"), rec.param("offset")) == (USER, "5,12", None)


# --- error mapping -------------------------------------------------------------------------


def test_429_retry_after_then_body_wait_and_local_block(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """429 uses Retry-After, else extras.wait_seconds; afterwards sends are refused locally until the wait passes."""
    body = {"errors": ["You’ve performed this action too many times."], "error_type": "rate_limit", "extras": {"wait_seconds": 12}}
    fixture_server.route(
        "POST", "/posts.json", Reply(status=429, body=body, headers={"retry-after": "7"}), Reply(status=429, body=body),
        Reply(body=fx("post_created.json")),
    )
    clock = FakeClock()
    p = make(fixture_server.url, http_client, clock)
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert (err.value.retry_after_s, err.value.status) == (7.0, 429)
    clock.advance(8)
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.retry_after_s == 12.0
    assert "performed this action too many times" in err.value.detail
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.status is None  # refused locally: no request
    assert len(fixture_server.requests) == 2
    clock.advance(13)
    assert p.send(parent(), "x", provider_key="k").reply_id == "29"


@pytest.mark.parametrize(
    "message", ["Body is too similar to what you recently posted", "Title has already been used"]
)
def test_422_is_rejected_with_the_text(message: str, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 422 (duplicate body, duplicate title) is Rejected and its errors text is kept for the log."""
    fixture_server.route("POST", "/posts.json", Reply(status=422, body={"errors": [message], "error_type": "invalid_parameters"}))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert err.value.status == 422 and message in err.value.detail


# A JSON body nested past the json module's depth (RecursionError), as a hostile or broken server could send.
NESTED = b'{"errors": ' + b"[" * 5000 + b"]" * 5000 + b', "extras": {"wait_seconds": 3}}'


@pytest.mark.parametrize("status,error", [(422, Rejected), (429, RateLimited)])
def test_nested_error_body_keeps_the_status_meaning(status: int, error: type, fixture_server: FixtureServer,
                                                    http_client: httpx.Client) -> None:
    """A refusal (422) or 429 whose body nests too deeply to parse is still Rejected / RateLimited, never uncertain."""
    fixture_server.route("POST", "/posts.json", Reply(status=status, body=NESTED))
    with pytest.raises(error) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert err.value.status == status


def test_403_on_send_rechecks_credentials(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 403 to a POST is Rejected when the key still works (closed topic) and DefinitelyNotSent when it does not."""
    denied = {"errors": ["You are not permitted to view the requested resource."], "error_type": "invalid_access"}
    fixture_server.route("POST", "/posts.json", Reply(status=403, body=denied))
    fixture_server.route("GET", f"/u/{USER}.json", Reply(body=fx("user.json")), Reply(status=403, body=denied))
    p = make(fixture_server.url, http_client)
    with pytest.raises(Rejected) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.status == 403
    with pytest.raises(DefinitelyNotSent) as err2:
        p.send(parent(), "x", provider_key="k")
    assert err2.value.status == 403 and not isinstance(err2.value, RateLimited)
    assert "credentials refused" in err2.value.detail


@pytest.mark.parametrize("status", [404, 410, 400])
def test_other_4xx_on_send_rejected(status: int, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A deleted topic (404), gone post (410) or bad request is Rejected."""
    fixture_server.route("POST", "/posts.json", Reply(status=status, body={"errors": ["nope"], "error_type": "not_found"}))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert err.value.status == status


@pytest.mark.parametrize(
    "reply", [Reply(status=500, body={"errors": ["boom"]}), html_error(502), html_error(503, "Service Unavailable")],
    ids=["500", "502-html", "503-html"],
)
def test_5xx_on_post_maybe_sent_on_read_not_sent(reply: Reply, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """5xx answering the POST is MaybeSent; the same answering a GET is DefinitelyNotSent."""
    fixture_server.route("POST", "/posts.json", reply)
    fixture_server.route("GET", "/notifications.json", reply)
    p = make(fixture_server.url, http_client)
    with pytest.raises(MaybeSent) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.status == reply.status
    with pytest.raises(DefinitelyNotSent):
        p.inbox(None)


def test_transport_failures(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Refused connect: DefinitelyNotSent; connection cut mid-answer or a timeout after the POST: MaybeSent."""
    with pytest.raises(DefinitelyNotSent) as err:
        make(closed_port_url(), http_client).send(parent(), "x", provider_key="k")
    assert "ConnectError" in err.value.detail
    fixture_server.route("POST", "/posts.json", Reply(fault="drop"), Reply(body=fx("post_created.json"), delay_s=1.0))
    p = make(fixture_server.url, http_client, timeout_s=0.2)
    with pytest.raises(MaybeSent):
        p.send(parent(), "x", provider_key="k")
    with pytest.raises(MaybeSent) as err2:
        p.send(parent(), "x", provider_key="k")
    assert "ReadTimeout" in err2.value.detail


def test_enqueued_post_is_rejected_not_retried(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A reply held for approval ({"action": "enqueued"}) is Rejected: it may still land, so it must not be retried."""
    fixture_server.route("POST", "/posts.json", Reply(body={"action": "enqueued", "pending_post": {"id": 9, "raw": "x"}, "pending_count": 1}))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert "moderator approval" in err.value.detail


def test_parent_without_topic_is_rejected_before_sending(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A parent lacking topic_id/post_number is refused without a request."""
    with pytest.raises(Rejected):
        make(fixture_server.url, http_client).send(Parent(id="5", author_id="1"), "x", provider_key="k")
    assert fixture_server.requests == []


def test_malformed_read_is_bad_response(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """An HTML 200 or a body without the notifications array is BadResponse naming what was wrong."""
    fixture_server.route("GET", "/notifications.json", Reply(body="<html></html>", content_type="text/html"), Reply(body={"x": 1}))
    p = make(fixture_server.url, http_client)
    with pytest.raises(BadResponse) as err:
        p.inbox(None)
    assert err.value.detail == "inbox: not JSON (text/html)"
    with pytest.raises(BadResponse) as err:
        p.inbox(None)
    assert err.value.detail == "inbox: field notifications missing"


def test_key_never_in_errors_logs_or_repr(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """No error, repr or log line carries the API key, even when the server echoes it."""
    echo = {"errors": [f"bad key {KEY}"], "error_type": "invalid_access"}
    fixture_server.route(
        "POST", "/posts.json",
        Reply(status=422, body=echo), Reply(status=500, body=echo), Reply(status=429, body=echo, headers={"retry-after": "1"}),
        Reply(status=403, body=echo),
    )
    fixture_server.route("GET", f"/u/{USER}.json", Reply(status=403, body=echo))
    clock = FakeClock()
    p = make(fixture_server.url, http_client, clock)
    errors: list[PlatformError] = []
    with capture_logs() as logs:
        for _ in range(4):
            with pytest.raises(PlatformError) as err:
                p.send(parent(), "x", provider_key="k")
            errors.append(err.value)
            clock.advance(2)
    assert [type(e) for e in errors] == [Rejected, MaybeSent, RateLimited, DefinitelyNotSent]
    assert "<redacted>" in errors[0].detail
    for e in errors:
        assert KEY not in str(e) and KEY not in e.detail
        assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    assert KEY not in repr(p) and KEY not in repr(p._auth)
    assert logs and KEY not in repr(logs)


# --- paging ---------------------------------------------------------------------------------


def test_inbox_pages_offsets_until_cursor(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a cursor, inbox follows load_more_notifications offsets until it meets the cursor; oldest first."""
    items = [notification(600 + n, 1, 70, n, 7000 + n, f"2026-01-01T00:{n:02d}:00.000Z") for n in range(1, 12)]
    fixture_server.route("GET", "/notifications.json", NotificationFeed(items, page=3))
    route_posts(fixture_server, {7000 + n: post_body(7000 + n, 70, n) for n in range(1, 12)})
    page = make(fixture_server.url, http_client).inbox("603")
    assert [p.id for p in page.parents] == [str(7000 + n) for n in range(4, 12)]
    assert page.cursor == "611"
    offsets = [r.param("offset") for r in fixture_server.requests_to("GET", "/notifications.json")]
    assert offsets == [None, "3", "6"]


def test_inbox_stops_cursor_before_a_failed_resolution(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """If resolving a notification fails transiently, the cursor stays before it so the next poll retries it."""
    items = [notification(600 + n, 1, 70, n, 7000 + n, f"2026-01-01T00:{n:02d}:00.000Z") for n in range(1, 5)]
    fixture_server.route("GET", "/notifications.json", NotificationFeed(items, page=60))
    route_posts(fixture_server, {7001: post_body(7001, 70, 1), 7003: post_body(7003, 70, 3), 7004: post_body(7004, 70, 4)})
    fixture_server.route("GET", "/posts/7002.json", html_error(502))
    page = make(fixture_server.url, http_client).inbox("600")
    assert [p.id for p in page.parents] == ["7001"] and page.cursor == "601"


def test_inbox_skips_gone_posts_for_good(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A notification whose post is deleted (404) is skipped and the cursor moves past it."""
    items = [notification(601, 1, 70, 1, 7001, "2026-01-01T00:01:00.000Z"), notification(602, 1, 70, 2, 7002, "2026-01-01T00:02:00.000Z")]
    fixture_server.route("GET", "/notifications.json", NotificationFeed(items, page=60))
    route_posts(fixture_server, {7002: post_body(7002, 70, 2)})
    with capture_logs() as logs:
        page = make(fixture_server.url, http_client).inbox("600")
    assert [p.id for p in page.parents] == ["7002"] and page.cursor == "602"
    assert any(e["event"] == "replyd.poller.unreadable" for e in logs)


def test_refind_pages_back_until_since(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """refind pages back through notifications until they are older than since, with no cursor."""
    items = [notification(600 + n, 2, 70, n, 7000 + n, f"2026-01-01T00:{n:02d}:00.000Z") for n in range(1, 12)]
    fixture_server.route("GET", "/notifications.json", NotificationFeed(items, page=4))
    route_posts(fixture_server, {7000 + n: post_body(7000 + n, 70, n) for n in range(1, 12)})
    found = make(fixture_server.url, http_client).refind(_http.iso_to_epoch("2026-01-01T00:06:00Z"))
    assert [p.id for p in found] == [str(7000 + n) for n in range(6, 12)]
    assert [r.param("offset") for r in fixture_server.requests_to("GET", "/notifications.json")] == [None, "4"]


def test_refind_reuses_posts_resolved_by_inbox(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Posts resolved for the inbox are remembered: a re-find over the same notifications reads only the listing."""
    items = [notification(600 + n, 1, 70, n, 7000 + n, f"2026-01-01T00:{n:02d}:00.000Z") for n in range(1, 4)]
    fixture_server.route("GET", "/notifications.json", NotificationFeed(items, page=60))
    route_posts(fixture_server, {7000 + n: post_body(7000 + n, 70, n) for n in range(1, 4)})
    p = make(fixture_server.url, http_client)
    assert len(p.inbox(None).parents) == 3
    before = len(fixture_server.requests)
    assert [x.id for x in p.refind(0.0)] == ["7001", "7002", "7003"]
    assert [r.path for r in fixture_server.requests[before:]] == ["/notifications.json"]


def test_search_pages_with_cursor(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """search follows more_full_page_results pages until hits are not newer than the cursor."""
    shape = fxj("search.json")

    def page(rec: Recorded) -> Reply:
        n = int(rec.param("page") or 1)
        body = copy.deepcopy(shape)
        hits = [copy.deepcopy(shape["posts"][0]) | {"id": pid, "topic_id": 13, "post_number": 1} for pid in range(40 - 10 * n, 30 - 10 * n, -1)]
        body["posts"] = hits
        body["grouped_search_result"]["more_full_page_results"] = n < 3
        return Reply(body=body)

    fixture_server.route("GET", "/search.json", page)
    bodies = {pid: post_body(pid, 13, 1) for pid in range(1, 31)}
    for pid, body in bodies.items():
        fixture_server.route("GET", f"/posts/{pid}.json", Reply(body=body))
    got = make(fixture_server.url, http_client).search("x", "14")
    assert [p.id for p in got.parents] == [str(n) for n in range(15, 31)]
    assert got.cursor == "30"
    assert [r.param("page") for r in fixture_server.requests_to("GET", "/search.json")] == [None, "2"]


def test_read_back_user_actions_pages_by_offset(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The own-replies feed is paged by offset (30 a page) until it reaches back past the parent's opening."""
    clock = FakeClock()
    now = clock.now()
    shape = fxj("user_actions_replies.json")["user_actions"][0]
    rows = [shape | {"post_id": 9000 - i, "topic_id": 80, "reply_to_post_number": 100 + i, "acting_user_id": 11,
                     "created_at": iso_ms(now - 60 * i)} for i in range(70)]

    def feed(rec: Recorded) -> Reply:
        off = int(rec.param("offset") or 0)
        return Reply(body={"user_actions": rows[off : off + 30]})

    fixture_server.route("GET", "/user_actions.json", feed)
    pending = [
        Pending(parent("P45", 80, 145), opened_at=now - 60 * 45),
        Pending(parent("P65", 80, 165), opened_at=now - 60 * 64),
        Pending(parent("PX", 80, 999), opened_at=now - 60 * 30),
    ]
    rb = make(fixture_server.url, http_client, clock).read_back(pending, sender_id="11")
    assert {k: [r.reply_id for r in v] for k, v in rb.found.items()} == {"P45": ["8955"], "P65": ["8935"]}
    assert rb.checked == {"P45", "P65", "PX"}
    assert [r.param("offset") for r in fixture_server.requests] == [None, "30", "60"]


def test_read_back_topic_fetches_unloaded_ids_in_chunks(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A topic longer than its first chunk: ids after the parent are fetched 20 at a time by post_ids[]."""
    topic = fxj("topic.json")
    tpl = topic["post_stream"]["posts"][0]
    posts = {pid: copy.deepcopy(tpl) | {"id": pid, "post_number": pid - 100, "user_id": 5, "reply_to_post_number": None}
             for pid in range(101, 156)}
    posts[153].update(user_id=11, reply_to_post_number=2)  # the own reply, in the tail
    topic["post_stream"] = {"posts": [posts[pid] for pid in range(101, 121)], "stream": list(posts)}
    fixture_server.route("GET", "/user_actions.json", Reply(status=503))
    fixture_server.route("GET", "/t/1148.json", Reply(body=topic))

    def by_ids(rec: Recorded) -> Reply:
        ids = [int(v) for k, v in rec.query if k == "post_ids[]"]
        return Reply(body={"post_stream": {"posts": [posts[i] for i in ids]}, "id": 1148})

    fixture_server.route("GET", "/t/1148/posts.json", by_ids)
    rb = make(fixture_server.url, http_client).read_back([Pending(parent("102", 1148, 2), opened_at=0.0)], sender_id="11")
    assert [r.reply_id for r in rb.found["102"]] == ["153"] and rb.checked == {"102"}
    asked = [[v for k, v in r.query if k == "post_ids[]"] for r in fixture_server.requests_to("GET", "/t/1148/posts.json")]
    assert [len(a) for a in asked] == [20, 15] and asked[0][0] == "121"


# --- thread depth --------------------------------------------------------------------------

NOT_FOUND = Reply(status=404, body={"errors": ["The requested URL or resource could not be found."], "error_type": "not_found"})


class RecordedTopic:
    """Serves the recorded topic's posts as Discourse's reply-history and by_number endpoints do.

    ``/posts/{id}/reply-history.json`` climbs ``reply_to_post_number`` like
    ``TopicView#find_post_replies_ids`` (at most ``max_reply_history`` levels,
    the site setting, default 1) and leaves out posts this account may not see
    (``hidden``); ``/posts/by_number/{topic}/{n}.json`` answers one post or 404.
    """

    def __init__(self, server: FixtureServer, *, max_reply_history: int = 1, hidden: tuple[int, ...] = (),
                 posts: list[dict[str, Any]] | None = None) -> None:
        self.posts = posts if posts is not None else fxj("topic.json")["post_stream"]["posts"]
        self.by_number = {p["post_number"]: p for p in self.posts}
        self.max_reply_history = max_reply_history
        self.hidden = set(hidden)
        for p in self.posts:
            server.route("GET", f"/posts/{p['id']}.json", Reply(body=p))
            server.route("GET", f"/posts/{p['id']}/reply-history.json", self.history)
            server.route("GET", f"/posts/by_number/{p['topic_id']}/{p['post_number']}.json", self.one)

    def history(self, rec: Recorded) -> Reply:
        """The ancestors of the post in the path, nearest ``max_reply_history`` levels, visible ones, by id."""
        pid = int(rec.path.split("/")[2])
        cur = next(p for p in self.posts if p["id"] == pid)
        out: list[dict[str, Any]] = []
        while cur.get("reply_to_post_number") and len(out) < self.max_reply_history:
            cur = self.by_number.get(cur["reply_to_post_number"])
            if cur is None:
                break
            out.append(cur)
        return Reply(body=sorted((p for p in out if p["post_number"] not in self.hidden), key=lambda p: p["id"]))

    def one(self, rec: Recorded) -> Reply:
        """One post by number, 404 when hidden."""
        number = int(rec.path.rsplit("/", 1)[1].split(".")[0])
        return NOT_FOUND if number in self.hidden else Reply(body=self.by_number[number])


def depth_requests(server: FixtureServer) -> list[str]:
    """The reply-history and by_number requests made, in order (not the resolves)."""
    return [r.path for r in server.requests if "reply-history" in r.path or "by_number" in r.path]


def recorded_parents(server: FixtureServer, p: DiscoursePlatform) -> dict[int, Parent]:
    """Every loaded post of the recorded topic as resolve parses it, by post number; requests forgotten."""
    out = {n: p.resolve(str(post["id"])) for n, post in RecordedTopic(server).by_number.items()}
    server.requests.clear()
    return out


# Depths in the recorded topic (reply_to_post_number as recorded): 20 → 19 → 18 → 14 → the first post.
RECORDED_DEPTHS = {1: 0, 2: 1, 3: 1, 4: 2, 8: 2, 12: 2, 13: 3, 17: 2, 18: 2, 19: 3, 20: 4}


def test_thread_depth_recorded_topic_one_level_per_request(fixture_server: FixtureServer,
                                                           http_client: httpx.Client) -> None:
    """Depths in the recorded topic; the first post and direct replies cost nothing, deeper ones one request a level."""
    p = make(fixture_server.url, http_client)
    parents = recorded_parents(fixture_server, p)
    RecordedTopic(fixture_server)
    for number, depth in RECORDED_DEPTHS.items():
        fixture_server.requests.clear()
        assert p.thread_depth(parents[number], 10) == depth, number
        assert len(depth_requests(fixture_server)) == max(depth - 1, 0), number
    fixture_server.requests.clear()
    p.thread_depth(parents[20], 10)
    assert depth_requests(fixture_server) == [
        "/posts/20545/reply-history.json", "/posts/20218/reply-history.json", "/posts/20136/reply-history.json"]
    assert fixture_server.requests[0].param("max_replies") == "10"  # 19 and up to 9 more: enough to pass 10


def test_thread_depth_one_request_where_the_site_serves_more_history(fixture_server: FixtureServer,
                                                                    http_client: httpx.Client) -> None:
    """With max_reply_history raised, one reply-history answer carries the whole chain: one request."""
    p = make(fixture_server.url, http_client)
    parents = recorded_parents(fixture_server, p)
    RecordedTopic(fixture_server, max_reply_history=10)
    assert p.thread_depth(parents[20], 10) == 4
    assert p.thread_depth(parents[13], 10) == 3
    assert depth_requests(fixture_server) == ["/posts/20545/reply-history.json", "/posts/20052/reply-history.json"]


@pytest.mark.parametrize(("limit", "answer", "requests"), [(0, 1, 0), (1, 2, 0), (2, 3, 1), (3, 4, 2), (4, 4, 3)])
def test_thread_depth_stops_after_limit_plus_one(limit: int, answer: int, requests: int, fixture_server: FixtureServer,
                                                 http_client: httpx.Client) -> None:
    """Post 20 (depth 4): counting stops once the answer exceeds the limit, with no request more than needed."""
    p = make(fixture_server.url, http_client)
    target = recorded_parents(fixture_server, p)[20]
    RecordedTopic(fixture_server)
    assert p.thread_depth(target, limit) == answer
    assert len(depth_requests(fixture_server)) == requests


def test_thread_depth_hidden_ancestor_counts_and_ends_the_count(fixture_server: FixtureServer,
                                                                http_client: httpx.Client) -> None:
    """Post 18 deleted (not shown to this account): it counts, nothing above it is seen (a lower bound)."""
    p = make(fixture_server.url, http_client)
    target = recorded_parents(fixture_server, p)[20]
    RecordedTopic(fixture_server, hidden=(18,))
    with capture_logs() as logs:
        assert p.thread_depth(target, 10) == 3  # the first post, 19, 18 (14 above it is unseen)
    assert depth_requests(fixture_server) == [
        "/posts/20545/reply-history.json", "/posts/20218/reply-history.json", "/posts/by_number/1148/18.json"]
    assert any(e["event"] == "replyd.discourse.thread_hidden" and e["post_number"] == 18 for e in logs)


def test_thread_depth_site_without_reply_history_falls_back_to_by_number(fixture_server: FixtureServer,
                                                                         http_client: httpx.Client) -> None:
    """A site whose reply-history answers nothing (max_reply_history 0) is read by number, asked only once."""
    p = make(fixture_server.url, http_client)
    target = recorded_parents(fixture_server, p)[20]
    RecordedTopic(fixture_server, max_reply_history=0)
    assert p.thread_depth(target, 10) == 4
    assert depth_requests(fixture_server) == [
        "/posts/20545/reply-history.json", "/posts/by_number/1148/19.json", "/posts/by_number/1148/18.json",
        "/posts/by_number/1148/14.json"]


def test_thread_depth_parent_without_extra_is_read_first(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A parent lacking post_number / reply_to_post_number is read by id first (one request), then climbed."""
    RecordedTopic(fixture_server)
    p = make(fixture_server.url, http_client)
    assert p.thread_depth(Parent(id="20052", author_id="x", thread_depth=1), 10) == 3
    assert p.thread_depth(Parent(id="18952", author_id="x"), 10) == 0
    assert [r.path for r in fixture_server.requests] == [
        "/posts/20052.json", "/posts/20052/reply-history.json", "/posts/20039/reply-history.json", "/posts/18952.json"]


def test_thread_depth_reply_loop_ends(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Edited reply_to_post_numbers that loop (5 → 4 → 3 → 4) end the count at the distinct posts, with a warning."""
    posts = [post_body(100 + n, 9, n, reply_to_post_number=r) for n, r in ((1, None), (3, 4), (4, 3), (5, 4))]
    RecordedTopic(fixture_server, posts=posts, max_reply_history=5)
    p = make(fixture_server.url, http_client)
    with capture_logs() as logs:
        assert p.thread_depth(p.resolve("105"), 1000) == 3
    assert any(e["event"] == "replyd.discourse.reply_loop" for e in logs)
    assert len(depth_requests(fixture_server)) == 1


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(body={"post_stream": {"posts": []}}), "thread_depth: expected an array at top level, got an object"),
        (Reply(body=[7]), "thread_depth: post is not an object"),
        (Reply(body=[{"id": 1, "post_number": "19"}]), "thread_depth: field post_number is a string, not int"),
        (Reply(body="<html>Maintenance</html>", content_type="text/html"), "thread_depth: not JSON (text/html)"),
    ],
    ids=["object", "item-number", "number-as-string", "html-200"],
)
def test_thread_depth_malformed_history_is_bad_response(reply: Reply, message: str, fixture_server: FixtureServer,
                                                        http_client: httpx.Client) -> None:
    """A reply-history body of the wrong shape raises BadResponse naming what was wrong."""
    p = make(fixture_server.url, http_client)
    target = recorded_parents(fixture_server, p)[20]
    fixture_server.route("GET", "/posts/20545/reply-history.json", reply)
    with pytest.raises(BadResponse) as err:
        p.thread_depth(target, 10)
    assert err.value.detail == message


@pytest.mark.parametrize(
    ("reply", "cls"),
    [
        (Reply(status=500, body={"errors": ["boom"]}), DefinitelyNotSent),
        (html_error(502), DefinitelyNotSent),
        (Reply(status=403, body={"errors": ["You are not permitted to view the requested resource."],
                                 "error_type": "invalid_access"}), DefinitelyNotSent),
        (NOT_FOUND, Rejected),
    ],
    ids=["500", "502-html", "403", "404"],
)
def test_thread_depth_errors_map_like_other_reads(reply: Reply, cls: type, fixture_server: FixtureServer,
                                                  http_client: httpx.Client) -> None:
    """A failed reply-history read maps as the adapter's other GETs: 5xx and 403 DefinitelyNotSent, 404 Rejected."""
    p = make(fixture_server.url, http_client)
    target = recorded_parents(fixture_server, p)[20]
    fixture_server.route("GET", "/posts/20545/reply-history.json", reply)
    with pytest.raises(cls) as err:
        p.thread_depth(target, 10)
    assert type(err.value) is cls and err.value.status == reply.status


def test_thread_depth_429_blocks_locally(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 429 (extras.wait_seconds) is RateLimited and blocks the next thread_depth locally until the wait passes."""
    clock = FakeClock()
    p = make(fixture_server.url, http_client, clock)
    target = recorded_parents(fixture_server, p)[13]
    limited = Reply(status=429, body={"errors": ["slow down"], "error_type": "rate_limit", "extras": {"wait_seconds": 9}})
    RecordedTopic(fixture_server)
    fixture_server.route("GET", "/posts/20052/reply-history.json", limited, Reply(body=[fxj("topic.json")["post_stream"]["posts"][11]]))
    with pytest.raises(RateLimited) as err:
        p.thread_depth(target, 10)
    assert err.value.retry_after_s == 9.0
    with pytest.raises(RateLimited) as err:
        p.thread_depth(target, 10)
    assert err.value.status is None and len(fixture_server.requests) == 1
    clock.advance(10)
    assert p.thread_depth(target, 10) == 3


# --- a stateful fake forum, end to end through Guard + Sweeper + Store --------------------------


@pytest.fixture(scope="module")
def host() -> Iterator[FakeHost]:
    """One uvicorn server for the module; each test installs a fresh fake forum."""
    with FakeHost() as h:
        yield h


@pytest.fixture
def world(host: FakeHost, tmp_path, http_client: httpx.Client, store_template) -> Iterator[dict[str, Any]]:
    """A fresh fake forum, an adapter on it, and guard + sweeper over a SQLite store in tmp_path."""
    clock = FakeClock()
    fake = FakeDiscourse(clock)
    host.fake = fake
    plat = DiscoursePlatform.from_settings(
        {"base_url": host.url, "api_key": FakeDiscourse.API_KEY, "api_username": "replybot", "listing_delay_s": 5},
        http=http_client, clock=clock,
    )
    store = fresh_store(store_template, tmp_path, clock)
    ident = plat.whoami()
    guard = Guard(store, plat, ident, clock=clock, send_timeout_s=10.0)
    sweeper = Sweeper(store, [Bot(plat, ident)], clock=clock)
    alice = fake.add_user("alice")
    yield {"clock": clock, "fake": fake, "plat": plat, "store": store, "guard": guard, "sweeper": sweeper, "alice": alice}
    host.fake = None
    store.dispose()


def _mention(w: dict[str, Any]) -> Any:
    """Alice opens a topic mentioning the bot; the clock moves past the listing delay."""
    post = w["fake"].create_topic(w["alice"], "Widget question", "@replybot how do widgets work?")
    w["clock"].advance(1)
    return post


def _past_deadline(w: dict[str, Any]) -> None:
    w["clock"].advance(10.0 + w["plat"].listing_delay_s + 1)


def test_e2e_rate_limited_releases_without_posting(world: dict[str, Any]) -> None:
    """A 429 releases the row with a not-before; nothing lands until the wait has passed."""
    post = _mention(world)
    [p] = world["plat"].inbox(None).parents
    world["fake"].faults = ["rate_limited"]
    out = world["guard"].post(p, "hi")
    assert out.status is Status.NOT_SENT and out.retry_after_s == pytest.approx(7.0)
    assert world["guard"].post(p, "hi").status is Status.NOT_SENT
    world["clock"].advance(8)
    assert world["guard"].post(p, "hi").status is Status.POSTED
    assert world["fake"].reply_count(post.id) == 1 and world["fake"].create_requests == 2


def test_e2e_collapsed_notifications_offer_every_reply(world: dict[str, Any]) -> None:
    """Two replies to the bot before a poll collapse into one notification; both posts are offered and answered once."""
    fake, plat, guard, clock = world["fake"], world["plat"], world["guard"], world["clock"]
    root = _mention(world)
    [p] = plat.inbox(None).parents
    guard.post(p, "first answer")
    cursor = plat.inbox(None).cursor
    bob = fake.add_user("bob")
    bot_post = fake.replies(root.id)[0]
    r1 = fake.reply(world["alice"], root.topic_id, "thanks, but what about gears?", reply_to=bot_post.post_number)
    r2 = fake.reply(bob, root.topic_id, "and sprockets?", reply_to=bot_post.post_number)
    clock.advance(6)
    assert len([n for n in fake.notes if n["notification_type"] == 2]) == 1  # collapsed
    page = plat.inbox(cursor)
    assert [x.id for x in page.parents] == [str(r1.id), str(r2.id)]
    assert [guard.post(x, "answer").status for x in page.parents] == [Status.POSTED, Status.POSTED]
    assert (fake.reply_count(r1.id), fake.reply_count(r2.id)) == (1, 1)


def test_e2e_private_message_read_back(world: dict[str, Any]) -> None:
    """A PM parent whose answer was lost is closed from the feed's NEW_PRIVATE_MESSAGE (12) rows."""
    fake = world["fake"]
    pm = fake.create_topic(world["alice"], "Private help", "can you help me privately?", private_with=(fake.bot,))
    world["clock"].advance(1)
    [p] = world["plat"].inbox(None).parents
    assert p.id == str(pm.id) and p.extra["private_message"] is True
    fake.faults = ["lost"]
    assert world["guard"].post(p, "sure").status is Status.UNCERTAIN
    _past_deadline(world)
    assert world["sweeper"].run_once().closed == 1
    assert fake.reply_count(pm.id) == 1


def test_e2e_listing_delay_longer_than_configured_duplicates(world: dict[str, Any]) -> None:
    """The measured limit: with no provider idempotency, a real listing delay above the configured one duplicates."""
    fake = world["fake"]
    post = _mention(world)
    [p] = world["plat"].inbox(None).parents
    fake.listing_delay_s = 600.0  # the forum lists new posts ten minutes late; replyd waits 5 s
    fake.faults = ["lost"]
    assert world["guard"].post(p, "hi").status is Status.UNCERTAIN
    _past_deadline(world)
    assert world["sweeper"].run_once().not_landed == 1  # the read-back could not see it yet
    assert world["guard"].post(p, "hi").status is Status.POSTED
    assert fake.reply_count(post.id) == 2


# --- edits of own posts (EditReply: a streamed answer grows its post) -------------------------


def _answered(w: dict[str, Any], text: str = "Looking") -> tuple[Any, Parent, str]:
    """A topic mentioning the bot, answered through the guard: (the parent post, parent, the reply's post id)."""
    post = _mention(w)
    [p] = w["plat"].inbox(None).parents
    out = w["guard"].post(p, text)
    assert out.status is Status.POSTED
    return post, p, out.reply_id


def test_e2e_a_prompt_injection_pings_nobody_but_the_author(world: dict[str, Any]) -> None:
    """A reply echoing every mention form (users, teams, groups) keeps only the author's @name live, posted and
    edited, as the fake stores it; ``allow_mentions`` lets them through."""
    from tests.test_mentions import INJECTION

    world["fake"].create_topic(world["alice"], "Widgets", f"@replybot {INJECTION} @alice")
    injection_pings_only_the_author(world)


def test_e2e_edit_replaces_the_raw_and_read_back_still_finds_one_reply(world: dict[str, Any]) -> None:
    """An edit PUTs the whole raw; the feed and the topic still show the one reply, same id, new text."""
    fake = world["fake"]
    post, p, rid = _answered(world)
    edit_and_sweep(world, p, rid, ["Looking into it: widgets", "Looking into it: widgets spin on gears."],
                   10.0 + world["plat"].listing_delay_s + 1)
    assert fake.reply_count(post.id) == 1 and fake.create_requests == 1 and fake.edit_requests == 2


def test_e2e_edit_lost_answer_is_maybe_sent_and_the_retry_makes_no_second_revision(world: dict[str, Any]) -> None:
    """The edit acts but its answer is lost: MaybeSent; repeating it sets the same raw: one revision, one reply."""
    fake, plat = world["fake"], world["plat"]
    post, p, rid = _answered(world)
    walk_edit_faults(fake, plat, p, rid)
    assert fake.reply_count(post.id) == 1 and fake.create_requests == 1


def test_e2e_edit_refused_too_long_foreign_closed_late_or_gone(world: dict[str, Any]) -> None:
    """Over max_post_length (422), another's post, a closed topic or past the edit time limit (403, key still
    good), a deleted post (404): Rejected, the text unchanged."""
    fake, plat, clock = world["fake"], world["plat"], world["clock"]
    post, p, rid = _answered(world)
    with pytest.raises(Rejected) as err:
        plat.edit(p, rid, "x" * (fake.max_post_length + 1))
    assert err.value.status == 422 and "limited to 32000" in err.value.detail
    plat.edit(p, rid, "x" * fake.max_post_length)
    with pytest.raises(Rejected) as err:
        plat.edit(p, str(post.id), "hijacked")
    assert err.value.status == 403 and fake.reply_text(post.id) == "@replybot how do widgets work?"
    fake.topics[post.topic_id].closed = True
    with pytest.raises(Rejected):
        plat.edit(p, rid, "in a closed topic")
    fake.topics[post.topic_id].closed = False
    clock.advance(fake.edit_time_limit_s + 1)
    with pytest.raises(Rejected) as err:
        plat.edit(p, rid, "too late")
    assert err.value.status == 403 and not isinstance(err.value, DefinitelyNotSent)
    fake.posts[int(rid)].deleted = True
    with pytest.raises(Rejected) as err:
        plat.edit(p, rid, "after the delete")
    assert err.value.status == 404
    assert fake.edits(rid) == 1 and fake.reply_text(rid) == "x" * fake.max_post_length


def test_e2e_edit_rate_limited_and_a_refused_key(world: dict[str, Any]) -> None:
    """A 429 is RateLimited with the body's wait and blocks the post bucket locally; a revoked key's 403 is
    DefinitelyNotSent (tried again), not a refusal of the post."""
    fake, plat, clock = world["fake"], world["plat"], world["clock"]
    _, p, rid = _answered(world)
    fake.edit_faults = ["rate_limited"]
    with pytest.raises(RateLimited) as err:
        plat.edit(p, rid, "grown")
    assert err.value.retry_after_s == pytest.approx(7.0) and fake.reply_text(rid) == "Looking"
    with pytest.raises(RateLimited):
        plat.edit(p, rid, "grown")  # refused locally: no request
    assert fake.edit_requests == 1
    clock.advance(8)
    plat.edit(p, rid, "grown")
    assert fake.reply_text(rid) == "grown"
    fake.users.pop(fake.bot.id)  # the key's user is gone: every request is the same 403
    with pytest.raises(DefinitelyNotSent) as err2:
        plat.edit(p, rid, "grown more")
    assert err2.value.status == 403 and "credentials refused" in err2.value.detail
    assert not isinstance(err2.value, RateLimited) and fake.reply_text(rid) == "grown"


def test_e2e_streamed_answer_grows_one_post_through_a_lost_edit_answer(world: dict[str, Any]) -> None:
    """A streamed responder through the guard: one post, grown by PUTs to the whole answer, an edit whose answer
    was lost repeated safely; the sweep verifies one reply and no duplicate."""
    from tests.test_stream import Streamer

    fake = world["fake"]
    post = _mention(world)
    [p] = world["plat"].inbox(None).parents
    words = [f"w{i:02d}" for i in range(20)]
    fake.edit_faults = ["none", "lost"]  # the second edit acts, its answer never comes
    out = world["guard"].post(p, Streamer(world["clock"], words=words, step_s=0.4, asynchronous=False))
    assert out.status is Status.POSTED, out
    [r] = fake.replies(post.id)
    assert str(r.id) == out.reply_id and r.raw == " ".join(words)
    assert fake.lost_edits == 1 and fake.edits(r.id) >= 2 and fake.create_requests == 1
    _past_deadline(world)
    res = world["sweeper"].run_once()
    assert (res.verified, res.duplicates) == (1, 0)
