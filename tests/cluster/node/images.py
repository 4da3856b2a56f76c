"""What the real node's images are made of, built locally and cached by a hash of inputs.

* ``registry.k8s.io/pause:3.10.1``: one static binary compiled from ``pause.c``, as an OCI archive.
* the Debian bookworm root filesystem (debootstrap minbase + python3) that stands in for the
  public Python image as the Dockerfile's ``BASE_IMAGE`` (see dockerfile_images.py);
* the wheel cache: torch and its CUDA wheels (2.6 GB), Transformers and accelerate, phalanx's
  dependencies and build backend, downloaded once per requirement set and served to the
  Dockerfile's pip steps.

Cache layout (``<cache>`` = ``${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/phalanx}``):

    <cache>/wheels/                      pip wheel cache, see ensure_wheels()
    <cache>/node/rootfs/<key>/           debootstrap result
    <cache>/node/images/pause-<key>.tar  the pause image for ``ctr images import``
    <cache>/node/docker/data/            the build daemon's data root (dockerfile_images.py)

``python -m tests.cluster.node.images`` builds the pause image and fills the wheel cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import oci
from .host import NODE_DIR, REPO_ROOT, cache_dir, hash_inputs, node_cache_dir, run

log = logging.getLogger(__name__)

PAUSE_REF = "registry.k8s.io/pause:3.10.1"
TORCH_REQUIREMENT = os.environ.get("PHALANX_TORCH_REQUIREMENT", "torch==2.13.0")
TRANSFORMERS_PACKAGES = ("transformers", "accelerate")
"""What the trainer image adds after torch (the Dockerfile's TRANSFORMERS_REQUIREMENTS), at the
versions pinned in pyproject.toml's frameworks extra, so the image runs what the unit tests ran."""
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("PHALANX_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_PACKAGES = ["python3", "python3-venv", "python3-pip", "ca-certificates", "iproute2", "procps", "netbase"]


@dataclass
class BuildReport:
    """What a build did; times in seconds, sizes in bytes."""

    archive: Path
    ref: str
    cached: bool
    timings: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record how long the block took under ``name``."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - t0, 1)


# ---------------------------------------------------------------------------------- pause


def build_pause_image() -> BuildReport:
    src = NODE_DIR / "pause.c"
    key = hash_inputs(src, Path(oci.__file__), PAUSE_REF, "v2")[:16]
    out = node_cache_dir() / "images" / f"pause-{key}.tar"
    report = BuildReport(out, PAUSE_REF, cached=out.exists())
    for old in out.parent.glob("pause-*.tar"):
        if old != out:
            old.unlink(missing_ok=True)
    if out.exists():
        return report
    with timed(report.timings, "build"), tempfile.TemporaryDirectory(prefix="pause-") as tmp:
        binary = Path(tmp) / "pause"
        run(["gcc", "-Os", "-static", "-o", binary, src])
        run(["strip", binary])
        rootfs = oci.single_file_rootfs(Path(tmp) / "rootfs", {"/pause": binary})
        out.parent.mkdir(parents=True, exist_ok=True)
        layer = oci.write_layer(rootfs, Path(tmp) / "layer.tar")
        oci.write_oci_archive(out, PAUSE_REF, [layer], entrypoint=["/pause"])
    report.sizes["archive"] = out.stat().st_size
    return report


# ---------------------------------------------------------------------------------- wheels


def wheels_dir() -> Path:
    d = cache_dir() / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _find_links() -> list[str]:
    links = [str(wheels_dir())]
    for extra in [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]:
        if extra and extra not in links and Path(extra).is_dir():
            links.insert(0, extra)  # a local torch wheel there wins over the cache
    return links


def ensure_wheels(requirement: str | list[str] = TORCH_REQUIREMENT) -> list[Path]:
    """Download ``requirement`` (one or a list) and dependencies once into the wheel cache.

    Uses the host's pip for the image's interpreter (cp311, manylinux x86_64); if a matching
    wheel already sits in a find-links directory, pip takes it from there.
    """
    reqs = [requirement] if isinstance(requirement, str) else sorted(requirement)
    dest = wheels_dir()
    marker = dest / f".complete-{hash_inputs(*reqs)[:12]}"
    if marker.exists():
        lines = marker.read_text().splitlines()
        if "--files--" in lines:
            files = lines[lines.index("--files--") + 1 :]
            if all((dest / f).exists() for f in files):
                return [dest / f for f in files]
    cmd: list[str | Path] = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--progress-bar",
        "off",
        "--dest",
        dest,
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
        "--platform",
        "manylinux_2_36_x86_64",
    ]
    # pip accepts --platform more than once; list every manylinux level glibc 2.36 runs.
    for minor in range(35, 4, -1):
        cmd += ["--platform", f"manylinux_2_{minor}_x86_64"]
    cmd += ["--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64", "--platform", "linux_x86_64"]
    for link in _find_links():
        cmd += ["--find-links", link]
    cmd += reqs
    log.info("downloading %s into %s (once)", " ".join(reqs), dest)
    out = run(cmd, timeout=3600).stdout
    # the files this requirement set resolved to ("Saved <path>" / "File was already
    # downloaded <path>"), so the trainer's cache key never depends on unrelated wheels
    files = sorted(
        {
            Path(line.split()[-1]).name
            for line in out.splitlines()
            if line.strip().startswith(("Saved ", "File was already downloaded "))
        }
    )
    files = [f for f in files if f.endswith(".whl") and (dest / f).exists()]
    if not files:
        files = sorted(p.name for p in dest.glob("*.whl"))
    marker.write_text("\n".join(reqs) + "\n--files--\n" + "\n".join(files) + "\n")
    return [dest / f for f in files]


# --------------------------------------------------------------------------------- rootfs


def debian_rootfs() -> tuple[Path, float | None]:
    """Cached ``debootstrap --variant=minbase`` tree. Returns (path, seconds or None if cached)."""
    key = hash_inputs(DEBIAN_SUITE, DEBIAN_MIRROR, ",".join(DEBIAN_PACKAGES), "v1")[:16]
    root = node_cache_dir() / "rootfs" / f"{DEBIAN_SUITE}-{key}"
    if (root / ".complete").exists():
        return root, None
    t0 = time.monotonic()
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(DEBIAN_PACKAGES)}",
            DEBIAN_SUITE,
            tmp,
            DEBIAN_MIRROR,
        ],
        timeout=1800,
    )
    _slim_rootfs(tmp)
    (tmp / ".complete").write_text("ok\n")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root, time.monotonic() - t0


def _slim_rootfs(root: Path) -> None:
    for rel in (
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
        "var/cache/debconf/templates.dat-old",
        "var/log",
    ):
        p = root / rel
        if p.is_dir():
            for child in p.iterdir():
                if child.name in ("partial", "lock"):
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        elif p.exists():
            p.unlink()


# ------------------------------------------------------------------------ project


def project_requirements() -> list[str]:
    """Runtime dependencies and build requirements of both distributions the Dockerfile builds:
    ``phalanx`` (pyproject.toml, the operator) and ``phalanx-worker`` (worker/pyproject.toml,
    the trainer's in-pod helper; without its extras)."""
    import tomllib

    requirements: set[str] = set()
    for pyproject in ("pyproject.toml", "worker/pyproject.toml"):
        data = tomllib.loads((REPO_ROOT / pyproject).read_text())
        requirements |= set(data.get("project", {}).get("dependencies", []))
        requirements |= set(data.get("build-system", {}).get("requires", []))
    return sorted(requirements)


def transformers_requirements() -> list[str]:
    """The frameworks extra's pins of TRANSFORMERS_PACKAGES (``name==version``)."""
    import tomllib

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["frameworks"]
    pins = {line.split("==")[0].strip().lower(): line for line in extra if "==" in line}
    missing = [name for name in TRANSFORMERS_PACKAGES if name not in pins]
    if missing:
        raise RuntimeError(f"pyproject.toml's frameworks extra pins none of {missing} (the trainer image needs them)")
    return [pins[name] for name in TRANSFORMERS_PACKAGES]


def host_ca_bundle() -> Path:
    for cand in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise RuntimeError("no CA bundle found for pip inside the image build chroot")


def main() -> None:
    """``python -m tests.cluster.node.images``: build the pause image and fill the wheel cache."""
    logging.basicConfig(level=logging.INFO)
    t0 = time.monotonic()
    pause = build_pause_image()
    wheels = ensure_wheels(project_requirements()) + ensure_wheels(TORCH_REQUIREMENT)
    wheels += ensure_wheels([TORCH_REQUIREMENT, *transformers_requirements()])
    print(json.dumps({"pause": str(pause.archive), "cached": pause.cached, "wheels": len(set(wheels)),
                      "seconds": round(time.monotonic() - t0, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
