"""The ``command`` kind: a program (argv, never a shell) with the parent as JSON on stdin; its stdout is the reply.

Containment: the program runs under a small supervisor process (``supervise.py``)
that is a child subreaper, so every process the program starts stays below it,
even in a new session (``setsid``) or after a double fork, and dies when the call
ends. Where the machine offers a writable cgroup v2 hierarchy (with
``cgroup.kill``, Linux 5.14+) each call also gets a cgroup of its own, killed as a
whole at the end: that catches even a process that killed the supervisor first.
``containment`` chooses: ``auto`` (cgroup when available), ``cgroup`` (required),
``subreaper``. replyd owns the pipe ends it reads and writes, so a call ends
within about a second of its timeout whatever its processes do.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import re
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from replyd import log as rlog
from replyd.errors import ConfigError, ResponderError
from replyd.responders.base import (Parent, Responder, ResponderSettings, TimeoutS, declined, log, register_responder,
                                    responder_payload)

# The child's whole environment is these (when set) plus its ``env_pass``: never replyd's tokens.
CHILD_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_STDERR_KEEP = 8192  # bytes of stderr kept (the tail)
_STDERR_LOG = 2000  # characters of stderr logged
_STDERR_ERROR = 300  # characters of stderr in a ResponderError
SUPERVISOR = str(Path(__file__).with_name("supervise.py"))
# The end of a call, bounded: after SIGTERM the supervisor kills and reaps its tree (milliseconds) within
# _GRACE_S; the cgroup then empties within _DRAIN_S; a supervisor still there is SIGKILLed and reaped within
# _REAP_S. Together under 1 s past the timeout.
_GRACE_S = 0.4
_DRAIN_S = 0.2
_REAP_S = 0.2
_CGROUP_DIR = "replyd-calls"  # below replyd's own cgroup: one directory per call, removed when it ends
_calls = itertools.count(1)
Containment = Literal["auto", "cgroup", "subreaper"]


@functools.cache
def cgroup_parent() -> tuple[Path | None, str]:
    """Where this process can make per-call cgroups (below its own cgroup v2 group), or None; and why.

    Probed once per process: a cgroup v2 mount, this process's group in it, a test
    directory made and removed there, ``cgroup.kill`` present, and write access to
    the ``cgroup.procs`` files a move into it needs (root, or a delegated group).
    """
    try:
        mounts = Path("/proc/self/mounts").read_text()
        groups = Path("/proc/self/cgroup").read_text()
    except OSError as exc:
        return None, f"cannot read /proc: {exc.strerror}"
    mount = next((f[1] for f in (line.split() for line in mounts.splitlines()) if f[2:3] == ["cgroup2"]), None)
    own = next((line[3:] for line in groups.splitlines() if line.startswith("0::")), None)
    if mount is None or own is None:
        return None, "no cgroup v2 hierarchy is mounted" if mount is None else "this process is in no cgroup v2 group"
    own_dir = Path(mount) / own.lstrip("/")
    base = own_dir / _CGROUP_DIR
    probe = base / f"probe-{os.getpid()}"
    try:
        base.mkdir(exist_ok=True)
        probe.mkdir(exist_ok=True)
        try:
            killable = (probe / "cgroup.kill").exists()
            movable = os.access(probe / "cgroup.procs", os.W_OK) and os.access(own_dir / "cgroup.procs", os.W_OK)
        finally:
            probe.rmdir()
    except OSError as exc:
        return None, f"cannot make a cgroup in {own_dir}: {exc.strerror or exc}"
    if not killable:
        return None, f"{own_dir} has no cgroup.kill (Linux before 5.14)"
    if not movable:
        return None, f"{own_dir}/cgroup.procs is not writable (delegate the group to replyd's user)"
    remove_stale_cgroups(base)
    return base, f"a cgroup per call in {base}"


def remove_stale_cgroups(base: Path) -> list[str]:
    """Remove the empty call groups of replyd processes that are gone (SIGKILLed mid-call); return their names.

    Their processes died with them (the supervisor's parent-death signal), but a
    process cannot remove the group it is in. ``rmdir`` only succeeds on an empty
    group, so a group still in use, whoever's, is never touched.
    """
    removed = []
    for group in base.glob("call-*"):
        pid = group.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                group.rmdir()
                removed.append(group.name)
            except OSError:  # populated, or someone else's to remove
                pass
    return removed


class _CallCgroup:
    """One call's cgroup: made before the spawn, killed as a whole and removed when the call ends."""

    def __init__(self, base: Path) -> None:
        self.path = base / f"call-{os.getpid()}-{next(_calls)}-{os.urandom(3).hex()}"
        self.path.mkdir()

    def _populated(self) -> bool:
        """Whether any process is left in it (``cgroup.events``: ``populated 1``)."""
        try:
            return "populated 1" in (self.path / "cgroup.events").read_text()
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL every process in it (``cgroup.kill``), if any is left (a failure shows when ``end`` removes it)."""
        try:
            if self._populated():
                (self.path / "cgroup.kill").write_text("1")
        except OSError:
            pass

    async def end(self, program: str) -> None:
        """Kill everything in it, wait until it is empty (bounded), remove it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _DRAIN_S
        try:
            self.kill()
            while self._populated() and loop.time() < deadline:
                await asyncio.sleep(0.005)  # the kernel's kill is asynchronous: a few ms for the last exit
            self.path.rmdir()
        except OSError as exc:
            log.warning("replyd.responder.cgroup_left", responder="command", program=program, cgroup=str(self.path),
                        error=exc.strerror or str(exc))


@dataclass
class _Output:
    """What a child wrote: its stdout (up to the cap), the tail of its stderr."""

    stdout: bytearray
    stderr: bytearray
    overflow: bool = False
    stderr_cut: bool = False


@dataclass
class _Fds:
    """The pipe ends replyd keeps for one call (non-blocking), each closed exactly once."""

    fds: dict[str, int] = field(default_factory=dict)

    def open(self, name: str) -> tuple[int, int]:
        """Make a pipe; keep the end named ``name`` ('r' or 'w' suffix), return (read end, write end)."""
        r, w = os.pipe()
        self.fds[name] = r if name.endswith("_r") else w
        os.set_blocking(self.fds[name], False)
        return r, w

    def close(self, name: str) -> None:
        """Close the end named ``name`` if it is still open."""
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        """Close every end still open."""
        for name in list(self.fds):
            self.close(name)


async def _ready(fd: int, *, write: bool) -> None:
    """Wait until ``fd`` can be read (or written) without blocking."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: None if fut.done() else fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)


async def _read(fd: int) -> bytes:
    """The next chunk from the non-blocking pipe ``fd``; b"" at EOF."""
    while True:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            await _ready(fd, write=False)


def _read_now(fd: int) -> bytes:
    """Everything the non-blocking pipe ``fd`` holds now."""
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    return data


async def _feed(fds: _Fds, data: bytes) -> None:
    """Write ``data`` to the child's stdin and close it; a child that does not read it is fine."""
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fds.fds["stdin_w"], view):]
            except BlockingIOError:
                await _ready(fds.fds["stdin_w"], write=True)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        fds.close("stdin_w")


async def _stderr_tail(fd: int, out: _Output) -> None:
    """Drain the child's stderr, keeping its last ``_STDERR_KEEP`` bytes."""
    while chunk := await _read(fd):
        out.stderr += chunk
        if len(out.stderr) > _STDERR_KEEP:
            del out.stderr[: len(out.stderr) - _STDERR_KEEP]
            out.stderr_cut = True


def _signal(pid: int, sig: int, *, group: bool = False) -> None:
    """Send ``sig`` to ``pid`` (or its process group); one already gone is fine."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _wait(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``proc`` to exit and be reaped."""
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        pass


@dataclass
class _End:
    """What the supervisor reported: the command's exit code, or why it could not start."""

    code: int | None = None
    spawn_error: str | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> _End:
        """Read the supervisor's status lines (see ``supervise.py``)."""
        end = cls()
        for line in text.splitlines():
            word, _, rest = line.partition(" ")
            if word == "exit":
                end.code = int(rest)
            elif word == "spawn-failed":
                end.spawn_error = rest
            elif word != "stopped" and line != "cgroup ok":
                end.notes.append(line)
        return end


@dataclass
class _Call:
    """One call's pipes, cgroup and what its supervisor reported so far."""

    fds: _Fds = field(default_factory=_Fds)
    cgroup: _CallCgroup | None = None
    status: str = ""

    def read_status(self) -> None:
        """Take in the status lines the supervisor has written by now."""
        self.status += _read_now(self.fds.fds["status_r"]).decode("utf-8", "replace")

    def finished(self) -> bool:
        """Whether the supervisor reported the end (after its cleanup): nothing of the call is left."""
        return any(line.split(" ", 1)[0] in ("exit", "spawn-failed", "stopped") for line in self.status.splitlines())


class CommandResponder:
    """Runs a program (argv, never a shell) with the parent as JSON on stdin; its stdout is the reply.

    Empty or whitespace-only stdout declines; trailing newlines are stripped. A
    non-zero exit, a timeout, invalid UTF-8 or more than ``max_output_bytes`` is a
    ``ResponderError``. The child gets a fresh environment (``CHILD_ENV`` plus
    ``env_pass``) and runs under the supervisor (see the module docstring): every
    process it started is killed and reaped whenever it ends (reply, error, timeout,
    overflow or cancellation), and the call returns within about 1 s of its timeout.
    """

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 30.0, env_pass: Sequence[str] = (),
                 cwd: str | None = None, max_output_bytes: int = 64 * 1024, containment: Containment = "auto") -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.env_pass = tuple(env_pass)
        self.cwd = cwd
        self.max_output_bytes = max_output_bytes
        self.program = Path(self.argv[0]).name
        self.name = f"command {self.program}"
        base, why = cgroup_parent() if containment != "subreaper" else (None, "subreaper chosen")
        if containment == "cgroup" and base is None:
            raise ConfigError(f"responder.containment: 'cgroup' is not available here: {why}")
        self._cgroups = base
        self.containment = "cgroup" if base is not None else "subreaper"
        log.info("replyd.responder.contained", responder="command", program=self.program, containment=self.containment,
                 why=why)

    def __repr__(self) -> str:
        return f"CommandResponder(program={self.program!r}, timeout_s={self.timeout_s:g})"

    def child_env(self) -> dict[str, str]:
        """The child's complete environment: ``CHILD_ENV`` and ``env_pass`` variables that are set."""
        return {k: os.environ[k] for k in (*CHILD_ENV, *self.env_pass) if k in os.environ}

    async def respond(self, parent: Parent) -> str | None:
        """Run the command once for ``parent``; return its stdout (empty declines); raise ResponderError."""
        payload = responder_payload(parent)  # before any process: a parent it cannot encode starts none
        call = _Call()
        out = _Output(bytearray(), bytearray())
        try:
            if self._cgroups is not None:
                call.cgroup = self._new_cgroup()
            proc = await self._spawn(call)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await asyncio.gather(self._stdout(proc, call.fds.fds["stdout_r"], out),
                                         _stderr_tail(call.fds.fds["stderr_r"], out),
                                         _feed(call.fds, payload), self._after_exit(proc, call))
            except TimeoutError:
                raise ResponderError(f"{self.name}: timed out after {self.timeout_s:g} s (killed)") from None
            finally:
                # Always, whatever the command did: kill what is left of the call, reap the supervisor.
                end = await self._end(proc, call)
                self._log_stderr(end.code, out)
        finally:
            call.fds.close_all()
        return self._reply(end, out)

    def _new_cgroup(self) -> _CallCgroup | None:
        """The call's cgroup, or None (logged) when it cannot be made now: the subreaper still contains the call."""
        assert self._cgroups is not None
        try:
            return _CallCgroup(self._cgroups)
        except OSError as exc:
            log.warning("replyd.responder.cgroup_failed", responder="command", program=self.program,
                        error=exc.strerror or str(exc))
            return None

    async def _spawn(self, call: _Call) -> asyncio.subprocess.Process:
        """Start the supervisor (in a session of its own) running the command on pipes replyd owns."""
        fds = call.fds
        child_ends = [fds.open("stdin_w")[0], fds.open("stdout_r")[1], fds.open("stderr_r")[1], fds.open("status_r")[1]]
        stdin, stdout, stderr, status = child_ends
        argv = [sys.executable, "-I", "-S", SUPERVISOR, str(status), str(os.getpid()),
                str(call.cgroup.path) if call.cgroup else "-", "--", *self.argv]
        try:
            return await asyncio.create_subprocess_exec(
                *argv, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=(status,), env=self.child_env(),
                cwd=self.cwd, start_new_session=True)
        except OSError as exc:
            if call.cgroup is not None:
                await call.cgroup.end(self.program)
            raise ResponderError(f"{self.name}: cannot start: {exc.strerror or exc}") from None
        finally:
            for fd in child_ends:  # the child has its copies: EOF on each comes when the call's processes are gone
                os.close(fd)

    async def _after_exit(self, proc: asyncio.subprocess.Process, call: _Call) -> None:
        """Wait for the supervisor to exit; then kill at once what is left of the call (it would hold the pipes).

        Normally nothing is: the supervisor killed it. But a command that killed its
        supervisor leaves its processes to the cgroup (or, without one, to its group).
        """
        await proc.wait()
        call.read_status()
        if call.cgroup is not None:
            call.cgroup.kill()
        if not call.finished():
            _signal(proc.pid, signal.SIGKILL, group=True)

    async def _end(self, proc: asyncio.subprocess.Process, call: _Call) -> _End:
        """Kill whatever is left of the call and reap the supervisor, in at most about 0.8 s; its report."""
        if proc.returncode is None:
            _signal(proc.pid, signal.SIGTERM)  # the supervisor kills and reaps every descendant, then exits
            await _wait(proc, _GRACE_S)
        call.read_status()
        if call.cgroup is not None:
            await call.cgroup.end(self.program)  # whatever is still in the call's cgroup, the supervisor included
        if proc.returncode is None or not call.finished():
            # A supervisor stuck, or killed before its cleanup: its process group (the command's) by hand.
            _signal(proc.pid, signal.SIGKILL, group=True)
            _signal(proc.pid, signal.SIGKILL)
            await _wait(proc, _REAP_S)
            if proc.returncode is None:
                log.warning("replyd.responder.unreaped", responder="command", program=self.program, pid=proc.pid)
        end = _End.parse(call.status)
        for note in end.notes:
            log.warning("replyd.responder.containment_degraded", responder="command", program=self.program, note=note)
        return end

    async def _stdout(self, proc: asyncio.subprocess.Process, fd: int, out: _Output) -> None:
        """Read stdout up to the cap; past it, flag the overflow and stop the call."""
        while chunk := await _read(fd):
            out.stdout += chunk
            if len(out.stdout) > self.max_output_bytes:
                out.overflow = True
                _signal(proc.pid, signal.SIGTERM)  # the supervisor kills the tree; stderr and wait then end
                return

    def _stderr_text(self, out: _Output) -> str:
        """The kept stderr, decoded leniently, secrets masked (a cut first line is dropped)."""
        text = out.stderr.decode("utf-8", "replace")
        if out.stderr_cut and "\n" in text:
            text = text.split("\n", 1)[1]  # the cut may have split a secret: drop the partial line
        return rlog.mask(text)

    def _log_stderr(self, code: int | None, out: _Output) -> None:
        """Log what the child wrote to stderr (always, if anything), truncated and masked."""
        if not out.stderr.strip():
            return
        log.info("replyd.responder.stderr", responder="command", program=self.program, exit_code=code,
                 stderr=self._stderr_text(out)[-_STDERR_LOG:])

    def _reply(self, end: _End, out: _Output) -> str | None:
        """Turn the finished child's exit code and output into the reply; raise ResponderError."""
        if end.spawn_error is not None:
            raise ResponderError(f"{self.name}: cannot start: {end.spawn_error}")
        if out.overflow:
            raise ResponderError(f"{self.name}: wrote more than {self.max_output_bytes} bytes to stdout (killed)")
        code = end.code
        if code != 0:
            lines = [ln.strip() for ln in self._stderr_text(out).splitlines() if ln.strip()]
            tail = " | ".join(lines[-3:])[-_STDERR_ERROR:]
            if code is None:
                how = "was killed before it finished (its supervisor died)"
            else:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise ResponderError(f"{self.name}: {how}" + (f"; stderr: {tail}" if tail else "; no stderr"))
        try:
            text = out.stdout.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ResponderError(f"{self.name}: stdout is not valid UTF-8 (at byte {exc.start})") from None
        return declined(text.rstrip("\r\n"))


def _env_name(name: str) -> str:
    """Refuse a string that cannot name an environment variable."""
    if not _ENV_NAME.match(name):
        raise ValueError("must be an environment variable name (letters, digits, '_'; not starting with a digit)")
    return name


def _argv(value: Any) -> Any:
    """Refuse a command written as one string (it would need a shell) or an empty one, before the type check."""
    if isinstance(value, str):
        raise ValueError("must be a list of strings (argv), not a string: replyd runs no shell, so write e.g. "
                         'command = ["python3", "bot.py", "--flag"]')
    if isinstance(value, list) and not value:
        raise ValueError("required: a non-empty list of strings (argv)")
    return value


def _directory(cwd: str) -> str:
    """Refuse a ``cwd`` that is not an existing directory."""
    if not Path(cwd).is_dir():
        raise ValueError(f"must name an existing directory, got {cwd!r}")
    return cwd


class CommandSettings(ResponderSettings):
    """The ``command`` kind's settings."""

    kind: ClassVar[str] = "command"

    command: Annotated[list[str], BeforeValidator(_argv)] = Field(description="a non-empty list of strings (argv)")
    timeout_s: TimeoutS = 30.0
    env_pass: list[Annotated[str, AfterValidator(_env_name)]] = []
    cwd: Annotated[str, AfterValidator(_directory)] | None = None
    max_output_bytes: int = Field(64 * 1024, ge=1, le=16 * 1024 * 1024)
    containment: Containment = "auto"

    @model_validator(mode="after")
    def _program(self) -> CommandSettings:
        """Each argument without NUL; the program non-empty and an executable file (on PATH when it has no slash)."""
        for i, arg in enumerate(self.command):
            if "\0" in arg or (i == 0 and not arg):
                raise ValueError(f"command[{i}]: must be a {'non-empty ' if i == 0 else ''}string without NUL")
        program = self.command[0]
        if "/" in program:
            path = Path(self.cwd or ".") / program
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ValueError(f"command[0]: {program!r} is not an executable file")
        elif shutil.which(program, path=os.environ.get("PATH", os.defpath)) is None:
            raise ValueError(f"command[0]: program {program!r} not found on PATH")
        if self.containment == "cgroup" and cgroup_parent()[0] is None:
            raise ValueError(f"containment: 'cgroup' is not available here: {cgroup_parent()[1]}")
        return self


@register_responder("command")
def _command(settings: Mapping[str, Any]) -> Responder:
    """Build a ``command`` responder from its settings; raise ConfigError."""
    s = CommandSettings.parse(settings)
    return CommandResponder(s.command, timeout_s=s.timeout_s, env_pass=s.env_pass, cwd=s.cwd,
                            max_output_bytes=s.max_output_bytes, containment=s.containment)
