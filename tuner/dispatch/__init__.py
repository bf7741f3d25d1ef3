"""Which implementation runs a call, and how: the dispatch rule (``rule``), the one plan
cache (``plans``), the implementations (``implementations/``), masks recognised as block
masks (``dense_mask``, ``hf_mask``), deciding on a neighbour, and the winners and
comparisons shown to people.
"""
