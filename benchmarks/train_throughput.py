"""Training throughput and MFU of the torch and megatron backends on this machine.

For each model (``tiny``: the demo model's architecture, 1.7M parameters; ``25m``: a
25.7M-parameter Qwen2; both built by :func:`benchmarks.rollout_throughput.build_model_dir`)
and each backend (``torch``: :class:`rl_core.training.torch_trainer.TorchTrainer`;
``megatron``: :class:`rl_core.training.megatron.MegatronTrainer` as one rank in-process,
what ``train.backend=megatron`` runs in ``cluster.mode: local``), one GRPO batch of
``--batch`` sequences (prompts of 16-48 random tokens, ``--response-len`` response tokens
each, random advantages) is timed through

- ``train_step``: one optimizer step (forward, GRPO loss, backward, AdamW) over micro-
  batches of ``--micro-batch``: about ``6 N`` FLOPs per token;
- ``compute_logprobs``: the forward pass the old/reference log-probs take: ``2 N``.

Reported: tokens/s (every real token of the sequences, prompt and response: the forward and
backward pass process them all), response tokens/s (what ``train_tokens_per_s`` in a run's
metrics counts), and MFU = ``6 N tokens / seconds / peak`` (``2 N`` for the forward),
where ``N`` counts every parameter once (the tied LM head's matmul is the embedding's
``V x d``) and the attention score FLOPs are left out, as the usual estimate does. The peak
is measured here, not taken from a data sheet: the best of several ``--peak-n`` square fp32
matmuls (``2 n^3`` FLOPs) with the same thread count, in a process of its own.

Every measurement runs in a fresh process (model load, ``--warmup`` untimed steps, one
timed step); ``--repeats`` rounds run every (model, backend) in turn, and each figure is the
median of the rounds. The 1-minute load average is recorded around every measurement.
Prints a table and writes JSON (default ``benchmarks/results/train_throughput.json``).
A benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.train_throughput`` (about 5 minutes on 2 idle cores;
``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS, ROOT, format_table, load1, run_meta, write_json
from benchmarks.rollout_throughput import MODEL_SIZES, build_model_dir, make_prompts

DEFAULT_OUT = RESULTS / "train_throughput.json"
BACKENDS = ("torch", "megatron")


# ----------------------------------------------------------------------------- pieces


def make_batch(
    vocab: int, batch: int, response_len: int, seed: int, pad_id: int = 0
) -> Any:  # noqa: ANN401 - a rl_core.types.Batch
    """A GRPO batch as the rollout would hand it over: one :class:`~rl_core.types.Sample` per
    sequence (a prompt of 16-48 random tokens, ``response_len`` response tokens, rollout
    log-probs), laid out by :meth:`~rl_core.types.Batch.from_samples` with random advantages."""
    from rl_core.types import Batch, Sample

    g = torch.Generator().manual_seed(seed + 1)
    prompts = make_prompts(batch, 16, 48, vocab, seed)
    responses = [torch.randint(2, vocab, (response_len,), generator=g).tolist() for _ in prompts]
    logps = [(-torch.rand(response_len, generator=g) * 5).tolist() for _ in prompts]
    adv = torch.randn(batch, generator=g)
    samples = [Sample(p, r, lp) for p, r, lp in zip(prompts, responses, logps, strict=True)]
    return Batch.from_samples(samples, adv, pad_id)


def batch_tokens(batch: Any, micro: int) -> dict[str, int]:  # noqa: ANN401
    """Real tokens, response tokens, and the tokens the forward passes actually process
    (each micro-batch is trimmed to its longest row: the rest is padding)."""
    real = int(batch.attention_mask.sum())
    processed = 0
    for rows in torch.arange(batch.size).split(micro):
        width = int(batch.attention_mask[rows].sum(-1).max())
        processed += len(rows) * width
    return {"tokens": real, "response_tokens": int(batch.response_mask.sum()),
            "processed_tokens": processed}  # fmt: skip


def make_trainer(backend: str, model_dir: Path, micro: int, seed: int) -> Any:  # noqa: ANN401
    """The backend's trainer on ``model_dir`` as a run would configure it (no KL: no
    reference model; the forward timing stands for the reference pass too)."""
    from rl_core.config import AlgorithmConfig, TrainConfig

    train = TrainConfig(backend=backend, steps=1000, micro_batch_size=micro, seed=seed)
    algo = AlgorithmConfig(kl_coef=0.0, clip_high=0.28)
    if backend == "megatron":
        from rl_core.training.megatron import MegatronTrainer

        return MegatronTrainer(model_dir, train, algo, max_response_len=None)
    from rl_core.training.torch_trainer import TorchTrainer

    return TorchTrainer(model_dir, train, algo)


def measure_peak(n: int, repeats: int = 5) -> dict[str, float]:
    """The best fp32 FLOP/s of an ``n x n`` matmul on this thread count (after a warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n**3
    return {"n": n, "flops": flops, "seconds_best": min(times),
            "seconds_median": statistics.median(times),
            "peak_flops": flops / min(times), "median_flops": flops / statistics.median(times)}  # fmt: skip


# ----------------------------------------------------------------------------- worker


def worker_main(args: argparse.Namespace) -> None:
    """``--worker KIND``: one measurement in this fresh process; JSON to ``--out``."""
    torch.set_num_threads(args.threads)
    if args.worker == "peak":
        record = {"peak": measure_peak(args.peak_n), "load1": load1()}
        args.out.write_text(json.dumps(record))
        return
    model_dir = Path(args.model_dir)
    n_params = int(json.loads((model_dir / "params.json").read_text())["parameters"])
    trainer = make_trainer(args.worker, model_dir, args.micro_batch, args.seed)
    batch = make_batch(MODEL_SIZES[args.model]["vocab_size"], args.batch, args.response_len,
                       args.seed)  # fmt: skip
    for _ in range(args.warmup):
        trainer.train_step(batch)
    record: dict[str, Any] = {"parameters": n_params, **batch_tokens(batch, args.micro_batch)}
    load = load1()
    c0, t0 = time.process_time(), time.perf_counter()
    trainer.compute_logprobs(batch)
    record["forward"] = {"seconds": time.perf_counter() - t0,
                         "cpu_seconds": time.process_time() - c0, "load1": load}  # fmt: skip
    load = load1()
    c0, t0 = time.process_time(), time.perf_counter()
    metrics = trainer.train_step(batch)
    record["train"] = {"seconds": time.perf_counter() - t0,
                       "cpu_seconds": time.process_time() - c0, "load1": load,
                       "loss": float(metrics.get("loss", float("nan")))}  # fmt: skip
    record["threads"] = torch.get_num_threads()
    args.out.write_text(json.dumps(record))
    os._exit(0)  # megatron's process groups and threads: nothing left to tear down


def _worker(kind: str, args: argparse.Namespace, work: Path, model: str | None = None,
            model_dir: Path | None = None) -> dict[str, Any]:  # fmt: skip
    out = work / f"worker-{kind}-{model}.json"
    out.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "benchmarks.train_throughput", "--worker", kind, "--out", str(out),
        "--threads", str(args.threads), "--batch", str(args.batch),
        "--response-len", str(args.response_len), "--micro-batch", str(args.micro_batch),
        "--warmup", str(args.warmup), "--seed", str(args.seed), "--peak-n", str(args.peak_n),
    ]  # fmt: skip
    if model is not None:
        argv += ["--model", model, "--model-dir", str(model_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{kind} worker failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- driver


def summarize(runs: list[dict[str, Any]], peak: float) -> dict[str, Any]:
    """Medians over the rounds of one (model, backend): seconds, tokens/s, MFU."""
    first = runs[0]
    n, tokens, resp = first["parameters"], first["tokens"], first["response_tokens"]
    train_s = statistics.median(r["train"]["seconds"] for r in runs)
    fwd_s = statistics.median(r["forward"]["seconds"] for r in runs)
    return {
        "parameters": n,
        "tokens": tokens,
        "response_tokens": resp,
        "processed_tokens": first["processed_tokens"],
        "train_seconds": train_s,
        "train_seconds_min": min(r["train"]["seconds"] for r in runs),
        "train_seconds_max": max(r["train"]["seconds"] for r in runs),
        "train_tokens_per_s": tokens / train_s,
        "train_response_tokens_per_s": resp / train_s,
        "train_mfu": 6.0 * n * tokens / train_s / peak,
        "forward_seconds": fwd_s,
        "forward_tokens_per_s": tokens / fwd_s,
        "forward_mfu": 2.0 * n * tokens / fwd_s / peak,
        "runs": runs,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "25m", "both"], default="both")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--batch", type=int, default=32, help="sequences per GRPO batch")
    p.add_argument("--response-len", type=int, default=32, help="response tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=32, help="train.micro_batch_size")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3, help="rounds (a fresh process each)")
    p.add_argument("--warmup", type=int, default=1, help="untimed train steps per process")
    p.add_argument("--peak-n", type=int, default=4096, help="size of the peak-FLOP/s matmul")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one round, batch 8, responses of 16 tokens")  # fmt: skip
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--worker", choices=["peak", *BACKENDS], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.batch, args.response_len, args.peak_n = 1, 8, 16, 2048
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.worker:
        worker_main(args)
        return {}
    torch.set_num_threads(args.threads)
    meta = run_meta("benchmarks.train_throughput", argv)
    meta["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    sizes = ["tiny", "25m"] if args.model == "both" else [args.model]
    peaks: list[dict[str, Any]] = []
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {
        (s, b): [] for s in sizes for b in args.backends
    }
    print(f"load1 at start {load1():.2f}")
    with tempfile.TemporaryDirectory(prefix="grpoflow-train-bench-") as tmp:
        work = Path(tmp)
        dirs = {}
        for size in sizes:
            d, n = build_model_dir(size, work / size, seed=args.seed)
            (d / "params.json").write_text(json.dumps({"parameters": n}))
            dirs[size] = d
        for r in range(args.repeats):
            peaks.append(_worker("peak", args, work))
            print(f"round {r + 1}: peak {peaks[-1]['peak']['peak_flops'] / 1e9:.1f} GFLOP/s "
                  f"(load1 {peaks[-1]['load1']:.2f})")  # fmt: skip
            for size in sizes:
                for backend in args.backends:
                    rec = _worker(backend, args, work, size, dirs[size])
                    runs[(size, backend)].append(rec)
                    print(f"round {r + 1}: {size:<4} {backend:<8} train {rec['train']['seconds']:.2f}s "
                          f"forward {rec['forward']['seconds']:.2f}s (load1 {rec['train']['load1']:.2f})")  # fmt: skip
    peak = statistics.median(p["peak"]["peak_flops"] for p in peaks)
    results = [
        {"model": s, "backend": b, **summarize(rs, peak)} for (s, b), rs in runs.items()
    ]
    rows = [
        [r["model"], f"{r['parameters'] / 1e6:.2f}M", r["backend"], r["train_seconds"],
         r["train_tokens_per_s"], r["train_response_tokens_per_s"], f"{r['train_mfu']:.1%}",
         r["forward_tokens_per_s"], f"{r['forward_mfu']:.1%}"]
        for r in results
    ]  # fmt: skip
    print()
    print(format_table(
        ["model", "params", "backend", "train step s", "train tok/s", "resp tok/s", "train MFU",
         "fwd tok/s", "fwd MFU"], rows))  # fmt: skip
    print(f"peak (measured, {args.peak_n}^2 fp32 matmul, {args.threads} threads): "
          f"{peak / 1e9:.1f} GFLOP/s; batch {args.batch} x ({results[0]['tokens'] / args.batch:.0f} "
          f"tokens, {args.response_len} of them response); load1 {load1():.2f}")  # fmt: skip
    report = {**meta, "peak_flops": peak, "peaks": peaks, "results": results}
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
