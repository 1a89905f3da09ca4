"""Fully asynchronous rollouts: a stream of groups, partial rollouts across weight updates.

``rollout.streaming: true``: prompts are admitted a batch at a time (at most
``rollout.max_staleness`` batches ahead of training), every unfinished sample gets one
generation *segment* per round, and a step trains on the oldest finished groups. Each token
is tagged with the weight version that produced it (:attr:`Sample.versions`); a sample's age is
its oldest token's. The whole stream is checkpointed, so a resume is exact (deterministic
mode). How segments end, staleness and resume: docs/training.md, "Fully asynchronous rollouts".
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rl_core.data.records import Record
from rl_core.data.sampler import PromptSampler
from rl_core.engine.sampling import SamplingParams, sample_seed
from rl_core.interfaces import RolloutPlane
from rl_core.types import Sample
from rl_core.weight_sync import served_version

__all__ = ["Group", "GroupStream"]

log = logging.getLogger(__name__)


def _segment_seed(seed: int, done: int) -> int:
    """The seed of a sample's segment starting after ``done`` tokens (the first: its own)."""
    if done == 0:
        return seed
    blob = f"{seed}:{done}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2


@dataclass
class Group:
    """The ``n`` samples of one prompt, in flight or finished."""

    index: int  # admission order over the whole run
    batch: int  # the admitted batch (1-based): the uid's step
    record: int  # the prompt's row in the training data
    samples: list[Sample]
    seeds: list[int]
    finished_round: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def oldest(self) -> int:
        return min(s.weight_version for s in self.samples)

    def row(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "samples"},
                "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Group:
        return cls(**{**row, "samples": [Sample(**s) for s in row["samples"]]})


class GroupStream:
    """The prompts admitted, the groups in flight, and the finished groups not yet trained."""

    def __init__(self, records: Sequence[Record], prompts: Sequence[Sequence[int]],
                 sampler: PromptSampler, *, n: int, params: SamplingParams, seed: int,
                 per_step: int, max_staleness: int, partial_tokens: int | None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        if max_staleness < 1:
            raise ValueError("a stream needs rollout.max_staleness >= 1 (0 is synchronous)")
        self.records, self.prompts, self.sampler = records, prompts, sampler
        self.n, self.params, self.seed = n, params, seed
        self.per_step, self.max_staleness = per_step, max_staleness
        self.partial_tokens, self.decode = partial_tokens, decode
        self.limit: int | None = None  # at most this many batches (the run's steps + k)
        self.admitted = 0  # batches drawn so far
        self.drawn = 0  # groups drawn so far (the next group's index)
        self.rounds = 0
        self.groups: list[Group] = []  # in flight and finished, in admission order

    # ------------------------------------------------------------------ generation

    def admit(self, version: int) -> int:
        """Draw batches while fewer than ``version + 1 + max_staleness`` are admitted (a
        sample admitted now is at most ``max_staleness`` versions old when its batch trains,
        unless it is slower than its batch); how many groups were admitted."""
        added, bound = 0, version + 1 + self.max_staleness
        while self.admitted < (bound if self.limit is None else min(bound, self.limit)):
            self.admitted += 1
            for record in self.sampler.next_batch():
                rec = self.records[record]
                seeds = [sample_seed(self.seed, self.admitted, rec.id, j) for j in range(self.n)]
                samples = [Sample(list(self.prompts[record]), [], [], weight_version=version,
                                  uid=f"{self.admitted}:{rec.id}:{j}", record_id=rec.id,
                                  answer=rec.answer, prompt=rec.question,
                                  columns=dict(rec.columns), versions=[])
                           for j in range(self.n)]
                self.groups.append(Group(self.drawn, self.admitted, record, samples, seeds))
                self.drawn += 1
                added += 1
        return added

    def round(self, plane: RolloutPlane, version: int) -> dict[str, float]:
        """Admit what the bound allows, then one segment per unfinished sample in one
        generate call (the tail batches with the new prompts); finished groups are marked."""
        admitted = self.admit(version)
        todo = [(g, j) for g in self.groups if g.finished_round is None
                for j, s in enumerate(g.samples) if not _done(s, self.params.max_new_tokens)]
        self.rounds += 1
        reprefill = 0
        if todo:
            prompts, params = [], []
            for g, j in todo:
                s = g.samples[j]
                left = self.params.max_new_tokens - len(s.completion_ids)
                budget = left if self.partial_tokens is None else min(left, self.partial_tokens)
                prompts.append(s.prompt_ids + s.completion_ids)
                params.append(replace(self.params, max_new_tokens=budget,
                                      seed=_segment_seed(g.seeds[j], len(s.completion_ids))))
            outs = plane.generate(prompts, params, partial=True)
            for (g, j), out in zip(todo, outs, strict=True):
                reprefill += _extend(g.samples[j], out, self.params.max_new_tokens, version)
        finished = 0
        for g in self.groups:
            if g.finished_round is None and all(
                    _done(s, self.params.max_new_tokens) for s in g.samples):
                g.finished_round = self.rounds
                finished += 1
                for s in g.samples:
                    s.weight_version = min(s.versions or [s.weight_version])
                    if self.decode is not None:
                        s.text = self.decode(s.completion_ids)
        return {"stream_round_samples": float(len(todo)), "stream_admitted_groups": float(admitted),
                "stream_finished_groups": float(finished),
                "stream_reprefill_tokens": float(reprefill)}

    # ------------------------------------------------------------------ consumption

    @property
    def finished(self) -> list[Group]:
        """Finished groups, oldest first (by the round they finished in, then admission)."""
        return sorted((g for g in self.groups if g.finished_round is not None),
                      key=lambda g: (g.finished_round, g.index))

    @property
    def in_flight(self) -> list[Group]:
        return [g for g in self.groups if g.finished_round is None]

    def take(self, step: int) -> tuple[list[Group], list[Group]]:
        """Up to ``per_step`` finished groups for ``step`` (whose policy is version
        ``step - 1``), and the finished groups too old to train on (removed too)."""
        ready, stale = [], []
        for g in self.finished:
            if step - 1 - g.oldest > self.max_staleness:
                stale.append(g)
            elif len(ready) < self.per_step:
                ready.append(g)
        gone = {id(g) for g in ready + stale}
        self.groups = [g for g in self.groups if id(g) not in gone]
        return ready, stale

    def ready(self, step: int) -> bool:
        """Whether ``per_step`` finished groups young enough for ``step`` are waiting."""
        young = [g for g in self.finished if step - 1 - g.oldest <= self.max_staleness]
        return len(young) >= self.per_step

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "drawn": self.drawn, "rounds": self.rounds}

    def rows(self) -> list[dict[str, Any]]:
        """Every group in the stream, with every field of every sample (JSON-able)."""
        return [g.row() for g in self.groups]

    def load(self, state: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
        self.admitted, self.rounds = int(state["admitted"]), int(state["rounds"])
        self.drawn = int(state["drawn"])
        self.groups = [Group.from_row(r) for r in rows]


def _done(s: Sample, max_new_tokens: int) -> bool:
    """Finished: stopped (EOS, a stop string or token), or out of ``max_new_tokens``; a
    sample cut at a segment's budget or aborted by an update is not."""
    kind = s.finish_reason.get("type")
    if kind == "length":
        return len(s.completion_ids) >= max_new_tokens
    return kind is not None and kind != "abort"


def _extend(s: Sample, out: Sample, max_new_tokens: int, started: int) -> int:
    """Append a segment's tokens, log-probs and versions to ``s``; the tokens the engine
    computed again for it (a continuation's prompt + tokens so far, a retraction's KV)."""
    if len(out.logprobs) != len(out.completion_ids):
        raise ValueError(f"sample {s.uid}: a segment came back with {len(out.completion_ids)} "
                         f"tokens but {len(out.logprobs)} log-probs")
    again = (len(s.prompt_ids) + len(s.completion_ids) if s.completion_ids else 0) + int(
        out.meta.get("recomputed_tokens") or 0)
    s.completion_ids = s.completion_ids + out.completion_ids
    s.logprobs = s.logprobs + out.logprobs
    s.versions = (s.versions or []) + _token_versions(out, started)
    s.finish_reason = dict(out.finish_reason)
    if s.finish_reason.get("type") == "length" and len(s.completion_ids) >= max_new_tokens:
        s.finish_reason["length"] = max_new_tokens
    s.text += out.text
    s.meta = {**out.meta, "segments": s.meta.get("segments", 0) + 1}
    if out.routed_experts is not None:  # its request held every token so far: it covers all
        s.routed_experts = out.routed_experts
    return again


def _token_versions(out: Sample, started: int) -> list[int]:
    """Each token's weight version: the engine's spans where it reports them (an in-place or
    retracting pause carries a request across updates), else one version for the segment:
    the engine's label, or the version the round started at if older (an engine without
    spans, e.g. SGLang, labels a request carried across an update with the newest)."""
    spans, n = out.meta.get("weight_version_spans"), len(out.completion_ids)
    if spans and sum(int(k) for _, k in spans) == n:
        return [served_version(v) for v, k in spans for _ in range(int(k))]
    return [min(out.weight_version, started)] * n
