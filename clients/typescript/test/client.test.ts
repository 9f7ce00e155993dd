// Runs the client against a real `replyd run` on the simulated platform (python -m replyd.sim).
// REPLYD_PYTHON names a Python that can import replyd (default python3).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Processes, freePort } from "@replyd/testkit";
import { Replyd, type PostResult } from "../src/index.js";

const PYTHON = process.env.REPLYD_PYTHON ?? "python3";
const TOKEN = "ts-client-test-token";
let procs: Processes;
let dir = "";
let simUrl = "";
let apiUrl = "";

async function sim(path: string, body?: unknown): Promise<any> {
  const res = await fetch(`${simUrl}${path}`, body === undefined ? {} : { method: "POST", body: JSON.stringify(body) });
  assert.equal(res.status, 200, `${path}: ${await res.clone().text()}`);
  return res.json();
}

/** A parent nobody mentions the bot in: only the API answers it. */
async function newParent(): Promise<string> {
  return String((await sim("/_sim/posts", { account: "alice", text: "a post for the client" })).id);
}

/** The replies the platform itself counts under a parent (every account). */
async function repliesTo(parentId: string): Promise<number> {
  const counts: Record<string, number> = (await sim("/_sim/report")).parents[parentId] ?? {};
  return Object.values(counts).reduce((a, b) => a + b, 0);
}

function outcome(r: PostResult) {
  assert.ok(r.ok, `expected ok, got ${JSON.stringify(r)}`);
  return r;
}

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "replyd-ts-"));
  const env = { ...process.env, HOME: dir, XDG_STATE_HOME: join(dir, "state"), SIM_TOKEN: "sim-token-replybot",
                REPLYD_API_TOKEN: TOKEN };
  procs = new Processes({ python: PYTHON, cwd: dir, env });
  const simProc = procs.start(["-m", "replyd.sim", "--port", "0", "--account", "replybot:sim-token-replybot:bot",
                               "--account", "alice", "--listing-delay-s", "0"]);
  simUrl = await procs.waitFor("sim", simProc, async () => /SIM_URL=(\S+)/.exec(procs.logs.join(""))?.[1]);
  const port = await freePort();
  apiUrl = `http://127.0.0.1:${port}`;
  writeFileSync(join(dir, "replyd.toml"), `
[guard]
max_attempts = 2
[sweep]
interval_s = 1.0
[[bots]]
name = "sim"
platform = "mastodon"
[bots.settings]
base_url = "${simUrl}"
token_env = "SIM_TOKEN"
listing_delay_s = 0.2
idempotency = true
[bots.pollers]
inbox_interval_s = 0
search_interval_s = 0
refind_interval_s = 0
[bots.responder]
kind = "template"
template = "not used: the pollers are off"
[api]
enabled = true
host = "127.0.0.1"
port = ${port}
token_env = "REPLYD_API_TOKEN"
`);
  const run = procs.start(["-m", "replyd", "run", "--config", "replyd.toml"]);
  await procs.waitFor("replyd run", run, async () =>
    (await fetch(`${apiUrl}/readyz`, { headers: { authorization: `Bearer ${TOKEN}` } })).status === 200);
});

after(async () => {
  await procs?.stopAll();
  rmSync(dir, { recursive: true, force: true });
});

test("a post, then the same post again: one reply, the same id", async () => {
  const client = new Replyd({ baseUrl: apiUrl, token: TOKEN });
  const parentId = await newParent();
  const first = outcome(await client.post({ platform: "sim", parentId, text: "Thanks!" }));
  assert.equal(first.status, 201);
  assert.equal(first.outcome.status, "posted");
  assert.ok(first.outcome.reply_id);
  const again = outcome(await client.post({ platform: "sim", parentId, text: "Thanks, reworded" }));
  assert.equal(again.status, 200);
  assert.equal(again.outcome.status, "already_answered");
  assert.equal(again.outcome.reply_id, first.outcome.reply_id);
  assert.equal(await repliesTo(parentId), 1);
});

test("compose is called once across concurrent posts and a later one", async () => {
  const client = new Replyd({ baseUrl: apiUrl, token: TOKEN });
  const parentId = await newParent();
  let calls = 0;
  const compose = async () => {
    calls += 1;
    await new Promise((r) => setTimeout(r, 100));
    return "Composed once.";
  };
  const [a, b] = await Promise.all([client.post({ platform: "sim", parentId, compose }),
                                    client.post({ platform: "sim", parentId, compose })]);
  assert.equal(calls, 1);
  assert.equal(outcome(a).outcome.status, "posted");
  assert.equal(outcome(b).outcome.reply_id, outcome(a).outcome.reply_id);
  const later = outcome(await client.post({ platform: "sim", parentId, compose }));
  assert.equal(later.outcome.status, "already_answered");
  assert.equal(later.composed, false);
  assert.equal(calls, 1);
  assert.equal(await repliesTo(parentId), 1);
});

test("a retry after not_sent sends the composed text without composing again", async () => {
  const client = new Replyd({ baseUrl: apiUrl, token: TOKEN });
  const parentId = await newParent();
  let calls = 0;
  const compose = () => { calls += 1; return `Answer ${calls}.`; };
  await sim("/_sim/config", { retry_after_s: 1 });
  await sim("/_sim/faults", { next_creates: ["rate_limit_429"] });
  const refused = await client.post({ platform: "sim", parentId, compose });
  assert.equal(refused.ok, false);
  assert.ok(!refused.ok && refused.error.code === "not_sent" && refused.error.status === 429, JSON.stringify(refused));
  assert.ok(!refused.ok && refused.error.retryAfterS);
  let retried: PostResult = refused;
  for (let i = 0; i < 20 && !retried.ok; i++) {
    await new Promise((r) => setTimeout(r, 500));
    retried = await client.post({ platform: "sim", parentId, compose });
  }
  assert.equal(outcome(retried).outcome.status, "posted");
  assert.equal(calls, 1);
  assert.equal(await repliesTo(parentId), 1);
});

test("check: the row when answered, null when free", async () => {
  const client = new Replyd({ baseUrl: apiUrl, token: TOKEN });
  const parentId = await newParent();
  const free = await client.check("sim", parentId);
  assert.ok(free.ok);
  assert.equal(free.history, null);
  const posted = outcome(await client.post({ platform: "sim", parentId, text: "Checked." }));
  const seen = await client.check("sim", parentId);
  assert.ok(seen.ok && seen.history !== null);
  assert.equal(seen.history.row.state, "closed");
  assert.equal(seen.history.row.reply_id, posted.outcome.reply_id);
});

test("refusals and failures are typed values, never thrown", async () => {
  const parentId = await newParent();
  const wrong = await new Replyd({ baseUrl: apiUrl, token: "not-the-token" }).post({ platform: "sim", parentId,
                                                                                     text: "x" });
  assert.deepEqual(wrong.ok ? null : [wrong.error.code, wrong.error.status], ["unauthorized", 401]);
  const client = new Replyd({ baseUrl: apiUrl, token: TOKEN });
  const nobody = await client.post({ platform: "nosuchbot", parentId, text: "x" });
  assert.deepEqual(nobody.ok ? null : [nobody.error.code, nobody.error.status, nobody.error.field],
                   ["unknown_platform", 404, "platform"]);
  outcome(await client.post({ platform: "sim", parentId, text: "Once." }));
  const rearm = await client.rearm("sim", parentId);
  assert.deepEqual(rearm.ok ? null : [rearm.error.code, rearm.error.status], ["not_rearmable", 409]);
  const confirm = await client.confirm("sim", parentId);
  assert.deepEqual(confirm.ok ? null : [confirm.error.code, confirm.error.status], ["not_unconfirmed", 409]);
  const down = await new Replyd({ baseUrl: `http://127.0.0.1:${await freePort()}`, token: TOKEN })
    .post({ platform: "sim", parentId, text: "x" });
  assert.deepEqual(down.ok ? null : [down.error.code, down.error.status], ["network_error", 0]);
  assert.equal(await repliesTo(parentId), 1);
});
