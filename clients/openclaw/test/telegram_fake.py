"""replyd's Telegram Bot API fake (replyd.sim.telegram) with a small control API for the node tests.

Prints ``TELEGRAM_URL=<Bot API root>`` and ``CONTROL_URL=<control root>``, then serves until killed.
Control: POST /post {"chat_id", "text"} -> {"parent_id"}; POST /faults {"send": ["lost", ...]};
GET /counts -> {"replies": {parent: n}, "lost_parents": [...], "send_requests": n}.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from replyd.sim.telegram import TelegramApi, TelegramWorld

world = TelegramWorld()
api = TelegramApi(world).start()


class Control(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, body: object) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._answer({"replies": dict(world.reply_counts()), "lost_parents": list(world.lost_parents),
                      "send_requests": world.send_requests, "unanswered": list(world.unanswered)})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        if self.path == "/post":
            world.chat(int(body["chat_id"]), type="private")
            self._answer({"parent_id": world.post(int(body["chat_id"]), body["text"], mention=False)})
        elif self.path == "/faults":
            with world.lock:
                world.send_faults.extend(body.get("send", []))
            self._answer({"ok": True})
        else:
            self.send_error(404)


server = ThreadingHTTPServer(("127.0.0.1", 0), Control)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(f"TELEGRAM_URL={api.url} CONTROL_URL=http://127.0.0.1:{server.server_address[1]}", flush=True)
try:
    threading.Event().wait()
except KeyboardInterrupt:
    pass
