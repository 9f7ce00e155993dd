"""Shared fixtures: a store on SQLite and on the real PostgreSQL, a fake clock."""

from __future__ import annotations

import fnmatch
import os
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import structlog

from replyd.clock import FakeClock
from replyd.store import Store
from tests.bsky_network import bsky_network  # noqa: F401  (one dev-env network per session for every Bluesky test)
from tests.synapse_server import synapse  # noqa: F401  (one Synapse per session for every Matrix test)
from tests.mail_server import mail_server  # noqa: F401  (one Postfix + Dovecot per session for the email tests)

PG_ADMIN_URL = os.environ.get("REPLYD_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/postgres")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ALLOWED_SKIPS_FILE = Path(__file__).with_name("ci_allowed_skips.toml")


def load_allowed_skips(path: Path = ALLOWED_SKIPS_FILE) -> dict[str, str]:
    """The CI allow-list: node id (or fnmatch pattern) -> reason; an entry without a reason is an error."""
    doc = tomllib.loads(path.read_text())
    allowed: dict[str, str] = {}
    for i, entry in enumerate(doc.get("allow", [])):
        test, reason = entry.get("test"), entry.get("reason")
        if not isinstance(test, str) or not test or not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"{path.name}: allow[{i}] needs a non-empty test and reason")
        allowed[test] = reason
    return allowed


def plain_nodeid(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` that ``--dist loadgroup`` appends to a grouped test's id."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid  # an "@" inside [params] is the test's own


def skip_allowed(nodeid: str, allowed: dict[str, str]) -> bool:
    """Whether the allow-list lets ``nodeid`` (grouped by xdist or not) skip under CI."""
    nodeid = plain_nodeid(nodeid)
    return any(nodeid == pat or fnmatch.fnmatchcase(nodeid, pat) for pat in allowed)


# Session servers too costly to start on every xdist worker: every test that uses one joins its group, and
# `--dist loadgroup` runs a group on one worker, so each server starts once per run (fixture -> group).
SERVER_GROUPS = {"synapse": "synapse", "bsky_network": "bsky"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marks into "@group" node id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test that uses a shared session server (directly or through a fixture) in that server's group."""
    for item in items:
        for fixture, group in SERVER_GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))


_ALLOWED_KEY = pytest.StashKey[dict[str, str]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    """Under CI=true a skip not in ci_allowed_skips.toml fails: silent skips hid untested code there."""
    report = yield
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        allowed = item.config.stash.setdefault(_ALLOWED_KEY, load_allowed_skips())
        if not skip_allowed(item.nodeid, allowed):
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = (f"skipped under CI=true, which allows no skip but those listed in "
                               f"tests/{ALLOWED_SKIPS_FILE.name}: {why}")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """Under CI=true a whole module skipped at import (allow_module_level) fails unless listed too."""
    report = yield
    if IN_CI and report.skipped and not skip_allowed(report.nodeid, load_allowed_skips()):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped under CI=true (not in tests/{ALLOWED_SKIPS_FILE.name}): {why}"
    return report


@pytest.fixture(autouse=True)
def _structlog_config_restored() -> Iterator[None]:
    """Each test gets back the structlog config it started with: a test that configures logging in-process
    (``log.configure(level="warning")``) must not filter the events a later test on the same xdist worker
    captures."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _pg_reachable() -> str | None:
    """Return None if PostgreSQL answers, else why not."""
    try:
        eng = sa.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with eng.connect() as c:
            c.exec_driver_sql("SELECT 1")
        eng.dispose()
        return None
    except Exception as exc:  # any failure means "not reachable" here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session; dropped at the end."""
    why = _pg_reachable()
    if why:
        if IN_CI:
            pytest.fail(f"PostgreSQL is required under CI=true but unreachable at {PG_ADMIN_URL}: {why}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL} ({why}); set REPLYD_TEST_PG or start it")
    name = f"replyd_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    Store.open(url).dispose()  # migrate once
    yield url
    with admin.connect() as c:
        c.exec_driver_sql(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        )
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
    admin.dispose()


def _truncate(url: str) -> None:
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, answers, replicas, bot_leases")
    eng.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A clean store URL, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'replyd.sqlite3'}"
    url = request.getfixturevalue("pg_url")
    _truncate(url)
    return url


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test moves it."""
    return FakeClock()


@pytest.fixture
def store(store_url: str, clock: FakeClock) -> Iterator[Store]:
    """A migrated store on the parametrised database with the fake clock."""
    s = Store.open(store_url, clock=clock)
    yield s
    s.dispose()
