"""Run the examples of README.md and docs/*.md as written, from outside the checkout.

A fenced block is runnable when the line before its fence is ``<!-- runnable -->`` (an HTML comment: it
renders as nothing). ``<!-- runnable: needs-daemon -->`` marks a ``sh`` block that talks to a running
daemon: the harness starts the simulated platform (``python -m replyd.sim``) and ``replyd run`` with the
API on, as ``config/demo.toml`` describes, and gives the block ``$REPLYD_API_TOKEN`` and ``$PARENT_ID``
(a post mentioning the bot).

Each python block runs in a fresh temporary directory outside the checkout, with a clean environment.
Only the ``replyd`` package is importable from the checkout: its test suite (``tests``) is not, even
when an editable install put the checkout on ``sys.path``. When "prints" and a plain fenced block follow
a block, its stdout must be that text. Every python block, marked or not, must compile.

    python tools/doc_examples.py                 # every doc
    python tools/doc_examples.py docs/MCP.md     # some docs
    python tools/doc_examples.py -k telegram     # the blocks whose text contains a word

One line per example (``file:line ok|FAILED seconds``); the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*runnable(?::\s*([\w-]+))?\s*-->\s*$")
TIMEOUT_S = 120.0
API_PORT, SIM_PORT = 8787, 8790  # the ports docs/API.md and docs/SIM.md write (config/demo.toml's)
API_TOKEN = "docs-example-api-token"

# Runs the example file as __main__ after taking off sys.path every directory holding a ``tests`` package:
# an editable install adds the checkout's root, and an example must not lean on the test suite.
BOOT = """\
import os, runpy, sys
sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or os.getcwd(), "tests", "__init__.py"))]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class Block:
    """One fenced block: where it starts, its language and text, its marker, the output it promises."""

    path: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    mode: str | None  # None: not runnable; "" runnable; else the marker's word ("needs-daemon")
    expect: str | None = None

    @property
    def where(self) -> str:
        """``file:line``, relative to the checkout when inside it."""
        try:
            return f"{self.path.resolve().relative_to(ROOT)}:{self.line}"
        except ValueError:
            return f"{self.path}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with their markers and "prints" blocks."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        start, ticks, lang = i, fence.group(1), fence.group(2)
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            j += 1
        before = start - 1
        marker = MARKER.match(lines[before]) if before >= 0 else None
        found.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                           None if marker is None else (marker.group(1) or "")))
        i = j + 1
        if lang:
            k = _skip_blank(lines, i)
            if k < len(lines) and lines[k].strip() == "prints":
                k = _skip_blank(lines, k + 1)
                if k < len(lines) and lines[k].strip() == "```":
                    end = k + 1
                    while end < len(lines) and lines[end].strip() != "```":
                        end += 1
                    found[-1].expect = "\n".join(lines[k + 1:end]) + "\n"
                    i = end + 1
    return found


def _skip_blank(lines: list[str], i: int) -> int:
    while i < len(lines) and not lines[i].strip():
        i += 1
    return i


def _free(port: int) -> int:
    """``port`` when nothing listens on it, else any free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])


class Sandbox:
    """A temporary directory outside the checkout, an importable ``replyd`` (the checkout's) and a clean env."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.dir = Path(tempfile.mkdtemp(prefix="replyd-doc-examples-"))
        if self.dir.resolve().is_relative_to(ROOT):
            raise SystemExit(f"doc_examples: the temporary directory {self.dir} is inside the checkout")
        site = self.dir / "site"
        site.mkdir()
        (site / "replyd").symlink_to(ROOT / "replyd", target_is_directory=True)
        bin_dir = str(Path(python).parent)
        self.env = {"PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "/usr/bin:/bin")]),
                    "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8",
                    "TMPDIR": tempfile.gettempdir()}
        self.daemon: Daemon | None = None

    def workdir(self, name: str) -> Path:
        """A fresh directory for one example; its HOME and XDG state too."""
        d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.dir))
        return d

    def close(self) -> None:
        """Stop the daemon and remove the directory."""
        if self.daemon is not None:
            self.daemon.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Daemon:
    """The simulated platform and ``replyd run`` with its API, as config/demo.toml sets them up."""

    def __init__(self, box: Sandbox) -> None:
        self.box = box
        self.dir = box.workdir("daemon")
        self.sim_port, self.api_port = _free(SIM_PORT), _free(API_PORT)
        self.env = {**box.env, "HOME": str(self.dir), "XDG_STATE_HOME": str(self.dir / "state"),
                    "SIM_TOKEN": "sim-token-replybot", "REPLYD_API_TOKEN": API_TOKEN}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = self.dir / "daemon.log"
        self.failed = ""  # why the start failed: later blocks fail at once with it

    def start(self) -> Daemon:
        """Start the sim and the daemon; wait until the API answers; post the parent the examples use."""
        if self.failed:
            raise RuntimeError(self.failed)
        try:
            return self._start()
        except (OSError, RuntimeError, ValueError) as exc:
            self.failed = f"the daemon did not start: {exc}"
            raise RuntimeError(self.failed) from exc

    def _start(self) -> Daemon:
        if self.procs:
            return self
        out = self.log.open("ab")
        sim = subprocess.Popen([self.box.python, "-m", "replyd.sim", "--port", str(self.sim_port),
                                "--account", "replybot:sim-token-replybot:bot", "--account", "alice",
                                "--listing-delay-s", "0.5"], cwd=self.dir, env=self.env, stdout=out, stderr=out)
        self.procs.append(sim)
        self._wait(f"http://127.0.0.1:{self.sim_port}/api/v1/instance", sim)
        config = (ROOT / "config" / "demo.toml").read_text()
        config = config.replace("127.0.0.1:8790", f"127.0.0.1:{self.sim_port}")
        config = config.replace(f"port = {API_PORT}", f"port = {self.api_port}")
        (self.dir / "replyd.toml").write_text(config)
        run = subprocess.Popen([self.box.python, "-m", "replyd", "run", "--config", "replyd.toml"],
                               cwd=self.dir, env=self.env, stdout=out, stderr=out)
        self.procs.append(run)
        self._wait(f"http://127.0.0.1:{self.api_port}/healthz", run)
        req = urllib.request.Request(f"http://127.0.0.1:{self.sim_port}/_sim/posts", method="POST",
                                     data=json.dumps({"account": "alice", "text": "@replybot a question?",
                                                      "mention": ["replybot"]}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            self.env["PARENT_ID"] = str(json.load(r)["id"])
        time.sleep(1.0)  # past the sim's listing delay (0.5 s): before it, reading the post answers 404
        return self

    def _wait(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode} before serving {url}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # an answer (401, 404): it serves
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{url} did not answer within 60 s:\n{self.log.read_text()[-3000:]}")

    def adapt(self, code: str) -> str:
        """The block with the doc's ports replaced by the ones in use (the same unless those were taken)."""
        return code.replace(f":{SIM_PORT}", f":{self.sim_port}").replace(f":{API_PORT}", f":{self.api_port}")

    def stop(self) -> None:
        """SIGTERM both, the daemon first."""
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def run_block(block: Block, box: Sandbox) -> str | None:
    """Run one runnable block; None when it passed, else why it failed."""
    if block.lang == "python":
        d = box.workdir("example")
        (d / "example.py").write_text(block.code)
        argv = [box.python, "-c", BOOT, "example.py"]
        env = {**box.env, "HOME": str(d), "XDG_STATE_HOME": str(d / "state")}
    elif block.lang in ("sh", "bash"):
        if block.mode == "needs-daemon":
            if box.daemon is None:
                box.daemon = Daemon(box)  # kept first: close() stops what a failed start left running
            box.daemon.start()
            d, env, code = box.daemon.dir, box.daemon.env, box.daemon.adapt(block.code)
        else:
            d = box.workdir("example")
            env, code = {**box.env, "HOME": str(d)}, block.code
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        return f"cannot run a {block.lang or 'plain'} block"
    try:
        got = subprocess.run(argv, cwd=d, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"timed out after {TIMEOUT_S:.0f} s"
    if got.returncode != 0:
        return f"exit {got.returncode}\n{got.stdout[-2000:]}{got.stderr[-4000:]}"
    if block.expect is not None and got.stdout != block.expect:
        diff = difflib.unified_diff(block.expect.splitlines(), got.stdout.splitlines(), "prints (the doc)",
                                    "stdout", lineterm="")
        return "output differs:\n" + "\n".join(diff) + ("\n" + got.stderr[-2000:] if got.stderr else "")
    return None


def docs() -> list[Path]:
    """README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    """Compile every python block, run the runnable ones; one line each; 1 when any failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md)")
    ap.add_argument("-k", dest="word", default="", help="run only the blocks whose text contains this")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with replyd's dependencies")
    args = ap.parse_args(argv)
    found = [b for f in (args.files or docs()) for b in blocks(f)]
    failed, broken = 0, set()
    for b in found:
        if b.lang != "python":
            continue
        try:
            compile(b.code, b.where, "exec")
        except SyntaxError as exc:
            failed += 1
            broken.add(b.where)
            print(f"{b.where} FAILED compile: {exc.msg} (line {exc.lineno} of the block)", flush=True)
    box = Sandbox(args.python)
    try:
        for b in found:
            if b.mode is None or b.where in broken or args.word not in b.code:
                continue
            t0 = time.monotonic()
            try:
                why = run_block(b, box)
            except RuntimeError as exc:
                why = f"setup: {exc}"
            took = time.monotonic() - t0
            if why is None:
                print(f"{b.where} ok {took:.1f}s", flush=True)
            else:
                failed += 1
                print(f"{b.where} FAILED {took:.1f}s: {why.rstrip()}", flush=True)
    finally:
        box.close()
    runnable = sum(b.mode is not None for b in found)
    print(f"doc_examples: {runnable} runnable, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
