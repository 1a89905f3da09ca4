"""An OpenEnv environment for tests/test_connectors.py: guess the task's answer, a structured
(two-field) action and a text observation. Its own module, so that collecting the tests does not
import OpenEnv (and Gradio with it, ~4 s a process)."""

from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State

from environments.arithmetic import final_number


class GuessAction(Action):
    guess: int
    reason: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess the task's answer in as many tries as needed; a structured (two-field) action and
    a text observation. ``fail`` makes its reset raise, or its step raise or hang."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.fail, self._state, self.target = fail, State(), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              answer: str = "") -> GuessObservation:
        if self.fail == "reset":
            raise ConnectionError("the game server is down")
        self.target = int(final_number(answer) or 0)
        self._state = State(episode_id=episode_id)
        return GuessObservation(text="Guess the number.")

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:  # noqa: ANN401
        if self.fail == "raise":
            raise RuntimeError("the game engine crashed")
        if self.fail == "hang":
            time.sleep(3)
        self._state.step_count += 1
        right = action.guess == self.target
        return GuessObservation(text="higher" if action.guess < self.target else "lower",
                                done=right, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


class SoloGuessEnv(GuessEnv):
    SUPPORTS_CONCURRENT_SESSIONS = False
