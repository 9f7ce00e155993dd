"""Run the simulated platform over real HTTP: uvicorn in a background thread, or a child process.

In-thread mode gives the test direct access to ``.world`` (and its clock);
process mode runs ``python -m replyd.sim`` so replyd's own processes can race
against a platform that is not in their address space. The admin helpers
(``configure``, ``report``, ...) go over HTTP and work in both modes.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

from replyd.serve import ThreadedServer
from replyd.sim.app import build_app
from replyd.sim.world import World


class _MuteIntentionalDrop(logging.Filter):
    """Hide uvicorn's error line for the connection the lost_drop fault cuts on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop only that one message."""
        return "returned without completing response" not in record.getMessage()


_mute_filter = _MuteIntentionalDrop()


class SimServer:
    """The sim platform on ``127.0.0.1`` with an ephemeral port; use as a context manager.

    ``SimServer(world)`` serves ``world`` from a thread of this process.
    ``SimServer(process=True, args=[...])`` starts ``python -m replyd.sim`` with
    those command-line arguments; ``.world`` is then None.
    """

    def __init__(
        self,
        world: World | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        process: bool = False,
        args: Sequence[str] = (),
        start_timeout_s: float = 15.0,
    ) -> None:
        if process and world is not None:
            raise ValueError("a world cannot be shared with a child process")
        self.world: World | None = None if process else (world or World())
        self.host = host
        self.port = port
        self.process = process
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self.base_url = ""
        self._server: ThreadedServer | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._admin_http: httpx.Client | None = None

    # ----- lifecycle ------------------------------------------------------------------------------

    def start(self) -> SimServer:
        """Start serving and block until requests are accepted; sets ``base_url``."""
        if self.process:
            self._start_process()
        else:
            self._start_thread()
        return self

    def _start_thread(self) -> None:
        assert self.world is not None
        logging.getLogger("uvicorn.error").addFilter(_mute_filter)
        self._server = ThreadedServer(build_app(self.world), host=self.host, port=self.port, name="sim", date_header=False,
                                      grace_s=2, start_timeout_s=self.start_timeout_s).start()
        self.port = self._server.port
        self.base_url = self._server.url
        self.world.base_url = self.base_url

    def _start_process(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "replyd.sim", "--host", self.host, "--port", str(self.port), *self.args],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            """Forward stdout lines to the queue until EOF."""
            # Keep draining stdout for the child's whole life so it never blocks on a full pipe.
            assert self._proc is not None and self._proc.stdout is not None
            for line in self._proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="replyd-sim-stdout", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise RuntimeError("sim process did not print SIM_URL")
            if line.startswith("SIM_URL="):
                self.base_url = line.strip().split("=", 1)[1]
                self.port = int(self.base_url.rsplit(":", 1)[1])
                return

    def stop(self) -> None:
        """Stop serving (terminate the child process in process mode)."""
        if self._admin_http is not None:
            self._admin_http.close()
            self._admin_http = None
        if self._server is not None:
            if self.world is not None:
                self.world.stop_traffic()
            self._server.stop()
            self._server = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None

    @property
    def pid(self) -> int | None:
        """The child's process id in process mode."""
        return self._proc.pid if self._proc else None

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- admin over HTTP (both modes) ------------------------------------------------------------------

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """Call a ``/_sim`` admin endpoint and return its JSON; raise on an error status."""
        if self._admin_http is None:
            self._admin_http = httpx.Client(timeout=10)
        r = self._admin_http.request(method, f"{self.base_url}/_sim/{path.lstrip('/')}", json=body)
        r.raise_for_status()
        return r.json()

    def configure(self, **knobs: Any) -> dict[str, Any]:
        """Set knobs (see ``World.configure``); returns all knobs."""
        return self.admin("POST", "config", knobs)

    def queue_faults(self, next_creates: Iterable[str] = (), next_readbacks: Iterable[str] = ()) -> dict[str, Any]:
        """Queue deterministic faults (see ``World.queue_faults``)."""
        return self.admin("POST", "faults", {"next_creates": list(next_creates), "next_readbacks": list(next_readbacks)})

    def add_account(self, username: str, bot: bool = False, token: str | None = None) -> dict[str, Any]:
        """Create an account; the answer is its account JSON plus ``token``."""
        return self.admin("POST", "accounts", {"username": username, "bot": bot, "token": token})

    def post(self, account: str, text: str, in_reply_to_id: str | None = None, mention: Iterable[str] = ()) -> dict[str, Any]:
        """Post as a simulated user (by username or id); returns the status JSON."""
        return self.admin(
            "POST", "posts", {"account": account, "text": text, "in_reply_to_id": in_reply_to_id, "mention": list(mention)}
        )

    def report(self) -> dict[str, Any]:
        """The platform-side report (see ``World.report``)."""
        return self.admin("GET", "report")

    def reset(self, seed: int | None = None, keep_accounts: bool = True) -> None:
        """Reset the world (see ``World.reset``)."""
        self.admin("POST", "reset", {"seed": seed, "keep_accounts": keep_accounts})

    def advance(self, seconds: float) -> float:
        """Move a fake clock forward (process mode needs ``--fake-clock``); returns the new time."""
        return self.admin("POST", "clock", {"advance": seconds})["now"]
