"""tuner.lookup.bundle: export -> validate -> store round trip between two databases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from db import crud
from db.session import dispose_engine, session_scope
from tests.api.serving_data import bundle, item, problem
from tuner.lookup.bundle import BundleError, make_bundle, store_bundle, validate_bundle


def test_export_then_import_reproduces_the_best_configs(tmp_path: Path) -> None:
    source, target = (f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db"))
    items = [item(problem(n), tflops=300.0 + n / 100) for n in (512, 2048)]
    items.append(item(problem(1024, causal="top_left"), default_tflops=None, sweep=None))
    with session_scope(source) as s:
        store_bundle(s, validate_bundle(bundle(*items)), host="gpu-a")
    with session_scope(source, write=False) as s:
        exported = make_bundle(s, host="gpu-a")
    assert len(exported["items"]) == 3
    text = json.dumps(exported)  # what `tuner export` writes
    with session_scope(target) as s:
        summary = store_bundle(s, validate_bundle(json.loads(text)), host="gpu-a")
    assert (summary.items, summary.best_updated) == (3, 3)

    def rows(url: str) -> list[tuple[object, ...]]:
        with session_scope(url, write=False) as s:
            return [(r.device.key, r.template.version, r.problem_key, r.config, r.tflops,
                     r.default_tflops, r.speedup) for r in crud.list_best(s)]

    assert rows(source) == rows(target)
    with session_scope(target, write=False) as s:
        again = make_bundle(s, host="gpu-a")
    assert {json.dumps(i, sort_keys=True) for i in again["items"]} == \
        {json.dumps(i, sort_keys=True) for i in exported["items"]}
    for url in (source, target):
        dispose_engine(url)


@pytest.mark.parametrize(("data", "index"), [
    ({"format": "attention-tuner/bundle", "version": 1, "items": "x"}, None),
    ("not a mapping", None),
])
def test_malformed_bundles_name_no_item(data: object, index: int | None) -> None:
    with pytest.raises(BundleError) as err:
        validate_bundle(data)
    assert err.value.index == index
