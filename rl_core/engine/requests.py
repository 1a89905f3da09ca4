"""The embedded engine's request and result records, in SGLang's terms.

``GenerateOutput.weight_version_spans`` is grpoflow's addition to SGLang's ``meta_info``: the
weight version of every output token, run-length encoded (``[[version, tokens], ...]``), so a
request that an in-place or retracting pause carried across a weight update says which tokens
each version produced (docs/training.md, "Fully asynchronous rollouts").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl_core.engine.sampling import SamplingParams
from rl_core.models.vlm import ImageInputs

__all__ = ["EngineRequestError", "GenerateOutput", "GenerateRequest", "abort_reason", "add_run",
           "check_request"]


@dataclass
class GenerateRequest:
    """One sequence to generate (or, with ``max_new_tokens=0``, to score)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    lora: str | None = None  # SGLang's lora_path: the adapter's name (None: the base model)
    return_routed_experts: bool = False  # MoE: every token's experts (engine/routing.py)
    # The prompt's images as the model takes them (its image pads already expanded to match:
    # engine/vision.py); None: a text prompt.
    images: ImageInputs | None = None
    top_logprobs_num: int = 0  # SGLang's: the k most likely tokens at each output position
    # Called on the scheduler's thread with each token as it is sampled (token id, log-prob,
    # its top_logprobs_num alternatives or None), before the request may finish; it must be
    # quick and must not raise (the rollout plane streams a turn through it).
    on_token: Callable[[int, float, list[list[Any]] | None], None] | None = None


@dataclass
class GenerateOutput:
    """A finished request in SGLang's terms (``finish_reason`` has SGLang's JSON shapes)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None] | None
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float
    num_retractions: int = 0
    routed_experts: str | None = None  # SGLang's base64 int32 [seq_len-1, moe_layers, top_k]
    weight_version_spans: list[list[Any]] = field(default_factory=list)  # [[version, tokens]]
    recomputed_tokens: int = 0  # KV recomputed after retractions (prompt + tokens so far)
    # top_logprobs_num > 0: per output token, the k most likely [[logprob, token_id], ...], from
    # the same log-softmax as output_logprobs (SGLang's output_top_logprobs, without the text)
    output_top_logprobs: list[list[list[Any]]] | None = None


def add_run(spans: list[list[Any]], version: str, tokens: int = 1) -> None:
    """Count ``tokens`` more tokens of ``version`` at the end of run-length ``spans``."""
    if spans and spans[-1][0] == version:
        spans[-1][1] += tokens
    else:
        spans.append([version, tokens])


def abort_reason(message: str, status_code: int | None = None,
                 err_type: str | None = None) -> dict[str, Any]:
    """SGLang's ``finish_reason`` of an aborted request."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


class EngineRequestError(ValueError):
    """A request or update the engine refuses; the HTTP server answers it with 400."""


def check_request(req: GenerateRequest, vocab_size: int, context_length: int,
                  max_total_tokens: int) -> None:
    """Raise :class:`EngineRequestError` (SGLang's messages) if ``req``'s ids, lengths or
    ``logprob_start_len`` do not fit the engine."""
    ids, n_new = req.input_ids, req.params.max_new_tokens
    if not ids:
        raise EngineRequestError("input_ids cannot be empty.")
    if bad := [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]:
        raise EngineRequestError(f"The input_ids contain token id {bad[0]!r} outside the "
                                 f"vocabulary [0, {vocab_size}).")
    n_in, ctx = len(ids), context_length
    if n_in >= ctx:
        raise EngineRequestError(f"The input ({n_in} tokens) is longer than the model's "
                                 f"context length ({ctx} tokens).")
    if n_in + n_new > ctx:
        raise EngineRequestError(
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {n_in + n_new} tokens: {n_in} tokens from the "
            f"input messages and {n_new} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit.")
    if n_in + n_new > max_total_tokens:
        raise EngineRequestError(
            f"The request needs {n_in + n_new} KV tokens ({n_in} input + {n_new} new) but "
            f"the engine's KV budget is max_total_tokens={max_total_tokens}.")
    start = req.logprob_start_len
    if start < -1:
        raise EngineRequestError(f"logprob_start_len must be -1 or >= 0, got {start}.")
    if start > n_in:
        raise EngineRequestError(
            f"logprob_start_len={start} is higher than the number of input tokens {n_in}. "
            "Please use a smaller logprob_start_len.")
