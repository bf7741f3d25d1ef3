"""Snapshots (issue 18, item 4): content-addressed, immutable, and a job pinned to one answers
from it alone, as the database would have answered when it was frozen."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from db import crud
from db.session import dispose_engine, session_scope
from templates.base import Problem
from tests.api.serving_data import (
    FWD,
    bundle,
    faster,
    interpreter,
    item,
    problem,
    store,
    tuned_config,
)
from tests.tuner.dispatch.test_dispatch import measured
from tuner.dispatch.rule import Call, choose
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.lookup.snapshot import (
    SnapshotError,
    canonical_text,
    delete_snapshot,
    freeze,
    read_snapshot,
    snapshot_id_of,
    stored_bundle,
)
from tuner.settings import load_settings


# ----------------------------------------------------------------------------- the id
def test_the_id_hashes_the_content_not_its_order_or_where_and_when_it_was_written() -> None:
    items = [item(problem(n)) for n in (256, 512, 1024, 2048)]
    first = bundle(*items, host="gpu-1")
    shuffled = bundle(*random.Random(3).sample(items, len(items)), host="gpu-2")
    shuffled["exported_at"] = "2026-11-26T10:00:00+00:00"
    assert snapshot_id_of(first) == snapshot_id_of(shuffled)
    assert len(snapshot_id_of(first)) == 64
    # Any change of what it holds is another id: a config, a number, an item more or less.
    changed = json.loads(json.dumps(first))
    changed["items"][2]["tflops"] += 1.0
    assert snapshot_id_of(changed) != snapshot_id_of(first)
    assert snapshot_id_of(bundle(*items[:3])) != snapshot_id_of(first)
    # Canonical text: keys sorted, no spaces; re-reading it gives the same text.
    text = canonical_text(first)
    assert canonical_text(json.loads(text)) == text and ": " not in text


# ----------------------------------------------------------------------------- freezing
def test_the_same_content_frozen_twice_is_one_snapshot_and_a_snapshot_never_changes(
        db_url: str) -> None:
    p = problem(1024)
    first = item(p)
    store(db_url, first, item(problem(4096)))
    a = freeze(db_url)
    assert a.created and a.items == 2
    again = freeze(db_url)
    assert (again.id, again.created, again.items) == (a.id, False, 2)

    store(db_url, faster(p, first))  # a sweep finds better
    b = freeze(db_url)
    assert b.created and b.id != a.id
    with session_scope(db_url, write=False) as s:
        old = crud.get_snapshot(s, snapshot_id=a.id)
        new = crud.get_snapshot(s, snapshot_id=b.id)
        assert old is not None and new is not None
        old_bundle = stored_bundle(old.content, a.id, "test")
        new_bundle = stored_bundle(new.content, b.id, "test")
        assert [r[0] for r in crud.list_snapshots(s)] == sorted(
            [a.id, b.id], key=lambda i: i != b.id)  # newest first
    by_problem = {json.dumps(i["problem"], sort_keys=True): i["config"]
                  for i in old_bundle["items"]}
    assert by_problem[json.dumps(p.to_dict(), sort_keys=True)] == first["config"]
    assert faster(p, first)["config"] in [i["config"] for i in new_bundle["items"]]
    # A filter freezes part: only that device's configs.
    store(db_url, item(problem(512), device=interpreter()))
    part = freeze(db_url, device=interpreter().key)
    assert part.items == 1


def test_a_changed_row_no_longer_hashes_to_its_id_and_is_refused(db_url: str) -> None:
    store(db_url, item(problem(1024)))
    frozen = freeze(db_url)
    with session_scope(db_url) as s:
        row = crud.get_snapshot(s, snapshot_id=frozen.id)
        assert row is not None
        tampered = json.loads(row.content)
        tampered["items"][0]["tflops"] = 1e5
        s.execute(sa.update(type(row)).where(type(row).id == frozen.id)
                  .values(content=canonical_text(tampered)))
    with session_scope(db_url, write=False) as s:
        row = crud.get_snapshot(s, snapshot_id=frozen.id)
        assert row is not None
        with pytest.raises(SnapshotError, match="does not hash to its id"):
            stored_bundle(row.content, frozen.id, "test")


def test_freezing_nothing_is_refused_with_the_filters_named(db_url: str) -> None:
    store(db_url, item(problem(1024)))
    with pytest.raises(SnapshotError, match="no stored best config matches.*'template': 'nope'"):
        freeze(db_url, template="nope")


def test_a_snapshot_is_read_back_checked_and_deleted_whole_leaving_the_others(
        db_url: str) -> None:
    store(db_url, item(problem(1024)))
    kept = freeze(db_url)
    store(db_url, item(problem(4096)))
    doomed = freeze(db_url)
    read = read_snapshot(db_url, doomed.id)
    assert (read.id, read.items, snapshot_id_of(read.bundle)) == (doomed.id, 2, doomed.id)
    assert read.created_at.replace(tzinfo=None) == doomed.created_at.replace(tzinfo=None)

    assert delete_snapshot(db_url, doomed.id)[:2] == (doomed.id, 2)
    with pytest.raises(SnapshotError, match=f"no snapshot {doomed.id} in database"):
        read_snapshot(db_url, doomed.id)
    with pytest.raises(SnapshotError, match=f"no snapshot {doomed.id} in database"):
        delete_snapshot(db_url, doomed.id)  # deleted once: unknown now
    with pytest.raises(SnapshotError, match="64 lowercase hex digits"):
        delete_snapshot(db_url, "HEAD")
    with session_scope(db_url, write=False) as s:
        assert [r[0] for r in crud.list_snapshots(s)] == [kept.id]
        assert crud.count_best(s) == 2  # the best configs it froze are untouched
    # Frozen again, the same content is the same id: a snapshot deleted by mistake comes back.
    again = freeze(db_url)
    assert (again.id, again.created) == (doomed.id, True)


# ----------------------------------------------------------------------------- pinned jobs
# Shapes asked of a database holding tiny(64) and tiny(256): one of tiny(64)'s bucket, one
# nearest, one of another head dim (nothing of its family tuned: the default), and tiny(64)
# itself: exact, also after another problem of its bucket was asked (a pinned resolver
# matches each problem on its own, so the order of questions changes no answer).
def tiny(seqlen: int, head_dim: int = 16) -> Problem:
    return problem(seqlen, batch=1, heads=2, head_dim=head_dim, dtype="float16")


ASKED = [tiny(50), tiny(1024), tiny(64, head_dim=32), tiny(64)]


def pinned_resolver(database_url: str, snapshot: str | None, url: str | None = None
                    ) -> ConfigResolver:
    return ConfigResolver(load_settings(database_url=database_url, url=url, token=None,
                                        snapshot=snapshot))


def answers(r: ConfigResolver) -> list[tuple[str, dict[str, Any]]]:
    return [(got.match, got.config.to_dict())
            for got in (r.resolve(FWD, p, interpreter()) for p in ASKED)]


def database_answers(url: str) -> list[tuple[str, dict[str, Any]]]:
    """The database's answer to each problem (a fresh resolver each: no bucket cached)."""
    return [(got.match, got.config.to_dict()) for got in (
        pinned_resolver(url, None).resolve(FWD, p, interpreter()) for p in ASKED)]


def test_a_pinned_resolver_answers_as_the_database_did_when_it_was_frozen(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    dev = interpreter()
    first = item(tiny(64), device=dev, config=tuned_config(tiny(64), dev))
    store(url, first, item(tiny(256), device=dev))
    frozen = freeze(url)
    from_database = database_answers(url)
    assert [m for m, _ in from_database] == ["bucket", "nearest", "default", "exact"]
    pinned = pinned_resolver(url, frozen.id)
    assert answers(pinned) == from_database
    assert pinned.pinned is not None and pinned.pinned.id == frozen.id
    got = pinned_resolver(url, frozen.id).resolve(FWD, tiny(64), dev)
    assert (got.source, got.match, got.config.to_dict()) == ("snapshot", "exact",
                                                             first["config"])
    assert got.expires_at == float("inf") and got.measured

    store(url, faster(tiny(64), first, device=dev))  # the database moves on
    dispose_engine(url)
    assert database_answers(url) != from_database
    assert answers(pinned_resolver(url, frozen.id)) == from_database  # a restart: the same

    # The snapshot exported as a file pins the same configs, under the same id.
    with session_scope(url, write=False) as s:
        row = crud.get_snapshot(s, snapshot_id=frozen.id)
        assert row is not None
        data = stored_bundle(row.content, frozen.id, "test")
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(data, indent=2))
    from_file = pinned_resolver(f"sqlite:///{tmp_path / 'none.db'}", str(path))
    assert answers(from_file) == from_database
    assert from_file.pinned is not None and from_file.pinned.id == frozen.id


def test_an_unknown_snapshot_stops_the_job_naming_the_id_and_where_it_looked(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    store(url, item(tiny(64), device=interpreter()))
    freeze(url)
    unknown = "0" * 64
    r = pinned_resolver(url, unknown, url="http://127.0.0.1:9")  # nothing listens on port 9
    for _ in range(2):  # every lookup, not only the first: no config runs unpinned
        with pytest.raises(SnapshotError) as info:
            r.resolve(FWD, tiny(64), interpreter())
        message = str(info.value)
        assert f"snapshot {unknown} not found" in message
        assert f"database sqlite:///{tmp_path / 'tuner.db'} (no such snapshot)" in message
        assert "service http://127.0.0.1:9" in message
    with pytest.raises(SnapshotError, match="no such database.*TUNER_URL is not set"):
        pinned_resolver(f"sqlite:///{tmp_path / 'absent.db'}", unknown).resolve(
            FWD, tiny(64), interpreter())
    with pytest.raises(SnapshotError, match="neither a snapshot id .* nor an existing file"):
        pinned_resolver(url, str(tmp_path / "missing.json")).resolve(
            FWD, tiny(64), interpreter())
    not_a_bundle = tmp_path / "x.json"
    not_a_bundle.write_text('{"format": "something else", "items": []}')
    with pytest.raises(SnapshotError, match="is not a bundle"):
        pinned_resolver(url, str(not_a_bundle)).resolve(FWD, tiny(64), interpreter())


def test_the_dispatcher_prices_implementations_from_the_snapshot(
        tmp_path: Path, no_tuned_configs: None) -> None:
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    p = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=24, seqlen_kv=40, head_dim=16,
                dtype="float32")
    store(url, measured("torch_sdpa", p, 100.0), measured("flash_fwd", p, 50.0))
    frozen = freeze(url)
    # Later, another flash config measures faster than SDPA.
    store(url, measured("flash_fwd", p, 300.0, tuned_config(p, interpreter())))
    call = Call(p, needs_grad=False, device=interpreter())
    set_resolver(pinned_resolver(url, None))
    assert choose(call).implementation.name == "flash"
    set_resolver(pinned_resolver(url, frozen.id))
    choice = choose(call)
    assert choice.implementation.name == "sdpa" and choice.source == "snapshot", choice.why
    priced = {e.implementation: e for e in choice.estimates}
    assert priced["flash"].ms == pytest.approx(FWD.flops(p) / 50e9)  # the frozen 50 TFLOP/s
    assert all(r.source == "snapshot" for r in priced["flash"].resolved)
