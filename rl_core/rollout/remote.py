"""The rollout plane over SGLang's HTTP API: the engine the GRPO loop uses by default.

:class:`HttpRollout` offers what the loop needs from a rollout engine (``generate`` with
per-sample seeds, ``weight_version``, a tokenizer) on top of an
:class:`~rl_core.rollout.pool.EnginePool` of engine processes — grpoflow's embedded engine
(``python -m rl_core.rollout.server``) on CPU, real SGLang on GPUs — optionally behind the
real ``sglang-router``. Every sample travels through the same client code a real SGLang
deployment would see.

Weight sync is the sequence slime and Miles run (pause → flush → update → continue) from a
safetensors directory the trainer writes (``disk`` mode). After every update each engine
must report the new ``weight_version`` and, when it can (the embedded engine's
``/weights_checksum``), the checksum of the trainer's weights; anything else fails loudly.
Every sample's ``weight_version`` is checked against the version the loop expects, so a
stale engine cannot slip samples into a step.

Never imports Prefect or MLflow; never waits without a bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rl_core.rollout.client import RolloutError, SampleResult
from rl_core.rollout.pool import EngineCommand, EnginePool
from rl_core.rollout.sampler import Completion, SamplingParams
from rl_core.weight_sync import WeightSyncError, weights_checksum

__all__ = ["HttpRollout", "embedded_engine_command", "sampling_payload"]

log = logging.getLogger(__name__)


def embedded_engine_command(
    model_path: str | Path,
    *,
    dtype: str = "float32",
    num_threads: int | None = None,
    max_running_requests: int = 256,
    max_total_tokens: int | None = None,
    trust_remote_code: bool = False,
) -> EngineCommand:
    """``command(index, port)`` for the embedded engine, tied to this process's life."""
    if trust_remote_code:
        raise ValueError("the embedded engine does not run remote code; use rollout.engine=local")

    def command(index: int, port: int) -> list[str]:
        cmd = [
            sys.executable, "-m", "rl_core.rollout.server",
            "--model", str(model_path),
            "--port", str(port),
            "--dtype", dtype,
            "--max-running-requests", str(max_running_requests),
            "--log-level", "warning",
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if num_threads:
            cmd += ["--num-threads", str(num_threads)]
        if max_total_tokens:
            cmd += ["--max-total-tokens", str(max_total_tokens)]
        return cmd

    return command


def sampling_payload(params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``params`` (the seed as ``sampling_seed``)."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = int(params.seed)
    return out


class HttpRollout:
    """N engines behind SGLang's HTTP API, as one rollout engine for the loop.

    ``pool`` is started and owned by this object (``close()`` stops it). ``staging_dir``
    holds the safetensors directory of the current weights: engines that restart are
    re-synced from it, so only the newest version is kept.
    """

    def __init__(
        self,
        pool: EnginePool,
        model_path: str | Path,
        *,
        staging_dir: str | Path,
        request_batch_size: int = 16,
        timeout_s: float = 600.0,
        weight_sync_timeout_s: float = 600.0,
        verify_checksum: bool = True,
        trust_remote_code: bool = False,
        weight_sync: str = "disk",
    ) -> None:
        if request_batch_size < 1:
            raise ValueError(f"request_batch_size must be >= 1, got {request_batch_size}")
        if weight_sync not in ("disk", "object_store"):
            raise ValueError(
                f"rollout.weight_sync={weight_sync!r}; allowed values: 'disk', 'object_store'"
            )
        self.weight_sync = weight_sync
        self._weights_ref: Any = None  # object_store: the current weights, for re-syncs
        if weight_sync == "object_store":
            pool.resync = self._resync_from_object_store
        self.pool = pool
        self.model_path = str(model_path)
        self.staging_dir = Path(staging_dir)
        self.request_batch_size = request_batch_size
        self.timeout_s = timeout_s
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.verify_checksum = verify_checksum
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=trust_remote_code
        )
        self.weight_version = 0  # the base model, until the first sync
        self._warned_no_checksum = False

    @property
    def urls(self) -> list[str]:
        """Where generation requests go: the router, else the engines."""
        return [self.pool.url] if self.pool.url else self.pool.engine_urls

    def start(self) -> HttpRollout:
        t0 = time.monotonic()
        self.pool.start()
        log.info("rollout plane: %s up in %.1fs", ", ".join(self.urls), time.monotonic() - t0)
        return self

    def close(self) -> None:
        self.pool.stop()

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """One completion per prompt, in order. Requests go out concurrently (each retried
        by the client): chunks of ``request_batch_size`` samples straight to the engines,
        one sample per request through the router."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if not prompts:
            return []
        client = self._client()
        # sglang-router 0.3 refuses a batch with per-sample sampling_params (422), and every
        # sample has its own seed: through the router each sample is its own request.
        size = 1 if self.pool.url else self.request_batch_size
        chunks = [
            (list(prompts[i : i + size]), [sampling_payload(p) for p in params[i : i + size]])
            for i in range(0, len(prompts), size)
        ]

        async def one(p: list[list[int]], sp: list[dict[str, Any]]) -> list[SampleResult]:
            if len(p) == 1:
                return [await client.aio.generate(p[0], sp[0])]
            return await client.aio.generate_batch(p, sp)

        async def run_all() -> list[list[SampleResult]]:
            return list(await asyncio.gather(*(one(p, sp) for p, sp in chunks)))

        results = [r for chunk in client.run(run_all(), timeout_s=self.timeout_s) for r in chunk]
        return [self._completion(p, r) for p, r in zip(prompts, results, strict=True)]

    def _completion(self, prompt: Sequence[int], r: SampleResult) -> Completion:
        if r.aborted:
            raise RolloutError(
                f"{r.base_url}: sample {r.rid} was aborted ({r.finish_reason.get('message')}); "
                "the rollout is retried"
            )
        expected = str(self.weight_version)
        # Version 0 is the base model, which engines report under their own initial label.
        if self.weight_version and r.weight_version not in (None, expected):
            raise WeightSyncError(
                f"{r.base_url} answered with weight_version {r.weight_version}, expected "
                f"{expected}: an engine serves stale weights"
            )
        return Completion(
            prompt_ids=list(prompt),
            output_ids=r.output_ids,
            output_logprobs=r.output_logprobs,
            finish_reason=r.finish_reason,
            text=r.text,
        )

    # ------------------------------------------------------------------ weights

    def sync_from(self, trainer: Any, version: int) -> dict[str, float]:
        """Move every engine to ``trainer``'s weights as ``version``.

        ``disk``: the trainer writes safetensors the engines read (one node, or a shared
        filesystem). ``object_store`` (engines are Ray actors): the weights travel through
        Ray's object store as numpy arrays and each engine's actor hands them to its server
        from node-local disk.
        """
        weights = trainer.export_weights()
        expected = weights_checksum(weights)
        if self.weight_sync == "disk":
            return self.push_weights(trainer.save_pretrained, version, expected)
        return self._push_object_store(weights, version, expected)

    def _push_object_store(
        self, weights: Any, version: int, expected_checksum: str
    ) -> dict[str, float]:
        import ray

        from rl_core.rollout.ray_engines import tensors_to_arrays

        t0 = time.perf_counter()
        arrays = tensors_to_arrays(weights)
        ref = ray.put(arrays)
        nbytes = sum((a[1] if isinstance(a, tuple) else a).nbytes for a in arrays.values())
        self.pool.weight_update(
            version,
            update=lambda urls, v: self._load_on(urls, v, ref),
            timeout_s=self.weight_sync_timeout_s,
        )
        self._weights_ref = ref
        self.weight_version = version
        self.verify(expected_checksum)
        return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": float(nbytes)}

    def _load_on(self, urls: list[str], version: str, ref: Any) -> None:
        import ray

        actors = {e.url: e.proc.actor for e in self.pool.engines if e.proc is not None}
        missing = [u for u in urls if u not in actors or not hasattr(actors[u], "load_weights")]
        if missing:
            raise WeightSyncError(
                f"rollout.weight_sync=object_store needs engines that are Ray actors "
                f"(cluster.mode=ray); {missing} are not"
            )
        staging = str(self.staging_dir)
        t = self.weight_sync_timeout_s
        ray.get(
            [actors[u].load_weights.remote(ref, str(version), staging, t) for u in urls],
            timeout=t,
        )

    def _resync_from_object_store(self, url: str) -> None:
        if self._weights_ref is not None:
            self._load_on([url], str(self.weight_version), self._weights_ref)

    def push_weights(
        self, write: Callable[[Path], object], version: int, expected_checksum: str
    ) -> dict[str, float]:
        """Move every engine to ``version``: ``write(dir)`` stores the weights in HF
        safetensors layout, the engines load them (pause → flush → update → continue) and
        must report ``version`` and ``expected_checksum``. Returns time and byte metrics."""
        t0 = time.perf_counter()
        target = self.staging_dir / f"v{version:06d}"
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        nbytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
        written = time.perf_counter()
        self.pool.weight_update(version, model_path=target, timeout_s=self.weight_sync_timeout_s)
        self.weight_version = version
        self.verify(expected_checksum)
        for old in self.staging_dir.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return {
            "sync_seconds": time.perf_counter() - t0,
            "sync_write_seconds": written - t0,
            "sync_bytes": float(nbytes),
        }

    def verify(self, expected_checksum: str) -> None:
        """Every engine in service serves ``weight_version`` and the expected weights."""
        client = self._client()
        for url in self.pool.in_service_urls():
            served = client.weight_version(url=url)
            if served != str(self.weight_version):
                raise WeightSyncError(
                    f"{url} serves weight_version {served}, expected {self.weight_version}"
                )
            if not self.verify_checksum:
                continue
            got = client.weights_checksum(url=url)
            if got is None:
                if not self._warned_no_checksum:
                    log.warning("%s has no /weights_checksum: verified by version only", url)
                    self._warned_no_checksum = True
            elif got != expected_checksum:
                raise WeightSyncError(
                    f"weight sync to version {self.weight_version}: {url} serves checksum "
                    f"{got[:12]} but the trainer exported {expected_checksum[:12]}; refusing "
                    "to sample from weights that are not the trainer's"
                )

    def _client(self) -> Any:
        if self.pool.client is None:
            raise RuntimeError("the rollout plane is not started")
        return self.pool.client
