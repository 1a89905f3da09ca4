"""Models: the embedded tiny demo model, resolving model references, shared loading helpers.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import torch

__all__ = ["torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``model.dtype`` as a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype={name!r}; allowed values: {sorted(_DTYPES)}") from None
