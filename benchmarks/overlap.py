"""Overlap and dynamic sampling against the synchronous loop: step time and accuracy.

Runs the embedded demo (``configs/tiny-cpu.yaml``, HTTP rollout engine, MLflow off) once
per variant, each in a fresh ``grpoflow train`` process with the same seed and steps:

- ``sync``: ``rollout.max_staleness=0`` (the default: generate, train, sync in turn);
- ``overlap``: ``rollout.max_staleness=1`` (step t+1's rollout runs while step t trains;
  TIS on by default);
- ``dynamic``: ``algorithm.dynamic_sampling=true`` (DAPO: zero-variance groups are not
  trained on; more rollout rounds fill the batch);
- ``overlap_split`` (``--variants``): ``overlap`` with the cores split between the planes
  (one engine thread, one trainer thread) instead of each taking them all;
- ``stream_abort`` / ``stream_retract`` / ``stream_in_place`` (``--variants``): a stream whose
  rounds run across weight updates (``rollout.deterministic=false``, as with SGLang), each
  ``rollout.pause_mode``: the step time, the tokens the engines computed again
  (``reprefill_tokens_per_step``: a continuation's prompt + tokens so far, a retraction's KV)
  and how many versions a sample's tokens span (``token_version_spread_mean``).

For each it reads the run's ``metrics.jsonl`` and ``summary.json``: the mean step wall time
over steps 2..N (step 1 has nothing to overlap with and pays warm-up), the phases, the
held-out greedy accuracy before and after, and for dynamic sampling the share of generated
tokens kept out of training and the rounds per step. Prints a table and writes JSON
(default ``benchmarks/results/overlap.json``). The load average is recorded: numbers are
only comparable on the same machine at the same load. A benchmark, never a test.

With ``--repeats R`` every variant runs R times, round-robin (a drift in machine load hits
all alike); figures are medians, and the speedup is also given as the median of each
round's own ratio ("paired"). With ``--seed-per-round`` round i runs with ``seed=i``
(accuracy across seeds: is a mode's final accuracy within the seed-to-seed spread of sync's?);
the per-round accuracies are kept in the JSON (``runs``) and printed.

Run: ``.venv/bin/python -m benchmarks.overlap --steps 20 --repeats 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import GRPOFLOW, ROOT

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "overlap.json"
VARIANTS: dict[str, list[str]] = {
    "sync": [],
    "overlap": ["rollout.max_staleness=1"],
    "dynamic": ["algorithm.dynamic_sampling=true"],
    # overlap with the cores split between the planes (1 engine thread + 1 trainer thread
    # on 2 cores) instead of each plane taking them all: no OpenMP oversubscription
    "overlap_split": ["rollout.max_staleness=1", "rollout.engine_threads=1",
                      "train.num_threads=1"],
    # fully asynchronous (rollout.streaming): partial rollouts, a stream of groups
    "stream": ["rollout.max_staleness=2", "rollout.streaming=true"],
    # rounds across updates (SGLang's timing), each pause mode (rollout.pause_mode)
    **{f"stream_{mode}": ["rollout.max_staleness=2", "rollout.streaming=true",
                          "rollout.deterministic=false", f"rollout.pause_mode={mode}"]
       for mode in ("abort", "retract", "in_place")},
    # the planes on separate cores (as on separate GPUs): 1 engine thread + 1 trainer thread
    **{f"{name}_disagg": [*extra, "cluster.placement=disaggregated", "train.num_threads=1"]
       for name, extra in (("sync", []), ("overlap", ["rollout.max_staleness=1"]),
                           ("stream", ["rollout.max_staleness=2", "rollout.streaming=true"]))},
}
DEFAULT_VARIANTS = ("sync", "overlap", "dynamic")


def run_variant(
    name: str, extra: list[str], steps: int, eval_examples: int, work: Path, round_: int = 0,
    config: Path = ROOT / "configs" / "tiny-cpu.yaml", seed: int | None = None,
    timeout_s: float = 1800,
) -> dict:
    """One ``grpoflow train`` of the demo; its timings and accuracy."""
    overrides = [
        f"storage.root={work}", f"run_name={name}-{round_}", f"train.steps={steps}",
        "tracking.backend=none", "eval.every=0", f"eval.num_examples={eval_examples}",
        "eval.pass_k_examples=0", "checkpoint.every=0", *extra,
        *([f"seed={seed}"] if seed is not None else []),
    ]  # fmt: skip
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    subprocess.run(
        [*GRPOFLOW, "train", str(config), "--quiet",
         "--no-resume", *overrides],
        check=True, cwd=ROOT, timeout=timeout_s,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    run = work / f"{name}-{round_}"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    later = metrics[1:] or metrics

    def mean(key: str) -> float:
        return statistics.fmean(m.get(key, 0.0) for m in later)

    out: dict[str, Any] = {
        "overrides": extra,
        "seed": seed,
        "wall_s": wall,
        "load_avg_1m_start": load,
        "step_s_mean": mean("time/step"),
        "phases_s_mean": {
            k: mean(f"time/{k}")
            for k in ("rollout", "reward", "logprobs", "train", "overlap_wait", "sync")
        },
        "overlapped_rollout_s_mean": mean("overlap/time/rollout"),
        "trained_samples_per_s": len(later) * _batch(metrics)
        / max(sum(m["time/step"] for m in later), 1e-9),
        "response_len_mean": mean("response_len_mean"),
        "response_len_max_mean": mean("response_len_max"),
        "stale_groups": sum(m.get("stream_stale_groups", 0.0) for m in metrics),
        "reprefill_tokens_per_step": statistics.fmean(
            m.get("stream_reprefill_tokens", 0.0) + m.get("overlap/stream_reprefill_tokens", 0.0)
            for m in later),
        "response_tokens_per_step": mean("response_tokens"),
        "token_version_spread_mean": mean("token_version_spread_mean"),
        "partial_sample_frac_mean": mean("partial_sample_frac"),
        "token_age_mean": mean("token_age_mean"),
        "reward_mean_last5": statistics.fmean(m["reward_mean"] for m in metrics[-5:]),
        "pass_at_1_first": summary["first_eval"]["pass_at_1"],
        "pass_at_1_last": summary["last_eval"]["pass_at_1"],
    }
    if name == "dynamic":
        out["untrained_token_frac_mean"] = statistics.fmean(
            m["dynamic_sampling_untrained_token_frac"] for m in metrics
        )
        out["rounds_mean"] = statistics.fmean(m["dynamic_sampling_rounds"] for m in metrics)
        out["zero_var_groups_per_step"] = statistics.fmean(
            m["dynamic_sampling_zero_var_groups"] for m in metrics
        )
    return out


def _batch(metrics: list[dict]) -> float:
    """Samples a step trains on (the ledger's count, from the metrics: tokens / mean length)."""
    m = metrics[-1]
    return round(m["response_tokens"] / max(m["response_len_mean"], 1e-9))


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one variant (every number of :func:`run_variant`)."""
    out: dict[str, Any] = {"rounds": len(runs), "overrides": runs[0]["overrides"]}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "seed":
            out[key] = statistics.median(r[key] for r in runs)
    out["phases_s_mean"] = {k: statistics.median(r["phases_s_mean"][k] for r in runs)
                            for k in runs[0]["phases_s_mean"]}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-examples", type=int, default=100)
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                    choices=list(VARIANTS))  # fmt: skip
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.yaml",
                    help="e.g. configs/long-tail-cpu.yaml (a long-tailed response length)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds; each round runs every variant once, in turn")  # fmt: skip
    ap.add_argument("--seed-per-round", action="store_true",
                    help="round i runs with seed=i (accuracy across seeds)")
    ap.add_argument("--seeds", type=int, nargs="+",
                    help="one round per seed, with that seed (overrides --repeats)")
    ap.add_argument("--timeout", type=float, default=1800, help="per run, seconds")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="overrides for every variant (e.g. train.prompts_per_step=8)")
    args = ap.parse_args(argv)
    seeds = args.seeds or [i if args.seed_per_round else None for i in range(args.repeats)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants}
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="grpoflow-overlap-") as tmp:
        for i, seed in enumerate(seeds):
            for name in args.variants:
                try:
                    r = run_variant(name, [*VARIANTS[name], *args.set], args.steps,
                                    args.eval_examples,
                                    Path(tmp), i, args.config, seed, args.timeout)
                except (subprocess.SubprocessError, OSError) as e:  # keep the other runs
                    failed.append({"variant": name, "round": i, "seed": seed, "error": str(e)})
                    print(f"round {i + 1} {name}: FAILED ({e})", flush=True)
                    continue
                runs[name].append(r)
                print(f"round {i + 1} {name:<8} {r['step_s_mean']:.2f} s/step, pass@1 "
                      f"{r['pass_at_1_first']:.3f}->{r['pass_at_1_last']:.3f} "
                      f"(load1 {r['load_avg_1m_start']:.2f})", flush=True)  # fmt: skip
    runs = {name: rs for name, rs in runs.items() if rs}
    results = {name: _summary(rs) for name, rs in runs.items()}
    print(f"{'variant':<14} {'step s':>8} {'samples/s':>9} {'speedup':>8} {'paired':>8} "
          f"{'rollout':>8} {'train':>8} {'wait':>6} {'pass@1':>14}")  # fmt: skip
    for name, r in results.items():
        ph = r["phases_s_mean"]
        sync = "sync_disagg" if name.endswith("_disagg") else "sync"  # same placement
        base = results.get(sync, {}).get("step_s_mean")
        speed = f"{base / r['step_s_mean']:.2f}x" if base else "-"
        paired = "-"
        if base and name != sync:
            ratios = [a["step_s_mean"] / b["step_s_mean"]
                      for a, b in zip(runs[sync], runs[name], strict=False)]  # fmt: skip
            r["speedup_paired_median"] = statistics.median(ratios)
            paired = f"{r['speedup_paired_median']:.2f}x"
        print(f"{name:<14} {r['step_s_mean']:>8.2f} {r['trained_samples_per_s']:>9.1f} "
              f"{speed:>8} {paired:>8} {ph['rollout']:>8.2f} {ph['train']:>8.2f} "
              f"{ph['overlap_wait']:>6.2f} "
              f"{r['pass_at_1_first']:.3f}->{r['pass_at_1_last']:.3f}")  # fmt: skip
    if args.repeats > 1:
        for name, rs in runs.items():
            accs = ", ".join(f"{r['pass_at_1_last']:.3f}" for r in rs)
            print(f"{name:<14} final pass@1 per round: {accs}")
    if modes := [name for name in results if name.startswith("stream_")]:
        print(f"{'pause mode':<16} {'step s':>7} {'re-prefill tok/step':>20} {'of generated':>13} "
              f"{'version spread':>15} {'token age':>10}")
        for name in modes:
            r = results[name]
            frac = r["reprefill_tokens_per_step"] / max(r["response_tokens_per_step"], 1e-9)
            print(f"{name:<16} {r['step_s_mean']:>7.2f} {r['reprefill_tokens_per_step']:>20.0f} "
                  f"{frac:>13.1%} {r['token_version_spread_mean']:>15.3f} "
                  f"{r['token_age_mean']:>10.3f}")
    if "dynamic" in results:
        d = results["dynamic"]
        print(f"dynamic sampling: {d['untrained_token_frac_mean']:.1%} of generated tokens kept "
              f"out of training, {d['rounds_mean']:.2f} rollout rounds per step")
    doc = {
        "benchmark": "overlap",
        "command": "python -m benchmarks.overlap " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "steps": args.steps,
        "repeats": len(seeds), "seeds": seeds,
        "load_avg_end": os.getloadavg(),
        "results": results,
        "runs": runs,
        "failed": failed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
