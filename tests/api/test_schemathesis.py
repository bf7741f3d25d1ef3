"""Property-based checks of every operation against the service's own OpenAPI schema.

schemathesis reads ``/openapi.json`` from the ASGI app and generates requests from it: valid
ones (positive mode) and ones that break the schema (negative mode: wrong types, out-of-range
values, missing or unknown parameters, bad bodies). Every answer is checked: never a 5xx, a
documented status code, the documented content type and headers, a body that conforms to the
documented response schema, input that breaks the schema refused, and (for uploads that were
stored) the bearer token really enforced. Every request carries the token, so POST /v1/results
gets past 401 to bundle validation.

The schema alone cannot describe a valid bundle (the body is an open object), so uploads are
also fuzzed from a valid bundle broken in one or two places: every value of it replaced by odd
JSON (huge and non-finite numbers, NUL characters, wrong types), removed, or joined by an
unknown key. Those run first, so the read endpoints are then checked over whatever odd but
valid data they stored.

The tests drive schemathesis through plain hypothesis (``operation.as_strategy``), not
``schemathesis.pytest.from_fixture``: that loader sets ``Function._nodeid``, which pytest 9.2
no longer has.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

# An optional test dependency (the dev extra): hosts without it, such as the GPU image that
# scripts/gpu_check.sh runs on, skip this module instead of failing the whole collection.
schemathesis = pytest.importorskip(
    "schemathesis", reason="schemathesis is not installed here (pip install -e '.[dev]')")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.core.result import Ok  # noqa: E402
from schemathesis.specs.openapi.schemas import OpenApiSchema  # noqa: E402

from api.main import create_app  # noqa: E402
from db.session import dispose_engine  # noqa: E402
from tests.api.serving_data import H100, TOKEN, bundle, item, problem  # noqa: E402
from tuner.lookup.bundle import BundleDevice  # noqa: E402
from tuner.settings import load_settings  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]
# Negative mode's refusals: schemathesis's defaults, and 413. A body past the service's size
# limit (an array past maxItems of large items, say) is refused before it is parsed.
CONFIG = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
    "expected-statuses": ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422",
                          "428", "429", "5xx"]}}})
# Every operation of /openapi.json, and whether it takes input that negative mode can break
# (test_every_operation_is_checked keeps this complete).
OPERATIONS = {
    "GET /healthz": False,
    "GET /v1/devices": False,
    "GET /v1/templates": False,
    "GET /v1/best": True,
    "GET /v1/winners": True,
    "GET /v1/configs": True,
    "POST /v1/results": True,
    "POST /v1/snapshots": True,
    "GET /v1/snapshots": True,
    "GET /v1/snapshots/{snapshot_id}": True,
    "DELETE /v1/snapshots/{snapshot_id}": True,
    "POST /v1/demand": True,
    "GET /v1/demand": True,
    "POST /v1/demand/claim": True,
    "POST /v1/demand/{demand_id}/lease": True,
    "POST /v1/demand/{demand_id}/finish": True,
    "POST /v1/demand/{demand_id}/release": True,
    "GET /v1/kernels/{template}/source": True,
    "GET /dashboard": False,
}
MAX_EXAMPLES = 25  # per operation and mode: the whole file takes ~20 s on 2 cores


def hypothesis_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenApiSchema]:
    url = f"sqlite:///{tmp_path_factory.mktemp('schemathesis') / 'service.db'}"
    app = create_app(load_settings(database_url=url, token=TOKEN, url=None))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
    # Seeded through the API itself, so lookups find exact, bucket and nearest matches.
    seed = bundle(*(item(problem(n)) for n in (512, 2048)), item(problem(1024, causal="top_left")))
    response = schema["/v1/results"]["POST"].Case(body=seed).call(headers=AUTH)
    assert response.status_code == 201, response.text
    yield schema
    dispose_engine(url)


def test_every_operation_is_checked(api_schema: OpenApiSchema) -> None:
    found = {}
    for result in api_schema.get_all_operations():
        assert isinstance(result, Ok), result
        op = result.ok()
        found[f"{op.method.upper()} {op.path}"] = bool(
            len(op.query) or len(op.path_parameters) or len(op.body))
    assert found == OPERATIONS


# ----------------------------------------------------------------- uploads: a valid bundle, broken
VALID = bundle(item(problem(4096, heads=8, heads_kv=2, causal="bottom_right"), sweep="fuzz"))
ODD_VALUES: list[Any] = [
    None, True, 0, -1, 0.5, 1 << 31, 1 << 63, 1 << 64, 10**400, 1e308, 5e-324,
    float("nan"), float("inf"), float("-inf"), "", "\x00", "gpu\x00", "x" * 1000, "é\u2028",
    [], {}, [1], {"a": 1},
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from(ODD_VALUES),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3),
    max_leaves=6)
_device_names = (f"Fuzz GPU {n}" for n in itertools.count())


def _places(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every value inside ``value``."""
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, inner in items:
        yield (*at, key)
        yield from _places(inner, (*at, key))


PLACES = list(_places(VALID))


def fresh_bundle() -> Any:
    """VALID on a device the database has not seen: a stored upload inserts its device row."""
    data = copy.deepcopy(VALID)
    device = dataclasses.replace(H100, name=next(_device_names))
    data["items"][0]["device"] = BundleDevice.of(device).model_dump()
    return data


def broken(data: Any, place: tuple[Any, ...], action: str, value: Any = None) -> Any:
    """``data`` with the value at ``place`` replaced by ``value``, deleted, or given a sibling."""
    parent = data
    try:
        for key in place[:-1]:
            parent = parent[key]
        if action == "replace" or not isinstance(parent, dict):
            parent[place[-1]] = value
        elif action == "delete":
            del parent[place[-1]]
        else:
            parent[f"unknown-{place[-1]}"] = value
    except (KeyError, IndexError, TypeError):
        pass  # an earlier break removed or replaced the way there
    return data


def upload_and_check(schema: OpenApiSchema, body: Any) -> int:
    # Sent as bytes: NaN and infinities travel as JSON's common extension (Python's json reads
    # them, as the service does), which requests refuses to write.
    case = schema["/v1/results"]["POST"].Case(media_type="application/json")
    response = case.call_and_validate(headers={**AUTH, "Content-Type": "application/json"},
                                      checks=CHECKS, data=json.dumps(body).encode())
    return response.status_code


def test_every_value_of_a_bundle_broken_once(api_schema: OpenApiSchema) -> None:
    cases = [(place, "replace", value) for place in PLACES for value in ODD_VALUES]
    cases += [(place, action, 1) for place in PLACES for action in ("delete", "add")]
    statuses: dict[int, int] = {}
    failures = []
    for place, action, value in cases:
        try:
            code = upload_and_check(api_schema, broken(fresh_bundle(), place, action, value))
        except (Exception, FailureGroup) as exc:  # the app's own exceptions reach here too
            failures.append(f"{action} {'.'.join(map(str, place))} {value!r:.40}: {exc}")
        else:
            statuses[code] = statuses.get(code, 0) + 1
    assert not failures, f"{len(failures)} of {len(cases)} uploads failed:\n" + "\n".join(
        failures[:10])
    assert set(statuses) == {201, 422}, statuses


@given(data=st.data())
@hypothesis_settings(3 * MAX_EXAMPLES)
def test_bundles_broken_at_random(api_schema: OpenApiSchema, data: st.DataObject) -> None:
    body = fresh_bundle()
    for _ in range(data.draw(st.integers(1, 2))):
        body = broken(body, data.draw(st.sampled_from(PLACES)),
                      data.draw(st.sampled_from(["replace", "delete", "add"])),
                      data.draw(JSON_VALUES))
    upload_and_check(api_schema, body)


# ------------------------------------------------------------------ every operation, from its schema
CASES = [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [
    (op, GenerationMode.NEGATIVE) for op, takes_input in OPERATIONS.items() if takes_input]


@pytest.mark.parametrize(("operation", "mode"), CASES, ids=[f"{op}-{m.value}" for op, m in CASES])
def test_operation_conforms_to_its_schema(api_schema: OpenApiSchema, operation: str,
                                          mode: GenerationMode) -> None:
    method, path = operation.split(" ", 1)

    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    @hypothesis_settings(MAX_EXAMPLES)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=AUTH, checks=CHECKS)

    check()
