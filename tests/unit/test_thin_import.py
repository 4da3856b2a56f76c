"""The docker-archive -> thin OCI layout converter the real node imports images with."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.cluster.node import thin_import


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def docker_archive(layers: list[bytes], config: bytes) -> bytes:
    """What `docker save` writes, in its order: layer directories by v1 id, config, manifest."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        v1_ids = [hashlib.sha256(b"v1" + layer).hexdigest() for layer in layers]
        for v1_id, layer in sorted(zip(v1_ids, layers, strict=True)):
            add(archive, f"{v1_id}/VERSION", b"1.0")
            add(archive, f"{v1_id}/json", b"{}")
            add(archive, f"{v1_id}/layer.tar", layer)
        add(archive, f"{digest(config).split(':')[1]}.json", config)
        manifest = [{"Config": "x.json", "RepoTags": ["r/x:dev"], "Layers": [f"{i}/layer.tar" for i in v1_ids]}]
        add(archive, "manifest.json", json.dumps(manifest).encode())
        add(archive, "repositories", b"{}")
    return buffer.getvalue()


def read_layout(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive if m.isfile()}  # type: ignore[union-attr]


LAYERS = [b"base" * 3000, b"torch" * 50000, b"phalanx" * 100]
CONFIG = json.dumps({"rootfs": {"type": "layers", "diff_ids": [digest(layer) for layer in LAYERS]}}).encode()
SIZES = {digest(layer): len(layer) for layer in LAYERS}


def test_layers_containerd_has_are_left_out_and_the_manifest_names_all() -> None:
    present = {digest(LAYERS[0]), digest(LAYERS[1])}
    sink = io.BytesIO()
    written = thin_import.thin_oci_stream(io.BytesIO(docker_archive(LAYERS, CONFIG)), sink, "r/x:dev", SIZES, present)
    assert written == [digest(LAYERS[2])]
    files = read_layout(sink.getvalue())
    blobs = {name.split("/")[-1] for name in files if name.startswith("blobs/")}
    assert digest(LAYERS[2]).split(":")[1] in blobs
    assert not {d.split(":")[1] for d in present} & blobs
    assert files["blobs/sha256/" + digest(LAYERS[2]).split(":")[1]] == LAYERS[2]
    assert files["blobs/sha256/" + digest(CONFIG).split(":")[1]] == CONFIG
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "r/x:dev"
    manifest = json.loads(files["blobs/sha256/" + entry["digest"].split(":")[1]])
    assert manifest["config"] == {
        "mediaType": "application/vnd.oci.image.config.v1+json",
        "digest": digest(CONFIG),
        "size": len(CONFIG),
    }
    assert [(layer["digest"], layer["size"]) for layer in manifest["layers"]] == list(SIZES.items())
    assert files["oci-layout"] == b'{"imageLayoutVersion":"1.0.0"}'


def test_layers_of_equal_size_are_refused() -> None:
    sizes = {digest(b"a"): 10, digest(b"b"): 10}
    with pytest.raises(thin_import.AmbiguousLayersError):
        thin_import.thin_oci_stream(io.BytesIO(docker_archive(LAYERS, CONFIG)), io.BytesIO(), "r/x:dev", sizes, set())


def test_a_layer_of_unknown_size_is_refused() -> None:
    sizes = {digest(LAYERS[0]): len(LAYERS[0])}
    with pytest.raises(thin_import.AmbiguousLayersError):
        thin_import.thin_oci_stream(io.BytesIO(docker_archive(LAYERS, CONFIG)), io.BytesIO(), "r/x:dev", sizes, set())


def test_tar_split_size_counts_file_contents_and_raw_segments(tmp_path: Path) -> None:
    entries = [
        {"type": 2, "payload": base64.b64encode(b"h" * 512).decode(), "position": 0},
        {"type": 1, "name": "a", "size": 1000, "payload": "AAAA", "position": 1},
        {"type": 2, "payload": base64.b64encode(b"\0" * 24 + b"h" * 512).decode(), "position": 2},
        {"type": 1, "name": "dir/", "size": 0, "position": 3},
        {"type": 2, "payload": None, "position": 4},
    ]
    path = tmp_path / "tar-split.json.gz"
    with gzip.open(path, "wt") as out:
        out.write("\n".join(json.dumps(entry) for entry in entries) + "\n")
    assert thin_import.tar_split_size(path) == 512 + 1000 + 536


def test_chain_ids_follow_the_image_spec() -> None:
    a, b, c = (digest(x) for x in (b"a", b"b", b"c"))
    ab = digest(f"{a} {b}".encode())
    assert thin_import.chain_ids([a, b, c]) == [a, ab, digest(f"{ab} {c}".encode())]
