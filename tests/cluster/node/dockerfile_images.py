"""The images the real node runs, built from the repository's Dockerfile: ``operator`` and
``trainer`` (the one every real-node test and ``make up`` run), by a private dockerd.

No registry is reachable here, so ``BASE_IMAGE`` is a Debian bookworm + python3 image made
locally: the debootstrap tree of :func:`images.debian_rootfs` is ``docker import``-ed, then a
generated one-line build adds what only this build needs, so that the Dockerfile itself stays
exactly what users build on ``python:3.11-slim-bookworm``:

* ``PIP_BREAK_SYSTEM_PACKAGES=1``: Debian's python3 marks itself externally managed (PEP 668);
  the official python image does not;
* the host's CA bundle as ``PIP_CERT``: this CI reaches PyPI through a TLS-intercepting proxy
  whose CA only the host's bundle has.

Every ``pip`` in the Dockerfile reads the build args ``PIP_FIND_LINKS``/``PIP_NO_INDEX``; the
build sets them to a throw-away HTTP server over the wheel cache (:func:`images.ensure_wheels`),
so torch (2.6 GB of CUDA wheels) is downloaded once per machine, never per build. The server
listens on a fixed port (``PHALANX_WHEEL_PORT``, default 38917) because the classic builder
keys a ``RUN`` step's cache on the build args it sees.

The daemon (Debian's docker.io 20.10) is private and started only for a build or an export:
its ``--data-root`` is ``<cache>/node/docker/data`` and **kept**, so the torch layer is built
once and a change to phalanx rebuilds only the layers after it; ``--exec-root``, pidfile and
socket live under ``/run/phx-dockerd-<random>``; no bridge, no iptables/ip-forward/masquerading
changes; ``--oom-score-adjust=0`` (lowering it needs CAP_SYS_RESOURCE, which this host's
bounding set lacks). One build at a time per cache (``flock`` on ``<cache>/node/docker/lock``);
a daemon left by a killed build is stopped by the next one. The classic builder
(``DOCKER_BUILDKIT=0``) is used: BuildKit would pull the ``# syntax=`` frontend from Docker Hub.

An image carries the label ``dev.phalanx.image-key`` (a hash of its inputs); containerd gets
it by ``docker save | ctr images import -`` (no archive on disk), pinned and labelled
``phalanx.dev/key``, and is skipped when that label already matches. When containerd already
holds some of its layers (the torch layer, after a change to phalanx), the stream is turned
into an OCI layout without them on the way (thin_import.py).

``python -m tests.cluster.node.dockerfile_images [operator|trainer ...]`` builds (or finds)
them and prints timings and sizes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import images, thin_import
from .containerd import Containerd
from .host import NODE_DIR, REPO_ROOT, HostProcess, hash_inputs, node_cache_dir, run, stop_pidfile

log = logging.getLogger(__name__)

REFS = {"operator": "phalanx.local/operator:dev", "trainer": "phalanx.local/trainer:dev"}
KEY_LABEL = "dev.phalanx.image-key"
BUILD_CA_PATH = "/etc/ssl/certs/phalanx-build-ca.crt"
DOCKER = "/usr/bin/docker"  # Debian's docker.io client (matches the daemon's API version)
DOCKERD = "/usr/sbin/dockerd"
WHEEL_PORT = int(os.environ.get("PHALANX_WHEEL_PORT", "38917"))
# What the Dockerfile COPYs (besides itself); the build context holds only these (as .dockerignore).
CONTEXT_FILES = ("Dockerfile", "pyproject.toml", "README.md", "worker/pyproject.toml", "worker/README.md")
CONTEXT_DIRS = ("operator",)
# What each target's image is made of, for its key: the trainer installs phalanx-worker alone
# (its stage copies only these), so a change to the operator's code keeps the trainer image.
TARGET_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "operator": (("Dockerfile", "pyproject.toml", "README.md"), ("operator",)),
    "trainer": (("Dockerfile", "worker/pyproject.toml", "worker/README.md"), ("operator/phalanx/worker",)),
}


@dataclass
class ImageBuild:
    """What a build did; times in seconds, sizes in bytes."""

    target: str
    ref: str
    key: str
    cached: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------ inputs


def _context_inputs(
    files_and_dirs: tuple[tuple[str, ...], tuple[str, ...]] = (CONTEXT_FILES, CONTEXT_DIRS),
) -> list[Path]:
    names, dirs = files_and_dirs
    files = [REPO_ROOT / f for f in names]
    for d in dirs:
        files += [
            p
            for p in (REPO_ROOT / d).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]  # fmt: skip
    return sorted(files)


def _wheels(target: str) -> list[Path]:
    """Every wheel the target's pip steps need, in the cache (downloaded once per requirement set)."""
    wheels = images.ensure_wheels(images.project_requirements())
    if target == "trainer":
        wheels += images.ensure_wheels(images.TORCH_REQUIREMENT)
        # resolved with torch, so pip picks what the image's torch satisfies
        wheels += images.ensure_wheels([images.TORCH_REQUIREMENT, *images.transformers_requirements()])
    return sorted(set(wheels))


def _base_key(rootfs: Path) -> str:
    return hash_inputs(rootfs.name, images.host_ca_bundle(), "base-v2")[:16]


def image_key(target: str, rootfs: Path, wheels: list[Path]) -> str:
    inputs = _context_inputs(TARGET_INPUTS[target])
    return hash_inputs(
        target,
        _base_key(rootfs),
        images.TORCH_REQUIREMENT if target == "trainer" else "",
        *(images.transformers_requirements() if target == "trainer" else []),
        *[f"{w.name}:{w.stat().st_size}" for w in wheels],
        *[str(p.relative_to(REPO_ROOT)) for p in inputs],
        *inputs,
        Path(__file__),
    )[:16]


# ------------------------------------------------------------------------------ daemon


def _docker_dir() -> Path:
    d = node_cache_dir() / "docker"
    d.mkdir(parents=True, exist_ok=True)
    return d


class Dockerd:
    """The private dockerd over the persistent data root; a context manager that holds the
    cache's build lock, stops the daemon by PID and removes its run directory on exit."""

    def __init__(self) -> None:
        self.home = _docker_dir()
        self.exec_root = Path(f"/run/phx-dockerd-{secrets.token_hex(4)}")  # short: socket path
        self.socket = self.exec_root / "docker.sock"
        self._lock_fd: int | None = None
        self.proc = HostProcess(
            "dockerd",
            [
                DOCKERD,
                f"--config-file={self.home / 'daemon.json'}",  # never the host's /etc/docker/daemon.json
                f"--data-root={self.home / 'data'}",
                f"--exec-root={self.exec_root / 'exec'}",
                f"--pidfile={self.exec_root / 'dockerd.pid'}",
                f"--host=unix://{self.socket}",
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--userland-proxy=false",
                "--oom-score-adjust=0",
                "--storage-driver=overlay2",
                "--log-level=warn",
            ],
            log_dir=self.home,
            pid_dir=self.home,
        )

    def docker(self, *args: str | Path, timeout: float = 1800, input: str | None = None) -> str:
        return str(
            run(
                [DOCKER, f"--host=unix://{self.socket}", *map(str, args)],
                env={"DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(self.home / "client")},
                timeout=timeout,
                input=input,
            ).stdout
        )

    def image_key(self, ref: str) -> str | None:
        """The key label of ``ref`` in the data root, or None when the image is not there."""
        proc = run([DOCKER, f"--host=unix://{self.socket}", "image", "inspect", ref], check=False, timeout=60)
        if proc.returncode != 0:
            return None
        labels = json.loads(proc.stdout)[0]["Config"].get("Labels") or {}
        return str(labels.get(KEY_LABEL, ""))

    def _stop_leftover(self) -> None:
        """A daemon whose build was killed still runs (we hold the lock, so nobody uses it)."""
        stop_pidfile(self.home / "dockerd.pid")
        Containerd.remove_recorded_dir(self.home / "exec-root")

    def __enter__(self) -> Dockerd:
        self._lock_fd = os.open(self.home / "lock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # waits for another process's build
        try:
            self._stop_leftover()
            self.exec_root.mkdir(parents=True)
            (self.home / "exec-root").write_text(f"{self.exec_root}\n")
            (self.home / "daemon.json").write_text("{}\n")
            self.proc.start()
            deadline = time.monotonic() + 60
            while True:
                self.proc.check_alive()
                if (
                    self.socket.exists()
                    and run([DOCKER, f"--host=unix://{self.socket}", "info"], check=False).returncode == 0
                ):
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dockerd did not come up; log:\n{self.proc.tail(40)}")
                time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(timeout=30)
        Containerd.unmount_under(self.exec_root)
        shutil.rmtree(self.exec_root, ignore_errors=True)
        (self.home / "exec-root").unlink(missing_ok=True)
        for empty in ("/run/docker/plugins", "/run/docker"):  # made by every dockerd, if empty
            with contextlib.suppress(OSError):
                os.rmdir(empty)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def wheel_server() -> Iterator[str]:
    """Serve the wheel cache for pip's ``--find-links`` while a build runs; yields the URL."""
    handler = functools.partial(_QuietHandler, directory=str(images.wheels_dir()))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
    except OSError as exc:  # port taken: the build still works, only its RUN cache misses
        log.warning("port %d busy (%s): serving wheels on a random port", WHEEL_PORT, exc)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheel-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _base_image(dockerd: Dockerd, rootfs: Path) -> str:
    """Import the debootstrap tree and add the build settings (see the module docstring);
    kept in the data root under a tag named by its key."""
    key = _base_key(rootfs)
    base = f"phalanx.local/debian-python:{key}"
    if dockerd.image_key(base) is not None:
        return base
    raw = f"phalanx.local/debian-python-raw:{key}"
    tar = subprocess.Popen(
        ["tar", "-C", str(rootfs), "--exclude=./.complete", "--numeric-owner", "-cf", "-", "."],
        stdout=subprocess.PIPE,
    )
    try:
        imported = subprocess.run(
            [DOCKER, f"--host=unix://{dockerd.socket}", "import", "-", raw],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
    if imported.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import of {rootfs} failed: {imported.stderr}")
    with tempfile.TemporaryDirectory(prefix="base-context-", dir=dockerd.home) as tmp:
        ctx = Path(tmp)
        shutil.copy2(images.host_ca_bundle(), ctx / "ca.crt")
        (ctx / "Dockerfile").write_text(
            f"FROM {raw}\n"
            f"COPY ca.crt {BUILD_CA_PATH}\n"
            f"ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_CERT={BUILD_CA_PATH} PIP_DISABLE_PIP_VERSION_CHECK=1\n"
        )
        dockerd.docker("build", "--quiet", f"--label={KEY_LABEL}={key}", "--tag", base, ctx)
    dockerd.docker("rmi", raw)
    return base


def _prune(dockerd: Dockerd, keep_base: str) -> None:
    """Drop base images of other keys and untagged images (earlier builds); the build cache
    of the current images stays, it hangs off them."""
    for line in dockerd.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}").split():
        if line.startswith("phalanx.local/debian-python") and line != keep_base:
            dockerd.docker("rmi", line)
    dockerd.docker("image", "prune", "--force")


def _build(dockerd: Dockerd, target: str, rootfs: Path, key: str, report: ImageBuild) -> None:
    with images.timed(report.timings, "base_image"):
        base = _base_image(dockerd, rootfs)
    with tempfile.TemporaryDirectory(prefix="context-", dir=dockerd.home) as tmp:
        ctx = Path(tmp)
        for path in _context_inputs():
            dst = ctx / path.relative_to(REPO_ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst)
        with wheel_server() as wheels_url, images.timed(report.timings, "docker_build"):
            dockerd.docker(
                "build", "--network=host", f"--target={target}", f"--build-arg=BASE_IMAGE={base}",
                f"--build-arg=PIP_FIND_LINKS={wheels_url}", "--build-arg=PIP_NO_INDEX=1",
                *_target_build_args(target), f"--label={KEY_LABEL}={key}", f"--tag={REFS[target]}", ctx,
            )  # fmt: skip
    _prune(dockerd, base)


def _target_build_args(target: str) -> list[str]:
    if target != "trainer":
        return []
    return [f"--build-arg=TRANSFORMERS_REQUIREMENTS={' '.join(images.transformers_requirements())}"]


def _inspect_size(dockerd: Dockerd, ref: str) -> int:
    return int(json.loads(dockerd.docker("image", "inspect", ref))[0]["Size"])


def ensure_built(target: str, dockerd: Dockerd) -> ImageBuild:
    """Build ``target`` in the running daemon unless an image with its key is there."""
    rootfs, t_debootstrap = images.debian_rootfs()
    wheels = _wheels(target)
    key = image_key(target, rootfs, wheels)
    report = ImageBuild(target, REFS[target], key)
    if t_debootstrap is not None:
        report.timings["debootstrap"] = round(t_debootstrap, 1)
    if dockerd.image_key(report.ref) == key:
        report.cached = True
    else:
        t0 = time.monotonic()
        _build(dockerd, target, rootfs, key, report)
        report.timings["total"] = round(time.monotonic() - t0, 1)
    report.sizes["image"] = _inspect_size(dockerd, report.ref)
    return report


def _save_command(dockerd: Dockerd, ref: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [DOCKER, f"--host=unix://{dockerd.socket}", "save", ref],
        stdout=subprocess.PIPE,
        env={**os.environ, "DOCKER_CONFIG": str(dockerd.home / "client")},
    )


def _finish(save: subprocess.Popen[bytes], ref: str) -> None:
    assert save.stdout is not None
    save.stdout.close()
    if save.wait(timeout=60) != 0:
        raise RuntimeError(f"docker save {ref} failed ({save.returncode})")


def _abandon(save: subprocess.Popen[bytes]) -> None:
    """Stop a ``docker save`` whose reader failed (without hiding why it failed)."""
    assert save.stdout is not None
    save.stdout.close()
    save.kill()
    save.wait(timeout=60)


def _import_thin(dockerd: Dockerd, containerd: Containerd, ref: str, labels: dict[str, str]) -> bool:
    """Stream only the layers containerd lacks (see thin_import.py); False when that cannot
    help (no layer there yet) or cannot be done (layers of equal size)."""
    inspect = json.loads(dockerd.docker("image", "inspect", ref))[0]
    diff_ids: list[str] = inspect["RootFS"]["Layers"]
    present = containerd.content_digests() & set(diff_ids)
    if not present:
        return False
    sizes = thin_import.layer_tar_sizes(dockerd.home / "data", diff_ids)
    if len(set(sizes.values())) < len(sizes):
        return False
    read_end, write_end = os.pipe()
    save = _save_command(dockerd, ref)
    failure: list[BaseException] = []

    def convert() -> None:
        assert save.stdout is not None
        with os.fdopen(write_end, "wb") as sink:
            try:
                thin_import.thin_oci_stream(save.stdout, sink, ref, sizes, present)
            except BaseException as exc:  # reported by the caller's thread
                failure.append(exc)

    thread = threading.Thread(target=convert, name="thin-import", daemon=True)
    thread.start()
    try:
        with os.fdopen(read_end, "rb") as stream:
            containerd.import_stream(stream, [ref], labels=labels)
    except BaseException:
        _abandon(save)
        raise
    finally:
        thread.join(timeout=600)
    _finish(save, ref)
    if failure:
        raise RuntimeError(f"converting the docker save stream of {ref} failed") from failure[0]
    return True


def import_into(containerd: Containerd, target: str) -> tuple[ImageBuild | None, float | None]:
    """Make ``target`` (current key) present in the node's containerd, pinned.

    Returns the build report (None when containerd already had the image and no daemon was
    needed) and the import time (None when nothing was imported)."""
    rootfs, _ = images.debian_rootfs()
    ref = REFS[target]
    key = image_key(target, rootfs, _wheels(target))
    labels = {"phalanx.dev/key": key}
    if (containerd.image_labels(ref) or {}).get("phalanx.dev/key") == key:
        return None, None
    run(["sh", NODE_DIR / "install-packages.sh"], capture=False)
    with Dockerd() as dockerd:
        report = ensure_built(target, dockerd)
        t0 = time.monotonic()
        try:
            thin = _import_thin(dockerd, containerd, ref, labels)
        except RuntimeError as exc:
            log.warning("importing only the new layers of %s failed, importing all of it: %s", ref, exc)
            thin = False
        if not thin:
            save = _save_command(dockerd, ref)
            try:
                containerd.import_stream(save.stdout, [ref], labels=labels)
            except BaseException:
                _abandon(save)
                raise
            _finish(save, ref)
        report.timings["import_thin" if thin else "import_full"] = round(time.monotonic() - t0, 1)
    return report, round(time.monotonic() - t0, 1)


def build(targets: list[str]) -> list[ImageBuild]:
    """Build (or find) the targets in the daemon's data root."""
    run(["sh", NODE_DIR / "install-packages.sh"], capture=False)
    with Dockerd() as dockerd:
        return [ensure_built(target, dockerd) for target in targets]


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    targets = sys.argv[1:] or list(REFS)
    unknown = set(targets) - set(REFS)
    if unknown:
        sys.exit(f"unknown target(s) {sorted(unknown)}; the Dockerfile's are {sorted(REFS)}")
    t0 = time.monotonic()
    for report in build(targets):
        print(json.dumps({"ref": report.ref, "key": report.key, "cached": report.cached,
                          "timings": report.timings, "sizes": report.sizes}))  # fmt: skip
    print(json.dumps({"seconds": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
