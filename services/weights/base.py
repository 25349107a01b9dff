"""How a weight version travels from the trainer to the engines: one protocol, one owner.

Three parties meet a version, and each asks its transport one thing:

- the **trainer** saved `<root>/<run>/v000012/` (layout.py) and `publish`es
  it: the transport makes it reachable and returns the URI that
  `WeightsPublished` announces (`file://…` for a shared disk,
  `nats://<stream>/<version>` once its chunks are in JetStream);
- the **rollout worker** beside each engine `receive`s it into the engine's
  local directory when the transport needs a local copy (NATS), and its
  heartbeat reports what it holds;
- **sync** asks the announced URI's `source` where each engine loads the
  version from (`engine_path`: the shared directory, or the engine's own
  copy once it is there, else not yet), and `cleanup`s what versions no
  engine needs any more hold in the transport.

Nothing outside this package looks at a URI's scheme or at the transport's
kind. This module is the protocol and its value types; the transports
implement it beside it, and registry.py, the package's edge, names them.
A new transport implements the four methods and registers its class there.
*Sparse deltas* are one (natsdelta.py: `publish` sends the
elements that changed against the previous version, `receive` rebuilds the
version from the engine's copy of the base plus the deltas, verified, else
downloads it whole; `source` is a `LocalCopy`). *torch.distributed* is another
(distributed.py): `publish` announces the saved directory, `receive` has
nothing to do, and its `source` broadcasts it, sync being rank 0, into each
engine's group through SGLang's `update_weights_from_distributed`: sync
updates an engine by calling its source's `load`, the one place the engine
call differs by transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from services.runtime.errors import FlywheelError, PermanentError
from services.weights.layout import version_dir

if TYPE_CHECKING:
    from proto.messages import WeightsPublished
    from services.engine_api.engine_client import EngineClient, UpdateResult
    from services.weights.delta import DeltaStats


class WeightsTransferError(FlywheelError, RuntimeError):
    """A version could not be sent or received (incomplete, timed out, corrupt)."""

    def __init__(self, message: str, *, version: int) -> None:
        super().__init__(message)
        self.version = version


class BadWeightsUri(PermanentError):
    """An announced weights URI no transport accepts (or one pointing outside its root)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="bad_uri")


@dataclass(frozen=True)
class Transfer:
    """What went over the wire for one version."""

    version: int
    chunks: int
    bytes: int
    seconds: float
    deltas: int = 0  # deltas applied to get this version (0: it came whole)
    rebuild_s: float = 0.0  # of `seconds`, applying them and writing the directory

    @property
    def mb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e6


@dataclass(frozen=True)
class Sent:
    """What `publish` did: the URI to announce, and what went over the wire for it."""

    uri: str
    transfer: Transfer | None = None  # None: nothing was sent (engines read the directory)
    delta: DeltaStats | None = None  # a delta transport's sizes (None: no delta this time)


class WeightsSource(Protocol):
    """Where engines load one announced version from (sync's view of it)."""

    def engine_path(self, engine_dir: str | None, downloaded: int | None) -> str | None:
        """The directory an engine loads from, or None while it has no copy to load.

        `engine_dir` and `downloaded` are what the engine's heartbeat reports:
        its local weights directory and the newest version received there.
        """
        ...

    async def load(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        """Sync: update the engine behind `client` to this version from `path`."""
        ...


@dataclass(frozen=True)
class SharedDir:
    """A directory every engine reads as it is (shared storage)."""

    path: str

    def engine_path(self, engine_dir: str | None, downloaded: int | None) -> str | None:
        return self.path

    async def load(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        return await client.update_weights_from_disk(path, version, update_mode=update_mode)


@dataclass(frozen=True)
class LocalCopy:
    """A version each engine loads from its own local copy, once its worker received it."""

    version: int

    def engine_path(self, engine_dir: str | None, downloaded: int | None) -> str | None:
        if engine_dir is None or downloaded is None or downloaded < self.version:
            return None
        return str(version_dir(engine_dir, self.version))

    async def load(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        return await client.update_weights_from_disk(path, version, update_mode=update_mode)


@dataclass(frozen=True)
class Wiring:
    """What a transport may need; each party fills in what it has.

    `root` is where the trainer writes published versions (<root>/<run>/…);
    `js` the JetStream context of transports that use NATS.
    """

    run: str
    root: Path | None = None
    js: Any = None
    nc: Any = None  # core NATS (the delta transport's requests for a full version)
    snapshot_every: int = 10  # the delta transport: a full snapshot every this many versions
    max_payload: int = 1024 * 1024
    upload_window: int = 16  # NATS: chunk publishes in flight at once
    idle_timeout_s: float = 30.0  # NATS: a download fails after this long with no chunk
    dist_address: str = "127.0.0.1"  # distributed: where sync (rank 0) hosts its groups


class WeightsTransport(Protocol):
    """One way weight versions travel (module docstring: who calls what)."""

    kind: ClassVar[str]  # its name in [trainer] weights_transport
    scheme: ClassVar[str]  # the scheme of the URIs it announces

    async def publish(self, version: int, directory: Path) -> Sent:
        """Trainer: make the saved `directory` reachable; the URI to announce."""
        ...

    def source(self, uri: str, version: int) -> WeightsSource:
        """Sync: check an announced URI (BadWeightsUri) and say where engines load it."""
        ...

    async def receive(
        self, msg: WeightsPublished, into: Path, newer_than: int | None
    ) -> Transfer | None:
        """Beside an engine: bring the version into `into`/v000012 if this transport needs
        a local copy and it is newer than `newer_than`; None when there is nothing to do."""
        ...

    async def cleanup(self, below: int) -> None:
        """Sync: no engine needs versions below `below` any more; drop what this transport
        holds of them (the version directories themselves: `Transports.cleanup`)."""
        ...
