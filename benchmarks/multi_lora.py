"""Several LoRA adapters per batch in the embedded engine: ``max_loras_per_batch`` 1 and N.

:class:`rl_core.engine.core.EmbeddedEngine` in this process serves ``--model-dir`` (default: the
demo model's directory, ``.cache/grpoflow/models/tiny-*``, built by ``embedded:tiny``) with
``--adapters`` random rank-``--rank`` adapters on every q/k/v/o and gate/up/down projection.
Each round submits ``--requests`` requests at once (a ``--prompt-len``-token prompt, ``--new``
new tokens, temperature 1, a seed each) and times the batch until all finish:

* ``one``: every request carries the same adapter (single-adapter use, as the RL loop);
* ``mixed``: request ``i`` carries adapter ``i mod --adapters`` (tenants sharing an engine);
* ``serial``: ``mixed``'s requests sent one adapter after another (as a service that runs one
  request at a time hands them to the engine).

for ``max_loras_per_batch`` 1 (merged, one adapter per batch) and ``--n`` (unmerged, per row).
Settings alternate within each round, so load drifting over the run hits all of them; each
figure is the median of ``--repeats`` timed rounds after one untimed one. Prints a table and
writes JSON (default ``benchmarks/results/multi_lora.json``). A benchmark, never a test::

    python -m benchmarks.multi_lora [--model-dir DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS, ROOT, format_table, run_meta, write_json

DEFAULT_OUT = RESULTS / "multi_lora.json"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(model: torch.nn.Module, rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith(TARGETS):
            key = f"base_model.model.{name}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.05
            out[f"{key}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.05
    return out


def _model_dir(arg: str | None) -> str:
    if arg:
        return arg
    found = sorted((ROOT / ".cache" / "grpoflow" / "models").glob("tiny-*"))
    if not found:
        raise SystemExit("no demo model: give --model-dir, or build it (grpoflow bootstrap-model)")
    return str(found[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from rl_core.engine.core import EmbeddedEngine, GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="max_loras_per_batch besides 1")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = run_meta("benchmarks.multi_lora", argv)
    model_dir = _model_dir(args.model_dir)
    engines = {n: EmbeddedEngine(model_dir, background=False, max_loras_per_batch=n)
               for n in (1, args.n)}
    names = [f"t{k}" for k in range(args.adapters)]
    config = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": list(TARGETS)}
    for eng in engines.values():
        for k, name in enumerate(names):
            eng.load_lora_adapter(name, tensors=_adapter(eng.model, args.rank, k), config=config)
    prompt = [(7 * j) % 50 + 10 for j in range(args.prompt_len)]

    def reqs(r: int, mixed: bool) -> list[GenerateRequest]:
        return [GenerateRequest(f"{r}-{i}", prompt, SamplingParams(
            temperature=1.0, max_new_tokens=args.new, ignore_eos=True, seed=r * 1000 + i),
            lora=names[i % len(names)] if mixed else names[0]) for i in range(args.requests)]

    def run(n: int, kind: str, r: int) -> float:
        eng = engines[n]
        start = time.perf_counter()
        if kind == "serial":
            for name in names:
                eng.generate_sync([q for q in reqs(r, True) if q.lora == name])
        else:
            eng.generate_sync(reqs(r, kind == "mixed"))
        return time.perf_counter() - start

    settings = [(n, kind) for kind in ("one", "mixed", "serial") for n in engines]
    times: dict[str, list[float]] = {f"{kind} N={n}": [] for n, kind in settings}
    for r in range(args.repeats + 1):
        for n, kind in settings if r % 2 else settings[::-1]:
            seconds = run(n, kind, r)
            if r:  # the first round warms up
                times[f"{kind} N={n}"].append(seconds)
    for eng in engines.values():
        eng.close()
    tokens = args.requests * args.new
    rows = [{"setting": k, "median_s": statistics.median(v), "seconds": v,
             "tokens_per_s": tokens / statistics.median(v)} for k, v in times.items()]
    print(format_table(["setting", "median s", "new tokens/s"],
                       [[r["setting"], round(r["median_s"], 3), round(r["tokens_per_s"])]
                        for r in rows]))
    doc = {"meta": meta, "settings": {k: str(v) for k, v in vars(args).items()},
           "model_dir": model_dir, "results": rows}
    write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
