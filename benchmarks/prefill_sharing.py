"""Identical prompts prefilled once: a GRPO rollout batch with the engine's sharing on and off.

One batch as a GRPO step sends it: ``--prompts`` prompts x ``--samples`` samples each, all
submitted at once to :class:`rl_core.engine.core.EmbeddedEngine` (in this process), sampled
at temperature 1 with a seed per sample. ``shared`` is the engine as it is (each distinct
prompt, with its pictures, computed once per prefill: ``rl_core.engine.kv.shared_rows``);
``unshared`` replaces ``shared_rows`` by the identity, as the engine was before. Rounds
alternate the two, so load drifting over the run hits both; each figure is the median of
``--repeats`` timed rounds after one untimed one. Two models: the text demo's (a directory of
``embedded:tiny``, e.g. ``.cache/grpoflow/models/tiny-*``; 32 new tokens) and the tiny VLM
(``embedded:tiny-vlm``; the shapes task's pictures, 4 new tokens). Prints a table and writes
JSON (default ``benchmarks/results/prefill_sharing.json``)::

    python -m benchmarks.prefill_sharing --text DIR [--vlm DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "prefill_sharing.json"


def _prompts(kind: str, model_dir: str, n: int) -> tuple[list[list[int]], list[tuple[bytes, ...]]]:
    from transformers import AutoTokenizer

    from rl_core.data.prompts import encode_record_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    if kind == "text":
        from rl_core.data.synthetic import generate_splits

        records, _ = generate_splits(n, 1, 0, digits=(1, 1), steps=(1, 2))
        return encode_record_prompts(tok, records[:n]), [()] * n
    from rl_core.data.shapes import shape_splits
    from rl_core.models.vlm import vision_processor

    records, _ = shape_splits(n, 1, 0, size=56)
    return (encode_record_prompts(tok, records[:n], vision_processor(model_dir)),
            [r.images for r in records[:n]])


def _measure(kind: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    import rl_core.engine.kv as kv
    from rl_core.engine.core import EmbeddedEngine, GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    share = kv.shared_rows
    prompts, images = _prompts(kind, model_dir, args.prompts)
    new_tokens = 32 if kind == "text" else 4
    times: dict[str, list[float]] = {"shared": [], "unshared": []}
    with EmbeddedEngine(model_dir, max_running_requests=args.prompts * args.samples) as eng:
        pixels = [eng.images.processor.process(im) if im else None for im in images]

        def batch(seed: int) -> float:
            reqs = [GenerateRequest(f"{seed}-{i}-{j}", p, SamplingParams(
                temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                seed=seed * 100_000 + i * args.samples + j), images=pixels[i])
                for i, p in enumerate(prompts) for j in range(args.samples)]
            start = time.perf_counter()
            eng.generate_sync(reqs)
            return time.perf_counter() - start

        for r in range(args.repeats + 1):
            for mode in ("shared", "unshared") if r % 2 else ("unshared", "shared"):
                kv.shared_rows = share if mode == "shared" else (
                    lambda seqs, _images: (list(range(len(seqs))), list(range(len(seqs)))))
                try:
                    seconds = batch(r)
                finally:
                    kv.shared_rows = share
                if r:  # the first round warms up
                    times[mode].append(seconds)
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"model": kind, "model_dir": model_dir, "prompts": args.prompts,
            "samples": args.samples, "new_tokens": new_tokens, "seconds": times,
            "median_s": med, "speedup": med["unshared"] / med["shared"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", help="the demo model's directory (embedded:tiny)")
    p.add_argument("--vlm", help="the tiny VLM's directory (embedded:tiny-vlm)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not (args.text or args.vlm):
        p.error("give --text DIR and/or --vlm DIR")
    torch.set_num_threads(args.threads)
    results = [_measure(k, d, args) for k, d in (("text", args.text), ("vlm", args.vlm)) if d]
    report = {"load_avg": os.getloadavg(), "threads": args.threads, "results": results}
    print(f"{'model':6} {'unshared s':>11} {'shared s':>9} {'speedup':>8}")
    for r in results:
        print(f"{r['model']:6} {r['median_s']['unshared']:11.3f} {r['median_s']['shared']:9.3f} "
              f"{r['speedup']:7.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
