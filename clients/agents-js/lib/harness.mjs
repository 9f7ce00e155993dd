// What every SDK's test shares: the simulated platform, a replyd config, the naive post and the counts.
// REPLYD_PYTHON names a Python that imports replyd (default: the checkout's .venv).
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));
/** The repository root: the tests run this checkout's replyd (PYTHONPATH), whatever the venv installed. */
export const ROOT = resolve(HERE, "../../..");
export const PYTHON = process.env.REPLYD_PYTHON ?? resolve(HERE, "../../../.venv/bin/python");
export const BOT = "mastodon";
const BOT_TOKEN = "sim-token-replybot";

/** Starts `python -m replyd.sim` and writes a replyd config for `replyd mcp`. */
export async function startSim() {
  const dir = mkdtempSync(join(tmpdir(), "replyd-agents-js-"));
  const env = { ...process.env, HOME: dir, XDG_STATE_HOME: join(dir, "state"),
                PYTHONPATH: [ROOT, process.env.PYTHONPATH].filter(Boolean).join(":") };
  const logs = [];
  const proc = spawn(PYTHON, ["-m", "replyd.sim", "--port", "0", "--account", `replybot:${BOT_TOKEN}:bot`,
                              "--account", "alice", "--listing-delay-s", "0"],
                     { cwd: dir, env, stdio: ["ignore", "pipe", "pipe"] });
  proc.stdout.on("data", (b) => logs.push(b.toString()));
  proc.stderr.on("data", (b) => logs.push(b.toString()));
  const url = await new Promise((ok, fail) => {
    const timer = setTimeout(() => fail(new Error(`sim: no SIM_URL in 60 s\n${logs.join("")}`)), 60_000);
    proc.on("exit", (code) => fail(new Error(`sim: exited ${code} (REPLYD_PYTHON=${PYTHON})\n${logs.join("")}`)));
    proc.stdout.on("data", () => {
      const m = /SIM_URL=(\S+)/.exec(logs.join(""));
      if (m) { clearTimeout(timer); ok(m[1]); }
    });
  });
  const config = join(dir, "replyd.toml");
  writeFileSync(config, `
[store]
url = "sqlite:///${dir}/replyd.sqlite3"

[log]
level = "warning"

[[bots]]
name = "${BOT}"
platform = "mastodon"

[bots.settings]
base_url = "${url}"
token_env = "MASTODON_TOKEN"
listing_delay_s = 0.5
`);

  async function sim(path, body) {
    const res = await fetch(`${url}${path}`, body === undefined ? {} : { method: "POST", body: JSON.stringify(body) });
    if (res.status !== 200) throw new Error(`${path}: HTTP ${res.status} ${await res.text()}`);
    return res.json();
  }

  return {
    url,
    config,
    /** `replyd mcp --config …` over stdio: the command, its arguments and its environment. */
    mcp: { command: PYTHON, args: ["-m", "replyd", "mcp", "--config", config],
           env: { ...env, MASTODON_TOKEN: BOT_TOKEN } },
    /** A post by alice that mentions the bot: the parent an agent answers. */
    async newParent(text = "@replybot is this on?") {
      return String((await sim("/_sim/posts", { account: "alice", text, mention: ["replybot"] })).id);
    },
    /** The naive tool's body: the platform's own API, as the bot. */
    async postDirectly({ parent, text }) {
      const res = await fetch(`${url}/api/v1/statuses`, {
        method: "POST",
        headers: { authorization: `Bearer ${BOT_TOKEN}`, "content-type": "application/json" },
        body: JSON.stringify({ status: text, in_reply_to_id: parent }),
      });
      return res.ok ? "sent" : `HTTP ${res.status}`;
    },
    /** The replies the platform itself counts under a parent (every account). */
    async repliesTo(parent) {
      const counts = (await sim("/_sim/report")).parents[parent] ?? {};
      return Object.values(counts).reduce((a, b) => a + b, 0);
    },
    async stop() {
      if (proc.exitCode === null) {
        const gone = new Promise((r) => proc.once("exit", r));
        proc.kill("SIGTERM");
        await gone;
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** The status in a reply_once result, whether it came back as an object or as its JSON text. */
export function statusOf(result) {
  if (typeof result === "string") {
    try { return statusOf(JSON.parse(result)); } catch { return result; }
  }
  if (Array.isArray(result)) {
    for (const part of result) {
      const s = statusOf(part);
      if (s) return s;
    }
    return undefined;
  }
  if (typeof result?.text === "string") return statusOf(result.text); // an MCP text content part
  return result?.structuredContent?.status ?? result?.status ?? undefined;
}

/** The error a test throws to stand for a worker that died. */
export class WorkerDied extends Error {
  constructor(where) {
    super(`the worker died ${where}`);
    this.name = "WorkerDied";
  }
}
