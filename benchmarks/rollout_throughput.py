"""Rollout throughput: the embedded engine against ``transformers`` ``generate``.

Both sides get the same randomly initialised Qwen2 model (loaded from the same directory),
the same prompts, the same batch size and the same sampling settings (pure temperature
sampling, no top-k / top-p, KV cache on), and generate exactly ``--max-new-tokens`` tokens
per prompt (EOS is ignored on both sides), so tokens/s compare like for like:

- ``hf_generate``: ``model.generate`` on left-padded batches of ``--batch`` prompts (its
  default ``DynamicCache``); ``hf_generate_static`` (``--backends ... hf_static``): the same
  with ``cache_implementation="static"``;
- ``engine``: :class:`rl_core.rollout.engine.EmbeddedEngine` in-process, every prompt
  submitted at once with ``max_running_requests = --batch``;
- ``engine_http`` (``--http``): the same engine behind the SGLang-protocol HTTP server, driven
  by :class:`rl_core.rollout.client.SyncSGLangClient` ``generate_groups``.

Warm-up runs are excluded; each figure is the median of ``--repeats`` timed runs. Prints a
table and writes JSON (default ``benchmarks/results/rollout_throughput.json``). Numbers are
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


def measure(runners: dict[str, Callable[[], int]], warmup: int, repeats: int) -> dict[str, Any]:
    """Time every runner (returns tokens generated) ``repeats`` times, round-robin.

    Each round runs every backend once, so a change in machine load hits all of them alike;
    ``warmup`` untimed runs of each come first.
    """
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            load = os.getloadavg()[0]
            c0, t0 = time.process_time(), time.perf_counter()
            tokens = fn()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            runs[name].append(
                {
                    "seconds": dt,
                    "cpu_seconds": cpu,  # all threads of this process; wall >> cpu: starved
                    "tokens": tokens,
                    "tokens_per_s": tokens / dt,
                    "load1": load,
                }
            )
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
    from rl_core.rollout.engine import GenerateRequest
    from rl_core.rollout.sampler import SamplingParams

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
    """``generate_groups`` (one HTTP request per sample) against the served engine."""
    from rl_core.rollout.client import SyncSGLangClient

    client = SyncSGLangClient(url)
    params = {
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": True,
    }
    seeds = [[args.seed + i] for i in range(len(prompts))]

    def run() -> int:
        res = client.generate_groups(prompts, 1, params, seeds, return_logprob=True)
        assert all(len(r.output_ids) == args.max_new_tokens for r in res)
        return sum(len(r.output_ids) for r in res)

    run.close = client.close  # type: ignore[attr-defined]
    return run


def bench_size(size: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from rl_core.rollout.engine import EmbeddedEngine

    model_dir, n_params = build_model_dir(size, workdir / size, seed=args.seed)
    vocab = MODEL_SIZES[size]["vocab_size"]
    prompts = make_prompts(args.prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.seed)
    result: dict[str, Any] = {
        "model": size,
        "parameters": n_params,
        "config": MODEL_SIZES[size],
        "prompt_tokens": sum(len(p) for p in prompts),
    }
    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"[{size}] {n_params / 1e6:.2f}M parameters; load1 {os.getloadavg()[0]:.2f}")

    runners: dict[str, Callable[[], int]] = {}
    if "hf" in args.backends:
        runners["hf_generate"] = hf_runner(model_dir, prompts, args)
    if "hf_static" in args.backends:
        runners["hf_generate_static"] = hf_runner(model_dir, prompts, args, cache="static")
    engine = server = client = None
    try:
        if {"engine", "http"} & set(args.backends):
            layout = {} if args.kv_layout == "auto" else {"kv_layout": args.kv_layout}
            engine = EmbeddedEngine(
                model_dir, max_running_requests=args.batch, num_threads=args.threads, **layout
            )
            result["engine_kv_layout"] = getattr(engine, "kv_layout", "padded (no kv_layout)")
        if "engine" in args.backends:
            runners["engine"] = engine_runner(engine, prompts, args)
        if "http" in args.backends:
            from rl_core.rollout.server import serve_in_thread

            server = serve_in_thread(engine)
            client = runners["engine_http"] = http_runner(server.url, prompts, args)
        result.update(measure(runners, args.warmup, args.repeats))
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        if engine is not None:
            engine.close()
    base = result.get("hf_generate")
    for key in ("hf_generate_static", "engine", "engine_http"):
        if base and key in result:
            m = result[key]
            m["ratio_vs_hf"] = m["tokens_per_s"] / base["tokens_per_s"]
            paired = [
                r["tokens_per_s"] / h["tokens_per_s"]
                for r, h in zip(m["runs"], base["runs"], strict=True)
            ]
            m["ratio_vs_hf_paired_median"] = statistics.median(paired)
    for key in runners:
        log(f"[{size}] {key} {result[key]['tokens_per_s']:.0f} tok/s")
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    """tok/s (median, min, max of the repeats) and the ratio to ``hf_generate``: of the
    medians, and the median of each round's ratio (robust to load drifting between rounds)."""
    head = f"{'model':<6} {'backend':<18} {'tok/s':>8} {'min':>8} {'max':>8} {'x hf':>6}"
    print(f"\n{head} {'x hf (paired)':>13}")
    for r in results:
        for key in ("hf_generate", "hf_generate_static", "engine", "engine_http"):
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
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.http and "http" not in args.backends:
        args.backends.append("http")
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
    from rl_core.rollout import engine as engine_module

    meta["engine_module"] = engine_module.__file__
    meta["git_head"] = _git("rev-parse", "HEAD")
    meta["git_dirty_files"] = _git("status", "--porcelain", "--", "rl_core", "benchmarks")
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
