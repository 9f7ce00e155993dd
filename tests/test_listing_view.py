"""The learned listing delay where operators look: /v1/status, the status page and `replyd status` (text)."""

from __future__ import annotations

import re

from replyd import statuspage
from replyd.clock import FakeClock
from replyd.config import SweepConfig
from replyd.guard import Guard
from replyd.lag import ListingLag
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.api_harness import running
from tests.test_cli import env, replyd  # noqa: F401  (env is a fixture)

CFG = SweepConfig(listing_delay_min_samples=5, listing_lag_refresh_s=0.5)


def learn(store: Store, clock: FakeClock, instance: str, configured_s: float, real_s: float, n: int = 6) -> ListingLag:
    """Post ``n`` parents through a guard on a platform listing after ``real_s`` and sweep until measured."""
    plat = MemoryPlatform(instance=instance, listing_delay_s=configured_s, clock=clock)
    plat.real_listing_delay_s = real_s
    lag = ListingLag(store, plat.instance, configured_s, CFG, clock=clock)
    g = Guard(store, plat, plat.whoami(), clock=clock, send_timeout_s=1.0, watch_interval_s=None, lag=lag)
    sw = Sweeper(store, [Bot(plat, plat.whoami(), lag)], clock=clock, config=CFG)
    for i in range(n):
        g.post(plat.add_parent(f"p{i}"), "hello")
    for _ in range(20):
        clock.advance(0.5)
        sw.run_once()
    lag.refresh()
    return lag


def summary(bots: dict) -> dict:
    """A /v1/status summary with only ``bots`` filled in."""
    return {"generated_at": 0.0, "store": {"url": "sqlite://", "up": True, "error": None}, "counts": [],
            "open_rows": 0, "oldest_open_age_s": 0.0, "oldest_open": [], "recent_events": [], "bots": bots}


def test_status_page_shows_configured_in_use_and_observed_per_bot():
    """The page has a listing-delay row per running bot: configured, in use (marked when above), p50 / p99."""
    listing = {"platform": "mastodon:https://m.example", "configured_s": 1.0, "in_use_s": 7.5, "auto": True,
               "samples": 12, "observed_p50_s": 3.25, "observed_p99_s": 3.75, "listed_p99_s": 4.0}
    html = statuspage.render(summary({
        "fast": {"ready": True, "platform": "p", "sender_id": "1", "listing": {**listing, "in_use_s": 1.0}},
        "<slow>": {"ready": True, "platform": "p", "sender_id": "2", "listing": listing},
        "down": {"ready": False, "platform": None, "sender_id": None, "listing": None},
    }))
    row = re.search(r'<tr id="listing-&lt;slow&gt;">(.*?)</tr>', html).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[1:] == ["<code>mastodon:https://m.example</code>", "1", "7.5", "learned", "12", "3.25", "3.75"]
    assert 'class="n failing" data-in-use="7.5"' in row  # in use above the configured delay: highlighted
    assert 'class="n" data-in-use="1"' in html  # the fast bot: not highlighted
    assert 'id="listing-down"' not in html  # a bot not running has no delay to show
    off = statuspage.render(summary({"b": {"ready": True, "platform": "p", "sender_id": "1",
                                           "listing": {**listing, "auto": False, "in_use_s": 1.0}}}))
    assert "configured (listing_delay_auto = false)" in off
    assert 'id="listing-empty"' in statuspage.render(summary({}))


def test_api_status_reports_the_live_delay_in_use(tmp_path, monkeypatch):
    """/v1/status bots.<name>.listing: the configured delay, and the delay in use once the daemon learned one."""
    with running(tmp_path, monkeypatch) as h:
        with h.client() as c:
            before = c.get("/v1/status").json()["bots"]["sim"]["listing"]
        assert before["platform"] == h.instance and before["configured_s"] == 0.2 and before["in_use_s"] == 0.2
        assert before["auto"] is True and before["samples"] == 0
        lag = h.daemon.guards["sim"].lag
        # Six replies proven unlisted at 3 s and listed at 3.5 s, as the sweep records them, then a refresh.
        with h.daemon.store.transaction() as tx:
            for i in range(6):
                sent = h.daemon.store.clock.now() - 10
                tx.lag_look(lag.platform, h.bot.id, f"r{i}", sent_at=sent, age_s=3.0, listed=False, now=sent + 3.0)
                tx.lag_look(lag.platform, h.bot.id, f"r{i}", sent_at=sent, age_s=3.5, listed=True, now=sent + 3.5)
        lag.refresh()
        with h.client() as c:
            after = c.get("/v1/status").json()["bots"]["sim"]["listing"]
        assert after["samples"] == 6 and after["observed_p50_s"] == after["observed_p99_s"] == 3.0
        assert after["in_use_s"] == 6.0 and after["configured_s"] == 0.2  # 2 x p99, the default factor


def test_status_text_shows_the_listing_delay_table(env):
    """`replyd status` prints configured, in use and observed p50 / p99 per platform instance."""
    clock = FakeClock()
    store = Store.open(clock=clock)
    lag = learn(store, clock, "memory:text", 1.0, 3.0)
    store.dispose()
    r = replyd("status", env=env)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "memory:text" in ln and "│" in ln and "1 " in ln
                and f"{lag.delay_s():g}" in ln)
    cells = [c.strip() for c in line.split("│") if c.strip()]
    assert "listing delay" in r.stdout
    assert cells[:4] == ["memory:text", "1", f"{lag.delay_s():g}", "6"]
    assert float(cells[5]) == lag.summary.p99_s and 2.0 <= lag.summary.p99_s < 3.0 <= lag.delay_s()
