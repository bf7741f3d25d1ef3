"""docker-compose.yml as the deployment tests read it: one source for both of them.

The topology tests (test_topology.py) run what :func:`topology` derives from the compose
file: the api's two commands, the commands of both kinds of worker and their environments, with ``${VAR}``
interpolated as Compose does it, from variables the test chooses. So the test cannot drift
from the file. The only departures are what belongs to a container and not to a process on
this host, named here once: the address the service listens on (:data:`SERVE_OVERRIDES`) and
the GPU lock folder's path (:data:`ENV_OVERRIDES`).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"

SERVE_OVERRIDES = ("--host", "--port")
ENV_OVERRIDES = frozenset({"TUNER_GPU_LOCK_DIR"})

# $$, ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $NAME
_REFERENCE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


class ComposeError(ValueError):
    """The compose file cannot be used as the topology test needs (or Compose would refuse)."""


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    return data


def references(text: str) -> list[tuple[str, str | None, str | None]]:
    """Every variable reference in ``text``: (name, operator, argument)."""
    found = []
    for m in _REFERENCE.finditer(text):
        if m["escaped"]:
            continue
        found.append((m["name"] or m["bare"], m["op"], m["arg"]))
    return found


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """``text`` with its variable references replaced as ``docker compose`` does at start;
    a required variable (``:?``/``?``) that is missing raises ComposeError."""

    def replace(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["name"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        value = variables.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-") and unset:
            return arg
        if op in (":?", "?") and unset:
            raise ComposeError(f"required variable {name} is missing: {arg}")
        return value or ""

    # A "${" that is neither escaped ("$${") nor a reference the pattern knows (e.g. nested
    # defaults) would be passed on as text here but is an error or a value for Compose.
    braced = sum(1 for m in _REFERENCE.finditer(text) if m["name"])
    if text.count("${") - text.count("$${") != braced:
        raise ComposeError(f"a variable reference this reader cannot parse in {text!r}")
    return _REFERENCE.sub(replace, text)


def command_steps(command: Any, variables: Mapping[str, str]) -> list[list[str]]:
    """A service's command as the argument lists it runs: an exec-form list is one step; a
    ``sh -c "a && exec b"`` list is its steps in order."""
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        raise ComposeError(f"command must be a list of strings (exec form), but is {command!r}")
    if command[:2] != ["sh", "-c"]:
        return [[interpolate(a, variables) for a in command]]
    if len(command) != 3:
        raise ComposeError(f"sh -c takes one script, but got {command!r}")
    steps = []
    for part in interpolate(command[2], variables).split("&&"):
        argv = shlex.split(part)
        steps.append(argv[1:] if argv[:1] == ["exec"] else argv)
    return steps


def environment(service: Mapping[str, Any], variables: Mapping[str, str]) -> dict[str, str]:
    env = service.get("environment") or {}
    if not isinstance(env, dict):
        raise ComposeError("environment must be a mapping (NAME: value)")
    return {str(k): interpolate(str(v), variables) for k, v in env.items()}


def _set_option(argv: list[str], option: str, value: str) -> list[str]:
    if option not in argv[:-1]:
        raise ComposeError(f"{option} is not in {argv}")
    i = argv.index(option)
    return [*argv[: i + 1], value, *argv[i + 2:]]


@dataclass(frozen=True)
class Topology:
    """What the api container and each worker container run, and with which environment:
    ``worker`` the sweep's, ``demand_worker`` the one that follows demand."""

    migrate: list[str]
    serve: list[str]
    api_env: dict[str, str]
    worker: list[str]
    worker_env: dict[str, str]
    demand_worker: list[str]
    demand_worker_env: dict[str, str]


def _worker(service: Mapping[str, Any], variables: Mapping[str, str], gpu_lock_dir: str
            ) -> tuple[list[str], dict[str, str]]:
    (command,) = command_steps(service["command"], variables)
    env = environment(service, variables)
    for name in ENV_OVERRIDES:
        if name not in env:
            raise ComposeError(f"a worker's environment has no {name}")
    env["TUNER_GPU_LOCK_DIR"] = gpu_lock_dir
    return command, env


def topology(variables: Mapping[str, str], *, host: str, port: int, gpu_lock_dir: str,
             compose: Mapping[str, Any] | None = None) -> Topology:
    services = (compose or load_compose())["services"]
    api_steps = command_steps(services["api"]["command"], variables)
    if len(api_steps) != 2:
        raise ComposeError(f"the api must migrate, then serve; its steps are {api_steps}")
    migrate, serve = api_steps
    for option, value in zip(SERVE_OVERRIDES, (host, str(port)), strict=True):
        serve = _set_option(serve, option, value)
    worker, worker_env = _worker(services["worker"], variables, gpu_lock_dir)
    demand_worker, demand_worker_env = _worker(services["demand-worker"], variables,
                                               gpu_lock_dir)
    return Topology(migrate=migrate, serve=serve, api_env=environment(services["api"], variables),
                    worker=worker, worker_env=worker_env, demand_worker=demand_worker,
                    demand_worker_env=demand_worker_env)


def local(argv: list[str]) -> list[str]:
    """A container's ``tuner ...`` as a process of this test run (the same CLI, this venv)."""
    if argv[:1] != ["tuner"]:
        raise ComposeError(f"expected a tuner command, but got {argv}")
    return [sys.executable, "-m", "tuner.cli.app", *argv[1:]]
