"""tuner winners: per problem, the implementation the dispatcher runs, the runner-up, and
every measured implementation's TFLOP/s (stored bests of this machine's device)."""

from __future__ import annotations

import json
from pathlib import Path

from db.session import dispose_engine, session_scope
from templates.base import Problem
from tests.api.serving_data import bundle
from tests.tuner.test_dispatch import measured
from tests.tuner.test_sweep_cli import cli
from tuner.bundle import BundleDevice, store_bundle, validate_bundle


def small(seqlen_q: int, seqlen_kv: int | None = None) -> Problem:
    """A GQA problem the interpreter runs in no time."""
    return Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=seqlen_q,
                   seqlen_kv=seqlen_kv or seqlen_q, head_dim=16, dtype="float32")


def stored(path: Path, *items: dict) -> str:
    """A database at ``path`` holding the bundle of ``items``; its URL."""
    url = f"sqlite:///{path}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(*items)))
    dispose_engine(url)
    return url


def test_the_winner_runner_up_and_margin_follow_the_dispatch_rule(tmp_path: Path) -> None:
    tuned, untuned = small(64), small(128)
    url = stored(tmp_path / "w.db", measured("torch_sdpa", tuned, 100.0),
                 measured("flash_fwd", tuned, 150.0), measured("flash_fwd", untuned, 500.0))
    code, out, err = cli("winners", "--db", url, "--json")
    assert code == 0, err
    by_key = {it["problem"]["seqlen_q"]: it for it in json.loads(out)}
    assert by_key[64]["winner"] == "flash" and by_key[64]["runner_up"] == "sdpa"
    assert by_key[64]["margin"] == 1.5 and by_key[64]["tflops"] == {"sdpa": 100.0,
                                                                     "flash": 150.0}
    # Ours measured alone: SDPA still runs (nothing says ours is faster than it).
    assert by_key[128]["winner"] == "sdpa" and by_key[128]["margin"] is None
    assert "not measured" in by_key[128]["why"]
    code, out, _ = cli("winners", "--db", url)
    assert code == 0 and "1.50x sdpa" in out


def test_nothing_stored_says_how_to_tune(tmp_path: Path) -> None:
    code, out, _ = cli("winners", "--db", f"sqlite:///{tmp_path / 'empty.db'}")
    assert code == 0 and "tuner sweep quick" in out


def test_best_says_which_implementation_runs_a_shared_problem(tmp_path: Path) -> None:
    shared, alone, decode = small(64), small(256), small(1, 512)
    url = stored(tmp_path / "b.db", measured("torch_sdpa", shared, 100.0),
                 measured("flash_fwd", shared, 125.0), measured("flash_fwd", alone, 500.0),
                 measured("flash_fwd", decode, 2.0), measured("flash_decode", decode, 3.0))
    code, out, err = cli("best", "--db", url, "--json")
    assert code == 0, err
    runs = {(it["template"], it["problem"]["seqlen_q"]): it["runs"] for it in json.loads(out)}
    assert runs[("flash_fwd", 64)] == {
        "implementation": "flash", "winner": "flash", "runner_up": "sdpa", "margin": 1.25,
        "why": "fastest measured", "tflops": {"sdpa": 100.0, "flash": 125.0}}
    assert runs[("torch_sdpa", 64)]["winner"] == "flash"
    assert runs[("flash_fwd", 256)] is None  # nothing else measured there: nothing to compare
    # Two of ours, torch SDPA unmeasured: it runs by rule, neither of ours.
    assert runs[("flash_decode", 1)]["winner"] == "sdpa"
    code, out, _ = cli("best", "--db", url)
    lines = {line.split("│")[1].strip() + "|" + line.split("│")[2].strip(): line
             for line in out.splitlines() if line.count("│") > 3}
    flash_64 = next(v for k, v in lines.items() if k.startswith("flash_fwd|B1 H4/2 N64 "))
    sdpa_64 = next(v for k, v in lines.items() if k.startswith("torch_sdpa|B1 H4/2 N64 "))
    assert "yes, 1.25x sdpa" in flash_64 and "no, flash 1.25x faster" in sdpa_64
    decode_row = next(v for k, v in lines.items() if k.startswith("flash_decode|"))
    assert "no, sdpa (torch_sdpa not measured" in decode_row
    assert "tuner winners" in out


def test_a_device_name_of_several_devices_is_refused(tmp_path: Path) -> None:
    here = measured("torch_sdpa", small(64), 100.0)
    there = {**here, "device": {**here["device"], "torch_version": "0.0.1"}}
    there["device"]["key"] = BundleDevice.model_validate(
        {**there["device"], "key": "x"}).info().key
    url = stored(tmp_path / "two.db", here, there)
    code, _, err = cli("winners", "--db", url, "--device", here["device"]["name"])
    assert code != 0 and "name of 2 stored devices" in err and there["device"]["key"] in err
    code, out, err = cli("winners", "--db", url, "--device", there["device"]["key"], "--json")
    assert code == 0 and json.loads(out)[0]["tflops"] == {"sdpa": 100.0}
