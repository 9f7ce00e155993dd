"""Webhook discovery: a platform pushes a delivery, replyd turns it into the same ``Parent`` a poller finds.

A delivery is checked before anything else happens (its HMAC signature over the raw body, with the
bot's secret from the environment), parsed by the bot's adapter into parents (the id as served, so the
key is the one the pollers use), recorded, and offered to the bot's pipeline with path ``webhook`` in the
background: the platform gets its answer at once (GitHub waits 10 s, Slack 3 s) and the post runs after.

Recorded before the ack: every parent of an accepted delivery is inserted as a ``released`` row (its snapshot,
no attempt spent, event ``received``) unless its key already has a row, all of them in one durable commit,
before the 2xx. A replica SIGKILLed between the ack and the guard's claim then loses nothing: re-find's
re-offer (``Pollers.reoffer``, on any replica, or this one restarted) offers the row from its snapshot.
Telegram (``setWebhook``) and WhatsApp do not deliver again after a 2xx, and Telegram refuses ``getUpdates``
while a webhook is set, so without the row such a delivery would be gone. A store that cannot take the
commit gets the delivery answered 503 (nothing acked, nothing offered), so a platform that retries does.
The offer after the ack takes the delivery's parents as one page (``Pipeline.offer_page``): the ``released``
rows are claimed together, in one durable transaction, as re-find's waiting rows are.
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
``telegram``       ``X-Telegram-Bot-Api-Secret-Token``: the     in the body (``update_id``)
                   ``secret_token`` itself (constant-time)
``discord``        ``X-Signature-Ed25519``: Ed25519 of          in the body (``type``) / the
                   ``{X-Signature-Timestamp}{body}`` under the  interaction id is in the body
                   app's public key (``secret_env``), 5 min
``whatsapp``       ``X-Hub-Signature-256: sha256=<hex>`` with   in the body (``entry[].changes``)
                   the Meta app secret (``secret_env``)
=================  ==========================================  ===============================

WhatsApp (Meta) checks the URL with ``GET ?hub.mode=subscribe&hub.verify_token=…&hub.challenge=…``:
``Receiver.challenge`` answers the challenge (text) when the token equals the hook's verify token
(``push.verify_token_env``, compared in constant time), else the one 403. Its deliveries also carry
``value.statuses[]`` (``WebhookReceipts``): a ``sent``/``delivered``/``read`` report whose
``biz_opaque_callback_data`` names one of this bot's keys closes that row, ``unconfirmed`` or still ``open``
(``library.confirm``: event ``confirmed`` by ``whatsapp_status``, the reply id the report's message id),
before the 2xx; a ``failed`` report is logged (``replyd.hooks.delivery_failed``) and kept as an event
``delivery_failed`` on its row. A report whose key is not this bot's confirms nothing.

Slack also checks the URL once with a signed ``url_verification`` delivery: an adapter that is a
``WebhookChallenge`` answers it (200 and the challenge). Slack's retries of a slow or failed ack
(``X-Slack-Retry-Num`` 1-3) are ordinary deliveries here: the guard's key makes them harmless.

Scope: a webhook delivers more than the bot's config asks for (a GitHub App or organisation webhook sends
every repository's issues, Discourse every post of the forum, a Slack app every workspace it is installed
in). Each parent is offered only when the adapter's ``webhook_scope`` says its own pollers would have found
it; any other is answered 202 (acked, so the platform does not retry), not offered, logged as
``replyd.hook.dropped`` and counted in ``replyd_webhook_dropped_total{platform,reason}``.

Before the signature is checked nothing tells one bot from another: an unknown bot, an unsigned, forged or
stale delivery all get the same 401 and body (and an unknown bot costs the same HMAC), so the URL space
cannot be probed for the bots that exist or the kind of their hook.
A configured bot still starting checks the signature too: only a signed delivery gets its 503. Refusals are
logged once per event and minute (``suppressed`` counts the rest): anyone can send them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replyd import metrics
from replyd import store as st
from replyd.core import Status
from replyd.errors import ContentionError, ReplydError, StoreError
from replyd.log import get_logger
from replyd.platforms import unreadable
from replyd.platforms.base import Parent, Receipt, WebhookAnswer, WebhookChallenge, WebhookReceipts, WebhookSource
from replyd.policy import FINAL_SKIPS
from replyd.quiet import Quiet

if TYPE_CHECKING:
    from replyd.guard import Guard, Outcome

log = get_logger("replyd.hooks")


# Checks a delivery's signature from its headers and body at epoch ``now`` (for kinds with a replay window).
Check = Callable[[str, bytes, Mapping[str, str], float], bool]


@dataclass(frozen=True)
class Kind:
    """Where one platform's deliveries carry their signature, event name and delivery id."""

    signature: str
    event: str
    delivery: str
    check: Check | None = None  # None: ``verify`` of the signature header over the body
    # True where a refused delivery is sent again and holds the ones after it (Telegram's queue, Meta's
    # retries for days, Slack's retries): an unreadable one is answered 200, as it will never read.
    ack_unreadable: bool = False


SLACK_WINDOW_S = 300.0  # Slack's documented replay window for X-Slack-Request-Timestamp
# A timestamp is ASCII digits only: str.isdigit() is also true for "\xb2" or "\u0663", which int() refuses or reads.
_STAMP = re.compile(r"[0-9]{1,12}")
_UNPRINTABLE = re.compile(r"[^\x21-\x7e]")

# What ``webhook_scope`` may answer (the ``reason`` label); any other word is counted as ``out_of_scope``.
DROP_REASONS = frozenset({
    "repo_not_listed",     # GitHub: the repository is not in ``repos`` (and notifications would not find it)
    "issue_closed",        # GitHub: a listed repository's closed issue (the repos listing reads open ones)
    "not_addressed",       # no mention / assignment / reply to the bot that its notifications would show
    "other_workspace",     # Slack: an event of another workspace the app is installed in
    "channel_not_listed",  # Slack: a channel outside ``channels``
    "other_phone_number",  # WhatsApp: a message to another number of the business account
    "out_of_scope",
})


def printable(value: str | None, limit: int = 100) -> str:
    """``value`` cut to ``limit`` with every character outside printable ASCII replaced (safe to log)."""
    return _UNPRINTABLE.sub("?", (value or "")[:limit])


def slack_sign(secret: str, timestamp: str, body: bytes) -> str:
    """Return Slack's ``v0=<hex>`` signature: HMAC-SHA256 of ``v0:{timestamp}:{body}`` under the signing secret."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def slack_verify(secret: str, body: bytes, headers: Mapping[str, str], now: float) -> bool:
    """True when a Slack delivery is signed with ``secret`` and its timestamp is within 5 minutes of ``now``."""
    stamp = (headers.get("x-slack-request-timestamp") or "").strip()
    header = (headers.get("x-slack-signature") or "").strip()
    if not _STAMP.fullmatch(stamp) or not header.isascii() or abs(now - int(stamp)) > SLACK_WINDOW_S:
        return False  # a replay of an old signed delivery is refused even though its signature is genuine
    return hmac.compare_digest(slack_sign(secret, stamp, body).encode(), header.encode())


def telegram_verify(secret: str, body: bytes, headers: Mapping[str, str], now: float) -> bool:
    """True when a Telegram delivery carries ``secret`` (the ``secret_token`` of ``setWebhook``) in
    ``X-Telegram-Bot-Api-Secret-Token``, compared in constant time (Telegram sends the token itself, no HMAC)."""
    header = (headers.get("x-telegram-bot-api-secret-token") or "").strip()
    if not header or not header.isascii():
        return False
    return hmac.compare_digest(secret.encode(), header.encode())


def discord_verify(public_key: str, body: bytes, headers: Mapping[str, str], now: float) -> bool:
    """True when a Discord interaction is signed (Ed25519 over ``timestamp + body``) by the application's public
    key and its timestamp is within 5 minutes of ``now`` (replyd's replay window: Discord documents none)."""
    from nacl.exceptions import BadSignatureError, ValueError as NaclValueError
    from nacl.signing import VerifyKey

    stamp = (headers.get("x-signature-timestamp") or "").strip()
    sig = (headers.get("x-signature-ed25519") or "").strip()
    if not _STAMP.fullmatch(stamp) or abs(now - int(stamp)) > SLACK_WINDOW_S or not re.fullmatch(r"[0-9a-f]{128}", sig):
        return False
    try:
        VerifyKey(bytes.fromhex(public_key)).verify(stamp.encode() + body, bytes.fromhex(sig))
    except (BadSignatureError, NaclValueError, ValueError, TypeError):
        return False
    return True


KINDS: dict[str, Kind] = {
    "github": Kind("x-hub-signature-256", "x-github-event", "x-github-delivery"),
    "discourse": Kind("x-discourse-event-signature", "x-discourse-event", "x-discourse-event-id"),
    "slack": Kind("x-slack-signature", "", "x-slack-retry-num", check=slack_verify, ack_unreadable=True),
    "telegram": Kind("x-telegram-bot-api-secret-token", "", "", check=telegram_verify, ack_unreadable=True),
    "discord": Kind("x-signature-ed25519", "", "", check=discord_verify),
    "whatsapp": Kind("x-hub-signature-256", "", "", ack_unreadable=True),
}
# Status reports that prove a sent message exists (WhatsApp: "sent" is accepted by its servers).
LANDED = frozenset({"sent", "delivered", "read"})


def _no_sink(_bad: unreadable.Item) -> None:
    """A hook without a store sink: the report is logged and counted only."""


def sign(secret: str, body: bytes) -> str:
    """Return the ``sha256=<hex>`` signature of ``body`` under ``secret`` (what the platforms send)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str | None) -> bool:
    """True when ``header`` is ``body``'s signature under ``secret`` (compared in constant time)."""
    if not header or not header.isascii():
        return False  # compare_digest refuses non-ASCII str; a header of other bytes signs nothing
    return hmac.compare_digest(sign(secret, body).encode(), header.strip().encode())


@dataclass(frozen=True)
class Answer:
    """What the receiver tells the platform: an HTTP status and a small JSON body."""

    status: int
    body: dict[str, Any]


# The one answer before authentication, for an unknown bot as for a bad signature (names no header, no kind).
BAD_SIGNATURE = Answer(401, {"error": "bad_signature",
                             "detail": "the delivery is not signed with this hook's secret (or its timestamp is stale)"})
# The store could not keep the delivery's parents: not acked, so a platform that retries delivers it again.
STORE_DOWN = Answer(503, {"error": "store_unavailable", "detail": "the delivery could not be recorded; retry it"})
# The one answer to a verification handshake that is not this hook's (unknown bot, wrong token, not a handshake).
BAD_CHALLENGE = Answer(403, {"error": "bad_verify_token", "detail": "not a subscription with this hook's verify token"})
_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_DECOY_SECRET = secrets.token_hex(32)  # an unknown bot's body is signed-checked too: the same work, the same time


@dataclass
class Hook:
    """One bot's webhook: its kind, its secret, its adapter and the pipeline the parents go to."""

    bot: str
    kind: str
    secret: str
    source: WebhookSource
    offer: Callable[[Parent, str], Outcome]  # the bot's Pipeline.offer
    instance: str = ""
    guard: Guard | None = None  # the bot's guard: its store keeps each parent before the ack (None: not kept)
    verify_token: str = ""  # a handshake's hub.verify_token (WhatsApp); "" refuses every handshake
    # The bot's Pipeline.offer_page: a delivery's parents offered as one page (None: ``offer`` on each in turn).
    offer_page: Callable[[list[Parent], str], list[Outcome | Exception]] | None = None
    # Where an item of a delivery the adapter cannot read is kept (default: the guard's store; None: logged).
    unreadable: unreadable.Sink | None = None

    def __post_init__(self) -> None:
        if self.unreadable is None and self.guard is not None:  # kept in the bot's store, as its pollers keep them
            self.unreadable = unreadable.recorder(self.guard.store, self.guard.platform.instance,
                                                  self.guard.identity.sender_id)

    def offers(self, parents: list[Parent], path: str) -> list[Outcome | Exception]:
        """Each parent's outcome, or the exception its offer raised: through ``offer_page`` when the hook has it."""
        if self.offer_page is not None:
            return self.offer_page(parents, path)
        got: list[Outcome | Exception] = []
        for parent in parents:
            try:
                got.append(self.offer(parent, path))
            except Exception as exc:  # one parent's; the others are offered all the same
                got.append(exc)
        return got

    def __repr__(self) -> str:
        return f"Hook(bot={self.bot!r}, kind={self.kind!r}, instance={self.instance!r})"  # never the secrets


class Receiver:
    """Checks, parses and hands deliveries to the bots' pipelines in the background (two worker threads)."""

    def __init__(self, hooks: Mapping[str, Hook], *, max_body_bytes: int = 1_048_576, workers: int = 2,
                 now: Callable[[], float] = time.time, waiting: Mapping[str, tuple[str, str]] | None = None) -> None:
        self.hooks = dict(hooks)
        # Push bots configured but not started yet: name -> (kind, secret), to check a delivery before a 503.
        self.waiting = dict(waiting or {})
        self.now = now  # the wall clock: Slack's timestamps are the sender's wall time
        self._quiet = Quiet(log, now)  # refusals anyone can cause: one warning a minute per event
        self.max_body_bytes = max_body_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replyd-hook")

    def challenge(self, bot: str, params: Mapping[str, str]) -> Answer:
        """Answer a verification handshake (``hub.mode=subscribe``): 200 with the challenge, else the one 403."""
        hook = self.hooks.get(bot)
        token = params.get("hub.verify_token") or ""
        expected = hook.verify_token if hook is not None and hook.verify_token else _DECOY_SECRET
        same = token.isascii() and hmac.compare_digest(expected.encode(), token.encode())
        challenge = params.get("hub.challenge") or ""
        if hook is None or not hook.verify_token or not same or params.get("hub.mode") != "subscribe" \
                or not _CHALLENGE.fullmatch(challenge):
            self._quiet.warning("replyd.hooks.bad_challenge", bot=printable(bot, 64))
            return BAD_CHALLENGE
        log.info("replyd.hooks.verified", bot=bot, platform=hook.instance)
        return Answer(200, {"challenge": challenge})

    def _signed(self, kind: str, secret: str, headers: Mapping[str, str], body: bytes) -> bool:
        check = KINDS[kind]
        return (check.check(secret, body, headers, self.now()) if check.check is not None
                else verify(secret, body, headers.get(check.signature)))

    def signed_while_starting(self, bot: str, headers: Mapping[str, str], body: bytes) -> bool:
        """Whether a delivery for ``bot``, configured but not started, is signed with its secret; a refusal is
        logged (rate-limited) as for a started bot."""
        kind, secret = self.waiting.get(bot, ("github", _DECOY_SECRET))
        if self._signed(kind, secret, headers, body):
            return True
        self._quiet.warning("replyd.hooks.bad_signature", bot=printable(bot, 64), starting=True)
        return False

    def receive(self, bot: str, headers: Mapping[str, str], body: bytes) -> Answer:
        """Handle one delivery for ``bot``; never raises, never waits for a post."""
        hook = self.hooks.get(bot)
        if hook is None:
            verify(_DECOY_SECRET, body, sign(_DECOY_SECRET, b""))  # as long as a real bot's check
            self._quiet.warning("replyd.hooks.unknown_bot", bot=printable(bot, 64))
            return BAD_SIGNATURE
        kind = KINDS[hook.kind]
        delivery = printable(headers.get(kind.delivery)) if kind.delivery else ""
        if not self._signed(hook.kind, hook.secret, headers, body):
            # Nothing is parsed, logged of the body, or offered for an unsigned or forged delivery.
            self._quiet.warning("replyd.hooks.bad_signature", bot=bot, platform=hook.instance, delivery=delivery,
                        signed=bool(headers.get(kind.signature)))
            metrics.webhook(hook.instance, "bad_signature")
            return BAD_SIGNATURE
        event = printable((headers.get(kind.event) or "").strip(), 64) if kind.event else ""
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
        receipts = hook.source.webhook_receipts(payload) if isinstance(hook.source, WebhookReceipts) else []
        if receipts and not self._receipts(hook, receipts):
            metrics.webhook(hook.instance, "store_failed")
            return STORE_DOWN
        try:
            # An unreadable item among good ones is reported by the adapter and left out; the rest go on.
            with unreadable.reporting("webhook", hook.unreadable or _no_sink):
                found = hook.source.parse_webhook(event, payload)
        except (ReplydError, *unreadable.ERRORS) as exc:
            words = unreadable.problem_words(exc)
            log.warning("replyd.hooks.unreadable", bot=bot, platform=hook.instance, delivery=delivery, hook_event=event,
                        error=words)
            metrics.webhook(hook.instance, "unreadable")
            if isinstance(exc, unreadable.ERRORS):
                metrics.unreadable(hook.instance, "webhook")
            if kind.ack_unreadable and isinstance(exc, unreadable.ERRORS):  # refused, it would come back and hold
                return Answer(200, {"accepted": 0, "unreadable": words})
            return Answer(422, {"error": "unreadable_delivery", "detail": words})
        if isinstance(found, str) or not found:
            reason = found if isinstance(found, str) else "no parent in it"
            log.info("replyd.hooks.ignored", bot=bot, platform=hook.instance, delivery=delivery, hook_event=event,
                     reason=reason)
            metrics.webhook(hook.instance, "statuses" if receipts else "ignored")
            return Answer(202, {"accepted": 0, "ignored": reason, **({"statuses": len(receipts)} if receipts else {})})
        inside, reasons = self._scoped(hook, event, payload, found, delivery)
        if not inside:
            metrics.webhook(hook.instance, "dropped")
            return Answer(202, {"accepted": 0, "dropped": reasons})
        if not self._keep(hook, inside, delivery):
            metrics.webhook(hook.instance, "store_failed")
            return STORE_DOWN
        self._pool.submit(self._offer, hook, inside, delivery)
        log.info("replyd.hooks.accepted", bot=bot, platform=hook.instance, delivery=delivery, hook_event=event,
                 parents=[p.id for p in inside])
        metrics.webhook(hook.instance, "accepted")
        if isinstance(hook.source, WebhookAnswer) and (answer := hook.source.webhook_answer(payload)) is not None:
            return Answer(200, answer)  # Discord's deferred interaction response: the post runs after it
        return Answer(202, {"accepted": len(inside), "parents": [p.id for p in inside],
                            **({"dropped": reasons} if reasons else {})})

    @staticmethod
    def _scoped(hook: Hook, event: str, payload: Any, found: list[Parent],
                delivery: str) -> tuple[list[Parent], list[str]]:
        """The parents inside the bot's scope, and the reasons of those dropped (each logged and counted)."""
        inside: list[Parent] = []
        reasons: list[str] = []
        for parent in found:
            try:
                reason = hook.source.webhook_scope(event, payload, parent)
            except Exception as exc:  # unreadable or a bug: not provably inside, so not offered (fail closed)
                log.error("replyd.hooks.scope_failed", bot=hook.bot, platform=hook.instance, delivery=delivery,
                          error=f"{type(exc).__name__}: {exc}"[:300])
                reason = "out_of_scope"
            if reason is None:
                inside.append(parent)
                continue
            reason = reason if reason in DROP_REASONS else "out_of_scope"
            log.info("replyd.hook.dropped", bot=hook.bot, platform=hook.instance, reason=reason, delivery=delivery,
                     hook_event=event, parent_id=printable(parent.id), url=printable(parent.url, 200))
            metrics.webhook_dropped(hook.instance, reason)
            reasons.append(reason)
        return inside, reasons

    @staticmethod
    def _keep(hook: Hook, parents: list[Parent], delivery: str) -> bool:
        """Record ``parents`` as ``released`` rows (where their key has none) in one durable commit; False when
        the store cannot take it (the delivery must not be acked)."""
        guard = hook.guard
        if guard is None:
            return True
        try:
            made = guard.keep_received(parents, path="webhook", detail={"delivery": delivery},
                                       doing="recording a webhook delivery")
        except (StoreError, ContentionError) as exc:
            log.error("replyd.hooks.store_failed", bot=hook.bot, platform=hook.instance, delivery=delivery,
                      error=str(exc)[:300])
            return False
        log.debug("replyd.hooks.kept", bot=hook.bot, platform=hook.instance, delivery=delivery, new=made)
        return True

    @staticmethod
    def _receipts(hook: Hook, receipts: list[Receipt]) -> bool:
        """Close each row a landed report proves (``library.confirm``), note each failed one; False when the store
        cannot take it (the delivery must not be acked: Meta delivers it again)."""
        from replyd import library

        guard = hook.guard
        if guard is None:
            return True
        for r in receipts:
            if r.parent_id is None or r.provider_key is None:
                continue  # not one of replyd's sends (another app's, or sent before replyd)
            if not hmac.compare_digest(guard.provider_key(r.parent_id).encode(), r.provider_key.encode()):
                log.warning("replyd.hooks.foreign_status", bot=hook.bot, platform=hook.instance,
                            parent_id=printable(r.parent_id), status=r.status)
                continue  # another bot's (or a forged) key: never confirms this bot's row
            key = guard.key(r.parent_id)
            try:
                if r.status in LANDED:
                    res = library.confirm(guard.store, key, by="whatsapp_status", reply_id=r.message_id,
                                          reason=f"status {r.status}", owner=guard.owner,
                                          states=(st.UNCONFIRMED, st.OPEN))
                    if res.confirmed:
                        log.info("replyd.hooks.confirmed", bot=hook.bot, platform=hook.instance,
                                 parent_id=r.parent_id, reply_id=r.message_id, status=r.status, previous=res.previous)
                        metrics.webhook(hook.instance, "confirmed")
                elif r.status == "failed":
                    log.error("replyd.hooks.delivery_failed", bot=hook.bot, platform=hook.instance,
                              parent_id=r.parent_id, reply_id=r.message_id, errors=r.errors)
                    metrics.webhook(hook.instance, "delivery_failed")
                    with guard.store.transaction(doing="recording a failed delivery") as tx:
                        row = tx.get(key)
                        if row is not None:
                            tx.append_event(key, "delivery_failed", state=row.state, attempt=row.attempt,
                                            owner=guard.owner, detail={"reply_id": r.message_id, "errors": r.errors})
            except (StoreError, ContentionError) as exc:
                log.error("replyd.hooks.store_failed", bot=hook.bot, platform=hook.instance, error=str(exc)[:300])
                return False
        return True

    @staticmethod
    def _offer(hook: Hook, parents: list[Parent], delivery: str) -> None:
        """Offer a delivery's parents as one page; each parent's outcome (or failure) logged on its own."""

        def failed(parent: Parent, exc: BaseException) -> None:
            log.error("replyd.hooks.offer_failed", bot=hook.bot, platform=hook.instance, delivery=delivery,
                      parent_id=parent.id, error=f"{type(exc).__name__}: {exc}"[:300])

        try:
            got = hook.offers(parents, "webhook")
        except Exception as exc:  # the poll backstop finds them again (their rows are kept); a worker must not die
            got = [exc]
        for parent, out in zip(parents, got, strict=False):  # shorter when the page failed (logged below)
            if isinstance(out, Exception):
                failed(parent, out)
                continue
            log.info("replyd.hooks.offered", bot=hook.bot, platform=hook.instance, delivery=delivery,
                     parent_id=parent.id, status=out.status.value)
            if hook.guard is not None and out.status is Status.SKIPPED and out.detail in FINAL_SKIPS:
                try:
                    hook.guard.retire(parent.id, out.detail)  # its kept row must not wait for re-find to rule it out
                except Exception as exc:
                    failed(parent, exc)
        if len(got) < len(parents):  # the page ended at a failure: these wait in their kept rows for re-find
            log.warning("replyd.hooks.not_offered", bot=hook.bot, platform=hook.instance, delivery=delivery,
                        parent_ids=[p.id for p in parents[len(got):]])

    def close(self, wait: bool = True) -> None:
        """Stop taking deliveries; with ``wait``, let the offers under way finish."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
