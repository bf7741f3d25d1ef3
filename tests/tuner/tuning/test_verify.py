"""``tuner verify``: a tiny flash_fwd sweep under the interpreter, then its stored best
re-measured in a fresh worker; a stored time faked far off fails; nothing stored is an error.

Interpreter timings are wall-clock runs of a few milliseconds, noisy from run to run, so the
CLI tests verify with a tolerance of 900% (any ratio up to 10x): they check the pipeline and
the numbers it reports, not the 3% bar, which only a GPU can meet. The ratio and tolerance
arithmetic is tested exactly with a runner that answers fixed times.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from db import crud
from db.models import BestConfig, TrialStatus
from db.session import session_scope
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.piped_table import piped_table
from tuner.cli.common import fmt_tflops
from tuner.errors import TunerError
from tuner.lookup.stored_bests import StoredBest
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.runner.timing import REP_MS
from tuner.tuning.verify import VerifyOptions, parse_tolerance, verify

SHAPE = "B=1,H=2,N=32,D=16"
LABEL = "B1 H2 N32 D16 float16 dense"
GENEROUS = "9"  # interpreter timings are noisy: 900%, i.e. anything up to 10x the stored time


@pytest.fixture(scope="module")
def swept_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database holding one stored best of flash_fwd on cpu-interpreter (the default
    config, the only trial)."""
    db = f"sqlite:///{tmp_path_factory.mktemp('verify') / 'tuner.db'}"
    code, _, err = cli("sweep", "--shape", SHAPE, "--dtype", "float16", "--trials", "1",
                       "--timeout", "120", "--seed", "0", "--db", db, "--json")
    assert code == 0, err
    return db


def stored_row(db: str) -> dict[str, Any]:
    with session_scope(db, write=False) as s:
        (row,) = s.scalars(select(BestConfig))
        readings = crud.best_readings(s, [row])[row.id]
        return {"median_ms": row.median_ms, "tflops": row.tflops, "config": dict(row.config),
                "readings": readings.count, "spread": readings.spread}


def test_verify_remeasures_the_stored_best_in_a_fresh_worker(swept_db: str) -> None:
    stored = stored_row(swept_db)
    code, out, err = cli("verify", "--shape", SHAPE, "--dtype", "float16", "--db", swept_db,
                         "--tolerance", GENEROUS, "--repeats", "2", "--json")
    assert code == 0, err + out
    report = json.loads(out)
    assert report["ok"] is True and report["verified"] == 1 and report["failed"] == 0
    assert report["device"]["name"] == "cpu-interpreter" and "NOT GPU" in report["warning"]
    (problem,) = report["problems"]
    assert problem["template"] == "flash_fwd" and problem["status"] == "ok"
    assert problem["config"] == stored["config"]
    assert problem["stored_ms"] == pytest.approx(stored["median_ms"])
    assert problem["stored_tflops"] == pytest.approx(stored["tflops"])
    assert len(problem["runs_ms"]) == 2 and all(ms > 0 for ms in problem["runs_ms"])
    assert problem["measured_ms"] == pytest.approx(sum(problem["runs_ms"]) / 2)  # median of 2
    assert problem["ratio"] == pytest.approx(problem["measured_ms"] / stored["median_ms"])
    # Same FLOPs: TFLOP/s scale inversely with the time.
    assert problem["measured_tflops"] == pytest.approx(
        stored["tflops"] * stored["median_ms"] / problem["measured_ms"])
    assert problem["within_tolerance"] is True


@pytest.fixture
def faked_db(swept_db: str) -> Iterator[str]:
    """The swept database with its stored best claiming 1000x its measured speed (put back
    afterwards)."""

    def scale(factor: float) -> None:
        with session_scope(swept_db) as s:
            (row,) = s.scalars(select(BestConfig))
            row.median_ms /= factor
            row.tflops *= factor

    scale(1000.0)
    try:
        yield swept_db
    finally:
        scale(1 / 1000.0)


def test_a_stored_time_far_off_fails_and_names_the_problem(faked_db: str) -> None:
    stored = stored_row(faked_db)
    code, out, err = cli("verify", "--db", faked_db, "--tolerance", GENEROUS)
    assert code == 1, err + out
    header, rows = piped_table(out, "problem")
    assert header == ["problem", "stored ms", "TFLOP/s", "re-measured ms", "TFLOP/s", "ratio",
                      "stored readings (spread)", "within 900%"]
    (cells,) = [row for row in rows if row[0] == LABEL]
    assert cells[:3] == [LABEL, f"{stored['median_ms']:.4g}", fmt_tflops(stored["tflops"])]
    assert float(cells[5]) > 100 and cells[7] == "NO"  # ratio: the stored time is 1000x off
    assert float(cells[3]) == pytest.approx(stored["median_ms"] * float(cells[5]), rel=2e-3)
    # Next to the verdict, what the stored time rests on: the sweep's finalist readings.
    assert stored["readings"] == 3
    assert cells[6] == f"3 ({stored['spread'] * 100:.1f}%)"
    assert f"off: flash_fwd {LABEL}: re-measured" in out
    assert f"vs stored {stored['median_ms']:.4g} ms" in out
    assert f"beyond the {stored['spread'] * 100:.1f}% spread of its 3 stored readings" in out
    assert "0 of 1 within 900%" in out


def test_auto_tolerance_and_longer_timing_through_the_cli(swept_db: str) -> None:
    stored = stored_row(swept_db)
    code, out, err = cli("verify", "--shape", SHAPE, "--dtype", "float16", "--db", swept_db,
                         "--tolerance", "auto", "--rep-ms", "250", "--json")
    report = json.loads(out)
    assert report["tolerance"] == "auto" and report["rep_ms"] == 250.0
    (problem,) = report["problems"]
    assert problem["stored_readings"] == stored["readings"] == 3
    assert problem["stored_spread"] == pytest.approx(stored["spread"])
    # The bar of this stored best: the larger of 3% and its own readings' spread.
    assert problem["tolerance"] == pytest.approx(max(0.03, stored["spread"]))
    deviation = abs(problem["deviation"])
    assert problem["within_tolerance"] is (deviation <= problem["tolerance"])
    assert problem["within_stored_spread"] is (deviation <= stored["spread"])
    assert code == (0 if problem["within_tolerance"] else 1), err


def test_nothing_stored_for_a_problem_is_an_error_naming_it(swept_db: str,
                                                             tmp_path: Path) -> None:
    code, _, err = cli("verify", "--shape", "B=1,H=2,N=64,D=16", "--dtype", "float16",
                       "--causal", "top_left", "--db", swept_db)
    err = " ".join(err.split())  # rich wraps lines at the terminal's width
    assert code == 2
    assert "no stored best config on cpu-interpreter" in err
    assert "flash_fwd B1 H2 N64 D16 float16 causal-top_left" in err
    assert "tuner sweep" in err
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    code, out, _ = cli("verify", "--db", empty, "--json")
    assert code == 2 and "tuner sweep" in json.loads(out)["fix"]


def test_bad_flags_exit_2_before_measuring(swept_db: str) -> None:
    for flags, says in ((["--repeats", "0"], "--repeats must be >= 1"),
                        (["--tolerance", "0"], "--tolerance must be > 0"),
                        (["--tolerance", "3%"], "--tolerance must be a number > 0 or 'auto'"),
                        (["--rep-ms", "0"], "--rep-ms must be > 0"),
                        (["--rep-ms", "nan"], "--rep-ms must be > 0"),
                        (["--causal", "top_left"], "--causal goes with --shape"),
                        (["cpu", "--shape", SHAPE], "not both")):
        code, _, err = cli("verify", *flags, "--db", swept_db)
        assert code == 2 and says in " ".join(err.split()), (flags, err)


# ----------------------------------------------------------------------------- the arithmetic
class FixedRunner:
    """Answers each request with the next of ``times`` (ms); None: a wrong result."""

    def __init__(self, times: list[float | None]) -> None:
        self.times = list(times)
        self.requests: list[TrialRequest] = []

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        self.requests.append(request)
        ms = self.times.pop(0)
        if ms is None:
            return TrialOutcome.failed(TrialStatus.WRONG_RESULT, "relative error 0.5")
        return TrialOutcome(TrialStatus.OK, median_ms=ms, tflops=100.0 / ms)  # 1e11 FLOPs


STORED = StoredBest(device_key="d", template="flash_fwd", template_version="v", problem_key="k",
                    problem={"batch": 1}, config={"BLOCK_M": 64}, median_ms=2.0, tflops=50.0)


@pytest.mark.parametrize(("times", "ratio", "ok"), [
    ([2.058], 1.029, True),  # 2.9% slower
    ([1.942], 0.971, True),  # 2.9% faster
    ([2.1], 1.05, False),
    ([1.9], 0.95, False),
    ([2.2, 1.0, 2.04], 1.02, True),  # the median of the repeats counts
    ([1.0, 3.0], 1.0, True),  # even repeats: the mean of the middle two
])
def test_the_median_time_over_the_stored_time_against_the_tolerance(
        times: list[float | None], ratio: float, ok: bool) -> None:
    runner = FixedRunner(times)
    (result,) = verify([STORED], runner, VerifyOptions(repeats=len(times), seed=1))
    assert result.ratio == pytest.approx(ratio)
    assert result.within_tolerance is ok
    assert result.measured_ms is not None
    assert result.measured_tflops == pytest.approx(100.0 / result.measured_ms)
    seeds = [r.seed for r in runner.requests]
    assert len(set(seeds)) == len(seeds)  # fresh inputs for every re-measurement
    assert all(r.config == STORED.config and r.problem == STORED.problem
               for r in runner.requests)


def test_a_failed_remeasurement_fails_and_stops_the_repeats() -> None:
    runner = FixedRunner([2.0, None, 2.0])
    (result,) = verify([STORED], runner, VerifyOptions(repeats=3))
    assert len(runner.requests) == 2
    assert result.failure is not None and result.failure.status == TrialStatus.WRONG_RESULT
    assert result.measured_ms is None and result.ratio is None
    assert result.within_tolerance is False
    data = result.to_dict()
    assert data["status"] == "wrong_result" and data["within_tolerance"] is False


def test_the_timing_length_reaches_every_request() -> None:
    runner = FixedRunner([2.0, 2.0])
    verify([STORED], runner, VerifyOptions(repeats=2, rep_ms=500.0))
    assert [r.rep_ms for r in runner.requests] == [500.0, 500.0]
    runner = FixedRunner([2.0])
    verify([STORED], runner, VerifyOptions())
    assert [r.rep_ms for r in runner.requests] == [REP_MS] == [100]  # the sweep's protocol


@pytest.mark.parametrize(("spread", "tolerance", "ok", "within_spread"), [
    (0.07, 0.07, True, True),  # 5% off, within the config's own 7% spread: passes the auto bar
    (0.01, 0.03, False, False),  # a tight config keeps the 3% floor
    (None, 0.03, False, None),  # measured once: its noise is unknown
])
def test_auto_tolerance_is_the_larger_of_3_percent_and_the_stored_spread(
        spread: float | None, tolerance: float, ok: bool, within_spread: bool | None) -> None:
    stored = dataclasses.replace(STORED, readings=1 if spread is None else 3, spread=spread)
    (fixed,) = verify([stored], FixedRunner([2.1]), VerifyOptions())
    assert fixed.tolerance == 0.03 and fixed.within_tolerance is False  # the default bar
    (auto,) = verify([stored], FixedRunner([2.1]), VerifyOptions(tolerance="auto"))
    assert auto.tolerance == pytest.approx(tolerance) and auto.within_tolerance is ok
    assert auto.within_stored_spread is within_spread
    data = auto.to_dict()
    assert (data["tolerance"], data["stored_readings"], data["stored_spread"]) == (
        pytest.approx(tolerance), stored.readings, spread)
    assert data["within_stored_spread"] is within_spread


def test_bad_options_name_what_is_allowed() -> None:
    assert parse_tolerance("AUTO") == "auto" and parse_tolerance("0.05") == 0.05
    with pytest.raises(TunerError, match="--tolerance must be a number > 0 or 'auto'"):
        parse_tolerance("three percent")
    for bad in ({"tolerance": "loose"}, {"tolerance": -0.1}, {"rep_ms": 0.0},
                {"rep_ms": float("inf")}):
        with pytest.raises(TunerError, match="must be > 0"):
            VerifyOptions(**bad)  # type: ignore[arg-type]
