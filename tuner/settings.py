"""Process-wide configuration, read from the environment (prefix ``TUNER_``) or a ``.env`` file.

    TUNER_DATABASE_URL   SQLAlchemy URL of the project database
                         (default: sqlite:///tuner.db in the working directory)
    TUNER_URL            base URL of a config service the client may ask (default: none)
    TUNER_TOKEN          bearer token the service requires for writes / the client sends
    TUNER_LOG_LEVEL      DEBUG, INFO, WARNING, ERROR (default WARNING)
    TUNER_LOOKUP_TIMEOUT seconds the client waits for the service before using the default
    TUNER_TEMPLATE_MODULES JSON list of modules the service imports at start (templates from
                         outside the ``templates`` package, as a sweep spec's template_modules)
    TUNER_GPU_LOCK_DIR   folder where the sweep processes of one host claim their GPUs
                         (see tuner/tuning/gpus.py); unset: a sweep uses every GPU it sees
    TUNER_SNAPSHOT       a snapshot id (64 hex digits, `tuner snapshot create`) or the path of
                         a bundle file: the job answers every lookup from it alone, loaded once
                         (tuner/lookup/pinned.py); unset: lookups ask the database and the service
    TUNER_REFRESH        on: a running process picks up newer answers for problems it already
                         ran (default off: a config a kernel ran with is kept for the
                         process's life, docs/SERVING.md)
    TUNER_DEMAND         on (default) / off: report the problems run without a tuned config
                         to TUNER_URL, for `tuner worker` to tune (tuner/demand/reporter.py)
    TUNER_DEMAND_INTERVAL seconds between a process's demand reports (default 10)
    TUNER_DEMAND_RATE_LIMIT the service's POST /v1/demand requests per second per client
                         address (default 20; bursts of twice that)
    TUNER_REFUSED_WRITE_RATE the service's refusals of writes without a valid token answered
                         at once per second per client address (default 5; bursts of twice
                         that); past it they line up, each held at most 1 s
    TUNER_NEIGHBOUR_MARGIN how much faster than torch SDPA an implementation must have been
                         measured on a neighbouring problem to run a problem whose own bucket
                         has no SDPA measurement (default 0.03: 3%; docs/DISPATCH.md)
    TUNER_DEMAND_MAX_PENDING the service's cap on problems waiting in the demand queue (open);
                         reports of new problems beyond it are refused (default 10,000)
    TUNER_SHIPPED        on (default): lookups consult the measurements shipped in the package
                         (tuner/lookup/shipped/) after the database and the service; off: never (the
                         untuned state, your own measurements only); or the path of a folder of
                         such tables (<model>.json, e.g. from `tuner ship --out`) to use instead
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from tuner.errors import TunerError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_DATABASE_URL = "sqlite:///tuner.db"
# Problems waiting in the demand queue (a worker takes minutes per problem: more than a fleet
# tunes in a day), a few MB of table.
DEFAULT_DEMAND_MAX_PENDING = 10_000
# TUNER_SHIPPED: the package's shipped tables, none, or (any other value) a folder of tables.
# The words pydantic reads as booleans for the other on/off settings mean the same here.
SHIPPED_ON, SHIPPED_OFF = "on", "off"
SHIPPED_ON_WORDS = ("", "on", "true", "t", "1", "yes", "y")
SHIPPED_OFF_WORDS = ("off", "false", "f", "0", "no", "n")

# The write token's policy, one rule for the service's start and its every write
# (``write_token_problem``): a token that looks set but protects nothing is refused.
MIN_TOKEN_LENGTH = 16  # `openssl rand -hex 8`, 64 random bits
# A random token of 16 hex digits has ~10 distinct characters, fewer than 5 with probability
# 4e-7; "aaaa..." or "abab..." have 1 or 2.
MIN_TOKEN_DISTINCT = 5
# RFC 6750's b64token: what an Authorization: Bearer header can carry. It also refuses the
# unexpanded templates people paste ("${TUNER_TOKEN}", "<your-token-here>") and inner spaces.
_BEARER_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
# Words of example and template values; a token containing one was typed, not generated.
PLACEHOLDER_WORDS = ("changeme", "change-me", "change_me", "replaceme", "replace-me",
                     "placeholder", "example", "yourtoken", "your-token", "your_token",
                     "tokenhere", "token-here", "password", "secret", "insert")


def write_token_problem(token: str | None) -> str | None:
    """Why ``token`` cannot be the service's write token (None: it can)."""
    if not token:
        return "TUNER_TOKEN is not set"
    if not _BEARER_TOKEN.match(token):
        bad = sorted({c for c in token if not _BEARER_TOKEN.match(c + "a")} - {"="})
        return (f"TUNER_TOKEN has characters a bearer token cannot carry ({bad or ['=']}; "
                "allowed: letters, digits and - . _ ~ + /, = only at the end): an unexpanded "
                "template or a phrase?")
    if len(token) < MIN_TOKEN_LENGTH:
        return f"TUNER_TOKEN must be at least {MIN_TOKEN_LENGTH} characters, but has {len(token)}"
    lowered = token.lower()
    word = next((w for w in PLACEHOLDER_WORDS if w in lowered), None)
    if word is not None:
        return f"TUNER_TOKEN contains the placeholder {word!r}"
    distinct = len(set(token))
    if distinct < MIN_TOKEN_DISTINCT:
        return (f"TUNER_TOKEN has {distinct} distinct characters, fewer than the "
                f"{MIN_TOKEN_DISTINCT} of any random token of its length: it is guessable")
    period = next((p for p in range(1, len(token) // 2 + 1)
                   if all(token[i] == token[i % p] for i in range(len(token)))), None)
    if period is not None:
        return f"TUNER_TOKEN repeats a pattern of {period} characters: it is guessable"
    return None


TOKEN_FIX = ("set TUNER_TOKEN to a random secret (e.g. `openssl rand -hex 24`), or unset it to "
             "serve reads only")


class SettingsError(TunerError, ValueError):
    """A TUNER_* setting has a value the program cannot use; ``variables`` names them, and
    ``fix`` says to correct them. ``str()`` is the message alone (the service shows it)."""

    def __init__(self, message: str, variables: tuple[str, ...] = ()) -> None:
        names = ", ".join(variables) or "the TUNER_* variable named"
        super().__init__(message, f"correct or unset {names} (in the environment or in .env); "
                                  "docs/CONFIGURATION.md lists them")
        self.variables = variables

    def __str__(self) -> str:
        return self.message


class LogSettings(BaseSettings):
    """The logging part of the settings, readable alone: a command configures logging before
    it knows (or whatever else is wrong with) its database URL."""

    model_config = SettingsConfigDict(env_prefix="TUNER_", env_file=".env", extra="ignore")

    log_level: str = Field("WARNING", description="one of " + ", ".join(LOG_LEVELS))

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        upper = value.upper()
        if upper not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, but got {value!r}")
        return upper

    @property
    def log_level_set(self) -> bool:
        """Whether TUNER_LOG_LEVEL was given (environment or .env), not defaulted."""
        return "log_level" in self.model_fields_set


class Settings(LogSettings):
    database_url: str = Field(DEFAULT_DATABASE_URL, description="SQLAlchemy database URL")
    url: str | None = Field(None, description="config service base URL, e.g. http://host:8000")
    token: str | None = Field(None, description="bearer token for writes to the service")
    lookup_timeout: float = Field(0.5, gt=0, le=60, description="seconds to wait for the service")
    cors_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="largest request body")
    template_modules: list[str] = Field(
        default_factory=list, description="modules the service imports to register templates")
    gpu_lock_dir: str | None = Field(
        None, description="folder of the GPU claims shared by the sweeps of one host")
    snapshot: str | None = Field(
        None, description="snapshot id or bundle file every lookup of a job answers from")
    refresh: bool = Field(
        False, description="pick up newer answers for problems this process already ran")
    # pydantic reads on/off, true/false, 1/0, yes/no.
    demand: bool = Field(True, description="report problems run untuned to TUNER_URL")
    demand_interval: float = Field(10.0, gt=0, le=3600,
                                   description="seconds between demand reports")
    demand_rate_limit: float = Field(20.0, gt=0, le=1e6, description=(
        "POST /v1/demand requests per second per client address (service)"))
    refused_write_rate: float = Field(5.0, gt=0, le=1e6, description=(
        "writes refused for their token answered at once per second per client address "
        "(bursts of twice as many); past that each is answered after up to 1 s (service)"))
    # A neighbour's ratio is a prediction for another shape, so it must clear the noise of
    # the measurements behind it: sdpa timed against itself read up to 2.6% apart on the
    # H100 (benchmarks/results/dispatch_h100.json, notes/dispatch_measurements.md).
    neighbour_margin: float = Field(0.03, ge=0, le=1, description=(
        "fraction by which an implementation must beat torch SDPA on a neighbouring problem "
        "to run an untuned one"))
    demand_max_pending: int = Field(DEFAULT_DEMAND_MAX_PENDING, ge=1, le=10_000_000, description=(
        "problems waiting in the demand queue before new ones are refused (service)"))
    shipped: str = Field(SHIPPED_ON, description=(
        "on: consult the package's shipped measurements; off: never; or a folder of tables"))

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        # Imported here: SQLAlchemy costs the `tuner` command 0.3 s at start (python -X
        # importtime, 2-core CPU machine), and most settings are read without this URL set.
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(value)
        except ArgumentError as exc:
            raise ValueError(f"is not a SQLAlchemy URL ({exc}); e.g. sqlite:///tuner.db or "
                             "postgresql+psycopg://user@host/db") from None
        if url.get_backend_name() not in ("sqlite", "postgresql"):
            raise ValueError(f"backend {url.get_backend_name()!r} is not supported; "
                             "use sqlite or postgresql")
        return value

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, but got {value!r}")
        return value.rstrip("/")

    @field_validator("shipped")
    @classmethod
    def _check_shipped(cls, value: str) -> str:
        word = value.strip()
        if word.lower() in SHIPPED_ON_WORDS:  # "" too: compose passes an unset variable as ""
            return SHIPPED_ON
        if word.lower() in SHIPPED_OFF_WORDS:
            return SHIPPED_OFF
        folder = Path(word).expanduser()
        if not folder.is_dir():
            raise ValueError(f"must be {SHIPPED_ON}, {SHIPPED_OFF} or the path of a folder of "
                             f"shipped tables (<model>.json, as `tuner ship --out` writes), "
                             f"but got {value!r}, which is no folder")
        # Absolute: the folder stays the same one if the process changes directory later.
        return str(folder.resolve())

    @field_validator("snapshot")
    @classmethod
    def _strip_snapshot(cls, value: str | None) -> str | None:
        # Empty is unset, as for the token: compose passes an unset variable on as "".
        value = value.strip() if value is not None else None
        return value or None

    @field_validator("token")
    @classmethod
    def _strip_token(cls, value: str | None) -> str | None:
        # Stripped here, on the side that checks and on the side that sends: a configured
        # "abc " could never match the presented token, which HTTP strips (issue 19). Empty
        # is unset: docker-compose passes an unset variable on as "" (docker-compose.yml).
        value = value.strip() if value is not None else None
        return value or None

    def require_write_token(self) -> str:
        """The token a service needs to accept writes; refuses unset or guessable values
        (``write_token_problem``)."""
        problem = write_token_problem(self.token)
        if problem is not None:
            raise SettingsError(problem)
        assert self.token is not None  # write_token_problem refuses None
        return self.token


def load_settings(**overrides: object) -> Settings:
    """Read the settings; a bad value raises SettingsError naming the variable and the fix."""
    return _load(Settings, overrides)


def load_log_settings() -> LogSettings:
    """Read TUNER_LOG_LEVEL alone (SettingsError if it is bad)."""
    return _load(LogSettings, {})


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def _load(cls: type[SettingsT], overrides: dict[str, object]) -> SettingsT:
    try:
        return cls(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems, variables = [], []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "?"
            variables.append(f"TUNER_{field.upper()}")
            problems.append(f"{variables[-1]}: {err['msg']}")
        raise SettingsError("bad configuration: " + "; ".join(problems),
                            tuple(variables)) from None
    except SourceError as exc:
        # pydantic-settings reads a list variable as JSON before validating, and names the
        # field only in its message ('error parsing value for field "x" from source ...').
        named = re.search(r'field "(\w+)"', str(exc))
        variable = f"TUNER_{named.group(1).upper()}" if named else "a TUNER_* variable"
        raise SettingsError(f"bad configuration: {variable}: is not a JSON list "
                            f"({exc.__cause__ or exc}); write it as [\"a\", \"b\"] or []",
                            (variable,) if named else ()) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return load_settings()
