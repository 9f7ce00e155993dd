// LangGraph JS: a model node and a ToolNode with a MemorySaver checkpointer.
// The model is @langchain/core's FakeStreamingChatModel: it asks for one reply_once call, no LLM behind it.
// The worker dies right after the tool ran, before the checkpoint; the resumed run executes the tool node again.
// The naive reply_once posts through the platform's API; the other is replyd's MCP tool (@langchain/mcp-adapters).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { HumanMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { FakeStreamingChatModel } from "@langchain/core/utils/testing";
import { END, MemorySaver, MessagesAnnotation, START, StateGraph } from "@langchain/langgraph";
import { ToolNode } from "@langchain/langgraph/prebuilt";
import { MultiServerMCPClient } from "@langchain/mcp-adapters";
import { z } from "zod";
import { BOT, WorkerDied, startSim, statusOf } from "../lib/harness.mjs";

let sim;
before(async () => { sim = await startSim(); });
after(async () => { await sim?.stop(); });

/** The graph: model → tools → END, checkpointed. `results` collects what each tool call returned. */
function agent(tools, parent, results) {
  const llm = new FakeStreamingChatModel({
    chunks: [{ content: "", tool_calls: [
      { name: "reply_once", args: { bot: BOT, parent, text: "Yes, it is." }, id: "call-1", type: "tool_call" }] }],
  }).bindTools(tools);
  const toolNode = new ToolNode(tools);
  let died = false;
  return new StateGraph(MessagesAnnotation)
    .addNode("model", async (state) => ({ messages: [await llm.invoke(state.messages)] }))
    .addNode("tools", async (state, config) => {
      const out = await toolNode.invoke(state, config);
      results.push(...out.messages.map((m) => statusOf(m.content)));
      if (!died) {
        died = true;
        throw new WorkerDied("after the tool ran, before LangGraph saved the checkpoint");
      }
      return out;
    })
    .addEdge(START, "model")
    .addEdge("model", "tools")
    .addEdge("tools", END)
    .compile({ checkpointer: new MemorySaver() });
}

/** The first run dies in the tool node; the second resumes the thread from its checkpoint. */
async function runThenResume(graph, parent) {
  const thread = { configurable: { thread_id: parent } };
  await assert.rejects(graph.invoke({ messages: [new HumanMessage(`Answer post ${parent}`)] }, thread), WorkerDied);
  return graph.invoke(null, thread); // resume: the tool node runs again
}

/** The naive reply_once: straight to the platform's API. */
function naiveTool() {
  return tool(async (args) => sim.postDirectly(args), {
    name: "reply_once",
    description: "Reply to a post (straight to the platform).",
    schema: z.object({ bot: z.string(), parent: z.string(), text: z.string() }),
  });
}

test("naive tool: the resumed run posts a second reply", async () => {
  const parent = await sim.newParent();
  const results = [];
  await runThenResume(agent([naiveTool()], parent, results), parent);
  assert.deepEqual(results, ["sent", "sent"]);
  assert.equal(await sim.repliesTo(parent), 2);
});

test("replyd's MCP tool: the resumed run gets already_answered, one reply", async () => {
  const parent = await sim.newParent();
  const mcp = new MultiServerMCPClient({
    mcpServers: { replyd: { transport: "stdio", ...sim.mcp, stderr: "inherit" } },
  });
  try {
    const tools = (await mcp.getTools()).filter((t) => t.name === "reply_once");
    assert.equal(tools.length, 1);
    const results = [];
    const final = await runThenResume(agent(tools, parent, results), parent);
    assert.deepEqual(results, ["posted", "already_answered"]);
    assert.equal(statusOf(final.messages.at(-1).content), "already_answered");
  } finally {
    await mcp.close();
  }
  assert.equal(await sim.repliesTo(parent), 1);
});
