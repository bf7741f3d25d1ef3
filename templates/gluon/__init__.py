"""The Gluon (Hopper) family: forward and backward templates and kernel modules, the
persistent schedule, what both kernels share (``common``, ``template``) and the training
templates that pair a forward with a backward (``training``, ``train``, ``cudnn_train``).
"""
