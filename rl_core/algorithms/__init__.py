"""Pure RL math for grpoflow: advantages (``advantages``) and policy losses (``losses``) on
torch tensors.

Nothing in this package may import prefect or mlflow, touch models, or do I/O; the trainer
computes log-probs and calls these functions. Import from the submodules.
"""
