"""grpoflow's embedded rollout engine: a continuous-batching PyTorch engine and its SGLang API.

``core`` (scheduler), ``kv`` (KV cache layouts), ``weights`` (served weights), ``sampling``
(seeded sampler), ``protocol`` (SGLang bodies), ``routes_*`` (FastAPI routers), ``server`` (the
app, ``python -m rl_core.engine.server``). The in-process plane drives ``core`` directly.
Never imports Prefect or MLflow.
"""
