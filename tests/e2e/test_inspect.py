"""``phalanx logs`` on the real node, where containers write real logs: a 2-worker CPU job followed
with ``-f`` from before its workers exist until it succeeds, then one worker's tail, also through
``kubectl phalanx``."""

from __future__ import annotations

import contextlib
import pathlib
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

import pytest

from tests.cluster.kube import Kubectl
from tests.integration.operator_process import OperatorProcess
from tests.integration.phalanx_cli import environment, kubectl_plugin, phalanx, phalanx_command, plugin_path

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

JOB = "logged"
STEPS = 60
STEP = re.compile(r"phalanx-demo: step=(\d+) loss=[0-9.]+ world_size=2 rank=(\d)")


def two_worker_job() -> dict[str, Any]:
    """Created suspended, so that the command is surely following before any worker exists."""
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB},
        "spec": {
            "suspend": True,
            "workers": {"min": 2, "max": 2, "desired": 2},
            "rendezvous": {"lastCallTimeoutSeconds": 1},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "phalanx.local/trainer:dev",
                            "imagePullPolicy": "Never",
                            "command": ["torchrun"],
                            "args": [
                                "-m",
                                "phalanx.worker.demo",
                                "--steps",
                                str(STEPS),
                                "--step-seconds",
                                "0.05",
                                "--log-every",
                                "5",
                            ],
                            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1"}},
                        }
                    ]
                }
            },
        },
    }


class Background:
    """A command whose output is read as it comes, by two threads; stopped by its PID."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment()
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, self.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str] | None, into: list[str]) -> None:
        assert stream is not None
        for line in stream:
            into.append(line.removesuffix("\n"))

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@contextlib.contextmanager
def background(command: list[str]) -> Iterator[Background]:
    running = Background(command)
    try:
        yield running
    finally:
        running.stop()


def by_worker(lines: list[str]) -> dict[str, list[str]]:
    """Lines by prefix ([worker-0], ...), the prefix removed; every line must have one."""
    found: dict[str, list[str]] = {}
    for line in lines:
        match = re.match(r"\[(worker-\d+)\] (.*)$", line)
        assert match, f"a line without a worker prefix: {line!r}"
        found.setdefault(match[1], []).append(match[2])
    return found


def test_logs_follow_a_job_from_before_its_workers_exist_until_it_succeeds(
    kubectl: Kubectl, real_cluster: Any, namespace: str, operator: OperatorProcess, tmp_path: pathlib.Path
) -> None:
    kubeconfig = str(real_cluster.kubeconfig)
    kubectl.create(two_worker_job(), namespace=namespace)
    with background(phalanx_command("logs", "-f", JOB, "-n", namespace, "--kubeconfig", kubeconfig)) as following:
        kubectl.wait_for(
            lambda: any("waiting for the workers" in line for line in following.stderr),
            timeout=60,
            what=lambda: f"logs -f following; stderr {following.stderr}",
        )
        assert kubectl.list("pods", namespace, f"phalanx.dev/job-name={JOB},phalanx.dev/role=worker") == []
        kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"suspend":false}}')
        resumed = time.monotonic()
        code = following.wait(timeout=240)  # it ends by itself when the job succeeds
        assert code == 0, following.stderr
        out = "\n".join(following.stdout)
    # both streams ended with their containers, not cut off after the job ended
    assert not any("stopped following" in line for line in following.stderr), following.stderr
    status = (kubectl.get("tj", JOB, namespace) or {}).get("status") or {}
    assert status.get("phase") == "Succeeded", status
    print(f"logs -f ended {time.monotonic() - resumed:.0f}s after the job was resumed:\n{out}")
    print("stderr:", *following.stderr, sep="\n")

    workers = by_worker(following.stdout)
    assert set(workers) == {"worker-0", "worker-1"}, out
    for name, lines in workers.items():
        steps = [int(step) for step, _ in (match.groups() for match in map(STEP.search, lines) if match)]
        assert steps == sorted(steps) and len(set(steps)) == len(steps), f"{name} out of order: {steps}"
        assert steps and steps[-1] == STEPS, f"{name} lacks its last steps: {steps}"
        assert any("done rank=" in line for line in lines), lines

    # one worker's last lines, the same as the followed stream ended with
    tail = phalanx("logs", JOB, "--worker", "1", "--tail", "5", "-n", namespace, "--kubeconfig", kubeconfig)
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout.splitlines() == [f"[worker-1] {line}" for line in workers["worker-1"][-5:]]

    plugin = plugin_path(tmp_path / "plugins")
    through_kubectl = kubectl_plugin(
        plugin, "logs", JOB, "--worker", "0", "--tail", "3", "-n", namespace, "--kubeconfig", kubeconfig
    )
    assert through_kubectl.returncode == 0, through_kubectl.stderr
    assert through_kubectl.stdout.splitlines() == [f"[worker-0] {line}" for line in workers["worker-0"][-3:]]
