// What the JavaScript clients' tests share: Python processes (the sim, a fake, `replyd run`) with their
// logs kept for the error message, a free local port, and waits that fail with the logs' tail.
import { spawn } from "node:child_process";
import { createServer } from "node:net";

/** A TCP port free on 127.0.0.1 now. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.on("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      srv.close(() => resolve(typeof addr === "object" && addr !== null ? addr.port : 0));
    });
  });
}

/** Polls `ok()` every 100 ms until it returns a truthy value, which it returns (throws after `ms`). */
export async function until(what, ok, ms = 20_000) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const got = await ok();
    if (got) return got;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`${what}: not in ${ms / 1000} s`);
}

/** The Python processes of one test file, started in `cwd` with `env`; their output kept in `logs`. */
export class Processes {
  constructor({ python, cwd, env, stdin = "ignore" }) {
    this.python = python;
    this.cwd = cwd;
    this.env = env;
    this.stdin = stdin;
    this.procs = [];
    this.logs = [];
  }

  /** Starts `python ...args` (with `env`, default the one given at construction). */
  start(args, env = this.env) {
    const proc = spawn(this.python, args, { cwd: this.cwd, env, stdio: [this.stdin, "pipe", "pipe"] });
    proc.stdout.on("data", (b) => this.logs.push(b.toString()));
    proc.stderr.on("data", (b) => this.logs.push(b.toString()));
    this.procs.push(proc);
    return proc;
  }

  /** The last `chars` characters of every process's output. */
  tail(chars = 3000) {
    return this.logs.join("").slice(-chars);
  }

  /** Polls `ok()` until it returns a truthy value, which it returns; fails if `proc` exits or after `ms`. */
  async waitFor(what, proc, ok, ms = 60_000) {
    const deadline = Date.now() + ms;
    while (Date.now() < deadline) {
      if (proc && proc.exitCode !== null) {
        throw new Error(`${what}: exited ${proc.exitCode} (python: ${this.python})\n${this.tail()}`);
      }
      const got = await ok().catch(() => undefined);
      if (got) return got;
      await new Promise((r) => setTimeout(r, 100));
    }
    throw new Error(`${what}: not in ${ms / 1000} s\n${this.tail()}`);
  }

  /** Stops every process still running (stdin closed, then SIGTERM) and waits for each to exit. */
  async stopAll() {
    for (const p of this.procs) {
      if (p.exitCode !== null) continue;
      p.stdin?.end();
      p.kill("SIGTERM");
    }
    await Promise.all(this.procs.map((p) => p.exitCode !== null ? null : new Promise((r) => p.once("exit", r))));
  }
}
