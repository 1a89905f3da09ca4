"""Token fidelity with reasoning templates (docs/agents.md, 'Reasoning templates').

A Qwen3-style template drops earlier assistant turns' ``<think>`` blocks once a newer user
message follows, so re-rendering a conversation no longer gives the tokens the model saw. Here
``STRIP`` does exactly that (its generation prompt opens an empty reasoning block, as Qwen3's
does with thinking off, so every turn the model takes is preceded by one), on the demo's tiny
tokenizer; the demo's own ChatML template only appends. For both, with both policies
(``keep_prefix``, ``new_sample``), episodes of EpisodeRunner and of the gateway (the real
``openai`` client) are checked against the trainer: its log-probs of every trained token, in
every segment, equal the engine's, which holds only if each row's ids are the ones the engine
saw and sampled.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer

from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner, StepResult, Turn
from rl_core.agents.episode import episode_metrics
from rl_core.agents.gateway import AgentGateway
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import GroupRelative
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.types import TEMPLATE_SEGMENTS, Batch, expand_segments

TASKS = [Record(f"t{i}", f"What is {i} + {i + 1}?", f"#### {2 * i + 1}") for i in range(2)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)
TURNS = 3
GO_ON = "Go on."

# Qwen3's assistant branch, cut down: reasoning split from the content at </think>; turns after
# the last user message keep their block, earlier ones are rendered without it.
STRIP = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content"
    " + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizers(demo_model: Path) -> dict:
    plain = AutoTokenizer.from_pretrained(demo_model)
    strip = AutoTokenizer.from_pretrained(demo_model)
    strip.chat_template = STRIP
    return {"plain": plain, "strip": strip}


@pytest.fixture(scope="module")
def plane(demo_model: Path):
    plane = InProcessPlane(demo_model)
    yield plane
    plane.close()


@pytest.fixture(scope="module")
def trainer(demo_model: Path):
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.training.torch_trainer import TorchTrainer

    return TorchTrainer(demo_model, TrainConfig(), AlgorithmConfig(), temperature=1.0)


class GoOnEnv:
    """Answers each model turn with a ``role`` message until ``TURNS`` turns, then ends."""

    def __init__(self, role: str = "user") -> None:
        self.role = role

    def reset(self, task: Record) -> list[dict]:
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        done = turn.index + 1 >= TURNS
        return StepResult([] if done else [{"role": self.role, "content": GO_ON}],
                          reward=float(turn.index % 2), done=done)


def _assert_token_exact(trainer, samples) -> int:
    """Every row (episodes, then their earlier segments): the trainer's log-probs of the
    trained tokens equal the engine's. Returns the number of rows."""
    rows, adv = expand_segments(samples, torch.zeros(len(samples)))
    batch = Batch.from_samples(rows, adv, 0)
    logp = trainer.compute_logprobs(batch)
    diff = (logp - batch.rollout_logp).abs()[batch.response_mask]
    assert batch.response_mask.sum() == sum(sum(r.loss_mask) for r in rows) > 0
    assert float(diff.max()) < 2e-3, float(diff.max())
    return len(rows)


def test_observation_tokens_survive_a_template_that_drops_reasoning(tokenizers) -> None:
    chat = ChatTokens(tokenizers["strip"])
    first = [{"role": "user", "content": "Q"}]
    prompt, text = chat.prompt(first)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    turn = chat.encode("fine") + [tokenizers["strip"].eos_token_id]
    obs, obs_text = chat.observation([{"role": "user", "content": GO_ON}], turn)
    # The recorded chain keeps the turn's reasoning block; the template's rendering drops it.
    chain = chat.decode(prompt + turn + obs)
    assert chain == text + "fine<|im_end|>" + obs_text
    assert obs_text == f"\n<|im_start|>user\n{GO_ON}<|im_end|>\n<|im_start|>assistant\n" \
                       "<think>\n\n</think>\n\n"
    whole = [*first, {"role": "assistant", "content": "fine"}, {"role": "user", "content": GO_ON}]
    assert chat.render(whole, generation_prompt=True) != chain
    assert "<think>\n\n</think>\n\nfine" not in chat.render(whole, generation_prompt=True)
    # A tool reply is not a user query: the turn keeps its block and nothing differs.
    tool = [*first, {"role": "assistant", "content": "fine"}, {"role": "tool", "content": "5"}]
    obs, obs_text = chat.observation(tool[2:], turn)
    assert chat.render(tool, generation_prompt=True) == text + "fine<|im_end|>" + obs_text
    # A turn cut short gets the end-of-turn token first, in the ids and in the text.
    cut, cut_text = chat.observation([{"role": "user", "content": GO_ON}], turn[:-1])
    assert cut[0] == tokenizers["strip"].eos_token_id and cut_text.startswith("<|im_end|>\n")


@pytest.mark.parametrize("template,policy", [("plain", "keep_prefix"), ("strip", "keep_prefix"),
                                             ("strip", "new_sample"), ("plain", "new_sample")])
def test_episode_runner_is_token_exact_with_either_template_and_policy(
        plane, tokenizers, trainer, template, policy) -> None:
    chat = ChatTokens(tokenizers[template])
    runner = EpisodeRunner(plane, chat, GoOnEnv, EpisodeLimits(max_turns=4, max_tokens=200),
                           template_mismatch=policy)
    samples = runner.run(TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    strips = template == "strip"
    for s in samples:
        ep = s.meta["episode"]
        assert ep["status"] == "ok" and ep["turns"] == TURNS
        assert ep["template_checks"] == TURNS - 1
        assert ep["template_mismatches"] == (TURNS - 1 if strips else 0)
        split = strips and policy == "new_sample"
        assert ep["segments"] == (TURNS if split else 1)
        segments = s.meta.get(TEMPLATE_SEGMENTS, [])
        assert len(segments) == ep["segments"] - 1
        if split:  # each segment: one model turn after the template's rendering
            for seg in [*segments, s]:
                assert sum(seg.loss_mask) == len(seg.completion_ids)
                # each prompt is the template's rendering: only its generation prompt reasons
                assert chat.decode(seg.prompt_ids).count("<think>") == 1
            assert [seg.uid for seg in segments] == [f"{s.uid}#{k}" for k in range(TURNS - 1)]
        else:  # one chain: every turn after its own (empty) reasoning block, never re-rendered
            text = chat.decode(s.prompt_ids + s.completion_ids)
            assert text.count("<think>\n\n</think>\n\n") == (TURNS if strips else 0)
    metric = episode_metrics(samples)["agent/template_mismatch_frac"]
    assert metric == (1.0 if strips else 0.0)
    rows = _assert_token_exact(trainer, samples)
    assert rows == len(samples) * (TURNS if strips and policy == "new_sample" else 1)


def test_tool_replies_keep_the_reasoning_so_nothing_differs(plane, tokenizers) -> None:
    runner = EpisodeRunner(plane, ChatTokens(tokenizers["strip"]), lambda: GoOnEnv("tool"),
                           EpisodeLimits(max_turns=4, max_tokens=200),
                           template_mismatch="new_sample")
    samples = runner.run(TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    assert [s.meta["episode"]["template_mismatches"] for s in samples] == [0, 0]
    assert all(TEMPLATE_SEGMENTS not in s.meta for s in samples)


def _chat_program(client: openai.OpenAI, task: Record) -> list[str]:
    messages = [{"role": "user", "content": task.question}]
    replies = []
    for k in range(TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages)
        replies.append(reply.choices[0].message.content)
        messages += [{"role": "assistant", "content": replies[-1]}]
        if k < TURNS - 1:
            messages += [{"role": "user", "content": GO_ON}]
    return replies


@pytest.mark.parametrize("template,policy", [("plain", "keep_prefix"), ("strip", "keep_prefix"),
                                             ("strip", "new_sample")])
def test_gateway_sessions_are_token_exact_with_either_template_and_policy(
        plane, tokenizers, trainer, template, policy) -> None:
    with AgentGateway(plane, ChatTokens(tokenizers[template]),
                      template_mismatch=policy) as gateway:
        samples = []
        for g, task in enumerate(TASKS):
            session = gateway.open_session(task, index=0, group=g, params=PARAMS,
                                           limits=EpisodeLimits(max_turns=4, max_tokens=200))
            with openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=60) as client:
                _chat_program(client, task)
            samples.append(session.sample())
    strips = template == "strip"
    for s in samples:
        ep = s.meta["episode"]
        assert ep["turns"] == TURNS and ep["info"]["history_rewrites"] == 0
        assert ep["template_checks"] == TURNS - 1
        assert ep["template_mismatches"] == (TURNS - 1 if strips else 0)
        assert ep["segments"] == (TURNS if strips and policy == "new_sample" else 1)
    assert episode_metrics(samples)["agent/template_mismatch_frac"] == (1.0 if strips else 0.0)
    rows = _assert_token_exact(trainer, samples)
    assert rows == len(samples) * (TURNS if strips and policy == "new_sample" else 1)


def test_segments_train_with_their_episodes_advantage_and_count_once(plane, tokenizers) -> None:
    runner = EpisodeRunner(plane, ChatTokens(tokenizers["strip"]), GoOnEnv,
                           EpisodeLimits(max_turns=4, max_tokens=200),
                           template_mismatch="new_sample")
    samples = runner.run(TASKS[:1], n=2, params=PARAMS, step=1, seed=0)
    samples[0].reward, samples[1].reward = 1.0, 0.0
    batch = GroupRelative(2, "grpo").batch(samples, 0)
    # The group saw two episodes (advantages +-0.707); each one's segments carry its own.
    assert batch.input_ids.shape[0] == 2 * TURNS
    first = batch.advantages[0].item()
    assert first > 0 and batch.advantages[1].item() == pytest.approx(-first)
    owners = [0] * (TURNS - 1) + [1] * (TURNS - 1)
    assert batch.advantages[2:].tolist() == [batch.advantages[i].item() for i in owners]
    assert GroupRelative(2, "grpo").batch(samples, 0, segments=False).input_ids.shape[0] == 2
    samples[1].valid = False  # an infrastructure failure: its segments train on nothing either
    rows, _ = expand_segments(samples, torch.zeros(2))
    assert [r.valid for r in rows] == [True, False] + [True] * (TURNS - 1) + [False] * (TURNS - 1)
