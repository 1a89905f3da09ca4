"""The in-process rollout plane (``rollout.engine: local``): the engine core without HTTP.

:class:`InProcessPlane` drives the same :class:`~rl_core.engine.core.EmbeddedEngine` the HTTP
server wraps, from the training process, behind the same
:class:`~rl_core.interfaces.RolloutPlane` interface; weights arrive as tensors (``TensorSync``)
or, with ``rollout.weight_sync: shared``, the engine serves a :func:`shared_view` of the
trainer's model and a sync is a checked version bump (docs/rollout.md, "The single-machine
fast path"). Never changes the trainer's model object.
"""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.sampling import SamplingParams
from rl_core.types import Sample
from rl_core.weight_sync import WeightSyncError, served_version

__all__ = ["InProcessPlane", "TokenHook", "shared_view"]

# A streamed request's hook: (token id, log-prob, its top-k alternatives or None) per token.
TokenHook = Callable[[int, float, list[list[Any]] | None], None]


def shared_view(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters alias ``model``'s storage (no gradients).
    Buffers and modules are copied (the engine may set eval mode), tied weights stay tied,
    and in-place changes to ``model``'s parameters show through without a copy."""
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.data, requires_grad=False)
                            for p in model.parameters()}
    return copy.deepcopy(model, memo)



class InProcessPlane:
    """One engine core in this process, as a rollout plane."""

    def __init__(self, model_path: str | Path, *, timeout_s: float = 600.0,
                 share: torch.nn.Module | None = None, routed_experts: bool = False,
                 **engine_kw: Any):
        """``share``: serve a :func:`shared_view` of this model instead of loading one;
        ``routed_experts``: samples carry their MoE routing (``train.moe.routing_replay``)."""
        model = shared_view(share) if share is not None else None
        # No scheduler thread: the engine runs on the thread that asks it to generate (the
        # trainer's), so generation and training share one OpenMP team (docs/benchmarks.md).
        engine_kw.setdefault("background", False)
        self.engine = EmbeddedEngine(model_path, model=model, **engine_kw)
        self.timeout_s, self.routed_experts = timeout_s, routed_experts
        self.weight_version = 0
        self.lora_name: str | None = None  # set by a LoRA weight sync: requests carry it
        self.pause_mode = "abort"  # rollout.pause_mode: what an update does to requests in flight
        self._verified = True  # False from the start of an update until it succeeds

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
        *, partial: bool = False, images: Sequence[tuple[bytes, ...]] | None = None,
        routing_keys: Sequence[str] | None = None, top_logprobs: Sequence[int] | None = None,
        on_token: Sequence[TokenHook | None] | None = None,
    ) -> list[Sample]:
        """One sample per prompt, in order, scheduled together by the engine (``partial``:
        a partial rollout's segment; an update's pause may abort it, and each sample is
        tagged with the version the engine served it with; ``images``: each prompt's, its
        image pads already expanded; ``routing_keys``: one engine, every key's).
        ``top_logprobs``: each prompt's k alternatives per token, in
        ``meta["output_top_logprobs"]`` (``[[logprob, token_id], ...]`` per token, as the HTTP
        plane's); ``on_token``: each prompt's hook, called with every token as it is sampled
        (token id, log-prob, alternatives or None), on the thread that drives the engine.
        Neither changes what is sampled."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if not self._verified:  # one thread: an update in progress here has failed
            raise WeightSyncError("the last weight update was not verified; no sampling from "
                                  "its weights until an update succeeds")
        batch = uuid.uuid4().hex[:12]
        pics = list(images) if images is not None else [()] * len(prompts)
        tops = list(top_logprobs) if top_logprobs is not None else [0] * len(prompts)
        hooks = list(on_token) if on_token is not None else [None] * len(prompts)
        if not len(tops) == len(hooks) == len(prompts):
            raise ValueError(f"{len(tops)} top_logprobs and {len(hooks)} token hooks for "
                             f"{len(prompts)} prompts")
        reqs = [GenerateRequest(f"{batch}-{i}", list(p), sp, return_logprob=True,
                                lora=self.lora_name, return_routed_experts=self.routed_experts,
                                images=self._pixels(p, im), top_logprobs_num=tops[i],
                                on_token=hooks[i])
                for i, (p, sp, im) in enumerate(zip(prompts, params, pics, strict=True))]
        outs = self.engine.generate_sync(reqs, timeout=self.timeout_s)
        tok = self.engine.tokenizer

        def version(o: Any) -> int:  # a partial segment: the version that served it
            return served_version(o.weight_version) if partial else self.weight_version

        return [Sample(list(p), o.output_ids, o.output_logprobs, o.finish_reason, version(o),
                       tok.decode(o.output_ids, skip_special_tokens=True)
                       if tok is not None else "",
                       meta={"id": o.rid, "cached_tokens": o.cached_tokens, **_spans(o),
                             **({"output_top_logprobs": o.output_top_logprobs}
                                if o.output_top_logprobs is not None else {})},
                       routed_experts=o.routed_experts, images=tuple(im))
                for p, o, im in zip(prompts, outs, pics, strict=True)]

    def _pixels(self, prompt: Sequence[int], images: Sequence[bytes]) -> Any:  # noqa: ANN401
        """A prompt's images as the engine's pixel inputs (its pads must be expanded)."""
        if not images and self.engine.images.processor is None:
            return None
        ids, pixels = self.engine.images.prepare(list(prompt), images)
        if len(ids) != len(prompt):
            raise ValueError(f"a prompt's image pads are not expanded ({len(prompt)} tokens, "
                             f"{len(ids)} expanded): expand them before sampling "
                             "(rl_core.models.vlm.VisionProcessor.expand)")
        return pixels

    def score(self, prompt: Sequence[int], completions: Sequence[Sequence[int]], *,
              lora: str | None = None) -> list[list[float]]:
        """Each completion's per-token log-probs after ``prompt`` (prefill only)."""
        start, batch = len(prompt) - 1, uuid.uuid4().hex[:12]
        reqs = [GenerateRequest(f"{batch}-s{i}", [*prompt, *c], SamplingParams(max_new_tokens=0),
                                return_logprob=True, logprob_start_len=start, lora=lora)
                for i, c in enumerate(completions)]
        outs = self.engine.generate_sync(reqs, timeout=self.timeout_s)
        return [[float(x) for x in o.input_logprobs[1:]] for o in outs]

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """No sampling from an update's weights until it succeeded (see :class:`HttpPlane`)."""
        self._verified = False
        yield
        self._verified = True  # not on a failure: until an update succeeds

    def probe(self, prompt: Sequence[int], completions: Sequence[Sequence[int]],
              ) -> dict[str, list[list[float]]]:
        """The engine's scores of the probe batch (served adapter included)."""
        return {"the in-process engine": self.score(prompt, completions, lora=self.lora_name)}

    def rebuild(self, engines: Sequence[str]) -> None:
        raise WeightSyncError("the in-process engine failed the weight probe after a reload and "
                              "cannot be rebuilt alone: the step fails and the planes are "
                              "rebuilt from the latest checkpoint")

    @contextlib.contextmanager
    def paused(self) -> Iterator[list[EmbeddedEngine]]:
        """Pause (``pause_mode``: abort, retract or hold what runs), flush the KV cache
        (``abort`` only: held requests make a flush fail), yield the engine; resume always."""
        self.engine.pause(self.pause_mode)
        try:
            if self.pause_mode == "abort":
                self.engine.flush_cache()
            yield [self.engine]
        finally:
            self.engine.resume()

    def verify(self, version: int, checksum: str | None) -> None:
        served = self.engine.weight_version
        if served != str(version):
            raise WeightSyncError(f"the engine serves weight_version {served}, expected {version}")
        if checksum is not None and (got := self.engine.checksum(self.lora_name)) != checksum:
            raise WeightSyncError(f"weight sync to version {version}: the engine serves checksum "
                                  f"{got[:21]} but the trainer exported {checksum[:21]}")

    def health(self) -> dict[str, Any]:
        return {"engines": 1, "weight_version": self.weight_version, **self.engine.load()}

    def loads(self) -> list[dict[str, float]]:
        """The engine's queue and KV usage (as ``HttpPlane.loads``)."""
        load = self.engine.load()
        return [{"waiting": float(load["num_waiting_reqs"]),
                 "running": float(load["num_running_reqs"]),
                 "token_usage": float(load["token_usage"])}]

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.engine.resume_memory(tags)

    @property
    def memory_released(self) -> set[str]:
        return {tag for tag, released in self.engine.memory_released.items() if released}

    def close(self) -> None:
        self.engine.close()


def _spans(o: Any) -> dict[str, Any]:
    """The engine's per-token versions and recomputed KV, as its HTTP answer carries them."""
    return {"weight_version_spans": o.weight_version_spans,
            "recomputed_tokens": o.recomputed_tokens}
