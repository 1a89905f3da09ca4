"""Where the learning signal comes from: reward (and its judge), agent environments, teacher."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rl_core.config.base import Section


class EnginesConfig(Section):
    """The engines of a model a run serves besides the policy (a teacher, a judge): declared
    once here, brought up as the rollout plane's are (``rl_core.planes.start_engines``)."""
    engine: Literal["embedded", "local", "sglang"] = Field("embedded", description="As "
        "rollout.engine: `embedded` (grpoflow's HTTP engine processes, CPU), `local` (in this "
        "process), `sglang` (SGLang servers, GPU).")
    num_engines: int = Field(1, ge=1, description="Engine processes (each a model copy).")


class JudgeConfig(EnginesConfig):
    """An LLM judge or reward model on engines of its own (`reward.fn: judge`, docs/judges.md)."""
    model: str | None = Field(None, description="The judge: a local Hugging Face directory or hub "
        "id of a chat model (its tokenizer's chat template renders the prompt).")
    mode: Literal["score", "verdict"] = Field("score", description="`score`: a number read from "
        "the output (\"Score: 7\") divided by `max_score`; `verdict`: yes / no scores 1 / 0.")
    template: str | None = Field(None, description="The user turn; fields `{question}`, "
        "`{response}`, `{answer}`, `{max_score}` (literal braces doubled). null: the mode's "
        "default.")
    system_prompt: str | None = Field(None, description="A system turn before the template.")
    max_score: float = Field(10.0, gt=0.0, description="`score` mode: the top of the scale.")
    max_new_tokens: int = Field(64, ge=1, description="Greedy tokens per judgement at most.")
    batch_size: int = Field(8, ge=1, description="Samples per request to a judge engine.")
    timeout_s: float = Field(60.0, gt=0.0, description="Bound on one request (a batch), queueing "
        "at the engine included; its samples then count as timeouts (scored 0) after `retries`.")
    retries: int = Field(2, ge=0, description="Further attempts of a request after a timeout or "
        "an engine error, with exponential backoff (a dead engine is restarted meanwhile).")
    retry_backoff_s: float = Field(1.0, gt=0.0, description="Wait before the first retry; doubled "
        "for each further one.")
    engine: Literal["embedded", "sglang"] = Field("embedded", description="`embedded`: grpoflow's "
        "engine processes (CPU); `sglang`: SGLang servers (GPU).")  # the scorer runs on its own
    engine_threads: int | None = Field(None, ge=1, description="torch threads per embedded "
        "judge engine; default: cores / engines.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: "
        "`model.dtype` on embedded engines, the checkpoint's own on SGLang.")
    sglang_tp: int = Field(1, ge=1, description="Tensor parallelism of each judge SGLang server.")
    sglang_base_gpu_id: int = Field(0, ge=0, description="First GPU of judge engine 0 (engine i "
        "starts at base + i * tp): keep the judge off the rollout engines' GPUs, or share them "
        "with a small `sglang_mem_fraction_static`.")
    sglang_mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0, description="SGLang's "
        "`--mem-fraction-static` of each judge server; null: SGLang's default.")
    sglang_extra_args: list[str] = Field(
        [], description="Arguments appended to each judge SGLang server's command line.")

    @field_validator("template")
    @classmethod
    def _check_template(cls, template: str | None) -> str | None:
        if template is None:
            return None
        import string

        allowed = {"question", "response", "answer", "max_score"}
        try:
            names = {n for _, n, _, _ in string.Formatter().parse(template) if n is not None}
        except ValueError as e:
            raise ValueError(f"not a format string ({e}); write literal braces as "
                             "{{ }}") from None
        if bad := names - allowed:
            raise ValueError(f"unknown fields {sorted(bad)}; the fields are {sorted(allowed)} "
                             "(write literal braces as {{ }})")
        if "response" not in names:
            raise ValueError("the template must contain {response}: what the judge is to judge")
        return template


# The builtin rewards (rl_core.rewards.runner.BUILTIN_REWARDS; a test keeps them equal).
BUILTIN_REWARD_NAMES = ("gsm8k", "format", "exact_match", "normalized_match", "multiple_choice",
                        "regex", "code_tests")


def _check_reward_spec(fn: str, *, judge: bool = True) -> str:
    spec = fn.strip()
    if spec in BUILTIN_REWARD_NAMES or (judge and spec == "judge"):
        return fn
    module, sep, attr = spec.partition(":")
    names = [*module.split("."), *attr.split(".")]
    if not sep or ":" in attr or not all(n.isidentifier() for n in names):
        raise ValueError(f"{fn!r} is neither a builtin ({', '.join(BUILTIN_REWARD_NAMES)}"
                         f"{', judge' if judge else ''}) nor a dotted path "
                         "'package.module:function' (e.g. my_rewards.math:score)")
    return fn


class RewardTermConfig(Section):
    """One more reward function (`reward.extra`), added to `reward.fn`'s score with a weight."""
    fn: str = Field(description="A builtin (as `reward.fn`, but not `judge`) or "
        "`package.module:function`, in either form: `fn(completion, answer)` or TRL's batched "
        "`fn(prompts, completions, **columns)`.")
    weight: float = Field(1.0, description="Its score is multiplied by this and added.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments bound "
        "to the function (e.g. `{pattern: '^#### '}` for `regex`).")
    name: str | None = Field(None, description="Its metric name (`reward/<name>`); default: "
        "the function's name.")

    @field_validator("fn")
    @classmethod
    def _check_fn(cls, fn: str) -> str:
        return _check_reward_spec(fn, judge=False)


class RewardConfig(Section):
    """How completions are scored (docs/data-and-rewards.md)."""
    fn: str = Field("gsm8k", description="The task reward (its score decides `correct`): "
        "`gsm8k`, `exact_match`, `normalized_match`, `multiple_choice`, `regex`, `code_tests`, "
        "`format`, `judge` (an LLM judge: `reward.judge`), or `package.module:function` in "
        "either form: `fn(completion, answer)` or TRL's batched `fn(prompts, completions, "
        "**columns)`, sync or async.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments bound to "
        "`reward.fn` (e.g. `{letters: ABCD}` for `multiple_choice`).")
    extra: list[RewardTermConfig] = Field(default_factory=list, description="More reward "
        "functions, each `{fn, weight, args, name}`: the score is `reward.fn`'s plus each "
        "weight times its score; each is logged as `reward/<name>`.")
    format_weight: float = Field(0.0, ge=0.0, description="Weight of a format bonus added to "
        "each score: 1 when the completion ends in a `#### <number>` line, else 0.")
    timeout_s: float = Field(
        5.0, gt=0.0, description="Bound on one sample's reward call (a batched or async "
        "function: on the batch, times its samples); a timeout scores 0.")
    memory_limit_mb: int | None = Field(
        4096, ge=64, description="Address-space limit (RLIMIT_AS) of each worker process running "
        "a custom reward function; an allocation past it scores that sample 0. null: no limit.")
    pass_threshold: float = Field(1.0, description="A completion counts as correct (accuracy, eval "
        "pass@k) when the reward function scores it at least this (format bonus excluded).")
    max_failed_steps: int = Field(
        3, ge=0, description="Fail the run when the reward function fails every sample of this "
        "many consecutive steps (0: never; such steps score 0 and the run goes on).")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The judge of "
        "`fn: judge`.")

    @field_validator("fn")
    @classmethod
    def _check_fn(cls, fn: str) -> str:
        return _check_reward_spec(fn)

    @model_validator(mode="after")
    def _judge_has_model(self) -> RewardConfig:
        if self.fn.strip() == "judge" and not self.judge.model:
            raise ValueError("reward.fn is 'judge' but reward.judge.model is not set: name the "
                             "judge model (a local Hugging Face directory or hub id)")
        if self.fn.strip() == "judge" and self.args:
            raise ValueError("reward.fn is 'judge': reward.args does not apply (the judge's "
                             "settings are reward.judge.*); remove reward.args")
        return self


class BreakerConfig(Section):
    """The circuit breaker over environment calls and agent programs (docs/agents.md,
    'Failures are not rewards')."""
    enabled: bool = Field(True, description="Pause the rollout while the environment fails.")
    failure_rate: float = Field(0.5, gt=0.0, le=1.0, description="Open when this share of the "
        "last `window` environment calls (or program attempts) failed.")
    window: int = Field(20, ge=1, description="Calls the failure rate is taken over.")
    min_calls: int = Field(10, ge=1, description="Calls in the window before it can open.")
    cooldown_s: float = Field(5.0, gt=0.0, description="Wait before the first probe call "
        "(doubling after each failed probe).")
    max_pause_s: float = Field(300.0, gt=0.0, description="Paused longer than this in a row: "
        "the step fails (EnvironmentUnavailableError), and Prefect retries it.")


class ConcurrencyConfig(Section):
    """Episodes in flight at once (agent programs), adapted to the engines' load."""
    adaptive: bool = Field(True, description="Halve the cap when an engine queues requests or "
        "its KV cache is fuller than `kv_high`; grow it by one while they keep up.")
    max_episodes: int = Field(64, ge=1, description="The cap's upper bound (and its value when "
        "not adaptive).")
    min_episodes: int = Field(2, ge=1, description="The cap's lower bound.")
    max_waiting: int = Field(0, ge=0, description="Requests an engine may queue (beyond those "
        "it runs) before the cap shrinks.")
    kv_high: float = Field(0.9, gt=0.0, le=1.0, description="KV cache usage that shrinks the "
        "cap.")


class AgentConfig(Section):
    """Multi-turn episodes (`rl_core.agents`, docs/agents.md). With neither `env` nor `program`
    set, rollouts are single completions."""
    env: str | None = Field(None, description="`tools` (the builtin tool-use environment), "
        "`verifiers:<environment id>`, `openenv:<package.module:EnvClass>`, or "
        "`package.module:factory` (called with `env_args`, returns an Environment per episode).")
    program: str | None = Field(None, description="A black-box agent, `package.module:function`"
        "(client, task) -> reward, run against the rollout plane's OpenAI-compatible endpoint.")
    env_args: dict[str, Any] = Field({}, description="Keyword arguments for the factory.")
    tools: list[str] = Field(["calculator"], description="Tools of `env: tools`: builtins "
        "(`calculator`, `python`) or `package.module:attribute` naming an rl_core.agents.Tool.")
    system_prompt: str | None = Field(None, description="`env: tools`: the system message; "
        "null: the Hermes tool instructions, unless the chat template renders tools itself.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode at most.")
    max_tokens: int = Field(256, ge=1, description="Tokens after the prompt per episode at most "
        "(model turns and observations); each turn also stops at rollout.max_new_tokens.")
    timeout_s: float = Field(120.0, gt=0, description="Wall time of one episode at most.")
    env_timeout_s: float = Field(30.0, gt=0, description="Bound on one environment call.")
    episode_retries: int = Field(1, ge=0, description="An episode whose environment fails is "
        "started over this many times, then recorded as failed (trains nothing).")
    max_failed_frac: float = Field(0.5, ge=0.0, le=1.0, description="A step in which more than "
        "this share of episodes failed counts towards `max_failed_steps`.")
    max_failed_steps: int = Field(3, ge=0, description="Fail the run after this many such steps "
        "in a row (0: never).")
    score_final_answer: bool = Field(True, description="Add `reward.fn`'s score of the last model "
        "turn to the environment's reward (off for environments that score themselves).")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="The circuit "
        "breaker that pauses episodes while their environment fails.")
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig, description=""
        "Agent-program episodes in flight, adapted to the engines' queue and KV cache.")
    template_mismatch: Literal["keep_prefix", "new_sample"] = Field("keep_prefix", description=""
        "When the chat template renders the conversation differently from the tokens the model "
        "saw (a reasoning template that drops earlier `<think>` blocks): `keep_prefix` goes on "
        "from the recorded tokens plus the template's tokens for the new messages; `new_sample` "
        "ends the episode's sample there as a segment (trained with the episode's advantage) "
        "and goes on from the template's rendering (docs/agents.md, 'Reasoning templates').")

    @model_validator(mode="after")
    def _one_kind(self) -> AgentConfig:
        if self.env is not None and self.program is not None:
            raise ValueError("set agent.env (an environment grpoflow drives) or agent.program (a "
                             "black-box agent on the OpenAI endpoint), not both")
        return self

    @property
    def enabled(self) -> bool:
        return self.env is not None or self.program is not None


class TeacherConfig(EnginesConfig):
    """On-policy distillation (``path`` set): docs/distillation.md."""

    path: str | None = Field(None, description="The teacher: HF hub id, local HF directory or "
                             "an `embedded:` model; None = no distillation.")
    kl_weight: float = Field(1.0, ge=0.0, description="Weight of the per-token reverse-KL "
                             "advantage log p_teacher - log p_student.")
    task_weight: float = Field(0.0, ge=0.0, description="Weight of the task reward's GRPO "
                               "advantage (0: pure distillation).")
    normalize: bool = Field(False, description="Centre and scale the per-token gap over the "
                            "step's response tokens (mean 0, std 1) before kl_weight: a "
                            "baseline, so the gap's mean stops pushing every sampled token down, "
                            "and GRPO's scale, so kl_weight and task_weight compare.")

    @property
    def enabled(self) -> bool:
        return self.path is not None
