"""The parallelism planner: from a model's shape, the sequence lengths and the device's memory,
recommend TP/PP/DP for the rollout and training planes, say why, and report the weight traffic
each sync moves between the two layouts (the rules, formulas and sources: docs/planner.md). A
vision-language model's tower (:mod:`rl_core.cluster.vision`) adds its weights, its activations
per image and its image tokens to each sequence; frozen, it has no grads or optimizer state.

    python -m rl_core.cluster.planner --model qwen2.5-7b --device mi300x --devices 8

Memory in GiB (nominal capacity read as GiB), bandwidth in GB/s per direction per device.
Every number is an estimate for choosing a layout, not a promise that a run will not OOM.
Pure standard-library arithmetic: never imports torch, Ray, Prefect or MLflow, never touches a
device or the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rl_core.cluster.shapes import (
    DEVICES,
    GB,
    GIB,
    MODEL_PRESETS,
    Device,
    ModelShape,
    estimate_params,
    fsdp_working_bytes,
    get_device,
    kv_bytes_per_token,
    load_model,
    training_activation_bytes,
)
from rl_core.cluster.vision import VisionPlan, VisionShape, vision_activation_bytes

__all__ = ["DEVICES", "MODEL_PRESETS", "MOE_DISPATCH_IMBALANCE", "Device", "ModelShape", "Plan",
           "Resharding", "RolloutPlan", "TrainingPlan", "VisionPlan", "VisionShape",
           "estimate_params", "format_plan", "fsdp_working_bytes", "get_device",
           "kv_bytes_per_token", "load_model", "main", "plan", "plan_to_dict", "resharding",
           "training_activation_bytes", "vision_activation_bytes"]


Placement = Literal["colocated", "disaggregated"]

# bf16 param 2 + bf16 grad 2 + fp32 master 4 + Adam m 4 + Adam v 4 (mixed precision), or
# fp32 param 4 + fp32 grad 4 + m 4 + v 4 (FSDP2 keeps fp32 shards): 16 bytes either way.
TRAIN_BYTES_PER_PARAM = 16
# Megatron with the distributed optimizer: bf16 weights 2 + fp32 main_grad 4 are split only
# by TP x PP; fp32 master + m + v (12) are split by every device.
MEGATRON_MODEL_BYTES_PER_PARAM, MEGATRON_OPTIM_BYTES_PER_PARAM = 6, 12
# A frozen parameter (a vision tower under model.freeze_vision) keeps its weight only, no grad
# or Adam state: FSDP2's fp32 shard (4), megatron's bf16 weight (2).
FROZEN_BYTES_PER_PARAM, MEGATRON_FROZEN_BYTES_PER_PARAM = 4, 2
# Qwen2-VL's default max_pixels (data.image_max_pixels): 1,280 tokens an image.
IMAGE_MAX_PIXELS = 28 * 28 * 1280
# MoE under expert parallelism: the all-to-all may hand a rank up to this multiple of its
# share of the routed tokens (routers are not perfectly balanced; megatron drops none).
MOE_DISPATCH_IMBALANCE = 2.0

# The published result the rollout rule rests on (see docs/planner.md).
TP1_RESULT = ("a published AMD/SGLang study of RL rollout on MI300X measured TP=1 with more DP "
              "replicas at 2.3-4.3x the rollout throughput of larger TP for a 7B model")


@dataclass(frozen=True)
class RolloutPlan:
    """The rollout plane's layout: ``dp`` SGLang engines of ``tp`` x ``pp`` devices each. Per
    device: ``weight_bytes`` = P * bytes / (tp * pp), ``kv_bytes`` = the KV pool
    (``mem_fraction_static`` * memory - weights). ``kv_tokens`` per replica = kv_bytes /
    :func:`kv_bytes_per_token`; ``concurrent_seqs`` = dp * (kv_tokens // seq_len) full-length
    sequences at once; ``waves`` = ceil(rollout_batch / concurrent_seqs)."""
    devices: int
    tp: int
    pp: int
    dp: int
    weight_bytes: int
    kv_bytes: int
    kv_tokens: int
    concurrent_seqs: int
    waves: int
    fits: bool
    mem_fraction_static: float


@dataclass(frozen=True)
class TrainingPlan:
    """The training plane's layout. ``backend``: ``fsdp2`` (grpoflow's torch backend) or
    ``megatron``; ``shard``: the FSDP shard group (``dp`` for a full shard, a node for hybrid
    sharding, 1 for megatron). Per device: ``state_bytes`` (weights, grads, optimizer),
    ``working_bytes`` (FSDP's gathered units), ``activation_bytes`` at ``micro_batch``.
    ``min_devices``: the fewest devices on which a full FSDP shard fits at micro-batch 1.
    ``offload_seconds`` (colocated only): moving the state to host memory and back per step.
    ``ep``: Megatron's expert parallelism (MoE; carved out of the ``dp`` ranks, 1: none)."""
    devices: int
    backend: str
    tp: int
    pp: int
    dp: int
    shard: int
    state_bytes: int
    working_bytes: int
    activation_bytes: int
    micro_batch: int
    max_tokens_per_device: int
    fits: bool
    min_devices: int | None
    offload_seconds: float = 0.0
    ep: int = 1


@dataclass(frozen=True)
class Resharding:
    """Bytes one weight sync moves from the training layout to the rollout layout (formulas:
    docs/planner.md). ``weight_bytes`` W: the full model in the rollout dtype, which every rollout
    replica needs (SGLang's broadcast path hands every rank full tensors). The training side first
    all-gathers full tensors inside the group that shards them (FSDP's shard group, megatron's TP
    group per stage), over NVLink / Infinity Fabric within a node, else the NIC.
    ``transfer_seconds``: colocated 0 (handed over in place, CUDA IPC); disaggregated one pipelined
    broadcast of W to all replicas. ``seconds``: gather + transfer, a bandwidth bound."""
    weight_bytes: int
    replicas: int
    bytes_to_rollout: int
    bytes_per_rollout_device: int
    gather_bytes_per_train_device: int
    gather_link: str
    gather_gbps: float
    gather_seconds: float
    link: str
    link_gbps: float
    transfer_seconds: float
    efficiency: float
    seconds: float


@dataclass(frozen=True)
class Plan:
    """A recommendation for both planes, with the reasons and the warnings. ``image_tokens``:
    each sequence's image tokens (a vision-language model; ``vision`` has the tower's share)."""
    model: ModelShape
    device: Device
    num_devices: int
    placement: str
    prompt_len: int
    response_len: int
    rollout_batch: int
    rollout: RolloutPlan
    training: TrainingPlan
    resharding: Resharding
    reasons: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    image_tokens: int = 0
    vision: VisionPlan | None = None

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.image_tokens + self.response_len


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _pow2_upto(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length())] if n >= 1 else []


def _tp_ok(m: ModelShape, tp: int) -> bool:
    """SGLang and Megatron split attention heads evenly; KV heads split or replicate."""
    return m.heads % tp == 0 and (m.kv_heads % tp == 0 or tp % m.kv_heads == 0)


def _plan_rollout(m: ModelShape, dev: Device, devices: int, *, seq_len: int, rollout_batch: int,
                  dtype_bytes: int, mem_fraction_static: float, min_kv_seqs: int,
                  reasons: list[str], warnings: list[str]) -> RolloutPlan:
    static, min_tokens = int(dev.memory_bytes * mem_fraction_static), min_kv_seqs * seq_len
    tps = [t for t in _pow2_upto(min(dev.max_tp, dev.devices_per_node, devices)) if _tp_ok(m, t)]
    candidates = [(t, 1) for t in tps]
    # Past a node's TP, SGLang's pipeline parallelism splits layers across nodes.
    candidates += [(tps[-1], p) for p in _pow2_upto(devices // tps[-1]) if 1 < p <= m.layers]

    def weights_at(tp: int, pp: int) -> int:
        return m.n_params * dtype_bytes // (tp * pp)

    def kv_token(tp: int, pp: int) -> int:
        return kv_bytes_per_token(m, tp=tp, pp=pp, dtype_bytes=dtype_bytes)

    choice = next(((tp, pp) for tp, pp in candidates
                   if static - weights_at(tp, pp) >= min_tokens * kv_token(tp, pp)), None)
    fits = choice is not None
    tp, pp = choice or candidates[-1]
    weights, dp = weights_at(tp, pp), devices // (tp * pp)
    kv_tokens = (kv := max(0, static - weights)) // kv_token(tp, pp)
    concurrent = dp * (kv_tokens // seq_len)
    waves = math.ceil(rollout_batch / concurrent) if concurrent else 0
    where = f"{mem_fraction_static:g} x {dev.memory_gib:g} GiB = {_gib(static)} static memory"
    min_kv = f"a KV budget for {min_kv_seqs} sequences of {seq_len} tokens"
    if not fits:
        warnings.append(f"rollout does not fit: at TP={tp} PP={pp} the weights take "
                        f"{_gib(weights)} of {where} per device, leaving less than {min_kv}; use "
                        "more or larger devices, fp8 weights, or a shorter response_len")
    elif tp == 1 and pp == 1:
        more = (", so every device runs its own engine; larger TP would add an all-reduce per "
                "layer per decoded token and leave fewer schedulers; " + TP1_RESULT)
        reasons.append(f"rollout TP=1, DP={dp}: the weights ({_gib(weights)}) and {min_kv} fit "
                       f"one device's {where}" + (more if dp > 1 else ""))
    else:
        ptp, ppp = candidates[candidates.index((tp, pp)) - 1]
        w = weights_at(ptp, ppp)
        reasons.append(
            f"rollout TP={tp}" + (f" PP={pp}" if pp > 1 else "") + f", DP={dp}: at "
            f"TP={ptp}" + (f" PP={ppp}" if ppp > 1 else "") + f" the weights ({_gib(w)} per "
            f"device) leave {_gib(max(0, static - w))} of {where} for KV, less than {min_kv} "
            f"({_gib(min_tokens * kv_token(ptp, ppp))})")
    if devices % (tp * pp):
        warnings.append(f"{devices % (tp * pp)} of {devices} rollout devices stay idle: "
                        f"{devices} is not a multiple of TP x PP = {tp * pp}")
    if fits and waves > 1:
        warnings.append(
            f"the KV cache holds {concurrent} sequences of {seq_len} tokens at once across "
            f"{dp} replica(s); a rollout batch of {rollout_batch} runs in >= {waves} waves "
            "(more rollout devices, a shorter response_len or an fp8 KV cache would help)")
    return RolloutPlan(devices=devices, tp=tp, pp=pp, dp=dp, weight_bytes=weights, kv_bytes=kv,
                       kv_tokens=kv_tokens, concurrent_seqs=concurrent, waves=waves, fits=fits,
                       mem_fraction_static=mem_fraction_static)


def _plan_training(m: ModelShape, dev: Device, devices: int, *, seq_len: int, rollout_batch: int,
                   dtype_bytes: int, headroom: float, max_micro_batch: int, reasons: list[str],
                   warnings: list[str], frozen: int = 0, vision_act: Any = None) -> TrainingPlan:
    """``frozen``: parameters without grads or optimizer state (a frozen vision tower);
    ``vision_act(micro_batch, tp)``: the tower's activations, added to the language model's."""
    usable, p = int(dev.memory_bytes * headroom), m.n_params
    node, working = min(dev.devices_per_node, devices), fsdp_working_bytes(m, dtype_bytes)

    def act(mb: int, tp: int = 1) -> int:
        return training_activation_bytes(m, micro_batch=mb, seq_len=seq_len, tp=tp,
                                         dtype_bytes=dtype_bytes,
                                         dispatch_imbalance=MOE_DISPATCH_IMBALANCE) + (
            vision_act(mb, tp) if vision_act else 0)

    def fsdp_state(shard: int) -> int:
        return (TRAIN_BYTES_PER_PARAM * (p - frozen) + FROZEN_BYTES_PER_PARAM * frozen) // shard

    def megatron_state(tp: int, pp: int, ep: int = 1) -> int:
        # Experts are split by EP (never by TP: expert TP 1), the rest by TP; both by PP.
        dense, experts = p - m.expert_params - frozen, m.expert_params
        return (MEGATRON_MODEL_BYTES_PER_PARAM * dense // (tp * pp)
                + MEGATRON_FROZEN_BYTES_PER_PARAM * frozen // (tp * pp)
                + MEGATRON_MODEL_BYTES_PER_PARAM * experts // (ep * pp)
                + MEGATRON_OPTIM_BYTES_PER_PARAM * (p - frozen) // devices)

    spare, min_devices = usable - working - act(1), None
    if spare > 0:
        need, per_node = math.ceil(fsdp_state(1) / spare), dev.devices_per_node
        min_devices = (next(n for n in _pow2_upto(per_node) + [per_node] if n >= need)
                       if need <= per_node else math.ceil(need / per_node) * per_node)

    def result(backend: str, tp: int, pp: int, shard: int, state: int, work: int,
               fits: bool = True, ep: int = 1) -> TrainingPlan:
        dp = devices // (tp * pp)
        cap = max(1, min(max_micro_batch, math.ceil(rollout_batch / dp)))
        mb = max([b for b in _pow2_upto(cap) if state + work + act(b, tp) <= usable],
                 default=0) if fits else 0
        return TrainingPlan(
            devices=devices, backend=backend, tp=tp, pp=pp, dp=dp, shard=shard,
            state_bytes=state, working_bytes=work, activation_bytes=act(max(mb, 1), tp),
            micro_batch=mb, max_tokens_per_device=mb * seq_len, fits=fits and mb > 0,
            min_devices=min_devices, ep=ep)

    state_txt = (f"16 bytes/param x {(p - frozen) / 1e9:.2f}B params" + (
        f" + {FROZEN_BYTES_PER_PARAM} x {frozen / 1e9:.2f}B frozen" if frozen else "")
        + f" = {_gib(fsdp_state(1))}")
    # 0. Mixture of experts: Megatron with expert parallelism (TP 1, PP across nodes).
    if m.experts and (moe := _plan_moe(m, dev, devices, usable, act, megatron_state, reasons)):
        return result("megatron", 1, moe[0], 1, megatron_state(1, *moe), 0, ep=moe[1])
    if m.experts:
        warnings.append(f"no megatron expert-parallel layout (TP 1, EP within a node, PP "
                        f"across nodes) fits {devices} {dev.name} device(s); the dense rules "
                        "below decide (FSDP2 runs the experts one by one: slow)")
    # 1. FSDP2 within a node (full shard on one node; hybrid shard across nodes).
    if fsdp_state(node) + working + act(1) <= usable:
        plan_ = result("fsdp2", 1, 1, node, fsdp_state(node), working)
        how = (f"FSDP2 full shard over {devices} device(s)" if node == devices
               else f"FSDP2 hybrid shard: shard within each {node}-device node, replicate across "
               f"{devices // node} nodes (per-layer all-gathers stay on {dev.interconnect})")
        reasons.append(
            f"training {how}: the weights, grads and Adam states ({state_txt}) take "
            f"{_gib(plan_.state_bytes)} per device, plus {_gib(working)} of gathered layers; "
            f"micro-batch {plan_.micro_batch} x {seq_len} tokens fits "
            f"{headroom:g} x {dev.memory_gib:g} GiB")
        return plan_
    # 2. The state fits a node but one micro-batch's activations do not: TP splits them.
    if fsdp_state(node) + working <= usable:
        for tp in _pow2_upto(min(dev.max_tp, node))[1:]:
            if _tp_ok(m, tp) and megatron_state(tp, 1) + act(1, tp) <= usable:
                reasons.append(
                    f"training megatron TP={tp}: the state fits when sharded, but one "
                    f"sequence of {seq_len} tokens needs {_gib(act(1))} of activations; TP "
                    f"with sequence parallelism splits them {tp} ways")
                return result("megatron", tp, 1, 1, megatron_state(tp, 1), 0)
        warnings.append(f"training does not fit: one sequence of {seq_len} tokens needs "
                        f"{_gib(act(1))} of activations even with recompute; use context "
                        "parallelism or a shorter response_len")
        return result("fsdp2", 1, 1, node, fsdp_state(node), working, fits=False)
    # 3. Across nodes: TP within a node, PP across nodes, the optimizer over everything.
    if devices > node:
        tp = max(t for t in _pow2_upto(min(dev.max_tp, node)) if _tp_ok(m, t))
        for pp in range(2, devices // tp + 1):
            if (not devices % (tp * pp) and not m.layers % pp
                    and megatron_state(tp, pp) + act(1, tp) <= usable):
                reasons.append(
                    f"training megatron TP={tp} PP={pp} DP={devices // (tp * pp)}: the state "
                    f"({state_txt}) does not fit one node even fully sharded "
                    f"({_gib(fsdp_state(node))} per device); TP inside a node and PP across "
                    f"nodes split the bf16 weights and fp32 grads (6 bytes/param) {tp * pp} "
                    f"ways and the distributed optimizer splits Adam (12 bytes/param) over "
                    f"all {devices}: {_gib(megatron_state(tp, pp))} per device")
                return result("megatron", tp, pp, 1, megatron_state(tp, pp), 0)
        if fsdp_state(devices) + working + act(1) <= usable:
            reasons.append(
                f"training FSDP2 full shard over all {devices} devices: the state "
                f"({state_txt}) needs every device ({_gib(fsdp_state(devices))} each); "
                "per-layer all-gathers cross the network, so expect slow steps")
            return result("fsdp2", 1, 1, devices, fsdp_state(devices), working)
    more = (f"needs >= {min_devices} {dev.name} devices" if min_devices
            else "cannot fit at any scale at this sequence length")
    warnings.append(
        f"training does not fit on {devices} device(s): the state ({state_txt}) fully sharded "
        f"is {_gib(fsdp_state(devices))} per device of {headroom:g} x {dev.memory_gib:g} GiB; "
        f"{more} (or offload the optimizer to host memory)")
    return result("fsdp2", 1, 1, devices, fsdp_state(devices), working, fits=False)


def _plan_moe(m: ModelShape, dev: Device, devices: int, usable: int, act: Any,
              megatron_state: Any, reasons: list[str]) -> tuple[int, int] | None:
    """``(pp, ep)`` for an MoE model, or None when no such layout fits (the dense rules then
    decide). EP: the largest power of two that divides the experts and the data-parallel
    ranks within a node (the token all-to-all stays on NVLink / Infinity Fabric); PP doubles
    across nodes until the state and one sequence's activations fit. TP stays 1: megatron
    trains MoE layers under TP only with sequence parallelism (Transformer Engine's spec)."""
    node = min(dev.devices_per_node, devices)
    for pp in (x for x in _pow2_upto(devices) if not m.layers % x and not devices % x):
        dp = devices // pp
        ep = max(e for e in _pow2_upto(min(node, dp)) if not m.experts % e and not dp % e)
        state = megatron_state(1, pp, ep)
        if state + act(1) > usable:
            continue
        experts_bytes = MEGATRON_MODEL_BYTES_PER_PARAM * m.expert_params // (ep * pp)
        reasons.append(
            f"training megatron EP={ep}" + (f" PP={pp}" if pp > 1 else "") + f" DP={dp}: a "
            f"mixture of experts ({m.expert_params / 1e9:.2f}B of {m.n_params / 1e9:.2f}B "
            f"params in {m.experts} experts per layer) shards its experts {ep} ways "
            f"({m.experts // ep} per device, {_gib(experts_bytes)} of bf16 weights and fp32 "
            f"grads) with the token all-to-all on {dev.interconnect}; the distributed optimizer "
            f"splits Adam (12 bytes/param) over all {devices}: {_gib(state)} per device; TP 1 "
            "(megatron trains MoE layers under TP only with sequence parallelism, which needs "
            "the Transformer Engine spec)")
        return pp, ep
    return None


def resharding(m: ModelShape, dev: Device, *, placement: Placement, num_devices: int,
               rollout: RolloutPlan, training: TrainingPlan, dtype_bytes: int,
               efficiency: float = 0.8, frozen: int = 0) -> Resharding:
    """The weight traffic of one sync (see :class:`Resharding` for the formulas). ``frozen``
    parameters (a frozen vision tower) stay out of it: the engines keep what they loaded."""
    w = (m.n_params - frozen) * dtype_bytes
    k = training.shard if training.backend == "fsdp2" else training.tp
    gather = w // training.pp * (k - 1) // k
    if training.backend == "megatron" and training.ep > 1:  # experts over EP, the rest over TP
        w_exp = m.expert_params * dtype_bytes
        gather = ((w - w_exp) // training.pp * (k - 1) // k
                  + w_exp // training.pp * (training.ep - 1) // training.ep)
        k = max(k, training.ep)
    nic = ("the network (per-device NIC)", dev.network_gbps)
    local = (dev.interconnect, dev.link_gbps)
    gather_link, gather_gbps = nic if k > dev.devices_per_node else local
    if placement == "colocated":
        link, link_gbps, transfer = "in place (same device)", 0.0, 0.0
    else:
        link, link_gbps = nic if num_devices > dev.devices_per_node else local
        transfer = w / (link_gbps * GB * efficiency)
    gather_s = gather / (gather_gbps * GB * efficiency)
    return Resharding(
        weight_bytes=w, replicas=rollout.dp, bytes_to_rollout=w * rollout.dp,
        bytes_per_rollout_device=w // (rollout.tp * rollout.pp),
        gather_bytes_per_train_device=gather, gather_link=gather_link, gather_gbps=gather_gbps,
        gather_seconds=gather_s, link=link, link_gbps=link_gbps, transfer_seconds=transfer,
        efficiency=efficiency, seconds=gather_s + transfer)


def plan(model: ModelShape | str, device: Device | str, num_devices: int, *,
         prompt_len: int = 1024, response_len: int = 2048, rollout_batch: int = 512,
         placement: Placement = "colocated", rollout_devices: int | None = None,
         mem_fraction_static: float = 0.85, headroom: float = 0.9, min_kv_seqs: int = 32,
         max_micro_batch: int = 64, link_efficiency: float = 0.8,
         images_per_sample: int | None = None, image_max_pixels: int = IMAGE_MAX_PIXELS,
         freeze_vision: bool = True) -> Plan:
    """Recommend a layout for both planes. ``rollout_batch``: sequences generated per step (prompts
    x samples each). ``placement``: ``colocated`` (both planes on all devices, taking turns: each
    frees its memory while the other runs, as slime and verl do) or ``disaggregated`` (rollout gets
    ``rollout_devices``, default half; training the rest). ``mem_fraction_static``: SGLang's share
    of memory for weights + KV pool (the rest: activations, CUDA graphs). ``headroom``: the share
    training may fill. ``min_kv_seqs``: the KV budget (whole sequences) below which TP grows.
    A vision-language model (``model.vision``): each sequence carries ``images_per_sample``
    images (None: 1) of ``image_max_pixels`` (``data.image_max_pixels``), whose tokens join its
    length (KV, activations); ``freeze_vision`` (``model.freeze_vision``): the tower keeps its
    weights only and stays out of the weight sync (:class:`VisionPlan`)."""
    m = load_model(model) if isinstance(model, str) else model
    dev = get_device(device) if isinstance(device, str) else device
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if prompt_len < 1 or response_len < 1 or rollout_batch < 1:
        raise ValueError("prompt_len, response_len and rollout_batch must be >= 1")
    if not 0 < mem_fraction_static < 1 or not 0 < headroom <= 1:
        raise ValueError("mem_fraction_static must be in (0, 1) and headroom in (0, 1]")
    if placement == "colocated":
        n_roll = n_train = num_devices
        if rollout_devices not in (None, num_devices):
            raise ValueError("rollout_devices applies to placement='disaggregated' only")
    elif placement == "disaggregated":
        n_roll = num_devices // 2 if rollout_devices is None else rollout_devices
        n_train = num_devices - n_roll
        if n_roll < 1 or n_train < 1:
            raise ValueError(f"disaggregated placement needs >= 1 device per plane: num_devices="
                             f"{num_devices}, rollout_devices={n_roll}")
    else:
        raise ValueError(f"placement must be 'colocated' or 'disaggregated', got {placement!r}")
    v = m.vision
    images = (1 if images_per_sample is None else images_per_sample) if v else 0
    if images < 0 or image_max_pixels < 1:
        raise ValueError("images_per_sample must be >= 0 and image_max_pixels >= 1")
    image_tokens = images * v.tokens_per_image(image_max_pixels) if v else 0
    frozen = m.vision_params if v and freeze_vision else 0
    dtype_bytes, seq_len = (dev.dtype_bytes or m.dtype_bytes,
                            prompt_len + image_tokens + response_len)
    reasons, warnings = [], []

    def vision_act(mb: int, tp: int) -> int:
        return vision_activation_bytes(v, images=mb * images, max_pixels=image_max_pixels,
                                       trainable=not frozen, tp=tp, dtype_bytes=dtype_bytes)

    common = dict(seq_len=seq_len, rollout_batch=rollout_batch, dtype_bytes=dtype_bytes,
                  reasons=reasons, warnings=warnings)
    roll = _plan_rollout(m, dev, n_roll, mem_fraction_static=mem_fraction_static,
                         min_kv_seqs=min_kv_seqs, **common)
    train = _plan_training(m, dev, n_train, headroom=headroom, max_micro_batch=max_micro_batch,
                           frozen=frozen, vision_act=vision_act if images else None, **common)
    sync = resharding(m, dev, placement=placement, num_devices=num_devices, rollout=roll,
                      training=train, dtype_bytes=dtype_bytes, efficiency=link_efficiency,
                      frozen=frozen)
    vision = _vision_plan(v, train, roll, images=images, max_pixels=image_max_pixels,
                          frozen=bool(frozen), dtype_bytes=dtype_bytes,
                          act=vision_act(max(train.micro_batch, 1), train.tp) if images else 0
                          ) if v else None
    if placement == "colocated":
        offload = 2 * train.state_bytes / (dev.pcie_gbps * GB * link_efficiency)
        train = dataclasses.replace(train, offload_seconds=offload)
        reasons.insert(0, f"colocated: both planes use all {num_devices} device(s) in turn; the "
                       "engines release weights and KV cache while training runs and the trainer "
                       f"moves its state ({_gib(train.state_bytes)} per device) to host memory "
                       f"while generation runs (~{offload:.1f} s per step there and back over "
                       f"PCIe at {dev.pcie_gbps:g} GB/s x {link_efficiency:g}), so each plane "
                       "sees the whole device")
    else:
        reasons.insert(0, f"disaggregated: {n_roll} device(s) generate while {n_train} train"
                       + (" (half each by default; set rollout_devices)"
                          if rollout_devices is None else ""))
    reasons.append(
        f"weight sync: {_gib(sync.weight_bytes)} to each of {roll.dp} rollout replica(s) "
        f"({_gib(sync.bytes_to_rollout)} in all; {_gib(sync.bytes_per_rollout_device)} kept "
        f"per rollout device), ~{sync.seconds:.2f} s at the links' bandwidth")
    reasons += [vision.reason()] if vision else []
    return Plan(model=m, device=dev, num_devices=num_devices, placement=placement,
                prompt_len=prompt_len, response_len=response_len, rollout_batch=rollout_batch,
                rollout=roll, training=train, resharding=sync, reasons=tuple(reasons),
                warnings=tuple(warnings), image_tokens=image_tokens, vision=vision)


def _vision_plan(v: VisionShape, t: TrainingPlan, r: RolloutPlan, *, images: int,
                 max_pixels: int, frozen: bool, dtype_bytes: int, act: int) -> VisionPlan:
    """The vision tower's share of the plan (:class:`VisionPlan`)."""
    pv, mega = v.params, (MEGATRON_FROZEN_BYTES_PER_PARAM if frozen
                          else MEGATRON_MODEL_BYTES_PER_PARAM)
    state = ((FROZEN_BYTES_PER_PARAM if frozen else TRAIN_BYTES_PER_PARAM) * pv // t.shard
             if t.backend == "fsdp2" else mega * pv // (t.tp * t.pp)
             + (0 if frozen else MEGATRON_OPTIM_BYTES_PER_PARAM * pv // t.devices))
    return VisionPlan(
        params=pv, trainable=not frozen, images_per_sample=images, max_pixels=max_pixels,
        patches_per_image=v.patches_per_image(max_pixels),
        tokens_per_image=v.tokens_per_image(max_pixels),
        rollout_weight_bytes=pv * dtype_bytes // (r.tp * r.pp), train_state_bytes=state,
        train_activation_bytes=act, sync_bytes=0 if frozen else pv * dtype_bytes)


def _sync_how(s: Resharding) -> str:
    parts = []
    if s.gather_bytes_per_train_device:
        parts.append(f"all-gather {_gib(s.gather_bytes_per_train_device)} per training device "
                     f"over {s.gather_link} at {s.gather_gbps:g} GB/s x {s.efficiency:g}: "
                     f"{s.gather_seconds:.2f} s")
    parts.append(f"broadcast {_gib(s.weight_bytes)} over {s.link} at {s.link_gbps:g} GB/s x "
                 f"{s.efficiency:g}: {s.transfer_seconds:.2f} s" if s.transfer_seconds
                 else "engines take their slices in place")
    return " + ".join(parts)


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (bytes as integers; ``*_gib`` copies for people)."""
    out: dict[str, Any] = {
        "model": {**dataclasses.asdict(p.model), "params": p.model.n_params},
        "device": dataclasses.asdict(p.device), "num_devices": p.num_devices,
        "placement": p.placement, "prompt_len": p.prompt_len, "response_len": p.response_len,
        "seq_len": p.seq_len, "image_tokens": p.image_tokens, "rollout_batch": p.rollout_batch}
    out["vision"] = None  # a text model's
    for key in ("rollout", "training", "resharding") + (("vision",) if p.vision else ()):
        section = out[key] = dataclasses.asdict(getattr(p, key))
        section.update({k.replace("bytes", "gib"): round(v / GIB, 2)
                        for k, v in section.items() if "bytes" in k and isinstance(v, int)})
    out["reasons"], out["warnings"] = list(p.reasons), list(p.warnings)
    return out


def format_plan(p: Plan) -> str:
    """The plan as a table with its reasons and warnings, for people."""
    m, d, r, t, s = p.model, p.device, p.rollout, p.training, p.resharding
    rollout_mem = f"{_gib(r.weight_bytes)} weights + {_gib(r.kv_bytes)} KV"
    rollout_note = (f"{r.kv_tokens:,} KV tokens/replica, {r.concurrent_seqs} seqs at once"
                    if r.fits else "DOES NOT FIT")
    train_mem = (
        f"{_gib(t.state_bytes)} state + {_gib(t.working_bytes + t.activation_bytes)} transient")
    train_note = (t.backend + (f" shard {t.shard}" if t.backend == "fsdp2" else "")
                  + (f" EP {t.ep}" if t.ep > 1 else "")
                  + f", micro-batch {t.micro_batch} ({t.max_tokens_per_device:,} tokens)"
                  if t.fits else f"{t.backend}, DOES NOT FIT"
                  + (f" (needs >= {t.min_devices} devices)" if t.min_devices else ""))
    lines = [
        f"{m.name} ({m.n_params / 1e9:.2f}B params) on {p.num_devices} x {d.label} "
        f"({d.memory_gib:g} GiB, {d.interconnect}), {p.placement}",
        f"sequences: {p.prompt_len} prompt + "
        + (f"{p.image_tokens} image + " if p.vision else "")
        + f"{p.response_len} response = {p.seq_len} tokens; rollout batch {p.rollout_batch}", "",
        f"{'plane':<9}{'devices':>8}{'TP':>4}{'PP':>4}{'DP':>5}  {'per device':<40}notes",
        *(f"{n:<9}{x.devices:>8}{x.tp:>4}{x.pp:>4}{x.dp:>5}  {mem:<40}{note}" for n, x, mem, note
          in (("rollout", r, rollout_mem, rollout_note), ("training", t, train_mem, train_note))),
        "",
        f"weight sync: {_gib(s.weight_bytes)} x {s.replicas} replica(s) = "
        f"{_gib(s.bytes_to_rollout)}; {_gib(s.bytes_per_rollout_device)} kept per rollout "
        f"device; ~{s.seconds:.2f} s",
        f"  {_sync_how(s)}", *([p.vision.describe()] if p.vision else []), "", "why:",
        *(f"  - {x}" for x in p.reasons)]
    if p.warnings:
        lines += ["warnings:", *(f"  ! {x}" for x in p.warnings)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``grpoflow plan``: print a plan (a table, or JSON with ``--json``). 2 on bad input."""
    ap = argparse.ArgumentParser(
        prog="grpoflow plan", description="Recommend TP/PP/DP for the rollout and training planes.")
    ap.add_argument("--model", required=True,
                    help=f"preset ({', '.join(MODEL_PRESETS)}) or model dir")
    ap.add_argument("--device", required=True, help=", ".join(DEVICES))
    ap.add_argument("--devices", type=int, default=8, help="number of devices (default 8)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--response-len", type=int, default=2048)
    ap.add_argument("--rollout-batch", type=int, default=512, help="sequences per step")
    ap.add_argument("--placement", choices=("colocated", "disaggregated"), default="colocated")
    ap.add_argument("--rollout-devices", type=int, help="disaggregated: rollout's share")
    ap.add_argument("--memory-gib", type=float, help="override the device memory (CPU RAM)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--images-per-sample", type=int, help="vision-language model (default 1)")
    ap.add_argument("--image-max-pixels", type=int, default=IMAGE_MAX_PIXELS,
                    help=f"data.image_max_pixels (default {IMAGE_MAX_PIXELS:,})")
    ap.add_argument("--train-vision", action="store_true",
                    help="model.freeze_vision: false (the vision tower trains too)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)  # None: sys.argv[1:]
    knobs = ("prompt_len", "response_len", "rollout_batch", "placement", "rollout_devices",
             "mem_fraction_static", "images_per_sample", "image_max_pixels")  # plan()'s keywords
    try:
        result = plan(load_model(args.model), get_device(args.device, memory_gib=args.memory_gib),
                      args.devices, freeze_vision=not args.train_vision,
                      **{k: getattr(args, k) for k in knobs})
    except ValueError as e:
        print(f"grpoflow plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(result), indent=2) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
