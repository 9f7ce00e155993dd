"""schemathesis hooks for test_api_schema: point some positive cases at the real bot and real parents.

Random strings only ever meet "unknown platform" (404); mapping a share of
the positive cases onto the configured bot and parents that exist on the sim
makes the run reach the guard itself: posts, already-answered, rejections,
history and rearm, with their response schemas checked.
"""

from __future__ import annotations

import os
import random

import schemathesis

BOT = os.environ.get("REPLYD_ST_BOT", "sim")
PARENTS = [p for p in os.environ.get("REPLYD_ST_PARENTS", "").split(",") if p]
_rng = random.Random(int(os.environ.get("REPLYD_ST_SEED", "7")))


@schemathesis.hook
def map_case(context, case):
    """Give ~70% of positive cases the real bot and a real parent id (negative cases stay as generated)."""
    meta = case.meta
    if not PARENTS or meta is None or not meta.generation.mode.is_positive or _rng.random() < 0.3:
        return case
    if case.path_parameters and {"platform", "parent_id"} <= set(case.path_parameters):
        case.path_parameters = {**case.path_parameters, "platform": BOT, "parent_id": _rng.choice(PARENTS)}
    if isinstance(case.body, dict) and {"platform", "parent_id"} <= set(case.body):
        case.body = {**case.body, "platform": BOT, "parent_id": _rng.choice(PARENTS)}
    if case.operation.path == "/v1/rearm" and isinstance(case.body, dict):
        # The real bot's rows, listed only: a bulk rearm would release the refused parent the single rearm needs.
        case.body = {**case.body, "bot": BOT, "dry_run": True}
    return case
