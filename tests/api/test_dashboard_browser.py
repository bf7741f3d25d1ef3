"""The dashboard rendered by headless Chromium, checked by its screenshot."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from api.main import create_app
from db.session import dispose_engine
from tests.api.serving_data import TOKEN, bundle, item, live_server, problem
from tuner.client import TunerClient
from tuner.settings import load_settings

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium"
                                        if Path("/usr/bin/chromium").exists() else None)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium package (/usr/bin/chromium) for the "
                             "headless screenshot; not installed on this machine")


def png_size_and_colors(data: bytes) -> tuple[int, int, int]:
    """Width, height and number of distinct row checksums of an 8-bit RGB(A) PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6), f"unexpected PNG format {depth=} {color=}"
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels + 1
    rows = {zlib.crc32(raw[i * stride + 1:(i + 1) * stride]) for i in range(height)}
    return width, height, len(rows)


def test_dashboard_screenshot_is_not_blank(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'dash.db'}"
    with live_server(create_app(load_settings(database_url=url, token=TOKEN))) as base:
        with TunerClient(base, token=TOKEN) as client:
            client.upload(bundle(*(item(problem(n)) for n in (512, 1024, 2048, 4096))))
        shot = tmp_path / "dashboard.png"
        assert CHROMIUM is not None
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        f"--screenshot={shot}", "--window-size=1280,1600",
                        f"{base}/dashboard"], check=True, timeout=60, capture_output=True)
    dispose_engine(url)
    width, height, distinct_rows = png_size_and_colors(shot.read_bytes())
    assert (width, height) == (1280, 1600)
    assert distinct_rows > 100, "the page rendered (nearly) blank"
