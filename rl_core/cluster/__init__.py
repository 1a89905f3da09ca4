"""Where the planes run: platform detection and presets, the parallelism planner, Ray
bring-up and placement.

Import from the submodules (``rl_core.cluster.platform``, ``rl_core.cluster.planner``):
this package's ``__init__`` stays empty so that importing one never imports Ray.

Never imports Prefect or MLflow.
"""
