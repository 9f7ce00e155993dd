"""A stateful fake of the WhatsApp Cloud API and its webhooks, built from Meta's documentation
(sources and licence: tests/fixtures/whatsapp/SOURCES.md).

- ``WhatsAppWorld``: one business phone number, customers (``wa_id``), inbound messages (``wamid.…``), the 24-hour
  customer service window per customer (on ``now``), the messages the business sent, and the counts tests trust,
  on the platform side: ``reply_counts()`` counts sent messages per ``context.message_id``; ``lost_parents``
  lists the parents of messages created whose answer never reached the client. ``send_faults`` (popped per
  send): ``"lost"`` created then the connection drops, ``"error_after"`` created then HTTP 500, ``"error_before"``
  HTTP 500 and nothing created, ``"ratelimited"`` 130429, ``"pair"`` 131056, ``"hold"`` created and the answer held until
  ``release_held`` (then the connection drops). ``lose_fraction`` loses that share
  of the answers at random (seeded). Outside a customer's window a send is refused with 131047.
- Status callbacks: every created message queues ``sent``, ``delivered``, ``read`` deliveries carrying its
  ``biz_opaque_callback_data``; ``drop_statuses`` drops that share of a message's reports (all of them).
- ``WebhookSender``: POSTs each queued delivery signed ``X-Hub-Signature-256`` with the app secret, to a random
  one of ``urls``; a non-2xx answer or a timeout (a slow ack) is retried later; ``lose_acks`` of the 2xx are
  treated as lost (delivered again); ``repeat`` of the deliveries are sent twice; the next delivery is picked
  among the first ``reorder`` pending (out of order).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import hmac
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.fakes_forum import AppServer
from tests.fixtures_server import DropResponse

FIXTURES = Path(__file__).parent / "fixtures" / "whatsapp"
PHONE_ID, DISPLAY = "106540352242922", "+1 555-078-3881"
TOKEN = "EAAfaketokenfortestsonly0123456789abcdef"
APP_SECRET = "wa-app-secret-0123456789abcdef"
VERIFY_TOKEN = "wa-verify-token-0123456789abcdef"
WINDOW_S = 86_400.0  # the customer service window: 24 hours from the customer's last message


def fixture(name: str) -> Any:
    """One of the Cloud-API-shaped JSON bodies in tests/fixtures/whatsapp."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def sign(secret: str, body: bytes) -> str:
    """Meta's ``X-Hub-Signature-256`` value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _err(name: str, status: int) -> JSONResponse:
    return JSONResponse(fixture(name), status_code=status)


class WhatsAppWorld:
    """The Cloud API's state in memory, the webhook queue, and the platform-side counts."""

    def __init__(self, *, now: Callable[[], float] = time.time, seed: int = 1) -> None:
        self.now = now
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.n = 0
        self.inbound: dict[str, dict[str, Any]] = {}  # wamid -> message
        self.last_seen: dict[str, float] = {}  # wa_id -> time of the customer's last message
        self.sent: list[dict[str, Any]] = []  # {id, to, context, text, biz}
        self.send_faults: list[str] = []
        self.lose_fraction = 0.0
        self.drop_statuses = 0.0
        self.send_requests = 0
        self.lost_parents: list[str] = []
        self.lost_ids: list[str] = []
        self.confirmable: set[str] = set()  # lost parents whose status reports were queued
        self.queue: list[dict[str, Any]] = []  # webhook deliveries waiting
        self.held = threading.Event()  # a "hold" send was created and its answer is held
        self.release_held = threading.Event()
        self.held_tag = ""  # the api_url tag of the client whose send is held
        self.send_times: list[tuple[float, str]] = []  # (monotonic arrival, parent) of every created message
        self.window_s = WINDOW_S  # a test moving its clock by days may widen it (the window has its own tests)

    def _wamid(self) -> str:
        self.n += 1
        raw = f"{PHONE_ID}:{self.n}:{self.rng.random()}".encode()
        return "wamid." + base64.b64encode(hashlib.sha256(raw).digest()[:24]).decode()

    def _envelope(self, value: dict[str, Any]) -> dict[str, Any]:
        return {"object": "whatsapp_business_account", "entry": [{"id": "102290129340398", "changes": [
            {"field": "messages", "value": {"messaging_product": "whatsapp",
                                            "metadata": {"display_phone_number": "15550783881",
                                                         "phone_number_id": PHONE_ID}, **value}}]}]}

    def customer_says(self, wa_id: str, text: str, *, name: str = "Sheena") -> str:
        """A customer messages the business: the webhook delivery is queued; returns the wamid."""
        with self.lock:
            wamid = self._wamid()
            msg = {"from": wa_id, "id": wamid, "timestamp": str(int(self.now())), "type": "text",
                   "text": {"body": text}}
            self.inbound[wamid] = msg
            self.last_seen[wa_id] = self.now()
            self.queue.append(self._envelope({"contacts": [{"profile": {"name": name}, "wa_id": wa_id}],
                                              "messages": [copy.deepcopy(msg)]}))
        return wamid

    def reply_counts(self) -> Counter[str]:
        """Sent messages per parent (``context.message_id``): the platform's count of answers."""
        with self.lock:
            return Counter(m["context"] for m in self.sent if m["context"])

    def send(self, body: dict[str, Any]) -> tuple[str, dict[str, Any] | Response]:
        """Create the business's message (or refuse): (fault, the answer body or an error response)."""
        with self.lock:
            self.send_requests += 1
            fault = self.send_faults.pop(0) if self.send_faults else ""
            if not fault and self.lose_fraction and self.rng.random() < self.lose_fraction:
                fault = "lost"
        if fault == "ratelimited":
            return fault, _err("error_130429", 400)
        if fault == "pair":
            return fault, _err("error_131056", 400)
        if fault == "error_before":
            return fault, _err("error_131000", 500)
        to, ctx = body.get("to"), (body.get("context") or {}).get("message_id")
        text = (body.get("text") or {}).get("body")
        if body.get("messaging_product") != "whatsapp" or not isinstance(to, str) or body.get("type") != "text" \
                or not isinstance(text, str) or not text:
            return "", JSONResponse({"error": {"message": "(#100) Invalid parameter", "type": "OAuthException",
                                               "code": 100}}, status_code=400)
        with self.lock:
            seen = self.last_seen.get(to)
            if seen is None or self.now() - seen > self.window_s:
                return "", _err("error_131047", 400)
            wamid = self._wamid()
            biz = body.get("biz_opaque_callback_data")
            self.sent.append({"id": wamid, "to": to, "context": ctx, "text": text, "biz": biz})
            self.send_times.append((time.monotonic(), ctx))
            if fault in ("lost", "error_after", "hold"):
                self.lost_parents.append(ctx)
                self.lost_ids.append(wamid)
            if not (self.drop_statuses and self.rng.random() < self.drop_statuses):
                if fault in ("lost", "error_after", "hold"):
                    self.confirmable.add(ctx)
                for status in ("sent", "delivered", "read"):
                    report = {"id": wamid, "status": status, "timestamp": str(int(self.now())), "recipient_id": to}
                    if isinstance(biz, str):
                        report["biz_opaque_callback_data"] = biz
                    self.queue.append(self._envelope({"statuses": [report]}))
        return fault, {"messaging_product": "whatsapp", "contacts": [{"input": to, "wa_id": to}],
                       "messages": [{"id": wamid, "message_status": "accepted"}]}


class WhatsAppApi:
    """The Graph API over HTTP: ``/{version}/{phone-number-id}`` and ``…/messages`` with a Bearer token."""

    def __init__(self, world: WhatsAppWorld, *, token: str = TOKEN) -> None:
        self.world, self.token = world, token
        # A path prefix before the version (``api_url = <fake>/<tag>``) names the client in a test.
        routes = []
        for pre in ("", "/{tag}"):
            routes += [Route(pre + "/{version}/{pnid}", self._number, methods=["GET"]),
                       Route(pre + "/{version}/{pnid}/messages", self._messages, methods=["POST"])]
        self.server = AppServer(Starlette(routes=routes))

    @property
    def url(self) -> str:
        """The Graph API root (``api_url``)."""
        return self.server.url

    def start(self) -> WhatsAppApi:
        """Serve on an ephemeral port."""
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop()

    def _authorized(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.token}"

    async def _number(self, request: Request) -> Response:
        if not self._authorized(request):
            return _err("error_190", 401)
        if request.path_params["pnid"] != PHONE_ID:
            return JSONResponse({"error": {"message": "Unsupported get request", "type": "GraphMethodException",
                                           "code": 100}}, status_code=400)
        return JSONResponse(fixture("phone_number"))

    async def _messages(self, request: Request) -> Response:
        if not self._authorized(request):
            return _err("error_190", 401)
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "(#100) Invalid parameter", "code": 100}}, status_code=400)
        fault, out = self.world.send(body)
        if isinstance(out, Response):
            return out
        if fault == "lost":
            return DropResponse(status_code=200)
        if fault == "error_after":
            return _err("error_131000", 500)
        if fault == "hold":
            self.world.held_tag = request.path_params.get("tag", "")
            self.world.held.set()
            while not self.world.release_held.is_set():
                await asyncio.sleep(0.05)
            return DropResponse(status_code=200)
        return JSONResponse(out)


class WebhookSender:
    """Meta's webhook side: every queued delivery POSTed, signed, until some URL answers 2xx (at least once)."""

    def __init__(self, world: WhatsAppWorld, urls: list[str], *, secret: str = APP_SECRET, timeout_s: float = 3.0,
                 retry_s: float = 0.2, lose_acks: float = 0.0, repeat: float = 0.0, reorder: int = 1,
                 seed: int = 2) -> None:
        self.world, self.urls, self.secret = world, urls, secret
        self.timeout_s, self.retry_s, self.lose_acks, self.repeat, self.reorder = timeout_s, retry_s, lose_acks, repeat, reorder
        self.rng = random.Random(seed)
        self.posts = 0
        self.statuses: Counter[int] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="whatsapp-webhooks", daemon=True)

    def start(self) -> WebhookSender:
        """Deliver in the background."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop delivering."""
        self._stop.set()
        self._thread.join(timeout=10)

    def deliver(self, client: httpx.Client, payload: dict[str, Any], url: str | None = None) -> int:
        """POST one delivery, signed; its HTTP status (0: no answer)."""
        raw = json.dumps(payload).encode()
        self.posts += 1
        try:
            status = client.post(url or self.rng.choice(self.urls), content=raw,
                                 headers={"content-type": "application/json",
                                          "X-Hub-Signature-256": sign(self.secret, raw)}).status_code
        except httpx.HTTPError:
            status = 0
        self.statuses[status] += 1
        return status

    def idle(self) -> bool:
        """Whether nothing waits to be delivered."""
        with self.world.lock:
            return not self.world.queue

    def _run(self) -> None:
        w = self.world
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                with w.lock:
                    i = self.rng.randrange(min(self.reorder, len(w.queue))) if w.queue else -1
                    payload = w.queue.pop(i) if i >= 0 else None
                if payload is None:
                    self._stop.wait(0.05)
                    continue
                status = self.deliver(client, payload)
                again = not 200 <= status < 300 or (self.lose_acks and self.rng.random() < self.lose_acks) \
                    or (self.repeat and self.rng.random() < self.repeat)
                if again:
                    with w.lock:
                        w.queue.append(payload)
                    if not 200 <= status < 300:
                        self._stop.wait(self.retry_s)
