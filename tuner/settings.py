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
                         (see tuner/gpus.py); unset: a sweep uses every GPU it sees
"""

from __future__ import annotations

from functools import lru_cache
from typing import TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_DATABASE_URL = "sqlite:///tuner.db"
# Tokens that look set but protect nothing; the service refuses to start with one of them.
PLACEHOLDER_TOKENS = frozenset({"changeme", "change-me", "secret", "token", "password", "test"})


class SettingsError(ValueError):
    """A TUNER_* setting has a value the program cannot use; ``variables`` names them."""

    def __init__(self, message: str, variables: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.variables = variables


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

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
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

    def require_write_token(self) -> str:
        """The token a service needs to accept writes; refuses unset or placeholder values."""
        if not self.token:
            raise SettingsError("TUNER_TOKEN is not set: the service needs a token for writes")
        if self.token.lower() in PLACEHOLDER_TOKENS or len(self.token) < 12:
            raise SettingsError("TUNER_TOKEN is a placeholder or shorter than 12 characters; "
                                "set a random secret (e.g. `openssl rand -hex 24`)")
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


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return load_settings()
