"""GET /v1/best?compare=true: which implementation runs the problem on the device, the
runner-up, every implementation's time and each SDPA backend's (``tuner.dispatch.comparison``, the
computation ``tuner best --shape`` prints), at the kernel versions this service runs.

The forward templates' bests come from the answers' cache (``api.answers.BestCache``, no query
where held); each SDPA backend's time is read from the stored trials (two queries, in a worker
thread), which is why it is asked for, not part of every lookup's answer.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from api.answers import BestCache, template_version_of
from db.session import get_sessionmaker
from templates.base import Problem
from templates.registry import get_template
from tuner.dispatch.comparison import compare_implementations, sdpa_backends_of
from tuner.dispatch.rule import BASELINE, get_implementation
from tuner.dispatch.winners import forward_templates
from tuner.lookup.resolver import Candidate, device_info_from_key
from tuner.wire import BackendTime, ImplementationsCompared

__all__ = ["compared_answer"]


async def compared_answer(cache: BestCache, *, problem: Problem, device_key: str,
                          margin: float) -> ImplementationsCompared:
    """The comparison for ``problem`` on the device ``device_key`` (a stored device's key as
    ``best_answer`` resolved it, or another key: nothing measured)."""
    catalog = await cache.catalog()
    info = catalog.devices.get(device_key) or device_info_from_key(device_key)
    bests: dict[str, list[Candidate]] = {}
    for name in forward_templates():
        version = template_version_of(name)
        if device_key in catalog.devices and (name, version) in catalog.template_versions:
            held = await cache.bests(get_template(name), version, device_key)
            bests[name] = held.candidates
    sdpa_version = template_version_of(get_implementation(BASELINE).forward)

    def backends_of(problem_key: str) -> dict[str, BackendTime]:
        with get_sessionmaker(cache.database_url, write=False)() as session:
            return sdpa_backends_of(session, device_key=device_key, version=sdpa_version,
                                    problem_key=problem_key)

    return await run_in_threadpool(
        lambda: compare_implementations(problem, info, bests, margin=margin, source="service",
                                        backends_of=backends_of))
