"""Where each GRPO step's samples come from: generated in the step, ahead of it, or in more
rounds.

``rollout.max_staleness = k > 0`` submits steps ``t+1 .. t+k``'s rollouts while step ``t``
trains (or just before, where the planes cannot share the cores); ``rollout.streaming`` streams
groups across weight updates; ``algorithm.dynamic_sampling`` (DAPO) draws more prompt batches.
Batches drawn and rollouts generated ahead go into the checkpoint, so a resume trains on exactly
the samples the uninterrupted run did (docs/training.md, 'Overlapping rollout and training').
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from typing import Any

from prefect.utilities.annotations import opaque

from rl_core.data.sampler import PromptSampler
from rl_core.grpo import split_informative_groups, summarize_samples
from rl_core.planes import PlanesHandle, get_planes
from rl_core.rollout.stream import GroupStream
from rl_core.types import Sample
from tasks.step import StepSamples, reward, rollout, rollout_round, sampling_params

__all__ = ["Ahead", "DynamicSampling", "InStep", "Schedule", "StalenessError", "Streamed",
           "schedule_for"]

log = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A sample older than ``rollout.max_staleness`` reached training (a bug guard)."""


class Schedule:
    """A scheduling regime: what the flow calls (take, informative, prefetch, drain, done, and
    the checkpoint's state and buffer). Shared: the prompt sampler and the batches drawn but
    not trained. :func:`schedule_for` picks the regime from the config."""

    def __init__(self, planes: PlanesHandle) -> None:
        p = get_planes(planes)
        cfg = p.config
        self.planes, self.config = planes, cfg
        self.sampler = PromptSampler(len(p.train_records), cfg.train.prompts_per_step, cfg.seed)
        self.max_staleness, self.steps = cfg.rollout.max_staleness, cfg.train.steps
        # Generation for later steps runs during training only where the planes' threads
        # fit side by side (cluster.placement); else before it, in turn: the same samples.
        self.overlap = cfg.overlaps_training
        self.pending: dict[int, list[int]] = {}  # step -> prompt indices drawn, not trained
        self._futures: dict[int, Any] = {}
        self.select = DynamicSampling(self) if cfg.algorithm.dynamic_sampling else None

    def _indices(self, step: int) -> list[int]:
        if step not in self.pending:
            self.pending[step] = self.sampler.next_batch()
        return self.pending[step]

    def take(self, step: int) -> StepSamples:
        """Step ``step``'s samples."""
        raise NotImplementedError

    def informative(self, scored: StepSamples, step: int) -> StepSamples:
        """The scored samples the step trains on (all, unless dynamic sampling selects)."""
        return scored if self.select is None else self.select(scored, step)

    def prefetch(self, step: int) -> None:
        """Submit what generates while ``step`` trains (nothing by default)."""

    def drain(self) -> None:
        """Before the engines' weights change: wait for the rollouts in flight."""
        for future in self._futures.values():
            future.wait()

    def done(self, step: int) -> dict[str, float]:
        """Step ``step`` has trained and synced: its prompts are consumed."""
        self.pending.pop(step, None)
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position and the batches drawn but not trained (JSON-able)."""
        pending = [[step, list(idx)] for step, idx in sorted(self.pending.items())]
        return {**self.sampler.state_dict(), "pending": pending}

    def load_state_dict(self, state: dict[str, Any], buffer: list[dict[str, Any]] | None = None
                        ) -> None:  # fmt: skip
        """The sampler's position and batches drawn ahead, and the rollouts generated for them
        (``buffer``, :meth:`buffer`'s rows)."""
        state = dict(state)
        pending, stream = state.pop("pending", []), state.pop("stream", None)
        self.sampler.load_state_dict(state)
        self._restore(pending, stream, buffer or [])

    def _restore(self, pending: list, stream: dict[str, Any] | None,
                 buffer: list[dict[str, Any]]) -> None:  # fmt: skip
        raise NotImplementedError

    def buffer(self) -> list[dict[str, Any]]:
        """The finished rollouts generated ahead (call after :meth:`drain`) as JSON-able
        checkpoint rows."""
        return []


class InStep(Schedule):
    """Each step generates its own samples (``rollout.max_staleness: 0``); after a resume,
    those a checkpoint holds for the step are taken instead."""

    def __init__(self, planes: PlanesHandle) -> None:
        super().__init__(planes)
        self._ready: dict[int, StepSamples] = {}  # generated before a resume (the buffer)

    def take(self, step: int) -> StepSamples:
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
        samples.metrics.update(_ages(ages, self.max_staleness))
        return samples

    def _restore(self, pending: list, stream: dict[str, Any] | None,
                 buffer: list[dict[str, Any]]) -> None:  # fmt: skip
        self.pending = {int(step): list(idx) for step, idx in pending}
        self._futures.clear()
        self._ready = {}
        for row in buffer:
            step = int(row["step"])
            if self.pending.get(step) == list(row["indices"]):  # the batch it was drawn for
                self._ready[step] = StepSamples(step, [Sample(**x) for x in row["samples"]],
                                                dict(row["metrics"]))
        if self._ready:
            log.info("took back the rollouts generated ahead for steps %s", sorted(self._ready))
        if again := sorted(set(self.pending) - set(self._ready)):
            log.info("regenerating the prompt batches drawn ahead for steps %s", again)

    def buffer(self) -> list[dict[str, Any]]:
        rows = []
        for step in sorted({*self._futures, *self._ready}):
            done = self._ready[step] if step in self._ready else self._futures[step].result()
            rows.append({"step": step, "indices": list(self.pending[step]),
                         "samples": [asdict(s) for s in done.samples],
                         "metrics": dict(done.metrics)})
        return rows


class Ahead(InStep):
    """``rollout.max_staleness = k > 0``: steps ``t+1 .. t+k``'s rollouts are submitted while
    step ``t`` trains."""

    def prefetch(self, step: int) -> None:
        """Submit steps ``step+1 .. step+k``'s rollouts not in flight yet, each after the one
        before it, so no two share the engines' batches and their tokens and log-probs are
        bit-reproducible."""
        for ahead in range(step + 1, min(step + self.max_staleness, self.steps) + 1):
            if ahead not in self._futures and ahead not in self._ready:
                before = self._futures.get(ahead - 1)
                self._futures[ahead] = future = rollout.submit(
                    self.planes, self._indices(ahead), ahead,
                    wait_for=[before] if before is not None else None)
                if not self.overlap:
                    future.wait()


class Streamed(Schedule):
    """``rollout.streaming``: groups stream across weight updates (rl_core.rollout.stream);
    a step takes the first finished groups young enough for it."""

    def __init__(self, planes: PlanesHandle) -> None:
        super().__init__(planes)
        p, cfg = get_planes(planes), self.config
        tok = p.tokenizer
        self.stream = GroupStream(
            p.train_records, p.train_prompts, self.sampler, n=cfg.rollout.n_samples,
            params=sampling_params(cfg.rollout), seed=cfg.seed,
            per_step=cfg.train.prompts_per_step, max_staleness=self.max_staleness,
            partial_tokens=cfg.rollout.segment_tokens,
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
        self.stream.limit = self.steps + self.max_staleness
        self._stop: threading.Event | None = None  # ends a round that the update aborts

    def take(self, step: int) -> StepSamples:
        """The first ``train.prompts_per_step`` finished groups young enough for ``step``;
        rounds run now (the trainer waits) only while too few are ready."""
        stream = self.stream
        waited: dict[str, float] = {}
        rounds = 0
        while not stream.ready(step):
            if not stream.in_flight and stream.limit is not None and stream.admitted >= stream.limit:
                stream.limit += 1  # stale groups were dropped: one more batch than planned
            rounds += 1
            for key, value in rollout_round(self.planes, opaque(stream), rounds, step).items():
                waited[key] = waited.get(key, 0.0) + value
        ready, stale = stream.take(step)
        samples = [s for g in ready for s in g.samples]
        for i, s in enumerate(samples):
            s.group = i // stream.n
        dropped = [s for g in stale for s in g.samples]
        for s in dropped:
            s.meta["stale"] = True
        ages = [step - 1 - s.weight_version for s in samples]
        tokens = [step - 1 - v for s in samples for v in (s.versions or [])]
        metrics = {"time/rollout": waited.get("time/rollout", 0.0),
                   "stream_sync_rounds": float(rounds),
                   "stream_in_flight_groups": float(len(stream.in_flight)),
                   "stream_buffered_groups": float(len(stream.finished)),
                   "stream_stale_groups": float(len(stale)),
                   "partial_sample_frac": sum(len(set(s.versions or [])) > 1 for s in samples)
                   / max(len(samples), 1),
                   "token_age_mean": sum(tokens) / max(len(tokens), 1),
                   # versions a sample's tokens span (0: one version); rounds the trainer waited
                   # for re-sent this many tokens (an update's pause mode decides it)
                   "token_version_spread_mean": sum(max(s.versions or [0]) - min(s.versions or [0])
                                                    for s in samples) / max(len(samples), 1),
                   "stream_reprefill_tokens": waited.get("stream_reprefill_tokens", 0.0),
                   **_ages(ages, self.max_staleness)}
        if step == self.steps:  # the run ends: what it drew and never trained, to the ledger
            for s in (s for g in stream.groups for s in g.samples):
                s.meta["unused"] = True
                dropped.append(s)
            stream.groups = []
        if stale:
            log.warning("step %d: %d finished group(s) older than rollout.max_staleness=%d are "
                        "not trained on (recorded in the ledger as stale)", step, len(stale),
                        self.max_staleness)
        if not samples:
            raise RuntimeError(f"step {step}: the stream has no finished group to train on "
                               f"({len(stream.in_flight)} in flight, {len(stale)} stale)")
        return StepSamples(step, samples, metrics, dropped=dropped)

    def prefetch(self, step: int) -> None:
        """Submit a round that generates while ``step`` trains."""
        limit = self.stream.limit or 0
        if step < self.steps and (self.stream.admitted < limit or self.stream.in_flight):
            abort = self.overlap and not self.config.rollout.timing_free
            self._stop = threading.Event() if abort else None
            self._futures[step] = future = rollout_round.submit(
                self.planes, opaque(self.stream), 0, step, self._stop)
            if not self.overlap:  # the planes take turns on the cores
                future.wait()

    def drain(self) -> None:
        """A round the update aborts is told to stop after this one; else it is waited for."""
        if self._stop is not None:
            self._stop.set()
            return
        super().drain()

    def done(self, step: int) -> dict[str, float]:
        """The step's round has ended too (an aborted one returns as soon as the update's
        pause cut it); returns what it measured."""
        super().done(step)
        if (future := self._futures.pop(step, None)) is None:
            return {}
        self._stop = None
        return {f"overlap/{k}": v for k, v in future.result().items()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "stream": self.stream.state_dict()}

    def _restore(self, pending: list, stream: dict[str, Any] | None,
                 buffer: list[dict[str, Any]]) -> None:  # fmt: skip
        if stream is None:
            raise RuntimeError("this checkpoint was written without rollout.streaming: "
                               "resume it with rollout.streaming=false")
        self.stream.load(stream, buffer)
        log.info("took back the stream: %d group(s) in flight, %d finished",
                 len(self.stream.in_flight), len(self.stream.finished))

    def buffer(self) -> list[dict[str, Any]]:
        return self.stream.rows()


class DynamicSampling:
    """DAPO's dynamic sampling (``algorithm.dynamic_sampling``) over a regime's prompts."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def __call__(self, scored: StepSamples, step: int) -> StepSamples:
        """DAPO's dynamic sampling: keep groups whose rewards differ, roll out more batches until
        ``train.prompts_per_step`` such groups exist (or the rounds run out) and train on that many;
        the rest go to the ledger as not trained."""
        r = self.schedule
        cfg = r.config
        n, want = cfg.rollout.n_samples, cfg.train.prompts_per_step * cfg.rollout.n_samples
        generated = list(scored.samples)
        kept, dropped = split_informative_groups(scored.samples, n)
        rounds = 1
        while len(kept) < want and rounds < cfg.algorithm.dynamic_sampling_max_rounds:
            indices = r.sampler.next_batch()
            r.pending[step] = r._indices(step) + indices
            more = reward(r.planes, opaque(rollout(r.planes, indices, step)), step)
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


def schedule_for(planes: PlanesHandle) -> Schedule:
    """The regime the config asks for: streamed, ahead (``max_staleness`` > 0) or in-step."""
    r = get_planes(planes).config.rollout
    return (Streamed if r.streaming else Ahead if r.max_staleness else InStep)(planes)


def _ages(ages: list[int], max_staleness: int) -> dict[str, float]:
    """Staleness of a step's samples in weight versions: max, mean, and the histogram."""
    out = {"staleness_max": float(max(ages, default=0)),
           "staleness_mean": float(sum(ages) / len(ages)) if ages else 0.0}
    for age in range(max_staleness + 1):
        out[f"staleness_frac/{age}"] = ages.count(age) / max(len(ages), 1)
    return out
