"""A reward function that misbehaves on planned calls, for tests/test_chaos.py (fault 7).

``chaos_gsm8k`` is the builtin gsm8k reward, except that planned calls raise, hang past
``reward.timeout_s``, or allocate past ``reward.memory_limit_mb``. The plan is by call
number, not by what the model wrote: ``GRPOFLOW_CHAOS_PLAN="3:raise,17:hang,30:oom"`` makes
the 3rd, 17th and 30th reward call of the run (counted across every worker process in a
counter file beside the log, under an exclusive lock) misbehave, whatever texts a tiny model
happens to produce. A run that makes at least as many calls as the plan's last number sees
exactly the planned faults, in any scheduling. Each injected fault is appended to
``GRPOFLOW_CHAOS_LOG`` *before* it happens, one line each, so a test can check that the run
counted exactly what was injected. Workers inherit the variables from the flow process.
Tests put this directory on sys.path; it is not a package.

What it must never do: import prefect, mlflow or torch (worker start-up must stay fast);
hang more than 60 s; or allocate without a memory limit in force (it raises instead).
"""

from __future__ import annotations

import fcntl
import os
import random
import resource
import time

from rl_core.rewards import gsm8k_reward

LOG_ENV = "GRPOFLOW_CHAOS_LOG"
PLAN_ENV = "GRPOFLOW_CHAOS_PLAN"
HANG_S = 60.0  # far past any test's reward.timeout_s, and the most a worker may hang
KINDS = ("raise", "hang", "oom")


def parse_plan(text: str) -> dict[int, str]:
    """``"3:raise,17:hang"`` -> {3: "raise", 17: "hang"} (call numbers start at 1)."""
    plan: dict[int, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        number, kind = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{PLAN_ENV}: unknown fault {kind!r} (one of {KINDS})")
        plan[int(number)] = kind
    return plan


def seeded_plan(seed: int, calls: int, counts: dict[str, int]) -> str:
    """A plan with ``counts[kind]`` faults of each kind on distinct calls in 1..``calls``,
    drawn from ``random.Random(seed)`` (the soak's random-but-replayable faults)."""
    numbers = random.Random(seed).sample(range(1, calls + 1), sum(counts.values()))
    kinds = [k for k, c in counts.items() for _ in range(c)]
    return ",".join(f"{n}:{k}" for n, k in sorted(zip(numbers, kinds, strict=True)))


def _next_call(log_path: str) -> int:
    """This call's number in the run: a counter file beside the log, bumped under a lock."""
    fd = os.open(log_path + ".calls", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        number = int(os.pread(fd, 32, 0) or b"0") + 1
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(number).encode(), 0)
        return number
    finally:
        os.close(fd)  # closing releases the lock


def _record(path: str, number: int, kind: str) -> None:
    # one write of one short line with O_APPEND: lines never interleave
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{number} {os.getpid()} {kind}\n".encode())
    finally:
        os.close(fd)


def fault_for_call() -> str | None:
    """``"raise"``, ``"hang"``, ``"oom"`` or None: the plan's entry for this call."""
    path, plan = os.environ.get(LOG_ENV), parse_plan(os.environ.get(PLAN_ENV, ""))
    if not path or not plan:
        return None
    number = _next_call(path)
    kind = plan.get(number)
    if kind is not None:
        _record(path, number, kind)
    return kind


def chaos_gsm8k(completion: str, answer: str) -> float:
    """gsm8k_reward, except on the planned calls, which raise, hang or exhaust memory."""
    kind = fault_for_call()
    if kind == "raise":
        raise RuntimeError("chaos: injected reward failure")
    if kind == "hang":
        time.sleep(HANG_S)
    if kind == "oom":
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            raise RuntimeError("chaos: no memory limit in force; refusing to exhaust memory")
        block = bytearray(soft)  # more than the whole address space allowed: MemoryError
        return float(len(block) > 0)
    return gsm8k_reward(completion, answer)
