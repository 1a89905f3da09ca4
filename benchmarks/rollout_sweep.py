"""Rollout throughput over batch size and response length: the embedded engine against
``transformers`` ``generate`` (issue 10, benchmark 1).

Two one-dimensional sweeps per model size, each point one round of
:mod:`benchmarks.rollout_throughput` (the same models, prompts, sampling settings and
process-per-run isolation; see its docstring for the method):

- batch: ``--batches`` (default 1, 8, 32, 128) at ``--base-len`` new tokens (64), with
  as many prompts as the batch (one batch of requests: the engine's running cap and
  ``generate``'s batch are the same number);
- response length: ``--lengths`` (default 16, 64, 256, 512) at ``--base-batch`` (32);
  a length that does not fit the model's context with the prompts (the tiny model has 512
  positions) is skipped.

A full grid (4 x 4 x 2 sizes x 2 backends, each a fresh process) does not fit the
10-minute budget on 2 cores; the two sweeps cross at (``--base-batch``, ``--base-len``),
which is measured once and reported in both.
One round per point by default (``--repeats``): points of a sweep share the machine's load,
and the JSON records the load average around every run. Prints a table and writes JSON
(default ``benchmarks/results/rollout_sweep.json``). A benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.rollout_sweep`` (about 9 minutes on 2 idle cores;
``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, format_table, load1, run_meta, write_json
from benchmarks.rollout_throughput import MODEL_SIZES

MAX_PROMPT_LEN = 48  # rollout_throughput's default --max-prompt-len
DEFAULT_OUT = RESULTS / "rollout_sweep.json"


def point(model: str, batch: int, length: int, args: argparse.Namespace, tmp: Path) -> dict:
    """One (model, batch, length) point: ``generate`` and the engine, a process each."""
    from benchmarks import rollout_throughput

    out = tmp / f"{model}-b{batch}-l{length}.json"
    rollout_throughput.main([
        "--model", model, "--batch", str(batch), "--prompts", str(batch),
        "--max-new-tokens", str(length), "--repeats", str(args.repeats), "--warmup", "1",
        "--backends", "hf", "engine", "--out", str(out), "--quiet",
    ])  # fmt: skip
    r = json.loads(out.read_text())["results"][0]
    return {
        "model": model,
        "batch": batch,
        "max_new_tokens": length,
        "hf_tok_s": r["hf_generate"]["tokens_per_s"],
        "engine_tok_s": r["engine"]["tokens_per_s"],
        "ratio": r["engine"]["ratio_vs_hf"],
        "load1": load1(),
        "raw": r,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["tiny", "25m"], default=["tiny", "25m"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256, 512])
    p.add_argument("--base-batch", type=int, default=32, help="batch of the length sweep")
    p.add_argument("--base-len", type=int, default=64, help="max_new_tokens of the batch sweep")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, 2 points each")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.lengths = ["tiny"], [1, 8], [16, 32]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    meta = run_meta("benchmarks.rollout_sweep", argv)
    points: list[dict[str, Any]] = []
    done: dict[tuple[str, int, int], dict[str, Any]] = {}  # the crossing point runs once

    def measure(model: str, batch: int, length: int, tmp: Path) -> dict[str, Any]:
        key = (model, batch, length)
        if key not in done:
            done[key] = point(model, batch, length, args, tmp)
            print(_line(done[key]), flush=True)
        return done[key]

    with tempfile.TemporaryDirectory(prefix="grpoflow-sweep-") as tmp:
        for model in args.models:
            for batch in args.batches:
                points.append({"sweep": "batch", **measure(model, batch, args.base_len,
                                                          Path(tmp))})  # fmt: skip
            context = MODEL_SIZES[model]["max_position_embeddings"]
            for length in args.lengths:
                if length + MAX_PROMPT_LEN > context:
                    print(f"{model}: {length} new tokens + prompts of up to {MAX_PROMPT_LEN} "
                          f"exceed its {context}-token context: skipped")  # fmt: skip
                    continue
                points.append({"sweep": "length", **measure(model, args.base_batch, length,
                                                           Path(tmp))})  # fmt: skip
    rows = [[p["model"], p["sweep"], p["batch"], p["max_new_tokens"], p["hf_tok_s"],
             p["engine_tok_s"], p["ratio"], p["load1"]] for p in points]  # fmt: skip
    print()
    print(format_table(["model", "sweep", "batch", "new tokens", "generate tok/s",
                        "engine tok/s", "x generate", "load1"], rows))  # fmt: skip
    doc = {**meta, "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}, "points": points}  # fmt: skip
    write_json(args.out, doc)
    return doc


def _line(p: dict[str, Any]) -> str:
    return (f"{p['model']} batch {p['batch']:>3} x {p['max_new_tokens']:>3} tokens: generate "
            f"{p['hf_tok_s']:8.0f} tok/s, engine {p['engine_tok_s']:8.0f} tok/s "
            f"({p['ratio']:.2f}x; load1 {p['load1']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
