"""Data for GRPO: GSM8K-format records, their sources, synthetic problems, prompts, sampling.

Everything here is plain Python over local data; it must never import prefect or mlflow, and
never download anything unless given an explicit hub dataset name.
"""

from rl_core.data.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    PLAIN_TEMPLATE,
    encode_prompts,
    render_prompt,
)
from rl_core.data.records import (
    BadRow,
    DataValidationError,
    Record,
    extract_final_answer,
    records_digest,
    validate_numbered_rows,
    validate_records,
)
from rl_core.data.sampler import PromptSampler
from rl_core.data.sources import load_records, read_parquet, write_parquet
from rl_core.data.synthetic import generate_arithmetic, generate_splits

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "PLAIN_TEMPLATE",
    "BadRow",
    "DataValidationError",
    "PromptSampler",
    "Record",
    "encode_prompts",
    "extract_final_answer",
    "generate_arithmetic",
    "generate_splits",
    "load_records",
    "read_parquet",
    "records_digest",
    "render_prompt",
    "validate_numbered_rows",
    "validate_records",
    "write_parquet",
]
