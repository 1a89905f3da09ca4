"""A black-box agent program: the calculator task written against the ``openai`` client.

Nothing in it knows about grpoflow: an ordinary agent loop that runs the tools the model asks
for. ``agent.program: environments.calculator_agent:solve`` (docs/agents.md, 'Black-box agents').
"""

from __future__ import annotations

import json
from typing import Any

from rl_core.agents.tools import CALCULATOR, calculate

SYSTEM_PROMPT = "You can call the calculator tool."


def solve(client: Any, task: Any, *, max_turns: int = 3) -> float | None:  # noqa: ANN401
    """Answer ``task.question``, calling the calculator when the model asks; the reward is
    left to ``reward.fn`` (None), which scores the last answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": task.question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR.schema()], max_tokens=48,
            temperature=1.0).choices[0].message
        messages.append({"role": "assistant", "content": reply.content or ""})
        if not reply.tool_calls:
            return None
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments or "{}")
                result = calculate(**args)
            except Exception as e:  # the model reads its mistake, as with any tool
                result = f"Error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "content": result, "tool_call_id": call.id})
    return None
