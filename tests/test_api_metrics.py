"""GET /metrics after a real run: every named series is there, with the values the run must produce."""

from __future__ import annotations

from dataclasses import replace

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api_harness import BOT, running


COUNTED = ("_total", "_count", "_sum", "_bucket")


def scrape(h) -> dict[tuple[str, frozenset], float]:
    """Return {(sample name, labels): value} from the API's /metrics; counters as counted since the fixture began.

    Counters are process-wide and labelled by bot name ("sim" in every test), so earlier tests' counts are
    subtracted.
    """
    with h.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    base = getattr(h, "baseline", {})
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            out[key] = s.value - (base.get(key, 0.0) if s.name.endswith(COUNTED) else 0.0)
    return out


def value(samples, name: str, **labels: str) -> float:
    """One sample's value (0 when the series is absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def h(tmp_path, monkeypatch):
    """A sim and a daemon serving the API."""
    with running(tmp_path, monkeypatch) as harness:
        harness.baseline = scrape(harness)
        yield harness


def test_metrics_count_a_real_run(h):
    """Sends, outcomes, rows by state, open rows and their age, platform errors, responder, sweep and duplicates."""
    inst = "sim"  # the bot's name, never the URL
    post = lambda pid, text="thanks": h.client().post(  # noqa: E731
        "/v1/replies", json={"platform": "sim", "parent_id": pid, "text": text})
    p_ok, p_rej, p_lost, p_dup = h.parent(), h.parent(), h.parent(), h.parent()
    assert post(p_ok).status_code == 201
    assert post(p_ok, "again").status_code == 200
    assert post(p_rej, "x" * 600).status_code == 409
    h.world.queue_faults(next_creates=["lost_504", "lost_504"])
    assert post(p_lost).status_code == 202
    assert post(p_dup).status_code == 202
    # Another writer outside replyd answers p_dup too: the sweep must report a duplicate.
    h.world.post(BOT, "@alice a second answer", in_reply_to_id=p_dup)

    m = scrape(h)
    assert value(m, "replyd_sends_total", platform=inst) == 4
    assert value(m, "replyd_outcomes_total", platform=inst, status="posted") == 1
    assert value(m, "replyd_outcomes_total", platform=inst, status="already_answered") == 1
    assert value(m, "replyd_outcomes_total", platform=inst, status="rejected") == 1
    assert value(m, "replyd_outcomes_total", platform=inst, status="uncertain") == 2
    assert value(m, "replyd_platform_errors_total", platform=inst, op="send", kind="rejected") == 1
    assert value(m, "replyd_platform_errors_total", platform=inst, op="send", kind="maybe_sent") == 2
    assert value(m, "replyd_send_seconds_count", platform=inst) == 4
    # Post-to-answer latency: one answer posted, timed from the parent's creation on the platform.
    assert value(m, "replyd_answer_latency_seconds_count", platform=inst) == 1
    assert 0 <= value(m, "replyd_answer_latency_seconds_sum", platform=inst) < 60
    assert value(m, "replyd_rows", platform=inst, state="closed") == 1
    assert value(m, "replyd_rows", platform=inst, state="rejected") == 1
    assert value(m, "replyd_rows", platform=inst, state="open") == 2
    assert value(m, "replyd_rows", platform=inst, state="gave_up") == 0
    assert value(m, "replyd_open_rows", platform=inst) == 2
    assert value(m, "replyd_oldest_open_row_age_seconds") > 0
    assert value(m, "replyd_store_up") == 1

    # A responder call through the same guard (what the pollers do).
    parent = h.daemon.bots[0].platform.resolve(h.parent())
    out = h.daemon.guards["sim"].post(parent, lambda p: f"hi {p.author_handle}", path="inbox")
    assert out.status.value == "posted"
    declined = h.daemon.guards["sim"].post(h.daemon.bots[0].platform.resolve(h.parent()), lambda p: None)
    assert declined.status.value == "declined"

    time.sleep(1.5)  # past send_timeout_s + the listing delay: the open rows are due
    h.daemon.sweep_once()
    m = scrape(h)
    assert value(m, "replyd_responder_calls_total", platform=inst, result="ok") == 1
    assert value(m, "replyd_responder_calls_total", platform=inst, result="declined") == 1
    assert value(m, "replyd_responder_seconds_count", platform=inst) == 2
    assert value(m, "replyd_sweep_rows_total", platform=inst, result="closed") == 2
    assert value(m, "replyd_duplicates_detected_total", platform=inst) == 1
    assert value(m, "replyd_open_rows", platform=inst) == 0
    assert value(m, "replyd_oldest_open_row_age_seconds") == 0
    assert value(m, "replyd_rows", platform=inst, state="closed") == 4
    assert value(m, "replyd_rows", platform=inst, state="declined") == 1

    # A parent by a bot, offered twice through the bot's pipeline: two skips counted, one event recorded.
    pipe = h.daemon.bots[0].pipeline
    botty = replace(h.daemon.bots[0].platform.resolve(h.parent()), author_is_bot=True)
    assert [pipe.offer(botty, "inbox").detail for _ in range(2)] == ["author_is_bot"] * 2
    assert value(scrape(h), "replyd_policy_skips_total", platform=inst, reason="author_is_bot") == 2


def test_readback_errors_are_counted(h):
    """A failing read-back counts as a platform error of op read_back; the row stays open."""
    pid = h.parent()
    h.world.queue_faults(next_creates=["lost_504"])
    assert h.client().post("/v1/replies", json={"platform": "sim", "parent_id": pid, "text": "x"}).status_code == 202
    time.sleep(1.5)
    before = value(scrape(h), "replyd_sweep_rows_total", platform="sim", result="left_open")
    h.world.configure(readback_error_rate=1.0)
    h.daemon.sweep_once()
    h.world.configure(readback_error_rate=0.0)
    m = scrape(h)
    assert value(m, "replyd_sweep_rows_total", platform="sim", result="left_open") == before + 1
    assert value(m, "replyd_open_rows", platform="sim") == 1


def test_a_send_after_the_bot_is_named_counts_under_the_new_label():
    """A platform's send series follow ``name_platform``: sends before it count under the old label, sends after
    it under the bot's name, none under the old one (the children kept for the send path are dropped too)."""
    from replyd import metrics

    inst = "memory:relabel-test"

    def sends(label: str) -> float:
        return metrics.registry().get_sample_value("replyd_sends_total", {"platform": label}) or 0.0

    old = metrics.platform_label(inst)
    before = sends(old)
    with metrics.watching_send(inst):
        pass
    metrics.name_platform(inst, "relabelled")
    with metrics.watching_send(inst):
        pass
    with metrics.watching_send(inst):
        pass
    assert (sends(old) - before, sends("relabelled")) == (1.0, 2.0)
