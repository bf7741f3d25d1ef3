"""Config resolution: matching, and the cache -> database -> service -> default chain."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from api.main import create_app
from db.session import dispose_engine, session_scope
from templates.base import Problem
from templates.device import CPU_INTERPRETER, DeviceInfo
from tests.api.serving_data import (
    FWD,
    H100,
    TOKEN,
    ScriptedServer,
    bundle,
    free_port,
    interpreter,
    item,
    live_server,
    problem,
    tuned_config,
)
from tuner.lookup.bundle import store_bundle, validate_bundle
from tuner.lookup.resolver import (
    ConfigResolver,
    device_info_from_key,
    match_best,
    match_with_neighbours,
    parse_candidates,
)
from tuner.settings import Settings, load_settings


# ----------------------------------------------------------------------------- match_best
@dataclass
class Row:
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: float = 100.0
    problem_key: str = field(init=False)

    def __post_init__(self) -> None:
        self.problem_key = FWD.problem_key(Problem.from_dict(self.problem))


def row(p: Problem, tflops: float = 100.0, **config: Any) -> Row:
    return Row(p.to_dict(), {**FWD.default_config(p, H100).to_dict(), **config}, tflops)


def test_exact_beats_bucket_beats_nearest() -> None:
    p = problem(1000)
    exact = row(p, num_stages=1)
    bucket = row(problem(1024), tflops=900.0, num_stages=2)
    near = row(problem(2048), num_stages=3)
    found = match_best(FWD, p, H100, [near, bucket, exact])
    assert found is not None and (found.kind, found.candidate) == ("exact", exact)
    found = match_best(FWD, p, H100, [near, bucket])
    assert found is not None and (found.kind, found.candidate) == ("bucket", bucket)
    found = match_best(FWD, p, H100, [near])
    assert found is not None and found.kind == "nearest" and found.config.to_dict()["num_stages"] == 3


def test_nearest_needs_the_same_family_and_prefers_the_closest_shape() -> None:
    p = problem(3000)
    far, close = row(problem(512), num_stages=1), row(problem(8192), num_stages=2)
    found = match_best(FWD, p, H100, [far, close])
    assert found is not None and found.candidate is close
    others = [row(problem(4096, dtype="float16")), row(problem(4096, causal="top_left")),
              row(problem(4096, head_dim=64)), row(problem(4096, heads_kv=4))]
    assert match_best(FWD, p, H100, others) is None


def test_stored_configs_that_do_not_validate_or_fit_are_skipped() -> None:
    p = problem(1024)
    off_space = Row(p.to_dict(), {"BLOCK_M": 48})
    unknown_field = Row(p.to_dict(), {"BLOCK_M": 64, "payload": "__import__('os')"})
    too_big = next(c for c in FWD.config_cls.grid()
                   if "shared memory" in (FWD.constraint(p, c, H100) or ""))
    no_fit = Row(p.to_dict(), too_big.to_dict())
    assert match_best(FWD, p, H100, [off_space, unknown_field, no_fit]) is None


def test_a_nearest_match_carries_the_neighbours_that_run_the_problem_nearest_first() -> None:
    p = problem(3000)
    far, close, bucket = row(problem(512)), row(problem(8192)), row(problem(4000))
    other_family = row(problem(4096, head_dim=64))
    too_big = next(c for c in FWD.config_cls.grid()
                   if "shared memory" in (FWD.constraint(p, c, H100) or ""))
    no_fit = Row(problem(2048).to_dict(), too_big.to_dict())
    rows = [far, other_family, no_fit, close]
    found = match_with_neighbours(FWD, p, H100, parse_candidates(FWD, rows))
    assert found is not None and found.kind == "nearest"
    assert list(found.neighbours) == [close.problem_key, far.problem_key]
    assert found.neighbours[far.problem_key].problem == problem(512)
    # A measurement of the problem's own bucket needs none.
    found = match_with_neighbours(FWD, p, H100, parse_candidates(FWD, [*rows, bucket]))
    assert found is not None and found.kind == "bucket" and not found.neighbours


def test_device_info_from_key_reads_keys_and_falls_back_to_hopper() -> None:
    a100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", sm_count=108,
                      total_memory=1, smem_per_block=1, driver_version="", triton_version="3.6.0",
                      torch_version="2.11.0", cuda_version="12.8")
    info = device_info_from_key(a100.key)
    assert (info.compute_capability, info.family, info.smem_per_block) == ("8.0", "ampere-ada",
                                                                          163 * 1024)
    assert info.key == a100.key and info.cudnn_version is None
    with_cudnn = dataclasses.replace(a100, cudnn_version="9.19.0")
    info = device_info_from_key(with_cudnn.key)
    assert (info.compute_capability, info.cuda_version, info.cudnn_version) == (
        "8.0", "12.8", "9.19.0")
    assert info.key == with_cudnn.key
    bare = device_info_from_key("mystery accelerator")
    assert bare.family == "hopper" and bare.name == "mystery accelerator"
    # The interpreter's key, also on a GPU host (where interpreter() is the GPU).
    cpu = dataclasses.replace(interpreter(), name=CPU_INTERPRETER, compute_capability="")
    assert device_info_from_key(cpu.key).is_interpreter


# ----------------------------------------------------------------------------- the chain
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored_db(path: Path, *items: dict[str, Any]) -> str:
    url = f"sqlite:///{path}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(*items)))
    dispose_engine(url)
    return url


def resolver(database_url: str, url: str | None = None, timeout: float = 2.0,
             clock: Clock | None = None) -> ConfigResolver:
    settings: Settings = load_settings(database_url=database_url, url=url, token=None,
                                       lookup_timeout=timeout)
    return ConfigResolver(settings, clock=clock or time.monotonic)


TINY = problem(64, batch=1, heads=2, head_dim=16, dtype="float16")


def test_local_database_answers_and_the_bucket_is_cached(tmp_path: Path) -> None:
    dev = interpreter()
    config = tuned_config(TINY, dev)
    r = resolver(stored_db(tmp_path / "local.db", item(TINY, device=dev, config=config)))
    got = r.resolve(FWD, TINY, dev)
    assert (got.source, got.match, got.config.to_dict()) == ("database", "exact", config)
    assert got.expires_at == float("inf")
    same_bucket = problem(50, batch=1, heads=2, head_dim=16, dtype="float16")
    assert r.resolve(FWD, same_bucket, dev) is got  # from the cache, no query
    r.clear()
    assert r.resolve(FWD, same_bucket, dev).match == "bucket"


def test_a_lookup_never_creates_a_database(tmp_path: Path) -> None:
    missing = tmp_path / "absent.db"
    got = resolver(f"sqlite:///{missing}").resolve(FWD, TINY, interpreter())
    assert got.source == "default" and got.config == FWD.default_config(TINY, interpreter())
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()  # a file without the project's tables
    before = empty.read_bytes()
    r = resolver(f"sqlite:///{empty}")
    assert r.resolve(FWD, TINY, interpreter()).source == "default"
    assert empty.read_bytes() == before


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live service knowing one tuned config of TINY for this machine's device."""
    folder = tmp_path_factory.mktemp("lookup-service")
    url = stored_db(folder / "service.db",
                    item(TINY, device=interpreter(), config=tuned_config(TINY, interpreter())))
    with live_server(create_app(load_settings(database_url=url, token=TOKEN))) as base:
        yield base
    dispose_engine(url)


def test_the_service_answers_when_the_database_cannot(service: str, tmp_path: Path) -> None:
    r = resolver(f"sqlite:///{tmp_path / 'none.db'}", url=service)
    got = r.resolve(FWD, TINY, interpreter())
    assert (got.source, got.match) == ("service", "exact")
    assert got.config.to_dict() == tuned_config(TINY, interpreter())
    untuned = problem(64, batch=1, heads=2, head_dim=32, dtype="float16")
    assert r.resolve(FWD, untuned, interpreter()).source == "default"  # service said default


def test_a_service_exact_answer_beats_a_local_nearest_one(service: str, tmp_path: Path) -> None:
    dev = interpreter()
    far = problem(1024, batch=1, heads=2, head_dim=16, dtype="float16")
    local = stored_db(tmp_path / "near.db", item(far, device=dev))
    assert resolver(local).resolve(FWD, TINY, dev).match == "nearest"
    got = resolver(local, url=service).resolve(FWD, TINY, dev)
    assert (got.source, got.match) == ("service", "exact")


def test_a_dead_service_costs_one_try_per_retry_period(tmp_path: Path) -> None:
    clock = Clock()
    with ScriptedServer([(500, {"detail": "boom"}, 0)]) as server:
        r = resolver(f"sqlite:///{tmp_path / 'none.db'}", url=server.url, clock=clock)
        shapes = [problem(n, batch=1, heads=2, head_dim=16, dtype="float16")
                  for n in (64, 128, 256)]
        assert r.resolve(FWD, shapes[0], interpreter()).source == "default"
        assert r.service_down and len(server.requests) == 1
        clock.now += 59
        assert r.resolve(FWD, shapes[1], interpreter()).source == "default"
        assert len(server.requests) == 1  # remembered: not asked again
        clock.now += 2
        assert r.resolve(FWD, shapes[2], interpreter()).source == "default"
        assert len(server.requests) == 2
    nothing = f"http://127.0.0.1:{free_port()}"
    r = resolver(f"sqlite:///{tmp_path / 'none.db'}", url=nothing, clock=clock)
    assert r.resolve(FWD, TINY, interpreter()).source == "default" and r.service_down


def test_a_slow_service_is_waited_for_only_the_lookup_timeout(tmp_path: Path) -> None:
    with ScriptedServer([(200, {}, 3.0)]) as server:
        r = resolver(f"sqlite:///{tmp_path / 'none.db'}", url=server.url, timeout=0.2)
        start = time.monotonic()
        got = r.resolve(FWD, TINY, interpreter())
        assert got.source == "default" and time.monotonic() - start < 1.5
        start = time.monotonic()
        other = problem(128, batch=1, heads=2, head_dim=16, dtype="float16")
        assert r.resolve(FWD, other, interpreter()).source == "default"
        assert time.monotonic() - start < 0.1 and len(server.requests) == 1


def _answer(config: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    return {"template": FWD.name, "template_version": version or FWD.version(),
            "device": interpreter().key, "problem": TINY.to_dict(), "problem_key": "k",
            "match": "exact", "config": config}


@pytest.mark.parametrize("answer", [
    _answer({"BLOCK_M": 48}),
    _answer({"BLOCK_M": 64, "code": "__import__('os').system('echo pwned')"}),
    _answer({"BLOCK_M": "64"}),
    _answer({"BLOCK_M": 256, "BLOCK_N": 256, "num_stages": 5}),  # violates a constraint
    _answer({"BLOCK_M": 64}, version="0123456789abcdef"),  # another kernel's config
], ids=["off-space", "unknown-field", "wrong-type", "constraint", "other-version"])
def test_a_served_config_outside_the_space_is_never_run(tmp_path: Path,
                                                       answer: dict[str, Any]) -> None:
    with ScriptedServer([(200, answer, 0)]) as server:
        r = resolver(f"sqlite:///{tmp_path / 'none.db'}", url=server.url)
        got = r.resolve(FWD, TINY, interpreter())
        assert len(server.requests) == 1
        assert (got.source, got.config) == ("default", FWD.default_config(TINY, interpreter()))
        assert not r.service_down  # the service works; its answer was just unusable


def test_a_best_stored_while_the_process_runs_is_picked_up_within_5_s(tmp_path: Path) -> None:
    """Issue 20, item 2: a default answer is asked again after UNTUNED_TTL_S (5 s), also when
    the database file did not exist yet at the first lookup."""
    dev, clock = interpreter(), Clock()
    path = tmp_path / "later.db"
    r = resolver(f"sqlite:///{path}", clock=clock)
    first = r.resolve(FWD, TINY, dev)
    assert first.source == "default" and first.expires_at == clock.now + 5.0
    config = tuned_config(TINY, dev)
    stored_db(path, item(TINY, device=dev, config=config))  # a sweep writes meanwhile
    clock.now += 4.9
    assert r.resolve(FWD, TINY, dev) is first  # still cached
    clock.now += 0.2
    got = r.resolve(FWD, TINY, dev)
    assert (got.source, got.match, got.config.to_dict()) == ("database", "exact", config)
