"""Discord end to end: two `replyd run` replicas on PostgreSQL, the Gateway with RESUME replays, the backstop
poll, lost create answers and a SIGKILL mid-send; replies counted on the Discord fake."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests import discord_scenario


def _truncate(url: str) -> None:
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    eng.dispose()


def _logs(tmp_path) -> str:
    return "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in ("a", "b"))


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize("nonce_window_s", [120.0, 0.5], ids=["nonce-window-2min", "nonce-window-shorter-than-delay"])
def test_two_replicas_gateway_replays_lost_answers_sigkill_one_reply_each(pg_url, tmp_path, nonce_window_s) -> None:
    """Every message by both Gateway sessions, again after a forced RESUME replay, and by the poll; 20 % of
    creates lose their answer; a SIGKILL mid-send; with the nonce window shorter than the listing delay the
    read-back must close what the nonce no longer covers: one reply per message on the fake, 0 duplicates."""
    _truncate(pg_url)
    res = discord_scenario.run(tmp_path, store_url=pg_url, messages=15, lose_ratio=0.2, kill_mid_send=True,
                               nonce_window_s=nonce_window_s, listing_delay_s=2.0)
    logs = _logs(tmp_path)
    assert res.killed and res.killed[0].endswith("mid-send"), logs
    assert res.resumes >= 1 and res.replayed >= 1 and res.dispatched > 2 * 15, res  # resumed, replayed to
    assert res.lost_answers >= 1, res
    assert res.replies == {p: 1 for p in res.parents}, ({p: n for p, n in res.replies.items() if n != 1}, res, logs)


@pytest.mark.slow
def test_the_naive_bot_answers_replays_and_retries_twice(tmp_path) -> None:
    """The control: a bot answering each MESSAGE_CREATE it sees (RESUME replays included) and retrying a failed
    create without a nonce posts duplicates on the same fake."""
    res = discord_scenario.naive(tmp_path, messages=15, lose_ratio=0.2)
    assert res.duplicates > 0, res
