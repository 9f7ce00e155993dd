"""The Mastodon adapter against a real local HTTP server serving recorded Mastodon bodies."""

from __future__ import annotations

import copy
import dataclasses
import email.utils
import json
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from tests.fixtures_server import (  # noqa: F401  (pytest finds the fixtures by name)
    FixtureServer,
    Recorded,
    Reply,
    closed_port_url,
    fixture_server,
    fixture_server_session,
    html_error,
    http_client,
    load_fixture,
)
from replyd.clock import FakeClock
from replyd.errors import (
    BadResponse,
    DefinitelyNotSent,
    MaybeSent,
    RateLimited,
    Rejected,
)
from replyd.platforms.base import (
    Identity,
    OwnReply,
    Parent,
    Pending,
    Platform,
    Sent,
)
from replyd.platforms import _http
from replyd.platforms.mastodon import MastodonPlatform

TOKEN = "tok-SECRET-9f8e7d6c5b4a3921"
NOTIFICATIONS = "/api/v1/notifications"
STATUSES = "/api/v1/statuses"
VERIFY = "/api/v1/accounts/verify_credentials"
SEARCH = "/api/v2/search"
SENDER = "117020565966271181"
FEED = f"/api/v1/accounts/{SENDER}/statuses"

# Headers recorded with the fixtures (see shared/fixtures/SOURCES.md); the links point at
# the recording host, not at this server.
NOTIF_LINK = (
    '<http://localhost:3000/api/v1/notifications?max_id=21&types%5B%5D=mention>; rel="next", '
    '<http://localhost:3000/api/v1/notifications?min_id=21&types%5B%5D=mention>; rel="prev"'
)
STATUSES_LINK = (
    "<http://localhost:3000/api/v1/accounts/117020565966271181/statuses?limit=5&max_id=117020580489281910>; "
    'rel="next", <http://localhost:3000/api/v1/accounts/117020565966271181/statuses?limit=5&'
    'min_id=117020580518794573>; rel="prev"'
)
RATE = {
    "x-ratelimit-limit": "300",
    "x-ratelimit-remaining": "299",
    "x-ratelimit-reset": "2026-08-01T13:55:00.940463Z",
}


def fx(name: str) -> bytes:
    """A recorded Mastodon body, byte for byte."""
    return load_fixture("mastodon", name)


def fxj(name: str) -> Any:
    """A recorded Mastodon body, parsed."""
    return json.loads(fx(name))


def iso(t: float) -> str:
    """Epoch seconds as Mastodon writes them."""
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def epoch(text: str) -> float:
    """ISO time to epoch seconds."""
    return _http.iso_to_epoch(text)


def make(url: str, http: httpx.Client, clock: FakeClock | None = None, **settings: Any) -> MastodonPlatform:
    """An adapter for ``url`` with the test token."""
    return MastodonPlatform.from_settings(
        {"base_url": url, "token": TOKEN, **settings}, http=http, clock=clock or FakeClock()
    )


def in_sync(p: MastodonPlatform, clock: FakeClock) -> MastodonPlatform:
    """``p`` with its platform clock measured in step with ``clock`` (one exact sample, as a reply's created_at
    would give): these recorded servers serve no Date, and an unmeasured clock widens every window a day."""
    p.platform_clock.note(clock.now(), 0.0, clock.now(), clock.now(), "created")
    return p


def id_key(value: str) -> tuple[int, str]:
    """Mastodon id order."""
    return (len(value), value)


class Feed:
    """Serves items like Mastodon lists do: newest first, max_id/min_id/limit, Link next/prev."""

    def __init__(self, items: list[dict[str, Any]], link_base: str = "http://localhost:3000") -> None:
        self.items = sorted(items, key=lambda i: id_key(i["id"]), reverse=True)
        self.link_base = link_base

    def __call__(self, rec: Recorded) -> Reply:
        limit = int(rec.param("limit") or 20)
        max_id, min_id = rec.param("max_id"), rec.param("min_id")
        cands = [
            i
            for i in self.items
            if (max_id is None or id_key(i["id"]) < id_key(max_id))
            and (min_id is None or id_key(i["id"]) > id_key(min_id))
        ]
        # min_id pages forward: the items just above min_id, still listed newest first.
        page = cands[-limit:] if (min_id is not None and max_id is None) else cands[:limit]
        links = []
        if len(page) == limit:
            links.append(f'<{self.link_base}{rec.path}?limit={limit}&max_id={page[-1]["id"]}>; rel="next"')
        if page:
            links.append(f'<{self.link_base}{rec.path}?limit={limit}&min_id={page[0]["id"]}>; rel="prev"')
        headers = {"link": ", ".join(links)} if links else {}
        return Reply(body=page, headers=headers)


def notification(nid: str, status_id: str, created: float, **status_changes: Any) -> dict[str, Any]:
    """A mention notification cloned from the recorded one."""
    item = copy.deepcopy(fxj("notifications_mention.json")[0])
    item["id"] = nid
    item["group_key"] = f"ungrouped-{nid}"
    item["created_at"] = iso(created)
    item["status"].update(id=status_id, created_at=iso(created - 0.5), **status_changes)
    return item


def own_status(sid: str, created: float, in_reply_to: str | None, account_id: str = SENDER) -> dict[str, Any]:
    """An own status cloned from the recorded account feed."""
    item = copy.deepcopy(fxj("account_statuses.json")[0])
    item.update(id=sid, created_at=iso(created), in_reply_to_id=in_reply_to)
    item["account"]["id"] = account_id
    return item


def reply_echo(reply_id: str) -> Any:
    """A POST handler answering like Mastodon: the recorded status, replying to the requested parent."""

    def handler(rec: Recorded) -> Reply:
        body = fxj("status_post_reply.json")
        body["id"] = reply_id
        body["in_reply_to_id"] = rec.form()["in_reply_to_id"]
        body["visibility"] = rec.form().get("visibility", "public")
        return Reply(body=body)

    return handler


def parent(pid: str = "117020583245459824", **extra: Any) -> Parent:
    """A parent as inbox would return it."""
    fields = {"acct": "mastodonpy_test_2", "visibility": "public", **extra}
    return Parent(id=pid, author_id="117020566092212359", author_handle=fields["acct"], extra=fields)


# --- settings and registration ------------------------------------------------------------


def test_settings_defaults_and_instance(http_client: httpx.Client) -> None:
    """from_settings fills the documented defaults and derives the instance from base_url."""
    p = MastodonPlatform.from_settings(
        {"base_url": "https://m.example/", "token": TOKEN}, http=http_client, clock=FakeClock()
    )
    assert p.instance == "mastodon:https://m.example"
    assert p.listing_delay_s == 10.0
    assert p.kind == "mastodon"
    assert isinstance(p, Platform)
    custom = make("https://m.example", http_client, instance="mastodon:prod", listing_delay_s=30)
    assert custom.instance == "mastodon:prod"
    assert custom.listing_delay_s == 30.0


# --- every recorded fixture parses ---------------------------------------------------------


def test_verify_credentials_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """whoami parses the recorded verify_credentials; the id is the exact served string."""
    fixture_server.route("GET", VERIFY, Reply(body=fx("verify_credentials.json"), headers=RATE))
    ident = make(fixture_server.url, http_client).whoami()
    assert ident == Identity(sender_id="117020457910412882", handle="mastodonpy_test")
    assert fixture_server.requests[-1].headers["authorization"] == f"Bearer {TOKEN}"


def test_notifications_fixture_parses(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """inbox(None) turns the recorded mention into a Parent: exact ids, plain text, extras, cursor."""
    fixture_server.route(
        "GET", NOTIFICATIONS, Reply(body=fx("notifications_mention.json"), headers={"link": NOTIF_LINK, **RATE})
    )
    page = make(fixture_server.url, http_client).inbox(None)
    assert page.cursor == "21"
    assert page.parents == [
        Parent(
            id="117020577157693549",
            author_id="117020565693913441",
            author_handle="admin",
            author_is_bot=False,
            text="@mastodonpy_test hello!",
            url="http://localhost:3000/@admin/117020577157693549",
            created_at=epoch("2026-08-01T13:51:42.823Z"),
            thread_depth=0,
            extra={
                "acct": "admin",
                "visibility": "public",
                "in_reply_to_id": None,
                "in_reply_to_account_id": None,
                "mention_ids": ["117020565966271181"],  # the bot's account: Addressing reads it (MCP's scope)
                "spoiler_text": "",
                "language": "en",
            },
        )
    ]
    [rec] = fixture_server.requests  # no cursor: the newest page only, links not followed
    assert ("types[]", "mention") in rec.query
    assert rec.param("limit") == "40"
    assert rec.param("min_id") is None


def test_search_v2_fixture_parses(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """search parses the recorded v2 result into parents with local served ids, oldest first."""
    fixture_server.route("GET", SEARCH, Reply(body=fx("search_v2.json")))
    page = make(fixture_server.url, http_client).search("halcy", None)
    assert [p.id for p in page.parents] == ["116388107849695302", "116388149027005349"]
    assert page.cursor == "116388149027005349"
    greg = page.parents[1]
    assert greg.author_handle == "greg@icosahedron.website"
    assert greg.author_id == "108902549022722291"
    assert greg.thread_depth == 1
    assert greg.extra["in_reply_to_id"] == "116387888508422624"
    # The remote URL carries the origin server's id, not the served one.
    assert greg.url == "https://icosahedron.website/@greg/116388148912635764"
    [rec] = fixture_server.requests
    assert (rec.param("q"), rec.param("type"), rec.param("resolve")) == ("halcy", "statuses", "false")


def test_search_cursor_sends_min_id_and_filters(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """search with a cursor sends min_id and drops statuses not newer than it, even if the server returns them."""
    fixture_server.route("GET", SEARCH, Reply(body=fx("search_v2.json")))
    page = make(fixture_server.url, http_client).search("halcy", "116388107849695302")
    assert [p.id for p in page.parents] == ["116388149027005349"]
    assert fixture_server.requests[-1].param("min_id") == "116388107849695302"
    empty = make(fixture_server.url, http_client).search("halcy", "116388149027005349")
    assert empty.parents == [] and empty.cursor == "116388149027005349"


def test_search_gap_resumes_at_its_offset_and_a_refused_one_is_given_up(fixture_server: FixtureServer,
                                                                         http_client: httpx.Client) -> None:
    """max_pages ends before the cursor: the next poll reads on from that offset (same min_id); if the server
    refuses the resume (4xx) three polls in a row, nothing is offered and the cursor moves to the newest."""
    fixture_server.route("GET", SEARCH, Reply(body=fx("search_v2.json")),
                         Reply(status=422, body={"error": "offset too large"}))
    p = make(fixture_server.url, http_client, page_limit=1, max_pages=1)
    first = p.search("halcy", "1")
    assert [q.id for q in first.parents] == ["116388107849695302", "116388149027005349"]
    cursor = first.cursor
    for i in range(3):
        page = p.search("halcy", cursor)
        assert page.parents == []
        resumed = fixture_server.requests[-1]
        assert (resumed.param("min_id"), resumed.param("offset")) == ("1", "2")
        cursor = page.cursor
        assert (cursor == "116388149027005349") == (i == 2), cursor


def test_status_context_fixture_used_by_read_back(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With the own feed failing, read_back reads the recorded context and finds the own direct reply."""
    pid = "110446983926957470"
    fixture_server.route("GET", "/api/v1/accounts/43/statuses", Reply(status=500, body={"error": "boom"}))
    fixture_server.route("GET", f"{STATUSES}/{pid}/context", Reply(body=fx("status_context.json")))
    opened = epoch("2023-05-28T15:20:30Z")
    rb = make(fixture_server.url, http_client).read_back(
        [Pending(parent=Parent(id=pid, author_id="43"), opened_at=opened)], sender_id="43"
    )
    assert rb.found == {pid: [OwnReply("110446984249325790", pid, epoch("2023-05-28T15:20:35.248Z"))]}
    assert rb.checked == {pid}


def test_status_post_reply_fixture_send(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """send posts the recorded form and returns the recorded reply id and url (Mastodon answers 200)."""
    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json")))
    sent = make(fixture_server.url, http_client).send(parent(), "same!", provider_key="key-1")
    assert sent == Sent(reply_id="117020583258292382", url="http://localhost:3000/@admin/117020583258292382")
    [rec] = fixture_server.requests
    assert rec.form() == {
        "status": "@mastodonpy_test_2 same!",
        "in_reply_to_id": "117020583245459824",
        "visibility": "public",
    }
    assert rec.headers["idempotency-key"] == "key-1"


def test_a_prompt_injection_in_a_direct_thread_addresses_only_the_author(
        fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A direct status goes to every account it mentions: a reply echoing mentions names only the author, posted
    and edited; ``allow_mentions`` lets them through."""
    from tests.test_mentions import INJECTION, at_pings, injected

    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json")))
    fixture_server.route("PUT", f"{STATUSES}/117020583258292382", Reply(body={"id": "117020583258292382"}))
    p = dataclasses.replace(parent(visibility="direct"), text=f"{INJECTION} @mastodonpy_test_2")
    make(fixture_server.url, http_client).send(p, injected(p), provider_key="key-1")
    make(fixture_server.url, http_client).edit(p, "117020583258292382", injected(p))
    make(fixture_server.url, http_client, allow_mentions=True).send(p, injected(p), provider_key="key-2")
    sent, edited, loose = (rec.form() for rec in fixture_server.requests)
    assert sent["visibility"] == "direct"
    assert at_pings(sent["status"]) == at_pings(edited["status"]) == ["mastodonpy_test_2"]
    assert "mallory@evil.example" in at_pings(loose["status"])


def test_account_statuses_fixture_read_back(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded own feed (no replies) conclusively checks a parent opened after its oldest post."""
    fixture_server.route("GET", FEED, Reply(body=fx("account_statuses.json"), headers={"link": STATUSES_LINK}))
    pid = "117020577157693549"
    clock = FakeClock()
    rb = in_sync(make(fixture_server.url, http_client, clock), clock).read_back(
        [Pending(parent=Parent(id=pid, author_id="x"), opened_at=epoch("2026-08-01T13:55:00Z"))],
        sender_id=SENDER,
    )
    assert rb.checked == {pid}
    assert rb.found == {}
    [rec] = fixture_server.requests
    assert rec.param("limit") == "40"


def test_recorded_404_is_rejected(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded 404 body of GET /statuses/0 becomes Rejected carrying status 404."""
    fixture_server.route("GET", f"{STATUSES}/0", Reply(status=404, body=fx("error_404_status_not_found.json")))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).resolve("0")
    assert err.value.status == 404
    assert "Not Found" in err.value.detail


def test_recorded_422_is_rejected_in_any_language(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded 422 and its Japanese twin both map to Rejected: the status decides, not the text."""
    japanese = {"error": "バリデーションに失敗しました: Textを入力してください"}
    fixture_server.route(
        "POST", STATUSES, Reply(status=422, body=fx("error_422_status_empty.json")), Reply(status=422, body=japanese)
    )
    p = make(fixture_server.url, http_client)
    for _ in range(2):
        with pytest.raises(Rejected) as err:
            p.send(parent(), "", provider_key="k")
        assert err.value.status == 422


def test_ids_stay_exact_strings(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Ids beyond 64 bits or with leading zeros are kept verbatim from parse to the reply POST."""
    big = "98765432109876543210987"
    item = notification("0000021", big, 1_800_000_000.0)
    item["status"]["account"]["id"] = "00042"
    fixture_server.route("GET", NOTIFICATIONS, Reply(body=[item]))
    fixture_server.route("POST", STATUSES, reply_echo("98765432109876543210988"))
    p = make(fixture_server.url, http_client)
    page = p.inbox(None)
    [par] = page.parents
    assert (par.id, par.author_id, page.cursor) == (big, "00042", "0000021")
    sent = p.send(par, "hi", provider_key="k")
    assert sent.reply_id == "98765432109876543210988"
    assert fixture_server.requests_to("POST", STATUSES)[0].form()["in_reply_to_id"] == big
    assert Parent.from_snapshot(json.loads(json.dumps(par.snapshot()))).id == big


# --- error mapping ---------------------------------------------------------------------------


def test_dns_failure_is_definitely_not_sent(http_client: httpx.Client) -> None:
    """An unresolvable host (reserved .invalid TLD) is DefinitelyNotSent."""
    p = make("http://replyd-test.invalid", http_client, timeout_s=5, allow_insecure_http=True)
    with pytest.raises(DefinitelyNotSent):
        p.send(parent(), "hi", provider_key="k")


def test_connection_cut_mid_response_is_maybe_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A connection cut after the 200 headers (body incomplete) makes send MaybeSent."""
    fixture_server.route("POST", STATUSES, Reply(fault="drop"))
    with pytest.raises(MaybeSent):
        make(fixture_server.url, http_client).send(parent(), "hi", provider_key="k")
    assert len(fixture_server.requests_to("POST", STATUSES)) == 1


@pytest.mark.parametrize(
    "reply",
    [
        Reply(status=500, body={"error": "We're sorry, but something went wrong"}),
        html_error(502),
        html_error(503, "Service Unavailable"),
        Reply(status=504, body=b"upstream timed out", content_type="text/plain"),
    ],
    ids=["500", "502-html", "503-html", "504"],
)
def test_5xx_on_post_is_maybe_sent(reply: Reply, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Any 5xx answer to the POST, JSON or an HTML proxy page, is MaybeSent with its status."""
    fixture_server.route("POST", STATUSES, reply)
    with pytest.raises(MaybeSent) as err:
        make(fixture_server.url, http_client).send(parent(), "hi", provider_key="k")
    assert err.value.status == reply.status


def test_5xx_on_read_is_definitely_not_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 502 page on a read raises DefinitelyNotSent: a GET cannot have created anything."""
    fixture_server.route("GET", NOTIFICATIONS, html_error(502))
    with pytest.raises(DefinitelyNotSent) as err:
        make(fixture_server.url, http_client).inbox(None)
    assert err.value.status == 502


def test_429_retry_after_seconds(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """429 with Retry-After seconds is RateLimited carrying that value."""
    fixture_server.route("POST", STATUSES, Reply(status=429, body={"error": "Too many requests"}, headers={"retry-after": "7"}))
    with pytest.raises(RateLimited) as err:
        make(fixture_server.url, http_client).send(parent(), "hi", provider_key="k")
    assert err.value.retry_after_s == 7.0
    assert err.value.status == 429


def test_429_retry_after_http_date(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """429 with an HTTP-date Retry-After gives the seconds until that date by the injected clock."""
    clock = FakeClock()
    when = email.utils.formatdate(clock.now() + 90, usegmt=True)
    fixture_server.route("POST", STATUSES, Reply(status=429, headers={"retry-after": when}))
    with pytest.raises(RateLimited) as err:
        make(fixture_server.url, http_client, clock).send(parent(), "hi", provider_key="k")
    assert err.value.retry_after_s == pytest.approx(90, abs=1)


def test_429_falls_back_to_reset_header(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """429 without Retry-After uses X-RateLimit-Reset (an ISO time) minus the injected clock's now."""
    clock = FakeClock()
    headers = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": iso(clock.now() + 42.5)}
    fixture_server.route("GET", VERIFY, Reply(status=429, headers=headers))
    with pytest.raises(RateLimited) as err:
        make(fixture_server.url, http_client, clock).whoami()
    assert err.value.retry_after_s == pytest.approx(42.5, abs=0.01)


@pytest.mark.parametrize("status", [400, 404, 409, 410, 413, 422, 418])
def test_4xx_on_post_is_rejected(status: int, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A refusal of the POST (bad request, parent gone, validation, …) is Rejected, not releasable."""
    fixture_server.route("POST", STATUSES, Reply(status=status, body={"error": "nope"}))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).send(parent(), "hi", provider_key="k")
    assert err.value.status == status


@pytest.mark.parametrize("status", [401, 403])
def test_auth_errors_are_definitely_not_sent(status: int, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """401/403 on send mean the server did nothing: DefinitelyNotSent."""
    fixture_server.route(
        "POST",
        STATUSES,
        Reply(status=status, body={"error": "The access token is invalid"},
              headers={"www-authenticate": 'Bearer realm="Doorkeeper", error="invalid_token"'}),
    )
    with pytest.raises(DefinitelyNotSent) as err:
        make(fixture_server.url, http_client).send(parent(), "hi", provider_key="k")
    assert err.value.status == status and not isinstance(err.value, RateLimited)


def test_read_timeout_on_post_is_maybe_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A POST whose answer is slower than timeout_s is MaybeSent (ReadTimeout after sending)."""
    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json"), delay_s=2.0))
    with pytest.raises(MaybeSent) as err:
        make(fixture_server.url, http_client, timeout_s=0.3).send(parent(), "hi", provider_key="k")
    assert "ReadTimeout" in err.value.detail


def test_read_timeout_on_get_is_definitely_not_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A slow read times out as DefinitelyNotSent: reads cannot create."""
    fixture_server.route("GET", VERIFY, Reply(body=fx("verify_credentials.json"), delay_s=2.0))
    with pytest.raises(DefinitelyNotSent) as err:
        make(fixture_server.url, http_client, timeout_s=0.3).whoami()
    assert "ReadTimeout" in err.value.detail


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(body=b'[{"id": "1", '), "inbox: not JSON (application/json)"),
        (Reply(body="<html><body>Maintenance</body></html>", content_type="text/html"), "inbox: not JSON (text/html)"),
        (Reply(body={"error": "surprise"}), "inbox: expected an array at top level, got an object"),
    ],
    ids=["garbage", "html-200", "wrong-type"],
)
def test_malformed_body_on_read_is_bad_response(
    reply: Reply, message: str, fixture_server: FixtureServer, http_client: httpx.Client
) -> None:
    """A wholly malformed 200 body on a read raises BadResponse saying what was wrong."""
    fixture_server.route("GET", NOTIFICATIONS, reply)
    with pytest.raises(BadResponse) as err:
        make(fixture_server.url, http_client).inbox(None)
    assert err.value.detail == message


def test_reply_under_another_parent_is_maybe_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """If the created status answers another parent (a reused key), send does not claim success."""
    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json")))
    with pytest.raises(MaybeSent) as err:
        make(fixture_server.url, http_client).send(parent("999"), "hi", provider_key="k")
    assert "not '999'" in err.value.detail


# --- idempotency and rate limits -------------------------------------------------------------


def test_idempotency_key_identical_across_attempts(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The Idempotency-Key header is sent, and is the same on the retry after a 504."""
    fixture_server.route("POST", STATUSES, Reply(status=504), Reply(body=fx("status_post_reply.json")))
    p = make(fixture_server.url, http_client)
    with pytest.raises(MaybeSent):
        p.send(parent(), "first wording", provider_key="replyd-key-abc")
    assert p.send(parent(), "second wording", provider_key="replyd-key-abc").reply_id == "117020583258292382"
    keys = [r.headers.get("idempotency-key") for r in fixture_server.requests_to("POST", STATUSES)]
    assert keys == ["replyd-key-abc", "replyd-key-abc"]


def test_idempotency_can_be_disabled(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With idempotency = false no Idempotency-Key header is sent."""
    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json")))
    make(fixture_server.url, http_client, idempotency=False).send(parent(), "hi", provider_key="k")
    assert "idempotency-key" not in fixture_server.requests[-1].headers


def test_remaining_zero_blocks_without_network(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """After X-RateLimit-Remaining: 0 with a future reset, the next call raises RateLimited and sends nothing."""
    clock = FakeClock()
    spent = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": iso(clock.now() + 30)}
    fixture_server.route("GET", VERIFY, Reply(body=fx("verify_credentials.json"), headers=spent))
    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json")))
    p = make(fixture_server.url, http_client, clock)
    p.whoami()
    before = len(fixture_server.requests)
    with pytest.raises(RateLimited) as err:
        p.whoami()
    assert err.value.retry_after_s == pytest.approx(30, abs=0.01)
    with pytest.raises(RateLimited):  # the account-wide budget covers posting too
        p.send(parent(), "hi", provider_key="k")
    assert len(fixture_server.requests) == before
    clock.advance(31)
    p.whoami()
    assert len(fixture_server.requests) == before + 1


def test_spent_post_budget_blocks_sends_not_reads(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A spent posting budget (its own bucket on Mastodon) blocks the next send but not reads."""
    clock = FakeClock()
    spent = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": iso(clock.now() + 3600)}
    fixture_server.route("POST", STATUSES, Reply(body=fx("status_post_reply.json"), headers=spent))
    fixture_server.route("GET", VERIFY, Reply(body=fx("verify_credentials.json"), headers=RATE))
    p = make(fixture_server.url, http_client, clock)
    p.send(parent(), "hi", provider_key="k")
    with pytest.raises(RateLimited):
        p.send(parent(), "hi", provider_key="k")
    assert p.whoami().sender_id == "117020457910412882"
    assert len(fixture_server.requests_to("POST", STATUSES)) == 1


def test_429_blocks_until_retry_after(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """After a 429 the adapter itself refuses further calls until Retry-After has passed."""
    clock = FakeClock()
    fixture_server.route(
        "GET", VERIFY, Reply(status=429, headers={"retry-after": "20"}), Reply(body=fx("verify_credentials.json"))
    )
    p = make(fixture_server.url, http_client, clock)
    with pytest.raises(RateLimited):
        p.whoami()
    with pytest.raises(RateLimited) as err:
        p.whoami()
    assert err.value.status is None  # refused locally, no HTTP exchange
    assert len(fixture_server.requests) == 1
    clock.advance(21)
    assert p.whoami().handle == "mastodonpy_test"


# --- read-back ---------------------------------------------------------------------------------


def test_read_back_batched_one_request_closes_several(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """One own-feed page finds replies to several pending parents and checks all, without /context."""
    clock = FakeClock()
    now = clock.now()
    feed = [
        own_status("2000", now - 10, "P1"),
        own_status("1999", now - 20, "P2"),
        own_status("1998", now - 30, None),
        own_status("1997", now - 40, "P1"),  # a duplicate: both are reported, oldest first
        own_status("1996", now - 50, "P3"),
        own_status("1001", now - 4000, "OLD"),
    ]
    fixture_server.route("GET", FEED, Feed(feed))
    pending = [Pending(parent=Parent(id=pid, author_id="a"), opened_at=now - 300) for pid in ("P1", "P2", "P3", "P4")]
    rb = make(fixture_server.url, http_client, clock).read_back(pending, sender_id=SENDER)
    assert rb.checked == {"P1", "P2", "P3", "P4"}
    assert {k: [r.reply_id for r in v] for k, v in rb.found.items()} == {
        "P1": ["1997", "2000"],
        "P2": ["1999"],
        "P3": ["1996"],
    }
    assert len(fixture_server.requests) == 1


def test_read_back_falls_back_to_context(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """When the feed's pages run out before an old parent's window, that parent is read via /context."""
    clock = FakeClock()
    now = clock.now()
    feed = [own_status(str(3000 + i), now - 100 + i, None) for i in range(45)]
    fixture_server.route("GET", FEED, Feed(feed))
    context = fxj("status_context.json")
    context["descendants"][0].update(id="2500", in_reply_to_id="OLD")
    context["descendants"][0]["account"]["id"] = SENDER
    fixture_server.route("GET", f"{STATUSES}/OLD/context", Reply(body=context))
    pending = [
        Pending(parent=Parent(id="NEW", author_id="a"), opened_at=now),
        Pending(parent=Parent(id="OLD", author_id="a"), opened_at=now - 5000),
    ]
    rb = in_sync(make(fixture_server.url, http_client, clock, readback_max_pages=1), clock).read_back(
        pending, sender_id=SENDER)
    assert rb.checked == {"NEW", "OLD"}
    assert [r.reply_id for r in rb.found["OLD"]] == ["2500"]
    assert "NEW" not in rb.found
    assert len(fixture_server.requests_to("GET", FEED)) == 1
    assert len(fixture_server.requests_to("GET", f"{STATUSES}/NEW/context")) == 0


def test_read_back_partial_feed_then_failures(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Page 1 covers the recent parent; page 2 fails and so does the old parent's /context: only the recent one is checked."""
    clock = FakeClock()
    now = clock.now()
    page1 = Feed([own_status(str(3000 + i), now - 100 + i, None) for i in range(40)])
    fixture_server.route("GET", FEED, page1, Reply(status=503))
    fixture_server.route("GET", f"{STATUSES}/OLD/context", html_error(502))
    pending = [
        Pending(parent=Parent(id="NEW", author_id="a"), opened_at=now),
        Pending(parent=Parent(id="OLD", author_id="a"), opened_at=now - 5000),
    ]
    rb = in_sync(make(fixture_server.url, http_client, clock), clock).read_back(pending, sender_id=SENDER)
    assert rb.checked == {"NEW"}
    assert rb.found == {}
    assert len(fixture_server.requests_to("GET", FEED)) == 2


def test_read_back_malformed_feed_item_not_conclusive(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A feed item without account.id could be the reply: the feed is not trusted and /context decides."""
    clock = FakeClock()
    now = clock.now()
    broken = own_status("2001", now - 5, "P1")
    del broken["account"]["id"]
    fixture_server.route("GET", FEED, Feed([broken, own_status("1000", now - 9000, None)]))
    fixture_server.route("GET", f"{STATUSES}/P1/context", Reply(body={"ancestors": [], "descendants": []}))
    rb = make(fixture_server.url, http_client, clock).read_back(
        [Pending(parent=Parent(id="P1", author_id="a"), opened_at=now - 60)], sender_id=SENDER
    )
    assert rb.checked == {"P1"}
    assert len(fixture_server.requests_to("GET", f"{STATUSES}/P1/context")) == 1


def test_read_back_empty_feed_is_conclusive(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """An empty own feed proves there is no reply: the parent is checked and nothing is found."""
    fixture_server.route("GET", FEED, Reply(body=[]))
    rb = make(fixture_server.url, http_client).read_back(
        [Pending(parent=Parent(id="P", author_id="a"), opened_at=0.0)], sender_id=SENDER
    )
    assert rb.checked == {"P"} and rb.found == {}


# --- paging, malformed items, reblogs ------------------------------------------------------------


def test_inbox_pages_forward_along_prev_links(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a cursor, inbox follows prev links (min_id) so a burst bigger than a page is not skipped."""
    items = [notification(str(n), f"5{n:03d}", 1_800_000_000.0 + n) for n in range(9, 21)]
    fixture_server.route("GET", NOTIFICATIONS, Feed(items))
    page = make(fixture_server.url, http_client, page_limit=3).inbox("8")
    assert [p.id for p in page.parents] == [f"5{n:03d}" for n in range(9, 21)]
    assert page.cursor == "20"  # by (len, str): "20" > "9", which plain string order gets wrong
    assert [r.param("min_id") for r in fixture_server.requests] == ["8", "11", "14", "17", "20"]


def test_inbox_max_pages_then_next_poll_continues(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """max_pages bounds one poll; the next poll from the returned cursor gets the rest, nothing skipped."""
    items = [notification(str(n), f"5{n:03d}", 1_800_000_000.0 + n) for n in range(100, 112)]
    fixture_server.route("GET", NOTIFICATIONS, Feed(items))
    p = make(fixture_server.url, http_client, page_limit=3, max_pages=2)
    first = p.inbox("99")
    second = p.inbox(first.cursor)
    third = p.inbox(second.cursor)
    got = [x.id for x in first.parents + second.parents + third.parents]
    assert got == [f"5{n:03d}" for n in range(100, 112)]
    assert (first.cursor, second.cursor, third.cursor) == ("105", "111", "111")


def test_inbox_keeps_old_cursor_when_nothing_new(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """An empty poll returns the old cursor unchanged."""
    fixture_server.route("GET", NOTIFICATIONS, Reply(body=[]))
    page = make(fixture_server.url, http_client).inbox("21")
    assert page.parents == [] and page.cursor == "21"


def test_malformed_items_skipped_with_warning(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A mention missing status.account.id is skipped with a warning naming the field; the rest parse."""
    good = notification("31", "700", 1_800_000_000.0)
    bad = notification("32", "701", 1_800_000_001.0)
    del bad["status"]["account"]["id"]
    fixture_server.route("GET", NOTIFICATIONS, Reply(body=[bad, "junk", good]))
    with capture_logs() as logs:
        page = make(fixture_server.url, http_client).inbox(None)
    assert [p.id for p in page.parents] == ["700"]
    assert page.cursor == "32"  # the bad item is reported and passed, not retried for ever
    skipped = [e for e in logs if e["event"] == "replyd.poller.unreadable"]
    assert skipped[0]["problem"] == "inbox: field status.account.id missing"
    assert skipped[0]["item_id"] == "32"
    assert skipped[0]["log_level"] == "warning"
    assert len(skipped) == 2


def test_reblogs_are_skipped(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A status that is a reblog is not offered as a parent."""
    body = fxj("search_v2.json")
    body["statuses"][0]["reblog"] = copy.deepcopy(body["statuses"][1])
    fixture_server.route("GET", SEARCH, Reply(body=body))
    page = make(fixture_server.url, http_client).search("halcy", None)
    assert [p.id for p in page.parents] == ["116388107849695302"]


def test_refind_pages_back_until_since(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """refind follows next links (max_id) until notifications are older than since, with no cursor."""
    items = [notification(str(n), f"6{n:03d}", 1_800_000_000.0 + n * 10) for n in range(1, 21)]
    fixture_server.route("GET", NOTIFICATIONS, Feed(items))
    found = make(fixture_server.url, http_client, page_limit=4).refind(1_800_000_000.0 + 125)
    assert [p.id for p in found] == [f"6{n:03d}" for n in range(13, 21)]
    assert [r.param("max_id") for r in fixture_server.requests] == [None, "17", "13"]
    assert all(r.param("min_id") is None for r in fixture_server.requests)


# --- resolve, send options, delete -----------------------------------------------------------------


def test_resolve_url_gives_local_served_id(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A remote status URL resolves through v2 search (resolve=true) to the local served id."""
    fixture_server.route("GET", SEARCH, Reply(body=fx("search_v2.json")))
    found = make(fixture_server.url, http_client).resolve("https://icosahedron.website/@greg/116388148912635764")
    assert found.id == "116388149027005349"
    [rec] = fixture_server.requests
    assert (rec.param("resolve"), rec.param("type")) == ("true", "statuses")


def test_resolve_served_id(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A served id is read from /statuses/:id and returned unchanged."""
    fixture_server.route("GET", f"{STATUSES}/117020583258292382", Reply(body=fx("status_post_reply.json")))
    found = make(fixture_server.url, http_client).resolve("117020583258292382")
    assert found.id == "117020583258292382"
    assert found.thread_depth == 1
    assert found.text == "@mastodonpy_test_2 same!"


def test_mention_not_repeated_and_direct_stays_direct(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """An existing @mention is not repeated, and a direct parent gets a direct reply even if config says public."""
    fixture_server.route("POST", STATUSES, reply_echo("9"))
    p = make(fixture_server.url, http_client, visibility="public")
    p.send(parent(visibility="direct"), "hi @MastodonPy_Test_2!", provider_key="k")
    p.send(parent(acct="bob@remote.example", visibility="unlisted"), "@bob@remote.example.org hi", provider_key="k")
    forms = [r.form() for r in fixture_server.requests_to("POST", STATUSES)]
    assert forms[0]["status"] == "hi @MastodonPy_Test_2!"
    assert forms[0]["visibility"] == "direct"
    # A longer handle is another account: the author is named, the other one defused (a zero-width space).
    assert forms[1]["status"] == "@bob@remote.example @\u200bbob@remote.example.org hi"
    assert forms[1]["visibility"] == "unlisted"


def test_delete_sends_delete_and_tolerates_gone(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """delete issues DELETE /statuses/:id; a 404 (already gone) counts as done, a 500 is MaybeSent."""
    fixture_server.route("DELETE", f"{STATUSES}/42", Reply(body=fx("status_post_reply.json")))
    fixture_server.route("DELETE", f"{STATUSES}/43", Reply(status=404, body=fx("error_404_status_not_found.json")))
    fixture_server.route("DELETE", f"{STATUSES}/44", Reply(status=500))
    p = make(fixture_server.url, http_client)
    p.delete("42")
    p.delete("43")
    with pytest.raises(MaybeSent):
        p.delete("44")
    assert [r.path for r in fixture_server.requests] == [f"{STATUSES}/42", f"{STATUSES}/43", f"{STATUSES}/44"]


# --- secrets ----------------------------------------------------------------------------------------


# --- shared helpers (_http) -----------------------------------------------------------------------


def test_parse_link_header_recorded_values() -> None:
    """The recorded Mastodon Link headers parse into rel → URL and their page cursors."""
    links = _http.parse_link_header(STATUSES_LINK)
    assert links["next"].endswith("max_id=117020580489281910")
    assert links["prev"].endswith("min_id=117020580518794573")
    resp = httpx.Response(200, headers={"link": NOTIF_LINK})
    assert _http.link_param(resp, "next", "max_id") == "21"
    assert _http.link_param(resp, "prev", "min_id") == "21"
    assert _http.link_param(resp, "last", "page") is None
    assert _http.parse_link_header('<https://x/?a=1,2>; rel="next last"') == {"next": "https://x/?a=1,2", "last": "https://x/?a=1,2"}
    assert _http.parse_link_header(None) == {}


def test_retry_after_forms() -> None:
    """retry_after_s reads seconds, HTTP-dates, ISO and epoch reset headers, and never goes negative."""
    now = 1_800_000_000.0
    assert _http.retry_after_s(httpx.Response(429, headers={"retry-after": "12"}), now) == 12.0
    date = email.utils.formatdate(now + 60, usegmt=True)
    assert _http.retry_after_s(httpx.Response(429, headers={"retry-after": date}), now) == pytest.approx(60)
    assert _http.retry_after_s(httpx.Response(429, headers={"x-ratelimit-reset": iso(now + 5)}), now) == pytest.approx(5)
    assert _http.retry_after_s(httpx.Response(429, headers={"x-ratelimit-reset": str(int(now + 9))}), now) == 9.0
    assert _http.retry_after_s(httpx.Response(429, headers={"retry-after": "-3"}), now) == 0.0
    assert _http.retry_after_s(httpx.Response(429), now) is None


def test_iso_to_epoch_and_html_to_text() -> None:
    """ISO times with Z, offsets or no zone parse to epoch; HTML keeps text with br and /p as newlines."""
    assert _http.iso_to_epoch("2026-08-01T13:51:43.458Z") == pytest.approx(1785592303.458)
    assert _http.iso_to_epoch("2026-08-01T15:51:43.458+02:00") == pytest.approx(1785592303.458)
    assert _http.iso_to_epoch("2026-08-01T13:51:43.458") == pytest.approx(1785592303.458)
    with pytest.raises(ValueError):
        _http.iso_to_epoch("yesterday")
    assert _http.html_to_text("<p>a<br>b<br/>c</p><p>d &amp; <span class=\"invisible\">https://</span>e</p>") == (
        "a\nb\nc\nd & https://e"
    )


# --- thread depth ------------------------------------------------------------------------------

CONTEXT_PID = "110446983926957470"  # the recorded status_context.json is this status's context
CONTEXT_PATH = f"{STATUSES}/{CONTEXT_PID}/context"


def ancestor(sid: str, in_reply_to: str | None) -> dict[str, Any]:
    """An ancestor status cloned from the recorded context's one."""
    item = copy.deepcopy(fxj("status_context.json")["ancestors"][0])
    item.update(id=sid, in_reply_to_id=in_reply_to)
    return item


def reply_parent(pid: str, in_reply_to: str | None) -> Parent:
    """A parent as inbox parses a reply: thread_depth 1 and its in_reply_to_id in extra."""
    return Parent(id=pid, author_id="43", thread_depth=1, extra={"in_reply_to_id": in_reply_to})


def test_thread_depth_top_level_costs_no_request(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A status with no in_reply_to_id is depth 0, a reply under limit 0 is 1: nothing is requested."""
    top = Parent(id="1", author_id="43", thread_depth=0, extra={"in_reply_to_id": None})
    p = make(fixture_server.url, http_client)
    assert p.thread_depth(top, 3) == 0
    assert p.thread_depth(reply_parent("2", "1"), 0) == 1  # a reply is already past limit 0
    assert fixture_server.requests == []


def test_thread_depth_recorded_context_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded context (one ancestor, a root) gives depth 1 with one /context request."""
    fixture_server.route("GET", CONTEXT_PATH, Reply(body=fx("status_context.json"), headers=RATE))
    p = make(fixture_server.url, http_client)
    assert p.thread_depth(reply_parent(CONTEXT_PID, "110446983178245440"), 5) == 1
    assert [r.path for r in fixture_server.requests] == [CONTEXT_PATH]
    assert p.limits.snapshot()["api"][0] == 299  # the read went through the rate-limit bookkeeping


def test_thread_depth_one_request_capped_at_limit_plus_one(fixture_server: FixtureServer,
                                                           http_client: httpx.Client) -> None:
    """Four listed ancestors: depth 4 under limit 10, capped at limit + 1 under limit 1; one request each."""
    chain = [ancestor("11", None), ancestor("12", "11"), ancestor("13", "12"), ancestor("14", "13")]
    fixture_server.route("GET", f"{STATUSES}/15/context", Reply(body={"ancestors": chain, "descendants": []}))
    p = make(fixture_server.url, http_client)
    assert p.thread_depth(reply_parent("15", "14"), 10) == 4
    assert p.thread_depth(reply_parent("15", "14"), 1) == 2
    assert len(fixture_server.requests) == 2


@pytest.mark.parametrize(
    ("listed", "in_reply_to", "depth"),
    [
        ([("11", None), ("12", "11")], "13", 3),  # 13 is not shown (private, muted, deleted)
        ([("11", None), ("13", "12")], "13", 3),  # 12 is not shown: a gap in the middle
        ([("12", "11")], "12", 2),  # 11 is not shown: the chain is cut at the top
        ([], "12", 1),  # nothing shown at all: the parent is still a reply
    ],
    ids=["nearest-hidden", "middle-hidden", "top-cut", "none-listed"],
)
def test_thread_depth_counts_each_broken_link_once(listed: list[tuple[str, str | None]], in_reply_to: str,
                                                   depth: int, fixture_server: FixtureServer,
                                                   http_client: httpx.Client) -> None:
    """Ancestors Mastodon does not show this account break the in_reply_to_id links; each break counts one."""
    body = {"ancestors": [ancestor(s, r) for s, r in listed], "descendants": []}
    fixture_server.route("GET", f"{STATUSES}/20/context", Reply(body=body))
    with capture_logs() as logs:
        assert make(fixture_server.url, http_client).thread_depth(reply_parent("20", in_reply_to), 10) == depth
    assert any(e["event"] == "replyd.mastodon.thread_gaps" for e in logs)


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(body={"ancestors": "nope", "descendants": []}), "thread_depth: field ancestors is a string, not list"),
        (Reply(body={"descendants": []}), "thread_depth: field ancestors missing"),
        (Reply(body={"ancestors": [7]}), "thread_depth: ancestor is not an object"),
        (Reply(body={"ancestors": [{"in_reply_to_id": None}]}), "thread_depth: field id missing"),
        (Reply(body=b'{"ancestors": ['), "thread_depth: not JSON (application/json)"),
        (Reply(body=[]), "thread_depth: expected an object at top level, got an array"),
    ],
    ids=["ancestors-string", "ancestors-missing", "item-number", "item-no-id", "garbage", "array"],
)
def test_thread_depth_malformed_context_is_bad_response(reply: Reply, message: str, fixture_server: FixtureServer,
                                                        http_client: httpx.Client) -> None:
    """A /context body of the wrong shape raises BadResponse naming what was wrong."""
    fixture_server.route("GET", f"{STATUSES}/20/context", reply)
    with pytest.raises(BadResponse) as err:
        make(fixture_server.url, http_client).thread_depth(reply_parent("20", "19"), 3)
    assert err.value.detail == message


@pytest.mark.parametrize(
    ("reply", "cls"),
    [
        (html_error(502), DefinitelyNotSent),
        (Reply(status=503, body={"error": "down"}), DefinitelyNotSent),
        (Reply(status=429, body={"error": "Too many requests"}, headers={"retry-after": "7"}), RateLimited),
        (Reply(status=404, body=fx("error_404_status_not_found.json")), Rejected),
        (Reply(status=401, body={"error": "The access token is invalid"}), DefinitelyNotSent),
    ],
    ids=["502-html", "503", "429", "404-recorded", "401"],
)
def test_thread_depth_errors_map_like_other_reads(reply: Reply, cls: type, fixture_server: FixtureServer,
                                                  http_client: httpx.Client) -> None:
    """Failed /context reads map exactly as the adapter's other GETs: 5xx is DefinitelyNotSent, 429 RateLimited."""
    fixture_server.route("GET", f"{STATUSES}/20/context", reply)
    with pytest.raises(cls) as err:
        make(fixture_server.url, http_client).thread_depth(reply_parent("20", "19"), 3)
    assert type(err.value) is cls and err.value.status == reply.status


def test_thread_depth_respects_a_spent_budget(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With X-RateLimit-Remaining 0 and a future reset, thread_depth refuses locally without a request."""
    clock = FakeClock()
    spent = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": iso(clock.now() + 30)}
    fixture_server.route("GET", CONTEXT_PATH, Reply(body=fx("status_context.json"), headers=spent))
    p = make(fixture_server.url, http_client, clock)
    target = reply_parent(CONTEXT_PID, "110446983178245440")
    assert p.thread_depth(target, 3) == 1
    with pytest.raises(RateLimited) as err:
        p.thread_depth(target, 3)
    assert err.value.status is None and len(fixture_server.requests) == 1
    clock.advance(31)
    assert p.thread_depth(target, 3) == 1
    assert len(fixture_server.requests) == 2


def test_thread_depth_transport_failures(http_client: httpx.Client) -> None:
    """A refused connection on the /context read is DefinitelyNotSent."""
    with pytest.raises(DefinitelyNotSent):
        make(closed_port_url(), http_client).thread_depth(reply_parent("20", "19"), 3)


# --- thread depth against the simulated Mastodon (replyd.sim over real HTTP) ----------------------


@pytest.fixture(scope="module")
def sim_server() -> Any:
    """One in-thread sim server for this module, on a fake clock with no listing delay."""
    from replyd.sim import SimServer, World

    world = World(FakeClock())
    with SimServer(world) as srv:
        yield srv


def test_thread_depth_on_the_sim_reply_chain(sim_server: Any, http_client: httpx.Client) -> None:
    """On the sim, a chain root → r1 → r2 → r3 → r4 resolves to depths 0..4; hidden and deleted ancestors still count."""
    world = sim_server.world
    world.reset(seed=0, keep_accounts=False)
    world.configure(listing_delay_s=0)
    bot = world.add_account("replybot", bot=True)
    alice, bob, carol = world.add_account("alice"), world.add_account("bob"), world.add_account("carol")
    chain = [world.post(alice, "a thread root")]
    for n in range(1, 5):
        chain.append(world.post(bob if n % 2 else alice, f"reply level {n}", in_reply_to_id=chain[-1].id))
    p = MastodonPlatform.from_settings({"base_url": sim_server.base_url, "token": bot.token},
                                       http=http_client, clock=world.clock)
    parents = [p.resolve(st.id) for st in chain]
    assert [q.thread_depth for q in parents] == [0, 1, 1, 1, 1]
    assert [p.thread_depth(q, 10) for q in parents] == [0, 1, 2, 3, 4]
    assert p.thread_depth(parents[4], 2) == 3  # capped at limit + 1
    # a private post in the chain (not shown to the bot) and a deleted one: each still counts one
    hidden = world.post(carol, "a private aside", in_reply_to_id=chain[4].id, visibility="private")
    after_hidden = world.post(alice, "level 6", in_reply_to_id=hidden.id)
    assert p.thread_depth(p.resolve(after_hidden.id), 10) == 6
    world.delete(bob, chain[1].id)
    assert p.thread_depth(parents[4], 10) == 4
    assert p.thread_depth(parents[2], 10) == 2
