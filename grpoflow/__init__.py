"""What users run: the ``grpoflow`` command line (:mod:`grpoflow.cli`), ``grpoflow doctor``
(:mod:`grpoflow.doctor`) and ``grpoflow deploy`` (:mod:`grpoflow.deploy`).

The CLI loads the config and runs the pre-flight checks (:mod:`rl_core.preflight`) before it
starts a flow (``flows/``); ``flows/`` holds flows only. Nothing in ``rl_core``, ``tasks`` or
``flows`` imports this package.
"""
