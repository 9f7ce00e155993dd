"""What the hermes-agent tests share: a hermes adapter, guarded or not, with a scripted agent (no LLM)."""

from __future__ import annotations

from typing import Any

from replyd.integrations.hermes import guard

ANSWER = "It is noon."


async def connected(adapter: Any, store_url: str | None) -> list[str]:
    """Guard ``adapter`` (unless ``store_url`` is None), give it a scripted agent, connect it; return its turns."""
    if store_url is not None:
        guard(adapter, store_url, sweep_every_s=0, send_timeout_s=1.0)
    turns: list[str] = []

    async def agent(event: Any) -> str:  # the agent's turn: scripted, no LLM
        turns.append(event.message_id)
        return ANSWER

    adapter.set_message_handler(agent)
    assert await adapter.connect()
    return turns
