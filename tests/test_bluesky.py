"""The Bluesky adapter against a real local HTTP server serving recorded Bluesky bodies.

Behaviour against the real reference network is in ``test_bluesky_network.py``;
here every recorded fixture is parsed, and faults the network cannot be made
to produce on demand (429, dropped connections, odd bodies) are injected.

The session bodies and XRPC error bodies below are not recorded (no recording
exists, see SOURCES.md); their shapes are the ones the @atproto/pds 0.4.217
answered in the dev-env network.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from tests.fixtures_server import (  # noqa: F401  (pytest finds the fixtures by name)
    FixtureServer,
    Reply,
    fixture_server,
    fixture_server_session,
    http_client,
    load_fixture,
)
from replyd.clock import FakeClock
from replyd.errors import (
    AlreadyLanded,
    BadResponse,
    DefinitelyNotSent,
    MaybeSent,
    RateLimited,
    Rejected,
)
from replyd.platforms.base import Identity, Parent, Pending, Platform, Sent
from replyd.platforms import _http
from replyd.platforms.bluesky import (
    DEFAULT_APPVIEW,
    TID_BASE_US,
    BlueskyPlatform,
    is_tid,
    rkey_for,
    tid_decode,
    tid_encode,
)

BOT = "did:plc:iijrtk7ocored6zuziwmqq3c"  # the account the recorded notifications were for
PASSWORD = "app-pass-SECRET-9f8e-7d6c"
ACCESS = "access-JWT-SECRET-0a1b2c3d"
REFRESH = "refresh-JWT-SECRET-4e5f6a7b"
APPVIEW = "did:plc:atzjyk7jekfz3pqhve4y7zok"


def x(nsid: str) -> str:
    """The XRPC path of ``nsid``."""
    return f"/xrpc/{nsid}"


CREATE_SESSION = x("com.atproto.server.createSession")
REFRESH_SESSION = x("com.atproto.server.refreshSession")
GET_SESSION = x("com.atproto.server.getSession")
NOTIFS = x("app.bsky.notification.listNotifications")
SEARCH = x("app.bsky.feed.searchPosts")
FEED = x("app.bsky.feed.getAuthorFeed")
THREAD = x("app.bsky.feed.getPostThread")
POSTS = x("app.bsky.feed.getPosts")
RESOLVE = x("com.atproto.identity.resolveHandle")
CREATE = x("com.atproto.repo.createRecord")
GET_RECORD = x("com.atproto.repo.getRecord")
DELETE = x("com.atproto.repo.deleteRecord")

NOT_FOUND = Reply(status=400, body={"error": "RecordNotFound", "message": "Could not locate record: at://…"})
DUPLICATE_500 = Reply(status=500, body={"error": "InternalServerError", "message": "Internal Server Error"})


def fx(name: str) -> Any:
    """A recorded Bluesky body, parsed."""
    return json.loads(load_fixture("bluesky", name))


def epoch(text: str) -> float:
    """ISO time to epoch seconds."""
    return _http.iso_to_epoch(text)


def session(access: str = ACCESS, refresh: str = REFRESH, did: str = BOT) -> Reply:
    """A createSession/refreshSession answer."""
    return Reply(body={"did": did, "handle": "shinyakato.dev", "accessJwt": access, "refreshJwt": refresh,
                       "active": True})


def make(fs: FixtureServer, http: httpx.Client, clock: FakeClock | None = None, **settings: Any) -> BlueskyPlatform:
    """An adapter on the fixture server, logged in with the canned session."""
    if not fs._routes.get(("POST", CREATE_SESSION)):
        fs.route("POST", CREATE_SESSION, session())
    return BlueskyPlatform.from_settings(
        {"service": fs.url, "identifier": "shinyakato.dev", "app_password": PASSWORD, "appview_did": APPVIEW,
         **settings},
        http=http, clock=clock or FakeClock(),
    )


def parent_from(post: dict[str, Any]) -> Parent:
    """A Parent as inbox would hand it over, built from a recorded post view."""
    rec = post["record"]
    root = rec.get("reply", {}).get("root") or {"uri": post["uri"], "cid": post["cid"]}
    return Parent(id=post["uri"], author_id=post["author"]["did"], author_handle=post["author"]["handle"],
                  extra={"cid": post["cid"], "root_uri": root["uri"], "root_cid": root["cid"]})


def record_answering(uri: str, parent_uri: str, created: str = "2026-11-29T19:24:31.156Z") -> Reply:
    """A getRecord answer: our reply at ``uri`` answering ``parent_uri``."""
    ref = {"uri": parent_uri, "cid": "bafyreidddvd5f37dnvpclrqaradxaagurrhetgfyzxzowaz3zyq6acxtwy"}
    return Reply(body={"uri": uri, "cid": "bafyreihkvibpy72c6b7yacrhgsdsf6g3vnwfvax3tzv2esyakvqfvkkb4e",
                       "value": {"$type": "app.bsky.feed.post", "text": "hi", "createdAt": created,
                                 "reply": {"root": ref, "parent": ref}}})


# --- settings ----------------------------------------------------------------------------


def test_settings_defaults_and_instance(http_client: httpx.Client) -> None:
    """from_settings fills the documented defaults and derives the instance from the service URL."""
    p = BlueskyPlatform.from_settings(
        {"service": "https://pds.example/", "identifier": "@bot.example", "app_password": PASSWORD},
        http=http_client, clock=FakeClock(),
    )
    assert p.instance == "bluesky:https://pds.example"
    assert p.listing_delay_s == 5.0
    assert p.kind == "bluesky"
    assert p._proxy == DEFAULT_APPVIEW
    assert p._identifier == "bot.example"
    assert isinstance(p, Platform)
    q = BlueskyPlatform.from_settings(
        {"service": "http://localhost:2583", "identifier": "did:plc:abc", "app_password": PASSWORD,
         "appview_did": APPVIEW, "listing_delay_s": 2, "instance": "bluesky:dev", "search_queries": ["help"]},
        http=http_client, clock=FakeClock(),
    )
    assert q._proxy == f"{APPVIEW}#bsky_appview"
    assert (q.instance, q.listing_delay_s, q.search_queries) == ("bluesky:dev", 2.0, ["help"])


# --- TIDs --------------------------------------------------------------------------------


def test_tid_codec_matches_published_vectors() -> None:
    """TID encoding matches the atproto spec's layout: zero, a published vector, round trips."""
    assert tid_encode(0, 0) == "2222222222222"
    # @atcute/tid README: TID.create(1724171495793000, 512) -> "3l25zusnsfck2"
    assert tid_encode(1724171495793000, 512) == "3l25zusnsfck2"
    assert tid_decode("3l25zusnsfctk") == (1724171495793000, 816)
    for ts, clock in [(1, 1), (TID_BASE_US, 1023), ((1 << 53) - 1, 0)]:
        assert tid_decode(tid_encode(ts, clock)) == (ts, clock)
    assert not is_tid("kaaaaaaaaaaaa")  # the PDS refuses this one (first char)
    assert not is_tid("3aaaaaaaaaaa") and not is_tid("3aaaaaaaaaaa1")


def test_rkey_is_deterministic_valid_and_in_the_past() -> None:
    """rkey_for gives the same valid TID for the same (sender, parent), a 2000–2008 time, and spreads."""
    parent = "at://did:plc:go4lnp3xq6gmw3bkg3xkape2/app.bsky.feed.post/3n3hwz26pyc2r"
    k = rkey_for(BOT, parent)
    assert k == rkey_for(BOT, parent)
    assert is_tid(k) and re.fullmatch(r"[234567abcdefghij][2-7a-z]{12}", k)
    assert rkey_for("did:plc:other", parent) != k
    assert rkey_for(BOT, parent + "x") != k
    keys = {rkey_for(BOT, f"{parent}{i}") for i in range(5000)}
    assert len(keys) == 5000
    for key in keys:
        ts, _ = tid_decode(key)
        assert TID_BASE_US <= ts < TID_BASE_US + (1 << 48)
        assert datetime.fromtimestamp(ts / 1e6, timezone.utc).year in range(2000, 2009)


def test_provider_key_is_the_rkey(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The adapter's provider_key (what the guard stores and passes to send) is rkey_for."""
    p = make(fixture_server, http_client)
    assert p.provider_key(BOT, "at://a/app.bsky.feed.post/b") == rkey_for(BOT, "at://a/app.bsky.feed.post/b")


# --- recorded fixtures -------------------------------------------------------------------


def test_list_notifications_fixture_inbox(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """listNotifications.json: mentions and replies become parents, oldest first, with root refs."""
    body = fx("listNotifications.json")
    fixture_server.route("GET", NOTIFS, Reply(body=body))
    p = make(fixture_server, http_client)
    page = p.inbox(None)
    wanted = [n for n in body["notifications"] if n["reason"] in ("mention", "reply")]
    assert len(wanted) == 20
    assert [q.id for q in page.parents] == [n["uri"] for n in sorted(wanted, key=lambda n: n["indexedAt"])]
    by_id = {n["uri"]: n for n in wanted}
    for q in page.parents:
        n = by_id[q.id]
        assert q.author_id == n["author"]["did"] and q.author_handle == n["author"]["handle"]
        assert q.text == n["record"]["text"]
        assert q.extra["cid"] == n["cid"]
        root = n["record"].get("reply", {}).get("root") or {"uri": n["uri"], "cid": n["cid"]}
        assert (q.extra["root_uri"], q.extra["root_cid"]) == (root["uri"], root["cid"])
        assert q.thread_depth == (1 if "reply" in n["record"] else 0)
        assert q.url == f"https://bsky.app/profile/{n['author']['handle']}/post/{q.id.rsplit('/', 1)[1]}"
        assert q.created_at == epoch(n["record"]["createdAt"])
    newest = body["notifications"][0]
    assert page.cursor == f"{newest['indexedAt']}|{newest['uri']}"
    [req] = fixture_server.requests_to("GET", NOTIFS)
    assert req.headers["authorization"] == f"Bearer {ACCESS}"
    assert req.headers["atproto-proxy"] == f"{APPVIEW}#bsky_appview"
    assert [v for k, v in req.query if k == "reasons"] == ["mention", "reply"]
    assert req.param("cursor") is None  # no cursor: the newest page only



def test_addressing_reads_mention_facets_and_reply_refs(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Addressing (MCP's addressed scope): a recorded mention or reply addresses the bot when its DID is in a mention
    facet or in the reply's parent/root URI; a reply deeper in a thread the bot only took part in does not (Bluesky
    notifies it, but the post itself does not say so); no post addresses another account."""
    body = fx("listNotifications.json")
    fixture_server.route("GET", NOTIFS, Reply(body=body))
    p = make(fixture_server, http_client)
    parents = p.inbox(None).parents

    def names_bot(n: dict[str, Any]) -> bool:
        r = n["record"]
        refs = [(r.get("reply") or {}).get(k, {}).get("uri", "") for k in ("parent", "root")]
        dids = [f.get("did") for fa in r.get("facets") or [] for f in fa.get("features", [])]
        return BOT in dids or any(u.startswith(f"at://{BOT}/") for u in refs)

    expected = {n["uri"] for n in body["notifications"] if n["reason"] in ("mention", "reply") and names_bot(n)}
    assert len(parents) == 20 and len(expected) == 16
    assert {q.id for q in parents if p.addresses(q, Identity(BOT))} == expected
    assert sum(BOT in q.extra["mention_dids"] for q in parents) == 3  # the three "mention" notifications
    assert not any(p.addresses(q, Identity("did:plc:someoneelse0000000000000")) for q in parents)
    top = Parent(id="at://did:plc:x/app.bsky.feed.post/1", author_id="did:plc:x", extra={"mention_dids": ["bad", 7]})
    assert not p.addresses(top, Identity(BOT))


def test_inbox_cursor_returns_only_newer(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a cursor, only notifications indexed after it (or at it, unseen) come back, in one page."""
    body = fx("listNotifications.json")
    fixture_server.route("GET", NOTIFS, Reply(body=body))
    p = make(fixture_server, http_client)
    wanted = sorted((n for n in body["notifications"] if n["reason"] in ("mention", "reply")),
                    key=lambda n: n["indexedAt"])
    mark = wanted[14]
    page = p.inbox(f"{mark['indexedAt']}|{mark['uri']}")
    assert [q.id for q in page.parents] == [n["uri"] for n in wanted[15:]]
    assert len(fixture_server.requests_to("GET", NOTIFS)) == 1  # the page reached the cursor
    again = p.inbox(page.cursor)
    assert again.parents == [] and again.cursor == page.cursor


def test_inbox_partial_failure_keeps_the_cursor(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """If a later page fails before reaching the cursor, the parents read are offered and the cursor stays."""
    body = fx("listNotifications.json")
    fixture_server.route("GET", NOTIFS, Reply(body=body), Reply(status=502, body="bad gateway"))
    p = make(fixture_server, http_client)
    old = "2023-01-01T00:00:00.000Z"
    page = p.inbox(old)
    assert len(page.parents) == 20 and page.cursor == old
    second = fixture_server.requests_to("GET", NOTIFS)[1]
    assert second.param("cursor") == body["cursor"]


def test_page_budget_ending_before_the_cursor_resumes_there(fixture_server: FixtureServer,
                                                             http_client: httpx.Client) -> None:
    """max_pages ends before the old cursor: the next poll pages on from where it stopped (nothing between is
    skipped), then moves to the newest item the first poll saw; a resume that keeps failing is given up."""
    body = fx("listNotifications.json")
    older = {"notifications": [], "cursor": None}  # the page after: nothing more before the old cursor
    fixture_server.route("GET", NOTIFS, Reply(body=body), Reply(body=older))
    p = make(fixture_server, http_client, max_pages=1)
    old = "2023-01-01T00:00:00.000Z"
    first = p.inbox(old)
    assert len(first.parents) == 20 and first.cursor is not None and first.cursor != old
    second = p.inbox(first.cursor)
    assert second.parents == []
    resumed = fixture_server.requests_to("GET", NOTIFS)[1]
    assert resumed.param("cursor") == body["cursor"]  # where the first poll stopped, not the newest page
    whole = make(fixture_server, http_client)
    fixture_server.route("GET", NOTIFS, Reply(body=body), Reply(body=older))
    assert second.cursor == whole.inbox(old).cursor  # the gap closed: the same cursor as one unlimited poll
    # A listing that no longer takes its own cursor: three failed resumes, then the newest (refind's backstop).
    fixture_server.route("GET", NOTIFS, Reply(body=body), Reply(status=400, body={"error": "InvalidCursor"}))
    cursor = p.inbox(old).cursor
    for _ in range(3):
        page = p.inbox(cursor)
        assert page.parents == []
        cursor = page.cursor
    assert cursor == second.cursor


def test_refind_fixture_pages_back_to_since(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """refind returns mentions and replies indexed at or after since, and stops paging once past it."""
    body = fx("listNotifications.json")
    fixture_server.route("GET", NOTIFS, Reply(body=body))
    p = make(fixture_server, http_client)
    since = epoch("2023-09-02T12:00:00Z")
    got = p.refind(since)
    expected = sorted((n for n in body["notifications"]
                       if n["reason"] in ("mention", "reply") and epoch(n["indexedAt"]) >= since),
                      key=lambda n: n["indexedAt"])
    assert [q.id for q in got] == [n["uri"] for n in expected] and len(got) == 13
    assert len(fixture_server.requests_to("GET", NOTIFS)) == 1


def test_search_posts_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """searchPosts.json parses; the placeholder cursor is never used; a cursor filters and sends since."""
    body = fx("searchPosts.json")
    fixture_server.route("GET", SEARCH, Reply(body=body))
    p = make(fixture_server, http_client)
    page = p.search("fone", None)
    [post] = body["posts"]
    [q] = page.parents
    assert (q.id, q.author_id, q.author_handle, q.text) == (
        post["uri"], post["author"]["did"], post["author"]["handle"], post["record"]["text"])
    assert q.extra["root_uri"] == post["uri"] and q.thread_depth == 0
    assert page.cursor == f"{post['indexedAt']}|{post['uri']}"
    req = fixture_server.requests_to("GET", SEARCH)[0]
    assert (req.param("q"), req.param("sort"), req.param("since")) == ("fone", "latest", None)
    again = p.search("fone", page.cursor)
    assert again.parents == []
    req2 = fixture_server.requests_to("GET", SEARCH)[1]
    assert req2.param("since") == post["indexedAt"] and req2.param("cursor") is None


def test_get_author_feed_fixture_read_back(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """getAuthorFeed.json: a reply to a pending parent is found; coverage decides checked; pages follow cursor."""
    body = fx("getAuthorFeed.json")
    fixture_server.route("GET", GET_RECORD, NOT_FOUND)
    fixture_server.route("GET", FEED, Reply(body=body), Reply(body={"feed": []}))
    p = make(fixture_server, http_client)
    # Measured in step with replyd's clock (one exact sample): the recorded server serves no Date, and an
    # unmeasured clock would read the feed a day further back.
    now = p._clock.now()
    p.platform_clock.note(now, 0.0, now, now, "created")
    mine = next(i["post"] for i in body["feed"] if "reply" in i["post"]["record"])
    target = mine["record"]["reply"]["parent"]["uri"]
    created = epoch(mine["record"]["createdAt"])
    pend = Pending(parent=Parent(id=target, author_id="x"), opened_at=created - 1, provider_key=rkey_for(BOT, target))
    rb = p.read_back([pend], sender_id=BOT)
    assert [r.reply_id for r in rb.found[target]] == [mine["uri"]]
    assert rb.found[target][0].created_at == created
    assert target in rb.checked
    assert len(fixture_server.requests_to("GET", FEED)) == 1  # the first page reached back far enough
    req = fixture_server.requests_to("GET", FEED)[0]
    assert (req.param("actor"), req.param("filter")) == (BOT, "posts_with_replies")
    rec = fixture_server.requests_to("GET", GET_RECORD)[0]
    assert (rec.param("repo"), rec.param("collection"), rec.param("rkey")) == (
        BOT, "app.bsky.feed.post", rkey_for(BOT, target))

    fixture_server.route("GET", FEED, Reply(body=body), Reply(body={"feed": []}))
    old = Parent(id="at://did:plc:q/app.bsky.feed.post/3jaaaaaaaaaa2", author_id="x")
    rb2 = p.read_back([Pending(parent=old, opened_at=epoch("2023-04-01T00:00:00Z"), provider_key=None)],
                      sender_id=BOT)
    assert rb2.found == {} and old.id in rb2.checked  # page 2 was empty: the feed is complete
    assert fixture_server.requests_to("GET", FEED)[-1].param("cursor") == body["cursor"]


def test_read_back_feed_failure_is_not_checked(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A row the feed did not reach (page 2 failed) and no other read settled stays unchecked."""
    body = fx("getAuthorFeed.json")
    fixture_server.route("GET", GET_RECORD, Reply(status=503, body="busy"))
    fixture_server.route("GET", FEED, Reply(body=body), Reply(status=500, body={"error": "InternalServerError"}))
    fixture_server.route("GET", THREAD, Reply(status=500, body={"error": "InternalServerError"}))
    p = make(fixture_server, http_client)
    old = Parent(id="at://did:plc:q/app.bsky.feed.post/3jaaaaaaaaaa2", author_id="x")
    with capture_logs() as logs:
        rb = p.read_back([Pending(parent=old, opened_at=epoch("2023-04-01T00:00:00Z"))], sender_id=BOT)
    assert rb.checked == set() and rb.found == {}
    assert {e.get("source") for e in logs if e["event"] == "replyd.bluesky.read_back_failed"} == {
        "record", "feed", "thread"}


@pytest.mark.parametrize("name", ["getPostThread.json", "getPostThread_embed_images.json"])
def test_get_post_thread_fixtures_read_back(name: str, fixture_server: FixtureServer,
                                            http_client: httpx.Client) -> None:
    """getPostThread fixtures: own direct replies found, complete when all replyCount replies are listed."""
    body = fx(name)
    thread = body["thread"]
    fixture_server.route("GET", GET_RECORD, Reply(status=500, body={"error": "InternalServerError"}))
    fixture_server.route("GET", FEED, Reply(status=500, body={"error": "InternalServerError"}))
    fixture_server.route("GET", THREAD, Reply(body=body))
    p = make(fixture_server, http_client)
    replies = [r["post"] for r in thread.get("replies", [])]
    sender = replies[0]["author"]["did"] if replies else BOT
    pid = thread["post"]["uri"]
    rb = p.read_back([Pending(parent=Parent(id=pid, author_id="x"), opened_at=0.0)], sender_id=sender)
    assert pid in rb.checked
    assert [r.reply_id for r in rb.found.get(pid, [])] == [r["uri"] for r in replies if r["author"]["did"] == sender]
    req = fixture_server.requests_to("GET", THREAD)[0]
    assert (req.param("uri"), req.param("depth")) == (pid, "1")


def test_get_post_thread_fixture_parent_refs(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A post deep in the recorded hellthread resolves with root = its thread root, cid = its own."""
    post = fx("getPostThread.json")["thread"]["post"]
    fixture_server.route("GET", POSTS, Reply(body={"posts": [post]}))
    did = post["author"]["did"]
    fixture_server.route("GET", RESOLVE, Reply(body={"did": did}))
    p = make(fixture_server, http_client)
    rkey = post["uri"].rsplit("/", 1)[1]
    for ref in (post["uri"], f"https://bsky.app/profile/{post['author']['handle']}/post/{rkey}"):
        q = p.resolve(ref)
        assert q.id == post["uri"]
        assert q.extra["cid"] == post["cid"]
        assert q.extra["root_uri"] == post["record"]["reply"]["root"]["uri"]
        assert q.extra["root_cid"] == post["record"]["reply"]["root"]["cid"]
        assert q.extra["in_reply_to"] == post["record"]["reply"]["parent"]["uri"]
        assert q.thread_depth == 1
    assert fixture_server.requests_to("GET", RESOLVE)[0].param("handle") == post["author"]["handle"]
    assert fixture_server.requests_to("GET", POSTS)[-1].param("uris") == post["uri"]


def test_embed_thread_fixture_parses_empty_text(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded recordWithMedia post (empty text) parses as a parent with text ""."""
    post = fx("getPostThread_embed_images.json")["thread"]["post"]
    fixture_server.route("GET", POSTS, Reply(body={"posts": [post]}))
    q = make(fixture_server, http_client).resolve(post["uri"])
    assert (q.id, q.text, q.thread_depth) == (post["uri"], "", 0)


def test_create_record_fixture_send(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """createRecord.json (uri and cid only) is a Sent; the request carries repo, rkey and reply refs."""
    body = fx("createRecord.json")
    rkey = body["uri"].rsplit("/", 1)[1]
    fixture_server.route("POST", CREATE, Reply(body=body))
    clock = FakeClock(start=1_795_980_000.25)
    p = make(fixture_server, http_client, clock=clock, langs=["en"])
    thread_post = fx("getPostThread.json")["thread"]["post"]
    parent = parent_from(thread_post)
    sent = p.send(parent, "hello", provider_key=rkey)
    assert sent == Sent(reply_id=body["uri"], url=f"https://bsky.app/profile/shinyakato.dev/post/{rkey}")
    [req] = fixture_server.requests_to("POST", CREATE)
    data = req.form()
    assert (data["repo"], data["collection"], data["rkey"]) == (BOT, "app.bsky.feed.post", rkey)
    rec = data["record"]
    assert rec["$type"] == "app.bsky.feed.post" and rec["text"] == "hello" and rec["langs"] == ["en"]
    assert rec["createdAt"] == "2026-11-29T19:20:00.250Z"
    root = thread_post["record"]["reply"]["root"]
    assert rec["reply"] == {"root": {"uri": root["uri"], "cid": root["cid"]},
                            "parent": {"uri": thread_post["uri"], "cid": thread_post["cid"]}}
    assert req.headers["authorization"] == f"Bearer {ACCESS}"
    assert "atproto-proxy" not in req.headers


def test_a_prompt_injection_posts_no_mention_facet(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Bluesky notifies only by a mention facet: a reply echoing @handles carries none, so it pings nobody."""
    from tests.test_mentions import INJECTION, injected

    body = fx("createRecord.json")
    fixture_server.route("POST", CREATE, Reply(body=body))
    parent = dataclasses.replace(parent_from(fx("getPostThread.json")["thread"]["post"]),
                                 text=f"{INJECTION} @alice.bsky.social")
    make(fixture_server, http_client).send(parent, injected(parent), provider_key=body["uri"].rsplit("/", 1)[1])
    [req] = fixture_server.requests_to("POST", CREATE)
    assert "@mallory" in req.form()["record"]["text"] and "facets" not in req.form()["record"]


# --- send: what the PDS answers, mapped ----------------------------------------------------


def _target() -> Parent:
    return parent_from(fx("searchPosts.json")["posts"][0])


def test_duplicate_rkey_500_is_already_landed(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A taken rkey (the PDS answers 500) is looked up with getRecord and becomes AlreadyLanded(uri)."""
    parent = _target()
    key = rkey_for(BOT, parent.id)
    uri = f"at://{BOT}/app.bsky.feed.post/{key}"
    fixture_server.route("POST", CREATE, DUPLICATE_500)
    fixture_server.route("GET", GET_RECORD, record_answering(uri, parent.id))
    with pytest.raises(AlreadyLanded) as ei:
        make(fixture_server, http_client).send(parent, "again", provider_key=key)
    assert ei.value.reply_id == uri and ei.value.status == 500
    assert fixture_server.requests_to("GET", GET_RECORD)[0].param("rkey") == key


def test_500_with_nothing_at_the_rkey_is_maybe_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 500 with no record at the rkey is MaybeSent (never a release)."""
    parent = _target()
    fixture_server.route("POST", CREATE, DUPLICATE_500)
    fixture_server.route("GET", GET_RECORD, NOT_FOUND)
    with pytest.raises(MaybeSent) as ei:
        make(fixture_server, http_client).send(parent, "x", provider_key=rkey_for(BOT, parent.id))
    assert not isinstance(ei.value, AlreadyLanded) and ei.value.status == 500


def test_rkey_held_by_another_parent_is_rejected(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """If the rkey holds a reply to another parent (a collision), the send is Rejected, never closed."""
    parent = _target()
    key = rkey_for(BOT, parent.id)
    fixture_server.route("POST", CREATE, DUPLICATE_500)
    fixture_server.route("GET", GET_RECORD, record_answering(f"at://{BOT}/app.bsky.feed.post/{key}",
                                                             "at://did:plc:z/app.bsky.feed.post/3zzzzzzzzzzzz"))
    with pytest.raises(Rejected, match="answers"):
        make(fixture_server, http_client).send(parent, "x", provider_key=key)


@pytest.mark.parametrize("found", [True, False])
def test_dropped_create_response_is_probed(found: bool, fixture_server: FixtureServer,
                                           http_client: httpx.Client) -> None:
    """A connection cut after the create left: AlreadyLanded if the record is there, else MaybeSent."""
    parent = _target()
    key = rkey_for(BOT, parent.id)
    uri = f"at://{BOT}/app.bsky.feed.post/{key}"
    fixture_server.route("POST", CREATE, Reply(fault="drop"))
    fixture_server.route("GET", GET_RECORD, record_answering(uri, parent.id) if found else NOT_FOUND)
    p = make(fixture_server, http_client)
    if found:
        with pytest.raises(AlreadyLanded) as ei:
            p.send(parent, "x", provider_key=key)
        assert ei.value.reply_id == uri
    else:
        with pytest.raises(MaybeSent) as ei:
            p.send(parent, "x", provider_key=key)
        assert not isinstance(ei.value, AlreadyLanded)


def test_read_timeout_on_create_is_maybe_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A create that times out is MaybeSent after a getRecord that finds nothing."""
    parent = _target()
    fixture_server.route("POST", CREATE, Reply(body=fx("createRecord.json"), delay_s=1.5))
    fixture_server.route("GET", GET_RECORD, NOT_FOUND)
    p = make(fixture_server, http_client, timeout_s=0.3)
    with pytest.raises(MaybeSent, match="ReadTimeout"):
        p.send(parent, "x", provider_key=rkey_for(BOT, parent.id))
    assert len(fixture_server.requests_to("GET", GET_RECORD)) == 1


def test_invalid_request_is_rejected(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 400 InvalidRequest (record validation, as the PDS words it) is Rejected."""
    parent = _target()
    fixture_server.route("POST", CREATE, Reply(status=400, body={
        "error": "InvalidRequest",
        "message": "Invalid app.bsky.feed.post record: string too big (maximum 3000, got 5000) at $.record.text"}))
    fixture_server.route("GET", GET_RECORD, NOT_FOUND)
    with pytest.raises(Rejected) as ei:
        make(fixture_server, http_client).send(parent, "x" * 5000, provider_key=rkey_for(BOT, parent.id))
    assert ei.value.status == 400


def test_nested_error_body_is_still_rejected(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 400 whose body nests too deeply to parse is Rejected (not an uncaught RecursionError, not uncertain)."""
    parent = _target()
    fixture_server.route("POST", CREATE, Reply(status=400, body=b'{"error": ' + b"[" * 5000 + b"]" * 5000 + b"}"))
    fixture_server.route("GET", GET_RECORD, NOT_FOUND)
    with pytest.raises(Rejected) as ei:
        make(fixture_server, http_client).send(parent, "x", provider_key=rkey_for(BOT, parent.id))
    assert ei.value.status == 400


def test_429_is_rate_limited_until_ratelimit_reset(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 429 with ratelimit-reset (epoch seconds) is RateLimited, and the next create is refused locally."""
    clock = FakeClock(start=1_795_980_000.0)
    headers = {"ratelimit-limit": "5000", "ratelimit-remaining": "0", "ratelimit-reset": "1795980120",
               "ratelimit-policy": "5000;w=3600"}
    fixture_server.route("POST", CREATE, Reply(status=429, headers=headers,
                                               body={"error": "RateLimitExceeded", "message": "Rate Limit Exceeded"}))
    p = make(fixture_server, http_client, clock=clock)
    parent = _target()
    with pytest.raises(RateLimited) as ei:
        p.send(parent, "x", provider_key=rkey_for(BOT, parent.id))
    assert ei.value.retry_after_s == 120.0
    with pytest.raises(RateLimited):
        p.send(parent, "x", provider_key=rkey_for(BOT, parent.id))
    assert len(fixture_server.requests_to("POST", CREATE)) == 1
    assert fixture_server.requests_to("GET", GET_RECORD) == []  # refused before acting: no probe


def test_non_tid_provider_key_falls_back_to_the_rkey(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A provider_key that is not a TID (an old row) is replaced by the deterministic rkey."""
    parent = _target()
    key = rkey_for(BOT, parent.id)
    fixture_server.route("POST", CREATE, Reply(body={"uri": f"at://{BOT}/app.bsky.feed.post/{key}", "cid": "c"}))
    sent = make(fixture_server, http_client).send(parent, "x", provider_key="a" * 40)
    assert sent.reply_id.endswith(key)
    assert fixture_server.requests_to("POST", CREATE)[0].form()["rkey"] == key


def test_unreadable_2xx_is_probed(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 2xx create with an unreadable body is resolved by getRecord (AlreadyLanded) or MaybeSent."""
    parent = _target()
    key = rkey_for(BOT, parent.id)
    uri = f"at://{BOT}/app.bsky.feed.post/{key}"
    fixture_server.route("POST", CREATE, Reply(body="<html>ok</html>", content_type="text/html"))
    fixture_server.route("GET", GET_RECORD, NOT_FOUND, record_answering(uri, parent.id))
    p = make(fixture_server, http_client)
    with pytest.raises(MaybeSent, match="not JSON"):
        p.send(parent, "x", provider_key=key)
    with pytest.raises(AlreadyLanded) as ei:
        p.send(parent, "x", provider_key=key)
    assert ei.value.reply_id == uri


# --- session -------------------------------------------------------------------------------


def test_expired_token_refreshes_and_retries(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """400 ExpiredToken: refreshSession with the refresh token, then the call is retried once."""
    fixture_server.route("GET", NOTIFS, Reply(status=400, body={"error": "ExpiredToken", "message": "Token has expired"}),
                         Reply(body=fx("listNotifications.json")))
    fixture_server.route("POST", REFRESH_SESSION, session(access="access-2-SECRET", refresh="refresh-2-SECRET"))
    p = make(fixture_server, http_client)
    assert len(p.inbox(None).parents) == 20
    reqs = fixture_server.requests_to("GET", NOTIFS)
    assert [r.headers["authorization"] for r in reqs] == [f"Bearer {ACCESS}", "Bearer access-2-SECRET"]
    assert fixture_server.requests_to("POST", REFRESH_SESSION)[0].headers["authorization"] == f"Bearer {REFRESH}"
    assert len(fixture_server.requests_to("POST", CREATE_SESSION)) == 1


def test_refused_refresh_logs_in_again(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """If the refresh token is refused too, the adapter logs in again with the app password."""
    fixture_server.route("GET", GET_SESSION, Reply(status=400, body={"error": "InvalidToken"}),
                         Reply(body={"did": BOT, "handle": "shinyakato.dev"}))
    fixture_server.route("POST", REFRESH_SESSION, Reply(status=400, body={"error": "ExpiredToken"}))
    fixture_server.route("POST", CREATE_SESSION, session(), session(access="access-3-SECRET"))
    p = make(fixture_server, http_client)
    me = p.whoami()
    assert (me.sender_id, me.handle) == (BOT, "shinyakato.dev")
    assert len(fixture_server.requests_to("POST", CREATE_SESSION)) == 2
    assert fixture_server.requests_to("GET", GET_SESSION)[-1].headers["authorization"] == "Bearer access-3-SECRET"
    body = fixture_server.requests_to("POST", CREATE_SESSION)[0].form()
    assert body == {"identifier": "shinyakato.dev", "password": PASSWORD}


def test_401_after_refresh_is_definitely_not_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A create refused for auth again after the refresh is DefinitelyNotSent (the PDS never acted)."""
    fixture_server.route("POST", CREATE, Reply(status=401, body={"error": "AuthenticationRequired"}))
    fixture_server.route("POST", REFRESH_SESSION, session(access="access-2-SECRET"))
    parent = _target()
    with pytest.raises(DefinitelyNotSent, match="after renewing") as ei:
        make(fixture_server, http_client).send(parent, "x", provider_key=rkey_for(BOT, parent.id))
    assert ei.value.status == 401 and len(fixture_server.requests_to("POST", CREATE)) == 2


def test_bad_login_is_definitely_not_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A refused app password is DefinitelyNotSent and the password is not in the error."""
    fixture_server.route("POST", CREATE_SESSION, Reply(status=401, body={
        "error": "AuthenticationRequired", "message": "Invalid identifier or password"}))
    p = make(fixture_server, http_client)
    with pytest.raises(DefinitelyNotSent) as ei:
        p.send(_target(), "x", provider_key=rkey_for(BOT, _target().id))
    assert PASSWORD not in str(ei.value)
    assert fixture_server.requests_to("POST", CREATE) == []


def test_secrets_never_in_errors_logs_or_repr(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The app password and the JWTs never appear in repr, error details or logs, even if echoed back."""
    fixture_server.route("GET", NOTIFS, Reply(status=400, body={"error": f"bad {ACCESS} {PASSWORD} {REFRESH}"}))
    p = make(fixture_server, http_client)
    with capture_logs() as logs, pytest.raises(Rejected) as ei:
        p.inbox(None)
    text = repr(p) + str(ei.value) + ei.value.detail + json.dumps(logs, default=str) + repr(p._session)
    for secret in (PASSWORD, ACCESS, REFRESH):
        assert secret not in text
    assert "<redacted>" in ei.value.detail


# --- malformed bodies --------------------------------------------------------------------------


def test_malformed_items_skipped_with_warning(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Malformed notifications are skipped with replyd.poller.unreadable; the rest still parse."""
    body = fx("listNotifications.json")
    broken = copy.deepcopy(body)
    mentions = [n for n in broken["notifications"] if n["reason"] == "mention"]
    del mentions[0]["author"]["did"]
    mentions[1]["record"]["reply"] = {"root": "nope"}
    broken["notifications"].insert(3, "not an object")
    broken["notifications"][5]["indexedAt"] = "yesterday"
    fixture_server.route("GET", NOTIFS, Reply(body=broken))
    with capture_logs() as logs:
        page = make(fixture_server, http_client).inbox(None)
    skipped = [e for e in logs if e["event"] == "replyd.poller.unreadable"]
    assert len(skipped) == 4 and all(e["log_level"] == "warning" for e in skipped)
    assert any("author.did" in e["problem"] for e in skipped)
    assert len(page.parents) == 18


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (Reply(body={"notifications": "x"}), "field notifications is a string"),
        (Reply(body={"cursor": "c"}), "field notifications missing"),
        (Reply(body=[1, 2]), "expected an object"),
        (Reply(body="<html></html>", content_type="text/html"), "not JSON"),
    ],
)
def test_wholly_malformed_body_is_bad_response(reply: Reply, match: str, fixture_server: FixtureServer,
                                               http_client: httpx.Client) -> None:
    """A body that is not a notifications listing at all raises BadResponse naming what is wrong."""
    fixture_server.route("GET", NOTIFS, reply)
    with pytest.raises(BadResponse, match=match):
        make(fixture_server, http_client).inbox(None)


def test_resolve_refuses_non_posts(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """resolve refuses refs that are not posts, and a post the AppView does not know."""
    fixture_server.route("GET", POSTS, Reply(body={"posts": []}))
    p = make(fixture_server, http_client)
    for ref in ("hello", "at://did:plc:x/app.bsky.feed.like/3k", "https://bsky.app/profile/a.test",
                "at://did:plc:x/app.bsky.feed.post/3jaaaaaaaaaa2"):
        with pytest.raises(Rejected):
            p.resolve(ref)


def test_delete_record(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """delete sends deleteRecord for an own post, refuses another account's post."""
    fixture_server.route("POST", DELETE, Reply(body={}))
    p = make(fixture_server, http_client)
    p.delete(f"at://{BOT}/app.bsky.feed.post/3jqhxhsrye223")
    assert fixture_server.requests_to("POST", DELETE)[0].form() == {
        "repo": BOT, "collection": "app.bsky.feed.post", "rkey": "3jqhxhsrye223"}
    with pytest.raises(Rejected):
        p.delete("at://did:plc:someone/app.bsky.feed.post/3jqhxhsrye223")


# --- thread depth ------------------------------------------------------------------------


def resolved(fs: FixtureServer, p: BlueskyPlatform, post: dict[str, Any]) -> Parent:
    """``post`` as resolve parses it (getPosts answered with it); the request is forgotten."""
    fs.route("GET", POSTS, Reply(body={"posts": [post]}))
    parent = p.resolve(post["uri"])
    fs.requests.clear()
    return parent


class Chain:
    """getPostThread over a synthetic chain of ``n + 1`` posts (post i answers post i-1), honouring parentHeight."""

    def __init__(self, n: int) -> None:
        self.template = fx("getPostThread.json")["thread"]["post"]
        self.n = n

    def uri(self, i: int) -> str:
        """The URI of post ``i``."""
        return f"at://did:plc:chain/app.bsky.feed.post/{tid_encode(TID_BASE_US + i, 0)}"

    def post(self, i: int) -> dict[str, Any]:
        """Post ``i`` as a post view; post 0 is the root."""
        post = copy.deepcopy(self.template)
        post["uri"] = self.uri(i)
        if i == 0:
            post["record"].pop("reply")
        else:
            post["record"]["reply"] = {"root": {"uri": self.uri(0), "cid": post["cid"]},
                                       "parent": {"uri": self.uri(i - 1), "cid": post["cid"]}}
        return post

    def __call__(self, rec: Any) -> Reply:
        i = int(tid_decode(rec.param("uri").rsplit("/", 1)[1])[0] - TID_BASE_US)
        top = max(0, i - int(rec.param("parentHeight")))
        node: dict[str, Any] | None = None
        for k in range(top, i + 1):
            node = {"$type": "app.bsky.feed.defs#threadViewPost", "post": self.post(k),
                    **({"parent": node} if node is not None else {})}
        return Reply(body={"thread": node})


def test_thread_depth_top_level_costs_no_request(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded top-level post is depth 0, a reply under limit 0 is 1: nothing is requested."""
    p = make(fixture_server, http_client)
    top = resolved(fixture_server, p, fx("getPostThread_embed_images.json")["thread"]["post"])
    reply = resolved(fixture_server, p, fx("getPostThread.json")["thread"]["post"])
    assert (top.thread_depth, reply.thread_depth) == (0, 1)
    assert p.thread_depth(top, 5) == 0
    assert p.thread_depth(reply, 0) == 1
    assert fixture_server.requests_to("GET", THREAD) == []


def test_thread_depth_recorded_hellthread(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded thread: 53 posts above the anchor, then a blockedPost that is not the root: 53 + 1 + the root."""
    body = fx("getPostThread.json")
    fixture_server.route("GET", THREAD, Reply(body=body))
    p = make(fixture_server, http_client)
    anchor = resolved(fixture_server, p, body["thread"]["post"])
    assert p.thread_depth(anchor, 100) == 55
    [req] = fixture_server.requests_to("GET", THREAD)
    assert (req.param("uri"), req.param("depth"), req.param("parentHeight")) == (anchor.id, "0", "101")
    assert req.headers["atproto-proxy"] == f"{APPVIEW}#bsky_appview"


@pytest.mark.parametrize(("limit", "answer"), [(1, 2), (10, 11), (52, 53), (53, 54)])
def test_thread_depth_recorded_hellthread_cut_at_limit(limit: int, answer: int, fixture_server: FixtureServer,
                                                       http_client: httpx.Client) -> None:
    """Even when the server sends the whole chain, counting stops at limit + 1 (the parentHeight asked)."""
    body = fx("getPostThread.json")
    fixture_server.route("GET", THREAD, Reply(body=body))
    p = make(fixture_server, http_client)
    anchor = resolved(fixture_server, p, body["thread"]["post"])
    assert p.thread_depth(anchor, limit) == answer
    assert fixture_server.requests_to("GET", THREAD)[0].param("parentHeight") == str(limit + 1)


@pytest.mark.parametrize("kind", ["notFoundPost", "blockedPost"])
@pytest.mark.parametrize(("is_root", "answer"), [(True, 2), (False, 3)], ids=["root", "mid-thread"])
def test_thread_depth_unseen_parent_counts_and_ends(kind: str, is_root: bool, answer: int,
                                                    fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A notFound or blocked grandparent counts and ends the chain; unless it is the root, the root above counts too."""
    body = copy.deepcopy(fx("getPostThread.json"))
    root = body["thread"]["post"]["record"]["reply"]["root"]["uri"]
    stub: dict[str, Any] = {"$type": f"app.bsky.feed.defs#{kind}",
                            "uri": root if is_root else "at://did:plc:gone/app.bsky.feed.post/3jaaaaaaaaaa2"}
    stub.update({"notFound": True} if kind == "notFoundPost" else {"blocked": True, "author": {"did": "did:plc:x"}})
    body["thread"]["parent"]["parent"] = stub
    fixture_server.route("GET", THREAD, Reply(body=body))
    p = make(fixture_server, http_client)
    assert p.thread_depth(resolved(fixture_server, p, body["thread"]["post"]), 100) == answer


@pytest.mark.parametrize(("is_root", "answer"), [(True, 2), (False, 3)], ids=["root", "mid-thread"])
def test_thread_depth_left_out_parent_counts(is_root: bool, answer: int, fixture_server: FixtureServer,
                                             http_client: httpx.Client) -> None:
    """A reply shown without its parent (outside the thread root, or a threadgate) counts that parent, with a log."""
    body = copy.deepcopy(fx("getPostThread.json"))
    body["thread"]["parent"].pop("parent")  # the AppView stops at a reply although height was left
    if is_root:
        reply = body["thread"]["parent"]["post"]["record"]["reply"]
        reply["parent"] = dict(reply["root"])
    fixture_server.route("GET", THREAD, Reply(body=body))
    p = make(fixture_server, http_client)
    with capture_logs() as logs:
        assert p.thread_depth(resolved(fixture_server, p, body["thread"]["post"]), 100) == answer
    assert any(e["event"] == "replyd.bluesky.thread_cut" for e in logs)


@pytest.mark.parametrize(("n", "limit", "answer", "heights"),
                         [(3, 10, 3, ["11"]), (300, 1000, 300, ["250", "250"]), (700, 600, 601, ["250", "250", "101"])])
def test_thread_depth_pages_long_chains(n: int, limit: int, answer: int, heights: list[str],
                                        fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Past 250 ancestors the count goes on from the topmost post seen, a request per 250, stopping at limit + 1."""
    chain = Chain(n)
    fixture_server.route("GET", THREAD, chain)
    p = make(fixture_server, http_client)
    assert p.thread_depth(resolved(fixture_server, p, chain.post(n)), limit) == answer
    asked = fixture_server.requests_to("GET", THREAD)
    assert [r.param("parentHeight") for r in asked] == heights
    assert [r.param("uri") for r in asked] == [chain.uri(n - 250 * k) for k in range(len(heights))]


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(body={"thread": "x"}), "thread_depth: field thread is a string, not dict"),
        (Reply(body={"thread": {"$type": "app.bsky.feed.defs#blockedPost", "uri": "at://x"}}),
         "thread_depth: thread is a app.bsky.feed.defs#blockedPost"),
        (Reply(body="<html></html>", content_type="text/html"), "thread_depth: not JSON (text/html)"),
        (Reply(body=b'{"thread": ' + b'{"parent": ' * 3000 + b"{}" + b"}" * 3001),
         "thread_depth: JSON nested too deeply to parse"),
    ],
    ids=["thread-string", "anchor-blocked", "html-200", "nested-3000"],
)
def test_thread_depth_malformed_thread_is_bad_response(reply: Reply, message: str, fixture_server: FixtureServer,
                                                       http_client: httpx.Client) -> None:
    """A getPostThread body of the wrong shape, or nested past what json can parse, is BadResponse."""
    fixture_server.route("GET", THREAD, reply)
    p = make(fixture_server, http_client)
    with pytest.raises(BadResponse) as err:
        p.thread_depth(resolved(fixture_server, p, fx("getPostThread.json")["thread"]["post"]), 5)
    assert err.value.detail == message


@pytest.mark.parametrize(
    ("reply", "cls"),
    [
        (Reply(status=502, body={"error": "UpstreamFailure", "message": "Upstream Failure"}), DefinitelyNotSent),
        (Reply(status=400, body={"error": "NotFound", "message": "Post not found: at://…"}), Rejected),
        (Reply(status=429, body={"error": "RateLimitExceeded"}, headers={"ratelimit-reset": "2000000000"}),
         RateLimited),
    ],
    ids=["502", "400-not-found", "429"],
)
def test_thread_depth_errors_map_like_other_reads(reply: Reply, cls: type, fixture_server: FixtureServer,
                                                  http_client: httpx.Client) -> None:
    """A failed getPostThread maps as the adapter's other reads: 5xx DefinitelyNotSent, 4xx Rejected, 429 RateLimited."""
    fixture_server.route("GET", THREAD, reply)
    p = make(fixture_server, http_client)
    with pytest.raises(cls) as err:
        p.thread_depth(resolved(fixture_server, p, fx("getPostThread.json")["thread"]["post"]), 5)
    assert type(err.value) is cls and err.value.status == reply.status


def test_thread_depth_spent_budget_refused_locally(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """After ratelimit-remaining 0 on getPostThread, the next thread_depth is refused without a request."""
    clock = FakeClock(1_900_000_000.0)
    spent = {"ratelimit-limit": "3000", "ratelimit-remaining": "0", "ratelimit-reset": str(int(clock.now() + 60))}
    body = fx("getPostThread.json")
    fixture_server.route("GET", THREAD, Reply(body=body, headers=spent))
    p = make(fixture_server, http_client, clock)
    anchor = resolved(fixture_server, p, body["thread"]["post"])
    assert p.thread_depth(anchor, 3) == 4
    with pytest.raises(RateLimited) as err:
        p.thread_depth(anchor, 3)
    assert err.value.status is None and len(fixture_server.requests_to("GET", THREAD)) == 1
    clock.advance(61)
    assert p.thread_depth(anchor, 3) == 4


@pytest.mark.parametrize("access", ["\x80", "eyJ bad", ""])
def test_session_token_that_cannot_be_a_header_is_refused_cleanly(fixture_server, http_client, access) -> None:
    """A createSession answer whose accessJwt could never be sent as a header is a DefinitelyNotSent, not a crash."""
    fixture_server.route("POST", CREATE_SESSION, session(access=access))
    plat = make(fixture_server, http_client)
    with pytest.raises(DefinitelyNotSent, match="accessJwt is (not a usable token|empty)"):
        plat.whoami()
