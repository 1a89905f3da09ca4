"""A real ``verifiers`` environment (verifiers 0.4.0): arithmetic with a calculator tool.

A plugin package: :class:`CalculatorTaskset` (seeded problems, scored by each task's
``@vf.reward``) and :class:`CalculatorHarness` (the model's chat loop with the ``calculator``
tool); verifiers loads it by the id ``vf_calculator``, :func:`load_environment` builds the env.
Built locally because nothing may be downloaded at run time (docs/agents.md, 'Environment
hubs'). Never imports ``rl_core``, Prefect or MLflow; runs no code the model writes.
"""

from __future__ import annotations

import functools
import json
import random
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import verifiers.v1 as vf
from pydantic import Field

from environments.arithmetic import SYSTEM_PROMPT, TOOL_SCHEMA, calculate, make_problem, score

__all__ = ["CalculatorConfig", "CalculatorData", "CalculatorHarness", "CalculatorHarnessConfig",
           "CalculatorTask", "CalculatorTaskset", "load_environment"]

ENV_ID = "vf_calculator"  # the verifiers plugin id: its loader imports ids as top-level modules


class CalculatorData(vf.TaskData):
    """One problem: ``prompt`` is the question, ``answer`` the worked answer ending in
    ``#### <number>`` (a bare ``#### <number>`` is enough)."""

    answer: str = ""


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    """Scoring of one problem, over the finished trace."""

    @vf.reward
    async def correct_answer(self, task: CalculatorData, trace: vf.Trace) -> float:
        """1.0 when the last reply's ``#### <number>`` is the answer."""
        return score(trace.last_reply, task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalculatorConfig(vf.TasksetConfig):
    """``--env.taskset.*``: how many problems, their seed and shape, the instructions."""

    num_tasks: int = Field(200, ge=1)
    seed: int = 0
    steps: int = Field(2, ge=1)
    digits: int = Field(2, ge=1)
    instructions: str | None = SYSTEM_PROMPT
    """Each task's system prompt (None: none)."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    """Seeded problems, the same for the same config."""

    def load(self) -> Iterator[CalculatorTask]:
        rng = random.Random(self.config.seed)  # never the global random state
        for i in range(self.config.num_tasks):
            question, answer = make_problem(rng, self.config.steps, self.config.digits)
            yield CalculatorTask(
                CalculatorData(id=f"calc-{self.config.seed}-{i}", prompt=question,
                               system_prompt=self.config.instructions, answer=answer),
                self.config.task)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class CalculatorHarnessConfig(vf.HarnessConfig):
    """``--env.agent.harness.*``."""

    max_calls_per_turn: int = Field(4, ge=1)
    """Tool calls run per model turn; further calls are answered with an error."""
    stream: bool = False
    """Ask for streamed completions (as verifiers' own chat program does)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Bound on one model call (a training step's whole rollout may run in between)."""


def _run_call(call: dict[str, Any]) -> str:
    """The tool message text for one OpenAI tool call: the value, or an error the model reads."""
    function = call.get("function") or {}
    if function.get("name") != TOOL_SCHEMA["function"]["name"]:
        return f"Error: unknown tool {function.get('name')!r}; available: ['calculator']"
    try:
        args = json.loads(function.get("arguments") or "{}")
        return calculate(str(args["expression"]))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        return f"Error: bad arguments for calculator: {e}"
    except (ValueError, ZeroDivisionError, SyntaxError, OverflowError) as e:
        return f"Error: {type(e).__name__}: {e}"


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
    """The model's program: chat with the ``calculator`` tool until a reply makes no call."""

    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt stays a system message
    SUPPORTS_RESUME = True  # a stateless chat loop: verifiers may relaunch it on a transcript
    EXECUTES_CODE = False  # arithmetic only: safe in the subprocess runtime
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: vf.TaskData, tool_interception_url: str | None = None
                     ) -> vf.ProgramResult:
        from openai import AsyncOpenAI
        from verifiers.v1.dialects.chat import message_to_wire

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        # No SDK retries: a failed call is the rollout's to record, not to hide. One TLS
        # context for every episode: building one per client was most of an episode's CPU.
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             timeout=self.config.request_timeout_s,
                             http_client=httpx.AsyncClient(verify=_tls_context()))
        async with client:
            while True:
                reply = await self._complete(client, ctx.model, messages)
                messages.append(reply)
                calls = reply.get("tool_calls") or []
                if not calls:
                    break
                for i, call in enumerate(calls):
                    text = (_run_call(call) if i < self.config.max_calls_per_turn else
                            f"Error: at most {self.config.max_calls_per_turn} calls per turn")
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def _complete(self, client: Any, model: str,  # noqa: ANN401 (an AsyncOpenAI)
                        messages: list[dict[str, Any]]) -> dict[str, Any]:
        """One model call; the assistant message as OpenAI wire JSON."""
        if not self.config.stream:
            out = await client.chat.completions.create(model=model, messages=messages,
                                                       tools=[TOOL_SCHEMA])
            return out.choices[0].message.model_dump(exclude_none=True)
        content, calls = [], {}
        stream = await client.chat.completions.create(model=model, messages=messages,
                                                      tools=[TOOL_SCHEMA], stream=True)
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                content.append(delta.content or "")
                for part in delta.tool_calls or []:  # streamed calls arrive in pieces, by index
                    call = calls.setdefault(part.index, {"id": "", "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                    call["id"] += part.id or ""
                    if part.function is not None:
                        call["function"]["name"] += part.function.name or ""
                        call["function"]["arguments"] += part.function.arguments or ""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message


def load_environment(**kwargs: Any) -> vf.Env:  # noqa: ANN401
    """The environment as verifiers runs it: ``kwargs`` are taskset settings
    (:class:`CalculatorConfig`), the seat runs in the local subprocess runtime."""
    import sys

    sys.modules.setdefault(ENV_ID, sys.modules[__name__])  # verifiers imports ids top-level
    config = vf.resolve_env_config({"taskset": {"id": ENV_ID, **kwargs},
                                    "agent": {"runtime": {"type": "subprocess"}}})
    return vf.load_environment(config)
