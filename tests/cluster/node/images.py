"""Images for the real-node tier, built locally and cached by a hash of their inputs.

* ``registry.k8s.io/pause:3.10.1``: one static binary compiled from ``pause.c``.
* ``phalanx.local/trainer:dev``: Debian bookworm (debootstrap minbase) + python3 + a venv in
  /opt/venv with ``torch`` (from the wheel cache, ``--no-index``) in layer 1, and the phalanx
  package from this repository in layer 2 (``pip install --target /opt/phalanx/site`` plus a
  ``.pth`` file), so a change to phalanx only rebuilds the small layer.

Cache layout (``<cache>`` = ``${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/phalanx}``):

    <cache>/wheels/                      pip wheel cache (torch and its deps), see ensure_wheels()
    <cache>/node/rootfs/<key>/           debootstrap result
    <cache>/node/layers/<key>.tar        built layers
    <cache>/node/images/<name>-<key>.tar image archives for ``ctr images import``

Run ``python -m tests.cluster.node.images`` to build everything and print timings/sizes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import oci
from .host import NODE_DIR, REPO_ROOT, cache_dir, hash_inputs, node_cache_dir, run

log = logging.getLogger(__name__)

PAUSE_REF = "registry.k8s.io/pause:3.10.1"
TRAINER_REF = "phalanx.local/trainer:dev"
WORKER_EXTRA = "worker"  # phalanx's extra for the in-pod helper (numpy for torch.distributed.checkpoint)
TORCH_REQUIREMENT = os.environ.get("PHALANX_TORCH_REQUIREMENT", "torch==2.13.0")
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("PHALANX_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_PACKAGES = ["python3", "python3-venv", "python3-pip", "ca-certificates", "iproute2", "procps", "netbase"]
VENV = "/opt/venv"
PHALANX_SITE = "/opt/phalanx/site"
PY_SITE = f"{VENV}/lib/python3.11/site-packages"

TRAINER_ENV = {
    "PATH": f"{VENV}/bin:{PHALANX_SITE}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "VIRTUAL_ENV": VENV,
    "PYTHONUNBUFFERED": "1",
    "LANG": "C.UTF-8",
}


@dataclass
class BuildReport:
    """What a build did; times in seconds, sizes in bytes."""

    archive: Path
    ref: str
    cached: bool
    thin_archive: Path | None = None  # same image without the base layer (see oci.py)
    thin_needs: tuple[str, ...] = ()  # blobs the thin archive expects in containerd
    writer: Callable[[], Path] | None = None  # writes the full archive if it is missing
    timings: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def ensure_archive(self) -> Path:
        """The full archive, written now if it was deferred."""
        return self.writer() if self.writer is not None else self.archive


@contextlib.contextmanager
def _timed(report: BuildReport, name: str):
    t0 = time.monotonic()
    try:
        yield
    finally:
        report.timings[name] = round(time.monotonic() - t0, 1)


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
    with _timed(report, "build"), tempfile.TemporaryDirectory(prefix="pause-") as tmp:
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
    {p.name for p in dest.glob("*.whl")}
    cmd = [
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


@contextlib.contextmanager
def _chroot_mounts(root: Path, binds: dict[str, Path]):
    """Mount /proc, /dev (bind) and ``binds`` ({path in root: host dir}) for a chroot."""
    mounted: list[Path] = []
    try:
        for inner, host in [("proc", None), ("dev", Path("/dev"))] + [(k.lstrip("/"), v) for k, v in binds.items()]:
            target = root / inner
            target.mkdir(parents=True, exist_ok=True)
            if host is None:
                run(["mount", "-t", "proc", "proc", target])
            else:
                run(["mount", "--bind", host, target])
            mounted.append(target)
        yield
    finally:
        for target in reversed(mounted):
            run(["umount", "-l", target], check=False)
        for inner in binds:
            with contextlib.suppress(OSError):
                (root / inner.lstrip("/")).rmdir()


def _chroot(root: Path, *cmd: str, env: dict[str, str] | None = None, timeout: float = 3600):
    base_env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_ROOT_USER_ACTION": "ignore",
    }
    base_env.update(env or {})
    return subprocess.run(["chroot", str(root), *cmd], env=base_env, check=True, timeout=timeout)


# ----------------------------------------------------------------------------- trainer


def _repo_inputs() -> list[Path]:
    """Files of the phalanx package (for the layer-2 cache key): git-visible, minus tests."""
    try:
        out = run(["git", "-C", REPO_ROOT, "ls-files", "-co", "--exclude-standard"]).stdout.split("\n")
    except RuntimeError:
        return []
    skip = ("tests/", "docs/", ".github/")
    return sorted(REPO_ROOT / p for p in out if p and not p.startswith(skip) and (REPO_ROOT / p).is_file())


def _project_requirements() -> list[str]:
    """Runtime dependencies (with the ``worker`` extra) and build requirements of pyproject.toml."""
    import tomllib

    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    project = data.get("project", {})
    return sorted(
        set(project.get("dependencies", []))
        | set(project.get("optional-dependencies", {}).get(WORKER_EXTRA, []))
        | set(data.get("build-system", {}).get("requires", []))
    )


def _has_project() -> bool:
    return (REPO_ROOT / "pyproject.toml").exists() or (REPO_ROOT / "setup.py").exists()


def build_trainer_image(install_phalanx: bool = True, full_archive: bool = False) -> BuildReport:
    """Build (or reuse from cache) the trainer image.

    Always produces the cached layers and, when phalanx is installed, a *thin* archive
    (without the multi-GB base layer). The full archive is written only on demand
    (:meth:`BuildReport.ensure_archive`, or ``full_archive=True``): containerd needs it only
    when its content store does not yet hold the base layer.
    """
    report_timings: dict[str, float] = {}
    wheels = ensure_wheels()
    rootfs, t_debootstrap = debian_rootfs()
    if t_debootstrap is not None:
        report_timings["debootstrap"] = round(t_debootstrap, 1)
    wheel_names = "\n".join(f"{w.name}:{w.stat().st_size}" for w in wheels)
    base_key = hash_inputs(rootfs.name, TORCH_REQUIREMENT, wheel_names, "base-v1")[:16]
    repo_files = _repo_inputs() if install_phalanx and _has_project() else []
    app_key = hash_inputs(base_key, *[str(p.relative_to(REPO_ROOT)) for p in repo_files], *repo_files, "app-v3")[:16]
    key = hash_inputs(base_key, app_key, json.dumps(TRAINER_ENV, sort_keys=True), Path(oci.__file__), "oci-v1")[:16]
    images_dir = node_cache_dir() / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    out = images_dir / f"trainer-{key}.tar"
    thin = images_dir / f"trainer-{key}.thin.tar"
    meta_path = images_dir / f"trainer-{key}.json"
    config = {"env": TRAINER_ENV, "workdir": "/", "cmd": ["python3"], "labels": {"dev.phalanx.image-key": key}}
    report = BuildReport(out, TRAINER_REF, cached=False, timings=report_timings)

    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if (
        meta
        and "layers" in meta
        and all(Path(lay["path"]).exists() for lay in meta["layers"])
        and (out.exists() or (thin.exists() and meta["thin_needs"]))
    ):
        report.cached = True
        layers = [oci.Layer(Path(lay["path"]), lay["digest"], lay["size"]) for lay in meta["layers"]]
    else:
        layers = _build_trainer_layers(
            report, rootfs, base_key, app_key, repo_files=repo_files, install_phalanx=install_phalanx
        )
        thin_needs: list[str] = []
        with _timed(report, "write_thin_archive"):
            if len(layers) > 1:
                oci.write_oci_archive(thin, TRAINER_REF, layers, omit_layers=[layers[0].digest], **config)
                thin_needs = [layers[0].digest]
        meta = {
            "layers": [{"path": str(lay.path), "digest": lay.digest, "size": lay.size} for lay in layers],
            "thin_needs": thin_needs,
        }
        meta_path.write_text(json.dumps(meta))
        # keep only the newest few trainer archives / layers around
        _prune(images_dir, "trainer-*.json", keep=2, also=lambda p: [p.with_suffix(".tar"), p.with_suffix(".thin.tar")])
        _prune(node_cache_dir() / "layers", "trainer-app-*.tar", keep=3, also=lambda p: [p.with_suffix(".json")])
    if thin.exists() and meta["thin_needs"]:
        report.thin_archive, report.thin_needs = thin, tuple(meta["thin_needs"])
    report.sizes.update({f"layer{i}": lay.size for i, lay in enumerate(layers)})

    def write_full() -> Path:
        if not out.exists():
            with _timed(report, "write_full_archive"):
                oci.write_oci_archive(out, TRAINER_REF, layers, **config)
        report.sizes["archive"] = out.stat().st_size
        return out

    report.writer = write_full
    if full_archive or not report.thin_archive:
        write_full()
    return report


def _build_trainer_layers(
    report: BuildReport, rootfs: Path, base_key: str, app_key: str, *, repo_files: list[Path], install_phalanx: bool
) -> list[oci.Layer]:
    layers_dir = node_cache_dir() / "layers"
    layers_dir.mkdir(parents=True, exist_ok=True)
    base_layer_path = layers_dir / f"trainer-base-{base_key}.tar"
    base_meta = base_layer_path.with_suffix(".json")
    work = node_cache_dir() / "work"
    if base_layer_path.exists() and base_meta.exists():
        base = oci.Layer(base_layer_path, json.loads(base_meta.read_text())["digest"], base_layer_path.stat().st_size)
    else:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        tree = work / "rootfs"
        with _timed(report, "copy_rootfs"):
            run(["cp", "-a", f"{rootfs}/.", f"{tree}/"])
            (tree / ".complete").unlink(missing_ok=True)
        with _timed(report, "pip_install_torch"):
            with _chroot_mounts(tree, {"/mnt/wheels": wheels_dir()}):
                _chroot(tree, "python3", "-m", "venv", VENV)
                _chroot(
                    tree,
                    f"{VENV}/bin/pip",
                    "install",
                    "--quiet",
                    "--no-index",
                    "--find-links",
                    "/mnt/wheels",
                    TORCH_REQUIREMENT,
                )
            shutil.rmtree(tree / "root/.cache", ignore_errors=True)
        with _timed(report, "tar_base_layer"):
            base = oci.write_layer(tree, base_layer_path)
            base_meta.write_text(json.dumps({"digest": base.digest}))
        shutil.rmtree(work)
        # an older base layer is dead weight now (GBs)
        _prune(layers_dir, "trainer-base-*.tar", keep=1, also=lambda p: [p.with_suffix(".json")])
    layers = [base]
    if repo_files:
        with _timed(report, "pip_install_phalanx"):
            layers.append(_phalanx_layer(rootfs, layers_dir / f"trainer-app-{app_key}.tar"))
    elif install_phalanx:
        log.warning("no pyproject.toml in %s yet: trainer image built WITHOUT phalanx", REPO_ROOT)
    return layers


def _phalanx_layer(rootfs: Path, out: Path) -> oci.Layer:
    """Layer 2: ``pip install --target`` of this repository, using the debian rootfs's pip.

    Runs in a throw-away overlay-free copy: a bind mount of the source (read-only copy in a
    temp dir, so build artefacts never land in the checkout) and an output dir.
    """
    meta = out.with_suffix(".json")
    if out.exists() and meta.exists():
        return oci.Layer(out, json.loads(meta.read_text())["digest"], out.stat().st_size)
    work = Path(tempfile.mkdtemp(prefix="phalanx-app-", dir=node_cache_dir()))
    try:
        src = work / "src"
        files = _repo_inputs()
        for f in files:
            dst = src / f.relative_to(REPO_ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
        layer_root = work / "layer"
        site = layer_root / PHALANX_SITE.lstrip("/")
        site.mkdir(parents=True)
        pth = layer_root / PY_SITE.lstrip("/") / "zz-phalanx.pth"
        pth.parent.mkdir(parents=True)
        pth.write_text(PHALANX_SITE + "\n")
        resolv = rootfs / "etc/resolv.conf"
        saved = resolv.read_bytes() if resolv.exists() else b""
        shutil.copy2("/etc/resolv.conf", resolv)
        # The host may reach PyPI through a TLS-intercepting proxy whose CA only the host's
        # bundle has: hand that bundle to pip inside the chroot.
        ca_dir = work / "ca"
        ca_dir.mkdir()
        shutil.copy2(_host_ca_bundle(), ca_dir / "ca.crt")
        pip = [
            "python3",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--break-system-packages",
            "--target",
            "/mnt/out",
            "--find-links",
            "/mnt/wheels",
        ]
        offline = False
        if (REPO_ROOT / "pyproject.toml").exists():
            # dependencies (and the build backend) come from the wheel cache: no network
            # after the first build with a given dependency list
            try:
                ensure_wheels(_project_requirements())
                offline = True
            except RuntimeError as exc:  # e.g. a dependency without a wheel: use the index
                log.warning("could not cache phalanx dependencies as wheels: %s", exc)
        env = {"PIP_CERT": "/mnt/ca/ca.crt", "SSL_CERT_FILE": "/mnt/ca/ca.crt", "PIP_DEFAULT_TIMEOUT": "180"}
        binds = {"/mnt/src": src, "/mnt/out": site, "/mnt/wheels": wheels_dir(), "/mnt/ca": ca_dir}
        try:
            with _chroot_mounts(rootfs, binds):
                try:
                    _chroot(rootfs, *pip, *(["--no-index"] if offline else []), f"/mnt/src[{WORKER_EXTRA}]", env=env)
                except subprocess.CalledProcessError:
                    if not offline:
                        raise
                    log.warning("offline install of phalanx failed; retrying with the package index")
                    for child in site.iterdir():
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
                    _chroot(rootfs, *pip, f"/mnt/src[{WORKER_EXTRA}]", env=env)
        finally:
            resolv.write_bytes(saved)
        # console scripts were written for the chroot's /usr/bin/python3; they must run with the
        # venv's interpreter, which sees /opt/phalanx/site through zz-phalanx.pth
        for script in (site / "bin").glob("*") if (site / "bin").is_dir() else []:
            data = script.read_bytes()
            if data.startswith(b"#!/usr/bin/python3"):
                script.write_bytes(b"#!" + f"{VENV}/bin/python3".encode() + data[len(b"#!/usr/bin/python3") :])
        layer = oci.write_layer(layer_root, out)
        meta.write_text(json.dumps({"digest": layer.digest}))
        return layer
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _host_ca_bundle() -> Path:
    for cand in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise RuntimeError("no CA bundle found for pip inside the image build chroot")


def _prune(directory: Path, pattern: str, keep: int, also=None) -> None:
    """Delete all but the ``keep`` newest files matching ``pattern`` (and ``also(file)``)."""
    files = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[keep:]:
        for f in [old, *(also(old) if also else [])]:
            f.unlink(missing_ok=True)


def main() -> None:
    """``python -m tests.cluster.node.images [--full]``: build what is missing, print timings.
    ``--full`` also writes the full trainer archive (otherwise written on first need)."""
    logging.basicConfig(level=logging.INFO)
    full = "--full" in sys.argv[1:]
    for build in (build_pause_image, lambda: build_trainer_image(full_archive=full)):
        t0 = time.monotonic()
        rep = build()
        print(
            json.dumps(
                {
                    "ref": rep.ref,
                    "archive": str(rep.archive),
                    "thin_archive": str(rep.thin_archive) if rep.thin_archive else None,
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
