"""Checking a demand item against what the service knows: the template is registered here at
the version the item names, the problem is valid (``ProblemQuery``, the checks of
``GET /v1/best``) and the template can run it. What passes becomes a shape bucket to count.

Jobs report the same few problems again and again, so each distinct item's verdict is kept
(at most ``MAX_REMEMBERED`` of them; then they are forgotten at once and checked afresh):
the checks of a problem cost far more than finding it in a dict, and the service takes
thousands of items a second (benchmarks/api_load.py --demand-clients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.answers import template_version
from api.schemas import DemandItemIn, ProblemQuery
from templates.registry import all_templates, get_template

__all__ = ["MAX_REMEMBERED", "DemandBucket", "DemandChecker"]

MAX_REMEMBERED = 50_000


@dataclass(frozen=True)
class DemandBucket:
    """What a demand row counts: one shape bucket of one template version on one device."""

    device_key: str
    template: str
    template_version: str
    problem_key: str


Verdict = tuple[DemandBucket, dict[str, Any]] | str


class DemandChecker:
    """Checks items, remembering each distinct item's verdict (one per app: the templates an
    app knows are fixed when it starts)."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        # An item's identity (its count aside) -> its bucket and problem, or why refused.
        self._verdicts: dict[tuple[Any, ...], Verdict] = {}

    def check(self, item: DemandItemIn) -> Verdict:
        """The item's bucket and its problem's fields (the one to tune if the bucket is
        new), or why it cannot be counted."""
        try:
            # The problem's fields in the order sent: a client sends them in one order, and
            # another order only costs one more check. Values that compare equal (1, 1.0,
            # True) share a verdict, and the problem counted is always the checked one.
            identity = (item.template, item.template_version, item.device,
                        tuple(item.problem.items()))
            verdict = self._verdicts.get(identity)
        except TypeError:  # a list or an object among the problem's values: never valid
            identity, verdict = None, None
        if verdict is None:
            verdict = _checked(item)
            if identity is not None:
                if len(self._verdicts) >= self.max_remembered:
                    self._verdicts.clear()
                self._verdicts[identity] = verdict
        return verdict


def _checked(item: DemandItemIn) -> Verdict:
    try:
        template = get_template(item.template)
    except ValueError:
        return (f"unknown template {item.template!r}; this service knows "
                f"{sorted(t.name for t in all_templates())}")
    version = template_version(template)
    if item.template_version != version:
        return (f"template {template.name!r} is at version {version} here, but the item names "
                f"{item.template_version}: no worker of this deployment runs that kernel")
    try:
        problem = ProblemQuery.model_validate(item.problem).problem()
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        return f"problem{'.' + where if where else ''}: {err['msg']}"
    why = template.unsupported(problem)
    if why:
        return f"template {template.name!r} cannot run this problem: {why}"
    bucket = DemandBucket(item.device, template.name, version, template.problem_key(problem))
    return bucket, problem.to_dict()
