"""Running this checkout's ``phalanx`` as a user does: ``python -m phalanx`` and, through the real
kubectl, the ``kubectl phalanx`` plugin. Commands name their kubeconfig; ``$KUBECONFIG`` is left out."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from tests.cluster.kube import find_kubectl

ROOT = pathlib.Path(__file__).resolve().parents[2]


def environment(path: str | None = None) -> dict[str, str]:
    """This checkout's phalanx first on the import path, and no $KUBECONFIG."""
    env = {key: value for key, value in os.environ.items() if key != "KUBECONFIG"}
    env["PYTHONPATH"] = f"{ROOT / 'operator'}{os.pathsep}{ROOT}"
    if path is not None:
        env["PATH"] = path
    return env


def phalanx_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", *args]


def phalanx(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        phalanx_command(*args), capture_output=True, text=True, timeout=timeout, check=False, env=environment()
    )


def plugin_path(directory: pathlib.Path) -> str:
    """A PATH on which kubectl finds ``kubectl-phalanx``: a copy, in ``directory``, of the console
    script pip writes, running this checkout (the venv's own may belong to another checkout, and
    installing this one would repoint it); then the venv's bin, where pip installed the real one."""
    venv_bin = pathlib.Path(sys.executable).parent
    assert (venv_bin / "kubectl-phalanx").is_file(), f"no kubectl-phalanx console script in {venv_bin}"
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "kubectl-phalanx"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT / 'operator')!r}, {str(ROOT)!r}]\n"
        "from phalanx.cli import main\n"
        "sys.exit(main())\n"
    )
    script.chmod(0o755)
    return os.pathsep.join([str(directory), str(venv_bin), os.environ.get("PATH", "/usr/bin:/bin")])


def kubectl_plugin(path: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``kubectl phalanx ARGS``: kubectl hands every argument after the plugin's name to it."""
    command = [str(find_kubectl()), "phalanx", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=environment(path))
