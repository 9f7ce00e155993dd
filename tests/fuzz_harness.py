"""Shared pieces of the adapter fuzz tests: mutations of recorded bodies, a regex-routed server, checks.

An adapter under fuzz is served its platform's recorded responses
(``shared/fixtures/<platform>``) over real local HTTP, with one response
replaced by a hypothesis-drawn mutation: a field deleted, a node replaced by a
value of another JSON type, a huge string or list, random bytes, an HTML error
page, a truncated body, a connection cut mid-body, an unexpected status.

What a call may do: return a well-formed value, or raise a ``ReplydError``
(``PlatformError`` and its subclasses, which the daemon logs and retries).
Never another exception type, and never a half-parsed ``Parent``: every parent
returned has a non-empty id that the served body really contains, a non-empty
author id (the "never answer yourself" policy compares it), the declared field
types and a JSON-serialisable snapshot (the guard stores it).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as hs
from hypothesis import HealthCheck, given, settings

from replyd.errors import ReplydError
from replyd.guard import Guard, Status
from replyd.platforms.base import Identity, OwnReply, Page, Parent, ReadBack, Sent
from replyd.store import Store
from tests.conftest import IN_CI
from tests.fixtures_server import FixtureServer, Recorded, Reply

HTML_PAGE = "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center></body></html>"
MUTATIONS = ("delete", "replace", "replace", "delete_many", "huge_string", "huge_list", "not_json", "html_200",
             "truncate", "drop", "empty", "wrong_top", "status")
STATUSES = (200, 201, 204, 301, 400, 401, 403, 404, 409, 410, 413, 422, 429, 500, 502, 503, 504)

# What a header, a timestamp or an id may carry that ``str.isdigit()``, ``int()`` or a log line mishandles: digits
# of other scripts ("²".isdigit() is True and int("²") raises; int("١٢") is 12), control and format characters,
# terminal escapes, latin-1 bytes as Starlette decodes a header, overlong and signed numbers.
NASTY_TEXT = hs.sampled_from([
    "\xb2", "\xb9\xb2\xb3", "\u0661\u0662\u0663", "\uff11\uff12", "\u2460", "17\x00", "\x1b[31mred\x1b[0m", "1\r\n2",
    "\u202e1700000000", "\x7f", "9" * 40, "-1", "+1", "1e9", "0x10", " 1700000000 ", "1700000000.5", "", "\t",
]) | hs.text(alphabet=hs.characters(categories=("Nd", "No", "Cc", "Cf", "Zs")) | hs.sampled_from("0123456789.:-"),
             max_size=16)

json_leaf = hs.none() | hs.booleans() | hs.integers(-2**70, 2**70) | hs.floats(allow_nan=False, allow_infinity=False) \
    | hs.text(max_size=12) | hs.sampled_from(["", "0", "-1", "1e309", "NaN", "2026-13-45T99:99:99Z", "@", "../..", "%2F"])
json_value = hs.recursive(json_leaf, lambda c: hs.lists(c, max_size=3) | hs.dictionaries(hs.text(max_size=6), c, max_size=3),
                          max_leaves=6)


def node_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node of a JSON document (the root is ``()``)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(node_paths(v, (*prefix, k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(node_paths(v, (*prefix, i)))
    return out


def _parent_of(doc: Any, path: tuple) -> tuple[Any, Any]:
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    return cur, path[-1]


@hs.composite
def mutated(draw: hs.DrawFn, raw: bytes) -> tuple[str, Reply]:
    """A mutation of the recorded body ``raw``: (what was done, the reply to serve)."""
    kind = draw(hs.sampled_from(MUTATIONS))
    doc = json.loads(raw)
    if kind in ("delete", "replace", "delete_many", "huge_string", "huge_list"):
        doc = copy.deepcopy(doc)
        paths = node_paths(doc)
        if kind == "delete_many":
            victims = draw(hs.lists(hs.sampled_from(paths[1:]), min_size=2, max_size=6)) if len(paths) > 1 else []
            for path in sorted(victims, key=len, reverse=True):
                try:
                    holder, k = _parent_of(doc, path)
                    del holder[k]
                except (KeyError, IndexError, TypeError):
                    pass
            return f"delete_many {victims}", Reply(body=doc)
        if kind == "huge_list":
            lists = [p for p in paths if isinstance(_get(doc, p), list)]
            if lists:
                path = draw(hs.sampled_from(lists))
                items = _get(doc, path)
                if items:
                    items.extend(copy.deepcopy(items[0]) for _ in range(3000))
                return f"huge_list {path}", Reply(body=doc)
            kind = "huge_string"
        if kind == "huge_string":
            strings = [p for p in paths if isinstance(_get(doc, p), str)]
            if strings:
                path = draw(hs.sampled_from(strings))
                holder, k = _parent_of(doc, path)
                holder[k] = "x" * 2_000_000
                return f"huge_string {path}", Reply(body=doc)
            kind = "replace"
        if len(paths) == 1:
            return "replace root", Reply(body=draw(json_value))
        path = draw(hs.sampled_from(paths[1:]))
        holder, k = _parent_of(doc, path)
        if kind == "delete":
            del holder[k]
        else:
            holder[k] = draw(json_value)
        return f"{kind} {path}", Reply(body=doc)
    if kind == "not_json":
        return kind, Reply(body=draw(hs.binary(max_size=300)), content_type="application/octet-stream")
    if kind == "html_200":
        return kind, Reply(body=HTML_PAGE, content_type="text/html")
    if kind == "truncate":
        n = draw(hs.integers(0, max(0, len(raw) - 1)))
        return f"truncate {n}", Reply(body=raw[:n])
    if kind == "drop":
        return kind, Reply(fault="drop")
    if kind == "empty":
        return kind, Reply(body=b"", content_type="application/json")
    if kind == "wrong_top":
        return kind, Reply(body=draw(hs.sampled_from([[], {}, "a string", 42, None, [1, 2], {"error": "x"}])))
    status = draw(hs.sampled_from(STATUSES))
    body = draw(hs.sampled_from([raw, HTML_PAGE.encode(), b"", b'{"error": "nope"}']))
    headers = {"Retry-After": draw(hs.sampled_from(["1", "-5", "abc", "Wed, 21 Oct 2015 07:28:00 GMT", "1e400"]))}
    return f"status {status}", Reply(status=status, body=body, headers=headers)


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


# How a fake answers a create: the recorded body (parsed), made a new reply from the request and a sequence number
# (its own id, the parent the request named), as the platform would.
Answer = Callable[[Recorded, Any, int], Any]


class RoutedServer:
    """Routes a FixtureServer by (method, path regex) to recorded bodies, one route replaced by a mutation."""

    def __init__(self, server: FixtureServer, routes: list[tuple[str, str, bytes]]) -> None:
        self.server = server
        self.routes = [(m, re.compile(rx), body) for m, rx, body in routes]
        self.override: dict[int, Reply] = {}
        self.answers: dict[int, Answer] = {}  # routes answered from their request when not overridden (creates)
        self.served: list[bytes] = []
        self.hits: list[int] = []
        self._made = itertools.count(1)
        server.reset()
        server._next = self._next  # type: ignore[method-assign]

    def _next(self, rec: Recorded) -> Reply:
        for i, (m, rx, body) in enumerate(self.routes):
            if m == rec.method and rx.fullmatch(rec.path):
                answer = self.answers.get(i)
                reply = self.override.get(i) or Reply(
                    body=answer(rec, json.loads(body), next(self._made)) if answer is not None else body)
                self.served.append(reply.encoded())
                self.hits.append(i)
                return reply
        return Reply(status=404, body={"error": "no route"})


def check_parent(p: Any, served: list[bytes]) -> None:
    """A parent is whole: typed fields, non-empty ids it was served, a JSON-safe snapshot."""
    assert isinstance(p, Parent), p
    assert isinstance(p.id, str) and p.id.strip(), p
    assert any(p.id.encode() in b or json.dumps(p.id)[1:-1].encode() in b for b in served), f"id {p.id!r} was never served"
    assert isinstance(p.author_id, str) and p.author_id.strip(), f"parent {p.id} has no author id: {p.author_id!r}"
    assert isinstance(p.author_handle, str) and isinstance(p.text, str) and isinstance(p.url, str), p
    assert isinstance(p.author_is_bot, bool) and isinstance(p.thread_depth, int) and isinstance(p.extra, dict), p
    assert p.created_at is None or (isinstance(p.created_at, float) and math.isfinite(p.created_at)), p
    json.dumps(p.snapshot(), default=str)
    assert Parent.from_snapshot(json.loads(json.dumps(p.snapshot()))).id == p.id


def check_result(value: Any, served: list[bytes], pending_ids: set[str] | None = None) -> None:
    """Validate whatever an adapter call returned."""
    if isinstance(value, Identity):
        assert isinstance(value.sender_id, str) and value.sender_id.strip(), value
    elif isinstance(value, Page):
        assert value.cursor is None or isinstance(value.cursor, str), value.cursor
        for p in value.parents:
            check_parent(p, served)
    elif isinstance(value, Parent):
        check_parent(value, served)
    elif isinstance(value, list):
        for p in value:
            check_parent(p, served)
    elif isinstance(value, Sent):
        assert isinstance(value.reply_id, str) and value.reply_id.strip(), value
    elif isinstance(value, ReadBack):
        assert pending_ids is not None
        assert set(value.found) <= pending_ids and value.checked <= pending_ids, value
        for replies in value.found.values():
            for r in replies:
                assert isinstance(r, OwnReply) and isinstance(r.reply_id, str) and r.reply_id.strip(), r
    else:
        raise AssertionError(f"unexpected return value {value!r}")


@dataclass
class Call:
    """One adapter entry point: the route it reads, and how to call it."""

    name: str
    route: int  # index of the route whose response is mutated
    fn: Callable[[Any], Any]
    pending_ids: set[str] | None = None


def run_call(platform: Any, call: Call, rs: RoutedServer) -> tuple[str, Any]:
    """Call; return ("ok", value) or ("error", exc) for a ReplydError; anything else propagates."""
    try:
        value = call.fn(platform)
    except ReplydError as exc:
        assert str(exc) is not None
        return "error", exc
    check_result(value, rs.served, call.pending_ids)
    return "ok", value


# -- one hostile item among good ones ----------------------------------------------------------------------
HOSTILE_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=IN_CI)
LISTINGS = {"inbox": lambda p: p.inbox(None).parents, "search": lambda p: p.search("help", None).parents,
            "refind": lambda p: p.refind(0.0)}


@hs.composite
def hostile_item(draw: hs.DrawFn, items: list[Any]) -> Any:
    """An item no adapter can read whole: any JSON value, or a good item with one node deleted or replaced."""
    if not items or draw(hs.booleans()):
        return draw(json_value | NASTY_TEXT)
    item = copy.deepcopy(draw(hs.sampled_from(items)))
    paths = node_paths(item)[1:]
    if not paths:
        return draw(json_value)
    holder, k = _parent_of(item, draw(hs.sampled_from(paths)))
    if draw(hs.booleans()):
        del holder[k]
    else:
        holder[k] = draw(json_value | NASTY_TEXT | hs.sampled_from([10 ** 400, "\ud800", -1, [], {}]))
    return item


def one_hostile_item(routes: list[tuple[str, str, bytes]], pages: list[tuple[str, str, tuple]],
                     server: FixtureServer, make: Callable[[], Any], *, send: tuple[str, str, Answer]) -> None:
    """Each listing (an entry point, the route it reads, the path to its item list) with one hostile item
    inserted among its good ones: no exception, every good parent kept, and every good parent answered through
    the guard (a SQLite store): one create each on the fake (``send``: the create's method, route and
    ``Answer``), none when offered again. ``make`` builds a fresh adapter."""
    rs = RoutedServer(server, routes)
    method, send_rx, answer = send
    creates = next(i for i, (m, r, _) in enumerate(routes) if m == method and r == send_rx)
    rs.answers = {creates: answer}
    listings = []
    for name, rx, at in pages:
        route = next(i for i, (_, r, _) in enumerate(routes) if r == rx)
        rs.override = {}
        good = {p.id: p for p in LISTINGS[name](make())}
        assert good, f"{name}: the fixtures name no parent to keep"
        listings.append((name, route, at, good))
    runs = itertools.count(1)

    @HOSTILE_FUZZ
    @given(data=hs.data())
    def check(data: hs.DataObject) -> None:
        name, route, at, good = data.draw(hs.sampled_from(listings), label="listing")
        doc = json.loads(routes[route][2])
        page = _get(doc, at)
        hostile = data.draw(hostile_item(copy.deepcopy(page)), label="hostile")
        page.insert(data.draw(hs.integers(0, len(page)), label="at"), hostile)
        rs.override = {route: Reply(body=doc)}
        plat = make()
        parents = LISTINGS[name](plat)
        got = {p.id for p in parents}
        assert set(good) <= got, f"{name}: {sorted(set(good) - got)} lost to {hostile!r:.300}"
        # Every good parent comes back whole, exactly as the page without the hostile item gives it (a hostile copy
        # of one good item, under its id, may stand for that one), and is answered through the guard: each example's
        # keys its own in the one store.
        whole = list({p.id: p for p in parents if good.get(p.id) == p}.values())
        twins = {p.id for p in parents if p.id in good and good[p.id] != p}
        assert len(twins) <= 1 and set(good) - {p.id for p in whole} <= twins, \
            f"{name}: {sorted(twins)} not whole with {hostile!r:.300}"
        plat.instance = f"{plat.instance}#{next(runs)}"
        guard = Guard(store, plat, plat.whoami(), send_timeout_s=5.0, watch_interval_s=None)
        made = rs.hits.count(creates)
        outs = guard.post_page([(p, "thanks") for p in whole], path=name)
        assert [o.status for o in outs] == [Status.POSTED] * len(whole), f"{name}: {outs} with {hostile!r:.300}"
        assert rs.hits.count(creates) - made == len(whole) == len({o.reply_id for o in outs}), (name, outs)
        again = guard.post_page([(p, "thanks") for p in whole], path=name)
        assert [o.status for o in again] == [Status.ALREADY_ANSWERED] * len(whole), (name, again)
        assert rs.hits.count(creates) - made == len(whole)  # one create each, on the fake's side

    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(f"sqlite:///{tmp}/replyd.sqlite3")
        try:
            check()
        finally:
            store.dispose()
