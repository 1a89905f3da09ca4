"""LoRA against full-weight training: trainer step time, memory, and what a weight sync moves.

For each model (``tiny``: the demo's architecture, 1.7M parameters; ``25m``: a 25.7M Qwen2,
both from :func:`benchmarks.rollout_throughput.build_model_dir`) and each mode (``full``;
``lora``: rank ``--rank``, alpha 2r, every attention and MLP projection; ``qlora``: the same
adapter on an NF4 base, bitsandbytes), a fresh process
builds :class:`~rl_core.training.torch_trainer.TorchTrainer` with KL on (full: a second,
frozen copy as the reference; LoRA: the base with the adapter disabled), runs ``--warmup``
untimed GRPO steps on one batch (:func:`benchmarks.train_throughput.make_batch`) and times
one ``train_step`` and one reference ``compute_logprobs``. Reported: trainable parameters,
the frozen base's bytes, the optimizer state and gradient bytes (counted from the tensors),
the process's peak RSS
(``ru_maxrss``: model, reference, optimizer, activations), and the bytes one weight sync
stages (``export_weights``). ``--repeats`` rounds run every (model, mode) in turn; times are
medians. Prints a table and writes JSON (default ``benchmarks/results/lora.json``). A
benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.lora`` (about 3 minutes on 2 idle cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS, ROOT, format_table, load1, run_meta, write_json
from benchmarks.rollout_throughput import MODEL_SIZES, build_model_dir
from benchmarks.train_throughput import make_batch

DEFAULT_OUT = RESULTS / "lora.json"
MODES = ("full", "lora", "qlora")


def _bytes(tensors: Any) -> int:  # noqa: ANN401
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def worker_main(args: argparse.Namespace) -> None:
    """``--worker MODE``: one measurement in this fresh process; JSON to ``--out``."""
    from rl_core.config import AlgorithmConfig, LoraConfig, TrainConfig
    from rl_core.training.torch_trainer import TorchTrainer

    torch.set_num_threads(args.threads)
    lora = LoraConfig() if args.worker == "full" else LoraConfig(
        rank=args.rank, alpha=2.0 * args.rank, quantize="nf4" if args.worker == "qlora" else None)
    train = TrainConfig(steps=1000, micro_batch_size=args.micro_batch, lora=lora)
    trainer = TorchTrainer(args.model_dir, train, AlgorithmConfig(kl_coef=0.001))
    batch = make_batch(MODEL_SIZES[args.model]["vocab_size"], args.batch, args.response_len, 0)
    batch.ref_logp = trainer.compute_logprobs(batch, reference=True)
    for _ in range(args.warmup):
        trainer.train_step(batch)
    t0 = time.perf_counter()
    trainer.compute_logprobs(batch, reference=True)
    ref_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train_step(batch)
    train_s = time.perf_counter() - t0
    state = [v for s in trainer.optimizer.state.values() for v in s.values()]
    trained = trainer._trained()
    record = {
        "parameters": sum(p.numel() for n, p in trainer.model.named_parameters()
                          if ".lora_" not in n),
        "trainable": sum(p.numel() for p in trained),
        "base_mb": _bytes(v for k, v in trainer.model.state_dict().items()
                          if ".lora_" not in k) / 2**20,
        "optimizer_state_mb": _bytes(state) / 2**20,
        "grad_mb": _bytes(p.grad for p in trained) / 2**20,
        "reference_copy_mb": _bytes(trainer.ref_model.parameters()) / 2**20
        if trainer.ref_model is not None else 0.0,
        "sync_mb": _bytes(trainer.export_weights().values()) / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_seconds": train_s, "reference_seconds": ref_s, "load1": load1(),
    }
    args.out.write_text(json.dumps(record))


def _worker(mode: str, model: str, model_dir: Path, args: argparse.Namespace,
            work: Path) -> dict[str, Any]:
    out = work / f"{mode}-{model}.json"
    argv = [sys.executable, "-m", "benchmarks.lora", "--worker", mode, "--out", str(out),
            "--model", model, "--model-dir", str(model_dir), "--threads", str(args.threads),
            "--batch", str(args.batch), "--response-len", str(args.response_len),
            "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
            "--rank", str(args.rank)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{mode} worker failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "25m"], choices=list(MODEL_SIZES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--worker", choices=MODES)
    ap.add_argument("--model", choices=list(MODEL_SIZES))
    ap.add_argument("--model-dir", type=Path)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    doc: dict[str, Any] = {**run_meta("benchmarks.lora", argv), "rank": args.rank,
                           "batch": args.batch, "response_len": args.response_len}
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-lora-") as tmp:
        work = Path(tmp)
        dirs = {m: build_model_dir(m, work / m)[0] for m in args.models}
        for _ in range(args.repeats):
            for model in args.models:
                for mode in MODES:
                    runs.setdefault(f"{model}/{mode}", []).append(
                        _worker(mode, model, dirs[model], args, work))
    results = {}
    for key, rs in runs.items():
        results[key] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    rows = []
    for key, r in results.items():
        model = key.split("/")[0]
        full = results[f"{model}/full"]
        rows.append([key, int(r["trainable"]), r["base_mb"], r["optimizer_state_mb"], r["grad_mb"],
                     r["reference_copy_mb"], r["peak_rss_mb"], r["sync_mb"], r["train_seconds"],
                     full["train_seconds"] / r["train_seconds"]])  # fmt: skip
    print(format_table(["model/mode", "trainable", "base MB", "optim MB", "grad MB", "ref copy MB",
                        "peak RSS MB", "sync MB", "train s", "speed vs full"], rows))
    doc.update(results=results, runs=runs)
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
