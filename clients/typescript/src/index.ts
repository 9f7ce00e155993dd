// A small client for replyd's HTTP API over Node's global fetch; no runtime dependencies.
// Its types come from src/schema.ts, generated from openapi.json (npm run generate): never edit them by hand.
import type { components, operations } from "./schema.js";

type Schemas = components["schemas"];

/** The guard's outcome of a post (POST /v1/replies). */
export type PostOutcome = Schemas["PostOutcome"];
/** The outcome's status word: posted, already_answered, in_flight, uncertain, not_sent, rejected, … */
export type OutcomeStatus = Schemas["Status"];
/** A key's row and its events (GET /v1/replies/{platform}/{parent_id}). */
export type ReplyHistory = Schemas["ReplyHistory"];
/** A key's row of the answered-log. */
export type Row = Schemas["Row"];
/** POST …/rearm's answer. */
export type Rearmed = Schemas["Rearmed"];
/** POST …/confirm's answer. */
export type Confirmed = Schemas["Confirmed"];
/** Every refusal's body: a stable code, words and the field at fault. */
export type ApiErrorBody = Schemas["Error"];
/** POST /v1/replies's body. */
export type ReplyIn = operations["postReply"]["requestBody"]["content"]["application/json"];
/** POST …/confirm's body. */
export type ConfirmIn = operations["confirmReply"]["requestBody"]["content"]["application/json"];

/** Codes this client gives when the API gave none. */
export type ClientErrorCode = "network_error" | "timeout" | "bad_response" | "compose_failed";

/** A refusal or failure, as a value: never thrown. */
export interface ReplydError {
  /** The API's error code (unknown_platform, invalid_body, unauthorized, …), the outcome's status
   *  (rejected, gave_up, declined, unconfirmed, skipped, not_sent) or a ClientErrorCode. */
  code: string;
  /** What went wrong, for people. */
  message: string;
  /** The HTTP status; 0 when no answer came. */
  status: number;
  /** The request field at fault, when the API named one. */
  field?: string | null;
  /** Seconds to wait before retrying, from Retry-After or the outcome. */
  retryAfterS?: number | null;
  /** The guard's outcome, when the refusal carries one (409, 429, 503 not_sent). */
  outcome?: PostOutcome;
}

export type Failure = { ok: false; error: ReplydError };
export type Result<T> = ({ ok: true; status: number } & T) | Failure;

/** posted (201), already_answered (200), in_flight / uncertain / dry_run (202). Other outcomes are errors. */
export type PostResult = Result<{ outcome: PostOutcome; composed: boolean }>;
/** history is null when the key has no row: a post would claim it. */
export type CheckResult = Result<{ history: ReplyHistory | null }>;
export type RearmResult = Result<{ rearmed: Rearmed }>;
export type ConfirmResult = Result<{ confirmed: Confirmed }>;

/** Builds the reply's text; called at most once per parent by one client, and only when the key is free. */
export type Compose = (parent: ComposeParent) => string | Promise<string>;

export interface ComposeParent {
  platform: string;
  parentId: string;
  /** The key's row when it has one (released or not_landed: a retry), else null. */
  row: Row | null;
}

export type PostArgs =
  | { platform: string; parentId: string; text: string; compose?: never; path?: string }
  | { platform: string; parentId: string; compose: Compose; text?: never; path?: string };

export interface ReplydOptions {
  /** e.g. http://127.0.0.1:8787 */
  baseUrl: string;
  /** The bearer token (the variable api.token_env names). */
  token?: string;
  /** Per request, in milliseconds (default 30000). */
  timeoutMs?: number;
  /** Defaults to the global fetch. */
  fetch?: typeof fetch;
}

// Row states a post may claim: nothing blocks them. Every other state answers from the log.
const CLAIMABLE = new Set<string>(["released", "not_landed"]);
// A blocking row's state as the outcome a POST would answer, and that answer's HTTP status.
const FROM_ROW: Record<string, [OutcomeStatus, number]> = {
  closed: ["already_answered", 200],
  composing: ["in_flight", 202],
  open: ["in_flight", 202],
  parts: ["in_flight", 202],
  rejected: ["rejected", 409],
  gave_up: ["gave_up", 409],
  declined: ["declined", 409],
  unconfirmed: ["unconfirmed", 409],
  skipped: ["skipped", 409],
};
// Composed texts kept for retries at most; the oldest goes first past it.
const KEPT_TEXTS = 1000;
// Outcomes after which a composed text is not needed again.
const SETTLED = new Set<string>(["posted", "already_answered", "rejected", "gave_up", "declined", "dry_run"]);

type Answer = { status: number; body: unknown; retryAfterS: number | null } | Failure;

export class Replyd {
  readonly baseUrl: string;
  private readonly token: string | undefined;
  private readonly timeoutMs: number;
  private readonly fetch: typeof fetch;
  // One compose-post per key at a time: concurrent posts of one parent share it.
  private readonly running = new Map<string, Promise<PostResult>>();
  // A composed text kept until its post settles, so a retry sends it without composing again.
  private readonly composed = new Map<string, string>();

  constructor(options: ReplydOptions) {
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.token = options.token;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.fetch = options.fetch ?? globalThis.fetch;
  }

  /** Post a reply at most once. A retry of the same post is safe: the key is (bot, parent), never the text. */
  async post(args: PostArgs): Promise<PostResult> {
    if (typeof args.compose !== "function") {
      return this.send(args.platform, args.parentId, args.text ?? "", args.path, false);
    }
    const key = `${args.platform}\u0000${args.parentId}`;
    const running = this.running.get(key);
    if (running !== undefined) return running;
    const started = this.composeAndSend(key, args.platform, args.parentId, args.compose, args.path);
    this.running.set(key, started);
    try {
      return await started;
    } finally {
      this.running.delete(key);
    }
  }

  /** The key's row and history; history null when there is no row. */
  async check(platform: string, parentId: string): Promise<CheckResult> {
    const got = await this.request("GET", replyPath(platform, parentId));
    if ("ok" in got) return got;
    if (got.status === 404 && errorCode(got.body) === "no_row") return { ok: true, status: 404, history: null };
    if (got.status !== 200) return refusal(got);
    return { ok: true, status: 200, history: got.body as ReplyHistory };
  }

  /** Operator: mark an unconfirmed key answered (its reply was seen on the platform). */
  async confirm(platform: string, parentId: string, body: ConfirmIn = {}): Promise<ConfirmResult> {
    const got = await this.request("POST", `${replyPath(platform, parentId)}/confirm`, body);
    if ("ok" in got) return got;
    if (got.status !== 200) return refusal(got);
    return { ok: true, status: 200, confirmed: got.body as Confirmed };
  }

  /** Operator: move a rejected, gave_up or declined key to released, so the next post may claim it. */
  async rearm(platform: string, parentId: string): Promise<RearmResult> {
    const got = await this.request("POST", `${replyPath(platform, parentId)}/rearm`);
    if ("ok" in got) return got;
    if (got.status !== 200) return refusal(got);
    return { ok: true, status: 200, rearmed: got.body as Rearmed };
  }

  private async composeAndSend(key: string, platform: string, parentId: string, compose: Compose,
                               path: string | undefined): Promise<PostResult> {
    let text = this.composed.get(key);
    if (text === undefined) {
      const seen = await this.check(platform, parentId);
      if (!seen.ok) return seen;
      const row = seen.history?.row ?? null;
      if (row !== null && !CLAIMABLE.has(row.state)) return fromRow(seen.history as ReplyHistory);
      try {
        text = await compose({ platform, parentId, row });
      } catch (exc) {
        return fail("compose_failed", `compose: ${String(exc)}; nothing sent`, 0);
      }
      this.composed.set(key, text);
      if (this.composed.size > KEPT_TEXTS) this.composed.delete(this.composed.keys().next().value as string);
    }
    const out = await this.send(platform, parentId, text, path, true);
    const status = out.ok ? out.outcome.status : out.error.outcome?.status;
    if (status !== undefined && SETTLED.has(status)) this.composed.delete(key);
    return out;
  }

  private async send(platform: string, parentId: string, text: string, path: string | undefined,
                     composed: boolean): Promise<PostResult> {
    const body: ReplyIn = { platform, parent_id: parentId, text, ...(path === undefined ? {} : { path }) };
    const got = await this.request("POST", "/v1/replies", body);
    if ("ok" in got) return got;
    if (got.status >= 200 && got.status < 300 && isOutcome(got.body)) {
      return { ok: true, status: got.status, outcome: got.body, composed };
    }
    return refusal(got);
  }

  private async request(method: string, path: string, body?: unknown): Promise<Answer> {
    const headers: Record<string, string> = { accept: "application/json" };
    if (this.token !== undefined) headers.authorization = `Bearer ${this.token}`;
    if (method === "POST") headers["content-type"] = "application/json";
    let res: Response;
    try {
      res = await this.fetch(`${this.baseUrl}${path}`, {
        method, headers, body: method === "POST" ? JSON.stringify(body ?? {}) : undefined,
        signal: AbortSignal.timeout(this.timeoutMs),
      });
    } catch (exc) {
      const name = (exc as { name?: string }).name;
      if (name === "TimeoutError" || name === "AbortError") {
        return fail("timeout", `${method} ${path}: no answer in ${this.timeoutMs} ms (a post may have landed: retry it)`, 0);
      }
      const cause = (exc as { cause?: { message?: string } }).cause?.message;
      return fail("network_error", `${method} ${path}: ${cause ?? String(exc)}`, 0);
    }
    const raw = await res.text().catch(() => "");
    let parsed: unknown;
    try {
      parsed = JSON.parse(raw);
    } catch {
      return fail("bad_response", `${method} ${path}: HTTP ${res.status}, not JSON: ${raw.slice(0, 200)}`, res.status);
    }
    const after = Number(res.headers.get("retry-after"));
    return { status: res.status, body: parsed, retryAfterS: Number.isFinite(after) && after > 0 ? after : null };
  }
}

function replyPath(platform: string, parentId: string): string {
  return `/v1/replies/${encodeURIComponent(platform)}/${encodeURIComponent(parentId)}`;
}

function fail(code: string, message: string, status: number): Failure {
  return { ok: false, error: { code, message, status } };
}

function isOutcome(body: unknown): body is PostOutcome {
  return typeof body === "object" && body !== null && typeof (body as { status?: unknown }).status === "string"
    && typeof (body as { parent_id?: unknown }).parent_id === "string";
}

function errorCode(body: unknown): string | undefined {
  const code = (body as { error?: unknown } | null)?.error;
  return typeof code === "string" ? code : undefined;
}

function refusal(got: { status: number; body: unknown; retryAfterS: number | null }): Failure {
  if (isOutcome(got.body)) {
    const o = got.body;
    return { ok: false, error: { code: o.status, message: o.detail || o.status, status: got.status, field: null,
                                 retryAfterS: o.retry_after_s ?? got.retryAfterS, outcome: o } };
  }
  const code = errorCode(got.body);
  if (code === undefined) return fail("bad_response", `HTTP ${got.status}: no error code in the body`, got.status);
  const e = got.body as ApiErrorBody;
  return { ok: false, error: { code, message: String(e.detail ?? code), status: got.status, field: e.field ?? null,
                               retryAfterS: got.retryAfterS } };
}

function fromRow(h: ReplyHistory): PostResult {
  const row = h.row;
  const [status, http] = FROM_ROW[row.state] ?? ["in_flight", 202];
  const outcome: PostOutcome = {
    status, bot: h.bot, platform: h.platform, sender_id: h.sender_id, parent_id: h.parent_id, state: row.state,
    attempt: row.attempt, reply_id: row.reply_id ?? null, detail: `from the log: the key is ${row.state}; nothing composed`,
    retry_after_s: null, parts: [],
  };
  if (http >= 300) {
    return { ok: false, error: { code: status, message: outcome.detail, status: http, field: null, outcome } };
  }
  return { ok: true, status: http, outcome, composed: false };
}
