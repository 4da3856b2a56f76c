"""Packaging: operator/ is a source root that never shadows the standard library's operator."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_operator_directory_holds_no_python_of_its_own() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not list((ROOT / "operator").glob("*.py"))


def test_import_operator_still_gives_the_standard_library() -> None:
    code = "import operator, sys; print(operator.__file__); print(operator.itemgetter)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}", "PATH": "/usr/bin:/bin"},
    )
    path = Path(result.stdout.splitlines()[0]).resolve()
    assert path.is_relative_to(Path(sys.base_prefix).resolve()), path


@pytest.fixture(scope="module")
def wheel(wheels: dict[str, Path]) -> Path:
    """The operator's wheel (conftest.py builds it and phalanx-worker's)."""
    return wheels["phalanx"]


def test_wheel_contains_phalanx_and_no_operator_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "phalanx/__init__.py" in names
    assert "phalanx/py.typed" in names
    assert not [name for name in names if name.startswith("operator/")]
    assert not [name for name in names if name.startswith("phalanx/worker/")]  # phalanx-worker's
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "phalanx = phalanx.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_wheel_imports_after_install(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )
    code = "import phalanx, phalanx.api.crd, operator; print(phalanx.__file__, operator.__name__)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert str(target) in result.stdout


def test_plan_and_convert_work_on_a_fresh_install_without_a_cluster(wheel: Path, tmp_path: Path) -> None:
    """The operator's wheel in a new venv with its dependencies (pinned to this venv's versions, so
    pip's cache serves them), no kubeconfig anywhere: plan and convert work, describe says why not."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
    ).stdout
    (tmp_path / "constraints.txt").write_text(frozen)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "--disable-pip-version-check",
         "install", "--quiet", "--constraint", str(tmp_path / "constraints.txt"), str(wheel)],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home)}

    def phalanx(*argv: str, stdin: str | None = None, program: str = "phalanx") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(venv / "bin" / program), *argv],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=False,
        )

    planned = phalanx("plan", "examples/cpu-gloo.yaml")
    assert planned.returncode == 0 and "trainingjob/cpu-gloo (namespace default): accepted" in planned.stdout
    converted = phalanx("convert", "tests/fixtures/kubeflow/cpu-demo.yaml")
    assert converted.returncode == 0 and "kind: TrainingJob" in converted.stdout, converted.stderr
    replanned = phalanx("plan", "-", stdin=converted.stdout, program="kubectl-phalanx")
    assert replanned.returncode == 0 and ": accepted" in replanned.stdout, replanned.stderr
    described = phalanx("describe", "demo")
    assert described.returncode == 1 and described.stderr.count("\n") == 1, described.stderr
