"""Split-KV decode over contiguous or paged KV caches: the template (``template``) and its
kernels (``kernel``).
"""
