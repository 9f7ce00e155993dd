// Vercel's Chat SDK (`chat` + `@chat-adapter/telegram`) on replyd's Telegram fake: the same bot answering each
// mention naively (`thread.post`) and through replyd (`@replyd/client` post with compose). The fake counts.
//  - polling: the first sendMessage answer is lost; thread.post throws; the SDK retries the update.
//  - webhooks: every update reaches replica A (its 2xx lost), then replica B; each has its own memory state.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { BOT, parentOf, startBot, startFake, startReplyd, stopAll, until } from "../lib/harness.mjs";

let fake;
let replyd;

before(async () => {
  fake = await startFake();
  replyd = await startReplyd(fake.url);
});

after(stopAll);

const text = (message) => `Thanks, ${message.author.userName}!`;

/** The naive handler: the SDK's own post. */
const naive = (seen) => async (thread, message) => {
  seen.push(parentOf(message));
  await thread.post(text(message));
};

// Settled: nothing more to do. Anything else (uncertain, in_flight, not_sent, no answer) throws, so the SDK retries.
const DONE = new Set(["posted", "already_answered"]);
const REFUSED = new Set(["unconfirmed", "rejected", "gave_up", "declined", "skipped"]);

/** What replyd answered each call of the handler: "<parent> <status or error code>". */
const outcomes = [];

/** The handler through replyd: replyd posts once per parent; a retry of the SDK asks again and sends nothing. */
const viaReplyd = (seen) => async (thread, message) => {
  const parentId = parentOf(message);
  seen.push(parentId);
  const r = await replyd.post({ platform: BOT, parentId, compose: async () => text(message) });
  outcomes.push(`${parentId} ${r.ok ? r.outcome.status : r.error.code}`);
  if (r.ok ? DONE.has(r.outcome.status) : REFUSED.has(r.error.code)) return;
  throw new Error(`replyd: ${r.ok ? r.outcome.status : r.error.code}: not settled, let the SDK retry`);
};

const stateOf = async (parentId) => (await replyd.check(BOT, parentId)).history?.row.state;

/** The chat ids whose bot message lost its sendMessage answer ("<chat>:<message>" in `unanswered`). */
const lostChats = (counts, chats) => chats.filter((c) => counts.unanswered.some((id) => id.startsWith(`${c}:`)));

/** Two mentions, the first sendMessage answer lost, under `mode`; the platform's counts once settled. */
async function run(mode, chats, handler, settled) {
  const seen = [];
  await fake.faults(["lost"]);
  const bots = [await startBot({ fakeUrl: fake.url, mode, answer: handler(seen) })];
  if (mode === "webhook") {
    bots.push(await startBot({ fakeUrl: fake.url, mode, answer: handler(seen) }));
    await fake.webhook(bots.map((b) => b.url));
  }
  const parents = [];
  for (const c of chats) parents.push(await fake.post(c));
  await until(`${mode}: every update confirmed`, async () => (await fake.counts(chats)).pending_updates.length === 0);
  // Not settled in time: the counts below say why, so no throw here.
  await until(`${mode}: settled`, () => settled(parents, seen), 15_000).catch(() => {});
  await new Promise((r) => setTimeout(r, 1500)); // room for one more retry of the SDK, if any
  if (mode === "webhook") await fake.stopWebhook();
  for (const b of bots) await b.stop();
  return { parents, seen, counts: await fake.counts(chats) };
}

const total = (counts) => Object.values(counts.bot_messages).reduce((a, b) => a + b, 0);

test("polling, one lost answer: the SDK's retry posts twice naively, once through replyd", async () => {
  const n = await run("polling", [101, 102], naive,
                      async (parents, seen) => seen.length >= 3);
  const lost = lostChats(n.counts, [101, 102]);
  assert.equal(lost.length, 1);
  assert.equal(n.counts.bot_messages[lost[0]], 2, `naive: ${JSON.stringify(n.counts)}`);
  assert.equal(total(n.counts), 3);

  const r = await run("polling", [201, 202], viaReplyd, async (parents) =>
    (await Promise.all(parents.map(stateOf))).every((s) => s === "closed" || s === "unconfirmed"));
  assert.deepEqual(r.counts.bot_messages, { 201: 1, 202: 1 }, `replyd: ${JSON.stringify(r.counts)}`);
  const [lostR] = lostChats(r.counts, [201, 202]);
  const lostParent = r.parents.find((p) => p.startsWith(`${lostR}:`));
  assert.equal(await stateOf(lostParent), "unconfirmed");
  assert.equal(await stateOf(r.parents.find((p) => p !== lostParent)), "closed");
  assert.ok(r.seen.filter((p) => p === lostParent).length >= 2, `the SDK retried: ${r.seen}`);
  console.log(`polling: naive ${total(n.counts)} messages for 2 mentions, replyd ${total(r.counts)}; `
              + `handler calls naive ${n.seen.length}, replyd ${r.seen.length}`);
});

test("webhooks redelivered to a second replica: naive posts twice, replyd once", async () => {
  const n = await run("webhook", [301, 302], naive, async (parents, seen) => seen.length >= 4);
  assert.deepEqual(n.counts.bot_messages, { 301: 2, 302: 2 }, `naive: ${JSON.stringify(n.counts)}`);

  const r = await run("webhook", [401, 402], viaReplyd, async (parents, seen) =>
    seen.length >= 4 && (await Promise.all(parents.map(stateOf))).every((s) => s === "closed" || s === "unconfirmed"));
  assert.deepEqual(r.counts.bot_messages, { 401: 1, 402: 1 }, `replyd: ${JSON.stringify(r.counts)}`);
  assert.ok(Object.values(r.counts.deliveries).every((d) => d === 2), `each update twice: ${JSON.stringify(r.counts)}`);
  const [lostR] = lostChats(r.counts, [401, 402]);
  const lostParent = r.parents.find((p) => p.startsWith(`${lostR}:`));
  assert.equal(await stateOf(lostParent), "unconfirmed");
  assert.equal(await stateOf(r.parents.find((p) => p !== lostParent)), "closed");
  console.log(`webhook: naive ${total(n.counts)} messages for 2 mentions, replyd ${total(r.counts)}`);
  console.log(`replyd's answers to the handler: ${outcomes.join(", ")}`);
});
