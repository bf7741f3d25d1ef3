"""Replay: the search logic on recorded trial results, without a GPU.

A :class:`ReplayRunner` answers each config with its recorded measurement (a config that
was never recorded answers ``runtime_error``), so the same ``ProblemSearch`` that drives a
real sweep runs in milliseconds per trial on an in-memory study. Uses: testing the samplers
and the search loop, and comparing samplers offline, e.g. what TPE finds with a quarter of
the trials against the best of a full grid sweep recorded on the GPU (``tuner replay``).

Recordings come from the project database (every trial of a device and template) or from a
JSON file written by ``tuner export --trials``::

    {"format": "attention-tuner/trials", "version": 1,
     "problems": [{"template": "flash_fwd", "template_version": "...", "device": {...},
                   "problem": {...}, "problem_key": "...",
                   "trials": [{"config": {...}, "status": "ok", "tflops": 412.0,
                               "median_ms": 1.3, "reason": "",
                               "remeasurements": [{"status": "ok", "median_ms": 1.32,
                                                   ...}]}, ...]}]}

``remeasurements`` (a finalist's further readings, oldest first; absent from older files) are
carried for analysis; a replay runs no finalists and answers each config with its first
reading.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
from sqlalchemy import select

from db.models import Device, Remeasurement, Trial, TrialStatus
from db.models import Template as TemplateRow
from db.session import session_scope
from templates.base import KernelConfig, Problem, Template
from templates.registry import get_template
from tuner.errors import TunerError
from tuner.lookup.resolver import device_info_from_row
from tuner.lookup.stored_bests import StoredBest
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.search.loop import ProblemSearch, SearchSettings
from tuner.tuning.search.prior import transfer_prior
from tuner.tuning.search.samplers import make_sampler
from tuner.tuning.search.space import SearchSpace, SpaceRestriction, problem_space
from tuner.tuning.search.store import MemoryStore
from tuner.tuning.sweep import device_from_dict

if TYPE_CHECKING:
    from sqlalchemy import Select

__all__ = [
    "TRIALS_FORMAT",
    "RecordedProblem",
    "ReplayResult",
    "ReplayRunner",
    "SamplerSummary",
    "compare_samplers",
    "dump_recorded",
    "load_recorded_file",
    "load_recorded_from_db",
    "replay",
    "search_space",
]

log = logging.getLogger(__name__)
TRIALS_FORMAT = "attention-tuner/trials"
NOT_RECORDED = "not recorded: replay has no measurement of this config"


@dataclass(frozen=True)
class RecordedProblem:
    """Every recorded trial of one problem of one template on one device."""

    template: str
    template_version: str
    device: dict[str, Any]  # DeviceInfo fields plus "key"
    problem: dict[str, Any]
    problem_key: str
    trials: dict[str, TrialOutcome]  # by config key
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by config key
    # A finalist's re-measurements, oldest first, by config key (configs without: absent).
    remeasurements: dict[str, tuple[TrialOutcome, ...]] = field(default_factory=dict)

    @property
    def best_tflops(self) -> float | None:
        values = [o.tflops for o in self.trials.values() if o.ok and o.tflops]
        return max(values) if values else None

    @property
    def results(self) -> int:
        """Recorded configs with a result (invalid ones do not count)."""
        return sum(1 for o in self.trials.values() if o.status != TrialStatus.INVALID)

    def within(self, space: SearchSpace) -> RecordedProblem:
        """The recording of the configs inside ``space`` only (all of it for a whole space)."""
        if space.is_full:
            return self
        keys = [key for key, config in self.configs.items()
                if key in self.trials and space.contains(config)]
        return dataclasses.replace(
            self, trials={k: self.trials[k] for k in keys},
            configs={k: self.configs[k] for k in keys},
            remeasurements={k: v for k, v in self.remeasurements.items() if k in keys})

    def to_dict(self) -> dict[str, Any]:
        trials = []
        for key, o in self.trials.items():
            row = {"config": self.configs.get(key, {}), **_reading(o), "compile_s": o.compile_s}
            if self.remeasurements.get(key):
                row["remeasurements"] = [_reading(r) for r in self.remeasurements[key]]
            trials.append(row)
        return {"template": self.template, "template_version": self.template_version,
                "device": self.device, "problem": self.problem,
                "problem_key": self.problem_key, "trials": trials}


def _reading(outcome: TrialOutcome) -> dict[str, Any]:
    return {"status": outcome.status.value, "reason": outcome.reason, "tflops": outcome.tflops,
            "median_ms": outcome.median_ms, "error": outcome.error}


class ReplayRunner:
    """A runner that answers from recorded outcomes; counts what it was asked.

    ``delay_s`` stands in for the benchmark's time, so that concurrent searches overlap as
    they do on a GPU.
    """

    def __init__(self, template: Template, outcomes: Mapping[str, TrialOutcome], *,
                 delay_s: float = 0.0) -> None:
        self.template = template
        self.outcomes = dict(outcomes)
        self.delay_s = delay_s
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        key = self.template.config(request.config).key()
        with self._lock:
            self.calls[key] += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.outcomes.get(key) or TrialOutcome.failed(TrialStatus.RUNTIME_ERROR,
                                                             NOT_RECORDED)


@dataclass(frozen=True)
class ReplayResult:
    problem_key: str
    sampler: str
    seed: int | None
    budget: int
    measured: int  # configs the replayed search ran
    best_found_tflops: float | None
    best_recorded_tflops: float | None
    default_tflops: float | None
    repeated: int = 0  # configs the runner was asked for more than once (should be none)

    @property
    def fraction_of_best(self) -> float | None:
        """Best found / best recorded: 1.0 means the search found the recorded best."""
        if not self.best_found_tflops or not self.best_recorded_tflops:
            return None
        return self.best_found_tflops / self.best_recorded_tflops

    def to_dict(self) -> dict[str, Any]:
        return {"problem_key": self.problem_key, "sampler": self.sampler, "seed": self.seed,
                "budget": self.budget, "measured": self.measured,
                "best_found_tflops": self.best_found_tflops,
                "best_recorded_tflops": self.best_recorded_tflops,
                "default_tflops": self.default_tflops, "repeated": self.repeated,
                "fraction_of_best": self.fraction_of_best}


def replay(recorded: RecordedProblem, *, sampler: str, budget: int, seed: int | None = None,
           space: SpaceRestriction | None = None, default_first: bool = True,
           prior: Sequence[KernelConfig] = ()) -> ReplayResult:
    """Run the search on ``recorded`` as if on the GPU; see the module docstring.

    ``space`` narrows the search as the recorded sweep's spec did (its [space] table): a
    grid recorded over a subset must be replayed over the same subset. ``default_first=False``
    leaves out the default and known good configs a sweep measures first: the sampler alone.
    ``prior``: the transfer prior, measured after the default (``recorded_prior``).

    No finalists: the runner answers each config with its first reading (a recording's
    re-measurements are not replayed), so re-measuring would answer it again and change no
    choice; it would only make ``repeated`` count them.
    """
    template = _template(recorded.template)
    problem = Problem.from_dict(recorded.problem)
    device = device_from_dict(recorded.device)
    if template.problem_key(problem) != recorded.problem_key:
        raise TunerError(f"recorded problem key {recorded.problem_key!r} is not what template "
                         f"{template.name!r} gives its problem ({template.problem_key(problem)!r})",
                         "record and replay with the same template code")
    searched = search_space(recorded, space)
    recorded = recorded.within(searched)
    runner = ReplayRunner(template, recorded.trials)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="maximize",
                                sampler=make_sampler(sampler, searched, budget=budget, seed=seed))
    store = MemoryStore()
    search = ProblemSearch(template=template, problem=problem, device=device, study=study,
                           store=store, runner=runner, space=searched, prior=prior,
                           settings=SearchSettings(budget=budget, timeout_s=1.0, seed=seed,
                                                   default_first=default_first, finalists=0))
    stats = search.run()
    default_key = template.default_config(problem, device).key()
    default = recorded.trials.get(default_key)
    return ReplayResult(problem_key=recorded.problem_key, sampler=sampler, seed=seed,
                        budget=budget, measured=stats.measured,
                        best_found_tflops=stats.best.tflops if stats.best else None,
                        best_recorded_tflops=recorded.best_tflops,
                        default_tflops=default.tflops if default and default.ok else None,
                        repeated=sum(1 for n in runner.calls.values() if n > 1))


@dataclass(frozen=True)
class SamplerSummary:
    """One sampler over several seeds on one recorded problem."""

    problem_key: str
    sampler: str
    budget: int
    runs: list[ReplayResult]

    @property
    def mean_fraction(self) -> float | None:
        values = [r.fraction_of_best for r in self.runs if r.fraction_of_best is not None]
        return statistics.fmean(values) if values else None

    @property
    def worst_fraction(self) -> float | None:
        values = [r.fraction_of_best for r in self.runs if r.fraction_of_best is not None]
        return min(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        return {"problem_key": self.problem_key, "sampler": self.sampler,
                "budget": self.budget, "mean_fraction_of_best": self.mean_fraction,
                "worst_fraction_of_best": self.worst_fraction,
                "runs": [r.to_dict() for r in self.runs]}


def compare_samplers(recorded: RecordedProblem, *, samplers: Sequence[str], budget: int,
                     seeds: Sequence[int], space: SpaceRestriction | None = None,
                     default_first: bool = True,
                     prior: Sequence[KernelConfig] = ()) -> list[SamplerSummary]:
    return [SamplerSummary(recorded.problem_key, name, budget,
                           [replay(recorded, sampler=name, budget=budget, seed=seed,
                                   space=space, default_first=default_first, prior=prior)
                            for seed in seeds])
            for name in samplers]


def recorded_prior(recorded: RecordedProblem,
                   others: Sequence[RecordedProblem]) -> list[KernelConfig]:
    """The transfer prior a sweep of ``recorded`` would measure first
    (``tuner.tuning.search.prior``), from the best recorded config of each of ``others`` (the
    recording's other problems, as if their sweeps had stored them; ``recorded`` itself is left
    out)."""
    rows = []
    for other in others:
        if other.template != recorded.template or other.problem_key == recorded.problem_key:
            continue
        ok = [(o.tflops, key) for key, o in other.trials.items()
              if o.ok and o.tflops and key in other.configs]
        if ok:
            tflops, key = max(ok)
            median_ms = other.trials[key].median_ms
            rows.append(StoredBest(device_key=other.device.get("key", ""),
                                   template=other.template,
                                   template_version=other.template_version,
                                   problem_key=other.problem_key, problem=other.problem,
                                   config=other.configs[key], tflops=float(tflops),
                                   median_ms=float(median_ms or 0.0)))
    template = _template(recorded.template)
    return transfer_prior(template, recorded.template_version,
                          Problem.from_dict(recorded.problem), device_from_dict(recorded.device),
                          recorded.device.get("key", ""), rows)


def search_space(recorded: RecordedProblem,
                 space: SpaceRestriction | None = None) -> SearchSpace:
    """The space a replay of ``recorded`` searches: the template's whole space, or the subset
    ``space`` allows for that problem on the recorded device."""
    template = _template(recorded.template)
    try:
        return problem_space(template, Problem.from_dict(recorded.problem),
                             device_from_dict(recorded.device), space)
    except ValueError as exc:
        raise TunerError(str(exc), "give the [space] of the spec the recording was swept "
                         "with") from None


# ----------------------------------------------------------------------------- recordings
def _template(name: str) -> Template:
    try:
        return get_template(name)
    except ValueError as exc:
        raise TunerError(str(exc), "replay recordings of a registered template") from None


def _outcome(*, status: str, **fields: Any) -> TrialOutcome:
    return TrialOutcome(status=TrialStatus(status), reason=fields.get("reason") or "",
                        median_ms=fields.get("median_ms"), tflops=fields.get("tflops"),
                        compile_s=fields.get("compile_s"), error=fields.get("error"))


_Query = TypeVar("_Query", bound="Select[*tuple[Any, ...]]")


def load_recorded_from_db(url: str, *, template: str | None = None,
                          device: str | None = None) -> list[RecordedProblem]:
    """Every problem with trials in the database, filtered by template name and device name
    or key."""
    def chosen(query: _Query) -> _Query:
        query = query.join(Device, Trial.device_id == Device.id) \
            .join(TemplateRow, Trial.template_id == TemplateRow.id)
        if template is not None:
            query = query.where(TemplateRow.name == template)
        if device is not None:
            query = query.where((Device.name == device) | (Device.key == device))
        return query

    groups: dict[tuple[int, int, str], RecordedProblem] = {}
    of_trial: dict[int, tuple[RecordedProblem, str]] = {}  # trial id -> its group, config key
    with session_scope(url, write=False) as s:
        query = chosen(select(Trial, Device, TemplateRow)).order_by(Trial.id)
        for trial, dev, tpl in s.execute(query):
            ident = (dev.id, tpl.id, trial.problem_key)
            group = groups.get(ident)
            if group is None:
                info = device_info_from_row(dev)
                group = groups[ident] = RecordedProblem(
                    template=tpl.name, template_version=tpl.version,
                    device=info.to_dict() | {"key": dev.key}, problem=dict(trial.problem),
                    problem_key=trial.problem_key, trials={})
            group.trials[trial.config_key] = _outcome(
                status=TrialStatus(trial.status).value, reason=trial.reason, median_ms=trial.median_ms,
                tflops=trial.tflops, compile_s=trial.compile_s, error=trial.error)
            group.configs[trial.config_key] = dict(trial.config)
            of_trial[trial.id] = (group, trial.config_key)
        again = chosen(select(Remeasurement).join(Trial, Remeasurement.trial_id == Trial.id))
        for row in s.scalars(again.order_by(Remeasurement.id)):
            if row.trial_id not in of_trial:  # its trial came after the first query
                continue
            group, key = of_trial[row.trial_id]
            group.remeasurements[key] = (*group.remeasurements.get(key, ()), _outcome(
                status=TrialStatus(row.status).value, reason=row.reason,
                median_ms=row.median_ms, tflops=row.tflops, error=row.error))
    return list(groups.values())


def dump_recorded(problems: Sequence[RecordedProblem]) -> dict[str, Any]:
    return {"format": TRIALS_FORMAT, "version": 1, "problems": [p.to_dict() for p in problems]}


def load_recorded_file(path: Path) -> list[RecordedProblem]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TunerError(f"cannot read trials file {str(path)!r}: {exc}",
                         "give a file written by `tuner export --trials`") from None
    if not isinstance(data, dict) or data.get("format") != TRIALS_FORMAT:
        raise TunerError(f"{str(path)!r} is not a trials file (format must be "
                         f"{TRIALS_FORMAT!r})", "write one with `tuner export --trials FILE`")
    problems: list[RecordedProblem] = []
    for i, item in enumerate(data.get("problems", [])):
        try:
            template = _template(item["template"])
            trials: dict[str, TrialOutcome] = {}
            configs: dict[str, dict[str, Any]] = {}
            again: dict[str, tuple[TrialOutcome, ...]] = {}
            for row in item["trials"]:
                key = template.config(row["config"]).key()
                trials[key] = _outcome(**row)
                configs[key] = dict(row["config"])
                if row.get("remeasurements"):
                    again[key] = tuple(_outcome(**r) for r in row["remeasurements"])
            problems.append(RecordedProblem(
                template=item["template"], template_version=item["template_version"],
                device=dict(item["device"]), problem=dict(item["problem"]),
                problem_key=item["problem_key"], trials=trials, configs=configs,
                remeasurements=again))
        except (KeyError, TypeError, ValueError) as exc:
            raise TunerError(f"{str(path)!r}: problems[{i}] is malformed: "
                             f"{type(exc).__name__}: {exc}",
                             "re-export it with `tuner export --trials`") from None
    return problems
