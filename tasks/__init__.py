"""Prefect tasks: thin, retryable, timed wrappers over ``rl_core``.

A task calls ``rl_core``, measures itself, and returns a small value. Heavy state (models,
optimizers, KV caches) stays in the planes, which tasks reach through a ``PlanesHandle``;
tasks that take one use ``cache_policy=NO_CACHE``.
"""
