"""Seeded arithmetic word problems in GSM8K format, for the embedded demo and for tests.

A few ``+``, ``-`` or ``*`` steps evaluated left to right (parenthesised so ordinary precedence
agrees), one worked line per step, ending with ``#### <result>``: a tiny model can learn this
(docs/configuration.md, 'Data'). Never touches global random state, does I/O or imports
prefect or mlflow; output is a pure function of (n, seed, knobs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rl_core.data.records import Record

__all__ = ["SUPPORTED_OPERATIONS", "generate_arithmetic", "generate_splits"]

SUPPORTED_OPERATIONS = ("+", "-", "*")
_MAX_RESTARTS = 1000


def _check_knobs(
    digits: tuple[int, int], operations: Sequence[str], steps: tuple[int, int]
) -> tuple[str, ...]:
    for name, value in (("digits", digits), ("steps", steps)):
        lo, hi = value
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be (min, max) with 1 <= min <= max, got {value!r}")
    ops = tuple(operations)
    if not ops:
        raise ValueError(f"operations must not be empty; choose from {SUPPORTED_OPERATIONS}")
    unknown = [op for op in ops if op not in SUPPORTED_OPERATIONS]
    if unknown:
        raise ValueError(f"unsupported operations {unknown!r}; choose from {SUPPORTED_OPERATIONS}")
    return ops


def _bounds(d: int) -> tuple[int, int]:
    """Smallest and largest integer with exactly ``d`` digits (0 counts as 1 digit)."""
    return (0 if d == 1 else 10 ** (d - 1)), 10**d - 1


def _operand(rng: random.Random, digits: tuple[int, int]) -> int:
    return rng.randint(*_bounds(rng.randint(*digits)))


def _subtrahend(rng: random.Random, current: int, digits: tuple[int, int]) -> int | None:
    """An operand in the digit range that is <= current, or None when none exists."""
    feasible = [d for d in range(digits[0], digits[1] + 1) if _bounds(d)[0] <= current]
    if not feasible:
        return None
    lo, hi = _bounds(rng.choice(feasible))
    return rng.randint(lo, min(hi, current))


def _problem(rng: random.Random, digits: tuple[int, int], ops: tuple[str, ...],
             steps: tuple[int, int], allow_negative: bool,
             long_tail: tuple[float, int] = (0.0, 0)) -> tuple[str, str]:
    """One (question, answer) pair; restarts when "-" cannot stay non-negative. With
    ``long_tail = (p, s)``, p > 0, a problem has ``s`` steps with probability p."""
    for _ in range(_MAX_RESTARTS):
        current = _operand(rng, digits)
        expression, top_op = str(current), None
        lines: list[str] = []
        count = rng.randint(*steps)
        if long_tail[0] > 0 and rng.random() < long_tail[0]:  # no draw when off: same data
            count = long_tail[1]
        for step in range(count):
            op = rng.choice(ops)
            # The right operand of "*" is one digit (2-9) so products stay small.
            operand = rng.randint(2, 9) if op == "*" else _operand(rng, digits)
            if op == "-" and not allow_negative and operand > current:
                if step == 0:
                    current, operand = operand, current  # swap the two literals
                    expression = str(current)
                else:
                    resampled = _subtrahend(rng, current, digits)
                    if resampled is None:
                        break  # restart: nothing in the digit range fits
                    operand = resampled
            if op == "*" and top_op in ("+", "-"):
                expression = f"({expression})"
            result = {"+": current + operand, "-": current - operand, "*": current * operand}[op]
            lines.append(f"{current} {op} {operand} = {result}")
            expression = f"{expression} {op} {operand}"
            current, top_op = result, op
        else:
            lines.append(f"#### {current}")
            return f"What is {expression}?", "\n".join(lines)
    raise ValueError(
        f"could not build a non-negative problem with digits={digits}, operations={ops}, "
        f"steps={steps}; allow '+' or set allow_negative=True")


def generate_arithmetic(
    n: int, seed: int, *, digits: tuple[int, int] = (1, 2),
    operations: Sequence[str] = ("+", "-"), steps: tuple[int, int] = (1, 2),
    allow_negative: bool = False, long_frac: float = 0.0, long_steps: int = 12,
) -> list[Record]:
    """``n`` GSM8K-format arithmetic problems, deterministic for ``seed``; ids ``syn-{seed}-{i}``.
    Steps, operand digits and ``*``'s one-digit right operand as docs/configuration.md ('Data')
    says; ``allow_negative=False``: no negative intermediate result; ``long_frac`` of the problems
    get ``long_steps`` steps. May repeat a question (:func:`generate_splits`: disjoint splits)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    ops = _check_knobs(digits, operations, steps)
    rng, tail = random.Random(seed), _tail(long_frac, long_steps)
    return [Record(f"syn-{seed}-{i}", *_problem(rng, digits, ops, steps, allow_negative, tail))
            for i in range(n)]


def _tail(long_frac: float, long_steps: int) -> tuple[float, int]:
    if not 0.0 <= long_frac <= 1.0 or long_steps < 1:
        raise ValueError(f"long_frac must be in [0, 1] and long_steps >= 1, got {long_frac}, "
                         f"{long_steps}")
    return long_frac, long_steps


def generate_splits(
    n_train: int, n_test: int, seed: int, *, digits: tuple[int, int] = (1, 2),
    operations: Sequence[str] = ("+", "-"), steps: tuple[int, int] = (1, 2),
    allow_negative: bool = False, long_frac: float = 0.0, long_steps: int = 12,
    task: str = "arithmetic", size: int = 64,
) -> tuple[list[Record], list[Record]]:
    """(train, test): train is ``generate_arithmetic(n_train, seed, ...)``; test questions are
    unique and never appear in train; test ids are ``syn-{seed}-test-{i}``. Raises ValueError
    when the knobs allow too few distinct questions to fill the test set. ``task="shapes"``:
    :func:`rl_core.data.shapes.shape_splits` on ``size``-pixel pictures instead.
    """
    if task == "shapes":
        from rl_core.data.shapes import shape_splits

        return shape_splits(n_train, n_test, seed, size=size)
    if task != "arithmetic":
        raise ValueError(f"synthetic task must be arithmetic or shapes, got {task!r}")
    if n_test < 0:
        raise ValueError(f"n_test must be >= 0, got {n_test}")
    train = generate_arithmetic(n_train, seed, digits=digits, operations=operations, steps=steps,
                                allow_negative=allow_negative, long_frac=long_frac,
                                long_steps=long_steps)
    tail = _tail(long_frac, long_steps)
    ops = _check_knobs(digits, operations, steps)
    seen = {r.question for r in train}
    rng = random.Random(f"grpoflow-synthetic-test:{seed}")
    test: list[Record] = []
    attempts, max_attempts = 0, 50 * n_test + 10_000
    while len(test) < n_test:
        if attempts >= max_attempts:
            raise ValueError(
                f"only {len(test)} of {n_test} test questions could be made that are not in the "
                f"training set after {attempts} tries; widen digits/steps/operations or "
                "lower n_train/n_test")
        attempts += 1
        question, answer = _problem(rng, digits, ops, steps, allow_negative, tail)
        if question in seen:
            continue
        seen.add(question)
        test.append(Record(id=f"syn-{seed}-test-{len(test)}", question=question, answer=answer))
    return train, test
