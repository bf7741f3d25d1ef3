"""The demand queue on both backends: counts add up per shape bucket, workers claim the most
reported row of their device and kernel versions, leases expire, claims race safely."""

from __future__ import annotations

from datetime import timedelta

import pytest

from db import demand
from db.demand import DemandCount
from db.models import DemandStatus, utcnow
from db.session import run_in_transaction, session_scope
from tests.db import _workers

GPU = "NVIDIA H100 80GB HBM3|cc9.0|triton3.6.0|torch2.11.0|cuda12.8"
OTHER_GPU = "NVIDIA A100-SXM4-80GB|cc8.0|triton3.6.0|torch2.11.0|cuda12.8"
VERSIONS = {"flash_fwd": "v1", "torch_sdpa": "s1"}


def count(key: str, reports: int = 1, *, device: str = GPU, template: str = "flash_fwd",
          version: str = "v1") -> DemandCount:
    return DemandCount(device, template, version, key, {"seqlen_q": len(key)}, reports)


def add(url: str, *counts: DemandCount) -> None:
    run_in_transaction(url, lambda s: demand.add_demand(s, counts=counts))


def claim(url: str, worker: str = "w1", *, device: str = GPU, lease_s: float = 60.0,
          versions: dict[str, str] | None = None, max_attempts: int = 3,
          at: float = 0.0) -> tuple[int, str, int] | None:
    """(id, problem key, attempts) of the row claimed, or None."""

    def take(s: object) -> tuple[int, str, int] | None:
        row = demand.claim_demand(s, device_key=device, versions=versions or VERSIONS,  # type: ignore[arg-type]
                                  worker=worker, lease_s=lease_s, max_attempts=max_attempts,
                                  now=utcnow() + timedelta(seconds=at))
        return None if row is None else (row.id, row.problem_key, row.attempts)

    return run_in_transaction(url, take)


def rows(url: str, *, at: float = 0.0, status: str | None = None
         ) -> dict[str, tuple[int, str, str]]:
    """problem key -> (reports, shown status, worker), as seen ``at`` seconds from now."""
    now = utcnow() + timedelta(seconds=at)
    with session_scope(url, write=False) as s:
        return {r.problem_key: (r.reports, demand.demand_status(r, now), r.worker)
                for r in demand.list_demand(s, status=status, now=now)}


def test_reports_add_up_per_bucket_and_the_first_problem_is_kept(db_url: str) -> None:
    add(db_url, count("b1", 2), count("b2"))
    add(db_url, DemandCount(GPU, "flash_fwd", "v1", "b1", {"seqlen_q": 999}, 5))
    with session_scope(db_url, write=False) as s:
        listed = demand.list_demand(s)
        assert [(r.problem_key, r.reports) for r in listed] == [("b1", 7), ("b2", 1)]
        assert listed[0].problem == {"seqlen_q": 2}  # the first reported, what is tuned
        assert listed[0].last_seen >= listed[0].first_seen
        assert demand.count_demand(s) == 2


def test_beyond_the_cap_new_buckets_are_refused_and_known_ones_still_counted(
        db_url: str) -> None:
    def add_capped(*counts: DemandCount) -> list[str]:
        refused = run_in_transaction(db_url, lambda s: demand.add_demand(
            s, counts=counts, max_open=3))
        return [c.problem_key for c in refused]

    assert add_capped(count("b1"), count("b2")) == []
    # One place left: the most reported new bucket takes it; b1 is counted whatever the cap.
    assert add_capped(count("b1", 4), count("c1", 2), count("c2", 9)) == ["c1"]
    assert rows(db_url) == {"b1": (5, "open", ""), "c2": (9, "open", ""),
                            "b2": (1, "open", "")}
    assert add_capped(count("c1")) == ["c1"]
    # A claimed (or done) row takes no place: room for one more; its own reports still add up.
    claim(db_url)  # c2, the most reported
    assert add_capped(count("c2", 3), count("c1"), count("c3")) == ["c3"]
    with session_scope(db_url, write=False) as s:
        assert demand.count_open(s) == 3
        assert demand.stored_buckets(s, keys=[count(k).bucket for k in ("b1", "c2", "c3")]
                                     + [count("b1", device=OTHER_GPU).bucket]) == {
            count("b1").bucket, count("c2").bucket}
    assert rows(db_url)["c2"][:2] == (12, "claimed")


def test_a_worker_claims_the_most_reported_row_of_its_device_and_versions(db_url: str) -> None:
    add(db_url, count("low", 1), count("high", 9), count("other-gpu", 50, device=OTHER_GPU),
        count("old-kernel", 40, version="v0"), count("sdpa", 5, template="torch_sdpa",
                                                      version="s1"))
    taken = [claim(db_url) for _ in range(4)]
    assert [t[1] if t else None for t in taken] == ["high", "sdpa", "low", None]
    assert claim(db_url, device=OTHER_GPU)[1] == "other-gpu"  # type: ignore[index]
    assert claim(db_url, versions={"flash_fwd": "v0"})[1] == "old-kernel"  # type: ignore[index]
    assert claim(db_url, versions={}) is None
    assert rows(db_url, status="claimed")["high"] == (9, "claimed", "w1")
    assert rows(db_url, status="open") == {}


def test_a_lapsed_lease_is_taken_over_and_its_old_worker_can_no_longer_finish(
        db_url: str) -> None:
    add(db_url, count("b1"))
    first = claim(db_url, "dead", lease_s=30)
    assert first is not None and claim(db_url, "w2", at=10) is None  # the lease holds
    assert rows(db_url, status="expired", at=31) == {"b1": (1, "expired", "dead")}
    assert rows(db_url, status="expired") == {}
    second = claim(db_url, "w2", at=31)
    assert second == (first[0], "b1", 2)
    with session_scope(db_url) as s:
        assert not demand.renew_demand_claim(s, demand_id=first[0], worker="dead", lease_s=30)
        assert not demand.finish_demand(s, demand_id=first[0], worker="dead",
                                        status=DemandStatus.DONE, note="")
        assert demand.renew_demand_claim(s, demand_id=first[0], worker="w2", lease_s=30)
        assert demand.finish_demand(s, demand_id=first[0], worker="w2",
                                    status=DemandStatus.DONE, note="best 1 TFLOP/s")
    assert rows(db_url) == {"b1": (1, "done", "w2")}
    assert claim(db_url, "w3", at=1000) is None  # done rows are never claimed again


def test_a_problem_that_kills_every_worker_is_given_up(db_url: str) -> None:
    add(db_url, count("poison", 10), count("fine", 1))
    assert claim(db_url, "a", lease_s=1, max_attempts=2)[1] == "poison"  # type: ignore[index]
    assert claim(db_url, "b", lease_s=1, max_attempts=2, at=2)[1] == "poison"  # type: ignore[index]
    # Both leases passed: given up, and the next claim takes the other row.
    assert claim(db_url, "c", lease_s=1, max_attempts=2, at=5)[1] == "fine"  # type: ignore[index]
    with session_scope(db_url, write=False) as s:
        [poison] = demand.list_demand(s, status="failed")
        assert poison.attempts == 2 and "given up" in poison.note


def test_a_released_claim_is_open_again_and_not_an_attempt(db_url: str) -> None:
    add(db_url, count("b1"))
    taken = claim(db_url, "w1")
    assert taken is not None
    with session_scope(db_url) as s:
        assert demand.release_demand(s, demand_id=taken[0], worker="w1", note="stopped")
    assert rows(db_url) == {"b1": (1, "open", "")}
    assert claim(db_url, "w2") == (taken[0], "b1", 1)


def test_bad_arguments_are_refused(db_url: str) -> None:
    with session_scope(db_url) as s:
        with pytest.raises(ValueError, match="lease_s must be > 0"):
            demand.claim_demand(s, device_key=GPU, versions=VERSIONS, worker="w",
                                lease_s=0, max_attempts=1)
        with pytest.raises(ValueError, match="done or failed"):
            demand.finish_demand(s, demand_id=1, worker="w", status=DemandStatus.OPEN, note="")
        with pytest.raises(ValueError, match="status must be one of"):
            demand.list_demand(s, status="busy")


@pytest.mark.slow
def test_workers_claiming_at_once_each_get_their_own_row(db_url: str) -> None:
    workers, per_worker = 4, 5
    add(db_url, *(count(f"b{i:02d}", i + 1) for i in range(workers * per_worker)))
    claimed = _workers.race(_workers.claim_demand_rows,
                            [(db_url, f"w{w}", GPU, VERSIONS, per_worker + 1)
                             for w in range(workers)])
    every = [key for keys in claimed.values() for key in keys]
    assert sorted(every) == sorted(f"b{i:02d}" for i in range(workers * per_worker))
    assert all(len(keys) >= 1 for keys in claimed.values())
    assert rows(db_url, status="open") == {}
