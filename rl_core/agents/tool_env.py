"""The builtin tool-use environment: answer the task, calling tools on the way.

Each tool call of a model turn gets a ``tool`` message; a turn without one is the final answer.
No reward of its own: ``reward.fn`` scores the final answer (``agent.score_final_answer``) with
its sandbox and fault budget (docs/agents.md, 'Tools'). Never imports Prefect or MLflow.
"""

from __future__ import annotations

from rl_core.agents.env import Message, StepResult, Turn
from rl_core.agents.tools import Tool, parse_tool_calls, run_tool
from rl_core.data.records import Record

__all__ = ["ToolEnv"]


class ToolEnv:
    """Question in, tool calls answered, final answer out (see the module docstring)."""

    def __init__(self, tools: dict[str, Tool], system_prompt: str | None = None,
                 max_calls_per_turn: int = 4) -> None:
        self.tools, self.system_prompt = tools, system_prompt
        self.max_calls_per_turn = max_calls_per_turn
        self.calls = 0

    def reset(self, task: Record) -> list[Message]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return StepResult(done=True, info={"tool_calls": 0})
        messages, failed = [], 0
        for call in calls[: self.max_calls_per_turn]:
            text, status = run_tool(self.tools, call)
            failed += status != "ok"
            messages.append({"role": "tool", "content": text})
        self.calls += len(messages)
        return StepResult(messages, info={"tool_calls": len(messages), "tool_errors": failed})
