"""``@once`` (replyd/once.py): the guard around one send function, sync and ``async def``.

The send is a real HTTP request to a local server that counts what it received (the platform's side): five
paths offering one parent make one send; a lost answer (the server acted, the connection dropped) is never
retried without read-back and ends ``unconfirmed`` after the sweep; with ``read_back`` it is closed by the
sweep; two OS processes racing on one SQLite store send once.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from replyd.clock import FakeClock
from replyd.guard import Status
from replyd.once import once
from replyd.serve import ThreadedServer

CTX = mp.get_context("spawn")


class Chat:
    """A chat server: ``POST /send`` records the message (the platform's count) and answers its id, or drops
    the connection after recording when ``lose`` says so."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.lose = 0
        self.lock = threading.Lock()
        self.server = ThreadedServer(Starlette(routes=[Route("/send", self._send, methods=["POST"])]), name="chat")

    async def _send(self, request: Request) -> Response:
        body = await request.json()
        with self.lock:
            self.sent.append(body)
            mid = len(self.sent)
            lose, self.lose = self.lose > 0, max(0, self.lose - 1)
        if lose:
            raise ConnectionResetError("the answer is lost")  # uvicorn drops the connection: the send acted
        return JSONResponse({"message_id": mid})

    def replies(self, parent_id: str) -> int:
        """How many messages answer ``parent_id`` on the server."""
        with self.lock:
            return sum(1 for m in self.sent if m["reply_to"] == parent_id)


def _sender(url: str):
    """A bot's own send: one POST of its SDK (here httpx), returning the message id."""
    def send(parent_id: str, text: str, provider_key: str) -> str:
        r = httpx.post(f"{url}/send", json={"reply_to": parent_id, "text": text, "key": provider_key}, timeout=5.0)
        r.raise_for_status()
        return str(r.json()["message_id"])
    return send


def test_a_decorated_send_posts_each_parent_once(tmp_path: Path) -> None:
    """Five calls for one parent (five discovery paths) and one for another: two sends on the server."""
    chat = Chat()
    with chat.server:
        reply = once(f"sqlite:///{tmp_path / 'r.sqlite3'}", instance="chat:test", sender="bot")(_sender(chat.server.url))
        outs = [reply("p1", "hello") for _ in range(5)] + [reply("p2", lambda p: f"hi {p.id}")]
        reply.close()
    assert [o.status for o in outs] == [Status.POSTED] + [Status.ALREADY_ANSWERED] * 4 + [Status.POSTED]
    assert chat.replies("p1") == 1 and chat.replies("p2") == 1
    assert chat.sent[1]["text"] == "hi p2" and chat.sent[0]["key"] != chat.sent[1]["key"]


def test_a_lost_answer_is_never_sent_again_without_read_back(tmp_path: Path) -> None:
    """The server acted but the answer was lost: uncertain, never retried, unconfirmed after the sweep."""
    chat = Chat()
    with chat.server:
        clock = FakeClock()
        reply = once(f"sqlite:///{tmp_path / 'r.sqlite3'}", instance="chat:test", sender="bot", listing_delay_s=0.0,
                     send_timeout_s=2.0, clock=clock)(_sender(chat.server.url))
        chat.lose = 1
        first = reply("p1", "hello")
        assert first.status is Status.UNCERTAIN, first
        again = [reply("p1", "hello") for _ in range(3)]
        clock.advance(5.0)  # past the row's deadline: the sweep judges it
        reply.sweep()
        last = reply("p1", "hello")
        reply.close()
    assert chat.replies("p1") == 1
    assert all(o.status is not Status.POSTED for o in again) and last.status is Status.UNCONFIRMED, (again, last)


def test_with_read_back_the_sweep_closes_a_lost_answer(tmp_path: Path) -> None:
    """Given ``read_back``, the sweep finds the lost answer's message and closes the row with it."""
    chat = Chat()

    def read_back(parent_ids: list[str]) -> dict[str, list[str]]:
        with chat.lock:
            return {p: [str(i + 1) for i, m in enumerate(chat.sent) if m["reply_to"] == p] for p in parent_ids}

    with chat.server:
        clock = FakeClock()
        reply = once(f"sqlite:///{tmp_path / 'r.sqlite3'}", instance="chat:test", sender="bot", read_back=read_back,
                     listing_delay_s=0.0, send_timeout_s=2.0, clock=clock)(_sender(chat.server.url))
        chat.lose = 1
        assert reply("p1", "hello").status is Status.UNCERTAIN
        clock.advance(5.0)
        reply.sweep()
        out = reply("p1", "hello")
        reply.close()
    assert out.status is Status.ALREADY_ANSWERED and out.reply_id == "1" and chat.replies("p1") == 1


def test_an_async_send_makes_an_async_wrapper(tmp_path: Path) -> None:
    """``async def`` send: the wrapper is a coroutine function on the asyncio face; five concurrent calls for
    one parent make one send."""
    chat = Chat()

    async def main(url: str) -> list:
        async with httpx.AsyncClient() as client:
            @once(f"sqlite:///{tmp_path / 'r.sqlite3'}", instance="chat:test", sender="bot")
            async def reply(parent_id: str, text: str, provider_key: str) -> str:
                r = await client.post(f"{url}/send", json={"reply_to": parent_id, "text": text, "key": provider_key})
                return str(r.json()["message_id"])

            outs = await asyncio.gather(*(reply("p1", "hello") for _ in range(5)))
            await reply.aclose()
            return outs

    with chat.server:
        outs = asyncio.run(main(chat.server.url))
    assert sum(o.status is Status.POSTED for o in outs) == 1 and chat.replies("p1") == 1


def _race(url: str, db: str, n: int) -> None:
    """A child process posting parents p0..p(n-1) through a decorated send."""
    reply = once(db, instance="chat:test", sender="bot")(_sender(url))
    for i in range(n):
        reply(f"p{i}", "hello")
    reply.close()


def test_two_processes_racing_send_each_parent_once(tmp_path: Path) -> None:
    """Two OS processes offering the same 30 parents through one SQLite store: one send per parent."""
    chat = Chat()
    db = f"sqlite:///{tmp_path / 'r.sqlite3'}"
    with chat.server:
        procs = [CTX.Process(target=_race, args=(chat.server.url, db, 30)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
    assert [chat.replies(f"p{i}") for i in range(30)] == [1] * 30
