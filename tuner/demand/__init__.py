"""Demand: what jobs ran untuned, reported in the background (``reporter``), and the worker
that tunes it (``worker``) from a queue in the database or at the service (``queue``,
``service_queue``).
"""
