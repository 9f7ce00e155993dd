"""A naive Slack bot, as the agent frameworks build one: ack at once, dedupe on a TTL seen-set marked on receipt.

It does what the frameworks' Slack bots are reported to do (vercel/chat, agno, Bolt apps): every Events API
delivery or Socket Mode envelope is acknowledged at once; its key (``event_id``, or the message's
``client_msg_id``) is marked in a shared Redis seen-set with a 10-minute TTL (``SET NX EX``) *on
receipt*; if the mark is new the bot answers ``app_mention`` and DM messages in the thread. Posts go
through a client that retries a connection error once (slack-sdk's default ``ConnectionErrorRetryHandler``).
No backstop poll, no read-back.

    python -m bench.slack_naive --api-url URL --token-env T --mode events --port 8123 --redis redis://… \
        --prefix run1 --ttl-s 600 --key event_id --calls calls.txt
    python -m bench.slack_naive … --mode socket --app-token-env A

``--calls`` gets one line per responder call (``<channel>:<ts> <pid>``), as replyd's counting responder.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from replyd.hooks import slack_verify


class NaiveBot:
    """The seen-set bot: one per process; replicas share the Redis seen-set."""

    def __init__(self, args: argparse.Namespace) -> None:
        import redis

        self.args = args
        self.token = os.environ[args.token_env]
        self.http = httpx.Client(timeout=10.0)
        self.redis = redis.Redis.from_url(args.redis)
        self.me = self._api("auth.test", {})["user_id"]
        self.compose_s = args.compose_s

    def _api(self, method: str, body: dict[str, Any], *, token: str | None = None) -> dict[str, Any]:
        resp = self.http.post(f"{self.args.api_url}/{method}", json=body,
                              headers={"Authorization": f"Bearer {token or self.token}"})
        return resp.json()

    def seen(self, body: dict[str, Any]) -> bool:
        """Mark the delivery's key on receipt; True when it was marked before (a duplicate to drop)."""
        event = body.get("event") or {}
        key = event.get("client_msg_id") if self.args.key == "client_msg_id" else body.get("event_id")
        if not key:
            return False
        fresh = self.redis.set(f"{self.args.prefix}:{key}", "1", nx=True, ex=max(1, int(self.args.ttl_s)))
        return not fresh

    def handle(self, body: dict[str, Any]) -> None:
        """Answer an app_mention or a DM in its thread (the work a framework's listener does)."""
        event = body.get("event") or {}
        is_dm = event.get("type") == "message" and event.get("channel_type") == "im"
        if event.get("type") != "app_mention" and not is_dm:
            return
        if event.get("user") == self.me or event.get("bot_id") or event.get("subtype"):
            return
        parent = f"{event['channel']}:{event['ts']}"
        with open(self.args.calls, "a") as f:
            f.write(f"{parent} {os.getpid()}\n")
        time.sleep(self.compose_s * (10 if "slow" in str(event.get("text")) else 1))  # the LLM call
        post = {"channel": event["channel"], "text": "thanks, we are on it",
                "thread_ts": event.get("thread_ts") or event["ts"]}
        for attempt in range(2):  # slack-sdk retries a connection error once by default
            try:
                self._api("chat.postMessage", post)
                return
            except httpx.HTTPError:
                if attempt:
                    return

    def receive(self, body: dict[str, Any]) -> None:
        """Dedupe on receipt, then answer in the background (the ack has already gone)."""
        if body.get("type") != "event_callback" or self.seen(body):
            return
        threading.Thread(target=self.handle, args=(body,), daemon=True).start()

    def serve_events(self) -> None:
        """The Events API Request URL: signature checked, url_verification answered, ack at once."""
        bot, secret = self, os.environ[self.args.secret_env]

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                if not slack_verify(secret, raw, headers, time.time()):
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.loads(raw)
                out = json.dumps({"challenge": body.get("challenge")} if body.get("type") == "url_verification"
                                 else {}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                bot.receive(body)

            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        ThreadingHTTPServer(("127.0.0.1", self.args.port), Handler).serve_forever()

    def serve_socket(self) -> None:
        """Socket Mode: ack every envelope first, then dedupe and answer; reconnect after a disconnect."""
        from websockets.sync.client import connect

        app_token = os.environ[self.args.app_token_env]
        while True:
            try:
                url = self._api("apps.connections.open", {}, token=app_token)["url"]
                with connect(url) as ws:
                    for raw in ws:
                        msg = json.loads(raw)
                        if msg.get("envelope_id"):
                            ws.send(json.dumps({"envelope_id": msg["envelope_id"]}))
                        if msg.get("type") == "disconnect":
                            break
                        if msg.get("type") == "events_api":
                            self.receive(msg.get("payload") or {})
            except Exception:  # reconnect like the SDK's client does
                time.sleep(1.0)


def main() -> None:
    """Run one naive bot process."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api-url", required=True)
    ap.add_argument("--token-env", default="SLACK_BOT_TOKEN")
    ap.add_argument("--app-token-env", default="SLACK_APP_TOKEN")
    ap.add_argument("--secret-env", default="SLACK_SIGNING_SECRET")
    ap.add_argument("--mode", choices=("events", "socket"), required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--prefix", default="naive")
    ap.add_argument("--ttl-s", type=float, default=600.0)
    ap.add_argument("--key", choices=("event_id", "client_msg_id"), default="event_id")
    ap.add_argument("--calls", required=True)
    ap.add_argument("--compose-s", type=float, default=0.2)
    args = ap.parse_args()
    bot = NaiveBot(args)
    bot.serve_events() if args.mode == "events" else bot.serve_socket()


if __name__ == "__main__":
    main()
