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
