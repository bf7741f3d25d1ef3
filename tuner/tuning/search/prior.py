"""The transfer prior: configs worth measuring first for a problem, before the sampler's own
(issue 42). After the template's default: the best configs this device stored for the
problem's own bucket under any version of the kernel (fastest first: after a kernel change,
the last version's best), the stored best configs of the problem's neighbouring buckets on
this device (nearest first, ``tuner.lookup.resolver``'s order), the stored best of the same
bucket on other devices (fastest first); the search loop adds the template's known good
configs after them. A good config of a neighbour, or of the kernel before its last change, is
usually good here, so the search starts near the optimum and a short budget ends near it;
each is checked against the template's constraint for this problem first, and one that no
longer validates (another kernel version's knob) is left out.

The package's shipped table of this GPU model counts as this device's stored bests
(``shipped_bests``): a sweep on a fresh database after a kernel change (the ship sweep that
makes the next table) measures the table's config of each bucket right after the default.
"""

from __future__ import annotations

from db import crud
from db.session import session_scope
from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from tuner.lookup.resolver import neighbours_of, parse_candidates
from tuner.lookup.shipped.table import ShippedTable, keyed_records
from tuner.lookup.stored_bests import StoredBest

__all__ = ["EARLIER", "NEIGHBOURS", "shipped_bests", "stored_bests", "transfer_prior"]

# Neighbouring buckets whose bests are measured first: enough to cover the buckets on either
# side (shorter and longer sequences, fewer and more programs), few enough to leave the
# budget to the sampler.
NEIGHBOURS = 3
# The bucket's own bests of other kernel versions measured first: the last version's, and
# one more (a table shipped for a version between).
EARLIER = 2
OTHER_DEVICES = 2


def stored_bests(url: str, template_name: str) -> list[StoredBest]:
    """Every stored best config of ``template_name``, any device and version."""
    with session_scope(url, write=False) as s:
        total = crud.count_best(s, template=template_name)
        return [StoredBest.of_row(row)
                for row in crud.list_best(s, template=template_name, limit=total)]


def transfer_prior(template: Template, version: str, problem: Problem, device: DeviceInfo,
                   device_key: str, rows: list[StoredBest]) -> list[KernelConfig]:
    """The stored configs to measure first after the default (module docstring), without
    repeats."""
    key = template.problem_key(problem)
    here = [r for r in rows if r.device_key == device_key and r.template_version == version]
    # Only what the search's constraint offers (serving's neighbours also hold configs that
    # run but waste work here, ``matching.runs``).
    near = list(neighbours_of(template, problem, device, parse_candidates(template, here),
                              for_search=True).values())[:NEIGHBOURS]
    elsewhere = sorted((r for r in rows if r.device_key != device_key and r.problem_key == key),
                       key=lambda r: -r.tflops)
    earlier = sorted((r for r in rows if r.device_key == device_key and r.problem_key == key),
                     key=lambda r: -r.tflops)

    def runnable(bests: list[StoredBest], limit: int) -> list[KernelConfig]:
        configs = [c.config for c in parse_candidates(template, bests)]
        return [c for c in configs if template.constraint(problem, c, device) is None][:limit]

    found = [*runnable(earlier, EARLIER), *(n.config for n in near),
             *runnable(elsewhere, OTHER_DEVICES)]
    out: list[KernelConfig] = []
    for config in found:
        if config not in out:
            out.append(config)
    return out


def shipped_bests(table: ShippedTable | None, template: Template,
                  device_key: str) -> list[StoredBest]:
    """``template``'s records in ``table`` (the shipped table that answers for the device of
    ``device_key``, ``ConfigResolver.shipped_table``) as that device's stored bests, any
    kernel version; a record whose problem no longer validates is left out."""
    if table is None:
        return []
    out = []
    for r, key in keyed_records(table, template):
        out.append(StoredBest(device_key=device_key, template=r.template,
                              template_version=r.template_version, problem_key=key,
                              problem=dict(r.problem), config=dict(r.config), tflops=r.tflops,
                              median_ms=r.median_ms, readings=r.readings))
    return out
