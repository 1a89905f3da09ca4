"""The self-play demo's curve (configs/selfplay-cpu.yaml): per-role rewards over a run, and the
solver on a fixed problem set before and after.

Reads a finished run's ``metrics.jsonl`` and ``evals.jsonl`` and prints, per window of steps,
the proposer's mean frontier reward (``role/proposer/reward_mean``) and the solver's accuracy
on the step's proposed problems (``role/solver/reward_mean``), then the evaluations (the
solver's greedy answer to the greedy proposer's problem). The solver's accuracy on the
proposer's problems mixes two things: a better solver and easier problems. ``--fixed`` also
answers every one-step problem ``What is a op b?`` (``a``, ``b`` one digit, ``+`` and ``-``
without negative results: 155 problems) greedily with the base model and with the run's
exported model, the same problems for both: the solver's own progress. A benchmark, never a
test.

Run: ``grpoflow train configs/selfplay-cpu.yaml run_name=selfplay`` then
``.venv/bin/python -m benchmarks.selfplay runs/selfplay --fixed --base <the tiny model's dir>``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

__all__ = ["fixed_accuracy", "main"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fixed_accuracy(model: Path) -> float:
    """Greedy accuracy of ``model`` on every one-step one-digit ``+``/``-`` problem."""
    from transformers import AutoTokenizer

    from rl_core.agents import ChatTokens
    from rl_core.engine.sampling import SamplingParams
    from rl_core.rollout.inprocess import InProcessPlane

    problems = [(a, op, b) for a in range(10) for b in range(10) for op in "+-"
                if op == "+" or a >= b]
    chat = ChatTokens(AutoTokenizer.from_pretrained(model))
    plane = InProcessPlane(model)
    try:
        outs = plane.generate(
            [chat.prompt_ids([{"role": "user", "content": f"What is {a} {op} {b}?"}])
             for a, op, b in problems],
            [SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)] * len(problems))
    finally:
        plane.close()
    right = 0
    for (a, op, b), s in zip(problems, outs, strict=True):
        found = re.findall(r"####\s*(-?\d+)", s.text)
        right += bool(found) and int(found[-1]) == (a + b if op == "+" else a - b)
    return right / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the run's directory (metrics.jsonl, evals.jsonl)")
    ap.add_argument("--window", type=int, default=10, help="steps per row")
    ap.add_argument("--fixed", action="store_true", help="the solver on the fixed problem set")
    ap.add_argument("--base", type=Path, help="the base model's directory (with --fixed)")
    ap.add_argument("--trained", type=Path, help="the trained model (default: RUN/model)")
    args = ap.parse_args()
    steps = _rows(args.run / "metrics.jsonl")
    print("| steps | proposer frontier reward | solver accuracy (proposed problems) | s/step |")
    print("|---|---:|---:|---:|")
    for k in range(0, len(steps), args.window):
        w = steps[k : k + args.window]
        cells = [statistics.fmean(m[key] for m in w) if key in w[0] else float("nan")
                 for key in ("role/proposer/reward_mean", "role/solver/reward_mean", "time/step")]
        print(f"| {w[0]['step']}-{w[-1]['step']} | {cells[0]:.3f} | {cells[1]:.3f} | "
              f"{cells[2]:.1f} |")
    evals = _rows(args.run / "evals.jsonl") if (args.run / "evals.jsonl").exists() else []
    for e in evals:
        print(f"eval @ step {e['step']}: solver greedy pass@1 on the greedy proposer's problems "
              f"{e['pass_at_1']:.3f} (n={e['num_examples']})")
    if args.fixed:
        if args.base is None:
            ap.error("--fixed needs --base")
        trained = args.trained or args.run / "model"
        print(f"fixed set: base {fixed_accuracy(args.base):.3f}, "
              f"trained {fixed_accuracy(trained):.3f}")


if __name__ == "__main__":
    main()
