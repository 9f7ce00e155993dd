"""The memory one email poll takes when the mailbox holds big mails (a sender sets their size).

A real Dovecot serves a desk whose INBOX holds ``count`` mails of ``size_mb`` each: a short text part and a
base64 attachment. The poll (``inbox(None)``) runs in a child process; the figure is its peak RSS (VmHWM,
reset just before the poll) above its RSS just before the poll.

    python -m bench.email_memory                   # 200 mails of 25 MB (one file, hard-linked 200 times)
    python -m bench.email_memory --count 24 --size-mb 8 --pythonpath /work/main   # another checkout's code

The mails share one file on disk (hard links), so 200 x 25 MB costs 25 MB of disk; Dovecot serves each as its
own mail. The goal: a poll's peak at most 50 MB above its start.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

GOAL_MB = 50.0

# The child: build the adapter, connect once, then measure one poll. Plain text so any checkout can run it.
_CHILD = r"""
import gc, json, sys, time
import httpx
from replyd.clock import SystemClock
from replyd.platforms.base import make_platform

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0

settings = json.loads(sys.argv[1])
p = make_platform("email", settings, http=httpx.Client(), clock=SystemClock())
p.whoami()
gc.collect()
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
t = time.monotonic()
page = p.inbox(None)
took = time.monotonic() - t
peak = rss("VmHWM:")
print(json.dumps({"before_mb": round(before, 1), "peak_mb": round(peak, 1), "delta_mb": round(peak - before, 1),
                  "parents": len(page.parents), "seconds": round(took, 2)}))
"""


def big_mail(size_mb: float, tag: str) -> bytes:
    """A mail of about ``size_mb`` MB: headers, a short text part, a base64 attachment."""
    payload = base64.encodebytes(os.urandom(int(size_mb * 1024 * 1024 * 3 / 4)))
    head = (f"From: sender-{tag}@replyd.test\r\nTo: desk@replyd.test\r\nSubject: big {tag}\r\n"
            f"Message-ID: <big-{tag}@client.example>\r\nMIME-Version: 1.0\r\n"
            'Content-Type: multipart/mixed; boundary="b1"\r\n\r\n--b1\r\nContent-Type: text/plain\r\n\r\n'
            "please see the attachment\r\n--b1\r\nContent-Type: application/octet-stream\r\n"
            "Content-Transfer-Encoding: base64\r\n\r\n")
    return head.encode() + payload.replace(b"\n", b"\r\n") + b"--b1--\r\n"


def fill(home: Path, count: int, size_mb: float, *, distinct: bool) -> None:
    """Put ``count`` mails into the Maildir under ``home`` (Dovecot picks them up): hard links of one file, or
    ``distinct`` files (each its own Message-ID)."""
    nobody = pwd.getpwnam("nobody")
    maildir = home / "Maildir"
    for d in (home, maildir, *(maildir / s for s in ("new", "cur", "tmp"))):
        d.mkdir(exist_ok=True)
        os.chown(d, nobody.pw_uid, nobody.pw_gid)
    first: Path | None = None
    for i in range(count):
        path = maildir / "new" / f"1700000000.M{i}P{os.getpid()}.bench"
        if distinct or first is None:
            path.write_bytes(big_mail(size_mb, f"{os.getpid()}-{i}"))
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
            first = first or path
        else:
            os.link(first, path)


def measure(settings: dict[str, Any], pythonpath: str | None = None) -> dict[str, Any]:
    """One poll's memory in a child process (``pythonpath``: the checkout whose replyd it runs)."""
    env = {**os.environ, "PYTHONPATH": pythonpath or str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(settings)], env=env, cwd=env["PYTHONPATH"],
                         capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the poll failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_all(runs: list[tuple[int, float]]) -> dict[str, Any]:
    """One Dovecot, one desk per run of ``count`` distinct mails of ``size_mb``: each poll's peak above its start."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.mail_server import start, stop

    rows = []
    server = start()
    try:
        for i, (count, size_mb) in enumerate(runs):
            bot = server.add_user(f"bench{i}")
            fill(server.home(bot), count, size_mb, distinct=True)
            got = measure({**server.settings(bot), "max_fetch": 10_000})
            rows.append({"count": count, "size_mb": size_mb, **got})
    finally:
        stop(server)
    return {"rows": rows}


def tables(res: dict[str, Any], cmd: str) -> list[Any]:
    """The email memory table, with the goal's verdict on the largest mailbox."""
    from bench.common import Table, verdict

    t = Table("19. One email poll's memory when a sender picks the mail sizes",
              ["mails in the inbox", "size each", "parents read", "RSS before MB", "peak above it MB", "poll s"])
    for r in res["rows"]:
        t.rows.append([f"{r['count']:,}", f"{r['size_mb']:g} MB", f"{r['parents']:,}", f"{r['before_mb']:.1f}",
                       f"{r['delta_mb']:.1f}", f"{r['seconds']:.1f}"])
    big = max(res["rows"], key=lambda r: r["count"] * r["size_mb"])
    t.verdicts.append(verdict(big["delta_mb"] <= GOAL_MB, f"{big['count']} mails of {big['size_mb']:g} MB: "
                              f"the poll's peak {big['delta_mb']:.1f} MB above its start (goal ≤ {GOAL_MB:g} MB)"))
    t.notes.append("A real Dovecot serves the mails; each is its own file with its own Message-ID. "
                   "The poll reads sizes first and fetches in batches; a mail over `max_mail_bytes` is read in part.")
    return [t]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--size-mb", type=float, default=25.0)
    ap.add_argument("--distinct", action="store_true", help="distinct files (count x size of disk)")
    ap.add_argument("--pythonpath", help="the checkout whose replyd runs the poll (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.mail_server import start, stop

    server = start()
    try:
        bot = server.add_user("bench")
        fill(server.home(bot), args.count, args.size_mb, distinct=args.distinct)
        got = measure({**server.settings(bot), "max_fetch": 10_000}, args.pythonpath)
    finally:
        stop(server)
    verdict = "met" if got["delta_mb"] <= GOAL_MB else "MISSED"
    print(f"{args.count} mails x {args.size_mb:g} MB: poll peak +{got['delta_mb']} MB over {got['before_mb']} MB "
          f"({got['parents']} parents, {got['seconds']} s); goal +{GOAL_MB:g} MB: {verdict}")
    return 0 if verdict == "met" else 1


if __name__ == "__main__":
    raise SystemExit(main())
