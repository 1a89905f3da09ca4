"""Sampling (docs/tinker-protocol.md, section 12): sampling sessions on a checkpoint (either
kind: ``weights/`` or ``sampler_weights/``) or a bare base model, and ``asample``, which also
serves ``compute_logprobs`` (``prompt_logprobs``). The methods of
:class:`~grpoflow.tinker.service.TinkerService` that sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpoflow.tinker.backend import Backend
from grpoflow.tinker.errors import ApiError
from grpoflow.tinker.futures import Result, Scheduler
from grpoflow.tinker.proto import WireError, encode_sample_response, prompt_tokens
from grpoflow.tinker.schemas import CreateSamplingSessionBody, SampleBody
from grpoflow.tinker.state import CheckpointStore, Registry, Sampler
from rl_core.tinker import SamplingParams, TinkerError

__all__ = ["DEFAULT_MAX_TOKENS", "SamplingOps"]

DEFAULT_MAX_TOKENS = 16  # a sample request without max_tokens (the SDK sends it unset)


class SamplingOps:
    """Sampling sessions and samples, mixed into TinkerService: they use its state (below)
    and its ``_base``, ``_session``, ``_job`` and ``readable_checkpoint``."""

    backend: Backend
    registry: Registry
    store: CheckpointStore
    scheduler: Scheduler
    max_queued: int

    def _target(self, owner: str, model_path: str | None,
                base_model: str | None) -> tuple[str, Path | None]:
        """(base model, adapter directory) of a ``model_path`` or a bare ``base_model``."""
        if model_path:
            run, kind, name, meta = self.readable_checkpoint(model_path, owner)
            if base_model is not None and base_model != meta["base_model"]:
                raise ApiError(400, f"{model_path} was trained on {meta['base_model']}, "
                               f"not {base_model}")
            return self._base(meta["base_model"]), self.store.dir(run, kind, name)
        if base_model is None:
            raise ApiError(400, "give model_path (a tinker:// checkpoint) or base_model")
        return self._base(base_model), None

    def create_sampling_session(self, body: CreateSamplingSessionBody,
                                owner: str) -> dict[str, Any]:
        session = self._session(body.session_id, owner)
        sampler_id = f"{session.id}:sample:{body.sampling_session_seq_id}"
        with self.registry.lock:
            if sampler_id not in self.registry.samplers:
                base, adapter = self._target(owner, body.model_path, body.base_model)
                self.registry.add_sampler(Sampler(
                    id=sampler_id, session_id=session.id, owner=owner, base_model=base,
                    model_path=body.model_path, adapter_dir=adapter))
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def get_sampler(self, sampler_id: str, owner: str) -> dict[str, Any]:
        try:
            s = self.registry.sampler(sampler_id, owner)
        except KeyError as exc:
            raise ApiError(404, str(exc.args[0])) from None
        out = {"sampler_id": s.id, "base_model": s.base_model}
        return out | ({"model_path": s.model_path} if s.model_path else {})

    def sample(self, body: SampleBody, owner: str) -> dict[str, Any]:
        if body.sampling_session_id is not None:
            try:
                s = self.registry.sampler(body.sampling_session_id, owner)
            except KeyError as exc:
                raise ApiError(404, str(exc.args[0])) from None
            base, adapter = s.base_model, s.adapter_dir
        else:
            base, adapter = self._target(owner, body.model_path, body.base_model)
        unsupported = [name for name, on in (
            ("topk_prompt_logprobs", body.topk_prompt_logprobs > 0),
            ("topk_sample_logprobs", body.topk_sample_logprobs > 0),
            ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0),
            ("record_stability_info", bool(body.record_stability_info))) if on]
        if unsupported:
            raise ApiError(400, f"{', '.join(unsupported)}: not supported by this server")
        try:
            tokens = prompt_tokens(body.prompt)
        except WireError as exc:
            raise ApiError(400, str(exc)) from None
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        sp = body.sampling_params
        stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        # the SDK: None keeps the implicit EOS stop; [] disables every stop, EOS included
        no_stop = sp.stop is not None and not isinstance(sp.stop, str) and not stop
        params = SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if sp.max_tokens is None else sp.max_tokens,
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
            stop=stop, ignore_eos=no_stop)
        if self.scheduler.queue_depth(base) >= self.max_queued:
            raise ApiError(429, f"{base}'s queue is full ({self.max_queued} requests); "
                           "retry shortly")
        n, want_prompt, last_n = body.num_samples, bool(body.prompt_logprobs), \
            body.prompt_logprobs_last_n

        def run() -> Result:
            if adapter is not None and not adapter.exists():
                raise TinkerError("this sampling session's weights are gone (its checkpoint "
                                  "was deleted, or its session finished)")
            seqs = self.backend.sample(base, adapter, tokens, n, params)
            if len(seqs) != n:
                raise RuntimeError(f"the backend returned {len(seqs)} samples, not {n}")
            lps = None
            if want_prompt:
                lps = list(self.backend.compute_logprobs(base, adapter, tokens))
                if last_n is not None:
                    lps = [None if i < len(lps) - last_n else v for i, v in enumerate(lps)]
            return Result(proto=encode_sample_response(seqs, lps))

        key = None if body.seq_id is None else ("sample", body.sampling_session_id or
                                                f"{owner}:{body.model_path or base}",
                                                body.seq_id)
        # on the sampling threads: other tenants' samples share the engine's batches
        rid = self.scheduler.submit(base, self._job(run), key=key, owner=owner,
                                    concurrent=True)
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}
