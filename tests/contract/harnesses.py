"""One harness per adapter: how the contract suite builds it, makes parents, injects faults and counts replies.

A harness is the whole per-platform part of the adapter contract suite. The
cases in ``tests/contract/test_*.py`` speak only the public ``Platform``
Protocol plus the :class:`Harness` methods below, so adding a platform means:
one adapter module, one settings model, one harness class here and one entry
in :data:`HARNESSES`.

Each harness runs its adapter against what that platform has for tests: the
sim (Mastodon), the stateful forum fakes built on recorded bodies (Discourse,
GitHub), the real reference servers (Bluesky dev-env, Synapse), or the script
(memory). Every HTTP harness puts a :class:`~tests.contract.proxy.FaultProxy`
between its adapter and that server, so faults are met over real sockets;
replies are counted on the platform side, never from replyd.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from replyd.clock import FakeClock, SystemClock
from replyd.platforms.base import Parent, Platform, default_provider_key, make_platform
from tests.contract.proxy import FaultProxy, Rule
from tests.fixtures_server import Reply, closed_port_url, html_error

# Send faults every harness can inject into the next send (see ``Harness.fail_next_send``).
SEND_FAULTS = ("lost", "error_before", "rate_limited", "refused", "garbled", "no_id")
RETRY_AFTER_S = 30


@dataclass
class Post:
    """A post made on the platform's side for a test: its served id, its author, and references that name it."""

    id: str
    author_id: str
    refs: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


def tag() -> str:
    """A word no other test uses (search terms, message bodies)."""
    return f"zq{uuid.uuid4().hex[:10]}"


# A secret for the settings cases: no settings error may echo it (the cases check every message for "SECRET").
SECRET = "sec-SECRET-00112233445566778899"


def bad(base: dict[str, Any], *, missing: tuple[str, ...] = (), wrong: tuple[tuple[str, Any], ...] = (),
        ) -> list[tuple[dict[str, Any], str]]:
    """Bad settings from good ``base``: each ``missing`` key left out, each ``wrong`` (key, value) set in."""
    out = [({k: v for k, v in base.items() if k != key}, key) for key in missing]
    return out + [({**base, key: value}, key) for key, value in wrong]


def _html_502() -> Reply:
    return html_error(502)


class Harness:
    """The per-platform half of the contract suite; subclasses fill in the platform's paths and bodies."""

    kind: ClassVar[str]
    # Contract test name -> why that case cannot apply to this adapter (reported as a skip with the reason).
    skips: ClassVar[dict[str, str]] = {}
    # Contract test name -> the adapter bug that makes it fail today (a strict xfail: fixing it fails the run).
    known_bugs: ClassVar[dict[str, str]] = {}
    # (settings, key): bad settings and the key their one-line error must name.
    bad_settings: ClassVar[list[tuple[dict[str, Any], str]]] = []
    # Seconds to keep re-reading while a real server indexes asynchronously (0: one look is the answer).
    patience_s: ClassVar[float] = 0.0
    # Whether an unclear send (lost or unreadable answer) is probed on the platform, so it may return Sent.
    probes_unclear_sends: ClassVar[bool] = False
    # Settings that make listings page in small steps.
    small_pages: ClassVar[dict[str, Any]] = {}
    # The adapter is a ``NoReadBack`` platform: the cases of ``test_no_read_back.py`` run on it.
    no_read_back: ClassVar[bool] = False

    clock: FakeClock  # every harness: the adapter, guard and sweep read it; a test moves it past deadlines
    proxy: FaultProxy | None = None
    http: httpx.Client

    # --- building -----------------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The adapter's settings for this test's bot, pointing at the proxy."""
        raise NotImplementedError

    def adapter(self, **extra: Any) -> Platform:
        """A fresh adapter for the bot, built by kind from settings as the daemon builds it."""
        return make_platform(self.kind, {**self.settings(), **extra}, http=self.http, clock=self.clock)

    def bot_id(self) -> str:
        """The bot's stable id as the platform itself knows it."""
        raise NotImplementedError

    def secret(self) -> str:
        """The bot's credential in the settings (token, API key, app password)."""
        raise NotImplementedError

    def echo_secret(self, status: int, *, every_request: bool = False) -> None:
        """Make the next send (or every request) meet ``status`` with a body repeating the secret in every usual field."""
        assert self.proxy is not None
        text = f"token {self.secret()} is odd"
        body = {"error": text, "message": text, "errors": [text], "errcode": "M_UNKNOWN_TOKEN"}
        route = ("*", ".") if every_request else self.send_route
        self.proxy.add(Rule(*route, answer=Reply(status, body, {"retry-after": "1"}), times=None if every_request else 1))

    def provider_key(self, adapter: Platform, parent_id: str) -> str:
        """The idempotency key the guard would pass for (bot, parent)."""
        return default_provider_key(adapter.instance, self.bot_id(), parent_id)

    # --- the platform's side ------------------------------------------------------------------

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """A person posts ``text`` (mentioning the bot); ``place`` picks a separate topic/room/issue."""
        raise NotImplementedError

    def parent(self, adapter: Platform, text: str = "", *, place: int = 0) -> Parent:
        """A new post mentioning the bot, as the adapter serves it (resolved by its first reference)."""
        post = self.post(text or f"{tag()} how do widgets work?", place=place)
        return self.eventually(lambda: adapter.resolve(post.refs[0]), lambda p: p.id == post.id)

    def reply_ids(self, parent_id: str) -> list[str]:
        """The ids of the bot's replies that exist under ``parent_id``, read on the platform's side."""
        raise NotImplementedError

    def reply_count(self, parent_id: str) -> int:
        """How many replies by the bot exist under ``parent_id``, read on the platform's side."""
        return len(self.reply_ids(parent_id))

    def settle(self, posts: list[Post]) -> None:
        """Wait until the platform's listings show ``posts`` (real servers index asynchronously)."""

    def eventually(self, fn: Callable[[], Any], ok: Callable[[Any], bool]) -> Any:
        """Call ``fn`` until ``ok(result)`` or ``patience_s`` passes; return the last result."""
        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                got = fn()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            if ok(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    # --- faults ------------------------------------------------------------------------------

    url_key: ClassVar[str] = "base_url"  # the setting holding the server's URL
    send_route: ClassVar[tuple[str, str]]  # (method, pattern) of the send request
    delete_route: ClassVar[tuple[str, str]]  # (method, pattern) of the delete request

    def refusal(self) -> Reply:
        """The platform's answer refusing a reply's content or target for good (Rejected)."""
        raise NotImplementedError

    def rate_limit(self) -> Reply:
        """The platform's rate-limit answer asking to wait ``RETRY_AFTER_S`` seconds."""
        return Reply(429, {"error": "Too many requests"}, {"retry-after": str(RETRY_AFTER_S)})

    def gone(self) -> Reply:
        """The platform's answer for a reply that no longer exists."""
        return Reply(404, {"error": "Record not found"})

    def fail_next_send(self, fault: str) -> None:
        """Make the next send meet ``fault`` (one of ``SEND_FAULTS``)."""
        assert self.proxy is not None
        method, pattern = self.send_route
        rule = {
            "lost": Rule(method, pattern, lose=True),
            "error_before": Rule(method, pattern, answer=_html_502()),
            "rate_limited": Rule(method, pattern, answer=self.rate_limit()),
            "refused": Rule(method, pattern, answer=self.refusal()),
            "garbled": Rule(method, pattern, garble=b"{not json"),
            "no_id": Rule(method, pattern, garble=b"{}"),
        }[fault]
        self.proxy.add(rule)

    def unreachable(self) -> Platform:
        """An adapter for the bot whose server refuses connections (nothing listens at its URL)."""
        return self.adapter(**{self.url_key: closed_port_url()})

    def faults_met(self) -> bool:
        """Whether every fault injected for a number of requests was met that many times."""
        assert self.proxy is not None
        return all(r.hits == r.times for r in self.proxy.rules if r.times is not None)

    edit_route: ClassVar[tuple[str, str]]  # (method, pattern) of the edit request (EditReply adapters)

    def fail_next_edit(self, fault: str) -> None:
        """Make the next edit meet ``fault``: "lost" (done, answer dropped), "error_before" (502, nothing done),
        "rate_limited" (429)."""
        assert self.proxy is not None
        method, pattern = self.edit_route
        rule = {"lost": Rule(method, pattern, lose=True),
                "error_before": Rule(method, pattern, answer=_html_502()),
                "rate_limited": Rule(method, pattern, answer=self.rate_limit())}[fault]
        self.proxy.add(rule)

    def reply_text(self, reply_id: str) -> str:
        """The current text of the bot's reply ``reply_id``, read on the platform's side (EditReply adapters)."""
        raise NotImplementedError

    def answer_next_delete_gone(self) -> None:
        """Make the next delete meet the platform's "not found" answer (the reply is already gone)."""
        assert self.proxy is not None
        self.proxy.add(Rule(*self.delete_route, answer=self.gone()))

    def read_routes(self, parent: Parent) -> list[str]:
        """Patterns of the read-back requests that could settle ``parent`` (own feed and per-parent looks)."""
        raise NotImplementedError

    def break_reads(self, parent: Parent | None = None) -> None:
        """Make read-back unable to look at ``parent`` (every read, when None): those requests meet a 502."""
        assert self.proxy is not None
        patterns = ["."] if parent is None else self.read_routes(parent)
        for pattern in patterns:
            self.proxy.add(Rule("GET", pattern, answer=_html_502(), times=None))

    def close(self) -> None:
        """Release what this test's harness holds."""
        if self.proxy is not None:
            self.proxy.clear()


# --- memory ----------------------------------------------------------------------------------


class MemoryHarness(Harness):
    """The scripted in-memory platform: faults are script steps, the adapter object is the platform."""

    kind = "memory"
    skips = {
        "test_read_back_partial_checks_only_what_was_read":
            "memory read-back is one all-or-nothing call: no per-parent look can fail alone",
        "test_search_cursor_moves_forward":
            "memory search takes no cursor: it returns every matching parent on every call",
        "test_delete_meeting_not_found_is_done":
            "memory delete has no transport: there is no 'not found' answer to inject",
        "test_whoami_unreachable_is_definitely_not_sent": "memory whoami asks no server: it cannot be unreachable",
        "test_secret_never_in_errors_logs_or_repr": "memory has no credential to leak",
    }
    bad_settings = bad({"sender_id": "bot-1"}, wrong=(("listing_delay_s", "soon"), ("colour", "red")))
    small_pages: ClassVar[dict[str, Any]] = {}

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.clock = FakeClock()
        self.platform = make_platform("memory", self.settings(), http=http, clock=self.clock)
        self._n = 0

    def settings(self) -> dict[str, Any]:
        """A memory bot."""
        return {"instance": "memory:contract", "sender_id": "bot-contract"}

    def adapter(self, **extra: Any) -> Platform:
        """The one platform object: the script and the replies live in it."""
        return self.platform

    def bot_id(self) -> str:
        """The configured sender id."""
        return "bot-contract"

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Add a parent the bot can find."""
        self._n += 1
        self.clock.advance(1)
        p = self.platform.add_parent(f"m-{self._n}", author_id="user-1", text=text)  # type: ignore[attr-defined]
        return Post(p.id, "user-1", [p.id])

    def reply_ids(self, parent_id: str) -> list[str]:
        """Replies the platform object holds."""
        return [r["reply_id"] for r in self.platform.replies()  # type: ignore[attr-defined]
                if r["parent_id"] == parent_id and r["sender_id"] == self.bot_id()]

    def fail_next_send(self, fault: str) -> None:
        """The next script step (an unreadable answer is a lost one here: memory has no body to garble)."""
        step = {"refused": "rejected", "garbled": "lost", "no_id": "lost"}.get(fault, fault)
        self.platform.script.append(step)  # type: ignore[attr-defined]

    def faults_met(self) -> bool:
        """Whether every scripted step was used."""
        return not self.platform.script and not self.platform.edit_script  # type: ignore[attr-defined]

    def fail_next_edit(self, fault: str) -> None:
        """The next edit script step."""
        self.platform.edit_script.append(fault)  # type: ignore[attr-defined]

    def reply_text(self, reply_id: str) -> str:
        """The reply's text as the platform object holds it now."""
        return next(r["text"] for r in self.platform.replies() if r["reply_id"] == reply_id)  # type: ignore[attr-defined]

    def unreachable(self) -> Platform:
        """The platform scripted as unreachable: the next send is refused before acting, the next read-back fails."""
        self.platform.script.append("not_sent")  # type: ignore[attr-defined]
        self.platform.readback_failures = 1  # type: ignore[attr-defined]
        return self.platform

    def break_reads(self, parent: Parent | None = None) -> None:
        """The next read-back fails (memory has no per-parent reads)."""
        self.platform.readback_failures = 1  # type: ignore[attr-defined]


# --- Mastodon on the sim -------------------------------------------------------------------


class MastodonHarness(Harness):
    """Mastodon on the sim (``replyd.sim``): a Mastodon-compatible server that counts replies per parent."""

    kind = "mastodon"
    # The cases of the former tests/test_mastodon.py::test_settings_errors_name_the_key.
    bad_settings = bad({"base_url": "https://m.example", "token": SECRET}, missing=("base_url", "token"), wrong=(
        ("base_url", "ftp://m.example"), ("base_url", "https://u:p@m.example"), ("token", "  "),
        ("token", SECRET + " x"), ("listing_delay_s", "10"), ("timeout_s", 0), ("idempotency", "yes"),
        ("visibility", "everyone"), ("mention_author", 1), ("page_limit", 0), ("max_pages", True), ("instance", ""),
        ("visiblity", "direct")))
    small_pages = {"page_limit": 2, "max_pages": 1}
    send_route = ("POST", r"^/api/v1/statuses$")
    delete_route = ("DELETE", r"^/api/v1/statuses/")
    edit_route = ("PUT", r"^/api/v1/statuses/")

    def __init__(self, sim: Any, http: httpx.Client) -> None:
        self.sim, self.world, self.http = sim, sim.world, http
        self.world.reset(keep_accounts=True)
        self.world.configure(listing_delay_s=0)
        self.clock = self.world.clock
        self.bot = self.world.find_account("replybot") or self.world.add_account("replybot", bot=True)
        self.alice = self.world.find_account("alice") or self.world.add_account("alice")
        self.proxy = FaultProxy(sim.base_url)

    def settings(self) -> dict[str, Any]:
        """The bot's token on the sim, through the proxy."""
        return {"base_url": self.proxy.url, "token": self.bot.token, "listing_delay_s": 0}

    def bot_id(self) -> str:
        """The bot's account id."""
        return self.bot.id

    def secret(self) -> str:
        """The bot's access token."""
        return self.bot.token

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice posts, mentioning the bot."""
        self.clock.advance(1)  # type: ignore[attr-defined]
        st = self.world.post(self.alice, text, mention=[self.bot] if mention else [])
        return Post(st.id, self.alice.id, [f"{self.sim.base_url}/@alice/{st.id}", st.id])

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's live statuses answering the parent, as the sim holds them."""
        with self.world.lock:
            return [st.id for st in self.world.statuses.values()
                    if st.account_id == self.bot.id and st.in_reply_to_id == parent_id and st.deleted_at is None]

    def reply_text(self, reply_id: str) -> str:
        """The status's text as the sim holds it now."""
        with self.world.lock:
            return self.world.statuses[reply_id].text

    def refusal(self) -> Reply:
        """Mastodon's 422."""
        return Reply(422, {"error": "Validation failed: Text character limit of 500 exceeded"})

    def read_routes(self, parent: Parent) -> list[str]:
        """The own statuses feed and the parent's context."""
        return [r"/api/v1/accounts/[^/]+/statuses", rf"/api/v1/statuses/{parent.id}/context"]

    def close(self) -> None:
        """Stop the proxy."""
        assert self.proxy is not None
        self.proxy.close()


# --- Discourse and GitHub on the stateful fakes -----------------------------------------------


class DiscourseHarness(Harness):
    """Discourse on ``tests/fakes_forum.FakeDiscourse`` (recorded bodies, stateful topics and posts)."""

    kind = "discourse"
    # The cases of the former tests/test_discourse.py::test_settings_errors_name_the_key.
    bad_settings = bad({"base_url": "https://f.example", "api_key": SECRET, "api_username": "discourse1"},
                       missing=("base_url", "api_key", "api_username"), wrong=(
        ("base_url", "ftp://f.example"), ("api_key", SECRET + " x"), ("listing_delay_s", "9"), ("timeout_s", 0),
        ("search_queries", "x"), ("notification_types", ["liked"]), ("max_pages", 0), ("instance", ""),
        ("api_secret", SECRET))) + [({"base_url": "https://f.example", "user_api_key": SECRET, "api_key": SECRET},
                                     "user_api_key")]
    small_pages = {"max_pages": 1}
    send_route = ("POST", r"^/posts\.json$")
    delete_route = ("DELETE", r"^/posts/\d+\.json$")
    edit_route = ("PUT", r"^/posts/\d+\.json$")

    def __init__(self, host: Any, http: httpx.Client) -> None:
        from tests.fakes_forum import FakeDiscourse

        self.http, self.host = http, host
        self.clock = FakeClock()
        self.fake = FakeDiscourse(self.clock)
        self.fake.notifications_page = 2
        self.fake.search_page = 2
        host.fake = self.fake
        self.alice = self.fake.add_user("alice")
        self.proxy = FaultProxy(host.url)
        self._topics: dict[int, int] = {}

    def settings(self) -> dict[str, Any]:
        """The bot's API key on the fake, through the proxy."""
        from tests.fakes_forum import FakeDiscourse

        return {"base_url": self.proxy.url, "api_key": FakeDiscourse.API_KEY, "api_username": "replybot",
                "listing_delay_s": 0}

    def bot_id(self) -> str:
        """The bot's user id."""
        return str(self.fake.bot.id)

    def secret(self) -> str:
        """The bot's API key."""
        from tests.fakes_forum import FakeDiscourse

        return FakeDiscourse.API_KEY

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice opens a topic per place, then replies in it; each post mentions the bot."""
        self.clock.advance(1)
        body = f"@replybot {text}" if mention else text
        if place in self._topics:
            p = self.fake.reply(self.alice, self._topics[place], body)
        else:
            p = self.fake.create_topic(self.alice, f"Question {tag()}", body)
            self._topics[place] = p.topic_id
        topic = self.fake.topics[p.topic_id]
        return Post(str(p.id), str(self.alice.id),
                    [f"{self.proxy.url}/t/{topic.slug}/{p.topic_id}/{p.post_number}", str(p.id)])

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's live posts answering the post, as the fake holds them."""
        return [str(p.id) for p in self.fake.replies(parent_id)]

    def reply_text(self, reply_id: str) -> str:
        """The reply's current raw text, as the fake holds it (after any edits)."""
        return self.fake.reply_text(reply_id)

    def refusal(self) -> Reply:
        """Discourse's 422 for a post it will not take."""
        return Reply(422, {"errors": ["Body is too similar to what you recently posted"],
                            "error_type": "invalid_parameters"})

    def rate_limit(self) -> Reply:
        """Discourse's 429 with its wait in the body and the header."""
        return Reply(429, {"errors": ["You've performed this action too many times."], "error_type": "rate_limit",
                            "extras": {"wait_seconds": RETRY_AFTER_S, "time_left": f"{RETRY_AFTER_S} seconds"}},
                      {"retry-after": str(RETRY_AFTER_S)})

    def gone(self) -> Reply:
        """Discourse's 404."""
        return Reply(404, {"errors": ["The requested URL or resource could not be found."],
                            "error_type": "not_found"})

    def read_routes(self, parent: Parent) -> list[str]:
        """The own activity feed and every read of the parent's topic."""
        topic = parent.extra.get("topic_id")
        return [r"^/user_actions\.json", rf"^/t/{topic}[/.]", rf"^/posts/by_number/{topic}/"]

    def close(self) -> None:
        """Stop the proxy and unplug the fake."""
        assert self.proxy is not None
        self.proxy.close()
        self.host.fake = None


class GitHubHarness(Harness):
    """GitHub on ``tests/fakes_forum.FakeGitHub`` (recorded bodies, stateful issues and comments)."""

    kind = "github"
    # The cases of the former tests/test_github.py::test_settings_errors_name_the_key.
    bad_settings = bad({"token": SECRET}, missing=("token",), wrong=(
        ("token", "two words"), ("api_url", "ftp://x"), ("repos", "acme/widgets"), ("repos", ["widgets"]),
        ("notifications", "yes"), ("notification_reasons", []), ("login", "a/b"), ("writes_per_minute", 0),
        ("writes_per_hour", 1.5), ("listing_delay_s", -1), ("timeout_s", 0), ("search_queries", [""]),
        ("instance", " "), ("repo", ["acme/widgets"])))
    small_pages = {"max_pages": 1}
    url_key = "api_url"
    send_route = ("POST", r"^/repos/[^/]+/[^/]+/issues/\d+/comments$")
    delete_route = ("DELETE", r"^/repos/[^/]+/[^/]+/issues/comments/\d+$")
    edit_route = ("PATCH", r"^/repos/[^/]+/[^/]+/issues/comments/\d+$")
    REPO = "acme/widgets"

    def __init__(self, host: Any, http: httpx.Client) -> None:
        from tests.fakes_forum import FakeGitHub

        self.http, self.host = http, host
        self.clock = FakeClock()
        self.fake = FakeGitHub(self.clock)
        self.fake.add_repo(self.REPO)
        host.fake = self.fake
        self.alice = self.fake.add_user("alice")
        self.proxy = FaultProxy(host.url)
        self.issues: dict[str, Any] = {}

    def settings(self) -> dict[str, Any]:
        """The bot's token on the fake, through the proxy."""
        from tests.fakes_forum import FakeGitHub

        return {"api_url": self.proxy.url, "token": FakeGitHub.TOKEN, "repos": [self.REPO], "listing_delay_s": 0}

    def bot_id(self) -> str:
        """The bot's user id."""
        return str(self.fake.bot.id)

    def secret(self) -> str:
        """The bot's token."""
        from tests.fakes_forum import FakeGitHub

        return FakeGitHub.TOKEN

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice opens an issue mentioning the bot (every post is its own issue: a parent is an issue)."""
        self.clock.advance(1)
        body = f"@replyd-bot {text}" if mention else text
        issue = self.fake.open_issue(self.alice, self.REPO, f"Widgets {text}", body)
        self.issues[str(issue.id)] = issue
        return Post(str(issue.id), str(self.alice.id),
                    [f"https://github.com/{self.REPO}/issues/{issue.number}", f"{self.REPO}#{issue.number}"])

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's live comments on the issue, as the fake holds them."""
        return [str(c.id) for c in self.fake.replies(self.issues[parent_id])]

    def reply_text(self, reply_id: str) -> str:
        """The comment's current body, as the fake holds it (after any edits)."""
        return self.fake.reply_text(reply_id)

    def refusal(self) -> Reply:
        """GitHub's 422."""
        return Reply(422, {"message": "Validation Failed", "errors": [{"resource": "IssueComment",
                            "code": "unprocessable", "field": "data", "message": "Body is too long"}],
                            "documentation_url": "https://docs.github.com/rest", "status": "422"})

    def rate_limit(self) -> Reply:
        """GitHub's secondary rate limit: 403 with Retry-After."""
        return Reply(403, {"message": "You have exceeded a secondary rate limit. Please wait a few minutes.",
                            "documentation_url": "https://docs.github.com/rest", "status": "403"},
                      {"retry-after": str(RETRY_AFTER_S)})

    def gone(self) -> Reply:
        """GitHub's 404."""
        return Reply(404, {"message": "Not Found", "documentation_url": "https://docs.github.com/rest",
                            "status": "404"})

    def read_routes(self, parent: Parent) -> list[str]:
        """The repository-wide comment listing and the parent's issue comments."""
        return [r"^/repos/[^/]+/[^/]+/issues/comments(\?|$)",
                rf"^/repos/[^/]+/[^/]+/issues/{parent.extra.get('number')}/comments"]

    def close(self) -> None:
        """Stop the proxy and unplug the fake."""
        assert self.proxy is not None
        self.proxy.close()
        self.host.fake = None


# --- Bluesky on the dev-env network -----------------------------------------------------------


class BlueskyHarness(Harness):
    """Bluesky on the real reference network (@atproto/dev-env), counted on the bot's PDS repository."""

    kind = "bluesky"
    skips = {
        "test_delete_meeting_not_found_is_done":
            "deleteRecord of a missing record answers 200 on the PDS: there is no 'not found' to map",
    }
    # The cases of the former tests/test_bluesky.py::test_settings_errors_name_the_key.
    bad_settings = bad({"service": "https://x", "identifier": "a", "app_password": SECRET},
                       missing=("service", "identifier", "app_password"), wrong=(
        ("service", "ftp://x"), ("service", "https://u:pw@x"), ("identifier", "a b"), ("app_password", SECRET + " w"),
        ("appview_did", "api.bsky.app"), ("listing_delay_s", "5"), ("timeout_s", 0), ("page_limit", 101),
        ("search_queries", "help"), ("token", "t")))
    patience_s = 10.0
    probes_unclear_sends = True  # getRecord at the deterministic rkey settles a lost createRecord
    small_pages = {"page_limit": 2, "max_pages": 1}
    url_key = "service"
    send_route = ("POST", r"^/xrpc/com\.atproto\.repo\.createRecord")
    delete_route = ("POST", r"^/xrpc/com\.atproto\.repo\.deleteRecord")

    def __init__(self, net: Any, http: httpx.Client) -> None:
        self.net, self.http = net, http
        self.clock = FakeClock(SystemClock().now())  # real time at the start; tests move it past deadlines
        self.alice = net.people["alice.test"]
        self.proxy = FaultProxy(net.pds)

    def settings(self) -> dict[str, Any]:
        """The bot's app password on the PDS, through the proxy."""
        return {"service": self.proxy.url, "identifier": self.net.bot.handle,
                "app_password": self.net.bot_app_password, "appview_did": self.net.appview_did,
                "listing_delay_s": 2.0, "instance": f"bluesky:{self.net.pds}"}

    def bot_id(self) -> str:
        """The bot's DID."""
        return self.net.bot.did

    def secret(self) -> str:
        """The bot's app password."""
        return self.net.bot_app_password

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice posts on her PDS, mentioning the bot; returned once the AppView serves it."""
        out = self.net.post(self.alice, text, mention=self.net.bot if mention else None)
        self.net.wait_indexed(out["uri"])
        rkey = out["uri"].rsplit("/", 1)[1]
        return Post(out["uri"], self.alice.did, [out["uri"], f"https://bsky.app/profile/{self.alice.handle}/post/{rkey}"])

    def settle(self, posts: list[Post]) -> None:
        """The AppView indexes notifications a moment after the post itself."""
        self.net.settle(1.0)

    def reply_ids(self, parent_id: str) -> list[str]:
        """Posts in the bot's PDS repository whose reply parent is ``parent_id`` (read-your-writes)."""
        out: list[str] = []
        cursor = None
        while True:
            params = {"repo": self.net.bot.did, "collection": "app.bsky.feed.post", "limit": 100}
            if cursor:
                params["cursor"] = cursor
            body = self.net.xrpc("GET", "com.atproto.repo.listRecords", params=params).json()
            for rec in body.get("records", []):
                if rec["value"].get("reply", {}).get("parent", {}).get("uri") == parent_id:
                    out.append(rec["uri"])
            cursor = body.get("cursor")
            if not cursor or not body.get("records"):
                return out

    def refusal(self) -> Reply:
        """The PDS's 400 InvalidRequest."""
        return Reply(400, {"error": "InvalidRequest", "message": "Invalid app.bsky.feed.post record: text too long"})

    def rate_limit(self) -> Reply:
        """The PDS's 429 with its ratelimit headers."""
        reset = int(self.clock.now()) + RETRY_AFTER_S
        return Reply(429, {"error": "RateLimitExceeded", "message": "Rate Limit Exceeded"},
                      {"ratelimit-limit": "5000", "ratelimit-remaining": "0", "ratelimit-reset": str(reset),
                       "retry-after": str(RETRY_AFTER_S)})

    def read_routes(self, parent: Parent) -> list[str]:
        """getRecord at the parent's rkey, the own feed, and the parent's thread."""
        from replyd.platforms.bluesky import rkey_for

        rkey = rkey_for(self.bot_id(), parent.id)
        return [rf"getRecord\?.*rkey={rkey}", r"app\.bsky\.feed\.getAuthorFeed",
                rf"app\.bsky\.feed\.getPostThread\?.*uri={re.escape(parent.id)}"]

    def close(self) -> None:
        """Stop the proxy."""
        assert self.proxy is not None
        self.proxy.close()


# --- Matrix on Synapse ----------------------------------------------------------------------------


class MatrixHarness(Harness):
    """Matrix on a real Synapse homeserver; replies counted by reading the room as another member."""

    kind = "matrix"
    # The cases of the former tests/test_matrix.py::test_bad_settings_name_the_key, and more.
    bad_settings = bad({"base_url": "http://127.0.0.1:8008", "token": SECRET}, missing=("base_url", "token"), wrong=(
        ("msgtype", "m.emote"), ("room", "x"), ("base_url", "http://example.org"), ("device_id", "a b"),
        ("page_limit", 0)))
    small_pages = {"page_limit": 2, "max_pages": 1}
    send_route = ("PUT", r"/rooms/[^/]+/send/m\.room\.message/")
    delete_route = ("PUT", r"/rooms/[^/]+/redact/")
    edit_route = ("PUT", r"/rooms/[^/]+/send/m\.room\.message/replyd-edit-")

    def __init__(self, hs: Any, http: httpx.Client) -> None:
        self.hs, self.http = hs, http
        self.clock = FakeClock(SystemClock().now())  # real time at the start; tests move it past deadlines
        self.alice, self.carol = hs.people["alice"], hs.people["carol"]
        self.rooms: dict[int, str] = {}
        self.proxy = FaultProxy(hs.base_url)
        self._room_of: dict[str, str] = {}

    def room(self, place: int) -> str:
        """The test's room number ``place`` (alice owns it; the bot and carol are in)."""
        if place not in self.rooms:
            self.rooms[place] = self.hs.create_room(self.alice, others=(self.carol,))
        return self.rooms[place]

    def settings(self) -> dict[str, Any]:
        """The bot's access token on Synapse, through the proxy."""
        return {"base_url": self.proxy.url, "token": self.hs.bot.token, "listing_delay_s": 0.5,
                "instance": f"matrix:{self.hs.base_url}"}

    def bot_id(self) -> str:
        """The bot's user id."""
        return self.hs.bot.user_id

    def secret(self) -> str:
        """The bot's access token."""
        return self.hs.bot.token

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice says ``text`` in the room, mentioning the bot."""
        room = self.room(place)
        body = f"{self.hs.bot.user_id} {text}" if mention else text
        event_id = self.hs.say(self.alice, room, body, mention_bot=mention)
        self._room_of[event_id] = room
        return Post(event_id, self.alice.user_id, [f"https://matrix.to/#/{room}/{event_id}", f"{room}/{event_id}"])

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's replies to the event as carol reads the room."""
        room = self._room_of[parent_id]
        return self.hs.replies_by(room, self.hs.bot.user_id, self.carol).get(parent_id, [])

    def reply_text(self, reply_id: str) -> str:
        """The reply's text as carol sees it: its latest valid replacement's ``m.new_content`` body (spec: event
        replacements), else its own body; the reply is looked for in this test's rooms."""
        for room in self.rooms.values():
            try:
                return self.hs.reply_text(room, reply_id, self.carol)
            except AssertionError:  # not an event of this room
                continue
        raise AssertionError(f"reply {reply_id} is in none of this test's rooms")

    def refusal(self) -> Reply:
        """Synapse's 400 M_TOO_LARGE."""
        return Reply(400, {"errcode": "M_TOO_LARGE", "error": "event too large"})

    def rate_limit(self) -> Reply:
        """Synapse's 429 M_LIMIT_EXCEEDED."""
        return Reply(429, {"errcode": "M_LIMIT_EXCEEDED", "error": "Too Many Requests",
                            "retry_after_ms": RETRY_AFTER_S * 1000})

    def gone(self) -> Reply:
        """Synapse's 404 M_NOT_FOUND."""
        return Reply(404, {"errcode": "M_NOT_FOUND", "error": "Event not found"})

    def read_routes(self, parent: Parent) -> list[str]:
        """The parent's room's ``/messages``."""
        return [rf"/rooms/{re.escape(str(parent.extra.get('room_id')))}/messages"]

    def close(self) -> None:
        """Stop the proxy."""
        assert self.proxy is not None
        self.proxy.close()


# --- Slack on the stateful fake ---------------------------------------------------------------


class SlackHarness(Harness):
    """Slack on ``tests/slack_fake.py`` (Web API on Slack's published shapes), counted in the fake's threads."""

    kind = "slack"
    skips = {
        "test_search_cursor_moves_forward": "a bot cannot search Slack: search.messages needs a user token",
        "test_three_paths_find_the_parent_and_it_is_answered_once":
            "a bot cannot search Slack (search.messages needs a user token): one of the three paths does not exist",
    }
    bad_settings = bad({"token": "xoxb-" + SECRET}, missing=("token",), wrong=(
        ("token", SECRET), ("app_token", "xoxb-" + SECRET), ("api_url", "ftp://x"), ("channels", ["#general"]),
        ("page_limit", 0), ("rate_per_minute", {"chat.postMessage": 0}), ("search_queries", ["help"]),
        ("listing_delay_s", -1), ("max_post_chars", 40_001), ("colour", "red")))
    small_pages = {"page_limit": 1, "max_pages": 1}
    url_key = "api_url"
    send_route = ("POST", r"^/api/chat\.postMessage")
    delete_route = ("POST", r"^/api/chat\.delete")
    edit_route = ("POST", r"^/api/chat\.update")
    ALICE = "U0ALICE001"

    def __init__(self, http: httpx.Client) -> None:
        from tests.slack_fake import BOT_USER, SlackWebApi, SlackWorld

        self.http = http
        self.clock = FakeClock(time.time())
        self.world = SlackWorld(now=self.clock.now)
        self.channels: dict[int, str] = {}
        self.bot = BOT_USER
        self.api = SlackWebApi(self.world).__enter__()
        self.proxy = FaultProxy(self.api.url.removesuffix("/api"))

    def settings(self) -> dict[str, Any]:
        """The bot token on the fake, through the proxy."""
        from tests.slack_fake import BOT_TOKENS

        return {"api_url": self.proxy.url + "/api", "token": BOT_TOKENS[0], "listing_delay_s": 0}

    def bot_id(self) -> str:
        """The bot user id auth.test serves."""
        return self.bot

    def secret(self) -> str:
        """The bot token."""
        from tests.slack_fake import BOT_TOKENS

        return BOT_TOKENS[0]

    def _channel(self, place: int) -> str:
        if place not in self.channels:
            cid = f"C0PLACE{place:03d}"
            self.world.add_channel(cid, self.bot, self.ALICE)
            self.channels[place] = cid
        return self.channels[place]

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice says ``text`` in the place's channel, naming the bot; refs: the served id and the permalink."""
        self.clock.advance(1)
        cid = self._channel(place)
        pid = self.world.say(cid, self.ALICE, f"<@{self.bot}> {text}" if mention else text, push=False)
        ts = pid.partition(":")[2]
        return Post(pid, self.ALICE, [pid, f"https://acme.slack.com/archives/{cid}/p{ts.replace('.', '')}"])

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's messages in the parent's thread, as the fake holds them."""
        channel = parent_id.partition(":")[0]
        return [f"{channel}:{m.ts}" for m in self.world.bot_replies(parent_id)]

    def reply_text(self, reply_id: str) -> str:
        """The reply's current text as the fake holds it (``chat.update`` applied): what an edit is judged on."""
        return self.world.text_of(reply_id)

    def refusal(self) -> Reply:
        """Slack's refusal: HTTP 200, ``ok: false``, ``msg_too_long``."""
        return Reply(200, {"ok": False, "error": "msg_too_long"})

    def rate_limit(self) -> Reply:
        """Slack's 429 ``ratelimited`` with Retry-After."""
        return Reply(429, {"ok": False, "error": "ratelimited"}, {"retry-after": str(RETRY_AFTER_S)})

    def gone(self) -> Reply:
        """Slack's ``message_not_found`` (HTTP 200)."""
        return Reply(200, {"ok": False, "error": "message_not_found"})

    def read_routes(self, parent: Parent) -> list[str]:
        """conversations.replies of the parent's thread."""
        channel, _, ts = parent.id.partition(":")
        root = parent.extra.get("thread_ts") or ts
        return [rf"^/api/conversations\.replies\?channel={re.escape(channel)}&ts={re.escape(root)}"]

    def close(self) -> None:
        """Stop the proxy and the fake."""
        assert self.proxy is not None
        self.proxy.close()
        self.api.__exit__(None, None, None)


def no_read_back_skips(why: str) -> dict[str, str]:
    """The read-back cases a ``NoReadBack`` harness skips (``test_no_read_back.py`` covers the class), with ``why``."""
    return {name: why for name in (
        "test_read_back_found_after_a_lost_response", "test_read_back_found_is_the_sent_reply_oldest_first",
        "test_read_back_not_found_is_checked_without_replies", "test_read_back_partial_checks_only_what_was_read",
        "test_read_parents_finds_the_reply_without_the_own_feed",
        "test_lost_answer_is_closed_by_the_sweep_with_the_landed_reply",
        "test_5xx_with_nothing_created_gets_one_more_attempt", "test_crash_between_send_and_close_is_closed_by_the_sweep",
        "test_pollers_over_three_paths_with_lost_answers_one_reply_and_one_call_each")}


def start_fake(h: Harness, http: httpx.Client, world_cls: type, api_cls: type) -> None:
    """Give harness ``h`` a fake platform on its own fake clock, served over HTTP behind a fault proxy."""
    h.http = http
    h.clock = FakeClock(time.time())
    h.world = world_cls(now=h.clock.now)  # type: ignore[attr-defined]
    h.api = api_cls(h.world).start()  # type: ignore[attr-defined]
    h.proxy = FaultProxy(h.api.url)  # type: ignore[attr-defined]


class NoReadBackFakeHarness(Harness):
    """A harness of the no-read-back class on a fake started by ``start_fake``: nothing to read back."""

    no_read_back = True

    def read_routes(self, parent: Parent) -> list[str]:
        """None: nothing reads back on such a platform."""
        return []

    def close(self) -> None:
        """Stop the proxy and the fake."""
        assert self.proxy is not None
        self.proxy.close()
        self.api.stop()  # type: ignore[attr-defined]


class TelegramHarness(NoReadBackFakeHarness):
    """Telegram on ``tests/telegram_fake.py`` (the Bot API from its documentation), counted in the fake's chats."""

    kind = "telegram"
    no_read_back = True
    _NO_READ_BACK = "a Telegram bot cannot list what it sent (no read-back): test_no_read_back.py covers the class"
    skips = {
        **no_read_back_skips(_NO_READ_BACK),
        "test_delete_removes_the_reply_and_twice_is_done": _NO_READ_BACK + " (its last step is a read-back)",
        "test_an_edited_reply_is_read_back_as_the_one_reply": _NO_READ_BACK + " (the case is a read-back)",
        "test_three_paths_find_the_parent_and_it_is_answered_once":
            "a bot cannot search Telegram or re-read a chat: getUpdates (or the webhook) is the only path",
        "test_search_cursor_moves_forward": "a bot cannot search Telegram",
        "test_resolve_every_reference_gives_the_served_parent":
            "a bot cannot read a message by id: resolve gives the served id, not the author",
    }
    bad_settings = bad({"token": "1:" + SECRET}, missing=("token",), wrong=(
        ("token", "has space " + SECRET), ("api_url", "ftp://x"), ("mode", "push"), ("long_poll_s", 60),
        ("updates_limit", 0), ("listing_delay_s", -1), ("colour", "red")))
    small_pages = {"updates_limit": 1}
    url_key = "api_url"
    send_route = ("POST", r"^/bot[^/]+/sendMessage")
    delete_route = ("POST", r"^/bot[^/]+/deleteMessage")
    edit_route = ("POST", r"^/bot[^/]+/editMessageText")
    ALICE = 5000000002

    def __init__(self, http: httpx.Client) -> None:
        from tests.telegram_fake import TelegramApi, TelegramWorld

        start_fake(self, http, TelegramWorld, TelegramApi)

    def settings(self) -> dict[str, Any]:
        """The bot token on the fake, through the proxy; short polls."""
        from tests.telegram_fake import TOKEN

        return {"api_url": self.proxy.url, "token": TOKEN, "long_poll_s": 0}

    def bot_id(self) -> str:
        """The bot user id getMe serves."""
        from tests.telegram_fake import BOT_ID

        return str(BOT_ID)

    def secret(self) -> str:
        """The bot token (it travels in the URL path)."""
        from tests.telegram_fake import TOKEN

        return TOKEN

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice says ``text`` in the place's supergroup, mentioning the bot; refs: the served id and the t.me/c link."""
        self.clock.advance(1)
        chat = -1001000000000 - place
        self.world.chat(chat, type="supergroup")
        pid = self.world.post(chat, text, user_id=self.ALICE, mention=mention)
        mid = pid.partition(":")[2]
        return Post(pid, str(self.ALICE), [pid, f"https://t.me/c/{str(chat).removeprefix('-100')}/{mid}"])

    def parent(self, adapter: Platform, text: str = "", *, place: int = 0) -> Parent:
        """A new mention, as the inbox serves it (resolve cannot know its author)."""
        post = self.post(text or f"{tag()} how do widgets work?", place=place)
        return self.eventually(lambda: next(p for p in adapter.inbox(None).parents if p.id == post.id),
                               lambda p: p.id == post.id)

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's messages replying to the parent, as the fake holds them."""
        chat_id, _, mid = parent_id.partition(":")
        chat = self.world.chats.get(int(chat_id))
        if chat is None:
            return []
        return [f"{chat_id}:{m['message_id']}" for m in list(chat.messages.values())
                if m["from"]["is_bot"] and (m.get("reply_to_message") or {}).get("message_id") == int(mid)]

    def refusal(self) -> Reply:
        """The Bot API's 400 ``Bad Request``."""
        return Reply(400, {"ok": False, "error_code": 400, "description": "Bad Request: message text is empty"})

    def rate_limit(self) -> Reply:
        """The Bot API's 429 with ``parameters.retry_after``."""
        return Reply(429, {"ok": False, "error_code": 429, "description": f"Too Many Requests: retry after "
                           f"{RETRY_AFTER_S}", "parameters": {"retry_after": RETRY_AFTER_S}})

    def gone(self) -> Reply:
        """The Bot API's answer deleting a message that is not there."""
        return Reply(400, {"ok": False, "error_code": 400, "description": "Bad Request: message to delete not found"})

    def reply_text(self, reply_id: str) -> str:
        """The bot message's current text in the fake's chat (edits applied): the ground truth of an edit."""
        return str(self.world.text(reply_id))



# --- Discord on the stateful fake -------------------------------------------------------------


class DiscordHarness(Harness):
    """Discord on ``tests/discord_fake.py`` (REST on the published shapes), replies counted on the fake by reference."""

    kind = "discord"
    skips = {
        "test_search_cursor_moves_forward": "a Discord bot cannot search messages",
        "test_three_paths_find_the_parent_and_it_is_answered_once":
            "a Discord bot cannot search messages: one of the three paths does not exist",
    }
    bad_settings = bad({"token": SECRET}, missing=("token",), wrong=(
        ("token", "Bot " + SECRET), ("api_url", "ftp://x"), ("channels", ["#general"]), ("page_limit", 0),
        ("gateway_url", "https://x"), ("search_queries", ["help"]), ("listing_delay_s", -1), ("colour", "red")))
    small_pages = {"page_limit": 1, "max_pages": 1}
    url_key = "api_url"
    send_route = ("POST", r"^/api/v10/channels/\d+/messages$")
    delete_route = ("DELETE", r"^/api/v10/channels/\d+/messages/\d+$")
    edit_route = ("PATCH", r"^/api/v10/channels/\d+/messages/\d+$")
    ALICE = "53908099506183680"

    def __init__(self, http: httpx.Client) -> None:
        from tests.discord_fake import BOT_ID, DiscordRest, DiscordWorld

        self.http = http
        self.clock = FakeClock(time.time())
        self.world = DiscordWorld(now=self.clock.now)
        self.channels: dict[int, str] = {}
        self.bot = BOT_ID
        self.api = DiscordRest(self.world).__enter__()
        self.proxy = FaultProxy(self.api.url.removesuffix("/api/v10"))

    def settings(self) -> dict[str, Any]:
        """The bot token on the fake, through the proxy; the listed channels are the poll's."""
        from tests.discord_fake import BOT_TOKENS

        return {"api_url": self.proxy.url + "/api/v10", "token": BOT_TOKENS[0], "listing_delay_s": 0,
                "channels": [self._channel(i) for i in range(3)]}

    def bot_id(self) -> str:
        """The bot user id /users/@me serves."""
        return self.bot

    def secret(self) -> str:
        """The bot token."""
        from tests.discord_fake import BOT_TOKENS

        return BOT_TOKENS[0]

    def provider_key(self, adapter: Platform, parent_id: str) -> str:
        """The adapter's own 25-character nonce (``ProviderKeys``)."""
        from replyd.platforms.discord import discord_nonce

        return discord_nonce(adapter.instance, self.bot_id(), parent_id)

    def _channel(self, place: int) -> str:
        if place not in self.channels:
            self.channels[place] = self.world.add_channel()
        return self.channels[place]

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice says ``text`` in the place's channel, mentioning the bot; refs: the served id and the jump link."""
        from tests.discord_fake import GUILD

        self.clock.advance(1)
        cid = self._channel(place)
        pid = self.world.say(cid, self.ALICE, text, mention=mention)
        mid = pid.partition(":")[2]
        return Post(pid, self.ALICE, [pid, f"https://discord.com/channels/{GUILD}/{cid}/{mid}"])

    def reply_ids(self, parent_id: str) -> list[str]:
        """The bot's live messages referencing the parent, as the fake holds them."""
        channel = parent_id.partition(":")[0]
        return [f"{channel}:{m.id}" for m in self.world.bot_replies(parent_id)]

    def refusal(self) -> Reply:
        """Discord's 50035 Invalid Form Body."""
        from tests.discord_fake import fixture

        return Reply(400, fixture("error_invalid_form_body"))

    def rate_limit(self) -> Reply:
        """Discord's bucket 429 with Retry-After and the body's retry_after."""
        return Reply(429, {"message": "You are being rate limited.", "retry_after": RETRY_AFTER_S, "global": False},
                     {"retry-after": str(RETRY_AFTER_S), "x-ratelimit-scope": "user"})

    def gone(self) -> Reply:
        """Discord's 10008 Unknown Message."""
        from tests.discord_fake import fixture

        return Reply(404, fixture("error_unknown_message"))

    def reply_text(self, reply_id: str) -> str:
        """The bot message's current content on the fake (edits applied): the ground truth of an edit."""
        return self.world.text(reply_id)

    def read_routes(self, parent: Parent) -> list[str]:
        """The parent's channel listing."""
        channel = parent.id.partition(":")[0]
        return [rf"^/api/v10/channels/{channel}/messages\?"]

    def close(self) -> None:
        """Stop the proxy and the fake."""
        assert self.proxy is not None
        self.proxy.close()
        self.api.__exit__(None, None, None)


# --- email on a real Postfix and Dovecot ------------------------------------------------------


class EmailHarness(Harness):
    """Email on a real Postfix (SMTP) and Dovecot (IMAP, LMTP); replies counted in the customer's Maildir on disk."""

    kind = "email"
    skips = {
        "test_read_back_partial_checks_only_what_was_read":
            "email read-back is one IMAP connection: a fault cuts it for every parent (the rest stay unchecked)",
        "test_delete_removes_the_reply_and_twice_is_done": "a sent mail cannot be taken back (delete is Rejected)",
        "test_delete_meeting_not_found_is_done": "a sent mail cannot be taken back (delete is Rejected)",
    }
    bad_settings = bad({"address": "bot@example.org", "password": SECRET, "imap_host": "imap.example.org",
                        "smtp_host": "smtp.example.org"},
                       missing=("address", "password", "imap_host", "smtp_host"), wrong=(
        ("address", "bot"), ("address", "a b@example.org"), ("password", SECRET + " x"), ("imap_tls", "tls"),
        ("imap_port", 0), ("smtp_port", 70000), ("answer", "all"), ("max_fetch", 0), ("listing_delay_s", "2"),
        ("colour", "red")))
    small_pages = {"max_fetch": 1}
    patience_s = 10.0  # delivery through Postfix and LMTP is asynchronous

    def __init__(self, mail: Any, http: httpx.Client) -> None:
        from tests.mail_proxy import CutProxy, SmtpFaultProxy

        self.mail, self.http = mail, http
        self.clock = FakeClock(SystemClock().now())
        self.bot = mail.add_user("bot")
        self.alice = mail.add_user("alice")
        self.smtp = SmtpFaultProxy(mail.smtp_port)
        self.imap = CutProxy(mail.imap_port)

    def settings(self) -> dict[str, Any]:
        """The bot's mailbox, through the proxies."""
        return self.mail.settings(self.bot, smtp_port=self.smtp.port, imap_port=self.imap.port, listing_delay_s=1.0)

    def bot_id(self) -> str:
        """The bot's address."""
        return self.bot

    def secret(self) -> str:
        """The bot's password."""
        return str(self.mail.passwords[self.bot])

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """Alice mails the bot; refs: the Message-ID, it without brackets, its ``mid:`` URL."""
        from tests.mail_server import person_mail

        msg = person_mail(self.alice, self.bot, f"question {place}: {text[:40]}", text)
        self.mail.deliver(msg)
        mid = str(msg["Message-ID"])
        self.settle_ids([mid])
        return Post(mid, self.alice, [mid, mid.strip("<>"), f"mid:{mid.strip('<>')}"])

    def settle_ids(self, ids: list[str]) -> None:
        """Wait until the bot's Maildir holds every mail of ``ids``."""
        want = set(ids)
        self.mail.wait_for(self.bot, lambda ms: want <= {str(m.get("Message-ID", "")) for m in ms})

    def settle(self, posts: list[Post]) -> None:
        """Wait for the mails' delivery."""
        self.settle_ids([p.id for p in posts])

    def reply_ids(self, parent_id: str) -> list[str]:
        """Message-IDs of the bot's replies in alice's Maildir whose In-Reply-To is the parent, once delivery is still."""
        return [str(m["Message-ID"]) for m in self.mail.settled_replies(self.alice, parent_id, sender=self.bot)]

    def echo_secret(self, status: int, *, every_request: bool = False) -> None:
        """The next DATA (or every IMAP connection) meets a reply that repeats the password."""
        text = f"token {self.secret()} is odd"
        if every_request:
            self.imap.greet = f"* BYE {text}\r\n".encode()
            return
        code = {422: 554, 500: 451, 429: 452, 401: 535}.get(status, 554)
        self.smtp.add(f"{code} {text}")

    def fail_next_send(self, fault: str) -> None:
        """The next message's DATA meets ``fault`` (an answer without an id is a garbled one: the id is ours)."""
        self.smtp.add({"no_id": "garbled"}.get(fault, fault))

    def faults_met(self) -> bool:
        """Whether every queued fault was met."""
        return self.smtp.pending() == 0

    def unreachable(self) -> Platform:
        """An adapter whose IMAP and SMTP ports refuse connections."""
        from tests.mail_server import free_port

        return self.adapter(imap_port=free_port(), smtp_port=free_port())

    def break_reads(self, parent: Parent | None = None) -> None:
        """Every IMAP connection meets a BYE (no per-parent break: one connection serves the whole read-back)."""
        self.imap.greet = b"* BYE server shutting down\r\n"

    def close(self) -> None:
        """Stop the proxies."""
        self.smtp.close()
        self.imap.close()


# --- WhatsApp on the stateful fake ------------------------------------------------------------


class WhatsAppHarness(NoReadBackFakeHarness):
    """WhatsApp on ``tests/whatsapp_fake.py`` (the Cloud API from Meta's docs), counted in the fake's sent messages."""

    kind = "whatsapp"
    no_read_back = True
    _NO_READ_BACK = "the Cloud API cannot list what a business sent (no read-back): test_no_read_back.py covers the class"
    _WEBHOOK_ONLY = "the Cloud API delivers messages by webhook only: no inbox, search or re-find to poll"
    skips = {
        **no_read_back_skips(_NO_READ_BACK),
        "test_delete_removes_the_reply_and_twice_is_done": "the Cloud API cannot delete a message a business sent",
        "test_delete_meeting_not_found_is_done": "the Cloud API cannot delete a message a business sent",
        "test_three_paths_find_the_parent_and_it_is_answered_once": _WEBHOOK_ONLY,
        "test_inbox_cursor_moves_forward": _WEBHOOK_ONLY,
        "test_search_cursor_moves_forward": _WEBHOOK_ONLY,
    }
    bad_settings = bad({"token": SECRET, "phone_number_id": "106540352242922"}, missing=("token", "phone_number_id"),
                       wrong=(("token", "has space " + SECRET), ("phone_number_id", "+1 555"), ("api_url", "ftp://x"),
                              ("api_version", "21"), ("listing_delay_s", -1), ("colour", "red")))
    url_key = "api_url"
    send_route = ("POST", r"/messages$")
    delete_route = ("DELETE", r"^/nothing$")
    ADA = "16505551234"

    def __init__(self, http: httpx.Client) -> None:
        from tests.whatsapp_fake import WhatsAppApi, WhatsAppWorld

        start_fake(self, http, WhatsAppWorld, WhatsAppApi)
        self.world.window_s = 10 * 365 * 86_400.0  # the cases move the clock by days; the window has its own tests

    def settings(self) -> dict[str, Any]:
        """The access token on the fake's number, through the proxy."""
        from tests.whatsapp_fake import PHONE_ID, TOKEN

        return {"api_url": self.proxy.url, "token": TOKEN, "phone_number_id": PHONE_ID}

    def bot_id(self) -> str:
        """The phone-number-id."""
        from tests.whatsapp_fake import PHONE_ID

        return PHONE_ID

    def secret(self) -> str:
        """The access token (a Bearer header)."""
        from tests.whatsapp_fake import TOKEN

        return TOKEN

    def post(self, text: str, *, mention: bool = True, place: int = 0) -> Post:
        """A customer (one per place) messages the number; refs: ``<wa_id>/<wamid>``."""
        self.clock.advance(1)
        wa_id = str(int(self.ADA) + place)
        wamid = self.world.customer_says(wa_id, text)
        return Post(wamid, wa_id, [f"{wa_id}/{wamid}"])

    def parent(self, adapter: Platform, text: str = "", *, place: int = 0) -> Parent:
        """A new message, as its webhook delivery serves it to the adapter."""
        post = self.post(text or f"{tag()} how do widgets work?", place=place)
        with self.world.lock:
            found = [p for body in self.world.queue for p in (adapter.parse_webhook("", body) or [])  # type: ignore[attr-defined]
                     if not isinstance(p, str) and p.id == post.id]
        return found[0]

    def reply_ids(self, parent_id: str) -> list[str]:
        """The business's messages sent in context of the parent, as the fake holds them."""
        with self.world.lock:
            return [m["id"] for m in self.world.sent if m["context"] == parent_id]

    def refusal(self) -> Reply:
        """Graph's 400 invalid parameter."""
        return Reply(400, {"error": {"message": "(#100) Invalid parameter", "type": "OAuthException", "code": 100}})

    def rate_limit(self) -> Reply:
        """130429 with a Retry-After."""
        from tests.whatsapp_fake import fixture

        return Reply(400, fixture("error_130429"), {"retry-after": str(RETRY_AFTER_S)})



@dataclass(frozen=True)
class Entry:
    """One adapter's row in the contract-suite parameters: its harness and the session fixture it runs on."""

    harness: type[Harness]
    backend: str | None  # a pytest fixture name (None: nothing to start)


# THE parameter table of the adapter contract suite: one entry per adapter.
HARNESSES: dict[str, Entry] = {
    "memory": Entry(MemoryHarness, None),
    "mastodon": Entry(MastodonHarness, "contract_sim"),
    "discourse": Entry(DiscourseHarness, "contract_forum_host"),
    "github": Entry(GitHubHarness, "contract_forum_host"),
    "bluesky": Entry(BlueskyHarness, "bsky_network"),
    "matrix": Entry(MatrixHarness, "synapse"),
    "slack": Entry(SlackHarness, None),
    "telegram": Entry(TelegramHarness, None),
    "whatsapp": Entry(WhatsAppHarness, None),
    "discord": Entry(DiscordHarness, None),
    "email": Entry(EmailHarness, "mail_server"),
}


def build(name: str, backend: Any, http: httpx.Client) -> Iterator[Harness]:
    """Make the harness ``name`` on ``backend``; close it after the test."""
    entry = HARNESSES[name]
    h = entry.harness(http) if entry.backend is None else entry.harness(backend, http)  # type: ignore[call-arg]
    try:
        yield h
    finally:
        h.close()
