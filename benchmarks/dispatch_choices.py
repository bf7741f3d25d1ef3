"""What the dispatcher would run with one database against another: per stored problem and
call kind (inference, training), the implementation and configs ``tuner.attention`` chooses
with each, and whether they agree (issue 42: a short sweep is as good as a longer one where it
makes the job run the same kernels).

    python benchmarks/dispatch_choices.py short.db long.db        # any two sweeps' databases

Why beside ``time_to_tuned.py``'s readings: a problem's fastest reading in a sweep is a minimum
over noisy readings, lower the more readings there are; a sweep 4x as long reads a 25 us
decode kernel at 25-52 us (H200, one sweep, the same config), so its minimum beats a short
sweep's by 10% or more while both run the same kernel. Where the choices differ, the short
sweep's choice is priced by the long sweep's own measurements (its estimate of that
implementation on that problem: the same run's conditions for both).

No GPU: the choice is the dispatcher's rule on the stored measurements (``tuner.dispatch.rule``
``choose``), for the device the databases hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tuner  # noqa: E402, F401  (registers the templates and implementations)
from db.models import BestConfig, Device  # noqa: E402
from db.session import dispose_engine, session_scope  # noqa: E402
from templates.base import Problem  # noqa: E402
from templates.device import DeviceInfo  # noqa: E402
from tuner.attention import clear_plans  # noqa: E402
from tuner.dispatch.implementations.base import Choice  # noqa: E402
from tuner.dispatch.implementations.call import Call  # noqa: E402
from tuner.dispatch.rule import choose  # noqa: E402
from tuner.lookup.devices import device_info_from_row  # noqa: E402
from tuner.lookup.resolver import ConfigResolver, set_resolver  # noqa: E402
from tuner.settings import load_settings  # noqa: E402

KINDS = {False: "inference", True: "training"}


@dataclass(frozen=True)
class Chosen:
    """One database's choice for one (problem, kind)."""

    implementation: str
    configs: tuple[str, ...]  # each priced template's config key, in the implementation's order
    ms: float | None  # its estimated time (None: not measured, e.g. SDPA by default)
    prices: dict[str, float]  # every measured implementation's estimate there, ms


def stored(db_url: str) -> tuple[DeviceInfo, dict[str, Problem]]:
    """The database's one device and its problems (by key)."""
    with session_scope(db_url) as session:
        devices = session.query(Device).all()
        if len(devices) != 1:
            raise SystemExit(f"error: {db_url} holds {len(devices)} devices; compare databases "
                             "of one device's sweeps")
        device = device_info_from_row(devices[0])
        problems = {row.problem_key: Problem.from_dict(row.problem)
                    for row in session.query(BestConfig)}
    return device, problems


@contextmanager
def resolving_from(db_url: str) -> Iterator[None]:
    """The dispatcher reads ``db_url`` (and no shipped table) inside; after, a resolver
    from the environment again."""
    set_resolver(ConfigResolver(load_settings(database_url=db_url, url=None, shipped="off")))
    clear_plans()
    try:
        yield
    finally:
        set_resolver(None)
        clear_plans()


def _chosen(choice: Choice) -> Chosen:
    prices = {e.implementation: e.ms for e in choice.estimates if e.ms is not None}
    return Chosen(choice.implementation.name,
                  tuple(r.config.key() for r in choice.resolved),
                  prices.get(choice.implementation.name), prices)


def choices(db_url: str, device: DeviceInfo, problems: dict[str, Problem]
            ) -> dict[tuple[str, str], Chosen]:
    """(problem key, kind) -> what ``tuner.attention`` runs with ``db_url``'s measurements."""
    out = {}
    with resolving_from(db_url):
        for key, problem in sorted(problems.items()):
            for needs_grad, kind in KINDS.items():
                out[(key, kind)] = _chosen(choose(Call(problem, needs_grad, device)))
    return out


def compare(test_url: str, reference_url: str) -> dict[str, Any]:
    """Per (problem, kind) of the reference database: both choices, whether they are the
    same, and the test's choice priced by the reference's measurements against the
    reference's choice (1.0 where the same)."""
    device, problems = stored(reference_url)
    try:
        reference = choices(reference_url, device, problems)
        test = choices(test_url, device, problems)
    finally:
        dispose_engine(test_url)
        dispose_engine(reference_url)
    rows = []
    for (key, kind), ref in reference.items():
        got = test[(key, kind)]
        same = (got.implementation, got.configs) == (ref.implementation, ref.configs)
        priced = ref.prices.get(got.implementation)
        ratio = 1.0 if same else (priced / ref.ms if priced is not None and ref.ms else None)
        rows.append({"problem": key, "kind": kind, "test": got.implementation,
                     "reference": ref.implementation, "same": same,
                     "same_implementation": got.implementation == ref.implementation,
                     "test_over_reference": ratio})
    return {"device": device.key, "rows": rows, "same": sum(r["same"] for r in rows),
            "same_implementation": sum(r["same_implementation"] for r in rows),
            "worst": max((r["test_over_reference"] for r in rows
                          if r["test_over_reference"] is not None), default=None)}


def print_comparison(result: dict[str, Any]) -> None:
    rows = result["rows"]
    print(f"dispatcher choices (problem x inference/training): {result['same']} of {len(rows)} "
          f"the same implementation and configs, {result['same_implementation']} the same "
          "implementation")
    for r in rows:
        if r["same"]:
            continue
        ratio = r["test_over_reference"]
        priced = (f"{ratio:.3f}x the reference choice's time by its own measurements"
                  if ratio is not None else "not priced by the reference")
        print(f"  {r['problem']} {r['kind']}: {r['test']} (reference: {r['reference']}), "
              f"{priced}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test", type=Path, help="the short sweep's SQLite database")
    parser.add_argument("reference", type=Path, help="the longer sweep's SQLite database")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for path in (args.test, args.reference):
        if not path.is_file():
            parser.error(f"no database at {path}")
    result = compare(f"sqlite:///{args.test}", f"sqlite:///{args.reference}")
    print_comparison(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
