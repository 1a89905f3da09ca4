"""Delta weight sync against the full one: bytes and time per version, on CPU.

Models of three sizes (Qwen2 shapes, float32, random weights): ``25m``, ``50m`` and ``0.5b``
(Qwen2.5-0.5B's shape, 494M parameters). Each version is one AdamW step with the demo's
settings (lr 1e-4, betas 0.9/0.999) on random gradients: as in training, every element moves.
Per version, the trainer side (:class:`rl_core.weight_sync.delta.DeltaEncoder.write`: a delta
file, or the whole model) and the engine side (:func:`~rl_core.weight_sync.delta.apply_delta`,
or reading the whole file) are timed; the bytes are the file's. ``--dtype bfloat16`` casts the
weights as a bfloat16 engine would receive them (fewer elements change at its resolution).
Prints a table and writes JSON (default ``benchmarks/results/delta_sync.json``)::

    python -m benchmarks.delta_sync [--models 25m 50m 0.5b] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # hidden, layers, heads, kv heads, MLP, vocabulary, tied
    "25m": (448, 4, 7, 1, 1536, 32000, True),
    "50m": (640, 8, 10, 2, 1792, 32000, True),
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
}


def _model(name: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, n, heads, kv, mlp, vocab, tied = SHAPES[name]
    cfg = Qwen2Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=mlp, vocab_size=vocab,
                      tie_word_embeddings=tied, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--versions", type=int, default=3, help="deltas timed per model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/delta_sync.json")
    args = ap.parse_args(argv)

    from safetensors.torch import load_file

    from rl_core.weight_sync.delta import DeltaEncoder, apply_delta

    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    results = {}
    for name in args.models:
        model = _model(name)
        params = [p for p in model.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
        enc = DeltaEncoder(full_every=10**6)
        served: dict[str, torch.Tensor] = {}
        held = ""  # the checksum of what the engine side holds
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for version in range(args.versions + 1):
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
                weights = {n: t.detach().to(dtype) for n, t in model.state_dict().items()}
                enc.confirm(version - 1)
                t0 = time.perf_counter()
                checksum, m = enc.write(weights, version, Path(tmp) / f"v{version}")
                write_s = time.perf_counter() - t0
                path = Path(tmp) / f"v{version}"
                t0 = time.perf_counter()
                if m["sync_delta"]:
                    served.update(apply_delta(path, served, held))
                else:
                    served = {n: t.clone() for n, t in  # read, not only mapped
                              load_file(str(path / "model.safetensors")).items()}
                read_s = time.perf_counter() - t0
                held = checksum
                sent = sum(f.stat().st_size for f in path.glob("*.safetensors"))
                rows.append({"version": version, "delta": bool(m["sync_delta"]), "bytes": sent,
                             "fraction": sent / m["sync_full_bytes"], "write_s": write_s,
                             "read_s": read_s})
                for f in path.glob("*"):
                    f.unlink()
        full, deltas = rows[0], rows[1:]
        r = {"parameters": sum(p.numel() for p in params), "full_bytes": full["bytes"],
             "full_write_s": full["write_s"], "full_read_s": full["read_s"],
             "delta_fraction": sum(d["fraction"] for d in deltas) / len(deltas),
             "delta_write_s": sum(d["write_s"] for d in deltas) / len(deltas),
             "delta_read_s": sum(d["read_s"] for d in deltas) / len(deltas), "rows": rows}
        results[name] = r
        print(f"{name:5s} {r['parameters'] / 1e6:6.1f}M {args.dtype}: full {full['bytes'] / 1e6:7.1f}"
              f" MB write {r['full_write_s']:.2f}s read {r['full_read_s']:.2f}s | delta "
              f"{100 * r['delta_fraction']:5.1f}% of the bytes, write {r['delta_write_s']:.2f}s "
              f"apply {r['delta_read_s']:.2f}s")
        del model, opt, served, enc
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
