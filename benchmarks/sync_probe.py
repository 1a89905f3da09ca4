"""The cost of the weight sync's behavioural probe against the sync's own time.

On the demo's model (configs/tiny-cpu.yaml, built in the cache on first use) a torch trainer
syncs to the rollout plane through the transports the demo and the HTTP plane use: ``shared``
(the in-process engine reads the trainer's parameters: a sync is a version bump) and
``disk`` (one embedded engine process; safetensors, reload, checksum). Each sync is timed
with and without the probe, interleaved, after a fixed change of the weights; the probe's
share is its median time over the median sync without it. Prints a table and writes JSON
(default ``benchmarks/results/sync_probe.json``)::

    python -m benchmarks.sync_probe [--syncs 10] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _planes(kind: str, model: Path, tmp: Path, trainer: object) -> tuple[object, object]:
    from rl_core.rollout.http import HttpPlane
    from rl_core.rollout.inprocess import InProcessPlane
    from rl_core.rollout.launch import embedded_engine_command
    from rl_core.rollout.pool import EnginePool
    from rl_core.weight_sync.transports import DiskSync, SharedSync

    if kind == "shared":
        plane = InProcessPlane(model, share=trainer.model, num_threads=1)  # type: ignore[attr-defined]
        return plane, SharedSync(trainer)
    pool = EnginePool(embedded_engine_command(model, num_threads=1), 1, log_dir=tmp / "engines",
                      router=False, startup_timeout_s=300)
    plane = HttpPlane(pool, weight_sync_timeout_s=300)
    sync = DiskSync(plane, tmp / "staging", 300)
    pool.resync = sync.resync
    return plane.start(), sync


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=10, help="syncs per transport and arm")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "grpoflow-bench")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sync_probe.json")
    args = ap.parse_args(argv)

    from rl_core.base_model import snapshot_model
    from rl_core.config import AlgorithmConfig, TrainConfig, load_config
    from rl_core.data.prompts import encode_prompts
    from rl_core.data.synthetic import generate_arithmetic
    from rl_core.training.torch_trainer import TorchTrainer
    from rl_core.weight_sync import sync_weights
    from rl_core.weight_sync.probe import TOLERANCE, ProbeBatch, WeightProbe

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    model = Path(snapshot_model(cfg.model, cfg.data, args.cache).path)
    trainer = TorchTrainer(model, TrainConfig(lr=1e-5), AlgorithmConfig())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    records = generate_arithmetic(8, 0)
    prompts = encode_prompts(tok, [r.question for r in records],
                             system_prompt=cfg.data.system_prompt,
                             use_chat_template=cfg.data.use_chat_template,
                             plain_template=cfg.data.plain_template)
    probe = WeightProbe(ProbeBatch.from_prompts(prompts), TOLERANCE["float32"],
                        tok.pad_token_id or 0)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    version = 0
    for kind in ("shared", "disk"):
        with tempfile.TemporaryDirectory() as tmp:
            plane, transport = _planes(kind, model, Path(tmp), trainer)
            times: dict[str, list[float]] = {"without": [], "with": [], "probe": []}
            try:
                for i in range(2 * args.syncs + 1):
                    with torch.no_grad():
                        for p in trainer.model.parameters():
                            p.add_(1e-4 * torch.randn(p.shape, generator=gen))
                    version += 1
                    arm = "with" if i % 2 else "without"
                    t0 = time.perf_counter()
                    m = sync_weights(trainer, plane, transport, version,
                                     probe if arm == "with" else None)
                    if i == 0:
                        continue  # warm-up
                    times[arm].append(time.perf_counter() - t0)
                    if arm == "with":
                        times["probe"].append(m["sync/probe_seconds"])
            finally:
                plane.close()
        r = {k: statistics.median(v) for k, v in times.items()}
        r["probe_share"] = r["probe"] / r["without"]
        results[kind] = r
        print(f"{kind:7s} sync {r['without'] * 1e3:8.1f} ms | with probe {r['with'] * 1e3:8.1f}"
              f" ms | probe {r['probe'] * 1e3:6.1f} ms = {100 * r['probe_share']:6.1f}% of the "
              "sync")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(model), "syncs": args.syncs,
                                    "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
