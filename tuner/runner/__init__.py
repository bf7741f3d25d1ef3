"""Measuring configs: the isolated trial worker, compile-ahead, timing, outcomes."""

from __future__ import annotations

from tuner.runner.compile_ahead import CompileAhead
from tuner.runner.isolated import IsolatedRunner
from tuner.runner.measure import measure
from tuner.runner.outcome import Runner, TrialOutcome, TrialRequest

__all__ = ["CompileAhead", "IsolatedRunner", "Runner", "TrialOutcome", "TrialRequest", "measure"]
