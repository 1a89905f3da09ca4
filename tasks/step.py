"""The tasks of one GRPO step: rollout, reward, (log-probs), train, sync; and advantages.

Each is one phase in the Prefect UI and returns a small value with its own duration. Tasks that
reach an engine or user code retry with backoff (a rollout is safe to rerun: sampling seeds
depend only on run seed, step, prompt and sample index); ``train`` never retries, so an
optimizer step is never applied twice.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import opaque

from rl_core.agents.kind import EpisodeFailureError
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import summarize_samples
from rl_core.planes import PlanesHandle, get_planes
from rl_core.rewards import RewardFunctionError
from rl_core.types import Batch, Sample

__all__ = ["BUDGET_ERRORS", "StepSamples", "StepTaskError", "compute_advantages", "compute_logprobs",
           "needs_logprobs", "release_rollout_memory", "reward", "rollout", "rollout_round",
           "sampling_params", "score_advantages", "sync_weights", "train"]

# Failures a retry cannot fix: the run stops with the error (the flow does not restart planes).
BUDGET_ERRORS = (RewardFunctionError, EpisodeFailureError)
_RETRY = dict(retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
F = TypeVar("F", bound=Callable[..., Any])


class StepTaskError(RuntimeError):
    """A step's task failed; the message names the task run, the step and the cause."""

    def __init__(self, task: str, step: int, cause: BaseException) -> None:
        self.task, self.step = task, step
        super().__init__(f"task {task}-step-{step} failed: {type(cause).__name__}: {cause}")


def _named(task: str) -> Callable[[F], F]:
    """Re-raise failures as StepTaskError so the flow can say which task and step failed."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except StepTaskError:
                raise
            except Exception as exc:
                step = kwargs.get("step", args[-1] if args else -1)
                raise StepTaskError(task, step, exc) from exc

        return run  # type: ignore[return-value]

    return wrap


@dataclass
class StepSamples:
    """The samples of one step and what has been measured about them so far."""

    step: int
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)
    # Generated and scored but not trained on (dynamic sampling's zero-variance groups and
    # the groups beyond the batch): in the ledger, never in a training batch.
    dropped: list[Sample] = field(default_factory=list)

    def ledger(self) -> list[dict]:
        """One small row per sample: what was consumed, by which weights, how it scored,
        and whether it was trained on."""
        return [s.ledger_row(True) for s in self.samples] + [
            s.ledger_row(False) for s in self.dropped]


def _not_a_spent_budget(task: Any, task_run: Any, state: Any) -> bool:
    """Retry the task, unless the reward function or the episodes have spent their failure
    budget (``reward.max_failed_steps``, ``agent.max_failed_steps``): a retry would fail the
    same way."""
    exc = state.result(raise_on_failure=False)
    return not isinstance(getattr(exc, "__cause__", None), BUDGET_ERRORS)


def sampling_params(r: Any) -> SamplingParams:  # noqa: ANN401 - a RolloutConfig
    """The training rollouts' sampling parameters, from ``rollout.*``."""
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop=list(r.stop),
                          stop_token_ids=list(r.stop_token_ids))


# No task timeout: rollouts generated ahead run in worker threads, where Prefect's timeout
# cannot interrupt them (and warns each step); every generate call is bounded by
# rollout.timeout_s, every episode by agent.timeout_s.
@task(name="rollout", task_run_name="rollout-step-{step}",
      retry_condition_fn=_not_a_spent_budget, **_RETRY)
@_named("rollout")
def rollout(planes: PlanesHandle, indices: list[int], step: int) -> StepSamples:
    """Generate ``rollout.n_samples`` completions for each prompt in ``indices``."""
    p = get_planes(planes)
    r = p.config.rollout
    started = time.perf_counter()
    params = sampling_params(r)
    records = [p.train_records[i] for i in indices]
    metrics: dict[str, float] = {}
    samples = p.kind.episodes(records, [p.train_prompts[i] for i in indices], n=r.n_samples,
                              params=params, step=step, seed=p.config.seed)
    metrics.update(p.kind.check(samples))
    seconds = time.perf_counter() - started
    tokens = sum(len(s.completion_ids) for s in samples)
    return StepSamples(step, samples, {**metrics, "time/rollout": seconds,
                                       "rollout_tokens_per_s": tokens / max(seconds, 1e-9)})


# No task timeout: a round runs in a worker thread, where Prefect's cannot interrupt it;
# each generate call in it is bounded by rollout.timeout_s.
@task(name="rollout-round", task_run_name="rollout-round-{step}-{n}", **_RETRY)
@_named("rollout-round")
def rollout_round(planes: PlanesHandle, stream: Any, n: int, step: int,
                  stop: threading.Event | None = None) -> dict[str, float]:
    """Rounds of the streamed rollout at the plane's weight version: before ``step`` trains
    (``n`` > 0: the n-th round the trainer waits for) one round; while it trains (``n`` = 0) one,
    or with ``stop`` rounds until it is set or nothing is left. Safe to retry: a failed round leaves
    the samples as they were."""
    plane = get_planes(planes).rollout
    started, metrics, rounds = time.perf_counter(), {}, 0
    while True:
        for key, value in stream.round(plane, plane.weight_version).items():
            metrics[key] = metrics.get(key, 0.0) + value
        rounds += 1
        if stop is None or stop.is_set() or not stream.in_flight:
            break
    metrics.update({"stream_rounds": float(rounds), "time/rollout": time.perf_counter() - started})
    return metrics


@task(name="reward", task_run_name="reward-step-{step}", timeout_seconds=900,
      retry_condition_fn=_not_a_spent_budget, **_RETRY)
@_named("reward")
def reward(planes: PlanesHandle, batch: StepSamples, step: int) -> StepSamples:
    """Score every sample; failures of the reward function score 0 and are counted."""
    p = get_planes(planes)
    started = time.perf_counter()
    result = p.kind.score(batch.samples, p.reward_runner, step=step,
                          pass_threshold=p.config.reward.pass_threshold)
    metrics = {**batch.metrics, **summarize_samples(batch.samples, p.config.rollout.n_samples)}
    if len(result.components) > 1:  # several reward functions: each one's mean
        metrics.update(result.component_means())
    metrics.update({"reward_errors": float(result.num_errors),
                    "reward_timeouts": float(result.num_timeouts),
                    "reward_failed_streak": float(result.failed_streak),
                    "time/reward": time.perf_counter() - started})
    return StepSamples(step, batch.samples, metrics, dropped=batch.dropped)


@task(name="release-rollout-memory", task_run_name="release-rollout-memory-step-{step}",
      timeout_seconds=300, **_RETRY)
@_named("release-rollout-memory")
def release_rollout_memory(planes: PlanesHandle, step: int) -> dict[str, float]:
    """Colocated planes: the engines free their weights and KV cache for the trainer; the
    weight sync takes them back."""
    return get_planes(planes).release_rollout_memory()


def compute_advantages(planes: PlanesHandle, batch: StepSamples) -> Batch:
    """The samples as a training batch with the advantage source's advantages. A plain call,
    not a task: it is milliseconds of deterministic arithmetic, and each task run costs the
    Prefect API server CPU that the step's compute shares (docs/benchmarks.md)."""
    p = get_planes(planes)
    out = p.advantage.batch(batch.samples, p.pad_token_id)
    if p.config.train.lora.per_role:  # each row trains its role's adapter (docs/lora.md)
        roles = [s.meta.get("role", "") for s in batch.samples]
        if len(roles) != out.size:
            raise ValueError(f"train.lora.per_role: {out.size} rows for {len(roles)} samples")
        out.roles = roles
    return out


def score_advantages(planes: PlanesHandle, batch: StepSamples, step: int) -> StepSamples:
    """The advantage source's own pass over the scored samples (distillation: the teacher's
    log-prob of every sampled token), as a task named after it; none: ``batch`` as it is."""
    name = get_planes(planes).advantage.pass_name
    if name is None:
        return batch
    return _pass_task(name)(planes, opaque(batch), step)  # opaque: see grpo_step


@functools.cache
def _pass_task(name: str) -> Any:  # noqa: ANN401 - a Prefect Task
    """The pass's task, built once per name (not a copy every step)."""
    return _advantage_pass.with_options(name=name, task_run_name=name + "-step-{step}")


@task(timeout_seconds=1800, **_RETRY)
def _advantage_pass(planes: PlanesHandle, batch: StepSamples, step: int) -> StepSamples:
    source = get_planes(planes).advantage
    try:
        metrics = source.score(batch.samples)
    except Exception as exc:
        raise StepTaskError(str(source.pass_name), step, exc) from exc
    return StepSamples(step, batch.samples, {**batch.metrics, **metrics}, dropped=batch.dropped)


@task(name="logprobs", task_run_name="logprobs-step-{step}", timeout_seconds=1800, **_RETRY)
@_named("logprobs")
def compute_logprobs(planes: PlanesHandle, batch: Batch, step: int) -> tuple[Batch, dict]:
    """Old-policy and reference log-probs (the flow calls it only where the objective needs
    them: see ``needs_logprobs``)."""
    trainer = get_planes(planes).trainer
    started = time.perf_counter()
    if trainer.needs_old_logp:
        batch.old_logp = trainer.compute_logprobs(batch)
    if trainer.has_ref_model:
        batch.ref_logp = trainer.compute_logprobs(batch, reference=True)
    return batch, {"time/logprobs": time.perf_counter() - started}


def needs_logprobs(planes: PlanesHandle) -> bool:
    """Whether the step has log-probs to compute before training (off-policy mini-batches,
    several epochs, TIS, or a KL term); on-policy GRPO with beta 0 skips the task."""
    trainer = get_planes(planes).trainer
    return bool(trainer.needs_old_logp or trainer.has_ref_model)


@task(name="train", task_run_name="train-step-{step}", timeout_seconds=3600, cache_policy=NO_CACHE)
@_named("train")
def train(planes: PlanesHandle, batch: Batch, step: int) -> dict[str, float]:
    """One GRPO update (``mini_batches * ppo_epochs`` optimizer steps); never retried."""
    started = time.perf_counter()
    metrics = get_planes(planes).trainer.train_step(batch)
    metrics["time/train"] = time.perf_counter() - started
    return metrics


@task(name="sync-weights", task_run_name="sync-weights-step-{step}", timeout_seconds=600, **_RETRY)
@_named("sync-weights")
def sync_weights(planes: PlanesHandle, step: int) -> dict[str, float]:
    """Push the trainer's weights to the rollout plane as ``weight_version = step``."""
    metrics = get_planes(planes).sync_weights(step)
    metrics["time/sync"] = metrics.pop("sync_seconds")
    return metrics
