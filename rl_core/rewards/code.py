"""Code against hidden unit tests, in the sandbox: the ``code_tests`` reward and the harness
the code environment (:mod:`rl_core.agents.code_env`) shares with it.

:func:`run_tests` runs a solution and then each test (an assert statement, or a script's
top-level statement) in one sandboxed interpreter (:mod:`rl_core.rewards.sandbox`) and reads
each test's result as it finishes, so a solution that hangs on one test keeps the tests it
passed before. Results travel on stdout behind a random token the solution is not shown, so
printing ``PASSED`` fakes nothing (the harness shares the solution's process: a solution that
goes looking for the token in the interpreter's memory can find it, which the reward's
sandbox bounds but does not prevent). A run the sandbox could not make (no slot before the
deadline, or cut short by the caller's deadline) is an infrastructure failure: no score, never
a 0. Imports nothing heavy.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import math
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rl_core.rewards.sandbox import Ran, Sandbox, default_sandbox

__all__ = ["TestReport", "code_tests", "extract_code", "run_tests", "split_tests"]

_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# The token is a literal of _main's code, never a module global the solution's namespace sees.
_HARNESS = """
def _main():
    import os, json
    write, token = os.write, %(token)r
    def report(item):
        write(1, ("\\n" + token + json.dumps(item) + "\\n").encode())
    ns = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(%(code)r, "<solution>", "exec"), ns)
    except BaseException as e:
        report(["load", (type(e).__name__ + ": " + str(e))[:300]])
        return
    report(["load", None])
    for i, test in enumerate(%(tests)r):
        try:
            exec(compile(test, "<test>", "exec"), ns)
            report([i, None])
        except BaseException as e:
            report([i, (type(e).__name__ + ": " + str(e))[:300]])
_main()
"""


def extract_code(completion: str) -> str:
    """The last fenced python block of a completion, else the whole completion."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def split_tests(tests: Any) -> list[str]:  # noqa: ANN401
    """Unit tests as a list of statements: a list given, or a script's top-level statements."""
    if isinstance(tests, list | tuple):
        return [str(t) for t in tests]
    if not tests:
        return []
    try:
        tree = ast.parse(str(tests))
    except SyntaxError:
        return [str(tests)]
    return [ast.unparse(node) for node in tree.body]


@dataclass
class TestReport:
    """How a solution did: each test's error (None: passed), a load error (the solution itself
    raised: every test failed), and the sandbox's status (``Ran.status``)."""

    tests: list[str]
    errors: list[str | None] = field(default_factory=list)  # aligned with tests
    load_error: str | None = None
    status: str = "ok"
    stderr: str = ""

    @property
    def passed(self) -> int:
        return sum(e is None for e in self.errors)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and self.passed == len(self.tests)

    @property
    def infrastructure_failure(self) -> bool:
        """The sandbox did not run the solution to its own limit (no slot in time, cut short by
        the caller's deadline): not the solution's fault."""
        return self.status in ("busy", "deadline", "error")

    def feedback(self, show_tests: bool = True, max_failures: int = 3) -> str:
        """What a model reads after an attempt: the count, why the solution did not load or
        ran out of time, and (``show_tests``) the first failing tests with their errors."""
        lines = [f"{self.passed}/{len(self.tests)} tests passed."]
        if self.load_error:
            lines.append(f"Your code raised before any test ran: {self.load_error}")
        elif self.status == "timeout":
            lines.append("The run was stopped at its time limit.")
        elif self.status == "output_limit":
            lines.append("The run was stopped: it printed too much.")
        if show_tests and not self.load_error:
            failed = [(t, e) for t, e in zip(self.tests, self.errors, strict=True) if e is not None]
            for test, error in failed[:max_failures]:
                lines.append(f"Failed: {test}\n  {error}")
        return "\n".join(lines)


def run_tests(code: str, tests: Sequence[str], *, sandbox: Sandbox | None = None,
              timeout_s: float | None = None, memory_limit_mb: int | None = None,
              deadline: float | None = None) -> TestReport:
    """Run ``code`` then each of ``tests`` in one sandboxed interpreter (``timeout_s``: its
    wall-clock bound; the sandbox's own limits otherwise; ``deadline``: the caller's)."""
    box = sandbox or default_sandbox()
    limits = box.limits
    if timeout_s is not None:
        limits = replace(limits, wall_s=float(timeout_s), cpu_s=max(1, math.ceil(timeout_s)))
    if memory_limit_mb is not None:
        limits = replace(limits, memory_mb=int(memory_limit_mb))
    token = secrets.token_hex(16)
    program = _HARNESS % {"token": token, "code": code, "tests": list(tests)}
    ran = box.run(program, deadline=deadline, limits=limits)
    return _read_report(ran, token, list(tests))


def _read_report(ran: Ran, token: str, tests: list[str]) -> TestReport:
    report = TestReport(tests, [f"not run ({_why(ran)})"] * len(tests), status=ran.status,
                        stderr=ran.stderr[-2000:])
    loaded = False
    for line in ran.stdout.splitlines():
        if not line.startswith(token):
            continue
        try:
            key, error = json.loads(line[len(token):])
        except ValueError:
            continue
        if key == "load":
            loaded, report.load_error = error is None, error
        elif loaded and isinstance(key, int) and 0 <= key < len(tests):
            report.errors[key] = error
    if not loaded and report.load_error is None and not report.infrastructure_failure:
        report.load_error = f"the solution ended the run before the tests ({_why(ran)})"
    return report


def _why(ran: Ran) -> str:
    if ran.status == "ok":
        return f"exit code {ran.returncode}"
    return {"timeout": "time limit", "output_limit": "output limit",
            "deadline": "caller's deadline"}.get(ran.status, ran.status)


def code_tests(prompts: Sequence[Any], completions: Sequence[str], *,  # noqa: ANN401
               tests_column: str = "answer", timeout_s: float = 5.0,
               memory_limit_mb: int = 512, require: Literal["fraction", "all"] = "fraction",
               deadline: float | None = None, **columns: Sequence[Any]) -> list[float | None]:
    """The share of a task's unit tests that the completion's code passes (``require:
    all``: 1.0 only when every test passes, else 0.0): its last fenced python block, else the
    whole completion, run with the tests in the sandbox (:func:`run_tests`), the batch's
    programs concurrently (the sandbox's queue bounds them). ``tests_column``: the column of
    the tests (a list of assert statements, or a script whose top-level statements are the
    tests); ``timeout_s``/``memory_limit_mb``: each program's bounds; ``deadline``: the reward
    runner's (a program never runs past it). A task without tests, or one the sandbox could not
    run in time, scores None (no score)."""
    if require not in ("fraction", "all"):
        raise ValueError(f"code_tests: require must be 'fraction' or 'all', got {require!r}")
    tests_of = columns.get(tests_column)
    if tests_of is None:
        raise ValueError(f"code_tests: no column {tests_column!r} (columns: "
                         f"{', '.join(sorted(columns)) or 'none'}); set args.tests_column")
    box = default_sandbox()
    if deadline is not None:  # one program alone always fits, so its own limit decides it
        timeout_s = min(timeout_s, max(0.1, deadline - time.monotonic() - box.reserve_s - 0.25))

    def one(completion: str, tests: Any) -> float | None:  # noqa: ANN401
        statements = split_tests(tests)
        if not statements:
            return None
        report = run_tests(extract_code(completion), statements, sandbox=box,
                           timeout_s=timeout_s, memory_limit_mb=memory_limit_mb,
                           deadline=deadline)
        if report.infrastructure_failure:
            return None
        return float(report.all_passed) if require == "all" else report.fraction

    pairs = list(zip(completions, tests_of, strict=True))
    if len(pairs) <= 1:
        return [one(c, t) for c, t in pairs]
    workers = min(len(pairs), box.max_concurrent)
    with concurrent.futures.ThreadPoolExecutor(workers, "grpoflow-code-tests") as pool:
        return list(pool.map(lambda pair: one(*pair), pairs))

