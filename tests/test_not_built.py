"""A request that cannot be built is a provable not-sent: released, no attempt, no breaker count, nothing sent.

A value from a parent (an account name with a lone surrogate, a header value it supplies) can make building the
request raise before httpx hands a byte to the transport: a form or JSON body it cannot encode, a header value
with CR, LF or non-ASCII. The HTTP drivers build each request whole first and map what that raises to
``NotBuilt``; the guard releases the row with the reason and a back-off, spends no attempt and tells the write
breaker nothing. Before, the exception was unmapped: the row stayed ``open`` as an uncertain send (swept as
``not_landed``, then retried) and each try counted as a platform failure for the breaker.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
from typing import Any

import httpx
import pytest

from replyd import store as st
from replyd.breaker import Breaker
from replyd.clock import FakeClock
from replyd.config import BreakerConfig
from replyd.errors import NotBuilt
from replyd.guard import Guard, Status
from replyd.platforms import _http
from replyd.platforms.base import Parent
from replyd.platforms.mastodon import MastodonPlatform
from replyd.store import Store
from tests.fixtures_server import (  # noqa: F401  (pytest fixtures by name)
    FixtureServer,
    Recorded,
    Reply,
    fixture_server,
    fixture_server_session,
    load_fixture,
)

# Three failures in a window of five open it: three unbuildable sends would, were they counted.
BREAKER = BreakerConfig(window=5, min_failures=3, failure_ratio=0.6, probe_s=2.0, probe_max_s=8.0)
STATUSES = "/api/v1/statuses"
CASES = {
    "header_crlf": {"headers": {"X-Name": "alice\r\nX-Injected: 1"}},
    "header_non_ascii": {"headers": {"X-Name": "\u00e9l\u00e8ve"}},
    "json_surrogate": {"json": {"text": "hi \ud800"}},
    "json_nan": {"json": {"score": float("nan")}},
    "form_surrogate": {"data": {"status": "@al\udc80ice thanks"}},
}


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_request_that_cannot_be_built_is_not_built_and_never_reaches_the_server(
        fixture_server: FixtureServer, case: str, driver: str) -> None:
    """Both drivers: ``NotBuilt`` (a ``DefinitelyNotSent``), its detail naming the cause and never the value; the
    server saw no request. A request built whole reaches it (the server counts)."""
    fixture_server.route("POST", "/send", Reply(body={}))
    url = fixture_server.url + "/send"

    def run(**kwargs: Any) -> Any:
        steps = _http.request_steps("POST", url, what="send", **kwargs)
        if driver == "sync":
            with _http.make_client(5.0) as client:
                return _http.run_sync(client, steps)

        async def go() -> Any:
            async with _http.make_async_client(5.0) as aclient:
                return await _http.run_async(aclient, steps)

        return asyncio.run(go())

    with pytest.raises(NotBuilt, match="request not built") as got:
        run(**copy.deepcopy(CASES[case]))
    assert "Injected" not in got.value.detail and "alice" not in got.value.detail
    assert fixture_server.requests == []
    assert run(json={"text": "hi"}).status_code == 200 and len(fixture_server.requests) == 1


def _mastodon(server: FixtureServer, clock: FakeClock) -> MastodonPlatform:
    """The Mastodon adapter on the recorded server; its replies answer the parent the form names."""
    body = json.loads(load_fixture("mastodon", "status_post_reply.json"))
    ids = itertools.count(117020583258292400)

    def created(rec: Recorded) -> Reply:
        return Reply(body={**body, "id": str(next(ids)), "in_reply_to_id": rec.form()["in_reply_to_id"]})

    server.route("GET", "/api/v1/accounts/verify_credentials",
                 Reply(body=json.loads(load_fixture("mastodon", "verify_credentials.json"))))
    server.route("POST", STATUSES, created)
    return MastodonPlatform.from_settings({"base_url": server.url, "token": "tok-SECRET-0123456789abcdef"},
                                          http=httpx.Client(trust_env=False, timeout=5.0), clock=clock)


def test_a_parent_whose_account_cannot_be_encoded_is_released_with_no_attempt_or_breaker_count(
        fixture_server: FixtureServer, store: Store, clock: FakeClock) -> None:
    """Three parents whose ``acct`` holds a lone surrogate (the reply's "@acct" makes the form unencodable):
    each is ``not_sent``, its row ``released`` (attempt 1, the reason in its error and event, offered again after
    a doubling back-off), the breaker counts nothing and stays closed, and no POST reached the server. A
    good parent then goes out once."""
    plat = _mastodon(fixture_server, clock)
    me = plat.whoami()
    brk = Breaker(BREAKER, clock, bot="b1", platform=plat.instance)
    guard = Guard(store, plat, me, clock=clock, send_timeout_s=10.0, watch_interval_s=None, breaker=brk,
                  responder_backoff_s=30.0, responder_backoff_max_s=3600.0)
    bad = [Parent(id=f"11700000000000000{i}", author_id=f"9{i}", author_handle=f"al\ud800ice{i}",
                  extra={"acct": f"al\ud800ice{i}@social.example", "visibility": "public"}) for i in range(3)]
    for parent in bad:
        out = guard.post(parent, "thanks", path="inbox")
        assert out.status is Status.NOT_SENT and out.retry_after_s == 30.0, out
        assert "request not built" in out.detail and "UnicodeEncodeError" in out.detail, out
        row = store.get(guard.key(parent.id))
        assert row is not None and row.state == st.RELEASED and row.attempt == 1, row
        assert "request not built" in (row.error or "") and row.not_before == clock.now() + 30.0
        released = [e for e in store.history(guard.key(parent.id)) if e.kind == "released"]
        assert len(released) == 1 and json.loads(released[0].detail)["not_built"] is True
    assert not brk.is_open and not [f for f, _ref in brk._window if f]  # the window holds no failure
    assert fixture_server.requests_to("POST", STATUSES) == []
    clock.advance(31.0)  # offered again once its back-off ran out: released again, the back-off doubled
    again = guard.post(bad[0], "thanks", path="refind")
    assert again.status is Status.NOT_SENT and again.retry_after_s == 60.0, again
    assert store.get(guard.key(bad[0].id)).attempt == 1
    good = dataclasses.replace(bad[0], id="117000000000000009", author_handle="alice",
                               extra={"acct": "alice@social.example", "visibility": "public"})
    assert guard.post(good, "thanks", path="inbox").status is Status.POSTED
    assert [r.form()["in_reply_to_id"] for r in fixture_server.requests_to("POST", STATUSES)] == [good.id]
    assert not brk.is_open



def test_a_parent_whose_repo_cannot_be_in_a_url_is_released_on_github(
        fixture_server: FixtureServer, store: Store, clock: FakeClock) -> None:
    """The request's path: a GitHub parent whose repo name holds a lone surrogate (no URL carries it) is
    ``not_sent`` and ``released`` at attempt 1; the server saw no POST."""
    from replyd.platforms.base import make_platform

    fixture_server.route("GET", "/user", Reply(body=json.loads(load_fixture("github", "user.json"))))
    plat = make_platform("github", {"token": "ghp_notbuilt0123456789abcdef", "api_url": fixture_server.url,
                                    "repos": ["octo/repo"]}, http=httpx.Client(trust_env=False, timeout=5.0),
                         clock=clock)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, watch_interval_s=None)
    parent = Parent(id="2344425004", author_id="50799773", author_handle="octocat",
                    extra={"owner": "octo", "repo": "re\ud800po", "number": 7})
    out = guard.post(parent, "thanks", path="inbox")
    assert out.status is Status.NOT_SENT and "request not built" in out.detail, out
    row = store.get(guard.key(parent.id))
    assert row is not None and row.state == st.RELEASED and row.attempt == 1, row
    assert [r for r in fixture_server.requests if r.method == "POST"] == []


def test_a_reply_text_with_a_lone_surrogate_is_not_sent_and_never_a_crash(
        fixture_server: FixtureServer, store: Store, clock: FakeClock) -> None:
    """A responder's text can carry a lone surrogate (an LLM's broken output). Opening the row hashes the text:
    that hash must not raise. The send then cannot encode its form: ``not_sent``, the row released, no POST."""
    plat = _mastodon(fixture_server, clock)
    guard = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=10.0, watch_interval_s=None,
                  responder_backoff_s=30.0, responder_backoff_max_s=3600.0)
    parent = Parent(id="117000000000000011", author_id="91", author_handle="alice",
                    extra={"acct": "alice@social.example", "visibility": "public"})
    out = guard.post(parent, "thanks \ud800", path="inbox")
    assert out.status is Status.NOT_SENT and "request not built" in out.detail, out
    row = store.get(guard.key(parent.id))
    assert row is not None and row.state == st.RELEASED and row.attempt == 1, row
    assert fixture_server.requests_to("POST", STATUSES) == []
