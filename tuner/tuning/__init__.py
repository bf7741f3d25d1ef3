"""Tuning: sweeps over suites (``sweep``, ``suites``), the search (``search/``), trial
processes and timing (``runner/``), the head-to-head, verification, replay, GPU claims.
"""
