"""Custom reward functions that tests/test_rewards.py loads by dotted path ("reward_plugins:...").

What this module is for: giving `load_reward_fn` and `RewardRunner` real user-style functions
to import — well-behaved, raising, hanging, crashing, memory-hungry, badly typed — in-process
and in worker subprocesses. Tests put this directory on sys.path; it is not a package.

What it must never do: import prefect, mlflow or torch (worker start-up must stay fast), or
hang forever — every blocking function gives up after at most 60 s so a lost worker cannot
outlive a test session by much.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

from rl_core.rewards import gsm8k_reward

NOT_CALLABLE = 42

# Lets a test free a thread that RewardRunner(isolate=False) abandoned after a timeout.
RELEASE = threading.Event()


def length_reward(completion: str, answer: str) -> float:
    return min(len(completion), 100) / 100


def raising_reward(completion: str, answer: str) -> float:
    raise RuntimeError(f"boom on {completion!r}")


def exit_reward(completion: str, answer: str) -> float:
    raise SystemExit(3)


def nan_reward(completion: str, answer: str) -> float:
    return float("nan")


def str_reward(completion: str, answer: str) -> str:
    return "1.0"


def none_reward(completion: str, answer: str) -> None:
    return None


def list_reward(completion: str, answer: str) -> list[float]:
    return [1.0, 2.0]


def bool_reward(completion: str, answer: str) -> bool:
    return completion == answer


def huge_reward(completion: str, answer: str) -> float:
    return 1e308


def sleep_on_marker(completion: str, answer: str) -> float:
    """gsm8k_reward, except that a completion containing HANG sleeps for 60 s."""
    if "HANG" in completion:
        time.sleep(60)
    return gsm8k_reward(completion, answer)


def wait_on_marker(completion: str, answer: str) -> float:
    """gsm8k_reward, except that HANG blocks until RELEASE is set (at most 60 s)."""
    if "HANG" in completion:
        RELEASE.wait(60)
    return gsm8k_reward(completion, answer)


def die_on_marker(completion: str, answer: str) -> float:
    """gsm8k_reward, except that DIE kills the whole worker process without cleanup."""
    if "DIE" in completion:
        os._exit(7)
    return gsm8k_reward(completion, answer)


def spawn_and_hang(completion: str, answer: str) -> float:
    """Start a grandchild process, write its pid to the file named by `answer`, then hang."""
    child = subprocess.Popen(["sleep", "60"])
    with open(answer, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
    return 1.0


def memory_hog(completion: str, answer: str) -> float:
    """Allocate `completion` megabytes (as a decimal string) and report success."""
    block = bytearray(int(completion) * 1024 * 1024)
    return float(len(block) > 0)


def grow_on_marker(completion: str, answer: str) -> float:
    """gsm8k_reward, except that GROW allocates 8 MB blocks, and keeps them, without end.

    Only a memory limit stops it (MemoryError); the blocks are freed when the frame unwinds.
    Never call it without ``memory_limit_mb``: it would take the machine's memory.
    """
    if "GROW" in completion:
        blocks = []
        while True:
            blocks.append(bytearray(8 * 1024 * 1024))
    return gsm8k_reward(completion, answer)


def raise_on_marker(completion: str, answer: str) -> float:
    """gsm8k_reward, except that a completion containing FAIL raises."""
    if "FAIL" in completion:
        raise ValueError(f"cannot score {completion!r}")
    return gsm8k_reward(completion, answer)


def address_space_limit(completion: str, answer: str) -> float:
    """The worker's soft RLIMIT_AS in MB (-1: unlimited): what limit the runner applied."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return -1.0 if soft == resource.RLIM_INFINITY else soft / (1024 * 1024)


def partial_credit(completion: str, answer: str) -> float:
    """Partial credit: the number on the completion's first line (``"0.5\n#### 3"`` -> 0.5)."""
    return float(completion.split("\n", 1)[0])


def pid_reward(completion: str, answer: str) -> float:
    return float(os.getpid())


def one_arg(completion: str) -> float:
    return 0.0


class Scorer:
    @staticmethod
    def score(completion: str, answer: str) -> float:
        return 0.5


# --- the batched (TRL) form and async functions (tests/test_data_and_rewards.py)

def batched_label(prompts: list, completions: list[str], label: list, **columns) -> list:  # noqa: ANN003
    """1.0 when the completion ends with the row's label; None for a row without a label."""
    return [None if lab is None else float(c.strip().endswith(str(lab)))
            for c, lab in zip(completions, label, strict=True)]


def batched_sees_everything(prompts: list, completions: list[str], **columns) -> list[float]:  # noqa: ANN003
    """Scores 1.0 when it got a prompt and the columns, to show what travels to a worker."""
    return [float(p is not None and "label" in columns and "extra" in columns) for p in prompts]


def batched_wrong_length(prompts: list, completions: list[str], **columns) -> list[float]:  # noqa: ANN003
    return [1.0]


def batched_hang(prompts: list, completions: list[str], **columns) -> list[float]:  # noqa: ANN003
    time.sleep(60)
    return [0.0] * len(completions)


async def async_single(completion: str, answer: str) -> float:
    import asyncio

    await asyncio.sleep(0.01)
    return float(completion.strip() == str(answer))


async def async_batched(prompts: list, completions: list[str], **columns) -> list[float]:  # noqa: ANN003
    import asyncio

    await asyncio.sleep(0.01)
    return [float(len(c)) for c in completions]


def three_args(completion: str, answer: str, extra: str) -> float:
    return 0.0
