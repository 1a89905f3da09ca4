"""Tools a model calls during an episode: parsing its calls, running them, bounded.

:func:`parse_tool_calls` finds Hermes ``<tool_call>`` blocks (reporting malformed ones, never
guessing); :func:`run_tool` runs one call with a wall-time bound, and a tool that raises, times
out or gets bad arguments answers with an error the model reads. Builtins: :data:`CALCULATOR`
(from the AST, never ``eval``) and :data:`PYTHON` (a fresh interpreter in the bubblewrap
sandbox, :mod:`rl_core.rewards.sandbox`: no network, no project files, no environment, bounded
in time, memory, processes and output; asking for it checks the sandbox can run, at start-up).
docs/agents.md, 'Tools' and 'Code sandbox'. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rl_core.engine.tool_parser import ToolCall, parse_tool_calls
from rl_core.rewards.sandbox import require_sandbox, run_code

__all__ = ["CALCULATOR", "PYTHON", "Tool", "ToolCall", "hermes_system_prompt", "parse_tool_calls",
           "resolve_tools", "run_tool"]

_MAX_OUTPUT_CHARS = 2000
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="grpoflow-tool")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``fn(**arguments) -> str`` plus its JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., str]
    timeout_s: float = 10.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function schema (what ``apply_chat_template(tools=...)`` takes)."""
        return {"type": "function", "function": {"name": self.name, "description":
                self.description, "parameters": self.parameters}}


def run_tool(tools: dict[str, Tool], call: ToolCall) -> tuple[str, str]:
    """Run ``call``: (tool message text, status) with status ``ok``, ``error`` or ``timeout``."""
    if call.error is not None:
        return f"Error: {call.error}", "error"
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; available: {sorted(tools)}", "error"
    future = _POOL.submit(tool.fn, **call.arguments)
    try:
        out = future.result(timeout=tool.timeout_s)
    except concurrent.futures.TimeoutError:
        return f"Error: {call.name} timed out after {tool.timeout_s:g}s", "timeout"
    except TypeError as e:
        return f"Error: bad arguments for {call.name}: {e}", "error"
    except Exception as e:  # the tool's failure is an observation for the model
        return f"Error: {type(e).__name__}: {e}"[:_MAX_OUTPUT_CHARS], "error"
    return str(out)[:_MAX_OUTPUT_CHARS], "ok"


# ---------------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses)."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _evaluate(ast.parse(expression.replace("^", "**"), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer():
            value = int(value)
    return str(value)


CALCULATOR = Tool(
    "calculator", "Evaluate an arithmetic expression and return its value.",
    {"type": "object", "properties": {"expression": {"type": "string", "description":
     "e.g. (12 + 7) * 3"}}, "required": ["expression"]}, calculate, timeout_s=2.0)


# ---------------------------------------------------------------------------- python

def run_python(code: str, *, timeout_s: float = 10.0, memory_limit_mb: int = 1024) -> str:
    """Run ``code`` in the sandbox (:func:`rl_core.rewards.sandbox.run_code`); its stdout (and
    stderr on failure). Raises TimeoutError at the time limit, RuntimeError when the sandbox
    had no slot for it in time (the model reads either as the tool's error)."""
    ran = run_code(code, timeout_s=timeout_s, memory_limit_mb=memory_limit_mb)
    if ran.status == "timeout":
        raise TimeoutError(f"the code ran longer than {timeout_s:g}s")
    if ran.status in ("busy", "error"):
        raise RuntimeError(f"the sandbox could not run the code: {ran.stderr}")
    if ran.status == "output_limit":
        return ran.stdout[:_MAX_OUTPUT_CHARS].strip() + "\n(output cut: the code printed too much)"
    text = ran.stdout
    if ran.returncode != 0:
        text += ran.stderr[-_MAX_OUTPUT_CHARS:]
    return text[:_MAX_OUTPUT_CHARS].strip() or "(no output)"


PYTHON = Tool(
    "python", "Run Python code in a sandbox and return what it prints.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    lambda code: run_python(code, timeout_s=10.0), timeout_s=15.0)

BUILTIN_TOOLS = {t.name: t for t in (CALCULATOR, PYTHON)}


def resolve_tools(names: Sequence[str]) -> dict[str, Tool]:
    """Builtin tools by name, or ``package.module:attribute`` naming a :class:`Tool`."""
    import importlib

    out: dict[str, Tool] = {}
    for name in names:
        if name in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[name]
            if tool is PYTHON:
                require_sandbox()  # now, naming the fix, not at the model's first call
        elif ":" in name:
            module, _, attr = name.partition(":")
            tool = getattr(importlib.import_module(module), attr)
            if not isinstance(tool, Tool):
                raise ValueError(f"agent.tools: {name} is a {type(tool).__name__}, not a Tool")
        else:
            raise ValueError(f"agent.tools: unknown tool {name!r}; builtins are "
                             f"{sorted(BUILTIN_TOOLS)}, or give package.module:attribute")
        out[tool.name] = tool
    return out


def hermes_system_prompt(tools: Sequence[Tool]) -> str:
    """The Hermes/Qwen tool instructions, for chat templates that do not render ``tools``."""
    listed = "\n".join(json.dumps(t.schema()) for t in tools)
    return ("You may call functions to help answer. Function signatures are within <tools>"
            f"</tools>:\n<tools>\n{listed}\n</tools>\nFor each call, return a JSON object "
            'within <tool_call></tool_call>: <tool_call>{"name": <name>, "arguments": '
            "<args-object>}</tool_call>")
