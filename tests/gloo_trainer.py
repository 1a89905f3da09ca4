"""A stand-in trainer rank 0 for the weight-sync tests, run as its own process.

``python tests/gloo_trainer.py WEIGHTS.safetensors PORT GROUP WORLD_SIZE TIMEOUT_S`` hosts a
gloo group on 127.0.0.1:PORT (the rendezvous SGLang's trainers use), prints ``ready`` just
before joining, and broadcasts every tensor of the file in sorted-name order. Imports only
torch, safetensors and rl_core.weight_sync, so it starts fast.
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file

from rl_core.weight_sync.process_group import (
    broadcast_named_tensors,
    destroy_process_group,
    init_custom_process_group,
)


def main(argv: list[str]) -> None:
    weights_file, port, group_name, world_size, timeout_s = argv
    torch.set_num_threads(1)
    named = load_file(weights_file)
    print("trainer: ready", flush=True)
    pg = init_custom_process_group(
        master_address="127.0.0.1",
        master_port=int(port),
        rank=0,
        world_size=int(world_size),
        group_name=group_name,
        backend="gloo",
        timeout_s=float(timeout_s),
    )
    broadcast_named_tensors(sorted(named.items()), pg, timeout_s=float(timeout_s))
    destroy_process_group(pg)
    print("trainer: broadcast", len(named), "tensors", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
