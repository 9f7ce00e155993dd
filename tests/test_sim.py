"""Tests for replyd.sim: the simulated Mastodon platform, exercised over real HTTP with httpx."""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.sim import Account, SimServer, World


@dataclass
class Env:
    """One test's view of the shared server: world, clock and per-account clients."""

    world: World
    clock: FakeClock
    server: SimServer
    bot: Account
    alice: Account
    bob: Account

    def client(self, acc: Account | None = None, token: str | None = None) -> httpx.Client:
        """An httpx client authenticated as ``acc`` (the bot by default)."""
        tok = token if token is not None else (acc or self.bot).token
        return httpx.Client(base_url=self.server.base_url, headers={"Authorization": f"Bearer {tok}"}, timeout=5)


@pytest.fixture(scope="module")
def server():
    """One in-thread sim server for the module, on a fake clock."""
    world = World(FakeClock())
    with SimServer(world) as srv:
        yield srv


@pytest.fixture
def env(server: SimServer):
    """A freshly reset world with a bot and two users."""
    world = server.world
    assert world is not None
    world.reset(seed=0, keep_accounts=False)
    bot = world.add_account("replybot", bot=True)
    alice = world.add_account("alice")
    bob = world.add_account("bob")
    e = Env(world, world.clock, server, bot, alice, bob)  # type: ignore[arg-type]
    with e.client() as c:
        e.c = c  # type: ignore[attr-defined]
        yield e


def _qs(url: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(url).query)


def test_verify_credentials_shape_and_auth(env: Env) -> None:
    """verify_credentials returns the bot's account with string id; a bad token gets Mastodon's 401."""
    r = env.c.get("/api/v1/accounts/verify_credentials")
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == env.bot.id and isinstance(body["id"], str) and len(body["id"]) == 18
    assert (body["username"], body["acct"], body["bot"]) == ("replybot", "replybot", True)
    assert body["url"] == f"{env.server.base_url}/@replybot"
    assert "source" in body and body["created_at"].endswith(".000Z")
    assert r.headers["x-ratelimit-limit"] == "10000" and r.headers["x-ratelimit-reset"].endswith("Z")
    env.world.configure(rate_limit_budget=300)
    r = env.c.get("/api/v1/accounts/verify_credentials")
    assert r.headers["x-ratelimit-limit"] == "300" and int(r.headers["x-ratelimit-remaining"]) < 300
    with env.client(token="nope") as bad:
        r = bad.get("/api/v1/accounts/verify_credentials")
    assert r.status_code == 401
    assert r.json() == {"error": "The access token is invalid"}
    assert 'error="invalid_token"' in r.headers["www-authenticate"]
    r = httpx.get(f"{env.server.base_url}/api/v1/notifications")
    assert r.status_code == 401


def test_listing_delay_hides_new_statuses_until_due(env: Env) -> None:
    """A status exists at once but read endpoints show it only after the listing delay."""
    env.world.configure(listing_delay_s=30)
    parent = env.world.post(env.alice, "is anyone there about gardens", mention=[env.bot])
    r = env.c.post("/api/v1/statuses", data={"status": "@alice hi", "in_reply_to_id": parent.id})
    assert r.status_code == 200
    reply_id = r.json()["id"]
    assert env.world.report()["replies_total"] == 1

    def visible() -> dict[str, bool]:
        """Which read endpoints show the parent or the reply."""
        return {
            "notif": bool(env.c.get("/api/v1/notifications").json()),
            "get": env.c.get(f"/api/v1/statuses/{parent.id}").status_code == 200,
            "search": bool(env.c.get("/api/v2/search", params={"q": "GARDENS", "type": "statuses"}).json()["statuses"]),
            "own": any(s["id"] == reply_id for s in env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses").json()),
        }

    assert not any(visible().values())
    r = env.c.get(f"/api/v1/statuses/{parent.id}")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    env.clock.advance(29.9)
    assert not any(visible().values())
    env.clock.advance(0.1)
    assert all(visible().values())
    ctx = env.c.get(f"/api/v1/statuses/{parent.id}/context").json()
    assert [s["id"] for s in ctx["descendants"]] == [reply_id]


def test_notifications_paging_and_link_headers(env: Env) -> None:
    """Notifications page newest first; since_id, min_id, max_id and the Link rels behave like Mastodon."""
    posts = [env.world.post(env.alice, f"question {i}?", mention=[env.bot]) for i in range(5)]
    r = env.c.get("/api/v1/notifications", params={"types[]": "mention", "limit": 2})
    page = r.json()
    assert [n["status"]["id"] for n in page] == [posts[4].id, posts[3].id]
    n0 = page[0]
    assert n0["type"] == "mention" and n0["account"]["id"] == env.alice.id and isinstance(n0["id"], str)
    assert n0["status"]["mentions"][0]["id"] == env.bot.id
    assert 'class="u-url mention"' in n0["status"]["content"]
    ids = [int(n["id"]) for n in env.c.get("/api/v1/notifications").json()]
    assert ids == sorted(ids, reverse=True) and len(ids) == 5
    links = r.links
    assert _qs(links["next"]["url"])["max_id"] == [page[-1]["id"]]
    assert _qs(links["prev"]["url"])["min_id"] == [page[0]["id"]]
    assert _qs(links["next"]["url"])["types[]"] == ["mention"]
    older = env.c.get(links["next"]["url"]).json()
    assert [n["status"]["id"] for n in older] == [posts[2].id, posts[1].id]
    first_id = str(ids[-1])
    # since_id takes the newest page above the cursor; min_id the page right after it.
    since = env.c.get("/api/v1/notifications", params={"since_id": first_id, "limit": 2}).json()
    assert [n["status"]["id"] for n in since] == [posts[4].id, posts[3].id]
    after = env.c.get("/api/v1/notifications", params={"min_id": first_id, "limit": 2}).json()
    assert [n["status"]["id"] for n in after] == [posts[2].id, posts[1].id]
    empty = env.c.get("/api/v1/notifications", params={"min_id": str(ids[0])})
    assert empty.json() == [] and "link" not in empty.headers
    assert env.c.get("/api/v1/notifications", params={"types[]": "follow"}).json() == []


def test_account_statuses_paging_and_exclude_replies(env: Env) -> None:
    """Account statuses come newest first with Link paging, and exclude_replies drops replies to others."""
    parent = env.world.post(env.alice, "root")
    own = [env.world.post(env.bot, f"toot {i}") for i in range(3)]
    reply = env.world.post(env.bot, "@alice re", in_reply_to_id=parent.id)
    r = env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses", params={"limit": 2})
    assert [s["id"] for s in r.json()] == [reply.id, own[2].id]
    nxt = env.c.get(r.links["next"]["url"]).json()
    assert [s["id"] for s in nxt] == [own[1].id, own[0].id]
    r = env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses", params={"exclude_replies": "true"})
    assert reply.id not in [s["id"] for s in r.json()]
    got = env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses", params={"min_id": own[0].id}).json()
    assert [s["id"] for s in got] == [reply.id, own[2].id, own[1].id]
    assert env.c.get("/api/v1/accounts/1/statuses").status_code == 404


def test_idempotency_key_dedupes_when_on(env: Env) -> None:
    """The same Idempotency-Key from one account returns the first status and creates nothing."""
    parent = env.world.post(env.alice, "hello")
    h = {"Idempotency-Key": "k-1"}
    a = env.c.post("/api/v1/statuses", data={"status": "@alice one", "in_reply_to_id": parent.id}, headers=h)
    b = env.c.post("/api/v1/statuses", json={"status": "@alice reworded", "in_reply_to_id": parent.id}, headers=h)
    assert a.status_code == b.status_code == 200
    assert a.json()["id"] == b.json()["id"]
    assert env.world.report()["parents"] == {parent.id: {env.bot.id: 1}}
    with env.client(env.bob) as bob:  # keys are scoped per account
        assert bob.post("/api/v1/statuses", data={"status": "x", "in_reply_to_id": parent.id}, headers=h).status_code == 200
    env.clock.advance(3601)  # keys expire after an hour
    c = env.c.post("/api/v1/statuses", data={"status": "@alice late", "in_reply_to_id": parent.id}, headers=h)
    assert c.json()["id"] != a.json()["id"]
    assert env.world.duplicates(env.bot.id) == 1


def test_idempotency_key_ignored_when_off(env: Env) -> None:
    """With the idempotency knob off, a repeated key creates a second status."""
    env.world.configure(idempotency=False)
    parent = env.world.post(env.alice, "hello")
    h = {"Idempotency-Key": "k-1"}
    ids = {env.c.post("/api/v1/statuses", data={"status": "@alice hi", "in_reply_to_id": parent.id}, headers=h).json()["id"]
           for _ in range(2)}
    assert len(ids) == 2
    assert env.world.report()["duplicates"] == 1


def test_validation_errors(env: Env) -> None:
    """An empty status answers 422 and an unknown parent 404; neither creates anything."""
    r = env.c.post("/api/v1/statuses", data={"status": "  "})
    assert r.status_code == 422 and r.json() == {"error": "Validation failed: Text can't be blank"}
    r = env.c.post("/api/v1/statuses", data={"status": "hi", "in_reply_to_id": "999"})
    assert r.status_code == 404 and "error" in r.json()
    assert env.world.report()["statuses_total"] == 0


def test_lost_drop_is_transport_error_but_status_exists(env: Env) -> None:
    """lost_drop creates the status, then cuts the response so httpx raises a transport error."""
    parent = env.world.post(env.alice, "hello")
    env.world.queue_faults(["lost_drop"])
    with pytest.raises(httpx.TransportError):
        env.c.post("/api/v1/statuses", data={"status": "@alice hi", "in_reply_to_id": parent.id})
    rep = env.world.report()
    assert rep["parents"] == {parent.id: {env.bot.id: 1}}
    assert rep["faults_injected"] == {"lost_drop": 1} and rep["creates_attempted"] == 1
    own = env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses").json()
    assert [s["in_reply_to_id"] for s in own] == [parent.id]


def test_lost_504_creates_status(env: Env) -> None:
    """lost_504 answers a 504 HTML gateway page although the status was created."""
    parent = env.world.post(env.alice, "hello")
    env.world.queue_faults(["lost_504"])
    r = env.c.post("/api/v1/statuses", data={"status": "@alice hi", "in_reply_to_id": parent.id})
    assert r.status_code == 504 and r.headers["content-type"].startswith("text/html")
    assert "Gateway" in r.text
    assert env.world.replies_by(env.bot.id) == {parent.id: 1}


def test_error_before_creates_nothing(env: Env) -> None:
    """error_500_before and error_503_before fail without creating a status."""
    parent = env.world.post(env.alice, "hello")
    env.world.queue_faults(["error_500_before", "error_503_before"])
    codes = [env.c.post("/api/v1/statuses", data={"status": "hi", "in_reply_to_id": parent.id}).status_code
             for _ in range(2)]
    assert codes == [500, 503]
    assert env.world.replies_by(env.bot.id) == {}
    rep = env.world.report()
    assert rep["creates_attempted"] == 2 and rep["faults_injected"] == {"error_500_before": 1, "error_503_before": 1}
    ok = env.c.post("/api/v1/statuses", data={"status": "hi", "in_reply_to_id": parent.id})
    assert ok.status_code == 200  # the queue is consumed one fault per create


def test_rate_limit_429_has_retry_after_and_creates_nothing(env: Env) -> None:
    """rate_limit_429 answers 429 with Retry-After seconds and remaining 0, creating nothing."""
    env.world.configure(retry_after_s=7)
    env.world.queue_faults(["rate_limit_429"])
    r = env.c.post("/api/v1/statuses", data={"status": "hi"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "7" and r.headers["x-ratelimit-remaining"] == "0"
    assert r.json() == {"error": "Too many requests"}
    assert env.world.report()["statuses_total"] == 0


def test_random_fault_rates_are_seeded(env: Env) -> None:
    """Fault rates draw from a seeded RNG: the same seed gives the same fault sequence."""

    def run() -> list[int]:
        """Post 12 statuses at a 50% 504 rate and return the status codes."""
        env.world.configure(lost_504_rate=0.5)
        return [env.c.post("/api/v1/statuses", data={"status": f"s{i}"}).status_code for i in range(12)]

    first = run()
    env.world.reset(seed=0)
    assert run() == first
    assert set(first) == {200, 504}
    env.world.reset(seed=1)
    assert run() != first


def test_readback_errors(env: Env) -> None:
    """readback faults make account statuses and context answer 502 without touching creates."""
    parent = env.world.post(env.alice, "hello")
    env.world.queue_faults(next_readbacks=["error_502", "ok", "error_502"])
    assert env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses").status_code == 502
    assert env.c.get(f"/api/v1/accounts/{env.bot.id}/statuses").status_code == 200
    assert env.c.get(f"/api/v1/statuses/{parent.id}/context").status_code == 502
    env.world.configure(readback_error_rate=1.0)
    assert env.c.get(f"/api/v1/statuses/{parent.id}/context").status_code == 502
    assert env.c.get(f"/api/v1/statuses/{parent.id}").status_code == 200
    assert env.world.report()["faults_injected"] == {"readback_502": 3}


def test_report_counts_duplicates_and_deletes(env: Env) -> None:
    """The report counts replies per (parent, account), duplicates beyond the first, and deletions."""
    p1 = env.world.post(env.alice, "one")
    p2 = env.world.post(env.alice, "two")
    r1 = env.world.post(env.bot, "@alice a", in_reply_to_id=p1.id)
    env.world.post(env.bot, "@alice b", in_reply_to_id=p1.id)
    env.world.post(env.bot, "@alice c", in_reply_to_id=p1.id)
    env.world.post(env.bot, "@alice d", in_reply_to_id=p2.id)
    env.world.post(env.bob, "@alice e", in_reply_to_id=p1.id)
    rep = env.world.report()
    assert rep["parents"] == {p1.id: {env.bot.id: 3, env.bob.id: 1}, p2.id: {env.bot.id: 1}}
    assert (rep["replies_total"], rep["duplicates"]) == (5, 2)
    assert env.world.duplicates(env.bob.id) == 0 and env.world.duplicates(env.bot.id) == 2
    assert env.c.delete(f"/api/v1/statuses/{r1.id}").status_code == 200
    rep = httpx.get(f"{env.server.base_url}/_sim/report").json()
    assert (rep["duplicates"], rep["deleted_replies"]) == (1, 1)
    assert rep["parents"][p1.id][env.bot.id] == 2


def test_search_text_and_resolve_by_url(env: Env) -> None:
    """Search matches text case-insensitively and resolve=true turns a status URL into that status."""
    target = env.world.post(env.alice, "Need HELP with bikes")
    env.world.post(env.bob, "nothing here")
    r = env.c.get("/api/v2/search", params={"q": "help", "type": "statuses"}).json()
    assert set(r) >= {"accounts", "statuses", "hashtags"}
    assert [s["id"] for s in r["statuses"]] == [target.id] and r["accounts"] == []
    url = env.c.get(f"/api/v1/statuses/{target.id}").json()["url"]
    assert url == f"{env.server.base_url}/@alice/{target.id}"
    r = env.c.get("/api/v2/search", params={"q": url, "type": "statuses", "resolve": "true"}).json()
    assert [s["id"] for s in r["statuses"]] == [target.id]
    uri = r["statuses"][0]["uri"]
    r = env.c.get("/api/v2/search", params={"q": uri, "resolve": "true"}).json()
    assert [s["id"] for s in r["statuses"]] == [target.id]
    r = env.c.get("/api/v2/search", params={"q": f"{env.server.base_url}/@alice/1", "resolve": "true"}).json()
    assert r["statuses"] == []


def test_delete_own_only(env: Env) -> None:
    """DELETE removes the caller's own status (200 with it) and refuses others' with 404."""
    mine = env.c.post("/api/v1/statuses", data={"status": "mine"}).json()
    theirs = env.world.post(env.alice, "theirs")
    assert env.c.delete(f"/api/v1/statuses/{theirs.id}").status_code == 404
    r = env.c.delete(f"/api/v1/statuses/{mine['id']}")
    assert r.status_code == 200 and r.json()["id"] == mine["id"] and r.json()["text"] == "mine"
    assert env.c.get(f"/api/v1/statuses/{mine['id']}").status_code == 404
    assert env.c.delete(f"/api/v1/statuses/{mine['id']}").status_code == 404


def test_status_shape_follows_fixture(env: Env) -> None:
    """A created reply carries the fixture's fields: string ids, ISO time, uri/url, mentions, reblog null."""
    parent = env.world.post(env.alice, "hi")
    body = env.c.post("/api/v1/statuses", data={"status": "@alice hello & <you>", "in_reply_to_id": parent.id}).json()
    for key in ("id", "created_at", "in_reply_to_id", "in_reply_to_account_id", "visibility", "uri", "url",
                "content", "account", "mentions", "reblog", "media_attachments", "replies_count", "application"):
        assert key in body, key
    assert body["in_reply_to_account_id"] == env.alice.id and body["reblog"] is None
    assert body["created_at"].endswith("Z") and len(body["created_at"]) == 24
    assert body["content"].endswith(" hello &amp; &lt;you&gt;</p>")
    assert body["uri"] == f"{env.server.base_url}/ap/users/{env.bot.id}/statuses/{body['id']}"
    assert int(body["id"]) > int(parent.id)


def test_admin_endpoints_drive_the_world(env: Env) -> None:
    """The /_sim admin routes create accounts and posts, set knobs, queue faults and reset."""
    s = env.server
    carol = s.add_account("carol", token="tok-carol")
    assert carol["token"] == "tok-carol" and carol["username"] == "carol"
    st = s.post("carol", "ping", mention=["replybot"])
    assert st["content"].startswith("<p><span class=\"h-card\"")
    assert s.configure(listing_delay_s=2)["listing_delay_s"] == 2.0
    assert s.queue_faults(["lost_504"])["next_creates"] == ["lost_504"]
    assert httpx.post(f"{s.base_url}/_sim/config", json={"nope": 1}).status_code == 400
    assert httpx.post(f"{s.base_url}/_sim/faults", json={"next_creates": ["bogus"]}).status_code == 400
    gen = httpx.post(f"{s.base_url}/_sim/posts", json={"generate": 3, "query_word": "zebra"}).json()
    assert len(gen) == 3 and all("zebra" in g["content"] for g in gen)
    assert s.report()["statuses_total"] == 4
    s.reset()
    assert s.report()["statuses_total"] == 0 and env.world.knobs.listing_delay_s == 0
    assert env.world.find_account("carol") is not None


def test_generate_is_deterministic_and_traffic_runs(env: Env) -> None:
    """generate() is a function of the seed, and start_traffic posts the requested total in the background."""
    texts = [s.text for s in env.world.generate(5, mention_fraction=0.5, query_word="help")]
    env.world.reset(seed=0, keep_accounts=False)
    env.world.add_account("replybot", bot=True)
    assert [s.text for s in env.world.generate(5, mention_fraction=0.5, query_word="help")] == texts
    assert any("@replybot" in t for t in texts) and any("@replybot" not in t for t in texts)
    traffic = env.world.start_traffic(200, total=4, users=2)
    traffic.join(5)
    assert not traffic.running and len(traffic.posted) == 4


def test_latency_knob_delays_responses(env: Env) -> None:
    """latency_s adds real delay to every request."""
    env.world.configure(latency_s=0.15)
    t0 = time.monotonic()
    env.c.get("/api/v1/accounts/verify_credentials")
    assert time.monotonic() - t0 >= 0.15


def test_standalone_process_prints_url_and_serves() -> None:
    """python -m replyd.sim prints SIM_URL and serves accounts, fake-clock delay and the report."""
    args = ["--account", "bot1:tok1:bot", "--account", "alice", "--fake-clock", "1800000000", "--listing-delay-s", "5"]
    with SimServer(process=True, args=args) as s:
        assert s.base_url.startswith("http://127.0.0.1:") and s.world is None
        st = s.post("alice", "hi", mention=["bot1"])
        with httpx.Client(base_url=s.base_url, headers={"Authorization": "Bearer tok1"}) as c:
            bot_id = c.get("/api/v1/accounts/verify_credentials").json()["id"]
            assert c.get("/api/v1/notifications").json() == []
            s.advance(5)
            assert [n["status"]["id"] for n in c.get("/api/v1/notifications").json()] == [st["id"]]
            s.queue_faults(["lost_drop"])
            with pytest.raises(httpx.TransportError):
                c.post("/api/v1/statuses", data={"status": "@alice yo", "in_reply_to_id": st["id"]})
        rep = s.report()
        assert rep["parents"] == {st["id"]: {bot_id: 1}} and rep["faults_injected"] == {"lost_drop": 1}
