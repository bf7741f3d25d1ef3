"""docker-compose.yml, the Dockerfile and .dockerignore, read without a Docker engine.

The topology test runs what tests/deploy/compose.py derives from docker-compose.yml; these
tests pin what that derivation must find (the commands and settings the topology test uses,
real commands of the CLI) and the parts of the file no process here can run: health checks,
start order, volumes, the GPU reservation, secrets without defaults.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer

from tests.deploy.compose import (
    COMPOSE_FILE,
    ENV_OVERRIDES,
    ROOT,
    ComposeError,
    command_steps,
    environment,
    interpolate,
    load_compose,
    references,
    topology,
)
from tuner.cli.app import app as tuner_app

# The variables an operator sets; the topology test sets the same names (its _variables).
VARIABLES = {"POSTGRES_HOST": "db", "POSTGRES_PORT": "5433", "POSTGRES_USER": "u",
             "POSTGRES_DB": "d", "POSTGRES_PASSWORD": "pw", "TUNER_TOKEN": "t" * 32,
             "TUNER_TEMPLATE_MODULES": '["my.templates"]', "SWEEP_SPEC": "/sweeps/s.toml",
             "SWEEP_HEARTBEAT": "7", "WORKER_POLL": "5", "WORKER_TRIALS": "12"}
# What each container is configured with, by name: a setting added to the compose file
# must be added here, and so thought about for the topology test too.
API_ENV = {"TUNER_DATABASE_URL", "PGPASSWORD", "TUNER_TOKEN", "TUNER_TEMPLATE_MODULES",
           "TUNER_LOG_LEVEL"}
WORKER_ENV = {"TUNER_DATABASE_URL", "PGPASSWORD", "TUNER_GPU_LOCK_DIR", "TUNER_LOG_LEVEL"}
DEMAND_WORKER_ENV = WORKER_ENV | {"TUNER_TEMPLATE_MODULES"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def _cli_accepts(argv: list[str]) -> None:
    """Parse ``argv`` (``tuner ...``) with the real CLI, types included, without running it."""
    command: Any = typer.main.get_command(tuner_app)
    args = argv[1:]
    while hasattr(command, "commands"):  # a group: descend (typer vendors its own click)
        assert args and args[0] in command.commands, f"no command {args[:1]} in {argv}"
        command, args = command.commands[args[0]], args[1:]
    command.make_context(argv[-1], list(args))


def test_the_topology_test_runs_the_compose_commands_and_settings(
        compose: dict[str, Any]) -> None:
    topo = topology(VARIABLES, host="127.0.0.1", port=18000, gpu_lock_dir="/tmp/locks",
                    compose=compose)
    assert topo.migrate == ["tuner", "db", "upgrade"]
    assert topo.serve == ["tuner", "serve", "--host", "127.0.0.1", "--port", "18000"]
    assert topo.worker == ["tuner", "sweep", "/sweeps/s.toml", "--heartbeat", "7", "--json"]
    assert topo.demand_worker == ["tuner", "worker", "--trials", "12", "--heartbeat", "7",
                                  "--poll", "5", "--json"]
    for argv in (topo.migrate, topo.serve, topo.worker, topo.demand_worker):
        _cli_accepts(argv)
    assert set(topo.api_env) == API_ENV
    assert set(topo.worker_env) == WORKER_ENV
    assert set(topo.demand_worker_env) == DEMAND_WORKER_ENV
    assert ENV_OVERRIDES <= WORKER_ENV
    # The database URL is built from the variables, its password is not in it (libpq's
    # PGPASSWORD), and every container uses the same one.
    url = "postgresql+psycopg://u@db:5433/d"
    assert topo.api_env["TUNER_DATABASE_URL"] == topo.worker_env["TUNER_DATABASE_URL"] == url
    assert topo.demand_worker_env["TUNER_DATABASE_URL"] == url
    assert topo.api_env["PGPASSWORD"] == topo.worker_env["PGPASSWORD"] == "pw"
    assert topo.demand_worker_env["PGPASSWORD"] == "pw"
    # The templates the service answers for are the ones the demand workers can tune.
    assert topo.api_env["TUNER_TEMPLATE_MODULES"] == '["my.templates"]'
    assert topo.demand_worker_env["TUNER_TEMPLATE_MODULES"] == '["my.templates"]'
    # In the containers themselves (what the test replaces): the address the service
    # listens on, and the lock folder, a volume.
    services = compose["services"]
    assert "exec tuner serve --host 0.0.0.0 --port 8000" in services["api"]["command"][2]
    assert services["worker"]["environment"]["TUNER_GPU_LOCK_DIR"] == "/var/tuner/gpu-locks"


def test_postgres_keeps_its_data_in_a_named_volume_and_has_a_health_check(
        compose: dict[str, Any]) -> None:
    postgres = compose["services"]["postgres"]
    assert postgres["image"].startswith("postgres:")
    assert "pgdata:/var/lib/postgresql/data" in postgres["volumes"]
    assert "pgdata" in compose["volumes"]
    test = " ".join(postgres["healthcheck"]["test"])
    assert "pg_isready" in test
    # The service's own user and database are the ones the tuner's URL names.
    env = {k: interpolate(str(v), VARIABLES) for k, v in postgres["environment"].items()}
    assert (env["POSTGRES_USER"], env["POSTGRES_DB"], env["POSTGRES_PASSWORD"]) == (
        "u", "d", "pw")


def test_start_order_waits_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["api"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"] == {"api": {"condition": "service_healthy"}}
    assert services["demand-worker"]["depends_on"] == {"api": {"condition": "service_healthy"}}
    check = " ".join(services["api"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/healthz" in check  # the port `tuner serve` listens on
    assert any(str(p).endswith(":8000") for p in services["api"]["ports"])


def test_workers_reserve_gpus_and_claim_one_each(compose: dict[str, Any]) -> None:
    worker, api = compose["services"]["worker"], compose["services"]["api"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    # Every GPU in sight (Docker hands out count: N from index 0 in every replica); each
    # replica then claims its own through the shared lock folder (tuner/tuning/gpus.py).
    assert device["count"] == "all"
    locks = worker["environment"]["TUNER_GPU_LOCK_DIR"]
    assert f"gpu-locks:{locks}" in worker["volumes"] and "gpu-locks" in compose["volumes"]
    assert "deploy" not in api  # the service needs no GPU
    # No fixed name or published port: `--scale worker=N` must be able to start N of them.
    assert "container_name" not in worker and "ports" not in worker


def test_demand_workers_are_workers_that_start_only_when_named(compose: dict[str, Any]) -> None:
    services = compose["services"]
    worker, demand = services["worker"], services["demand-worker"]
    # Everything a GPU worker needs, as the sweep worker has it (one anchor).
    for key in ("image", "build", "deploy", "volumes", "init", "stop_signal",
                "stop_grace_period"):
        assert demand[key] == worker[key], key
    assert {k: v for k, v in demand["environment"].items()
            if k != "TUNER_TEMPLATE_MODULES"} == worker["environment"]
    assert demand["stop_signal"] == "SIGINT"  # Ctrl-C: the claim is given back at once
    assert "container_name" not in demand and "ports" not in demand
    # A plain `docker compose up` starts what it did before this service existed; the
    # workers never finish on their own, so they come back unless stopped by hand.
    assert demand["profiles"] == ["demand"] and "profiles" not in worker
    assert demand["restart"] == "unless-stopped"


def test_secrets_come_from_the_environment_without_working_defaults() -> None:
    text = COMPOSE_FILE.read_text()
    refs = references(text)
    password = [(op, arg) for name, op, arg in refs if name == "POSTGRES_PASSWORD"]
    assert password and all(op == ":?" for op, _ in password)  # required, no default
    token = [(op, arg) for name, op, arg in refs if name == "TUNER_TOKEN"]
    assert token and all(not arg for _, arg in token)  # unset or empty: writes refused
    with pytest.raises(ComposeError, match="POSTGRES_PASSWORD"):
        topology({k: v for k, v in VARIABLES.items() if k != "POSTGRES_PASSWORD"},
                 host="h", port=1, gpu_lock_dir="x")
    # No literal secret anywhere: every password/token/secret value is a reference.
    for service in load_compose()["services"].values():
        for name, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD|TOKEN|SECRET", name):
                assert str(value).startswith("${"), (name, value)


def test_interpolation_follows_compose() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $SET $$X", env) == "v d  d v $X"
    with pytest.raises(ComposeError, match="EMPTY"):
        interpolate("${EMPTY:?needed}", env)
    assert interpolate("${EMPTY?needed}", env) == ""
    assert interpolate('pg_isready -U "$${USER}"', env) == 'pg_isready -U "${USER}"'
    with pytest.raises(ComposeError, match="cannot parse"):
        interpolate("${A:-${B}}", env)


def test_the_image_is_cuda_with_torch_and_triton_and_carries_no_secrets() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)", dockerfile, re.M)
    assert base and base.group(1).startswith("nvidia/cuda:")
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", dockerfile, re.M)
    assert 'pip install "torch==' in dockerfile and "import torch, triton" in dockerfile
    assert 'pip install ".[postgres]"' in dockerfile
    assert not re.search(r"^(ENV|ARG)\b.*(TOKEN|PASSWORD)", dockerfile, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".env", ".venv", ".git", "*.db"} <= set(ignored)


def test_the_example_sweep_mounted_into_the_workers_is_valid(compose: dict[str, Any]) -> None:
    from tuner.tuning.suites import resolve_spec

    assert "./deploy/sweeps:/sweeps:ro" in compose["services"]["worker"]["volumes"]
    spec, _ = resolve_spec(str(ROOT / "deploy/sweeps/example.toml"), interpreter=False)
    assert spec.templates and spec.problems


def test_service_workers_follow_demand_through_the_service_without_the_database(
        compose: dict[str, Any]) -> None:
    """The recipe for GPU hosts that reach only the service: ``tuner worker --service``,
    the token and no database setting, its own SQLite file in a volume."""
    services = compose["services"]
    worker, remote = services["worker"], services["service-worker"]
    for key in ("image", "build", "deploy", "init", "stop_signal", "stop_grace_period"):
        assert remote[key] == worker[key], key
    (argv,) = command_steps(remote["command"], {**VARIABLES,
                                                "TUNER_SERVICE_URL": "http://10.0.0.5:8000"})
    assert argv[:4] == ["tuner", "worker", "--service", "http://10.0.0.5:8000"]
    _cli_accepts(argv)
    (default,) = command_steps(remote["command"], VARIABLES)
    assert default[3] == "http://api:8000"  # the api of the same compose project
    env = environment(remote, VARIABLES)
    assert env["TUNER_TOKEN"] == VARIABLES["TUNER_TOKEN"]
    assert not {"TUNER_DATABASE_URL", "PGPASSWORD"} & set(env)  # nothing of the database
    assert env["TUNER_GPU_LOCK_DIR"] == worker["environment"]["TUNER_GPU_LOCK_DIR"]
    assert env["TUNER_TEMPLATE_MODULES"] == '["my.templates"]'
    db = argv[argv.index("--db") + 1]
    assert db.startswith("sqlite:////var/tuner/worker/")
    assert "worker-db:/var/tuner/worker" in remote["volumes"] and "worker-db" in compose["volumes"]
    assert remote["profiles"] == ["service"] and remote["restart"] == "unless-stopped"
    assert "container_name" not in remote and "ports" not in remote
