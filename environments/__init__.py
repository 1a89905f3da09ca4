"""Environments built locally for grpoflow's agent demos and tests (docs/agents.md).

Real environments of the hubs users bring (``verifiers``, OpenEnv), written here because nothing
may be downloaded at run time. Not imported by ``rl_core``."""
