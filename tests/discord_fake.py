"""The Discord fake's Gateway and interactions sender; the REST fake is ``replyd.sim.discord`` (re-exported here).

- ``Gateway``: a real WebSocket server: HELLO, heartbeat ACKs, IDENTIFY (intents checked: MESSAGE_CONTENT
  refused with 4014 unless ``content_allowed``), READY with a session id and ``resume_gateway_url``,
  RESUME replaying every dispatch after the client's ``seq`` (and ``replay_seen`` already-seen ones before
  it, as observed in the field), RESUMED. A session keeps its events while no connection holds it and stays
  resumable ``resume_window_s`` (the docs: "timeout after a few minutes"); a client close with 1000 or 1001
  ends it at once, as the docs say; a RESUME of an ended session is answered INVALID_SESSION ``d: false``
  (``invalid_answers``); ``expire()`` ends every unheld session. ``force_reconnect()`` closes every connection with 4000 (the
  client resumes), ``invalidate()`` sends INVALID_SESSION, ``stop_acks`` stops heartbeat ACKs.
- ``InteractionSender``: slash-command interactions POSTed to the app's interactions endpoint, signed with
  Ed25519 (``X-Signature-Ed25519`` over ``X-Signature-Timestamp`` + body) by the fake app's key, each
  delivered ``deliveries`` times (to the URLs in turn); an answer counts as the initial response only when
  it is type 4/5 within ``ack_timeout_s`` (3 s) and the first for its id (later ones are ``late_acks``:
  "already acknowledged"). A type 5 makes the deferred original message (flag LOADING) that
  ``PATCH /webhooks/{app}/{token}/messages/@original`` fills; ``POST /webhooks/{app}/{token}`` makes a
  follow-up message. Tokens die ``token_life_s`` (900 s) after the interaction (401 50027).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from replyd.sim.discord import (  # noqa: F401  (re-exported: the tests import the REST fake from here)
    BOT_ID,
    BOT_NAME,
    BOT_TOKENS,
    DISCORD_EPOCH_MS,
    FIXTURES,
    GUILD,
    INTENT_MESSAGE_CONTENT,
    MAX_CONTENT,
    Channel,
    DiscordRest,
    DiscordWorld,
    Interaction,
    Msg,
    fixture,
    pings,
)


class InteractionSender:
    """Discord's side of the interactions endpoint: signed deliveries (each ``deliveries`` times), acks judged."""

    def __init__(self, world: DiscordWorld, urls: list[str], *, deliveries: int = 2, ack_timeout_s: float = 3.0,
                 key: Any = None) -> None:
        import httpx
        from nacl.signing import SigningKey

        self.world, self.urls, self.deliveries, self.ack_timeout_s = world, urls, deliveries, ack_timeout_s
        self.key = key or SigningKey.generate()
        self.statuses: list[int | None] = []
        self._http = httpx.Client(timeout=ack_timeout_s + 2)

    @property
    def public_key(self) -> str:
        """The app's public key (hex), as the developer portal shows it."""
        return bytes(self.key.verify_key).hex()

    def payload(self, cid: str, user: str, question: str) -> dict[str, Any]:
        """A CHAT_INPUT command interaction in ``cid`` by ``user``, registered in the world."""
        w = self.world
        with w.lock:
            iid = w.snowflake()
            token = "aW50ZXJhY3Rpb246" + uuid.uuid4().hex + uuid.uuid4().hex
            w.interactions[iid] = Interaction(iid, token, cid, user, w.now())
            guild = w.channels[cid].guild_id
        who = {"id": user, "username": f"user{user[-4:]}", "discriminator": "0"}
        body: dict[str, Any] = {"id": iid, "application_id": BOT_ID, "type": 2, "token": token, "version": 1,
                                "channel_id": cid, "locale": "en-US", "app_permissions": "442368",
                                "data": {"id": "771825006014889984", "name": "ask", "type": 1,
                                         "options": [{"name": "question", "type": 3, "value": question}]}}
        if guild:
            body.update({"guild_id": guild, "member": {"user": who, "roles": [], "permissions": "2147483647"}})
        else:
            body["user"] = who
        return body

    def deliver(self, body: dict[str, Any], url: str, *, key: Any = None, stamp: int | None = None) -> Any:
        """POST one signed delivery; judge its answer as Discord would. Returns the response (or None)."""
        raw = json.dumps(body).encode()
        ts = str(stamp if stamp is not None else int(time.time()))
        sig = (key or self.key).sign(ts.encode() + raw).signature.hex()
        t0 = time.monotonic()
        try:
            resp = self._http.post(url, content=raw, headers={"Content-Type": "application/json",
                                                              "X-Signature-Ed25519": sig, "X-Signature-Timestamp": ts})
        except Exception:
            self.statuses.append(None)
            return None
        took = time.monotonic() - t0
        self.statuses.append(resp.status_code)
        it = self.world.interactions.get(str(body.get("id")))
        try:
            kind = resp.json().get("type") if resp.status_code == 200 else None
        except ValueError:
            kind = None
        if it is not None:
            with self.world.lock:
                if kind in (4, 5) and took <= self.ack_timeout_s and it.acks == 0:
                    it.acks += 1
                    it.ack_s.append(took)
                    it.original = Msg(self.world.snowflake(), it.channel_id, BOT_ID, "")
                    self.world.channels[it.channel_id].messages.append(it.original)
                else:
                    it.late_acks += 1
        return resp

    def fire(self, cid: str, user: str, question: str) -> str:
        """One interaction delivered ``deliveries`` times, to the URLs in turn, at once; returns its id."""
        body = self.payload(cid, user, question)
        threads = [threading.Thread(target=self.deliver, args=(body, self.urls[i % len(self.urls)]), daemon=True)
                   for i in range(self.deliveries)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.ack_timeout_s + 3)
        return str(body["id"])

    def close(self) -> None:
        """Close the client."""
        self._http.close()


@dataclass
class _Session:
    id: str
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (seq, frame)
    seq: int = 0
    content: bool = False
    left_at: float | None = None  # monotonic time its last connection ended (None: connected)


class Gateway:
    """The Gateway on a real WebSocket: sessions buffered for RESUME, replays, forced reconnects."""

    def __init__(self, world: DiscordWorld, *, heartbeat_ms: int = 1000, content_allowed: bool = False,
                 replay_seen: int = 0, resume_window_s: float = 180.0) -> None:
        from websockets.sync.server import serve

        self.world = world
        self.heartbeat_ms = heartbeat_ms
        self.content_allowed = content_allowed
        self.replay_seen = replay_seen  # on RESUME, also replay this many dispatches the client had seen
        # A session outlives its connection this long ("timeout after a few minutes"), unless closed 1000/1001.
        self.resume_window_s = resume_window_s
        self.invalid_answers = 0  # RESUMEs answered INVALID_SESSION (d: false)
        self.stop_acks = False
        self.sessions: dict[str, _Session] = {}
        self.identifies = 0
        self.resumes: list[tuple[str, Any]] = []  # (session id, seq the client sent)
        self.dispatched: list[tuple[str, str]] = []  # (session id, message id) of every MESSAGE_CREATE sent
        self._lock = threading.Lock()
        self._live: dict[Any, _Session] = {}
        self._server = serve(self._handler, "127.0.0.1", 0)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="discord-gateway")
        self._thread.start()
        world.on_message.append(self._heard)
        world.on_update.append(lambda msg: self._heard(msg, "MESSAGE_UPDATE"))

    def url(self) -> str:
        """What ``GET /gateway/bot`` hands out."""
        return f"ws://127.0.0.1:{self.port}"

    def _heard(self, msg: Msg, kind: str = "MESSAGE_CREATE") -> None:
        with self._lock:
            sessions = list(self.sessions.values())
            live = dict(self._live)
        for s in sessions:
            data = msg.json(self.world)
            if not s.content and msg.author_id != BOT_ID and BOT_ID not in msg.mentions \
                    and self.world.channels[msg.channel_id].guild_id is not None:
                data["content"] = ""  # the MESSAGE_CONTENT rule
            with self._lock:
                s.seq += 1
                frame = {"op": 0, "s": s.seq, "t": kind, "d": data}
                s.events.append((s.seq, frame))
            for ws, held in live.items():
                if held is s:
                    self._send(ws, s, frame)

    def _send(self, ws: Any, s: _Session, frame: dict[str, Any]) -> None:
        try:
            ws.send(json.dumps(frame))
            if frame.get("t") == "MESSAGE_CREATE":
                with self._lock:
                    self.dispatched.append((s.id, frame["d"]["id"]))
        except Exception:  # a closing connection: the session keeps the event for a RESUME
            pass

    def _handler(self, ws: Any) -> None:
        hello = fixture("gateway_hello")
        hello["d"]["heartbeat_interval"] = self.heartbeat_ms
        ws.send(json.dumps(hello))
        session: _Session | None = None
        try:
            for raw in ws:
                try:
                    frame = json.loads(raw)
                except ValueError:
                    ws.close(4002, "decode error")
                    return
                op, d = frame.get("op"), frame.get("d")
                if op == 1:
                    if not self.stop_acks:
                        ws.send(json.dumps({"op": 11}))
                elif op == 2 and isinstance(d, dict):
                    if d.get("token") not in self.world.tokens:
                        ws.close(4004, "Authentication failed.")
                        return
                    intents = d.get("intents")
                    if not isinstance(intents, int):
                        ws.close(4013, "Invalid intent(s).")
                        return
                    if intents & INTENT_MESSAGE_CONTENT and not self.content_allowed:
                        ws.close(4014, "Disallowed intent(s).")
                        return
                    session = _Session(uuid.uuid4().hex, content=bool(intents & INTENT_MESSAGE_CONTENT))
                    ready = fixture("gateway_ready")
                    ready["d"].update({"session_id": session.id, "resume_gateway_url": self.url()})
                    ready["d"]["user"].update({"id": BOT_ID, "username": BOT_NAME})
                    with self._lock:
                        self.identifies += 1
                        session.seq = 1
                        ready["s"] = 1
                        session.events.append((1, ready))
                        self.sessions[session.id] = session
                        self._live[ws] = session
                    ws.send(json.dumps(ready))
                elif op == 6 and isinstance(d, dict):
                    with self._lock:
                        self.resumes.append((str(d.get("session_id")), d.get("seq")))
                        session = self.sessions.get(str(d.get("session_id")))
                        if session is not None and session.left_at is not None \
                                and time.monotonic() - session.left_at > self.resume_window_s:
                            self.sessions.pop(session.id, None)  # timed out while nobody held it
                            session = None
                    if session is None or d.get("token") not in self.world.tokens:
                        self.invalid_answers += 1
                        ws.send(json.dumps(fixture("gateway_invalid_session")))
                        continue
                    seq = d.get("seq") if isinstance(d.get("seq"), int) else 0
                    with self._lock:
                        again = [f for s, f in session.events if s > seq - self.replay_seen]
                        self._live[ws] = session
                        session.left_at = None
                    for f in again:
                        self._send(ws, session, f)
                    with self._lock:
                        session.seq += 1
                        resumed = {"op": 0, "s": session.seq, "t": "RESUMED", "d": {}}
                        session.events.append((session.seq, resumed))
                    ws.send(json.dumps(resumed))
        except Exception:
            pass
        finally:
            with self._lock:
                held = self._live.pop(ws, None)
                if held is not None and held not in self._live.values():
                    held.left_at = time.monotonic()
                    if ws.close_code in (1000, 1001):  # the docs: these close codes invalidate the session
                        self.sessions.pop(held.id, None)

    def force_reconnect(self, code: int = 4000) -> None:
        """Close every connection (4000: reconnect and resume; 4009: session timed out)."""
        with self._lock:
            live = list(self._live)
            if code in (4007, 4009):
                for s in list(self._live.values()):
                    self.sessions.pop(s.id, None)
        for ws in live:
            try:
                ws.close(code, "forced")
            except Exception:
                pass

    def expire(self) -> None:
        """End every session nobody holds now, as Discord does once its resume window has passed."""
        with self._lock:
            for s in [s for s in self.sessions.values() if s not in self._live.values()]:
                self.sessions.pop(s.id, None)

    def invalidate(self, resumable: bool = False) -> None:
        """Send INVALID_SESSION to every connection (``d: false`` ends their sessions)."""
        with self._lock:
            live = dict(self._live)
            if not resumable:
                for s in live.values():
                    self.sessions.pop(s.id, None)
        for ws in live:
            try:
                ws.send(json.dumps({**fixture("gateway_invalid_session"), "d": resumable}))
            except Exception:
                pass

    @property
    def connections(self) -> int:
        """Connections holding a session now."""
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._thread.join(2)
