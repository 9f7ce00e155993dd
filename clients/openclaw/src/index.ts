// openclaw channel hooks backed by replyd: a channel's final text sends go through replyd's post-once,
// and openclaw's `reconcileUnknownSend` asks replyd's answered-log whether a send whose outcome was lost landed.
// Typed against openclaw's published plugin SDK (openclaw/plugin-sdk/channel-message); no openclaw runtime import.
import type {
  ChannelMessageAdapterShape,
  ChannelMessageDurableFinalAdapter,
  ChannelMessageSendResult,
  ChannelMessageSendTextContext,
  ChannelMessageUnknownSendContext,
  ChannelMessageUnknownSendReconciliationResult,
  MessageReceipt,
} from "openclaw/plugin-sdk/channel-message";
import type { PostOutcome, Replyd, Row } from "@replyd/client";

export type ReconcileResult = ChannelMessageUnknownSendReconciliationResult;

/** What a parent is made of: the chat (openclaw's `to`) and the message replied to. */
export interface ParentFacts {
  to: string;
  replyToId?: string | null;
  threadId?: string | number | null;
}

export interface ReplydChannelOptions {
  /** A `@replyd/client` instance pointed at the daemon's HTTP API. */
  replyd: Pick<Replyd, "post" | "check">;
  /** The replyd bot (its `name` in replyd's config) that answers on this channel. */
  bot: string;
  /** replyd's parent id for a send. Default: Telegram's `<chat id>:<message id>` from `to` and the reply target. */
  parentOf?: (facts: ParentFacts) => string | null;
  /** The row label replyd stores (default `openclaw`). */
  path?: string;
}

/** replyd's row states, as openclaw's reconciliation answers them (docs/INTEGRATIONS.md, "openclaw"). */
export const STATE_ANSWERS: Readonly<Record<string, ReconcileResult["status"]>> = Object.freeze({
  closed: "sent", // the reply landed; reply_id is its platform id
  not_landed: "not_sent", // the sweep proved the send did not land
  released: "not_sent", // claimable again: nothing of this attempt landed (a rearm, a refused send)
  rejected: "not_sent", // the platform refused the send
  declined: "not_sent", // the responder chose not to answer; nothing was sent
  skipped: "not_sent", // the policy skipped the parent; nothing was sent
  open: "unresolved", // a send is in flight, or its answer was lost and the sweep has not judged it
  composing: "unresolved", // a writer holds the key and may send
  parts: "unresolved", // a long answer partly sent
  unconfirmed: "unresolved", // no read-back (Telegram): a person must confirm or rearm
  gave_up: "unresolved", // read-back failed so far; later looks may still decide
});

/** Telegram's parent id: `<chat id>:<message id>`; `to` may carry openclaw's `telegram:` prefix. */
export function telegramParentOf(facts: ParentFacts): string | null {
  const reply = facts.replyToId == null ? "" : String(facts.replyToId).trim();
  const chat = String(facts.to).trim().replace(/^telegram:/i, "").replace(/^(group|channel|user):/i, "");
  if (!/^\d+$/.test(reply) || !/^-?\d+$/.test(chat)) return null;
  return `${chat}:${reply}`;
}

/** A receipt for replyd's reply id (Telegram's is `<chat>:<message>`; openclaw wants the message id). */
export function receiptFor(replyId: string | null | undefined, facts: { threadId?: string | number | null;
                                                                      replyToId?: string | null } = {}): MessageReceipt {
  const id = replyId == null ? "" : platformMessageId(replyId);
  const thread = facts.threadId == null ? undefined : String(facts.threadId);
  const reply = facts.replyToId == null ? undefined : String(facts.replyToId);
  return {
    ...(id ? { primaryPlatformMessageId: id } : {}),
    platformMessageIds: id ? [id] : [],
    parts: id ? [{ platformMessageId: id, kind: "text", index: 0, ...(thread ? { threadId: thread } : {}),
                   ...(reply ? { replyToId: reply } : {}) }] : [],
    ...(thread ? { threadId: thread } : {}),
    ...(reply ? { replyToId: reply } : {}),
    sentAt: Date.now(),
  };
}

function platformMessageId(replyId: string): string {
  const m = /^-?\d+:(\d+)$/.exec(replyId);
  return m?.[1] ?? replyId;
}

/** The reconciliation answer for a replyd row (null: replyd has no row for the parent). */
export function answerForRow(row: Row | null, facts: ParentFacts = { to: "" }): ReconcileResult {
  if (row === null) return { status: "not_sent" }; // replyd never claimed the parent, so it never sent
  const status = STATE_ANSWERS[row.state] ?? "unresolved";
  if (status === "sent") {
    const receipt = receiptFor(row.reply_id, facts);
    return { status: "sent", receipt, ...(receipt.primaryPlatformMessageId ? { messageId: receipt.primaryPlatformMessageId } : {}) };
  }
  if (status === "not_sent") return { status: "not_sent" };
  return { status: "unresolved", error: `replyd: the parent's row is ${row.state}${row.state === "unconfirmed"
    ? " (confirm or rearm it: replyd confirm / replyd rearm)" : ""}`, retryable: true };
}

/** openclaw's `durableFinal.reconcileUnknownSend`, answered from replyd's `check` of the parent's row. */
export function createReconcileUnknownSend(opts: ReplydChannelOptions):
  (ctx: ChannelMessageUnknownSendContext) => Promise<ReconcileResult> {
  const parentOf = opts.parentOf ?? telegramParentOf;
  return async (ctx) => {
    const facts: ParentFacts = { to: ctx.to, replyToId: ctx.effectiveReplyToId ?? ctx.replyToId ?? null,
                                 threadId: ctx.threadId ?? null };
    const parent = parentOf(facts);
    if (parent === null) {
      return { status: "unresolved", error: "replyd: the send names no parent (no reply target)", retryable: false };
    }
    const got = await opts.replyd.check(opts.bot, parent);
    if (!got.ok) return { status: "unresolved", error: `replyd check: ${got.error.code}: ${got.error.message}`, retryable: true };
    return answerForRow(got.history?.row ?? null, facts);
  };
}

/** The durable-final facet a channel adds to its message adapter: reconciliation for text sends, by replyd. */
export function replydDurableFinal(opts: ReplydChannelOptions, base: ChannelMessageDurableFinalAdapter = {}):
  ChannelMessageDurableFinalAdapter {
  return {
    ...base,
    capabilities: { ...base.capabilities, text: true, replyTo: true, reconcileUnknownSend: true },
    reconcileUnknownSendKinds: { ...base.reconcileUnknownSendKinds, text: true },
    reconcileUnknownSend: createReconcileUnknownSend(opts),
  };
}

/** A send whose outcome replyd cannot tell yet (lost answer, in flight): openclaw keeps it `unknown_after_send`. */
export class ReplydUnknownSendError extends Error {
  readonly outcome: PostOutcome | undefined;
  constructor(message: string, outcome?: PostOutcome) {
    super(message);
    this.name = "ReplydUnknownSendError";
    this.outcome = outcome;
  }
}

/** replyd refused before anything was sent (rate limit, shutting down, store down): safe to retry. */
export class ReplydNotSentError extends Error {
  readonly retryable = true;
  readonly retryAfterS: number | null;
  constructor(message: string, retryAfterS: number | null = null) {
    super(message);
    this.name = "ReplydNotSentError";
    this.retryAfterS = retryAfterS;
  }
}

/** replyd's terminal refusal for the parent (rejected, gave_up, declined, unconfirmed): nothing is sent again. */
export class ReplydRefusedError extends Error {
  readonly retryable = false;
  readonly state: string;
  constructor(message: string, state: string) {
    super(message);
    this.name = "ReplydRefusedError";
    this.state = state;
  }
}

const UNKNOWN = new Set(["in_flight", "uncertain"]);
const NOT_SENT_CODES = new Set(["not_sent", "store_unavailable", "store_busy", "network_error", "resolve_failed"]);

/** openclaw's `send.text` for a channel, posting through replyd's post-once instead of the platform's API. */
export function createReplydSendText(opts: ReplydChannelOptions):
  (ctx: ChannelMessageSendTextContext) => Promise<ChannelMessageSendResult> {
  const parentOf = opts.parentOf ?? telegramParentOf;
  return async (ctx) => {
    const facts: ParentFacts = { to: ctx.to, replyToId: ctx.replyToId ?? null, threadId: ctx.threadId ?? null };
    const parent = parentOf(facts);
    if (parent === null) throw new ReplydRefusedError("replyd: a final send needs the message it answers (replyToId)", "no_parent");
    await ctx.onPlatformSendDispatch?.();
    ctx.assertDirectAdapterHandoff?.();
    const got = await opts.replyd.post({ platform: opts.bot, parentId: parent, text: ctx.text, path: opts.path ?? "openclaw" });
    if (got.ok) {
      const o = got.outcome;
      if ((o.status === "posted" || o.status === "already_answered") && o.reply_id) {
        const receipt = receiptFor(o.reply_id, facts);
        return { receipt, messageId: receipt.primaryPlatformMessageId ?? o.reply_id };
      }
      if (UNKNOWN.has(o.status)) throw new ReplydUnknownSendError(`replyd: ${o.status}: ${o.detail || "the send may have landed"}`, o);
      if (o.status === "dry_run") return { outcome: "not_sent", receipt: receiptFor(null, facts) };
      throw new ReplydRefusedError(`replyd: ${o.status} (${o.state})`, o.state ?? o.status);
    }
    const e = got.error;
    // A timeout may hide a send that landed: openclaw must reconcile, never resend blindly.
    if (e.code === "timeout") throw new ReplydUnknownSendError(`replyd: ${e.message}`);
    if (NOT_SENT_CODES.has(e.code)) throw new ReplydNotSentError(`replyd: ${e.code}: ${e.message}`, e.retryAfterS ?? null);
    throw new ReplydRefusedError(`replyd: ${e.code}: ${e.message}`, e.outcome?.state ?? e.code);
  };
}

/** A channel's message adapter with its final text sends routed through replyd and replyd's reconciliation added. */
export function withReplyd<T extends ChannelMessageAdapterShape>(adapter: T, opts: ReplydChannelOptions): T {
  return {
    ...adapter,
    send: { ...adapter.send, text: createReplydSendText(opts) },
    durableFinal: replydDurableFinal(opts, adapter.durableFinal),
  };
}
