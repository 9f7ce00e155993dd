"""The simulated platform in this process, with a jumpable clock and a per-parent request counter.

``replyd.sim.World`` is the ground truth (what landed). On top of it this
module adds what the chaos runner needs and the sim does not count:

* ``posts_per_parent``: every ``POST /api/v1/statuses`` that reached the
  platform, per ``in_reply_to_id`` (attempts as the platform saw them,
  including the ones refused with 429/5xx);
* ``kill_on_create``: SIGKILL the daemon process that sent the next create
  after the platform created the status and before the response leaves: the
  crash between "send" and "remember";
* ``create_delay_s``: creates wait this long before the platform acts (a
  queue in front of it), while reads stay fast;
* a platform clock with an offset the runner can jump.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from replyd.serve import ThreadedServer
from replyd.sim.app import build_app
from replyd.sim.server import _mute_filter
from replyd.sim.world import World


class JumpClock:
    """The platform's wall clock: system time plus an offset the runner may jump (forward only in runs)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        """Return system time plus the offset."""
        return time.time() + self.offset


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def pid_for_client_port(port: int, pids: list[int]) -> int | None:
    """Return which of ``pids`` owns the TCP socket whose local port is ``port`` (Linux /proc)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh)
                for line in fh:
                    parts = line.split()
                    if int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inode = parts[9]
                        break
        except OSError:
            continue
        if inode:
            break
    if not inode:
        return None
    for pid in pids:
        if inode in _socket_inodes(pid):
            return pid
    return None


class _Counting:
    """ASGI middleware: counts creates per parent; optionally kills the sender mid-create."""

    def __init__(self, app: Any, host: SimHost) -> None:
        self.app, self.host = app, host

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/api/v1/statuses":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        form = dict(parse_qsl(body.decode("utf-8", "replace")))
        parent = form.get("in_reply_to_id", "")
        host = self.host
        with host.lock:
            host.posts_per_parent[parent] += 1
            victim_wanted = host.kill_on_create
            if victim_wanted:
                host.kill_on_create = False
        if host.create_delay_s > 0:
            # The request waits in front of the platform (a queue, a slow proxy) before it acts.
            await asyncio.sleep(host.create_delay_s)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def guarded_send(message: Any) -> None:
            if victim_wanted and message["type"] == "http.response.start":
                client = scope.get("client") or ("", 0)
                pid = pid_for_client_port(int(client[1]), host.daemon_pids())
                if pid is not None:
                    # The platform has acted; the sender dies before it can read the answer.
                    host.on_kill(pid)  # recorded first: the supervisor must see it as our kill
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                else:
                    # The sender is gone already (its send timed out and closed the socket, as on a loaded
                    # machine): the kill waits for the next create rather than being spent on nobody.
                    with host.lock:
                        host.kill_on_create = not host.faults_over
            await send(message)

        await self.app(scope, replay, guarded_send)


class SimHost:
    """Serves a ``World`` over real HTTP from a thread of this process, with chaos hooks."""

    def __init__(self, world: World, daemon_pids: Callable[[], list[int]], on_kill: Callable[[int], None]) -> None:
        self.world = world
        self.daemon_pids = daemon_pids
        self.on_kill = on_kill
        self.lock = threading.Lock()
        self.posts_per_parent: Counter[str] = Counter()
        self.kill_on_create = False
        self.faults_over = False  # set when the run's faults end: nothing re-arms a kill after it
        self.create_delay_s = 0.0
        self.base_url = ""
        self._server: ThreadedServer | None = None

    def start(self) -> SimHost:
        """Bind an ephemeral port and serve."""
        logging.getLogger("uvicorn.error").addFilter(_mute_filter)
        self._server = ThreadedServer(_Counting(build_app(self.world), self), name="chaos-sim", grace_s=1,
                                      date_header=False, log_level="critical").start()
        self.base_url = self.world.base_url = self._server.url
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.world.stop_traffic()
        if self._server is not None:
            self._server.stop()

    def attempts(self) -> dict[str, int]:
        """Creates that reached the platform, per parent id."""
        with self.lock:
            return dict(self.posts_per_parent)


def dumps(obj: Any) -> str:
    """Compact JSON."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, default=str)
