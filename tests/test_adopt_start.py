"""A store with no memory of a bot never re-answers: the daemon adopts the bot's own replies before any path runs.

The sim's Idempotency-Key support is off, so nothing on the platform's side hides a second answer: every
duplicate the daemon sends is counted by the sim. 200 parents are answered through replyd (a copy of the store
is taken at 100), then the store is replaced by a new empty one, or by the copy, and 10 new mentions arrive.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from replyd import store as st
from replyd.clock import SystemClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.test_daemon import wait_until

TABLES = ("replies", "events", "cursors", "listing_lag", "listing_delay", "answers")
TOKEN_ENV = "ADOPT_SIM_TOKEN"


def _config(path: Path, base_url: str, store_url: str, api_port: int | None = None) -> Path:
    """A daemon config for the sim with short intervals (and the API on ``api_port`` when given)."""
    api = f'\n[api]\nenabled = true\nhost = "127.0.0.1"\nport = {api_port}\n' if api_port else ""
    path.write_text(f"""
[store]
url = "{store_url}"

[log]
format = "json"
level = "warning"

[guard]
send_timeout_s = 1.0
compose_lease_s = 10.0

[sweep]
interval_s = 0.3
retry_s = 0.3
{api}
[[bots]]
name = "sim"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "{TOKEN_ENV}"
listing_delay_s = 0.3
timeout_s = 3.0
max_pages = 10

[bots.pollers]
inbox_interval_s = 0.3
search_interval_s = 0
refind_interval_s = 0.8
refind_lookback_s = 3600
jitter_s = 0
""")
    os.chmod(path, 0o600)
    return path


@pytest.fixture
def sim() -> Iterator[tuple]:
    """The sim with its Idempotency-Key support off, a bot account and a user who mentions it."""
    world = World(SystemClock(), seed=11, listing_delay_s=0.1)
    world.configure(idempotency=False)
    bot = world.add_account("replybot", bot=True)
    alice = world.add_account("alice")
    with SimServer(world) as srv:
        os.environ[TOKEN_ENV] = bot.token
        yield world, bot, alice, srv
    os.environ.pop(TOKEN_ENV, None)


def _answered(world: World, bot_id: str) -> set[str]:
    return {pid for pid, per in world.report()["parents"].items() if per.get(bot_id)}


def _settled(url: str) -> bool:
    s = Store.open(url, migrate=None)
    try:
        return not any(n for (_, state), n in s.counts().items()
                       if state in (st.OPEN, st.NOT_LANDED, st.RELEASED, st.COMPOSING))
    finally:
        s.dispose()


def _run_until(cfg: Path, url: str, world: World, bot_id: str, parents: set[str], *, linger_s: float = 0.0) -> None:
    """Run the daemon until every parent in ``parents`` is answered and no row is open, then ``linger_s`` more
    (re-find and the sweep run a few times meanwhile), then stop it."""
    d = Daemon(Config.load(cfg))
    d.start()
    try:
        assert wait_until(lambda: parents <= _answered(world, bot_id) and _settled(url), timeout_s=60), \
            f"{len(parents - _answered(world, bot_id))} parent(s) not answered"
        if linger_s:
            wait_until(lambda: False, timeout_s=linger_s)
            assert wait_until(lambda: _settled(url), timeout_s=30)
    finally:
        d.stop(grace_s=5)


def _tables(url: str, sql: str) -> None:
    """Run ``sql`` (with ``{t}`` for each of the store's tables) on the store, in one transaction."""
    eng = sa.create_engine(url)
    try:
        with eng.begin() as c:
            for t in TABLES:
                c.exec_driver_sql(sql.format(t=t))
    finally:
        eng.dispose()


def _mentions(world: World, alice: object, n: int, start: int) -> set[str]:
    return {world.post(alice, f"@replybot question {i}").id for i in range(start, start + n)}


@pytest.mark.parametrize("replaced_by", ["new_empty_store", "halfway_copy"])
def test_a_replaced_store_answers_only_the_new_mentions(sim, store_url: str, tmp_path: Path, replaced_by: str) -> None:
    world, bot, alice, srv = sim
    cfg = _config(tmp_path / "c.toml", srv.base_url, store_url)
    Store.open(store_url).dispose()  # a migrated store (the PostgreSQL one is shared by the session: cleaned)
    _tables(store_url, "DROP TABLE IF EXISTS bak_{t}")
    try:
        first = _mentions(world, alice, 100, 0)
        _run_until(cfg, store_url, world, bot.id, first)
        _tables(store_url, "CREATE TABLE bak_{t} AS SELECT * FROM {t}")  # the copy, taken halfway
        second = _mentions(world, alice, 100, 100)
        _run_until(cfg, store_url, world, bot.id, first | second)
        assert world.duplicates(bot.id) == 0
        if replaced_by == "new_empty_store":
            _tables(store_url, "DELETE FROM {t}")
        else:
            _tables(store_url, "DELETE FROM {t}")
            _tables(store_url, "INSERT INTO {t} SELECT * FROM bak_{t}")
        new = _mentions(world, alice, 10, 200)
        _run_until(cfg, store_url, world, bot.id, new, linger_s=2.5)  # three re-find runs over the whole window

        assert world.duplicates(bot.id) == 0, "a parent answered before the store was replaced was answered again"
        answered = world.report()["parents"]
        assert all(answered[p][bot.id] == 1 for p in first | second | new)
        s = Store.open(store_url)
        try:
            adopted = [e for e in s.export_rows("events") if e["kind"] == "adopted"]
            lag = {r["reply_id"] for r in _rows(store_url, "SELECT reply_id FROM listing_lag")}
            assert s.duplicate_counts() == {}
        finally:
            s.dispose()
        # What the copy did not know was adopted: the parents answered after it (all of them for a new store).
        assert len(adopted) == (200 if replaced_by == "new_empty_store" else 100)
        assert {e["parent_id"] for e in adopted} <= first | second
        # No lag sample from an adopted reply: its send time is not known.
        adopted_ids = {r["reply_id"] for r in _rows(store_url, "SELECT reply_id FROM replies WHERE path = 'adopt'")}
        assert adopted_ids and not adopted_ids & lag
    finally:
        _tables(store_url, "DROP TABLE IF EXISTS bak_{t}")


def _rows(url: str, sql: str) -> list[dict]:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            return [dict(m) for m in c.exec_driver_sql(sql).mappings()]
    finally:
        eng.dispose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_duplicates_found_are_counted_per_bot_in_status_page_and_metrics(sim, store_url: str, tmp_path: Path) -> None:
    """Parents the bot answered twice before replyd: adopted at start, and the second replies are counted where an
    operator looks (``/v1/status``, the status page, ``/metrics``), not only logged."""
    world, bot, alice, srv = sim
    twice = sorted(_mentions(world, alice, 3, 0))
    for pid in twice:
        world.post(bot, "@alice first", in_reply_to_id=pid)
        world.post(bot, "@alice second", in_reply_to_id=pid)
    # The adopt pass reads what the platform lists: wait out the sim's listing delay (0.1 s) first.
    wait_until(lambda: False, timeout_s=0.4)
    port = _free_port()
    cfg = _config(tmp_path / "c.toml", srv.base_url, store_url, api_port=port)
    d = Daemon(Config.load(cfg))
    d.start()
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: httpx.get(f"{base}/v1/status").json()["bots"]["sim"]["ready"], timeout_s=30)
        status = httpx.get(f"{base}/v1/status").json()
        assert status["bots"]["sim"]["duplicates"] == 3
        assert status["liveness"]["sim"]["start"]["adopting"] is False
        page = httpx.get(f"{base}/").text
        assert 'data-duplicates="3"' in page
        metrics = httpx.get(f"{base}/metrics").text
        assert re.search(r'^replyd_duplicates\{platform="sim"\} 3\.0$', metrics, re.M), metrics[:2000]
        from tests.api_harness import replyd_cli  # a process of its own: the daemon's threads log to this one's stdout

        js = replyd_cli("status", "--config", str(cfg), "--json")
        assert js.returncode == 0, js.stderr
        assert json.loads(js.stdout)["duplicates"] == [{"bot": "sim", "platform": status["bots"]["sim"]["platform"],
                                                        "sender_id": bot.id, "duplicates": 3}]
        text = replyd_cli("status", "--config", str(cfg)).stdout
        assert "duplicates detected" in text and re.search(r"sim .*\b3\b", text)
    finally:
        d.stop(grace_s=5)
    assert world.duplicates(bot.id) == 3  # the daemon added none


def test_adopting_is_said_in_liveness_and_on_the_status_page() -> None:
    """While a bot reads its own replies back it is not running, and its start says so (JSON flag, words, page)."""
    from replyd import statuspage
    from replyd.liveness import Liveness

    live = Liveness(SystemClock())
    live.expect("sim")
    live.adopting("sim")
    start = live.snapshot()["sim"]["start"]
    assert start["state"] == "starting" and start["adopting"] is True
    assert start["words"].startswith("adopting")
    assert "bot sim: adopting" in live.problems()[0]
    html = statuspage.render({"counts": [], "store": {"up": True, "url": "x"}, "oldest_open_age_s": 0.0,
                              "generated_at": 0.0, "oldest_open": [], "recent_events": [],
                              "bots": {"sim": {"ready": False, "duplicates": 0}},
                              "liveness": {"sim": {**live.snapshot()["sim"]}}})
    assert 'data-adopting="1"' in html and "adopting: reading its own replies back" in html
    live.started("sim")
    assert live.snapshot()["sim"]["start"]["adopting"] is False


@pytest.fixture
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no schema at all: a SQLite path not yet created, or a new PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'new.sqlite3'}"
        return
    request.getfixturevalue("pg_url")  # skips (fails under CI) when PostgreSQL is unreachable
    from tests.conftest import PG_ADMIN_URL

    name = f"replyd_fresh_{os.getpid()}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.mark.parametrize("fresh_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
                         indirect=True)
def test_replyd_adopt_works_on_a_fresh_database(sim, fresh_url: str, tmp_path: Path) -> None:
    """``replyd adopt`` on a database nobody migrated yet creates the schema and adopts (no ``db upgrade`` first)."""
    from tests.api_harness import replyd_cli

    world, bot, alice, srv = sim
    old = world.post(alice, "@replybot answered before replyd?")
    mine = world.post(bot, "@alice yes", in_reply_to_id=old.id)
    cfg = _config(tmp_path / "c.toml", srv.base_url, fresh_url)
    r = replyd_cli("adopt", "--config", str(cfg), "--json", env={TOKEN_ENV: bot.token})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sim"]["adopted"] == {old.id: mine.id}
    s = Store.open(fresh_url, migrate=False)  # the schema is current
    try:
        assert [e.kind for e in s.find_events(old.id)] == ["adopted"]
    finally:
        s.dispose()


def test_a_new_store_replays_nothing_into_the_platform_clock(sim, tmp_path: Path) -> None:
    """With the platform's Idempotency-Key on, a replay is answered with the old status: its ``created_at``, seconds
    old, would be sampled as the platform's clock. Adopting sends no replay, so the offset stays near 0."""
    world, bot, alice, srv = sim
    world.configure(idempotency=True)
    url = f"sqlite:///{tmp_path / 'r.sqlite3'}"
    cfg = _config(tmp_path / "c.toml", srv.base_url, url)
    old = _mentions(world, alice, 60, 0)
    _run_until(cfg, url, world, bot.id, old)
    wait_until(lambda: False, timeout_s=8.0)  # the answers are 8 s old and more when the new store starts
    _tables(url, "DELETE FROM {t}")
    new = _mentions(world, alice, 5, 60)
    d = Daemon(Config.load(cfg))
    d.start()
    try:
        assert wait_until(lambda: new <= _answered(world, bot.id) and _settled(url), timeout_s=60)
        wait_until(lambda: False, timeout_s=1.5)
        offset = d.bots[0].platform.clock_view()["offset_s"]
    finally:
        d.stop(grace_s=5)
    assert offset is not None and abs(offset) < 3.0, f"platform clock offset {offset} s: replays were sampled"
    assert world.report()["creates_attempted"] == 65  # 60 answers, then only the 5 new ones
    answers = {s.id for s in world.statuses.values() if s.account_id == bot.id and s.in_reply_to_id in old}
    sampled = {r["reply_id"] for r in _rows(url, "SELECT reply_id FROM listing_lag")}
    assert len(answers) == 60 and not answers & sampled  # no listing-lag sample from an answer the store adopted
