"""benchmarks/gluon_pack_gqa.py: its shape parsing (the timing needs a Hopper GPU)."""

from __future__ import annotations

import pytest

from tests.benchmarks.benchmark_scripts import load_benchmark_script

pack_gqa = load_benchmark_script("gluon_pack_gqa")


def test_shapes_are_parsed_and_bad_ones_named() -> None:
    assert pack_gqa.parse_shapes("1,32,8,16,4096,128; 2,8,1,1,300,64") == [
        (1, 32, 8, 16, 4096, 128), (2, 8, 1, 1, 300, 64)]
    assert len(pack_gqa.parse_shapes(pack_gqa.DEFAULT_SHAPES)) == 8
    for bad in ("1,32,8,16,4096", "1,32,8,0,4096,128", "a,b,c,d,e,f"):
        with pytest.raises(ValueError, match=f"B,Hq,Hkv,Nq,Nkv,D items of positive integers "
                                             f"separated by ';', got '{bad}'"):
            pack_gqa.parse_shapes(bad)
    with pytest.raises(ValueError, match=r"Hq \(30\) must be a multiple of Hkv \(8\)"):
        pack_gqa.parse_shapes("1,30,8,16,4096,128")
