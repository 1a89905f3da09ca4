"""The arithmetic task the calculator environments share: problems, the tool, the score.

Two-digit ``+``/``-``/``*`` steps evaluated left to right (``"What is (47 + 38) * 7?"``,
``"#### 595"``), the calculator (from the AST, never ``eval``) and the score, shared so the hub
environments agree (docs/agents.md, 'Environment hubs'). Standalone on purpose: never imports
``rl_core``, Prefect or MLflow, does no I/O, and never touches global random state.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from fractions import Fraction

__all__ = ["SYSTEM_PROMPT", "TOOL_SCHEMA", "calculate", "final_number", "hermes_calls",
           "make_problem", "score"]

# What grpoflow's tiny agent model is warm-started on (rl_core.models.tiny.TOOL_SYSTEM_PROMPT):
# short, because the tiny model's context is 512 tokens.
SYSTEM_PROMPT = "You can call the calculator tool."

TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression and return its value.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "e.g. (12 + 7) * 3"}}, "required": ["expression"]}}}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _evaluate(node: ast.AST) -> int | float:
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
    """The value of an arithmetic expression (``+ - * / // % **``, parentheses); raises
    ``ValueError``/``ZeroDivisionError``/``SyntaxError`` on anything else."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _evaluate(ast.parse(expression.replace("^", "**"), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer():
            value = int(value)
    return str(value)


def make_problem(rng: random.Random, steps: int = 2, digits: int = 2) -> tuple[str, str]:
    """One problem: (question, answer ending in ``#### <result>``), left-to-right steps
    whose results stay non-negative."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    value = rng.randint(lo, hi)
    text, lines = str(value), []
    for _ in range(steps):
        op = rng.choice("+-*")
        if op == "-" and value < lo:
            op = "+"
        operand = rng.randint(lo, min(hi, value) if op == "-" else hi)
        new = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
        lines.append(f"{value} {op} {operand} = {new}")
        # Parenthesise a sum or difference before a `*`, so ordinary precedence gives the
        # left-to-right value.
        grouped = op == "*" and ("+" in text or "-" in text)
        text = f"({text}) {op} {operand}" if grouped else f"{text} {op} {operand}"
        value = new
    return f"What is {text}?", "\n".join([*lines, f"#### {value}"])


def final_number(text: str) -> Fraction | None:
    """The number after the last ``####`` in ``text`` (the whole text when there is none)."""
    _, marker, tail = text.rpartition("####")
    m = _NUMBER.search(tail if marker else text)
    if m is None:
        return None
    try:
        return Fraction(m.group(0).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def score(reply: str, answer: str) -> float:
    """1.0 when ``reply``'s final answer (after its last ``####``) equals ``answer``'s."""
    _, marker, tail = reply.rpartition("####")
    if not marker:
        return 0.0  # the answer format is part of the task, as for grpoflow's gsm8k reward
    got, want = final_number(tail), final_number(answer)
    return 1.0 if got is not None and got == want else 0.0


def hermes_calls(text: str) -> list[tuple[str, dict | None, str | None]]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text`` as
    (name, arguments, error); a malformed call has ``error`` set and arguments None."""
    calls: list[tuple[str, dict | None, str | None]] = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(("", None, f"the tool call is not valid JSON ({e.msg})"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append((name if isinstance(name, str) else "", None,
                          'a tool call must be {"name": str, "arguments": {...}}'))
            continue
        calls.append((name, args, None))
    return calls
