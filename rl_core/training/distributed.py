"""Trainer ranks: torch trainers in Ray actors that form one ``torch.distributed`` group.

:class:`TrainerGroup` (driver side) starts :class:`TrainerRank` actors (DDP or FSDP2
``TorchTrainer`` ranks, or ``MegatronTrainer`` ranks) and offers the single-rank
:class:`~rl_core.interfaces.Trainer` interface. N ranks make exactly the update one rank makes
on the whole batch (global-count normalisation, summed gradients); checkpoints keep the
single-rank layout; every wait is bounded, and a failure names the rank and leaves the group
unusable. Never touches the rollout plane. docs/training.md, "Trainer ranks".
"""


from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as dcp

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.training.torch_trainer import MiniBatch, TorchTrainer
from rl_core.types import Batch
from rl_core.weight_sync.process_group import host_tcp_store
from rl_core.weight_sync.source import from_arrays, to_arrays

__all__ = ["DataParallel", "TrainerGroup", "TrainerRank", "TrainerRankError", "shard_for_logprobs",
           "shard_for_training"]

DataParallel = Literal["ddp", "fsdp2"]

# How long a failed call waits for the other ranks' outcomes, so the message names the rank
# that died rather than the peer whose collective broke because of it.
_FAILURE_GRACE_S = 2.0
_FULL = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)


class TrainerRankError(RuntimeError):
    """A trainer rank died or failed; ``ranks`` lists which."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


def _pad_split(rows: torch.Tensor, world: int) -> list[tuple[torch.Tensor, int]]:
    """``rows`` cut into ``world`` contiguous slices of equal length, short ones padded by
    repeating ``rows[0]``; each with how many of its rows are real."""
    parts = rows.tensor_split(world)
    width = len(parts[0])  # tensor_split puts the longer slices first
    return [(torch.cat([p, rows[:1].repeat(width - len(p))]), len(p)) for p in parts]


def shard_for_logprobs(batch: Batch, world: int) -> list[tuple[Batch, torch.Tensor]]:
    """Each rank's rows (equal counts; padding rows at the end) and the global rows its
    first ``len(rows)`` results belong to."""
    if batch.size == 0:
        raise ValueError("empty batch")
    return [(batch.select(padded), padded[:n_real])
            for padded, n_real in _pad_split(torch.arange(batch.size), world)]


def shard_for_training(batch: Batch, world: int,
                       mini_batches: int) -> list[tuple[Batch, list[MiniBatch]]]:
    """Each rank's rows and its :class:`MiniBatch` plan for one ``train_step``: the single-rank
    mini-batches (``arange(B).chunk(mini_batches)``), each split across ranks with the global
    counts attached. Padding rows have an empty response mask: they add nothing to the loss, the
    gradient or the metrics."""
    if batch.size == 0:
        raise ValueError("empty batch")
    rows, real, plans = ([[] for _ in range(world)] for _ in range(3))  # per rank
    for mini in torch.arange(batch.size).chunk(mini_batches):
        tokens, seqs = float(batch.response_mask[mini].sum()), float(len(mini))
        for r, (part, n_real) in enumerate(_pad_split(mini, world)):
            start = len(rows[r])
            rows[r] += part.tolist()
            real[r] += [True] * n_real + [False] * (len(part) - n_real)
            plans[r].append(MiniBatch(torch.arange(start, len(rows[r])), tokens, seqs))
    shards = []
    for r in range(world):
        local = batch.select(torch.tensor(rows[r]))
        local.response_mask &= torch.tensor(real[r]).unsqueeze(-1)
        shards.append((local, plans[r]))
    return shards


def _sum_gradients(group, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations
    """DDP comm hook: sum, not average; every rank's loss already is its share of the whole."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _fully_shard(model: torch.nn.Module) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum gradients (see _sum_gradients); SUM ops only, which gloo supports too.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class _RankTrainer(TorchTrainer):
    """A :class:`TorchTrainer` whose model is data-parallel over the default process group;
    every method here is collective: all ranks call it; rank 0 writes the files."""

    def __init__(self, *args: Any, data_parallel: DataParallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_parallel, self.rank, self._ddp = data_parallel, dist.get_rank(), None
        self._sends_weights = self.rank == 0  # only rank 0 talks to the engines
        if data_parallel == "fsdp2":
            _fully_shard(self.model)
            if self.ref_model is not None:
                _fully_shard(self.ref_model)
            self._build_optimizer()  # over the sharded (DTensor) parameters
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Buffers (rotary tables) are equal on every rank and never change: no per-forward
            # broadcast (newer torch names the flag forward_sync_buffers).
            quiet = "forward_sync_buffers" in inspect.signature(DDP).parameters
            buffers = {"forward_sync_buffers" if quiet else "broadcast_buffers": False}
            self._ddp = DDP(self.model, device_ids=ids, **buffers)
            self._ddp.register_comm_hook(None, _sum_gradients)

    @property
    def _train_module(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None else self.model

    def _grad_sync(self, sync: bool) -> AbstractContextManager:
        # Gradients are reduced once per optimizer step, after the mini-batch's last backward.
        if self._ddp is not None:
            return contextlib.nullcontext() if sync else self._ddp.no_sync()
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _across_ranks(self, sums: dict[str, float],
                      maxes: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        out = []
        for values, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
            keys = sorted(values)
            t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=op)
            out.append(dict(zip(keys, t.tolist(), strict=True)))
        return out[0], out[1]

    # Weights and state: gathered whole on rank 0 (a collective under FSDP2).
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0; ``{}`` on the others."""
        return dcp.get_model_state_dict(self.model, options=_FULL)

    def _barrier(self) -> None:
        dist.barrier()

    def save_state(self, path: str | Path) -> Path:
        path, weights = Path(path), self.export_weights()  # LoRA: the adapter only
        optimizer = dcp.get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        self._write_hf(path / "model", weights)
        if self.rank == 0:
            torch.save({"optimizer": _by_index(optimizer), "scheduler": self.scheduler.state_dict(),
                        "global_step": self.global_step}, path / "trainer_state.pt")
        dist.barrier()
        return path

    def load_state(self, path: str | Path) -> None:
        path, options = Path(path), dcp.StateDictOptions(full_state_dict=True, strict=False)
        result = dcp.set_model_state_dict(self.model, self._loadable(path), options=options)
        self._check_restore(path, result.missing_keys, result.unexpected_keys)
        # Our own file, written by save_state: it holds optimizer tensors and plain numbers.
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        dcp.set_optimizer_state_dict(self.model, self.optimizer,
                                     _by_name(state["optimizer"], order),
                                     options=dcp.StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = state["global_step"]


def _by_index(osd: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``get_optimizer_state_dict``) keyed by parameter index,
    as ``torch.optim.Optimizer.state_dict`` writes it (the single-rank checkpoint layout)."""
    index: dict[str, int] = {}
    groups = [{**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]}
              for g in osd["param_groups"]]
    return {"state": {index[k]: v for k, v in osd["state"].items()}, "param_groups": groups}


def _by_name(osd: dict[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`_by_index`; ``order``: parameter names in optimizer order."""
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {order[i]: v for i, v in osd["state"].items()}, "param_groups": groups}


def _rank_device(device: str) -> str:
    """``"cuda"``: the GPU Ray gave this rank, by its index among the visible ones."""
    if device != "cuda":
        return device
    if not (ids := ray.get_gpu_ids()):
        raise RuntimeError("device 'cuda' but Ray gave this trainer rank no GPU (num_gpus=1)")
    # With the platform presets (RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES=1) Ray leaves the
    # visible-devices variable alone, so the assigned id is looked up in it; without them
    # Ray sets it to the one assigned GPU and the lookup gives index 0.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES")
    gpu = str(ids[0])
    return f"cuda:{visible.split(',').index(gpu) if visible else int(gpu)}"


class TrainerRank:
    """One trainer rank in this process: a data-parallel :class:`TorchTrainer`, or a
    ``MegatronTrainer`` rank of a TP x PP x DP layout (``train.backend``). Run as a Ray actor
    by :class:`TrainerGroup`; the methods are its remote protocol."""

    def __init__(self, rank: int, world_size: int, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.trainer: _RankTrainer | None = None
        self._store: dist.TCPStore | None = None

    def host_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: start the group's TCP store on a free port of this node's Ray address
        (127.0.0.1 on a local Ray), listening there only: where the other ranks connect."""
        address = ray.util.get_node_ip_address()
        self._store = host_tcp_store(address, 0, self.world_size,
                                     timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return address, self._store.port

    def setup(self, address: str, port: int, timeout_s: float, trainer_args: tuple[Any, ...],
              trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Join the process group, then load the model (every rank from ``model_path``)."""
        device, timeout = _rank_device(trainer_kwargs.pop("device")), timedelta(seconds=timeout_s)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store = self._store or dist.TCPStore(address, port, self.world_size, is_master=False,
                                             timeout=timeout)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store,
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        if trainer_args[1].backend == "megatron":
            from rl_core.training.megatron import MegatronTrainer

            trainer_kwargs.pop("data_parallel", None)  # megatron's own DDP over its DP groups
            t = self.trainer = MegatronTrainer(*trainer_args, device=device, **trainer_kwargs)
            layout = {"dp_rank": t.dp_rank, "dp_size": t.dp_size, "reports": t.reports}
        else:
            self.trainer = _RankTrainer(*trainer_args, device=device, **trainer_kwargs)
            layout = {"dp_rank": self.rank, "dp_size": self.world_size, "reports": True}
        return {"device": device, "needs_old_logp": self.trainer.needs_old_logp,
                "has_ref_model": self.trainer.has_ref_model, **layout}

    def compute_logprobs(self, batch: Batch, reference: bool) -> torch.Tensor:
        return self.trainer.compute_logprobs(batch, reference=reference)

    def train_step(self, batch: Batch, minis: list[MiniBatch],
                   norm_const: float) -> tuple[dict[str, float], int]:
        metrics = self.trainer.train_step(batch, minis=minis, norm_const=norm_const)
        return metrics, self.trainer.global_step

    def export_weights(self) -> dict[str, tuple[np.ndarray, str]] | None:
        weights = self.trainer.export_weights()  # every rank takes part
        return to_arrays(weights) if self.rank == 0 else None

    def write_weights(self, path: str) -> str | None:
        return self.trainer.write_weights(path)

    def put_weights(self) -> tuple[Any, str, int] | None:
        return self.trainer.put_weights()

    def weight_layout(self) -> dict[str, tuple[str, list[int]]]:
        return self.trainer.weight_layout()

    def save_pretrained(self, path: str) -> str:
        return str(self.trainer.save_pretrained(path))

    def weight_broadcast_endpoint(self) -> tuple[str, int]:
        return self.trainer.weight_broadcast_endpoint(ray.util.get_node_ip_address())

    def open_weight_broadcast(self, *args: Any, **kwargs: Any) -> None:
        self.trainer.open_weight_broadcast(*args, **kwargs)

    def broadcast_weights(self, group_name: str) -> str | None:
        return self.trainer.broadcast_weights(group_name)

    def close_weight_broadcast(self, group_name: str | None = None) -> None:
        self.trainer.close_weight_broadcast(group_name)

    def save_state(self, path: str) -> str:
        return str(self.trainer.save_state(path))

    def load_state(self, path: str) -> int:
        self.trainer.load_state(path)
        return self.trainer.global_step

    def apply(self, fn: Callable[[TorchTrainer], Any]) -> Any:
        """``fn(trainer)`` on this rank (inspection, tests)."""
        return fn(self.trainer)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def release(self) -> None:
        """Leave the trainer's groups and drop it, the process kept for another group's
        :meth:`setup` (megatron's parallel state too: a kept one would hold dead groups)."""
        if self.trainer is not None and hasattr(self.trainer, "shutdown"):
            self.trainer.shutdown()
        self.shutdown()
        self.trainer, self._store = None, None


class TrainerGroup:
    """Data-parallel trainer ranks behind the single-rank trainer's interface."""

    def __init__(self, actors: list[Any], *, timeout_s: float,
                 max_response_len: int | None) -> None:
        self._actors, self.timeout_s, self.max_response_len = actors, timeout_s, max_response_len
        self.global_step, self.needs_old_logp, self.has_ref_model = 0, False, False
        self.device, self._mini_batches, self._broken = "cpu", 1, None  # _broken: why unusable
        # Rank r trains on data-parallel slice _dp_of[r] of _dp_size; ranks in _reports return
        # log-probs (all for DDP/FSDP2; for megatron TP rank 0 of each replica's last stage).
        self._dp_of, self._dp_size = list(range(len(actors))), len(actors)
        self._reports = [True] * len(actors)

    @classmethod
    def start(
        cls, model_path: str | Path, train_cfg: TrainConfig, algo_cfg: AlgorithmConfig, *,
        num_ranks: int, temperature: float = 1.0, max_response_len: int | None = None,
        dtype: str = "float32", num_threads_per_rank: int = 1, device: str = "cpu",
        scheduling_strategies: Sequence[Any] | None = None, timeout_s: float = 300.0,
        data_parallel: DataParallel | None = None, trust_remote_code: bool = False,
        env: Mapping[str, str] | None = None, num_cpus_per_rank: float | None = None,
        num_gpus_per_rank: float | None = None, freeze_vision: bool = True,
        actors: Sequence[Any] | None = None) -> TrainerGroup:
        """Start ``num_ranks`` rank actors (one Ray scheduling strategy each, or None), form
        their process group, load the model. ``data_parallel``: default FSDP2 on GPUs, else
        DDP (and for QLoRA: FSDP2 cannot shard 4-bit weights). ``timeout_s`` bounds every call
        and collective; ``num_cpus/gpus_per_rank`` default to its threads and one GPU on GPUs.
        ``actors``: the rank actors of a group of ``num_ranks`` handed back by :meth:`release`,
        to form this one on (no new processes; their placement options stay)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if scheduling_strategies is not None and len(scheduling_strategies) != num_ranks:
            raise ValueError(
                f"{len(scheduling_strategies)} scheduling strategies for {num_ranks} ranks")
        gpu = device.startswith("cuda")
        mode: DataParallel = data_parallel or ("fsdp2" if gpu and not train_cfg.lora.quantize
                                               else "ddp")
        if mode not in ("ddp", "fsdp2"):
            raise ValueError(f"data_parallel must be 'ddp' or 'fsdp2', got {mode!r}")
        if mode == "fsdp2" and train_cfg.lora.quantize:
            raise ValueError("train.lora.quantize (QLoRA) with FSDP2: FSDP2 does not shard "
                             "bitsandbytes' 4-bit weights; use data_parallel='ddp'")
        if actors is not None and len(actors) != num_ranks:
            raise ValueError(f"{len(actors)} rank actors for {num_ranks} ranks")
        reused, actors = actors is not None, list(actors or [])
        remote = ray.remote(TrainerRank)
        # What a rank reserves (a placement slot may hold half a device when the planes are
        # colocated); its thread budget is num_threads_per_rank either way.
        cpus = num_threads_per_rank if num_cpus_per_rank is None else num_cpus_per_rank
        gpus = (1 if gpu else 0) if num_gpus_per_rank is None else num_gpus_per_rank
        base: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0}
        if env:
            base["runtime_env"] = {"env_vars": dict(env)}
        for r, strategy in enumerate([] if reused else scheduling_strategies or [None] * num_ranks):
            options = base if strategy is None else {**base, "scheduling_strategy": strategy}
            actors.append(remote.options(**options).remote(r, num_ranks, num_threads_per_rank))
        group = cls(actors, timeout_s=timeout_s, max_response_len=max_response_len)
        group._mini_batches = train_cfg.mini_batches
        trainer_kwargs = {"temperature": temperature, "max_response_len": max_response_len,
                          "dtype": dtype, "trust_remote_code": trust_remote_code,
                          "device": device, "data_parallel": mode}
        if freeze_vision is not True:  # a vision-language policy's tower trains (torch only)
            trainer_kwargs["freeze_vision"] = freeze_vision
        trainer_args = (str(model_path), train_cfg, algo_cfg)
        try:
            ((address, port),) = group._call("start the process group's store",
                                             [actors[0].host_store.remote(timeout_s)])
            infos = group._call("join the process group and load the model", [
                a.setup.remote(address, port, timeout_s, trainer_args, trainer_kwargs)
                for a in actors])
        except BaseException:
            group.shutdown()  # reused actors too: a half-formed group leaves them unusable
            raise
        first = infos[0]
        group.needs_old_logp, group.has_ref_model = first["needs_old_logp"], first["has_ref_model"]
        group.device, group._dp_size = first["device"], first["dp_size"]
        group._dp_of, group._reports = [i["dp_rank"] for i in infos], [i["reports"] for i in infos]
        return group

    @property
    def num_ranks(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The rank actors' handles, in rank order."""
        return list(self._actors)

    @property
    def ref_model(self) -> str | None:
        """Truthy when reference log-probs exist (the loop's ``ref_model is not None`` test);
        prefer :attr:`has_ref_model`. The reference policy itself stays on the ranks."""
        return "reference policy (on the trainer ranks)" if self.has_ref_model else None

    def compute_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs (B, L-1), each rank scoring a slice of the batch."""
        if reference and not self.has_ref_model:
            raise ValueError("no reference model: algorithm.kl_coef is 0")
        shards = shard_for_logprobs(batch, self._dp_size)
        refs = [a.compute_logprobs.remote(shards[self._dp_of[r]][0], reference)
                for r, a in enumerate(self._actors)]
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        for r, got in enumerate(self._call("compute_logprobs", refs)):
            if self._reports[r]:
                rows = shards[self._dp_of[r]][1]
                out[rows, : got.shape[1]] = got[: len(rows)]
        return out

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One GRPO update over all ranks; the same update one rank makes on ``batch``."""
        shards = shard_for_training(batch, self._dp_size, self._mini_batches)
        # Dr.GRPO's constant, as one rank would take it from the whole batch.
        norm_const = float(self.max_response_len or batch.response_mask.shape[-1])
        refs = [a.train_step.remote(*shards[self._dp_of[r]], norm_const)
                for r, a in enumerate(self._actors)]
        metrics, self.global_step = self._call("train_step", refs)[0]
        return metrics

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights by HF name, as CPU tensors in this process (from rank 0):
        for inspection and the in-process plane; the transports never call it."""
        return from_arrays(self._on_all("export_weights")[0])

    def write_weights(self, path: str | Path) -> str | None:
        """Rank 0 writes the policy as HF safetensors; the checksum it took of them."""
        return self._on_all("write_weights", str(path))[0]

    def put_weights(self) -> tuple[Any, str, int]:
        """Rank 0 puts the policy into Ray's object store: (reference, checksum, bytes)."""
        return self._on_all("put_weights")[0]

    def weight_layout(self) -> dict[str, tuple[str, list[int]]]:
        """Name -> (dtype, shape) of what a broadcast sends (no weights travel)."""
        return self._on_all("weight_layout")[0]

    def save_pretrained(self, path: str | Path) -> Path:
        """Rank 0 writes the policy in HF format (safetensors)."""
        return Path(self._on_all("save_pretrained", str(path))[0])

    # Distributed weight sync: rank 0 hosts the group and broadcasts; a failed broadcast
    # (an engine died) leaves the ranks usable, a dead rank does not.
    def weight_broadcast_endpoint(self) -> tuple[str, int]:
        """Rank 0's node address and a port free there (the engines' rendezvous)."""
        ref = self._actors[0].weight_broadcast_endpoint.remote()
        return tuple(self._call("weight_broadcast_endpoint", [ref], breaks=False)[0])

    def open_weight_broadcast(self, master_address: str, master_port: int, world_size: int,
                              group_name: str, backend: str = "gloo",
                              timeout_s: float = 120.0) -> None:
        """Rank 0 hosts weight-update group ``group_name`` (blocks until engines join)."""
        ref = self._actors[0].open_weight_broadcast.remote(
            master_address, master_port, world_size, group_name, backend, timeout_s)
        self._call("open_weight_broadcast", [ref], timeout_s=timeout_s + 30.0, breaks=False)

    def broadcast_weights(self, group_name: str) -> str | None:
        """Every rank exports (a collective), rank 0 broadcasts; the checksum it sent."""
        return self._on_all("broadcast_weights", group_name, breaks=False)[0]

    def close_weight_broadcast(self, group_name: str | None = None) -> None:
        ref = self._actors[0].close_weight_broadcast.remote(group_name)
        self._call("close_weight_broadcast", [ref], timeout_s=30.0, breaks=False)

    def save_state(self, path: str | Path) -> Path:
        """Rank 0 writes model, optimizer and scheduler in the single-rank layout."""
        return Path(self._on_all("save_state", str(path))[0])

    def load_state(self, path: str | Path) -> None:
        """Every rank restores what :meth:`save_state` (of any world size) wrote."""
        self.global_step = self._on_all("load_state", str(path))[0]

    def apply(self, fn: Callable[[TorchTrainer], Any]) -> list[Any]:
        """``fn(trainer)`` on every rank, results in rank order (inspection, tests)."""
        return self._on_all("apply", fn)

    def shutdown(self) -> None:
        """Leave the process group where ranks still answer, then kill every rank."""
        if self._actors and self._broken is None:
            with contextlib.suppress(Exception):
                self._on_all("shutdown", timeout_s=10.0)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._actors, self._broken = [], "shut down"

    def release(self) -> list[Any]:
        """Leave the process group on every rank and hand back the rank actors, alive, for
        :meth:`start`'s ``actors`` (another configuration without new processes). A broken
        group, or a rank that fails to leave, is shut down instead (raises)."""
        try:
            self._on_all("release", timeout_s=30.0)
        except BaseException:
            self.shutdown()
            raise
        actors, self._actors, self._broken = self._actors, [], "released"
        return actors

    def _on_all(self, method: str, *args: Any, **call_kwargs: Any) -> list[Any]:
        """``TrainerRank.<method>(*args)`` on every rank; :meth:`_call`'s results."""
        return self._call(method, [getattr(a, method).remote(*args) for a in self._actors],
                          **call_kwargs)

    def _call(self, what: str, refs: list[Any], *, timeout_s: float | None = None,
              breaks: bool = True) -> list[Any]:
        """Results of one remote call per rank (ref ``i`` is rank ``i``), in rank order. Bounded
        by ``timeout_s``; a rank that dies or raises fails the call at once, naming it, and marks
        the group broken (``breaks=False``: only a rank that died does)."""
        if self._broken is not None:
            raise TrainerRankError(f"{what}: the trainer group is unusable ({self._broken}); "
                                   "shut it down and start a new one", [])
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results, errors, pending = [None] * len(refs), {}, list(refs)
        while pending:
            # After an error, a short grace for the others, to name the rank that died.
            left = min(deadline - time.monotonic(), _FAILURE_GRACE_S if errors else float("inf"))
            if left <= 0:
                break
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    results[rank_of[ref]] = ray.get(ref, timeout=0)
                except Exception as e:  # noqa: BLE001 - reported below, naming the rank
                    errors[rank_of[ref]] = e
        if errors:
            dead = {r: e for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)}
            first = dead or errors
            parts = [f"trainer rank {r} {'died' if r in dead else 'raised'}: {_cause(e)}"
                     for r, e in sorted(first.items())]
            if dead or breaks:
                self._broken = f"{what} failed on rank(s) {sorted(first)}"
            unusable = (" The group is unusable: shut it down and start a new one (from the "
                        "latest checkpoint)." if self._broken else "")
            raise TrainerRankError(f"{what} failed: {'; '.join(parts)}.{unusable}",
                                   sorted(first)) from next(iter(first.values()))
        if pending:
            late = sorted(rank_of[ref] for ref in pending)
            self._broken = f"{what} timed out on rank(s) {late}"
            raise TimeoutError(f"{what}: trainer rank(s) {late} did not answer within "
                               f"{timeout_s:.0f} s")
        return results


def _cause(e: BaseException) -> str:
    """The first line of a Ray error's cause (not Ray's whole wrapped traceback)."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1].rstrip('.') if text else ''}"
