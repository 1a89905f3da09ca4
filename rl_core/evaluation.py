"""Held-out evaluation: greedy pass@1 and sampled pass@k of any rollout plane, scored by the
run's own reward (same function, sandbox and timeouts as training). A completion passes at
``reward.pass_threshold`` or more (format bonus excluded); pass@k is Chen et al.'s (2021)
unbiased ``1 - C(n - c, k) / C(n, k)`` with ``n = k`` ("any of k passes"), averaged over
problems. Seeds depend only on (seed, problem, sample index): reproducible across steps.
Never imports Prefect or MLflow.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rl_core.agents.episode import episode_metrics
from rl_core.data.records import Record, cell_texts
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import EpisodeKind, SingleTurn
from rl_core.interfaces import RolloutPlane
from rl_core.rewards import RewardResult, Scorer
from rl_core.thumbnails import thumbnails_b64
from rl_core.types import Sample

__all__ = ["EvalResult", "evaluate", "pass_at_k"]


@dataclass
class EvalResult:
    pass_at_1: float  # greedy
    pass_at_k: float | None
    k: int
    num_examples: int
    reward_mean: float  # of the greedy completions
    reward_errors: int  # reward calls that raised (scored 0), greedy and sampled
    reward_timeouts: int  # reward calls that timed out (scored 0)
    response_len_mean: float
    truncation_rate: float
    seconds: float
    # a few (question, completion, answer, correct, columns) rows; a prompt with images also
    # has ``images``: base64 thumbnails (rl_core.thumbnails), which the MLflow table shows
    samples: list[dict[str, Any]]
    episodes: dict[str, float] | None = None  # agent runs: tool use, turns, failures (greedy)
    rewards: dict[str, float] | None = None  # several reward functions: each one's mean (greedy)

    def to_dict(self) -> dict:
        return asdict(self)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` passing out of ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(plane: RolloutPlane, records: Sequence[Record], prompt_ids: Sequence[Sequence[int]],
             rewards: Scorer, *, max_new_tokens: int, k: int = 4, k_examples: int = 64,
             temperature: float = 1.0, seed: int = 0, keep_samples: int = 8,
             kind: EpisodeKind | None = None, pass_threshold: float = 1.0) -> EvalResult:
    """Greedy pass@1 on every record; sampled pass@k on the first ``k_examples``. Each
    attempt is what ``kind`` plays (default: one completion on ``plane``; an agent run's
    attempts are whole episodes), scored as in training."""
    started = time.perf_counter()
    kind = kind or SingleTurn(plane)

    def attempts(recs: Sequence[Record], prompts: Sequence[Sequence[int]],
                 params: SamplingParams, n: int) -> tuple[list[Sample], RewardResult]:
        outs = kind.episodes(recs, prompts, n=n, params=params, step=-1, seed=seed)
        return outs, kind.score(outs, rewards, pass_threshold=pass_threshold, budget=False)

    greedy, scored = attempts(records, prompt_ids, SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, seed=0), 1)
    lengths = [len(s.completion_ids) for s in greedy]
    failed = [scored.num_errors, scored.num_timeouts]
    pk = None
    subset = list(zip(records, prompt_ids, strict=True))[:k_examples]
    if k > 1 and subset:
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        outs, sampled = attempts([r for r, _ in subset], [ids for _, ids in subset], params, k)
        failed = [failed[0] + sampled.num_errors, failed[1] + sampled.num_timeouts]
        pk = statistics.fmean(
            pass_at_k(k, sum(sampled.correct[i * k : (i + 1) * k]), k) for i in range(len(subset))
        )
    rows = [{"question": r.text, "completion": s.text, "answer": r.final_answer,
             "correct": str(bool(ok)), **cell_texts(r.columns, skip=("completion", "correct")),
             **_thumbnails(getattr(s, "images", ()) or getattr(r, "images", ()))}
            for r, s, ok in list(zip(records, greedy, scored.correct, strict=True))[:keep_samples]]
    return EvalResult(
        pass_at_1=statistics.fmean(scored.correct) if greedy else 0.0,
        pass_at_k=pk,
        k=k,
        num_examples=len(records),
        reward_mean=statistics.fmean(scored.scores) if greedy else 0.0,
        reward_errors=failed[0],
        reward_timeouts=failed[1],
        response_len_mean=statistics.fmean(lengths) if lengths else 0.0,
        truncation_rate=statistics.fmean(s.truncated for s in greedy) if greedy else 0.0,
        seconds=time.perf_counter() - started,
        samples=rows,
        episodes=episode_metrics(greedy) or None,
        rewards={k.removeprefix("reward/"): v for k, v in scored.component_means().items()}
        if len(scored.components) > 1 else None,
    )


def _thumbnails(images: Sequence[bytes]) -> dict[str, list[str]]:
    """A sample row's ``images`` (JSON-safe: the rows go to evals.jsonl); none for text."""
    return {"images": small} if images and (small := thumbnails_b64(images)) else {}
