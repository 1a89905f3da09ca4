"""Off-policy corrections on the demo: none, TIS, MIS, IcePop, sequence masking.

Trains the embedded demo (``configs/tiny-cpu.yaml``) off-policy, ``rollout.max_staleness=2``
(the rollouts of steps t+1 and t+2 are generated while step t trains, from weights up to two
versions old), once per correction, each a fresh ``grpoflow train`` process with the same
seed, for ``--steps`` steps (evaluation only before and after, greedy on
``--eval-examples`` held-out examples; MLflow and checkpoints off):

- ``none``: ``algorithm.tis_cap=null`` (no correction: the update treats the stale samples
  as on-policy);
- ``tis``: truncated importance sampling, ``tis_cap`` 2.0 (the default with staleness > 0);
- ``mis``: masked importance sampling, ``tis_cap=2.0 tis_mode=mask``;
- ``icepop``: IcePop token masking alone, band [0.5, 2.0];
- ``seqmask``: sequence masking alone, max per-token |log ratio| > 1.0 drops the sample.

Every variant splits the 2 cores between the planes (``rollout.engine_threads=1``,
``train.num_threads=1``): overlapped planes with 2 OpenMP threads each oversubscribe the
cores and run ~3x slower (docs/benchmarks.md, "Overlapping rollout and training").

From each run's ``metrics.jsonl`` and ``summary.json``: the greedy accuracy before and
after, the mean reward over the last 5 steps, the mean step time over steps 2..N, the mean
trainer/rollout mismatch (``rollout_trainer_logp_diff``) and the share of tokens or samples
each correction touched (``tis_clip_frac``, ``mis_masked_token_frac``,
``icepop_masked_token_frac``, ``seq_masked_sample_frac``). Prints a table and writes JSON
(default ``benchmarks/results/offpolicy_ablation.json``). One seed, one run per variant: a
benchmark, never a test, and on this tiny model differences of a few points of accuracy
are within run-to-run noise.

Run: ``.venv/bin/python -m benchmarks.offpolicy_ablation`` (about 10 minutes on 2 idle cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, format_table, load1, mean, run_grpoflow_train, run_meta, write_json

DEFAULT_OUT = RESULTS / "offpolicy_ablation.json"
COMMON = ["rollout.max_staleness=2", "rollout.engine_threads=1", "train.num_threads=1"]
VARIANTS: dict[str, list[str]] = {
    "none": ["algorithm.tis_cap=null"],
    "tis": [],  # tis_cap 2.0, truncate: what max_staleness > 0 turns on
    "mis": ["algorithm.tis_cap=2.0", "algorithm.tis_mode=mask"],
    "icepop": ["algorithm.tis_cap=null", "algorithm.icepop_low=0.5", "algorithm.icepop_high=2.0"],
    "seqmask": ["algorithm.tis_cap=null", "algorithm.seq_mask_threshold=1.0"],
}
TOUCHED = ("tis_clip_frac", "mis_masked_token_frac", "icepop_masked_token_frac",
           "seq_masked_sample_frac")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-examples", type=int, default=100)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def one_run(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One ``grpoflow train`` of the demo with variant ``name``; what the table shows."""
    overrides = [
        f"train.steps={args.steps}", "eval.every=0", f"eval.num_examples={args.eval_examples}",
        "eval.pass_k_examples=0", "checkpoint.every=0", "tracking.backend=none",
        *COMMON, *VARIANTS[name],
    ]  # fmt: skip
    print(f"{name}: grpoflow train configs/tiny-cpu.yaml {' '.join(overrides)} "
          f"(load1 {load1():.2f})", flush=True)  # fmt: skip
    home = work / f"prefect-{name}"
    home.mkdir()
    run = run_grpoflow_train(overrides, run_name=name, storage_root=work,
                             env={"PREFECT_HOME": str(home)}, log_path=work / f"{name}.log")
    m = run.metrics
    later = m[1:] or m
    out: dict[str, Any] = {
        "overrides": VARIANTS[name],
        "pass_at_1_before": run.summary["first_eval"]["pass_at_1"],
        "pass_at_1_after": run.summary["last_eval"]["pass_at_1"],
        "reward_mean_last5": mean([x["reward_mean"] for x in m[-5:]]),
        "step_s_mean": mean([x["time/step"] for x in later]),
        "staleness_mean": mean([x.get("staleness_mean", float("nan")) for x in later]),
        "wall_s": run.wall_s, "load1_start": run.load_start, "load1_end": run.load_end,
    }  # fmt: skip
    for key in ("rollout_trainer_logp_diff", *TOUCHED):
        values = [x[key] for x in m if key in x]
        out[key] = statistics.fmean(values) if values else None
    print(f"{name}: pass@1 {out['pass_at_1_before']:.3f} -> {out['pass_at_1_after']:.3f}, "
          f"{out['step_s_mean']:.2f} s/step ({run.wall_s:.0f} s in all)", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    meta = run_meta("benchmarks.offpolicy_ablation", argv)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-offpolicy-") as tmp:
        for name in args.variants:
            results[name] = one_run(name, args, Path(tmp))

    def frac(v: float | None) -> str:
        return "–" if v is None else f"{v:.1%}"

    rows = [[name, r["pass_at_1_before"], r["pass_at_1_after"], r["reward_mean_last5"],
             r["step_s_mean"], r["rollout_trainer_logp_diff"] or float("nan"),
             *(frac(r[k]) for k in TOUCHED)]
            for name, r in results.items()]  # fmt: skip
    print()
    print(format_table(["variant", "pass@1 before", "pass@1 after", "reward (last 5)",
                        "s/step", "|Δlogp|", "TIS capped", "MIS masked tok",
                        "IcePop masked tok", "seq masked samples"], rows))  # fmt: skip
    doc = {**meta, "settings": {"steps": args.steps, "eval_examples": args.eval_examples,
                                "common_overrides": COMMON},
           "results": results}  # fmt: skip
    write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
