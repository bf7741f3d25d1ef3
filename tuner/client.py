"""Typed HTTP client of the config service.

    from tuner.client import TunerClient

    with TunerClient("http://tuner.internal:8000") as client:
        answer = client.best("flash_fwd", problem)          # BestOut: config, match, TFLOP/s
        ranked = client.best("torch_sdpa", problem, compare=True).implementations  # who runs it
        page = client.configs(template="flash_fwd", limit=50)
        queue = client.demand(status="open")                # what jobs ran untuned
        job = client.claim_demand(device=key, templates=versions, worker="gpu-7:12",
                                  lease_s=300, max_attempts=3)  # a worker's (write token)

Transient failures (connection errors, timeouts, 429/502/503/504) are retried ``retries`` times
with exponential backoff and jitter; other 4xx/5xx answers raise ``ServiceError`` at once with
the service's explanation.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from templates.base import Problem
from templates.device import DeviceInfo, current_device
from tuner.errors import ServiceError, TunerError
from tuner.settings import get_settings
from tuner.wire import (
    BestOut,
    ConfigPage,
    ConfigRow,
    DemandAccepted,
    DemandClaimOut,
    DemandPage,
    DemandRow,
    DeviceOut,
    HealthOut,
    SnapshotCreated,
    SnapshotList,
    SnapshotOut,
    SnapshotSummary,
    TemplateOut,
    UploadResult,
    WinnersOut,
)

# TunerError too: `except TunerError` written against this module before ServiceError still
# catches the service's errors (each ServiceError is one).
__all__ = ["ServiceError", "TunerClient", "TunerError"]

M = TypeVar("M")
_RETRY_STATUS = frozenset({429, 502, 503, 504})


class TunerClient:
    """Client of one service. ``url``/``token`` default to ``TUNER_URL``/``TUNER_TOKEN``; the
    token is sent with uploads only."""

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 timeout: float = 10.0, retries: int = 3, backoff_s: float = 0.2,
                 transport: httpx.BaseTransport | None = None) -> None:
        if url is None or token is None:
            settings = get_settings()
            url = url if url is not None else settings.url
            token = token if token is not None else settings.token
        if not url:
            raise ValueError("TunerClient needs the service URL (argument or TUNER_URL), "
                             "e.g. http://localhost:8000")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"service URL must start with http:// or https://, but got {url!r}")
        if retries < 0 or timeout <= 0:
            raise ValueError(f"retries must be >= 0 and timeout > 0, "
                             f"but got retries={retries}, timeout={timeout}")
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        # Sent with writes only: a read needs no token, and the write token must not travel
        # with every lookup (to a service, a proxy or a log that has no use for it; issue 19).
        token = token.strip() if token else None
        self._write_headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout),
                                  transport=transport)

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TunerClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- endpoints ------------------------------------------------------------------------
    def health(self) -> HealthOut:
        return self._get("/healthz", HealthOut, ok_status=(200, 503))

    def devices(self) -> list[DeviceOut]:
        return self._get("/v1/devices", list[DeviceOut])

    def templates(self) -> list[TemplateOut]:
        return self._get("/v1/templates", list[TemplateOut])

    def best(self, template: str, problem: Problem | Mapping[str, Any], *,
             device: str | DeviceInfo | None = None,
             template_version: str | None = None, compare: bool = False) -> BestOut:
        """The service's config for ``problem`` on ``device`` (default: this machine's GPU);
        with ``compare``, ``implementations`` compares every implementation of the problem
        (a service older than that field refuses the parameter: ``ServiceError``, 422)."""
        params = {"template": template, "device": _device_key(device), **_problem_params(problem)}
        if template_version:
            params["template_version"] = template_version
        if compare:
            params["compare"] = "true"
        return self._get("/v1/best", BestOut, params=params)

    def winners(self, *, device: str | DeviceInfo | None = None,
                dtype: str | None = None) -> WinnersOut:
        """Per stored problem of ``device`` (default: this machine's GPU), the implementation
        ``tuner.attention`` runs, the runner-up and margin, each implementation's best."""
        params = {"device": _device_key(device), **({"dtype": dtype} if dtype else {})}
        return self._get("/v1/winners", WinnersOut, params=params)

    def configs(self, *, device: str | None = None, template: str | None = None,
                dtype: str | None = None, variant: str | None = None, offset: int = 0,
                limit: int = 100) -> ConfigPage:
        params = {k: v for k, v in {"device": device, "template": template, "dtype": dtype,
                                    "variant": variant}.items() if v is not None}
        return self._get("/v1/configs", ConfigPage,
                         params={**params, "offset": offset, "limit": limit})

    def iter_configs(self, *, page_size: int = 500, **filters: str | None) -> Iterator[ConfigRow]:
        """Every stored best config matching ``filters``, page by page."""
        offset = 0
        while True:
            page = self.configs(**filters, offset=offset, limit=page_size)  # type: ignore[arg-type]
            yield from page.items
            offset += len(page.items)
            if not page.items or offset >= page.total:
                return

    def report_demand(self, items: Sequence[Mapping[str, Any]]) -> DemandAccepted:
        """Report problems run without a tuned config (no token): each item names template,
        template_version, device (key), problem and count. ``tuner.demand.reporter`` does this in
        the background for ``tuner.attention``; the answer says which items were refused."""
        response = self._request("POST", "/v1/demand", json={"items": list(items)},
                                 ok_status=(202,))
        return _parse(response, DemandAccepted)

    def demand(self, *, device: str | None = None, template: str | None = None,
               status: str | None = None, offset: int = 0, limit: int = 100) -> DemandPage:
        """The demand queue, most reported first (status: open, claimed, expired, done,
        failed)."""
        params = {k: v for k, v in {"device": device, "template": template,
                                    "status": status}.items() if v is not None}
        return self._get("/v1/demand", DemandPage,
                         params={**params, "offset": offset, "limit": limit})

    # -- a worker's claims (tuner worker --service): each needs the write token --------------
    def claim_demand(self, *, device: str, templates: Mapping[str, str], worker: str,
                     lease_s: float, max_attempts: int) -> DemandRow | None:
        """Claim the most reported problem of ``device`` whose template runs at a version
        ``templates`` names (None: none waits). Asked again while ``worker`` holds a claim,
        the service answers that claim (so a retried request takes no second problem)."""
        body = {"device": device, "templates": dict(templates), "worker": worker,
                "lease_s": lease_s, "max_attempts": max_attempts}
        response = self._request("POST", "/v1/demand/claim", json=body,
                                 headers=self._write_headers, ok_status=(200,))
        return _parse(response, DemandClaimOut).claim

    def renew_demand_claim(self, demand_id: int, *, worker: str, lease_s: float) -> DemandRow:
        """Extend ``worker``'s claim to ``lease_s`` from now (409 ``ServiceError``: no longer
        its claim)."""
        return self._claim_call(demand_id, "lease", {"worker": worker, "lease_s": lease_s})

    def finish_demand(self, demand_id: int, *, worker: str, status: str, note: str
                      ) -> DemandRow:
        """Mark ``worker``'s claim ``done`` or ``failed`` (409: no longer its claim)."""
        return self._claim_call(demand_id, "finish",
                                {"worker": worker, "status": status, "note": note})

    def release_demand(self, demand_id: int, *, worker: str, note: str) -> DemandRow:
        """Give ``worker``'s claim back, open (409: no longer its claim)."""
        return self._claim_call(demand_id, "release", {"worker": worker, "note": note})

    def _claim_call(self, demand_id: int, action: str, body: dict[str, Any]) -> DemandRow:
        response = self._request("POST", f"/v1/demand/{demand_id}/{action}", json=body,
                                 headers=self._write_headers, ok_status=(200,))
        return _parse(response, DemandRow)

    def upload(self, bundle: Mapping[str, Any]) -> UploadResult:
        """Store a bundle (``tuner.lookup.bundle``'s format); needs the write token."""
        response = self._request("POST", "/v1/results", json=dict(bundle),
                                 headers=self._write_headers)
        return _parse(response, UploadResult)

    def create_snapshot(self, *, device: str | None = None, template: str | None = None,
                        dtype: str | None = None, variant: str | None = None
                        ) -> SnapshotCreated:
        """Freeze the service's best configs matching the filters (none: all) into a snapshot;
        needs the write token. The same content frozen again gives the same id."""
        params = {k: v for k, v in {"device": device, "template": template, "dtype": dtype,
                                    "variant": variant}.items() if v is not None}
        response = self._request("POST", "/v1/snapshots", params=params,
                                 headers=self._write_headers)
        return _parse(response, SnapshotCreated)

    def snapshot(self, snapshot_id: str) -> SnapshotOut:
        """A snapshot, whole: its bundle (``ServiceError`` with status 404 if unknown)."""
        return self._get(f"/v1/snapshots/{snapshot_id}", SnapshotOut)

    def delete_snapshot(self, snapshot_id: str) -> SnapshotSummary:
        """Delete a snapshot no job pins any more; needs the write token. Answers what was
        deleted (``ServiceError`` with status 404 if unknown)."""
        response = self._request("DELETE", f"/v1/snapshots/{snapshot_id}",
                                 headers=self._write_headers, ok_status=(200,))
        return _parse(response, SnapshotSummary)

    def snapshots(self, *, offset: int = 0, limit: int = 100) -> SnapshotList:
        """Stored snapshots (ids, sizes, dates), newest first."""
        return self._get("/v1/snapshots", SnapshotList,
                         params={"offset": offset, "limit": limit})

    def kernel_source(self, template: str, problem: Problem | Mapping[str, Any], *,
                      device: str | DeviceInfo | None = None) -> str:
        """A standalone Python module of ``template`` with the served config baked in."""
        params = {"device": _device_key(device), **_problem_params(problem)}
        return self._request("GET", f"/v1/kernels/{template}/source", params=params).text

    # -- transport ------------------------------------------------------------------------
    def _get(self, path: str, model: Any, *, params: Mapping[str, Any] | None = None,
             ok_status: tuple[int, ...] = (200,)) -> Any:
        return _parse(self._request("GET", path, params=params, ok_status=ok_status), model)

    def _request(self, method: str, path: str, *, ok_status: tuple[int, ...] = (200, 201),
                 **kwargs: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:  # connect, read, write, pool, protocol errors
                if last:
                    raise ServiceError(f"{method} {self.url}{path} failed after "
                                     f"{attempt + 1} attempt(s): {type(exc).__name__}: {exc}"
                                     ) from exc
            else:
                if response.status_code in ok_status:
                    return response
                if last or response.status_code not in _RETRY_STATUS:
                    raise _error_of(method, self.url + path, response)
            # Exponential backoff with jitter: clients that failed together do not retry together.
            time.sleep(self.backoff_s * 2**attempt * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable: the loop returns or raises")


def _device_key(device: str | DeviceInfo | None) -> str:
    if device is None:
        return current_device().key
    return device.key if isinstance(device, DeviceInfo) else device


def _problem_params(problem: Problem | Mapping[str, Any]) -> dict[str, Any]:
    data = problem.to_dict() if isinstance(problem, Problem) else dict(problem)
    return {k: v for k, v in data.items() if v is not None}


def _error_of(method: str, url: str, response: httpx.Response) -> ServiceError:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = response.text[:500]
    return ServiceError(f"{method} {url} answered {response.status_code}: {detail}",
                      status=response.status_code, detail=detail)


_adapters: dict[Any, TypeAdapter[Any]] = {}


def _parse(response: httpx.Response, model: Any) -> Any:
    try:
        if isinstance(model, type) and issubclass(model, BaseModel):
            return model.model_validate_json(response.content)
        adapter = _adapters.get(model)
        if adapter is None:
            adapter = _adapters[model] = TypeAdapter(model)
        return adapter.validate_json(response.content)
    except ValidationError as exc:
        raise ServiceError(f"{response.request.method} {response.request.url} answered with a "
                         f"body that is not a valid {model}: {exc.errors()[0]['msg']}",
                         status=response.status_code) from None
