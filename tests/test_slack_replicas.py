"""Slack end to end: two `replyd run` replicas on PostgreSQL, every Slack path and redelivery, faults, SIGKILL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests import slack_scenario


def cut_composes(pg_url: str, killed_at: list[tuple[str, float]]) -> set[str]:
    """Parents a SIGKILLed replica was composing when it died: their responder's answer died with it."""
    cut: set[str] = set()
    eng = sa.create_engine(pg_url)
    with eng.connect() as c:
        rows = c.exec_driver_sql("SELECT parent_id, kind, state, owner, at FROM events ORDER BY id").all()
    eng.dispose()
    for rid, when in killed_at:
        composing: dict[str, bool] = {}
        for parent, kind, state, owner, at in rows:
            if owner != rid or at > when:
                continue
            if kind == "claimed" and state == "composing":
                composing[parent] = True
            elif parent in composing and state != "composing":
                composing[parent] = False
        cut |= {p for p, open_ in composing.items() if open_}
    return cut


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_every_path_every_retry_one_reply_one_call(pg_url, tmp_path) -> None:
    """Events API (4 tries + an extra event id each), Socket Mode (a reconnect), the backstop poll, 3 lost
    chat.postMessage answers and a SIGKILL mid-send: one reply per message counted by the fake, one responder
    call per message (two at most where the SIGKILL also cut a compose short: that answer died with the process)."""
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    eng.dispose()
    res = slack_scenario.run("replyd", tmp_path, store_url=pg_url, messages=12, lost=3, kill_mid_send=True)
    logs = "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in ("a", "b"))
    assert res.killed and res.killed[0].endswith("mid-send"), logs
    assert res.deliveries >= 12 * 4, res  # every message came by several paths, several times
    assert res.replies == {p: 1 for p in res.parents}, ({p: n for p, n in res.replies.items() if n != 1}, logs)
    cut = cut_composes(pg_url, res.killed_at)
    # A cut compose may have died before its responder call or after it: one call or two, never more.
    wrong = {p: (res.calls[p], p in cut) for p in res.parents if not 1 <= res.calls[p] <= 1 + (p in cut)}
    assert not wrong, (wrong, res.killed_at, logs)
