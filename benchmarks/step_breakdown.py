"""One GRPO step of the demo, split the way public RL-framework reports split theirs.

Runs the real pipeline: ``grpoflow train configs/tiny-cpu.yaml`` (the Prefect flow, the
embedded engine behind SGLang's HTTP API, MLflow tracking into the run's SQLite store, the
product defaults) for ``--steps`` steps with a checkpoint every ``--checkpoint-every`` steps,
evaluation only before and after (``eval.every=0``: an evaluation is not part of a step),
each run in a fresh process with a ``PREFECT_HOME`` of its own. From the run's
``metrics.jsonl`` it takes, for steps 2..N (step 1 pays warm-up):

- the step's wall time: the time between its metrics line and the previous step's, i.e.
  everything the loop did for that step;
- the phases the step's tasks time themselves: ``time/rollout``, ``time/reward``,
  ``time/logprobs`` (old and reference log-probs), ``time/train``, ``time/sync`` (weight
  sync to the engine, verified) and ``time/checkpoint`` (0 on steps without one);
- orchestration = wall - phases: Prefect task calls, advantages, MLflow logging, the
  sample ledger and metrics files, console lines. ``in-step`` is the part inside the step's
  own timer (``time/step`` - phases: the task calls), ``between steps`` the rest.

Means over steps 2..N (and over ``--repeats`` runs), as seconds and as shares of the step,
beside the Miles report on 8 x MI300X (Qwen3-30B-A3B: a 388.5 s step of rollout 152.8 s,
log-probs 31.5 s, training 95.3 s, weight update 33.9 s; the remaining 75 s unattributed).
Prints a table and writes JSON (default ``benchmarks/results/step_breakdown.json``); the load
average is recorded. A benchmark, never a test.

``--against REF`` is a before/after: the same runs of commit REF (checked out in a temporary
worktree, sharing this checkout's model cache) interleaved with this tree's, this tree first
in odd repeats and REF first in even ones, so machine noise hits both; the table adds REF's
seconds and the ratio.

Run: ``.venv/bin/python -m benchmarks.step_breakdown`` (about 2 minutes on 2 idle cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import (
    RESULTS,
    ROOT,
    format_table,
    git,
    load1,
    run_grpoflow_train,
    run_meta,
    write_json,
)

DEFAULT_OUT = RESULTS / "step_breakdown.json"
PHASES = ("rollout", "reward", "logprobs", "train", "sync", "checkpoint")
# Miles on 8 x MI300X (Qwen3-30B-A3B), seconds of one 388.5 s step.
MILES = {"rollout": 152.8, "logprobs": 31.5, "train": 95.3, "sync": 33.9}
MILES_STEP = 388.5


def breakdown(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step wall, phases and orchestration for steps 2..N of one run; their means."""
    rows = []
    for prev, m in zip(metrics, metrics[1:], strict=False):
        wall = m["time"] - prev["time"]
        phases = {p: float(m.get(f"time/{p}", 0.0)) for p in PHASES}
        in_step = m.get("time/step", float("nan")) - sum(v for k, v in phases.items()
                                                        if k != "checkpoint")  # fmt: skip
        rows.append({"step": m["step"], "wall": wall, **phases,
                     "orchestration": wall - sum(phases.values()),
                     "orchestration_in_step": in_step,
                     "orchestration_between_steps": wall - sum(phases.values()) - in_step})  # fmt: skip
    keys = ["wall", *PHASES, "orchestration", "orchestration_in_step",
            "orchestration_between_steps"]  # fmt: skip
    means = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    stdev = {k: statistics.pstdev([r[k] for r in rows]) for k in keys}
    return {"steps": rows, "mean": means, "stdev": stdev}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1, help="runs (each a fresh process)")
    p.add_argument("--eval-examples", type=int, default=50, help="eval.num_examples (before/after)")
    p.add_argument("--tracking", choices=["mlflow", "none"], default="mlflow")
    p.add_argument("--quick", action="store_true", help="smoke run: 5 steps, checkpoint every 2")
    p.add_argument("--against", metavar="REF", help="also run git REF, interleaved")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("overrides", nargs="*", help="more dotted overrides for grpoflow train")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.checkpoint_every, args.eval_examples = 5, 2, 10
    return args


def one_run(root: Path, name: str, i: int, args: argparse.Namespace, overrides: list[str],
            work: Path) -> dict[str, Any]:
    """One ``grpoflow train`` of ``root``'s code in a fresh process; its breakdown."""
    print(f"run {i + 1}/{args.repeats} ({name}): grpoflow train configs/tiny-cpu.yaml "
          f"{' '.join(overrides)} (load1 {load1():.2f})")  # fmt: skip
    tag = f"{i}-{'ref' if root != ROOT else 'this'}"
    home = work / f"prefect-{tag}"
    home.mkdir()
    run = run_grpoflow_train(overrides, run_name=f"run-{tag}", storage_root=work,
                             config=root / "configs" / "tiny-cpu.yaml", root=root,
                             env={"PREFECT_HOME": str(home)}, log_path=work / f"run-{tag}.log")
    b = breakdown(run.metrics)
    b.update(wall_s=run.wall_s, load1_start=run.load_start, load1_end=run.load_end,
             response_len_mean=statistics.fmean(m["response_len_mean"]
                                                for m in run.metrics[1:]))  # fmt: skip
    print(f"run {i + 1} ({name}): {b['mean']['wall']:.2f} s/step, orchestration "
          f"{b['mean']['orchestration'] * 1000:.0f} ms/step ({run.wall_s:.0f} s in all)")
    return b


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    meta = run_meta("benchmarks.step_breakdown", argv)
    overrides = [
        f"train.steps={args.steps}", f"checkpoint.every={args.checkpoint_every}",
        "eval.every=0", f"eval.num_examples={args.eval_examples}", "eval.pass_k_examples=0",
        f"tracking.backend={args.tracking}", *args.overrides,
    ]  # fmt: skip
    trees = {"this tree": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {"this tree": []}
    with tempfile.TemporaryDirectory(prefix="grpoflow-step-breakdown-") as tmp:
        work = Path(tmp)
        if args.against:
            trees[args.against] = work / "against"
            runs[args.against] = []
            git("worktree", "add", "--detach", str(trees[args.against]), args.against)
            # Both trees use this checkout's cached model (the same digest: same config).
            overrides.append(f"storage.cache_dir={ROOT / '.cache' / 'grpoflow'}")
        try:
            for i in range(args.repeats):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                for name in order:
                    runs[name].append(one_run(trees[name], name, i, args, overrides, work))
        finally:
            if args.against:
                git("worktree", "remove", "--force", str(trees[args.against]))
    mean = {k: statistics.fmean(r["mean"][k] for r in runs["this tree"])
            for k in runs["this tree"][0]["mean"]}  # fmt: skip
    wall = mean["wall"]
    names = {"rollout": "rollout (generate)", "reward": "reward", "logprobs":
             "old/ref log-probs", "train": "train", "sync": "weight sync",
             "checkpoint": f"checkpoint (every {args.checkpoint_every})",
             "orchestration": "orchestration (wall - phases)"}  # fmt: skip
    miles_other = MILES_STEP - sum(MILES.values())
    rows = []
    for key, label in names.items():
        miles = MILES.get(key, miles_other if key == "orchestration" else None)
        rows.append([label, mean[key], f"{mean[key] / wall:.1%}",
                     "–" if miles is None else f"{miles:.1f}",
                     "–" if miles is None else f"{miles / MILES_STEP:.1%}"])  # fmt: skip
    rows.append(["step (wall)", wall, "100%", f"{MILES_STEP:.1f}", "100%"])
    print()
    print(format_table(["phase", "grpoflow s", "share", "Miles s", "Miles share"], rows))
    print(f"orchestration: {mean['orchestration_in_step'] * 1000:.0f} ms in the step's tasks, "
          f"{mean['orchestration_between_steps'] * 1000:.0f} ms between steps; "
          f"load1 {load1():.2f}")  # fmt: skip
    against = None
    if args.against:
        ref = runs[args.against]
        against = {k: statistics.fmean(r["mean"][k] for r in ref) for k in ref[0]["mean"]}
        rows = [[label, mean[key], against[key],
                 f"{mean[key] / against[key]:.3f}" if against[key] else "–"]
                for key, label in [*names.items(), ("wall", "step (wall)")]]  # fmt: skip
        print()
        print(format_table(["phase", "this tree s", f"{args.against} s", "ratio"], rows))
    doc = {**meta, "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()},
           "overrides": overrides, "mean": mean, "runs": runs["this tree"],
           "against": None if against is None else {"ref": args.against,
                                                    "commit": git("rev-parse", args.against),
                                                    "mean": against, "runs": runs[args.against]},
           "miles_8xmi300x": {**MILES, "other": miles_other, "step": MILES_STEP}}  # fmt: skip
    write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
