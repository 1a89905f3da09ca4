"""Weight-sync bandwidth of each mode against a plain memory copy of the same bytes.

Payloads (float32, every tensor once: a tied LM head is the embedding):

- ``25m``: the state dict of the 25.7M-parameter Qwen2 of
  :mod:`benchmarks.rollout_throughput` (103 MB);
- ``200m``: random tensors in the shapes of a 206.6M-parameter Qwen2 (vocabulary 32768,
  hidden 1024, 11 layers, 16/8 heads, MLP 4096: 826 MB).

Modes, each timed from the sender's tensors to tensors the receiver owns:

- ``memcpy``: libc ``memcpy`` (``ctypes.memmove``) of every tensor into preallocated ones,
  one thread: the physical limit of one stream here, and the reference of the goal;
  ``memcpy_alloc``: the same into fresh allocations (their page faults, which every
  receiver below pays too); ``memcpy_2threads``: each tensor's halves on two threads.
  (torch's own ``copy_`` is not the reference: with 2 OpenMP threads on a loaded 2-core
  machine it ran at a tenth of ``memcpy``.)
- ``disk``: ``safetensors`` ``save_file`` + ``load_file`` in a temporary directory (the file
  stays in the page cache: what ``rollout.weight_sync=disk`` does on one node), the loaded
  (memory-mapped) tensors copied into the receiver's preallocated ones, as an engine's
  ``load_state_dict`` does;
- ``shm``: :class:`~rl_core.weight_sync.shm.SegmentWriter` writes the tensors into a shared
  segment (one ``memcpy`` each, hashed meanwhile: the trainer's half of
  ``rollout.weight_sync=shm``), then a private mapping of it and a view per tensor (the
  engine's half: its parameters are those views, no copy);
- ``object_store``: ``ray.put`` of the numpy arrays (:func:`rl_core.weight_sync.source.
  to_arrays`, what ``WeightSource.put_weights`` puts) in this process, ``ray.get`` in an
  actor (another process, zero-copy out of shared memory) and
  :func:`~rl_core.weight_sync.source.from_arrays` there, as ``EngineActor.load_weights``
  starts; ``object_store_product``: the whole of ``load_weights``' local work, i.e. also its
  safetensors write and the server's read;
- ``distributed``: a gloo broadcast, one per tensor, from this process (rank 0) to a
  receiver process (rank 1) over a group built by :mod:`rl_core.weight_sync.process_group`
  (``broadcast_named_tensors`` / ``receive_named_tensors``, told the tensors'
  :meth:`~rl_core.weight_sync.source.WeightSource.weight_layout`); the clock stops when the
  receiver acknowledges the last tensor. Group setup is timed apart.

With ``--product`` (25m only) it also times the product's whole sync,
:func:`rl_core.weight_sync.sync_weights` (stage, pause, load, checksum verification,
resume) from a :class:`~rl_core.training.torch_trainer.TorchTrainer` to one embedded engine
process, through the transport :func:`rl_core.planes.start_rollout` picks for
``rollout.weight_sync=disk`` (:class:`~rl_core.weight_sync.transports.DiskSync`), ``shm``
(:class:`~rl_core.weight_sync.transports.ShmSync`) and
``distributed`` (:class:`~rl_core.weight_sync.broadcast.BroadcastSync`, the group opened in
the warm-up sync). ``object_store`` has no product mode: its transport needs engines that
are Ray actors (``cluster.mode: ray``).

Each (payload, mode) runs in a fresh process: a warm-up transfer, then ``--repeats`` timed
ones; figures are medians. Bytes/s = payload bytes / seconds; the goal of issue 10 is
``object_store`` and ``distributed`` at >= half of ``memcpy``. Prints a table and writes JSON
(default ``benchmarks/results/weight_sync.json``); the load average is recorded.
A benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.weight_sync`` (about 3 minutes on 2 idle cores;
``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS, ROOT, format_table, load1, run_meta, write_json

DEFAULT_OUT = RESULTS / "weight_sync.json"
MODES = (
    "memcpy", "memcpy_alloc", "memcpy_2threads", "disk", "shm", "object_store",
    "object_store_product", "distributed",
)  # fmt: skip
PRODUCT_MODES = ("product_disk", "product_shm", "product_distributed")
# A Qwen2 of about 200M parameters: (vocab, hidden, layers, heads, kv_heads, intermediate).
SHAPES_200M = (32768, 1024, 11, 16, 8, 4096)


# ------------------------------------------------------------------------------ payloads


def qwen2_shapes(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 inter: int) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """Parameter names and shapes of a Qwen2 causal LM with tied embeddings (HF names)."""
    kv = hidden // heads * kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def payload(size: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The named float32 tensors of ``size`` (deterministic)."""
    if size == "25m":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from benchmarks.rollout_throughput import MODEL_SIZES

        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**MODEL_SIZES["25m"], tie_word_embeddings=True))
        return {k: v.detach().contiguous() for k, v in model.state_dict().items()
                if k != "lm_head.weight"}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in qwen2_shapes(*SHAPES_200M).items()}


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


# ------------------------------------------------------------------------------- modes


def repeat(fn: Callable[[], dict[str, float] | None], repeats: int) -> list[dict[str, float]]:
    """A warm-up call, then ``repeats`` timed ones (``fn`` may return sub-timings)."""
    fn()
    out = []
    for _ in range(repeats):
        load = load1()
        t0 = time.perf_counter()
        parts = fn() or {}
        out.append({"seconds": time.perf_counter() - t0, "load1": load, **parts})
    return out


def _memmove(dst: torch.Tensor, src: torch.Tensor) -> None:
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


def bench_memcpy(w: dict[str, torch.Tensor], repeats: int, kind: str) -> list[dict[str, float]]:
    """libc ``memcpy`` of every tensor: into preallocated tensors (``memcpy``), into fresh
    ones (``memcpy_alloc``: the page faults every receiver pays), or split over two threads
    (``memcpy_2threads``: ctypes releases the GIL)."""
    if kind == "memcpy_alloc":

        def fresh() -> None:
            for v in w.values():
                _memmove(torch.empty_like(v), v)

        return repeat(fresh, repeats)
    dst = {k: torch.empty_like(v) for k, v in w.items()}
    if kind == "memcpy":
        return repeat(lambda: [_memmove(dst[k], v) for k, v in w.items()] and None, repeats)
    from concurrent.futures import ThreadPoolExecutor

    halves: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for k, v in w.items():  # two flat halves of every tensor, one per thread
        a, b = v.reshape(-1), dst[k].reshape(-1)
        mid = a.numel() // 2
        halves[0].append((b[:mid], a[:mid]))
        halves[1].append((b[mid:], a[mid:]))
    pool = ThreadPoolExecutor(2)

    def two() -> None:
        list(pool.map(lambda pairs: [_memmove(d, s) for d, s in pairs], halves))

    try:
        return repeat(two, repeats)
    finally:
        pool.shutdown()


def bench_disk(w: dict[str, torch.Tensor], repeats: int, work: Path) -> list[dict[str, float]]:
    """``save_file``, then ``load_file`` and a copy into the receiver's preallocated tensors
    (``load_file`` only maps the file: an engine's ``load_state_dict`` then copies the bytes
    into its parameters, which is what reads them)."""
    from safetensors.torch import load_file, save_file

    path = work / "model.safetensors"
    dst = {k: torch.empty_like(v) for k, v in w.items()}

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        save_file(w, str(path))
        t1 = time.perf_counter()
        for k, v in load_file(str(path)).items():
            _memmove(dst[k], v)
        t2 = time.perf_counter()
        path.unlink()
        return {"write_s": t1 - t0, "read_s": t2 - t1}

    return repeat(run, repeats)


def bench_shm(w: dict[str, torch.Tensor], repeats: int, work: Path) -> list[dict[str, float]]:
    """``rollout.weight_sync=shm``'s two halves: the trainer's write into the segment (one
    ``memcpy`` per tensor, hashed meanwhile), the engine's attach (a private mapping and a
    view per tensor: its parameters, no copy)."""
    from rl_core.weight_sync.shm import SegmentWriter, map_segment, views

    writer, version = SegmentWriter(work), iter(range(1 << 20))

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        path, _ = writer.write(w, next(version))
        t1 = time.perf_counter()
        served = views(map_segment(path, writer.size, private=True), writer.layout or [])
        t2 = time.perf_counter()
        assert len(served) == len(w)
        return {"write_and_hash_s": t1 - t0, "attach_s": t2 - t1}

    try:
        return repeat(run, repeats)
    finally:
        writer.close()


class _Receiver:
    """The engine side of the object-store path, in a Ray actor (another process)."""

    def take(self, arrays: dict[str, Any]) -> int:
        from rl_core.weight_sync.source import from_arrays

        tensors = from_arrays(arrays)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def take_as_product(self, arrays: dict[str, Any], staging: str) -> int:
        """What ``EngineActor.load_weights`` does locally: copy out, write safetensors; the
        server then reads them (``/update_weights_from_disk``)."""
        from safetensors.torch import load_file, save_file

        from rl_core.weight_sync.source import from_arrays

        path = Path(staging) / "model.safetensors"
        save_file(from_arrays(arrays), str(path))
        got = load_file(str(path))
        path.unlink()
        return sum(t.numel() * t.element_size() for t in got.values())


def bench_object_store(w: dict[str, torch.Tensor], repeats: int, threads: int,
                       product: bool, work: Path) -> list[dict[str, float]]:  # fmt: skip
    import ray

    from rl_core.weight_sync.source import to_arrays

    ray.init(num_cpus=threads, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
             _temp_dir=str(work / "ray"))  # fmt: skip
    try:
        actor = ray.remote(num_cpus=0)(_Receiver).remote()
        want = nbytes(w)

        def run() -> dict[str, float]:
            t0 = time.perf_counter()
            ref = ray.put(to_arrays(w))
            t1 = time.perf_counter()
            call = (actor.take_as_product.remote(ref, str(work)) if product
                    else actor.take.remote(ref))  # fmt: skip
            got = ray.get(call, timeout=600)
            t2 = time.perf_counter()
            assert got == want, (got, want)
            del ref
            return {"put_s": t1 - t0, "get_s": t2 - t1}

        return repeat(run, repeats)
    finally:
        ray.shutdown()


def bench_distributed(w: dict[str, torch.Tensor], repeats: int, size: str, threads: int,
                      work: Path) -> tuple[list[dict[str, float]], float]:  # fmt: skip
    """Rank 0 here, rank 1 a receiver process; returns the timings and the group setup s."""
    from rl_core.host import free_port
    from rl_core.weight_sync import process_group as pg
    from rl_core.weight_sync.source import WeightSource

    class Sender(WeightSource):
        def export_weights(self) -> dict[str, torch.Tensor]:
            return w

    layout = Sender().weight_layout()  # what the engines are told, in broadcast order
    meta = work / "meta.json"
    meta.write_text(json.dumps({"names": list(layout), "dtypes": [d for d, _ in layout.values()],
                                "shapes": [s for _, s in layout.values()]}))  # fmt: skip
    host = "127.0.0.1"
    port = free_port(host)
    argv = [sys.executable, "-m", "benchmarks.weight_sync", "--worker", "receiver",
            "--size", size, "--port", str(port), "--meta", str(meta),
            "--repeats", str(repeats), "--threads", str(threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env)
    try:
        t0 = time.perf_counter()
        group = pg.init_custom_process_group(master_address=host, master_port=port, rank=0,
                                             world_size=2, group_name="bench", timeout_s=300)  # fmt: skip
        setup = time.perf_counter() - t0
        ack = torch.zeros(1)

        def run() -> None:
            pg.broadcast_named_tensors(w, group, timeout_s=300)
            torch.distributed.broadcast(ack, group=group, group_src=1)  # the receiver has all

        timings = repeat(run, repeats)
        pg.destroy_process_group(group)
    finally:
        proc.wait(timeout=300)
    return timings, setup


def receiver_main(args: argparse.Namespace) -> None:
    """Rank 1 of the distributed mode: receive every tensor, acknowledge, 1 + repeats times."""
    from rl_core.weight_sync import process_group as pg

    meta = json.loads(Path(args.meta).read_text())
    group = pg.init_custom_process_group(master_address="127.0.0.1", master_port=args.port,
                                         rank=1, world_size=2, group_name="bench", timeout_s=300)  # fmt: skip
    ack = torch.ones(1)
    for _ in range(1 + args.repeats):
        got = pg.receive_named_tensors(meta["names"], meta["dtypes"], meta["shapes"], group,
                                       timeout_s=300)  # fmt: skip
        assert len(got) == len(meta["names"])
        torch.distributed.broadcast(ack, group=group, group_src=1)
    pg.destroy_process_group(group)


def bench_product(mode: str, repeats: int, work: Path) -> list[dict[str, float]]:
    """``sync_weights`` of a TorchTrainer on the 25m model to one embedded engine, through
    the transport ``rollout.weight_sync`` configures."""
    from benchmarks.rollout_throughput import build_model_dir
    from rl_core.base_model import snapshot_model
    from rl_core.config import load_config
    from rl_core.planes import start_rollout
    from rl_core.training.torch_trainer import TorchTrainer
    from rl_core.weight_sync import sync_weights, weights_checksum

    model_dir, _ = build_model_dir("25m", work / "model")
    base = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), [])
    tiny = snapshot_model(base.model, base.data, base.storage.cache_dir).path
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tiny) / f).is_file():  # the engine needs a tokenizer; its ids fit in 4096
            shutil.copy(Path(tiny) / f, model_dir / f)
    sync = mode.removeprefix("product_")
    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"),
                      [f"model.path={model_dir}", f"rollout.weight_sync={sync}",
                       "rollout.engine=embedded",
                       "algorithm.kl_coef=0"])  # fmt: skip
    trainer = TorchTrainer(model_dir, cfg.train, cfg.algorithm)
    weights = trainer.export_weights()
    weights_checksum(weights)
    t0 = time.perf_counter()
    weights_checksum(weights)
    checksum_s = time.perf_counter() - t0  # each sync hashes on the trainer and the engine
    del weights
    plane, transport = start_rollout(cfg, model_dir, work / "run")
    try:
        version = iter(range(1, 1 << 20))

        def run() -> dict[str, float]:
            m = sync_weights(trainer, plane, transport, next(version))
            parts = {k: float(v) for k, v in m.items() if k != "sync_seconds"}
            if hasattr(transport, "num_buckets"):  # distributed: POSTs per engine and sync
                parts["sync_buckets"] = float(transport.num_buckets)
            return {**parts, "checksum_one_side_s": checksum_s}

        return repeat(run, repeats)
    finally:
        transport.close()
        plane.close()
        trainer.shutdown()


# ------------------------------------------------------------------------------ driver


def worker_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.worker == "receiver":
        receiver_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="grpoflow-wsync-") as tmp:
        work = Path(tmp)
        record: dict[str, Any] = {}
        if args.worker.startswith("product_"):
            record["runs"] = bench_product(args.worker, args.repeats, work)
            record["bytes"] = record["runs"][0]["sync_bytes"]
        else:
            w = payload(args.size)
            record.update(bytes=nbytes(w), tensors=len(w),
                          parameters=sum(t.numel() for t in w.values()))  # fmt: skip
            if args.worker.startswith("memcpy"):
                record["runs"] = bench_memcpy(w, args.repeats, args.worker)
            elif args.worker == "disk":
                record["runs"] = bench_disk(w, args.repeats, work)
            elif args.worker == "shm":
                record["runs"] = bench_shm(w, args.repeats, work)
            elif args.worker.startswith("object_store"):
                record["runs"] = bench_object_store(w, args.repeats, args.threads,
                                                    args.worker == "object_store_product", work)  # fmt: skip
            else:
                record["runs"], record["group_setup_s"] = bench_distributed(
                    w, args.repeats, args.size, args.threads, work)
        args.out.write_text(json.dumps(record))


def _worker(kind: str, size: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / f"{kind}-{size}.json"
    argv = [sys.executable, "-m", "benchmarks.weight_sync", "--worker", kind, "--size", size,
            "--repeats", str(args.repeats), "--threads", str(args.threads), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{kind} {size} failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    rec = json.loads(out.read_text())
    secs = [r["seconds"] for r in rec["runs"]]
    rec["seconds"] = statistics.median(secs)
    rec["bytes_per_s"] = rec["bytes"] / rec["seconds"]
    rec["bytes_per_s_min"] = rec["bytes"] / max(secs)
    rec["bytes_per_s_max"] = rec["bytes"] / min(secs)
    for part in ("write_s", "read_s", "put_s", "get_s", "write_and_hash_s", "attach_s"):
        if part in rec["runs"][0]:
            rec[part] = statistics.median(r[part] for r in rec["runs"])
    return rec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=["25m", "200m"], default=["25m", "200m"])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--product", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the product's sync_weights (25m; disk, shm, distributed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: 25m, 2 repeats, no product")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--worker", choices=[*MODES, *PRODUCT_MODES, "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--size", choices=["25m", "200m"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--meta", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.product = ["25m"], 2, False
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.worker:
        worker_main(args)
        return {}
    meta = run_meta("benchmarks.weight_sync", argv)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-wsync-bench-") as tmp:
        work = Path(tmp)
        for size in args.sizes:
            results[size] = {}
            kinds = list(args.modes) + (list(PRODUCT_MODES) if args.product and size == "25m" else [])
            for kind in kinds:
                rec = results[size][kind] = _worker(kind, size, args, work)
                print(f"{size} {kind:<22} {rec['bytes'] / 1e6:8.1f} MB in {rec['seconds']:.3f} s: "
                      f"{rec['bytes_per_s'] / 1e9:.2f} GB/s (load1 {load1():.2f})")  # fmt: skip
    rows = []
    for size, modes in results.items():
        base = modes.get("memcpy", {}).get("bytes_per_s")
        for kind, rec in modes.items():
            share = f"{rec['bytes_per_s'] / base:.2f}" if base else "–"
            rows.append([size, kind, rec["bytes"] / 1e6, 1000 * rec["seconds"],
                         rec["bytes_per_s"] / 1e9, rec["bytes_per_s_min"] / 1e9,
                         rec["bytes_per_s_max"] / 1e9, share])  # fmt: skip
    print()
    print(format_table(["payload", "mode", "MB", "ms", "GB/s", "min", "max", "x memcpy"], rows))
    doc = {**meta, "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}, "results": results}  # fmt: skip
    write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
