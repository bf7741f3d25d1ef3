"""tuner winners: per problem, the implementation the dispatcher runs, the runner-up, and
every measured implementation's TFLOP/s (stored bests of this machine's device), and each SDPA
backend's time from the stored trials (on SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from db import crud, head_to_head
from db.models import TrialStatus
from db.session import dispose_engine, init_db, make_engine, session_scope
from templates import current_device, get_template
from templates.base import Problem
from tests.api.serving_data import bundle
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.dispatch.test_dispatch import measured
from tests.tuner.piped_table import piped_table
from tuner.dispatch.winners import stored_winners
from tuner.lookup.bundle import BundleDevice, store_bundle, validate_bundle


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
        "why": "fastest measured", "tflops": {"sdpa": 100.0, "flash": 125.0},
        "median_ms": {name: get_template(t).flops(shared) / (tf * 1e9) for name, t, tf in (
            ("sdpa", "torch_sdpa", 100.0), ("flash", "flash_fwd", 125.0))},
        # The bundle holds SDPA's best trial (the default backend) alone.
        "sdpa_backends": {"default": {"median_ms": pytest.approx(
            SDPA.flops(shared) / 100e9), "tflops": 100.0, "readings": 1}}}
    assert runs[("torch_sdpa", 64)]["winner"] == "flash"
    assert runs[("flash_fwd", 256)] is None  # nothing else measured there: nothing to compare
    # Two of ours, torch SDPA unmeasured: it runs by rule, neither of ours.
    assert runs[("flash_decode", 1)]["winner"] == "sdpa"
    code, out, _ = cli("best", "--db", url)
    header, rows = piped_table(out, "template")
    assert header[:2] == ["template", "problem"] and header[-2:] == ["runs", "config"]
    assert len(rows) == 5
    runs = {(row[0], row[1].split(" float")[0]): row[-2] for row in rows}
    assert runs[("flash_fwd", "B1 H4/2 N64 D16")] == "yes, 1.25x sdpa"
    assert runs[("torch_sdpa", "B1 H4/2 N64 D16")] == "no, flash 1.25x faster"
    assert runs[("flash_fwd", "B1 H4/2 N256 D16")] == "-"
    (decode,) = [v for (template, _), v in runs.items() if template == "flash_decode"]
    assert decode.startswith("no, sdpa (torch_sdpa not measured")
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


# ----------------------------------------------------------------------------- SDPA backends
SDPA = get_template("torch_sdpa")
HERE = current_device()


@dataclass(frozen=True)
class Target:
    url: str
    device_id: int
    sdpa: int  # torch_sdpa's template id at this install's version
    old_sdpa: int  # ... at an older version
    flash: int  # flash_fwd's at this install's version


@pytest.fixture
def target(db_url: str) -> Target:
    init_db(db_url)
    with session_scope(db_url) as s:
        device = crud.get_or_create_device(s, info=HERE.to_dict() | {"key": HERE.key})
        templates = [crud.get_or_create_template(s, name=name, version=version, space={}).id
                     for name, version in (("torch_sdpa", SDPA.version()),
                                           ("torch_sdpa", "old"),
                                           ("flash_fwd", get_template("flash_fwd").version()))]
        return Target(db_url, device.id, *templates)


def trial(s: Session, t: Target, p: Problem, config: dict[str, Any], ms: float | None, *,
          template: int | None = None, status: TrialStatus = TrialStatus.OK) -> int:
    """A trial of ``config`` for ``p`` at ``ms`` (None: it failed), torch_sdpa's by default;
    the template's best refreshed."""
    template = t.sdpa if template is None else template
    key = SDPA.problem_key(p)
    row = crud.record_trial(
        s, device_id=t.device_id, template_id=template, problem_key=key, problem=p.to_dict(),
        config_key=json.dumps(config, sort_keys=True), config=config, status=status,
        reason="" if ms else "No available kernel", median_ms=ms,
        tflops=SDPA.flops(p) / (ms * 1e9) if ms else None)
    crud.refresh_best(s, device_id=t.device_id, template_id=template, problem_key=key)
    return row.id


def winners_of(url: str) -> dict[tuple[int, int], Any]:
    """``tuner.dispatch.winners`` of this machine's device, by the problem's sequence lengths."""
    with session_scope(url, write=False) as s:
        found = stored_winners(s, device=HERE.key,
                               version_of=lambda name: get_template(name).version())
    return {(it.problem["seqlen_q"], it.problem["seqlen_kv"]): it for it in found.items}


def times(item: Any) -> dict[str, float]:
    return {name: t.median_ms for name, t in item.sdpa_backends.items()}


def test_each_sdpa_backend_shows_its_best_time_beside_the_winner(target: Target) -> None:
    p, q = small(64), small(128)
    with session_scope(target.url) as s:
        cudnn = trial(s, target, p, {"backend": "cudnn"}, 0.8)
        trial(s, target, p, {"backend": "flash"}, 1.0)
        trial(s, target, p, {"backend": "efficient"}, 1.8)
        trial(s, target, p, {"BLOCK_M": 64}, 0.7, template=target.flash)
        # Re-measured, cuDNN's time is the median of its readings, as its stored best's is.
        for ms in (0.9, 0.85):
            crud.record_remeasurement(s, trial_id=cudnn, status=TrialStatus.OK, median_ms=ms,
                                      tflops=SDPA.flops(p) / (ms * 1e9))
        crud.refresh_best(s, device_id=target.device_id, template_id=target.sdpa,
                          problem_key=SDPA.problem_key(p))
        # A failed trial has no time; a failed re-measurement disqualifies its backend.
        trial(s, target, q, {"backend": "cudnn"}, 2.0)
        trial(s, target, q, {"backend": "flash"}, None, status=TrialStatus.RUNTIME_ERROR)
        efficient = trial(s, target, q, {"backend": "efficient"}, 1.5)
        crud.record_remeasurement(s, trial_id=efficient, status=TrialStatus.WRONG_RESULT,
                                  reason="relative error 0.5")
        crud.refresh_best(s, device_id=target.device_id, template_id=target.sdpa,
                          problem_key=SDPA.problem_key(q))
        # Trials of another kernel version are not what runs here: left out.
        trial(s, target, p, {"backend": "efficient"}, 0.1, template=target.old_sdpa)
        trial(s, target, p, {"backend": "default"}, 0.1, template=target.old_sdpa)
    found = winners_of(target.url)
    assert (found[64, 64].winner, found[64, 64].runner_up) == ("flash", "sdpa")
    assert times(found[64, 64]) == {"cudnn": pytest.approx(0.85), "flash": 1.0, "efficient": 1.8}
    assert list(found[64, 64].sdpa_backends) == ["cudnn", "flash", "efficient"]  # fastest first
    cudnn_time = found[64, 64].sdpa_backends["cudnn"]
    assert cudnn_time.readings == 3 and cudnn_time.median_ms == found[64, 64].median_ms["sdpa"]
    assert cudnn_time.tflops == pytest.approx(found[64, 64].tflops["sdpa"])
    assert found[64, 64].sdpa_backends["flash"].readings == 1
    assert times(found[128, 128]) == {"cudnn": 2.0}
    assert found[128, 128].configs["sdpa"] == {"backend": "cudnn"}


def test_a_head_to_head_times_the_backend_it_measured(target: Target) -> None:
    p = small(64)
    with session_scope(target.url) as s:
        cudnn = trial(s, target, p, {"backend": "cudnn"}, 0.8)
        flash = trial(s, target, p, {"backend": "flash"}, 1.0)
        session = head_to_head.start_head_to_head(s, device_id=target.device_id,
                                                  problem=p.to_dict(), rounds=3)
        for n, ms in enumerate((0.95, 0.97, 0.96)):
            head_to_head.record_head_to_head_reading(
                s, head_to_head_id=session, trial_id=cudnn, round=n, position=0,
                status=TrialStatus.OK, median_ms=ms, tflops=SDPA.flops(p) / (ms * 1e9))
        head_to_head.record_head_to_head_reading(
            s, head_to_head_id=session, trial_id=flash, round=0, position=1,
            status=TrialStatus.WRONG_RESULT, reason="relative error 0.5")
        head_to_head.finish_head_to_head(s, head_to_head_id=session)
        crud.refresh_best(s, device_id=target.device_id, template_id=target.sdpa,
                          problem_key=SDPA.problem_key(p))
    [found] = winners_of(target.url).values()
    # cuDNN at its head-to-head's median, as the stored best; flash failed there: disqualified.
    assert times(found) == {"cudnn": pytest.approx(0.96)}
    assert found.sdpa_backends["cudnn"].median_ms == found.median_ms["sdpa"]
    assert found.head_to_head == {"sdpa": session}  # whose median the sdpa time is


def test_backend_times_take_as_many_queries_for_twenty_problems_as_for_one(target: Target) -> None:
    def statements(problems: int) -> int:
        """Queries of ``tuner.dispatch.winners`` once ``problems`` problems (buckets) are stored."""
        with session_scope(target.url) as s:
            for n in range(problems):
                p = small(2 ** (4 + n % 5), 2 ** (4 + n // 5))  # one bucket each
                for backend, ms in (("cudnn", 1.0), ("flash", 1.1), ("efficient", 1.2)):
                    trial(s, target, p, {"backend": backend}, ms)
        engine = make_engine(target.url)
        seen: list[str] = []

        def count(*args: Any) -> None:
            seen.append(args[2])

        event.listen(engine, "before_cursor_execute", count)
        try:
            found = winners_of(target.url)
        finally:
            event.remove(engine, "before_cursor_execute", count)
        assert len(found) == problems
        assert all(len(it.sdpa_backends) == 3 for it in found.values())
        return len(seen)

    one = statements(1)
    assert statements(20) == one


def test_the_winners_table_shows_each_sdpa_backend(target: Target) -> None:
    p = small(64)
    with session_scope(target.url) as s:
        trial(s, target, p, {"backend": "cudnn"}, 0.8)
        trial(s, target, p, {"backend": "efficient"}, 1.5)
        trial(s, target, p, {"backend": "flash"}, None, status=TrialStatus.RUNTIME_ERROR)
    code, out, err = cli("winners", "--db", target.url, "--json")
    assert code == 0, err
    [item] = json.loads(out)
    assert item["sdpa_backends"] == {
        "cudnn": {"median_ms": 0.8, "tflops": pytest.approx(SDPA.flops(p) / 0.8e9),
                  "readings": 1},
        "efficient": {"median_ms": 1.5, "tflops": pytest.approx(SDPA.flops(p) / 1.5e9),
                      "readings": 1}}
    code, out, err = cli("winners", "--db", target.url)
    assert code == 0, err
    assert "sdpa backends" in out and "cudnn 0.8 ms, efficient 1.5 ms" in out
    assert "flash" not in out.split("sdpa backends")[1]


def side_by_side(s: Session, t: Target, p: Problem, readings: dict[int, list[float]]) -> int:
    """A finished head-to-head of ``p``: by trial id, its readings round after round; both
    templates' bests refreshed. Its id."""
    session = head_to_head.start_head_to_head(s, device_id=t.device_id, problem=p.to_dict(),
                                              rounds=len(next(iter(readings.values()))))
    for position, (trial_id, times_ms) in enumerate(readings.items()):
        for n, ms in enumerate(times_ms):
            head_to_head.record_head_to_head_reading(
                s, head_to_head_id=session, trial_id=trial_id, round=n, position=position,
                status=TrialStatus.OK, median_ms=ms, tflops=SDPA.flops(p) / (ms * 1e9))
    head_to_head.finish_head_to_head(s, head_to_head_id=session)
    for template in (t.sdpa, t.flash):
        crud.refresh_best(s, device_id=t.device_id, template_id=template,
                          problem_key=SDPA.problem_key(p))
    return session


def test_a_winner_within_its_head_to_heads_noise_says_so(target: Target) -> None:
    clear, close, apart = small(64), small(128), small(256)
    with session_scope(target.url) as s:
        for p, sdpa_ms, flash_ms in (
                # flash faster in 6 rounds of 6, the ranges overlapping: a sign test decides.
                (clear, [1.02, 1.05, 1.02, 1.05, 1.02, 1.05], [1.01, 1.04, 1.01, 1.04, 1.01, 1.04]),
                # flash faster by its median, but in 4 rounds of 6: noise.
                (close, [1.02, 1.05, 1.02, 1.05, 1.01, 1.01],
                 [1.00, 1.03, 1.00, 1.03, 1.015, 1.015]),
                # 3 rounds, the ranges apart.
                (apart, [1.2, 1.3, 1.25], [1.0, 1.1, 1.05])):
            sdpa = trial(s, target, p, {"backend": "cudnn"}, sdpa_ms[0])
            flash = trial(s, target, p, {"BLOCK_M": 64}, flash_ms[0], template=target.flash)
            side_by_side(s, target, p, {sdpa: sdpa_ms, flash: flash_ms})
        # Each measured alone, never side by side: nothing to say.
        alone = small(512)
        trial(s, target, alone, {"backend": "cudnn"}, 1.0)
        trial(s, target, alone, {"BLOCK_M": 64}, 0.9, template=target.flash)
    found = winners_of(target.url)
    assert {n: (found[n, n].winner, found[n, n].decided) for n in (64, 128, 256, 512)} == {
        64: ("flash", True), 128: ("flash", False), 256: ("flash", True), 512: ("flash", None)}
    code, out, err = cli("winners", "--db", target.url)
    assert code == 0, err
    rows = [line for line in out.splitlines() if "sdpa" in line and "x " in line]
    assert sum("(noise)" in line for line in rows) == 1, out


def test_forward_templates_name_the_implementation_that_serves_inference() -> None:
    # gluon_train pairs gluon's forward with our backward: its inference calls are gluon's, so
    # a table or `tuner winners` naming gluon_fwd's winner must say gluon (a dict built in
    # registration order once named the last pairing registered instead).
    import tuner.dispatch.implementations.gluon_train  # noqa: F401  (registers gluon_train)
    from tuner.dispatch.implementations import implementations
    from tuner.dispatch.winners import forward_templates

    sharing = [impl.name for impl in implementations() if impl.forward == "gluon_fwd"]
    assert len(sharing) >= 2, sharing  # the case this guards
    assert forward_templates()["gluon_fwd"] == "gluon"
