"""Locate (and, if missing, build) the third-party binaries the cluster tiers need.

The binaries are built by ``tests/cluster/build-binaries.sh`` from the wrapper Go modules under
``tests/cluster/go/`` into ``${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/phalanx}/bin/
<module>-<version>/``. Nothing here touches the network when the cache is complete.

    from tests.cluster.binaries import ensure_binaries
    bins = ensure_binaries()                        # every binary, builds what is missing
    bins = ensure_binaries(["kubelet", "coredns"])  # only the modules providing these
    bins["kube-apiserver"]  # -> pathlib.Path
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterable

HERE = pathlib.Path(__file__).resolve().parent
GO_DIR = HERE / "go"
BUILD_SCRIPT = HERE / "build-binaries.sh"

# module name -> (wrapper directory, Go module path, binaries)
MODULES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kubernetes": (
        "k8s",
        "k8s.io/kubernetes",
        (
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubelet",
            "kube-proxy",
            "kubectl",
        ),
    ),
    "etcd": ("etcd", "go.etcd.io/etcd/server/v3", ("etcd",)),
    "kwok": ("kwok", "sigs.k8s.io/kwok", ("kwok",)),
    "coredns": ("coredns", "github.com/coredns/coredns", ("coredns",)),
    "helm": ("helm", "helm.sh/helm/v3", ("helm",)),
    "scheduler-plugins": (
        "scheduler-plugins",
        "sigs.k8s.io/scheduler-plugins",
        ("scheduler-plugins-scheduler", "scheduler-plugins-controller"),
    ),
    "kueue": ("kueue", "sigs.k8s.io/kueue", ("kueue",)),
    "prometheus": ("prometheus", "github.com/prometheus/prometheus", ("promtool",)),
    # our own program (main.go beside its go.mod): kstatus and Argo CD's Lua judging TrainingJobs
    "gitops-checks": ("gitops-checks", "phalanx.invalid/tests/cluster/go/gitops-checks", ("gitops-checks",)),
    # Kubeflow's operator, only for tests/benchmarks/bench_scale.py (built when first asked for)
    "training-operator": ("training-operator", "github.com/kubeflow/training-operator", ("training-operator",)),
}

BINARY_MODULE: dict[str, str] = {b: m for m, (_, _, bins) in MODULES.items() for b in bins}
# Built only when asked for by name (build-binaries.sh's ALL_MODULES leaves them out too).
BENCHMARK_ONLY_MODULES = ("training-operator",)

# What a control plane + KWOK cluster needs.
CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
)


OWN_MODULE_PREFIX = "phalanx.invalid/"


class BinaryBuildError(RuntimeError):
    pass


def cache_dir() -> pathlib.Path:
    explicit = os.environ.get("PHALANX_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(xdg) / "phalanx"


def bin_root() -> pathlib.Path:
    return cache_dir() / "bin"


def module_version(module: str) -> str:
    """The version a wrapper go.mod requires, read without Go or the network."""
    wrapper, path, _ = MODULES[module]
    if path.startswith(OWN_MODULE_PREFIX):
        # our own program: a digest of its sources (build-binaries.sh computes the same)
        sources = [GO_DIR / wrapper / name for name in ("go.mod", "go.sum")]
        sources += sorted((GO_DIR / wrapper).glob("*.go"))
        return "src-" + hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    text = (GO_DIR / wrapper / "go.mod").read_text()
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(path)}\s+(v\S+)", text, re.MULTILINE)
    if not m:
        raise BinaryBuildError(f"no requirement for {path} in {GO_DIR / wrapper / 'go.mod'}")
    return m.group(1)


def versions() -> dict[str, str]:
    return {m: module_version(m) for m in MODULES}


def module_source(module: str) -> pathlib.Path:
    """The module's own files (CRDs, manifests) in the Go module cache, downloaded if missing: the
    same download its binaries were built from."""
    wrapper, path, _ = MODULES[module]
    env = {**os.environ, "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"}
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{path}@{module_version(module)}"],
        cwd=GO_DIR / wrapper,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BinaryBuildError(f"go mod download {path}: {proc.stdout.strip()} {proc.stderr.strip()}")
    return pathlib.Path(json.loads(proc.stdout)["Dir"])


def module_dir(module: str) -> pathlib.Path:
    return bin_root() / f"{module}-{module_version(module)}"


def binary_path(name: str) -> pathlib.Path:
    return module_dir(BINARY_MODULE[name]) / name


def _missing(names: Iterable[str]) -> list[str]:
    return [n for n in names if not os.access(binary_path(n), os.X_OK)]


def ensure_binaries(names: Iterable[str] | None = None, *, quiet: bool = False) -> dict[str, pathlib.Path]:
    """Return {binary name: path}, building the modules of any missing binary first.

    ``names`` restricts the set (default: every binary the tests need). A cold build of the
    kubernetes module takes tens of minutes on 2 cores; with the cache present this returns at once.
    """
    if names is None:
        names = [b for b, m in BINARY_MODULE.items() if m not in BENCHMARK_ONLY_MODULES]
    wanted = list(names)
    unknown = [n for n in wanted if n not in BINARY_MODULE]
    if unknown:
        raise KeyError(f"unknown binaries {unknown}; known: {sorted(BINARY_MODULE)}")
    missing = _missing(wanted)
    if missing:
        modules = sorted({BINARY_MODULE[n] for n in missing}, key=list(MODULES).index)
        out = subprocess.DEVNULL if quiet else sys.stderr
        proc = subprocess.run(
            ["bash", str(BUILD_SCRIPT), *modules],
            stdout=out,
            stderr=out,
            check=False,
        )
        still = _missing(wanted)
        if proc.returncode != 0 or still:
            raise BinaryBuildError(f"build-binaries.sh {' '.join(modules)} exited {proc.returncode}; missing: {still}")
    return {n: binary_path(n) for n in wanted}


if __name__ == "__main__":  # python -m tests.cluster.binaries [name...]
    for name, path in ensure_binaries(sys.argv[1:] or None).items():
        print(f"{name}\t{path}")
