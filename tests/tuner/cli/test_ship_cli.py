"""``tuner ship``: a shipped table from a sweep's database or a bundle file, for the problems of
a suite; bests tuned for other kernel source are dropped and said; the table it writes is what
a fresh install's dispatcher then prices from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from db import crud, head_to_head
from db.models import TrialStatus
from db.session import dispose_engine, session_scope
from templates.base import Problem
from templates.registry import get_template
from tests.api.serving_data import H100, bundle
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.dispatch.test_dispatch import measured, problem_of, qkv, store
from tests.tuner.lookup.test_shipped import STALE, on_h100  # noqa: F401  (a fixture)
from tuner.attention import clear_plans, plan_for
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.lookup.shipped import file_name, load_table
from tuner.settings import load_settings

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

FWD, SDPA = get_template("flash_fwd"), get_template("torch_sdpa")
# The suite's problems: the shape of tests/tuner/test_dispatch's qkv, dense and causal, and a
# longer one; float32 as those tests run.
SPEC = """
name = "ship-test"
templates = ["torch_sdpa", "flash_fwd"]
dtypes = ["float32"]
causal = ["none", "top_left"]
shapes = [{B = 1, H_q = 4, H_kv = 2, N_q = 24, N_kv = 40, D = 16},
          {B = 1, H_q = 4, H_kv = 2, N = 300, D = 16}]
"""


def dense(n_q: int = 24, n_kv: int = 40, causal: str = "none") -> Problem:
    return Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=n_q, seqlen_kv=n_kv, head_dim=16,
                   dtype="float32", causal=causal)


def spec(tmp_path: Path) -> Path:
    path = tmp_path / "suite.toml"
    path.write_text(SPEC)
    return path


def stored_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A database as a sweep of the H100 left it: dense ours faster, causal SDPA faster, the
    long problem's flash best tuned for other kernel source, and a problem outside the suite."""
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    fast, slow, long, outside = dense(), dense(causal="top_left"), dense(300, 300), dense(2048)
    items = [measured("torch_sdpa", fast, 100.0, device=H100),
             measured("flash_fwd", fast, 150.0, device=H100),
             measured("torch_sdpa", slow, 200.0, device=H100),
             measured("flash_fwd", slow, 150.0, device=H100),
             measured("torch_sdpa", long, 100.0, device=H100),
             measured("torch_sdpa", outside, 100.0, device=H100)]
    with session_scope(url) as s:
        from tuner.lookup.bundle import store_bundle, validate_bundle

        store_bundle(s, validate_bundle(bundle(*items)))
        with monkeypatch.context() as m:  # a best of the kernel as it was before an edit
            m.setattr(type(FWD), "version", lambda self: STALE)
            store_bundle(s, validate_bundle(bundle(measured("flash_fwd", long, 900.0,
                                                            device=H100))))
    dispose_engine(url)
    return url


def test_ship_writes_the_suites_bests_at_the_installed_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = stored_sweep(tmp_path, monkeypatch)
    code, out, err = cli("ship", "--from", url, "--device", "h100", "--suite",
                         str(spec(tmp_path)), "--out", str(tmp_path), "--partial")
    assert code == 0, err
    path = tmp_path / file_name(H100.name)
    assert f"to {path}" in out
    assert "flash on 1" in out and "sdpa on 2" in out  # inference calls, by its prices
    [dropped] = [line for line in out.splitlines() if line.startswith("dropped")]
    assert dropped.startswith("dropped: flash_fwd:") and STALE in dropped and FWD.version() in dropped
    assert FWD.problem_key(dense(300, 300)) in dropped
    table = load_table(path)
    assert table.device.key == H100.key and table.suite == "ship-test"
    got = {(r.template, r.problem["seqlen_q"], r.problem["causal"]): r for r in table.records}
    assert set(got) == {("torch_sdpa", 24, "none"), ("flash_fwd", 24, "none"),
                        ("torch_sdpa", 24, "top_left"), ("flash_fwd", 24, "top_left"),
                        ("torch_sdpa", 300, "none")}  # not the stale one, nor the outsider
    assert got[("flash_fwd", 24, "none")].tflops == 150.0
    assert all(r.template_version == get_template(r.template).version() for r in table.records)
    # What the suite's templates lack: the long causal problem, and the long problem's flash.
    assert "not measured (3)" in out and f"flash_fwd {FWD.problem_key(dense(300, 300))}" in out


def test_a_fresh_install_prices_from_the_table_ship_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_h100: None) -> None:  # noqa: F811
    url = stored_sweep(tmp_path, monkeypatch)
    folder = tmp_path / "tables"
    folder.mkdir()
    assert cli("ship", "--from", url, "--suite", str(spec(tmp_path)),
               "--out", str(folder), "--partial")[0] == 0
    set_resolver(ConfigResolver(load_settings(database_url=f"sqlite:///{tmp_path / 'new.db'}",
                                              url=None), shipped_dir=folder))
    clear_plans()
    q, k, v = qkv("cpu")
    assert problem_of(q, k) == dense()
    dense_choice = plan_for(q, k, v, enable_gqa=True)
    assert dense_choice.implementation.name == "flash" and dense_choice.source == "shipped"
    causal_choice = plan_for(q, k, v, is_causal=True, enable_gqa=True)
    assert causal_choice.implementation.name == "sdpa", causal_choice.why


def test_a_best_priced_by_a_head_to_head_ships_at_its_median(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = stored_sweep(tmp_path, monkeypatch)
    p = dense()
    with session_scope(url) as s:
        best = crud.best_for(s, device_key=H100.key, template_name=FWD.name,
                             template_version=FWD.version(), problem_key=FWD.problem_key(p))
        assert best is not None and best.trial_id is not None
        session = head_to_head.start_head_to_head(s, device_id=best.device_id,
                                                  problem=p.to_dict(), rounds=3)
        for n, tflops in enumerate((118.0, 120.0, 125.0)):
            head_to_head.record_head_to_head_reading(
                s, head_to_head_id=session, trial_id=best.trial_id, round=n, position=0,
                status=TrialStatus.OK, median_ms=FWD.flops(p) / (tflops * 1e9), tflops=tflops)
        head_to_head.finish_head_to_head(s, head_to_head_id=session)
        crud.refresh_best(s, device_id=best.device_id, template_id=best.template_id,
                          problem_key=best.problem_key)
    dispose_engine(url)
    code, out, err = cli("ship", "--from", url, "--suite", str(spec(tmp_path)),
                         "--out", str(tmp_path / "t.json"), "--json", "--partial")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["winners"][FWD.problem_key(p)] == "flash"
    [flash] = [r for r in load_table(tmp_path / "t.json").records
               if r.template == FWD.name and r.problem == p.to_dict()]
    assert flash.head_to_head and flash.readings == 3
    assert flash.tflops == pytest.approx(120.0)  # the head-to-head's median, not 150


def test_ship_from_a_bundle_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = stored_sweep(tmp_path, monkeypatch)
    exported = tmp_path / "export.json"
    assert cli("export", str(exported), "--db", url)[0] == 0
    code, out, err = cli("ship", "--from", str(exported), "--suite", str(spec(tmp_path)),
                         "--out", str(tmp_path / "t.json"), "--json", "--partial")
    assert code == 0, err
    shown: dict[str, Any] = json.loads(out)
    assert shown["records"] == 5 and shown["device"] == H100.key
    assert [d["template_version"] for d in shown["dropped"]] == [STALE]
    table = load_table(tmp_path / "t.json")
    assert "bundle" in table.source and not any(r.head_to_head for r in table.records)


def test_a_table_lacking_some_of_the_suites_bests_is_refused_unless_partial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sweep stopped by its budget: a problem nothing measured would be priced by its
    # neighbours' records alone, which can run ours where SDPA is faster.
    url = stored_sweep(tmp_path, monkeypatch)
    table = tmp_path / "t.json"
    code, _, err = cli("ship", "--from", url, "--suite", str(spec(tmp_path)),
                       "--out", str(table))
    long_causal = FWD.problem_key(dense(300, 300, causal="top_left"))
    assert code == 2 and "would lack 3" in err and f"torch_sdpa {long_causal}" in err, err
    assert "--partial" in err and "tuner sweep" in err
    assert not table.exists()
    # The sweep run again measures what it did not reach: then the table is whole.
    long, causal = dense(300, 300), dense(300, 300, causal="top_left")
    store(tmp_path, measured("flash_fwd", long, 120.0, device=H100),
          measured("torch_sdpa", causal, 100.0, device=H100),
          measured("flash_fwd", causal, 90.0, device=H100), db="sweep.db")
    code, out, err = cli("ship", "--from", url, "--suite", str(spec(tmp_path)),
                         "--out", str(table))
    assert code == 0, err
    assert len(load_table(table).records) == 8 and "not measured" not in out

def test_nothing_to_ship_writes_nothing_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    p = dense()
    with monkeypatch.context() as m:
        m.setattr(type(FWD), "version", lambda self: STALE)
        m.setattr(type(SDPA), "version", lambda self: STALE)
        store(tmp_path, measured("torch_sdpa", p, 100.0, device=H100),
              measured("flash_fwd", p, 150.0, device=H100), db="old.db")
    code, out, err = cli("ship", "--from", url, "--suite", str(spec(tmp_path)),
                         "--out", str(tmp_path / "t.json"))
    assert code == 2 and "nothing to ship" in err and STALE in err, err
    assert "tuner sweep" in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(("args", "said"), [
    (["--device", "a100"], "names no device"),
    (["--from", "sqlite:///{tmp}/missing.db"], "no such database file"),
    (["--from", "{tmp}/missing.json"], "cannot be read as a bundle"),
    (["--suite", "no-such-suite"], "unknown suite"),
])
def test_bad_input_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         args: list[str], said: str) -> None:
    url = stored_sweep(tmp_path, monkeypatch)
    given = [a.format(tmp=tmp_path) for a in args]
    if "--from" not in given:
        given += ["--from", url]
    code, _, err = cli("ship", *given, "--out", str(tmp_path / "t.json"))
    assert code == 2 and said in err, err
    assert not (tmp_path / "t.json").exists()


def test_ship_help_imports_no_heavy_library() -> None:
    from tests.tuner.cli.test_cli_new_user import run_cli

    result, err = run_cli("ship", "--help")
    assert result == {"code": 0, "heavy": []}, err
