"""Weight versions: their directory layout, their manifest, and how they travel.

- `layout`     where a version's directory is (`<root>/<run>/v000012`; the name
               itself and everything else a version is: proto/weight_version.py);
- `manifest`   the weights-directory format: an HF directory plus a sha256
               manifest, written atomically, verified by every reader;
- `base`       the `WeightsTransport` protocol (publish → URI, where an engine
               loads it, receive beside an engine, clean-up) and its value types;
- `registry`   the transports by name and by URI scheme (the package's edge);
- `disk`, `nats`, `natsdelta`, `diskdelta`, `distributed`  the transports
               (`[trainer] weights_transport`);
- `distgroup`  the torch.distributed weights-update group (SGLang's, both sides);
- `best`       the best evaluated version kept beside the checkpoints (`best/`);
- `chunks`     the NATS transports' mechanism: a directory as WeightsChunks;
- `delta`      the pure sparse-delta codec (changed elements' indices + bits);
- `deltasync`  deltas around it: the trainer writes them, a receiver rebuilds.

The trainer, sync and the rollout workers call the transport; nothing
outside this package branches on which one it is. No torch here: engines
and sync use it too.
"""

from services.weights.base import (
    BadWeightsUri,
    LocalCopy,
    Sent,
    SharedDir,
    Transfer,
    WeightsSource,
    WeightsTransferError,
    WeightsTransport,
    Wiring,
)
from services.weights.layout import (
    published_dir,
    version_dir,
    versions_in,
)
from services.weights.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestMissingError,
    WeightsError,
    WeightsExistsError,
    WeightsFileMissingError,
    WeightsMismatchError,
    build_manifest,
    directory_digest,
    file_sha256,
    read_manifest,
    verify_weights_dir,
    write_weights_dir,
)
from services.weights.registry import TransportKind, Transports, open_transport

__all__ = [
    "MANIFEST_NAME",
    "BadWeightsUri",
    "FileEntry",
    "LocalCopy",
    "Manifest",
    "ManifestMissingError",
    "Sent",
    "SharedDir",
    "Transfer",
    "TransportKind",
    "Transports",
    "WeightsError",
    "WeightsExistsError",
    "WeightsFileMissingError",
    "WeightsMismatchError",
    "WeightsSource",
    "WeightsTransferError",
    "WeightsTransport",
    "Wiring",
    "build_manifest",
    "directory_digest",
    "file_sha256",
    "open_transport",
    "published_dir",
    "read_manifest",
    "verify_weights_dir",
    "version_dir",
    "versions_in",
    "write_weights_dir",
]
