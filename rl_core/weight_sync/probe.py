"""The sync's behavioural check: each engine scores a fixed probe batch after every update.

A checksum proves the bytes arrived; the probe proves the engine computes with them. After the
load (and the checksum), each engine scores the same few tokens by prefill; the trainer's
log-probs for them are computed once per version. An engine whose log-probs differ from the
trainer's by more than the tolerance of the weights' precision (:data:`TOLERANCE`, measured:
docs/weight-sync.md) fails the sync like a checksum mismatch, naming the engine and by how
much. Metrics: ``sync/probe_max_abs_logp_diff`` and ``sync/probe_kl`` (the worst engine; also
per engine, ``.../engine<i>``) and ``sync/probe_seconds``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.types import Batch, Sample
from rl_core.weight_sync.checksum import WeightSyncError

__all__ = ["TOLERANCE", "ProbeBatch", "ProbeMismatch", "WeightProbe", "compare"]

log = logging.getLogger(__name__)

# Largest |log p| difference accepted between an engine and the trainer on the same weights, by
# the precision they run in: far above the noise measured on CPU (float32 < 1e-6, float16
# ~2e-3) and GPUs' published bfloat16 train/inference gaps, far below what a misplaced weight
# does (docs/weight-sync.md, "The probe").
TOLERANCE = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}


class ProbeMismatch(WeightSyncError):
    """An engine loaded weights that pass the checksum but do not behave as the trainer's."""

    def __init__(self, message: str, engines: Sequence[str]) -> None:
        super().__init__(message)
        self.engines = list(engines)


@dataclass
class ProbeBatch:
    """A prompt and fixed completions, the same at every sync (token ids)."""

    prompt: list[int]
    completions: list[list[int]]

    @classmethod
    def from_prompts(cls, prompts: Sequence[Sequence[int]], *, prompt_tokens: int = 24,
                     completion_tokens: int = 16, completions: int = 2) -> ProbeBatch:
        """From a run's tokenized prompts: the first one's last ``prompt_tokens`` tokens as
        the prompt, the next ones' first ``completion_tokens`` as completions (real text,
        so the probe runs through the weights that real tokens use)."""
        if not prompts:
            raise ValueError("the probe needs at least one tokenized prompt")
        prompt = list(prompts[0][-prompt_tokens:])
        others = [list(p[:completion_tokens]) for p in prompts[1 : completions + 1] if p]
        while len(others) < completions:  # a tiny prompt set: the prompt's own tokens
            others.append(list(prompts[0][:completion_tokens]))
        if len(prompt) < 2:
            raise ValueError("the probe's prompt needs at least two tokens")
        return cls(prompt, others)


def compare(reference: Sequence[Sequence[float]], served: Sequence[Sequence[float]],
            ) -> tuple[float, float]:
    """``(max |served - reference|, mean KL estimate)`` over every token; the KL estimate is
    k3, ``exp(d) - 1 - d`` with ``d = served - reference`` (>= 0, ~d^2/2)."""
    diffs = [s - r for ref, srv in zip(reference, served, strict=True)
             for r, s in zip(ref, srv, strict=True)]
    if not diffs:
        return 0.0, 0.0
    kl = sum(math.expm1(d) - d if abs(d) < 50 else math.inf for d in diffs) / len(diffs)
    return max(abs(d) for d in diffs), kl


@dataclass
class WeightProbe:
    """The probe of one run: the batch, the tolerance, the trainer's log-probs per version."""

    batch: ProbeBatch
    tolerance: float
    pad_token_id: int = 0
    _reference: tuple[int, list[list[float]]] | None = field(default=None, repr=False)

    def reference(self, trainer: Any, version: int) -> list[list[float]]:  # noqa: ANN401
        """The trainer's log-probs of the completions' tokens, computed once per version."""
        if self._reference is not None and self._reference[0] == version:
            return self._reference[1]
        p = self.batch.prompt
        samples = [Sample(list(p), list(c), [0.0] * len(c), {"type": "length"})
                   for c in self.batch.completions]
        # engines score unscaled log_softmax(logits): so does the trainer, for the probe
        temperature = getattr(trainer, "temperature", 1.0)
        try:
            trainer.temperature = 1.0
            logp = trainer.compute_logprobs(Batch.from_samples(samples, [0.0] * len(samples),
                                                               self.pad_token_id))
        finally:
            trainer.temperature = temperature
        start = len(p) - 1
        ref = [[float(x) for x in logp[i, start : start + len(c)]]
               for i, c in enumerate(self.batch.completions)]
        self._reference = (version, ref)
        return ref

    def admit(self, plane: Any, url: str, version: int) -> None:  # noqa: ANN401
        """An engine joining a running job (``EnginePool.add_engine``) against the trainer's
        log-probs of ``version``, kept from that version's sync (the trainer is not asked: it
        may be training); :class:`ProbeMismatch` over the tolerance."""
        if self._reference is None or self._reference[0] != version:
            log.warning("engine %s joins unprobed: no reference for weight version %d yet "
                        "(the next weight sync probes it)", url, version)
            return
        served = plane.probe(self.batch.prompt, self.batch.completions, urls=[url])
        diff, kl = compare(self._reference[1], next(iter(served.values())))
        if not diff <= self.tolerance:
            raise ProbeMismatch(f"engine {url} joining at weight version {version}: max |log p| "
                                f"difference {diff:.4g} from the trainer's, KL {kl:.3g} "
                                f"(tolerance {self.tolerance:g}); it does not join", [url])
        log.info("engine %s joins: probe max |log p| difference %.3g", url, diff)

    def check(self, trainer: Any, plane: Any, version: int) -> dict[str, float]:  # noqa: ANN401
        """Score the batch on every engine of ``plane`` (``plane.probe``) against the trainer;
        the metrics, or :class:`ProbeMismatch` naming each engine over the tolerance."""
        t0 = time.perf_counter()
        ref = self.reference(trainer, version)
        served: Mapping[str, list[list[float]]] = plane.probe(self.batch.prompt,
                                                              self.batch.completions)
        metrics: dict[str, float] = {}
        worst, worst_kl, bad, names = 0.0, 0.0, [], []
        for i, (engine, logps) in enumerate(served.items()):
            diff, kl = compare(ref, logps)
            metrics[f"sync/probe_max_abs_logp_diff/engine{i}"] = diff
            metrics[f"sync/probe_kl/engine{i}"] = kl
            worst, worst_kl = max(worst, diff), max(worst_kl, kl)
            if not diff <= self.tolerance:  # NaN fails too
                bad.append(f"{engine}: max |log p| difference {diff:.4g}, KL {kl:.3g}")
                names.append(engine)
        metrics.update({"sync/probe_max_abs_logp_diff": worst, "sync/probe_kl": worst_kl,
                        "sync/probe_seconds": time.perf_counter() - t0})
        if bad:
            raise ProbeMismatch(
                f"weight sync to version {version}: the checksum matched but the engine does "
                f"not compute as the trainer does on the probe (tolerance {self.tolerance:g}): "
                + "; ".join(bad) + ". The weights are loaded into the wrong place or a cache "
                "of the old ones is served; reloading", names)
        return metrics
