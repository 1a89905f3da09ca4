"""Orchestration overhead: the full pipeline against a bare loop doing the same steps.

Two ways to run the same GRPO steps (same config, seed, prompts, engine, trainer), each in a
fresh process, ``--repeats`` rounds in turn:

- ``pipeline``: ``grpoflow train`` as users run it (``grpoflow.cli.main`` in the worker
  process): the Prefect flow on Prefect's ephemeral API (a ``PREFECT_HOME`` of the
  benchmark's own), MLflow tracking into the run's SQLite store, the embedded engine
  process behind SGLang's HTTP API, the run directory's metrics, ledger and checkpoint;
- ``bare``: a plain Python loop over the ``rl_core`` functions the tasks call, with no
  Prefect and no MLflow: :func:`rl_core.planes.bring_up_planes` (the same HTTP engine and
  :class:`~rl_core.training.torch_trainer.TorchTrainer`), then per step
  ``rollout_groups`` -> ``score_samples`` -> ``advantages_for`` -> ``Batch.from_samples`` ->
  old/reference log-probs -> ``train_step`` -> ``Planes.sync_weights`` (the same verified
  :func:`~rl_core.weight_sync.sync_weights` to the same engine).

Per step (steps 2..N; step 1 pays warm-up) it takes the wall time between consecutive steps
and the phases each step times itself. Overhead = pipeline wall - bare wall, also as a share
of the pipeline's step. The goal of issue 10: at most 5 % of the step on the 25M-parameter
config and at most 50 ms per step.

The pipeline worker also profiles where its overhead goes, by wrapping (timers only) every
Prefect task's call and body (call - body = Prefect's machinery per task run), the MLflow
tracking in the step (``log_step``, which queues the step's metrics for the tracker's
sender thread, and the ``log-checkpoint`` task's body), and the bookkeeping of
:meth:`flows.run.Run.record_step` (the progress artifact update, the samples table rows, the
run directory writes and the console line), and by reading the CPU time each process and
each named Python thread used per step (the ephemeral Prefect API server is a process of its
own on these same cores).

Configs: ``tiny`` (``configs/tiny-cpu.yaml`` as it is: the 1.7M demo model, 32 prompts x 8)
and ``25m`` (the same with the embedded model built at hidden 512, 8 layers, 8/4 heads, MLP
1408: 23.8M parameters with the demo's 384-token vocabulary; random weights: its responses
run to ``max_new_tokens``; ``--prompts-25m`` prompts x 8 per step, 32 like the demo). Prints tables and writes
JSON (default ``benchmarks/results/orchestration.json``); the load average is recorded.
A benchmark, never a test.

With ``--before`` a third variant runs the pipeline as it was before the optimisations this
benchmark pointed at (:func:`as_before`), in the same rounds, for a before/after ratio.

Run: ``.venv/bin/python -m benchmarks.orchestration`` (about 8 minutes on 2 idle cores;
``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, format_table, load1, run_meta, write_json

DEFAULT_OUT = RESULTS / "orchestration.json"
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
PHASES = ("rollout", "reward", "logprobs", "train", "sync", "checkpoint")
MODEL_25M = [
    "model.tiny_hidden_size=512", "model.tiny_layers=8", "model.tiny_heads=8",
    "model.tiny_kv_heads=4", "model.tiny_intermediate_size=1408", "model.tiny_sft_steps=0",
    "model.name=grpoflow-25m",
]  # fmt: skip
# The tasks of the step loop (the rest run once per run: setup, evaluation, export). The
# step's metrics reach MLflow through ``log_step``, a plain function (profiled as
# "tracking"), not a task.
STEP_TASKS = {
    "rollout", "reward", "logprobs", "train", "sync-weights",
    "release-rollout-memory", "checkpoint", "log-checkpoint",
}  # fmt: skip
TRACKING_TASKS = {"log-checkpoint"}
VARIANTS = ("pipeline", "bare", "pipeline_before")


def overrides_for(size: str, steps: int, prompts_25m: int) -> list[str]:
    """The dotted overrides both variants run with."""
    common = [
        f"train.steps={steps}", "eval.every=0", "eval.num_examples=8",
        "eval.pass_k_examples=0", "checkpoint.every=0",
    ]  # fmt: skip
    if size == "25m":
        common += [*MODEL_25M, f"train.prompts_per_step={prompts_25m}"]
    return common


# --------------------------------------------------------------------- CPU accounting


class CpuProbe:
    """CPU seconds used since the last :meth:`sample`, by process kind and by Python thread
    name in this process (torch's OpenMP threads and the main thread are ``main+native``)."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.last: dict[str, float] | None = None

    def _now(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        names = {t.native_id: t.name for t in threading.enumerate()}
        main_id = threading.main_thread().native_id
        for t in self.me.threads():
            name = names.get(t.id, "main+native")
            if t.id == main_id:
                name = "main+native"
            out[f"thread:{_thread_kind(name)}"] += t.user_time + t.system_time
        for child in self.me.children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
                cpu = child.cpu_times()
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
            out[f"process:{_process_kind(cmd)}"] += cpu.user + cpu.system
        return out

    def sample(self) -> dict[str, float]:
        now = self._now()
        last, self.last = self.last, now
        if last is None:
            return {}
        return {k: now[k] - last.get(k, 0.0) for k in now}


def _thread_kind(name: str) -> str:
    for prefix in ("ThreadPoolExecutor", "Thread-", "AnyIO worker thread", "asyncio_"):
        if name.startswith(prefix):
            return prefix.rstrip("-_")
    return name


def _process_kind(cmd: str) -> str:
    if "prefect.server" in cmd or "prefect server" in cmd:
        return "prefect-api-server"
    if "rl_core.engine.server" in cmd:
        return "engine"
    if "mlflow" in cmd:
        return "mlflow"
    return "other"


# ------------------------------------------------------------------- pipeline worker


class Profile:
    """Timers around the pipeline's calls, each with its wall-clock start time."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.cpu: list[dict[str, Any]] = []
        self.local = threading.local()
        self.probe: CpuProbe | None = None

    def add(self, kind: str, name: str, start: float, seconds: float) -> None:
        self.events.append({"kind": kind, "name": name, "t": start, "s": seconds})

    def timed(self, kind: str, name: str, fn: Callable) -> Callable:
        import functools

        @functools.wraps(fn)
        def run(*a: Any, **k: Any) -> Any:
            t, t0 = time.time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(kind, name, t, time.perf_counter() - t0)

        return run


def _task_modules() -> list[Any]:
    """The modules holding the flow's Prefect tasks: ``tasks.*`` and every submodule of the
    ``tasks.tracking`` package."""
    import importlib
    import pkgutil

    import tasks.checkpoint
    import tasks.evaluate
    import tasks.setup
    import tasks.step
    import tasks.tracking

    tracking = [importlib.import_module(f"tasks.tracking.{m.name}")
                for m in pkgutil.iter_modules(tasks.tracking.__path__)]  # fmt: skip
    return [tasks.step, tasks.tracking, *tracking, tasks.checkpoint, tasks.setup, tasks.evaluate]


def install_profile(profile: Profile) -> None:
    """Wrap Prefect's task calls and bodies and the flow loop's own work in timers."""
    import prefect.tasks
    from prefect.tasks import Task

    import flows.run as fr
    from rl_core.rundir import RunDir

    call = Task.__call__

    def timed_call(self: Task, *a: Any, **k: Any) -> Any:
        t, t0 = time.time(), time.perf_counter()
        try:
            return call(self, *a, **k)
        finally:
            profile.add("task_call", self.name, t, time.perf_counter() - t0)

    prefect.tasks.Task.__call__ = timed_call  # type: ignore[method-assign]
    seen: set[int] = set()
    for module in _task_modules():
        for obj in vars(module).values():
            if isinstance(obj, Task) and id(obj) not in seen:
                seen.add(id(obj))
                obj.fn = profile.timed("task_body", obj.name, obj.fn)
    # Run.record_step's helpers, looked up in flows.run's namespace at each call.
    fr.update_progress_artifact = profile.timed("flow", "progress-artifact",
                                                fr.update_progress_artifact)  # fmt: skip
    fr.sample_rows = profile.timed("flow", "sample-rows", fr.sample_rows)
    fr.log_step = profile.timed("tracking", "log-step", fr.log_step)
    log_metrics, log_samples = RunDir.log_metrics, RunDir.log_samples

    def logged_metrics(self: RunDir, step: int, metrics: dict[str, Any]) -> None:
        if profile.probe is not None:  # CPU used by every process and thread since last step
            profile.cpu.append({"step": step, "t": time.time(), **profile.probe.sample()})
        t, t0 = time.time(), time.perf_counter()
        log_metrics(self, step, metrics)
        profile.add("flow", "rundir-metrics", t, time.perf_counter() - t0)

    RunDir.log_metrics = logged_metrics  # type: ignore[method-assign]
    RunDir.log_samples = profile.timed("flow", "rundir-ledger", log_samples)  # type: ignore[method-assign]
    fr.Run.say = profile.timed("flow", "console", fr.Run.say)  # type: ignore[method-assign]


def as_before() -> None:
    """The pipeline as it was before the orchestration optimisations of issue 10, restored
    from outside: the flow hands the step's samples and batches to its tasks unwrapped (Prefect
    walks every sample's token lists with ``visit_collection`` while resolving parameters and
    looking for upstream task inputs) and updates the progress artifact at every step.
    (The other two optimisations are not undone: the step's metrics leave through the
    tracker's background sender, and the checksum is XXH3; see docs/benchmarks.md.)"""
    import flows.grpo_train as gt
    import flows.run as fr
    import flows.schedule as ro

    gt.opaque = ro.opaque = lambda value: value
    fr._PROGRESS_EVERY_S = 0.0


def pipeline_worker(args: argparse.Namespace) -> dict[str, Any]:
    """``grpoflow train`` in this process, with the profile installed; its run and profile."""
    from grpoflow import cli

    cli._env_defaults()
    profile = Profile()
    install_profile(profile)
    if args.worker == "pipeline_before":
        as_before()
    profile.probe = CpuProbe()
    profile.probe.sample()
    work = Path(args.work)
    argv = ["train", str(CONFIG), "--quiet", "--no-resume", f"storage.root={work}",
            f"run_name={args.run_name}", *overrides_for(args.size, args.steps, args.prompts_25m)]  # fmt: skip
    t0 = time.perf_counter()
    rc = cli.main(argv)
    if rc:
        raise SystemExit(rc)
    return {"wall_s": time.perf_counter() - t0, "events": profile.events, "cpu": profile.cpu}


# ----------------------------------------------------------------------- bare worker


def bare_worker(args: argparse.Namespace) -> dict[str, Any]:
    """The same steps as plain calls into ``rl_core``: no Prefect, no MLflow."""
    from rl_core.base_model import snapshot_model
    from rl_core.config import load_config
    from rl_core.data.sampler import PromptSampler
    from rl_core.data.synthetic import generate_splits
    from rl_core.engine.sampling import SamplingParams
    from rl_core.grpo import advantages_for, rollout_groups, score_samples, summarize_samples
    from rl_core.planes import bring_up_planes, get_planes, tear_down
    from rl_core.types import Batch

    cfg = load_config(str(CONFIG), overrides_for(args.size, args.steps, args.prompts_25m))
    model_path = snapshot_model(cfg.model, cfg.data, cfg.storage.cache_dir).path
    d = cfg.data
    train, test = generate_splits(d.synthetic_train_size, d.synthetic_test_size, d.seed,
                                  **d.synthetic_knobs())  # fmt: skip
    train = train[: d.max_train_examples]
    work = Path(args.work) / args.run_name
    work.mkdir(parents=True, exist_ok=True)
    handle = bring_up_planes(cfg, model_path, train, test[: cfg.eval.num_examples], work)
    p = get_planes(handle)
    sampler = PromptSampler(len(p.train_records), cfg.train.prompts_per_step, cfg.seed)
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_new_tokens=r.max_new_tokens, stop=list(r.stop),
                            stop_token_ids=list(r.stop_token_ids))  # fmt: skip
    metrics_out = []
    t0 = time.perf_counter()
    try:
        for step in range(1, cfg.train.steps + 1):
            started = time.perf_counter()
            idx = sampler.next_batch()
            m: dict[str, Any] = {"step": step}
            t = time.perf_counter()
            samples = rollout_groups(p.rollout, [p.train_records[i] for i in idx],
                                     [p.train_prompts[i] for i in idx], n=r.n_samples,
                                     params=params, step=step, seed=cfg.seed)  # fmt: skip
            m["time/rollout"] = time.perf_counter() - t
            t = time.perf_counter()
            score_samples(samples, p.reward_runner)
            m.update(summarize_samples(samples, r.n_samples))
            m["time/reward"] = time.perf_counter() - t
            adv = advantages_for(samples, r.n_samples, cfg.algorithm.advantage)
            batch = Batch.from_samples(samples, adv, p.pad_token_id)
            t = time.perf_counter()
            if p.trainer.needs_old_logp:
                batch.old_logp = p.trainer.compute_logprobs(batch)
            if p.trainer.has_ref_model:
                batch.ref_logp = p.trainer.compute_logprobs(batch, reference=True)
            m["time/logprobs"] = time.perf_counter() - t
            t = time.perf_counter()
            m.update(p.trainer.train_step(batch))
            m["time/train"] = time.perf_counter() - t
            t = time.perf_counter()
            p.sync_weights(step)
            m["time/sync"] = time.perf_counter() - t
            m["time/step"] = time.perf_counter() - started
            m["time"] = time.time()
            metrics_out.append(m)
    finally:
        tear_down(handle)
    return {"wall_s": time.perf_counter() - t0, "metrics": metrics_out}


# ---------------------------------------------------------------------------- analysis


def step_rows(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Wall (time between consecutive steps) and phases of steps 2..N."""
    rows = []
    for prev, m in zip(metrics, metrics[1:], strict=False):
        phases = {p: float(m.get(f"time/{p}", 0.0)) for p in PHASES}
        rows.append({"step": m["step"], "t0": prev["time"], "t1": m["time"],
                     "wall": m["time"] - prev["time"], "in_step": m["time/step"], **phases})  # fmt: skip
    return rows


def attribute(rows: list[dict[str, Any]], events: list[dict[str, Any]],
              cpu: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Mean seconds per step (steps 2..N) of each profiled kind of work, and CPU seconds per
    step by process and thread."""
    n = len(rows)
    lo, hi = rows[0]["t0"], rows[-1]["t1"]
    inside = [e for e in events if lo <= e["t"] < hi]
    calls: dict[str, float] = defaultdict(float)
    bodies: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    flow: dict[str, float] = defaultdict(float)
    queued = 0.0  # log_step: the step's metrics and samples table onto the sender's queue
    for e in inside:
        if e["kind"] == "task_call":
            calls[e["name"]] += e["s"]
            counts[e["name"]] += 1
        elif e["kind"] == "task_body":
            bodies[e["name"]] += e["s"]
        elif e["kind"] == "tracking":
            queued += e["s"]
        else:
            flow[e["name"]] += e["s"]
    per_task = {
        name: {"calls_per_step": counts[name] / n, "call_ms": 1000 * calls[name] / counts[name],
               "body_ms": 1000 * bodies[name] / counts[name],
               "overhead_ms": 1000 * (calls[name] - bodies[name]) / counts[name]}
        for name in calls
    }  # fmt: skip
    step_names = [k for k in calls if k in STEP_TASKS]
    prefect_tasks = sum(calls[k] - bodies[k] for k in step_names) / n
    tracking = (queued + sum(bodies[k] for k in step_names if k in TRACKING_TASKS)) / n
    cpu_rows = [c for c in cpu if rows[0]["step"] <= c["step"] <= rows[-1]["step"]]
    cpu_mean: dict[str, float] = defaultdict(float)
    for c in cpu_rows:
        for k, v in c.items():
            if k not in ("step", "t"):
                cpu_mean[k] += v / max(len(cpu_rows), 1)
    return {
        "prefect_task_machinery_s": prefect_tasks,
        "mlflow_tracking_s": tracking,
        "flow_loop_s": {k: v / n for k, v in flow.items()},
        "tasks": per_task,
        "cpu_s_per_step": dict(sorted(cpu_mean.items(), key=lambda kv: -kv[1])),
    }


def summarize_variant(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs of the per-run means over steps 2..N."""
    means = []
    for run in runs:
        rows = run["rows"]
        means.append({k: statistics.fmean(r[k] for r in rows)
                      for k in ("wall", "in_step", *PHASES)})  # fmt: skip
    return {k: statistics.median(m[k] for m in means) for k in means[0]}


# ------------------------------------------------------------------------------ driver


def _run_worker(variant: str, size: str, args: argparse.Namespace, work: Path, i: int,
                prefect_home: Path) -> dict[str, Any]:  # fmt: skip
    out = work / f"{variant}-{size}-{i}.json"
    log = work / f"{variant}-{size}-{i}.log"
    argv = [sys.executable, "-m", "benchmarks.orchestration", "--worker", variant,
            "--size", size, "--steps", str(args.steps[size]),
            "--prompts-25m", str(args.prompts_25m), "--work", str(work),
            "--run-name", f"{variant}-{size}-{i}", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PREFECT_HOME": str(prefect_home)}
    load = load1()
    with log.open("w") as f:
        done = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=1800)  # fmt: skip
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{variant} {size} worker failed (rc={done.returncode}):\n"
                           f"{log.read_text()[-4000:]}")  # fmt: skip
    rec = json.loads(out.read_text())
    if variant != "bare":
        run_dir = work / f"{variant}-{size}-{i}"
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        rec["metrics"] = [json.loads(x) for x in lines if x.strip()]
    rec["rows"] = step_rows(rec["metrics"])
    rec["load1_start"], rec["load1_end"] = load, load1()
    if variant != "bare":
        rec["profile"] = attribute(rec["rows"], rec.pop("events"), rec.pop("cpu"))
    return rec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=["tiny", "25m"], default=["tiny", "25m"])
    p.add_argument("--steps-tiny", type=int, default=8)
    p.add_argument("--steps-25m", type=int, default=3)
    p.add_argument("--prompts-25m", type=int, default=32, help="train.prompts_per_step (x 8)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of tiny (fresh processes)")
    p.add_argument("--repeats-25m", type=int, default=1, help="rounds of 25m")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny only, 3 steps, 1 round")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--before", action="store_true",
                   help="also run the pipeline as it was before the orchestration "
                   "optimisations (see as_before), for a before/after ratio")  # fmt: skip
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--size", choices=["tiny", "25m"], help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--run-name", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps_tiny, args.repeats = ["tiny"], 3, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        fn = bare_worker if args.worker == "bare" else pipeline_worker
        rec = fn(args)
        args.out.write_text(json.dumps(rec, default=str))
        sys.stdout.flush()
        os._exit(0)  # engines and Prefect's workers are stopped; skip slow interpreter exit
    args.steps = {"tiny": args.steps_tiny, "25m": args.steps_25m}
    meta = run_meta("benchmarks.orchestration", argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-orchestration-") as tmp:
        work = Path(tmp)
        home = work / "prefect-home"
        home.mkdir()
        for size in args.sizes:
            variants = ["pipeline", "bare"] + (["pipeline_before"] if args.before else [])
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
            for i in range(args.repeats if size == "tiny" else args.repeats_25m):
                for variant in variants:
                    rec = _run_worker(variant, size, args, work, i, home)
                    runs[variant].append(rec)
                    w = statistics.fmean(r["wall"] for r in rec["rows"])
                    print(f"{size} round {i + 1} {variant:<8}: {w:.3f} s/step over steps "
                          f"2..{args.steps[size]} (load1 {rec['load1_start']:.2f})")  # fmt: skip
            pipe, bare = summarize_variant(runs["pipeline"]), summarize_variant(runs["bare"])
            paired = [statistics.fmean(r["wall"] for r in a["rows"])
                      - statistics.fmean(r["wall"] for r in b["rows"])
                      for a, b in zip(runs["pipeline"], runs["bare"], strict=True)]  # fmt: skip
            profiles = [r["profile"] for r in runs["pipeline"]]
            results[size] = {
                "overrides": overrides_for(size, args.steps[size], args.prompts_25m),
                "pipeline": pipe,
                "bare": bare,
                "overhead_s": pipe["wall"] - bare["wall"],
                "overhead_s_paired": paired,
                "overhead_share": (pipe["wall"] - bare["wall"]) / pipe["wall"],
                "ratio": pipe["wall"] / bare["wall"],
                "profiled": {
                    "prefect_task_machinery_s": statistics.median(
                        p["prefect_task_machinery_s"] for p in profiles),
                    "mlflow_tracking_s": statistics.median(p["mlflow_tracking_s"] for p in profiles),
                    "flow_loop_s": {k: statistics.median(p["flow_loop_s"].get(k, 0.0)
                                                         for p in profiles)
                                    for k in profiles[0]["flow_loop_s"]},
                },  # fmt: skip
                "runs": runs,
            }
            if "pipeline_before" in runs:
                before = summarize_variant(runs["pipeline_before"])
                results[size]["pipeline_before"] = before
                results[size]["overhead_s_before"] = before["wall"] - bare["wall"]
                results[size]["profiled_before"] = {
                    "prefect_task_machinery_s": statistics.median(
                        r["profile"]["prefect_task_machinery_s"] for r in runs["pipeline_before"])
                }  # fmt: skip
    print_report(results)
    doc = {**meta, "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}, "results": results}  # fmt: skip
    write_json(args.out, doc)
    return doc


def print_report(results: dict[str, Any]) -> None:
    rows = []
    for size, r in results.items():
        p, b = r["pipeline"], r["bare"]
        rows.append([size, p["wall"], b["wall"], 1000 * r["overhead_s"], f"{r['overhead_share']:.1%}",
                     r["ratio"], 1000 * (p["in_step"] - sum(p[k] for k in PHASES if k != "checkpoint")),
                     1000 * (b["in_step"] - sum(b[k] for k in PHASES if k != "checkpoint"))])  # fmt: skip
        if "pipeline_before" in r:
            o = r["pipeline_before"]
            rows.append([f"{size} (before)", o["wall"], b["wall"], 1000 * r["overhead_s_before"],
                         f"{r['overhead_s_before'] / o['wall']:.1%}", o["wall"] / b["wall"],
                         1000 * (o["in_step"] - sum(o[k] for k in PHASES if k != "checkpoint")),
                         1000 * (b["in_step"] - sum(b[k] for k in PHASES if k != "checkpoint"))])  # fmt: skip
    print()
    print(format_table(["config", "pipeline s/step", "bare s/step", "overhead ms", "share",
                        "ratio", "in-step ms (pipeline)", "in-step ms (bare)"], rows))  # fmt: skip
    for size, r in results.items():
        prof = r["profiled"]
        lines = [["Prefect task machinery (call - body, step tasks)",
                  1000 * prof["prefect_task_machinery_s"]],
                 ["MLflow (log_step, log-checkpoint body)", 1000 * prof["mlflow_tracking_s"]]]
        lines += [[f"flow loop: {k}", 1000 * v] for k, v in prof["flow_loop_s"].items()]
        print(f"\n{size}: profiled overhead per step (medians over the pipeline runs)")
        print(format_table(["what", "ms/step"], lines))
        for variant in ("pipeline", "pipeline_before"):
            if variant not in r["runs"]:
                continue
            run0 = r["runs"][variant][0]["profile"]
            tasks = [[k, v["calls_per_step"], v["call_ms"], v["body_ms"], v["overhead_ms"]]
                     for k, v in sorted(run0["tasks"].items(), key=lambda kv: -kv[1]["overhead_ms"])]
            print(f"{variant}, round 1: per task run")
            print(format_table(["task", "calls/step", "call ms", "body ms", "Prefect ms"], tasks))
        cpu0 = r["runs"]["pipeline"][0]["profile"]["cpu_s_per_step"]
        print("pipeline, round 1: CPU seconds per step, by process and by thread of the flow")
        print(format_table(["CPU seconds per step by", "s"], [[k, v] for k, v in cpu0.items()][:8]))


if __name__ == "__main__":
    main()
