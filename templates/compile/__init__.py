"""Compiling and launching: launch plans kept per argument layout (``plan_cache``),
direct launches and TMA tensor maps, stand-in tensors, offline compiles for a GPU this
host does not have (``offline_target``, ``report``: ``tuner compile-check``).
"""
