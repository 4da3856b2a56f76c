"""Turn a ``docker save`` stream into an OCI image-layout stream that leaves out the layers
containerd already holds, so that a change to phalanx imports its small layers, not 5 GB.

``ctr images import`` learns a docker-archive layer's digest only by reading it, so it reads
(and writes to its ingest area) every layer again. Here each ``<v1 id>/layer.tar`` of the
stream is matched to its diff ID by its size: docker reassembles a layer's tar from the
tar-split file in its layer store, so the exact tar size of every layer is known before the
stream starts. Layers containerd has are dropped from the stream; the others are written as
``blobs/sha256/<diff id>`` (containerd checks each blob against its name). The config blob is
copied, the manifest and index are written at the end. When two layers of the image have the
same tar size the match would be ambiguous: :class:`AmbiguousLayersError` tells the caller to
import the whole archive instead.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
BUFFER = 4 << 20  # skipping a 5 GB layer in tarfile's default 10 KB reads costs seconds


class AmbiguousLayersError(Exception):
    """Layers of equal tar size: sizes cannot tell them apart."""


def chain_ids(diff_ids: Iterable[str]) -> list[str]:
    """The layer store's chain IDs of an image's layers (bottom first)."""
    chain: list[str] = []
    for diff_id in diff_ids:
        if not chain:
            chain.append(diff_id)
        else:
            chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


def tar_split_size(path: Path) -> int:
    """The size of the tar that docker reassembles from a ``tar-split.json.gz``: file contents
    (type 1 entries) plus raw segments (type 2: headers, padding, the end-of-archive blocks)."""
    total = 0
    with gzip.open(path, "rt") as lines:
        for line in lines:
            entry = json.loads(line)
            if entry["type"] == 1:
                total += int(entry.get("size", 0))
            else:
                total += len(base64.b64decode(entry.get("payload") or ""))
    return total


def layer_tar_sizes(data_root: Path, diff_ids: list[str]) -> dict[str, int]:
    """{diff id: tar size} for an image in an overlay2 data root."""
    layerdb = data_root / "image" / "overlay2" / "layerdb" / "sha256"
    return {
        diff_id: tar_split_size(layerdb / chain.split(":", 1)[1] / "tar-split.json.gz")
        for diff_id, chain in zip(diff_ids, chain_ids(diff_ids), strict=True)
    }


def _add(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    out.addfile(info, io.BytesIO(data))


def thin_oci_stream(
    source: IO[bytes], sink: IO[bytes], ref: str, sizes: Mapping[str, int], present: set[str]
) -> list[str]:
    """Copy ``source`` (docker-archive) to ``sink`` (OCI layout) without the layers in
    ``present``; ``sizes`` are the image's diff IDs, bottom first, with their tar sizes.
    Returns the diff IDs written."""
    by_size: dict[int, list[str]] = {}
    for layer_id, size in sizes.items():
        by_size.setdefault(size, []).append(layer_id)
    if any(len(ids) > 1 for ids in by_size.values()):
        raise AmbiguousLayersError(f"layers of equal size: {[ids for ids in by_size.values() if len(ids) > 1]}")
    written: list[str] = []
    config: bytes | None = None
    with (
        tarfile.open(fileobj=source, mode="r|", bufsize=BUFFER) as archive,
        tarfile.open(fileobj=sink, mode="w|", bufsize=BUFFER) as out,
    ):
        _add(out, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        for member in archive:
            if member.name.endswith("/layer.tar"):
                diff_id: str | None
                (diff_id,) = by_size.get(member.size, [None])
                if diff_id is None:
                    raise AmbiguousLayersError(f"{member.name}: no layer of the image has {member.size} bytes")
                if diff_id in present:
                    continue  # the tar reader skips its bytes
                data = archive.extractfile(member)
                blob = tarfile.TarInfo("blobs/sha256/" + diff_id.split(":", 1)[1])
                blob.size, blob.mode = member.size, 0o644
                out.addfile(blob, data)
                written.append(diff_id)
            elif "/" not in member.name and member.name.endswith(".json") and member.name != "manifest.json":
                handle = archive.extractfile(member)
                assert handle is not None
                config = handle.read()
        if config is None:
            raise ValueError("the docker-archive stream has no image config")
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        _add(out, "blobs/sha256/" + config_digest.split(":", 1)[1], config)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(config),
                },
                "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": d, "size": s} for d, s in sizes.items()],
            },
            separators=(",", ":"),
        ).encode()
        manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        _add(out, "blobs/sha256/" + manifest_digest.split(":", 1)[1], manifest)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref.rpartition(":")[2],
                    },
                }
            ],
        }
        _add(out, "index.json", json.dumps(index).encode())
    return written
