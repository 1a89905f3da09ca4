"""The code environment (``agent.env: code``): write a function, hidden unit tests judge it,
the model reads how it did and tries again.

Each model turn's code (its last fenced python block, else the whole turn) runs with the
task's tests in the sandbox (:func:`rl_core.rewards.code.run_tests`: bubblewrap, no network, no
project files, bounded). All tests passing ends the episode; otherwise the model gets a user
message with the count and (``feedback: tests``) the first failing tests and their errors, until
``agent.max_turns``. The step rewards telescope: each is the change in the score, so the
episode's reward (their sum) is the last attempt's score: the share of tests passed, or
(``require: all``) 1 only when all pass. A sandbox that could not run the code in time fails the
episode (retried, never scored 0). Every step leaves ``agent.env_timeout_s`` room: the sandbox's
bound is what is left of it. docs/agents.md, 'Code environment'. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from rl_core.agents.env import EnvironmentFailure, Message, StepResult, Turn
from rl_core.data.records import Record
from rl_core.rewards.code import extract_code, run_tests, split_tests
from rl_core.rewards.sandbox import Sandbox, SandboxLimits, default_sandbox

__all__ = ["DEFAULT_SYSTEM_PROMPT", "CodeEnv", "code_factory"]

DEFAULT_SYSTEM_PROMPT = (
    "Solve the task in Python. Answer with your code in one ```python fenced block. Hidden unit "
    "tests check it; after each attempt you are told how it did, and you may try again.")


class CodeEnv:
    """One coding episode (see the module docstring). ``tests_column``: the task's column of
    tests (a list of asserts, or a script whose top-level statements are the tests; the
    reference ``answer`` when the row has no such column); ``step_timeout_s``: the bound the
    episode runner puts on a step (``agent.env_timeout_s``)."""

    def __init__(self, *, sandbox: Sandbox | None = None, tests_column: str = "tests",
                 feedback: Literal["tests", "count"] = "tests",
                 require: Literal["fraction", "all"] = "fraction",
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, timeout_s: float | None = None,
                 memory_limit_mb: int | None = None, step_timeout_s: float = 30.0) -> None:
        if feedback not in ("tests", "count") or require not in ("fraction", "all"):
            raise ValueError(f"agent.env_args: feedback must be 'tests' or 'count' (got "
                             f"{feedback!r}), require 'fraction' or 'all' (got {require!r})")
        self.sandbox = sandbox or default_sandbox()
        self.tests_column, self.feedback, self.require = tests_column, feedback, require
        self.system_prompt, self.step_timeout_s = system_prompt, float(step_timeout_s)
        self.timeout_s, self.memory_limit_mb = timeout_s, memory_limit_mb  # None: the sandbox's
        self.tests: list[str] = []
        self.score, self.attempts = 0.0, 0

    def reset(self, task: Record) -> list[Message]:
        raw = task.columns.get(self.tests_column, task.answer)
        self.tests, self.score, self.attempts = split_tests(raw), 0.0, 0
        if not self.tests:
            raise EnvironmentFailure("malformed", f"task {task.id!r} has no unit tests in column "
                                     f"{self.tests_column!r} (agent.env_args.tests_column)")
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        deadline = time.monotonic() + self.step_timeout_s
        # the attempt's own limit ends before the step's bound, so a hang is the code's fault
        wall = min(self.timeout_s or self.sandbox.limits.wall_s,
                   max(0.1, self.step_timeout_s - self.sandbox.reserve_s - 0.25))
        report = run_tests(extract_code(turn.text), self.tests, sandbox=self.sandbox,
                           timeout_s=wall, memory_limit_mb=self.memory_limit_mb,
                           deadline=deadline)
        if report.infrastructure_failure:
            raise EnvironmentFailure("error", f"the code sandbox could not run the attempt: "
                                     f"{report.status} ({report.stderr.strip()[:200]})")
        self.attempts += 1
        score = float(report.all_passed) if self.require == "all" else report.fraction
        reward, self.score = score - self.score, score
        info = {"tests_passed": report.passed, "tests_total": len(self.tests),
                "correct": report.all_passed, "attempts": self.attempts}
        if report.all_passed:
            return StepResult(reward=reward, done=True, info=info)
        text = report.feedback(show_tests=self.feedback == "tests")
        return StepResult([{"role": "user", "content": text}], reward=reward, info=info)


def code_factory(step_timeout_s: float, limits: dict[str, Any] | None = None,
                 max_concurrent: int | None = None, **kwargs: Any) -> Callable[[], CodeEnv]:  # noqa: ANN401
    """``agent.env: code``: a factory of :class:`CodeEnv` sharing one sandbox (``limits``: a
    :class:`SandboxLimits` mapping, e.g. ``{wall_s: 5, memory_mb: 256}``; ``max_concurrent``:
    its slots; the other ``agent.env_args`` go to :class:`CodeEnv`), checked now: a machine
    where bubblewrap cannot run fails here, at start-up, naming the fix."""
    box = default_sandbox() if limits is None and max_concurrent is None else Sandbox(
        SandboxLimits(**(limits or {})), max_concurrent=max_concurrent)
    CodeEnv(sandbox=box, step_timeout_s=step_timeout_s, **kwargs)  # bad env_args fail now too
    return lambda: CodeEnv(sandbox=box, step_timeout_s=step_timeout_s, **kwargs)
