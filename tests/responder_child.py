"""A child program for the ``command`` responder tests: ``python responder_child.py MODE [ARGS]``.

Stdlib only (it runs with a stripped environment). Modes:

- ``greet``: read the parent JSON on stdin, print ``hi @<author_handle>: <text>``
- ``echo-stdin``: write stdin back byte for byte (the payload as received)
- ``write S``: write ``S`` (Python escapes decoded) to stdout, read nothing
- ``bad-utf8``: write bytes that are not UTF-8
- ``fail CODE [LAST]``: write 50 noise lines then ``fatal: quota exhausted`` (or LAST) to stderr, exit CODE
- ``stderr-ok S``: write ``S`` to stderr, print ``ok``
- ``sleep PIDFILE``: start a grandchild, write both pids to PIDFILE, sleep 60 s
- ``kill-parent PIDFILE``: start ``setsid sleep 60``, write its pid, SIGKILL its own parent, sleep 60 s
- ``flood``: write to stdout for ever
- ``daemonize PIDFILE wait|exit``: double-fork (fork, setsid, fork) a ``sleep 60`` in a new session, write its pid
  to PIDFILE, then sleep 60 s (``wait``) or print ``ok`` and exit (``exit``), the orphan holding stdout
- ``setsid PIDFILE wait|exit``: start ``setsid sleep 60`` (a new session), write its pid, then as above
- ``env``: print the environment as JSON
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _daemonize(pidfile: str) -> None:
    """The classic double fork: a child starts a session, forks ``sleep 60`` and exits; wait for its pid file."""
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            with open(pidfile + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.rename(pidfile + ".tmp", pidfile)
            os.execvp("sleep", ["sleep", "60"])
        os._exit(0)
    os.waitpid(middle, 0)
    while not os.path.exists(pidfile):
        time.sleep(0.01)


def main() -> int:
    """Run the mode named in argv[1]; return the exit code."""
    mode, args = sys.argv[1], sys.argv[2:]
    out = sys.stdout.buffer
    if mode == "greet":
        doc = json.load(sys.stdin)
        print(f"hi @{doc['author_handle']}: {doc['text']}")
    elif mode == "echo-stdin":
        out.write(sys.stdin.buffer.read())
    elif mode == "write":
        out.write(args[0].encode("latin-1", "backslashreplace").decode("unicode_escape").encode("utf-8"))
    elif mode == "bad-utf8":
        out.write(b"caf\xe9 \xff\xfe\n")
    elif mode == "fail":
        for i in range(50):
            print(f"noise line {i}", file=sys.stderr)
        print(args[1] if len(args) > 1 else "fatal: quota exhausted", file=sys.stderr)
        out.write(b"partial reply that must not be sent\n")
        return int(args[0])
    elif mode == "stderr-ok":
        print(args[0], file=sys.stderr)
        print("ok")
    elif mode == "sleep":
        grandchild = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
        with open(args[0], "w") as f:
            f.write(f"{os.getpid()} {grandchild.pid}\n")
        time.sleep(60)
    elif mode in ("daemonize", "setsid"):
        if mode == "setsid":
            orphan = subprocess.Popen(["setsid", "sleep", "60"])
            with open(args[0], "w") as f:
                f.write(f"{orphan.pid}\n")
        else:
            _daemonize(args[0])
        if args[1] == "exit":
            print("ok")
            return 0
        time.sleep(60)
    elif mode == "kill-parent":
        orphan = subprocess.Popen(["setsid", "sleep", "60"])
        with open(args[0], "w") as f:
            f.write(f"{orphan.pid}\n")
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
    elif mode == "flood":
        while True:
            out.write(b"x" * 65536)
    elif mode == "env":
        print(json.dumps(dict(os.environ)))
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
