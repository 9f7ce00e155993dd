"""The learned-delay limit rows (chaos.limits, ``python -m chaos --limits --learned``): one short real run.

Real processes (``replyd run`` through the time shim, the sim over HTTP); duplicates counted by the sim.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from chaos.limits import LearnedRun, learned_plan, learned_table
from chaos.run import config_text

pytestmark = pytest.mark.slow


def test_plan_carries_the_learned_delay_setting_into_replyd_config():
    """Each row's [sweep] settings reach the replica's config: learned delay off or on, the reconcile cap."""
    off = config_text(learned_plan("listing_delay_4x_learned_off", 0, 1), "http://sim", "sqlite:///x")
    on = config_text(learned_plan("listing_delay_4x_learned_on", 0, 1), "http://sim", "sqlite:///x")
    assert "listing_delay_auto = false" in off and "listing_delay_auto = true" in on
    assert "reconcile_max_s = 30.0" in on and "idempotency = true" in on  # replyd sends the key; the sim ignores it
    p = learned_plan("listing_delay_2x_learned_on", 0, 1)
    assert not p.idempotency and p.ld_real == 2 * p.ld_conf and p.ld_real > p.ld_conf + p.send_timeout


def test_learned_off_row_every_duplicate_made_is_detected(tmp_path):
    """A short 4x row with the learned delay off: the sim holds duplicates, replyd detected each, none lost."""
    plan = replace(learned_plan("listing_delay_4x_learned_off", 9000, 3, parents=24, traffic_s=8.0),
                   rates={"lost_drop_rate": 0.2, "lost_504_rate": 0.2})
    run = LearnedRun(plan, tmp_path)
    res = run.execute()
    assert not res.error, res.error
    assert res.duplicates > 0  # the limit is real: lost responses judged before their replies were listed
    assert run.extra["detected"] == res.duplicates
    assert run.extra["answered"] == res.posts == 24 and run.extra["gave_up_answered"] == 0 and res.lost == 0
    assert run.extra["delay_in_use_s"] == 1.0  # the learned delay really was off in the replica
    row = {"real_over_configured": 4.0, "learned": False, "parents": res.posts, "lost_responses": 1,
           "duplicates_made": res.duplicates, "detected": run.extra["detected"], "duplicates_after_warm_up": 0,
           "answered": run.extra["answered"], "gave_up_answered": 0, "delay_in_use_s": [1.0]}
    assert f"| 4× (4 s) | off | 24 | 1 | {res.duplicates} | {res.duplicates} |" in learned_table([row])
