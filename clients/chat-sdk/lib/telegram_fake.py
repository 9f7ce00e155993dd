"""replyd's Telegram Bot API fake (replyd/sim/telegram.py) for the Chat SDK tests, with a control endpoint.

Prints ``FAKE_URL=<Bot API root>`` and ``CONTROL_URL=<control root>``, then serves until stdin closes or SIGTERM.
The control endpoint (JSON in, JSON out):

- ``POST /post {"chat_id"}``: a person mentions the bot in that supergroup; answers ``{"parent_id"}``.
- ``POST /faults {"send": ["lost", ...]}``: appended to the world's ``send_faults``.
- ``POST /webhook {"urls": [a, b], "secret_token", "retry_s"}``: sets the webhook and starts a ``WebhookSender``.
  Each update goes to ``a`` first, whose 2xx is then lost; Telegram redelivers it to ``b`` (a second replica).
- ``POST /webhook/stop``: stops the sender and deletes the webhook.
- ``GET /counts?chats=1,2``: the bot's messages per chat, the unanswered sends and each update's deliveries.
"""

from __future__ import annotations

import signal
import sys
import threading

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from replyd.sim.fakes import AppServer
from replyd.sim.telegram import TelegramApi, TelegramWorld, WebhookSender


class FirstToA:
    """The sender's random source, scripted: each update's first delivery goes to ``urls[0]`` and its 2xx is lost;
    every later one goes to ``urls[1]`` and counts. So every update reaches both replicas, in that order."""

    def __init__(self) -> None:
        self.sender: WebhookSender | None = None
        self.first = True

    def choice(self, urls: list[str]) -> str:
        w = self.sender.world  # type: ignore[union-attr]
        with w.lock:
            uid = w.updates[0][0] if w.updates else None
        self.first = uid is None or self.sender.deliveries[uid] == 0  # type: ignore[union-attr]
        return urls[0] if self.first else urls[1]

    def random(self) -> float:
        return 0.0 if self.first else 1.0  # below lose_acks: the ack is lost


def main() -> None:
    world = TelegramWorld()
    api = TelegramApi(world).start()
    senders: list[WebhookSender] = []  # every sender started (their delivery counts stay readable)
    running: list[WebhookSender] = []

    async def post(request: Request) -> JSONResponse:
        body = await request.json()
        world.chat(int(body["chat_id"]), title=f"chat {body['chat_id']}")
        return JSONResponse({"parent_id": world.post(int(body["chat_id"]), body.get("text", "are you there?"))})

    async def faults(request: Request) -> JSONResponse:
        body = await request.json()
        with world.lock:
            world.send_faults.extend(body.get("send", []))
        return JSONResponse({"send_faults": world.send_faults})

    async def webhook(request: Request) -> JSONResponse:
        body = await request.json()
        with world.lock:
            world.webhook = {"url": body["urls"][0], "secret_token": body.get("secret_token")}
        script = FirstToA()
        sender = WebhookSender(world, list(body["urls"]), retry_s=float(body.get("retry_s", 0.5)), lose_acks=0.5)
        script.sender, sender.rng = sender, script  # type: ignore[assignment]
        senders.append(sender.start())
        running.append(sender)
        return JSONResponse({"ok": True})

    async def webhook_stop(request: Request) -> JSONResponse:
        while running:
            running.pop().stop()
        with world.lock:
            world.webhook = None
        return JSONResponse({"ok": True})

    async def counts(request: Request) -> JSONResponse:
        chats = [int(c) for c in request.query_params.get("chats", "").split(",") if c]
        deliveries: dict[str, int] = {}
        for s in senders:
            deliveries.update({str(k): v for k, v in s.deliveries.items()})
        return JSONResponse({"bot_messages": {str(c): world.bot_messages(c) for c in chats},
                             "unanswered": list(world.unanswered), "send_requests": world.send_requests,
                             "pending_updates": world.pending_updates(), "deliveries": deliveries})

    control = AppServer(Starlette(routes=[
        Route("/post", post, methods=["POST"]), Route("/faults", faults, methods=["POST"]),
        Route("/webhook", webhook, methods=["POST"]), Route("/webhook/stop", webhook_stop, methods=["POST"]),
        Route("/counts", counts)]), name="telegram-control").start()
    print(f"FAKE_URL={api.url}", flush=True)
    print(f"CONTROL_URL={control.url}", flush=True)

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    def stdin_closed() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=stdin_closed, daemon=True).start()
    done.wait()
    for s in running:
        s.stop()
    control.stop()
    api.stop()


if __name__ == "__main__":
    main()
