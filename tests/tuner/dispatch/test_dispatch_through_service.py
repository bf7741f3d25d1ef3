"""A process that resolves configs through the config service (``TUNER_URL``) chooses as a
process reading the same database does, neighbour decisions included (docs/DISPATCH.md,
"Deciding on a neighbour"): one seeded database, read directly and served by a live service,
on SQLite and PostgreSQL (tiny shapes, under the interpreter without a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from api.main import create_app
from db.session import dispose_engine, session_scope
from templates.base import Problem
from templates.device import current_device
from templates.registry import get_template
from tests.api.serving_data import TOKEN, bundle, live_server
from tests.tuner.dispatch.test_dispatch import measured
from tests.tuner.dispatch.test_dispatch_neighbours import flash_on, shape
from tuner.dispatch.rule import Call, Choice, choose
from tuner.lookup.bundle import store_bundle, validate_bundle
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import load_settings

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

FWD = get_template("flash_fwd")
HERE = shape(24, 40)  # nothing stored for its bucket (32, 64) but in the exact case
NEAR, FAR = shape(48, 100), shape(96, 300)


@dataclass(frozen=True)
class Case:
    stored: Callable[[], list[dict[str, Any]]]
    implementation: str
    neighbour: Problem | None


CASES = {
    "exact": Case(lambda: [measured("torch_sdpa", HERE, 100.0), flash_on(HERE, 150.0)],
                  "flash", None),
    "neighbour win": Case(lambda: [measured("torch_sdpa", NEAR, 100.0), flash_on(NEAR, 110.0)],
                          "flash", NEAR),
    "neighbour within the margin": Case(
        lambda: [measured("torch_sdpa", NEAR, 100.0), flash_on(NEAR, 102.0)], "sdpa", NEAR),
    "no neighbour": Case(lambda: [measured("torch_sdpa", NEAR, 100.0), flash_on(FAR, 1000.0)],
                         "sdpa", None),
}


def seeded(url: str, items: list[dict[str, Any]]) -> None:
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(*items)))


def chosen(database_url: str, service_url: str | None) -> Choice:
    # A generous lookup timeout: a loaded test machine must not make the service look down.
    set_resolver(ConfigResolver(load_settings(database_url=database_url, url=service_url,
                                              token=None, demand=False, lookup_timeout=30.0)))
    return choose(Call(HERE, needs_grad=False, device=current_device()))


def as_compared(choice: Choice) -> dict[str, Any]:
    """What a choice says, where its answers came from left out."""
    return {"implementation": choice.implementation.name, "config": choice.config,
            "match": choice.match, "why": choice.why, "neighbour": choice.neighbour,
            "estimates": [(e.implementation, e.ms, [(r.match, r.config, r.neighbour)
                                                    for r in e.resolved])
                          for e in choice.estimates]}


@pytest.mark.parametrize("case", list(CASES))
def test_a_service_client_chooses_as_a_database_client_does(
        case: str, db_url: str, tmp_path: Path) -> None:
    expected = CASES[case]
    seeded(db_url, expected.stored())
    local = chosen(db_url, None)
    with live_server(create_app(load_settings(database_url=db_url, token=TOKEN))) as base:
        remote = chosen(f"sqlite:///{tmp_path / 'absent.db'}", base)
    dispose_engine(db_url)

    assert local.implementation.name == expected.implementation, local.why
    want = FWD.problem_key(expected.neighbour) if expected.neighbour is not None else None
    assert local.neighbour == want
    assert as_compared(remote) == as_compared(local)
    assert local.source.startswith("database") and remote.source.startswith("service")
    assert remote.source.removeprefix("service") == local.source.removeprefix("database")
    if want is not None and expected.implementation != "sdpa":
        assert remote.source == f"service, neighbour {want}"
        assert f"decided on neighbour {want}" in remote.why
