"""What users run: the ``grpoflow`` command line (:mod:`grpoflow.cli`), ``grpoflow doctor``
(:mod:`grpoflow.doctor`) and ``grpoflow deploy`` (:mod:`grpoflow.deploy`). The CLI runs the
pre-flight checks before it starts a flow; nothing in ``rl_core``, ``tasks`` or ``flows``
imports this package.
"""
