"""Recording what a job runs, as a sweep spec to tune ahead of time (issues 18 and 42).

    with tuner.record("job-shapes.toml"):
        train()                                # every problem tuner.attention/decode ran
    # then, on a GPU host:  tuner sweep job-shapes.toml

or ``TUNER_RECORD=job-shapes.toml python train.py`` (written when the process exits).

A problem is recorded when a plan for it is made (once per shape and layout, not per call),
with the templates of every implementation that could serve it (``tuner.dispatch.rule``): torch's
SDPA templates beside ours, so the sweep also measures what the dispatcher compares against.
Problems are written by the bucket the sweep tunes (``Problem.bucketed``: one stored config
serves a bucket), one line each with ``count``, the plans the job made in that bucket: a decode
loop whose KV length grows makes a plan per step, so its steps of one bucket are one line whose
count says how often they ran, and a sweep's ``--budget`` spends its time by these counts. A
line whose calls could run only some of the recording's templates names them (``templates``):
a decode step, never a training call, is not measured by the training templates.
The file is rewritten whole (atomically) at the end of the ``with`` block, or at exit for
``TUNER_RECORD``; an existing file's problems and counts are kept, so several runs of a job add
up in one spec. The ``[recorded]`` table says what wrote it (template versions); a sweep
tunes the problems whatever versions or device recorded them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from templates.base import Problem
from templates.registry import get_template
from tuner.dispatch.plans import clear_plans
from tuner.errors import TunerError

__all__ = ["RECORDED_BY", "Recorder", "note", "record", "recording"]

log = logging.getLogger(__name__)

ENV_VAR = "TUNER_RECORD"
RECORDED_BY = "tuner.record"


class Recorder:
    """The buckets of the problems seen while active, with the templates that tune each and
    how many plans the job made in each."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise TunerError(f"cannot record to {str(self.path)!r}: its folder does not exist",
                             "give a path in an existing folder")
        self.problems: dict[Problem, set[str]] = {}  # bucket representative -> templates
        self.counts: Counter[Problem] = Counter()  # bucket representative -> plans made
        self.templates: list[str] = []  # in first-seen order
        self._lock = threading.Lock()
        if self.path.is_file():
            self._read_existing()

    def add(self, problem: Problem, templates: Iterable[str], count: int = 1) -> None:
        bucket = problem.bucketed()
        with self._lock:
            names = self.problems.setdefault(bucket, set())
            self.counts[bucket] += count
            for name in templates:
                names.add(name)
                if name not in self.templates:
                    self.templates.append(name)

    def summary(self) -> str:
        """How many problems (buckets) the recording holds and how many plans they stand for."""
        with self._lock:
            buckets, plans = len(self.problems), sum(self.counts.values())
        return (f"{buckets} problem(s) to tune (one per shape bucket), from {plans} plan(s) "
                "the job made")

    def spec_text(self) -> str:
        """The recorded problems as a TOML sweep spec."""
        with self._lock:
            problems = sorted(self.problems, key=lambda p: p.key())
            templates = list(self.templates)
            counts = dict(self.counts)
            names = {p: set(t) for p, t in self.problems.items()}
        lines = [f"# Recorded by {RECORDED_BY}: {self.summary()}.",
                 f"# Tune them with `tuner sweep {self.path.name}` on the GPU that will run the "
                 "job",
                 "# (`--budget 5m` spends the time by each problem's count x its size).",
                 f"name = {_toml(self.path.stem)}",
                 f"templates = [{', '.join(_toml(t) for t in templates)}]",
                 "shapes = ["]
        for p in problems:
            fields = {"B": p.batch, "H_q": p.heads_q, "H_kv": p.heads_kv, "N_q": p.seqlen_q,
                      "N_kv": p.seqlen_kv, "D": p.head_dim, "dtype": p.dtype,
                      "causal": p.causal, "mask": p.mask,
                      **({"softcap": p.softcap} if p.softcap else {}), "count": counts[p]}
            own = [t for t in templates if t in names[p]]
            if len(own) < len(templates):  # the job's calls of it could run only these
                fields["templates"] = own
            lines.append("  {" + ", ".join(f"{k} = {_toml(v)}" for k, v in fields.items())
                         + "},")
        lines += ["]", "", "[recorded]", f"by = {_toml(RECORDED_BY)}",
                  "versions = {" + ", ".join(f"{name} = {_toml(version)}"
                                             for name, version in _versions(templates)) + "}"]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if not self.problems:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.spec_text())
        tmp.replace(self.path)  # atomic: a reader never sees half a spec
        log.info("tuner.record wrote %s: %s", self.path, self.summary())

    def _read_existing(self) -> None:
        # lazy: optuna, sqlalchemy +0.47 s (2-core CPU); `import tuner.attention` skips it
        from tuner.tuning.suites import load_spec_file

        spec = load_spec_file(self.path)
        for problem in spec.problems:
            self.add(problem, spec.problem_templates.get(problem, spec.templates),
                     spec.counts.get(problem, 1))


def _versions(templates: Iterable[str]) -> list[tuple[str, str]]:
    """The kernel version of each recorded template that this process knows (informational:
    a sweep tunes the problems with its own kernels)."""
    found = []
    for name in templates:
        try:
            found.append((name, get_template(name).version()))
        except (ValueError, OSError):  # unregistered here, or its source is not readable
            continue
    return found


_ACTIVE: list[Recorder] = []


def recording() -> bool:
    """Whether any recorder is active (callers skip preparing a note when none is)."""
    return bool(_ACTIVE)


def note(problem: Problem, templates: Iterable[str]) -> None:
    """Record ``problem`` in every active recorder (cheap when none is: one list check)."""
    if _ACTIVE:
        names = tuple(templates)
        for recorder in _ACTIVE:
            recorder.add(problem, names)


@contextlib.contextmanager
def record(path: str | os.PathLike[str]) -> Iterator[Recorder]:
    """Record every problem run inside the block; the spec is written at its end (also when
    the block raises: what ran until then was real)."""
    recorder = Recorder(path)
    clear_plans()  # plans made before the block would not be seen again
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)
        recorder.write()


def record_from_environment() -> Recorder | None:
    """With ``TUNER_RECORD=path``: record for the whole process, written at exit."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    recorder = Recorder(path)
    _ACTIVE.append(recorder)
    atexit.register(recorder.write)
    return recorder


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):  # a softcap: finite (Problem checks it), TOML's own form
        return repr(value)
    if isinstance(value, list):  # a shape's templates
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
