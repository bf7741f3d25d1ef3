"""``TUNER_SNAPSHOT``: every config of a job from one snapshot, loaded once.

``TUNER_SNAPSHOT`` is a snapshot id (``tuner.lookup.snapshot``) or the path of a bundle file. An id
is looked up in the local database (when it exists, read-only, as lookups read it), then at
the service (``TUNER_URL``, one request); the content must hash to the id wherever it came
from, so every rank of a job, and every restart, holds the very same configs. Nothing is
asked again afterwards: a service stopped, restarted or changed meanwhile changes nothing.

An id found nowhere stops the job at its first lookup (``SnapshotError`` naming the id and
every place looked in): a job that was told to run pinned configs must not run others.

``PinnedConfigs.resolve`` answers as the database does: the snapshot's items of the device and
kernel version, matched by ``tuner.lookup.matching.match_with_neighbours`` (exact, bucket, nearest
with its neighbours' bests), else the template's default. Each problem is matched on its own, not as
the first problem asked of its bucket (the unpinned resolver's cache): so the answer depends on
nothing but the snapshot and the problem, never on the order a rank happened to ask in.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from db import crud
from templates.base import Problem, Template
from templates.device import DeviceInfo
from tuner.errors import ServiceError
from tuner.lookup.bundle import Bundle, BundleItem, first_error
from tuner.lookup.matching import (
    Candidate,
    Match,
    Resolved,
    match_with_neighbours,
    parse_candidates,
)
from tuner.lookup.snapshot import SnapshotError, is_snapshot_id, snapshot_id_of, stored_bundle

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["PinnedConfigs", "load_pinned"]

log = logging.getLogger("tuner.lookup.pinned")

# One download of a whole snapshot at a job's start: far longer than a lookup may wait.
LOAD_TIMEOUT_S = 30.0
LOAD_RETRIES = 2
PIN_FIX = ("set TUNER_SNAPSHOT to an id that `tuner snapshot list` shows (against the same "
           "database or service), or to a bundle file that `tuner export --snapshot ID` wrote; "
           "unset it to look configs up as they are stored now")

GroupKey = tuple[str, str, str]  # device key, template name, template version
# Answers remembered per problem; past this many, start over (matching again is cheap, and
# gives the same answers). A decode loop poses a new problem every step.
MAX_ANSWERS = 4096


@dataclass(frozen=True)
class PinnedBest:
    """One item of the snapshot, as matching reads a stored best
    (``tuner.lookup.matching.BestLike``)."""

    problem_key: str
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: float


class PinnedConfigs:
    """The best configs of one snapshot, by device, template and kernel version."""

    def __init__(self, snapshot_id: str, bundle: Mapping[str, Any], origin: str) -> None:
        self.id = snapshot_id
        self.origin = origin  # where it was loaded from, for messages
        self._items: dict[GroupKey, list[BundleItem]] = {}
        for index, raw in enumerate(bundle.get("items", ())):
            try:
                item = BundleItem.model_validate(raw)
            except ValidationError as exc:
                raise SnapshotError(f"snapshot {snapshot_id} ({origin}): item {index}: "
                                    f"{first_error(exc)}", PIN_FIX) from None
            key = (item.device.key, item.template, item.template_version)
            self._items.setdefault(key, []).append(item)
        self._candidates: dict[GroupKey, list[Candidate]] = {}
        self._answers: dict[tuple[str, str, str, Problem], Resolved] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(items) for items in self._items.values())

    def resolve(self, template: Template, version: str, problem: Problem,
                device: DeviceInfo) -> Resolved:
        """The config ``problem`` runs with on ``device``: as the database answered when the
        snapshot was frozen (``source`` "snapshot"), or the default; never expires."""
        key = (device.key, template.name, version, problem)
        hit = self._answers.get(key)
        if hit is not None:
            return hit
        found = self.match(template, version, problem, device)
        if found is None:
            answer = Resolved(template.default_config(problem, device), "default", "default")
        else:
            answer = Resolved(found.config, found.kind, "snapshot",
                              tflops=float(found.candidate.tflops), neighbours=found.neighbours)
        if len(self._answers) >= MAX_ANSWERS:
            self._answers.clear()
        self._answers[key] = answer
        return answer

    def match(self, template: Template, version: str, problem: Problem,
              device: DeviceInfo) -> Match | None:
        return match_with_neighbours(template, problem, device,
                                     self._candidates_of((device.key, template.name, version),
                                                         template))

    def _candidates_of(self, key: GroupKey, template: Template) -> list[Candidate]:
        found = self._candidates.get(key)
        if found is None:
            with self._lock:
                found = self._candidates.get(key)
                if found is None:
                    found = self._candidates[key] = parse_candidates(
                        template, self._bests(template, self._items.get(key, [])))
                    if not found:
                        log.info("snapshot %s holds no config of %s version %s on %s: its "
                                 "problems run the default", self.id, key[1], key[2], key[0])
        return found

    @staticmethod
    def _bests(template: Template, items: list[BundleItem]) -> list[PinnedBest]:
        out = []
        for item in items:
            try:
                key = template.problem_key(Problem.from_dict(item.problem))
            except (TypeError, ValueError) as exc:  # as parse_candidates drops a bad row
                log.debug("skipping a snapshot item whose problem is invalid: %s", exc)
                continue
            out.append(PinnedBest(key, item.problem, item.config, item.tflops))
        return out


def load_pinned(value: str, *, local_engine: Callable[[], Engine | None], database_url: str,
                service_url: str | None) -> PinnedConfigs:
    """The snapshot ``value`` (TUNER_SNAPSHOT) names: an id, or a bundle file's path."""
    if is_snapshot_id(value):
        return _by_id(value, local_engine, database_url, service_url)
    path = Path(value).expanduser()
    if not path.is_file():
        raise SnapshotError(f"TUNER_SNAPSHOT={value!r} is neither a snapshot id (64 hex "
                            f"digits) nor an existing file", PIN_FIX)
    origin = f"file {path}"
    try:
        bundle = json.loads(path.read_text())
        Bundle.model_validate({**bundle, "items": []})
    except (OSError, ValueError, TypeError) as exc:  # ValidationError is a ValueError
        raise SnapshotError(f"TUNER_SNAPSHOT: {origin} is not a bundle ({exc})", PIN_FIX) from None
    pinned = PinnedConfigs(snapshot_id_of(bundle), bundle, origin)
    log.info("configs pinned to snapshot %s (%s, %d configs)", pinned.id, origin, len(pinned))
    return pinned


def _by_id(snapshot_id: str, local_engine: Callable[[], Engine | None], database_url: str,
           service_url: str | None) -> PinnedConfigs:
    looked: list[str] = []
    found = _from_database(snapshot_id, local_engine, database_url, looked)
    if found is None and service_url:
        found = _from_service(snapshot_id, service_url, looked)
    if found is None:
        if not service_url:
            looked.append("no service (TUNER_URL is not set)")
        raise SnapshotError(f"snapshot {snapshot_id} not found; looked in: "
                            + "; ".join(looked), PIN_FIX)
    bundle, origin = found
    pinned = PinnedConfigs(snapshot_id, bundle, origin)
    log.info("configs pinned to snapshot %s (%s, %d configs)", snapshot_id, origin, len(pinned))
    return pinned


def _from_database(snapshot_id: str, local_engine: Callable[[], Engine | None],
                   database_url: str, looked: list[str]) -> tuple[dict[str, Any], str] | None:
    where = f"database {make_url(database_url).render_as_string(hide_password=True)}"
    engine = local_engine()
    if engine is None:
        looked.append(f"{where} (no such database)")
        return None
    try:
        with Session(engine) as session:
            row = crud.get_snapshot(session, snapshot_id=snapshot_id)
            content = None if row is None else row.content
    except SQLAlchemyError as exc:  # no snapshots table (an older schema), server gone
        looked.append(f"{where} (unusable: {type(exc).__name__}: {str(exc).splitlines()[0]})")
        return None
    if content is None:
        looked.append(f"{where} (no such snapshot)")
        return None
    return stored_bundle(content, snapshot_id, where), where


def _from_service(snapshot_id: str, url: str, looked: list[str]
                  ) -> tuple[dict[str, Any], str] | None:
    # lazy: httpx +0.09 s (2-core CPU); `import tuner.attention` skips it
    from tuner.client import TunerClient

    where = f"service {url}"
    try:
        with TunerClient(url, token="", timeout=LOAD_TIMEOUT_S, retries=LOAD_RETRIES) as client:
            answer = client.snapshot(snapshot_id)
    except ServiceError as exc:
        looked.append(f"{where} ({'no such snapshot' if exc.status == 404 else exc})")
        return None
    if snapshot_id_of(answer.bundle) != snapshot_id:
        raise SnapshotError(f"snapshot {snapshot_id} from {where} does not hash to its id: "
                            "the service sent other content", PIN_FIX)
    return answer.bundle, where
