"""Verify stored best configs: re-measure each in a fresh trial worker, compare the times.

Issue 6's quality bar: the stored best of a problem, re-measured in a fresh process, lands
within 3% of its stored time. A re-measurement is an ordinary trial (``tuner.tuning.runner``): fresh
random inputs, the check against the template's reference, then ``do_bench`` (or wall-clock
runs under the interpreter), in a worker process that did not run the sweep. With several
repeats the median time counts. A config that fails its re-measurement (compile error, wrong
result, ...) fails the verification. The stored time of a sweep with finalists is already a
median: of the best config's first reading and its re-measurements at the end of the search
(``db.finalists``), so a lucky first reading no longer sets the bar.

Re-measured times on the H100 spread 3-10% from run to run, so a fixed 3% bar can flag noise.
Each result therefore carries the stored best's own readings and their spread (how far its
finalist readings lay apart): a deviation within it is within the config's measured noise.
``tolerance="auto"`` makes that the bar: per stored best, max(3%, its readings' spread).
``rep_ms`` times longer than the sweep's 100 ms, to lower the noise of the re-measurement.

The stored best configs are selected per problem of a sweep spec (each must have one), or
by filters over every stored best of the device, as ``tuner best`` lists them.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from db import crud
from db.session import session_scope
from templates.registry import all_templates, get_template
from tuner.errors import TunerError
from tuner.lookup.stored_bests import StoredBest
from tuner.tuning.runner.outcome import Runner, TrialOutcome, TrialRequest
from tuner.tuning.sweep import Task
from tuner.tuning.verify_options import AUTO, DEFAULT_TOLERANCE, VerifyOptions, parse_tolerance

__all__ = [
    "AUTO",
    "DEFAULT_TOLERANCE",
    "Verified",
    "VerifyOptions",
    "parse_tolerance",
    "stored_for_tasks",
    "stored_matching",
    "verify",
]

@dataclass(frozen=True)
class Verified:
    """One stored best and its re-measurements (``repeats`` trials)."""

    stored: StoredBest
    runs: tuple[TrialOutcome, ...]
    tolerance: float  # the bar this stored best was held to

    @property
    def failure(self) -> TrialOutcome | None:
        """The first re-measurement that gave no time, if any."""
        return next((r for r in self.runs if not r.ok or not r.median_ms), None)

    @property
    def measured_ms(self) -> float | None:
        if self.failure is not None or not self.runs:
            return None
        return statistics.median(r.median_ms for r in self.runs if r.median_ms)

    @property
    def measured_tflops(self) -> float | None:
        ms = self.measured_ms
        first = self.runs[0] if self.runs else None
        if ms is None or first is None or not first.tflops or not first.median_ms:
            return None
        # The problem's FLOPs over the median time, so the two columns agree for any repeats.
        return first.tflops * first.median_ms / ms

    @property
    def ratio(self) -> float | None:
        """Re-measured time / stored time: above 1 the config runs slower than stored."""
        ms = self.measured_ms
        return ms / self.stored.median_ms if ms is not None else None

    @property
    def within_tolerance(self) -> bool:
        ratio = self.ratio
        return ratio is not None and abs(ratio - 1.0) <= self.tolerance

    @property
    def within_stored_spread(self) -> bool | None:
        """Whether the deviation lies within the stored best's own readings' spread: the
        config's measured noise. None when unknown (one stored reading, or no time)."""
        ratio, spread = self.ratio, self.stored.spread
        if ratio is None or spread is None:
            return None
        return abs(ratio - 1.0) <= spread

    def to_dict(self) -> dict[str, Any]:
        failure = self.failure
        ratio = self.ratio
        return {"template": self.stored.template,
                "template_version": self.stored.template_version,
                "problem_key": self.stored.problem_key, "problem": self.stored.problem,
                "config": self.stored.config, "stored_ms": self.stored.median_ms,
                "stored_tflops": self.stored.tflops, "measured_ms": self.measured_ms,
                "measured_tflops": self.measured_tflops, "ratio": ratio,
                "deviation": None if ratio is None else ratio - 1.0,
                "tolerance": self.tolerance, "within_tolerance": self.within_tolerance,
                "stored_readings": self.stored.readings, "stored_spread": self.stored.spread,
                "within_stored_spread": self.within_stored_spread,
                "status": failure.status.value if failure else "ok",
                "reason": failure.reason if failure else "",
                "runs_ms": [r.median_ms for r in self.runs],
                "gpu_timing": all(r.gpu_timing for r in self.runs) if self.runs else False}


# ----------------------------------------------------------------------------- selection
def stored_for_tasks(url: str, device_key: str, tasks: Sequence[Task]) -> list[StoredBest]:
    """The stored best of each task's problem on ``device_key`` at the template's current
    version; a TunerError naming every problem that has none."""
    rows = []
    missing: list[str] = []
    with session_scope(url, write=False) as s:
        for task in tasks:
            row = crud.best_for(s, device_key=device_key, template_name=task.template.name,
                                template_version=task.template.version(),
                                problem_key=task.problem_key)
            if row is None:
                missing.append(task.label)
            else:
                rows.append(row)
        readings = crud.best_readings(s, rows)
        found = [StoredBest.of_row(row, readings[row.id]) for row in rows]
    if missing:
        device = device_key.split("|", 1)[0]
        raise TunerError(f"no stored best config on {device} (of the current kernel versions, "
                         f"in {url}) for: {'; '.join(missing)}",
                         "run `tuner sweep` on these problems on this device first (the same "
                         "spec or --shape flags, the same --db)")
    return found


def stored_matching(url: str, device_key: str, *, templates: Iterable[str] = (),
                    dtypes: Iterable[str] = (), variant: str | None = None
                    ) -> tuple[list[StoredBest], int]:
    """Every stored best of ``device_key`` that the filters let through (an empty filter lets
    everything through), of the registered templates at their current version; and how many
    rows were left out for being of another kernel version or an unregistered template."""
    wanted_templates, wanted_dtypes = set(templates), set(dtypes)
    current = {t.name: t.version() for t in all_templates()}
    with session_scope(url, write=False) as s:
        total = crud.count_best(s, device=device_key, variant=variant)
        rows = [r for r in crud.list_best(s, device=device_key, variant=variant,
                                          limit=max(1, total))
                if (not wanted_templates or r.template.name in wanted_templates)
                and (not wanted_dtypes or r.dtype in wanted_dtypes)]
        readings = crud.best_readings(s, rows)
        stored = [StoredBest.of_row(r, readings[r.id]) for r in rows]
    fresh = [b for b in stored if current.get(b.template) == b.template_version]
    return fresh, len(stored) - len(fresh)


# ----------------------------------------------------------------------------- measuring
def verify(stored: Sequence[StoredBest], runner: Runner, options: VerifyOptions,
           on_result: Callable[[Verified], None] | None = None) -> list[Verified]:
    """Re-measure every stored best ``options.repeats`` times with ``runner``, each time on
    fresh inputs, timing ``options.rep_ms`` ms; each is held to ``options.tolerance_for`` it."""
    rng = random.Random(options.seed)
    results: list[Verified] = []
    for best in stored:
        module = type(get_template(best.template)).__module__
        runs: list[TrialOutcome] = []
        for _ in range(options.repeats):
            request = TrialRequest(template=best.template, template_module=module,
                                   problem=best.problem, config=best.config,
                                   seed=rng.randrange(2**31), rep_ms=options.rep_ms)
            outcome = runner.measure(request, options.timeout_s)
            runs.append(outcome)
            if not outcome.ok:  # a config that fails once has failed its verification
                break
        result = Verified(best, tuple(runs), options.tolerance_for(best))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
