"""uvicorn's HTTP protocols with ``TCP_NODELAY`` on every connection, for ``tuner serve``.

asyncio turns Nagle's algorithm off on a connection only when its socket says it is TCP
(``sock.proto == IPPROTO_TCP``). With ``--workers N`` uvicorn binds the listening socket
itself, with protocol 0, so the connections its workers accept kept Nagle on: a response
written in two pieces (headers, then body) then waited for the client's delayed ACK, about
40 ms, on every request of a keep-alive connection (1.7 ms per request with one worker,
44 ms with two, on the dev VM, 2026-11-24). Setting the option on the connection itself
does not depend on how the socket was made.

``serving_protocol()`` is the one ``tuner serve`` runs: httptools' parser (C) where it is
installed, else h11's (pure Python). h11 took ~230 us of the service's CPU per best-config
read, httptools ~115 us (2-core VM, one worker, reads answered from kept answers, 2026-11-29).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # an optional dependency: without it, h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None  # type: ignore[assignment, misc]

__all__ = ["NoDelayH11Protocol", "NoDelayHttpToolsProtocol", "serving_protocol", "set_nodelay"]


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a Unix socket, or a transport without one: no Nagle to turn off
    with contextlib.suppress(OSError):  # the peer has gone already: uvicorn notices that
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class NoDelayH11Protocol(H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        set_nodelay(transport)
        super().connection_made(transport)


if HttpToolsProtocol is not None:
    class NoDelayHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            set_nodelay(transport)
            super().connection_made(transport)
else:
    NoDelayHttpToolsProtocol = None  # type: ignore[assignment, misc]


def serving_protocol() -> type[asyncio.Protocol]:
    """httptools' protocol with Nagle off where httptools is installed, else h11's."""
    return NoDelayH11Protocol if NoDelayHttpToolsProtocol is None else NoDelayHttpToolsProtocol
