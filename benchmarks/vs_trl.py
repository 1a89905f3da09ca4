"""grpoflow against TRL's ``GRPOTrainer`` on the same work, side by side.

    .venv/bin/pip install -e ".[bench]"          # trl, in the optional extra
    .venv/bin/python -m benchmarks.vs_trl        # the whole comparison, ~19 min on 2 cores
    .venv/bin/python -m benchmarks.vs_trl --only accuracy   # or --only sweep: each half < 10 min
    .venv/bin/python -m benchmarks.vs_trl --quick  # 1M only, 30 steps, one seed (~2.5 min)

One Qwen2-architecture checkpoint and one dataset per size are built (grpoflow's embedded
model builder; the 1M model gets the demo's warm start), saved, and given to each system:

- ``trl``: TRL's ``GRPOTrainer`` as its docs set it up (HF ``generate`` for rollouts,
  ``GRPOConfig``'s default gradient checkpointing), in a process of its own; per-phase times
  from wrapping its own methods. ``trl_nockpt``: the same without gradient checkpointing
  (the same arithmetic as grpoflow, more memory).
- ``pipeline``: ``grpoflow train`` (Prefect, MLflow, checkpoint, export, registration), on
  the single-machine fast path (``rollout.engine: local``, ``rollout.weight_sync: shared``);
  ``pipeline_http`` is the same with the default HTTP engine process and disk sync.
- ``bare``: a loop of ``rl_core`` calls (rollout, reward, advantages, train, sync), no
  Prefect or MLflow, on the same fast path.

The work is the same on every side: checkpoint, prompts, 8 prompts x 8 samples a step,
``max_new_tokens``, temperature 1, beta 0 (no reference model), AdamW lr 1e-4 constant,
clip 0.2/0.28, token-mean loss (TRL's ``dapo``), grad clip 1, 2 torch threads, one
optimizer step per generation (so neither side needs old log-probs). Runs interleave
(TRL, grpoflow, ..., alternating the order each round) so that machine noise hits both.
Per step: generation, reward, old/ref log-probs, train (forward + backward + optimizer),
weight sync, and orchestration (the step's wall time minus those phases). Accuracy is
held-out greedy pass@1 on 300 problems, before and after, measured by the same evaluator for
every system. Peak memory is the largest resident set of the run's process tree (polled).

Internal worker mode (what each run executes): ``python -m benchmarks.vs_trl worker ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, format_table, run_meta, write_json

DEFAULT_OUT = RESULTS / "vs_trl.json"
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
CACHE = ROOT / ".cache" / "grpoflow"
PHASES = ("generate", "reward", "logprobs", "train", "sync", "orchestration")
SIZES: dict[str, list[str]] = {
    "1m": [],  # the demo's model: warm-started to ~30 % so that GRPO has room to improve
    "25m": ["model.tiny_hidden_size=512", "model.tiny_layers=8", "model.tiny_heads=8",
            "model.tiny_kv_heads=4", "model.tiny_intermediate_size=1408",
            "model.tiny_sft_steps=0", "model.name=grpoflow-25m"],
    "50m": ["model.tiny_hidden_size=768", "model.tiny_layers=8", "model.tiny_heads=12",
            "model.tiny_kv_heads=4", "model.tiny_intermediate_size=2048",
            "model.tiny_sft_steps=0", "model.name=grpoflow-50m"],
}  # fmt: skip
PROMPTS, GROUP, LR, THREADS = 8, 8, 1e-4, 2
FAST_PATH = ["rollout.engine=local", "rollout.weight_sync=shared"]


def same_work(size: str, steps: int, seed: int, max_new_tokens: int) -> list[str]:
    """The grpoflow overrides that state the shared settings (TRL's are in :func:`_trl`)."""
    return [
        *SIZES[size], f"seed={seed}", f"train.seed={seed}", f"train.steps={steps}",
        f"train.prompts_per_step={PROMPTS}", f"rollout.n_samples={GROUP}",
        f"rollout.max_new_tokens={max_new_tokens}", "rollout.temperature=1.0",
        "algorithm.kl_coef=0", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
        "algorithm.loss_agg=token-mean", "algorithm.advantage=grpo", f"train.lr={LR}",
        "train.lr_schedule=constant", f"train.num_threads={THREADS}",
        f"train.micro_batch_size={PROMPTS * GROUP}", "eval.every=0", "eval.num_examples=300",
        "eval.pass_k=1", "eval.pass_k_examples=0", "checkpoint.every=0",
    ]  # fmt: skip


# ------------------------------------------------------------------------------ workers


def _records(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _greedy_accuracy(model_dir: str, test: list[dict[str, str]], max_new_tokens: int) -> float:
    """Held-out greedy pass@1 with grpoflow's evaluator (the same for every system)."""
    from transformers import AutoTokenizer

    from rl_core.data.prompts import encode_prompts
    from rl_core.data.records import Record
    from rl_core.evaluation import evaluate
    from rl_core.rewards import RewardRunner
    from rl_core.rollout.inprocess import InProcessPlane

    tok = AutoTokenizer.from_pretrained(model_dir)
    records = [Record(**r) for r in test]
    plane = InProcessPlane(model_dir)
    runner = RewardRunner("gsm8k")
    try:
        return evaluate(plane, records, encode_prompts(tok, [r.question for r in records]),
                        runner, max_new_tokens=max_new_tokens, k=1).pass_at_1
    finally:
        plane.close()
        runner.close()


def _trl(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer on the saved model and data; per-step phases from its own methods."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_core.rewards.math import gsm8k_reward

    torch.set_num_threads(THREADS)
    data = Path(a.data)
    train = _records(data / "train.jsonl")
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                             "answer": r["answer"]} for r in train])

    def accuracy(completions: list, answer: list[str], **_: Any) -> list[float]:
        return [gsm8k_reward(c[0]["content"], x) for c, x in zip(completions, answer, strict=True)]

    out = Path(a.work)
    cfg = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, gradient_accumulation_steps=1, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        max_steps=a.steps, seed=a.seed, logging_steps=10, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, dataloader_num_workers=0,
        disable_tqdm=True, model_init_kwargs={"dtype": "float32"},
        # GRPOConfig's default is True (recompute activations in backward, less memory);
        # trl_nockpt turns it off so that both sides do the same arithmetic.
        gradient_checkpointing=a.system == "trl",
    )  # fmt: skip
    t_setup = time.perf_counter()
    trainer = GRPOTrainer(model=a.model, reward_funcs=accuracy, args=cfg, train_dataset=ds,
                          processing_class=tok)
    current: dict[str, float] = {}
    steps: list[dict[str, float]] = []

    def timed(name: str, fn: Any, only_no_grad: bool = False) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            if only_no_grad and torch.is_grad_enabled():
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0
        return run

    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs", trainer._get_per_token_logps_and_entropies, only_no_grad=True)
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)

    class Phases(TrainerCallback):
        last_end: float | None = None

        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            current.clear()
            current["t0"] = time.perf_counter()

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            end = time.perf_counter()
            start = self.last_end if self.last_end is not None else current["t0"]
            self.last_end = end
            gen, rew, lp = (current.get(k, 0.0) for k in ("generate", "reward", "logprobs"))
            prepare = current.get("prepare", 0.0)
            train = end - current["t0"] - prepare
            steps.append({"wall": end - start, "generate": gen, "reward": rew, "logprobs": lp,
                          "train": train, "sync": 0.0,
                          "orchestration": end - start - gen - rew - lp - train})

    trainer.add_callback(Phases())
    setup_s = time.perf_counter() - t_setup
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trainer.save_model(str(out / "model"))
    return {"steps": steps, "setup_s": setup_s, "train_s": train_s, "model_dir": str(out / "model")}


def _bare(a: argparse.Namespace) -> dict[str, Any]:
    """The step as plain ``rl_core`` calls on the fast path: no Prefect, no MLflow."""
    from rl_core.config import load_config
    from rl_core.data.records import Record
    from rl_core.data.sampler import PromptSampler
    from rl_core.engine.sampling import SamplingParams
    from rl_core.grpo import advantages_for, rollout_groups, score_samples
    from rl_core.planes import bring_up_planes, get_planes, tear_down
    from rl_core.types import Batch

    cfg = load_config(CONFIG, [*same_work(a.size, a.steps, a.seed, a.max_new_tokens), *FAST_PATH])
    data = Path(a.data)
    train = [Record(**r) for r in _records(data / "train.jsonl")]
    test = [Record(**r) for r in _records(data / "test.jsonl")]
    t_setup = time.perf_counter()
    handle = bring_up_planes(cfg, a.model, train, test, a.work)
    p = get_planes(handle)
    trainer, r = p.trainer, cfg.rollout
    sampler = PromptSampler(len(p.train_records), PROMPTS, a.seed)
    params = SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens)
    setup_s = time.perf_counter() - t_setup
    steps = []
    t_train = last = time.perf_counter()
    for step in range(1, a.steps + 1):
        idx = sampler.next_batch()
        t0 = time.perf_counter()
        samples = rollout_groups(p.rollout, [p.train_records[i] for i in idx],
                                 [p.train_prompts[i] for i in idx], n=GROUP, params=params,
                                 step=step, seed=a.seed)  # fmt: skip
        t1 = time.perf_counter()
        score_samples(samples, p.reward_runner, step=step)
        t2 = time.perf_counter()
        batch = Batch.from_samples(samples, advantages_for(samples, GROUP, "grpo"), p.pad_token_id)
        t3 = time.perf_counter()
        if trainer.needs_old_logp:
            batch.old_logp = trainer.compute_logprobs(batch)
        t4 = time.perf_counter()
        trainer.train_step(batch)
        t5 = time.perf_counter()
        p.sync_weights(step)
        end = time.perf_counter()
        phases = {"generate": t1 - t0, "reward": t2 - t1, "logprobs": t4 - t3,
                  "train": t5 - t4, "sync": end - t5}
        steps.append({"wall": end - last, **phases,
                      "orchestration": end - last - sum(phases.values())})
        last = end
    train_s = time.perf_counter() - t_train
    model_dir = Path(a.work) / "model"
    trainer.save_pretrained(model_dir)
    for f in Path(a.model).iterdir():  # the tokenizer and generation config travel along
        if f.is_file() and not (model_dir / f.name).exists():
            shutil.copy(f, model_dir / f.name)
    tear_down(handle)
    return {"steps": steps, "setup_s": setup_s, "train_s": train_s, "model_dir": str(model_dir)}


def _pipeline(a: argparse.Namespace) -> dict[str, Any]:
    """``grpoflow train`` as a user runs it; phases from its metrics.jsonl."""
    from benchmarks import run_grpoflow_train

    extra = FAST_PATH if a.system == "pipeline" else []
    run = run_grpoflow_train(
        [*same_work(a.size, a.steps, a.seed, a.max_new_tokens), f"model.path={a.model}",
         f"data.source={Path(a.data) / 'train.jsonl'}",
         f"data.eval_source={Path(a.data) / 'test.jsonl'}", *extra],
        run_name=f"{a.system}-{a.size}-{a.seed}", storage_root=Path(a.work),
        log_path=Path(a.work) / "train.log")  # fmt: skip
    steps = []
    walls = dict(run.step_walls())
    for m in run.metrics:
        if m["step"] not in walls:
            continue  # the first step has no previous line to measure its wall from
        phases = {"generate": m.get("time/rollout", 0.0), "reward": m.get("time/reward", 0.0),
                  "logprobs": m.get("time/logprobs", 0.0), "train": m.get("time/train", 0.0),
                  "sync": m.get("time/sync", 0.0)}
        wall = walls[m["step"]]
        steps.append({"wall": wall, **phases, "orchestration": wall - sum(phases.values())})
    s = run.summary
    return {"steps": steps, "model_dir": s.get("model_dir"),
            "acc_before": s.get("first_eval", {}).get("pass_at_1"),
            "acc_after": s.get("last_eval", {}).get("pass_at_1")}


def worker(a: argparse.Namespace) -> None:
    """One run of one system; writes its result to ``a.out``."""
    t0 = time.perf_counter()
    result = {"trl": _trl, "trl_nockpt": _trl, "bare": _bare}.get(a.system, _pipeline)(a)
    if a.eval and result.get("acc_after") is None:
        test = _records(Path(a.data) / "test.jsonl")
        t1 = time.perf_counter()
        result["acc_before"] = _greedy_accuracy(a.model, test, a.max_new_tokens)
        result["acc_after"] = _greedy_accuracy(result["model_dir"], test, a.max_new_tokens)
        result["eval_s"] = time.perf_counter() - t1
    result["worker_s"] = time.perf_counter() - t0
    Path(a.out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------- driver


def prepare(size: str, out: Path) -> tuple[str, Path]:
    """Build (or find) the size's checkpoint and write the dataset; (model dir, data dir)."""
    from rl_core.base_model import snapshot_model
    from rl_core.config import load_config
    from rl_core.data.synthetic import generate_splits

    cfg = load_config(CONFIG, SIZES[size])
    model = snapshot_model(cfg.model, cfg.data, CACHE).path
    d = cfg.data
    train, test = generate_splits(d.synthetic_train_size, d.synthetic_test_size, d.seed,
                                  **d.synthetic_knobs())
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, recs in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": r.id, "question": r.question, "answer": r.answer}) + "\n"
            for r in recs))
    return str(model), data


def run_one(system: str, size: str, model: str, data: Path, steps: int, seed: int,
            max_new_tokens: int, work: Path, evaluate: bool) -> dict[str, Any]:
    """One worker process; its result, whole-run wall time and peak tree RSS."""
    import psutil

    work.mkdir(parents=True, exist_ok=True)
    out = work / "result.json"
    argv = [sys.executable, "-m", "benchmarks.vs_trl", "worker", "--system", system,
            "--size", size, "--model", model, "--data", str(data), "--steps", str(steps),
            "--seed", str(seed), "--max-new-tokens", str(max_new_tokens), "--work", str(work),
            "--out", str(out), *(["--eval"] if evaluate else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with (work / "worker.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak = 0
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.2)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (work / "worker.log").read_text()[-3000:]
        raise RuntimeError(f"{system} run failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(out.read_text())
    if not evaluate:  # a pipeline run evaluates itself; only accuracy runs report it
        result.pop("acc_before", None)
        result.pop("acc_after", None)
    result.update(system=system, size=size, seed=seed, max_new_tokens=max_new_tokens,
                  steps_run=steps, whole_run_s=wall, peak_rss_mb=peak / 2**20)
    print(f"  {system:<13} {size:>4} L={max_new_tokens:<4} seed={seed} "
          f"whole run {wall:6.1f}s  step median {_median(result, 'wall'):.3f}s"
          + (f"  acc {result['acc_before']:.3f} -> {result['acc_after']:.3f}"
             if result.get("acc_after") is not None else ""), flush=True)
    return result


def _median(result: dict[str, Any], phase: str, skip: int = 1) -> float:
    values = [s[phase] for s in result["steps"][skip:]] or [s[phase] for s in result["steps"]]
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (size, length, system): median and spread (p10-p90) of each phase over every
    timed step of every round (each run's first step is warm-up and left out)."""
    rows = []
    keys = sorted({(r["size"], r["max_new_tokens"], r["system"]) for r in runs},
                  key=lambda k: (list(SIZES).index(k[0]), k[1], k[2]))
    for size, length, system in keys:
        mine = [r for r in runs if (r["size"], r["max_new_tokens"], r["system"]) ==
                (size, length, system)]
        steps = [s for r in mine for s in r["steps"][1:]]
        row: dict[str, Any] = {"size": size, "max_new_tokens": length, "system": system,
                               "steps": len(steps)}
        for phase in ("wall", *PHASES):
            vals = sorted(s[phase] for s in steps)
            row[phase] = statistics.median(vals)
            row[f"{phase}_p10"] = vals[int(0.1 * (len(vals) - 1))]
            row[f"{phase}_p90"] = vals[int(0.9 * (len(vals) - 1))]
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in mine)
        row["whole_run_s"] = statistics.median(r["whole_run_s"] for r in mine)
        accs = [(r["acc_before"], r["acc_after"]) for r in mine if r.get("acc_after") is not None]
        if accs:
            row["acc_before"] = statistics.fmean(a for a, _ in accs)
            row["acc_after"] = statistics.fmean(b for _, b in accs)
            row["acc_after_each"] = [b for _, b in accs]
        rows.append(row)
    for row in rows:
        for trl, key in (("trl", "vs_trl"), ("trl_nockpt", "vs_trl_nockpt")):
            ref = next((r for r in rows if (r["size"], r["max_new_tokens"], r["system"]) ==
                        (row["size"], row["max_new_tokens"], trl)), None)
            if ref is not None:
                row[f"step_{key}"] = row["wall"] / ref["wall"]
                row[f"whole_run_{key}"] = row["whole_run_s"] / ref["whole_run_s"]
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """grpoflow's median step as a multiple of TRL's, by model size, for each response
    length (the ratio's trend with scale), with the targets drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["max_new_tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.6), squeeze=False,
                             sharey=True)
    for ax, length in zip(axes[0], lengths, strict=True):
        for system in ("pipeline", "bare", "pipeline_http"):
            pts = sorted((list(SIZES).index(r["size"]), r["step_vs_trl"]) for r in rows
                         if r["system"] == system and r["max_new_tokens"] == length
                         and "step_vs_trl" in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.axhline(1.0, color="tab:red", lw=1, ls="--", label="TRL (1.0x; pipeline target)")
        ax.axhline(0.5, color="tab:gray", lw=1, ls=":", label="bare-loop target (0.5x)")
        ax.set_xticks(range(len(SIZES)), list(SIZES))
        ax.set_ylim(0, 1.2)
        ax.set_xlabel("model size")
        ax.set_ylabel("median step / TRL's")
        ax.set_title(f"max_new_tokens={length}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle("GRPO step vs TRL GRPOTrainer: 8 prompts x 8 samples, 2 CPU cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--system", required=True,
                   choices=("trl", "trl_nockpt", "bare", "pipeline", "pipeline_http"))
    w.add_argument("--size", default="1m", choices=list(SIZES))
    for name in ("--model", "--data", "--work", "--out"):
        w.add_argument(name, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-new-tokens", type=int, default=32)
    w.add_argument("--eval", action="store_true")
    parser.add_argument("--only", choices=("accuracy", "sweep"),
                        help="one half: accuracy + whole run at 1M (~8 min on 2 cores), or "
                             "the size x length sweep (~11 min); default both")
    parser.add_argument("--quick", action="store_true",
                        help="1M only: 30 steps, one seed; no size sweep")
    parser.add_argument("--seeds", type=int, default=3, help="accuracy runs at 1M (default 3)")
    parser.add_argument("--steps", type=int, default=100, help="steps of each accuracy run")
    parser.add_argument("--sweep-steps", type=int, default=3,
                        help="steps of each size-sweep run (the first is warm-up)")
    parser.add_argument("--sizes", default="1m,25m,50m")
    parser.add_argument("--lengths", default="32,128")
    parser.add_argument("--sweep-systems", default="trl,bare,pipeline")
    parser.add_argument("--pipeline-sizes", default="1m,25m",
                        help="sizes the sweep runs the full pipeline at (it adds ~30 s a run)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "vs_trl.png")
    a = parser.parse_args(argv)
    if a.cmd == "worker":
        return worker(a)
    if a.quick:
        a.seeds, a.steps, a.sizes = 1, 30, "1m"
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        root = Path(tmp)
        built = {}
        for size in a.sizes.split(","):
            built[size] = prepare(size, root / size)
        model, data = built["1m"] if "1m" in built else next(iter(built.values()))
        if a.only != "sweep":
            print(f"accuracy and whole-run: 1m, {a.steps} steps, {a.seeds} seed(s)", flush=True)
        for seed in range(a.seeds if a.only != "sweep" else 0):
            order = ["trl", "pipeline", "bare"] if seed == 0 else ["trl", "pipeline"]
            for system in order if seed % 2 == 0 else order[::-1]:
                runs.append(run_one(system, "1m", model, data, a.steps, seed, 32,
                                    root / f"acc-{system}-{seed}", evaluate=True))
        if not a.quick and a.only != "sweep":
            runs.append(run_one("pipeline_http", "1m", model, data, 20, 0, 32,
                                root / "acc-pipeline_http", evaluate=False))
        if a.only != "accuracy":
            print(f"size sweep: {a.sweep_steps} steps per run", flush=True)
        for size in a.sizes.split(",") if a.only != "accuracy" else []:
            for length in (int(x) for x in a.lengths.split(",")):
                if size == "1m" and length == 32 and a.only != "sweep":
                    continue  # measured above, over every accuracy step
                model, data = built[size]
                systems = [x for x in a.sweep_systems.split(",")
                           if x != "pipeline" or size in a.pipeline_sizes.split(",")]
                for i, system in enumerate(systems if length % 2 == 0 else systems[::-1]):
                    runs.append(run_one(system, size, model, data, a.sweep_steps, 0, length,
                                        root / f"{size}-{length}-{system}-{i}", evaluate=False))
    rows = summarize(runs)
    cols = ["size", "max_new_tokens", "system", "steps", "wall", *PHASES, "step_vs_trl",
            "step_vs_trl_nockpt",
            "whole_run_s", "whole_run_vs_trl", "peak_rss_mb", "acc_before", "acc_after"]
    print(format_table(cols, [[r.get(c, float("nan")) for c in cols] for r in rows]))
    meta = run_meta("benchmarks.vs_trl", argv if argv is not None else sys.argv[1:])
    meta["seconds"] = time.perf_counter() - started
    write_json(a.out, {"meta": meta, "rows": rows, "runs": runs})
    plot(rows, a.plot)
    print(f"wrote {a.out} and {a.plot} in {meta['seconds']:.0f}s")


if __name__ == "__main__":
    main()
