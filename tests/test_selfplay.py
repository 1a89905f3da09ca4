"""Multi-role episodes (rl_core/agents/roles.py) and the self-play demo (environments/selfplay.py)
on the real engine, the real trainer and through the GRPO flow.

Each role's sample is token-exact (the trainer's log-probs of its model tokens equal the
engine's) and trains only on that role's tokens; each (task, role) is a contiguous group, so its
advantages are those of its own rewards alone; rewards reach the role they name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from environments.selfplay import frontier_reward, template
from rl_core.agents import ChatTokens, EpisodeLimits
from rl_core.agents.kind import AgentEpisodes
from rl_core.agents.roles import RoleEpisodeRunner, RoleStep, declared_roles, role_metrics
from rl_core.config import AgentConfig
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import advantages_for
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.types import Batch

ROOT = Path(__file__).resolve().parents[1]
TASKS = [Record(f"t{i}", f"What is {i + 2} + {i + 1}?", f"#### {2 * i + 3}") for i in range(3)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12)


class Relay:
    """Roles a and b: a speaks, b answers, a speaks again. Rewards by name: 0.5 to whoever
    just acted, and b gets 2 at the end."""

    roles = ("a", "b")

    def reset(self, task: Record) -> list[dict]:
        self.turn = 0
        return [{"role": "user", "content": task.question}]

    def step(self, turn) -> RoleStep:  # noqa: ANN001
        self.turn += 1
        if self.turn == 1:
            return RoleStep([{"role": "user", "content": "What is 2 + 3?"}], reward=0.5, role="b")
        if self.turn == 2:
            return RoleStep([{"role": "user", "content": "Go on."}], reward=0.5, role="a")
        return RoleStep(done=True, rewards={"b": 2.0})


@pytest.fixture(scope="module")
def plane(demo_model: Path):
    plane = InProcessPlane(demo_model)
    yield plane
    plane.close()


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path):
    return AutoTokenizer.from_pretrained(demo_model)


def _runner(plane, tokenizer, env, roles, **kw) -> RoleEpisodeRunner:  # noqa: ANN001
    return RoleEpisodeRunner(plane, ChatTokens(tokenizer), env, roles,
                             EpisodeLimits(max_turns=4, max_tokens=48, env_timeout_s=10), **kw)


def test_roles_samples_are_token_exact_and_train_only_on_their_own_tokens(
        plane, tokenizer, demo_model: Path) -> None:
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.training.torch_trainer import TorchTrainer

    samples = _runner(plane, tokenizer, Relay, Relay.roles).run(TASKS, n=2, params=PARAMS,
                                                                step=1, seed=0)
    # task-major, then role, then episode: each (task, role) a contiguous group of n
    assert [s.uid for s in samples] == [f"1:t{i}:{r}:{j}" for i in range(3) for r in "ab"
                                        for j in range(2)]
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    chat = ChatTokens(tokenizer)
    for s in samples:
        ep, role = s.meta["episode"], s.meta["role"]
        assert ep["status"] == "ok" and ep["finish"] == "done" and ep["episode_turns"] == 3
        turns = [t for t in ep["trace"] if t["role"] == "assistant" and t["actor"] == role]
        assert ep["turns"] == len(turns) == (2 if role == "a" else 1)
        first = TASKS[int(s.record_id[1:])].question if role == "a" else "What is 2 + 3?"
        assert s.prompt_ids == chat.prompt_ids([{"role": "user", "content": first}])
        # Its own turns trained on; the other role's words reach it only as observations.
        head = turns[0]["tokens"]
        assert s.loss_mask[:head] == [1] * head
        if role == "a":
            obs = chat.observation_ids([{"role": "user", "content": "Go on."}],
                                       s.completion_ids[:head])
            assert s.completion_ids[head : head + len(obs)] == obs
            assert s.loss_mask[head : head + len(obs)] == [0] * len(obs)
            assert s.loss_mask[head + len(obs):] == [1] * turns[1]["tokens"]
        else:
            assert len(s.completion_ids) == head
    trainer = TorchTrainer(demo_model, TrainConfig(), AlgorithmConfig(), temperature=1.0)
    batch = Batch.from_samples(samples, [0.0] * len(samples), 0)
    diff = (trainer.compute_logprobs(batch) - batch.rollout_logp).abs()[batch.response_mask]
    assert batch.response_mask.sum() == sum(sum(s.loss_mask) for s in samples)
    assert float(diff.max()) < 2e-3, float(diff.max())


def test_rewards_route_to_the_role_they_name(plane, tokenizer) -> None:
    samples = _runner(plane, tokenizer, Relay, Relay.roles).run(TASKS[:1], n=2, params=PARAMS,
                                                                step=1, seed=0)
    assert {s.meta["role"]: s.meta["episode"]["env_reward"] for s in samples} == {
        "a": 0.5, "b": 2.5}
    metrics = role_metrics(samples)
    assert metrics["role/a/reward_mean"] == 0.5 and metrics["role/b/reward_mean"] == 2.5
    assert metrics["role/a/spoke_frac"] == metrics["role/b/spoke_frac"] == 1.0


def test_selfplay_rewards_the_solver_for_answers_and_the_proposer_for_the_frontier(
        plane, tokenizer) -> None:
    assert template("What is (3 + 4) - 2?") == (3, "+", 4)
    assert [frontier_reward(k, 4) for k in range(5)] == [0.0, 1.0, 4 / 3, 1.0, 0.0]
    assert frontier_reward(1, 1) == 0.0
    agents = AgentEpisodes(AgentConfig(env="environments.selfplay:SelfPlayArithmetic",
                                       score_final_answer=False, max_turns=2, max_tokens=32),
                           plane, tokenizer)
    samples = agents.episodes(TASKS, n=4, params=PARAMS, step=1, seed=0)
    agents.score(samples, None, pass_threshold=1.0)  # the environment's rewards only
    assert [s.meta["role"] for s in samples[:8]] == ["proposer"] * 4 + ["solver"] * 4
    by_problem: dict[str, list[bool]] = {}
    for s in samples:
        info = s.meta["episode"]["info"]
        if s.meta["role"] == "solver" and info["proposal_valid"]:
            by_problem.setdefault(info["problem"], []).append(info["solved"])
    assert by_problem, "no proposal filled the template"
    for s in samples:
        info = s.meta["episode"]["info"]
        if s.meta["role"] == "solver":
            assert s.reward == float(info["solved"]) and s.correct == info["solved"]
            assert s.prompt_ids[-20:] and info["problem"] in tokenizer.decode(s.prompt_ids)
        else:
            seen = by_problem.get(info["problem"], []) if info["proposal_valid"] else []
            assert s.reward == frontier_reward(sum(seen), len(seen))
    # Held-out evaluation (step < 0): the solver's samples, one per attempt.
    held_out = agents.episodes(TASKS, n=1, params=PARAMS, step=-1, seed=0)
    assert [s.meta["role"] for s in held_out] == ["solver"] * 3
    with pytest.raises(ValueError, match="score_final_answer=false"):
        AgentEpisodes(AgentConfig(env="environments.selfplay:SelfPlayArithmetic"), plane,
                      tokenizer)
    assert declared_roles("tests.test_agents:CountdownEnv") == ((), None)


def test_each_roles_group_statistics_are_its_own(plane, tokenizer) -> None:
    samples = _runner(plane, tokenizer, Relay, Relay.roles).run(TASKS, n=4, params=PARAMS,
                                                                step=2, seed=0)
    gen = torch.Generator().manual_seed(0)
    for s in samples:  # different reward scales per role: a's in [0, 1), b's in [0, 100)
        s.reward = float(torch.rand((), generator=gen)) * (1 if s.meta["role"] == "a" else 100)
    samples[5].valid = False  # an infrastructure failure in one of b's groups
    whole = advantages_for(samples, 4, "grpo")
    for role in ("a", "b"):
        idx = [i for i, s in enumerate(samples) if s.meta["role"] == role]
        alone = advantages_for([samples[i] for i in idx], 4, "grpo")
        assert torch.allclose(whole[idx], alone, atol=1e-6), role
    # and each group is one task's one role
    for k in range(0, len(samples), 4):
        assert len({(s.record_id, s.meta["role"]) for s in samples[k : k + 4]}) == 1


def test_a_failing_environment_fails_every_roles_sample(plane, tokenizer) -> None:
    class Broken(Relay):
        def step(self, turn) -> RoleStep:  # noqa: ANN001
            if getattr(self, "turn", 0) == 1:
                raise ConnectionError("the solver's sandbox went away")
            return super().step(turn)

    samples = _runner(plane, tokenizer, Broken, Broken.roles, retries=1).run(
        TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    for s in samples:
        ep = s.meta["episode"]
        assert ep["status"] == "failed" and ep["attempts"] == 2 and not s.valid
        assert sum(s.loss_mask) == 0 and s.prompt_ids and "sandbox went away" in ep["errors"][-1]


def test_grpo_flow_trains_on_selfplay(prefect_harness, tiny_cache: Path, tmp_path: Path) -> None:
    from flows.grpo_train import grpo_train

    summary = grpo_train(config=str(ROOT / "configs" / "selfplay-cpu.yaml"), show_progress=False,
                         overrides=[f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}",
                                    "tracking.backend=none", "train.steps=2",
                                    "train.prompts_per_step=2", "rollout.n_samples=4",
                                    "eval.every=0", "eval.num_examples=4", "run_name=selfplay"])
    run_dir = Path(summary["run_dir"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in ("role/proposer/reward_mean", "role/solver/reward_mean", "grad_norm",
                    "episode_failed_frac"):
            assert key in m, key
    ledger = [row for line in (run_dir / "samples.jsonl").read_text().splitlines()
              for row in json.loads(line)["samples"]]
    assert len(ledger) == 2 * 2 * 2 * 4 and all(r["episode"] == "ok" for r in ledger)
    assert summary["evals"][-1]["num_examples"] == 4
