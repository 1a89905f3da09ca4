"""Data for GRPO: GSM8K-format records (``records``), their sources (``sources``), synthetic
problems (``synthetic``), prompts (``prompts``) and prompt sampling (``sampler``).

Everything here is plain Python over local data; it must never import prefect or mlflow, and
never download anything unless given an explicit hub dataset name or ``s3://`` URI. Import
from the submodules.
"""
