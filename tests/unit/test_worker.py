"""The in-pod helper: atomic checkpoints, resume with another world size, the SIGTERM protocol."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.worker.checkpoint import MARKER, CheckpointStore
from phalanx.worker.session import Progress
from tests.cluster.ports import free_port
from tests.unit.store_script import scrape, store_script

TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def state(value: float) -> dict[str, object]:
    progress = Progress()
    progress.step = int(value)
    return {"weights": torch.full((4,), value), "progress": progress}


def test_save_commits_atomically_and_keeps_the_newest(tmp_path: Path, process_group: None) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    for step in (10, 20, 30):
        info = store.save(state(step), step)
        assert (info.path / MARKER).is_file()
    assert [info.step for info in store.complete()] == [20, 30]
    marker = json.loads((tmp_path / "ckpt" / "step-00000030" / MARKER).read_text())
    assert marker["step"] == 30 and marker["world_size"] == 1


def test_incomplete_checkpoints_are_ignored_and_cleaned(tmp_path: Path, process_group: None) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(5), 5)
    (tmp_path / "step-00000009").mkdir()  # renamed but never committed: a crash between the two
    (tmp_path / "step-00000004.partial").mkdir()  # an abandoned save older than the newest
    (tmp_path / "step-00000007.partial").mkdir()
    latest = store.latest()
    assert latest is not None and latest.step == 5
    store.prune()
    assert not (tmp_path / "step-00000004.partial").exists()
    loaded = state(0)
    store.load(loaded, store.at(5))
    assert torch.equal(loaded["weights"], torch.full((4,), 5.0))  # type: ignore[arg-type]
    assert loaded["progress"].step == 5  # type: ignore[attr-defined]


def torchrun(tmp_path: Path, procs: int, steps: int, *extra: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "PHALANX_CHECKPOINT_KEEP": "2",
        "PHALANX_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # as the operator sets it (pytorch#135712)
    }
    command = [
        str(TORCHRUN),
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={procs}",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        "-m",
        "phalanx.worker.demo",
        "--steps",
        str(steps),
        "--log-every",
        "1",
        "--checkpoint-every",
        "1000",
        *extra,
    ]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def test_resume_with_a_different_world_size(tmp_path: Path) -> None:
    first = torchrun(tmp_path, 2, 30)
    out, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out
    second = torchrun(tmp_path, 3, 40)
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out
    assert "starting at step=31 resumed_from=30" in out
    assert "step=40 loss=" in out and "world_size=3" in out


def test_sigterm_on_one_rank_makes_all_ranks_save_then_training_resumes(tmp_path: Path) -> None:
    run = torchrun(tmp_path, 2, 400, "--step-seconds", "0.02")
    assert run.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = run.stdout.readline()
        lines.append(line)
        if "step=50 " in line:
            break
    workers = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True, check=False)
    victim = int(workers.stdout.split()[-1])
    os.kill(victim, signal.SIGTERM)
    try:
        out, _ = run.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate()
    text = "".join(lines) + out
    assert run.returncode == 0, text
    resumed = [int(m) for m in re.findall(r"resumed_from=(\d+)", text)]
    assert resumed and resumed[-1] >= 50, text  # the agreed final checkpoint, not step 0
    assert "done rank=0 world_size=2 steps=400" in text


def test_worker_metrics_are_served_and_gpu_series_are_absent_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.worker import metrics

    port = free_port()
    monkeypatch.setenv("PHALANX_WORKER_METRICS_PORT", str(port))
    monkeypatch.setenv("LOCAL_RANK", "0")
    served = metrics.from_environment()
    assert served is not None
    served.step_done(64)
    time.sleep(0.01)
    served.step_done(64)
    served.last_checkpoint.set(20)
    text = scrape(port)
    assert "phalanx_worker_steps_total 2.0" in text
    assert "phalanx_worker_last_checkpoint_step 20.0" in text
    assert "phalanx_worker_step_duration_seconds_count 1.0" in text
    samples = next(line for line in text.splitlines() if line.startswith("phalanx_worker_samples_per_second "))
    assert float(samples.split()[1]) > 0
    assert "phalanx_worker_gpu" not in text  # absent, not zero, without a GPU
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert metrics.from_environment() is None  # one endpoint per pod


def test_gpu_series_come_from_nvml_per_device() -> None:
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from phalanx.worker.metrics import WorkerMetrics

    class Nvml:  # the three NVML calls the collector makes, answered as a two-GPU node would
        def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - NVML's own names
            return 2

        def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
            return index

        def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:  # noqa: N802
            return SimpleNamespace(gpu=50 + handle)

        def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
            return SimpleNamespace(used=1024 * (handle + 1))

    text = generate_latest(WorkerMetrics(nvml=Nvml()).registry).decode()
    assert 'phalanx_worker_gpu_utilization_ratio{gpu="1"} 0.51' in text
    assert 'phalanx_worker_gpu_memory_used_bytes{gpu="0"} 1024.0' in text


JOB_UID = "6b1f5c1e-0d3a-4c7e-9a51-2f0c9d1e7a40"
ABORTED = re.compile(r"terminate called|SIGABRT|Signal 6|exitcode\s*:\s*-6|Fatal Python error")


def test_two_agents_end_their_training_cleanly_and_record_completion_in_the_store(tmp_path: Path) -> None:
    """As in the pods: two torchrun agents (one per worker pod) and the operator's store script in
    a process of its own. Both agents must exit 0 with no abort anywhere in teardown (a rank that
    aborts after its last step leaves the agents waiting on each other), and the store must serve
    the completion the operator reads. Three times: teardown races show up irregularly."""
    for run in range(3):
        base = {**os.environ, "OMP_NUM_THREADS": "1", "PHALANX_BACKEND": "gloo"}
        agents: list[subprocess.Popen[str]] = []
        with store_script(JOB_UID) as store:
            store_port, status_port = store.store_port, store.status_port
            try:
                for _ in range(2):
                    env = {
                        **base,
                        "PET_NNODES": "2:2",
                        "PET_NPROC_PER_NODE": "1",
                        "PET_RDZV_BACKEND": "c10d",
                        "PET_RDZV_ENDPOINT": f"127.0.0.1:{store_port}",
                        "PET_RDZV_ID": f"teardown-{run}",
                        "PET_RDZV_CONF": "join_timeout=60,last_call_timeout=1,read_timeout=60,is_host=false",
                        "PET_MAX_RESTARTS": "3",
                        "PET_MONITOR_INTERVAL": "0.2",
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                        "PHALANX_ATTEMPT": "4",
                        "PHALANX_JOB_UID": JOB_UID,
                        "PHALANX_WORKER_METRICS_PORT": str(free_port()),
                    }
                    agents.append(
                        subprocess.Popen(
                            [str(TORCHRUN), "-m", "phalanx.worker.demo", "--steps", "60", "--log-every", "20"],
                            env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            text=True,
                            start_new_session=True,
                        )
                    )
                outputs = []
                for agent in agents:
                    try:
                        out, _ = agent.communicate(timeout=240)
                    except subprocess.TimeoutExpired:
                        os.killpg(agent.pid, signal.SIGKILL)
                        out, _ = agent.communicate()
                    outputs.append(out)
                for agent, out in zip(agents, outputs, strict=True):
                    assert agent.returncode == 0, out
                    assert not ABORTED.search(out), out
                    assert "done rank=" in out and "will restart worker group" not in out, out
                served = scrape(status_port)
                assert f'phalanx_training_completed_attempt{{job="{JOB_UID}"}} 4' in served, served
                assert f'phalanx_training_completed_step{{job="{JOB_UID}"}} 60' in served, served
            finally:
                for agent in agents:
                    if agent.poll() is None:
                        os.killpg(agent.pid, signal.SIGKILL)
                        agent.wait()


def test_the_store_serves_only_a_small_completion_record_that_names_its_own_job() -> None:
    """Anyone who reaches the store can set the completion key (issue 21, defect 5): the operator's
    store script, in a process of its own, with records written by a plain TCPStore client as a pod
    of another namespace would."""
    import json

    from torch._C._distributed_c10d import TCPStore

    from phalanx.cluster.progress import parse_completion
    from phalanx.worker.protocol import COMPLETION_KEY

    with store_script(JOB_UID) as store:
        store_port, status_port = store.store_port, store.status_port
        intruder = TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
        for forged in (
            json.dumps({"attempt": 0, "step": 1, "rank": 0}),  # no job named
            json.dumps({"job": "0d6c61a0-0000-0000-0000-00000000dead", "attempt": 0, "step": 1, "rank": 0}),
            json.dumps({"job": JOB_UID, "attempt": 0, "step": 1, "rank": 0, "pad": "x" * 8192}),  # too large
            "not json",
            json.dumps([JOB_UID, 0]),
        ):
            intruder.set(COMPLETION_KEY, forged)
            served = scrape(status_port)
            assert "phalanx_training_completed" not in served, (forged, served)
            assert parse_completion(served) is None
        intruder.set(COMPLETION_KEY, json.dumps({"job": JOB_UID, "attempt": 2, "step": 90, "rank": 0}))
        done = parse_completion(scrape(status_port))
        assert done is not None and (done.job_uid, done.attempt, done.step, done.rank) == (JOB_UID, 2, 90, 0)
