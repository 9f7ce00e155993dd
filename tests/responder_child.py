"""A child program for the ``command`` responder tests: ``python responder_child.py MODE [ARGS]``.

Stdlib only (it runs with a stripped environment). Modes:

- ``greet``: read the parent JSON on stdin, print ``hi @<author_handle>: <text>``
- ``echo-stdin``: write stdin back byte for byte (the payload as received)
- ``write S``: write ``S`` (Python escapes decoded) to stdout, read nothing
- ``bad-utf8``: write bytes that are not UTF-8
- ``fail CODE [LAST]``: write 50 noise lines then ``fatal: quota exhausted`` (or LAST) to stderr, exit CODE
- ``stderr-ok S``: write ``S`` to stderr, print ``ok``
- ``sleep PIDFILE``: start a grandchild, write both pids to PIDFILE, sleep 60 s
- ``flood``: write to stdout for ever
- ``env``: print the environment as JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


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
