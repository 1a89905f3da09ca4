"""The environment protocol: what a multi-turn episode talks to.

An :class:`Environment` is one episode's world: ``reset(task)`` returns the first messages,
``step(turn)`` a :class:`StepResult` (observation, reward, done, info). :class:`EpisodeLimits`
bound an episode; an environment that raises, hangs or answers malformed data fails its episode
with an :class:`EnvironmentFailure`, never the step (docs/agents.md, 'Writing an environment').
Never imports Prefect or MLflow.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rl_core.data.records import Record

__all__ = ["EnvironmentFailure", "Environment", "EpisodeLimits", "Message", "StepResult", "Turn",
           "bounded_calls", "check_messages"]

Message = dict[str, Any]  # an OpenAI-style chat message: {"role": ..., "content": ...}
_ROLES = {"system", "user", "assistant", "tool"}


@dataclass
class Turn:
    """One model turn: the text and the exact token ids the engine sampled."""

    text: str
    token_ids: list[int]
    finish_reason: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # 0 for the first model turn of the episode

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"


@dataclass
class StepResult:
    """What an environment answers to a model turn."""

    observation: list[Message] = field(default_factory=list)  # appended after the model's turn
    reward: float = 0.0  # this step's reward; an episode's reward is the sum
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # e.g. {"correct": True, "tool_calls": 1}


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds on one episode. Whichever is hit first ends it (``finish_reason`` says which)."""

    max_turns: int = 4  # model turns
    max_tokens: int = 256  # tokens after the prompt: model turns and observations
    timeout_s: float = 120.0  # wall time of the whole episode
    env_timeout_s: float = 30.0  # one reset() or step() call

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_s", "env_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"agent.{name} must be > 0, got {getattr(self, name)}")


class EnvironmentFailure(RuntimeError):
    """An environment raised, hung past ``agent.env_timeout_s``, or answered malformed data.
    ``kind`` is ``error``, ``timeout`` or ``malformed``."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)

    def __reduce__(self):  # picklable across process boundaries (Prefect results, Ray)
        return (type(self), (self.kind, str(self)))


@runtime_checkable
class Environment(Protocol):
    """One episode's world (a fresh object per episode; see :mod:`rl_core.agents`)."""

    def reset(self, task: Record) -> list[Message]:
        """The episode's first messages (system and user), rendered by the chat template."""

    def step(self, turn: Turn) -> StepResult:
        """React to the model's turn."""


# Environment calls run here; a hung call keeps its thread (Python cannot stop a thread), so
# the pool is large enough that a few stuck environments do not stall the rest.
_ENV_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="grpoflow-env")


def bounded_calls(items: Sequence[Any], fn: Callable[[Any], Any], timeout_s: float) -> list[Any]:
    """``fn(item)`` for every item concurrently, all within ``timeout_s`` (``agent.env_timeout_s``):
    each result, or an :class:`EnvironmentFailure` where the call raised or outlived the bound.
    What both episode runners (single- and multi-role) call their environments through."""
    futures = [_ENV_POOL.submit(fn, x) for x in items]
    deadline = time.monotonic() + timeout_s
    out: list[Any] = []
    for f in futures:
        try:
            out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            out.append(EnvironmentFailure(
                "timeout", f"no answer within agent.env_timeout_s={timeout_s:g}s"))
        except EnvironmentFailure as e:
            out.append(e)
        except Exception as e:  # noqa: BLE001 - the environment's own bug
            out.append(EnvironmentFailure("error", f"{type(e).__name__}: {e}"))
    return out


def check_messages(messages: object, where: str) -> list[Message]:
    """``messages`` as a list of ``{"role", "content"}`` dicts (``content`` a string, or a
    list of ``{"type": "text", "text"}`` and ``{"type": "image", "image"}`` parts: an image
    observation, docs/vlm.md), else a ``malformed`` :class:`EnvironmentFailure` naming
    ``where`` and the bad entry."""
    if not isinstance(messages, list):
        raise EnvironmentFailure("malformed", f"{where} returned {type(messages).__name__}, "
                                 "expected a list of chat messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in _ROLES and _content_ok(m.get("content"))):
            raise EnvironmentFailure(
                "malformed", f"{where}: message {i} is {str(m)[:120]!r}; expected "
                f"{{'role': one of {sorted(_ROLES)}, 'content': str or a list of text and "
                "image parts}")
    return messages


def _content_ok(content: object) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and ((p.get("type") == "text" and isinstance(p.get("text"), str))
                                 or (p.get("type") == "image" and p.get("image") is not None))
        for p in content)
