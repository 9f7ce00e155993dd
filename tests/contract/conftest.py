"""The adapter contract suite's fixtures: ``harness`` runs each case once per entry of ``HARNESSES``.

A case that cannot apply to an adapter is skipped with the reason the
harness gives in its ``skips`` (never silently); a case an adapter fails
today is a strict xfail with the bug named in its ``known_bugs``. The servers are session
fixtures: the sim and the forum-fake host start once here; Synapse and the
Bluesky dev-env are the session fixtures of ``tests/conftest.py``, shared
with the platform tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from replyd.platforms.base import platform_class
from tests.conftest import SERVER_GROUPS
from tests.contract.harnesses import HARNESSES, Harness, build
from tests.fakes_forum import store_template  # noqa: F401  (a migrated SQLite template per module, copied per test)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise every case over the adapters, skipping with the harness's reason where it cannot apply."""
    if "harness" not in metafunc.fixturenames:
        return
    params = []
    # A module of one guarantee class's cases (``NO_READ_BACK = True``) runs on the adapters of that class only.
    only_no_read_back = getattr(metafunc.module, "NO_READ_BACK", False)
    # A module of one optional feature's cases (``FEATURE = EditReply``) runs on the adapters offering it.
    feature = getattr(metafunc.module, "FEATURE", None)
    for name, entry in HARNESSES.items():
        if only_no_read_back and not entry.harness.no_read_back:
            continue
        if feature is not None and not issubclass(platform_class(entry.harness.kind), feature):
            continue
        why = entry.harness.skips.get(metafunc.function.__name__)
        marks = [pytest.mark.skip(reason=f"{name}: {why}")] if why else []
        bug = entry.harness.known_bugs.get(metafunc.function.__name__)
        if bug:
            # strict: the day the adapter is fixed the case passes, XPASS fails, and the entry must go.
            marks.append(pytest.mark.xfail(reason=f"{name} adapter bug: {bug}", raises=AssertionError, strict=True))
        if entry.backend == "bsky_network":
            marks.append(pytest.mark.slow)  # as tests/test_bluesky_network.py: the network takes a minute to start
        if entry.backend in SERVER_GROUPS:
            # the backend is fetched by getfixturevalue, unseen by the root conftest's grouping: name it here
            marks.append(pytest.mark.xdist_group(SERVER_GROUPS[entry.backend]))
        params.append(pytest.param(name, id=name, marks=marks))
    metafunc.parametrize("adapter_name", params)


@pytest.fixture(scope="session")
def contract_sim() -> Iterator[Any]:
    """The Mastodon-compatible sim in a thread of this process, on a fake clock."""
    from replyd.clock import FakeClock
    from replyd.sim import SimServer, World

    with SimServer(World(FakeClock())) as srv:
        yield srv


@pytest.fixture(scope="session")
def contract_forum_host() -> Iterator[Any]:
    """One uvicorn server that serves whichever forum fake (Discourse, GitHub) a test installs."""
    from tests.fakes_forum import FakeHost

    with FakeHost() as host:
        yield host


@pytest.fixture
def harness(adapter_name: str, request: pytest.FixtureRequest) -> Iterator[Harness]:
    """This test's harness for ``adapter_name``, on its (session-wide) server."""
    backend_fixture = HARNESSES[adapter_name].backend
    backend = request.getfixturevalue(backend_fixture) if backend_fixture else None
    with httpx.Client(trust_env=False) as http:
        yield from build(adapter_name, backend, http)
