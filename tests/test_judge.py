"""LLM judges as a reward plane (rl_core.rewards.judge), on real embedded engine processes.

A tiny model cannot judge, so the judge here is a real chat model (byte-level BPE tokenizer,
ChatML template, Qwen2 weights) whose weights are set by hand so that greedy decoding answers
every chat prompt with ``OUTPUT``: the plumbing can then be pinned exactly. Pinned: the prompt
the judge reads (template, system turn, chat template) and that the engine got exactly its
tokens; parsing scores and verdicts; requests of ``batch_size``; a prompt the engine refuses
costs that sample only; a stalled engine (``/pause_generation``) costs timeouts, retries and
aborted requests, never a hang; a killed engine is restarted while requests fail over; concurrent
callers each get their own answers; an environment reaching the judge (``active_judge``); the
config's errors and the engines' command lines; and ``reward.fn: judge`` through the planes,
question lookup by record id and the failure budget included.

Never imports prefect or mlflow; every wait is bounded.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from rl_core.agents import Environment, StepResult, Turn
from rl_core.config import ConfigError, ExperimentConfig, RewardConfig, load_config
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import rollout_groups, score_samples
from rl_core.planes import (
    bring_up_planes,
    get_planes,
    judge_engine_spec,
    start_judge,
    tear_down,
)
from rl_core.rewards import (
    JudgeError,
    JudgeRunner,
    RewardFunctionError,
    RewardSet,
    active_judge,
    parse_judgement,
)

pytestmark = pytest.mark.timeout(300)

OUTPUT = "Verdict: yes; Score=7"  # what the judge model says to anything
TEMPLATE = ("Q: {question}\nReference: {answer}\nResponse: {response}\n"
            "Grade it from 0 to {max_score}.")
SYSTEM = "You grade answers."


def build_judge_model(path: Path, output: str = OUTPUT) -> Path:
    """A chat model whose greedy answer to any chat prompt is ``output``, then end of turn.

    Every layer's output projections are zero, so the last hidden state is the last token's
    embedding; embeddings are one-hot and ``lm_head`` maps each token of the chain (the
    generation prompt's last token, ``output``'s tokens, ``<|im_end|>``) to the next: a bigram
    machine in a real Qwen2 checkpoint that the engine loads like any other."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from rl_core.models.tiny import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([output, "user assistant system"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                            model_max_length=512).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)  # as the judge and the engine will load it
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                           add_generation_prompt=True)
    last = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [last, *tokenizer(output, add_special_tokens=False)["input_ids"],
             tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "the output's tokens must be distinct"
    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=vocab + (-vocab % 16), intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if "norm" in name else 0.0)
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, config.hidden_size))
        for token, following in zip(chain, chain[1:], strict=False):
            model.lm_head.weight[following, token] = 10.0
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


def reward_config(model: Path, **judge: object) -> RewardConfig:
    fields = {"model": str(model), "template": TEMPLATE, "system_prompt": SYSTEM, "batch_size": 2,
              "timeout_s": 3.0, "retries": 1, "retry_backoff_s": 0.2, "engine_threads": 1,
              **judge}
    return RewardConfig(fn="judge", judge=fields, max_failed_steps=0, pass_threshold=0.5)


def judge_run_config(reward: RewardConfig) -> ExperimentConfig:
    """A run config around ``reward`` whose engines are watched every 0.5 s."""
    return ExperimentConfig(reward=reward, rollout={
        "health_interval_s": 0.5, "health_timeout_s": 5.0, "health_failure_threshold": 2,
        "startup_timeout_s": 120})


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory) -> Path:
    return build_judge_model(tmp_path_factory.mktemp("judge") / "model")


@pytest.fixture(scope="module")
def judge(judge_model: Path, tmp_path_factory):
    """Two embedded engines of the judge model, watched every 0.5 s."""
    runner = start_judge(judge_run_config(reward_config(judge_model, num_engines=2)),
                         tmp_path_factory.mktemp("judge-logs"))
    with runner:
        yield runner


def delta(judge: JudgeRunner, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in judge.stats().items()}


# ---------------------------------------------------------------- parsing (no engine)


@pytest.mark.parametrize(("text", "max_score", "want"), [
    ("Score: 7", 10, 0.7),
    ("**Score:** 8/10", 10, 0.8),
    ("The response says 42, which is wrong. Score: 3", 10, 0.3),  # the label wins
    ("Score: 2. On reflection... Final score: 6", 10, 0.6),  # the last label wins
    ("I would give it 9 out of 10.", 10, 0.9),  # no label: the first number
    ("<think>a 2 maybe, or score 1</think>\nScore: 6", 10, 0.6),
    ("score=4.5", 5, 0.9),
    ("Score: 0", 10, 0.0),
])
def test_parse_score(text: str, max_score: float, want: float) -> None:
    assert parse_judgement(text, "score", max_score) == pytest.approx(want)


@pytest.mark.parametrize(("text", "why"), [
    ("a fine answer", "no score"),
    ("<think>Score: 7, I think, but", "no score"),  # never finished thinking
    ("Score: 12", "outside"),
    ("Score: -1", "outside"),
])
def test_parse_score_failures(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_judgement(text, "score", 10)


@pytest.mark.parametrize(("text", "want"), [
    ("Yes.", 1.0), ("no, the final answer is 5", 0.0), ("Verdict: no", 0.0),
    ("Yes, the steps look right... **Verdict:** no", 0.0), ("<think>yes?</think> No", 0.0),
    ("Correct: yes", 1.0), (OUTPUT, 1.0),
])
def test_parse_verdict(text: str, want: float) -> None:
    assert parse_judgement(text, "verdict") == want


def test_parse_verdict_failures() -> None:
    for text in ("maybe", "Yesterday it was not", ""):
        with pytest.raises(ValueError, match="no yes/no"):
            parse_judgement(text, "verdict")
    with pytest.raises(ValueError, match="reward.judge.mode"):
        parse_judgement("Score: 1", "stars")


# ---------------------------------------------------------------- config


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    cfg = load_config(None, ["reward.fn=judge", f"reward.judge.model={tmp_path}",
                             "reward.judge.mode=verdict", "reward.judge.batch_size=4"])
    assert (cfg.reward.judge.mode, cfg.reward.judge.batch_size) == ("verdict", 4)
    for overrides, message in [
        (["reward.fn=judge"], "reward.judge.model is not set"),
        ([f"reward.judge.model={tmp_path}", "reward.judge.template=Rate {reply}"],
         r"reward.judge.template: unknown fields \['reply'\]"),
        (["reward.judge.template=Rate {question}"], "must contain {response}"),
        (["reward.judge.template=Rate {response"], "not a format string"),
        (["reward.judge.mode=stars"], "reward.judge.mode: got 'stars'"),
        (["reward.judge.timeout_s=0"], "reward.judge.timeout_s"),
        (["reward.judge.engine=vllm"], "reward.judge.engine"),
        (["reward.fn=judge", f"reward.judge.model={tmp_path}", "reward.args={letters: AB}"],
         "reward.args does not apply"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    assert RewardConfig(judge={"template": "Rate {{this}}: {response}"})  # literal braces


def test_judge_refuses_a_model_it_cannot_use(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_model

    no_template = save_tiny_model(tmp_path / "plain")  # a tokenizer without a chat template
    for model, message in [(no_template, "no chat template"),
                           (tmp_path / "missing", "cannot load its tokenizer")]:
        with pytest.raises(ValueError, match=f"reward.judge.model .*{message}"):
            start_judge(judge_run_config(reward_config(model)), tmp_path)
    assert not (tmp_path / "judge").exists()  # refused before any engine started


def test_engine_commands_are_the_rollout_launchers(tmp_path: Path) -> None:
    """No GPU here: the SGLang judge's command line is pinned, the launch itself is the
    rollout plane's (tests/test_sglang_launcher.py)."""
    judge = reward_config(tmp_path, engine="sglang", num_engines=2, sglang_tp=2,
                          sglang_base_gpu_id=4, sglang_mem_fraction_static=0.3,
                          sglang_extra_args=["--context-length", "4096"]).judge
    command, env = judge_engine_spec(judge, {"NCCL_DEBUG": "WARN"}, "cuda", "float32").command()
    argv = [str(a) for a in command(1, 31001)]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model-path"] == str(tmp_path) and flags["--port"] == "31001"
    assert (flags["--tp-size"], flags["--base-gpu-id"]) == ("2", "6")  # engine 1: 4 + 1 * 2
    assert (flags["--mem-fraction-static"], flags["--dtype"]) == ("0.3", "auto")
    assert argv[-2:] == ["--context-length", "4096"] and env["NCCL_DEBUG"] == "WARN"

    embedded = reward_config(tmp_path, engine_threads=3, dtype="bfloat16").judge
    command, env = judge_engine_spec(embedded, None, "cuda", "float32").command()
    argv = [str(a) for a in command(0, 31002)]
    assert argv[1:3] == ["-m", "rl_core.engine.server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert (flags["--model"], flags["--dtype"], flags["--num-threads"]) == (
        str(tmp_path), "bfloat16", "3")
    assert env["OMP_NUM_THREADS"] == "3"


# ---------------------------------------------------------------- one judge, real engines


def test_prompt_scores_and_batching(judge: JudgeRunner) -> None:
    assert active_judge() is judge
    prompt = judge.render("It is 4.", "4", "What is 2+2?")
    assert prompt == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nQ: What is 2+2?"
                      "\nReference: 4\nResponse: It is 4.\nGrade it from 0 to 10.<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert prompt == judge.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TEMPLATE.format(
            question="What is 2+2?", answer="4", response="It is 4.", max_score=10)}],
        tokenize=False, add_generation_prompt=True)

    before = judge.stats()
    responses = [f"answer {i}" for i in range(5)]
    result = judge.score(responses, ["4"] * 5, questions=[f"q{i}" for i in range(5)])
    assert result.scores == [pytest.approx(0.7)] * 5  # "Score=7" of 10
    assert result.correct == [True] * 5  # pass_threshold 0.5
    assert (result.num_errors, result.num_timeouts, result.errors) == (0, 0, [])
    assert delta(judge, before) == {"calls": 1, "samples": 5, "errors": 0, "timeouts": 0,
                                    "requests": 3, "retries": 0, "all_failed_calls": 0}
    seen = judge.recent()[-5:]
    assert [(j.question, j.response, j.output, j.score) for j in seen] == [
        (f"q{i}", f"answer {i}", OUTPUT, pytest.approx(0.7)) for i in range(5)]
    for j in seen:  # the engine received exactly the judge's tokens
        assert j.prompt == judge.render(j.response, "4", j.question)
        assert j.prompt_tokens == len(judge.tokenizer(j.prompt, add_special_tokens=False)
                                      ["input_ids"])

    # Record ids resolve through the judge's map; an unknown one fails its sample only.
    judge.questions["r1"] = "What is 3+3?"
    result = judge.score(["6", "7"], ["6", "6"], record_ids=["r1", "r404"])
    assert result.scores[0] == pytest.approx(0.7) and result.scores[1] == 0.0
    assert result.num_errors == 1 and "no question for this sample" in result.errors[0]
    assert judge.recent()[-2].question == "What is 3+3?"
    assert judge.score([], []).scores == []
    with pytest.raises(ValueError, match="aligned"):
        judge.score(["a"], [])


def test_refused_prompt_costs_one_sample(judge: JudgeRunner) -> None:
    before = judge.stats()
    result = judge.score(["fine", "long " * 600], ["1", "1"], questions=["q", "q"])
    assert result.scores == [pytest.approx(0.7), 0.0]
    assert result.num_errors == 1 and "refused the prompt" in result.errors[0]
    assert "context length" in result.errors[0]
    assert delta(judge, before)["requests"] == 3  # the batch, then each prompt alone


def test_truncated_output_is_a_counted_error(judge: JudgeRunner) -> None:
    judge.cfg.max_new_tokens = 3  # the judge is cut off before it gets to the score
    try:
        result = judge.score(["x"], ["1"], questions=["q"], budget=False)
    finally:
        judge.cfg.max_new_tokens = 64
    assert result.scores == [0.0] and result.num_errors == 1
    assert "no score" in result.errors[0] and "reward.judge.max_new_tokens" in result.errors[0]
    assert judge.recent()[-1].output and OUTPUT.startswith(judge.recent()[-1].output)


def test_stalled_engines_time_out_retry_and_abort(judge: JudgeRunner) -> None:
    client, urls = judge.pool.client, judge.pool.engine_urls
    restarts = judge.health()["restarts"]  # an earlier test may have killed one (any order)
    for url in urls:
        client.pause("abort", url=url)  # requests queue and never run
    try:
        before, t0 = judge.stats(), time.monotonic()
        result = judge.score(["a", "b", "c"], ["1"] * 3, questions=["q"] * 3, step=7)
        took = time.monotonic() - t0
        assert result.scores == [0.0] * 3 and result.num_timeouts == 3
        assert "reward.judge.timeout_s=3 (attempt 2 of 2)" in result.last_error
        assert result.failed_streak == 1  # counted like a failing reward function
        assert delta(judge, before) == {"calls": 1, "samples": 3, "errors": 0, "timeouts": 3,
                                        "requests": 4, "retries": 2, "all_failed_calls": 1}
        assert 6.0 <= took < 6.0 + 0.2 + 10.0  # 2 attempts of 3 s, a backoff, aborts
        for url in urls:  # the timed-out requests were aborted, not left queued
            load = client.loads(url=url)["loads"][0]
            assert load["num_waiting_reqs"] == 0 and load["num_running_reqs"] == 0
    finally:
        for url in urls:
            client.resume(url=url)
    result = judge.score(["a"], ["1"], questions=["q"], step=8)
    assert result.scores == [pytest.approx(0.7)] and result.failed_streak == 0
    assert judge.health()["restarts"] == restarts  # paused on purpose: healthy, not restarted


def test_concurrent_callers_get_their_own_answers(judge: JudgeRunner) -> None:
    before, errors = judge.stats(), []

    def caller(t: int) -> None:
        try:
            for k in range(3):
                tags = [f"{t}-{k}-{i}" for i in range(3)]
                result = judge.score([f"resp {x}" for x in tags], ["1"] * 3,
                                     questions=[f"q {x}" for x in tags], budget=False)
                assert result.scores == [pytest.approx(0.7)] * 3, result
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert delta(judge, before) == {"calls": 12, "samples": 36, "errors": 0, "timeouts": 0,
                                    "requests": 24, "retries": 0, "all_failed_calls": 0}
    seen = judge.recent()[-36:]
    assert sorted(j.response for j in seen) == sorted(
        f"resp {t}-{k}-{i}" for t in range(4) for k in range(3) for i in range(3))
    for j in seen:  # no cross-talk: each prompt holds its own question and response
        tag = j.response.removeprefix("resp ")
        assert j.question == f"q {tag}" and f"Q: q {tag}\n" in j.prompt
        assert f"Response: resp {tag}\n" in j.prompt


class JudgedEnv:
    """An environment scored by the run's judge (the recipe of docs/judges.md)."""

    def reset(self, task: Record) -> list[dict[str, str]]:
        self.task = task
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        result = active_judge().score([turn.text], [self.task.answer],
                                      questions=[self.task.question], budget=False)
        return StepResult(reward=result.scores[0], done=True, info={"correct": result.correct[0]})


def test_an_environment_reaches_the_judge(judge: JudgeRunner) -> None:
    env, streak = JudgedEnv(), judge.failed_streak
    assert isinstance(env, Environment)
    env.reset(Record(id="e1", question="Explain 2+2.", answer="4"))
    got = env.step(Turn(text="Two and two make four.", token_ids=[]))
    assert (got.reward, got.done, got.info) == (pytest.approx(0.7), True, {"correct": True})
    seen = judge.recent()[-1]
    assert (seen.question, seen.response, seen.answer) == (
        "Explain 2+2.", "Two and two make four.", "4")
    assert judge.failed_streak == streak  # an environment's calls are not the step's


def test_killed_engine_fails_over_and_is_restarted(judge: JudgeRunner) -> None:
    pool = judge.pool
    old_pid = pool.engines[0].proc.pid
    pool.kill(0)
    before = judge.stats()
    result = judge.score([f"r{i}" for i in range(8)], ["1"] * 8, questions=["q"] * 8)
    assert result.scores == [pytest.approx(0.7)] * 8  # the other engine answered
    d = delta(judge, before)
    assert d["requests"] == 4 + d["retries"]  # a request the dead engine lost was retried
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (
            pool.engines[0].restarts == 1 and pool.engines[0].in_service):
        time.sleep(0.2)
    assert pool.engines[0].restarts == 1 and pool.engines[0].in_service
    assert pool.engines[0].proc.pid != old_pid
    assert judge.health()["in_service"] == pool.engine_urls
    result = judge.score(["a", "b", "c", "d"], ["1"] * 4, questions=["q"] * 4)
    assert result.scores == [pytest.approx(0.7)] * 4


# ---------------------------------------------------------------- reward.fn: judge, planes


def test_judge_as_reward_fn_through_the_planes(judge_model: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [
        "rollout.engine=embedded", "rollout.engine_threads=1", "rollout.startup_timeout_s=120",
        "rollout.health_interval_s=0.5", "reward.fn=judge", f"reward.judge.model={judge_model}",
        "reward.judge.mode=verdict", "reward.judge.timeout_s=3", "reward.judge.retries=0",
        "reward.judge.engine_threads=1", "reward.max_failed_steps=2",
        # a second, weighted reward beside the judge: 0.5 for a completion with a digit
        "reward.extra=[{fn: regex, name: digit, weight: 0.5, args: {pattern: '[0-9]'}}]"])
    records = [Record(id=f"r{i}", question=f"What is {i}+{i}?", answer=str(2 * i))
               for i in range(3)]
    handle = bring_up_planes(cfg, judge_model, records, records[:1], tmp_path, with_trainer=False)
    planes = get_planes(handle)
    rewards = planes.reward_runner
    try:
        assert isinstance(rewards, RewardSet) and [t.name for t in rewards.terms] == ["judge", "digit"]
        judge = rewards.terms[0].runner
        assert isinstance(judge, JudgeRunner) and active_judge() is judge
        assert (tmp_path / "judge" / "engine-0.log").is_file()
        params = SamplingParams(temperature=0.0, max_new_tokens=12)
        samples = rollout_groups(planes.rollout, planes.train_records, planes.train_prompts, n=2,
                                 params=params, step=1, seed=0)
        result = score_samples(samples, rewards, step=1)
        digit = [float(any(c.isdigit() for c in s.text)) for s in samples]
        assert [s.reward for s in samples] == [1.0 + 0.5 * d for d in digit]
        assert all(s.correct for s in samples)  # the judge alone decides `correct`
        assert result.components == {"judge": [1.0] * 6, "digit": digit}
        assert result.num_errors == result.num_timeouts == 0
        by_id = {r.id: r.question for r in records}
        for s, j in zip(samples, judge.recent()[-6:], strict=True):  # each sample's question
            assert (j.question, j.response, j.answer) == (by_id[s.record_id], s.text, s.answer)

        # The failure budget: a stalled judge fails every sample of two steps -> the run stops
        # (its samples score 0, whatever the other term says).
        judge.pool.client.pause("abort", url=judge.pool.engine_urls[0])
        result = score_samples(samples, rewards, step=2)
        assert result.num_timeouts == 6 and result.failed_streak == 1
        assert [s.reward for s in samples] == [0.0] * 6
        with pytest.raises(RewardFunctionError, match=r"reward.max_failed_steps=2") as err:
            score_samples(samples, rewards, step=3)
        assert isinstance(err.value, JudgeError) and "reward.judge.timeout_s" in str(err.value)
        with pytest.raises(JudgeError):  # and on every later call
            score_samples(samples, rewards, step=4)
        pids = [e.proc.pid for e in judge.pool.engines + planes.rollout.pool.engines]
    finally:
        tear_down(handle)
    for pid in pids:  # the judge's engines went with the planes
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="after close"):
        judge.score(["a"], ["1"], questions=["q"])
    assert all(j is not judge for j in _open())


def _open() -> list[JudgeRunner]:
    try:
        return [active_judge()]
    except LookupError:
        return []
