"""``tuner serve``: workers, and what it refuses before starting any (issue 19)."""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.server_protocol import NoDelayH11Protocol, serving_protocol
from tests.api.serving_data import TOKEN
from tuner.cli.app import main
from tuner.settings import get_settings


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    monkeypatch.setenv("TUNER_TOKEN", TOKEN)
    get_settings.cache_clear()  # read from this test's environment
    yield calls
    get_settings.cache_clear()


def test_serve_starts_n_workers_from_the_app_factory(
        started: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'served.db'}"
    with pytest.raises(SystemExit) as exited:  # typer's exit once the command returns
        main(["serve", "--workers", "3", "--port", "8123", "--db", url])
    assert exited.value.code == 0
    [(args, kwargs)] = started
    # By import string: each worker process builds its own app from the environment.
    assert args == ("api.main:create_app",)
    assert kwargs["factory"] is True and kwargs["workers"] == 3 and kwargs["port"] == 8123
    assert kwargs["access_log"] is False  # TUNER_LOG_LEVEL WARNING: no line per request
    assert kwargs["http"] is serving_protocol()  # (test_connections_have_nagle_off)
    assert os.environ["TUNER_DATABASE_URL"] == url
    assert (tmp_path / "served.db").exists()  # migrated once, before the workers start


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["serve", "--workers", "0"], {}, "--workers must be >= 1, but got 0"),
    (["serve"], {"TUNER_TOKEN": "changeme"}, "refusing to serve: TUNER_TOKEN must be at least"),
    (["serve"], {"TUNER_TOKEN": "${TUNER_TOKEN}"}, "cannot carry"),
    (["serve", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/x"], {},
     "cannot open the database postgresql+psycopg://nobody@127.0.0.1:1/x"),
])
def test_serve_refuses_before_starting(
        started: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], env: dict[str, str], needle: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert needle in err and "fix:" in err
    assert started == []


@pytest.mark.parametrize("loop", ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"))])
@pytest.mark.parametrize("protocol", [NoDelayH11Protocol, serving_protocol(), H11Protocol])
def test_connections_have_nagle_off(protocol: type[H11Protocol], loop: str) -> None:
    """As uvicorn's workers get it: a listening socket made with protocol 0, whose accepted
    connections asyncio leaves with Nagle on (40 ms per keep-alive request, notes/serving_performance.md).
    The protocol ``tuner serve`` runs is httptools' where it is installed (uvloop's loop too,
    where that is), else h11's (then the first two cases are one). uvloop's loop turns Nagle
    off on every connection itself."""
    seen: list[int] = []

    class Recording(protocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0, as uvicorn's
    listening.bind(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(hello, http=Recording, log_level="error",
                                           lifespan="off", loop=loop))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(1024).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listening.close()
    assert seen == [0 if protocol is H11Protocol and loop == "asyncio" else 1]
