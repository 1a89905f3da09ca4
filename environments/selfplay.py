"""Self-play arithmetic: a proposer completes a problem template, a solver answers it.

Two roles of one policy (docs/agents.md, 'Multi-role episodes and self-play'). The task's first
step (``What is 3 + 4 ...?``) becomes a template with its first operand blanked
(``What is _ + 4?``); the proposer fills the blank (the demo's tiny model, warm-started on worked
answers, writes ``8 + 4 = 12`` and the ``8`` is its choice), the solver gets ``What is 8 + 4?``.
Rewards: the solver's is correctness (1 or 0); the proposer's is the *frontier* reward
``4 k (m - k) / (m (m - 1))``, the unbiased estimate of ``4 p (1 - p)`` from the ``m`` solver
attempts at the same problem in the step, ``k`` of them right: 1 where the solver succeeds half
the time, 0 where it always or never does, or where the problem was seen once (no estimate) or
the proposal does not fill the template. Never imports Prefect or MLflow; no I/O.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rl_core.agents.env import Message, Turn
from rl_core.agents.roles import RoleStep
from rl_core.data.records import Record

__all__ = ["SelfPlayArithmetic", "frontier_reward", "template"]

_FIRST_STEP = re.compile(r"What is \(*\s*(\d+)\s*([-+*])\s*(\d+)")
_LINE = re.compile(r"^\s*(\d+)\s*([-+*])\s*(\d+)")
_FINAL = re.compile(r"####\s*(-?\d+)")


def template(question: str) -> tuple[int, str, int]:
    """The first step of an arithmetic question: (first operand, operator, second operand)."""
    m = _FIRST_STEP.search(question)
    if m is None:
        raise ValueError(f"not an arithmetic question with a first step: {question!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))


def frontier_reward(k: int, m: int) -> float:
    """``4 k (m - k) / (m (m - 1))``: unbiased for ``4 p (1 - p)`` given ``k`` of ``m`` right
    (peak 1 at a solve rate of 1/2; an estimate from few attempts may exceed it, e.g. 4/3 for
    2 of 4); 0 when ``m`` < 2 (one attempt estimates nothing)."""
    return 4.0 * k * (m - k) / (m * (m - 1)) if m >= 2 else 0.0


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class SelfPlayArithmetic:
    """One episode: the proposer's turn, then the solver's (see the module docstring)."""

    roles = ("proposer", "solver")

    def __init__(self, max_operand: int = 99) -> None:
        self.max_operand = max_operand
        self.problem, self.valid, self.solved = "", False, False

    def reset(self, task: Record) -> list[Message]:
        a, self.op, self.b = template(task.question)
        self.fallback = a  # the task's own operand, for a proposal that does not fill the blank
        return [{"role": "user", "content": f"What is _ {self.op} {self.b}?"}]

    def step(self, turn: Turn) -> RoleStep:
        if not self.problem:  # the proposer's turn: its first worked line fills the blank
            m = _LINE.match(turn.text)
            self.valid = bool(m and m.group(2) == self.op and int(m.group(3)) == self.b
                              and int(m.group(1)) <= self.max_operand)
            x = int(m.group(1)) if self.valid and m else self.fallback
            self.answer = _value(x, self.op, self.b)
            self.problem = f"What is {x} {self.op} {self.b}?"
            return RoleStep([{"role": "user", "content": self.problem}], role="solver",
                            info={"proposal_valid": self.valid, "problem": self.problem})
        found = _FINAL.findall(turn.text)
        self.solved = bool(found) and int(found[-1]) == self.answer
        return RoleStep(done=True, rewards={"solver": float(self.solved)},
                        info={"solved": self.solved})

    @staticmethod
    def step_rewards(envs: Sequence[SelfPlayArithmetic | None]) -> list[dict[str, float]]:
        """The proposers' frontier rewards: each valid proposal's problem, scored by every
        solver attempt at that problem in the step (``None``: a failed episode)."""
        attempts: dict[str, list[bool]] = defaultdict(list)
        for env in envs:
            if env is not None and env.valid and env.problem:
                attempts[env.problem].append(env.solved)
        out: list[dict[str, Any]] = []
        for env in envs:
            if env is None or not env.valid:
                out.append({})
                continue
            seen = attempts[env.problem]
            out.append({"proposer": frontier_reward(sum(seen), len(seen))})
        return out
