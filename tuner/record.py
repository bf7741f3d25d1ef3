"""Recording what a job runs, as a sweep spec to tune ahead of time (issue 18, item 3).

    with tuner.record("job-shapes.toml"):
        train()                                # every problem tuner.attention/decode ran
    # then, on a GPU host:  tuner sweep job-shapes.toml

or ``TUNER_RECORD=job-shapes.toml python train.py`` (written when the process exits).

A problem is recorded when a plan for it is made (once per shape and layout, not per call),
with the templates of every implementation that could serve it (``tuner.dispatch``): torch's
SDPA templates beside ours, so the sweep also measures what the dispatcher compares against.
Each shape is written with its own dtype, causal mode and mask, so the spec tunes exactly the
recorded problems. The file is rewritten whole (atomically) at the end of the ``with`` block,
or at exit for ``TUNER_RECORD``; an existing file's problems are kept, so several runs of a job
add up in one spec.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from templates.base import Problem
from tuner.errors import TunerError
from tuner.plans import clear_plans

__all__ = ["Recorder", "note", "record", "recording"]

ENV_VAR = "TUNER_RECORD"


class Recorder:
    """The problems seen while active, with the templates that tune each."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise TunerError(f"cannot record to {str(self.path)!r}: its folder does not exist",
                             "give a path in an existing folder")
        self.problems: dict[Problem, set[str]] = {}
        self.templates: list[str] = []  # in first-seen order
        self._lock = threading.Lock()
        if self.path.is_file():
            self._read_existing()

    def add(self, problem: Problem, templates: Iterable[str]) -> None:
        with self._lock:
            names = self.problems.setdefault(problem, set())
            for name in templates:
                names.add(name)
                if name not in self.templates:
                    self.templates.append(name)

    def spec_text(self) -> str:
        """The recorded problems as a TOML sweep spec."""
        with self._lock:
            problems = sorted(self.problems, key=lambda p: p.key())
            templates = list(self.templates)
        lines = [f"# Recorded by tuner.record: {len(problems)} problem(s) a job ran. Tune them",
                 f"# with `tuner sweep {self.path.name}` on the GPU that will run the job.",
                 f"name = {_toml(self.path.stem)}",
                 f"templates = [{', '.join(_toml(t) for t in templates)}]",
                 "shapes = ["]
        for p in problems:
            fields = {"B": p.batch, "H_q": p.heads_q, "H_kv": p.heads_kv, "N_q": p.seqlen_q,
                      "N_kv": p.seqlen_kv, "D": p.head_dim, "dtype": p.dtype,
                      "causal": p.causal, "mask": p.mask}
            lines.append("  {" + ", ".join(f"{k} = {_toml(v)}" for k, v in fields.items())
                         + "},")
        lines.append("]")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if not self.problems:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.spec_text())
        tmp.replace(self.path)  # atomic: a reader never sees half a spec

    def _read_existing(self) -> None:
        from tuner.suites import load_spec_file

        spec = load_spec_file(self.path)
        for problem in spec.problems:
            self.add(problem, spec.templates)


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
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
