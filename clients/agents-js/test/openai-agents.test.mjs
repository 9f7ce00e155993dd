// OpenAI Agents SDK (JS): an Agent whose model is the SDK's own ScriptedModel (@openai/agents/testing), no LLM.
// The model asks for one reply_once call. The run dies after the tool ran: the next model call fails.
// The Agents SDK has no checkpoint to resume from, so the job runs again with the same input.
// The re-run's model asks for the same call. The naive tool posts through the platform's API;
// the other is replyd's MCP server, attached as the SDK's own MCPServerStdio.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Agent, MCPServerStdio, run, setTracingDisabled, tool } from "@openai/agents";
import { ScriptedModel, assistantMessage, functionCall, modelError } from "@openai/agents/testing";
import { z } from "zod";
import { BOT, WorkerDied, startSim, statusOf } from "../lib/harness.mjs";

setTracingDisabled(true); // no key, no network: traces would go to OpenAI

let sim;
before(async () => { sim = await startSim(); });
after(async () => { await sim?.stop(); });

/** Two runs' worth of model turns: ask for the tool; die; then (the re-run) ask again and finish. */
function scriptedModel(parent) {
  const call = () => functionCall("reply_once", { bot: BOT, parent, text: "Yes, it is." }, { callId: "call-1" });
  return new ScriptedModel([
    [call()], modelError(new WorkerDied("after the tool ran, before the run finished")),
    [call()], [assistantMessage("Answered.")],
  ]);
}

/** The first run dies after its tool call; the job then runs again with the same input. */
async function runTwice(agentOptions, parent) {
  const model = scriptedModel(parent);
  const results = [];
  const agent = new Agent({ name: "replier", instructions: "Answer the post once.", model, ...agentOptions });
  agent.on("agent_tool_end", (_ctx, _tool, result) => results.push(statusOf(result)));
  const input = `Answer post ${parent}`;
  await assert.rejects(run(agent, input), WorkerDied);
  const final = await run(agent, input); // the same job, run again
  model.assertComplete();
  return { results, final };
}

/** The naive reply_once: straight to the platform's API. */
function naiveTool() {
  return tool({
    name: "reply_once",
    description: "Reply to a post (straight to the platform).",
    parameters: z.object({ bot: z.string(), parent: z.string(), text: z.string() }),
    execute: async (args) => sim.postDirectly(args),
  });
}

test("naive tool: the re-run posts a second reply", async () => {
  const parent = await sim.newParent();
  const { results } = await runTwice({ tools: [naiveTool()] }, parent);
  assert.deepEqual(results, ["sent", "sent"]);
  assert.equal(await sim.repliesTo(parent), 2);
});

test("replyd's MCP server: the re-run gets already_answered, one reply", async () => {
  const parent = await sim.newParent();
  const replyd = new MCPServerStdio({ name: "replyd", ...sim.mcp, toolFilter: { allowedToolNames: ["reply_once"] },
                                    clientSessionTimeoutSeconds: 60 });
  await replyd.connect();
  try {
    const { results, final } = await runTwice({ mcpServers: [replyd] }, parent);
    assert.deepEqual(results, ["posted", "already_answered"]);
    assert.equal(final.finalOutput, "Answered.");
  } finally {
    await replyd.close();
  }
  assert.equal(await sim.repliesTo(parent), 1);
});
