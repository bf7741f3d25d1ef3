"""The Triton FlashAttention family: forward and backward templates (``fwd``, ``bwd``),
their kernel modules (``fwd_kernel``, ``bwd_kernel``: torch and triton only, exported as
standalone source) and the autograd function over both (``autograd``).
"""
