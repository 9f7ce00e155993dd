"""The platform's clock measured against replyd's (``PlatformClock``), and read-back windows computed on it.

Unit tests run the estimator on the injected clock; the adapter tests put a Mastodon-shaped server (the sim)
and a GitHub-shaped one (``tests.fakes_forum.FakeGitHub``) on a clock 5 minutes behind or ahead of replyd's,
over real HTTP, and check that a reply on the second page of the own feed (Mastodon) or behind a ``since``
filter (GitHub) is found, never "checked, not found". The daemon tests are in tests/test_platform_clock_daemon.py.
"""

from __future__ import annotations

import random
import re

import httpx
import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from replyd import metrics
from replyd.clock import FakeClock, OffsetClock
from replyd.platforms._http import UNMEASURED_WIDE_S, PlatformClock
from replyd.platforms.base import Parent, Pending
from replyd.platforms.github import GitHubPlatform
from replyd.platforms.mastodon import MastodonPlatform
from replyd.sim import SimServer, World
from tests.fakes_forum import AppServer, FakeGitHub
from tests.fixtures_server import http_date

SKEWS_S = (-300.0, 300.0)


def estimator(clock: FakeClock) -> PlatformClock:
    """A PlatformClock on ``clock`` that logs through structlog (captured by the tests)."""
    import structlog

    return PlatformClock(clock.now, platform="test:platform", log=structlog.get_logger("replyd.test"))


def date_response(t: float) -> httpx.Response:
    """A response whose Date header says epoch ``t`` (to the second, as servers send it)."""
    return httpx.Response(200, headers={"date": http_date(t)})


# --- the estimator on the injected clock ------------------------------------------------------------------


def test_unmeasured_clock_errs_a_day_wide() -> None:
    """No sample yet: no offset, and the earliest platform time of a local epoch is a day before it."""
    clock = FakeClock()
    pc = estimator(clock)
    assert pc.offset_s() is None and pc.low_s() is None
    assert pc.earliest(clock.now()) == clock.now() - UNMEASURED_WIDE_S
    assert pc.earliest(clock.now(), unmeasured_s=0.0) == clock.now()
    assert pc.view() == {"offset_s": None, "low_s": None, "samples": 0, "source": None}


@pytest.mark.parametrize("true_offset_s", [-300.4, -0.6, 0.0, 299.9])
def test_date_samples_bound_the_true_offset(true_offset_s: float) -> None:
    """Date headers (whole seconds) over random round trips: the estimate is within 1 s and the low bound
    never above the true offset, so a window built on it can only open wider."""
    clock = FakeClock(1_800_000_000.25)
    pc = estimator(clock)
    rng = random.Random(3)
    for _ in range(40):
        t0 = clock.now()
        clock.advance(rng.uniform(0.0, 0.4))  # the request travels
        served = clock.now() + true_offset_s  # the platform stamps its Date at some instant in between
        clock.advance(rng.uniform(0.0, 0.4))
        pc.note_date(date_response(served), t0, clock.now())
        clock.advance(rng.uniform(0.0, 3.0))
    offset, low = pc.offset_s(), pc.low_s()
    assert offset is not None and low is not None
    assert abs(offset - true_offset_s) <= 1.0
    assert low <= true_offset_s
    assert pc.earliest(clock.now()) <= clock.now() + true_offset_s


def test_one_date_sample_allows_the_second_it_truncates() -> None:
    """A Date header is the platform's time rounded down to the second: one sample's low bound must allow the
    whole second (the platform at .1 past a second is served as the second; its centre alone is 0.4 s high)."""
    clock = FakeClock(1_800_000_000.5)
    pc = estimator(clock)
    pc.note_date(date_response(clock.now() - 300.4), clock.now(), clock.now())
    low = pc.low_s()
    assert low is not None and low <= -300.4 < low + 1.0


def test_whole_second_created_at_is_read_as_served_to_the_second() -> None:
    """GitHub serves created_at to the second (rounded down): the estimate takes the second's middle, within
    half a second of the truth, not its start."""
    clock = FakeClock(1_800_000_000.7)
    pc = estimator(clock)
    pc.note_created(float(int(clock.now() - 300.0)), clock.now(), clock.now())  # "…T…:40:00Z" for …:40:00.7
    assert pc.offset_s() == pytest.approx(-300.0, abs=0.5)
    assert pc.low_s() is not None and pc.low_s() <= -300.0


def test_created_samples_win_over_date_samples() -> None:
    """A reply's created_at (stamped between send and answer, ms resolution) is preferred to the Date header."""
    clock = FakeClock()
    pc = estimator(clock)
    t = clock.now()
    pc.note_date(date_response(t - 100), t, t)  # a stale Date (a cache in front)
    assert pc.view()["source"] == "date"
    pc.note_created(t + 0.5 - 300.0, t, t + 1.0)
    assert pc.view()["source"] == "created"
    assert pc.offset_s() == pytest.approx(-300.0, abs=0.01)


def test_median_resists_an_outlier_and_the_low_bound_follows_it() -> None:
    """One wild sample does not move the estimate (median), but the window opens to include it (low bound)."""
    clock = FakeClock()
    pc = estimator(clock)
    for _ in range(6):
        t = clock.advance(1.0)
        pc.note_created(t - 300.0 + 0.25, t, t + 0.5)
    pc.note_created(clock.now() - 900.0, clock.now(), clock.now())
    assert pc.offset_s() == pytest.approx(-300.0, abs=0.3)
    assert pc.low_s() is not None and pc.low_s() <= -900.0


def test_old_samples_leave_the_window() -> None:
    """A platform clock that stepped is followed once the window's samples are the new clock's."""
    clock = FakeClock(1_800_000_000.25)
    pc = PlatformClock(clock.now, platform="p", log=_Silent(), window=5)
    for _ in range(5):
        pc.note_created(clock.advance(1.0) - 300.0, clock.now(), clock.now())
    for _ in range(5):
        pc.note_created(clock.advance(1.0) + 10.0, clock.now(), clock.now())
    assert pc.offset_s() == pytest.approx(10.0, abs=0.01)
    assert pc.low_s() == pytest.approx(10.0, abs=0.01)


def test_skew_warned_once_per_change_past_the_threshold() -> None:
    """``replyd.platform.clock_skew``: once when the offset passes 30 s, once when it changes by 30 s more,
    once when it comes back; never again for the same skew."""
    clock = FakeClock()
    pc = estimator(clock)
    with capture_logs() as logs:
        for offset in [0.0] * 3 + [-300.0] * 20 + [300.0] * 30 + [0.2] * 40:
            t = clock.advance(1.0)
            pc.note_created(t + offset, t, t)
    warned = [e for e in logs if e["event"] == "replyd.platform.clock_skew"]
    assert [round(e["offset_s"]) for e in warned] == [-300, 300, 0]
    assert all(e["platform"] == "test:platform" for e in warned)


def test_offset_is_a_metric() -> None:
    """``replyd_platform_clock_offset_seconds{platform}`` follows the estimate of an adapter's clock."""
    clock = FakeClock()
    plat = MastodonPlatform.from_settings({"base_url": "http://127.0.0.1:9", "token": "t"}, http=httpx.Client(),
                                          clock=clock)
    metrics.name_platform(plat.instance, "skewbot")
    plat.platform_clock.note_created(clock.now() - 123.5, clock.now(), clock.now())
    text = generate_latest(metrics.registry()).decode()
    [value] = re.findall(r'^replyd_platform_clock_offset_seconds\{platform="skewbot"\} (\S+)$', text, re.M)
    assert float(value) == pytest.approx(-123.5, abs=0.01)


class _Silent:
    """A logger that drops everything."""

    def warning(self, *a: object, **k: object) -> None:
        """Drop it."""


# --- Mastodon: the own-feed walk on the platform's clock ----------------------------------------------------


def _mastodon(srv: SimServer, clock: FakeClock, token: str) -> MastodonPlatform:
    return MastodonPlatform.from_settings({"base_url": srv.base_url, "token": token, "idempotency": False},
                                          http=httpx.Client(timeout=10), clock=clock)


@pytest.mark.parametrize("skew_s", SKEWS_S)
def test_mastodon_reply_on_the_second_page_is_found(skew_s: float) -> None:
    """The sim's clock 5 min off replyd's; 45 newer own replies push the first one to page 2 of the own feed:
    the read-back must find it (before: the walk stopped at page 1, as the platform's times were all older than
    replyd's opened_at minus 60 s, and counted the parent checked and not found)."""
    clock = FakeClock(1_800_000_000.0)
    world = World(OffsetClock(clock, skew_s), listing_delay_s=0.0, idempotency=False)
    bot = world.add_account("skewbot", bot=True)
    alice = world.add_account("alice")
    parents = [world.post(alice, f"question {i}", mention=[bot]) for i in range(46)]
    with SimServer(world) as srv:
        plat = _mastodon(srv, clock, bot.token)
        me = plat.whoami()
        opened = clock.now()
        for p in parents:
            clock.advance(0.5)
            world.post(bot, "an answer", in_reply_to_id=p.id)
        clock.advance(30.0)
        rb = plat.read_back([Pending(parent=Parent(id=parents[0].id, author_id=alice.id), opened_at=opened)],
                            sender_id=me.sender_id)
    assert plat.platform_clock.offset_s() == pytest.approx(skew_s, abs=1.0)  # from the sim's Date headers
    assert [r.parent_id for r in rb.found.get(parents[0].id, [])] == [parents[0].id]
    assert rb.checked == {parents[0].id}


def test_mastodon_send_measures_the_offset_from_created_at() -> None:
    """A reply's created_at, served in the answer to its create, sets the offset to within the round trip."""
    clock = FakeClock(1_800_000_000.25)
    world = World(OffsetClock(clock, -300.0), listing_delay_s=0.0, idempotency=False)
    bot = world.add_account("skewbot", bot=True)
    alice = world.add_account("alice")
    status = world.post(alice, "question", mention=[bot])
    with SimServer(world) as srv:
        plat = _mastodon(srv, clock, bot.token)
        plat.send(plat.resolve(status.id), "hi", provider_key="")
    view = plat.clock_view()
    assert view["source"] == "created" and view["offset_s"] == pytest.approx(-300.0, abs=0.01)


def test_mastodon_unmeasured_walk_does_not_stop_on_time() -> None:
    """No Date header and no send: the walk reads on past replyd's horizon (a day wide), so a reply whose
    platform time is 5 min behind replyd's still counts (the recorded-server case)."""
    clock = FakeClock(1_800_000_000.0)
    world = World(OffsetClock(clock, -300.0), listing_delay_s=0.0, idempotency=False)
    bot = world.add_account("skewbot", bot=True)
    alice = world.add_account("alice")
    parents = [world.post(alice, f"q {i}", mention=[bot]) for i in range(42)]
    with SimServer(world) as srv:
        plat = _mastodon(srv, clock, bot.token)
        me = plat.whoami()
        plat.platform_clock = PlatformClock(clock.now, platform=plat.instance, log=_Silent())  # forget the Date
        plat.platform_clock.note_date = lambda *a: None  # type: ignore[method-assign]  # a server without Date
        opened = clock.now()
        for p in parents:
            world.post(bot, "answer", in_reply_to_id=p.id)
        rb = plat.read_back([Pending(parent=Parent(id=parents[0].id, author_id=alice.id), opened_at=opened)],
                            sender_id=me.sender_id)
    assert plat.platform_clock.offset_s() is None
    assert parents[0].id in rb.found and rb.checked == {parents[0].id}


# --- GitHub: the since filter on the platform's clock -------------------------------------------------------


@pytest.mark.parametrize("skew_s", SKEWS_S)
def test_github_since_is_sent_in_githubs_time(skew_s: float) -> None:
    """GitHub's clock 5 min off replyd's filters ``since`` on its own clock: the read-back's since must be in
    GitHub's time, or (GitHub behind) the bot's comment is never listed and the issue is checked, not found."""
    clock = FakeClock(1_800_000_000.0)
    gh = FakeGitHub(OffsetClock(clock, skew_s))  # type: ignore[arg-type]
    gh.add_repo("acme/widgets")
    alice = gh.add_user("alice")
    issues = [gh.open_issue(alice, "acme/widgets", f"broken {i}", "help") for i in range(3)]
    server = AppServer(gh.app)
    server.start()
    try:
        plat = GitHubPlatform.from_settings({"api_url": server.url, "token": FakeGitHub.TOKEN, "notifications": False,
                                             "repos": ["acme/widgets"]}, http=httpx.Client(timeout=10), clock=clock)
        me = plat.whoami()
        parents = {p.id: p for p in plat.inbox(None).parents}
        opened = clock.now()
        clock.advance(1.0)
        for issue in issues:
            gh.comment(gh.bot, issue, "an answer")  # as if the create's response was lost
        clock.advance(30.0)
        pending = [Pending(parent=parents[str(i.id)], opened_at=opened) for i in issues]
        rb = plat.read_back(pending, sender_id=me.sender_id)
    finally:
        server.stop()
    assert plat.platform_clock.offset_s() == pytest.approx(skew_s, abs=1.0)  # from GitHub's Date headers
    assert sorted(rb.found) == sorted(parents) and rb.checked == set(parents)


def test_github_unmeasured_since_is_a_day_early() -> None:
    """Before any sample the repo listing's since is sent a day (plus the margin) before the opening."""
    clock = FakeClock(1_800_000_000.0)
    plat = GitHubPlatform.from_settings({"api_url": "http://127.0.0.1:9", "token": "t"}, http=httpx.Client(),
                                        clock=clock)
    assert plat._horizon(clock.now()) == clock.now() - UNMEASURED_WIDE_S - plat.READ_BACK_MARGIN_S
    plat.platform_clock.note_created(clock.now() - 300.0, clock.now(), clock.now())
    # A whole-second created_at can be up to 1 s late: the window starts at the earliest it allows.
    assert plat._horizon(clock.now()) == pytest.approx(clock.now() - 300.0 - plat.READ_BACK_MARGIN_S)
