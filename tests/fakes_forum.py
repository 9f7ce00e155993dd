"""Stateful fakes of the Discourse and GitHub APIs, built on the recorded response shapes.

Each fake is a Starlette app served by uvicorn on 127.0.0.1 (through the
``FixtureServer`` machinery of ``tests/fixtures_server.py``) and holds its
forum in memory: topics and posts, or repositories, issues and comments. Every
JSON object it serves is a recorded body from ``shared/fixtures`` with the
fields that matter replaced, so the adapters meet the real shapes.

Both fakes model what the end-to-end tests need to measure:

- a listing delay: a created post or comment only appears in listings (topic
  views, own-activity feeds, search, comment listings) ``listing_delay_s``
  seconds of the shared ``FakeClock`` after it was created;
- injected faults for the next create request, taken from ``faults`` in order:
  ``"lost"`` (created, then the connection drops before the answer),
  ``"error_before"`` (502 and nothing created), ``"error_after"`` (created,
  then 502), ``"rate_limited"`` (429 / GitHub's secondary-limit 403),
  ``"forbidden"`` (403: closed topic, locked issue), ``"rejected"`` (422);
- edits of the bot's own replies (Discourse ``PUT /posts/{id}.json``, GitHub
  ``PATCH /repos/{o}/{r}/issues/comments/{id}``) with the platform's refusals
  (gone, not the bot's, locked / closed / too old, too long) and the same
  faults from ``edit_faults`` (any other word, e.g. ``"none"``, lets that edit
  through); a reply keeps every text it had (``history``),
  and setting the same text again is no new revision;
- counts kept by the fake itself (``reply_count``, ``create_requests``,
  ``edit_requests``, ``reply_text``): the tests count replies on the
  "platform", never from replyd's own log.
"""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from replyd.clock import FakeClock
from replyd.errors import MaybeSent
from replyd.guard import Status
from replyd.platforms.base import Pending
from replyd.store import Store
from tests.fixtures_server import DropResponse, FixtureServer, http_date, load_fixture


def _fx(platform: str, name: str) -> Any:
    return json.loads(load_fixture(platform, name))


def iso_ms(t: float) -> str:
    """Discourse's timestamps: milliseconds and Z."""
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso_s(t: float) -> str:
    """GitHub's timestamps: whole seconds and Z."""
    return datetime.fromtimestamp(int(t // 1), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> float:
    """Parse Z-terminated ISO times back to epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class AppServer(FixtureServer):
    """``FixtureServer``'s uvicorn thread serving a given Starlette app instead of canned routes."""

    def __init__(self, app: Starlette) -> None:
        super().__init__()
        self._app = app


@dataclass
class FakeUser:
    """A forum account."""

    id: int
    username: str
    kind: str = "User"


# --- Discourse ------------------------------------------------------------------------------


@dataclass
class DPost:
    """A Discourse post as the fake stores it."""

    id: int
    topic_id: int
    post_number: int
    user_id: int
    raw: str
    created_at: float
    reply_to_post_number: int | None = None
    deleted: bool = False
    history: list[str] = field(default_factory=list)  # every raw it had, the current one last (revisions)
    updated_at: float | None = None


@dataclass
class DTopic:
    """A Discourse topic; ``private`` makes it a private message."""

    id: int
    title: str
    slug: str
    private: bool = False
    closed: bool = False
    allowed: set[int] = field(default_factory=set)
    posts: list[int] = field(default_factory=list)


class FakeDiscourse:
    """An in-memory Discourse: topics, posts, the bot's notifications and activity, over real HTTP."""

    API_KEY = "disc-key-SECRET-0011223344556677"

    def __init__(self, clock: FakeClock, *, bot: str = "replybot", bot_id: int = 77) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.listing_delay_s = 0.0
        self.faults: list[str] = []
        self.notifications_page = 60
        self.search_page = 50
        self.users: dict[int, FakeUser] = {}
        self.topics: dict[int, DTopic] = {}
        self.posts: dict[int, DPost] = {}
        self.notes: list[dict[str, Any]] = []  # the bot's notifications, oldest first
        self.last_read: dict[int, int] = {}  # the bot's last read post number per topic
        self.create_requests = 0
        self.edit_faults: list[str] = []  # faults for the next edits (PUT /posts/{id}.json), as ``faults``
        self.edit_requests = 0
        self.lost_edits = 0  # edits that acted and whose response was then cut
        self.max_post_length = 32_000  # the site setting; an edit's raw above it is a 422
        self.edit_time_limit_s = 86_400.0  # post_edit_time_limit (1440 minutes): later edits are a 403
        self._ids = {"post": 1000, "topic": 100, "note": 500}
        self.bot = self.add_user(bot, bot_id)
        self._post_tpl = _fx("discourse", "post_created.json")
        self._note_tpl = _fx("discourse", "notifications.json")["notifications"][1]
        self._action_tpl = _fx("discourse", "user_actions_replies.json")["user_actions"][0]
        self._search_tpl = _fx("discourse", "search.json")
        self._user_tpl = _fx("discourse", "user.json")
        topic = _fx("discourse", "topic.json")
        topic.pop("post_stream")
        topic.pop("details", None)
        self._topic_tpl = topic
        self.app = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])

    # -- building the world --------------------------------------------------------------

    def _next(self, kind: str) -> int:
        self._ids[kind] += 1
        return self._ids[kind]

    def add_user(self, username: str, uid: int | None = None) -> FakeUser:
        """Register an account."""
        with self.lock:
            user = FakeUser(uid if uid is not None else 200 + len(self.users), username)
            self.users[user.id] = user
            return user

    def create_topic(self, author: FakeUser, title: str, raw: str, *, private_with: tuple[FakeUser, ...] = ()) -> DPost:
        """A new topic (or private message to ``private_with``) and its first post."""
        with self.lock:
            tid = self._next("topic")
            slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "topic"
            topic = DTopic(tid, title, slug, private=bool(private_with), allowed={author.id, *(u.id for u in private_with)})
            self.topics[tid] = topic
            return self._add_post(author, topic, raw, None)

    def reply(self, author: FakeUser, topic_id: int, raw: str, reply_to: int | None = None) -> DPost:
        """A human's reply in a topic (``reply_to`` is a post number)."""
        with self.lock:
            return self._add_post(author, self.topics[topic_id], raw, reply_to)

    def _add_post(self, author: FakeUser, topic: DTopic, raw: str, reply_to: int | None) -> DPost:
        number = max((self.posts[p].post_number for p in topic.posts), default=0) + 1
        post = DPost(self._next("post"), topic.id, number, author.id, raw, self.clock.now(), reply_to, history=[raw])
        self.posts[post.id] = post
        topic.posts.append(post.id)
        if author.id == self.bot.id:
            self.last_read[topic.id] = number
        else:
            self._notify(post, topic)
        return post

    def _notify(self, post: DPost, topic: DTopic) -> None:
        """What PostAlerter would give the bot for a post (collapsing replied / PM notifications)."""
        replied_to = self._by_number(topic.id, post.reply_to_post_number) if post.reply_to_post_number else None
        if replied_to is not None and replied_to.user_id == self.bot.id:
            ntype = 2
        elif f"@{self.bot.username}".lower() in post.raw.lower():
            ntype = 1
        elif topic.private and self.bot.id in topic.allowed:
            ntype = 6
        else:
            return
        first = post
        count = 1
        if ntype in (2, 6):  # COLLAPSED_NOTIFICATION_TYPES: older ones in the topic go away
            self.notes = [n for n in self.notes if not (n["topic_id"] == topic.id and n["notification_type"] in (2, 6, 9))]
            unread = [
                self.posts[p]
                for p in topic.posts
                if self.posts[p].post_number > self.last_read.get(topic.id, 0)
                and self.posts[p].user_id != self.bot.id
                and (topic.private or self._replies_to_bot(self.posts[p]))
            ]
            if unread:
                first = min(unread, key=lambda p: p.post_number)
                count = len(unread)
        note = copy.deepcopy(self._note_tpl)
        author = self.users[post.user_id].username
        note.update(
            id=self._next("note"),
            notification_type=ntype,
            read=False,
            created_at=iso_ms(self.clock.now()),
            post_number=first.post_number,
            topic_id=topic.id,
            fancy_title=topic.title,
            slug=topic.slug,
        )
        note["data"] = {
            "topic_title": topic.title,
            "original_post_id": post.id,
            "original_post_type": 1,
            "original_username": author,
            "revision_number": None,
            "display_username": f"{count} replies" if count > 1 else author,
        }
        self.notes.append(note)

    def _replies_to_bot(self, post: DPost) -> bool:
        target = self._by_number(post.topic_id, post.reply_to_post_number) if post.reply_to_post_number else None
        return target is not None and target.user_id == self.bot.id

    def _by_number(self, topic_id: int, number: int | None) -> DPost | None:
        for pid in self.topics[topic_id].posts:
            if self.posts[pid].post_number == number:
                return self.posts[pid]
        return None

    # -- what the tests count ------------------------------------------------------------

    def replies(self, parent_post_id: int | str, user: FakeUser | None = None) -> list[DPost]:
        """Live posts by ``user`` (the bot) answering the given post, however listed."""
        with self.lock:
            parent = self.posts[int(parent_post_id)]
            uid = (user or self.bot).id
            return [
                p
                for p in self.posts.values()
                if p.topic_id == parent.topic_id
                and p.reply_to_post_number == parent.post_number
                and p.user_id == uid
                and not p.deleted
            ]

    def reply_count(self, parent_post_id: int | str) -> int:
        """How many replies the bot has on the platform for this parent."""
        return len(self.replies(parent_post_id))

    def reply_text(self, post_id: int | str) -> str:
        """The post's current raw text, as the forum shows it."""
        with self.lock:
            return self.posts[int(post_id)].raw

    def edits(self, post_id: int | str) -> int:
        """How many revisions the post has beyond its first version."""
        with self.lock:
            return len(self.posts[int(post_id)].history) - 1

    # -- serialisation -------------------------------------------------------------------

    def _listed(self, post: DPost) -> bool:
        return not post.deleted and self.clock.now() >= post.created_at + self.listing_delay_s

    def _post_json(self, post: DPost, *, raw: bool = False) -> dict[str, Any]:
        topic = self.topics[post.topic_id]
        user = self.users[post.user_id]
        out = copy.deepcopy(self._post_tpl)
        out.update(
            id=post.id,
            username=user.username,
            user_id=user.id,
            created_at=iso_ms(post.created_at),
            updated_at=iso_ms(post.updated_at or post.created_at),
            version=len(post.history) or 1,
            cooked=f"<p>{post.raw}</p>",
            post_number=post.post_number,
            reply_to_post_number=post.reply_to_post_number,
            topic_id=topic.id,
            topic_slug=topic.slug,
            yours=user.id == self.bot.id,
            admin=False,
            staff=False,
        )
        out["post_url"] = f"/t/{topic.slug}/{topic.id}/{post.post_number}"
        target = self._by_number(topic.id, post.reply_to_post_number) if post.reply_to_post_number else None
        if target is not None:
            out["reply_to_user"] = {
                "username": self.users[target.user_id].username,
                "name": None,
                "avatar_template": "/letter_avatar_proxy/v4/letter/r/{size}.png",
            }
        if raw:
            out["raw"] = post.raw
        return out

    def _topic_json(self, topic: DTopic, posts: list[DPost], stream: list[int]) -> dict[str, Any]:
        out = copy.deepcopy(self._topic_tpl)
        out.update(
            id=topic.id,
            title=topic.title,
            fancy_title=topic.title,
            slug=topic.slug,
            archetype="private_message" if topic.private else "regular",
            closed=topic.closed,
            posts_count=len(stream),
            highest_post_number=max((self.posts[p].post_number for p in topic.posts), default=0),
        )
        out["post_stream"] = {"posts": [self._post_json(p) for p in posts], "stream": stream}
        return out

    # -- HTTP ----------------------------------------------------------------------------

    def _auth(self, request: Request) -> FakeUser | None:
        key = request.headers.get("api-key")
        name = request.headers.get("api-username")
        if key != self.API_KEY:
            return None
        return next((u for u in self.users.values() if u.username == name), None)

    @staticmethod
    def _error(status: int, message: str, error_type: str, **extra: Any) -> JSONResponse:
        return JSONResponse({"errors": [message], "error_type": error_type, **extra}, status_code=status)

    async def _endpoint(self, request: Request) -> Response:
        body = await request.body()
        with self.lock:
            me = self._auth(request)
            if me is None:
                return self._error(
                    403,
                    "You are not permitted to view the requested resource. The API username or key is invalid.",
                    "invalid_access",
                )
            resp = self._route(request, "/" + request.path_params["path"], body, me)
            resp.headers["date"] = http_date(self.clock.now())  # the forum's own clock, as a real server's Date
            return resp

    def _route(self, request: Request, path: str, body: bytes, me: FakeUser) -> Response:
        q = request.query_params
        m = re.fullmatch(r"/u/([^/]+)\.json", path)
        if m and request.method == "GET":
            user = next((u for u in self.users.values() if u.username == m.group(1)), None)
            if user is None:
                return self._error(404, "The requested URL or resource could not be found.", "not_found")
            out = copy.deepcopy(self._user_tpl)
            out["user"].update(id=user.id, username=user.username)
            return JSONResponse(out)
        if path == "/session/current.json":
            return JSONResponse({"current_user": {"id": me.id, "username": me.username}})
        if path == "/notifications.json":
            return self._notifications(q, me)
        m = re.fullmatch(r"/posts/(\d+)\.json", path)
        if m:
            post = self.posts.get(int(m.group(1)))
            if post is None or post.deleted:
                return self._error(404, "The requested URL or resource could not be found.", "not_found")
            if request.method == "DELETE":
                post.deleted = True
                return Response(status_code=200)
            if request.method == "PUT":
                return self._edit(post, body, me)
            return JSONResponse(self._post_json(post, raw=True))
        m = re.fullmatch(r"/t/(\d+)(?:/(\d+))?\.json", path)
        if m:
            return self._topic(int(m.group(1)), int(m.group(2)) if m.group(2) else None)
        m = re.fullmatch(r"/t/(\d+)/posts\.json", path)
        if m:
            return self._topic_posts(int(m.group(1)), q)
        if path == "/user_actions.json":
            return self._user_actions(q)
        if path == "/search.json":
            return self._search(q)
        if path == "/posts.json" and request.method == "POST":
            return self._create(json.loads(body or b"{}"), me)
        return self._error(404, "The requested URL or resource could not be found.", "not_found")

    def _notifications(self, q: Any, me: FakeUser) -> Response:
        offset = int(q.get("offset") or 0)
        limit = self.notifications_page
        newest_first = list(reversed(self.notes))
        page = newest_first[offset : offset + limit]
        return JSONResponse(
            {
                "notifications": page,
                "total_rows_notifications": len(newest_first),
                "seen_notification_id": newest_first[0]["id"] if newest_first else None,
                "load_more_notifications": f"/notifications?offset={offset + limit}&username={me.username}",
            }
        )

    def _topic(self, tid: int, near: int | None) -> Response:
        topic = self.topics.get(tid)
        if topic is None:
            return self._error(404, "The requested URL or resource could not be found.", "not_found")
        listed = [self.posts[p] for p in topic.posts if self._listed(self.posts[p])]
        listed.sort(key=lambda p: p.post_number)
        if near is None:
            chunk = listed[:20]
        else:
            at = next((i for i, p in enumerate(listed) if p.post_number >= near), len(listed))
            start = max(0, at - 5)
            chunk = listed[start : start + 20]
        return JSONResponse(self._topic_json(topic, chunk, [p.id for p in listed]))

    def _topic_posts(self, tid: int, q: Any) -> Response:
        topic = self.topics.get(tid)
        if topic is None:
            return self._error(404, "The requested URL or resource could not be found.", "not_found")
        listed = sorted((self.posts[p] for p in topic.posts if self._listed(self.posts[p])), key=lambda p: p.post_number)
        ids = q.getlist("post_ids[]")
        if ids:
            want = {int(i) for i in ids}
            posts = [p for p in listed if p.id in want]
        elif q.get("post_number") is not None:
            after = int(q["post_number"])
            if q.get("asc") == "true":
                posts = [p for p in listed if p.post_number > after][:20]
            else:
                posts = [p for p in listed if p.post_number < after][-20:]
        else:
            posts = listed[:20]
        return JSONResponse({"post_stream": {"posts": [self._post_json(p) for p in posts]}, "id": tid})

    def _user_actions(self, q: Any) -> Response:
        user = next((u for u in self.users.values() if u.username == q.get("username")), None)
        if user is None:
            return self._error(404, "The requested URL or resource could not be found.", "not_found")
        types = {int(t) for t in (q.get("filter") or "").split(",") if t}
        offset = int(q.get("offset") or 0)
        limit = int(q.get("limit") or 30)
        rows = []
        for post in sorted(self.posts.values(), key=lambda p: (p.created_at, p.id), reverse=True):
            if post.user_id != user.id or post.post_number == 1 or not self._listed(post):
                continue
            topic = self.topics[post.topic_id]
            action = 12 if topic.private else 5
            if types and action not in types:
                continue
            row = copy.deepcopy(self._action_tpl)
            row.update(
                action_type=action,
                created_at=iso_ms(post.created_at),
                excerpt=post.raw[:100],
                slug=topic.slug,
                topic_id=topic.id,
                target_user_id=user.id,
                target_username=user.username,
                post_number=post.post_number,
                post_id=post.id,
                reply_to_post_number=post.reply_to_post_number,
                username=user.username,
                user_id=user.id,
                acting_username=user.username,
                acting_user_id=user.id,
                title=topic.title,
            )
            rows.append(row)
        return JSONResponse({"user_actions": rows[offset : offset + limit]})

    def _search(self, q: Any) -> Response:
        terms = [t for t in (q.get("q") or "").lower().split() if not t.startswith("order:")]
        page = int(q.get("page") or 1)
        hits = [
            p
            for p in sorted(self.posts.values(), key=lambda p: (p.created_at, p.id), reverse=True)
            if self._listed(p) and not self.topics[p.topic_id].private and all(t in p.raw.lower() for t in terms)
        ]
        size = self.search_page
        chunk = hits[(page - 1) * size : page * size]
        out = copy.deepcopy(self._search_tpl)
        shape = out["posts"][0]
        topic_shape = out["topics"][0]
        out["posts"] = []
        out["topics"] = []
        for p in chunk:
            hit = copy.deepcopy(shape)
            hit.update(
                id=p.id,
                username=self.users[p.user_id].username,
                created_at=iso_ms(p.created_at),
                cooked=f"<p>{p.raw}</p>",
                blurb=p.raw[:100],
                post_number=p.post_number,
                topic_id=p.topic_id,
            )
            out["posts"].append(hit)
            if all(t["id"] != p.topic_id for t in out["topics"]):
                t = copy.deepcopy(topic_shape)
                t.update(id=p.topic_id, title=self.topics[p.topic_id].title, slug=self.topics[p.topic_id].slug)
                out["topics"].append(t)
        out["grouped_search_result"].update(
            post_ids=[p.id for p in chunk], more_full_page_results=len(hits) > page * size or None
        )
        return JSONResponse(out)

    def _create(self, data: dict[str, Any], me: FakeUser) -> Response:
        self.create_requests += 1
        fault = self.faults.pop(0) if self.faults else None
        if fault == "error_before":
            return Response("<html><body><h1>502 Bad Gateway</h1></body></html>", status_code=502, media_type="text/html")
        if fault == "rate_limited":
            return self._error(
                429,
                "You’ve performed this action too many times. Please wait 7 seconds before trying again.",
                "rate_limit",
                extras={"wait_seconds": 7, "time_left": "7 seconds"},
            )
        if fault == "rejected":
            return self._error(422, "Body is too similar to what you recently posted", "invalid_parameters")
        topic = self.topics.get(int(data.get("topic_id") or 0))
        if topic is None:
            return self._error(404, "The requested URL or resource could not be found.", "not_found")
        if fault == "forbidden" or topic.closed:
            return self._error(403, "You are not permitted to view the requested resource.", "invalid_access")
        post = self._add_post(me, topic, str(data.get("raw", "")), data.get("reply_to_post_number"))
        if fault == "lost":
            return DropResponse(status_code=200)
        if fault == "error_after":
            return Response("<html><body><h1>502 Bad Gateway</h1></body></html>", status_code=502, media_type="text/html")
        return JSONResponse(self._post_json(post, raw=True))

    def _edit(self, post: DPost, body: bytes, me: FakeUser) -> Response:
        """``PUT /posts/{id}.json`` with ``{"post": {"raw": …}}``: Discourse's "Update a single post", faults first."""
        self.edit_requests += 1
        fault = self.edit_faults.pop(0) if self.edit_faults else None
        if fault == "error_before":
            return Response("<html><body><h1>502 Bad Gateway</h1></body></html>", status_code=502, media_type="text/html")
        if fault == "rate_limited":
            return self._error(429, "You’ve performed this action too many times. Please wait 7 seconds before trying again.",
                               "rate_limit", extras={"wait_seconds": 7, "time_left": "7 seconds"})
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            data = None
        raw = data.get("post", {}).get("raw") if isinstance(data, dict) and isinstance(data.get("post"), dict) else None
        if not isinstance(raw, str):
            return self._error(400, "param is missing or the value is empty: post", "invalid_parameters")
        too_late = self.clock.now() > post.created_at + self.edit_time_limit_s
        if fault == "forbidden" or post.user_id != me.id or self.topics[post.topic_id].closed or too_late:
            return self._error(403, "You are not permitted to view the requested resource.", "invalid_access")
        if len(raw) > self.max_post_length:
            return self._error(422, f"Body is limited to {self.max_post_length} characters; you entered {len(raw)}.",
                               "invalid_parameters")
        if raw != post.raw:  # the same raw again makes no revision
            post.raw = raw
            post.history.append(raw)
            post.updated_at = self.clock.now()
        if fault == "lost":
            self.lost_edits += 1
            return DropResponse(status_code=200)
        if fault == "error_after":
            return Response("<html><body><h1>502 Bad Gateway</h1></body></html>", status_code=502, media_type="text/html")
        return JSONResponse({"post": self._post_json(post, raw=True)})


# --- GitHub ---------------------------------------------------------------------------------


@dataclass
class GIssue:
    """An issue or pull request as the fake stores it."""

    id: int
    repo: str
    number: int
    user_id: int
    title: str
    body: str
    created_at: float
    updated_at: float
    pull_request: bool = False
    state: str = "open"
    locked: bool = False


@dataclass
class GComment:
    """An issue comment as the fake stores it."""

    id: int
    repo: str
    number: int
    user_id: int
    body: str
    created_at: float
    updated_at: float
    deleted: bool = False
    history: list[str] = field(default_factory=list)  # every body it had, the current one last (edits)


class FakeGitHub:
    """An in-memory GitHub: repositories, issues, comments and the bot's notifications, over real HTTP."""

    TOKEN = "ghp_SECRETfaketoken0123456789abcdefABCD"
    LINK_HOST = "https://api.github.com"
    BODY_MAX = 65_536  # characters in a comment body (GitHub's 422 "Body is too long (maximum is 65536 characters)")

    def __init__(self, clock: FakeClock, *, bot: str = "replyd-bot", bot_id: int = 4_100_000_001) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.listing_delay_s = 0.0
        self.faults: list[str] = []
        self.lost_rate = 0.0  # the share of creates (without a queued fault) whose response is lost after creating
        self.lost_responses = 0  # creates whose comment was made and whose response was then cut
        self._rng = random.Random(0)
        self.users: dict[int, FakeUser] = {}
        self.repos: dict[str, int] = {}  # full name -> repository id
        self.issues: dict[int, GIssue] = {}
        self.comments: dict[int, GComment] = {}
        self.threads: dict[str, dict[str, Any]] = {}
        self.create_requests = 0
        self.edit_faults: list[str] = []  # faults for the next edits (PATCH of a comment), as ``faults``
        self.edit_requests = 0
        self.lost_edits = 0  # edits that acted and whose response was then cut
        self.requests: list[str] = []
        self._ids = {"issue": 3_500_000_000, "comment": 1_254_900_000, "thread": 530_000_000}
        self.bot = self.add_user(bot, bot_id, kind="Bot" if bot.endswith("[bot]") else "User")
        self._issue_tpl = _fx("github", "search_issues.json")["items"][0]
        self._issue_tpl.pop("score", None)
        self._comment_tpl = _fx("github", "issue_comment_created.json")
        self._thread_tpl = _fx("github", "notifications.json")[4]
        self._user_tpl = _fx("github", "user.json")
        self.app = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])

    # -- building the world --------------------------------------------------------------

    def _next(self, kind: str) -> int:
        self._ids[kind] += 1
        return self._ids[kind]

    def add_user(self, login: str, uid: int | None = None, kind: str = "User") -> FakeUser:
        """Register an account."""
        with self.lock:
            user = FakeUser(uid if uid is not None else 10_000 + len(self.users), login, kind)
            self.users[user.id] = user
            return user

    def add_repo(self, full: str) -> None:
        """Create a repository ``owner/name``."""
        with self.lock:
            self.repos[full] = 400_000 + len(self.repos)

    def open_issue(self, author: FakeUser, repo: str, title: str, body: str, *, pull_request: bool = False) -> GIssue:
        """A human opens an issue (or PR); a mention of the bot makes a notification thread."""
        with self.lock:
            number = 1 + max((i.number for i in self.issues.values() if i.repo == repo), default=0)
            now = self.clock.now()
            issue = GIssue(self._next("issue"), repo, number, author.id, title, body, now, now, pull_request)
            self.issues[issue.id] = issue
            if f"@{self.bot.username}".lower() in f"{title} {body}".lower():
                self._thread(issue, "mention")
            return issue

    def comment(self, author: FakeUser, issue: GIssue, body: str) -> GComment:
        """A human comments; the issue is updated (and a mention makes a notification)."""
        with self.lock:
            return self._add_comment(author, issue, body)

    def _add_comment(self, author: FakeUser, issue: GIssue, body: str) -> GComment:
        now = self.clock.now()
        c = GComment(self._next("comment"), issue.repo, issue.number, author.id, body, now, now, history=[body])
        self.comments[c.id] = c
        issue.updated_at = now
        if author.id != self.bot.id and f"@{self.bot.username}".lower() in body.lower():
            self._thread(issue, "mention")
        return c

    def _thread(self, issue: GIssue, reason: str) -> None:
        key = f"{issue.repo}#{issue.number}"
        thread = self.threads.get(key)
        if thread is None:
            thread = {"id": str(self._next("thread")), "issue": issue.id}
            self.threads[key] = thread
        thread.update(reason=reason, updated_at=self.clock.now())

    # -- what the tests count ------------------------------------------------------------

    def replies(self, issue: GIssue, user: FakeUser | None = None) -> list[GComment]:
        """Live comments by ``user`` (the bot) on the issue, however listed."""
        with self.lock:
            uid = (user or self.bot).id
            return [
                c
                for c in self.comments.values()
                if c.repo == issue.repo and c.number == issue.number and c.user_id == uid and not c.deleted
            ]

    def reply_count(self, issue: GIssue) -> int:
        """How many comments the bot has on the platform for this issue."""
        return len(self.replies(issue))

    def reply_text(self, comment_id: int | str) -> str:
        """The comment's current body, as GitHub shows it."""
        with self.lock:
            return self.comments[int(comment_id)].body

    def edits(self, comment_id: int | str) -> int:
        """How many times the comment's body changed (GitHub's "edited" history, without the first body)."""
        with self.lock:
            return len(self.comments[int(comment_id)].history) - 1

    # -- serialisation -------------------------------------------------------------------

    def _user_json(self, user: FakeUser) -> dict[str, Any]:
        out = copy.deepcopy(self._comment_tpl["user"])
        out.update(login=user.username, id=user.id, type=user.kind)
        return out

    def _issue_json(self, issue: GIssue) -> dict[str, Any]:
        base = f"{self.LINK_HOST}/repos/{issue.repo}"
        out = copy.deepcopy(self._issue_tpl)
        out.update(
            url=f"{base}/issues/{issue.number}",
            repository_url=base,
            labels_url=f"{base}/issues/{issue.number}/labels{{/name}}",
            comments_url=f"{base}/issues/{issue.number}/comments",
            events_url=f"{base}/issues/{issue.number}/events",
            html_url=f"https://github.com/{issue.repo}/{'pull' if issue.pull_request else 'issues'}/{issue.number}",
            id=issue.id,
            node_id=f"I_kwDOFAKE{issue.id}",
            number=issue.number,
            title=issue.title,
            user=self._user_json(self.users[issue.user_id]),
            state=issue.state,
            locked=issue.locked,
            comments=sum(1 for c in self.comments.values() if c.repo == issue.repo and c.number == issue.number),
            created_at=iso_s(issue.created_at),
            updated_at=iso_s(issue.updated_at),
            closed_at=None,
            body=issue.body,
            state_reason=None,
            timeline_url=f"{base}/issues/{issue.number}/timeline",
        )
        out["reactions"]["url"] = f"{base}/issues/{issue.number}/reactions"
        if issue.pull_request:
            out["pull_request"] = {
                "url": f"{base}/pulls/{issue.number}",
                "html_url": f"https://github.com/{issue.repo}/pull/{issue.number}",
            }
        return out

    def _comment_json(self, c: GComment) -> dict[str, Any]:
        base = f"{self.LINK_HOST}/repos/{c.repo}"
        out = copy.deepcopy(self._comment_tpl)
        out.update(
            url=f"{base}/issues/comments/{c.id}",
            html_url=f"https://github.com/{c.repo}/issues/{c.number}#issuecomment-{c.id}",
            issue_url=f"{base}/issues/{c.number}",
            id=c.id,
            node_id=f"IC_kwDOFAKE{c.id}",
            user=self._user_json(self.users[c.user_id]),
            created_at=iso_s(c.created_at),
            updated_at=iso_s(c.updated_at),
            body=c.body,
        )
        out["reactions"]["url"] = f"{base}/issues/comments/{c.id}/reactions"
        return out

    def _thread_json(self, thread: dict[str, Any]) -> dict[str, Any]:
        issue = self.issues[thread["issue"]]
        owner, name = issue.repo.split("/")
        out = copy.deepcopy(self._thread_tpl)
        kind = "pulls" if issue.pull_request else "issues"
        out.update(
            id=thread["id"],
            unread=True,
            reason=thread["reason"],
            updated_at=iso_s(thread["updated_at"]),
            last_read_at=None,
            url=f"{self.LINK_HOST}/notifications/threads/{thread['id']}",
            subscription_url=f"{self.LINK_HOST}/notifications/threads/{thread['id']}/subscription",
        )
        out["subject"] = {
            "title": issue.title,
            "url": f"{self.LINK_HOST}/repos/{issue.repo}/{kind}/{issue.number}",
            "latest_comment_url": f"{self.LINK_HOST}/repos/{issue.repo}/{kind}/{issue.number}",
            "type": "PullRequest" if issue.pull_request else "Issue",
        }
        out["repository"].update(id=self.repos[issue.repo], name=name, full_name=issue.repo)
        out["repository"]["owner"].update(login=owner)
        return out

    def _listed(self, created_at: float) -> bool:
        return self.clock.now() >= created_at + self.listing_delay_s

    def _paged(self, request: Request, items: list[Any], *, link_path: str | None = None) -> Response:
        q = request.query_params
        per_page = min(100, int(q.get("per_page") or 30))
        page = int(q.get("page") or 1)
        chunk = items[(page - 1) * per_page : page * per_page]
        headers = {"x-ratelimit-resource": "core", "x-ratelimit-remaining": "4999", "x-ratelimit-limit": "5000",
                   "x-ratelimit-reset": str(int(self.clock.now()) + 3600)}
        if page * per_page < len(items):
            params = [(k, v) for k, v in q.multi_items() if k != "page"] + [("page", str(page + 1))]
            headers["link"] = f'<{self.LINK_HOST}{link_path or request.url.path}?{urlencode(params)}>; rel="next"'
        return JSONResponse(chunk, headers=headers)

    # -- HTTP ----------------------------------------------------------------------------

    async def _endpoint(self, request: Request) -> Response:
        body = await request.body()
        with self.lock:
            self.requests.append(f"{request.method} {request.url.path}")
            if request.headers.get("authorization") != f"Bearer {self.TOKEN}":
                return JSONResponse(
                    {"message": "Bad credentials", "documentation_url": "https://docs.github.com/rest", "status": "401"},
                    status_code=401,
                )
            resp = self._route(request, "/" + request.path_params["path"], body)
            # GitHub's own clock: its Date, its created_at and updated_at, and the `since` it filters on.
            resp.headers["date"] = http_date(self.clock.now())
            return resp

    def _not_found(self) -> JSONResponse:
        return JSONResponse({"message": "Not Found", "documentation_url": "https://docs.github.com/rest", "status": "404"}, status_code=404)

    def _route(self, request: Request, path: str, body: bytes) -> Response:
        q = request.query_params
        if path == "/user":
            return self._user(self.bot)
        m = re.fullmatch(r"/users/([^/]+)", path)
        if m:
            user = next((u for u in self.users.values() if u.username == m.group(1)), None)
            return self._user(user) if user else self._not_found()
        if path == "/notifications":
            since = parse_iso(q["since"]) if q.get("since") else None
            threads = [t for t in self.threads.values() if since is None or t["updated_at"] >= since]
            threads.sort(key=lambda t: t["updated_at"], reverse=True)
            return self._paged(request, [self._thread_json(t) for t in threads])
        if path == "/search/issues":
            return self._search(request)
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues", path)
        if m and m.group(1) in self.repos:
            return self._list_issues(request, m.group(1))
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/comments", path)
        if m and m.group(1) in self.repos:
            return self._list_comments(request, m.group(1), None)
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/comments/(\d+)", path)
        if m and request.method == "PATCH":
            return self._edit(m.group(1), int(m.group(2)), body)
        if m and request.method == "DELETE":
            c = self.comments.get(int(m.group(2)))
            if c is None or c.deleted or c.repo != m.group(1):
                return self._not_found()
            c.deleted = True
            return Response(status_code=204)
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues/(\d+)(/comments)?", path)
        if m:
            issue = next((i for i in self.issues.values() if i.repo == m.group(1) and i.number == int(m.group(2))), None)
            if issue is None:
                return self._not_found()
            if not m.group(3):
                return JSONResponse(self._issue_json(issue))
            if request.method == "POST":
                return self._create(issue, json.loads(body or b"{}"))
            return self._list_comments(request, issue.repo, issue.number)
        return self._not_found()

    def _user(self, user: FakeUser) -> Response:
        out = copy.deepcopy(self._user_tpl)
        out.update(login=user.username, id=user.id, type=user.kind)
        return JSONResponse(out)

    def _list_issues(self, request: Request, repo: str) -> Response:
        q = request.query_params
        since = parse_iso(q["since"]) if q.get("since") else None
        state = q.get("state") or "open"
        key = "created_at" if q.get("sort") == "created" else "updated_at"
        items = [
            i
            for i in self.issues.values()
            if i.repo == repo
            and (state == "all" or i.state == state)
            and (since is None or i.updated_at >= since)
            and self._listed(i.created_at)
        ]
        items.sort(key=lambda i: (getattr(i, key), i.id), reverse=q.get("direction", "desc") == "desc")
        return self._paged(request, [self._issue_json(i) for i in items])

    def _list_comments(self, request: Request, repo: str, number: int | None) -> Response:
        q = request.query_params
        since = parse_iso(q["since"]) if q.get("since") else None
        items = [
            c
            for c in self.comments.values()
            if c.repo == repo
            and (number is None or c.number == number)
            and not c.deleted
            and (since is None or c.updated_at >= since)
            and self._listed(c.created_at)
        ]
        items.sort(key=lambda c: (c.created_at, c.id), reverse=q.get("direction") == "desc")
        # The repo-wide listing's next link names /repositories/{id}/…, as recorded.
        link_path = f"/repositories/{self.repos[repo]}/issues/comments" if number is None else None
        return self._paged(request, [self._comment_json(c) for c in items], link_path=link_path)

    def _search(self, request: Request) -> Response:
        q = request.query_params
        terms, after = [], None
        for tok in (q.get("q") or "").split():
            if tok.startswith("created:>="):
                after = parse_iso(tok[len("created:>="):])
            else:
                terms.append(tok.lower())
        items = [
            i
            for i in self.issues.values()
            if self._listed(i.created_at)
            and all(t in f"{i.title} {i.body}".lower() for t in terms)
            and (after is None or i.created_at >= after)
        ]
        items.sort(key=lambda i: (i.created_at, i.id), reverse=q.get("order", "desc") == "desc")
        per_page = min(100, int(q.get("per_page") or 30))
        page = int(q.get("page") or 1)
        chunk = items[(page - 1) * per_page : page * per_page]
        headers = {"x-ratelimit-resource": "search", "x-ratelimit-limit": "30", "x-ratelimit-remaining": "29",
                   "x-ratelimit-reset": str(int(self.clock.now()) + 60)}
        if page * per_page < len(items):
            params = [(k, v) for k, v in q.multi_items() if k != "page"] + [("page", str(page + 1))]
            headers["link"] = f'<{self.LINK_HOST}/search/issues?{urlencode(params)}>; rel="next"'
        body = {"total_count": len(items), "incomplete_results": False, "items": []}
        for i in chunk:
            item = self._issue_json(i)
            item["score"] = 1
            body["items"].append(item)
        return JSONResponse(body, headers=headers)

    def _create(self, issue: GIssue, data: dict[str, Any]) -> Response:
        self.create_requests += 1
        fault = self.faults.pop(0) if self.faults else None
        if fault is None and self.lost_rate and self._rng.random() < self.lost_rate:
            fault = "lost"
        if fault == "error_before":
            return JSONResponse({"message": "Server Error"}, status_code=502)
        if fault == "rate_limited":
            return JSONResponse(
                {
                    "message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",
                    "documentation_url": "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
                },
                status_code=403,
                headers={"retry-after": "61", "x-ratelimit-remaining": "4000"},
            )
        if fault == "rejected":
            return JSONResponse({"message": "Validation Failed", "errors": [{"resource": "IssueComment", "code": "custom", "field": "body", "message": "body is too long"}]}, status_code=422)
        if fault == "forbidden" or issue.locked:
            return JSONResponse(
                {"message": "Unable to create comment because issue is locked.",
                 "documentation_url": "https://docs.github.com/articles/locking-conversations/"},
                status_code=403,
            )
        c = self._add_comment(self.bot, issue, str(data.get("body", "")))
        if fault == "lost":
            self.lost_responses += 1
            return DropResponse(status_code=201)
        if fault == "error_after":
            return JSONResponse({"message": "Server Error"}, status_code=502)
        return JSONResponse(
            self._comment_json(c), status_code=201, headers={"location": f"{self.LINK_HOST}/repos/{c.repo}/issues/comments/{c.id}"}
        )

    def _edit(self, repo: str, comment_id: int, body: bytes) -> Response:
        """``PATCH /repos/{o}/{r}/issues/comments/{id}``: GitHub's "Update an issue comment", faults first."""
        self.edit_requests += 1
        fault = self.edit_faults.pop(0) if self.edit_faults else None
        if fault == "error_before":
            return JSONResponse({"message": "Server Error"}, status_code=502)
        if fault == "rate_limited":
            return JSONResponse(
                {"message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",
                 "documentation_url": "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"},
                status_code=403, headers={"retry-after": "61", "x-ratelimit-remaining": "4000"})
        c = self.comments.get(comment_id)
        if c is None or c.deleted or c.repo != repo:
            return self._not_found()
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return JSONResponse({"message": "Problems parsing JSON"}, status_code=400)
        text = data.get("body") if isinstance(data, dict) else None
        if not isinstance(text, str):
            return JSONResponse({"message": "Invalid request.\n\n\"body\" wasn't supplied.",
                                 "documentation_url": "https://docs.github.com/rest/issues/comments#update-an-issue-comment",
                                 "status": "422"}, status_code=422)
        issue = next(i for i in self.issues.values() if i.repo == c.repo and i.number == c.number)
        if fault == "forbidden" or issue.locked or c.user_id != self.bot.id:
            return JSONResponse({"message": "Must have admin rights to Repository.",
                                 "documentation_url": "https://docs.github.com/rest/issues/comments#update-an-issue-comment",
                                 "status": "403"}, status_code=403)
        if len(text) > self.BODY_MAX:
            return JSONResponse({"message": "Validation Failed", "errors": [{
                "resource": "IssueComment", "code": "unprocessable", "field": "data",
                "message": f"Body is too long (maximum is {self.BODY_MAX} characters)"}],
                "documentation_url": "https://docs.github.com/rest/issues/comments#update-an-issue-comment",
                "status": "422"}, status_code=422)
        if text != c.body:  # the same body again is no edit: no history entry, updated_at stays
            c.body = text
            c.history.append(text)
            c.updated_at = self.clock.now()
        if fault == "lost":
            self.lost_edits += 1
            return DropResponse(status_code=200)
        if fault == "error_after":
            return JSONResponse({"message": "Server Error"}, status_code=502)
        return JSONResponse(self._comment_json(c))


class FakeHost:
    """One uvicorn server whose requests go to the current fake, so tests swap fakes, not servers."""

    def __init__(self) -> None:
        self.fake: FakeDiscourse | FakeGitHub | None = None
        app = Starlette(routes=[Route("/{path:path}", self._dispatch, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])
        self.server = AppServer(app)

    @property
    def url(self) -> str:
        """Base URL, without trailing slash."""
        return self.server.url

    async def _dispatch(self, request: Request) -> Response:
        if self.fake is None:
            return JSONResponse({"error": "no fake installed"}, status_code=503)
        return await self.fake._endpoint(request)

    def __enter__(self) -> FakeHost:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def edit_and_sweep(world: dict[str, Any], parent: Any, reply_id: str, texts: list[str], deadline_s: float) -> None:
    """Edit the reply to each of ``texts`` in turn, then check the platform shows the last one, the read-back (and
    the per-parent read) lists that one reply under its id, and a sweep ``deadline_s`` later verifies it with no
    duplicate: a forum fake's edit keeps the reply's id and its place."""
    fake, plat = world["fake"], world["plat"]
    world["clock"].advance(2)
    for text in texts:
        plat.edit(parent, reply_id, text)
    assert fake.reply_text(reply_id) == texts[-1] and fake.edits(reply_id) == len(texts)
    pending = [Pending(parent, opened_at=world["clock"].now() - 5)]
    sender = world["guard"].identity.sender_id
    for rb in (plat.read_back(pending, sender_id=sender), plat.read_parents(pending, sender_id=sender)):
        assert parent.id in rb.checked and [r.reply_id for r in rb.found[parent.id]] == [reply_id]
    world["clock"].advance(deadline_s)
    res = world["sweeper"].run_once()
    assert (res.verified, res.duplicates) == (1, 0)


def walk_edit_faults(fake: FakeDiscourse | FakeGitHub, plat: Any, parent: Any, reply_id: str) -> None:
    """Meet every edit fault a forum fake models through ``plat.edit``: a lost answer and a 502 after acting are
    ``MaybeSent`` with the text changed, a retried lost edit makes no second revision, a 502 before acting changes
    nothing (``MaybeSent`` all the same: the adapter cannot tell)."""
    fake.edit_faults = ["lost"]
    with pytest.raises(MaybeSent):
        plat.edit(parent, reply_id, "the whole answer")
    assert fake.lost_edits == 1 and fake.reply_text(reply_id) == "the whole answer"
    plat.edit(parent, reply_id, "the whole answer")  # the guard's retry of an edit whose outcome is unknown
    assert fake.edits(reply_id) == 1 and fake.edit_requests == 2
    fake.edit_faults = ["error_after"]
    with pytest.raises(MaybeSent) as err:
        plat.edit(parent, reply_id, "the whole answer, grown")
    assert err.value.status == 502 and fake.reply_text(reply_id) == "the whole answer, grown"
    fake.edit_faults = ["error_before"]
    with pytest.raises(MaybeSent):
        plat.edit(parent, reply_id, "never applied")
    assert fake.reply_text(reply_id) == "the whole answer, grown" and fake.edits(reply_id) == 2


@pytest.fixture(scope="module", name="fixture_server_session")
def nodelay_fixture_server_session() -> Iterator[FixtureServer]:
    """Replaces ``fixtures_server.fixture_server_session`` in a module that imports it: a server of its own."""
    server = FixtureServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite answered-log, made once per module (migrating costs ~0.4 s, copying ~1 ms)."""
    path = tmp_path_factory.mktemp("replyd-store") / "template.sqlite3"
    Store.open(f"sqlite:///{path}").dispose()  # the last close checkpoints the WAL into the file
    return path


def fresh_store(template: Path, tmp_path: Path, clock: FakeClock) -> Store:
    """A private copy of the migrated template in ``tmp_path``, opened without re-migrating."""
    dst = tmp_path / "replyd.sqlite3"
    shutil.copyfile(template, dst)
    return Store.open(f"sqlite:///{dst}", clock=clock, migrate=False)


_SSL_CONTEXT: ssl.SSLContext | None = None


@pytest.fixture(name="http_client")
def shared_tls_http_client() -> Iterator[httpx.Client]:
    """``fixtures_server.http_client`` without its per-test cost: one TLS context for every client.

    Each new ``httpx.Client`` loads the CA bundle (about 0.1 s); the clients
    here only speak plain HTTP to 127.0.0.1, so they share one context built
    once. Still a fresh client (and connection pool) per test.
    """
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context()
    with httpx.Client(trust_env=False, verify=_SSL_CONTEXT) as client:
        yield client


def injection_pings_only_the_author(world: dict[str, Any]) -> None:
    """Post the answer of a responder echoing the stranger's mentions, edit it, edit it again with
    ``allow_mentions``: only the author's @name is live until the operator allows the rest."""
    from tests.test_mentions import at_pings, injected

    world["clock"].advance(1)
    [p] = world["plat"].inbox(None).parents
    out = world["guard"].post(p, injected(p))
    assert out.status is Status.POSTED and at_pings(world["fake"].reply_text(out.reply_id)) == ["alice"]
    world["plat"].edit(p, out.reply_id, injected(p) + " (edited)")
    assert at_pings(world["fake"].reply_text(out.reply_id)) == ["alice"]
    loose = type(world["plat"]).from_settings({**world["plat"].s.model_dump(), "allow_mentions": True},
                                              http=world["plat"]._http, clock=world["clock"])
    loose.edit(p, out.reply_id, injected(p))
    assert "mallory" in at_pings(world["fake"].reply_text(out.reply_id))
