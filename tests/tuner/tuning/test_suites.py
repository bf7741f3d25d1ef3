"""Sweep specs: built-in suites, TOML/YAML files, flags, and the errors of bad ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from templates.base import Problem
from tuner.errors import TunerError
from tuner.tuning.suites import (
    BUILTIN_SUITES,
    load_spec_file,
    parse_shape,
    resolve_spec,
    spec_from_flags,
    spec_from_mapping,
)


def test_standard_suite_follows_the_protocol() -> None:
    spec, note = resolve_spec("standard", interpreter=False)
    assert note is None
    assert spec.templates == ("torch_sdpa", "flash_fwd", "gluon_fwd")
    seqlens = sorted({p.seqlen_q for p in spec.problems})
    assert seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert {p.head_dim for p in spec.problems} == {64, 128}
    assert {p.causal for p in spec.problems} == {"none", "top_left"}
    assert {p.dtype for p in spec.problems} == {"bfloat16"}
    assert len(spec.problems) == 6 * 2 * 2
    for p in spec.problems:  # 16k tokens per batch, hidden size 2048
        assert p.batch * p.seqlen_q == 16384 and p.heads_q * p.head_dim == 2048
        assert p.heads_kv == p.heads_q and p.seqlen_kv == p.seqlen_q


def test_quick_runs_as_cpu_without_a_gpu_and_standard_is_refused() -> None:
    gpu_quick, _ = resolve_spec("quick", interpreter=False)
    assert {p.dtype for p in gpu_quick.problems} == {"bfloat16"}
    assert {p.head_dim for p in gpu_quick.problems} == {64, 128}
    # torch SDPA is tuned beside ours (the dispatcher's baseline), and two decode rows.
    assert gpu_quick.templates[0] == "torch_sdpa" and "flash_decode" in gpu_quick.templates
    assert [(p.batch, p.seqlen_q, p.seqlen_kv) for p in gpu_quick.problems
            if p.seqlen_q == 1] == [(1, 1, 32768), (8, 1, 32768)]
    cpu, note = resolve_spec("quick", interpreter=True)
    assert cpu.name == "cpu" and note is not None and "interpreter" in note
    # Tiny fp16 shapes: the interpreter runs bf16 through float32 (suites.default_dtype).
    assert all(p.dtype == "float16" and p.seqlen_q <= 128 and p.batch == 1 for p in cpu.problems)
    # The implementations that compete, SDPA's beside ours, as on a GPU (make demo).
    assert cpu.templates == ("torch_sdpa", "flash_fwd")
    with pytest.raises(TunerError, match="needs a CUDA GPU") as err:
        resolve_spec("standard", interpreter=True)
    assert "cpu" in err.value.fix


def test_unknown_suite_names_the_choices() -> None:
    with pytest.raises(TunerError, match="unknown suite 'nope'") as err:
        resolve_spec("nope", interpreter=False)
    for name in BUILTIN_SUITES:
        assert name in err.value.fix


TOML = """
name = "mine"
templates = ["flash_fwd"]
dtypes = ["float16", "bfloat16"]
causal = [false, "bottom_right"]
trials = 12
sampler = "random"
timeout = 60
finalists = 0
final_repeats = 4
head_to_head_rounds = 0
shapes = [
  {B = 2, H = 8, N = 1000, D = 64},
  {B = 1, H_q = 32, H_kv = 8, N_q = 128, N_kv = 4096, D = 128},
]
"""

YAML = """
name: mine
templates: [flash_fwd]
dtypes: [float16, bfloat16]
causal: [false, bottom_right]
trials: 12
sampler: random
timeout: 60
finalists: 0
final_repeats: 4
head_to_head_rounds: 0
shapes:
  - {B: 2, H: 8, N: 1000, D: 64}
  - {batch: 1, heads_q: 32, heads_kv: 8, seqlen_q: 128, seqlen_kv: 4096, head_dim: 128}
"""


def test_toml_and_yaml_specs_give_the_same_problems(tmp_path: Path) -> None:
    toml_file = tmp_path / "s.toml"
    yaml_file = tmp_path / "s.yaml"
    toml_file.write_text(TOML)
    yaml_file.write_text(YAML)
    a, b = load_spec_file(toml_file), load_spec_file(yaml_file)
    assert a.problems == b.problems
    assert (a.trials, a.sampler, a.timeout_s) == (12, "random", 60.0)
    assert (a.finalists, a.final_repeats) == (0, 4)  # 0 is a setting: no finalists
    assert a.head_to_head_rounds == 0 == b.head_to_head_rounds  # and no head-to-head
    unset = spec_from_mapping({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}]}, source="test")
    assert unset.finalists is None and unset.head_to_head_rounds is None  # the flags' defaults
    assert len(a.problems) == 2 * 2 * 2
    assert Problem(2, 8, 8, 1000, 1000, 64, "float16", "none") in a.problems
    assert Problem(1, 32, 8, 128, 4096, 128, "bfloat16", "bottom_right") in a.problems
    assert resolve_spec(str(toml_file), interpreter=True)[0] == a


def test_duplicate_problems_are_dropped() -> None:
    spec = spec_from_mapping({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}] * 3},
                             source="test")
    assert len(spec.problems) == 1


def test_flags_make_a_spec() -> None:
    spec = spec_from_flags(templates=["flash_fwd"], shapes=["B=1,H=2,N=64,D=32", "B=2,H=4,N=128,D=64"],
                           dtypes=["float16"], causal=["none", "top_left"])
    assert len(spec.problems) == 4
    assert parse_shape("B=8, H_q=16,H_kv=4,N=2048,D=128") == {
        "B": 8, "H_q": 16, "H_kv": 4, "N": 2048, "D": 128}


@pytest.mark.parametrize(("data", "message"), [
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "colour": "red"}, "unknown key"),
    ({"templates": ["flash_fwd"]}, "no 'shapes'"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64}]}, r"lacks \['head_dim'\]"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32, "X": 1}]}, "unknown key 'X'"),
    ({"shapes": [{"B": "one", "H": 2, "N": 64, "D": 32}]}, "must be an integer"),
    ({"shapes": [{"B": 1, "H": 3, "H_kv": 2, "N": 64, "D": 32}]}, "multiple of heads_kv"),
    ({"shapes": [{"B": 0, "H": 2, "N": 64, "D": 32}]}, "positive integer"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "dtypes": ["fp8"]}, "dtype 'fp8'"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "causal": ["left"]}, "causal mode 'left'"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "trials": 0}, "'trials' must be"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "timeout": -1}, "'timeout' must be"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "finalists": -1},
     "'finalists' must be an integer >= 0"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "final_repeats": 0},
     "'final_repeats' must be a positive integer"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "head_to_head_rounds": -1},
     "'head_to_head_rounds' must be an integer >= 0"),
    ({"shapes": "B=1"}, r"shapes\[0\] must be a mapping"),
    ({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32, "templates": "flash_fwd"}]},
     r"shapes\[0\].templates must be a non-empty list"),
    ({"templates": ["flash_fwd"],
      "shapes": [{"B": 1, "H": 2, "N": 64, "D": 32, "templates": ["flash_bwd"]}]},
     r"names \['flash_bwd'\], which the spec's templates"),
])
def test_malformed_specs_name_the_problem(data: dict, message: str) -> None:
    with pytest.raises(TunerError, match=message) as err:
        spec_from_mapping(data, source="spec file 'x.toml'")
    assert "x.toml" in err.value.message and err.value.fix


def test_bad_files_are_reported_with_their_name(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("shapes = [{B = 1,\n")
    with pytest.raises(TunerError, match="broken.toml.*not valid TOML"):
        load_spec_file(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(TunerError, match="must hold a mapping"):
        load_spec_file(listy)
    with pytest.raises(TunerError, match="does not exist"):
        resolve_spec(str(tmp_path / "missing.toml"), interpreter=True)
    with pytest.raises(TunerError, match="not KEY=INTEGER"):
        parse_shape("B=1,H")


def test_without_dtypes_a_spec_takes_the_machines_dtype(tmp_path: Path) -> None:
    # The interpreter runs bf16 through float32 copies: a CPU sweep names float16 instead.
    spec_file = tmp_path / "plain.toml"
    spec_file.write_text("shapes = [{B = 1, H = 2, N = 64, D = 32}]\n")
    for interpreter, dtype in ((True, "float16"), (False, "bfloat16")):
        spec, _ = resolve_spec(str(spec_file), interpreter=interpreter)
        assert {p.dtype for p in spec.problems} == {dtype}
        flags = spec_from_flags(templates=[], shapes=["B=1,H=2,N=64,D=32"], dtypes=[],
                                causal=[], interpreter=interpreter)
        assert {p.dtype for p in flags.problems} == {dtype}
    named = spec_from_flags(templates=[], shapes=["B=1,H=2,N=64,D=32"], dtypes=["bfloat16"],
                            causal=[], interpreter=True)
    assert {p.dtype for p in named.problems} == {"bfloat16"}


SHAPE = {"B": 1, "H": 2, "N": 64, "D": 32}


def test_a_misspelled_key_names_the_nearest_known_one() -> None:
    with pytest.raises(TunerError) as err:
        spec_from_mapping({"tempaltes": ["flash_fwd"], "shapes": [SHAPE], "colour": "red"},
                          source="spec file 'x.toml'")
    assert "'colour', 'tempaltes' (did you mean 'templates'?)" in err.value.message
    with pytest.raises(TunerError, match=r"unknown key 'N_qv' \(did you mean 'N_q'\?\)"):
        spec_from_mapping({"shapes": [{**SHAPE, "N_qv": 64}]}, source="x")
    # The singular spellings are aliases, not ignored.
    spec = spec_from_mapping({"template": ["flash_bwd"], "dtype": "float16", "shapes": [SHAPE]},
                             source="x")
    assert spec.templates == ("flash_bwd",) and {p.dtype for p in spec.problems} == {"float16"}


def test_spec_keys_written_under_space_are_refused(tmp_path: Path) -> None:
    # In TOML every key after [space] belongs to that table: the templates would be lost.
    spec_file = tmp_path / "late.toml"
    spec_file.write_text('shapes = [{B = 1, H = 2, N = 64, D = 32}]\n[space]\nBLOCK_M = [32]\n'
                         'templates = ["flash_bwd"]\n')
    with pytest.raises(TunerError, match=r"\['templates'\] under \[space\] are spec keys") as err:
        load_spec_file(spec_file)
    assert err.value.fix == "move templates above the [space] table"


def test_the_sweep_command_stops_on_a_misspelled_key(tmp_path: Path) -> None:
    from tests.tuner.cli.test_sweep_cli import cli

    spec_file = tmp_path / "typo.toml"
    spec_file.write_text('tempaltes = ["flash_bwd"]\nshapes = [{B = 1, H = 2, N = 64, D = 32}]\n')
    code, _, err = cli("sweep", str(spec_file), "--db", f"sqlite:///{tmp_path / 't.db'}")
    assert code == 2
    assert "error:" in err and "(did you mean 'templates'?)" in err and "fix:" in err
    assert not (tmp_path / "t.db").exists()  # refused before anything ran


def test_sweep_tasks_are_problem_major_so_a_stopped_sweep_leaves_whole_problems() -> None:
    from tuner.tuning.sweep import expand_tasks
    spec = spec_from_flags(templates=["torch_sdpa", "flash_fwd"],
                           shapes=["B=1,H=2,N=128,D=64", "B=1,H=2,N=256,D=64"],
                           dtypes=["float16"], causal=["none"])
    tasks, skipped = expand_tasks(spec)
    assert not skipped
    order = [(t.problem.seqlen_q, t.template.name) for t in tasks]
    assert order == [(128, "torch_sdpa"), (128, "flash_fwd"),
                     (256, "torch_sdpa"), (256, "flash_fwd")]


def test_a_shapes_templates_are_the_only_ones_that_tune_its_problem() -> None:
    """A recording names, per line, the templates its calls could run (a decode step no
    training template): the sweep measures only those there; a problem that another line
    names without templates is tuned by all."""
    from tuner.tuning.sweep import expand_tasks
    spec = spec_from_mapping({"templates": ["torch_sdpa", "flash_fwd", "flash_bwd"], "shapes": [
        {"B": 1, "H": 2, "N_q": 1, "N_kv": 128, "D": 64, "templates": ["torch_sdpa"]},
        {"B": 1, "H": 2, "N": 128, "D": 64, "templates": ["flash_fwd"]},
        {"B": 1, "H": 2, "N": 128, "D": 64, "templates": ["flash_bwd", "flash_fwd"]},
        {"B": 1, "H": 2, "N": 256, "D": 64, "templates": ["flash_fwd"]},
        {"B": 1, "H": 2, "N": 256, "D": 64}]}, source="job.toml", dtype="float16")
    tasks, _ = expand_tasks(spec)
    assert [(t.problem.seqlen_q, t.problem.seqlen_kv, t.template.name) for t in tasks] == [
        (1, 128, "torch_sdpa"), (128, 128, "flash_fwd"), (128, 128, "flash_bwd"),
        (256, 256, "torch_sdpa"), (256, 256, "flash_fwd"), (256, 256, "flash_bwd")]
    assert [list(t) for t in spec.problem_templates.values()] == [
        ["torch_sdpa"], ["flash_fwd", "flash_bwd"]]


def test_the_ship_suite_is_standard_and_llamas_grouped_query_rows() -> None:
    from tuner.tuning.suites import ship_suite, standard_suite

    ship, standard = ship_suite(), standard_suite()
    assert ship.name == "ship" and ship.templates == standard.templates
    assert ship.problems[:len(standard.problems)] == standard.problems
    gqa = ship.problems[len(standard.problems):]
    assert {(p.heads_q, p.heads_kv, p.head_dim) for p in gqa} == {(32, 8, 128)}
    assert sorted({p.seqlen_q for p in gqa}) == [2048, 4096, 8192, 16384]
    assert {p.causal for p in gqa} == {"none", "top_left"}
    with pytest.raises(TunerError, match="needs a CUDA GPU"):
        resolve_spec("ship", interpreter=True)
