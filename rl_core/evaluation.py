"""Held-out evaluation: greedy pass@1 and sampled pass@k against any rollout engine.

pass@k uses the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)``
for ``c`` correct out of ``n`` samples, averaged over problems (here ``n = k``, so it is
"any of k correct"). Sampling seeds depend only on (seed, problem, sample index), so an
evaluation is reproducible and comparable across steps.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rl_core.data import Record
from rl_core.grpo import RolloutEngine, sample_seed
from rl_core.rewards import gsm8k_reward
from rl_core.rollout.sampler import SamplingParams

__all__ = ["EvalResult", "evaluate", "pass_at_k"]


@dataclass
class EvalResult:
    pass_at_1: float  # greedy
    pass_at_k: float | None
    k: int
    num_examples: int
    response_len_mean: float
    truncation_rate: float
    seconds: float
    samples: list[dict[str, str]]  # a few (question, completion, answer, correct) rows

    def as_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {
            f"{prefix}pass@1": self.pass_at_1,
            f"{prefix}response_len_mean": self.response_len_mean,
            f"{prefix}truncation_rate": self.truncation_rate,
        }
        if self.pass_at_k is not None:
            out[f"{prefix}pass@{self.k}"] = self.pass_at_k
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(
    engine: RolloutEngine,
    records: Sequence[Record],
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    k: int = 4,
    k_examples: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    keep_samples: int = 8,
) -> EvalResult:
    """Greedy pass@1 on every record; sampled pass@k on the first ``k_examples``."""
    started = time.perf_counter()
    greedy = engine.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    )
    right = [gsm8k_reward(c.text or "", r.answer) for c, r in zip(greedy, records, strict=True)]
    lengths = [len(c.output_ids) for c in greedy]
    truncated = [c.finish_reason.get("type") == "length" for c in greedy]

    pk = None
    subset = list(zip(records, prompt_ids, strict=True))[:k_examples]
    if k > 1 and subset:
        prompts, params = [], []
        for rec, ids in subset:
            for j in range(k):
                prompts.append(ids)
                params.append(
                    SamplingParams(
                        temperature=temperature,
                        max_new_tokens=max_new_tokens,
                        seed=sample_seed(seed, -1, rec.id, j),
                    )
                )
        outs = engine.generate(prompts, params)
        scores = []
        for i, (rec, _) in enumerate(subset):
            group = outs[i * k : (i + 1) * k]
            c = sum(int(gsm8k_reward(o.text or "", rec.answer)) for o in group)
            scores.append(pass_at_k(k, c, k))
        pk = statistics.fmean(scores)

    rows = [
        {
            "question": r.question,
            "completion": c.text or "",
            "answer": r.final_answer,
            "correct": str(bool(ok)),
        }
        for r, c, ok in list(zip(records, greedy, right, strict=True))[:keep_samples]
    ]
    return EvalResult(
        pass_at_1=statistics.fmean(right) if right else 0.0,
        pass_at_k=pk,
        k=k,
        num_examples=len(records),
        response_len_mean=statistics.fmean(lengths) if lengths else 0.0,
        truncation_rate=statistics.fmean(truncated) if truncated else 0.0,
        seconds=time.perf_counter() - started,
        samples=rows,
    )
