"""Where each GRPO step's samples come from: generated in the step, ahead of it, or in more
rounds.

``rollout.max_staleness = 0`` (the default): step ``t`` generates its samples, then trains,
then syncs the weights, in turn (fully synchronous, on-policy).

``rollout.max_staleness = k > 0`` (one-step off-policy for ``k = 1``, as verl, NeMo RL,
AReaL and prime-rl do): before step ``t`` trains, the rollouts of steps ``t+1 .. t+k`` are
submitted as Prefect tasks (threads) that the engines serve with the weights they have
(version ``t-1``) while the trainer trains; the weight sync after the update waits for them.
Step ``t+j`` then trains on samples from weights at most ``k`` versions old; every sample
carries its ``weight_version`` and :meth:`Rollouts.take` refuses one older than the bound
(the TIS correction uses the engine's log-probs recorded with it).

Dynamic sampling (DAPO, ``algorithm.dynamic_sampling``): :meth:`Rollouts.informative` keeps
the groups whose rewards differ and draws more prompt batches until the step has
``train.prompts_per_step`` of them (or the rounds run out).

Every prompt batch drawn stays in ``pending`` until its step has trained and is written into
the checkpoint with the sampler's position (:meth:`state_dict`), and the rollouts generated
ahead (all finished when a checkpoint is written: the weight sync waited for them) are written
beside it (:meth:`buffer`). A resume takes them back (:meth:`load_buffer`) instead of
generating them again from other weights, so consumed data is neither skipped nor repeated and
the resumed run trains on exactly the samples the uninterrupted one did; a batch drawn ahead
without its samples (an older checkpoint) is regenerated.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from prefect.utilities.annotations import opaque

from rl_core.data.sampler import PromptSampler
from rl_core.grpo import split_informative_groups, summarize_samples
from rl_core.planes import PlanesHandle, get_planes
from rl_core.types import Sample
from tasks.step import StepSamples, reward, rollout

__all__ = ["Rollouts", "StalenessError"]

log = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A sample older than ``rollout.max_staleness`` reached training (a bug guard)."""


class Rollouts:
    """The prompt sampler, the batches drawn ahead, and the rollouts in flight."""

    def __init__(self, planes: PlanesHandle) -> None:
        p = get_planes(planes)
        cfg = p.config
        self.planes = planes
        self.sampler = PromptSampler(len(p.train_records), cfg.train.prompts_per_step, cfg.seed)
        self.max_staleness, self.steps = cfg.rollout.max_staleness, cfg.train.steps
        self.pending: dict[int, list[int]] = {}  # step -> prompt indices drawn, not trained
        self._futures: dict[int, Any] = {}
        self._ready: dict[int, StepSamples] = {}  # generated before a resume (the buffer)

    def _indices(self, step: int) -> list[int]:
        if step not in self.pending:
            self.pending[step] = self.sampler.next_batch()
        return self.pending[step]

    def take(self, step: int) -> StepSamples:
        """Step ``step``'s samples: the rollout submitted ahead, or one run now."""
        future = self._futures.pop(step, None)
        if step in self._ready:
            samples = self._ready.pop(step)
        else:
            samples = future.result() if future is not None else rollout(
                self.planes, self._indices(step), step)
        # Before step t trains, the trainer's policy is version t-1.
        ages = [step - 1 - s.weight_version for s in samples.samples]
        if ages and max(ages) > self.max_staleness:
            raise StalenessError(
                f"step {step}: samples from weight version {step - 1 - max(ages)} are "
                f"{max(ages)} versions old, beyond rollout.max_staleness={self.max_staleness}")
        samples.metrics["staleness_max"] = float(max(ages, default=0))
        samples.metrics["staleness_mean"] = float(sum(ages) / len(ages)) if ages else 0.0
        for age in range(self.max_staleness + 1):  # the histogram of sample ages
            samples.metrics[f"staleness_frac/{age}"] = ages.count(age) / max(len(ages), 1)
        return samples

    def informative(self, scored: StepSamples, step: int) -> StepSamples:
        """DAPO's dynamic sampling: keep the groups whose rewards differ, roll out more prompt
        batches until ``train.prompts_per_step`` such groups exist (or
        ``algorithm.dynamic_sampling_max_rounds`` run out), and train on exactly that many;
        the rest go to the ledger as not trained."""
        cfg = get_planes(self.planes).config
        n, want = cfg.rollout.n_samples, cfg.train.prompts_per_step * cfg.rollout.n_samples
        generated = list(scored.samples)
        kept, dropped = split_informative_groups(scored.samples, n)
        rounds = 1
        while len(kept) < want and rounds < cfg.algorithm.dynamic_sampling_max_rounds:
            indices = self.sampler.next_batch()
            self.pending[step] = self._indices(step) + indices
            more = reward(self.planes, opaque(rollout(self.planes, indices, step)), step)
            rounds += 1
            generated += more.samples
            k, d = split_informative_groups(more.samples, n)
            kept, dropped = kept + k, dropped + d
        kept, surplus = kept[:want], kept[want:]
        tokens = sum(len(s.completion_ids) for s in generated) or 1
        untrained = sum(len(s.completion_ids) for s in dropped + surplus)
        metrics = {**scored.metrics, **summarize_samples(generated, n),  # the policy's rewards
                   "dynamic_sampling_rounds": float(rounds),
                   "dynamic_sampling_kept_groups": float(len(kept) // n),
                   "dynamic_sampling_zero_var_groups": float(len(dropped) // n),
                   "dynamic_sampling_surplus_groups": float(len(surplus) // n),
                   # share of generated response tokens kept out of training (no gradient)
                   "dynamic_sampling_untrained_token_frac": untrained / tokens}
        return StepSamples(step, kept, metrics, dropped=dropped + surplus)

    def prefetch(self, step: int) -> None:
        """Submit the rollouts of steps ``step+1 .. step+k`` that are not in flight yet, each
        after the one before it: rollouts never share the engines' batches, so what the
        engines compute (tokens and log-probs, to the last bit) does not depend on how two
        rollouts' requests happened to interleave."""
        for ahead in range(step + 1, min(step + self.max_staleness, self.steps) + 1):
            if ahead not in self._futures and ahead not in self._ready:
                before = self._futures.get(ahead - 1)
                self._futures[ahead] = rollout.submit(
                    self.planes, self._indices(ahead), ahead,
                    wait_for=[before] if before is not None else None)

    def drain(self) -> None:
        """Wait for the rollouts in flight (before the engines' weights change)."""
        for future in self._futures.values():
            future.wait()

    def done(self, step: int) -> None:
        """Step ``step`` has trained: its prompts are consumed."""
        self.pending.pop(step, None)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position and the batches drawn but not trained (JSON-able)."""
        pending = [[step, list(idx)] for step, idx in sorted(self.pending.items())]
        return {**self.sampler.state_dict(), "pending": pending}

    def load_state_dict(self, state: dict[str, Any], buffer: list[dict[str, Any]] | None = None
                        ) -> None:
        """The sampler's position and batches drawn ahead, and the rollouts generated for them
        (``buffer``, :meth:`buffer`'s rows)."""
        state = dict(state)
        pending = state.pop("pending", [])
        self.sampler.load_state_dict(state)
        self.pending = {int(step): list(idx) for step, idx in pending}
        self._futures.clear()
        self._ready = {}
        for row in buffer or []:
            step = int(row["step"])
            if self.pending.get(step) == list(row["indices"]):  # the batch it was drawn for
                self._ready[step] = StepSamples(step, [Sample(**x) for x in row["samples"]],
                                                dict(row["metrics"]))
        if self._ready:
            log.info("took back the rollouts generated ahead for steps %s", sorted(self._ready))
        if again := sorted(set(self.pending) - set(self._ready)):
            log.info("regenerating the prompt batches drawn ahead for steps %s", again)

    def buffer(self) -> list[dict[str, Any]]:
        """The rollouts generated ahead of the current step, finished (call after
        :meth:`drain`), as JSON-able rows for the checkpoint: step, prompt indices, samples
        (every field: tokens, log-probs, versions) and their metrics."""
        rows = []
        for step in sorted({*self._futures, *self._ready}):
            done = self._ready[step] if step in self._ready else self._futures[step].result()
            rows.append({"step": step, "indices": list(self.pending[step]),
                         "samples": [asdict(s) for s in done.samples],
                         "metrics": dict(done.metrics)})
        return rows
