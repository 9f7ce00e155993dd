// Mastra: a workflow step runs an Agent; the step has `retries: 1`.
// The model is Mastra's own MastraLanguageModelV2Mock (@mastra/core/test-utils/llm-mock), scripted, no LLM:
// it calls the one tool it is given, then answers in text once it sees the tool's result.
// The step dies after the agent's tool call ran, so Mastra retries the step: the agent runs again.
// The naive tool posts through the platform's API; the other is replyd's, listed by @mastra/mcp's MCPClient.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Agent } from "@mastra/core/agent";
import { MastraLanguageModelV2Mock } from "@mastra/core/test-utils/llm-mock";
import { createTool } from "@mastra/core/tools";
import { createStep, createWorkflow } from "@mastra/core/workflows";
import { MCPClient } from "@mastra/mcp";
import { z } from "zod";
import { BOT, WorkerDied, startSim, statusOf } from "../lib/harness.mjs";

let sim;
before(async () => { sim = await startSim(); });
after(async () => { await sim?.stop(); });

/** The scripted model: the first turn calls the tool it is given; a turn that sees a tool result answers. */
function scriptedModel(parent) {
  return new MastraLanguageModelV2Mock({
    modelId: "scripted",
    doGenerate: async ({ prompt, tools }) => ({
      ...(prompt.some((m) => m.role === "tool")
        ? { content: [{ type: "text", text: "Answered." }], finishReason: "stop" }
        : { content: [{ type: "tool-call", toolCallId: "call-1", toolName: tools[0].name,
                        input: JSON.stringify({ bot: BOT, parent, text: "Yes, it is." }) }],
            finishReason: "tool-calls" }),
      usage: { inputTokens: 1, outputTokens: 1, totalTokens: 2 },
      warnings: [],
    }),
  });
}

/** One workflow step runs the agent, then dies once before its result is saved; Mastra retries the step. */
async function runWorkflow(tools, parent) {
  const results = [];
  const agent = new Agent({ id: "replier", name: "replier", instructions: "Answer the post once.",
                            model: scriptedModel(parent), tools });
  let died = false;
  const answer = createStep({
    id: "answer",
    inputSchema: z.object({ parent: z.string() }),
    outputSchema: z.object({ text: z.string() }),
    retries: 1,
    execute: async ({ inputData }) => {
      const out = await agent.generate(`Answer post ${inputData.parent}`, { maxSteps: 3 });
      results.push(...out.toolResults.map((r) => statusOf(r.payload?.result ?? r.result)));
      if (!died) {
        died = true;
        throw new WorkerDied("after the agent's tool call, before the step's result was saved");
      }
      return { text: out.text };
    },
  });
  const workflow = createWorkflow({ id: "answer-post", inputSchema: z.object({ parent: z.string() }),
                                    outputSchema: z.object({ text: z.string() }) }).then(answer).commit();
  const run = await workflow.createRun();
  const final = await run.start({ inputData: { parent } });
  return { results, final };
}

/** The naive reply_once: straight to the platform's API. */
function naiveTool() {
  return createTool({
    id: "reply_once",
    description: "Reply to a post (straight to the platform).",
    inputSchema: z.object({ bot: z.string(), parent: z.string(), text: z.string() }),
    execute: async (args) => sim.postDirectly(args),
  });
}

test("naive tool: the retried step posts a second reply", async () => {
  const parent = await sim.newParent();
  const { results, final } = await runWorkflow({ reply_once: naiveTool() }, parent);
  assert.equal(final.status, "success", JSON.stringify(final));
  assert.deepEqual(results, ["sent", "sent"]);
  assert.equal(await sim.repliesTo(parent), 2);
});

test("replyd's MCP tool: the retried step gets already_answered, one reply", async () => {
  const parent = await sim.newParent();
  const mcp = new MCPClient({ id: "replyd-mastra-test", servers: { replyd: sim.mcp }, timeout: 60_000 });
  try {
    const all = await mcp.listTools();
    const tools = Object.fromEntries(Object.entries(all).filter(([name]) => name.endsWith("reply_once")));
    assert.deepEqual(Object.keys(tools), ["replyd_reply_once"]);
    const { results, final } = await runWorkflow(tools, parent);
    assert.equal(final.status, "success", JSON.stringify(final));
    assert.deepEqual(results, ["posted", "already_answered"]);
    assert.equal(final.result.text, "Answered.");
  } finally {
    await mcp.disconnect();
  }
  assert.equal(await sim.repliesTo(parent), 1);
});
