"""Deterministic faults in an engine's weight loading, to test the sync's behavioural probe.

Each fault leaves the bytes right where a checksum looks and the behaviour wrong, as the bugs
users report do (a wrong name mapping, a fused-expert slice, an adapter not applied, a derived
cache not dropped). ``GRPOFLOW_SYNC_FAULTS=FILE`` (tests only): FILE holds a JSON list of
``{"kind", "version", "times"}``; the first ``times`` loads of weights labelled ``version``
claim the entry, under a file lock so that engines in several processes never claim one twice,
and append ``{"kind", "version", "pid"}`` to ``FILE.claims``. Kinds (:data:`KINDS`):

- ``permute``: the rows of the first attention ``q_proj`` come in reversed order;
- ``transpose``: the first attention ``o_proj`` (square) is transposed;
- ``swap_experts``: experts 0 and 1 of the first MoE layer trade places;
- ``stale_cache``: what the engine derived from the old weights (the slot layout's packed
  matrices) is kept;
- ``lora_off``: a LoRA adapter is accepted (its checksum is the sent one) but never applied.

A corruption is applied when the engine resumes after the load, after its checksum was taken
and verified: the checksum still matches.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

__all__ = ["FAULTS_ENV", "KINDS", "claim", "corrupt"]

FAULTS_ENV = "GRPOFLOW_SYNC_FAULTS"
KINDS = ("permute", "transpose", "swap_experts", "stale_cache", "lora_off")
CORRUPTING = ("permute", "transpose", "swap_experts")


def claim(version: str | int | None, kinds: tuple[str, ...],
          accept: Callable[[str], bool] = lambda kind: True) -> str | None:
    """The kind of the fault planned for this load of ``version`` among ``kinds`` (and that
    ``accept`` takes: a bucket that does not hold the weight a fault hits leaves it), if any."""
    path = os.environ.get(FAULTS_ENV)
    if not path or version is None:
        return None
    plan = Path(path)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        entries = json.loads(plan.read_text())
        for entry in entries:
            if (str(entry["version"]) == str(version) and entry["kind"] in kinds
                    and entry.get("times", 1) > 0 and accept(entry["kind"])):
                entry["times"] = entry.get("times", 1) - 1
                plan.write_text(json.dumps(entries))
                with open(f"{path}.claims", "a") as claims:
                    claims.write(json.dumps({"kind": entry["kind"], "version": str(version),
                                             "pid": os.getpid()}) + "\n")
                return str(entry["kind"])
    return None


def target(kind: str, model: torch.nn.Module) -> str:
    """The weight corrupting fault ``kind`` hits (for ``swap_experts``: the first layer's
    experts, a name prefix)."""
    names = [n for n, _ in model.named_parameters()]
    suffix = {"permute": "self_attn.q_proj.weight", "transpose": "self_attn.o_proj.weight",
              "swap_experts": ".experts."}[kind]
    found = next((n for n in names if (suffix in n if kind == "swap_experts"
                                       else n.endswith(suffix))), None)
    if found is None:
        raise ValueError(f"fault {kind!r}: the model has no weight named *{suffix}*")
    return found.split(".experts.")[0] + ".experts." if kind == "swap_experts" else found


def touches(kind: str, model: torch.nn.Module, names: Iterable[str]) -> bool:
    """Whether weights ``names`` (a load, or one bucket of it) hold what ``kind`` hits."""
    hit = target(kind, model)
    return any(n.startswith(hit) for n in names) if hit.endswith(".") else hit in set(names)


def corrupt(kind: str, model: torch.nn.Module) -> str:
    """Apply corrupting fault ``kind`` to ``model``'s weights in place; the weight it hit."""
    named, hit = dict(model.named_parameters()), target(kind, model)
    with torch.no_grad():
        if kind == "permute":
            named[hit].copy_(named[hit].flip(0).clone())
        elif kind == "transpose":
            named[hit].copy_(named[hit].t().clone())
        elif kind == "swap_experts":
            fused = [n for n in named if n.startswith(hit) and n.endswith("_proj")]
            if fused:  # transformers 5: (experts, ...) tensors
                for n in fused:
                    named[n][[0, 1]] = named[n][[1, 0]].clone()
            else:  # experts one by one: <layer>.experts.<e>.<proj>.weight
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    a, b = named[f"{hit}0.{proj}.weight"], named[f"{hit}1.{proj}.weight"]
                    saved = a.clone()
                    a.copy_(b)
                    b.copy_(saved)
        else:
            raise ValueError(f"fault {kind!r} does not corrupt weights (kinds: {CORRUPTING})")
    return hit
