"""Pure RL math on torch tensors: advantages (``advantages``) and policy losses (``losses``).

No prefect or mlflow, no models, no I/O: the trainer computes log-probs and calls these
functions. Import from the submodules. The math: docs/training.md, "The loss, exactly".
"""
