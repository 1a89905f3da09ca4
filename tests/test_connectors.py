"""Environment-hub connectors (rl_core/agents/verifiers_env.py and openenv_env.py) with real
hub environments built locally: the verifiers calculator (environments/vf_calculator.py: its taskset, harness and
rubric run unchanged in verifiers 0.4.0, grpoflow being its model provider) and the OpenEnv
calculator (environments/openenv_calculator.py: in-process and behind OpenEnv's own HTTP app
on 127.0.0.1).

Scripted turns check what each adapter gives the episode runner exactly (messages, rewards,
done); the episode runner then plays both over the tiny chat model on the in-process engine.
A hub environment that raises or hangs fails its episode (retried, then recorded), never the
step, and the error names the environment.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from environments.arithmetic import score
from rl_core.agents import (
    ChatTokens,
    EnvironmentFailure,
    EpisodeLimits,
    EpisodeRunner,
    Turn,
    environment_factory,
)
from rl_core.agents.openenv_env import OpenEnvFactory, openenv_factory
from rl_core.agents.verifiers_env import VerifiersFactory, verifiers_factory
from rl_core.config import AgentConfig
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.inprocess import InProcessPlane

VF_ENV = "environments.vf_calculator"
OE_ENV = "environments.openenv_calculator:CalculatorEnvironment"
TASK = Record("t0", "What is (47 + 38) * 7?", "47 + 38 = 85\n85 * 7 = 595\n#### 595")
TASKS = [Record(f"t{i}", f"What is {i} + {i + 1}?", f"#### {2 * i + 1}") for i in range(3)]
SYSTEM = {"role": "system", "content": "You can call the calculator tool."}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "(47 + 38) * 7"}}</tool_call>'


def turn(text: str, n: int = 5, index: int = 0) -> Turn:
    return Turn(text, list(range(n)), {"type": "stop"}, index)


# ---------------------------------------------------------------------------- verifiers


def test_the_hub_envs_load_as_their_hubs_load_them() -> None:
    import verifiers.v1 as vf

    from environments import openenv_calculator, vf_calculator

    env = vf_calculator.load_environment(num_tasks=3, seed=1)  # the hub convention
    assert isinstance(env, vf.SingleAgentEnv)
    assert isinstance(env._harnesses["agent"], vf_calculator.CalculatorHarness)
    tasks = list(env.taskset)
    assert len(tasks) == 3 and all(t.data.prompt.startswith("What is ") for t in tasks)
    assert tasks[0].data.system_prompt == SYSTEM["content"]
    # OpenEnv's HTTP app, as `uvicorn environments.openenv_calculator:app` serves it.
    paths = {route.path for route in openenv_calculator.app.routes}
    assert {"/ws", "/reset", "/step", "/schema", "/health"} <= paths


@pytest.fixture(scope="module")
def vf_env():
    factory = verifiers_factory(VF_ENV, max_turns=3, render_tools=False)
    yield factory
    factory.close()


def test_verifiers_env_plays_its_turns_and_scores_with_its_rubric(vf_env) -> None:
    env = vf_env()
    # The taskset's own system prompt, then the record's question.
    assert env.reset(TASK) == [SYSTEM, {"role": "user", "content": TASK.question}]
    # Its harness ran the calculator on the turn's Hermes call: one tool message, no reward.
    step = env.step(turn(f"Let me compute. {CALL}"))
    assert (step.observation, step.reward, step.done) == (
        [{"role": "tool", "content": "595"}], 0.0, False)
    assert step.info == {"tool_calls": 1}
    # A turn without a call ends the episode; the task's @reward scores it, its @metric counts.
    step = env.step(turn("#### 595", index=1))
    assert (step.observation, step.reward, step.done) == ([], 1.0, True)
    assert step.info == {"env_rewards": {"correct_answer": 1.0},
                         "env_metrics": {"tool_calls": 1.0}, "env_stop": "agent_completed"}

    wrong = vf_env()
    wrong.reset(TASK)
    step = wrong.step(turn("#### 594"))
    assert (step.reward, step.done, step.info["env_metrics"]) == (0.0, True, {"tool_calls": 0.0})


def test_verifiers_env_limits_and_malformed_calls(vf_env) -> None:
    # Its own max_turns (3) ends the episode and still scores it: a turn limit, not a failure.
    env = vf_env()
    env.reset(TASK)
    for i in range(2):
        assert env.step(turn(CALL, index=i)).observation == [{"role": "tool", "content": "595"}]
    step = env.step(turn(CALL, index=2))
    assert (step.reward, step.done, step.info["env_stop"]) == (0.0, True, "max_turns")
    # A malformed call stays text (as vLLM's hermes parser leaves it): a final answer.
    env = vf_env()
    env.reset(TASK)
    step = env.step(turn('<tool_call>{"name": "calculator", oops}</tool_call> #### 595'))
    assert (step.done, step.reward, step.info["env_metrics"]) == (True, 1.0, {"tool_calls": 0.0})


def test_verifiers_env_describes_offered_tools_and_streams() -> None:
    # The harness streams its calls (as verifiers' own chat program does); the bridge renders
    # the offered tool in the Hermes system prompt.
    factory = verifiers_factory(VF_ENV, agent={"harness": {"id": "vf_calculator",
                                                           "stream": True}})
    try:
        env = factory()
        system, user = env.reset(TASK)
        assert system["content"].startswith(SYSTEM["content"] + "\n\nYou may call functions")
        assert '"name": "calculator"' in system["content"] and user["content"] == TASK.question
        assert env.step(turn(CALL)).observation == [{"role": "tool", "content": "595"}]
        step = env.step(turn("The answer:\n#### 595", index=1))
        assert (step.reward, step.done) == (1.0, True)
    finally:
        factory.close()


async def exploding_reward(task: Any, trace: Any) -> float:  # noqa: ANN401
    """Plugged into the verifiers task's scoring (``taskset.task.rewards``): a hub env bug."""
    raise RuntimeError("scoring exploded")


async def slow_reward(task: Any, trace: Any) -> float:  # noqa: ANN401
    await asyncio.sleep(3)
    return 0.0


def test_verifiers_env_failures_name_the_env_and_are_bounded() -> None:
    def plugged(fn: str, **kw: Any) -> VerifiersFactory:  # noqa: ANN401
        return verifiers_factory(VF_ENV, taskset={"task": {"rewards": {"bug": {
            "fn": f"{__name__}:{fn}"}}}}, **kw)

    raising, slow = plugged("exploding_reward"), plugged("slow_reward", call_timeout_s=0.5)
    try:
        env = raising()
        env.reset(TASK)
        with pytest.raises(EnvironmentFailure, match="scoring exploded") as e:
            env.step(turn("#### 595"))
        assert e.value.kind == "error" and f"verifiers env {VF_ENV!r}" in str(e.value)
        env = slow()
        env.reset(TASK)
        t0 = time.monotonic()
        with pytest.raises(EnvironmentFailure, match=f"verifiers env {VF_ENV!r}.*0.5s") as e:
            env.step(turn("#### 595"))
        assert e.value.kind == "timeout" and time.monotonic() - t0 < 2.5
    finally:
        raising.close()
        slow.close()
    with pytest.raises(ValueError, match="verifiers:no_such_env.*cannot load"):
        verifiers_factory("no_such_env")


# ---------------------------------------------------------------------------- OpenEnv


@pytest.fixture(scope="module")
def oe_http():
    factory = openenv_factory(OE_ENV, transport="http")
    yield factory
    factory.close()


def _play_calculator(factory: OpenEnvFactory) -> None:
    env = factory()
    assert env.reset(TASK) == [SYSTEM, {"role": "user", "content": TASK.question}]
    step = env.step(turn(f"Let me compute. {CALL}"))
    assert (step.observation, step.reward, step.done, step.info) == (
        [{"role": "tool", "content": "595"}], 0.0, False, {"tool_calls": 1})
    step = env.step(turn("#### 595", index=1))
    assert (step.observation, step.reward, step.done) == ([], 1.0, True)
    wrong = factory()
    wrong.reset(TASK)
    step = wrong.step(turn("#### 7"))
    assert (step.observation, step.reward, step.done) == ([], 0.0, True)


def test_openenv_env_in_process_and_over_its_http_app(oe_http) -> None:
    inproc = openenv_factory(OE_ENV)
    assert inproc.action_field == "message" and inproc.transport == "inprocess"
    _play_calculator(inproc)
    # OpenEnv's own app served on 127.0.0.1, played over its WebSocket session ...
    _play_calculator(oe_http)
    assert oe_http.url.startswith("http://127.0.0.1:")
    # ... and reached by URL, as a server someone else started (schema read over HTTP).
    remote = openenv_factory(oe_http.url)
    assert remote.action_field == "message"
    _play_calculator(remote)


GUESS = "openenv_guess:GuessEnv"  # tests/openenv_guess.py (OpenEnv is imported only when used)


def test_openenv_structured_actions_text_observations_and_invalid_actions() -> None:
    # grpoflow plays a step's episodes at once: a class must declare that it can.
    with pytest.raises(ValueError, match="SoloGuessEnv does not declare SUPPORTS_CONCURRENT"):
        openenv_factory("openenv_guess:SoloGuessEnv")
    factory = openenv_factory(GUESS, system_prompt="Answer in JSON.")
    assert factory.action_field is None  # two required fields: the turn is a JSON object
    env = factory()
    assert env.reset(TASK) == [{"role": "system", "content": "Answer in JSON."},
                               {"role": "user", "content": "Guess the number."}]
    step = env.step(turn('{"guess": 500, "reason": "about"}'))
    assert (step.observation, step.reward, step.done) == (
        [{"role": "user", "content": "higher"}], 0.0, False)
    assert env.step(turn('{"guess": 595, "reason": "sure"}')).reward == 1.0
    # Not an action: the model's mistake ends its episode with reward 0, not a failure.
    for text in ("595", '{"guess": "many", "reason": "?"}'):
        env = factory()
        env.reset(TASK)
        step = env.step(turn(text))
        assert (step.done, step.reward) == (True, 0.0) and step.info["invalid_action"]


@pytest.mark.parametrize("transport", ["inprocess", "http"])
def test_openenv_env_failures_name_the_env_and_are_bounded(transport: str) -> None:
    spec = GUESS
    raising = openenv_factory(spec, transport=transport, env_kwargs={"fail": "raise"})
    try:
        env = raising()
        env.reset(TASK)
        with pytest.raises(EnvironmentFailure, match="the game engine crashed") as e:
            env.step(turn('{"guess": 1, "reason": "x"}'))
        assert e.value.kind == "error" and f"OpenEnv env {spec!r}: step()" in str(e.value)
    finally:
        raising.close()
    if transport == "http":  # a hang in-process is the episode runner's bound to keep
        slow = openenv_factory(spec, transport="http", env_kwargs={"fail": "hang"},
                               call_timeout_s=0.5)
        try:
            env = slow()
            env.reset(TASK)
            t0 = time.monotonic()
            with pytest.raises(EnvironmentFailure) as e:
                env.step(turn('{"guess": 1, "reason": "x"}'))
            assert e.value.kind == "timeout" and time.monotonic() - t0 < 8
        finally:
            slow.close()


def test_missing_hub_packages_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("verifiers", "verifiers.v1", "openenv", "openenv.core"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the `agents` extra were absent
    with pytest.raises(ImportError,
                       match=r"verifiers:x.*`verifiers`.*pip install -e \"\.\[agents\]\""):
        verifiers_factory("x")
    with pytest.raises(ImportError, match=r"openenv:a\.b:C.*`openenv`.*\.\[agents\]"):
        openenv_factory("a.b:C")


# ---------------------------------------------------------------------------- on the engine


@pytest.fixture(scope="module")
def plane(demo_model: Path):
    plane = InProcessPlane(demo_model)
    yield plane
    plane.close()


@pytest.fixture(scope="module")
def chat(demo_model: Path) -> ChatTokens:
    return ChatTokens(AutoTokenizer.from_pretrained(demo_model))


@pytest.mark.parametrize("hub", ["verifiers", "openenv"])
def test_hub_episodes_on_the_engine(plane, chat: ChatTokens, vf_env, oe_http, hub: str) -> None:
    # Through agent.env, as a run configures it.
    if hub == "verifiers":
        cfg = AgentConfig(env=f"verifiers:{VF_ENV}", env_args={"max_turns": 3,
                                                              "render_tools": False})
        make_env = environment_factory(cfg)
        assert isinstance(make_env, VerifiersFactory)
        make_env.close()
        make_env = vf_env  # the same, already started
    else:
        cfg = AgentConfig(env=f"openenv:{OE_ENV}", env_args={"transport": "http"})
        assert isinstance(environment_factory(cfg), OpenEnvFactory)
        make_env = oe_http
    runner = EpisodeRunner(plane, chat, make_env, EpisodeLimits(max_turns=3, max_tokens=96),
                           retries=1)
    samples = runner.run(TASKS, n=2, params=SamplingParams(temperature=1.0, max_new_tokens=24),
                         step=1, seed=0)
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
    for s, rec in zip(samples, [r for r in TASKS for _ in range(2)], strict=True):
        ep = s.meta["episode"]
        assert ep["status"] == "ok" and ep["attempts"] == 1, ep["errors"]
        # The prompt is the hub env's first messages, rendered by the chat template.
        assert s.prompt_ids == chat.prompt_ids([SYSTEM, {"role": "user",
                                                         "content": rec.question}])
        model = sum(t["tokens"] for t in ep["trace"] if t["role"] == "assistant")
        assert sum(s.loss_mask) == model and len(s.loss_mask) == len(s.completion_ids)
        if ep["finish"] == "done" and ep["info"].get("env_stop", "agent_completed") == \
                "agent_completed":
            # The hub env's own rubric scored the model's last turn.
            assert s.reward == score(s.text.strip(), rec.answer)
        elif ep["finish"] != "done":
            assert s.reward == 0.0  # stopped by grpoflow's limits: the env never scored it


@pytest.mark.parametrize("hub", ["verifiers", "openenv"])
def test_a_failing_hub_env_costs_its_episodes_not_the_step(plane, chat: ChatTokens,
                                                           hub: str) -> None:
    if hub == "verifiers":
        factory: Any = verifiers_factory(VF_ENV, render_tools=False, taskset={"task": {
            "rewards": {"bug": {"fn": f"{__name__}:exploding_reward"}}}})
        needle = f"verifiers env {VF_ENV!r}"
    else:
        # (The tiny model's turns are no JSON actions, so this one fails at reset.)
        factory = openenv_factory(GUESS, transport="http",
                                  env_kwargs={"fail": "reset"})
        needle = "OpenEnv env"
    try:
        runner = EpisodeRunner(plane, chat, factory, EpisodeLimits(max_turns=2, max_tokens=64),
                               retries=1)
        t0 = time.monotonic()
        samples = runner.run(TASKS[:1], n=2, params=SamplingParams(temperature=1.0,
                             max_new_tokens=16), step=1, seed=0)
        assert time.monotonic() - t0 < 60
    finally:
        factory.close()
    for s in samples:
        ep = s.meta["episode"]
        assert ep["status"] == "failed" and ep["attempts"] == 2, ep
        assert all(needle in err and ": error: " in err for err in ep["errors"])
        assert s.reward == 0.0 and sum(s.loss_mask) == 0
