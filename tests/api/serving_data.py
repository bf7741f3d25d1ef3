"""Bundles and servers shared by the service, client and lookup tests."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from templates.base import Problem
from templates.device import DeviceInfo, current_device
from templates.registry import get_template
from tuner.lookup.bundle import BUNDLE_FORMAT, BundleDevice

TOKEN = "test-token-7f3a9c1e5b"  # >= 12 characters and no placeholder: accepted for writes

H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                  total_memory=85_520_809_984, smem_per_block=232_448, driver_version="570.86",
                  triton_version="3.6.0", torch_version="2.11.0", cuda_version="12.8")

FWD = get_template("flash_fwd")


def problem(seqlen: int = 1024, *, batch: int = 4, heads: int = 16, heads_kv: int | None = None,
            head_dim: int = 128, dtype: str = "bfloat16", causal: str = "none") -> Problem:
    return Problem(batch=batch, heads_q=heads, heads_kv=heads_kv or heads, seqlen_q=seqlen,
                   seqlen_kv=seqlen, head_dim=head_dim, dtype=dtype, causal=causal)


def tuned_config(p: Problem, device: DeviceInfo) -> dict[str, Any]:
    """A valid config for ``p`` on ``device`` that differs from the default."""
    default = FWD.default_config(p, device)
    # One knob away from the default: as fast under the interpreter, and still a different key.
    for knob in ("num_stages", "pipeline_masked_loop", "num_warps", "BLOCK_N"):
        for value in FWD.config_cls.__dataclass_fields__[knob].metadata["choices"]:
            cfg = dataclasses.replace(default, **{knob: value})
            if cfg != default and FWD.constraint(p, cfg, device) is None:
                return cfg.to_dict()
    raise AssertionError(f"no second valid config for {p.key()}")


def item(p: Problem, *, device: DeviceInfo = H100, tflops: float = 400.0,
         default_tflops: float | None = 300.0, config: dict[str, Any] | None = None,
         sweep: str | None = "test-sweep", **overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "device": BundleDevice.of(device).model_dump(),
        "template": FWD.name, "template_version": FWD.version(),
        "problem": p.to_dict(), "config": config or tuned_config(p, device),
        "tflops": tflops, "median_ms": FWD.flops(p) / (tflops * 1e9),
    }
    if default_tflops is not None:
        out["default_tflops"] = default_tflops
    if sweep is not None:
        out["sweep"] = sweep
    out.update(overrides)
    return out


def bundle(*items: dict[str, Any], host: str | None = "gpu-test") -> dict[str, Any]:
    out: dict[str, Any] = {"format": BUNDLE_FORMAT, "version": 1, "items": list(items)}
    if host:
        out["host"] = host
    return out


def store(database_url: str, *items: dict[str, Any]) -> None:
    """A write by another process (a sweep): ``items`` straight into the database."""
    from db.session import session_scope
    from tuner.lookup.bundle import store_bundle, validate_bundle

    with session_scope(database_url) as s:
        store_bundle(s, validate_bundle(bundle(*items)))


def faster(p: Problem, base: dict[str, Any], device: DeviceInfo = H100) -> dict[str, Any]:
    """An item for ``p`` whose config differs from ``base``'s and beats it."""
    config = {**base["config"],
              "pipeline_masked_loop": not base["config"]["pipeline_masked_loop"]}
    return item(p, device=device, tflops=999.0, default_tflops=None, config=config)


def interpreter() -> DeviceInfo:
    return current_device()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def live_server(app: Any, *, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Run ``app`` under uvicorn on a free loopback port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on port {port} in {start_timeout_s} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class ScriptedServer:
    """A real HTTP server on loopback answering GETs from a script of (status, JSON, delay)."""

    def __init__(self, script: list[tuple[int, Any, float]], repeat_last: bool = True) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests.append(self.path)
                index = min(len(owner.requests), len(script)) - 1
                if not repeat_last and len(owner.requests) > len(script):
                    index = -1
                status, body, delay = script[index]
                time.sleep(delay)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting: that is what slow-server tests expect

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
