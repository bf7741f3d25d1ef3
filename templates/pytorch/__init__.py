"""Templates that run PyTorch's own attention, so that they are priced as ours are: SDPA
and its backends (``sdpa``), FlexAttention (``flex``), cuDNN's backward (``cudnn_bwd``).
"""
