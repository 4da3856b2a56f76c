"""The import-linter contracts (layers, pure api and reconcile, the CLI through cluster) hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    result = subprocess.run(
        [lint_imports],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(ROOT / "operator"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"{contracts} kept, 0 broken" in result.stdout
