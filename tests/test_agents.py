"""Multi-turn episodes (rl_core.agents) on the real engine, and through the GRPO flow.

Token exactness is checked against the trainer itself: the log-probs the trainer computes for
an episode's model tokens equal the engine's, which holds only if the sample's ids are the
ones the engine saw and sampled. Environments that raise, hang or answer malformed data cost
their episode (retried, then recorded as failed), never the step; the failure budget stops a
run whose episodes keep failing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl_core.agents import (
    ChatTokens,
    EpisodeLimits,
    EpisodeRunner,
    StepResult,
    ToolEnv,
    Turn,
    episode_metrics,
    parse_tool_calls,
)
from rl_core.agents.kind import AgentEpisodes, EpisodeFailureError
from rl_core.agents.tools import CALCULATOR, PYTHON, Tool, ToolCall, calculate, run_python, run_tool
from rl_core.config import AgentConfig
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.types import Batch

ROOT = Path(__file__).resolve().parents[1]
TASKS = [Record(f"t{i}", f"What is {i} + {i + 1}?", f"#### {2 * i + 1}") for i in range(3)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12)


# ---------------------------------------------------------------------------- tools


def test_parse_tool_calls_hermes_format() -> None:
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"2 + 3"}}\n</tool_call>\n<tool_call>{"name": "python", "arguments": '
            '"{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, None), ("python", {"code": "print(1)"}, None)]
    bad = parse_tool_calls('<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>')
    assert [c.error is not None for c in bad] == [True, True]
    assert "not valid JSON" in bad[1].error
    assert parse_tool_calls("#### 5") == []


def test_calculator_evaluates_arithmetic_and_refuses_anything_else() -> None:
    assert calculate("(47 + 38) * 7") == "595"
    assert calculate("7 / 2") == "3.5" and calculate("2^10") == "1024"
    for bad in ("__import__('os')", "a + 1", "9 ** 9999", "[1, 2]"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_run_tool_turns_failures_into_messages_the_model_reads() -> None:
    tools = {"calculator": CALCULATOR}
    assert run_tool(tools, ToolCall("calculator", {"expression": "6 * 7"})) == ("42", "ok")
    text, status = run_tool(tools, ToolCall("search", {}))
    assert status == "error" and "unknown tool 'search'" in text
    text, status = run_tool(tools, ToolCall("calculator", {"expr": "1"}))
    assert status == "error" and "bad arguments" in text
    slow = Tool("slow", "sleeps", {}, lambda: time.sleep(5) or "late", timeout_s=0.2)
    t0 = time.monotonic()
    assert run_tool({"slow": slow}, ToolCall("slow", {}))[1] == "timeout"
    assert time.monotonic() - t0 < 2


def _cmdline(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # it ended between the listing and the read
        return b""


def test_python_tool_is_sandboxed_bounded_and_killed_with_its_children() -> None:
    assert run_tool({"python": PYTHON}, ToolCall("python", {"code": "print(6 * 7)"})) == (
        "42", "ok")
    assert "ZeroDivisionError" in run_python("1 / 0")
    out = run_python(f"open({str(Path.cwd() / 'x')!r}, 'w')")  # the project is not mounted
    assert "No such file" in out or "Read-only" in out
    tag = f"{time.monotonic_ns() % 10**6}.123"  # a sleep only this test starts
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{tag}'])\ntime.sleep(60)"
    with pytest.raises(TimeoutError):
        run_python(code, timeout_s=1.0)
    deadline = time.monotonic() + 5  # the whole sandbox went down (tests/test_sandbox.py)
    while any(tag.encode() in _cmdline(p) for p in Path("/proc").glob("[0-9]*/cmdline")):
        assert time.monotonic() < deadline, "the tool's child process outlived the timeout"
        time.sleep(0.05)
    out = run_python("x = bytearray(512 * 2**20); print('allocated')", memory_limit_mb=256)
    assert "MemoryError" in out


# ---------------------------------------------------------------------------- chat tokens


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path):
    return AutoTokenizer.from_pretrained(demo_model)


def test_chat_tokens_grow_the_conversation_without_retokenizing(tokenizer) -> None:
    chat = ChatTokens(tokenizer)
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = chat.prompt_ids(first)
    turn = chat.encode("<tool_call>x</tool_call>") + [tokenizer.eos_token_id]
    obs = chat.observation_ids([{"role": "tool", "content": "5"}], turn)
    whole = chat.render([*first, {"role": "assistant", "content": "<tool_call>x</tool_call>"},
                         {"role": "tool", "content": "5"}], generation_prompt=True)
    assert tokenizer.decode(prompt + turn + obs) == whole
    # A turn cut short gets the template's end-of-turn token first (masked: not the model's).
    cut = chat.observation_ids([{"role": "tool", "content": "5"}], turn[:-1])
    assert cut == [tokenizer.eos_token_id, *obs]


def test_chat_tokens_refuse_templates_without_chat_or_that_rewrite_history(tokenizer) -> None:
    class Plain:
        chat_template = None
        name_or_path = "plain-lm"

    with pytest.raises(ValueError, match="plain-lm.*no chat template"):
        ChatTokens(Plain())
    chat = ChatTokens(tokenizer)
    chat.render = lambda messages, generation_prompt: "".join(  # e.g. drops old reasoning
        m["content"][:1] for m in messages)
    with pytest.raises(ValueError, match="rewrites history"):
        chat.observation_ids([{"role": "tool", "content": "5"}], [1])


# ---------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def plane(demo_model: Path):
    plane = InProcessPlane(demo_model)
    yield plane
    plane.close()


class CountdownEnv:
    """Answers every model turn with a user message until ``turns`` turns, then ends."""

    def __init__(self, turns: int = 2, fail: str | None = None) -> None:
        self.turns, self.fail = turns, fail

    def reset(self, task: Record) -> list[dict]:
        if self.fail == "reset":
            raise ConnectionError("environment server refused the connection")
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        if self.fail == "raise":
            raise KeyError("state")
        if self.fail == "hang":
            time.sleep(3)
        if self.fail == "malformed":
            return StepResult([{"role": "narrator", "content": 5}])
        if self.fail == "not-a-result":
            return {"observation": []}  # type: ignore[return-value]
        done = turn.index + 1 >= self.turns
        return StepResult([] if done else [{"role": "user", "content": "Go on."}],
                          reward=1.0 if done else 0.0, done=done, info={"turn": turn.index})


def _runner(plane, tokenizer, make_env, **limits) -> EpisodeRunner:
    return EpisodeRunner(plane, ChatTokens(tokenizer), make_env,
                         EpisodeLimits(**{"max_turns": 4, "max_tokens": 96, **limits}), retries=1)


def test_episodes_are_token_exact_and_train_only_on_model_tokens(plane, tokenizer,
                                                                 demo_model: Path) -> None:
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.training.torch_trainer import TorchTrainer

    samples = _runner(plane, tokenizer, lambda: CountdownEnv(turns=3)).run(
        TASKS, n=2, params=PARAMS, step=1, seed=0)
    assert [s.uid for s in samples] == [f"1:t{i}:{j}" for i in range(3) for j in range(2)]
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
    chat = ChatTokens(tokenizer)
    for s in samples:
        ep = s.meta["episode"]
        assert ep["status"] == "ok" and ep["turns"] == 3 and ep["finish"] == "done"
        assert s.reward == 1.0
        assert len(s.loss_mask) == len(s.completion_ids) == len(s.logprobs) == len(s.versions)
        # Observation tokens: masked, log-prob 0, exactly the template's ids for the message.
        turns = [t for t in ep["trace"] if t["role"] == "assistant"]
        pos = 0
        for k, t in enumerate(turns):
            ids = s.completion_ids[pos : pos + t["tokens"]]
            assert s.loss_mask[pos : pos + t["tokens"]] == [1] * t["tokens"]
            pos += t["tokens"]
            if k < len(turns) - 1:
                obs = chat.observation_ids([{"role": "user", "content": "Go on."}], ids)
                assert s.completion_ids[pos : pos + len(obs)] == obs
                assert s.loss_mask[pos : pos + len(obs)] == [0] * len(obs)
                assert s.logprobs[pos : pos + len(obs)] == [0.0] * len(obs)
                pos += len(obs)
        assert pos == len(s.completion_ids)
        assert ep["masked_tokens"] == len(s.loss_mask) - sum(s.loss_mask) > 0
    # The trainer scores the model tokens as the engine sampled them: ids are exact.
    trainer = TorchTrainer(demo_model, TrainConfig(), AlgorithmConfig(), temperature=1.0)
    batch = Batch.from_samples(samples, [0.0] * len(samples), 0)
    logp = trainer.compute_logprobs(batch)
    diff = (logp - batch.rollout_logp).abs()[batch.response_mask]
    assert batch.response_mask.sum() == sum(sum(s.loss_mask) for s in samples)
    assert float(diff.max()) < 2e-3, float(diff.max())


def test_episodes_replay_exactly_under_a_seed(plane, tokenizer) -> None:
    run = _runner(plane, tokenizer, lambda: CountdownEnv(turns=2))
    a = run.run(TASKS, n=2, params=PARAMS, step=3, seed=7)
    b = run.run(TASKS, n=2, params=PARAMS, step=3, seed=7)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    c = run.run(TASKS, n=2, params=PARAMS, step=4, seed=7)
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]


@pytest.mark.parametrize("fail,kind", [("raise", "error"), ("reset", "error"),
                                       ("hang", "timeout"), ("malformed", "malformed"),
                                       ("not-a-result", "malformed")])
def test_a_misbehaving_environment_costs_its_episode_not_the_step(plane, tokenizer, fail: str,
                                                                  kind: str) -> None:
    made: list[int] = []

    def make_env():  # the first episode's environment misbehaves, the rest are fine
        made.append(1)
        return CountdownEnv(turns=2, fail=fail if len(made) == 1 else None)

    run = _runner(plane, tokenizer, make_env, env_timeout_s=0.5)
    t0 = time.monotonic()
    samples = run.run(TASKS[:2], n=2, params=PARAMS, step=1, seed=0)
    assert time.monotonic() - t0 < 30
    first = samples[0].meta["episode"]
    assert first["status"] == "ok" and first["attempts"] == 2  # retried with a fresh env
    assert f": {kind}: " in first["errors"][0]
    assert all(s.meta["episode"]["status"] == "ok" for s in samples)


def test_an_environment_that_keeps_failing_is_recorded_and_trains_nothing(plane,
                                                                          tokenizer) -> None:
    run = _runner(plane, tokenizer, lambda: CountdownEnv(fail="raise"))
    samples = run.run(TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    for s in samples:
        ep = s.meta["episode"]
        assert ep["status"] == "failed" and ep["attempts"] == 2 and len(ep["errors"]) == 2
        assert "KeyError" in ep["errors"][-1]
        assert s.reward == 0.0 and sum(s.loss_mask) == 0 and s.completion_ids
    assert episode_metrics(samples)["episode_failed_frac"] == 1.0
    # It still lays out in a batch: a row with no trained token.
    batch = Batch.from_samples(samples, [0.0, 0.0], 0)
    assert int(batch.response_mask.sum()) == 0


def test_episode_limits_end_episodes(plane, tokenizer) -> None:
    endless = _runner(plane, tokenizer, lambda: CountdownEnv(turns=99), max_turns=2)
    for s in endless.run(TASKS[:1], n=2, params=PARAMS, step=1, seed=0):
        assert s.meta["episode"]["finish"] == "max_turns" and s.meta["episode"]["turns"] == 2
    short = _runner(plane, tokenizer, lambda: CountdownEnv(turns=99), max_tokens=20)
    for s in short.run(TASKS[:1], n=2, params=PARAMS, step=1, seed=0):
        assert s.meta["episode"]["finish"] == "max_tokens"
        assert len(s.completion_ids) <= 20


def test_tool_env_runs_calls_and_ends_on_an_answer(plane, tokenizer) -> None:
    env = ToolEnv({"calculator": CALCULATOR}, "You can call the calculator tool.")
    assert env.reset(TASKS[0])[0]["role"] == "system"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 21"}}</tool_call>'
    r = env.step(Turn(call, []))
    assert r.observation == [{"role": "tool", "content": "42"}] and not r.done
    assert r.info == {"tool_calls": 1, "tool_errors": 0}
    r = env.step(Turn("#### 42", []))
    assert r.done and r.info["tool_calls"] == 0


def test_agent_rollout_scores_and_keeps_the_failure_budget(plane, tokenizer) -> None:
    from rl_core.rewards import RewardRunner

    cfg = AgentConfig(env="tests.test_agents:CountdownEnv", env_args={"fail": "raise"},
                      episode_retries=0, max_failed_steps=2)
    agents = AgentEpisodes(cfg, plane, tokenizer)
    samples = agents.episodes(TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    with RewardRunner("gsm8k") as rewards:
        agents.score(samples, rewards, pass_threshold=1.0, step=1)
    assert [s.reward for s in samples] == [0.0, 0.0]
    assert agents.check_failures(samples) == {"episode_failed_streak": 1.0}
    with pytest.raises(EpisodeFailureError, match="agent.max_failed_steps=2.*KeyError"):
        agents.check_failures(samples)
    ok = AgentEpisodes(AgentConfig(env="tests.test_agents:CountdownEnv", env_args={"turns": 1}),
                      plane, tokenizer)
    samples = ok.episodes(TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    with RewardRunner("gsm8k") as rewards:
        ok.score(samples, rewards, pass_threshold=1.0, step=1)
    for s in samples:  # the environment's 1.0 plus the final answer's gsm8k score
        assert s.reward == 1.0 + float(s.correct)


# ---------------------------------------------------------------------------- the flow


def _flow_overrides(tmp: Path, cache: Path, *extra: str) -> list[str]:
    return [f"storage.root={tmp}", f"storage.cache_dir={cache}", "tracking.backend=none",
            "train.steps=2", "train.prompts_per_step=4", "rollout.n_samples=4",
            "rollout.engine=local", "rollout.weight_sync=shared", "eval.every=0",
            "eval.num_examples=8", "eval.pass_k_examples=2", "agent.env=tools",
            "agent.system_prompt=You can call the calculator tool.", "agent.max_turns=2",
            "agent.max_tokens=64", *extra]


def test_grpo_flow_trains_on_episodes(prefect_harness, tiny_cache: Path, tmp_path: Path) -> None:
    from flows.grpo_train import grpo_train

    summary = grpo_train(config=str(ROOT / "configs" / "tiny-cpu.yaml"), show_progress=False,
                         overrides=_flow_overrides(tmp_path, tiny_cache, "run_name=agent"))
    run_dir = Path(summary["run_dir"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in ("episode_failed_frac", "episode_tool_call_frac", "episode_turns_mean",
                    "episode_masked_token_frac", "reward_mean", "grad_norm", "time/rollout"):
            assert key in m, key
    ledger = [row for line in (run_dir / "samples.jsonl").read_text().splitlines()
              for row in json.loads(line)["samples"]]
    assert len(ledger) == 2 * 4 * 4 and {r["episode"] for r in ledger} <= {"ok", "failed"}
    assert all(r["turns"] >= 1 for r in ledger)
    assert summary["evals"][-1]["episodes"]["episode_failed_frac"] == 0.0


def test_grpo_flow_stops_when_episodes_keep_failing(prefect_harness, tiny_cache: Path,
                                                    tmp_path: Path) -> None:
    from flows.grpo_train import grpo_train

    overrides = _flow_overrides(
        tmp_path, tiny_cache, "run_name=failing", "agent.env=tests.test_agents:CountdownEnv",
        'agent.env_args={"fail": "raise"}', "agent.episode_retries=0", "agent.max_failed_steps=1")
    state = grpo_train(config=str(ROOT / "configs" / "tiny-cpu.yaml"), show_progress=False,
                       overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="agent.max_failed_steps=1"):
        state.result()



def test_agent_rollout_runs_a_black_box_program_through_the_openai_endpoint(plane,
                                                                            tokenizer) -> None:
    agents = AgentEpisodes(AgentConfig(program="environments.calculator_agent:solve",
                                      max_tokens=96), plane, tokenizer)
    try:
        samples = agents.episodes(TASKS[:2], n=2, params=PARAMS, step=1, seed=0)
    finally:
        agents.close()
    assert [s.uid for s in samples] == ["1:t0:0", "1:t0:1", "1:t1:0", "1:t1:1"]
    for s in samples:
        ep = s.meta["episode"]
        assert ep["status"] == "ok" and ep["turns"] >= 1
        assert len(s.loss_mask) == len(s.completion_ids) == len(s.logprobs)
        assert sum(s.loss_mask) > 0 and s.text == ep["trace"][-1]["text"]
