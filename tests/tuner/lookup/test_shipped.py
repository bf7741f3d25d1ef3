"""Shipped measurements (tuner.lookup.shipped): with an empty database, the dispatcher prices from
the table of this GPU model as from a database: ours runs where the table measured it faster than
torch SDPA on the same bucket (or on a neighbour by the margin), SDPA elsewhere.

The CPU stands in for an H100 (tests/api/serving_data's), as in the Gluon dispatch tests: the
choice is made for that device, on tensors the interpreter can run."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F

import tuner
from templates.base import Problem
from templates.device import DeviceInfo
from templates.registry import get_template
from tests.api.serving_data import H100, bundle
from tests.tuner.dispatch.test_dispatch import assert_close_to, measured, problem_of, qkv
from tuner.attention import clear_plans, plan_for
from tuner.lookup.resolver import ConfigResolver, get_resolver, set_resolver
from tuner.lookup.shipped import PACKAGED_DIR, ShippedConfigs, file_name, load_table
from tuner.lookup.shipped.table import (
    SHIPPED_FORMAT,
    ShippedDevice,
    ShippedRecord,
    ShippedTable,
    why_not_serving,
)
from tuner.settings import load_settings

pytestmark = pytest.mark.usefixtures("no_tuned_configs", "on_h100")

call_module = importlib.import_module("tuner.dispatch.implementations.call")
configs_module = importlib.import_module("tuner.lookup.shipped.configs")
STALE = "0123456789abcdef"  # a kernel version no template here has


@pytest.fixture
def on_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_module, "cpu_device", lambda: H100)


def record(template: str, p: Problem, tflops: float, *, config: dict[str, Any] | None = None,
           version: str | None = None) -> ShippedRecord:
    """A shipped record of ``template`` for ``p`` on the H100: ``config`` or the default."""
    t = get_template(template)
    cfg = t.config(config) if config is not None else t.default_config(p, H100)
    return ShippedRecord(template=template, template_version=version or t.version(),
                         problem=p.to_dict(), config=cfg.to_dict(), tflops=tflops,
                         median_ms=t.flops(p) / (tflops * 1e9), readings=3, head_to_head=True)


def table(*records: ShippedRecord, device: DeviceInfo = H100) -> ShippedTable:
    return ShippedTable(format=SHIPPED_FORMAT, version=1, device=ShippedDevice.of(device),
                        suite="test", source="test", generated_at=datetime.now(UTC),
                        records=list(records))


def write_table(folder: Path, shipped: ShippedTable) -> Path:
    """``shipped`` as the table of its device in ``folder``."""
    folder.mkdir(exist_ok=True)
    path = folder / file_name(shipped.device.name)
    path.write_text(shipped.to_json())
    return path


def ship(folder: Path, shipped: ShippedTable, *, database_url: str | None = None,
         **settings: Any) -> Path:
    """``shipped`` as the table of its device in ``folder``, and a resolver that reads it (and
    ``database_url``: default, a database that does not exist)."""
    path = write_table(folder, shipped)
    url = database_url or f"sqlite:///{folder / 'none.db'}"
    set_resolver(ConfigResolver(load_settings(database_url=url, url=None, **settings),
                                shipped_dir=folder))
    clear_plans()
    return path


def test_an_empty_database_runs_ours_where_the_shipped_table_measured_it_faster(
        tmp_path: Path) -> None:
    q, k, v = qkv("cpu")
    faster, slower = problem_of(q, k), problem_of(q, k, causal="top_left")
    ship(tmp_path / "shipped", table(
        record("torch_sdpa", faster, 100.0), record("flash_fwd", faster, 150.0),
        record("torch_sdpa", slower, 200.0), record("flash_fwd", slower, 150.0)))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash", choice.why
    assert choice.match == "exact" and choice.measured
    assert [r.source for r in choice.resolved] == ["shipped"]
    assert choice.source == "shipped"
    assert "sdpa" in choice.why  # priced beside ours
    assert_close_to(tuner.attention(q, k, v, enable_gqa=True),
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    measured_slower = plan_for(q, k, v, is_causal=True, enable_gqa=True)
    assert measured_slower.implementation.name == "sdpa", measured_slower.why
    assert measured_slower.source == "shipped"

    # Another family (no GQA) has no record, nor a neighbour: SDPA as the user had it.
    q1, k1, v1 = qkv("cpu", heads_kv=4)
    untuned = plan_for(q1, k1, v1)
    assert untuned.implementation.name == "sdpa" and untuned.source == "default"


def test_ours_measured_alone_in_the_table_does_not_run(tmp_path: Path) -> None:
    q, k, v = qkv("cpu")
    ship(tmp_path / "shipped", table(record("flash_fwd", problem_of(q, k), 1000.0)))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and "not measured" in choice.why


def test_a_shipped_neighbour_decides_with_the_margin(tmp_path: Path) -> None:
    q, k, v = qkv("cpu", lq=24, lk=40)  # bucket q32-kv64
    near = dataclasses.replace(problem_of(q, k), seqlen_q=200, seqlen_kv=200)  # q256-kv256
    ship(tmp_path / "wins", table(record("torch_sdpa", near, 100.0),
                                  record("flash_fwd", near, 150.0)))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash", choice.why
    assert choice.why.startswith("decided on neighbour")
    assert choice.source == f"shipped, neighbour {choice.neighbour}"

    # 2% faster there: within the margin (3% by default), so SDPA runs.
    ship(tmp_path / "close", table(record("torch_sdpa", near, 100.0),
                                   record("flash_fwd", near, 102.0)))
    close = plan_for(q, k, v, enable_gqa=True)
    assert close.implementation.name == "sdpa" and "decided on neighbour" in close.why


def test_records_of_another_kernel_version_are_never_served(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    ship(tmp_path / "shipped", table(record("torch_sdpa", p, 100.0),
                                     record("flash_fwd", p, 150.0, version=STALE)))
    with caplog.at_level(logging.INFO, logger="tuner.lookup.shipped"):
        choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa", choice.why
    [flash] = [e for e in choice.estimates if e.implementation == "flash"]
    assert flash.ms is None and flash.resolved[0].source == "default"
    assert any(STALE in r.getMessage() and "flash_fwd" in r.getMessage()
               for r in caplog.records)


def test_the_local_database_overrides_the_shipped_table(tmp_path: Path) -> None:
    from tests.tuner.dispatch.test_dispatch import store

    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    store(tmp_path, measured("torch_sdpa", p, 200.0, device=H100),
          measured("flash_fwd", p, 150.0, device=H100))
    ship(tmp_path / "shipped", table(record("torch_sdpa", p, 100.0),
                                     record("flash_fwd", p, 150.0)),
         database_url=f"sqlite:///{tmp_path / 'tuned.db'}")
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa", choice.why
    assert {r.source for e in choice.estimates for r in e.resolved if r.measured} == {
        "database"}


def test_the_database_measured_one_implementation_and_the_table_the_other(
        tmp_path: Path) -> None:
    """Each template is resolved in the order on its own: the database's where it has one."""
    from tests.tuner.dispatch.test_dispatch import store

    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    store(tmp_path, measured("flash_fwd", p, 90.0, device=H100))
    ship(tmp_path / "shipped", table(record("torch_sdpa", p, 100.0),
                                     record("flash_fwd", p, 150.0)),
         database_url=f"sqlite:///{tmp_path / 'tuned.db'}")
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa", choice.why  # 90 (database) < 100 (shipped)
    sources = {e.implementation: e.resolved[0].source for e in choice.estimates}
    assert sources["flash"] == "database" and sources["sdpa"] == "shipped"


def test_the_tables_own_bucket_comes_before_a_database_neighbour(tmp_path: Path) -> None:
    """A measurement of the problem's own bucket on this GPU model (shipped) is kept over
    another bucket's (the database's nearest): the order, tier by tier (tuner.lookup.resolver)."""
    from tests.tuner.dispatch.test_dispatch import store

    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    near = dataclasses.replace(p, seqlen_q=200, seqlen_kv=200)
    store(tmp_path, measured("torch_sdpa", near, 200.0, device=H100),
          measured("flash_fwd", near, 100.0, device=H100))
    ship(tmp_path / "shipped", table(record("torch_sdpa", p, 100.0),
                                     record("flash_fwd", p, 150.0)),
         database_url=f"sqlite:///{tmp_path / 'tuned.db'}")
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash" and choice.source == "shipped", choice.why
    assert choice.neighbour is None


def test_a_pinned_snapshot_still_answers_alone(tmp_path: Path) -> None:
    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    pinned = tmp_path / "pinned.json"
    other = dataclasses.replace(p, head_dim=32)  # the snapshot holds another problem only
    pinned.write_text(json.dumps(bundle(
        measured("torch_sdpa", other, 100.0, device=H100))))
    ship(tmp_path / "shipped", table(record("torch_sdpa", p, 100.0),
                                     record("flash_fwd", p, 150.0)), snapshot=str(pinned))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and choice.source == "default", choice.why


@pytest.mark.parametrize(("change", "why"), [
    ({"name": "NVIDIA H200"}, "measured on NVIDIA H100"),
    ({"compute_capability": "8.0"}, "cc 9.0"),
    ({"torch_version": "2.13.0"}, "torch 2.11.0"),
    ({"triton_version": "3.9.0"}, "triton 3.6.0"),
])
def test_a_table_answers_for_its_gpu_model_and_releases_only(
        tmp_path: Path, change: dict[str, Any], why: str) -> None:
    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    shipped = table(record("torch_sdpa", p, 100.0), record("flash_fwd", p, 150.0))
    other = dataclasses.replace(H100, **change)
    assert why in (why_not_serving(shipped.device, other) or "")
    ship(tmp_path / "shipped", shipped)
    configs = ShippedConfigs(tmp_path / "shipped")
    if other.name == H100.name:  # the same file, for a device it does not serve
        assert configs.table_for(other) is None
    assert configs.table_for(H100) is not None
    # Patch releases, CUDA and cuDNN may differ.
    patched = dataclasses.replace(H100, torch_version="2.11.2", cuda_version="13.0",
                                  cudnn_version="9.20.0")
    assert why_not_serving(shipped.device, patched) is None


def test_a_broken_table_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = qkv("cpu")
    path = ship(tmp_path / "shipped", table(record("torch_sdpa", problem_of(q, k), 100.0)))
    path.write_text('{"format": "attention-tuner/shipped", "version": 1, "records": []}')
    with caplog.at_level(logging.WARNING, logger="tuner.lookup.shipped"):
        choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.source == "default"
    assert any("device" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)


def test_file_names_say_the_gpu_model() -> None:
    assert file_name("NVIDIA H200") == "h200.json"
    assert file_name("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3.json"


def test_the_packaged_tables_load_and_serve_their_device() -> None:
    tables = sorted(PACKAGED_DIR.glob("*.json"))
    if not tables:
        pytest.skip("no shipped table in the package yet (`tuner ship` writes them)")
    for path in tables:
        loaded = load_table(path)
        assert path.name == file_name(loaded.device.name)
        for r in loaded.records:
            get_template(r.template)  # every record's template is registered here


def test_the_resolver_reads_the_packaged_tables_by_default() -> None:
    set_resolver(None)
    resolver = ConfigResolver(load_settings(url=None))
    assert resolver.shipped is not None and resolver.shipped.folder == PACKAGED_DIR
    assert ConfigResolver(load_settings(url=None), shipped_dir=None).shipped is None


def test_tuner_shipped_on_consults_the_packaged_tables_and_off_leaves_them_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a process reads it from the environment at its first lookup: off is the untuned
    state (SDPA, as the user had it) even where a table for this GPU model ships."""
    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    packaged = tmp_path / "packaged"  # stands in for the package's folder, with a table
    write_table(packaged, table(record("torch_sdpa", p, 100.0), record("flash_fwd", p, 150.0)))
    monkeypatch.setattr(configs_module, "PACKAGED_DIR", packaged)
    monkeypatch.setenv("TUNER_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    for name in ("TUNER_URL", "TUNER_SNAPSHOT"):
        monkeypatch.delenv(name, raising=False)
    chosen = {}
    for setting in ("on", "off", ""):  # "": unset, as compose passes it on
        monkeypatch.setenv("TUNER_SHIPPED", setting)
        set_resolver(None)  # the next lookup builds the resolver from the environment
        clear_plans()
        choice = plan_for(q, k, v, enable_gqa=True)
        chosen[setting] = (choice.implementation.name, choice.source)
        shipped = get_resolver().shipped
        assert (shipped.folder if shipped is not None else None) == (
            None if setting == "off" else packaged)
    assert chosen == {"on": ("flash", "shipped"), "off": ("sdpa", "default"),
                      "": ("flash", "shipped")}


def test_tuner_shipped_may_name_a_folder_of_tables_to_use_instead(tmp_path: Path) -> None:
    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    mine = tmp_path / "mine"
    write_table(mine, table(record("torch_sdpa", p, 100.0), record("flash_fwd", p, 150.0)))
    settings = load_settings(database_url=f"sqlite:///{tmp_path / 'none.db'}", url=None,
                             shipped=str(mine))
    resolver = ConfigResolver(settings)
    assert resolver.shipped is not None and resolver.shipped.folder == mine.resolve()
    set_resolver(resolver)
    clear_plans()
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash" and choice.source == "shipped", choice.why


def test_a_shipped_answer_is_noted_as_demand_for_the_service(tmp_path: Path) -> None:
    """The service's fleet has not tuned a problem the table answered: it is still asked for."""
    q, k, _ = qkv("cpu")
    p = problem_of(q, k)
    ship(tmp_path / "shipped", table(record("torch_sdpa", p, 100.0)))
    resolver = ConfigResolver(load_settings(database_url=f"sqlite:///{tmp_path / 'no.db'}",
                                            url="http://127.0.0.1:9", lookup_timeout=0.5),
                              shipped_dir=tmp_path / "shipped")
    noted: list[tuple[str, Problem]] = []
    resolver._note_demand = (  # type: ignore[method-assign]
        lambda template, version, device_key, problem: noted.append((template, problem)))
    answer = resolver.resolve(get_template("torch_sdpa"), p, H100)
    assert answer.source == "shipped" and answer.match == "exact"
    assert noted == [("torch_sdpa", p)]
