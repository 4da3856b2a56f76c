"""The SDK in a real Jupyter kernel (nbclient) against the control plane with the operator running:
docs/sdk.md's training function, defined in a cell (its source is IPython's), shipped with
``submit_function`` from the kernel's running event loop, waited for with the progress display.
KWOK runs no trainer: the job reaching Running is the end here (the e2e tier trains for real)."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

from phalanx.sdk import Client
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import gpu_pool

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]


def docs_cells() -> list[str]:
    text = (ROOT / "docs" / "sdk.md").read_text()
    return re.findall(r"<!-- notebook cell -->\n```python\n(.*?)```", text, re.DOTALL)


@pytest.fixture
def kernel_env(kubeconfig: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel imports this checkout's phalanx and logs in with the test cluster's kubeconfig."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "operator"))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))


def test_a_notebook_ships_the_docs_function_and_waits_with_progress(
    kwok_cluster: LocalCluster,
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    operator: OperatorProcess,
    kernel_env: None,
) -> None:
    gpu_pool(kwok_cluster, kubectl, "sdk", count=1)
    train, submit, _, _ = docs_cells()
    submit = submit.replace("Client()", f"Client(namespace={namespace!r})")
    assert f"namespace={namespace!r}" in submit
    cells = [
        train,
        submit,
        'status = client.wait(job.name, until="Running", timeout=120, show_progress=True)\n'
        'print("phase", status.phase)',
        "client.close()",
    ]
    code_cells = [nbformat.v4.new_code_cell(source) for source in cells]  # type: ignore[no-untyped-call]
    notebook = nbformat.v4.new_notebook(cells=code_cells)  # type: ignore[no-untyped-call]
    NotebookClient(notebook, kernel_name="python3", timeout=180).execute()
    outputs = [cell["outputs"] for cell in notebook.cells]
    assert "".join(o.get("text", "") for o in outputs[2]).strip() == "phase Running"
    shown = [o["data"]["text/plain"] for o in outputs[2] if o["output_type"] == "display_data"]
    with Client(namespace=namespace, kubeconfig=kubeconfig) as client:
        (job,) = client.list()
        assert job.phase == "Running"
    assert shown == [f"{job.name} Running"]  # one display, updated in place to the last status
    config_map = kubectl.get("configmap", f"{job.name}-code", namespace)
    assert config_map is not None
    assert "def train(steps: int, lr: float) -> None:" in config_map["data"]["phalanx_function.py"]
    assert '"args": [\n  200\n ]' in config_map["data"]["phalanx_call.json"]
