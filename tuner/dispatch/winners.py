"""Per stored problem of a device: which implementation ``tuner.attention`` runs, the
runner-up, the margin, and every measured implementation's TFLOP/s beside them.

One computation for ``tuner winners``, ``tuner best``, ``GET /v1/winners`` and the dashboard.
It reads the stored bests of the forward templates of ``tuner.dispatch.rule``'s implementations
(torch_sdpa, flash_fwd, gluon_fwd, flash_decode) at the kernel versions of whoever asks (a
best tuned for other kernel source is not what would run there: it is counted as ``stale``
and left out), and ranks them by TFLOP/s, the dispatcher's rule for inference calls
(docs/DISPATCH.md). A problem without a ``torch_sdpa`` best runs torch SDPA whatever else is
stored: its winner is ``sdpa`` with no margin.

Beside ``sdpa``'s best backend, each SDPA backend's own best time (``sdpa_backends``), from the
``torch_sdpa`` trials of the same kernel version, chosen and timed by the rule of the stored
bests (``db.finalists``): cuDNN against FlashAttention-2 against memory-efficient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy.orm import Session

import tuner.dispatch.implementations  # noqa: F401  (registers the implementations)
from db import crud
from db.finalists import Measured, Readings, choose_best
from tuner.dispatch.close_calls import decided
from tuner.dispatch.rule import BASELINE, get_implementation, implementations
from tuner.wire import BackendTime, ProblemWinner, WinnersOut

__all__ = ["backend_times", "forward_templates", "rank_problems", "stored_winners"]

VersionOf = Callable[[str], str]  # template name -> the kernel version that runs here

# Rows per device read at most: far more bests than a device ever holds.
MAX_ROWS = 100_000


def forward_templates() -> dict[str, str]:
    """Template name -> the implementation whose inference calls it prices: the first
    registered with that forward (``gluon``, not ``gluon_train`` or another training pairing
    of the same forward, whose inference calls are the first's)."""
    impl_of: dict[str, str] = {}
    for impl in implementations():
        impl_of.setdefault(impl.forward, impl.name)
    return impl_of


def backend_times(configs: Iterable[tuple[Mapping[str, Any], Measured]]
                  ) -> dict[str, BackendTime]:
    """By SDPA backend (the ``backend`` knob of ``torch_sdpa`` configs), fastest first: the
    best of its configs of one problem (``db.crud.measured_configs``) by ``db.finalists``'
    rule, at the time a stored best of it would have: the backend the problem's best runs
    shows the best's own time. A backend whose configs are all disqualified is absent."""
    by_backend: dict[str, list[Measured]] = {}
    for config, measured in configs:
        if "backend" in config:
            by_backend.setdefault(str(config["backend"]), []).append(measured)
    times = {}
    for backend, candidates in by_backend.items():
        choice = choose_best(candidates)
        if choice is not None:
            best = choice.best
            times[backend] = BackendTime(median_ms=best.priced_median_ms,
                                         tflops=best.priced_tflops,
                                         readings=best.priced_readings.count)
    return dict(sorted(times.items(), key=lambda item: item[1].median_ms))


def rank_problems(rows: Iterable[Any], version_of: VersionOf,
                  sdpa_backends: Mapping[str, dict[str, BackendTime]] | None = None,
                  head_to_heads: Mapping[int, Readings] | None = None
                  ) -> tuple[list[ProblemWinner], int]:
    """The problems of ``rows`` (``db.models.BestConfig`` of one device, template loaded),
    each with its winner, ranked as the dispatcher ranks; and how many rows were stale.
    ``sdpa_backends``: each SDPA backend's time, by problem key (``backend_times``);
    ``head_to_heads``: by best id, the head-to-head readings a best's time comes from
    (``Readings.head_to_head`` set)."""
    sdpa_backends = sdpa_backends or {}
    head_to_heads = head_to_heads or {}
    impl_of = forward_templates()
    baseline = get_implementation(BASELINE)
    by_problem: dict[str, dict[str, Any]] = {}
    stale = 0
    for row in rows:
        name = row.template.name
        if name not in impl_of:
            continue
        if row.template.version != version_of(name):
            stale += 1
            continue
        entry = by_problem.setdefault(row.problem_key, {
            "problem": dict(row.problem), "tflops": {}, "median_ms": {}, "configs": {},
            "readings": {}})
        impl = impl_of[name]
        if row.id in head_to_heads:
            entry["readings"][impl] = head_to_heads[row.id]
        entry["tflops"][impl] = float(row.tflops)
        entry["median_ms"][impl] = float(row.median_ms)
        entry["configs"][impl] = dict(row.config)
    items = []
    for key, entry in sorted(by_problem.items()):
        tflops = entry["tflops"]
        ranked = sorted(tflops, key=lambda name: -tflops[name])
        measured_baseline = baseline.name in tflops
        winner = ranked[0] if measured_baseline else baseline.name
        runner_up = next((name for name in ranked if name != winner), None)
        items.append(ProblemWinner(
            problem_key=key, problem=entry["problem"], winner=winner, runner_up=runner_up,
            margin=(tflops[winner] / tflops[runner_up]
                    if measured_baseline and runner_up else None),
            why=("fastest measured" if measured_baseline else
                 f"{baseline.forward} not measured: torch SDPA runs as the user's call would"),
            tflops=tflops, median_ms=entry["median_ms"], configs=entry["configs"],
            head_to_head={impl: found.head_to_head
                          for impl, found in entry["readings"].items()},
            sdpa_backends=sdpa_backends.get(key, {}),
            decided=(_decided(entry["readings"].get(winner), entry["readings"].get(runner_up))
                     if measured_baseline and runner_up else None)))
    return items, stale


def _decided(winner: Readings | None, runner_up: Readings | None) -> bool | None:
    """Whether the winner's and the runner-up's readings of one head-to-head tell them
    apart (``tuner.dispatch.close_calls.decided``); None where they do not come from the same
    one."""
    if (winner is None or runner_up is None or winner.head_to_head is None
            or winner.head_to_head != runner_up.head_to_head):
        return None
    return decided(winner.by_round(), runner_up.by_round())


def stored_winners(s: Session, *, device: str, version_of: VersionOf,
                   dtype: str | None = None) -> WinnersOut:
    """``rank_problems`` over the bests stored for ``device`` (a device's key or name), with
    the head-to-head each best's time comes from (``db.crud.best_readings``).

    A name that several stored devices carry (the same GPU under two torch versions) raises
    ValueError listing their keys: their measurements are not comparable. With nothing
    stored, the answer has no items and ``device`` as given. Each SDPA backend's time comes
    from the device's ``torch_sdpa`` trials at ``version_of``'s version: two more queries
    (``db.crud.measured_configs``), not two per problem.
    """
    rows = crud.list_best(s, device=device, dtype=dtype, templates=list(forward_templates()),
                          limit=MAX_ROWS)
    devices = {row.device.key: row.device.name for row in rows}
    if len(devices) > 1:
        raise ValueError(f"device {device!r} is the name of {len(devices)} stored devices, "
                         f"whose measurements do not compare; name one by its key: "
                         f"{sorted(devices)}")
    key, name = next(iter(devices.items()), (device, device))
    sdpa = get_implementation(BASELINE).forward
    trials = (crud.measured_configs(s, device_key=key, template_name=sdpa,
                                    template_version=version_of(sdpa)) if rows else {})
    sessions = {best_id: found for best_id, found in crud.best_readings(s, rows).items()
                if found.head_to_head is not None}
    items, stale = rank_problems(rows, version_of, {
        problem_key: backend_times(configs) for problem_key, configs in trials.items()},
        sessions)
    return WinnersOut(device=key, device_name=name, items=items, stale=stale)
