"""The search: a template's space as Optuna distributions, samplers, studies in the project
database, the per-problem ask/tell loop and where its results are stored."""

from __future__ import annotations

from tuner.tuning.search.loop import ProblemSearch, SearchSettings, SearchStats, TrialEvent
from tuner.tuning.search.samplers import SAMPLERS, ExhaustiveSampler, make_sampler
from tuner.tuning.search.space import SearchSpace, problem_space
from tuner.tuning.search.store import DbStore, MemoryStore, ProblemBest, ResultStore, StoredResult
from tuner.tuning.search.study import make_storage, open_study, study_name

__all__ = [
    "SAMPLERS",
    "DbStore",
    "ExhaustiveSampler",
    "MemoryStore",
    "ProblemBest",
    "ProblemSearch",
    "ResultStore",
    "SearchSettings",
    "SearchSpace",
    "SearchStats",
    "StoredResult",
    "TrialEvent",
    "make_sampler",
    "make_storage",
    "open_study",
    "problem_space",
    "study_name",
]
