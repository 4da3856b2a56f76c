"""phalanx.localrun's runner: real processes (small Python programs, and the CPU example under torchrun).

The gang's rules hold on one machine: every worker is a process group, the first failure stops the
rest, a stop is SIGTERM then SIGKILL after the grace, and only all workers succeeding is success.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx import cli, localrun
from tests.unit.jobs import manifest
from tests.unit.test_localrun import CPU_EXAMPLE, LOCAL_CHANGES, ROOT, kubelet_environment, planned_workers


def python_job(script: str, *, workers: int = 2) -> dict[str, Any]:
    """Workers that run ``python -c script``."""
    trainer = {"name": "trainer", "image": "example/train:1", "command": [sys.executable, "-c", script]}
    return manifest(
        workers={"min": 1, "max": 4, "desired": workers},
        template={"spec": {"containers": [trainer]}},
    )


class Lines:
    """What on_line got, and a way to wait for it."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self.changed = threading.Condition()

    def __call__(self, index: int, line: str) -> None:
        with self.changed:
            self.lines.append((index, line))
            self.changed.notify_all()

    def wait_for(self, count: int, text: str, timeout: float = 60) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: sum(text in line for _, line in self.lines) >= count, timeout)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie that nobody reaped here does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_all_workers_succeeding_is_success(tmp_path: Path) -> None:
    lines = Lines()
    run = localrun.start(
        python_job("import os; print('hello', os.environ['PHALANX_WORKER_INDEX'], os.getcwd())"),
        on_line=lines,
        workdir=tmp_path,
    )
    assert run.workers == 2
    assert run.wait(timeout=120) == 0
    assert run.phase == "Succeeded"
    assert sorted(lines.lines) == [(0, f"hello 0 {tmp_path}"), (1, f"hello 1 {tmp_path}")]
    assert [env["PHALANX_WORKER_INDEX"] for env in run.environments] == ["0", "1"]
    assert not run.root.exists()  # the run's files go with it


FAILS_AS_WORKER_1 = """
import os, sys, time
if os.environ["PHALANX_WORKER_INDEX"] == "1":
    open(os.environ["TORCHELASTIC_ERROR_FILE"], "w").write("out of patience" + "!" * 10000)
    sys.exit(3)
time.sleep(300)
"""


def test_the_first_failure_stops_the_others(tmp_path: Path) -> None:
    started = time.monotonic()
    run = localrun.start(python_job(FAILS_AS_WORKER_1, workers=3), on_line=Lines(), grace=5)
    assert run.wait(timeout=60) == 3  # the failed worker's exit status
    assert run.phase == "Failed"
    assert time.monotonic() - started < 60
    # its termination message, cut as the kubelet cuts it
    assert list(run.termination_messages) == [1]
    assert run.termination_messages[1].startswith("out of patience!")
    assert len(run.termination_messages[1]) == 4096


IGNORES_SIGTERM = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "300"])
open(sys.argv[1] + os.environ["PHALANX_WORKER_INDEX"], "w").write(str(child.pid))
print("ready", flush=True)
time.sleep(300)
"""


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_with_its_children(tmp_path: Path) -> None:
    body = python_job(IGNORES_SIGTERM)
    body["spec"]["template"]["spec"]["containers"][0]["args"] = [str(tmp_path / "child-")]
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
    lines = Lines()
    run = localrun.start(body, on_line=lines)
    assert run.grace == 2  # the pod's terminationGracePeriodSeconds
    lines.wait_for(2, "ready")
    children = [int((tmp_path / f"child-{index}").read_text()) for index in range(2)]
    stopped = time.monotonic()
    run.stop()
    time.sleep(1)
    assert run.poll() is None  # SIGTERM is ignored: still in its grace
    assert run.wait(timeout=30) == 128 + 9  # SIGKILL
    assert time.monotonic() - stopped >= 2
    assert not [pid for pid in children if alive(pid)]  # the whole process group went


def test_the_command_prints_lines_as_phalanx_logs_does_and_exits_with_the_runs_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            python_job(
                "import os, sys; print('index', os.environ['PHALANX_WORKER_INDEX']); sys.exit(int(os.environ['EXIT']))"
            )
        )
    )
    assert cli.main(["run-local", str(job), "--env", "EXIT=0"]) == 0
    captured = capsys.readouterr()
    assert "[worker-0] index 0" in captured.out and "[worker-1] index 1" in captured.out
    assert "the cluster would run the image example/train:1" in captured.err
    assert cli.main(["run-local", str(job), "--env", "EXIT=4", "--workers", "1"]) == 4
    assert "Failed (exit status 4)" in capsys.readouterr().err


def test_the_cpu_example_trains_with_two_workers_given_the_planned_pods_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun from this interpreter's environment; phalanx.worker from the source tree
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "operator"))
    lines = Lines()
    run = localrun.start(yaml.safe_load(CPU_EXAMPLE.read_text()), on_line=lines, workdir=ROOT)
    code = run.wait(timeout=240)
    output = "\n".join(f"[worker-{index}] {line}" for index, line in lines.lines)
    assert code == 0, output
    for rank in (0, 1):
        assert f"phalanx-demo: done rank={rank} world_size=2 steps=200" in output
    # rank 0 recorded completion in the local store, which serves it as the store pod serves the operator
    uid = run.plan.job.metadata.uid
    assert f'phalanx_training_completed_step{{job="{uid}"}} 200' in run.store_metrics
    for environment, worker, pod in zip(run.environments, run.plan.workers, planned_workers(CPU_EXAMPLE), strict=True):
        cluster = kubelet_environment(pod, pod_ip="10.244.0.17")
        assert {name for name, value in cluster.items() if environment[name] != value} == LOCAL_CHANGES
        assert {name: environment[name] for name in LOCAL_CHANGES} == {name: worker.env[name] for name in LOCAL_CHANGES}
        assert set(worker.changed) == LOCAL_CHANGES
        # nothing of a launcher leaks in from the environment that ran phalanx
        assert {name for name in environment if name.startswith(("PET_", "PHALANX_"))} <= set(cluster)
