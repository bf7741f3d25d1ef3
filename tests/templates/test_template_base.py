from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

from templates.base import KernelConfig, Problem, inline_template_imports, knob
from templates.flash import bwd_kernel


@dataclass(frozen=True)
class ToyConfig(KernelConfig):
    block: int = knob(64, (32, 64, 128), "tile")
    fast: bool = knob(False, (False, True), "flag")


def test_config_validates_each_field() -> None:
    assert ToyConfig(block=128).block == 128
    with pytest.raises(ValueError, match=r"ToyConfig.block must be one of \[32, 64, 128\], but got 48"):
        ToyConfig(block=48)
    with pytest.raises(ValueError, match="fast"):
        ToyConfig(fast=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block"):
        ToyConfig(block=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no field"):
        ToyConfig.from_dict({"blok": 32})


def test_grid_and_schema_cover_the_space() -> None:
    grid = list(ToyConfig.grid())
    assert len(grid) == ToyConfig.grid_size() == 6
    assert len({c.key() for c in grid}) == 6
    schema = ToyConfig.json_schema()
    assert schema["properties"]["block"]["enum"] == [32, 64, 128]  # type: ignore[index]
    assert ToyConfig.from_dict(grid[3].to_dict()) == grid[3]


def test_problem_validation_and_buckets() -> None:
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        Problem(1, 6, 4, 16, 16, 64)
    with pytest.raises(ValueError, match="dtype"):
        Problem(1, 4, 4, 16, 16, 64, dtype="int8")
    p = Problem(3, 16, 4, 1000, 3333, 128, causal="top_left")
    b = p.bucketed()
    assert (b.seqlen_q, b.seqlen_kv) == (1024, 4096)
    assert b.batch * b.heads_q == 64  # 48 programs round up to 64
    assert Problem(4, 16, 4, 1024, 4096, 128, causal="top_left").bucket_key() == p.bucket_key()
    assert Problem.from_dict(p.to_dict()) == p


def test_problem_label_is_the_one_people_read_everywhere() -> None:
    # The sweep's progress and the CLI's tables (from a stored dict) print this one label.
    from tuner.cli.common import problem_label

    p = Problem(3, 16, 4, 1000, 3333, 128, causal="top_left", mask="sliding:64", softcap=50.0)
    assert p.label == "B3 H16/4 N1000/3333 D128 bfloat16 causal-top_left+sparse-sliding:64+softcap50"
    assert Problem(1, 2, 2, 64, 64, 32, mask="document:4").label.endswith(" sparse-document:4")
    assert Problem(1, 2, 2, 64, 64, 32).label == "B1 H2 N64 D32 bfloat16 dense"
    assert problem_label(p.to_dict()) == p.label and problem_label({}) == "-"


def test_exported_source_inlines_the_modules_of_the_family_packages() -> None:
    # A kernel module imports the shared modules by their package path
    # (templates.masks.listed_blocks); exported, each is pasted in its place, once.
    source = inline_template_imports(inspect.getsource(bwd_kernel))
    assert "from templates" not in source and "import templates" not in source
    for path in ("templates/kernel_common.py", "templates/masks/listed_blocks.py"):
        assert source.count(f"# ---- {path}, inlined ----") == 1, path
    compile(source, "flash_bwd_kernel_standalone.py", "exec")
