"""The JSON request bodies the service reads (docs/tinker-protocol.md, sections 3-14), as the
SDK 0.38.0 sends them: ``None`` fields are omitted, ``type`` discriminators are ignored, and
unknown fields are ignored (a newer SDK may add some). A body that does not fit is answered
422 by FastAPI, which the SDK surfaces at once.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AdamParamsBody", "CreateModelBody", "CreateSamplingSessionBody", "CreateSessionBody",
           "FinishBody", "LoadWeightsBody", "LoraConfigBody", "ModelIdBody", "OptimStepBody",
           "RetrieveBody",
           "SampleBody", "SamplingParamsBody", "SaveWeightsBody", "SaveWeightsForSamplerBody",
           "SessionIdBody", "TtlBody", "WeightsInfoBody"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(_Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionIdBody(_Body):
    session_id: str


class FinishBody(_Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class LoraConfigBody(_Body):
    rank: int = Field(32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfigBody = Field(default_factory=LoraConfigBody)
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class ModelIdBody(_Body):
    model_id: str


class LoadWeightsBody(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None  # in place (deprecated load_state): with seq_id
    seq_id: int | None = None
    session_id: str | None = None  # create-via-load: with model_seq_id
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None


class AdamParamsBody(_Body):
    type: str | None = None
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepBody(_Body):
    model_id: str
    seq_id: int = 0
    adam_params: AdamParamsBody | None = None
    optimizer_params: AdamParamsBody | None = None
    optim_params: AdamParamsBody | None = None


class SaveWeightsBody(_Body):
    model_id: str
    seq_id: int = 0
    path: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerBody(_Body):
    model_id: str
    seq_id: int = 0
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsBody(_Body):
    max_tokens: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleBody(_Body):
    num_samples: int = Field(1, ge=1)
    prompt: dict[str, Any]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool | None = None


class RetrieveBody(_Body):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoBody(_Body):
    tinker_path: str


class TtlBody(_Body):
    ttl_seconds: int | None = None
