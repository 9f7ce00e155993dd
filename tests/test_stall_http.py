"""The database's answer to the open held past send timeout + listing delay, on one of two replicas, over HTTP.

The stalled open commit against real servers: the sim (Mastodon-shaped, no Idempotency-Key) over HTTP, PostgreSQL
for both replicas, replica A's connections through a TCP proxy (``chaos.proxy.TcpProxy.hold_answer``) that
holds the server's answer to A's ``composing -> open`` commit. Meanwhile replica B's sweep judges the row and
B answers the parent again (what re-find does). Replies and duplicates are counted by the sim; every
duplicate the sim holds must be one replyd reported (``duplicate_detected``), and with the pre-send deadline
check there are none.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import sqlalchemy as sa

from chaos.proxy import OPEN_COMMIT, TcpProxy
from replyd.clock import SystemClock
from replyd.guard import Status
from replyd.library import open_guard
from replyd.sim import SimServer, World

pytestmark = pytest.mark.postgres

SEND_TIMEOUT_S = 1.0
LISTING_DELAY_S = 0.6  # configured; the sim's real delay is below it
HOLD_S = SEND_TIMEOUT_S + LISTING_DELAY_S + 2.0  # past send timeout + listing delay, and B's sweep and answer
ROUNDS = 4
BOT = "stallbot"


def reported(url: str) -> int:
    """Duplicates replyd reported: the reply ids named ``newer`` in its ``duplicate_detected`` events."""
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            rows = c.exec_driver_sql("SELECT detail FROM events WHERE kind = 'duplicate_detected'").all()
    finally:
        eng.dispose()
    return sum(len(json.loads(d or "{}").get("newer", [])) for (d,) in rows)


def test_open_answer_held_on_one_replica_sends_nothing_late(pg_url, monkeypatch) -> None:
    """Four rounds of A's open answer held 3.6 s while B sweeps and answers: 0 duplicates on the sim."""
    world = World(SystemClock(), seed=28, listing_delay_s=0.2, idempotency=False)
    bot = world.add_account(BOT, bot=True)
    user = world.add_account("asker")
    monkeypatch.setenv("STALL_SIM_TOKEN", bot.token)
    pg = sa.engine.make_url(pg_url)
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    eng.dispose()
    proxy = TcpProxy(pg.host or "127.0.0.1", pg.port or 5432).start()
    via_proxy = pg.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    with SimServer(world) as srv:
        settings = {"base_url": srv.base_url, "token_env": "STALL_SIM_TOKEN", "listing_delay_s": LISTING_DELAY_S,
                    "timeout_s": SEND_TIMEOUT_S, "idempotency": False}
        a = open_guard(via_proxy, "mastodon", settings, send_timeout_s=SEND_TIMEOUT_S, max_attempts=3)
        b = open_guard(pg_url, "mastodon", settings, send_timeout_s=SEND_TIMEOUT_S, max_attempts=3)
        outcomes = []
        try:
            for i in range(ROUNDS):
                status = world.post(user, f"@{BOT} question {i}", mention=[bot])
                time.sleep(0.3)  # the sim shows a new status after its listing delay
                parent = b.platform.resolve(status.id)
                proxy.hold_answer(OPEN_COMMIT, HOLD_S)
                held_before = proxy.held
                out: list = []
                t = threading.Thread(target=lambda out=out, parent=parent: out.append(a.guard.post(parent, lambda p: "attempt from A")))
                t.start()
                t_end = time.monotonic() + 10
                while proxy.held == held_before and time.monotonic() < t_end:
                    time.sleep(0.01)
                assert proxy.held == held_before + 1, "the open commit never went through the proxy"
                time.sleep(SEND_TIMEOUT_S + LISTING_DELAY_S + 0.3)  # past the row's deadline
                res = b.sweep()
                assert res.not_landed == 1, res  # nothing of A's attempt is on the platform
                again = b.guard.post(parent, "attempt from B")  # re-find offers the not_landed parent
                assert again.status is Status.POSTED, again  # attempt 2, or 1 again if A released it first
                t.join(15)
                outcomes.append(out[0])
            time.sleep(LISTING_DELAY_S + 0.5)
            for _ in range(3):  # verify every close (and count whatever landed late)
                b.sweep()
                time.sleep(LISTING_DELAY_S)
            made = world.duplicates(bot.id)
            assert reported(pg_url) == made, (made, world.report()["parents"])  # every late landing reported
            assert made == 0, [o.status for o in outcomes]
            assert all(o.status is Status.NOT_SENT for o in outcomes), outcomes
            per = world.replies_by(bot.id)
            assert len(per) == ROUNDS and set(per.values()) == {1}
        finally:
            a.close()
            b.close()
            proxy.close()
