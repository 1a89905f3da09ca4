"""The rollout plane over SGLang's HTTP API: the engine the GRPO loop uses by default.

:class:`HttpRollout` offers what the loop needs from a rollout engine (``generate`` with
per-sample seeds, ``weight_version``, a tokenizer) on top of an
:class:`~rl_core.rollout.pool.EnginePool` of engine processes — grpoflow's embedded engine
(``python -m rl_core.rollout.server``) on CPU, real SGLang on GPUs — optionally behind the
real ``sglang-router``. Every sample travels through the same client code a real SGLang
deployment would see.

Weight sync is the sequence slime and Miles run (pause → flush → update → continue), the
update itself one of: a safetensors directory the trainer writes (``disk``), Ray's object
store (``object_store``), or a ``torch.distributed`` broadcast from the trainer's rank 0 to
every engine over SGLang's ``/init_weights_update_group`` + ``/update_weights_from_
distributed`` (``distributed``: gloo on CPU, NCCL/RCCL on GPUs). After every update each
engine must report the new ``weight_version`` and, when it can (the embedded engine's
``/weights_checksum``), the checksum of the trainer's weights; anything else fails loudly.
Every sample's ``weight_version`` is checked against the version the loop expects, so a
stale engine cannot slip samples into a step.

Never imports Prefect or MLflow; never waits without a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rl_core.rollout.client import RolloutError, SampleResult
from rl_core.rollout.pool import EngineCommand, EnginePool
from rl_core.rollout.sampler import Completion, SamplingParams
from rl_core.weight_sync import WeightSyncError, weights_checksum
from rl_core.weight_sync.broadcast import weight_meta

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
    weight_sync_timeout_s: float | None = None,
) -> EngineCommand:
    """``command(index, port)`` for the embedded engine, tied to this process's life.

    ``weight_sync_timeout_s``: the engine's bound on a weight-update broadcast, the same as
    the trainer's (``rollout.weight_sync_timeout_s``), so neither side gives up first."""
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
        if weight_sync_timeout_s:
            cmd += ["--weight-sync-timeout-s", str(weight_sync_timeout_s)]
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


def _buckets(
    weights: dict[str, Any], bucket_bytes: int
) -> list[tuple[list[str], list[str], list[list[int]]]]:
    """``weights`` in order, cut into buckets of at most ``bucket_bytes`` (a bigger tensor
    is a bucket of its own), each as ``names, dtypes, shapes``."""
    buckets: list[dict[str, Any]] = []
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or (size + nbytes > bucket_bytes and buckets[-1]):
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += nbytes
    return [weight_meta(b) for b in buckets]


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
        weight_sync_backend: str = "gloo",
        weight_sync_bucket_mb: float = 512.0,
    ) -> None:
        if request_batch_size < 1:
            raise ValueError(f"request_batch_size must be >= 1, got {request_batch_size}")
        if weight_sync not in ("disk", "object_store", "distributed"):
            raise ValueError(
                f"rollout.weight_sync={weight_sync!r}; allowed values: 'disk', 'object_store', "
                "'distributed'"
            )
        self.weight_sync = weight_sync
        self.weight_sync_backend = weight_sync_backend
        self.weight_sync_bucket_bytes = int(weight_sync_bucket_mb * 2**20)
        self._weights_ref: Any = None  # object_store: the current weights, for re-syncs
        if weight_sync == "object_store":
            pool.resync = self._resync_from_object_store
        # distributed: the open group (name, member URLs), its tensor layout, and the trainer
        # whose weights the engines serve (a restarted engine waits for the next broadcast).
        self._group: tuple[str, tuple[str, ...]] | None = None  # name, members
        self._group_seq = 0
        # per bucket: names, dtypes, shapes (one /update_weights_from_distributed each)
        self._buckets: list[tuple[list[str], list[str], list[list[int]]]] = []
        self._layout_bytes = 0
        self._trainer: Any = None
        self._synced_step: int | None = None
        if weight_sync == "distributed":
            pool.resync = self._defer_resync
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

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Engines free their weights and KV cache (``tags``) while a colocated trainer runs."""
        self.pool.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.pool.resume_memory(tags)

    @property
    def memory_released(self) -> set[str]:
        return set(self.pool.released)

    def close(self) -> None:
        if self._group is not None:
            self._close_group()
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
        if self.pool.released:  # never sample from engines without weights
            log.warning("engines had released %s: taking it back before sampling",
                        sorted(self.pool.released))  # fmt: skip
            self.pool.resume_memory()
        if self.weight_sync == "distributed" and self.pool.awaiting_urls():
            self._resync_restarted()
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
        from node-local disk. ``distributed``: the trainer's rank 0 broadcasts every tensor
        to every engine over a weight-update process group (opened on the first sync and
        again whenever the engines in it change).
        """
        if self.weight_sync == "distributed":
            return self._push_distributed(trainer, version)
        weights = trainer.export_weights()
        expected = weights_checksum(weights)
        if self.weight_sync == "disk":
            return self.push_weights(trainer.save_pretrained, version, expected)
        return self._push_object_store(weights, version, expected)

    # ------------------------------------------------------------- distributed

    def _push_distributed(self, trainer: Any, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        targets = tuple(self.pool.update_targets())
        # A restarted engine keeps its URL but has left the group: membership is per process.
        members = self._members(targets)
        if self._group is None or self._group[1] != members or self._trainer is not trainer:
            self._open_group(trainer, list(targets))
        assert self._group is not None
        name = self._group[0]
        sent: dict[str, str | None] = {}

        def update(urls: list[str], v: str) -> None:
            if tuple(urls) != targets:
                raise WeightSyncError(
                    f"the engines changed during the weight update ({list(targets)} -> {urls})"
                )
            sent["checksum"] = self._broadcast(trainer, name, urls, v)

        opened = time.perf_counter()
        try:
            self.pool.weight_update(
                version, update=update, timeout_s=self.weight_sync_timeout_s + 60.0
            )
        except BaseException:
            self._close_group()  # a broken broadcast leaves the group unusable: reopen next time
            raise
        self.weight_version = version
        self._synced_step = getattr(trainer, "global_step", None)
        if sent.get("checksum"):
            self.verify(str(sent["checksum"]))
        return {
            "sync_seconds": time.perf_counter() - t0,
            "sync_group_seconds": opened - t0,
            "sync_bytes": float(self._layout_bytes * len(targets)),
            "sync_buckets": float(len(self._buckets)),
        }

    def _open_group(self, trainer: Any, urls: list[str]) -> None:
        """Close any previous group; open a new one with rank 0 the trainer, then ``urls``."""
        if self._group is not None:
            self._close_group()
        if not urls:
            raise WeightSyncError("rollout.weight_sync=distributed: no engine to update")
        t0 = time.perf_counter()
        weights = trainer.export_weights()
        self._buckets = _buckets(weights, self.weight_sync_bucket_bytes)
        self._layout_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        del weights
        self._group_seq += 1
        name = f"grpoflow-weights-{os.getpid()}-{self._group_seq}"
        address, port = trainer.weight_broadcast_endpoint()
        world = 1 + len(urls)
        t = self.weight_sync_timeout_s
        client = self._client()

        async def join_all() -> list[Any]:
            return await asyncio.gather(
                *(
                    client.aio.init_weights_update_group(
                        address, port, i + 1, world, group_name=name,
                        backend=self.weight_sync_backend, url=u, timeout_s=t + 10.0,
                    )  # fmt: skip
                    for i, u in enumerate(urls)
                ),
                return_exceptions=True,
            )

        with ThreadPoolExecutor(1, thread_name_prefix="weight-group") as ex:
            host = ex.submit(
                trainer.open_weight_broadcast, address, port, world, name,
                self.weight_sync_backend, t,
            )  # fmt: skip
            joined = client.run(join_all(), timeout_s=t + 20.0)
            host_error: BaseException | None = None
            try:
                host.result(timeout=t + 30.0)
            except BaseException as e:  # noqa: BLE001 - reported below with the engines'
                host_error = e
        errors = [f"{u}: {r}" for u, r in zip(urls, joined, strict=True) if isinstance(r, Exception)]
        if host_error is not None or errors:
            with contextlib.suppress(Exception):
                trainer.close_weight_broadcast(name)
            for u, r in zip(urls, joined, strict=True):
                if not isinstance(r, Exception):
                    with contextlib.suppress(Exception):
                        client.destroy_weights_update_group(name, url=u)
            raise WeightSyncError(
                f"rollout.weight_sync=distributed: opening weight update group {name} at "
                f"{address}:{port} ({self.weight_sync_backend}, {world} ranks) failed: "
                + "; ".join(errors + ([f"trainer: {host_error}"] if host_error else []))
                + ". Engines must reach the trainer's rank 0 at that address (firewall, "
                "cluster network) and the backend must match the devices (gloo on CPU)."
            ) from host_error
        self._group = (name, self._members(urls))
        self._trainer = trainer
        log.info(
            "weight update group %s: trainer + %d engine(s) over %s in %.2fs",
            name, len(urls), self.weight_sync_backend, time.perf_counter() - t0,
        )  # fmt: skip

    def _broadcast(self, trainer: Any, name: str, urls: list[str], version: str) -> str | None:
        """Engines receive bucket by bucket (one POST each, in order) while the trainer
        broadcasts every tensor in the same order; the checksum of what it sent."""
        client = self._client()
        t = self.weight_sync_timeout_s

        async def receive(url: str) -> None:
            for names, dtypes, shapes in self._buckets:
                await client.aio.update_weights_from_distributed(
                    names, dtypes, shapes, group_name=name, weight_version=version,
                    url=url, timeout_s=t + 10.0,
                )  # fmt: skip

        async def receive_all() -> list[Any]:
            return await asyncio.gather(*(receive(u) for u in urls), return_exceptions=True)

        with ThreadPoolExecutor(1, thread_name_prefix="weight-broadcast") as ex:
            sending = ex.submit(trainer.broadcast_weights, name)
            received = client.run(receive_all(), timeout_s=t + 20.0)
            sender_error: BaseException | None = None
            try:
                checksum = sending.result(timeout=t + 30.0)
            except BaseException as e:  # noqa: BLE001 - reported below with the engines'
                sender_error = e
        errors = [f"{u}: {r}" for u, r in zip(urls, received, strict=True) if isinstance(r, Exception)]
        if sender_error is not None:
            errors.append(f"trainer (rank 0): {sender_error}")
        if errors:
            raise WeightSyncError(
                f"weight broadcast over group {name} failed: " + "; ".join(errors)
            ) from sender_error
        return checksum

    @property
    def weight_sync_buckets(self) -> int:
        """How many ``/update_weights_from_distributed`` calls one sync makes per engine."""
        return len(self._buckets)

    def _members(self, urls: Sequence[str]) -> tuple[str, ...]:
        """``url#restarts`` of each engine: who is in a group, process by process."""
        restarts = {e.url: e.restarts for e in self.pool.engines}
        return tuple(f"{u}#{restarts.get(u, 0)}" for u in urls)

    def _close_group(self) -> None:
        """Leave the weight update group on the trainer and the engines (best effort)."""
        if self._group is None:
            return
        name, members = self._group
        urls = [m.rsplit("#", 1)[0] for m in members]
        self._group = None
        if self._trainer is not None:
            with contextlib.suppress(Exception):
                self._trainer.close_weight_broadcast(name)
        client = self.pool.client
        if client is None:
            return
        for u in urls:
            if u in self.pool.in_service_urls() or u in self.pool.awaiting_urls():
                with contextlib.suppress(Exception):
                    client.destroy_weights_update_group(name, url=u)

    def _defer_resync(self, url: str) -> bool:
        """A restarted engine serves the base model: fine before the first sync; after it,
        the engine waits out of service for the next broadcast."""
        return self.pool.weight_version is None

    def _resync_restarted(self) -> None:
        """Before sampling: bring restarted engines to the current weights, when the trainer
        still holds them (it has not trained since the last sync)."""
        trainer = self._trainer
        if trainer is None or getattr(trainer, "global_step", None) != self._synced_step:
            return  # they rejoin at the next sync
        log.warning(
            "re-broadcasting weight_version %s for restarted engine(s) %s",
            self.weight_version, self.pool.awaiting_urls(),
        )  # fmt: skip
        self._push_distributed(trainer, self.weight_version)

    # ------------------------------------------------------------- object store

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
                served_algo, expected_algo = _algorithm(got), _algorithm(expected_checksum)
                if served_algo != expected_algo:
                    raise WeightSyncError(
                        f"weight sync to version {self.weight_version}: {url} checksums its "
                        f"weights with {served_algo}, the trainer with {expected_algo}: the "
                        "engine runs another grpoflow version; install the same one on both "
                        "planes"
                    )
                raise WeightSyncError(
                    f"weight sync to version {self.weight_version}: {url} serves checksum "
                    f"{got[:21]} but the trainer exported {expected_checksum[:21]}; refusing "
                    "to sample from weights that are not the trainer's"
                )

    def _client(self) -> Any:
        if self.pool.client is None:
            raise RuntimeError("the rollout plane is not started")
        return self.pool.client


def _algorithm(checksum: str) -> str:
    """The algorithm a weights checksum names (``xxh3-128:...``; bare hex was SHA-256)."""
    algo, sep, _ = checksum.partition(":")
    return algo if sep else "sha256"
