"""A reward function that misbehaves at random, for tests/test_chaos.py (fault 7).

``chaos_gsm8k`` is the builtin gsm8k reward, except that a small, seeded share of samples
raise, hang past ``reward.timeout_s``, or allocate past ``reward.memory_limit_mb``. Whether
a sample misbehaves depends only on (``GRPOFLOW_CHAOS_SEED``, the reference answer, the
completion text), so a run is reproducible; every injected fault is appended, one line per
fault, to the file named by ``GRPOFLOW_CHAOS_LOG`` *before* it happens, so a test can check
that the run counted exactly what was injected. ``GRPOFLOW_CHAOS_REWARD_P`` sets the three
probabilities ("raise,hang,oom", default "0.02,0.02,0.02"). A tiny model repeats its texts,
so a run may see few distinct ones and, by chance, no fault of a kind: the kinds listed in
``GRPOFLOW_CHAOS_ENSURE`` (e.g. "raise,hang,oom") are injected on the next clean sample while
the log holds none of them yet (two workers may both do so; both log it, so counts still
match). Workers inherit the variables from the flow process. Tests put this directory on
sys.path; it is not a package.

What it must never do: import prefect, mlflow or torch (worker start-up must stay fast);
hang more than 60 s; or allocate without a memory limit in force (it raises instead).
"""

from __future__ import annotations

import hashlib
import os
import resource
import time

from rl_core.rewards import gsm8k_reward

SEED_ENV = "GRPOFLOW_CHAOS_SEED"
LOG_ENV = "GRPOFLOW_CHAOS_LOG"
P_ENV = "GRPOFLOW_CHAOS_REWARD_P"
ENSURE_ENV = "GRPOFLOW_CHAOS_ENSURE"
HANG_S = 60.0  # far past any test's reward.timeout_s, and the most a worker may hang


def fault_for(completion: str, answer: str) -> str | None:
    """``"raise"``, ``"hang"``, ``"oom"`` or None: this sample's fate, from a seeded hash."""
    p_raise, p_hang, p_oom = (float(x) for x in os.environ.get(P_ENV, "0.02,0.02,0.02").split(","))
    key = f"{os.environ.get(SEED_ENV, '0')}\0{answer}\0{completion}".encode()
    u = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
    for kind, edge in (("raise", p_raise), ("hang", p_raise + p_hang),
                       ("oom", p_raise + p_hang + p_oom)):  # fmt: skip
        if u < edge:
            return kind
    return _missing_kind()


_all_ensured = False  # this worker saw every wanted kind in the log: stop reading it


def _missing_kind() -> str | None:
    """The first kind in GRPOFLOW_CHAOS_ENSURE that the log holds no line of, if any."""
    global _all_ensured
    wanted = [k for k in os.environ.get(ENSURE_ENV, "").split(",") if k]
    path = os.environ.get(LOG_ENV)
    if _all_ensured or not wanted or not path:
        return None
    try:
        with open(path) as f:
            seen = {line.split()[-1] for line in f if line.strip()}
    except FileNotFoundError:
        seen = set()
    missing = next((k for k in wanted if k not in seen), None)
    _all_ensured = missing is None
    return missing


def _record(kind: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:  # one write of one short line with O_APPEND: lines never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{time.time():.3f} {os.getpid()} {kind}\n".encode())
        finally:
            os.close(fd)


def chaos_gsm8k(completion: str, answer: str) -> float:
    """gsm8k_reward, except for the seeded few samples that raise, hang or exhaust memory."""
    kind = fault_for(completion, answer)
    if kind is not None:
        _record(kind)
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
