"""Webhook discovery: a platform pushes a delivery, replyd turns it into the same ``Parent`` a poller finds.

A delivery is checked before anything else happens (its HMAC signature over the raw body, with the
bot's secret from the environment), parsed by the bot's adapter into parents (the id as served, so the
key is the one the pollers use), and offered to the bot's pipeline with path ``webhook`` in the
background: the platform gets its answer at once (GitHub waits 10 s, Slack 3 s) and the post runs after.
A delivery redelivered, delivered out of order or delivered to two replicas needs nothing here: the
guard's key makes the second offer ``already_answered`` or ``in_flight``. Polling stays on as the
backstop: a delivery that never arrives is found by the next poll.

=================  ==========================================  ===============================
kind               signature header (HMAC-SHA256 of the body)   event header / delivery id
=================  ==========================================  ===============================
``github``         ``X-Hub-Signature-256: sha256=<hex>``        ``X-GitHub-Event`` /
                                                                ``X-GitHub-Delivery``
``discourse``      ``X-Discourse-Event-Signature: sha256=<hex>`` ``X-Discourse-Event`` /
                                                                ``X-Discourse-Event-Id``
``slack``          ``X-Slack-Signature: v0=<hex>`` of           in the body (``event.type``) /
                   ``v0:{X-Slack-Request-Timestamp}:{body}``,   ``X-Slack-Retry-Num`` (logged:
                   refused outside a 5-minute window            the event id is in the body)
=================  ==========================================  ===============================

Slack also checks the URL once with a signed ``url_verification`` delivery: an adapter that is a
``WebhookChallenge`` answers it (200 and the challenge). Slack's retries of a slow or failed ack
(``X-Slack-Retry-Num`` 1-3) are ordinary deliveries here: the guard's key makes them harmless.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from replyd import metrics
from replyd.errors import ReplydError
from replyd.platforms.base import Parent, WebhookChallenge, WebhookSource

if TYPE_CHECKING:
    from replyd.guard import Outcome

log = structlog.get_logger("replyd.hooks")


# Checks a delivery's signature from its headers and body at epoch ``now`` (for kinds with a replay window).
Check = Callable[[str, bytes, Mapping[str, str], float], bool]


@dataclass(frozen=True)
class Kind:
    """Where one platform's deliveries carry their signature, event name and delivery id."""

    signature: str
    event: str
    delivery: str
    check: Check | None = None  # None: ``verify`` of the signature header over the body


SLACK_WINDOW_S = 300.0  # Slack's documented replay window for X-Slack-Request-Timestamp


def slack_sign(secret: str, timestamp: str, body: bytes) -> str:
    """Return Slack's ``v0=<hex>`` signature: HMAC-SHA256 of ``v0:{timestamp}:{body}`` under the signing secret."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def slack_verify(secret: str, body: bytes, headers: Mapping[str, str], now: float) -> bool:
    """True when a Slack delivery is signed with ``secret`` and its timestamp is within 5 minutes of ``now``."""
    stamp = (headers.get("x-slack-request-timestamp") or "").strip()
    header = (headers.get("x-slack-signature") or "").strip()
    if not stamp.isdigit() or not header or len(stamp) > 12 or abs(now - int(stamp)) > SLACK_WINDOW_S:
        return False  # a replay of an old signed delivery is refused even though its signature is genuine
    return hmac.compare_digest(slack_sign(secret, stamp, body).encode(), header.encode())


KINDS: dict[str, Kind] = {
    "github": Kind("x-hub-signature-256", "x-github-event", "x-github-delivery"),
    "discourse": Kind("x-discourse-event-signature", "x-discourse-event", "x-discourse-event-id"),
    "slack": Kind("x-slack-signature", "", "x-slack-retry-num", check=slack_verify),
}


def sign(secret: str, body: bytes) -> str:
    """Return the ``sha256=<hex>`` signature of ``body`` under ``secret`` (what the platforms send)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str | None) -> bool:
    """True when ``header`` is ``body``'s signature under ``secret`` (compared in constant time)."""
    return bool(header) and hmac.compare_digest(sign(secret, body).encode(), header.strip().encode())  # type: ignore[union-attr]


@dataclass(frozen=True)
class Answer:
    """What the receiver tells the platform: an HTTP status and a small JSON body."""

    status: int
    body: dict[str, Any]


@dataclass
class Hook:
    """One bot's webhook: its kind, its secret, its adapter and the pipeline the parents go to."""

    bot: str
    kind: str
    secret: str
    source: WebhookSource
    offer: Callable[[Parent, str], Outcome]  # the bot's Pipeline.offer
    instance: str = ""


class Receiver:
    """Checks, parses and hands deliveries to the bots' pipelines in the background (two worker threads)."""

    def __init__(self, hooks: Mapping[str, Hook], *, max_body_bytes: int = 1_048_576, workers: int = 2,
                 now: Callable[[], float] = time.time) -> None:
        self.hooks = dict(hooks)
        self.now = now  # the wall clock: Slack's timestamps are the sender's wall time
        self.max_body_bytes = max_body_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replyd-hook")

    def receive(self, bot: str, headers: Mapping[str, str], body: bytes) -> Answer:
        """Handle one delivery for ``bot``; never raises, never waits for a post."""
        hook = self.hooks.get(bot)
        if hook is None:
            return Answer(404, {"error": "unknown_hook", "detail": f"no webhook is configured for bot {bot!r}"})
        kind = KINDS[hook.kind]
        delivery = (headers.get(kind.delivery) or "")[:100] if kind.delivery else ""
        signed = (kind.check(hook.secret, body, headers, self.now()) if kind.check is not None
                  else verify(hook.secret, body, headers.get(kind.signature)))
        if not signed:
            # Nothing is parsed, logged of the body, or offered for an unsigned or forged delivery.
            log.warning("replyd.hooks.bad_signature", bot=bot, platform=hook.instance, delivery=delivery,
                        signed=bool(headers.get(kind.signature)))
            metrics.webhook(hook.instance, "bad_signature")
            return Answer(401, {"error": "bad_signature",
                                "detail": f"the {kind.signature} header does not sign this body with the bot's secret"})
        event = (headers.get(kind.event) or "").strip()[:64] if kind.event else ""
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            metrics.webhook(hook.instance, "bad_body")
            return Answer(400, {"error": "invalid_json", "detail": "body: not valid JSON"})
        if isinstance(hook.source, WebhookChallenge):
            challenge = hook.source.webhook_challenge(payload)
            if challenge is not None:
                log.info("replyd.hooks.challenged", bot=bot, platform=hook.instance)
                return Answer(200, challenge)
        try:
            found = hook.source.parse_webhook(event, payload)
        except ReplydError as exc:
            log.warning("replyd.hooks.unreadable", bot=bot, platform=hook.instance, delivery=delivery, hook_event=event,
                        error=str(exc)[:300])
            metrics.webhook(hook.instance, "unreadable")
            return Answer(422, {"error": "unreadable_delivery", "detail": str(exc)[:300]})
        if isinstance(found, str) or not found:
            reason = found if isinstance(found, str) else "no parent in it"
            log.info("replyd.hooks.ignored", bot=bot, platform=hook.instance, delivery=delivery, hook_event=event,
                     reason=reason)
            metrics.webhook(hook.instance, "ignored")
            return Answer(202, {"accepted": 0, "ignored": reason})
        for parent in found:
            self._pool.submit(self._offer, hook, parent, delivery)
        log.info("replyd.hooks.accepted", bot=bot, platform=hook.instance, delivery=delivery, hook_event=event,
                 parents=[p.id for p in found])
        metrics.webhook(hook.instance, "accepted")
        return Answer(202, {"accepted": len(found), "parents": [p.id for p in found]})

    @staticmethod
    def _offer(hook: Hook, parent: Parent, delivery: str) -> None:
        try:
            out = hook.offer(parent, "webhook")
            log.info("replyd.hooks.offered", bot=hook.bot, platform=hook.instance, delivery=delivery,
                     parent_id=parent.id, status=out.status.value)
        except Exception as exc:  # the poll backstop finds it again; a worker must not die
            log.error("replyd.hooks.offer_failed", bot=hook.bot, platform=hook.instance, delivery=delivery,
                      parent_id=parent.id, error=f"{type(exc).__name__}: {exc}"[:300])

    def close(self, wait: bool = True) -> None:
        """Stop taking deliveries; with ``wait``, let the offers under way finish."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
