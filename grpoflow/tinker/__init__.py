"""A Tinker-compatible training service: the real Tinker SDK
(``tinker.ServiceClient(base_url=..., api_key="tml-...")``) trains and samples LoRA adapters
on grpoflow's compute (``rl_core.tinker``). The wire protocol: docs/tinker-protocol.md.

* :mod:`.app`: :func:`create_app`, the FastAPI routes, authentication and encodings;
* :mod:`.service`: the operations behind them (:mod:`.sampling`: the sampling ones);
  :mod:`.rest`: the RestClient routes; :mod:`.errors`: a refusal as its HTTP status;
* :mod:`.futures`: request ids, long-polls, one worker thread per base model, ``seq_id`` order;
* :mod:`.proto`: the protobuf bodies; :mod:`.schemas`: the JSON bodies;
* :mod:`.state`: sessions, models, samplers, and runs and checkpoints on disk;
* :mod:`.backend`: :class:`Backend`, what the service needs from its compute, and the
  tracker interfaces; :mod:`.lineage`: the MLflow tracker (a run per training client);
* :mod:`.auth`: tenants' hashed keys and the request-size bound;
* :mod:`.serve`: ``grpoflow serve-tinker CONFIG``.

The ``tinker`` package (its protobuf schema) is an optional dependency:
``pip install 'grpoflow[tinker]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any) -> FastAPI:  # noqa: ANN401
    """:func:`grpoflow.tinker.app.create_app` (imported on first use)."""
    from grpoflow.tinker.app import create_app as _create_app

    return _create_app(*args, **kwargs)
