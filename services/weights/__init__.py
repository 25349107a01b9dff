"""Weight versions: their directory layout, their manifest, and how they travel.

- `layout`     the one place a version's directory name is made (`v000012`);
- `manifest`   the weights-directory format: an HF directory plus a sha256
               manifest, written atomically, verified by every reader;
- `transport`  the `WeightsTransport` protocol (publish → URI, where an engine
               loads it, receive beside an engine, clean-up) and its registry;
- `disk`, `nats`, `natsdelta`, `diskdelta`, `distributed`  the transports
               (`[trainer] weights_transport`);
- `distgroup`  the torch.distributed weights-update group (SGLang's, both sides);
- `chunks`     the NATS transports' mechanism: a directory as WeightsChunks;
- `delta`      the pure sparse-delta codec (changed elements' indices + bits);
- `deltasync`  deltas around it: the trainer writes them, a receiver rebuilds.

The trainer, sync and the rollout workers call the transport; nothing
outside this package branches on which one it is. No torch here: engines
and sync use it too.
"""

from services.weights.layout import (
    published_dir,
    version_dir,
    version_name,
    version_of,
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
from services.weights.transport import (
    BadWeightsUri,
    LocalCopy,
    Sent,
    SharedDir,
    Transfer,
    TransportKind,
    Transports,
    WeightsSource,
    WeightsTransferError,
    WeightsTransport,
    Wiring,
    open_transport,
)

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
    "version_name",
    "version_of",
    "versions_in",
    "write_weights_dir",
]
