"""The shared-disk transport: engines read the trainer's directory where it is.

`publish` has nothing to send and announces the directory as a `file://`
URI; `source` confines that URI to the reader's weights root (a message off
the bus must not point engines at an arbitrary directory: not through
`..`, an absolute path elsewhere, or a symlink that leads out); `receive`
has nothing to do, and neither has `cleanup` (the version directories
themselves are pruned for every transport: `Transports.cleanup`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import unquote, urlparse

from services.weights.base import (
    BadWeightsUri,
    Sent,
    SharedDir,
    Transfer,
    Wiring,
)

if TYPE_CHECKING:
    from proto.messages import WeightsPublished


def shared_path(uri: str, root: Path) -> Path:
    """The directory a `file://` URI names, confined to `root`; BadWeightsUri otherwise."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise BadWeightsUri(f"unsupported weights uri {uri!r}")
    # decoded: `publish` announces Path.as_uri(), which percent-encodes (a run directory
    # with a space in it reads "%20"); decoding first also confines an encoded "..".
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise BadWeightsUri(f"weights uri {uri!r} is outside {root}")
    return path


class DiskTransport:
    kind: ClassVar[str] = "disk"
    scheme: ClassVar[str] = "file"

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring

    @property
    def root(self) -> Path:
        if self.wiring.root is None:
            raise ValueError("the disk weights transport needs the weights root")
        return self.wiring.root

    async def publish(self, version: int, directory: Path) -> Sent:
        return Sent(uri=directory.resolve().as_uri())

    def source(self, uri: str, version: int) -> SharedDir:
        return SharedDir(str(shared_path(uri, self.root)))

    async def receive(
        self, msg: WeightsPublished, into: Path, newer_than: int | None
    ) -> Transfer | None:
        return None  # the engine reads the shared directory itself

    async def cleanup(self, below: int) -> None:
        return None  # the shared directories are the layout's: Transports.cleanup
