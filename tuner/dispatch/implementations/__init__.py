"""The implementations ``tuner.attention`` chooses among, one module each, and their registry.

``base.Implementation`` is the contract (its docstring); a module subclasses it and registers
an instance with ``register_implementation``. Imported here in registration order: torch SDPA
first (the baseline), then ours, then the eager baseline of softcapped calls, then torch's
varlen attention for packed documents.
"""

from __future__ import annotations

# The order they register in is the order they are priced and listed in: SDPA first.
# isort: off
from tuner.dispatch.implementations import (  # noqa: F401
    sdpa,
    flash,
    decode,
    gluon,
    gluon_train,
    flash_gluon,
    flex,
    eager,
    torch_varlen,
)
# isort: on
from tuner.dispatch.implementations.base import Choice, Estimate, Implementation, Request, Run
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.implementations.registry import (
    get_implementation,
    implementations,
    register_implementation,
    unregister_implementation,
)

__all__ = ["Call", "Choice", "Estimate", "Implementation", "Request", "Run",
           "get_implementation", "implementations", "register_implementation",
           "unregister_implementation"]
