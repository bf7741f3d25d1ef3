"""benchmarks/gluon_fwd_ab.py's --config (the B side's knobs) and --shapes, parsed and checked on the CPU."""

from __future__ import annotations

import pytest

from templates.gluon.fwd import GluonFwdConfig
from tests.benchmarks.benchmark_scripts import load_benchmark_script

ab = load_benchmark_script("gluon_fwd_ab")


def test_config_overrides_change_only_the_named_knobs() -> None:
    default = GluonFwdConfig()
    changed = ab.changed_config(default, ab.config_overrides(["kv_stages=3", "pingpong=false"]))
    assert changed.kv_stages == 3 and changed.pingpong is False
    rest = {k: v for k, v in changed.to_dict().items() if k not in ("kv_stages", "pingpong")}
    assert rest == {k: v for k, v in default.to_dict().items()
                    if k not in ("kv_stages", "pingpong")}
    assert ab.changed_config(default, ab.config_overrides(["persistent=1"])).persistent is True


@pytest.mark.parametrize(("pairs", "message"), [
    (["kv_stages"], "--config takes KNOB=VALUE, got 'kv_stages'"),
    (["=3"], "--config takes KNOB=VALUE"),
    (["stages=3"], "unknown knob 'stages'; the knobs: ['BLOCK_M'"),
    (["pingpong=maybe"], "pingpong is a boolean knob: true/false/1/0, got 'maybe'"),
])
def test_bad_config_overrides_say_what_is_allowed(pairs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ab.changed_config(GluonFwdConfig(), ab.config_overrides(pairs))


def test_results_of_different_switches_get_different_files() -> None:
    names = {ab.result_name(1, False, None, {}), ab.result_name(2, False, None, {}),
             ab.result_name(0, True, None, {}), ab.result_name(0, False, 3, {}),
             ab.result_name(0, False, None, {"kv_stages": "3"}),
             ab.result_name(0, False, None, {"kv_stages": "4", "pingpong": "false"}),
             ab.result_name(0, False, None, {}, 1.5), ab.result_name(0, False, None, {}, 0.75)}
    assert len(names) == 8
    assert ab.result_name(0, False, None, {}, 1.5) == "gluon_fwd_ab_combine1.5.json"
    assert ab.result_payload({}, 0, None, False, None, {}, [], 1.5)["combine"] == 1.5
    assert ab.result_name(0, False, None, {"kv_stages": "3"}) == "gluon_fwd_ab_kv_stages3.json"
    assert all(n.startswith("gluon_fwd_ab_") for n in names)  # report.py's prefix


def test_a_diag_meaning_is_kept_only_when_given() -> None:
    kept = ab.result_payload({}, 5, "the row max as a tree", False, None, {}, [])
    assert kept["diag_meaning"] == "the row max as a tree" and kept["diag"] == 5
    assert "diag_meaning" not in ab.result_payload({}, 5, None, False, None, {}, [])


def test_shapes_parse_and_name_what_is_wrong() -> None:
    assert ab.shapes("1x8x4096x128,2X12x1024x64") == [(1, 8, 4096, 128), (2, 12, 1024, 64)]
    with pytest.raises(ValueError, match="BxHxNxD"):
        ab.shapes("1x8x4096")
    with pytest.raises(ValueError, match="BxHxNxD"):
        ab.shapes("1x8xNx128")


def test_wrong_results_are_not_timed_unless_b_is_wrong_by_design() -> None:
    right = {"cudnn": 2e-3, "A": 2e-3, "B": 2e-3}
    assert ab.result_check(right, 1e-2, allow_wrong=False) == (None, [])
    wrong_b = {**right, "B": 0.5}
    why, wrong = ab.result_check(wrong_b, 1e-2, allow_wrong=False)
    assert why is not None and "B's error 5.0e-01" in why and wrong == ["B"]
    assert ab.result_check(wrong_b, 1e-2, allow_wrong=True) == (None, ["B"])
    # cuDNN and A are never allowed to be wrong; NaN is wrong.
    why, _ = ab.result_check({**right, "A": float("nan")}, 1e-2, allow_wrong=True)
    assert why is not None and "A's error nan" in why


def test_shapes_take_gqa_and_two_lengths() -> None:
    assert ab.problem_shapes("2x8x1024x128,1x16x8x4096x16384x256") == [
        (2, 8, 8, 1024, 1024, 128), (1, 16, 8, 4096, 16384, 256)]
    with pytest.raises(ValueError, match="not a multiple"):
        ab.problem_shapes("1x12x8x4096x4096x128")
    with pytest.raises(ValueError, match="BxHqxHkvxNqxNkvxD"):
        ab.problem_shapes("1x2x3x4x5")
