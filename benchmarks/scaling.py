"""Step time as the batch and the response length double (short ``grpoflow train`` runs).

Two sweeps of the demo pipeline (``configs/tiny-cpu.yaml``: the Prefect flow, the embedded
engine over HTTP, the torch trainer), each point a fresh ``grpoflow train`` process of
``--steps`` steps with a ``PREFECT_HOME`` of the benchmark's own, MLflow off (tracking is
measured by ``benchmarks.orchestration``) and evaluation only before and after:

- batch: ``train.prompts_per_step`` doubling (x ``rollout.n_samples`` = 8 samples each) at
  ``--base-len`` response tokens;
- response length: ``rollout.max_new_tokens`` doubling at ``--base-prompts`` prompts.

The model is the demo's architecture (1.7M parameters) with random weights
(``model.tiny_sft_steps=0``): the warm-started demo model answers in about 20 tokens and
stops, so a longer budget would not make longer responses; random weights rarely sample the
end-of-sequence token, so responses run to the budget (the measured mean length is
reported and plotted). For each point: the mean over steps 2..N of the step's wall time
(between consecutive metrics lines) and of its phases. Prints a table, writes JSON (default
``benchmarks/results/scaling.json``) and a plot (default ``docs/img/scaling.png``); the load
average is recorded. A benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.scaling`` (about 6 minutes on 2 idle cores;
``--batches 4 8 16 32 64 128 --lengths 32 64 128 256 512`` goes further).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, format_table, load1, run_grpoflow_train, run_meta, write_json

DEFAULT_OUT = RESULTS / "scaling.json"
DEFAULT_PLOT = ROOT / "docs" / "img" / "scaling.png"
PHASES = ("rollout", "reward", "logprobs", "train", "sync")
N_SAMPLES = 8


def run_point(prompts: int, max_new: int, args: argparse.Namespace, work: Path,
              home: Path) -> dict[str, Any]:  # fmt: skip
    """One short run; mean step wall and phases over steps 2..N."""
    name = f"p{prompts}-l{max_new}"
    overrides = [
        f"train.steps={args.steps}", f"train.prompts_per_step={prompts}",
        f"rollout.max_new_tokens={max_new}", "model.tiny_sft_steps=0",
        "tracking.backend=none", "eval.every=0", "eval.num_examples=8",
        "eval.pass_k_examples=0", "checkpoint.every=0",
    ]  # fmt: skip
    run = run_grpoflow_train(overrides, run_name=name, storage_root=work,
                             env={"PREFECT_HOME": str(home)}, log_path=work / f"{name}.log")  # fmt: skip
    later = run.metrics[1:]
    walls = [s for _, s in run.step_walls()]
    return {
        "prompts_per_step": prompts,
        "samples_per_step": prompts * N_SAMPLES,
        "max_new_tokens": max_new,
        "step_s": statistics.fmean(walls),
        "step_s_stdev": statistics.pstdev(walls),
        "phases_s": {p: statistics.fmean(m.get(f"time/{p}", 0.0) for m in later) for p in PHASES},
        "response_len_mean": statistics.fmean(m["response_len_mean"] for m in later),
        "response_tokens_per_step": statistics.fmean(m["response_tokens"] for m in later),
        "rollout_tokens_per_s": statistics.fmean(m["rollout_tokens_per_s"] for m in later),
        "train_tokens_per_s": statistics.fmean(m["train_tokens_per_s"] for m in later),
        "run_wall_s": run.wall_s,
        "load1_start": run.load_start,
        "load1_end": run.load_end,
    }


def plot(batch: list[dict[str, Any]], length: list[dict[str, Any]], path: Path,
         title: str) -> None:  # fmt: skip
    """Two panels: step time and its main phases against samples per step and against the
    mean response length, log2 x and log y (a doubling line shows linear scaling)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        (axes[0], batch, "samples_per_step", "samples per step (prompts x 8)"),
        (axes[1], length, "response_len_mean", "mean response length (tokens)"),
    )
    for ax, pts, key, label in panels:
        if not pts:
            ax.set_visible(False)
            continue
        x = [p[key] for p in pts]
        ax.plot(x, [p["step_s"] for p in pts], "o-", color="black", lw=2, label="step (wall)")
        for phase, color in (("rollout", "tab:blue"), ("train", "tab:orange"),
                             ("logprobs", "tab:green"), ("sync", "tab:gray")):  # fmt: skip
            ax.plot(x, [p["phases_s"][phase] for p in pts], "o--", color=color, label=phase)
        y0 = pts[0]["step_s"]
        ax.plot(x, [y0 * xi / x[0] for xi in x], ":", color="tab:red", label="linear from first")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:.0f}" for v in x])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if batch:
        axes[0].set_title(f"batch doubles (responses up to {batch[0]['max_new_tokens']} tokens)")
    if length:
        axes[1].set_title(f"response budget doubles ({length[0]['samples_per_step']} samples)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[4, 8, 16, 32],
                   help="train.prompts_per_step values (x 8 samples)")  # fmt: skip
    p.add_argument("--lengths", nargs="+", type=int, default=[32, 64, 128, 256],
                   help="rollout.max_new_tokens values")  # fmt: skip
    p.add_argument("--base-len", type=int, default=32, help="max_new_tokens of the batch sweep")
    p.add_argument("--base-prompts", type=int, default=8, help="prompts of the length sweep")
    p.add_argument("--steps", type=int, default=3, help="steps per run (means over 2..N)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 points each, 2 steps")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.lengths, args.steps = [2, 4], [16, 32], 2
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    meta = run_meta("benchmarks.scaling", argv)
    cache: dict[tuple[int, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-scaling-") as tmp:
        work = Path(tmp)
        home = work / "prefect-home"
        home.mkdir()
        points = [(b, args.base_len) for b in args.batches]
        points += [(args.base_prompts, n) for n in args.lengths]
        for prompts, max_new in points:
            if (prompts, max_new) in cache:
                continue
            print(f"{prompts} prompts x {N_SAMPLES}, max_new_tokens {max_new} "
                  f"(load1 {load1():.2f})", flush=True)  # fmt: skip
            r = cache[(prompts, max_new)] = run_point(prompts, max_new, args, work, home)
            print(f"  {r['step_s']:.2f} s/step, responses {r['response_len_mean']:.1f} tokens, "
                  f"run {r['run_wall_s']:.0f} s", flush=True)  # fmt: skip
    batch = [cache[(b, args.base_len)] for b in args.batches]
    length = [cache[(args.base_prompts, n)] for n in args.lengths]
    rows = []
    for sweep, pts in (("batch", batch), ("length", length)):
        prev = None
        for p in pts:
            ph = p["phases_s"]
            growth = p["step_s"] / prev if prev else float("nan")
            rows.append([sweep, p["samples_per_step"], p["max_new_tokens"], p["response_len_mean"],
                         p["step_s"], growth, ph["rollout"], ph["logprobs"], ph["train"],
                         ph["sync"], p["rollout_tokens_per_s"], p["train_tokens_per_s"]])  # fmt: skip
            prev = p["step_s"]
    print()
    print(format_table(["sweep", "samples", "max new", "resp len", "step s", "x prev", "rollout",
                        "logprobs", "train", "sync", "rollout tok/s", "train tok/s"], rows))  # fmt: skip
    title = (f"grpoflow train, tiny-cpu demo architecture (1.7M, random weights), 2 CPU cores; "
             f"{meta['started'][:10]}, commit {str(meta['git_head'])[:7]}")  # fmt: skip
    plot(batch, length, args.plot, title)
    doc = {**meta, "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()},
           "batch_sweep": batch, "length_sweep": length}  # fmt: skip
    write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
