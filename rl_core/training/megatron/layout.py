"""``train.megatron.tp/pp/ep: auto``: the parallelism planner's layout, taken at trainer start.

``auto`` takes :mod:`rl_core.cluster.planner`'s recommendation (``grpoflow plan``) for the
model, the device and the trainer ranks; an explicit value wins. The device is the host on
CPU; on GPUs the one this process sees (``detect_platform``), matched by name to the planner's
table (an unknown one fails with the fix). docs/megatron.md, docs/planner.md.
"""

from __future__ import annotations

from pathlib import Path

from rl_core.config import ExperimentConfig, MegatronConfig

__all__ = ["planner_device", "resolve_layout"]


def planner_device(cfg: ExperimentConfig) -> str:
    """The planner's name for the trainer's device (``cpu`` without GPUs)."""
    if cfg.cluster.gpus_per_trainer <= 0:
        return "cpu"
    from rl_core.cluster.planner import DEVICES
    from rl_core.cluster.platform import detect_platform

    found = detect_platform().devices
    name = found[0].name.lower() if found else ""
    # Longest key first: "a100-80gb" before "a100", "mi325x" is not "mi300x".
    for key in sorted(DEVICES, key=len, reverse=True):
        if key != "cpu" and key.split("-")[0] in name.replace(" ", ""):
            return key
    raise ValueError(
        f"train.megatron.tp/pp: auto needs the planner's device, and this process sees "
        f"{found[0].name if found else 'no GPU'!r}, which it does not know; set "
        "train.megatron.tp and train.megatron.pp explicitly (grpoflow plan --device ... "
        "prints a layout)")


def resolve_layout(
    cfg: ExperimentConfig, model_path: str | Path, *, device: str | None = None
) -> tuple[MegatronConfig, str | None]:
    """``cfg.train.megatron`` with ``auto`` replaced by the planner's TP/PP/EP, and a line
    saying what the planner chose and why (None when nothing was ``auto``)."""
    m = cfg.train.megatron
    if "auto" not in (m.tp, m.pp, m.ep):
        return m, None
    from rl_core.cluster.planner import load_model, plan

    ranks = cfg.cluster.trainer_ranks if cfg.cluster.mode == "ray" else 1
    device = device or planner_device(cfg)
    p = plan(load_model(str(model_path)), device, ranks, prompt_len=cfg.data.max_prompt_tokens,
             response_len=cfg.rollout.max_new_tokens,
             rollout_batch=cfg.train.prompts_per_step * cfg.rollout.n_samples).training
    tp = (p.tp if p.backend == "megatron" else 1) if m.tp == "auto" else m.tp
    pp = (p.pp if p.backend == "megatron" else 1) if m.pp == "auto" else m.pp
    ep = (p.ep if p.backend == "megatron" else 1) if m.ep == "auto" else m.ep
    if ranks % (tp * pp) or (ranks // pp) % ep:
        raise ValueError(f"train.megatron: the planner's tp={tp} x pp={pp} (ep={ep}) does not "
                         f"divide the {ranks} trainer ranks; set train.megatron.tp/pp/ep "
                         "explicitly")
    how = (f"the planner's {p.backend} layout on {ranks} x {device}: tp={tp}, pp={pp}, "
           f"dp={ranks // (tp * pp)}" + (f", ep={ep}" if ep > 1 else "")
           + f" ({'fits' if p.fits else 'does NOT fit'}: "
           f"{p.state_bytes / 2**30:.1f} GiB state per device)")
    return m.model_copy(update={"tp": tp, "pp": pp, "ep": ep}), how
