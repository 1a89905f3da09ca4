"""The embedded engine's request and result records, in SGLang's terms.

``GenerateOutput.weight_version_spans`` is grpoflow's addition to SGLang's ``meta_info``: the
weight version of every output token, run-length encoded (``[[version, tokens], ...]``), so a
request that an in-place or retracting pause carried across a weight update says which tokens
each version produced (docs/training.md, "Fully asynchronous rollouts").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl_core.engine.sampling import SamplingParams
from rl_core.models.vlm import ImageInputs

__all__ = ["GenerateOutput", "GenerateRequest", "abort_reason", "add_run"]


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
