"""A real PostgreSQL primary with a streaming standby, made, failed over and removed by the harness.

Built from the machine's own PostgreSQL binaries (``initdb``, ``pg_basebackup``, ``pg_ctl``; as the
``postgres`` user when run as root, since the server refuses root). Each node has its own data directory
and port. The standby streams from the primary through a :class:`chaos.proxy.TcpProxy`, so the harness
can cut the replication link (a partition, or a standby that lags) without touching either server.

``failover()`` stops the primary with ``immediate`` (no shutdown checkpoint, no last WAL shipped: a
crash), promotes the standby and rebuilds the old node as the new primary's standby, ready for the next.
Clients connect with a multi-host URL and ``target_session_attrs=read-write``, so they follow the primary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from chaos.proxy import TcpProxy

STANDBY_NAME = "standby"


def pg_bin() -> Path:
    """The directory of the server binaries (``REPLYD_PG_BIN``, else ``pg_config --bindir``, else PG 15's)."""
    if os.environ.get("REPLYD_PG_BIN"):
        return Path(os.environ["REPLYD_PG_BIN"])
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if (Path(out) / "initdb").exists():
            return Path(out)
    except (OSError, subprocess.CalledProcessError):
        pass
    return Path("/usr/lib/postgresql/15/bin")


def unavailable() -> str | None:
    """Why clusters cannot be made here, or None."""
    if not (pg_bin() / "initdb").exists():
        return f"no initdb under {pg_bin()} (set REPLYD_PG_BIN)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: the server refuses root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgPair:
    """A primary and one streaming standby; ``sync`` names the standby in ``synchronous_standby_names``."""

    def __init__(self, root: Path, *, sync: bool) -> None:
        self.root = root
        self.sync = sync
        self.nodes = [root / "n0", root / "n1"]
        self.ports = [_free_port(), _free_port()]
        self.primary = 0
        self.proxy: TcpProxy | None = None
        self.failovers = 0
        self.sock_dir = root / "sock"

    # -- commands -------------------------------------------------------------------------

    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [str(pg_bin() / args[0]), *args[1:]]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
        if check and done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{args[0]} failed (exit {done.returncode}): {' | '.join(tail)}")
        return done

    def _ctl(self, i: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run("pg_ctl", "-D", str(self.nodes[i]), "-l", str(self.root / f"n{i}.log"), *args, check=check)

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> PgPair:
        """Make the primary (initdb), its database ``replyd`` and the standby; start both."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.sock_dir.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.sock_dir, "postgres", "postgres")
        p = self.nodes[0]
        self._run("initdb", "-D", str(p), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
        with (p / "postgresql.conf").open("a") as f:
            f.write(f"""
listen_addresses = '127.0.0.1'
unix_socket_directories = '{self.sock_dir}'
wal_level = replica
max_wal_senders = 8
hot_standby = on
wal_keep_size = 128MB
shared_buffers = 32MB
max_connections = 80
wal_sender_timeout = 5s
wal_receiver_timeout = 5s
wal_retrieve_retry_interval = 200ms
""")
        with (p / "pg_hba.conf").open("a") as f:
            f.write("host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n")
        self._set_port(0)
        self._ctl(0, "-w", "start")
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.ports[0]), "-U", "postgres", "-c", "CREATE DATABASE replyd")
        self._make_standby(1)
        if self.sync:
            # Only now: with it set and no standby yet, every commit (CREATE DATABASE too) would wait.
            for i in (0, 1):
                self._sync_names(i)
                self._ctl(i, "reload")
        return self

    def _sync_names(self, i: int) -> None:
        with (self.nodes[i] / "postgresql.conf").open("a") as f:
            f.write(f"synchronous_standby_names = '{STANDBY_NAME}'\n")

    def _set_port(self, i: int) -> None:
        with (self.nodes[i] / "postgresql.conf").open("a") as f:
            f.write(f"port = {self.ports[i]}\n")

    def _make_standby(self, i: int) -> None:
        """(Re)build node ``i`` as the standby of the current primary, streaming through a new proxy."""
        if self.proxy is not None:
            self.proxy.close()
        self.proxy = TcpProxy("127.0.0.1", self.ports[self.primary]).start()
        d = self.nodes[i]
        if d.exists():
            shutil.rmtree(d)
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.ports[self.primary]), "-U", "postgres",
                  "-D", str(d), "-X", "stream", "-R", "-c", "fast", "--no-sync")
        with (d / "postgresql.auto.conf").open("a") as f:
            f.write(f"primary_conninfo = 'host=127.0.0.1 port={self.proxy.port} user=postgres "
                    f"application_name={STANDBY_NAME}'\n")
        self._set_port(i)
        self._ctl(i, "-w", "start")

    def url(self, database: str = "replyd") -> str:
        """A multi-host URL that finds whichever node is the primary."""
        hosts = "&".join(f"host=127.0.0.1:{p}" for p in self.ports)
        return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def cut_replication(self) -> None:
        """Cut the standby off (and keep it off): the primary commits what it alone will know."""
        assert self.proxy is not None
        self.proxy.outage()

    def failover(self) -> None:
        """Crash the primary (``immediate``), promote the standby, rebuild the old primary as the new standby."""
        old, new = self.primary, 1 - self.primary
        self._ctl(old, "-m", "immediate", "stop")
        self._ctl(new, "-w", "promote")
        self.primary = new
        self.failovers += 1
        self._make_standby(old)

    def stop(self) -> None:
        """Stop both servers and remove their data."""
        for i in (0, 1):
            if (self.nodes[i] / "postmaster.pid").exists():
                self._ctl(i, "-m", "immediate", "stop", check=False)
        if self.proxy is not None:
            self.proxy.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
