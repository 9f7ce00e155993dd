"""The reads for people (``Reader``): one named SQL text, the same answers on SQLite, PostgreSQL and sqlite3.

One log is planted with a row in every waiting state, a held parent, an answer in parts, duplicates,
unreadable items, a policy skip, listing lag and a platform name with LIKE wildcards in it. Every read is
then asked of the full store on SQLite, of the full store on PostgreSQL, and of ``SQLiteReader`` (stdlib
sqlite3, what the CLI's read commands open). Each must match the others and what was planted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from replyd import store as st
from replyd.errors import SchemaError
from replyd.store import Key, Store
from replyd.store.reader import SQLiteReader, for_driver
from replyd.store.schema import ANSWERS, EVENTS, LISTING_DELAY, LISTING_LAG, REPLIES, REPLY_DEFAULTS
from replyd.clock import FakeClock

ROOT = Path(__file__).resolve().parents[1]
NOW = 1_800_000_000.0
ODD = "mastodon:https://a_b%c.example"  # LIKE's wildcards in a platform name: a filter must match them as typed
BOT = "bot-1"


def _row(platform: str, parent: str, state: str, **kw: Any) -> dict[str, Any]:
    return {"platform": platform, "sender_id": BOT, "parent_id": parent, "state": state, "attempt": 1,
            "created_at": NOW - 3600, "updated_at": NOW - 1800, "path": "inbox", "snapshot": "{}", **kw}


def _event(platform: str, parent: str, kind: str, at: float, **kw: Any) -> dict[str, Any]:
    return {"platform": platform, "sender_id": BOT, "parent_id": parent, "kind": kind, "at": at,
            "detail": json.dumps(kw.pop("detail", {})), **kw}


def _plant(url: str) -> None:
    """Write the planted log straight into the tables (both dialects take these inserts)."""
    rows = [
        _row("memory:a", "p-open", st.OPEN, opened_at=NOW - 900, deadline_at=NOW - 700),
        _row("memory:a", "p-open-new", st.OPEN, opened_at=NOW - 10, deadline_at=NOW + 60),
        _row("memory:a", "p-composing", st.COMPOSING, lease_until=NOW - 1000),
        _row("memory:a", "p-held", st.RELEASED, error="policy: max_per_hour", not_before=NOW - 50),
        _row("memory:a", "p-held-2", st.RELEASED, error="policy: max_per_hour", not_before=NOW + 500),
        _row("memory:a", "p-lost", st.NOT_LANDED, not_before=NOW - 2000),
        _row("memory:a", "p-parts", st.PARTS, updated_at=NOW - 100),
        _row("memory:a", "p-parts#1", st.CLOSED, path=st.PART_PATH, reply_id="r-part-1"),
        _row("memory:a", "p-parts#2", st.NOT_LANDED, path=st.PART_PATH),
        _row("memory:a", "p-done", st.CLOSED, reply_id="r-1", closed_at=NOW - 60, path="search"),
        _row(ODD, "p-done", st.CLOSED, reply_id="r-2", closed_at=NOW - 30, created_at=NOW - 5),
        _row(ODD, "p-gave", st.GAVE_UP, attempt=3),
    ]
    events = [
        _event("memory:a", "p-done", "claimed", NOW - 70, state=st.OPEN, attempt=1, detail={"path": "search"}),
        _event("memory:a", "p-done", "closed", NOW - 60, state=st.CLOSED, attempt=1, detail={"reply_id": "r-1"}),
        _event("memory:a", "p-done", "duplicate_detected", NOW - 40, detail={"newer": ["r-9", "r-10"]}),
        _event(ODD, "p-done", "duplicate_detected", NOW - 35, detail={"newer": ["r-11"]}),
        _event(ODD, "p-done", "closed", NOW - 30, state=st.CLOSED, attempt=1, detail={"reply_id": "r-2"}),
        _event("memory:a", "u-1", "unreadable", NOW - 20, detail={"reason": "bad mail"}),
        _event("memory:a", "u-1", "unreadable", NOW - 19, detail={"reason": "bad mail again"}),
        _event("memory:a", "u-2", "unreadable", NOW - 18),
        _event("memory:a", "p-skip", "skipped", NOW - 10, detail={"reason": "own post"}),
    ]
    events.append({**_event("memory:a", "p-hand", "note", NOW - 5), "detail": "not json"})
    eng = sa.create_engine(url)
    try:
        with eng.begin() as c:
            c.execute(sa.insert(REPLIES), [{**REPLY_DEFAULTS, **r} for r in rows])
            c.execute(sa.insert(EVENTS), [{"state": None, "attempt": None, "owner": None, **e} for e in events])
            c.execute(sa.insert(ANSWERS), [{"platform": "memory:a", "sender_id": BOT, "parent_id": "p-parts",
                                            "parts": json.dumps(["one", "two"]), "created_at": NOW - 200}])
            c.execute(sa.insert(LISTING_DELAY), [{"platform": "memory:a", "configured_s": 2.0, "in_use_s": 3.5,
                                                  "updated_at": NOW}])
            c.execute(sa.insert(LISTING_LAG), [
                {"platform": "memory:a", "sender_id": BOT, "reply_id": f"r-{i}", "sent_at": NOW - 100 + i,
                 "lower_s": float(i), "upper_s": float(i) + 0.5 if i != 3 else None, "seen_at": NOW - 50 + i}
                for i in range(1, 6)])
    finally:
        eng.dispose()


def _plain(value: Any) -> Any:
    """A read's answer with its records as dicts and its containers comparable across backends."""
    if isinstance(value, st.Row | st.Event | st.ListingDelay):
        return {k: v for k, v in vars(value).items() if k != "id"}  # event ids differ only by insertion
    if isinstance(value, dict):
        return {k if not isinstance(k, tuple) else "|".join(k): _plain(v) for k, v in value.items()
                if k != "id"}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _reads(r: Any) -> dict[str, Any]:
    """Every read of ``Reader`` on the planted log."""
    key = Key("memory:a", BOT, "p-done")
    return {
        "counts": r.counts(),
        "oldest_open": r.oldest_open(5),
        "in_parts": r.in_parts(5),
        "overdue": r.overdue(NOW, 100.0),
        "waiting": r.waiting_reasons(),
        "duplicates": r.duplicate_counts(),
        "unreadable": r.event_key_counts("unreadable"),
        "paths": r.path_counts(),
        "delays": r.listing_delays(),
        "lag_platforms": sorted(r.lag_platforms()),
        "lag_samples": r.lag_samples("memory:a", 3),
        "listing": r.listing(),
        "peek": r.peek(key),
        "peek_none": r.peek(Key("memory:a", BOT, "nope")),
        "answer": r.answer(Key("memory:a", BOT, "p-parts")),
        "answer_none": r.answer(key),
        "history": r.history(key),
        "find": sorted(r.find("p-done"), key=lambda x: x.platform),
        "find_on": r.find("p-done", ODD),
        "find_events": r.find_events("p-done"),
        "find_events_on": r.find_events("p-done", ODD),
        "skipped_events": r.find_events("p-skip"),
        "kinds": r.event_kinds(),
        "log": r.events_with_path(limit=100),
        "log_limit": r.events_with_path(limit=2),
        "log_kind": r.events_with_path(kind="closed"),
        "log_state": r.events_with_path(state=st.CLOSED),
        "log_odd": r.events_with_path(platform="a_b%c"),
        "log_wild": r.events_with_path(platform="aXb"),
        "log_path": r.events_with_path(path="search"),
        "log_parent": r.events_with_path(parent_id="u-1"),
        "log_since": r.events_with_path(since=NOW - 19),
    }


@pytest.fixture
def planted(tmp_path: Path) -> dict[str, Any]:
    """The planted log on SQLite: the full store's reads and ``SQLiteReader``'s."""
    db = tmp_path / "r.sqlite3"
    url = f"sqlite:///{db}"
    Store.open(url).dispose()
    _plant(url)
    s = Store.open(url, clock=FakeClock(NOW))
    reader = SQLiteReader(db, url=url)
    try:
        reader.require_schema()
        return {"store": _reads(s), "reader": _reads(reader)}
    finally:
        s.dispose()
        reader.dispose()


def test_each_read_answers_what_was_planted(planted: dict[str, Any]) -> None:
    """The answers, checked against the planted rows (not against another read)."""
    r = planted["reader"]
    assert r["counts"][("memory:a", st.RELEASED)] == 2 and r["counts"][(ODD, st.CLOSED)] == 1
    assert [x.parent_id for x in r["oldest_open"]] == ["p-open", "p-open-new"]
    assert [x.parent_id for x in r["in_parts"]] == ["p-parts"]
    # Past its bound by more than 100 s at NOW: the lost row (2000 s), a lost part (1800 s), the composing
    # lease (1000 s), the open deadline (700 s). Not the held rows (50 s, one not due), not the fresh open row.
    assert [(x.parent_id, round(over)) for x, over in r["overdue"]] == [
        ("p-lost", 2000), ("p-parts#2", 1800), ("p-composing", 1000), ("p-open", 700)]
    # A part's row never counts as waiting: its answer's row does.
    assert r["waiting"] == {("memory:a", "max_per_hour"): 2, ("memory:a", st.NOT_LANDED): 1}
    assert r["duplicates"] == {("memory:a", BOT): 2, (ODD, BOT): 1}
    assert r["unreadable"] == {("memory:a", BOT): 2}
    assert ("memory:a", BOT, "search", 1, NOW - 3600) in r["paths"]
    assert r["delays"]["memory:a"].in_use_s == 3.5
    assert r["lag_samples"] == [(5.0, 5.5), (4.0, 4.5), (2.0, 2.5)]  # newest first, the incomplete one left out
    assert r["listing"] == [{"platform": "memory:a", "configured_s": 2.0, "in_use_s": 3.5, "samples": 4,
                             "observed_p50_s": 2.0, "observed_p99_s": 5.0, "listed_p99_s": 5.5}]
    assert r["peek"].reply_id == "r-1" and r["peek_none"] is None
    assert r["answer"] == ["one", "two"] and r["answer_none"] is None
    assert [e.kind for e in r["history"]] == ["claimed", "closed", "duplicate_detected"]
    assert [x.platform for x in r["find_on"]] == [ODD] and len(r["find"]) == 2
    assert [e.kind for e in r["skipped_events"]] == ["skipped"]
    assert r["kinds"] == ["claimed", "closed", "duplicate_detected", "note", "skipped", "unreadable"]
    assert len(r["log"]) == 10 and [e["parent_id"] for e in r["log_limit"]] == ["p-hand", "p-skip"]
    assert r["log"][0]["detail"] == "not json" and r["log"][0]["path"] is None
    assert {e["platform"] for e in r["log_odd"]} == {ODD} and r["log_wild"] == []
    assert {e["kind"] for e in r["log_path"]} == {"claimed", "closed", "duplicate_detected"}
    assert [e["at"] for e in r["log_since"]] == [NOW - 5, NOW - 10, NOW - 18, NOW - 19]


def test_sqlite3_reader_and_the_full_store_answer_alike(planted: dict[str, Any]) -> None:
    """What the CLI's read commands open (sqlite3) and what the daemon and API use (SQLAlchemy) agree."""
    assert _plain(planted["reader"]) == _plain(planted["store"])


@pytest.mark.postgres
def test_postgresql_answers_as_sqlite(planted: dict[str, Any], pg_url: str) -> None:
    """The same named SQL on PostgreSQL (psycopg's parameter style) gives the same answers as on SQLite."""
    from tests.conftest import _truncate

    _truncate(pg_url)
    _plant(pg_url)
    s = Store.open(pg_url, clock=FakeClock(NOW))
    try:
        pg = _reads(s)
    finally:
        s.dispose()
        _truncate(pg_url)
    assert _plain(pg) == _plain(planted["store"])


def test_for_driver_rewrites_names_only() -> None:
    """``:name`` becomes ``%(name)s`` for psycopg; a ``::`` cast or a time's colons are left alone."""
    assert for_driver("a = :a AND b::text = :b_2", "pyformat") == "a = %(a)s AND b::text = %(b_2)s"
    assert for_driver("a = :a", "named") == "a = :a"


def test_a_store_behind_the_schema_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A store at another revision is refused in one line naming ``replyd db upgrade``."""
    db = tmp_path / "old.sqlite3"
    url = f"sqlite:///{db}"
    Store.open(url).dispose()
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.exec_driver_sql("UPDATE alembic_version SET version_num = '0005'")
    eng.dispose()
    reader = SQLiteReader(db, url=url)
    try:
        with pytest.raises(SchemaError, match="at 0005, replyd needs .*replyd db upgrade"):
            reader.require_schema()
    finally:
        reader.dispose()


# What a read command on the default SQLite store, with no config, must never load: the engine, the ORM,
# the settings models, the logging stack (the config's defaults name the store).
LIGHT_HEAVY = ("sqlalchemy", "sqlmodel", "alembic", "pydantic_settings", "structlog", "httpx", "replyd.config",
               "replyd.store.base", "replyd.log")

_PROBE = ("import sys\n"
          "sys.argv = ['replyd', *sys.argv[1:]]\n"
          "from replyd.cli import main\n"
          "try:\n    main()\nexcept SystemExit:\n    pass\n"
          "sys.stderr.write('\\n'.join(sorted(sys.modules)))\n")


@pytest.mark.parametrize("args", [("status",), ("log",), ("explain", "p-done"), ("check", "p-done")])
def test_read_commands_on_sqlite_load_no_engine_orm_or_settings(args: tuple[str, ...], tmp_path: Path) -> None:
    """The cause of a read command's start time: on a SQLite store it loads stdlib sqlite3, never SQLAlchemy,
    SQLModel, pydantic-settings or structlog. The times live in bench/clistart.py."""
    state = tmp_path / "state"
    db = state / "replyd" / "replyd.sqlite3"
    db.parent.mkdir(parents=True)
    Store.open(f"sqlite:///{db}").dispose()
    _plant(f"sqlite:///{db}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLYD_")}
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, cwd=tmp_path,
                       env={**env, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT)}, timeout=60)
    out, loaded = r.stdout, r.stderr.split()
    assert "p-done" in out or "memory:a" in out, (out, r.stderr[-2000:])
    heavy = sorted(m for m in loaded if m.startswith(LIGHT_HEAVY))
    assert not heavy, f"replyd {' '.join(args)} loaded {heavy[:10]}"
