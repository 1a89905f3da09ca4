"""A real OpenEnv environment (openenv-core 0.3.0): arithmetic with a calculator tool.

:class:`CalculatorEnvironment` (typed action, observation, state; :class:`AnswerRubric` scores
the final answer), served by OpenEnv's own app: ``uvicorn environments.openenv_calculator:app``
or ``python -m environments.openenv_calculator --port 8000`` (docs/agents.md, 'Environment
hubs'). Built locally because nothing may be downloaded at run time. Never imports ``rl_core``,
Prefect or MLflow; runs no code the model writes.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State
from openenv.core.rubrics import Rubric
from pydantic import Field

from environments.arithmetic import SYSTEM_PROMPT, calculate, hermes_calls, make_problem, score

__all__ = ["AnswerRubric", "CalculatorAction", "CalculatorEnvironment", "CalculatorObservation",
           "CalculatorState", "make_app"]


class CalculatorAction(Action):
    """The model's turn."""

    message: str = Field(..., description="The model's turn: an answer ending in "
                         "`#### <number>`, or <tool_call> blocks calling the calculator.")


class CalculatorObservation(Observation):
    """What the model sees next, as chat messages."""

    messages: list[dict[str, str]] = Field(default_factory=list, description=
                                           "Chat messages for the model ({role, content}).")
    tool_calls: int = Field(0, ge=0, description="Calculator calls answered in this step.")


class CalculatorState(State):
    """The episode so far."""

    question: str = ""
    answer: str = ""
    tool_calls: int = 0


class AnswerRubric(Rubric):
    """1.0 when the final turn's ``#### <number>`` is the episode's answer, else 0.0."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = ""

    def forward(self, action: CalculatorAction, observation: CalculatorObservation) -> float:
        return score(action.message, self.answer)

    def reset(self) -> None:
        self.answer = ""


def _tool_message(name: str, args: dict | None, error: str | None) -> str:
    if error is not None:
        return f"Error: {error}"
    if name != "calculator":
        return f"Error: unknown tool {name!r}; available: ['calculator']"
    try:
        return calculate(str((args or {})["expression"]))
    except KeyError:
        return "Error: bad arguments for calculator: missing 'expression'"
    except (ValueError, ZeroDivisionError, SyntaxError, OverflowError) as e:
        return f"Error: {type(e).__name__}: {e}"


class CalculatorEnvironment(Environment[CalculatorAction, CalculatorObservation, CalculatorState]):
    """Answer the question, calling the calculator on the way; a turn without a call (or the
    one reaching ``max_steps``) ends the episode. ``reset(question=, answer=)`` sets the task,
    else a seeded problem is drawn."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared mutable state between instances

    def __init__(self, max_steps: int = 4, max_calls_per_step: int = 4, seed: int = 0,
                 system_prompt: str | None = SYSTEM_PROMPT) -> None:
        super().__init__(rubric=AnswerRubric())
        self.max_steps, self.max_calls_per_step = max_steps, max_calls_per_step
        self.system_prompt = system_prompt
        self._rng = random.Random(seed)  # never the global random state
        self._state = CalculatorState()

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              question: str | None = None, answer: str | None = None,
              **kwargs: Any) -> CalculatorObservation:  # noqa: ANN401
        self._reset_rubric()
        if question is None or answer is None:
            rng = random.Random(seed) if seed is not None else self._rng
            question, answer = make_problem(rng)
        self.rubric.answer = answer
        self._state = CalculatorState(episode_id=episode_id or uuid.uuid4().hex,
                                      question=question, answer=answer)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return CalculatorObservation(messages=[*system, {"role": "user", "content": question}],
                                     reward=0.0)

    def step(self, action: CalculatorAction, timeout_s: float | None = None,
             **kwargs: Any) -> CalculatorObservation:  # noqa: ANN401
        self._state.step_count += 1
        calls = hermes_calls(action.message)
        if calls and self._state.step_count < self.max_steps:
            answered = [_tool_message(*c) for c in calls[: self.max_calls_per_step]]
            answered += [f"Error: at most {self.max_calls_per_step} calls per turn"
                         for _ in calls[self.max_calls_per_step:]]
            self._state.tool_calls += len(answered)
            return CalculatorObservation(
                messages=[{"role": "tool", "content": text} for text in answered],
                tool_calls=len(answered), reward=0.0)
        observation = CalculatorObservation(done=True)
        observation.reward = self._apply_rubric(action, observation)
        return observation

    @property
    def state(self) -> CalculatorState:
        return self._state


def make_app(max_concurrent_envs: int = 64, **env_kwargs: Any) -> Any:  # noqa: ANN401
    """OpenEnv's HTTP app (FastAPI) serving :class:`CalculatorEnvironment` sessions."""
    import functools

    from openenv.core.env_server import create_fastapi_app

    factory = functools.partial(CalculatorEnvironment, **env_kwargs)
    return create_fastapi_app(factory, CalculatorAction, CalculatorObservation,
                              max_concurrent_envs=max_concurrent_envs)


def __getattr__(name: str) -> Any:  # noqa: ANN401
    # `uvicorn environments.openenv_calculator:app`, built on first use, not on import.
    if name == "app":
        globals()["app"] = app = make_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """``python -m environments.openenv_calculator [--host H] [--port P]``."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(make_app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
