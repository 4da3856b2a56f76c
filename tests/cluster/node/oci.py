"""Write an OCI image-layout tarball without a docker daemon or registry (the pause image).

Layers are produced from directories with the system ``tar`` (keeps owners, modes, hard links,
device nodes and xattrs) and kept uncompressed; the layout (``oci-layout``, ``index.json``,
``blobs/sha256/*``) is written here, and ``ctr -n k8s.io images import`` reads it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class Layer:
    """An uncompressed layer tarball on disk and its digest (== diff_id)."""

    path: Path
    digest: str  # "sha256:<hex>"
    size: int


def write_layer(src_dir: Path, out_path: Path) -> Layer:
    """Tar the *contents* of ``src_dir`` (paths relative to it) into ``out_path``.

    Entries are sorted and timestamps clamped so that equal inputs give equal digests.
    """
    src_dir = Path(src_dir)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    entries = sorted(os.listdir(src_dir))
    cmd = [
        "tar",
        "--create",
        "--file=-",
        f"--directory={src_dir}",
        "--numeric-owner",
        "--sort=name",
        "--mtime=@0",
        "--clamp-mtime",
        "--xattrs",
        "--format=posix",
        "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
        "--",
        *entries,
    ]
    if not entries:  # empty layer: a tar with just the end-of-archive marker
        cmd = ["tar", "--create", "--file=-", "--files-from=/dev/null"]
    sha = hashlib.sha256()
    size = 0
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "wb") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        while True:
            chunk = proc.stdout.read(_CHUNK)
            if not chunk:
                break
            sha.update(chunk)
            out.write(chunk)
            size += len(chunk)
        rc = proc.wait()
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"tar of {src_dir} failed with exit code {rc}")
    tmp.replace(out_path)
    return Layer(out_path, "sha256:" + sha.hexdigest(), size)


def image_config(
    layers: Sequence[Layer],
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    labels: Mapping[str, str] | None = None,
    user: str | None = None,
) -> dict[str, Any]:
    env = dict(env or {})
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    cfg: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in env.items()]}
    if entrypoint is not None:
        cfg["Entrypoint"] = list(entrypoint)
    if cmd is not None:
        cfg["Cmd"] = list(cmd)
    if workdir:
        cfg["WorkingDir"] = workdir
    if labels:
        cfg["Labels"] = dict(labels)
    if user:
        cfg["User"] = user
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        "history": [
            {"created": "1970-01-01T00:00:00Z", "created_by": "phalanx tests/cluster/node/oci.py"} for _ in layers
        ],
    }


def write_oci_archive(
    out_path: Path,
    ref: str,
    layers: Sequence[Layer],
    **config_kwargs: Any,
) -> str:
    """Write an OCI image-layout tarball (``oci-layout``, ``index.json``, ``blobs/sha256/*``)
    for ``ref`` with ``layers`` (bottom first); returns the manifest digest.

    The full reference goes into the ``io.containerd.image.name`` annotation, which
    ``ctr images import`` uses as the image name as-is.
    """
    cfg_bytes = json.dumps(image_config(layers, **config_kwargs), sort_keys=True, separators=(",", ":")).encode()
    cfg_digest = "sha256:" + hashlib.sha256(cfg_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": cfg_digest,
            "size": len(cfg_bytes),
        },
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    man_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    man_digest = "sha256:" + hashlib.sha256(man_bytes).hexdigest()
    tag = ref.rpartition(":")[2] if ":" in ref.rpartition("/")[2] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": man_digest,
                "size": len(man_bytes),
                "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")

    def add_bytes(tf: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tf.addfile(info, io.BytesIO(data))

    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        add_bytes(tf, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        seen = set()
        for layer in layers:
            if layer.digest in seen:
                continue
            seen.add(layer.digest)
            info = tarfile.TarInfo("blobs/sha256/" + layer.digest.split(":", 1)[1])
            info.size = layer.size
            info.mode = 0o644
            with open(layer.path, "rb") as fh:
                tf.addfile(info, fh)
        add_bytes(tf, "blobs/sha256/" + cfg_digest.split(":", 1)[1], cfg_bytes)
        add_bytes(tf, "blobs/sha256/" + man_digest.split(":", 1)[1], man_bytes)
        add_bytes(tf, "index.json", json.dumps(index).encode())
    tmp.replace(out_path)
    return man_digest


def single_file_rootfs(dest: Path, files: Mapping[str, Path]) -> Path:
    """Make a tiny rootfs containing just ``files`` ({path in image: host file})."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for inner, host in files.items():
        target = dest / inner.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(host, target)
    return dest
