"""Measuring configs: the isolated trial worker (``isolated``), compile-ahead
(``compile_ahead``), timing (``timing``), outcomes (``outcome``).

Import the submodules themselves: this package re-exports nothing, so that
``tuner.tuning.runner.timing`` does not import torch and the kernels with ``compile_ahead`` (the
``tuner`` command's options read its ``REP_MS``; issue 41, item 1).
"""
