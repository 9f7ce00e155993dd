// What the Chat SDK tests share: replyd's Telegram fake (lib/telegram_fake.py), a `replyd run` pointed at it,
// and Chat SDK bots (the real `chat` and `@chat-adapter/telegram`) polling it or served its webhooks.
// REPLYD_PYTHON names a Python that imports replyd (default: the checkout's .venv).
import { createServer } from "node:http";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { Chat } from "chat";
import { createTelegramAdapter } from "@chat-adapter/telegram";
import { createMemoryState } from "@chat-adapter/state-memory";
import { Replyd } from "@replyd/client";
import { Processes, freePort, until } from "@replyd/testkit";

const HERE = dirname(fileURLToPath(import.meta.url));
/** The repository root: the tests run this checkout's replyd (PYTHONPATH), whatever the venv installed. */
export const ROOT = resolve(HERE, "../../..");
export const PYTHON = process.env.REPLYD_PYTHON ?? resolve(ROOT, ".venv/bin/python");
/** The fake's bot token (replyd/sim/telegram.py, TOKEN). */
export const BOT_TOKEN = "7000000001:AAFakeTokenForTestsOnly-0123456789ab";
export const BOT = "telegram";
const API_TOKEN = "chat-sdk-test-token";
const SECRET = "chat-sdk-webhook-secret";
const quiet = { debug() {}, info() {}, warn() {}, error() {}, child() { return quiet; } };

const dir = mkdtempSync(join(tmpdir(), "replyd-chat-sdk-"));
const env = { ...process.env, HOME: dir, XDG_STATE_HOME: join(dir, "state"), TELEGRAM_BOT_TOKEN: BOT_TOKEN,
              REPLYD_API_TOKEN: API_TOKEN, PYTHONPATH: [ROOT, process.env.PYTHONPATH].filter(Boolean).join(":") };
const procs = new Processes({ python: PYTHON, cwd: dir, env, stdin: "pipe" }); // a fake stops when stdin closes

export { until };

/** The Telegram fake and its control endpoint. */
export async function startFake() {
  const proc = procs.start([join(HERE, "telegram_fake.py")]);
  const [url, control] = await procs.waitFor("telegram fake", proc, async () => {
    const text = procs.logs.join("");
    const a = /FAKE_URL=(\S+)/.exec(text), b = /CONTROL_URL=(\S+)/.exec(text);
    return a && b ? [a[1], b[1]] : undefined;
  });
  async function call(path, body) {
    const res = await fetch(`${control}${path}`, body === undefined ? {} : { method: "POST", body: JSON.stringify(body) });
    if (res.status !== 200) throw new Error(`${path}: HTTP ${res.status} ${await res.text()}`);
    return res.json();
  }
  return {
    url,
    /** A person mentions the bot in supergroup `chatId`; the parent id "<chat>:<message>". */
    post: async (chatId) => (await call("/post", { chat_id: chatId })).parent_id,
    /** The next sendMessage calls fail so: "lost" creates the message, then drops the connection. */
    faults: (send) => call("/faults", { send }),
    /** Webhooks on: every update goes to urls[0] (its 2xx lost), then is redelivered to urls[1]. */
    webhook: (urls) => call("/webhook", { urls, secret_token: SECRET, retry_s: 0.5 }),
    stopWebhook: () => call("/webhook/stop", {}),
    /** The platform's counts: the bot's messages per chat, the unanswered sends, each update's deliveries. */
    counts: (chats) => call(`/counts?chats=${chats.join(",")}`),
  };
}

/** `replyd run` with one Telegram bot on the fake: webhook mode and the pollers off, so only the API posts. */
export async function startReplyd(fakeUrl) {
  const port = await freePort();
  const config = join(dir, "replyd.toml");
  writeFileSync(config, `
[store]
url = "sqlite:///${dir}/replyd.sqlite3"
[log]
level = "warning"
[guard]
send_timeout_s = 1.0
[sweep]
interval_s = 0.5
[[bots]]
name = "${BOT}"
platform = "telegram"
[bots.settings]
api_url = "${fakeUrl}"
token_env = "TELEGRAM_BOT_TOKEN"
mode = "webhook"
listing_delay_s = 0
[bots.pollers]
inbox_interval_s = 0
search_interval_s = 0
refind_interval_s = 0
[bots.responder]
kind = "template"
template = "not used: only the API posts"
[api]
enabled = true
host = "127.0.0.1"
port = ${port}
token_env = "REPLYD_API_TOKEN"
`);
  const proc = procs.start(["-m", "replyd", "run", "--config", config]);
  const baseUrl = `http://127.0.0.1:${port}`;
  await procs.waitFor("replyd run", proc, async () =>
    (await fetch(`${baseUrl}/readyz`, { headers: { authorization: `Bearer ${API_TOKEN}` } })).status === 200);
  return new Replyd({ baseUrl, token: API_TOKEN });
}

/** The parent a Chat SDK message answers: replyd's Telegram id "<chat id>:<message id>". */
export function parentOf(message) {
  return `${message.raw.chat.id}:${message.raw.message_id}`;
}

/**
 * A Chat SDK bot on the fake: `mode` "polling" (getUpdates, the SDK retries an update whose handler threw) or
 * "webhook" (served on an ephemeral port; `url` is its webhook). `answer(thread, message)` is the mention handler.
 */
export async function startBot({ fakeUrl, mode, answer }) {
  const chat = new Chat({
    userName: "replyd_test_bot",
    adapters: { telegram: createTelegramAdapter({
      botToken: BOT_TOKEN, apiUrl: fakeUrl, mode, secretToken: SECRET, logger: quiet,
      longPolling: { timeout: 1, retryDelayMs: 1000 } }) },
    state: createMemoryState(),
    logger: quiet,
  });
  chat.onNewMention(answer);
  await chat.initialize();
  if (mode === "polling") return { url: undefined, stop: () => chat.shutdown() };
  const server = createServer(async (req, res) => {
    const chunks = [];
    for await (const c of req) chunks.push(c);
    const request = new Request(`http://127.0.0.1${req.url}`, { method: req.method, headers: req.headers,
                                                                 body: Buffer.concat(chunks) });
    const response = await chat.webhooks.telegram(request, { waitUntil: () => {} });
    res.writeHead(response.status, Object.fromEntries(response.headers));
    res.end(Buffer.from(await response.arrayBuffer()));
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  return {
    url: `http://127.0.0.1:${server.address().port}/telegram`,
    stop: async () => { await new Promise((ok) => server.close(ok)); await chat.shutdown(); },
  };
}

/** Stops every process started here and removes the scratch directory. */
export async function stopAll() {
  await procs.stopAll();
  rmSync(dir, { recursive: true, force: true });
}
