"""Typed settings for every service: a TOML run file plus environment overrides.

One run file configures a whole run. Top-level keys and the shared tables
(`[nats]`; a domain adds its own, as the tasks domain adds `[task]`:
services/tasks/settings.py) are read by every service; each service reads
its own table (`[trainer]`, `[buffer]`, …) on top. Environment variables override the file:
`FLYWHEEL_<SECTION>_<FIELD>` (e.g. `FLYWHEEL_TRAINER_LR=1e-4`), with `__`
for nested fields (`FLYWHEEL_TRAINER_NATS__URL=…`). Unknown keys are errors
that name the key, so a typo cannot silently fall back to a default.

Priority, highest first: keyword overrides, environment, run file, defaults.

Paths. Every path a run file (or its environment override) gives is read
the same way by every command (`up`, `eval`, `replay`, `demo`, the
services, the benches): as a `RunPath`, `~` is the user's home (the
shipped SmolLM2 run files say `model = "~/.cache/flywheel/models/..."`),
and a relative path is from the working directory the command runs in,
not from the run file's directory. That is what `flywheel up` has always
meant: it starts every service in its own working directory, each reading
the same run file, and the README and the examples give their data paths
from the directory they are run in (`configs/examples/data/...` from the
repository root; a user's `train.jsonl` beside the run file when run from
there). A model reference is resolved to its directory by one function,
services/models/resolve.py `resolve_model` (a directory, or a hub id in the
local cache), whose error is one line naming the key.
"""

from __future__ import annotations

import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.runtime.errors import ConfigError

# The run file's values for the settings class being built right now. A
# context variable (not a class attribute) so concurrent loads cannot mix.
_FILE_VALUES: ContextVar[dict[str, Any]] = ContextVar("flywheel_file_values", default={})  # noqa: B039


def run_path(value: str | Path) -> Path:
    """A path as a run file gives it: `~` expanded, a relative path left relative to the
    working directory (module docstring: why not the run file's directory)."""
    return Path(value).expanduser()


RunPath = Annotated[Path, AfterValidator(run_path)]
"""The type of every path field of a run file's settings (module docstring)."""


class _RunFileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole table

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_VALUES.get())


class NatsSettings(BaseModel):
    """How to reach NATS. Credentials are optional; all are off by default."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL(s), comma-separated: list every member of a cluster.",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=5,
        description=(
            "JetStream replicas of every stream and KV bucket Flywheel creates: 1 on a single "
            "server, 3 on a 3-server cluster (survives the loss of one). Existing streams are "
            "scaled to it; > 1 needs a clustered NATS. 5 is JetStream's maximum."
        ),
    )
    history_max_age_s: float = Field(
        7 * 24 * 3600.0,
        ge=0,
        description="How long the run's SAMPLES and BATCHES streams keep a message (0: for "
        "ever). A run can be replayed (`flywheel replay`) only while its streams hold every "
        "message: set it longer than you will want to replay (docs/replay.md). Set it in the "
        "run file, the same for every service: each one ensures the streams at start-up.",
    )
    history_max_bytes: int = Field(
        -1,
        ge=-1,
        description="At most this many bytes in each of SAMPLES and BATCHES (-1: no limit); "
        "past it the oldest messages go, and with them the run's replay from its start.",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Timeout of one connect attempt.")
    connect_attempts: int = Field(
        30, ge=1, description="Connect attempts at start-up (with backoff) before giving up."
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="At a stop, how long the service waits for its subscriptions to drain "
        "(messages already fetched handled, publishes flushed) before it closes the "
        "connection anyway; JetStream redelivers what was not acked.",
    )
    max_payload: int | None = Field(
        None, gt=0, description="Override the server's max_payload (bytes); None: ask the server."
    )
    user: str | None = Field(None, description="User name for user/password auth.")
    password: SecretStr | None = Field(None, description="Password for user/password auth.")
    token: SecretStr | None = Field(None, description="Token auth.")
    creds_file: RunPath | None = Field(None, description="NATS .creds file (JWT + nkey seed).")
    nkeys_seed: RunPath | None = Field(None, description="File holding an nkey seed.")
    tls_ca: RunPath | None = Field(None, description="CA bundle to verify the server; enables TLS.")
    tls_cert: RunPath | None = Field(None, description="Client certificate for mutual TLS.")
    tls_key: RunPath | None = Field(None, description="Client key for mutual TLS.")


class ServiceSettings(BaseSettings):
    """Fields every service shares. Subclass per service and set `section`."""

    section: ClassVar[str] = ""
    # Tables of the run file every service reads (not a section of their own); a
    # subclass that adds a shared table's field adds its name.
    shared_tables: ClassVar[frozenset[str]] = frozenset({"nats"})
    # Shared tables that are sections of their own in errors (`[task] source.path`, not
    # `[buffer] task.source.path`): name -> whether it holds named tables (`[tasks.<name>]`).
    own_tables: ClassVar[dict[str, bool]] = {}

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    run: str = Field(
        "demo", pattern=r"^[A-Za-z0-9_-]+$", description="Run name; namespaces every subject."
    )
    nats: NatsSettings = Field(default_factory=NatsSettings)
    metrics_host: str = Field("127.0.0.1", description="Bind address of /metrics and /healthz.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of /metrics and /healthz; 0 picks a free port."
    )
    log_level: str = Field("INFO", description="Python logging level.")

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Each section's environment prefix follows from its name: `FLYWHEEL_<SECTION>_`.

        Read by pydantic-settings when an instance is built, so setting it
        here (once per class) is all a subclass needs besides `section`.
        """
        super().__pydantic_init_subclass__(**kwargs)
        cls.model_config = {**cls.model_config, "env_prefix": env_prefix_for(cls.section)}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _RunFileSource(settings_cls))


S = TypeVar("S", bound=ServiceSettings)


def read_run_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML run file, with a ConfigError naming the file on failure."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"run file not found: {p}") from e
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not UTF-8
        raise ConfigError(f"run file {p} cannot be read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"run file {p} is not valid TOML: {e}") from e


def file_values(doc: dict[str, Any], cls: type[ServiceSettings]) -> dict[str, Any]:
    """The values `cls` takes from a parsed run file: shared keys, then its section.

    Shared: top-level keys and the tables `cls` shares (`shared_tables`: `[nats]`,
    `[task]`, `[tasks.*]`). Any other table is a section of its own
    (`[stack] engine` is a field, `[engine]` a section).
    """
    tables = cls.shared_tables
    shared = {
        k: v
        for k, v in doc.items()
        if k in cls.model_fields and k != cls.section and (k in tables or not isinstance(v, dict))
    }
    section = doc.get(cls.section, {}) if cls.section else {}
    if not isinstance(section, dict):
        raise ConfigError(f"[{cls.section}] must be a table")
    return {**shared, **section}


def load_settings(cls: type[S], path: str | Path | None = None, **overrides: Any) -> S:
    """Build `cls` from the run file at `path` (optional), the environment and overrides.

    Raises ConfigError naming each bad field (with its section) on invalid values.
    """
    values = file_values(read_run_file(path), cls) if path else {}
    token = _FILE_VALUES.set(values)
    try:
        return cls(**overrides)
    except ValidationError as e:
        given = {**values, **overrides}  # what was validated (the environment aside)
        raise ConfigError.from_validation(
            e, cls.section or "run", cls.own_tables, cls, given
        ) from e
    finally:
        _FILE_VALUES.reset(token)


def env_prefix_for(section: str) -> str:
    """The environment prefix of a section, e.g. `FLYWHEEL_TRAINER_`."""
    return f"FLYWHEEL_{section.upper()}_" if section else "FLYWHEEL_"


def render(settings: BaseSettings) -> str:
    """The resolved settings as JSON, for `--print-config`: secrets masked (SecretStr),
    and credentials in plain fields too (a NATS URL's user:password@)."""
    from services.runtime.redact import redact

    return redact(settings.model_dump_json(indent=2))
