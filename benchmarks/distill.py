"""On-policy distillation against GRPO on the same small student: accuracy per step and per FLOP.

The student is a smaller embedded tiny model (``--student``: hidden 96, 2 layers, built and
warm-started like the demo's, with the demo's tokenizer); the teacher (``--teacher``, a
local Hugging Face directory) is a larger model of the same tokenizer, e.g. the demo model
after a GRPO run (``runs/<run>/model``). Variants, each one ``grpoflow train`` of
``configs/tiny-cpu.yaml`` with the same seed and steps:

- ``grpo``: the task reward only;
- ``distill``: ``teacher.kl_weight=1``, ``teacher.task_weight=0`` (pure on-policy distillation);
- ``distill_task``: both (``task_weight=1``).

For each: held-out greedy accuracy before and after, the gain per step, and the gain per
PFLOP, where a step's FLOPs are estimated from its token counts and the parameter counts
(``N``, every parameter once): student rollout ``2 N_s`` per generated token, training
``6 N_s`` per trained token (prompt + response), the teacher's scoring ``2 N_t`` per token
it reads (prompt + response). Prints a table and writes JSON (default
``benchmarks/results/distill.json``). A benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.distill --teacher runs/<demo run>/model --steps 20``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, format_table, run_grpoflow_train, run_meta, write_json

DEFAULT_OUT = RESULTS / "distill.json"
STUDENT = ["model.tiny_hidden_size=96", "model.tiny_layers=2",
           "model.tiny_intermediate_size=256", "model.tiny_target_accuracy=0.15"]
VARIANTS = {
    "grpo": [],
    "distill": ["teacher.kl_weight=1.0", "teacher.task_weight=0.0"],
    "distill_task": ["teacher.kl_weight=1.0", "teacher.task_weight=1.0"],
}


def _params(model_dir: Path) -> int:
    """Parameters in ``model_dir``'s safetensors (tied weights are stored once)."""
    from safetensors.torch import load_file

    return sum(t.numel() for f in model_dir.glob("*.safetensors") for t in load_file(f).values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    teacher = args.teacher.resolve()
    n_t = _params(teacher)
    doc: dict[str, Any] = {**run_meta("benchmarks.distill", argv), "teacher": str(teacher),
                           "teacher_params": n_t, "steps": args.steps}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-distill-") as tmp:
        for name in args.variants:
            extra = [*STUDENT, *VARIANTS[name]]
            if name != "grpo":
                extra.append(f"teacher.path={teacher}")
            run = run_grpoflow_train(
                [f"train.steps={args.steps}", "eval.every=0", "tracking.backend=none",
                 f"eval.num_examples={args.eval_examples}", "eval.pass_k_examples=0",
                 "checkpoint.every=0", *extra],
                run_name=name, storage_root=Path(tmp), env={"PREFECT_HOME": f"{tmp}/ph-{name}"})
            n_s = _params(Path(run.summary["model_dir"]))
            flops = 0.0
            for m in run.metrics:
                gen = m["response_tokens"]
                trained = gen + m.get("prompt_tokens", 0.0)
                flops += 2 * n_s * gen + 6 * n_s * trained
                if name != "grpo":
                    flops += 2 * n_t * trained
            first = run.summary["first_eval"]["pass_at_1"]
            last = run.summary["last_eval"]["pass_at_1"]
            results[name] = {
                "student_params": n_s, "pass_at_1_first": first, "pass_at_1_last": last,
                "gain_per_step": (last - first) / args.steps, "pflops": flops / 1e15,
                "gain_per_pflop": (last - first) / max(flops / 1e15, 1e-12),
                "reverse_kl_first": run.metrics[0].get("distill/reverse_kl"),
                "reverse_kl_last": run.metrics[-1].get("distill/reverse_kl"),
                "reward_mean": [m["reward_mean"] for m in run.metrics],
                "seconds": run.wall_s, "load1": [run.load_start, run.load_end],
            }

            print(f"{name}: pass@1 {first:.3f} -> {last:.3f} in {run.wall_s:.0f}s", flush=True)
    print(format_table(
        ["variant", "pass@1 before", "after", "gain/step", "PFLOP", "gain/PFLOP", "rev KL first",
         "rev KL last"],
        [[k, r["pass_at_1_first"], r["pass_at_1_last"], r["gain_per_step"], r["pflops"],
          r["gain_per_pflop"], r["reverse_kl_first"] or float("nan"),
          r["reverse_kl_last"] or float("nan")] for k, r in results.items()]))
    doc["results"] = results
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
