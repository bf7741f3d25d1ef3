"""``tuner.install()`` / ``tuner.uninstall()``: calls of torch's own
``torch.nn.functional.scaled_dot_product_attention`` in code we do not own (diffusers, timm, a
user's model, transformers' "sdpa" path) run ``tuner.attention``, the dispatcher, instead.

    import tuner
    tuner.install()          # F.scaled_dot_product_attention(...) now asks the dispatcher
    ...
    tuner.uninstall()        # torch's own function again, the same object

``install`` puts ``tuner.attention`` (SDPA's signature and semantics) in the function's place
on ``torch.nn.functional``; a call that looks the name up when it runs (``F.scaled_dot_
product_attention(...)``, as those libraries write it) reaches the dispatcher, eager or under
torch.compile. A name bound before ``install`` (``from torch.nn.functional import
scaled_dot_product_attention`` at import) keeps torch's function: import tuner and install
first. Where the dispatcher chooses SDPA it calls torch's own function, kept by
``templates.pytorch.sdpa`` as torch defined it, so there is no recursion and the result is what
torch gives.

Why not torch's provider hook (``torch.nn.attention.register_flash_attention_impl`` /
``activate_flash_attention_impl``, in torch 2.13; absent in 2.11): it replaces the kernels of
one SDPA backend (FLASH_ATTENTION's aten ops) below torch's own backend choice, so it sees
only the calls torch already sent to that backend (no masks, no cuDNN's calls) and cannot
hand a call back to torch's other backends when they are faster; the dispatcher needs every
call, before torch chooses.
"""

from __future__ import annotations

import torch.nn.functional as F

from templates.pytorch.sdpa import TORCH_SDPA_FUNCTION
from tuner.attention import attention

__all__ = ["install", "installed", "uninstall"]


def install() -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through ``tuner.attention``
    (idempotent)."""
    current = F.scaled_dot_product_attention
    if current is not TORCH_SDPA_FUNCTION and current is not attention:
        raise RuntimeError(
            "torch.nn.functional.scaled_dot_product_attention was already replaced by "
            f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', current)}; "
            "tuner.install() will not stack on another patch: undo that one first")
    F.scaled_dot_product_attention = attention  # type: ignore[assignment]


def uninstall() -> None:
    """Put torch's own function back (idempotent)."""
    if F.scaled_dot_product_attention is attention:
        F.scaled_dot_product_attention = TORCH_SDPA_FUNCTION


def installed() -> bool:
    """Whether ``torch.nn.functional.scaled_dot_product_attention`` is the dispatcher now."""
    return F.scaled_dot_product_attention is attention
