"""Test helpers over the SGLang client and the engine pool: groups of samples with one seed
each (what :func:`rl_core.grpo.rollout_groups` asks a plane for) and a weight update from
disk through the pool's pause -> flush -> update -> continue."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rl_core.types import Sample


async def agenerate_groups(client: Any, prompts: Sequence[Sequence[int]], n: int,
                           params: dict[str, Any], seeds: Sequence[Sequence[int]] | None = None,
                           ) -> list[Sample]:  # fmt: skip
    """``n`` samples per prompt, prompt-major, one request each (``client``: async)."""
    if seeds is not None and (len(seeds) != len(prompts) or any(len(s) != n for s in seeds)):
        raise ValueError(f"seeds must be {len(prompts)} lists of {n} seeds")
    calls = [client.generate(p, {**params, **({"sampling_seed": seeds[i][j]} if seeds else {})})
             for i, p in enumerate(prompts) for j in range(n)]  # fmt: skip
    return list(await asyncio.gather(*calls))


def generate_groups(client: Any, prompts: Sequence[Sequence[int]], n: int,
                    params: dict[str, Any], seeds: Sequence[Sequence[int]] | None = None,
                    ) -> list[Sample]:  # fmt: skip
    """:func:`agenerate_groups` for a :class:`~rl_core.rollout.client.SyncSGLangClient`."""
    return client.run(agenerate_groups(client.aio, prompts, n, params, seeds))


def update_from_disk(pool: Any, version: int | str, path: Any, timeout_s: float = 120) -> None:
    """Every engine of ``pool`` to the weights in ``path`` as ``version``; a restarted engine
    is re-synced from there (what :class:`~rl_core.weight_sync.transports.DiskSync` does)."""
    with pool.paused(timeout_s=timeout_s) as urls:
        pool.each(urls, "update_weights_from_disk", lambda aio, u: aio.update_weights_from_disk(
            str(path), version, url=u, timeout_s=timeout_s))  # fmt: skip
        pool.weight_version = str(version)
    pool.resync = lambda url: pool.client.update_weights_from_disk(str(path), version, url=url)
