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
from tuner.bundle import store_bundle, validate_bundle


def test_the_winner_runner_up_and_margin_follow_the_dispatch_rule(tmp_path: Path) -> None:
    tuned = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_kv=64, head_dim=16,
                    dtype="float32")
    untuned = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=128, seqlen_kv=128, head_dim=16,
                      dtype="float32")
    url = f"sqlite:///{tmp_path / 'w.db'}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(
            measured("torch_sdpa", tuned, 100.0), measured("flash_fwd", tuned, 150.0),
            measured("flash_fwd", untuned, 500.0))))
    dispose_engine(url)
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
