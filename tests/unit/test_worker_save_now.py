"""The worker's side of save-now (``worker.session``): each rank reads its own pod's notices file,
any rank that reads a new token makes the whole world save at the same step, without a restart; a
token every rank has handled is never saved for again; the file is read bounded and at most once a
second."""

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
from typing import Any

import pytest

from phalanx.worker.protocol import save_now_key
from phalanx.worker.session import SAVE_NOW_CHECK_SECONDS, SaveNowNotice
from tests.cluster.ports import free_port

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
SAVED = re.compile(r"phalanx: saved step (\d+) at a save-now request")
STEP = re.compile(r"step=(\d+) loss=")


def test_the_file_is_read_at_most_once_a_second_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "save-now"
    clock = [100.0]
    notice = SaveNowNotice(str(path), clock=lambda: clock[0])
    assert notice.token() is None  # no file yet
    path.write_text("t1\n")
    assert notice.token() is None  # read a moment ago: not again yet
    clock[0] += SAVE_NOW_CHECK_SECONDS
    assert notice.token() == "t1"
    for written in ("x" * 64, "two words", "", "t\u00e9"):
        path.write_text(written)
        clock[0] += SAVE_NOW_CHECK_SECONDS
        assert notice.token() is None, written
    assert SaveNowNotice(None).token() is None  # a job without the file
    assert SaveNowNotice.from_environment({"PHALANX_SAVE_NOW_FILE": str(path)}).path == str(path)


def test_token_keys_are_positive_distinct_and_fit_the_all_reduce() -> None:
    keys = {save_now_key(f"2026-12-01T10:00:{second:02d}Z") for second in range(60)}
    assert len(keys) == 60 and all(0 < key < 2**48 for key in keys)


def start(rank: int, port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(OPERATOR),
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PHALANX_BACKEND": "gloo",
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "PHALANX_SAVE_NOW_FILE": str(tmp_path / f"save-now-{rank}"),  # one pod each
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PHALANX_WORKER_METRICS_PORT", None)
    args = ["--steps", "100000", "--log-every", "1", "--checkpoint-every", "100000", "--step-seconds", "0.02"]
    with (tmp_path / f"rank-{rank}.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "phalanx.worker.demo", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )


@pytest.fixture
def world(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    port = free_port()
    ranks = [start(rank, port, tmp_path) for rank in range(2)]
    yield ranks
    for process in ranks:
        if process.poll() is None:
            process.kill()
        process.wait()


def wait_until(what: str, check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def steps(log: Path) -> list[int]:
    return [int(step) for step in STEP.findall(log.read_text())]


def saves(log: Path) -> list[int]:
    return [int(step) for step in SAVED.findall(log.read_text())]


def test_one_rank_reading_a_token_makes_the_world_save_once_and_train_on(
    tmp_path: Path, world: list[subprocess.Popen[bytes]]
) -> None:
    log = tmp_path / "rank-0.log"
    wait_until("step 20", lambda: max(steps(log), default=0) >= 20)
    (tmp_path / "save-now-1").write_text("t1")  # only rank 1's kubelet has refreshed its file so far
    wait_until("the save for t1", lambda: saves(log))
    [first] = saves(log)
    marker = json.loads((tmp_path / "ckpt" / f"step-{first:08d}" / "COMMITTED").read_text())
    assert marker["step"] == first and marker["saveNow"] == save_now_key("t1")

    (tmp_path / "save-now-0").write_text("t1")  # rank 0's file catches up: already handled
    after = max(steps(log))
    # rank 0 reads its file at least once a second: wait well past that many steps
    wait_until("two more seconds of steps", lambda: max(steps(log)) >= after + 100)
    assert saves(log) == [first]

    (tmp_path / "save-now-0").write_text("t2")
    wait_until("the save for t2", lambda: len(saves(log)) == 2)
    assert saves(log)[1] > first
    assert all(process.poll() is None for process in world)  # trained on: nobody restarted or stopped
    assert "resumed_from=None" in log.read_text() and log.read_text().count("starting at step=") == 1
    for process in world:
        process.send_signal(signal.SIGTERM)
    for process in world:
        process.wait(timeout=60)
