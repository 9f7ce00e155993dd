"""The ``command`` responder's supervisor, a tiny child process: ``python -I -S supervise.py FD PPID CGROUP -- ARGV``.

It runs one command so that nothing the command starts outlives it, in whatever
session or process group it hides (``setsid``, a double fork):

1. it asks the kernel to send it SIGTERM if replyd dies (``PR_SET_PDEATHSIG``);
2. it moves itself into the call's cgroup ``CGROUP`` when replyd made one (``-``
   when none), so the command and all it starts are in it from their first
   instruction, and replyd can kill them all with ``cgroup.kill``;
3. it makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): every orphaned
   descendant is re-parented to it, not to init, so it always sees them; this is
   why a helper process does it and not replyd, since the attribute is per process
   and would make the daemon adopt its own orphans;
4. it spawns ARGV (``posix_spawnp``, no shell) with stdin, stdout and stderr
   inherited, and waits for it;
5. when ARGV exits, or at SIGTERM (replyd's timeout, overflow, cancellation, its
   death), it SIGKILLs every descendant (found by walking the parent links in
   ``/proc/<pid>/stat``) and reaps until it has no child left, then reports and exits.

It never writes on stdout or stderr (they are the command's): each finding is one
line on the pipe ``FD``: ``cgroup ok`` or ``cgroup failed <why>``, ``subreaper
failed <why>``, then ``exit <code>`` (negative: killed by that signal),
``spawn-failed <why>`` or ``stopped``. Standard library only: it runs with ``-I -S``
in the command's stripped environment, so replyd's imports are not there.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Signals the supervisor turns into a stop; the command gets them back at their defaults (Python ignores
# SIGPIPE and SIGXFSZ, and an ignored disposition would survive the exec).
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_DEFAULTS = (signal.SIGPIPE, signal.SIGXFSZ, *_STOPS)


class _Stop(Exception):
    """A stop signal arrived: kill the tree now."""


def _stop(signum: int, frame: object) -> None:
    """Signal handler: interrupt the wait (PEP 475 retries it unless the handler raises)."""
    raise _Stop


def _prctl(option: int, value: int) -> None:
    """Call prctl(2); raise OSError when it fails (or when there is no prctl: not Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def descendants(root: int) -> list[int]:
    """Every process below ``root`` now, by the parent links in ``/proc/<pid>/stat`` (children first-found)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat.rsplit(b")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(name))
    found: list[int] = []
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def kill_all() -> None:
    """SIGKILL every descendant and reap until no child is left.

    As a subreaper every descendant is a child or below one, and an orphan comes to
    us; so "no child" means nothing of the call is left. One that forked between the
    scan and the kill is seen by the next scan, once its parent's death hands it to us.
    """
    me = os.getpid()
    while True:
        for pid in descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already, or not ours to kill (setuid): the wait below then bounds us
                pass
        try:
            os.waitpid(-1, 0)  # one death (they were all just killed), then collect the rest that are done
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return


def _report(fd: int, line: str) -> None:
    """Write one status line for replyd; a replyd that is gone does not stop the cleanup."""
    try:
        os.write(fd, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _wait_for(child: int) -> int:
    """Wait for ``child`` (reaping orphans that die meanwhile); return its exit code (negative: a signal)."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    """Run the command under supervision (see the module docstring); return 0 (its code goes on the pipe)."""
    fd, ppid, cgroup, cmd = int(argv[1]), int(argv[2]), argv[3], argv[5:]
    os.set_inheritable(fd, False)  # the command must not hold the status pipe
    for sig in _STOPS:
        signal.signal(sig, _stop)
    end = "stopped"
    try:
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
        if os.getppid() != ppid:  # replyd died before the death signal was armed
            raise _Stop
        if cgroup != "-":
            try:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                _report(fd, "cgroup ok")
            except OSError as exc:
                _report(fd, f"cgroup failed {exc.strerror or exc}")
        try:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        except (OSError, AttributeError) as exc:
            _report(fd, f"subreaper failed {getattr(exc, 'strerror', None) or exc}")
        try:
            child = os.posix_spawnp(cmd[0], cmd, os.environ, setsigdef=_DEFAULTS)
        except OSError as exc:
            end = f"spawn-failed {exc.strerror or exc}"
        else:
            end = f"exit {_wait_for(child)}"
    except _Stop:
        pass
    for sig in _STOPS:  # from here on a second stop changes nothing: the kill is under way
        signal.signal(sig, signal.SIG_IGN)
    kill_all()
    _report(fd, end)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
