"""Block masks and the mask patterns the templates tune for: ``BlockMask`` (``block_mask``),
mask mods and patterns, packed documents, and the jit walk over a mask's lists
(``listed_blocks``, inlined into exported kernel source).
"""
