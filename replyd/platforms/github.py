"""The GitHub adapter: issues and pull requests in, issue comments out, comments read back.

Settings: ``[platforms.<name>]`` with ``kind = "github"``; each key is a field of
``GitHubPlatform.Settings`` below, with its meaning beside it.

Ids: a parent is an issue or pull request, keyed by the issue's numeric ``id``
as served (a JSON number above 2^31, kept as its decimal string; for a pull
request the *issue* id, which is what ``/repos/{o}/{r}/issues/{n}`` serves).
``owner``, ``repo``, ``number`` and ``node_id`` ride in ``Parent.extra``. A
reply is an issue comment; its id is the comment id. The sender id is the
numeric user id from ``/user`` (or ``/users/{login}``).

Read-back is batched per repository from
``/repos/{o}/{r}/issues/comments?since=…&sort=created&direction=asc`` (``since``
filters on *update* time, so every comment created after it is listed), own
comments matched to pending parents by ``issue_url``; a repository whose
listing fails or runs past ``max_pages`` falls back to each parent's
``/repos/{o}/{r}/issues/{n}/comments``.

Edits (``EditReply``, a streamed answer growing its comment): ``PATCH
/repos/{o}/{r}/issues/comments/{id}`` with the whole new ``body``. An edited
comment keeps its id and ``created_at`` (only ``updated_at`` moves), so the
read-back still finds one comment per parent, listed again by ``since``.

Rate limits: GitHub reports budgets per resource (``X-RateLimit-Resource``:
``core``, ``search`` with 30 a minute …); a spent one (``remaining: 0``) makes
the adapter refuse locally until ``X-RateLimit-Reset``. Content creation also
has *secondary* limits (80 a minute, 500 an hour): sends are paced locally on
the injected clock and refused with ``RateLimited`` *before* the request when
the budget is spent. The pacing is per process: replicas posting as one account
must share the budget (set lower ``writes_per_*`` on each).

Error mapping at this boundary (the shared table is in ``_http.py``)::

    what happened                                   send (POST)        edit (PATCH)       delete             reads (GET)
    ----------------------------------------------  -----------------  -----------------  -----------------  -----------------
    connect refused, DNS, ConnectTimeout,           DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
      PoolTimeout, TLS handshake
    local write pacing or a spent budget            RateLimited        RateLimited        RateLimited        RateLimited
      (remaining 0, reset in the future)
    ReadTimeout, WriteTimeout, ReadError,           MaybeSent          MaybeSent          MaybeSent          DefinitelyNotSent
      WriteError, RemoteProtocolError, other
      (an edit's lost answer: the edit may have
      acted; repeating it sets the same body)
    429; or 403 with Retry-After, with              RateLimited        RateLimited        RateLimited        RateLimited
      x-ratelimit-remaining 0, or a "rate limit"
      message (primary/secondary limits; wait:
      Retry-After, else the reset when remaining
      is 0, else 60 s as GitHub documents)
    403 otherwise (issue locked, repository         Rejected           Rejected           Rejected           Rejected
      archived, no permission, SSO not authorised;
      edit: not the bot's comment)
    401 (bad credentials), 408                      DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent  DefinitelyNotSent
    404, 410 (issue gone / transferred; edit: the   Rejected           Rejected           treated as done    Rejected
      comment deleted), 422 (validation; a body
      over 65,536 characters), other 4xx
    500-599                                         MaybeSent          MaybeSent          MaybeSent          DefinitelyNotSent
    3xx (moved repository: redirects are not        MaybeSent          MaybeSent          MaybeSent          BadResponse
      followed, the token stays on api_url)
    2xx with unreadable body                        MaybeSent          done (not read)    -                  BadResponse

GitHub honours no idempotency key on comment creation: a retry after a lost
response can only be kept from duplicating by the read-back.
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

import httpx
import structlog

from pydantic import AfterValidator, Field

from replyd.errors import BadResponse, DefinitelyNotSent, PlatformError, RateLimited, Rejected
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, ReadBack, Sent, Text, Texts, Token, register_platform,
)
from replyd.platforms import _http, unreadable
from replyd.platforms._http import id_order

DEFAULT_API_URL = "https://api.github.com"
DEFAULT_REASONS = ("mention", "assign", "team_mention")
API_HEADERS = {
    "Accept": "application/vnd.github+json",
    "X-GitHub-Api-Version": "2022-11-28",
    "User-Agent": "replyd",
}
# Listings may show an item after newer ones (notifications are made in the background,
# replicas lag): each poll re-reads this far behind its mark and skips what it has seen.
LISTING_OVERLAP_S = 300.0
# The search index lags further behind.
SEARCH_OVERLAP_S = 900.0
# GitHub's own wait when a secondary limit names none.
DEFAULT_LIMIT_WAIT_S = 60.0
PER_PAGE = 100
NOTIFICATIONS_PER_PAGE = 50

_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_REPO_URL_RE = re.compile(r"/repos/([^/]+)/([^/]+)$")
_ISSUE_URL_RE = re.compile(r"/repos/([^/]+)/([^/]+)/(issues|pulls)/(\d+)$")
_WEB_ISSUE_RE = re.compile(r"^/([^/]+)/([^/]+)/(issues|pull)/(\d+)/?$")
_SHORT_REF_RE = re.compile(r"^([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+)#(\d+)$")

def _repos(repos: list[str]) -> list[str]:
    for r in repos:
        if not _REPO_RE.match(r):
            raise ValueError(f"{r!r} is not owner/name")
    return repos


def _login(login: str) -> str:
    if "/" in login:
        raise ValueError("must be a user or bot login")
    return login


def _mentions(text: str, login: str) -> bool:
    """True when ``text`` @mentions ``login`` (case-insensitive, not part of a longer name, an address or a path)."""
    return re.search(rf"(?<![\w@/.`-])@{re.escape(login)}(?![\w-])", text, re.IGNORECASE) is not None


def _iso(t: float) -> str:
    """Epoch seconds as GitHub's ``since`` wants them, rounded down to the second."""
    return datetime.fromtimestamp(int(t // 1), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _issue_ref(url: str) -> tuple[str, str, int] | None:
    """``(owner, repo, number)`` of an API issue or pull URL, or None."""
    m = _ISSUE_URL_RE.search(urlsplit(url).path)
    return (m.group(1), m.group(2), int(m.group(4))) if m else None


def _repo_key(owner: str, repo: str) -> str:
    """Repository names are case-insensitive on GitHub; compare them folded."""
    return f"{owner}/{repo}".lower()


class _Mark:
    """A listing position: the newest time seen, and what was seen in the overlap before it."""

    def __init__(self, at: float | None = None, seen: Mapping[str, float] | None = None) -> None:
        self.at = at
        self.seen: dict[str, float] = dict(seen or {})

    @classmethod
    def load(cls, raw: Any) -> _Mark:
        if not isinstance(raw, dict):
            return cls()
        at = raw.get("at")
        seen = raw.get("seen")
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            return cls()
        if not isinstance(seen, dict):
            seen = {}
        return cls(float(at), {str(k): float(v) for k, v in seen.items() if isinstance(v, (int, float))})

    def dump(self, overlap: float) -> dict[str, Any] | None:
        if self.at is None:
            return None
        keep = {k: v for k, v in self.seen.items() if v >= self.at - overlap}
        return {"at": self.at, "seen": dict(sorted(keep.items()))}

    def take(self, key: str, t: float) -> None:
        self.seen[key] = t
        self.at = t if self.at is None else max(self.at, t)


def _load_cursor(cursor: str | None) -> dict[str, Any]:
    if not cursor:
        return {}
    try:
        data = json.loads(cursor)
    except (ValueError, RecursionError):
        structlog.get_logger("replyd.github").warning("replyd.github.cursor_unreadable")
        return {}
    return data if isinstance(data, dict) else {}


@register_platform("github")
class GitHubPlatform(_http.StepSend, _http.HttpPlatform):
    """A GitHub account (user or app) as a replyd platform: issues in, comments out, comments read back."""

    class Settings(_http.HttpSettings):
        """``kind = "github"``; ``instance`` defaults to ``github:<api_url>``."""

        URLS: ClassVar[tuple[str, ...]] = ("api_url",)
        token: Token  # a personal access token or an app installation token (sent as Bearer)
        api_url: _http.Url = DEFAULT_API_URL  # GitHub Enterprise: https://host/api/v3
        repos: Annotated[Texts, AfterValidator(_repos)] = []  # "owner/name"s whose open issues are parents
        # Read /notifications for the inbox and re-find (an installation token cannot: false for apps).
        notifications: bool = True
        notification_reasons: Annotated[Texts, Field(min_length=1)] = list(DEFAULT_REASONS)  # which threads
        # The bot's login: whoami reads /users/{login}, not /user (installation tokens, e.g. "my-app[bot]").
        login: Annotated[Text, AfterValidator(_login)] | None = None
        search_queries: Texts = []  # the queries the search poller runs
        # 60: GitHub ends requests after 10 s but serves reads from replicas, and a POST given up on may land.
        listing_delay_s: float = Field(60.0, ge=0)
        writes_per_minute: int = Field(80, ge=1, le=100_000)  # local pacing of comment creation
        writes_per_hour: int = Field(500, ge=1, le=1_000_000)
        max_pages: int = Field(5, ge=1, le=1000)  # pages per poll / re-find / read-back

    s: Settings
    BUCKET = "core"
    HEADERS = API_HEADERS

    def _setup(self) -> None:
        self._repos = tuple(self.s.repos)
        self._repo_keys = frozenset(_repo_key(*full.split("/", 1)) for full in self._repos)
        self._reasons = frozenset(self.s.notification_reasons)
        self._wpm, self._wph = self.s.writes_per_minute, self.s.writes_per_hour
        self._writes: deque[float] = deque()
        self._writes_lock = threading.Lock()
        # Comment id -> (owner, repo), learnt from sends and read-backs: delete needs the repo.
        self._comment_repo: dict[str, tuple[str, str]] = {}
        self.search_queries = tuple(self.s.search_queries)

    @property
    def root(self) -> str:
        """The API root (``api_url``)."""
        return self.s.api_url

    def _buckets(self, bucket: str) -> tuple[str, ...]:
        """GitHub's budgets (core, search) are separate: a request draws on its own only."""
        return (bucket,)

    def _limited(self, resp: httpx.Response) -> bool:
        """429; a 403 only with ``Retry-After``, a spent budget or a "rate limit" message (secondary limits)."""
        if resp.status_code not in (403, 429):
            return False
        return (resp.status_code == 429 or "retry-after" in resp.headers
                or resp.headers.get("x-ratelimit-remaining", "").strip() == "0"
                or "rate limit" in self._error_text(resp).lower())

    def _wait_s(self, resp: httpx.Response) -> float:
        """``Retry-After``, else the reset of a spent budget, else the 60 s GitHub documents."""
        now = self._clock.now()
        wait = _http.retry_after_s(resp, now) if "retry-after" in resp.headers else None
        if wait is None and resp.headers.get("x-ratelimit-remaining", "").strip() == "0":
            at = _http.parse_reset(resp.headers.get("x-ratelimit-reset", ""), now)
            wait = max(0.0, at - now) if at is not None else None
        return DEFAULT_LIMIT_WAIT_S if wait is None else wait

    def _error_text(self, resp: httpx.Response) -> str:
        """GitHub's ``message`` and, for a 422, what its ``errors`` say ("Body is too long (maximum is 65536 …)")."""
        text = super()._error_text(resp)
        data = _http.error_json(resp)
        errors = data.get("errors") if isinstance(data, dict) else None
        said = [e["message"] for e in errors if isinstance(e, dict) and isinstance(e.get("message"), str)] \
            if isinstance(errors, list) else []
        return " ".join(f"{text}: {'; '.join(said)}".split())[:200] if said else text

    def _raise_for_status(self, resp: httpx.Response, *, what: str, bucket: str = "", acts: bool | None = None) -> None:
        """The shared mapping, but a 403 that is no rate limit is a refusal, not an auth failure."""
        if resp.status_code == 403 and not self._limited(resp):
            # Locked issue, archived repository, missing permission, SSO.
            raise Rejected(self._detail(resp, what), status=403)
        super()._raise_for_status(resp, what=what, bucket=bucket, acts=acts)

    def _pages(
        self, path: str, params: list[tuple[str, str]], *, what: str, bucket: str = "core", pages: int | None = None
    ) -> Iterable[tuple[int, httpx.Response]]:
        """Yield ``(page number, response)`` along the ``next`` links (only their ``page`` is used)."""
        page: str | None = None
        for page_no in range(pages if pages is not None else self.s.max_pages):
            resp = self._call("GET", path, what=what, bucket=bucket, params=params + ([("page", page)] if page else []))
            yield page_no, resp
            nxt = _http.link_param(resp, "next", "page")
            if nxt is None or nxt == page:
                return
            page = nxt

    # --- write pacing ---------------------------------------------------------------

    def _reserve_write(self, what: str) -> float:
        """Take a slot in the secondary write budget, or raise ``RateLimited`` (nothing sent)."""
        now = self._clock.now()
        with self._writes_lock:
            while self._writes and self._writes[0] <= now - 3600.0:
                self._writes.popleft()
            recent = [t for t in self._writes if t > now - 60.0]
            waits = []
            if len(recent) >= self._wpm:
                waits.append(recent[len(recent) - self._wpm] + 60.0 - now)
            if len(self._writes) >= self._wph:
                waits.append(self._writes[len(self._writes) - self._wph] + 3600.0 - now)
            if waits:
                wait = max(0.0, max(waits))
                raise RateLimited(
                    f"{what}: write budget spent ({self._wpm}/min, {self._wph}/h), next slot in {wait:.0f}s (not sent)",
                    status=None,
                    retry_after_s=wait,
                )
            self._writes.append(now)
        return now

    def _release_write(self, slot: float) -> None:
        with self._writes_lock:
            try:
                self._writes.remove(slot)
            except ValueError:
                pass

    # --- parsing --------------------------------------------------------------------

    def _issue_parent(self, issue: Any, what: str) -> Parent:
        """Turn an issue object (issues, search, a single issue) into a parent."""
        if not isinstance(issue, dict):
            raise BadResponse(f"{what}: issue is not an object")
        iid = _http.served_id(issue, "id", what)
        number = _http.field(issue, "number", what, int)
        repo_url = _http.field(issue, "repository_url", what, default="")
        m = _REPO_URL_RE.search(urlsplit(repo_url).path) if repo_url else None
        if m:
            owner, repo = m.group(1), m.group(2)
        else:
            ref = _issue_ref(_http.field(issue, "url", what))
            if ref is None:
                raise BadResponse(f"{what}: field repository_url names no repository")
            owner, repo = ref[0], ref[1]
        title = _http.field(issue, "title", what, default="")
        body = _http.field(issue, "body", what, default="")
        user_type = _http.field(issue, "user.type", what, default="")
        return Parent(
            id=iid,
            author_id=_http.served_id(issue, "user.id", what),
            author_handle=_http.field(issue, "user.login", what, default=""),
            author_is_bot=user_type == "Bot",
            text=f"{title}\n\n{body}".strip(),
            url=_http.field(issue, "html_url", what, default=""),
            created_at=_http.iso_field(issue, "created_at", what),
            thread_depth=0,
            extra={
                "owner": owner,
                "repo": repo,
                "number": number,
                "node_id": _http.field(issue, "node_id", what, default=None),
                "pull_request": isinstance(issue.get("pull_request"), dict),
                "state": _http.field(issue, "state", what, default=None),
                "locked": issue.get("locked") is True,
                "title": title,
            },
        )

    def _issue(self, owner: str, repo: str, number: int, what: str) -> Parent:
        path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues/{number}"
        resp = self._call("GET", path, what=what)
        return self._issue_parent(_http.json_body(resp, what, dict), what)

    # --- Platform -------------------------------------------------------------------

    def whoami(self) -> Identity:
        """Return the account's numeric user id (as a string) and login."""
        what = "whoami"
        path = f"/users/{_http.seg(self.s.login, what)}" if self.s.login else "/user"
        body = _http.json_body(self._call("GET", path, what=what), what, dict)
        self._me = Identity(sender_id=_http.served_id(body, "id", what),
                            handle=_http.field(body, "login", what, default=""))
        return self._me

    # inbox ------------------------------------------------------------------------------

    def inbox(self, cursor: str | None) -> Page:
        """Return issues addressed to the bot (notifications) and new issues in ``repos``.

        The cursor is a JSON object holding one listing mark per source. A
        source that fails keeps its mark; only if every source fails is the
        error raised.
        """
        state = _load_cursor(cursor)
        found: dict[str, Parent] = {}
        errors: list[PlatformError] = []
        out: dict[str, Any] = {}
        if self.s.notifications:
            mark = _Mark.load(state.get("notifications"))
            try:
                self._notification_parents(mark, found, what="inbox")
            except PlatformError as exc:
                errors.append(exc)
                self.log.warning("replyd.github.inbox_partial", source="notifications", problem=exc.detail)
            out["notifications"] = mark.dump(LISTING_OVERLAP_S)
        repo_marks = state.get("repos") if isinstance(state.get("repos"), dict) else {}
        out_repos: dict[str, Any] = {}
        for full in self._repos:
            mark = _Mark.load(repo_marks.get(full))
            try:
                self._repo_issue_parents(full, mark, found)
            except PlatformError as exc:
                errors.append(exc)
                self.log.warning("replyd.github.inbox_partial", source=full, problem=exc.detail)
            out_repos[full] = mark.dump(LISTING_OVERLAP_S)
        if self._repos:
            out["repos"] = out_repos
        sources = int(self.s.notifications) + len(self._repos)
        if sources and len(errors) == sources:
            raise errors[0]
        parents = sorted(found.values(), key=lambda p: (p.created_at or 0.0, id_order(p.id)))
        return Page(parents=parents, cursor=json.dumps(out, sort_keys=True))

    def _notification_parents(self, mark: _Mark, found: dict[str, Parent], *, what: str, since: float | None = None) -> None:
        """Resolve wanted notification threads newer than ``mark`` (or since ``since``) oldest first."""
        params = [("all", "true"), ("per_page", str(NOTIFICATIONS_PER_PAGE))]
        if since is not None:
            params.append(("since", _iso(since)))
        elif mark.at is not None:
            params.append(("since", _iso(mark.at - LISTING_OVERLAP_S)))
        threads: list[tuple[float, str, dict[str, Any]]] = []
        pages = self.s.max_pages if (mark.at is not None or since is not None) else 1
        # Newest first: a page failing below the first would leave a gap under what was
        # read, so any listing failure fails the source and leaves its mark where it was.
        for page_no, resp in self._pages("/notifications", params, what=what, pages=pages):
            for item in _http.json_body(resp, what, list):
                got = self._read(what, item, lambda it: (_http.served_id(it, "id", what),
                                                         _http.iso_field(it, "updated_at", what)))
                if got is None:
                    continue
                tid, updated = got
                key = f"{tid}@{updated}"
                if key in mark.seen:
                    continue
                threads.append((updated, key, item))
            if page_no == pages - 1 and _http.link_param(resp, "next", "page") is not None:
                self.log.warning("replyd.github.listing_truncated", what=what, source="notifications", pages=pages)
        for updated, key, item in sorted(threads, key=lambda t: (t[0], t[1])):
            try:
                parent = self._thread_parent(item, what)
            except (Rejected, *unreadable.ERRORS) as exc:
                self._skipped(what, exc, item)
                parent = None
            except PlatformError as exc:
                if since is not None:  # re-find: no mark to hold; skip it this time (a failed read, not unreadable)
                    self.log.warning("replyd.github.refind_partial", thread=key, problem=exc.detail)
                    continue
                self.log.warning("replyd.github.inbox_partial", source="notifications", thread=key, problem=exc.detail)
                return
            if parent is not None:
                found.setdefault(parent.id, parent)
            mark.take(key, updated)

    def _thread_parent(self, item: dict[str, Any], what: str) -> Parent | None:
        """The issue a notification thread is about, if its reason and subject are wanted."""
        if item.get("reason") not in self._reasons:
            return None
        if _http.field(item, "subject.type", what, default="") not in ("Issue", "PullRequest"):
            return None
        ref = _issue_ref(_http.field(item, "subject.url", what))
        if ref is None:
            raise BadResponse(f"{what}: subject.url is not an issue or pull request URL")
        owner, repo, number = ref
        # A pull request's thread names /pulls/{n}; its issue (and the key) is /issues/{n}.
        return self._issue(owner, repo, number, what)

    def _repo_issue_parents(self, full: str, mark: _Mark, found: dict[str, Parent]) -> None:
        """Open issues (and pull requests) of ``full`` updated after ``mark``, oldest first."""
        what = "inbox repo"
        owner, repo = full.split("/", 1)
        path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues"
        params = [("state", "open"), ("per_page", str(PER_PAGE)), ("sort", "updated")]
        if mark.at is None:
            params.append(("direction", "desc"))
            pages = 1
        else:
            params += [("direction", "asc"), ("since", _iso(mark.at - LISTING_OVERLAP_S))]
            pages = self.s.max_pages
        for _, resp in self._pages(path, params, what=what, pages=pages):
            items = _http.json_body(resp, what, list)
            batch = []
            for item in items:
                got = self._read(what, item, lambda it: (self._issue_parent(it, what),
                                                         _http.iso_field(it, "updated_at", what)))
                if got is None:
                    continue
                parent, updated = got
                batch.append((updated, f"{parent.id}@{updated}", parent))
            for updated, key, parent in sorted(batch, key=lambda t: (t[0], t[1])):
                if key in mark.seen:
                    continue
                found.setdefault(parent.id, parent)
                mark.take(key, updated)

    # search -----------------------------------------------------------------------------

    def search(self, query: str, cursor: str | None) -> Page:
        """Return issues and pull requests matching ``query`` created after the cursor, oldest first.

        Without a cursor: the newest page. With one: ``created:>=`` a window
        behind the newest seen (the index lags), ascending, so a long backlog is
        read over several polls without gaps. Search has its own budget (30 a
        minute), tracked apart from the core one.
        """
        what = "search"
        mark = _Mark.load(_load_cursor(cursor))
        if mark.at is None:
            params = [("q", query), ("sort", "created"), ("order", "desc"), ("per_page", str(PER_PAGE))]
            pages = 1
        else:
            q = f"{query} created:>={_iso(mark.at - SEARCH_OVERLAP_S)}"
            params = [("q", q), ("sort", "created"), ("order", "asc"), ("per_page", str(PER_PAGE))]
            pages = self.s.max_pages
        found: dict[str, Parent] = {}
        batch: list[tuple[float, str, Parent]] = []
        try:
            for _, resp in self._pages("/search/issues", params, what=what, bucket="search", pages=pages):
                body = _http.json_body(resp, what, dict)
                if body.get("incomplete_results") is True:
                    self.log.warning("replyd.github.search_incomplete", query=query)
                for item in _http.field(body, "items", what, list):
                    if (parent := self._read(what, item, lambda it: self._issue_parent(it, what))) is None:
                        continue
                    batch.append((parent.created_at or 0.0, parent.id, parent))
        except PlatformError as exc:
            if not batch:
                raise
            self.log.warning("replyd.github.search_partial", problem=exc.detail)
        for created, key, parent in sorted(batch, key=lambda t: (t[0], id_order(t[1]))):
            if key in mark.seen:
                continue
            found.setdefault(parent.id, parent)
            mark.take(key, created)
        parents = sorted(found.values(), key=lambda p: (p.created_at or 0.0, id_order(p.id)))
        dumped = mark.dump(SEARCH_OVERLAP_S)
        return Page(parents=parents, cursor=json.dumps(dumped, sort_keys=True) if dumped else cursor)

    # refind -----------------------------------------------------------------------------

    def refind(self, since: float) -> list[Parent]:
        """Open issues in ``repos`` updated since ``since``, plus wanted notification threads."""
        # replyd's epoch on the platform's clock, erring early (unmeasured: as it is, a wider window would
        # offer parents older than the configured look-back)
        since = self.platform_clock.earliest(since, unmeasured_s=0.0)
        found: dict[str, Parent] = {}
        errors: list[PlatformError] = []
        for full in self._repos:
            what = "refind"
            owner, repo = full.split("/", 1)
            path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues"
            params = [
                ("state", "open"),
                ("sort", "updated"),
                ("direction", "desc"),
                ("since", _iso(since)),
                ("per_page", str(PER_PAGE)),
            ]
            try:
                for _, resp in self._pages(path, params, what=what):
                    for item in _http.json_body(resp, what, list):
                        try:
                            parent = self._issue_parent(item, what)
                        except unreadable.ERRORS as exc:
                            self._skipped(what, exc, item)
                            continue
                        found.setdefault(parent.id, parent)
            except PlatformError as exc:
                errors.append(exc)
                self.log.warning("replyd.github.refind_partial", source=full, problem=exc.detail)
        if self.s.notifications:
            try:
                self._notification_parents(_Mark(), found, what="refind", since=since)
            except PlatformError as exc:
                errors.append(exc)
                self.log.warning("replyd.github.refind_partial", source="notifications", problem=exc.detail)
        sources = int(self.s.notifications) + len(self._repos)
        if sources and len(errors) == sources:
            raise errors[0]
        return sorted(found.values(), key=lambda p: (p.created_at or 0.0, id_order(p.id)))

    # resolve ----------------------------------------------------------------------------

    # webhooks ---------------------------------------------------------------------------

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """A delivery's parents: the issue of ``issues`` opened/reopened and of ``issue_comment`` created.

        The delivery embeds the issue in its REST form, so the parent (its id as served) is the one the
        pollers build; anything else is a reason not to answer (``ping``, edits, closes, other events).
        """
        what = f"webhook {event or '(no event)'}"
        if not isinstance(payload, dict):
            raise BadResponse(f"{what}: body is not a JSON object")
        action = payload.get("action") if isinstance(payload.get("action"), str) else ""
        if event == "issues" and action in ("opened", "reopened"):
            return [self._issue_parent(payload.get("issue"), what)]
        if event == "issue_comment" and action == "created":
            return [self._issue_parent(payload.get("issue"), what)]
        return f"{event or 'an unnamed event'}{'.' + action if action else ''} is not answered"

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """None when this bot's pollers would find the delivery's issue; else why not (docs/PLATFORMS.md, GitHub).

        The inbox lists every *open* issue of ``repos`` (a new comment updates it, so it is listed again) and,
        with ``notifications``, the threads of ``notification_reasons`` in any repository: the bot's login
        @mentioned (in the issue's body for ``issues``, in the comment for ``issue_comment``) or the bot
        assigned. A ``team_mention`` or a search hit cannot be told from a delivery: those wait for the pollers.
        """
        owner, repo = parent.extra.get("owner"), parent.extra.get("repo")
        listed = isinstance(owner, str) and isinstance(repo, str) and _repo_key(owner, repo) in self._repo_keys
        if listed and parent.extra.get("state") == "open":
            return None
        if self.s.notifications:
            return None if self._notified(event, payload) else "not_addressed"
        return "issue_closed" if listed else "repo_not_listed"

    def _notified(self, event: str, payload: Any) -> bool:
        """True when GitHub would notify the bot of this delivery with one of ``notification_reasons``."""
        me = self._identity()
        issue = payload.get("issue") if isinstance(payload, dict) else None
        if not isinstance(issue, dict):
            return False
        if "assign" in self._reasons:
            people = issue.get("assignees") if isinstance(issue.get("assignees"), list) else []
            people = [*people, issue.get("assignee")]
            if any(isinstance(u, dict) and str(u.get("id")) == me.sender_id for u in people):
                return True
        if "mention" not in self._reasons:
            return False
        login = self.s.login or me.handle
        if event == "issue_comment":
            comment = payload.get("comment")
            if not isinstance(comment, dict) or not isinstance(comment.get("user"), dict):
                return False
            if str(comment["user"].get("id")) == me.sender_id:
                return False  # GitHub notifies no one of their own comment
            text = comment.get("body")
        else:
            text = issue.get("body")  # a mention in the title notifies no one
        return isinstance(text, str) and bool(login) and _mentions(text, login)

    def resolve(self, ref: str) -> Parent:
        """Turn ``owner/repo#n``, an issue/PR web URL or an API issue URL into the parent."""
        what = "resolve"
        ref = ref.strip()
        m = _SHORT_REF_RE.match(ref)
        if m:
            return self._issue(m.group(1), m.group(2), int(m.group(3)), what)
        parts = urlsplit(ref)
        if parts.scheme not in ("http", "https"):
            raise Rejected(f"{what}: give owner/repo#number or an issue URL (an issue id alone names no repository)")
        api_ref = _issue_ref(ref)
        if api_ref is not None and "/repos/" in parts.path:
            return self._issue(*api_ref, what)
        m = _WEB_ISSUE_RE.match(parts.path)
        if m:
            return self._issue(m.group(1), m.group(2), int(m.group(4)), what)
        raise Rejected(f"{what}: not an issue or pull request URL")

    # send -------------------------------------------------------------------------------

    def _issue_of(self, parent: Parent, what: str) -> tuple[str, str, int]:
        """The parent issue's ``(owner, repo, number)`` from ``extra``; ``Rejected`` when they are missing."""
        owner, repo, number = parent.extra.get("owner"), parent.extra.get("repo"), parent.extra.get("number")
        if (
            not isinstance(owner, str)
            or not isinstance(repo, str)
            or isinstance(number, bool)
            or not isinstance(number, int)
            or number < 1
        ):
            raise Rejected(f"{what}: parent {parent.id} lacks owner/repo/number")
        return owner, repo, number

    @contextmanager
    def _paced(self, what: str) -> Iterator[None]:
        """Hold a slot of the secondary write budget for one write; a write that never reached GitHub gives it back."""
        self.limits.check(("core",), what=what)
        slot = self._reserve_write(what)
        try:
            yield
        except DefinitelyNotSent as exc:
            if exc.status is None:
                self._release_write(slot)  # nothing reached GitHub: the slot is not spent
            raise

    def _send_steps(self, parent: Parent, text: str, *, provider_key: str) -> _http.HttpSteps[Sent]:
        """Comment ``text`` on the parent issue (``send`` / ``asend``; only the guard's faces call those).

        GitHub honours no idempotency key: ``provider_key`` is not sent.
        """
        what = "send"
        owner, repo, number = self._issue_of(parent, what)
        path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues/{number}/comments"
        with self._paced(what):
            reply_id, issue_url, html_url = yield from self._created_steps(
                "POST", path, parent, what=what, json={"body": self._at_names(parent, text)},
                read=lambda body: (_http.served_id(body, "id", what), _http.field(body, "issue_url", what, default=""),
                                   _http.field(body, "html_url", what, default="")))
        got = _issue_ref(issue_url) if issue_url else None
        if got is None or _repo_key(got[0], got[1]) != _repo_key(owner, repo) or got[2] != number:
            # The comment is ours and exists (a transferred issue answers under its new name).
            self.log.warning("replyd.github.reply_issue_differs", parent_id=parent.id, reply_id=reply_id, issue_url=issue_url)
        self._comment_repo[reply_id] = (owner, repo)
        self.log.info("replyd.github.sent", parent_id=parent.id, reply_id=reply_id)
        return Sent(reply_id=reply_id, url=html_url)

    def edit(self, parent: Parent, reply_id: str, text: str) -> None:
        """Replace the body of own comment ``reply_id`` on the parent issue (``EditReply``: PATCH the comment).

        An edit is content creation for GitHub's secondary limits: it takes a slot of the write budget as a
        send does. Setting the same body again changes nothing, so a retried edit is harmless.
        """
        what = "edit"
        owner, repo, _ = self._issue_of(parent, what)
        path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues/comments/{_http.seg(reply_id, what)}"
        with self._paced(what):
            self._edit("PATCH", path, parent, reply_id, text, json={"body": self._at_names(parent, text)})
        self._comment_repo[reply_id] = (owner, repo)

    # read-back --------------------------------------------------------------------------

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find own comments on the pending parents: one listing per repository, then per issue.

        A parent is ``checked`` only if its repository's listing (or its own
        issue's comments) was read to the end from before it was opened
        (minus a margin).
        """
        where: dict[str, tuple[str, str, int]] = {}
        for p in pending:
            owner, repo, number = (p.parent.extra.get(k) for k in ("owner", "repo", "number"))
            if isinstance(owner, str) and isinstance(repo, str) and isinstance(number, int) and not isinstance(number, bool):
                where[p.parent.id] = (owner, repo, number)
            else:
                self.log.warning("replyd.github.read_back_failed", source="parent", parent_id=p.parent.id,
                                 problem="no owner/repo/number")
        fallback: list[str] = []
        opened_at: dict[str, float] = {}

        def by_repo(opened: dict[str, float], found: _http.Found) -> set[str]:
            opened_at.update(opened)
            repos: dict[str, list[str]] = {}
            for pid, (owner, repo, _) in where.items():
                repos.setdefault(_repo_key(owner, repo), []).append(pid)
            checked: set[str] = set()
            for key, pids in repos.items():
                owner, repo, _ = where[pids[0]]
                targets = {(_repo_key(*where[pid][:2]), where[pid][2]): pid for pid in pids}
                since = self._horizon(min(opened[pid] for pid in pids))
                try:
                    if self._scan_repo_comments(owner, repo, since, sender_id, targets, found):
                        checked.update(pids)
                        continue
                except PlatformError as exc:
                    self.log.warning("replyd.github.read_back_failed", source="repo", repo=key, problem=exc.detail)
                    if isinstance(exc, RateLimited):
                        continue  # the issue listings draw on the same budget
                fallback.extend(pids)
            return checked

        def issue(pid: str, _: list[str], found: _http.Found) -> bool:
            owner, repo, number = where[pid]
            since = self._horizon(opened_at[pid])
            return self._scan_issue_comments(owner, repo, number, since, sender_id, pid, found)

        def issues(opened: dict[str, float], checked: set[str]) -> Iterable[tuple[str, list[str]]]:
            if self._per_parent():  # read_parents: no repository listing ran, every issue is read by itself
                opened_at.update(opened)
                return ((pid, [pid]) for pid in where)
            return ((pid, [pid]) for pid in fallback)

        return self._read_back(pending, source=("issue", "parent_id"), feed=by_repo, fallback=issue, units=issues)

    def _own_comment(self, item: Any, what: str) -> tuple[str, str, str, float]:
        """``(comment id, author id, issue_url, created_at)`` of a listed comment."""
        if not isinstance(item, dict):
            raise BadResponse(f"{what}: comment is not an object")
        return (
            _http.served_id(item, "id", what),
            _http.served_id(item, "user.id", what),
            _http.field(item, "issue_url", what),
            _http.iso_field(item, "created_at", what),
        )

    def _scan_repo_comments(
        self,
        owner: str,
        repo: str,
        since: float,
        sender_id: str,
        targets: Mapping[tuple[str, int], str],
        found: dict[str, dict[str, OwnReply]],
    ) -> bool:
        """List the repository's comments updated since ``since``; True if the listing ended."""
        what = "read_back repo"
        path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues/comments"
        params = [("since", _iso(since)), ("sort", "created"), ("direction", "asc"), ("per_page", str(PER_PAGE))]
        for page_no, resp in self._pages(path, params, what=what):
            items = _http.json_body(resp, what, list)
            # One unreadable item could be the reply we look for: the page is not conclusive.
            page = [self._own_comment(item, what) for item in items]
            for cid, author, issue_url, created in page:
                if author != sender_id:
                    continue
                ref = _issue_ref(issue_url)
                pid = targets.get((_repo_key(ref[0], ref[1]), ref[2])) if ref else None
                if pid is not None:
                    found.setdefault(pid, {})[cid] = OwnReply(cid, pid, created)
                    self._comment_repo[cid] = (owner, repo)
            if _http.link_param(resp, "next", "page") is None:
                return True
            if page_no == self.s.max_pages - 1:
                self.log.warning("replyd.github.listing_truncated", what=what, repo=f"{owner}/{repo}", pages=self.s.max_pages)
        return False

    def _scan_issue_comments(
        self, owner: str, repo: str, number: int, since: float, sender_id: str, pid: str, found: dict[str, dict[str, OwnReply]]
    ) -> bool:
        """List one issue's comments updated since ``since``; True if the listing ended."""
        what = "read_back issue"
        path = f"/repos/{_http.seg(owner, what)}/{_http.seg(repo, what)}/issues/{number}/comments"
        params = [("since", _iso(since)), ("per_page", str(PER_PAGE))]
        for _, resp in self._pages(path, params, what=what):
            for cid, author, _, created in (self._own_comment(i, what) for i in _http.json_body(resp, what, list)):
                if author == sender_id:
                    found.setdefault(pid, {})[cid] = OwnReply(cid, pid, created)
                    self._comment_repo[cid] = (owner, repo)
            if _http.link_param(resp, "next", "page") is None:
                return True
        return False

    # thread depth -----------------------------------------------------------------------

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """Return ``parent.thread_depth`` (0) without a request.

        Every parent this adapter yields is an issue or pull request, the top of
        its thread: inbox, search, re-find and resolve never yield a comment (a
        comment URL resolves to its issue). Issue comments are flat, so a comment
        would be depth 1; none is ever a parent. A bot-to-bot exchange on GitHub
        therefore shows as many comments on one depth-0 issue, not as depth.
        """
        return parent.thread_depth

    # delete -----------------------------------------------------------------------------

    def delete(self, reply_id: str) -> None:
        """Delete one own comment; one that is already gone counts as deleted.

        The comment's repository must be known: learnt from the send or the
        read-back that found it, or the only configured repository.
        """
        what = "delete"
        where = self._comment_repo.get(reply_id)
        if where is None and len(self._repos) == 1:
            owner, repo = self._repos[0].split("/", 1)
            where = (owner, repo)
        if where is None:
            raise Rejected(f"{what}: repository of comment {reply_id} unknown (read it back first)")
        path = f"/repos/{_http.seg(where[0], what)}/{_http.seg(where[1], what)}/issues/comments/{_http.seg(reply_id, what)}"
        self._delete("DELETE", path, reply_id)

    def write_budget(self) -> tuple[int, int]:
        """Return the sends paced in the last minute and the last hour (for metrics and tests)."""
        now = self._clock.now()
        with self._writes_lock:
            return (
                sum(1 for t in self._writes if t > now - 60.0),
                sum(1 for t in self._writes if t > now - 3600.0),
            )
