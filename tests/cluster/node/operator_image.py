"""The operator image for the real node, built from the repository's Dockerfile (``operator``
target) by a private, throw-away dockerd, and cached by a hash of its inputs.

No registry is reachable here, so ``BASE_IMAGE`` is a Debian bookworm + python3 image made
locally: the debootstrap tree of :func:`images.debian_rootfs` is ``docker import``-ed, then two
build-only settings are added on top (a generated one-line Dockerfile), so that the repository's
Dockerfile stays exactly what users build with ``python:3.11-slim-bookworm``:

* ``PIP_BREAK_SYSTEM_PACKAGES=1``: Debian's python3 marks itself externally managed (PEP 668);
  the official python image does not, and the Dockerfile installs with plain ``pip install``;
* the host's CA bundle as ``/etc/ssl/certs/phalanx-build-ca.crt`` with ``PIP_CERT`` pointing at
  it: this CI reaches PyPI through a TLS-intercepting proxy whose CA only the host's bundle has.

Then ``docker build --network host --target operator --build-arg BASE_IMAGE=<base>`` (the
classic builder, ``DOCKER_BUILDKIT=0``: BuildKit would try to pull the ``# syntax=`` frontend
image from Docker Hub), ``docker save`` to ``<cache>/node/images/operator-<key>.tar``
(docker-archive format, tag ``phalanx.local/operator:dev``), and the daemon is stopped by PID and
its directories removed. :func:`import_operator_image` imports the archive into the real node's
containerd (pinned, labelled with the key, skipped when already there).

The daemon (Debian's docker.io 20.10) is private: own ``--data-root`` (under the cache dir,
removed afterwards), ``--exec-root``/``--pidfile``/socket under ``/run/phx-dockerd-<random>``,
its own managed containerd, no bridge, no iptables/ip-forward/masquerading changes, and
``--oom-score-adjust=0`` (lowering it needs CAP_SYS_RESOURCE, which this host's bounding set
lacks).

Cache key: the Debian rootfs, the CA bundle, the Dockerfile, pyproject.toml, README.md (both
copied by the Dockerfile), every file under operator/ (minus bytecode) and this module.

``python -m tests.cluster.node.operator_image`` builds (or finds) it and prints timings/sizes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import images
from .containerd import Containerd
from .host import REPO_ROOT, HostProcess, hash_inputs, node_cache_dir, run, stop_pidfile

log = logging.getLogger(__name__)

OPERATOR_REF = "phalanx.local/operator:dev"
REPOSITORY, TAG = OPERATOR_REF.rsplit(":", 1)
BUILD_CA_PATH = "/etc/ssl/certs/phalanx-build-ca.crt"
DOCKER = "/usr/bin/docker"  # Debian's docker.io client (matches the daemon's API version)
DOCKERD = "/usr/sbin/dockerd"
# What the Dockerfile COPYs (besides itself); the build context holds only these.
CONTEXT_FILES = ("Dockerfile", "pyproject.toml", "README.md")
CONTEXT_DIRS = ("operator",)


def _context_inputs() -> list[Path]:
    files = [REPO_ROOT / f for f in CONTEXT_FILES]
    for d in CONTEXT_DIRS:
        files += [
            p
            for p in (REPO_ROOT / d).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]  # fmt: skip
    return sorted(files)


def image_key(rootfs: Path) -> str:
    inputs = _context_inputs()
    return hash_inputs(
        rootfs.name,
        images._host_ca_bundle(),
        *[str(p.relative_to(REPO_ROOT)) for p in inputs],
        *inputs,
        Path(__file__),
        "operator-v1",
    )[:16]


class Dockerd:
    """A private dockerd; use as a context manager (stopped by PID, directories removed)."""

    def __init__(self, work: Path) -> None:
        self.work = work  # data root and log live here
        self.exec_root = Path(f"/run/phx-dockerd-{secrets.token_hex(4)}")  # short: socket path
        self.socket = self.exec_root / "docker.sock"
        self.proc = HostProcess(
            "dockerd",
            [
                DOCKERD,
                f"--config-file={work / 'daemon.json'}",  # never the host's /etc/docker/daemon.json
                f"--data-root={work / 'data'}",
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
            log_dir=work,
            pid_dir=work,
        )

    def docker(self, *args: str | Path, timeout: float = 600, input: str | None = None) -> str:
        return run(
            [DOCKER, f"--host=unix://{self.socket}", *map(str, args)],
            env={"DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(self.work / "client")},
            timeout=timeout,
            input=input,
        ).stdout

    def __enter__(self) -> Dockerd:
        self.exec_root.mkdir(parents=True)
        (self.work / "exec-root").write_text(f"{self.exec_root}\n")  # for _cleanup_stale()
        (self.work / "daemon.json").write_text("{}\n")
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

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(timeout=30)
        Containerd.unmount_under(self.exec_root)
        Containerd.unmount_under(self.work)
        shutil.rmtree(self.exec_root, ignore_errors=True)
        for empty in ("/run/docker/plugins", "/run/docker"):  # made by every dockerd, if empty
            with contextlib.suppress(OSError):
                os.rmdir(empty)


def _remove_workdir(work: Path) -> None:
    stop_pidfile(work / "dockerd.pid")  # only if that PID still is a dockerd
    exec_root = work / "exec-root"
    if exec_root.exists():
        old = Path(exec_root.read_text().strip())
        Containerd.unmount_under(old)
        shutil.rmtree(old, ignore_errors=True)
    Containerd.unmount_under(work)
    shutil.rmtree(work, ignore_errors=True)


def _cleanup_stale() -> None:
    """Stop the dockerd and remove the directories of builds that died (their lock is free);
    builds still running in other processes hold their lock and are left alone."""
    for work in node_cache_dir().glob("dockerd-*"):
        try:
            fd = os.open(work / "lock", os.O_RDWR)
        except OSError:
            continue  # not yet set up, or already gone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        finally:
            os.close(fd)  # closing also drops a lock we got; the directory goes next
        log.warning("removing the leftovers of an interrupted operator image build: %s", work)
        _remove_workdir(work)


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    _cleanup_stale()
    work = Path(tempfile.mkdtemp(prefix="dockerd-", dir=node_cache_dir()))
    fd = os.open(work / "lock", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield work
    finally:
        _remove_workdir(work)
        os.close(fd)


def _base_image(dockerd: Dockerd, rootfs: Path, work: Path, key: str) -> str:
    """Import the debootstrap tree and add the two build settings (see the module docstring)."""
    raw = f"phalanx.local/debian-python-raw:{key}"
    proc = subprocess.Popen(
        ["tar", "-C", str(rootfs), "--exclude=./.complete", "--numeric-owner", "-cf", "-", "."],
        stdout=subprocess.PIPE,
    )
    try:
        run_import = subprocess.run(
            [DOCKER, f"--host=unix://{dockerd.socket}", "import", "-", raw],
            stdin=proc.stdout,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
        proc.wait()
    if run_import.returncode != 0 or proc.returncode != 0:
        raise RuntimeError(f"docker import of {rootfs} failed: {run_import.stderr}")
    ctx = work / "base-context"
    ctx.mkdir()
    shutil.copy2(images._host_ca_bundle(), ctx / "ca.crt")
    (ctx / "Dockerfile").write_text(
        f"FROM {raw}\n"
        f"COPY ca.crt {BUILD_CA_PATH}\n"
        f"ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_CERT={BUILD_CA_PATH} PIP_DISABLE_PIP_VERSION_CHECK=1\n"
    )
    base = f"phalanx.local/debian-python:{key}"
    dockerd.docker("build", "--quiet", "--tag", base, ctx)
    return base


def build_operator_image() -> images.BuildReport:
    """Build (or find in the cache) ``phalanx.local/operator:dev`` as a docker-archive tarball."""
    rootfs, t_debootstrap = images.debian_rootfs()
    key = image_key(rootfs)
    images_dir = node_cache_dir() / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    out = images_dir / f"operator-{key}.tar"
    meta_path = out.with_suffix(".json")
    report = images.BuildReport(out, OPERATOR_REF, cached=out.exists() and meta_path.exists())
    if t_debootstrap is not None:
        report.timings["debootstrap"] = round(t_debootstrap, 1)
    if report.cached:
        report.sizes.update(json.loads(meta_path.read_text())["sizes"])
        return report
    run(["sh", images.NODE_DIR / "install-packages.sh"], capture=False)
    t_total = time.monotonic()
    with _workdir() as work:
        ctx = work / "context"
        ctx.mkdir()
        for path in _context_inputs():
            dst = ctx / path.relative_to(REPO_ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst)
        t0 = time.monotonic()
        with Dockerd(work) as dockerd:
            report.timings["dockerd_start"] = round(time.monotonic() - t0, 1)
            with images._timed(report, "base_image"):
                base = _base_image(dockerd, rootfs, work, key)
            with images._timed(report, "docker_build"):
                dockerd.docker(
                    "build", "--network=host", "--target=operator", f"--build-arg=BASE_IMAGE={base}",
                    f"--label=dev.phalanx.image-key={key}", f"--tag={OPERATOR_REF}", ctx,
                )  # fmt: skip
            inspect: list[dict[str, Any]] = json.loads(dockerd.docker("image", "inspect", OPERATOR_REF))
            report.sizes["image"] = int(inspect[0]["Size"])
            tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
            with images._timed(report, "docker_save"):
                dockerd.docker("save", f"--output={tmp}", OPERATOR_REF)
            tmp.rename(out)
    report.sizes["archive"] = out.stat().st_size
    report.timings["total"] = round(time.monotonic() - t_total, 1)
    meta_path.write_text(json.dumps({"sizes": report.sizes, "timings": report.timings}))
    images._prune(images_dir, "operator-*.json", keep=2, also=lambda p: [p.with_suffix(".tar")])
    return report


def import_operator_image(containerd: Containerd, report: images.BuildReport | None = None) -> float | None:
    """Import the image into the node's containerd unless it is there with this key (pinned)."""
    report = report or build_operator_image()
    return containerd.ensure_image(report.archive, report.archive.stem, refs=[report.ref])


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    t0 = time.monotonic()
    rep = build_operator_image()
    print(
        json.dumps(
            {
                "ref": rep.ref,
                "archive": str(rep.archive),
                "cached": rep.cached,
                "seconds": round(time.monotonic() - t0, 1),
                "timings": rep.timings,
                "sizes": rep.sizes,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
    sys.exit(0)
