// The replyd hooks for openclaw against a real `replyd run` on replyd's Telegram Bot API fake.
// A small gateway loop stands in for openclaw's core: it polls getUpdates, answers each update with the
// channel's `send.text`, keeps a send whose answer was lost as `unknown_after_send`, and replays the update
// when it restarts before confirming the offset. The naive channel sends as grammY does; the other is withReplyd.
// REPLYD_PYTHON names a Python that can import replyd (default python3).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import type { ChannelMessageAdapterShape, ChannelMessageSendResult,
              ChannelMessageUnknownSendContext } from "openclaw/plugin-sdk/channel-message";
import { Replyd } from "@replyd/client";
import { Processes, freePort } from "@replyd/testkit";
import { ReplydNotSentError, createReconcileUnknownSend, receiptFor, withReplyd } from "../src/index.js";

const PYTHON = process.env.REPLYD_PYTHON ?? "python3";
const API_TOKEN = "openclaw-hook-test-token";
const BOT_TOKEN = "7000000001:AAFakeTokenForTestsOnly-0123456789ab";
const HERE = dirname(fileURLToPath(import.meta.url));
let procs: Processes;
let dir = "";
let telegramUrl = "";
let controlUrl = "";
let apiUrl = "";
let replyd: Replyd;

async function control(path: string, body?: unknown): Promise<any> {
  const res = await fetch(`${controlUrl}${path}`, body === undefined ? {} : { method: "POST", body: JSON.stringify(body) });
  assert.equal(res.status, 200, path);
  return res.json();
}

async function replies(parent: string): Promise<number> {
  return (await control("/counts")).replies[parent] ?? 0;
}

async function bot(method: string, body: unknown): Promise<any> {
  const res = await fetch(`${telegramUrl}/bot${BOT_TOKEN}/${method}`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
  const got = await res.json() as { ok: boolean; result?: any; description?: string };
  if (!got.ok) throw new Error(`${method}: ${got.description}`);
  return got.result;
}

/** The naive channel: openclaw's Telegram send as grammY makes it, sendMessage straight to the Bot API. */
const naive: ChannelMessageAdapterShape = {
  send: {
    text: async (ctx): Promise<ChannelMessageSendResult> => {
      const msg = await bot("sendMessage", { chat_id: Number(ctx.to), text: ctx.text,
                                             reply_parameters: { message_id: Number(ctx.replyToId) } });
      const receipt = receiptFor(`${msg.chat.id}:${msg.message_id}`, { replyToId: ctx.replyToId ?? null });
      return { receipt, messageId: String(msg.message_id) };
    },
  },
};

type Delivery = { state: "sent"; result: ChannelMessageSendResult } | { state: "unknown_after_send" | "not_sent"; error: unknown };

/** openclaw's core for one final send: a throw after the send began leaves the intent unknown_after_send. */
async function deliver(adapter: ChannelMessageAdapterShape, to: string, replyToId: string, text: string): Promise<Delivery> {
  try {
    const result = await adapter.send!.text!({ cfg: {} as never, to, text, replyToId, deliveryQueueId: `q-${to}-${replyToId}` });
    return { state: "sent", result };
  } catch (error) {
    return { state: error instanceof ReplydNotSentError ? "not_sent" : "unknown_after_send", error };
  }
}

/** A gateway run: getUpdates from `offset`, answer each message; returns the next offset (not confirmed yet). */
async function gatewayRun(adapter: ChannelMessageAdapterShape, chatId: number, offset?: number):
  Promise<{ next: number | undefined; deliveries: Delivery[] }> {
  const updates: any[] = await bot("getUpdates", offset === undefined ? { timeout: 0 } : { offset, timeout: 0 });
  const deliveries: Delivery[] = [];
  let next = offset;
  for (const u of updates) {
    next = u.update_id + 1;
    if (u.message?.chat?.id !== chatId) continue;
    deliveries.push(await deliver(adapter, String(chatId), String(u.message.message_id), `echo: ${u.message.text}`));
  }
  return { next, deliveries };
}

function unknownCtx(to: string, replyToId: string): ChannelMessageUnknownSendContext {
  return { cfg: {} as never, queueId: `q-${to}-${replyToId}`, channel: "telegram", to, enqueuedAt: Date.now(),
           retryCount: 0, effectiveReplyToId: replyToId, payloads: [{ text: "echo" }] };
}

async function rowState(parent: string): Promise<string | null> {
  const got = await replyd.check("telegram", parent);
  assert.ok(got.ok);
  return got.history?.row.state ?? null;
}

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "replyd-openclaw-"));
  const env = { ...process.env, HOME: dir, XDG_STATE_HOME: join(dir, "state"), REPLYD_API_TOKEN: API_TOKEN,
                TELEGRAM_BOT_TOKEN: BOT_TOKEN };
  procs = new Processes({ python: PYTHON, cwd: dir, env });
  const fake = procs.start([join(HERE, "..", "..", "test", "telegram_fake.py")]);
  [telegramUrl, controlUrl] = await procs.waitFor("telegram fake", fake, async () => {
    const m = /TELEGRAM_URL=(\S+) CONTROL_URL=(\S+)/.exec(procs.logs.join(""));
    return m?.[1] !== undefined && m[2] !== undefined ? [m[1], m[2]] as const : undefined;
  });
  const port = await freePort();
  apiUrl = `http://127.0.0.1:${port}`;
  writeFileSync(join(dir, "replyd.toml"), `
[store]
url = "sqlite:///${dir}/replyd.sqlite3"
[guard]
send_timeout_s = 1.0
[sweep]
interval_s = 0.5
[[bots]]
name = "telegram"
platform = "telegram"
[bots.settings]
token_env = "TELEGRAM_BOT_TOKEN"
api_url = "${telegramUrl}"
listing_delay_s = 0
[bots.pollers]
inbox_interval_s = 0
search_interval_s = 0
refind_interval_s = 0
[bots.responder]
kind = "template"
template = "not used: openclaw reads the updates"
[api]
enabled = true
host = "127.0.0.1"
port = ${port}
token_env = "REPLYD_API_TOKEN"
`);
  const run = procs.start(["-m", "replyd", "run", "--config", "replyd.toml"]);
  await procs.waitFor("replyd run", run, async () => (await fetch(`${apiUrl}/healthz`)).status === 200);
  replyd = new Replyd({ baseUrl: apiUrl, token: API_TOKEN });
});

after(async () => {
  await procs?.stopAll();
  rmSync(dir, { recursive: true, force: true });
});

const opts = () => ({ replyd, bot: "telegram" });

test("a lost sendMessage answer and a replayed update: naive posts twice, through replyd once", async () => {
  const sides = [{ name: "naive", chat: 1001, adapter: naive }, { name: "replyd", chat: 1002, adapter: withReplyd(naive, opts()) }];
  const seen: Record<string, { parent: string; first: Delivery[]; replay: Delivery[] }> = {};
  for (const side of sides) {
    const { parent_id: parent } = await control("/post", { chat_id: side.chat, text: "hello" });
    await control("/faults", { send: ["lost"] });
    const first = await gatewayRun(side.adapter, side.chat);  // the answer is lost; the gateway restarts unconfirmed
    const replay = await gatewayRun(side.adapter, side.chat);  // the same update again
    await gatewayRun(side.adapter, side.chat, replay.next);     // confirms the offset
    seen[side.name] = { parent, first: first.deliveries, replay: replay.deliveries };
  }
  const n = seen.naive!, r = seen.replyd!;
  assert.deepEqual(n.first.map((d) => d.state), ["unknown_after_send"]);
  assert.deepEqual(n.replay.map((d) => d.state), ["sent"]);
  assert.equal(await replies(n.parent), 2, "the naive channel posts twice");
  assert.deepEqual(r.first.map((d) => d.state), ["unknown_after_send"]);
  assert.deepEqual(r.replay.map((d) => d.state), ["unknown_after_send"]);
  assert.equal(await replies(r.parent), 1, "through replyd: one reply");
  const counts = await control("/counts");
  assert.ok(counts.lost_parents.includes(r.parent));

  // Telegram has no read-back: past the send deadline the sweep moves the row to unconfirmed.
  await procs.waitFor("unconfirmed", null, async () => (await rowState(r.parent)) === "unconfirmed", 20_000);
  const reconcile = createReconcileUnknownSend(opts());
  const [chat, mid] = r.parent.split(":") as [string, string];
  const pending = await reconcile(unknownCtx(chat, mid));
  assert.equal(pending.status, "unresolved");
  assert.equal(pending.status === "unresolved" && pending.retryable, true);

  // A person sees the message in the chat and confirms it; the hook then answers sent, with its id.
  const landed = counts.unanswered.find((id: string) => id.startsWith(`${chat}:`)) as string;
  const confirmed = await replyd.confirm("telegram", r.parent, { reply_id: landed });
  assert.ok(confirmed.ok, JSON.stringify(confirmed));
  const resolved = await reconcile(unknownCtx(chat, mid));
  assert.equal(resolved.status, "sent");
  assert.equal(resolved.status === "sent" && resolved.messageId, landed.split(":")[1]);
  assert.deepEqual(resolved.status === "sent" && resolved.receipt.platformMessageIds, [landed.split(":")[1]]);
  assert.equal(await replies(r.parent), 1);
});

test("reconcileUnknownSend answers sent, not sent and unresolved from replyd's rows", async () => {
  const chat = 1003;
  const channel = withReplyd(naive, opts());
  assert.equal(channel.durableFinal!.capabilities!.reconcileUnknownSend, true);
  assert.equal(channel.durableFinal!.reconcileUnknownSendKinds!.text, true);
  const reconcile = createReconcileUnknownSend(opts());

  // No row: replyd never sent to this parent.
  const { parent_id: fresh } = await control("/post", { chat_id: chat, text: "nobody answered" });
  assert.deepEqual(await reconcile(unknownCtx(String(chat), fresh.split(":")[1])), { status: "not_sent" });

  // Closed: the send landed; a replayed send is already_answered with the same id.
  const { parent_id: ok } = await control("/post", { chat_id: chat, text: "answer me" });
  const sent = await deliver(channel, String(chat), ok.split(":")[1], "hi");
  assert.equal(sent.state, "sent");
  const again = await deliver(channel, String(chat), ok.split(":")[1], "hi, reworded");
  assert.equal(again.state === "sent" && again.result.messageId, sent.state === "sent" && sent.result.messageId);
  const closed = await reconcile(unknownCtx(String(chat), ok.split(":")[1]));
  assert.equal(closed.status, "sent");
  assert.equal(closed.status === "sent" && closed.messageId, sent.state === "sent" && sent.result.messageId);
  assert.equal(await replies(ok), 1);

  // Open: a lost answer before the sweep's deadline is unresolved, never not sent.
  const { parent_id: lost } = await control("/post", { chat_id: chat, text: "lost answer" });
  await control("/faults", { send: ["lost"] });
  const unknown = await deliver(channel, String(chat), lost.split(":")[1], "hi");
  assert.equal(unknown.state, "unknown_after_send");
  const open = await reconcile(unknownCtx(String(chat), lost.split(":")[1]));
  assert.equal(open.status, "unresolved", `row ${await rowState(lost)}`);
  await procs.waitFor("unconfirmed", null, async () => (await rowState(lost)) === "unconfirmed", 20_000);
  assert.equal((await reconcile(unknownCtx(String(chat), lost.split(":")[1]))).status, "unresolved");

  // An operator who knows it did not land rearms it: released, so not sent.
  const rearmed = await replyd.rearm("telegram", lost);
  assert.ok(rearmed.ok, JSON.stringify(rearmed));
  assert.equal(await rowState(lost), "released");
  assert.deepEqual(await reconcile(unknownCtx(String(chat), lost.split(":")[1])), { status: "not_sent" });

  // Refused before anything was created (a 429): nothing landed, so not sent, and retryable.
  const { parent_id: refused } = await control("/post", { chat_id: chat, text: "a 429 first" });
  await control("/faults", { send: ["ratelimited"] });
  const failed = await deliver(channel, String(chat), refused.split(":")[1], "hi");
  assert.equal(failed.state, "not_sent", JSON.stringify(failed));
  assert.notEqual(await rowState(refused), "closed");
  assert.deepEqual(await reconcile(unknownCtx(String(chat), refused.split(":")[1])), { status: "not_sent" });
  assert.equal(await replies(refused), 0);
});
