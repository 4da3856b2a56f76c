"""phalanx-worker: the in-pod helper as a distribution of its own, for training images.

Two wheels come from one source tree (operator/): ``phalanx`` (the operator, pyproject.toml)
without ``phalanx.worker``, and ``phalanx-worker`` (worker/pyproject.toml) with nothing else.
Installed alone, phalanx-worker brings prometheus-client and numpy and no operator code or
dependency; installed next to the operator, both land in one ``phalanx/`` directory.

The venvs here get numpy and prometheus-client from the phalanx wheel cache (filled by
``make torch`` / ``make images``) without the network; when a wheel is not there, ``pip
download`` fetches the versions this venv has (from pip's own cache or the index).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

import phalanx
from phalanx.reconcile import naming
from phalanx.worker import protocol
from tests.cluster.node.host import cache_dir

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "operator" / "phalanx"
WORKER_SOURCE = SOURCE / "worker"
OPERATOR_ONLY = ("kopf", "pydantic", "aiohttp", "kubernetes", "pyyaml")
# What phalanx.worker may import beyond the standard library and itself: torch (the user's own
# build, imported lazily), prometheus-client (a dependency), pynvml (the nvml extra), and the
# frameworks whose progress callbacks phalanx.worker.progress makes only when asked (the user's own).
WORKER_THIRD_PARTY = {"torch", "prometheus_client", "pynvml", "transformers", "lightning", "pytorch_lightning"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject(path: Path) -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads(path.read_text())["project"]
    return project


def wheel_metadata(wheel: Path) -> tuple[list[str], Message]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        text = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    return names, Parser().parsestr(text)


# ------------------------------------------------------------------------------ sources


def test_versions_agree() -> None:
    operator, worker = pyproject(ROOT / "pyproject.toml"), pyproject(ROOT / "worker" / "pyproject.toml")
    assert worker["version"] == operator["version"] == phalanx.__version__
    assert worker["requires-python"] == operator["requires-python"]


def test_completion_key_is_one_wire_contract_on_both_sides() -> None:
    """The operator's store reads what the worker writes; neither imports the other's copy."""
    assert naming.COMPLETION_KEY == protocol.COMPLETION_KEY


def test_the_save_now_key_a_checkpoint_answered_is_one_wire_contract_on_both_sides() -> None:
    """The operator answers status.saveNow by the key a worker's metric gives: both compute it alike."""
    assert naming.CHECKPOINT_SAVE_NOW_METRIC == protocol.CHECKPOINT_SAVE_NOW_METRIC
    for token in ("t-1", "2026-12-07T03:00:23Z", "x" * 63):
        assert naming.save_now_key(token) == protocol.save_now_key(token)


def test_the_supervisor_reads_the_files_and_directory_the_operator_mounts() -> None:
    from phalanx.reconcile import desired, environment, naming

    items = {item["path"]: item["fieldRef"]["fieldPath"] for item in desired.pod_info_volume()["downwardAPI"]["items"]}
    assert set(items) == {
        protocol.ATTEMPT_FILE,
        protocol.RENDEZVOUS_ID_FILE,
        protocol.ROLE_FILE,
        protocol.WORKER_INDEX_FILE,
        protocol.RANK_ADDRESS_FILE,
    }
    assert items[protocol.ROLE_FILE] == f"metadata.labels['{naming.ROLE_LABEL}']"
    assert protocol.SPARE_ROLE == naming.ROLE_SPARE
    assert protocol.POD_INFO_DIR_ENV == "PHALANX_POD_INFO_DIR"
    assert environment.SUPERVISOR_MODULE == "phalanx.worker.supervise"
    scripts = pyproject(ROOT / "worker" / "pyproject.toml")["scripts"]
    assert scripts[environment.SUPERVISOR] == f"{environment.SUPERVISOR_MODULE}:main"


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file (lazy imports in functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            assert node.module is not None
            names.add(node.module)
    return names


def test_worker_imports_only_itself_the_standard_library_torch_and_its_dependencies() -> None:
    for path in sorted(WORKER_SOURCE.rglob("*.py")):
        for name in _imports(path):
            top = name.partition(".")[0]
            if top == "phalanx":
                assert name == "phalanx.worker" or name.startswith("phalanx.worker."), f"{path.name}: {name}"
            elif top != "__future__" and top not in sys.stdlib_module_names:
                assert top in WORKER_THIRD_PARTY, f"{path.name}: {name}"


def test_the_operator_never_imports_the_worker() -> None:
    for path in sorted(SOURCE.rglob("*.py")):
        if WORKER_SOURCE not in path.parents:
            worker = {n for n in _imports(path) if n == "phalanx.worker" or n.startswith("phalanx.worker.")}
            assert not worker, f"{path.relative_to(SOURCE)}: {worker}"


# ------------------------------------------------------------------------------ wheels


def test_the_two_wheels_split_the_source_tree(wheels: dict[str, Path]) -> None:
    operator_files, _ = wheel_metadata(wheels["phalanx"])
    worker_files, _ = wheel_metadata(wheels["phalanx-worker"])
    assert not set(operator_files) & set(worker_files)
    dist_info = f"phalanx_worker-{phalanx.__version__}.dist-info/"
    worker_code = {n for n in worker_files if not n.startswith(dist_info)}
    assert {f"{dist_info}{name}" for name in ("METADATA", "WHEEL", "RECORD")} <= set(worker_files)
    assert worker_code == {f"phalanx/worker/{p.relative_to(WORKER_SOURCE)}" for p in WORKER_SOURCE.rglob("*.py")} | {
        "phalanx/worker/py.typed"
    }
    operator_code = {n for n in operator_files if n.endswith(".py")}
    every_module = {f"phalanx/{p.relative_to(SOURCE)}" for p in SOURCE.rglob("*.py")}
    assert operator_code | (worker_code - {"phalanx/worker/py.typed"}) == every_module


def test_worker_wheel_metadata(wheels: dict[str, Path]) -> None:
    _, metadata = wheel_metadata(wheels["phalanx-worker"])
    assert metadata["Name"] == "phalanx-worker"
    assert metadata["Version"] == phalanx.__version__
    requires = {canonical(r.name): r for r in map(Requirement, metadata.get_all("Requires-Dist") or [])}
    assert not set(requires) & set(OPERATOR_ONLY) and "torch" not in requires, requires
    # lower bounds only: it joins the user's image and must not fight the user's own pins
    assert all(spec.operator == ">=" for r in requires.values() for spec in r.specifier), requires
    assert {name for name, r in requires.items() if r.marker is None} == {"prometheus-client", "numpy"}
    assert str(requires["nvidia-ml-py"].marker) == 'extra == "nvml"'
    assert metadata.get_all("Provides-Extra") == ["nvml"]


# ------------------------------------------------------------------------------ installed


def _pip(python: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """This venv's pip acting on another interpreter (pip --python): the test venvs need none."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "--no-input",
         *map(str, args)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True)
    return path / "bin" / "python"


def _site_packages(python: Path) -> Path:
    return Path(_run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())


def _run(python: Path, code: str) -> str:
    result = subprocess.run(
        [str(python), "-I", "-c", code], capture_output=True, text=True, check=False, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _wheel_cache() -> list[Path]:
    """Where `make torch` and `make images` keep wheels (images.py), and pip's usual find-links."""
    links = [cache_dir() / "wheels", *map(Path, os.environ.get("PIP_FIND_LINKS", "").split()), Path("/opt/wheels")]
    return [link for link in links if link.is_dir()]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """numpy and prometheus-client wheels of the versions this venv runs the unit tests with:
    from the phalanx wheel cache without the network, else downloaded."""
    dest = tmp_path_factory.mktemp("wheelhouse")
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in ("numpy", "prometheus-client")]
    download = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet", "--no-deps",
                "--only-binary=:all:", "--dest", str(dest), *pins]  # fmt: skip
    for link in _wheel_cache():
        download += ["--find-links", str(link)]
    offline = subprocess.run([*download, "--no-index"], capture_output=True, text=True, check=False)
    if offline.returncode != 0:
        online = subprocess.run(download, capture_output=True, text=True, check=False, timeout=300)
        assert online.returncode == 0, f"numpy/prometheus-client wheels: neither cached nor downloaded\n{online.stderr}"
    return dest


@pytest.fixture(scope="module")
def worker_only(tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path], wheelhouse: Path) -> Path:
    """A fresh venv with phalanx-worker and what it requires, nothing else (no pip either)."""
    python = _venv(tmp_path_factory.mktemp("worker-venv") / "venv")
    installed = _pip(python, "install", "--no-index", "--find-links", wheelhouse, wheels["phalanx-worker"])
    assert installed.returncode == 0, installed.stderr
    return python


INSTALLED_SET = """
import importlib.metadata as m, json
print(json.dumps(sorted((d.metadata["Name"], d.version) for d in m.distributions())))
"""


def test_installed_alone_it_brings_only_its_dependencies(worker_only: Path) -> None:
    installed = {canonical(name): version for name, version in json.loads(_run(worker_only, INSTALLED_SET))}
    assert installed == {
        "phalanx-worker": phalanx.__version__,
        "numpy": importlib.metadata.version("numpy"),
        "prometheus-client": importlib.metadata.version("prometheus-client"),
    }


IMPORT_EVERY_WORKER_MODULE = """
import importlib, importlib.util, json, pkgutil
import phalanx, phalanx.worker
modules = sorted(m.name for m in pkgutil.iter_modules(phalanx.worker.__path__))
for name in modules:
    importlib.import_module(f"phalanx.worker.{name}")
absent = [n for n in ("torch", "phalanx.api", "phalanx.cli", "kopf", "pydantic", "aiohttp", "kubernetes", "yaml")
          if importlib.util.find_spec(n) is not None]
print(json.dumps({"modules": modules, "present_but_should_not_be": absent,
                  "phalanx_file": phalanx.__file__, "phalanx_path": list(phalanx.__path__)}))
"""


def test_installed_alone_every_worker_module_imports_without_torch_or_the_operator(worker_only: Path) -> None:
    """torch is imported lazily (the user's own build comes later); `phalanx` is then a namespace
    package with phalanx.worker alone in it."""
    result = json.loads(_run(worker_only, IMPORT_EVERY_WORKER_MODULE))
    assert result["modules"] == sorted(p.stem for p in WORKER_SOURCE.glob("*.py") if p.stem != "__init__")
    assert {"backend", "checkpoint", "demo", "metrics", "protocol", "session"} <= set(result["modules"])
    assert result["present_but_should_not_be"] == []
    assert result["phalanx_file"] is None
    assert result["phalanx_path"] == [str(_site_packages(worker_only) / "phalanx")]


SERVE_METRICS = """
import urllib.request
from phalanx.worker.metrics import WorkerMetrics
metrics = WorkerMetrics()
metrics.step_done(64)
metrics.serve(0)
port = metrics._server.server_address[1]
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
metrics.close()
"""


def test_installed_alone_worker_metrics_serve(worker_only: Path) -> None:
    assert "phalanx_worker_steps_total 1.0" in _run(worker_only, SERVE_METRICS)


def test_next_to_the_operator_both_share_one_phalanx_directory(tmp_path: Path, wheels: dict[str, Path]) -> None:
    """Both wheels --no-deps into one venv (the operator's dependencies come from this venv's
    site-packages, appended to its path): both import from that venv's phalanx/; removing the
    operator leaves phalanx.worker working."""
    python = _venv(tmp_path / "venv")
    installed = _pip(python, "install", "--no-index", "--no-deps", wheels["phalanx-worker"], wheels["phalanx"])
    assert installed.returncode == 0, installed.stderr
    site = _site_packages(python)
    host = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz-test-host-dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(host)))
    code = "import phalanx, phalanx.api.crd, phalanx.worker.session; print(phalanx.__file__, phalanx.worker.__file__)"
    assert _run(python, code).split() == [
        str(site / "phalanx" / "__init__.py"),
        str(site / "phalanx/worker/__init__.py"),
    ]

    removed = _pip(python, "uninstall", "--yes", "phalanx")
    assert removed.returncode == 0, removed.stderr
    assert sorted(p.name for p in (site / "phalanx").iterdir()) == ["worker"]
    code = "import phalanx.worker.session; print(phalanx.worker.__file__)"
    assert _run(python, code).strip() == str(site / "phalanx" / "worker" / "__init__.py")
