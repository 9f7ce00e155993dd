"""Fuzzing the webhook receiver: hostile headers before authentication, mutated payloads after it.

Before the signature is checked a delivery may carry anything in its headers (timestamps in digits of
other scripts, control characters, terminal escapes) and name any bot: the answer is always the one
bad-signature 401, never a 500, and an unknown bot cannot be told from a known one. After it, a signed
delivery whose payload is a mutation of a published example (GitHub's, Slack's, Discourse's) is answered
2xx/4xx, never raises, and offers only parents inside the bot's scope; what the receiver logs of the
headers is printable ASCII.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import hypothesis.strategies as hs
from hypothesis import HealthCheck, given, settings
from structlog.testing import capture_logs

from replyd.clock import FakeClock
from replyd.hooks import BAD_SIGNATURE, KINDS, Hook, Receiver, sign, slack_sign
from replyd.platforms.base import Identity, Parent
from replyd.platforms.discourse import DiscoursePlatform
from replyd.platforms.github import GitHubPlatform
from replyd.platforms.slack import SlackPlatform
from tests.conftest import IN_CI
from tests.fuzz_harness import NASTY_TEXT, mutated

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=IN_CI)
SECRET = "whsec-fuzz-0123456789abcdef"
NOW = 1_800_000_000.0
FIXTURES = Path(__file__).parent / "fixtures"
PAYLOADS = {
    "gh": [("issues", FIXTURES / "webhooks/github/issues.opened.json"),
           ("issue_comment", FIXTURES / "webhooks/github/issue_comment.created.with-installation.json")],
    "sl": [("", FIXTURES / "slack/event_app_mention.json"), ("", FIXTURES / "slack/event_message_im.json")],
    "dc": [("post_created", None)],
}


def _discourse_post() -> bytes:
    """A post_created delivery around the recorded Discourse post (shared fixtures, MIT)."""
    from tests.fixtures_server import load_fixture

    post = json.loads(load_fixture("discourse", "post_created.json"))
    post.update(raw="hey @replybot, any idea?", user_id=12)
    return json.dumps({"post": post}).encode()


def _receiver(offered: list[tuple[str, Parent]]) -> tuple[Receiver, dict[str, Any]]:
    """A receiver with a GitHub, a Slack and a Discourse bot, identified as whoami would have left them."""
    http = httpx.Client()
    gh = GitHubPlatform.from_settings({"token": "t", "repos": ["Codertocat/Hello-World"]}, http=http, clock=FakeClock())
    gh._me = Identity("4100000001", "replyd-bot")
    sl = SlackPlatform.from_settings({"token": "xoxb-fuzz", "team_id": "T123ABC456"}, http=http, clock=FakeClock())
    sl._me = Identity("U0LAN0Z89", "replybot")  # the bot the published app_mention names
    dc = DiscoursePlatform.from_settings({"base_url": "https://forum.example", "api_key": "k" * 32,
                                          "api_username": "replybot"}, http=http, clock=FakeClock())
    dc._me = Identity("7", "replybot")
    sources = {"gh": gh, "sl": sl, "dc": dc}
    kinds = {"gh": "github", "sl": "slack", "dc": "discourse"}

    def offer_to(bot: str) -> Any:
        def offer(parent: Parent, path: str) -> Any:  # the pipeline's offer, recorded
            offered.append((bot, parent))

            class Out:
                class status:
                    value = "posted"
            return Out()
        return offer

    hooks = {b: Hook(b, kinds[b], SECRET, src, offer_to(b), instance=f"{kinds[b]}:fuzz") for b, src in sources.items()}
    return Receiver(hooks, now=lambda: NOW), sources


def _printable(events: list[dict[str, Any]]) -> None:
    """Every header-derived field the receiver logged is printable ASCII (no escape reaches a terminal)."""
    for e in events:
        for key in ("bot", "delivery", "hook_event"):
            value = e.get(key)
            if isinstance(value, str):
                assert all(0x21 <= ord(c) <= 0x7e for c in value), (e["event"], key, value)


@FUZZ
@given(bot=hs.sampled_from(["gh", "sl", "dc"]) | NASTY_TEXT, stamp=NASTY_TEXT, sig=NASTY_TEXT, delivery=NASTY_TEXT,
       event=NASTY_TEXT, body=hs.binary(max_size=200))
def test_before_authentication_every_answer_is_the_one_401(bot: str, stamp: str, sig: str, delivery: str,
                                                            event: str, body: bytes) -> None:
    """Hostile headers and any bot name, unsigned: the same 401 and body for known and unknown bots, no raise,
    nothing offered, nothing unprintable logged."""
    offered: list = []
    rec, _ = _receiver(offered)
    headers = {"x-slack-request-timestamp": stamp, "x-slack-signature": sig, "x-hub-signature-256": sig,
               "x-discourse-event-signature": sig, "x-github-delivery": delivery, "x-github-event": event,
               "x-discourse-event-id": delivery, "x-discourse-event": event, "x-slack-retry-num": delivery}
    try:
        with capture_logs() as logs:
            answer = rec.receive(bot, headers, body)
    finally:
        rec.close(wait=True)
    assert (answer.status, answer.body) == (BAD_SIGNATURE.status, BAD_SIGNATURE.body)
    assert offered == []
    _printable(logs)


@FUZZ
@given(stamp=NASTY_TEXT, delivery=NASTY_TEXT)
def test_signed_slack_with_a_nasty_timestamp_is_401(stamp: str, delivery: str) -> None:
    """A Slack delivery correctly signed over a timestamp that is not ASCII digits (or is outside the window)
    is the one 401, never a 500 (``"\\xb2".isdigit()`` is True and ``int("\\xb2")`` raises)."""
    offered: list = []
    rec, _ = _receiver(offered)
    body = (FIXTURES / "slack/event_app_mention.json").read_bytes()
    headers = {"x-slack-request-timestamp": stamp, "x-slack-signature": slack_sign(SECRET, stamp, body),
               "x-slack-retry-num": delivery}
    try:
        answer = rec.receive("sl", headers, body)
    finally:
        rec.close(wait=True)
    assert (answer.status, answer.body) == (BAD_SIGNATURE.status, BAD_SIGNATURE.body) and offered == []


@FUZZ
@given(data=hs.data(), bot=hs.sampled_from(["gh", "sl", "dc"]), delivery=NASTY_TEXT, event_tail=NASTY_TEXT)
def test_signed_mutated_payloads_offer_only_parents_in_scope(data: hs.DataObject, bot: str, delivery: str,
                                                             event_tail: str) -> None:
    """A signed delivery of a mutated published payload: 2xx or 4xx, no raise; every parent offered is in the
    bot's scope (asked again of its adapter) and has an id; header fields are logged printable."""
    event, path = data.draw(hs.sampled_from(PAYLOADS[bot]))
    raw = path.read_bytes() if path is not None else _discourse_post()
    what, reply = data.draw(mutated(raw))
    body = reply.encoded() if what != "drop" else raw
    event = data.draw(hs.sampled_from([event, event + event_tail]))
    offered: list = []
    rec, sources = _receiver(offered)
    kind = KINDS[{"gh": "github", "sl": "slack", "dc": "discourse"}[bot]]
    if bot == "sl":
        headers = {"x-slack-request-timestamp": str(int(NOW)),
                   "x-slack-signature": slack_sign(SECRET, str(int(NOW)), body)}
    else:
        headers = {kind.signature: sign(SECRET, body), kind.event: event}
    headers[kind.delivery] = delivery
    try:
        with capture_logs() as logs:
            answer = rec.receive(bot, headers, body)
    finally:
        rec.close(wait=True)
    assert answer.status in (200, 202, 400, 422), (what, answer)
    assert not [e for e in logs if e["event"] == "replyd.hooks.scope_failed"], (what, logs)
    payload = json.loads(body) if answer.status in (200, 202) else None
    for _, parent in offered:
        assert parent.id and sources[bot].webhook_scope(event.strip()[:64], payload, parent) is None, what
    _printable(logs)


@FUZZ
@given(team=hs.none() | hs.integers() | hs.lists(hs.text(max_size=3), max_size=2) | hs.dictionaries(
    hs.text(max_size=3), hs.text(max_size=3), max_size=2) | NASTY_TEXT, auths=hs.lists(
    hs.none() | hs.dictionaries(hs.sampled_from(["team_id", "user_id"]), hs.none() | hs.integers() | hs.lists(
        hs.integers(), max_size=2) | NASTY_TEXT, max_size=2), max_size=3))
def test_slack_scope_of_odd_workspace_fields_never_raises(team: Any, auths: list) -> None:
    """``team_id`` and ``authorizations`` of any JSON type (a list or an object is unhashable): a signed
    delivery is 2xx, its parent dropped as ``other_workspace`` unless the bot's workspace is named."""
    offered: list = []
    rec, _ = _receiver(offered)
    doc = json.loads((FIXTURES / "slack/event_app_mention.json").read_bytes())
    doc["team_id"], doc["authorizations"] = team, auths
    body = json.dumps(doc).encode()
    headers = {"x-slack-request-timestamp": str(int(NOW)), "x-slack-signature": slack_sign(SECRET, str(int(NOW)), body)}
    try:
        with capture_logs() as logs:
            answer = rec.receive("sl", headers, body)
    finally:
        rec.close(wait=True)
    assert not [e for e in logs if e["event"] == "replyd.hooks.scope_failed"], logs
    named = team == "T123ABC456" or any(isinstance(a, dict) and a.get("team_id") == "T123ABC456" for a in auths)
    assert answer.status == 202 and (len(offered) == 1) == named, answer
