"""Rollout throughput: the embedded engine against ``transformers`` ``generate``.

Both sides get the same randomly initialised Qwen2 model (loaded from the same directory),
the same prompts, the same batch size and the same sampling settings (pure temperature
sampling, no top-k / top-p, KV cache on), and generate exactly ``--max-new-tokens`` tokens
per prompt (EOS is ignored on both sides), so tokens/s compare like for like:

- ``hf_generate``: ``model.generate`` on left-padded batches of ``--batch`` prompts (its
  default ``DynamicCache``); ``hf_generate_static`` (``--backends ... hf_static``): the same
  with ``cache_implementation="static"``;
- ``engine``: :class:`rl_core.engine.core.EmbeddedEngine` in-process, every prompt
  submitted at once with ``max_running_requests = --batch``;
- ``engine_http`` (``--http``): the same engine behind the SGLang-protocol HTTP server
  (``python -m rl_core.engine.server``, a process of its own, as a training run starts it;
  with ``--in-process`` a server thread), driven by
  :class:`rl_core.rollout.client.SyncSGLangClient`: one concurrent ``/generate`` request
  per sample (``SGLangClient.generate``), each with its own ``sampling_seed``;
- ``engine_baseline`` / ``engine_http_baseline`` (``--baseline-tree PATH``): the ``engine``
  / ``http`` backend run from another checkout (e.g. ``git worktree add --detach /tmp/before
  HEAD`` before a change), in the same rounds, so a before/after ratio is not skewed by load
  drifting between two invocations.

Every measurement runs in a fresh process of its own (``--in-process`` runs all backends in
this one): torch's OpenMP pool belongs to the thread that first runs a parallel op, so two
backends in one process (``generate`` on the main thread, the engine on its scheduler
thread) leave two pools competing for the cores and slow both by a third on 2 cores, which
an engine in its own server process never sees. Each round runs every backend once, in
turn; each run loads the model, runs ``--warmup`` untimed passes and one timed pass. Each
figure is the median of ``--repeats`` rounds. Prints a table and writes JSON (default ``benchmarks/results/rollout_throughput.json``). Numbers are
only comparable on the same machine at the same load: the load average is recorded at the
start and around every measurement. A benchmark, never a test: it asserts nothing about time.

Run: ``.venv/bin/python -m benchmarks.rollout_throughput --model both``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "rollout_throughput.json"
PAD_ID, EOS_ID = 0, 1

# Qwen2 shapes. "tiny" is rl_core.models.tiny.TinyModelSpec's architecture; "25m" is a
# ~25.7M-parameter model with the same layout (GQA, tied embeddings, head_dim 64).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=384,
        max_position_embeddings=512,
    ),
    "25m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
}


def build_model_dir(size: str, path: Path, seed: int = 0) -> tuple[Path, int]:
    """Save a random-initialised Qwen2 of ``size`` (weights + generation_config) to ``path``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **MODEL_SIZES[size],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random length in [lo, hi] over ids 2..vocab-1 (no PAD, no EOS)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (k,), generator=g).tolist() for k in lengths]


def timed(fn: Callable[[], int]) -> dict[str, float]:
    """One timed call of a runner (it returns the tokens it generated)."""
    load = os.getloadavg()[0]
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": dt,
        "cpu_seconds": cpu,  # all threads of this process; wall >> cpu: starved
        "tokens": tokens,
        "tokens_per_s": tokens / dt,
        "load1": load,
    }


def measure(runners: dict[str, Callable[[], int]], warmup: int, repeats: int) -> dict[str, Any]:
    """In this process: time every runner ``repeats`` times, round-robin, after ``warmup``
    untimed runs of each."""
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            runs[name].append(timed(fn))
    return summarize(runs)


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Median, min and max tokens/s of each backend's runs (and the runs themselves)."""
    out = {}
    for name, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        out[name] = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "seconds_median": statistics.median(r["seconds"] for r in rs),
            "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in rs),
            "tokens": rs[0]["tokens"],
            "runs": rs,
        }
    return out


def hf_runner(
    model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, cache: str | None = None
) -> Callable:
    """``model.generate`` over left-padded batches: sampling, KV cache on, no early stop.

    ``cache=None`` is generate's default (a ``DynamicCache``); ``"static"`` preallocates.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # no early stop: exactly max_new_tokens

    batches = []
    for start in range(0, len(prompts), args.batch):
        chunk = prompts[start : start + args.batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        batches.append((ids, mask))
    sampling = (
        dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
        if args.temperature > 0
        else dict(do_sample=False)
    )

    def run() -> int:
        tokens = 0
        with torch.no_grad():
            for ids, mask in batches:
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=args.max_new_tokens,
                    pad_token_id=PAD_ID,
                    use_cache=True,
                    **({"cache_implementation": cache} if cache else {}),
                    **sampling,
                )
                new = out.shape[1] - ids.shape[1]
                assert new == args.max_new_tokens, f"generate stopped after {new} tokens"
                tokens += new * ids.shape[0]
        return tokens

    return run


def _engine_requests(prompts: list[list[int]], args: argparse.Namespace, tag: str) -> list:
    from rl_core.engine.core import GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    return [
        GenerateRequest(
            f"{tag}-{i}",
            p,
            SamplingParams(
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
                seed=args.seed + i,
            ),
        )
        for i, p in enumerate(prompts)
    ]


def engine_runner(engine: Any, prompts: list[list[int]], args: argparse.Namespace) -> Callable:
    """Every prompt submitted at once; the engine batches ``--batch`` at a time."""
    counter = iter(range(1 << 30))

    def run() -> int:
        outs = engine.generate_sync(_engine_requests(prompts, args, f"r{next(counter)}"))
        assert all(o.completion_tokens == args.max_new_tokens for o in outs)
        return sum(o.completion_tokens for o in outs)

    return run


def http_runner(url: str, prompts: list[list[int]], args: argparse.Namespace) -> Callable:
    """One concurrent HTTP request per sample against the served engine; each
    :class:`~rl_core.types.Sample` comes back with the engine's token ids and log-probs."""
    import asyncio

    from rl_core.rollout.client import SyncSGLangClient

    client = SyncSGLangClient(url)
    params = [
        {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
         "ignore_eos": True, "sampling_seed": args.seed + i}
        for i in range(len(prompts))
    ]  # fmt: skip

    async def generate_all() -> list[Any]:
        calls = [client.aio.generate(p, sp, return_logprob=True)
                 for p, sp in zip(prompts, params, strict=True)]  # fmt: skip
        return list(await asyncio.gather(*calls))

    def run() -> int:
        res = client.run(generate_all(), timeout_s=3600)
        assert all(len(r.completion_ids) == args.max_new_tokens for r in res)
        return sum(len(r.completion_ids) for r in res)

    run.close = client.close  # type: ignore[attr-defined]
    return run


BACKEND_NAMES = {
    "hf": "hf_generate",
    "hf_static": "hf_generate_static",
    "engine": "engine",
    "http": "engine_http",
    "engine_base": "engine_baseline",  # the engine from --baseline-tree
    "http_base": "engine_http_baseline",  # the HTTP engine from --baseline-tree
}


def bench_size(size: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model_dir, n_params = build_model_dir(size, workdir / size, seed=args.seed)
    vocab = MODEL_SIZES[size]["vocab_size"]
    prompts = make_prompts(args.prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.seed)
    result: dict[str, Any] = {
        "model": size,
        "parameters": n_params,
        "config": MODEL_SIZES[size],
        "prompt_tokens": sum(len(p) for p in prompts),
        "isolation": "in-process" if args.in_process else "a process per run",
    }
    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"[{size}] {n_params / 1e6:.2f}M parameters; load1 {os.getloadavg()[0]:.2f}")
    if args.in_process:
        result.update(_measure_in_process(model_dir, prompts, args, result))
    else:
        based = [f"{b}_base" for b in args.backends if b in ("engine", "http")]
        rounds = [*args.backends, *(based if args.baseline_tree else [])]
        runs: dict[str, list[dict[str, float]]] = {BACKEND_NAMES[b]: [] for b in rounds}
        for _ in range(args.repeats):
            for backend in rounds:
                record = _run_worker(backend, model_dir, size, args, workdir)
                result.setdefault("engine_kv_layout", record.get("engine_kv_layout"))
                runs[BACKEND_NAMES[backend]].append(record["run"])
        if result.get("engine_kv_layout") is None:
            result.pop("engine_kv_layout", None)
        result.update(summarize(runs))
    base = result.get("hf_generate")
    for key in ("hf_generate_static", "engine", "engine_http", "engine_baseline",
                "engine_http_baseline"):  # fmt: skip
        if base and key in result:
            m = result[key]
            m["ratio_vs_hf"] = m["tokens_per_s"] / base["tokens_per_s"]
            paired = [
                r["tokens_per_s"] / h["tokens_per_s"]
                for r, h in zip(m["runs"], base["runs"], strict=True)
            ]
            m["ratio_vs_hf_paired_median"] = statistics.median(paired)
    for key in ("engine", "engine_http"):
        if key not in result or f"{key}_baseline" not in result:
            continue
        new, old = result[key], result[f"{key}_baseline"]
        new["ratio_vs_baseline"] = new["tokens_per_s"] / old["tokens_per_s"]
        new["ratio_vs_baseline_paired_median"] = statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(new["runs"], old["runs"], strict=True)
        )
    for key in BACKEND_NAMES.values():
        if key in result:
            log(f"[{size}] {key} {result[key]['tokens_per_s']:.0f} tok/s")
    return result


def _run_worker(
    backend: str, model_dir: Path, size: str, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """One timed run of ``backend`` in a fresh interpreter (after its warm-up runs)."""
    import subprocess

    out = workdir / f"worker-{size}-{backend}.json"
    root = Path(__file__).resolve().parents[1]
    if backend.endswith("_base"):  # the same worker, from the baseline checkout
        backend, root = backend.removesuffix("_base"), args.baseline_tree.resolve()
    argv = [
        sys.executable, "-m", "benchmarks.rollout_throughput", "--worker", backend,
        "--model-dir", str(model_dir), "--model", size, "--out", str(out),
        "--batch", str(args.batch), "--prompts", str(args.prompts),
        "--max-new-tokens", str(args.max_new_tokens),
        "--min-prompt-len", str(args.min_prompt_len), "--max-prompt-len", str(args.max_prompt_len),
        "--temperature", str(args.temperature), "--threads", str(args.threads),
        "--warmup", str(args.warmup), "--seed", str(args.seed), "--kv-layout", args.kv_layout,
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(
            f"{backend} worker failed (rc={done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def worker_main(args: argparse.Namespace) -> None:
    """``--worker BACKEND``: warm up, time one run, write ``{"run": ..., ...}`` to --out."""
    size = args.model
    vocab = MODEL_SIZES[size]["vocab_size"]
    prompts = make_prompts(args.prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.seed)
    info: dict[str, Any] = {}
    if args.worker == "http":  # the server in a process of its own, as in a training run
        runners = {"engine_http": _server_process_runner(Path(args.model_dir), prompts, args, info)}
    else:
        runners = _runners(Path(args.model_dir), prompts, args, [args.worker], info)
    try:
        fn = runners[BACKEND_NAMES[args.worker]]
        for _ in range(args.warmup):
            fn()
        info["run"] = timed(fn)
    finally:
        _close_runners(info)
    info.pop("_closers", None)
    args.out.write_text(json.dumps(info) + "\n")


def _measure_in_process(
    model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, result: dict[str, Any]
) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        runners = _runners(model_dir, prompts, args, args.backends, info)
        out = measure(runners, args.warmup, args.repeats)
    finally:
        _close_runners(info)
    if "engine_kv_layout" in info:
        out["engine_kv_layout"] = info["engine_kv_layout"]
    return out


def _close_runners(info: dict[str, Any]) -> None:
    for close in reversed(info.get("_closers", [])):
        close()


def _runners(
    model_dir: Path,
    prompts: list[list[int]],
    args: argparse.Namespace,
    backends: list[str],
    info: dict[str, Any],
) -> dict[str, Callable[[], int]]:
    """The runners of ``backends``; what must be closed goes to ``info["_closers"]``."""
    from rl_core.engine.core import EmbeddedEngine

    closers = info.setdefault("_closers", [])
    runners: dict[str, Callable[[], int]] = {}
    if "hf" in backends:
        runners["hf_generate"] = hf_runner(model_dir, prompts, args)
    if "hf_static" in backends:
        runners["hf_generate_static"] = hf_runner(model_dir, prompts, args, cache="static")
    if {"engine", "http"} & set(backends):
        layout = {} if args.kv_layout == "auto" else {"kv_layout": args.kv_layout}
        engine = EmbeddedEngine(
            model_dir, max_running_requests=args.batch, num_threads=args.threads, **layout
        )
        closers.append(engine.close)
        info["engine_kv_layout"] = getattr(engine, "kv_layout", "padded (no kv_layout)")
        if "engine" in backends:
            runners["engine"] = engine_runner(engine, prompts, args)
        if "http" in backends:
            from rl_core.engine.server import serve_in_thread

            server = serve_in_thread(engine)
            closers.append(server.stop)
            client = runners["engine_http"] = http_runner(server.url, prompts, args)
            closers.append(client.close)  # type: ignore[attr-defined]
    return runners


def _server_process_runner(
    model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, info: dict[str, Any]
) -> Callable[[], int]:
    """``engine_http`` as the flow runs it: the engine server in its own process
    (``python -m rl_core.engine.server``), this process only the HTTP client."""
    from rl_core.rollout.launch import (
        free_port,
        start_process,
        stop_process,
        wait_healthy,
    )

    port = free_port()
    cmd = [
        sys.executable, "-m", "rl_core.engine.server", "--model", str(model_dir),
        "--port", str(port), "--max-running-requests", str(args.batch),
        "--num-threads", str(args.threads), "--kv-layout", args.kv_layout,
        "--log-level", "warning", "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    log_path = Path(args.out).with_suffix(".server.log")
    proc = start_process(cmd, log_path)
    info.setdefault("_closers", []).append(lambda: stop_process(proc, 10.0))
    wait_healthy(f"http://127.0.0.1:{port}", timeout_s=300, proc=proc, log_path=log_path)
    info["engine_kv_layout"] = args.kv_layout
    client = http_runner(f"http://127.0.0.1:{port}", prompts, args)
    info["_closers"].append(client.close)  # type: ignore[attr-defined]
    return client


def print_table(results: list[dict[str, Any]]) -> None:
    """tok/s (median, min, max of the repeats) and the ratio to ``hf_generate``: of the
    medians, and the median of each round's ratio (robust to load drifting between rounds)."""
    head = f"{'model':<6} {'backend':<18} {'tok/s':>8} {'min':>8} {'max':>8} {'x hf':>6}"
    print(f"\n{head} {'x hf (paired)':>13}")
    for r in results:
        for key in BACKEND_NAMES.values():
            if key not in r:
                continue
            m = r[key]
            ratio = f"{m['ratio_vs_hf']:.2f}" if "ratio_vs_hf" in m else "-"
            paired = f"{m['ratio_vs_hf_paired_median']:.2f}" if "ratio_vs_hf" in m else "-"
            print(
                f"{r['model']:<6} {key:<18} {m['tokens_per_s']:>8.0f} "
                f"{m['tokens_per_s_min']:>8.0f} {m['tokens_per_s_max']:>8.0f} {ratio:>6} "
                f"{paired:>13}"
            )
    for r in results:
        for key in ("engine", "engine_http"):
            m = r.get(key, {})
            if "ratio_vs_baseline" in m:
                print(
                    f"{r['model']:<6} {key} / {key}_baseline: {m['ratio_vs_baseline']:.2f} "
                    f"(paired {m['ratio_vs_baseline_paired_median']:.2f})"
                )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "25m", "both"], default="both")
    p.add_argument("--batch", type=int, default=32, help="generate batch = engine running cap")
    p.add_argument("--prompts", type=int, default=64, help="prompts per timed run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backends",
        nargs="+",
        choices=["hf", "hf_static", "engine", "http"],
        default=["hf", "engine"],
        help="what to measure: hf (generate, default cache), hf_static (generate with "
        "cache_implementation='static'), engine (in-process), http (engine over HTTP)",
    )
    p.add_argument("--http", action="store_true", help="shorthand: also measure 'http'")
    p.add_argument(
        "--kv-layout",
        choices=["auto", "slots", "padded"],
        default="auto",
        help="the engine's KV cache layout (padded: the model's own forward, as before)",
    )
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="another checkout whose engine is measured as 'engine_baseline' in the same "
        "rounds (before/after a change; not with --in-process)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every backend in this process (their OpenMP pools then compete: slower)",
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", choices=sorted(BACKEND_NAMES), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.http and "http" not in args.backends:
        args.backends.append("http")
    if args.baseline_tree is not None:
        if args.in_process:
            p.error("--baseline-tree runs the baseline in processes of its own: drop --in-process")
        if not (args.baseline_tree / "benchmarks" / "rollout_throughput.py").is_file():
            p.error(
                f"--baseline-tree {args.baseline_tree}: no benchmarks/rollout_throughput.py there"
            )
    return args


def _git(*cmd: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", *cmd], cwd=Path(__file__).resolve().parent, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker_main(args)
        return {}
    import transformers

    meta = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.rollout_throughput"])
        + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_at_start": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("quiet",)
        },
    }
    from rl_core.engine import core as engine_module

    meta["engine_module"] = engine_module.__file__
    meta["git_head"] = _git("rev-parse", "HEAD")
    meta["git_dirty_files"] = _git("status", "--porcelain", "--", "rl_core", "benchmarks")
    if args.baseline_tree is not None:
        meta["baseline_git_head"] = _git(
            "-C", str(args.baseline_tree.resolve()), "rev-parse", "HEAD"
        )
    sizes = ["tiny", "25m"] if args.model == "both" else [args.model]
    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-") as tmp:
        results = [bench_size(s, args, Path(tmp)) for s in sizes]
    meta["loadavg_at_end"] = os.getloadavg()
    report = {**meta, "results": results}
    print_table(results)
    print(
        f"threads={meta['threads']} torch={meta['torch']} "
        f"load1 start/end={meta['loadavg_at_start'][0]:.2f}/{meta['loadavg_at_end'][0]:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
