"""Fixtures shared by the unit tests: the two wheels this repository builds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the Dockerfile's build context holds (.dockerignore), so a stale build/ or egg-info of the
# checkout never reaches a wheel built here, and the checkout gets none written into it.
SOURCES = ("pyproject.toml", "README.md", "operator", "worker/pyproject.toml", "worker/README.md")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"phalanx": <operator wheel>, "phalanx-worker": <worker wheel>}``, built from a clean copy
    of the sources with ``python -m build --wheel --no-isolation`` (setuptools from this venv)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        source, target = ROOT / name, src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=IGNORED)
        else:
            shutil.copy2(source, target)
    out = tmp_path_factory.mktemp("dist")
    for project in (src, src / "worker"):
        subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(project)],
            check=True,
            capture_output=True,
        )
    return {"phalanx": next(out.glob("phalanx-*.whl")), "phalanx-worker": next(out.glob("phalanx_worker-*.whl"))}
