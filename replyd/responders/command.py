"""The ``command`` kind: a program (argv, never a shell) with the parent as JSON on stdin; its stdout is the reply."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from replyd import log as rlog
from replyd.errors import ResponderError
from replyd.responders.base import (Parent, Responder, ResponderSettings, TimeoutS, declined, log, register_responder,
                                    responder_payload)

# The child's whole environment is these (when set) plus its ``env_pass``: never replyd's tokens.
CHILD_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_STDERR_KEEP = 8192  # bytes of stderr kept (the tail)
_STDERR_LOG = 2000  # characters of stderr logged
_STDERR_ERROR = 300  # characters of stderr in a ResponderError


@dataclass
class _Output:
    """What a child wrote: its stdout (up to the cap), the tail of its stderr."""

    stdout: bytearray
    stderr: bytearray
    overflow: bool = False
    stderr_cut: bool = False


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's process group (it leads its own session), so its helpers die too, then the child.

    The group outlives its leader while any member lives and its id cannot be reused meanwhile, so this is
    right after the child exited too: ``killpg`` kills the leftovers, or finds no group (the id could only
    name another group after the kernel's pid numbers wrap around within these microseconds).
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes) -> None:
    """Write ``data`` to the child's stdin and close it; a child that does not read it is fine."""
    if stdin is None:
        return
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stdin.close()


async def _stderr_tail(stream: asyncio.StreamReader | None, out: _Output) -> None:
    """Drain the child's stderr, keeping its last ``_STDERR_KEEP`` bytes."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        out.stderr += chunk
        if len(out.stderr) > _STDERR_KEEP:
            del out.stderr[: len(out.stderr) - _STDERR_KEEP]
            out.stderr_cut = True


class CommandResponder:
    """Runs a program (argv, never a shell) with the parent as JSON on stdin; its stdout is the reply.

    Empty or whitespace-only stdout declines; trailing newlines are stripped. A
    non-zero exit, a timeout, invalid UTF-8 or more than ``max_output_bytes`` is a
    ``ResponderError``. The child gets a fresh environment (``CHILD_ENV`` plus
    ``env_pass``), runs in its own session, and its process group is killed
    (and the child reaped) whenever it ends: reply, error, timeout, overflow or
    cancellation, so nothing it started outlives it.
    """

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 30.0, env_pass: Sequence[str] = (),
                 cwd: str | None = None, max_output_bytes: int = 64 * 1024) -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.env_pass = tuple(env_pass)
        self.cwd = cwd
        self.max_output_bytes = max_output_bytes
        self.program = Path(self.argv[0]).name
        self.name = f"command {self.program}"

    def __repr__(self) -> str:
        return f"CommandResponder(program={self.program!r}, timeout_s={self.timeout_s:g})"

    def child_env(self) -> dict[str, str]:
        """The child's complete environment: ``CHILD_ENV`` and ``env_pass`` variables that are set."""
        return {k: os.environ[k] for k in (*CHILD_ENV, *self.env_pass) if k in os.environ}

    async def respond(self, parent: Parent) -> str | None:
        """Run the command once for ``parent``; return its stdout (empty declines); raise ResponderError."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.child_env(), cwd=self.cwd, start_new_session=True)
        except OSError as exc:
            raise ResponderError(f"{self.name}: cannot start: {exc.strerror or exc}") from None
        out = _Output(bytearray(), bytearray())
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(self._stdout(proc, out), _stderr_tail(proc.stderr, out),
                                     _feed(proc.stdin, responder_payload(parent)))
                await proc.wait()
        except TimeoutError:
            raise ResponderError(f"{self.name}: timed out after {self.timeout_s:g} s (killed)") from None
        finally:
            # Always, whatever the main child did: helpers it left in its group (a backgrounded `sleep &`
            # holding stdout, a daemonised tool) die with it. Then reap the main child (no zombie).
            _kill_group(proc)
            await proc.wait()
            self._log_stderr(proc.returncode, out)
        return self._reply(proc.returncode, out)

    async def _stdout(self, proc: asyncio.subprocess.Process, out: _Output) -> None:
        """Read stdout up to the cap; past it, flag the overflow and kill the child."""
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            out.stdout += chunk
            if len(out.stdout) > self.max_output_bytes:
                out.overflow = True
                _kill_group(proc)
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

    def _reply(self, code: int | None, out: _Output) -> str | None:
        """Turn the finished child's exit code and output into the reply; raise ResponderError."""
        if out.overflow:
            raise ResponderError(f"{self.name}: wrote more than {self.max_output_bytes} bytes to stdout (killed)")
        if code != 0:
            lines = [ln.strip() for ln in self._stderr_text(out).splitlines() if ln.strip()]
            tail = " | ".join(lines[-3:])[-_STDERR_ERROR:]
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
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
        return self


@register_responder("command")
def _command(settings: Mapping[str, Any]) -> Responder:
    """Build a ``command`` responder from its settings; raise ConfigError."""
    s = CommandSettings.parse(settings)
    return CommandResponder(s.command, timeout_s=s.timeout_s, env_pass=s.env_pass, cwd=s.cwd,
                            max_output_bytes=s.max_output_bytes)
