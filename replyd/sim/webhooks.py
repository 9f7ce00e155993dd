"""The sim's webhook sender: each new mention of an account leaves as a signed delivery, misbehaving on request.

GitHub and Discourse deliver at least once: a delivery is redelivered (GitHub's redelivery keeps the
``X-GitHub-Delivery`` GUID; Discourse's retry of a failed delivery runs its job again, which makes a new
``web_hook_event`` and so a new ``X-Discourse-Event-Id``), arrives late, out of order, or never. The sender reproduces each on purpose,
from a seeded random source, so the demo, the tests and chaos can drive replyd's receiver with push.

The body is the mention notification exactly as the notification stream sends it (Mastodon has no
per-account webhooks); headers and signature are GitHub's or Discourse's: an HMAC-SHA256 of the exact
body under the shared secret, computed here as the platform does (not with replyd's code).

Time: a copy's due time comes from the world's clock (``delay_s`` plus a random ``0..reorder_s``);
``pump()`` sends every copy that is due, in due order; ``start()`` pumps on a thread every 20 ms.
Every copy's fate is kept in ``log`` (HTTP status, 0 when the connection failed; GitHub does not retry).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import random
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx

from replyd.log import get_logger
from replyd.sim.render import notification_json
from replyd.sim.world import Notification, World

log = get_logger("replyd.sim.webhooks")

KINDS = ("github", "discourse")


@dataclass
class SenderFaults:
    """How the sender misbehaves; everything off by default (one delivery per mention, at once, in order)."""

    duplicates: int = 0  # extra copies of a duplicated delivery (GitHub: the same GUID; Discourse: a new event id)
    duplicate_rate: float = 1.0  # the fraction of deliveries that get the extra copies
    drop_rate: float = 0.0  # the fraction of deliveries never sent at all (no copy)
    delay_s: float = 0.0  # every copy leaves this long after the mention...
    reorder_s: float = 0.0  # ...plus a random 0..reorder_s, drawn per copy: mentions closer than this can cross

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"webhook fault {name}: {value!r} is not a number >= 0")
            if name.endswith("_rate") and value > 1:
                raise ValueError(f"webhook fault {name}: {value!r} is not a fraction 0..1")
        if not isinstance(self.duplicates, int):
            raise ValueError(f"webhook fault duplicates: {self.duplicates!r} is not a whole number")


@dataclass(order=True)
class _Copy:
    due: float
    seq: int
    delivery_id: str = field(compare=False)
    status_id: str = field(compare=False)
    copy: int = field(compare=False)  # 0: the first send; 1..: redeliveries
    body: bytes = field(compare=False, repr=False)
    url: str = field(compare=False)


@dataclass(frozen=True)
class Sent:
    """One copy that left the sender: which delivery, which mention, and what the receiver answered."""

    delivery_id: str
    status_id: str
    copy: int
    http_status: int  # 0: no answer (connection refused, reset or timed out)
    url: str = ""  # where it went (one of the sender's URLs)


class WebhookSender:
    """Delivers ``account``'s new mentions to ``url`` as ``kind`` (github or discourse) webhooks, with ``faults``.

    Several URLs are replicas behind a load balancer: each copy goes to one of them at random.
    """

    def __init__(
        self,
        world: World,
        url: str | Sequence[str],
        secret: str,
        *,
        kind: str = "github",
        account: str,
        faults: SenderFaults | None = None,
        seed: int = 0,
        timeout_s: float = 5.0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"webhook kind {kind!r}: expected one of {', '.join(KINDS)}")
        if not secret:
            raise ValueError("webhook secret: empty (the platform signs every delivery with it)")
        self.world = world
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls:
            raise ValueError("webhook url: none given")
        self.kind = kind
        self.account_id = world.account(account).id
        self.faults = faults or SenderFaults()
        self._secret = secret.encode()
        self._rng = random.Random(f"{seed}:webhooks")  # the fates: the same for every kind at one seed
        self._id_rng = random.Random(f"{seed}:webhook-ids")
        self._queue: list[_Copy] = []
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()  # one copy on the wire at a time: the send order is the due order
        self._seq = 0
        self._deliveries = 0
        self.dropped: list[str] = []  # status ids whose delivery was never sent
        self.log: list[Sent] = []
        self._http = httpx.Client(timeout=timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        world.subscribe(self._on_mention)

    # -- queueing (called by the world under its lock: draw the fate, queue the copies, nothing else) --

    def _delivery_id(self) -> str:
        if self.kind == "github":
            return str(uuid.UUID(int=self._id_rng.getrandbits(128), version=4))
        return str(self._deliveries)  # Discourse numbers its web_hook_events

    def _on_mention(self, note: Notification) -> None:
        if note.account_id != self.account_id:
            return
        f = self.faults
        with self._lock:
            self._deliveries += 1
            delivery_id = self._delivery_id()
            if self._rng.random() < f.drop_rate:
                self.dropped.append(note.status_id)
                return
            copies = 1 + (f.duplicates if self._rng.random() < f.duplicate_rate else 0)
            body = json.dumps(notification_json(self.world, note)).encode()
            for n in range(copies):
                if n and self.kind == "discourse":
                    # Discourse retries by running its job again, which creates a new web_hook_event: a new id.
                    self._deliveries += 1
                    delivery_id = self._delivery_id()
                due = note.created_at + f.delay_s + self._rng.uniform(0, f.reorder_s)
                # One URL draws nothing: the fates of a seed stay the same as before replicas existed.
                url = self.urls[0] if len(self.urls) == 1 else self._rng.choice(self.urls)
                self._seq += 1
                heapq.heappush(self._queue, _Copy(due, self._seq, delivery_id, note.status_id, n, body, url))

    # -- sending -----------------------------------------------------------------------------------

    def headers(self, delivery_id: str, body: bytes) -> dict[str, str]:
        """The headers ``kind``'s platform sends with a delivery of ``body`` (signature included)."""
        signature = "sha256=" + hmac.new(self._secret, body, hashlib.sha256).hexdigest()
        if self.kind == "github":
            return {"X-GitHub-Event": "mention", "X-GitHub-Delivery": delivery_id, "X-Hub-Signature-256": signature,
                    "User-Agent": "GitHub-Hookshot/sim", "Content-Type": "application/json"}
        return {"X-Discourse-Event": "mention", "X-Discourse-Event-Type": "notification",
                "X-Discourse-Event-Id": delivery_id, "X-Discourse-Event-Signature": signature,
                "X-Discourse-Instance": self.world.base_url, "Content-Type": "application/json"}

    def pending(self) -> int:
        """Copies queued and not yet sent."""
        with self._lock:
            return len(self._queue)

    def pump(self) -> int:
        """Send every copy due by the world's clock, earliest first; return how many were sent."""
        sent = 0
        with self._pump_lock:
            while True:
                with self._lock:
                    if not self._queue or self._queue[0].due > self.world.clock.now():
                        return sent
                    c = heapq.heappop(self._queue)
                try:
                    status = self._http.post(c.url, content=c.body, headers=self.headers(c.delivery_id, c.body)
                                             ).status_code
                except httpx.HTTPError as exc:
                    status = 0  # the receiver was down or slow: this copy is lost, as GitHub's would be
                    log.warning("replyd.sim.webhooks.unanswered", delivery=c.delivery_id, error=type(exc).__name__)
                with self._lock:
                    self.log.append(Sent(c.delivery_id, c.status_id, c.copy, status, c.url))
                sent += 1

    def start(self, every_s: float = 0.02) -> WebhookSender:
        """Pump on a daemon thread every ``every_s`` seconds until ``close``."""
        def run() -> None:
            while not self._stop.wait(every_s):
                self.pump()

        self._thread = threading.Thread(target=run, name="sim-webhooks", daemon=True)
        self._thread.start()
        return self

    def report(self) -> dict[str, Any]:
        """Mentions delivered, copies sent (by HTTP status), mentions dropped, copies still queued."""
        with self._lock:
            by_status: dict[str, int] = {}
            for s in self.log:
                by_status[str(s.http_status)] = by_status.get(str(s.http_status), 0) + 1
            return {"kind": self.kind, "urls": self.urls, "faults": asdict(self.faults),
                    "mentions_delivered": len({s.status_id for s in self.log}), "copies_sent": len(self.log),
                    "by_status": by_status, "dropped": list(self.dropped), "pending": len(self._queue)}

    def close(self) -> None:
        """Stop listening and pumping; queued copies are not sent."""
        self.world.unsubscribe(self._on_mention)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._http.close()


class Senders:
    """The ``/_sim/webhooks`` admin route's state: at most one sender per sim, started and stopped over HTTP."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sender: WebhookSender | None = None

    def handle(self, d: dict[str, Any]) -> dict[str, Any]:
        """``{"stop": true}`` stops the sender; otherwise start one (replacing any) from ``d``; answer its report."""
        if self.sender is not None and (d.get("stop") or "url" in d or "urls" in d):
            self.sender.close()
        if d.get("stop"):
            report, self.sender = (self.sender.report() if self.sender else {}), None
            return {"stopped": True, **report}
        known = {"url", "urls", "secret", "kind", "account", "seed"} | {f.name for f in fields(SenderFaults)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown webhook setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        faults = SenderFaults(**{k: d[k] for k in d if k in {f.name for f in fields(SenderFaults)}})
        urls = [str(u) for u in d["urls"]] if "urls" in d else str(d["url"])
        self.sender = WebhookSender(self.world, urls, str(d["secret"]), kind=str(d.get("kind", "github")),
                                    account=str(d["account"]), faults=faults, seed=int(d.get("seed", 0))).start()
        return self.sender.report()

    def report(self) -> dict[str, Any]:
        """The running sender's report, or ``{"running": false}``."""
        return self.sender.report() if self.sender else {"running": False}
