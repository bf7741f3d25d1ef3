"""Snapshots: the best configs of one moment, frozen and named by the hash of their content.

A snapshot's content is a bundle (``tuner.lookup.bundle``'s format, as ``tuner export`` writes it)
without the two header fields that say where and when it was written (``host``,
``exported_at``), in canonical form: its items sorted, its JSON text with sorted keys and no
spaces. Its id is the SHA-256 of that text, 64 hex digits. So

* the same best configs frozen twice (on any host, from either backend) give the same id,
  and a snapshot can never change under its id: a changed row would no longer hash to it,
  and every reader checks that it does;
* a bundle file is a snapshot too: ``tuner export --snapshot ID`` writes one that hashes to
  ID, and ``TUNER_SNAPSHOT=path`` pins a job to a file (``tuner.lookup.pinned``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tuner.errors import TunerError

__all__ = ["Frozen", "SnapshotError", "StoredSnapshot", "canonical_text", "check_snapshot_id",
           "delete_snapshot", "freeze", "is_snapshot_id", "read_snapshot", "snapshot_id_of",
           "stored_bundle"]

SNAPSHOT_ID = re.compile(r"^[0-9a-f]{64}$")
# Header fields of a bundle that say where and when it was written, not what it holds.
_WHERE_AND_WHEN = ("host", "exported_at")


class SnapshotError(TunerError):
    """A snapshot that cannot be made, found or trusted; the message names it and where."""


def is_snapshot_id(text: str) -> bool:
    return SNAPSHOT_ID.match(text) is not None


def check_snapshot_id(text: str) -> str:
    if not is_snapshot_id(text):
        raise SnapshotError(f"a snapshot id is 64 lowercase hex digits (the SHA-256 of its "
                            f"content), but got {text!r}",
                            "copy the id that `tuner snapshot create` or `tuner snapshot list` "
                            "printed")
    return text


def _canonical_json(value: Any) -> str:
    # allow_nan=False: NaN and Infinity are no JSON; a bundle refuses them anyway.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def canonical_text(bundle: Mapping[str, Any]) -> str:
    """The canonical JSON text of ``bundle``'s content (what the id hashes)."""
    content = {k: v for k, v in bundle.items() if k not in _WHERE_AND_WHEN}
    items = content.get("items")
    if isinstance(items, list):
        # Sorted by their own text: the order rows came in (a backend's collation, insertion
        # order) is not content.
        content["items"] = sorted(items, key=_canonical_json)
    return _canonical_json(content)


def snapshot_id_of(bundle: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_text(bundle).encode()).hexdigest()


@dataclass(frozen=True)
class Frozen:
    """A snapshot as ``freeze`` left it: its id, how many best configs, and whether this call
    stored it (False: the same content was frozen before, under the same id)."""

    id: str
    items: int
    created: bool
    created_at: datetime


def freeze(database_url: str, *, device: str | None = None, template: str | None = None,
           dtype: str | None = None, variant: str | None = None) -> Frozen:
    """Freeze the stored best configs matching the filters (``crud.list_best``'s; none: all
    of them) into a snapshot; refuses to freeze nothing (a filter that matches no best config
    is a mistake, not a pin to defaults)."""
    # lazy: sqlalchemy, torch+triton +1.8 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud
    from db.session import run_in_transaction, session_scope
    from tuner.lookup.bundle import make_bundle

    # Read in one read transaction (a consistent view), then stored in a short write one: the
    # bests are not read under SQLite's write lock, which would hold up sweeps meanwhile.
    with session_scope(database_url, write=False) as s:
        bundle = make_bundle(s, device=device, template=template, dtype=dtype,
                             variant=variant)
    if not bundle["items"]:
        filters = {k: v for k, v in {"device": device, "template": template, "dtype": dtype,
                                     "variant": variant}.items() if v is not None}
        raise SnapshotError(f"nothing to freeze: no stored best config matches "
                            f"{filters or 'the database'}",
                            "check the filters against `tuner list`, or tune first")
    text = canonical_text(bundle)
    snapshot_id = hashlib.sha256(text.encode()).hexdigest()
    row, created = run_in_transaction(database_url, lambda s: crud.create_snapshot(
        s, snapshot_id=snapshot_id, content=text, items=len(bundle["items"])))
    return Frozen(snapshot_id, row.items, created, row.created_at)


def stored_bundle(content: str, snapshot_id: str, where: str) -> dict[str, Any]:
    """The bundle of a stored snapshot's ``content``, checked against its id."""
    bundle = json.loads(content)
    if snapshot_id_of(bundle) != snapshot_id:
        raise SnapshotError(f"snapshot {snapshot_id} in {where} does not hash to its id: its "
                            "content was changed after it was frozen",
                            "freeze the configs again (`tuner snapshot create`) and pin the "
                            "new id")
    return bundle  # type: ignore[no-any-return]


@dataclass(frozen=True)
class StoredSnapshot:
    """A snapshot as read back: its id, when it was frozen, and its content (checked)."""

    id: str
    created_at: datetime
    bundle: dict[str, Any]

    @property
    def items(self) -> int:
        return len(self.bundle.get("items", ()))


def _utc(value: datetime) -> datetime:
    # SQLite hands times back without their offset; they are stored as UTC (db.models.utcnow).
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _where(database_url: str) -> str:
    # lazy: sqlalchemy +0.15 s (2-core CPU); keeps `tuner --help` < 1 s
    from sqlalchemy.engine import make_url

    return f"database {make_url(database_url).render_as_string(hide_password=True)}"


def _unknown(snapshot_id: str, where: str) -> SnapshotError:
    return SnapshotError(f"no snapshot {snapshot_id} in {where}",
                         "list them with `tuner snapshot list` (or pass the --db or --url that "
                         "holds it)")


def read_snapshot(database_url: str, snapshot_id: str) -> StoredSnapshot:
    """Snapshot ``snapshot_id`` of the database, its content checked against its id."""
    # lazy: sqlalchemy +0.28 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud
    from db.session import session_scope

    check_snapshot_id(snapshot_id)
    where = _where(database_url)
    with session_scope(database_url, write=False) as s:
        row = crud.get_snapshot(s, snapshot_id=snapshot_id)
        if row is None:
            raise _unknown(snapshot_id, where)
        return StoredSnapshot(row.id, _utc(row.created_at),
                              stored_bundle(row.content, snapshot_id, where))


def delete_snapshot(database_url: str, snapshot_id: str) -> tuple[str, int, datetime]:
    """Delete snapshot ``snapshot_id`` of the database: its (id, items, created_at)."""
    # lazy: sqlalchemy +0.34 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud
    from db.session import run_in_transaction

    check_snapshot_id(snapshot_id)
    deleted = run_in_transaction(database_url, lambda s: crud.delete_snapshot(
        s, snapshot_id=snapshot_id))
    if deleted is None:
        raise _unknown(snapshot_id, _where(database_url))
    sid, items, created = deleted
    return sid, items, _utc(created)
