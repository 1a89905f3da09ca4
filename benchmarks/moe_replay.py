"""The rollout/train log-prob mismatch of an MoE model, with and without routing replay (R3).

One rollout of the demo's tiny MoE model (``configs/tiny-moe-cpu.yaml``: Qwen3-MoE, warm
started; or ``--model DIR``) on ``--prompts`` training prompts x ``--samples`` samples, by the
in-process engine with ``return_routed_experts`` (the engine in ``ENGINE`` dtype: packed
prefill, KV-cached decode, its own batch shapes), then the torch trainer's log-probs of the
same tokens (``TRAINER`` dtype: padded full forward, the whole batch as one micro-batch),
once routing by its own router and once replaying the rollout's
experts. Reported per (engine, trainer) dtype pair and mode, over the response tokens: mean
and max ``|logp_train - logp_rollout|``, the k3 estimate of KL(rollout || train)
(``mean(exp(d) - 1 - d)``, ``d = logp_train - logp_rollout``), and the share of (token, MoE
layer) pairs whose expert set differs from the rollout's; and the same |dlogp| over the
*affected* tokens only: the response tokens at or after the first token whose routing
differed (in any layer) in the trainer's own routing (a different expert at token ``t``
changes the keys and values every later token attends to). ``bfloat16/bfloat16`` is the
realistic pair (SGLang and the trainer both compute in bfloat16 on GPUs, with different
kernels and batch shapes); ``bfloat16/float32`` is an engine serving bfloat16 against a
float32 trainer; ``float32/float32`` is the control (the planes agree to rounding). Prints
a table and writes JSON (default ``benchmarks/results/moe_replay.json``). A benchmark,
never a test.

Run: ``.venv/bin/python -m benchmarks.moe_replay`` (a few minutes on 2 cores: the first run
builds and warm-starts the tiny MoE model into ``.cache/grpoflow``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS, ROOT, format_table, run_meta, write_json

DEFAULT_OUT = RESULTS / "moe_replay.json"
PAIRS = (("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32"))


def _model_dir(args: argparse.Namespace) -> tuple[Path, Any]:
    from rl_core.base_model import snapshot_model
    from rl_core.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny-moe-cpu.yaml", [f"storage.cache_dir={args.cache}"])
    if args.model:
        return Path(args.model), cfg
    return snapshot_model(cfg.model, cfg.data, args.cache).path, cfg


def _prompts(model_dir: Path, cfg: Any, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rl_core.data.prompts import encode_prompts
    from rl_core.data.synthetic import generate_splits

    train, _ = generate_splits(cfg.data.synthetic_train_size, cfg.data.synthetic_test_size,
                               seed=cfg.data.seed, **cfg.data.synthetic_knobs())
    tok = AutoTokenizer.from_pretrained(model_dir)
    return encode_prompts(tok, [r.question for r in train[:n]])


def measure(model_dir: Path, prompts: list[list[int]], samples: int, max_new_tokens: int,
            engine_dtype: str, trainer_dtype: str) -> dict[str, Any]:
    """One rollout in ``engine_dtype``; the trainer's mismatch without and with replay."""
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.engine.sampling import SamplingParams
    from rl_core.models.moe import RouterTap
    from rl_core.rollout.inprocess import InProcessPlane
    from rl_core.training.torch_trainer import TorchTrainer
    from rl_core.types import Batch

    plane = InProcessPlane(model_dir, dtype=engine_dtype, routed_experts=True)
    try:
        todo = [p for p in prompts for _ in range(samples)]
        params = [SamplingParams(max_new_tokens=max_new_tokens, seed=i) for i in range(len(todo))]
        t0 = time.perf_counter()
        out = plane.generate(todo, params)
        gen_s = time.perf_counter() - t0
        pad = plane.engine.pad_token_id
    finally:
        plane.close()
    batch = Batch.from_samples(out, [0.0] * len(out), pad)
    b, cols, width = batch.routed_experts.shape
    real, mask = batch.attention_mask[:, 1:], batch.response_mask
    row: dict[str, Any] = {"engine_dtype": engine_dtype, "trainer_dtype": trainer_dtype,
                           "sequences": b, "response_tokens": int(mask.sum()),
                           "generate_seconds": round(gen_s, 2)}
    affected = None  # response tokens at or after a routing difference (own routing)
    for replay in (False, True):
        train = TrainConfig(micro_batch_size=b, pack_groups=False,
                            moe={"routing_replay": replay})
        trainer = TorchTrainer(model_dir, train, AlgorithmConfig(), dtype=trainer_dtype)
        trainer.compute_logprobs(batch.select(torch.arange(1)))  # its hooks go first
        with RouterTap(trainer.model) as tap:  # one micro-batch: one forward to read
            logp = trainer.compute_logprobs(batch)
            used = tap.indices()
        layers, k = trainer.moe.layers, trainer.moe.top_k
        used = used.view(b, cols + 1, layers, k)[:, :-1].long().sort(-1).values
        rollout = batch.routed_experts.view(b, cols, layers, k).long().sort(-1).values
        differ = (used != rollout).any(-1) & real[..., None]  # (token, layer) pairs
        if affected is None:
            affected = (differ.any(-1).cumsum(1) > 0) & mask
        d = (logp - batch.rollout_logp)[mask]
        hit = (logp - batch.rollout_logp)[affected].abs()
        row["replay" if replay else "own_routing"] = {
            "mean_abs_dlogp": float(d.abs().mean()), "max_abs_dlogp": float(d.abs().max()),
            "k3_kl": float((torch.exp(d) - 1 - d).mean()),
            "routing_differs": float(differ[real].float().mean()),
            "affected_tokens": int(affected.sum()),
            "affected_mean_abs_dlogp": float(hit.mean()) if len(hit) else 0.0}
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an MoE model directory (default: the demo's tiny MoE)")
    p.add_argument("--cache", default=str(ROOT / ".cache" / "grpoflow"))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = run_meta("benchmarks.moe_replay", argv)
    model_dir, cfg = _model_dir(args)
    prompts = _prompts(model_dir, cfg, args.prompts)
    rows = [measure(model_dir, prompts, args.samples, args.max_new_tokens, e, t)
            for e, t in PAIRS]
    table = []
    for r in rows:
        for mode in ("own_routing", "replay"):
            m = r[mode]
            table.append([f"{r['engine_dtype']}/{r['trainer_dtype']}", mode,
                          f"{m['mean_abs_dlogp']:.5f}", f"{m['max_abs_dlogp']:.4f}",
                          f"{m['k3_kl']:.2e}", f"{100 * m['routing_differs']:.3f}%",
                          m["affected_tokens"], f"{m['affected_mean_abs_dlogp']:.5f}"])
    print(format_table(["engine/trainer dtype", "routing", "mean |dlogp|", "max |dlogp|",
                        "k3 KL", "routes differ", "affected tokens",
                        "affected mean |dlogp|"], table))
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    model = {"path": str(model_dir), "model_type": c.model_type, "layers": c.num_hidden_layers,
             "experts": c.num_experts, "experts_per_token": c.num_experts_per_tok,
             "hidden_size": c.hidden_size}
    write_json(args.out, {**meta, "model": model, "prompts": args.prompts,
                          "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                          "results": rows})


if __name__ == "__main__":
    main(sys.argv[1:])
