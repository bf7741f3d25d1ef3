"""The device key carries the cuDNN version (what decides torch SDPA's cuDNN backend's speed):
keys with and without it, devices stored before it was recorded, bundles, and lookups of a
process finding what its own machine stored."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from db import crud
from db.session import dispose_engine, session_scope
from templates.device import cpu_device, cudnn_version_text
from tests.api.serving_data import FWD, H100, bundle, item, problem
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.lookup.test_lookup import resolver, stored_db
from tuner.lookup.bundle import BundleError, make_bundle, store_bundle, validate_bundle
from tuner.lookup.resolver import device_info_from_key
from tuner.settings import load_settings
from tuner.tuning.sweep import device_from_dict

CUDNN_919 = dataclasses.replace(H100, cudnn_version="9.19.0")
CUDNN_91 = dataclasses.replace(H100, cudnn_version="9.1.0")
P = problem(1024)


def test_the_key_ends_with_the_cudnn_version_only_where_there_is_one() -> None:
    assert CUDNN_919.key == H100.key + "|cudnn9.19.0"
    assert len({H100.key, CUDNN_919.key, CUDNN_91.key}) == 3
    # The CPU has none (torch's CPU attention never runs cuDNN): its key is what it was.
    cpu = cpu_device()
    assert cpu.cudnn_version is None and "cudnn" not in cpu.key
    for device in (H100, CUDNN_919, cpu):
        assert device_info_from_key(device.key).key == device.key
    # A device named like a key part still parses as a name.
    odd = dataclasses.replace(CUDNN_919, name="gpu|cudnn")
    assert device_info_from_key(odd.key).name == "gpu|cudnn"


@pytest.mark.parametrize(("number", "text"), [
    (91900, "9.19.0"), (90100, "9.1.0"), (100002, "10.0.2"), (8902, "8.9.2"), (7605, "7.6.5"),
    (None, None)])
def test_cudnn_version_numbers_read_as_torch_reports_them(number: int | None,
                                                          text: str | None) -> None:
    assert cudnn_version_text(number) == text


def test_a_negative_cudnn_version_number_is_refused() -> None:
    with pytest.raises(ValueError, match="cuDNN version number is >= 0, but got -1"):
        cudnn_version_text(-1)


def test_a_process_finds_what_its_machine_stored_and_nothing_of_another_cudnn(
        tmp_path: Path) -> None:
    # What a sweep worker reports (device.to_dict() plus its key) is what the sweep stores.
    reported = device_from_dict(json.loads(json.dumps(CUDNN_919.to_dict() | {"key": "x"})))
    assert reported == CUDNN_919
    url = stored_db(tmp_path / "t.db", item(P, device=reported))
    found = resolver(url).resolve(FWD, P, CUDNN_919)
    assert (found.source, found.match) == ("database", "exact")
    # Another cuDNN under the same torch, or a device stored before the cuDNN version was
    # recorded (its key has none): separate targets, nothing measured for them.
    for other in (CUDNN_91, H100):
        assert resolver(url).resolve(FWD, P, other).match == "default"


def test_bundles_carry_the_cudnn_version_and_old_bundles_still_import(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    old = item(P)  # a bundle of a release before the cuDNN version: no such field
    del old["device"]["cudnn_version"]
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(old, item(P, device=CUDNN_919))))
    with session_scope(url, write=False) as s:
        stored = {d.key: d.cudnn_version for d in crud.list_devices(s)}
        assert stored == {H100.key: None, CUDNN_919.key: "9.19.0"}
        exported = make_bundle(s)
    dispose_engine(url)
    devices = {i["device"]["key"]: i["device"] for i in exported["items"]}
    # Written only where there is one: a host of an older release reads the others.
    assert "cudnn_version" not in devices[H100.key]
    assert devices[CUDNN_919.key]["cudnn_version"] == "9.19.0"
    again = f"sqlite:///{tmp_path / 'again.db'}"
    with session_scope(again) as s:
        store_bundle(s, validate_bundle(exported))
        assert {d.key: d.cudnn_version for d in crud.list_devices(s)} == stored
    dispose_engine(again)


def test_a_cudnn_version_that_disagrees_with_the_key_is_refused() -> None:
    without = item(P, device=CUDNN_919)
    without["device"]["key"] = H100.key  # the key of no cuDNN, the field of 9.19
    with pytest.raises(BundleError, match=r"does not match its fields.*cudnn9\.19\.0"):
        validate_bundle(bundle(without))
    empty = item(P)
    empty["device"]["cudnn_version"] = ""
    with pytest.raises(BundleError, match="cudnn_version"):
        validate_bundle(bundle(empty))


def test_devices_list_their_cudnn_version(tmp_path: Path) -> None:
    url = stored_db(tmp_path / "l.db", item(P), item(P, device=CUDNN_919))
    code, out, err = cli("list", "devices", "--db", url, "--json")
    assert code == 0, err
    assert {d["key"]: d["cudnn"] for d in json.loads(out)} == {H100.key: "-",
                                                               CUDNN_919.key: "9.19.0"}
    with TestClient(create_app(load_settings(database_url=url, url=None))) as client:
        served = {d["key"]: d["cudnn_version"] for d in client.get("/v1/devices").json()}
        assert served == {H100.key: None, CUDNN_919.key: "9.19.0"}
        assert "<td>9.19.0</td>" in client.get("/dashboard").text
    dispose_engine(url)
