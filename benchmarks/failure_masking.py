"""Infrastructure failures masked, not scored 0: what injected environment faults do to a step.

The demo's tiny model answers arithmetic episodes (``--tasks`` tasks x ``--samples`` episodes,
one model turn each, reward 1 for a correct ``#### answer``) through
:class:`rl_core.agents.EpisodeRunner` on the in-process engine, with ``agent.episode_retries``
(1) and the default circuit breaker. The environment fails deterministically: every call whose
number is a multiple of ``round(1 / rate)`` raises (a server that drops that share of its
calls). For each fault rate it reports the episodes retried, those that failed after their
retry (masked: ``valid`` False), the breaker's openings, and what scoring them 0 instead would
have done to the other samples of their groups: the mean absolute change of their advantages
and the share whose advantage changes sign. Prints a table and writes JSON (default
``benchmarks/results/failure_masking.json``)::

    python -m benchmarks.failure_masking --model DIR [--tasks 16] [--samples 8]

``DIR``: the demo's model (``grpoflow bootstrap-model configs/tiny-cpu.yaml`` prints it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "failure_masking.json"


class _Answer:
    """One model turn: reward 1 if the final ``#### n`` is right; fails on every k-th call."""

    def __init__(self, every: int, counter: itertools.count, lock: threading.Lock) -> None:
        self.every, self.counter, self.lock = every, counter, lock

    def _call(self) -> None:
        with self.lock:
            n = next(self.counter)
        if self.every and n % self.every == self.every - 1:
            raise ConnectionError(f"environment server dropped call {n}")

    def reset(self, task: Any) -> list[dict]:  # noqa: ANN401
        self._call()
        self.answer = task.answer
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Any) -> Any:  # noqa: ANN401
        from rl_core.agents import StepResult
        from rl_core.rewards.math import gsm8k_reward

        self._call()
        return StepResult([], reward=float(gsm8k_reward(turn.text, self.answer)), done=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner
    from rl_core.agents.pacing import CircuitBreaker
    from rl_core.algorithms.advantages import group_advantages
    from rl_core.data.synthetic import generate_splits
    from rl_core.engine.sampling import SamplingParams
    from rl_core.rollout.inprocess import InProcessPlane

    records, _ = generate_splits(args.tasks, 1, 0, digits=(1, 1), steps=(1, 1))
    tok = AutoTokenizer.from_pretrained(args.model)
    plane = InProcessPlane(args.model)
    rows = []
    try:
        for rate in args.rates:
            every = round(1 / rate) if rate else 0
            counter, lock = itertools.count(), threading.Lock()
            breaker = CircuitBreaker(cooldown_s=0.01)  # the defaults, with a short cool-down
            runner = EpisodeRunner(plane, ChatTokens(tok),
                                   lambda e=every, c=counter, lk=lock: _Answer(e, c, lk),
                                   EpisodeLimits(max_turns=1, max_tokens=64), retries=1,
                                   breaker=breaker)
            samples = runner.run(records, n=args.samples, step=1, seed=0,
                                 params=SamplingParams(temperature=1.0, max_new_tokens=24))
            valid = torch.tensor([s.meta["episode"]["status"] != "failed" for s in samples])
            rewards = torch.tensor([s.reward for s in samples])  # a failed episode's is 0
            masked = group_advantages(rewards, args.samples, valid=valid)
            zeroed = group_advantages(rewards, args.samples)
            change = (masked - zeroed)[valid].abs()
            flips = ((masked > 0) != (zeroed > 0))[valid & (masked != 0)]
            rows.append({
                "fault_rate": rate, "episodes": len(samples),
                "retried": sum(s.meta["episode"]["attempts"] > 1 for s in samples),
                "masked": int((~valid).sum()), "breaker_opened": breaker.opened,
                "adv_change_mean": float(change.mean()) if len(change) else 0.0,
                "sign_flip_frac": float(flips.float().mean()) if len(flips) else 0.0,
                "reward_mean_valid": float(rewards[valid].mean()) if valid.any() else 0.0,
                "reward_mean_zeroed": float(rewards.mean())})
    finally:
        plane.close()
    print(f"{'faults':>6s} {'retried':>7s} {'masked':>6s} {'breaker':>7s} "
          f"{'|dA| if 0':>9s} {'sign flips':>10s} {'reward (valid / as 0)':>22s}")
    for r in rows:
        print(f"{r['fault_rate']:6.0%} {r['retried']:7d} {r['masked']:6d} "
              f"{r['breaker_opened']:7d} {r['adv_change_mean']:9.3f} {r['sign_flip_frac']:10.1%} "
              f"{r['reward_mean_valid']:10.3f} / {r['reward_mean_zeroed']:.3f}")
    result = {"model": args.model, "tasks": args.tasks, "samples": args.samples, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
