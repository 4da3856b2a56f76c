"""The SDK on the real node, as an ML engineer uses it: a Python script and a notebook submit work,
wait for it, stream its logs and read its progress, with nothing but the distribution and a
kubeconfig. The operator here runs under the chart's RBAC; the SDK logs in with the cluster admin's
kubeconfig (a user's), given through ``KUBECONFIG`` as a notebook user would have it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.cluster.kube import Kubectl
from tests.integration.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def user_kubeconfig(real_cluster: Any, namespace: str, directory: pathlib.Path) -> pathlib.Path:
    """The cluster's kubeconfig with the test's namespace as its context's: the SDK's default
    namespace comes from it, as kubectl's does."""
    config = yaml.safe_load(pathlib.Path(real_cluster.kubeconfig).read_text())
    for context in config.get("contexts") or []:
        context["context"]["namespace"] = namespace
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def user_environment(kubeconfig: pathlib.Path) -> dict[str, str]:
    """A user's environment: the kubeconfig, and phalanx importable from this checkout."""
    environment = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), environment.get("PYTHONPATH", "")])
    return environment


SCRIPT = """\
import json, sys
from phalanx.sdk import Client

phases = []
with Client() as client:
    job = client.submit(sys.argv[1])
    client.wait(job.name, until="Running", timeout=240, on_change=lambda s: phases.append(s.phase))
    lines = [str(line) for line in client.logs(job.name, follow=True)]
    final = client.wait(job.name, timeout=300, on_change=lambda s: phases.append(s.phase))
    progress = final.progress
    print(json.dumps({
        "phases": phases,
        "lines": lines,
        "phase": final.phase,
        "listed": [s.name for s in client.list()],
        "progress": None if progress is None else {
            "step": progress.step, "total": progress.total_steps, "percent": progress.percent,
        },
    }))
"""


def test_a_python_script_submits_the_cpu_example_waits_and_streams_its_logs(
    real_cluster: Any, kubectl: Kubectl, namespace: str, operator: OperatorProcess, tmp_path: pathlib.Path
) -> None:
    script = tmp_path / "train_on_cluster.py"
    script.write_text(SCRIPT)
    environment = user_environment(user_kubeconfig(real_cluster, namespace, tmp_path))
    done = subprocess.run(
        [sys.executable, str(script), str(ROOT / "examples" / "cpu-gloo.yaml")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    print(done.stderr[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({key: value for key, value in result.items() if key != "lines"}))
    assert result["phase"] == "Succeeded"
    assert "Running" in result["phases"] and result["phases"][-1] == "Succeeded", result["phases"]
    assert result["listed"] == ["cpu-gloo"]
    # the followed logs: both workers, from their first line to their last, in one stream
    lines: list[str] = result["lines"]
    for worker in (0, 1):
        own = [line for line in lines if line.startswith(f"[worker-{worker}] ")]
        assert any(re.search(r"joined rank=\d world_size=2", line) for line in own), own[:20]
        assert any("phalanx-demo: done" in line for line in own), own[-20:]
    # the demo steps in TrainingSession.steps, which reports progress from rank 0
    assert result["progress"] == {"step": 200, "total": 200, "percent": 100}, result["progress"]


def test_the_sdk_documents_example_runs_in_a_notebook_kernel(
    real_cluster: Any,
    kubectl: Kubectl,
    namespace: str,
    operator: OperatorProcess,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/sdk.md's notebook cells as they stand, from submit_function to the job's deletion."""
    import nbformat
    from nbclient import NotebookClient

    from tests.integration.test_sdk_notebook import docs_cells

    cells = [nbformat.v4.new_code_cell(cell) for cell in docs_cells()]  # type: ignore[no-untyped-call]
    notebook = nbformat.v4.new_notebook(cells=cells)  # type: ignore[no-untyped-call]
    # the kernel is a process of its own: it reads the environment it is started with
    for key, value in user_environment(user_kubeconfig(real_cluster, namespace, tmp_path)).items():
        if key in ("KUBECONFIG", "PYTHONPATH"):
            monkeypatch.setenv(key, value)
    where = {"metadata": {"path": str(tmp_path)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=where).execute()
    nbformat.write(notebook, tmp_path / "sdk.ipynb")  # type: ignore[no-untyped-call]
    outputs = []
    for number, cell in enumerate(notebook.cells, 1):
        for output in cell.get("outputs", []):
            text = output.get("text") or (output.get("data") or {}).get("text/plain") or ""
            outputs.append(f"[cell {number}] {text}")
    shown = "\n".join(outputs)
    print(f"--- notebook outputs ---\n{shown}")
    # the example prints the final status with its progress, then deletes the job
    assert re.search(r"Succeeded Progress\(step=200, total_steps=200, percent=100", shown), shown[-4000:]
    assert re.search(r"metrics=\{'loss': Metric\(value=", shown), shown[-4000:]
    assert not kubectl.list("tj", namespace, None)


def test_a_transformers_trainer_shows_its_progress_in_status_and_kubectl_get(
    real_cluster: Any, kubectl: Kubectl, namespace: str, operator: OperatorProcess, tmp_path: pathlib.Path
) -> None:
    """examples/transformers-progress shipped by submit_script: the callback's reports reach
    status.progress (percent, ETA, the logged loss) and the PROGRESS column while it trains."""
    from phalanx.sdk import Client

    steps = 300
    with Client(kubeconfig=str(real_cluster.kubeconfig), namespace=namespace) as client:
        job = client.submit_script(
            ROOT / "examples" / "transformers-progress",
            entry="train.py",
            args=["--steps", str(steps), "--step-seconds", "0.15", "--logging-steps", "10"],
            workers=2,
            name="hf-progress",
            cpu="500m",
            memory="1Gi",
        )
        client.wait(job.name, until="Running", timeout=300)

        def training_progress() -> dict[str, Any] | None:
            status = (kubectl.get("tj", job.name, namespace) or {}).get("status") or {}
            progress = status.get("progress") or {}
            metrics = {metric["name"] for metric in progress.get("metrics") or []}
            if status.get("phase") == "Running" and progress.get("etaSeconds") and "loss" in metrics:
                return progress
            return None

        during = kubectl.wait_for(training_progress, timeout=240, interval=1.0, what="an ETA and the loss")
        assert isinstance(during, dict)
        table = kubectl.run("get", "tj", job.name, f"--namespace={namespace}").stdout
        print(f"status.progress while training: {json.dumps(during)}\n{table}")
        header, row = table.splitlines()[:2]
        assert "PROGRESS" in header.split()
        column = row[header.index("PROGRESS") :]
        assert re.match(r"\d+%", column), table
        assert 0 < during["step"] < steps and during["totalSteps"] == steps
        assert 0 <= during["percent"] < 100 and during["etaSeconds"] > 0
        loss = next(metric for metric in during["metrics"] if metric["name"] == "loss")
        assert loss["step"] <= during["step"] and loss["value"] > 0

        final = client.wait(job.name, timeout=300)
    after = final.raw.get("status", {}).get("progress") or {}
    print(f"status.progress at the end: {json.dumps(after)}")
    assert final.phase == "Succeeded"
    assert after["step"] == steps and after["percent"] == 100 and "etaSeconds" not in after
