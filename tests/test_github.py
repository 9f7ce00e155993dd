"""The GitHub adapter over real local HTTP: recorded bodies, error mapping, write pacing, paging, and a stateful fake."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.errors import (
    BadResponse,
    DefinitelyNotSent,
    MaybeSent,
    RateLimited,
    Rejected,
)
from replyd.guard import Guard, Status
from replyd.platforms.base import Identity, Parent, Pending, Platform, Sent
from replyd.platforms import _http
from replyd.platforms.github import GitHubPlatform
from replyd.sweep import Bot, Sweeper
from tests.fakes_forum import (  # noqa: F401  (pytest finds the fixtures by name)
    FakeGitHub,
    FakeHost,
    fresh_store,
    injection_pings_only_the_author,
    iso_s,
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

TOKEN = "ghp_SECRETtok0123456789abcdefghijABCDEF"
RATE = {"x-ratelimit-limit": "5000", "x-ratelimit-remaining": "4998", "x-ratelimit-reset": "1770754529",
        "x-ratelimit-resource": "core"}
# Recorded Link headers (shared/fixtures/SOURCES.md); they point at api.github.com, not this server.
SEARCH_LINK = (
    '<https://api.github.com/search/issues?sort=created&q=repo%3Ahub4j%2Fgithub-api+is%3Aissue+is%3Aclosed&page=2>; '
    'rel="next", <https://api.github.com/search/issues?sort=created&q=repo%3Ahub4j%2Fgithub-api+is%3Aissue+is%3Aclosed&page=19>; rel="last"'
)
NOTIF_LINK = (
    '<https://api.github.com/notifications?all=true&since=1970-01-01T00%3A00%3A00Z&page=22>; rel="prev", '
    '<https://api.github.com/notifications?all=true&since=1970-01-01T00%3A00%3A00Z&page=1>; rel="first"'
)
REPO_COMMENTS_LINK = (
    '<https://api.github.com/repositories/417862/issues/comments?page=2>; rel="next", '
    '<https://api.github.com/repositories/417862/issues/comments?page=73>; rel="last"'
)


def fx(name: str) -> bytes:
    """A recorded GitHub body, byte for byte."""
    return load_fixture("github", name)


def fxj(name: str) -> Any:
    """A recorded GitHub body, parsed."""
    return json.loads(fx(name))


def in_sync(p: GitHubPlatform) -> GitHubPlatform:
    """``p`` with its platform clock measured in step with its own (one exact sample): these recorded servers
    serve no Date, and an unmeasured clock sends every ``since`` a day early."""
    now = p._clock.now()
    p.platform_clock.note(now, 0.0, now, now, "created")
    return p


def make(url: str, http: httpx.Client, clock: FakeClock | None = None, **settings: Any) -> GitHubPlatform:
    """An adapter for ``url`` with the test token."""
    return GitHubPlatform.from_settings({"api_url": url, "token": TOKEN, **settings}, http=http, clock=clock or FakeClock())


def issue_body(repo: str, number: int, iid: int, *, pr: bool = False, **changes: Any) -> dict[str, Any]:
    """An issue as /repos/{o}/{r}/issues/{n} serves it, cloned from the recorded search item."""
    body = copy.deepcopy(fxj("search_issues.json")["items"][0])
    body.pop("score")
    base = f"https://api.github.com/repos/{repo}"
    body.update(url=f"{base}/issues/{number}", repository_url=base, id=iid, number=number, **changes)
    if pr:
        body["pull_request"] = {"url": f"{base}/pulls/{number}"}
    return body


def parent(repo: str = "hub4j-test-org/GHIssueTest", number: int = 15, pid: str = "1382059470") -> Parent:
    """A parent as inbox would return it."""
    owner, name = repo.split("/")
    return Parent(id=pid, author_id="1", extra={"owner": owner, "repo": name, "number": number})


COMMENTS = "/repos/hub4j-test-org/GHIssueTest/issues/15/comments"


# --- settings and registration ------------------------------------------------------------


def test_settings_defaults_and_instance(http_client: httpx.Client) -> None:
    """from_settings fills the documented defaults; the instance derives from api_url."""
    p = GitHubPlatform.from_settings({"token": TOKEN}, http=http_client, clock=FakeClock())
    assert p.instance == "github:https://api.github.com"
    assert p.listing_delay_s == 60.0 and (p._wpm, p._wph) == (80, 500)
    assert p.kind == "github" and isinstance(p, Platform)
    q = make("https://ghe.example/api/v3/", http_client, repos=["acme/widgets"], instance="github:corp", writes_per_minute=10)
    assert (q.instance, q._repos, q._wpm) == ("github:corp", ("acme/widgets",), 10)
    assert make("https://ghe.example/api/v3/", http_client).instance == "github:https://ghe.example/api/v3"


# --- every recorded fixture parses -----------------------------------------------------------


def test_user_fixture_whoami(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """whoami parses the recorded /user; the id is a string, and the API headers and Bearer token are sent."""
    fixture_server.route("GET", "/user", Reply(body=fx("user.json"), headers=RATE))
    assert make(fixture_server.url, http_client).whoami() == Identity(sender_id="40047636", handle="Anonycoders")
    rec = fixture_server.requests[-1]
    assert rec.headers["authorization"] == f"Bearer {TOKEN}"
    assert rec.headers["x-github-api-version"] == "2022-11-28"
    assert rec.headers["accept"] == "application/vnd.github+json"


def test_login_setting_reads_users_endpoint(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With login set (installation tokens cannot read /user), whoami reads /users/{login}."""
    fixture_server.route("GET", "/users/my-app%5Bbot%5D", Reply(body=fx("user.json")))
    fixture_server.route("GET", "/users/my-app[bot]", Reply(body=fx("user.json")))
    assert make(fixture_server.url, http_client, login="my-app[bot]").whoami().sender_id == "40047636"


def test_notifications_fixture_inbox(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded last page: only the mention thread is a parent; its /pulls/84 URL resolves to /issues/84."""
    fixture_server.route("GET", "/notifications", Reply(body=fx("notifications.json"), headers={"link": NOTIF_LINK}))
    fixture_server.route("GET", "/repos/openrisc/mor1kx/issues/84", Reply(body=issue_body("openrisc/mor1kx", 84, 461234567, pr=True)))
    page = make(fixture_server.url, http_client).inbox(None)
    [p] = page.parents
    assert (p.id, p.extra["owner"], p.extra["repo"], p.extra["number"], p.extra["pull_request"]) == (
        "461234567", "openrisc", "mor1kx", 84, True,
    )
    assert [r.path for r in fixture_server.requests] == ["/notifications", "/repos/openrisc/mor1kx/issues/84"]
    assert fixture_server.requests[0].param("all") == "true" and fixture_server.requests[0].param("since") is None
    mark = json.loads(page.cursor)["notifications"]
    newest = _http.iso_to_epoch("2019-07-05T21:37:24Z")
    # Only threads inside the re-read overlap behind the newest are remembered.
    assert mark == {"at": newest, "seen": {f"528402703@{newest}": newest}}


def test_search_issues_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded search page parses into 30 parents with exact string ids; without a cursor the next link is not followed."""
    fixture_server.route("GET", "/search/issues", Reply(body=fx("search_issues.json"), headers={"link": SEARCH_LINK}))
    page = make(fixture_server.url, http_client).search("repo:hub4j/github-api is:issue is:closed", None)
    assert len(page.parents) == 30
    newest = page.parents[-1]
    assert (newest.id, newest.extra["number"], newest.author_id) == ("3495762524", 2150, "14809736")
    assert newest.extra["node_id"] == "I_kwDOAAlq-s7QXRpc" and newest.text.startswith("Add new DYNAMIC event")
    [rec] = fixture_server.requests
    assert (rec.param("sort"), rec.param("order")) == ("created", "desc")
    assert json.loads(page.cursor)["at"] == _http.iso_to_epoch("2025-10-08T14:45:59Z")


def test_search_with_cursor_pages_ascending(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a cursor, search asks created:>= a window back, ascending, follows next links and skips what it saw."""
    items = fxj("search_issues.json")["items"]
    first = {"total_count": 40, "incomplete_results": False, "items": sorted(items, key=lambda i: i["created_at"])[:20]}
    second = {"total_count": 40, "incomplete_results": False, "items": sorted(items, key=lambda i: i["created_at"])[20:]}
    fixture_server.route("GET", "/search/issues", Reply(body=first, headers={"link": SEARCH_LINK}), Reply(body=second))
    seen = sorted(items, key=lambda i: i["created_at"])[0]
    t0 = _http.iso_to_epoch(seen["created_at"])
    cursor = json.dumps({"at": t0, "seen": {str(seen["id"]): t0}})
    page = make(fixture_server.url, http_client).search("is:issue", cursor)
    assert len(page.parents) == 29 and str(seen["id"]) not in {p.id for p in page.parents}
    recs = fixture_server.requests
    assert [r.param("page") for r in recs] == [None, "2"]
    assert recs[0].param("q") == f"is:issue created:>={iso_s(t0 - 900)}" and recs[0].param("order") == "asc"


def test_issue_comment_created_fixture_send(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """send POSTs {"body": …} to the issue's comments and returns the recorded comment id and URL."""
    headers = {"location": "https://api.github.com/repos/hub4j-test-org/GHIssueTest/issues/comments/1254853505", **RATE}
    fixture_server.route("POST", COMMENTS, Reply(status=201, body=fx("issue_comment_created.json"), headers=headers))
    sent = make(fixture_server.url, http_client).send(parent(), "First comment", provider_key="k")
    assert sent == Sent(reply_id="1254853505", url="https://github.com/hub4j-test-org/GHIssueTest/issues/15#issuecomment-1254853505")
    assert fixture_server.requests[-1].form() == {"body": "First comment"}


def test_issue_comments_fixture_fallback(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With the repo-wide listing failing, the parent's own comments (recorded) are read: both own ones, oldest first."""
    fixture_server.route("GET", "/repos/hub4j-test-org/GHIssueTest/issues/comments", Reply(status=500))
    fixture_server.route("GET", COMMENTS, Reply(body=fx("issue_comments.json")))
    rb = make(fixture_server.url, http_client).read_back([Pending(parent(), opened_at=1_663_843_600.0)], sender_id="412878")
    assert [r.reply_id for r in rb.found["1382059470"]] == ["1254853505", "1254853570"]
    assert rb.checked == {"1382059470"}


def test_issue_comments_since_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The per-issue read sends since = opened minus the margin, and the recorded since-body yields only the newer comment."""

    def comments(rec: Recorded) -> Reply:
        since = rec.param("since")
        return Reply(body=fx("issue_comments_since.json") if since == "2022-09-22T10:48:19Z" else b"[]")

    fixture_server.route("GET", "/repos/hub4j-test-org/GHIssueTest/issues/comments", Reply(status=502))
    fixture_server.route("GET", COMMENTS, comments)
    opened = _http.iso_to_epoch("2022-09-22T10:49:19Z")
    rb = in_sync(make(fixture_server.url, http_client)).read_back([Pending(parent(), opened_at=opened)], sender_id="412878")
    assert [r.reply_id for r in rb.found["1382059470"]] == ["1254853570"]


def test_repo_issue_comments_fixture_batched(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """One repo-wide listing (recorded, with its /repositories/{id} next link) closes several parents at once."""
    path = "/repos/octokit/octokit.rb/issues/comments"
    fixture_server.route("GET", path, Reply(body=fx("repo_issue_comments.json"), headers={"link": REPO_COMMENTS_LINK}), Reply(body=b"[]"))
    pending = [Pending(parent("octokit/octokit.rb", n, f"P{n}"), opened_at=1_272_000_000.0) for n in (3, 4, 6, 8)]
    rb = in_sync(make(fixture_server.url, http_client)).read_back(pending, sender_id="865")
    assert {k: [r.reply_id for r in v] for k, v in rb.found.items()} == {
        "P3": ["436604", "439368"], "P6": ["490831"], "P8": ["645961", "655244"],
    }
    assert rb.checked == {"P3", "P4", "P6", "P8"}
    recs = fixture_server.requests
    assert [r.path for r in recs] == [path, path]  # the token never follows the link to another path
    assert [r.param("page") for r in recs] == [None, "2"]
    assert (recs[0].param("sort"), recs[0].param("direction"), recs[0].param("since")) == ("created", "asc", "2010-04-23T05:19:00Z")


def test_error_422_fixture(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The recorded 422 from /notifications is Rejected with GitHub's message."""
    fixture_server.route("GET", "/notifications", Reply(status=422, body=fx("error_422_notifications.json")))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).inbox(None)
    assert err.value.status == 422 and "If-Modified-Since" in err.value.detail


# --- error mapping ---------------------------------------------------------------------------


def test_secondary_limit_403_retry_after_and_local_block(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 403 secondary-limit answer with Retry-After is RateLimited; the next send is refused locally until then."""
    msg = {"message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}
    fixture_server.route("POST", COMMENTS, Reply(status=403, body=msg, headers={"retry-after": "61"}),
                         Reply(status=201, body=fx("issue_comment_created.json")))
    clock = FakeClock()
    p = make(fixture_server.url, http_client, clock)
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert (err.value.retry_after_s, err.value.status) == (61.0, 403)
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.status is None
    assert len(fixture_server.requests) == 1
    clock.advance(62)
    assert p.send(parent(), "x", provider_key="k").reply_id == "1254853505"


@pytest.mark.parametrize(
    ("status", "headers", "message", "wait"),
    [
        (403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1800000042"}, "API rate limit exceeded for user ID 1.", 42.0),
        (429, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1800000030"}, "API rate limit exceeded", 30.0),
        (403, {}, "You have exceeded a secondary rate limit.", 60.0),
        (429, {"retry-after": "5"}, "slow down", 5.0),
    ],
    ids=["403-primary", "429-primary", "403-secondary-no-headers", "429-retry-after"],
)
def test_rate_limit_answers(status: int, headers: dict[str, str], message: str, wait: float,
                            fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Primary (remaining 0: wait for the epoch reset) and secondary (Retry-After, else 60 s) limits are RateLimited."""
    fixture_server.route("POST", COMMENTS, Reply(status=status, body={"message": message}, headers=headers))
    with pytest.raises(RateLimited) as err:
        make(fixture_server.url, http_client, FakeClock(1_800_000_000.0)).send(parent(), "x", provider_key="k")
    assert err.value.retry_after_s == pytest.approx(wait) and err.value.status == status


def test_locked_issue_403_is_rejected(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A 403 that is not a rate limit (locked issue) is a refusal of the target: Rejected."""
    fixture_server.route("POST", COMMENTS, Reply(status=403, body={"message": "Unable to create comment because issue is locked."}))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert err.value.status == 403 and "locked" in err.value.detail


@pytest.mark.parametrize("status", [404, 410, 422])
def test_gone_or_invalid_is_rejected(status: int, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """404 / 410 (issue gone or transferred) and 422 (validation) on the POST are Rejected."""
    fixture_server.route("POST", COMMENTS, Reply(status=status, body={"message": "nope"}))
    with pytest.raises(Rejected) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert err.value.status == status


def test_bad_credentials_not_sent(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """401 Bad credentials: DefinitelyNotSent (the row is released, not rejected)."""
    fixture_server.route("POST", COMMENTS, Reply(status=401, body={"message": "Bad credentials"}))
    with pytest.raises(DefinitelyNotSent) as err:
        make(fixture_server.url, http_client).send(parent(), "x", provider_key="k")
    assert err.value.status == 401 and not isinstance(err.value, RateLimited)


@pytest.mark.parametrize("reply", [Reply(status=500, body={"message": "Server Error"}), html_error(502), Reply(status=504)], ids=["500", "502", "504"])
def test_5xx_post_maybe_sent_get_not_sent(reply: Reply, fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """5xx answering the POST is MaybeSent; answering a GET it is DefinitelyNotSent."""
    fixture_server.route("POST", COMMENTS, reply)
    fixture_server.route("GET", "/user", reply)
    p = make(fixture_server.url, http_client)
    with pytest.raises(MaybeSent) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.status == reply.status
    with pytest.raises(DefinitelyNotSent):
        p.whoami()


def test_transport_failures(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """Refused connect: DefinitelyNotSent (and the write slot is given back); cut answer or timeout after POST: MaybeSent."""
    p = make(closed_port_url(), http_client)
    with pytest.raises(DefinitelyNotSent):
        p.send(parent(), "x", provider_key="k")
    assert p.write_budget() == (0, 0)
    fixture_server.route("POST", COMMENTS, Reply(fault="drop"), Reply(status=201, body=fx("issue_comment_created.json"), delay_s=1.0))
    q = make(fixture_server.url, http_client, timeout_s=0.2)
    with pytest.raises(MaybeSent):
        q.send(parent(), "x", provider_key="k")
    with pytest.raises(MaybeSent) as err:
        q.send(parent(), "x", provider_key="k")
    assert "ReadTimeout" in err.value.detail
    assert q.write_budget() == (2, 2)


def test_malformed_listing_is_bad_response(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A notifications body that is not an array is BadResponse naming the problem."""
    fixture_server.route("GET", "/notifications", Reply(body={"message": "surprise"}))
    with pytest.raises(BadResponse) as err:
        make(fixture_server.url, http_client).inbox(None)
    assert err.value.detail == "inbox: expected an array at top level, got an object"


# --- write pacing and budgets ------------------------------------------------------------------


def test_write_pacing_per_minute_blocks_without_network(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """When the per-minute write budget is spent, send raises RateLimited before any request; it reopens as slots age."""
    fixture_server.route("POST", COMMENTS, Reply(status=201, body=fx("issue_comment_created.json")))
    clock = FakeClock()
    p = make(fixture_server.url, http_client, clock, writes_per_minute=3)
    for _ in range(3):
        p.send(parent(), "x", provider_key="k")
        clock.advance(10)
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.status is None and err.value.retry_after_s == pytest.approx(30.0)
    assert len(fixture_server.requests) == 3
    clock.advance(30.5)
    p.send(parent(), "x", provider_key="k")
    assert len(fixture_server.requests) == 4


def test_write_pacing_per_hour(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """The hourly budget blocks too, with the wait until the oldest write leaves the hour."""
    fixture_server.route("POST", COMMENTS, Reply(status=201, body=fx("issue_comment_created.json")))
    clock = FakeClock()
    p = make(fixture_server.url, http_client, clock, writes_per_hour=4)
    for _ in range(4):
        p.send(parent(), "x", provider_key="k")
        clock.advance(100)
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.retry_after_s == pytest.approx(3200.0)
    assert len(fixture_server.requests) == 4


def test_remaining_zero_blocks_core_not_search(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """x-ratelimit-remaining: 0 on a core answer refuses core calls until the reset; search keeps its own budget."""
    clock = FakeClock(1_800_000_000.0)
    spent = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1800000100", "x-ratelimit-resource": "core"}
    fixture_server.route("GET", "/user", Reply(body=fx("user.json"), headers=spent))
    fixture_server.route("GET", "/search/issues", Reply(body={"total_count": 0, "incomplete_results": False, "items": []},
                                                       headers={"x-ratelimit-resource": "search", "x-ratelimit-remaining": "29"}))
    p = make(fixture_server.url, http_client, clock)
    p.whoami()
    with pytest.raises(RateLimited) as err:
        p.send(parent(), "x", provider_key="k")
    assert err.value.retry_after_s == pytest.approx(100.0)
    p.search("anything", None)
    assert [r.path for r in fixture_server.requests] == ["/user", "/search/issues"]
    assert p.limits.snapshot()["search"] == (29, None)


# --- paging ----------------------------------------------------------------------------------


def test_inbox_repo_listing_pages_and_marks(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a mark, the repo listing is read ascending from a window behind it along next links; seen ones are skipped."""
    t0 = 1_800_000_000.0
    issues = [issue_body("acme/widgets", n, 900 + n, created_at=iso_s(t0 + n), updated_at=iso_s(t0 + n)) for n in range(1, 8)]

    def listing(rec: Recorded) -> Reply:
        n = int(rec.param("page") or 1)
        chunk = issues[(n - 1) * 3 : n * 3]
        link = f'<https://api.github.com/repositories/1/issues?page={n + 1}>; rel="next"' if n * 3 < len(issues) else ""
        return Reply(body=chunk, headers={"link": link} if link else {})

    fixture_server.route("GET", "/repos/acme/widgets/issues", listing)
    cursor = json.dumps({"repos": {"acme/widgets": {"at": t0 + 2, "seen": {f"902@{t0 + 2}": t0 + 2, f"901@{t0 + 1}": t0 + 1}}}})
    page = make(fixture_server.url, http_client, repos=["acme/widgets"], notifications=False).inbox(cursor)
    assert [p.id for p in page.parents] == [str(900 + n) for n in range(3, 8)]
    recs = fixture_server.requests
    assert [r.param("page") for r in recs] == [None, "2", "3"]
    assert (recs[0].param("direction"), recs[0].param("since"), recs[0].param("state")) == ("asc", iso_s(t0 + 2 - 300), "open")
    assert json.loads(page.cursor)["repos"]["acme/widgets"]["at"] == t0 + 7


def test_inbox_notifications_pages_with_mark(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """With a mark, /notifications is read with since = mark minus the overlap, across next links."""
    t0 = 1_800_000_000.0
    tpl = fxj("notifications.json")[4]
    threads = []
    for n in range(1, 6):
        t = copy.deepcopy(tpl)
        t.update(id=str(700 + n), reason="mention", updated_at=iso_s(t0 + n))
        t["subject"]["url"] = f"https://api.github.com/repos/acme/widgets/issues/{n}"
        t["subject"]["type"] = "Issue"
        threads.append(t)
    threads.reverse()  # newest first

    def listing(rec: Recorded) -> Reply:
        n = int(rec.param("page") or 1)
        link = f'<https://api.github.com/notifications?page={n + 1}>; rel="next"' if n * 2 < len(threads) else ""
        return Reply(body=threads[(n - 1) * 2 : n * 2], headers={"link": link} if link else {})

    fixture_server.route("GET", "/notifications", listing)
    for n in range(1, 6):
        fixture_server.route("GET", f"/repos/acme/widgets/issues/{n}", Reply(body=issue_body("acme/widgets", n, 900 + n)))
    cursor = json.dumps({"notifications": {"at": t0, "seen": {}}})
    page = make(fixture_server.url, http_client).inbox(cursor)
    assert sorted(p.id for p in page.parents) == [str(900 + n) for n in range(1, 6)]
    listing_recs = fixture_server.requests_to("GET", "/notifications")
    assert [r.param("page") for r in listing_recs] == [None, "2", "3"]
    assert listing_recs[0].param("since") == iso_s(t0 - 300)


def test_read_back_truncated_listing_falls_back_per_issue(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """A repo listing still going after max_pages is not conclusive: each parent's own comments are read instead."""
    tpl = fxj("issue_comment_created.json")
    fixture_server.route("GET", "/repos/acme/widgets/issues/comments",
                         Reply(body=[tpl], headers={"link": '<https://api.github.com/repositories/1/issues/comments?page=9>; rel="next"'}))
    own = copy.deepcopy(tpl) | {"id": 5555, "issue_url": "https://api.github.com/repos/acme/widgets/issues/3"}
    own["user"] = tpl["user"] | {"id": 77}
    fixture_server.route("GET", "/repos/acme/widgets/issues/3/comments", Reply(body=[own]))
    rb = make(fixture_server.url, http_client, max_pages=2).read_back(
        [Pending(parent("acme/widgets", 3, "P3"), opened_at=1_800_000_000.0)], sender_id="77"
    )
    assert [r.reply_id for r in rb.found["P3"]] == ["5555"] and rb.checked == {"P3"}
    assert len(fixture_server.requests_to("GET", "/repos/acme/widgets/issues/comments")) == 2


def test_resolve_forms(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """owner/repo#n, web issue and PR URLs and API URLs all resolve through /repos/{o}/{r}/issues/{n}; a bare id is refused."""
    fixture_server.route("GET", "/repos/acme/widgets/issues/7", Reply(body=issue_body("acme/widgets", 7, 3_000_000_007)))
    p = make(fixture_server.url, http_client)
    refs = ["acme/widgets#7", "https://github.com/acme/widgets/issues/7", "https://github.com/acme/widgets/pull/7",
            "https://api.github.com/repos/acme/widgets/issues/7"]
    assert {p.resolve(r).id for r in refs} == {"3000000007"}
    with pytest.raises(Rejected):
        p.resolve("3000000007")


def test_thread_depth_is_the_issue_level_without_a_request(fixture_server: FixtureServer,
                                                          http_client: httpx.Client) -> None:
    """Recorded search hits and a comment URL's issue are depth 0, with no request; the value passed is returned."""
    fixture_server.route("GET", "/search/issues", Reply(body=fx("search_issues.json")))
    fixture_server.route("GET", "/repos/acme/widgets/issues/7", Reply(body=issue_body("acme/widgets", 7, 3_000_000_007)))
    p = make(fixture_server.url, http_client)
    parents = p.search("repo:hub4j/github-api is:issue is:closed", None).parents
    parents.append(p.resolve("https://github.com/acme/widgets/issues/7#issuecomment-1254853505"))
    fixture_server.requests.clear()
    assert {q.thread_depth for q in parents} == {0}
    assert [p.thread_depth(q, 0) for q in parents] == [0] * 31
    assert p.thread_depth(Parent(id="1", author_id="2", thread_depth=1), 5) == 1
    assert fixture_server.requests == []


def test_delete_uses_known_repository(fixture_server: FixtureServer, http_client: httpx.Client) -> None:
    """delete finds the comment's repository from the send; a 404 counts as already deleted; unknown repos are refused."""
    fixture_server.route("POST", COMMENTS, Reply(status=201, body=fx("issue_comment_created.json")))
    fixture_server.route("DELETE", "/repos/hub4j-test-org/GHIssueTest/issues/comments/1254853505", Reply(status=204), Reply(status=404))
    p = make(fixture_server.url, http_client)
    rid = p.send(parent(), "x", provider_key="k").reply_id
    p.delete(rid)
    p.delete(rid)
    with pytest.raises(Rejected):
        p.delete("999")


# --- a stateful fake GitHub, end to end through Guard + Sweeper + Store ------------------------


@pytest.fixture(scope="module")
def host() -> Iterator[FakeHost]:
    """One uvicorn server for the module; each test installs a fresh fake GitHub."""
    with FakeHost() as h:
        yield h


@pytest.fixture
def world(host: FakeHost, tmp_path, http_client: httpx.Client, store_template) -> Iterator[dict[str, Any]]:
    """A fresh fake GitHub with acme/widgets, an adapter on it, and guard + sweeper over SQLite in tmp_path."""
    clock = FakeClock()
    fake = FakeGitHub(clock)
    fake.add_repo("acme/widgets")
    host.fake = fake
    plat = GitHubPlatform.from_settings(
        {"api_url": host.url, "token": FakeGitHub.TOKEN, "repos": ["acme/widgets"], "listing_delay_s": 5},
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


def _issue(w: dict[str, Any], **kw: Any) -> Any:
    issue = w["fake"].open_issue(w["alice"], "acme/widgets", "Widgets crash on start", "@replyd-bot please help", **kw)
    w["clock"].advance(1)
    return issue


def _one(w: dict[str, Any]) -> Parent:
    [p] = w["plat"].inbox(None).parents
    return p


def _past_deadline(w: dict[str, Any]) -> None:
    w["clock"].advance(10.0 + w["plat"].listing_delay_s + 1)


def test_e2e_sender_id_is_big_string(world: dict[str, Any]) -> None:
    """whoami's id beyond 2^31 is kept as the exact string; the guard's key uses it."""
    assert world["guard"].identity.sender_id == "4100000001"
    assert world["guard"].key("1").sender_id == "4100000001"


def test_e2e_lost_response_closed_by_sweep(world: dict[str, Any]) -> None:
    """The comment lands but its answer is lost: the sweep finds it in the repo-wide listing and closes the row."""
    issue = _issue(world)
    p = _one(world)
    world["fake"].faults = ["lost"]
    assert world["guard"].post(p, "hello").status is Status.UNCERTAIN
    _past_deadline(world)
    assert world["sweeper"].run_once().closed == 1
    [c] = world["fake"].replies(issue)
    assert world["store"].get(world["guard"].key(p.id)).reply_id == str(c.id)
    assert world["guard"].post(p, "hello").status is Status.ALREADY_ANSWERED
    assert world["fake"].reply_count(issue) == 1 and world["fake"].create_requests == 1
    assert any(r.endswith("/repos/acme/widgets/issues/comments") for r in world["fake"].requests)


def test_e2e_secondary_limit_and_locked_issue(world: dict[str, Any]) -> None:
    """A secondary-limit 403 releases with its Retry-After; a locked issue is rejected for good."""
    issue = _issue(world)
    p = _one(world)
    world["fake"].faults = ["rate_limited"]
    out = world["guard"].post(p, "hi")
    assert out.status is Status.NOT_SENT and out.retry_after_s == pytest.approx(61.0)
    world["clock"].advance(62)
    assert world["guard"].post(p, "hi").status is Status.POSTED
    locked = world["fake"].open_issue(world["alice"], "acme/widgets", "Locked", "@replyd-bot hi")
    locked.locked = True
    world["clock"].advance(1)
    lp = world["plat"].resolve(f"acme/widgets#{locked.number}")
    assert world["guard"].post(lp, "hi").status is Status.REJECTED
    assert world["fake"].reply_count(issue) == 1 and world["fake"].reply_count(locked) == 0


def test_e2e_write_pacing_holds_the_third_send(world: dict[str, Any]) -> None:
    """With writes_per_minute = 2 the third parent is not sent (no request reaches GitHub) until a slot frees."""
    fake, plat = world["fake"], world["plat"]
    plat._wpm = 2
    issues = [fake.open_issue(world["alice"], "acme/widgets", f"Bug {n}", "details") for n in range(3)]
    world["clock"].advance(1)
    parents = plat.inbox(None).parents
    outs = [world["guard"].post(p, "ack").status for p in parents]
    assert outs == [Status.POSTED, Status.POSTED, Status.NOT_SENT]
    assert fake.create_requests == 2
    world["clock"].advance(61)
    assert world["guard"].post(parents[2], "ack").status is Status.POSTED
    assert [fake.reply_count(i) for i in issues] == [1, 1, 1]


def test_e2e_pull_request_keyed_by_issue_id(world: dict[str, Any]) -> None:
    """A PR mention arrives as a /pulls/N notification but is keyed and answered as issue N."""
    pr = world["fake"].open_issue(world["alice"], "acme/widgets", "Fix gears", "@replyd-bot review?", pull_request=True)
    world["clock"].advance(1)
    [p] = world["plat"].inbox(None).parents
    assert p.id == str(pr.id) and p.extra["pull_request"] is True
    assert world["guard"].post(p, "looks good").status is Status.POSTED
    assert world["fake"].reply_count(pr) == 1


def test_e2e_listing_delay_longer_than_configured_duplicates(world: dict[str, Any]) -> None:
    """The measured limit: no provider idempotency, so a real listing delay above the configured one duplicates."""
    issue = _issue(world)
    p = _one(world)
    world["fake"].listing_delay_s = 600.0
    world["fake"].faults = ["lost"]
    assert world["guard"].post(p, "hi").status is Status.UNCERTAIN
    _past_deadline(world)
    assert world["sweeper"].run_once().not_landed == 1
    assert world["guard"].post(p, "hi").status is Status.POSTED
    assert world["fake"].reply_count(issue) == 2


# --- edits of own comments (EditReply: a streamed answer grows its comment) -------------------


def _answered(w: dict[str, Any], text: str = "Looking") -> tuple[Any, Parent, str]:
    """An issue mentioning the bot, answered through the guard: (issue, parent, the comment id)."""
    issue = _issue(w)
    p = _one(w)
    out = w["guard"].post(p, text)
    assert out.status is Status.POSTED
    return issue, p, out.reply_id


def test_e2e_a_prompt_injection_pings_nobody_but_the_author(world: dict[str, Any]) -> None:
    """A reply echoing every mention form (users, teams, groups) keeps only the author's @name live, posted and
    edited, as the fake stores it; ``allow_mentions`` lets them through."""
    from tests.test_mentions import INJECTION

    world["fake"].open_issue(world["alice"], "acme/widgets", "Widgets", f"@replyd-bot {INJECTION} @alice")
    injection_pings_only_the_author(world)


def test_e2e_edit_replaces_the_body_and_read_back_still_finds_one_comment(world: dict[str, Any]) -> None:
    """An edit PATCHes the comment's whole body; the read-back lists the edited comment as the one reply, same id."""
    fake = world["fake"]
    issue, p, cid = _answered(world)
    edit_and_sweep(world, p, cid, ["Looking into it: the gears", "Looking into it: the gears slip on start."],
                   10.0 + world["plat"].listing_delay_s + 1)
    assert fake.reply_count(issue) == 1 and fake.create_requests == 1
    assert f"PATCH /repos/acme/widgets/issues/comments/{cid}" in fake.requests


def test_e2e_edit_lost_answer_is_maybe_sent_and_the_retry_makes_no_second_edit(world: dict[str, Any]) -> None:
    """The edit acts but its answer is lost: MaybeSent; repeating it sets the same body: one edit, one comment."""
    fake, plat = world["fake"], world["plat"]
    issue, p, rid = _answered(world)
    walk_edit_faults(fake, plat, p, rid)
    assert fake.reply_count(issue) == 1 and fake.create_requests == 1


def test_e2e_edit_refused_gone_foreign_locked_or_too_long(world: dict[str, Any]) -> None:
    """A body over 65,536 characters (422), a deleted comment (404), another's comment or a locked issue (403): Rejected."""
    fake, plat = world["fake"], world["plat"]
    issue, p, cid = _answered(world)
    with pytest.raises(Rejected) as err:
        plat.edit(p, cid, "x" * (FakeGitHub.BODY_MAX + 1))
    assert err.value.status == 422 and "too long" in err.value.detail
    plat.edit(p, cid, "x" * FakeGitHub.BODY_MAX)  # the limit itself is allowed
    theirs = fake.comment(world["alice"], issue, "me too")
    with pytest.raises(Rejected) as err:
        plat.edit(p, str(theirs.id), "hijacked")
    assert err.value.status == 403 and fake.reply_text(theirs.id) == "me too"
    issue.locked = True
    with pytest.raises(Rejected) as err:
        plat.edit(p, cid, "after the lock")
    assert err.value.status == 403
    issue.locked = False
    plat.delete(cid)
    with pytest.raises(Rejected) as err:
        plat.edit(p, cid, "after the delete")
    assert err.value.status == 404
    assert fake.edits(cid) == 1 and fake.reply_text(cid) == "x" * FakeGitHub.BODY_MAX
    assert not isinstance(err.value, (MaybeSent, DefinitelyNotSent))


def test_e2e_edit_rate_limited_by_the_secondary_limit_and_the_local_pacing(world: dict[str, Any]) -> None:
    """A secondary-limit 403 is RateLimited with its Retry-After and blocks locally; edits draw on the write budget."""
    fake, plat, clock = world["fake"], world["plat"], world["clock"]
    _, p, cid = _answered(world)
    fake.edit_faults = ["rate_limited"]
    with pytest.raises(RateLimited) as err:
        plat.edit(p, cid, "grown")
    assert err.value.retry_after_s == pytest.approx(61.0) and fake.reply_text(cid) == "Looking"
    with pytest.raises(RateLimited):
        plat.edit(p, cid, "grown")  # refused locally: the wait is not over
    assert fake.edit_requests == 1
    clock.advance(62)
    plat.edit(p, cid, "grown")
    assert fake.reply_text(cid) == "grown"
    plat._wpm = 1  # the edit just made fills this minute's budget: the next waits, no request made
    with pytest.raises(RateLimited) as err:
        plat.edit(p, cid, "grown more")
    assert err.value.status is None and fake.edit_requests == 2
    assert plat.write_budget() == (1, 3)  # the send, the refused edit (it reached GitHub) and the edit


def test_e2e_streamed_answer_grows_one_comment_through_a_lost_edit_answer(world: dict[str, Any]) -> None:
    """A streamed responder through the guard: one comment, grown by PATCHes to the whole answer, an edit whose
    answer was lost repeated safely; the sweep verifies one reply and no duplicate."""
    from tests.test_stream import Streamer

    fake = world["fake"]
    issue = _issue(world)
    p = _one(world)
    words = [f"w{i:02d}" for i in range(20)]
    fake.edit_faults = ["none", "lost"]  # the second edit acts, its answer never comes
    out = world["guard"].post(p, Streamer(world["clock"], words=words, step_s=0.4, asynchronous=False))
    assert out.status is Status.POSTED, out
    [c] = fake.replies(issue)
    assert str(c.id) == out.reply_id and c.body == " ".join(words)
    assert fake.lost_edits == 1 and fake.edits(c.id) >= 2 and fake.create_requests == 1
    _past_deadline(world)
    res = world["sweeper"].run_once()
    assert (res.verified, res.duplicates) == (1, 0)
